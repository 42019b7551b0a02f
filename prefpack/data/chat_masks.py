"""A chat row rendered through its template: the prompt with the generation prompt, each completion as what the
whole conversation adds after it, and per completion the character ranges that are not scored.

Where the template marks assistant text with ``{% generation %}`` (SmolLM3's, prefpack's training templates, a
``--chat-template`` file), the scored text comes from one rendering of each whole conversation: the generation
spans inside the completion, less any generation prompt a span opens with (a role header the model did not write).
Otherwise each assistant message is cut out by rendering the conversation up to it (``turns``), and each cut is
checked to hold that message's own text. A row that cannot be cut or checked is refused with the cause found
(a generation prompt no reply continues, an earlier turn the template rewrites) and the fix; text the template
leaves out of a reply (content beside tool calls, reasoning, a second tool call) is reported, not refused.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from transformers.utils.chat_template_utils import render_jinja_template

from prefpack.data.formats import Example, InvalidRow
from prefpack.data.template_vars import template_reads
from prefpack.data.training_templates import OWN_TEMPLATE, ChatTemplate, has_generation_markers
from prefpack.data.turn_contexts import (
    MAX_TURNS,
    TurnRefused,
    TurnSequence,
    scored_turns,
    split_by_turns,
    turn_text,
)
from prefpack.data.turns import Ranges, complement, turn_ranges

FIX = ("render with a prefix-preserving template that marks assistant text with {% generation %}: "
       "prepare --chat-template FILE (docs/data.md, 'Chat templates: which tokens are scored')")


@dataclass
class RenderedChat:
    prompt: str
    completions: list[str]
    unscored: list[Ranges | None]
    left_out: list[str]  # text of the reply's assistant messages the template did not render, described
    # per completion, None (one sequence) or the character offsets in it where another sequence starts again after
    # the prompt (a template that rewrites earlier turns: ``turn_contexts``)
    segments: list[list[int] | None] = field(default_factory=list)
    # the prompt stops before the generation prompt (a later turn's context rewrites it): each completion starts with
    # it, unscored, and a sampler must not take this prompt as it is
    open_prompt: bool = False


class Renderer:
    """Renders messages through one template with a tokenizer's special tokens (as ``apply_chat_template``)."""

    def __init__(self, tok, template: ChatTemplate | None, earlier_reasoning: str | None = None):
        self.tok, self.template = tok, template
        self.extra = {"earlier_reasoning": earlier_reasoning} if template and template.training else {}

    def named(self) -> str:
        """The template in words, for a message: where it came from (``--chat-template F``, prefpack's training
        template for a family, or the tokenizer's own, with the tokenizer's name)."""
        name = self.template.name if self.template is not None else OWN_TEMPLATE
        if name == OWN_TEMPLATE:
            name = f"{name}, {getattr(self.tok, 'name_or_path', '') or 'a tokenizer without a name'}"
        return f"the chat template ({name})"

    def source(self, tools) -> str:
        if self.template is not None:
            return self.template.source
        return self.tok.get_chat_template(None, tools)

    def __call__(self, messages: list[dict], kwargs: dict[str, Any], generation_prompt: bool, name: str | None,
                 spans: bool = False) -> tuple[str, list[tuple[int, int]]]:
        kwargs = {**self.tok.special_tokens_map, **self.extra, **kwargs}
        tools = kwargs.pop("tools", None)
        what = "the prompt" if name is None else f"the conversation with field {name!r}"
        messages = as_apply_chat_template_sees(messages)
        try:
            with time_limit(RENDER_SECONDS):
                out, idx = render_jinja_template([messages], tools=tools, chat_template=self.source(tools),
                                                 return_assistant_tokens_mask=spans,
                                                 add_generation_prompt=generation_prompt, **kwargs)
        except RenderTimeout:
            raise InvalidRow("template_timeout", name, f"{self.named()} ran past {RENDER_SECONDS:g} s on {what} "
                             "(a loop without end?)") from None
        except Exception as exc:  # jinja2 errors, templates' raise_exception(), str + None in a template...
            message = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line, whatever the template raised
            raise InvalidRow("template_error", name, f"{self.named()} failed on {what}: {message}") from None
        if len(out[0]) > RENDER_CHARS:
            raise InvalidRow("template_output_too_large", name, f"{self.named()} rendered {what} as "
                             f"{len(out[0]):,} characters, past {RENDER_CHARS:,}")
        return out[0], (idx[0] if spans else [])


