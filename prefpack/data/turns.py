"""Which characters of a chat completion are scored (``prepare --train-on``), and a completion's score mask from
character ranges (chat turns, or a text row's ``loss_masking_spans``) through the tokenizer's offsets.

A reply such as [assistant tool call, tool result, assistant answer] is rendered as one completion string; only
what the model wrote should get a loss. Each assistant message's text is cut out of that string by rendering the
conversation up to it: with the generation prompt (the role header, which the model did not write) for where it
starts, and with the message for where it ends (its content, tool calls and the end-of-turn the template writes).
Prefix stability makes those cuts exact; ``chat_masks`` checks each cut holds its message's own text, and takes the
masks from ``{% generation %}`` tags instead where the template has them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

TRAIN_ON = ("assistant", "last", "all")

Ranges = list[tuple[int, int]]


def unscored_chat_ranges(render: Callable[[list[dict], bool], str], prompt: list[dict], reply: list[dict],
                         prompt_text: str, full: str, train_on: str) -> Ranges | None:
    """Character ranges ``[start, end)`` of the completion ``full[len(prompt_text):]`` that are NOT scored, or None
    when all of it is. ``render(messages, add_generation_prompt)`` renders a conversation; raises ValueError when
    a cut is not a prefix of the whole conversation (the template is not prefix-stable at that turn)."""
    if train_on == "all":
        return None
    return complement(turn_ranges(render, prompt, reply, prompt_text, full, train_on), len(full) - len(prompt_text))


def turn_ranges(render: Callable[[list[dict], bool], str], prompt: list[dict], reply: list[dict],
                prompt_text: str, full: str, train_on: str) -> Ranges:
    """Per scored assistant message of the reply, its character range ``[start, end)`` in the completion."""
    turns = [k for k, m in enumerate(reply) if m.get("role") == "assistant"]
    if train_on == "last":
        turns = turns[-1:]
    base, scored = len(prompt_text), []
    for k in turns:
        start = prompt_text if k == 0 else render(list(prompt) + list(reply[:k]), True)
        end = full if k == len(reply) - 1 else render(list(prompt) + list(reply[: k + 1]), False)
        for cut in (start, end):
            if not full.startswith(cut) or len(cut) < base:
                raise ValueError(f"rendering the conversation up to reply message {k} does not give a prefix of "
                                 "the whole conversation")
        scored.append((len(start) - base, len(end) - base))
    return scored


def complement(scored: Ranges, length: int) -> Ranges | None:
    """The ranges of ``[0, length)`` outside the sorted ``scored`` ranges; None when that is nothing."""
    out, pos = [], 0
    for a, b in scored:
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < length:
        out.append((pos, length))
    return out or None


def token_mask(offsets: list[tuple[int, int]], unscored: Ranges) -> list[bool]:
    """One bool per token (True = scored): a token is not scored when its characters touch an unscored range,
    even partly (a zero-width token counts as its first character)."""
    if not offsets:
        return []
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    ts, te = off[:, 0], np.maximum(off[:, 1], off[:, 0] + 1)
    rng = np.asarray(unscored, dtype=np.int64).reshape(-1, 2)
    j = np.searchsorted(rng[:, 1], ts, side="right")  # the first range ending after the token starts
    hit = j < len(rng)
    hit[hit] &= rng[j[hit], 0] < te[hit]
    return (~hit).tolist()
