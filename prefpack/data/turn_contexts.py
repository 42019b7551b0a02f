"""A reply scored turn by turn in the context its template gave the model at that turn: the general method for
templates that rewrite earlier turns (GLM-4.5, MiniMax-M2 and LFM2.5 drop an earlier turn's reasoning once a later
user turn or answer follows) or render history otherwise than they prompt for it (Kimi-K2-Thinking).

At inference the model sees ``render(messages before turn t, add_generation_prompt=True)`` and writes turn t: what
the template adds after that context when turn t is the last message. Turn t is scored exactly there. Turns whose
contexts extend one another (the template renders turn t in history just as it was written) share one sequence;
where the template rewrites an earlier turn, a new sequence starts from the prompt, so a reply becomes as many
sequences as its template forces, each laid out after the prompt (the store's segments), their sums one completion's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prefpack.data.turns import Ranges

# render(messages, add_generation_prompt) -> the rendered text
Render = Callable[[list[dict], bool], str]

MAX_TURNS = 512
"""Scored turns one reply may be split over: each renders the conversation up to it twice, so the cost grows with
the square of the turns; a reply past this is refused rather than left to run for hours."""


@dataclass
class TurnSequence:
    """One sequence of a reply: its whole text (from the very start of the rendering) and the character ranges of it
    that are scored (the turns the model wrote in it)."""

    text: str
    scored: Ranges = field(default_factory=list)
    turns: list[int] = field(default_factory=list)  # the reply's message indices scored in it


class TurnRefused(ValueError):
    """A turn its template cannot show as the continuation of the context it prompts for (the message says why)."""


def scored_turns(reply: list[dict], train_on: str) -> list[int]:
    """The reply's assistant message indices that ``--train-on`` scores (``assistant``: all, ``last``: the last)."""
    turns = [k for k, m in enumerate(reply) if m.get("role") == "assistant"]
    return turns[-1:] if train_on == "last" else turns


def turn_text(render: Render, prompt: list[dict], reply: list[dict], k: int) -> tuple[str, str]:
    """Reply message ``k`` as the model met and wrote it: (the context the template prompts with before it, what the
    template renders for the message after that context when it is the last message). Raises ``TurnRefused`` when
    the template renders the message otherwise than as a continuation of its generation prompt."""
    before = list(prompt) + list(reply[:k])
    context = render(before, True)
    written = render(before + [reply[k]], False)
    if written.startswith(context):
        return context, written[len(context):]
    plain = render(before, False)
    header = context[len(plain):] if context.startswith(plain) else ""
    # History rendered otherwise once the turn follows (Kimi keeps a tool-call chain's reasoning only while the chain
    # is open): the turn itself still follows the generation prompt, which the rendering holds just before it.
    at = written.rfind(header) if header else -1
    rest = written[at + len(header):] if at >= 0 else ""
    own = reply[k].get("content") if isinstance(reply[k].get("content"), str) else ""
    earlier = [m.get("content") for m in before if m.get("role") != "assistant" or m.get("content") not in own]
    pieces = [p.strip() for p in (own, reply[k].get("reasoning_content")) if isinstance(p, str) and p.strip()]
    whole = all(p in rest for p in pieces if p in written)  # (a header inside the message itself would cut it)
    if rest.strip() and whole and not any(isinstance(c, str) and c.strip() and c in rest for c in earlier):
        return context, rest  # (a header found inside the history would bring an earlier message along)
    i = next((i for i, (a, b) in enumerate(zip(context, written)) if a != b), min(len(context), len(written)))
    if i < len(plain) or not header:
        raise TurnRefused(f"it renders the conversation before assistant message {k} otherwise once that message "
                          f"follows ({context[max(0, i - 30):i + 30]!r} becomes {written[max(0, i - 30):i + 30]!r})")
    raise TurnRefused(f"its generation prompt before assistant message {k} is {header!r}, but it renders that message "
                      f"as {written[len(plain):len(plain) + 60]!r}...")


def split_by_turns(render: Render, prompt: list[dict], reply: list[dict], train_on: str) -> list[TurnSequence]:
    """The sequences the template forces on ``reply``: each scored turn after the context the template gives it,
    a turn joining the previous sequence when its context extends that sequence's text."""
    out: list[TurnSequence] = []
    turns = scored_turns(reply, train_on)
    if len(turns) > MAX_TURNS:
        raise TurnRefused(f"its {len(turns)} scored assistant turns are past the {MAX_TURNS} prefpack renders one by "
                          "one (each in its own context); split the trajectory into shorter rows")
    for k in turns:
        context, written = turn_text(render, prompt, reply, k)
        if out and context.startswith(out[-1].text):
            seq = out[-1]
        else:
            seq = TurnSequence("")
            out.append(seq)
        seq.text = context + written
        seq.scored.append((len(context), len(seq.text)))
        seq.turns.append(k)
    return out
