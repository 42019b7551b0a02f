"""Dotted config keys (``loss.beta``) and the suggestion for an unknown one: another trainer's name at the top level
(TRL's or LLaMA-Factory's, mapped with its value: ``foreign``), an alias, the same name in another section, a close
spelling or initials. Used only to word the error for keys the tree does not have: every unknown key of a config
(file and overrides) in one error, one line each.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, get_type_hints

from prefpack.config.foreign import foreign_line
from prefpack.config.schema import Config, ConfigError

__all__ = ["ALIASES", "UnknownKey", "join_key", "suggest_key", "unknown_key", "unknown_keys_error"]

# Names people carry over from other trainers; used only to suggest the right key.
ALIASES = {
    "learning_rate": "lr",
    "scheduler": "schedule",
    "lr_scheduler": "schedule",
    "lr_scheduler_type": "schedule",
    "lr_schedule": "schedule",
    "model_name_or_path": "name_or_path",
    "model_name": "name_or_path",
    "name": "name_or_path",
    "path": "name_or_path",
    "num_train_epochs": "epochs",
    "num_epochs": "epochs",
    "batch_size": "global_batch_pairs",
    "grad_clip": "max_grad_norm",
    "clip_grad_norm": "max_grad_norm",
    "lora_r": "r",
    "rank": "r",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "torch_dtype": "dtype",
    "ref_model": "model",
    "output": "output_dir",
    "save_steps": "save_every",
    "eval_steps": "eval_every",
    "logging_steps": "log_every",
    "loss_type": "terms",
    # TRL DPOConfig / TrainingArguments names (docs/coming-from-trl.md)
    "loss_weights": "terms",
    "sync_ref_model": "sync",
    "ref_model_mixup_alpha": "mixup_alpha",
    "ref_model_sync_steps": "sync_steps",
    "precompute_ref_log_probs": "mode",
    "per_device_train_batch_size": "global_batch_pairs",
    "gradient_accumulation_steps": "micro_batch_tokens",
    "save_total_limit": "keep_checkpoints",
    "adam_beta1": "betas",
    "adam_beta2": "betas",
    "adam_epsilon": "eps",
    "padding_free": "packing",
    "bf16": "dtype",
    "use_cpu": "device",
    "model_init_kwargs": "dtype",
    "per_device_eval_batch_size": "micro_batch_tokens",
    "eval_strategy": "eval_every",
    "save_strategy": "save_every",
    "run_name": "output_dir",
    "fsdp": "strategy",
    "torch_compile": "compile",
}


def join_key(path: str, key: str) -> str:
    """``key`` under ``path`` (the top level when ``path`` is empty)."""
    return f"{path}.{key}" if path else key


def _all_paths(cls: type | None = None, prefix: str = "") -> list[str]:
    """Every dotted key of the tree (sections and leaves), for suggestions across sections."""
    cls = cls or Config
    hints = get_type_hints(cls)
    out = []
    for f in fields(cls):
        path = join_key(prefix, f.name)
        out.append(path)
        tp = hints[f.name]
        if is_dataclass(tp):
            out.extend(_all_paths(tp, path))
    return out


def _initials(name: str) -> str:
    return "".join(p[0] for p in name.split("_") if p)


def suggest_key(key: str, section: str, names: list[str]) -> str | None:
    """The most likely intended full dotted key for an unknown ``key`` in ``section``."""
    norm = key.strip().lower().replace("-", "_")
    if norm in names:
        return join_key(section, norm)
    alias = ALIASES.get(norm)
    if alias in names:
        return join_key(section, alias)
    in_section = "[" not in section  # inside list items (loss.terms[0]) other sections make no sense
    if not section:  # a misspelt section (optimizer.lr) before a leaf of that name elsewhere (rounds.optimizer)
        close = difflib.get_close_matches(norm, names, n=1, cutoff=0.7)
        if close:
            return close[0]
    elsewhere = [p for p in _all_paths() if p.rsplit(".", 1)[-1] in (norm, alias)] if in_section else []
    if elsewhere:
        return elsewhere[0]
    close = difflib.get_close_matches(norm, names, n=1, cutoff=0.6)
    if close:
        return join_key(section, close[0])
    for name in names:
        if name == _initials(norm) or _initials(name) == norm:
            return join_key(section, name)
    if in_section:
        leaves = {p.rsplit(".", 1)[-1]: p for p in _all_paths()}
        close = difflib.get_close_matches(norm, list(leaves), n=1, cutoff=0.8)
        if close:
            return leaves[close[0]]
    return None


def _detail(key: Any, section: str, names: list[str], given: dict, quote: bool) -> str:
    """``'KEY' (did you mean 'X'?)``, ``KEY (LLaMA-Factory) -> loss.beta: 0.1`` or ``'KEY'; valid keys ...``."""
    full = join_key(section, str(key))
    shown = repr(full) if quote else full
    if not section and isinstance(key, str):
        mapped = foreign_line(key, given)
        if mapped:
            return f"{shown} {mapped}"
    guess = suggest_key(str(key), section, names)
    if guess:
        return f"{shown} (did you mean {guess!r}?)"
    where = f"in {section!r}" if section else "at the top level"
    return f"{shown}; valid keys {where}: {', '.join(names)}"


def unknown_key(key: Any, section: str, names: list[str], given: dict | None = None) -> ConfigError:
    """The error for ``key`` given in ``section`` whose keys are ``names``: with a suggestion, else the valid keys."""
    return ConfigError("unknown key " + _detail(key, section, names, given or {key: None}, quote=True))


@dataclass
class UnknownKey:
    key: Any  # as given
    section: str  # dotted path of the section it was given in ("" = the top level)
    names: list[str]  # that section's keys
    value: Any
    where: str  # "in FILE" or "in override 'TEXT'"


def unknown_keys_error(found: list[UnknownKey]) -> ConfigError:
    """One error for every unknown key of a config, one line each (a single one: the one-line form)."""
    given: dict[str, dict] = {}  # section -> every unknown name given there with its value (combined mappings)
    for u in found:
        given.setdefault(u.section, {})[u.key] = u.value
    if len(found) == 1:
        u = found[0]
        return ConfigError("unknown key " + _detail(u.key, u.section, u.names, given[u.section], quote=True)
                           + f" ({u.where})")
    wheres = list(dict.fromkeys(u.where for u in found))
    base = wheres[0] if not wheres[0].startswith("in override") else None  # the file's keys come first, unmarked
    lines = [f"  - {_detail(u.key, u.section, u.names, given[u.section], quote=False)}"
             + ("" if u.where == base else f" ({u.where})") for u in found]
    head = f"{len(found)} unknown keys"
    if base:
        head += f" ({base}" + (", the overrides' marked)" if len(wheres) > 1 else ")")
    if any(" -> " in line for line in lines):
        head += "; TRL's and LLaMA-Factory's names are mapped (docs/coming-from-trl.md has both tables)"
    return ConfigError(head + ":\n" + "\n".join(lines))
