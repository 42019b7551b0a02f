"""The one loading seam: every path that reads weights from a folder describes what it wants in a :class:`WeightSpec`
and calls :func:`load_weights`, which runs :data:`LOAD_STEPS` in order over it.

    4-bit config -> the model (``load.load_causal_lm``: model class, kernel fallback, recurrent boundaries, leak
    checks) -> compiled decoder layers -> a LoRA adapter

Who calls it, each with its own defaults (decided before the call, never here):

| purpose | caller | its choices |
|---|---|---|
| ``train``, ``reference`` | ``Engine.load_like_policy`` (engine/core.py) | the engine's stages: precision, kernel, compile, 4-bit, load device |
| ``reference`` | precompute-ref (training/precompute.py) | training's precision for ``--dtype``, ``auto`` attention |
| ``sample`` | ``TransformersEngine.load`` (generation/hf_engine.py) | sdpa, unpacked, bfloat16 on CUDA / float32 on CPU, ``--adapter`` |
| ``score`` | ``RewardModelScorer`` (rewards/reward_model.py) | ``--dtype`` (float32), ``auto`` attention, a one-label classifier |

A new way of holding weights (another quantisation, say) is a field here and a step in :data:`LOAD_STEPS` (and, for
training, the engine stage that sets it). The 4-bit config (:func:`four_bit_config`) and a saved adapter's load
(:func:`load_adapter`, also the LoRA stage's ``lora.adapter``) are built here only.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from prefpack.model.load import ModelError, compile_loaded, load_causal_lm
from prefpack.precision import Precision

__all__ = ["LOAD_STEPS", "PURPOSES", "FourBit", "WeightSpec", "four_bit_config", "load_adapter", "load_weights"]

Purpose = Literal["train", "reference", "score", "sample"]
PURPOSES: tuple[str, ...] = ("train", "reference", "score", "sample")


@dataclass(frozen=True)
class FourBit:
    """bitsandbytes' 4-bit linear weights: ``kind`` nf4 | fp4, ``double`` quantising the blocks' scales too."""

    kind: str
    double: bool = True


@dataclass(frozen=True)
class WeightSpec:
    """What one load reads and how the weights are held.

    ``precision`` (weights and compute dtype) or ``dtype`` (both); ``attn``: the attention kernel's name (the caller
    chose it); ``packed``: the model is refused if packed sequences would see each other; ``compile_layers``: True, or
    ``"auto"`` (eager where compiling fails); ``four_bit``: the linear weights in 4 bits, computed in the compute
    dtype; ``adapter``: a saved LoRA adapter folder run over the base unmerged (``adapter_trainable``: its weights
    train), its errors naming ``adapter_key`` and raised as ``adapter_error``; ``reward``: a one-label sequence
    classifier (a reward model) instead of a causal LM."""

    path: str
    purpose: Purpose
    device: torch.device
    precision: Precision | None = None
    dtype: torch.dtype | None = None
    attn: str = "sdpa"
    trust_remote_code: bool = False
    packed: bool = True
    compile_layers: bool | str = False
    four_bit: FourBit | None = None
    adapter: str | None = None
    adapter_trainable: bool = False
    adapter_key: str = "lora.adapter"
    adapter_error: type[Exception] = ModelError
    reward: bool = False

    def __post_init__(self):
        if self.purpose not in PURPOSES:
            raise ValueError(f"WeightSpec.purpose {self.purpose!r}: one of {', '.join(PURPOSES)}")

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the matmuls run in (what a 4-bit layer de-quantises to)."""
        if self.precision is not None:
            return self.precision.compute
        return self.dtype or torch.float32


@dataclass
class Loading:
    """What the steps hand each other: the spec, the 4-bit config built for it, the model once loaded."""

    spec: WeightSpec
    quantization: Any = None
    model: nn.Module | None = None


def _four_bit_step(state: Loading) -> None:
    q = state.spec.four_bit
    if q is not None:
        state.quantization = four_bit_config(q.kind, double=q.double, compute=state.spec.compute_dtype)


def _model_step(state: Loading) -> None:
    s = state.spec
    if not s.reward:
        refuse_classifier(s.path)
    state.model = load_causal_lm(s.path, attn_implementation=s.attn, device=s.device, precision=s.precision,
                                 dtype=s.dtype, trust_remote_code=s.trust_remote_code, packed=s.packed,
                                 quantization_config=state.quantization, reward=s.reward)


def _compile_step(state: Loading) -> None:
    if state.spec.compile_layers:
        compile_loaded(state.model, state.spec.compile_layers, state.spec.path)


