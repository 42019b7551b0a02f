"""Tokenise examples: prompt and completions apart, ids joined; BOS at most once, EOS exactly once.

Tokenising the joined string would let BPE merge across the prompt/completion boundary and shift the
split; tokenising apart keeps the boundary exact. Chat rows are rendered through the chat template
(``chat_masks``: the prompt with the generation prompt, each completion as what the whole conversation
adds after it, and which of its characters are scored).

A completion may leave some of its tokens unscored (``--train-on`` for chat replies, ``loss_masking_spans`` for
text): those are character ranges (``turns``), turned into a score mask per token through the tokenizer's offsets.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from prefpack.data.chat_masks import render_chat
from prefpack.data.formats import Example, InvalidRow
from prefpack.data.image_files import ImageSource, image_bytes, image_size, image_tokens
from prefpack.data.template_vars import TOOL_VARIABLES, template_reads
from prefpack.data.training_templates import ChatTemplate
from prefpack.data.truncation import (
    PROMPT_CUT_BEFORE_TOKENISING,
    TRUNCATION_POLICIES,
    check_prompt_keep,
    infer_seqlen,
)
from prefpack.data.turns import Ranges, token_mask
from prefpack.tokenizer import SpecialTokens

# With --max-length L, a text longer than this many characters per token of L (plus 1,024) is cut before it is
# tokenised (see ExampleTokenizer._encode_bounded): a token rarely spans 16 characters, and the cut is checked.
CUT_CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class TokenizeConfig:
    max_length: int | None = None  # longest prompt + completion sequence, in tokens
    # "prompt-left": cut the prompt's start, then completions' ends; "drop"; the peers' rules "trl-keep-start" and
    # "llamafactory" (truncation.py says exactly what each does)
    truncation: str = "prompt-left"
    min_prompt_tokens: int = 1  # never cut a prompt below this (the first completion token needs context)
    min_prompt_keep: float = 0.0  # prompt-left: refuse a cut keeping less of the prompt (prepare's default: 0.5)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # template variables for every chat row
    tools: list[dict] | None = None  # tools for chat rows that give none of their own
    train_on: str = "assistant"  # chat replies: which messages are scored (turns.TRAIN_ON)
    vision: Any = None  # prepare --processor: an ``images.Vision`` (image rows' placeholders expanded exactly)
    image_source: ImageSource = field(default_factory=ImageSource)  # where image paths may lead, the size limit
    template: ChatTemplate | None = None  # what chat rows are rendered with (None: the tokenizer's own)
    earlier_reasoning: str | None = None  # a training template's earlier turns' reasoning (dropped, kept, scored)


@dataclass
class TokenizedExample:
    prompt: list[int]
    completions: tuple[list[int], ...]
    label: int | None
    truncated: tuple[str, ...] = ()  # "prompt" and/or "completion" when --max-length cut something
    scored: tuple[list[bool] | None, ...] = ()  # per completion: True per scored token, None when all are
    # per completion: None (one sequence) or the sorted offsets k (0 < k < len) where a new segment starts, each laid
    # out again after the prompt as a sequence of its own (store_format: segments.bin)
    segments: tuple[list[int] | None, ...] = ()
    cut: int = 0  # texts of it cut before tokenising (far longer than --max-length; the kept tokens unchanged)
    before: tuple[int, ...] = ()  # prompt then completion lengths before --max-length cut (estimated if `cut`)
    # vision rows: per image (encoded bytes, width, height, where its image tokens start in the prompt, how many)
    images: tuple[tuple[bytes, int, int, int, int], ...] = ()
    left_out: tuple[str, ...] = ()  # text of the replies' assistant messages the chat template did not render
    open_prompt: bool = False  # the prompt stops before the generation prompt (chat_masks.RenderedChat.open_prompt)


class Dropped(Exception):
    """An example removed by the length policy (counted, not an error)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _template_source(tok) -> str:
    template = tok.chat_template
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return str(template or "")