def as_apply_chat_template_sees(messages: list[dict]) -> list[dict]:
    """The messages as transformers' ``apply_chat_template`` hands them to a template: without the keys whose value
    is None (``content: null`` beside tool calls; 5.23 and 5.24 both drop them before rendering), so prefpack, which
    calls the renderer itself for the masks, renders what the model is prompted with at inference."""
    return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]


RENDER_SECONDS = 10.0  # one rendering's time (a row's conversation renders in milliseconds)
RENDER_CHARS = 20_000_000  # one rendering's length (far past any row a model can take)


class RenderTimeout(Exception):
    """A template rendering past ``RENDER_SECONDS``."""


@contextmanager
def time_limit(seconds: float):
    """``RenderTimeout`` raised in the rendering after ``seconds`` (SIGALRM; only on a process's main thread, where
    prepare's workers and generate render; elsewhere unbounded). The caller's alarm, if any, is put back."""
    import signal
    import threading

    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_signum, _frame):
        raise RenderTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    left, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if left:  # an outer alarm (a caller's own limit) resumes with what it had left
            signal.setitimer(signal.ITIMER_REAL, left, interval)


def render_chat(tok, ex: Example, kwargs: dict[str, Any] | None = None, tools: list[dict] | None = None,
                train_on: str = "all", template: ChatTemplate | None = None,
                earlier_reasoning: str | None = None) -> RenderedChat:
    """Render a chat example; `kwargs` and `tools` are prepare's defaults (the row's own tools replace `tools`, its
    own template variables override `kwargs` key by key; its documents are passed as `documents`). Messages go to the
    template unchanged."""
    if template is None and not tok.chat_template:
        raise InvalidRow("no_chat_template", None, "the row holds chat messages but the tokenizer has no chat "
                         "template; use a tokenizer with one, pass --chat-template FILE, or give plain strings")
    render = Renderer(tok, template, earlier_reasoning)
    template_kwargs = {**(kwargs or {}), **ex.template_kwargs}
    row_tools = ex.tools if ex.tools is not None else tools
    if row_tools is not None:  # as `tools`, or `xml_tools` for a template that reads only that (SmolLM3)
        template_kwargs[template_reads(render.source(row_tools)).tools_variable or "tools"] = row_tools
    if ex.documents is not None:  # RAG rows: apply_chat_template's `documents` (a template that never reads them
        template_kwargs["documents"] = ex.documents  # is refused before rendering: tokenize._check_tool_support)
    markers = template.markers if template is not None else has_generation_markers(render.source(row_tools))
    prompt_text, _ = render(ex.prompt, template_kwargs, True, None)
    pieces: list[list[TurnSequence]] = []  # per completion: its sequences, each from the start of the rendering
    # turn by turn where one rendering cannot score what the model wrote; never under --train-on all (the whole reply
    # is one completion then), nor with prefpack's training templates (--earlier-reasoning says how they score)
    by_turns_allowed = train_on != "all" and not (template is not None and template.training)
    left: list[list[str]] = []
    for reply, name in zip(ex.completions, ex.completion_fields):
        try:
            seq, missing = _one_rendering(render, ex.prompt, reply, template_kwargs, prompt_text, name, train_on,
                                          template, earlier_reasoning, markers)
        except InvalidRow as err:
            if not by_turns_allowed or err.reason not in SPLIT_REASONS:
                raise
            seqs, missing = _by_turns(render, ex.prompt, reply, template_kwargs, name, train_on)
        else:
            seqs = [seq]
            if by_turns_allowed and _scored_missing(reply, missing, train_on):
                # the one rendering leaves out text of a turn it scores (an earlier turn's reasoning, dropped as
                # history): scored where the model wrote it instead, when that shows more of what it wrote
                try:
                    by_turns, turn_missing = _by_turns(render, ex.prompt, reply, template_kwargs, name, train_on)
                except InvalidRow:
                    by_turns = None
                if by_turns is not None and len(turn_missing) < len(missing):
                    seqs, missing = by_turns, turn_missing
        pieces.append(seqs)
        left.append([f"field {name!r}: {what}" for what in missing])
    return _assemble(render, ex, template_kwargs, prompt_text, pieces, left)


