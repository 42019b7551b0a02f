"""Tokenizer loading, content hashing and special-token conventions.

The store records a hash of what decides the token ids (vocabulary, merges, normaliser, pre-tokeniser, the
tokens added around a text, added and special tokens) so a model can later refuse a store whose ids would mean
something else. The chat template is not part of it (version 3): it decides which text is tokenised, not what an id
means, so a store prepared with a training template (or a tokenizer copy with another template) trains with the
model's own tokenizer; the template used is recorded beside the hash instead (``meta.json``'s ``chat_template``). File bytes
and the Python class that loaded the tokenizer are not hashed either: the same tokenizer.json loaded next to a
Mistral or a GPT-NeoX config must hash the same. Versions 1 (the backend's whole serialisation) and 2 (version 3
plus the chat template) are kept to check stores written before.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from prefpack.errors import PrefpackError
from prefpack.remote_code import check_tokenizer_code


class TokenizerError(PrefpackError, ValueError):
    """The tokenizer cannot be loaded or lacks what prefpack needs (e.g. an EOS token)."""


def load_tokenizer(name_or_path: str | Path, *, trust_remote_code: bool = False):
    """Load a *fast* tokenizer from a local folder or a hub id, with a clear error when that fails. A folder naming
    tokenizer code is refused unless ``trust_remote_code`` (prefpack.remote_code)."""
    from transformers import AutoTokenizer

    check_tokenizer_source(str(name_or_path))
    check_tokenizer_code(str(name_or_path), allowed=trust_remote_code)
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
    if not tok.chat_template:
        tok.chat_template = processor_chat_template(name_or_path)
    return tok


def processor_chat_template(folder: str | Path) -> str | None:
    """The chat template a processor folder keeps apart from its tokenizer (``chat_template.json``, as
    vision-language processors save it: what ``processor.apply_chat_template`` renders, hence what TRL renders for
    such a model); None when there is none. Read only where the tokenizer itself has no template."""
    path = Path(folder) / "chat_template.json"
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError) as exc:
        raise TokenizerError(f"{path}: cannot read its chat template ({exc})") from None
    return value if isinstance(value, str) and value.strip() else None


def check_tokenizer_source(name: str) -> None:
    """Answer at once for a tokenizer that is neither here nor reachable: transformers would retry a missing folder
    as a hub id, for ~50 s when the hub cannot be reached (a typo such as ``quickstrat/init-model``, offline)."""
    if os.path.exists(name):
        return
    looks_local = os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or "\\" in name
    if looks_local:
        raise TokenizerError(f"tokenizer folder {name!r} does not exist; give a folder holding tokenizer.json (or "
                             f"a hub id); {_LOCAL_HINT}")
    if not _hub_cached(name) and not hub_reachable():
        raise TokenizerError(f"tokenizer {name!r}: no such folder here, and the model hub cannot be reached to "
                             "download it as a hub id (offline, or HF_HUB_OFFLINE is set): check the spelling, or "
                             f"give a local folder holding tokenizer.json; {_LOCAL_HINT}")


# A model folder holds its tokenizer; where a newcomer gets one with no downloads.
_LOCAL_HINT = "prefpack quickstart --model-size small writes a model folder with one to runs/quickstart-small/model"


def _hub_cached(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return any(isinstance(try_to_load_from_cache(repo_id, f), str)
                   for f in ("tokenizer.json", "tokenizer_config.json"))
    except Exception:  # not a valid repo id, or an older huggingface_hub
        return False


@functools.cache
def hub_reachable() -> bool:
    """One TCP connection to the hub's endpoint, 3 s at most (HF_HUB_OFFLINE means unreachable)."""
    import socket
    from urllib.parse import urlparse

    try:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            return False
        url = urlparse(constants.ENDPOINT)
    except Exception:
        url = urlparse("https://huggingface.co")
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=3).close()
        return True
    except OSError:
        return False


HASH_VERSION = 3  # recorded in meta.json as tokenizer.hash_version; absent in stores hashed with version 1