class ExampleTokenizer:
    """Tokenises batches of examples with one batched call to the fast tokenizer."""

    def __init__(self, tok, specials: SpecialTokens, cfg: TokenizeConfig):
        if cfg.truncation not in TRUNCATION_POLICIES:
            raise ValueError(f"unknown truncation policy {cfg.truncation!r}; choose {', '.join(TRUNCATION_POLICIES)}")
        self.tok = tok
        self.specials = specials
        self.cfg = cfg
        self._ws_cache: dict[int, bool] = {}
        source = cfg.template.source if cfg.template is not None else _template_source(tok)
        # A template that never reads `tools`, `tool_calls` or `documents` would silently drop them: refuse such rows.
        self.reads = template_reads(source)  # the template rows are rendered with
        # a chat reply that ends with one of these (the template's own end of turn) gets no EOS after it
        self._turn_ends = {specials.eos_id, *tok.all_special_ids,
                           *(i for i, t in tok.added_tokens_decoder.items() if t.special)}

    def _check_tool_support(self, ex: Example) -> None:
        tools = ex.tools if ex.tools is not None else self.cfg.tools
        if tools and self.reads.tools_variable is None:
            raise InvalidRow("template_ignores_tools", "tools", "the row has tools but the tokenizer's chat "
                             f"template never reads `tools` (nor any of {', '.join(TOOL_VARIABLES[1:])}), so they would be "
                             "left out of the prompt; use a tokenizer whose template supports tool use")
        if ex.documents and "documents" not in self.reads.variables:
            raise InvalidRow("template_ignores_documents", "documents", "the row has documents but the chat "
                             "template never reads `documents`, so they would be left out of the prompt; use a "
                             "template that renders them (--chat-template FILE), or put them in the messages")
        for part, name in ((ex.prompt, None), *zip(ex.completions, ex.completion_fields)):
            if not self.reads.reads_tool_calls and any(m.get("tool_calls") for m in part):
                raise InvalidRow("template_ignores_tools", name, "a message has 'tool_calls' but the tokenizer's "
                                 "chat template never reads `tool_calls`, so the calls would be left out; use a "
                                 "tokenizer whose template supports tool use")

    def _is_whitespace(self, tid: int) -> bool:
        hit = self._ws_cache.get(tid)
        if hit is None:
            text = self.tok.decode([tid])
            hit = len(text) > 0 and not text.strip()
            self._ws_cache[tid] = hit
        return hit

    def _ends_with_eos(self, ids: list[int], chat: bool = False) -> bool:
        """True if the ids end with EOS, possibly followed by whitespace tokens (ChatML's '<|im_end|>\\n'); for a
        chat reply also with any special token, the template's own end of turn (Gemma's '<end_of_turn>\\n'): no
        EOS is added after it (TRL adds none to conversational rows)."""
        ends = self._turn_ends if chat else {self.specials.eos_id}
        i = len(ids) - 1
        while i >= 0 and ids[i] not in ends and self._is_whitespace(ids[i]):
            i -= 1
        return i >= 0 and ids[i] in ends

    def __call__(self, examples: list[Example]) -> list[TokenizedExample | InvalidRow | Dropped]:
        texts: list[str] = []
        # per example: (its prompt's text number, per completion the text numbers of its segments) or the error
        rendered: list[tuple[int, list[list[int]]] | InvalidRow] = []
        masked: dict[int, Ranges] = {}  # text number -> its unscored character ranges
        images: dict[int, list] = {}  # example number -> its images (bytes, width, height, tokens)
        left_out: dict[int, tuple[str, ...]] = {}  # example number -> what its template did not render
        open_prompts: set[int] = set()  # example numbers whose prompt stops before the generation prompt
        for e, ex in enumerate(examples):
            segments: list[list[int] | None] = []
            try:
                if ex.chat:
                    self._check_tool_support(ex)
                    chat = render_chat(self.tok, ex, self.cfg.chat_template_kwargs, self.cfg.tools, self.cfg.train_on,
                                       self.cfg.template, self.cfg.earlier_reasoning)
                    prompt, comps, unscored, segments = chat.prompt, chat.completions, chat.unscored, chat.segments
                    if chat.left_out:
                        left_out[e] = tuple(chat.left_out)
                    if chat.open_prompt:
                        open_prompts.add(e)
                else:
                    prompt, comps = ex.prompt, list(ex.completions)
                    unscored = list(ex.unscored or [None] * len(comps))
                if ex.images:
                    if any(segments):
                        raise InvalidRow("images_in_split_reply", None, "the chat template rewrites earlier turns, so "
                                         "the reply is scored as several sequences, which rows with images cannot be "
                                         "yet; render with a prefix-preserving template (--chat-template FILE)")
                    prompt, images[e] = self._expand_images(ex, prompt, comps)
            except InvalidRow as err:
                rendered.append(err)
                continue
            at, numbers = len(texts), []
            texts.append(prompt)
            for k, (text, ranges) in enumerate(zip(comps, unscored)):
                cuts = [0, *(segments[k] if k < len(segments) and segments[k] else []), len(text)]
                numbers.append([])
                for a, b in zip(cuts, cuts[1:]):  # each segment tokenised apart: its own sequence after the prompt
                    piece = [(max(x, a) - a, min(y, b) - a) for x, y in ranges or [] if x < b and y > a]
                    if piece:
                        masked[len(texts)] = piece
                    numbers[-1].append(len(texts))
                    texts.append(text[a:b])
            rendered.append((at, numbers))
        # The backend's batch encoder skips transformers' per-text dict building (half the time here); it keeps
        # no offsets, so the few texts with unscored ranges are encoded again with them.
        backend = self.tok.backend_tokenizer
        prompts = {r[0] for r in rendered if not isinstance(r, InvalidRow)}
        ids, cut = self._encode_bounded(texts, prompts, set(masked))
        keys = sorted(masked)
        masks = {k: token_mask(e.offsets, masked[k]) for k, e in
                 zip(keys, backend.encode_batch([texts[k] for k in keys], add_special_tokens=False))}
        out: list[TokenizedExample | InvalidRow | Dropped] = []
        for e, (ex, r) in enumerate(zip(examples, rendered)):
            if isinstance(r, InvalidRow):
                out.append(r)
                continue
            start, numbers = r
            comps, comp_masks, starts = [], [], []
            for parts in numbers:
                comps.append([t for k in parts for t in ids[k]])
                has_mask = any(k in masks for k in parts)
                comp_masks.append([b for k in parts for b in masks.get(k, [True] * len(ids[k]))] if has_mask else None)
                lengths = [len(ids[k]) for k in parts]
                starts.append([sum(lengths[:j]) for j in range(1, len(parts))] or None)
            try:
                done = self._finish(ex, ids[start], comps, comp_masks,
                                    [cut.get(k, 0) for k in (start, *(parts[0] for parts in numbers))], starts)
                if e in images:
                    done.images = self._place_images(ex, done, images[e])
                done.left_out = left_out.get(e, ())
                done.open_prompt = e in open_prompts
                out.append(done)
                out[-1].cut = sum(k in cut for k in (start, *(k for parts in numbers for k in parts)))
            except (InvalidRow, Dropped) as err:
                out.append(err)
        return out

    def _expand_images(self, ex: Example, prompt: str, comps: list[str]) -> tuple[str, list]:
        """Read and decode the example's images, and write each one's placeholder in the rendered prompt as the
        exact number of image tokens the processor gives it; returns the prompt and (bytes, width, height, tokens)
        per image."""
        token, name = self.cfg.vision.image_token, ex.images_field
        pieces = prompt.split(token)
        if len(pieces) - 1 != len(ex.images) or any(token in c for c in comps):
            raise InvalidRow("image_count_mismatch", name, f"field {name!r} holds {len(ex.images)} image(s) but the "
                             f"chat template wrote {len(pieces) - 1} {token!r} placeholder(s) in the prompt"
                             + (" and some in a reply" if any(token in c for c in comps) else "")
                             + "; the tokenizer's template must write one per {'type': 'image'} part, and the text "
                             f"must not hold {token!r} itself")
        infos = []
        for k, value in enumerate(ex.images):
            data = image_bytes(value, name, k, ex.image_dir, self.cfg.image_source)
            width, height = image_size(data, name, k)
            n = image_tokens(self.cfg.vision, width, height, name, k)
            infos.append((data, width, height, n))
        expanded = pieces[0] + "".join(token * info[3] + rest for info, rest in zip(infos, pieces[1:]))
        return expanded, infos

    def _place_images(self, ex: Example, res: TokenizedExample, infos: list) -> tuple:
        """Where each image's run of image tokens starts in the tokenised prompt; refuses a prompt --max-length cut
        (it would cut an image's tokens) and a run that did not tokenise to exactly its count."""
        if "prompt" in res.truncated:
            raise InvalidRow("image_prompt_cut", ex.images_field, "--max-length would cut this prompt, which holds "
                             f"{len(infos)} image(s) ({sum(i[3] for i in infos)} image tokens); raise --max-length or "
                             "use --truncation drop")
        tid, p = self.cfg.vision.image_token_id, res.prompt
        starts = [i for i, t in enumerate(p) if t == tid and (i == 0 or p[i - 1] != tid)]
        runs = [next((j for j in range(s, len(p)) if p[j] != tid), len(p)) - s for s in starts]
        if runs != [i[3] for i in infos] or any(tid in c for c in res.completions):
            raise InvalidRow("image_tokens_mismatch", ex.images_field, f"the image tokens tokenised as runs of {runs}, "
                             f"not {[i[3] for i in infos]}: the tokenizer splits {self.cfg.vision.image_token!r}")
        return tuple((data, w, h, s, n) for (data, w, h, n), s in zip(infos, starts))

    def _encode_bounded(self, texts: list[str], prompts: set[int], masked: set[int]) -> tuple[list[list[int]], dict]:
        """Token ids of every text; with --max-length, a text far longer than it is cut before tokenising (a
        prompt keeps its end, a completion its start: what truncation keeps), so one huge row does not cost
        gigabytes. The cut is checked: the kept tokens must be the same at two cut points (else the whole text is
        tokenised), and enough tokens must remain that truncation still applies. Also returns, per text cut, the
        tokens it left out (estimated from the characters per token of the part kept), for the cut counts."""
        backend, limit = self.tok.backend_tokenizer, self.cfg.max_length
        # what the policy keeps of a prompt: its end, its start, or nothing cut early (llamafactory's cut depends on
        # the whole prompt's length, so its texts are always tokenised whole)
        keep_end = PROMPT_CUT_BEFORE_TOKENISING[self.cfg.truncation]
        chars = None if limit is None or keep_end is None else CUT_CHARS_PER_TOKEN * limit + 1024
        long = [k for k, t in enumerate(texts) if chars is not None and len(t) > chars and k not in masked]
        if not long:
            return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)], {}

        def cut(k: int, n: int) -> str:
            return texts[k][-n:] if k in prompts and keep_end else texts[k][:n]

        bounded = list(texts)
        for k in long:
            bounded[k] = cut(k, chars)
        ids = [e.ids for e in backend.encode_batch_fast(bounded, add_special_tokens=False)]
        halves = backend.encode_batch_fast([cut(k, chars // 2) for k in long], add_special_tokens=False)
        done = set(long)
        for k, half in zip(long, halves):
            kept = (lambda x: x[-limit:]) if k in prompts and keep_end else (lambda x: x[:limit])
            if min(len(ids[k]), len(half.ids)) <= limit or kept(ids[k]) != kept(half.ids):
                ids[k] = backend.encode(texts[k], add_special_tokens=False).ids  # the cut is not safe here
                done.discard(k)
        return ids, {k: round(len(ids[k]) * (len(texts[k]) / chars - 1)) for k in done}

    def _with_prefix(self, prompt: list[int]) -> list[int]:
        prefix = list(self.specials.prefix_ids)
        if prefix and prompt[: len(prefix)] != prefix:
            prompt = prefix + prompt  # BOS by the tokenizer's convention, once (not if the text already has it)
        if not prompt:
            raise InvalidRow("empty_prompt", None, "the prompt is empty and the tokenizer adds no BOS, so the first "
                             "completion token would have no context to be predicted from")
        return prompt

    def encode_prompt(self, ex: Example) -> list[int]:
        """The token ids of an example's prompt alone, rendered and tokenised as :meth:`__call__` does for a whole
        example (``prefpack generate`` samples replies to them); no --max-length cut."""
        if ex.chat:
            self._check_tool_support(ex)
            alone = replace(ex, completions=(), completion_fields=())  # the prompt as a sampler prompts with it
            text = render_chat(self.tok, alone, self.cfg.chat_template_kwargs, self.cfg.tools, self.cfg.train_on,
                               self.cfg.template, self.cfg.earlier_reasoning).prompt
        else:
            text = ex.prompt
        return self._with_prefix(self.tok.backend_tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids)

    def _finish(self, ex: Example, prompt: list[int], comps: list[list[int]], masks: list[list[bool] | None],
                unseen: list[int], segments: list[list[int] | None] | None = None) -> TokenizedExample:
        sp = self.specials
        prompt = self._with_prefix(prompt)
        segments = list(segments or [None] * len(comps))
        finished, scored = [], []
        for k, (c, m, name) in enumerate(zip(comps, masks, ex.completion_fields)):
            if m is not None and not any(m):
                where = ex.unscored_fields[k] if ex.unscored_fields else name
                raise InvalidRow("no_scored_tokens", where, f"field {where!r}: no token of the completion "
                                 f"{name!r} is left scored, so it would carry no training signal")
            if not self._ends_with_eos(c, ex.chat):  # an empty completion becomes [EOS]: "answer nothing", as in TRL
                c = c + [sp.eos_id]
                m = None if m is None else m + [True]
            finished.append(c)
            scored.append(m)
        before = (len(prompt) + unseen[0], *(len(c) + u for c, u in zip(finished, unseen[1:])))
        if any(segments):  # each segment is its own sequence after the prompt: only the prompt may be cut
            pieces = [c[a:b] for c, s in zip(finished, segments) for a, b in zip([0, *(s or [])], [*(s or []), len(c)])]
            prompt, _, truncated = self._truncate(prompt, pieces, before[0])
            if "completion" in truncated:
                raise Dropped("too_long")
        else:
            prompt, finished, truncated = self._truncate(prompt, finished, before[0])
        if len(finished) == 2 and "completion" in truncated and finished[0] == finished[1]:
            raise Dropped("identical_after_truncation")  # both cut to the same tokens: a pair with zero gradient
        scored = [m if m is None else m[: len(c)] for m, c in zip(scored, finished)]
        if any(m is not None and not any(m) for m in scored):
            raise InvalidRow("no_scored_tokens", None, "--max-length cut every scored token of a completion; "
                             "raise --max-length or use --truncation drop")
        return TokenizedExample(prompt=prompt, completions=tuple(finished), label=ex.label, truncated=truncated,
                                scored=tuple(scored), before=before, segments=tuple(segments))

    def _truncate(self, prompt: list[int], comps: list[list[int]], whole: int):
        """Cut to --max-length: the prompt's start (keeping BOS), then completions' ends; `whole` is the prompt's
        length before any cut (more than len(prompt) when its text was cut before tokenising)."""
        limit = self.cfg.max_length
        longest = max(len(c) for c in comps)
        if limit is None or len(prompt) + longest <= limit:
            return prompt, comps, ()
        if self.cfg.truncation == "drop":
            raise Dropped("too_long")
        if self.cfg.truncation == "trl-keep-start":
            return self._keep_start(prompt, comps, limit)
        if self.cfg.truncation == "llamafactory":
            return self._llamafactory(prompt, comps, limit, longest)
        truncated = []
        keep_head = list(self.specials.prefix_ids) if prompt[: len(self.specials.prefix_ids)] == list(
            self.specials.prefix_ids) else []
        floor = max(self.cfg.min_prompt_tokens, len(keep_head) + (1 if len(prompt) > len(keep_head) else 0))
        floor = min(floor, len(prompt))
        room = max(limit - longest, floor)
        if room < len(prompt):
            tail = prompt[len(keep_head):]
            prompt = keep_head + tail[len(tail) - (room - len(keep_head)):]
            truncated.append("prompt")
        if len(prompt) < whole:
            check_prompt_keep(whole, len(prompt), longest, limit, self.cfg.min_prompt_keep)
        room = limit - len(prompt)
        if room <= 0:
            raise Dropped("too_long")
        if longest > room:
            comps = [c[:room] for c in comps]
            truncated.append("completion")
        return prompt, comps, tuple(truncated)

    @staticmethod
    def _keep_start(prompt: list[int], comps: list[list[int]], limit: int):
        """TRL's ``truncation_mode="keep_start"``: each prompt + completion keeps its first `limit` tokens, so the
        prompt is never cut and every completion loses its end; a prompt of `limit` tokens or more would leave no
        completion token, and TRL drops such a row (counted here as ``prompt_too_long``)."""
        if len(prompt) >= limit:
            raise Dropped("prompt_too_long")
        room = limit - len(prompt)
        return prompt, [c[:room] for c in comps], ("completion",)

    @staticmethod
    def _llamafactory(prompt: list[int], comps: list[list[int]], limit: int, longest: int):
        """LLaMA-Factory's pairwise (and feedback) rule: ``infer_seqlen`` shares `limit` between the prompt and the
        longest completion, then the prompt keeps its first tokens and every completion its first tokens."""
        keep_prompt, keep_comp = infer_seqlen(len(prompt), longest, limit)
        if keep_comp == 0:  # a prompt so long that no completion token is left: nothing to train on
            raise Dropped("too_long")
        truncated = []
        if keep_prompt < len(prompt):
            prompt = prompt[:keep_prompt]
            truncated.append("prompt")
        if keep_comp < longest:
            comps = [c[:keep_comp] for c in comps]
            truncated.append("completion")
        return prompt, comps, tuple(truncated)