SPLIT_REASONS = ("template_not_prefix_stable", "unverified_turn")  # refusals the turn-by-turn method may resolve


def _one_rendering(render: Renderer, prompt, reply, kwargs, prompt_text: str, name: str, train_on: str,
                   template: ChatTemplate | None, earlier_reasoning: str | None,
                   markers: bool) -> tuple[TurnSequence, list[str]]:
    """The reply as one sequence: the whole conversation rendered once, the reply what it adds after the prompt, its
    scored ranges from generation tags or per-message cuts; and what of the reply the rendering leaves out."""
    conversation = list(prompt) + list(reply)
    full, spans = render(conversation, kwargs, False, name, spans=markers and train_on != "all")
    if not full.startswith(prompt_text):
        raise InvalidRow("template_not_prefix_stable", name, _prompt_cause(render, prompt, kwargs, prompt_text, full,
                         name, template, _history_reply(template, earlier_reasoning, reply), reply))
    base = len(prompt_text)
    missing = left_out(reply, full[base:])
    if train_on == "last":  # earlier turns are context, shown as the template shows them: only the scored turn's
        missing = [line for line in missing if _scored_missing(reply, [line], train_on)]
    if train_on == "all":
        unscored = None
    elif markers:
        unscored = _marked(render, prompt, kwargs, prompt_text, full, spans, train_on, name)
    else:
        unscored = _cut(render, prompt, reply, kwargs, prompt_text, full, train_on, name, template)
    scored = complement(unscored or [], len(full) - base) or []
    return TurnSequence(full, [(base + a, base + b) for a, b in scored]), missing


def _scored_missing(reply: list[dict], missing: list[str], train_on: str) -> int:
    """How many pieces the rendering left out belong to turns ``train_on`` scores (``missing`` as ``left_out``)."""
    scored = set(scored_turns(reply, train_on))
    return sum(any(line.startswith(f"message {k}'s ") for k in scored) for line in missing)


def _by_turns(render: Renderer, prompt, reply, kwargs, name: str,
              train_on: str) -> tuple[list[TurnSequence], list[str]]:
    """The reply turn by turn (``turn_contexts``): each scored turn after the context its template prompts with; and
    what of the scored turns the template leaves out. A turn it cannot show so is refused, with the cause."""
    def by_prefix(msgs, gen):
        return render(msgs, kwargs, gen, name)[0]

    _check_turn_count(reply, train_on, name)
    try:
        seqs = split_by_turns(by_prefix, prompt, reply, train_on)
    except TurnRefused as exc:
        hint = _thinking_hint(render, prompt, reply, kwargs, name, train_on)
        raise InvalidRow("template_not_prefix_stable", name, _turn_cause(by_prefix, prompt, reply, name, train_on,
                         render, str(exc) + hint)) from None
    missing = []
    for seq in seqs:
        for k, (a, b) in zip(seq.turns, seq.scored):
            missing.extend(left_out([{}] * k + [reply[k]], seq.text[a:b]))
    return seqs, missing


