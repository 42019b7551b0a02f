"""Custom code a model, tokenizer or processor folder names: refused, before transformers reads the folder, unless
the user turned on the one switch (``model.trust_remote_code`` / ``--trust-remote-code``).

A folder's config may map an Auto class to a Python module shipped beside it (``auto_map``). transformers imports
that module when ``trust_remote_code`` is true; left unset it asks on stdin (a batch job with no answer then ends in
a traceback). prefpack passes the switch explicitly to every loader, and with it off names the folder, the file and
the key here, in one line. A model or tokenizer whose config also names a class transformers has built in
(``model_type``, ``tokenizer_class``) loads with that class and never imports the folder's code, so it is let
through (as transformers itself does with the switch off). Torch-free; transformers is imported only for that test.
"""

from __future__ import annotations

import json
import os

from prefpack.errors import PrefpackError

__all__ = ["SWITCH", "RemoteCodeError", "check_model_code", "check_processor_code", "check_tokenizer_code"]

# the flag's help, on every command that loads folders: without it a folder naming code is refused
REMOTE_CODE_HELP = ("run Python code that the model, tokenizer or processor folder names in its config (auto_map); "
                    "off, such a folder is refused")
SWITCH = ("pass --trust-remote-code (prepare, inspect, eval, precompute-ref) or set model.trust_remote_code=true (train) if "
          "you trust it")

# where transformers reads an image processor's or processor's class (config.json: its AutoImageProcessor and
# AutoProcessor entries only; its other entries are the model's)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
PROCESSOR_KEYS = ("AutoImageProcessor", "AutoProcessor", "AutoFeatureExtractor")


class RemoteCodeError(PrefpackError, ValueError):
    """A folder names custom code to run and the user did not allow it."""


def check_processor_code(folder, *, allowed: bool, what: str = "processor folder") -> None:
    """Refuse a processor folder (``prepare --processor``, a store's ``processor/``) naming code in its processor
    configs, or in config.json for its processor classes. prefpack expands images only for processors transformers
    has built in, so such code is never needed without the switch."""
    if allowed or not os.path.isdir(folder):
        return
    for name in PROCESSOR_FILES:
        _refuse_code(folder, name, _config(folder, name), None, what)
    _refuse_code(folder, "config.json", _config(folder, "config.json"), PROCESSOR_KEYS, what)


def check_model_code(folder, *, allowed: bool, what: str = "model") -> None:
    """Refuse a model folder whose config.json names code and a ``model_type`` transformers does not have."""
    if allowed or not os.path.isdir(folder):
        return
    config = _config(folder, "config.json")
    if not _known_model_type(config):
        _refuse_code(folder, "config.json", config, None, what)


def check_tokenizer_code(folder, *, allowed: bool, what: str = "tokenizer") -> None:
    """Refuse a tokenizer folder whose tokenizer_config.json (or config.json) names tokenizer code, unless it also
    names a tokenizer class or model type transformers has built in."""
    if allowed or not os.path.isdir(folder):
        return
    tok_config, config = _config(folder, "tokenizer_config.json"), _config(folder, "config.json")
    if _known_tokenizer(tok_config.get("tokenizer_class")) or _known_model_type(config):
        return
    _refuse_code(folder, "tokenizer_config.json", tok_config, None, what)
    _refuse_code(folder, "config.json", config, ("AutoTokenizer",), what)


def _refuse_code(folder, name: str, config: dict, keys: tuple[str, ...] | None, what: str) -> None:
    auto_map = config.get("auto_map")
    if not auto_map:
        return
    if keys is not None:
        if not isinstance(auto_map, dict) or not any(k in auto_map for k in keys):
            return
        auto_map = {k: auto_map[k] for k in keys if k in auto_map}
    raise RemoteCodeError(f"{what} {str(folder)!r}: {name} names custom code to run (key 'auto_map': "
                          f"{json.dumps(auto_map)}); prefpack runs no code from a folder unless told to: {SWITCH}")


def _config(folder, name: str) -> dict:
    """The JSON object of ``folder/name``; {} when absent or unreadable (the loader then says what is wrong)."""
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as fh:
            value = json.load(fh)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _known_model_type(config: dict) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = config.get("model_type")
    return isinstance(model_type, str) and model_type in CONFIG_MAPPING_NAMES


def _known_tokenizer(name) -> bool:
    if not isinstance(name, str) or not name:
        return False
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    return any(tokenizer_class_from_name(n) is not None for n in (name, name.removesuffix("Fast"), name + "Fast"))
