"""A reward model whose tokenizer is not the input's: each prompt + completion re-tokenised from its text with the
reward model's own tokenizer and chat template (TRL's online trainers do the same), so the model reads text, not
another tokenizer's ids.

What is re-tokenised, and how (the rows are then scored as any others; the output keeps the input's own ids):

- a samples row with ``messages`` (a chat prompt): the reward model's chat template renders the messages plus one
  assistant message holding the completion's text (``apply_chat_template(messages + [{"role": "assistant",
  "content": text}])``), its prompt part and its reply part tokenised as ``prepare`` tokenises a chat row for this
  tokenizer (no EOS after a reply the template ends with its own end of turn); no template: a one-line error;
- a samples row with a plain prompt: the prompt's text (less the input tokenizer's own BOS) with the reward model's
  BOS convention, then the completion's text and the reward model's EOS, as ``prepare`` stores a reward model's
  training pairs; a completion cut by ``max_new_tokens`` (``truncated``) gets no EOS, as its ids hold none;
- JSONL text rows: read again from the row with the reward model's tokenizer, as ``prepare`` would read them;
- a store, or samples rows without their texts (``completions``, and ``prompt`` or ``messages``): ids only, a
  one-line error.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from prefpack.data.formats import Example, InvalidRow, detect_layout, extract, resolve_fields
from prefpack.data.row_checks import (
    KWARGS_FIELD,
    TOOLS_FIELD,
    get_messages,
    parse_template_kwargs,
    parse_tools,
)
from prefpack.rewards.rows import ScoreInput, ScoreRow, _json_rows, _with_scores
from prefpack.rewards.scorers import ScorerError

WHAT = {"samples": "the samples'", "store": "the store's", "text": "the input rows'"}


def tokenizer_label(tok, name: str) -> str:
    """A tokenizer as the notes name it: its folder or hub id, size and content hash."""
    from prefpack.tokenizer import tokenizer_hash

    return f"{name}, {len(tok)} tokens, hash {tokenizer_hash(tok)[:12]}"


class Retokeniser:
    """Rows of ``source`` re-tokenised for a reward model's tokenizer ``tok`` (loaded from ``folder``)."""

    def __init__(self, tok, folder: str, source: ScoreInput):
        from prefpack.data.tokenize import ExampleTokenizer, TokenizeConfig
        from prefpack.tokenizer import special_tokens

        self.tok, self.folder, self.source = tok, folder, source
        self.specials = special_tokens(tok)
        self.encode = ExampleTokenizer(tok, self.specials, TokenizeConfig())
        self.layout: str | None = None
        prefix = list(source.specials.prefix_ids)  # the input tokenizer's BOS, left off a plain prompt's text
        self.prefix, self.prefix_text = prefix, source.tok.decode(prefix) if prefix else ""
        self.differs = (f"the reward model's tokenizer differs from {WHAT[source.kind]} (its: {tokenizer_label(tok, folder)}"
                        f"; {WHAT[source.kind]}: {tokenizer_label(source.tok, source.tokenizer_dir)})")

    def scan(self) -> str:
        """Every row checked to hold what re-tokenising needs (before anything is scored); the one-line note that
        says what is done."""
        src = self.source
        if src.kind == "store":
            raise ScorerError(f"--reward-model {self.folder!r}: {self.differs}, and the store {str(src.path)!r} holds "
                              "token ids only; score the rows it was prepared from (JSONL text rows, re-tokenised "
                              "with the reward model's own tokenizer), or samples from prefpack generate (they hold "
                              "their texts)")
        completions, chat, plain = 0, False, False
        for line, row in _json_rows(src.path):
            if src.kind == "samples":
                n, is_chat = self._samples_row_needs(row, line)
            else:
                ex = self._text_example(row, line)
                n, is_chat = len(ex.completions), ex.chat
            completions += n
            chat, plain = chat or is_chat, plain or not is_chat
            if is_chat and not self.tok.chat_template:
                raise ScorerError(f"--reward-model {self.folder!r}: {self.differs}, and {src.path} line {line} holds "
                                  "chat messages, but the reward model's tokenizer has no chat template to render "
                                  "them with; save the reward model's tokenizer with its chat template (its "
                                  "tokenizer_config.json's chat_template), or score with a reward model of "
                                  f"{WHAT[src.kind]} tokenizer")
        how = " and chat template" if chat else ""
        eos = (f", its EOS ({self.tok.eos_token}) after each plain completion not cut"
               if plain and src.kind == "samples" else
               f", its EOS ({self.tok.eos_token}) after each plain completion" if plain else "")
        return f"{self.differs}: re-tokenising {completions} completions from their text with its own tokenizer{how}{eos}"

    def _samples_row_needs(self, row: dict, line: int) -> tuple[int, bool]:
        comps = row.get("completion_ids")
        n = len(comps) if isinstance(comps, list) else 0
        texts = row.get("completions")
        chat = isinstance(row.get("messages"), list)
        has_texts = isinstance(texts, list) and len(texts) == n and all(isinstance(t, str) for t in texts)
        if not has_texts or not (chat or isinstance(row.get("prompt"), str)):
            missing = "'completions' texts" if not has_texts else "a 'prompt' text or 'messages'"
            raise ScorerError(f"--reward-model {self.folder!r}: {self.differs}, and {self.source.path} line {line} "
                              f"holds token ids without {missing}: re-tokenising for the reward model needs the "
                              "text; add each row's 'prompt' (or chat 'messages') and 'completions' texts (prefpack "
                              "generate writes them), or score with a reward model of the samples' tokenizer")
        return n, chat

    def _text_example(self, row: dict, line: int) -> Example:
        try:
            if self.layout is None:
                self.layout, _ = detect_layout(row, {})
            return extract(_with_scores(row, self.layout), self.layout, resolve_fields(self.layout, {}))
        except InvalidRow as err:  # ScoreInput reads the same rows and names this first; said here all the same
            raise ScorerError(f"{self.source.path} line {line}: {err.message}") from None

    def _samples_example(self, r: ScoreRow) -> Example:
        f = r.fields
        names = tuple(f"completion {k}" for k in range(len(r.completion_ids)))
        texts = list(f["completions"])
        if isinstance(f.get("messages"), list):
            messages = get_messages(f, "messages", allow_empty=True)
            return Example(messages, tuple([{"role": "assistant", "content": t}] for t in texts), chat=True,
                           completion_fields=names, tools=parse_tools(f.get(TOOLS_FIELD), TOOLS_FIELD),
                           template_kwargs={k: v for k, v in parse_template_kwargs(
                               f.get(KWARGS_FIELD), KWARGS_FIELD).items() if v is not None})
        prompt = f["prompt"]
        if self.prefix and r.prompt_ids[:len(self.prefix)] == self.prefix and prompt.startswith(self.prefix_text):
            prompt = prompt[len(self.prefix_text):]  # the input tokenizer's BOS: the reward model adds its own
        return Example(prompt, tuple(texts), chat=False, completion_fields=names)

    def rows(self, rows: list[ScoreRow]) -> list[ScoreRow]:
        """``rows`` with the reward model's token ids (and score masks) in place of the input's."""
        if self.source.kind == "samples":
            examples = [self._samples_example(r) for r in rows]
        else:
            examples = [self._text_example(r.fields, r.row) for r in rows]
        out = []
        for r, ex, res in zip(rows, examples, self.encode(examples)):
            if isinstance(res, InvalidRow):
                where = f", {res.field}" if res.field else ""
                raise ScorerError(f"--reward-model {self.folder!r}: row {r.row}{where}: re-tokenising it with the "
                                  f"reward model's tokenizer failed: {res.message}")
            comps, masks = [list(c) for c in res.completions], list(res.scored or [None] * len(res.completions))
            if self.source.kind == "samples" and not ex.chat:
                for k, cut in enumerate(r.truncated):  # cut by max_new_tokens: no EOS, as its ids hold none
                    if cut and len(comps[k]) > 1 and comps[k][-1] == self.specials.eos_id:
                        comps[k] = comps[k][:-1]
                        masks[k] = None if masks[k] is None else masks[k][:-1]
            out.append(replace(r, prompt_ids=list(res.prompt), completion_ids=comps,
                               scored=[None if m is None else np.asarray(m, dtype=bool) for m in masks]))
        return out