def _turn_cause(by_prefix, prompt, reply, name: str, train_on: str, render: Renderer, cause: str) -> str:
    """Why a reply cannot be scored turn by turn either, in one line: a turn without the reasoning its template's
    generation prompt opens, or the template's own rendering (``cause``)."""
    for k in scored_turns(reply, train_on):
        try:
            turn_text(by_prefix, prompt, reply, k)
        except TurnRefused:
            if not _reasoning_of(reply[k]):
                probe = [*reply[:k], {**reply[k], "reasoning_content": "..."}, *reply[k + 1:]]
                try:
                    turn_text(by_prefix, prompt, probe, k)
                except TurnRefused:
                    break
                return (f"{render.named()} always opens the model's reasoning after its generation prompt, but "
                        f"assistant message {k} of field {name!r} has none ({cause}); give such messages their "
                        "reasoning (reasoning_content), or " + FIX)
            break
    return (f"{render.named()} is not prefix-stable, even turn by turn, so field {name!r} cannot be stored as the "
            f"model wrote it: {cause}; {FIX}")


def _thinking_hint(render: Renderer, prompt, reply, kwargs, name: str, train_on: str) -> str:
    """Where the template reads ``enable_thinking`` and the other value renders every scored turn as a continuation
    of its generation prompt (Gemma 4 closes an empty thought channel by default), the kwarg to pass."""
    if "enable_thinking" not in render.source(kwargs.get("tools")):
        return ""
    flipped = {**kwargs, "enable_thinking": not kwargs.get("enable_thinking", False)}
    try:
        split_by_turns(lambda msgs, gen: render(msgs, flipped, gen, name)[0], prompt, reply, train_on)
    except (TurnRefused, InvalidRow):
        return ""
    value = str(flipped["enable_thinking"]).lower()
    return (f" (with enable_thinking {value} it does: --chat-template-kwargs '{{\"enable_thinking\": {value}}}' or the "
            "row's chat_template_kwargs)")


def _assemble(render: Renderer, ex: Example, kwargs: dict, prompt_text: str, pieces: list[list[TurnSequence]],
              left: list[list[str]]) -> RenderedChat:
    """The row from each completion's sequences: the prompt they all start with (the prompt with its generation
    prompt, or without it when a sequence rewrites that), each completion its sequences' rest back to back (a
    segment per sequence after the first), what is not scored, and what the template left out."""
    every = [s.text for seqs in pieces for s in seqs]
    prompt = prompt_text
    if not all(t.startswith(prompt) for t in every):
        prompt, _ = render(ex.prompt, kwargs, False, None)
        if not all(t.startswith(prompt) for t in every):
            raise InvalidRow("template_not_prefix_stable", None, f"{render.named()} renders the prompt itself "
                             "otherwise in a later turn's context (it rewrites the prompt's messages once the reply "
                             f"follows), so the reply's sequences share no prompt; {FIX}")
    base = len(prompt)
    out = RenderedChat(prompt, [], [], [line for lines in left for line in lines], open_prompt=prompt != prompt_text)
    for seqs in pieces:
        text, scored, starts = "", [], []
        for seq in seqs:
            if text:
                starts.append(len(text))
            scored.extend((len(text) + a - base, len(text) + b - base) for a, b in seq.scored)
            text += seq.text[base:]
        out.completions.append(text)
        out.unscored.append(complement(scored, len(text)))
        out.segments.append(starts or None)
    return out


def _generation_prompt(render: Renderer, prompt: list[dict], kwargs: dict, prompt_text: str) -> str:
    """What the generation prompt adds after the prompt's messages (a role header, an opened <think>...)."""
    plain, _ = render(prompt, kwargs, False, None)
    return prompt_text[len(plain):] if prompt_text.startswith(plain) else ""


def _marked(render: Renderer, prompt, kwargs, prompt_text: str, full: str, spans, train_on: str,
            name: str) -> Ranges | None:
    """The completion's unscored ranges from the generation spans of one rendering: each span clipped to the
    completion, less the generation prompt it opens with (the model did not write it)."""
    header = _generation_prompt(render, prompt, kwargs, prompt_text)
    base, scored = len(prompt_text), []
    for start, end in spans:
        if header and full.startswith(header, start):
            start += len(header)
        start, end = max(start, base), min(end, len(full))
        if start < end:
            scored.append((start - base, end - base))
    if not scored:
        raise InvalidRow("no_generation_span", name, f"the chat template marks assistant text with {{% generation %}}"
                         f" but marks none in field {name!r}; give a reply with an assistant message, or a template "
                         "that marks every assistant message")
    if train_on == "last":
        scored = scored[-1:]
    return complement(sorted(scored), len(full) - base)


