"""The 4-bit stage (``model.quantization``, QLoRA): the base weights held in bitsandbytes' NF4 or FP4, with LoRA
adapters trained over them in float32.

It runs before the load stage because transformers quantises while it reads the checkpoint: it sets
``engine.quantization`` (a ``FourBit``: kind and double quantisation) that ``Engine.load_like_policy`` passes to
every load (the policy; a copied reference of another model); the loading seam (``prefpack.model.weights``) builds
the ``BitsAndBytesConfig`` from it, in the compute dtype. The config's
rules (``config/rules.py``) refuse what cannot work: no LoRA, a 4-bit copy of the same base as reference (the
adapter-off policy is that reference, for free), FSDP2.

What it does not change: the matmuls run in the run's compute dtype (``precision.compute``: float32 on CPU,
bfloat16 on CUDA), the adapters stay float32 (peft), the non-linear weights (embeddings, norms, the head) keep the
load dtype. peft's ``prepare_model_for_kbit_training`` is not called: it casts norms and head to float32 and
turns on reentrant checkpointing, which would make the 4-bit run compute differently from the reference it is
compared with; the checkpointing stage already does non-reentrant checkpointing, which needs no input gradients.

The final folder is the adapters merged into the de-quantised base (never rounded back to 4 bits):
``training/checkpoint/final.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefpack.model import FourBit, ModelError

if TYPE_CHECKING:
    from prefpack.engine.core import Engine

__all__ = ["QuantizeStage", "check_four_bit"]


class QuantizeStage:
    """``model.quantization`` / ``model.quantization_double``."""

    name = "quantize"

    def apply(self, engine: Engine, log) -> None:
        m = engine.cfg.model
        if m.quantization is None:
            return
        check_four_bit(engine, f"model.quantization={m.quantization}")
        kind, double = m.quantization, m.quantization_double
        engine.quantization = FourBit(kind, double=double)
        log(f"4-bit base weights ({kind}{', double quantisation' if double else ''}; model.quantization): LoRA "
            "adapters train over them, the final model is merged into the de-quantised base")


def check_four_bit(engine: Engine, key: str) -> None:
    """Refuse ``key`` (a 4-bit setting) in one line where bitsandbytes is missing or cannot run on the device."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise ModelError(f"{key} needs bitsandbytes: pip install 'prefpack[qlora]'") from exc
    if engine.device.type not in ("cpu", "cuda"):
        raise ModelError(f"{key}: bitsandbytes' 4-bit weights run on cpu or cuda, not {engine.device.type}; set "
                         "train.device=cpu or cuda")