def _backend_digest(tok) -> str:
    """Version 1: sha256 of the backend's serialised content, without runtime truncation/padding settings.

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


def _hash_v1(tok) -> str:
    content = {
        "backend": _backend_digest(tok),
        "special_tokens": {k: str(v) for k, v in sorted(tok.special_tokens_map.items())},
        "chat_template": tok.chat_template,
    }
    return _sha(content)


def _sha(obj) -> str:
    blob = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _split_backend(text: str) -> tuple[dict, dict, str]:
    """(top-level parts but the model, model options, raw vocabulary-and-merges text) of `to_str()`.

    Parsing a 150k vocabulary takes half a second, so only the small parts are parsed. `"model"` is the
    last key and `"vocab"` the first large one; a quote inside a JSON string is always escaped, so the
    first `,"model":{` and `,"vocab":` are the keys themselves.
    """
    i = text.find(',"model":{')
    if i > 0 and text.endswith("}"):
        model_text = text[i + len(',"model":') : -1]
        j = model_text.find(',"vocab":')
        try:
            head = json.loads(text[:i] + "}")
            options = json.loads(model_text[:j] + "}") if j > 0 else None
        except json.JSONDecodeError:
            head = options = None
        if head is not None and options is not None:
            return head, options, model_text[j:]
    spec = json.loads(text)  # an unexpected layout: parse it all (slower, same result)
    model = spec.pop("model")
    data = {k: model.pop(k) for k in ("vocab", "merges") if k in model}
    return spec, model, json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def _decoder_view(dec):
    """ByteLevel decoding ignores its options (they only matter when pre-tokenising)."""
    if not isinstance(dec, dict):
        return dec
    if dec.get("type") == "ByteLevel":
        return {"type": "ByteLevel"}
    if dec.get("type") == "Sequence":
        return {**dec, "decoders": [_decoder_view(d) for d in dec.get("decoders", [])]}
    return dec


def _hash_v2(tok, *, with_template: bool = True) -> str:
    """Version 2 hashes the chat template too; version 3 is the same content without it."""
    head, options, data = _split_backend(tok.backend_tokenizer.to_str())
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if key in options and options[key] is None:
            options[key] = ""  # None and "" both mean no prefix/suffix; classes differ in which they write
    # The post-processor is hashed by what it adds around a text (transformers classes spell "nothing" as
    # an empty template or as ByteLevel offset trimming); pairs of texts are never used.
    around = tok("prefpack probe", add_special_tokens=True)["input_ids"]
    content = {
        "added_tokens": head.get("added_tokens"),
        "normalizer": head.get("normalizer"),
        "pre_tokenizer": head.get("pre_tokenizer"),
        "decoder": _decoder_view(head.get("decoder")),
        "model": options,
        "model_data": hashlib.sha256(data.encode("utf-8")).hexdigest(),
        "around": list(around),
        # pad is left out: it only fills padded batches (masked out); classes pick different defaults
        "special_tokens": {k: (str(getattr(tok, f"{k}_token")), getattr(tok, f"{k}_token_id"))
                           for k in ("bos", "eos", "unk")},
    }
    if with_template:
        content["chat_template"] = tok.chat_template
    return _sha(content)


def tokenizer_hash(tok, version: int = HASH_VERSION) -> str:
    """sha256 of the tokenizer's content, stable across save_pretrained/from_pretrained round trips."""
    if version == 1:
        return _hash_v1(tok)
    if version == 2:
        return _hash_v2(tok)
    if version == 3:
        return _hash_v2(tok, with_template=False)
    raise TokenizerError(f"tokenizer hash version {version} is unknown to this prefpack (it knows 1..{HASH_VERSION}); "
                         "the store was written by a newer prefpack")


def tokenizer_matches(tok, recorded: dict) -> bool:
    """True if `tok` is the tokenizer recorded in a store's `meta["tokenizer"]` (hash and hash_version).

    The hash is computed the way the store computed it, so stores written before version 3 keep working (and are
    judged as they were: their hash covers the chat template; ``model.load.resolve_tokenizer`` looks further).
    """
    return tokenizer_hash(tok, int(recorded.get("hash_version", 1))) == recorded.get("hash")


def template_sha(template: str | dict | None) -> str | None:
    """sha256 of a chat template (a named set of templates hashed as its sorted JSON); None for no template."""
    if not template:
        return None
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


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