def _cut(render: Renderer, prompt, reply, kwargs, prompt_text: str, full: str, train_on: str, name: str,
         template: ChatTemplate | None) -> Ranges | None:
    """Per-message cuts (rendering up to each assistant message), each checked to hold the message's own text."""
    _check_turn_count(reply, train_on, name)

    def by_prefix(msgs, gen):
        return render(msgs, kwargs, gen, name)[0]

    try:
        turns = turn_ranges(by_prefix, prompt, reply, prompt_text, full, train_on)
    except ValueError:
        raise InvalidRow("template_not_prefix_stable", name, _reply_cause(render, prompt, reply, kwargs, full, name,
                         template)) from None
    messages = [m for m in reply if m.get("role") == "assistant"][-len(turns):] if turns else []
    completion = full[len(prompt_text):]
    for k, (message, (a, b)) in enumerate(zip(messages, turns)):
        for piece in own_text(message):
            if piece in completion and piece not in completion[a:b]:
                raise InvalidRow("unverified_turn", name, f"field {name!r}: the cut of assistant message {k} does not "
                                 f"hold its own text {_short(piece)!r}, so what it scores cannot be verified; {FIX}")
    return complement(turns, len(completion))


def _check_turn_count(reply: list[dict], train_on: str, name: str) -> None:
    """A reply of more scored turns than ``MAX_TURNS``, refused before rendering them one by one (cuts and the
    turn-by-turn method render the conversation up to each turn: the square of the turns)."""
    turns = scored_turns(reply, train_on)
    if len(turns) > MAX_TURNS:
        raise InvalidRow("too_many_turns", name, f"field {name!r} has {len(turns)} scored assistant turns, past the "
                         f"{MAX_TURNS} prefpack renders one by one; split the trajectory into shorter rows, or render "
                         "with a template that marks assistant text with {% generation %} (--chat-template FILE: one "
                         "rendering whatever the length)")


