"""Tokenizer loading, content hashing and special-token conventions.

The store records a hash of the tokenizer's *content* (vocabulary, merges, normaliser, special tokens,
chat template) so a model can later refuse a store tokenised by something else. File bytes are not
hashed: the same tokenizer saved twice must hash the same.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path


class TokenizerError(ValueError):
    """The tokenizer cannot be loaded or lacks what prefpack needs (e.g. an EOS token)."""


def load_tokenizer(name_or_path: str | Path, *, trust_remote_code: bool = False):
    """Load a *fast* tokenizer from a local folder or a hub id, with a clear error when that fails."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(name_or_path), trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises many types here (OSError, ValueError, HF errors)
        raise TokenizerError(
            f"cannot load tokenizer {str(name_or_path)!r}: {exc}. Pass a local folder with tokenizer.json "
            "(or a hub id when the hub is reachable)."
        ) from exc
    if not getattr(tok, "is_fast", False):
        raise TokenizerError(
            f"tokenizer {str(name_or_path)!r} is a slow (pure Python) tokenizer; prefpack needs a fast one "
            "(a folder with tokenizer.json)."
        )
    if tok.eos_token_id is None:
        raise TokenizerError(
            f"tokenizer {str(name_or_path)!r} defines no EOS token; completions must end with one. "
            "Set eos_token in its tokenizer_config.json."
        )
    return tok


def _backend_digest(tok) -> str:
    """sha256 of the backend's serialised content, without runtime truncation/padding settings.

    `to_str()` is deterministic (vocabulary in id order), so hashing it directly is exact and ten times
    faster than re-serialising it; only when truncation or padding is set is it parsed to drop them.
    """
    backend = tok.backend_tokenizer
    text = backend.to_str()
    if backend.truncation is not None or backend.padding is not None:
        spec = json.loads(text)
        spec["truncation"] = None
        spec["padding"] = None
        text = json.dumps(spec, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenizer_hash(tok) -> str:
    """sha256 of the tokenizer's content, stable across save_pretrained/from_pretrained round trips."""
    content = {
        "backend": _backend_digest(tok),
        "special_tokens": {k: str(v) for k, v in sorted(tok.special_tokens_map.items())},
        "chat_template": tok.chat_template,
    }
    blob = json.dumps(content, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class SpecialTokens:
    """What the tokenizer adds around a text by its own convention, and the ids prefpack needs."""

    bos_id: int | None
    eos_id: int
    pad_id: int | None
    prefix_ids: tuple[int, ...]  # ids the tokenizer adds before a text (BOS for Llama-style, none for NeoX/Qwen)
    vocab_size: int  # len(tokenizer): base vocabulary plus added tokens

    def to_json(self) -> dict:
        return {
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "prefix_ids": list(self.prefix_ids),
            "vocab_size": self.vocab_size,
        }


def special_tokens(tok) -> SpecialTokens:
    """Find the tokenizer's convention by encoding a probe text with and without special tokens."""
    probe = "prefpack probe"
    plain = tok(probe, add_special_tokens=False)["input_ids"]
    full = tok(probe, add_special_tokens=True)["input_ids"]
    prefix: list[int] = []
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            prefix = full[:start]
            break
    return SpecialTokens(
        bos_id=tok.bos_token_id,
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
        prefix_ids=tuple(int(i) for i in prefix),
        vocab_size=len(tok),
    )


def tokenizer_name(tok, given: str | Path) -> str:
    return str(getattr(tok, "name_or_path", "") or given)