def _adapter_step(state: Loading) -> None:
    s = state.spec
    if s.adapter:
        state.model = load_adapter(state.model, s.adapter, trainable=s.adapter_trainable, key=s.adapter_key,
                                   error=s.adapter_error)


LOAD_STEPS: tuple[tuple[str, Callable[[Loading], None]], ...] = (
    ("four_bit", _four_bit_step),
    ("model", _model_step),
    ("compile", _compile_step),
    ("adapter", _adapter_step),
)


def load_weights(spec: WeightSpec) -> nn.Module:
    """The model ``spec`` describes, loaded through :data:`LOAD_STEPS` in order."""
    state = Loading(spec)
    for _, step in LOAD_STEPS:
        step(state)
    return state.model


def four_bit_config(kind: str, *, double: bool, compute: torch.dtype):
    """transformers' ``BitsAndBytesConfig`` for 4-bit ``kind`` (nf4 | fp4) weights computed in ``compute``."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=double,
                              bnb_4bit_compute_dtype=compute)


def refuse_classifier(path: str) -> None:
    """A local folder whose config names a sequence classifier (a reward model) refused as a causal LM in one line:
    transformers would load it with a random language-model head and only its load report would say so."""
    import json

    config = Path(path) / "config.json"
    try:
        architectures = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return  # not a local folder, or a config the load itself reports
    classifiers = [a for a in architectures if isinstance(a, str) and a.endswith("ForSequenceClassification")]
    if classifiers:
        raise ModelError(f"model {path!r} is a sequence classifier ({classifiers[0]}: a reward model, its head a "
                         "score), not a causal language model to train or sample; give it as a reward model "
                         "(--reward-model, rounds.reward_model) or train it with train.objective=reward")


def check_adapter_folder(folder: str, *, key: str, error: type[Exception]) -> None:
    """A saved adapter read only as prefpack reads weights: ``adapter_config.json`` a JSON object of a LoRA adapter,
    the weights in ``adapter_model.safetensors`` with a readable header (never ``adapter_model.bin``, a pickle that
    can run code)."""
    import json

    where = f"{key} {folder!r}" if key.startswith("--") else f"{key}: {folder!r}"
    try:
        config = json.loads((Path(folder) / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise error(f"{where}: adapter_config.json is not readable JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        raise error(f"{where}: adapter_config.json describes a {kind!r} adapter; prefpack reads LoRA adapters")
    weights = Path(folder) / "adapter_model.safetensors"
    if not weights.is_file():
        pickled = (Path(folder) / "adapter_model.bin").is_file()
        raise error(f"{where}: no adapter_model.safetensors" + (" (only adapter_model.bin, a pickle, which can run "
                                                                "code when read: save the adapter as safetensors)"
                                                                if pickled else ""))
    try:
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as fh:
            list(fh.keys())
    except Exception as exc:  # a damaged or truncated file
        raise error(f"{where}: adapter_model.safetensors is damaged ({type(exc).__name__}: {exc})") from None


def load_adapter(model: nn.Module, folder: str, *, trainable: bool = False, key: str = "lora.adapter",
                 error: type[Exception] = ModelError) -> nn.Module:
    """``model`` under the saved LoRA adapter of ``folder``, unmerged (peft's ``PeftModel``); ``trainable``: its
    weights train (``lora.adapter``: rounds continue the last round's adapter over the same base). Only a local
    folder with ``adapter_config.json`` is read (peft would try the hub for another name); ``key`` is the setting
    the user named it with (a config key, or a flag such as ``--adapter``), ``error`` the caller's user error."""
    if not (Path(folder) / "adapter_config.json").is_file():
        if key.startswith("--"):
            raise error(f"{key} {folder!r}: no adapter_config.json there (a peft adapter folder, e.g. a LoRA run's "
                        "final/adapter)")
        raise error(f"{key}: {folder!r} holds no adapter_config.json (a peft adapter folder, e.g. a LoRA run's "
                    "final/adapter)")
    try:
        from peft import PeftModel
    except ImportError as exc:
        raise error(f"{key} needs peft: pip install 'prefpack[lora]'") from exc
    check_adapter_folder(folder, key=key, error=error)
    with warnings.catch_warnings():  # peft reads transformers' deprecated name: not the user's to fix
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*is deprecated", category=FutureWarning)
        try:
            return PeftModel.from_pretrained(model, folder, is_trainable=trainable)  # safetensors: checked there
        except (RuntimeError, ValueError, KeyError) as exc:  # shapes or target modules of another base
            where = f"{key} {folder!r}" if key.startswith("--") else f"{key}: {folder!r}"
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise error(f"{where}: the adapter does not fit this base model ({first})") from None