def own_text(message: dict) -> list[str]:
    """The pieces of an assistant message a template should render: its reasoning, its content (with any
    <think>...</think> taken out) and each tool call's name; stripped, empty ones left out."""
    content = message.get("content") if isinstance(message.get("content"), str) else ""
    reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning")
                      if isinstance(message.get(k), str)), "")
    if "</think>" in content:
        head, content = content.rsplit("</think>", 1)
        reasoning = reasoning or head.split("<think>")[-1]
    names = [(c.get("function") or c).get("name") for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    return [p.strip() for p in (reasoning, content, *[n for n in names if isinstance(n, str)]) if p and p.strip()]


def left_out(reply: list[dict], completion: str) -> list[str]:
    """What of the reply's assistant messages the rendered completion does not hold, one line each."""
    out = []
    for k, message in enumerate(reply):
        if message.get("role") != "assistant":
            continue
        for piece in own_text(message):
            if piece not in completion:
                out.append(f"message {k}'s {_which(message, piece)} {_short(piece)!r}")
    return out


def _which(message: dict, piece: str) -> str:
    names = [(c.get("function") or c).get("name") for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    if piece in names:
        return "tool call"
    content = message.get("content") if isinstance(message.get("content"), str) else ""
    return "content" if piece == content.rsplit("</think>", 1)[-1].strip() else "reasoning"


def _short(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _differ(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _family(template: ChatTemplate | None) -> str:
    if template is not None and template.resembles:
        return (f" (the tokenizer's template looks like {template.resembles}'s but is not the one prefpack ships a "
                "training template for)")
    return ""


def _history_reply(template: ChatTemplate | None, earlier_reasoning: str | None, reply: list[dict]) -> bool:
    """A training template with earlier turns' reasoning dropped, and a reply holding a user turn: the reply's first
    assistant turn is then an earlier turn, rendered as history, not as the continuation of the generation prompt."""
    return bool(template is not None and template.training and (earlier_reasoning or "dropped") == "dropped"
                and any(m.get("role") == "user" for m in reply))


def _reasoning_of(message: dict) -> str:
    """An assistant message's reasoning (a reasoning field, or the <think> block of its content); "" if none."""
    reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning")
                      if isinstance(message.get(k), str) and message[k].strip()), "")
    content = message.get("content") if isinstance(message.get("content"), str) else ""
    if not reasoning and "</think>" in content:
        reasoning = content.rsplit("</think>", 1)[0].split("<think>")[-1]
    return reasoning.strip()


def _prompt_cause(render: Renderer, prompt, kwargs, prompt_text: str, full: str, name: str,
                  template: ChatTemplate | None, history_reply: bool = False, reply: list[dict] | None = None) -> str:
    """Why the prompt (with its generation prompt) is no prefix of the conversation with reply `name`."""
    plain, _ = render(prompt, kwargs, False, None)
    if prompt_text.startswith(plain) and full.startswith(plain):
        header = prompt_text[len(plain):]
        got = full[len(plain):len(plain) + len(header) + 12]
        first = next((m for m in reply or [] if m.get("role") == "assistant"), None)
        if kwargs.get("enable_thinking") is False and first is not None and _reasoning_of(first):
            return (f"field {name!r}'s assistant reply holds reasoning ({_short(_reasoning_of(first))!r}) but "
                    f"enable_thinking is false (--chat-template-kwargs or the row's chat_template_kwargs), so the "
                    f"generation prompt {header!r} closes an empty think block the reply cannot continue (it renders "
                    f"{got!r}...); the row's reasoning and the kwarg disagree, not the template: drop the reasoning "
                    "from such rows, or set enable_thinking true for them")
        if history_reply:
            return (f"field {name!r} holds a user turn, so its first assistant turn is an earlier turn, which "
                    f"--earlier-reasoning dropped (the default) renders as history ({got!r}...), not as the "
                    f"continuation of the generation prompt {header!r}; pass --earlier-reasoning kept (or scored) to "
                    "render earlier turns as the model wrote them")
        cause = (f"the template's generation prompt {header!r} is not how it renders the reply in field {name!r} "
                 f"(it renders {got!r}...), so no reply continues the prompt")
    else:
        i = _differ(prompt_text, full)
        cause = (f"the template rewrites an earlier turn once the reply in field {name!r} follows: the prompt renders "
                 f"{prompt_text[max(0, i - 30):i + 30]!r} but the whole conversation {full[max(0, i - 30):i + 30]!r}")
    return f"{render.named()} is not prefix-stable{_family(template)}: {cause}; {FIX}"


def _reply_cause(render: Renderer, prompt, reply, kwargs, full: str, name: str, template: ChatTemplate | None) -> str:
    """Why an assistant message inside reply `name` cannot be cut out by rendering the conversation up to it."""
    for k, message in enumerate(reply):
        if message.get("role") != "assistant":
            continue
        upto = list(prompt) + list(reply[:k + 1])
        alone, _ = render(upto, kwargs, False, name)
        if not full.startswith(alone):
            i = _differ(alone, full)
            what = (f"assistant message {k} of field {name!r} renders as {alone[max(0, i - 30):i + 30]!r} when it is "
                    f"last, but as {full[max(0, i - 30):i + 30]!r} once later messages follow (the template rewrites "
                    "an earlier turn)")
            break
        if k:
            before, _ = render(list(prompt) + list(reply[:k]), kwargs, True, name)
            if not full.startswith(before):
                i = _differ(before, full)
                what = (f"the generation prompt before assistant message {k} of field {name!r} renders "
                        f"{before[max(0, i - 30):]!r}, which the conversation does not continue "
                        f"({full[max(0, i - 30):i + 30]!r})")
                break
    else:
        what = f"a cut inside field {name!r} is no prefix of the whole conversation"
    return (f"{render.named()} is not prefix-stable inside the reply{_family(template)}: {what}, so its assistant "
            f"messages cannot be cut out exactly; {FIX} (--train-on all would score tool results too)")
