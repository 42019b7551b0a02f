"""The attention kernels prefpack knows, one :class:`Kernel` row each: everything the rest of the package asks of
a kernel. Code outside this folder reads the descriptor of the model's kernel (:func:`kernel_of`) or of a
configured name (:func:`kernel_named`) and never tests a name (tests/test_kernels.py greps for that).

Torch-free at import: the config's choices (``names.py``) and its device rule read this table, and loading the
config must not load torch. The rules that need torch import it when they run.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["KERNELS", "Kernel", "attention_name", "auto_candidates", "kernel_named", "kernel_of", "pick_attention",
           "reads_prompt_groups", "uses_flash_attention"]


@dataclass(frozen=True)
class Kernel:
    """What one ``attn_implementation`` needs and does.

    Availability (what ``auto`` may pick, :func:`pick_attention`): ``auto``, on ``devices`` (device types; empty:
    any), for half-precision compute only when ``half_only``, when ``installed()`` says its software is there.
    ``needs_cuda``: it cannot run off CUDA at all, so the config refuses it with ``train.device=cpu`` (``devices``
    only limits what ``auto`` picks: varlen runs on CPU through its reference loop).
    """

    name: str
    register: Callable[[], None] | None = None  # makes the name valid in transformers; None: one of its own
    auto: bool = False
    devices: tuple[str, ...] = ()
    half_only: bool = False
    installed: Callable[[], bool] | None = None
    needs_cuda: bool = False
    flattens_rows: bool = False  # reads sequence boundaries from position ids on ONE row only: flatten the batch
    reads_prompt_groups: bool = False  # prompt-shared rows (``Batch.score_positions``) run on it
    boundary_kwargs: bool = False  # the forward hands it host-computed cu_seqlens keywords (no device sync per layer)
    prefix_sharing_auto: bool = False  # ``data.prefix_sharing=auto`` turns sharing on (a speed-up measured on it)
    fallback: str | None = None  # loaded instead when the model has no sdpa support
    cudnn_sdp_off: bool = False  # on CUDA, switch cuDNN's sdpa off at load (it plans anew for every packed shape)
    shards_sequences: bool = False  # runs on token shards (distributed.sequence_parallel: its module is ``shardable``)
    refuses: tuple[tuple[str, str], ...] = ()  # (model config attribute, why) it cannot run when the value is set
    class_flag: str | None = None  # the model class attribute transformers reads before loading it (False: refused)
    # a vision tower may run it (transformers' own kernels); a tower's attention is bidirectional over one image's
    # patches and never packed, so under any other kernel (prefpack's packed ones, hub kernels) it runs sdpa
    runs_vision_tower: bool = False
    # model features it computes exactly (``features.unsupported`` refuses a model with one it leaves out):
    sinks: bool = False  # attention sinks, one more softmax term per head (gpt-oss)
    chunks: bool = False  # chunked local attention per packed sequence (Llama-4's ``chunked_attention`` layers;
    # transformers' masks count chunks from the row's start: right when padded, wrong for a row's later sequences)

    def available(self, device_type: str, compute_dtype: Any = None) -> bool:
        """Whether ``auto`` may pick this kernel for a device type and compute dtype (None: float32)."""
        if not self.auto or (self.devices and device_type not in self.devices):
            return False
        if self.half_only and not _is_half(compute_dtype):
            return False
        return self.installed is None or self.installed()

    def runs_prompt_groups(self, flattened: bool) -> bool:
        """Whether prompt-shared rows may run on it in this layout: a flattening kernel reads the groups in either
        layout; a row-wise reader (packed_sdpa) only in the rows training gives it, the layout its checks cover."""
        return self.reads_prompt_groups and (self.flattens_rows or not flattened)

    @property
    def where(self) -> str:
        """The devices ``auto`` picks it on, for messages."""
        return "/".join(d.upper() for d in self.devices) or "any device"


def _is_half(dtype: Any) -> bool:
    if dtype is None:
        return False
    import torch

    return dtype in (torch.float16, torch.bfloat16)


def _ours(module: str) -> Callable[[], None]:
    """The ``register()`` of a kernel module in this folder, imported when called (it imports torch)."""
    def register() -> None:
        importlib.import_module(f"prefpack.model.attention.{module}").register()

    return register


def _flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _torch_varlen_installed() -> bool:
    from prefpack.model.attention import varlen

    return bool(varlen.torch_varlen_kernel())


_SOFTCAP = ("attn_logit_softcapping", "softcaps its attention logits, which the varlen kernel cannot do; "
                                      "set model.attn_implementation=eager")

# In order of preference for ``auto`` (the config lists its choices in this order too).
KERNELS: tuple[Kernel, ...] = (
    Kernel("packed_sdpa", register=_ours("packed_sdpa"), auto=True, devices=("cpu",), reads_prompt_groups=True,
           prefix_sharing_auto=True, fallback="eager", shards_sequences=True, sinks=True, chunks=True),
    Kernel("flash_attention_2", auto=True, devices=("cuda",), installed=_flash_attn_installed, needs_cuda=True,
           flattens_rows=True, runs_vision_tower=True, class_flag="_supports_flash_attn"),
    # prompts laid out once on varlen: 1.14x tokens/s and 12% less peak at 0.7B on an H100 (2026-11-24)
    Kernel("varlen", register=_ours("varlen"), auto=True, devices=("cuda",), half_only=True,
           installed=_torch_varlen_installed, flattens_rows=True, reads_prompt_groups=True, boundary_kwargs=True,
           prefix_sharing_auto=True, shards_sequences=True, refuses=(_SOFTCAP,), sinks=True, chunks=True),
    Kernel("sdpa", auto=True, fallback="eager", cudnn_sdp_off=True, runs_vision_tower=True),
    Kernel("eager", runs_vision_tower=True, sinks=True),  # a family's own eager attention computes its sinks
)

# transformers' own kernels the config does not offer, which a vision tower may run all the same
_OTHER_TOWER_KERNELS = ("flash_attention_3",)

_BY_NAME = {k.name: k for k in KERNELS}


def kernel_named(name: str) -> Kernel:
    """The row for ``name``; any other transformers kernel (flash_attention_3, flex_attention, a hub kernel) gets
    a default row: it flattens rows when its name says flash (transformers' flash integration reads packed
    boundaries only on one row), reads no prompt groups, and runs a vision tower if transformers' own."""
    known = _BY_NAME.get(name)
    return known if known is not None else Kernel(name, flattens_rows="flash" in name.lower(),
                                                  runs_vision_tower=name in _OTHER_TOWER_KERNELS)


def attention_name(model: Any) -> str:
    """The model's ``attn_implementation`` ("" when it has none), through a distributed wrapper too."""
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    return str(getattr(config, "_attn_implementation", "") or "")


def kernel_of(model: Any) -> Kernel:
    return kernel_named(attention_name(model))


def uses_flash_attention(model: Any) -> bool:
    """True when the model's attention reads packing boundaries only for a single row (flash kernels, varlen)."""
    return kernel_of(model).flattens_rows


def reads_prompt_groups(model: Any) -> bool:
    """True when the model's attention reads prompt groups from position ids (prompt-shared rows run on it)."""
    return kernel_of(model).reads_prompt_groups


def pick_attention(name: str, device: Any, compute_dtype: Any = None) -> str:
    """The attention kernel for ``auto``: the first row of the table available on this device type and compute
    dtype (CPU: packed_sdpa; CUDA: the flash-attn package when installed, else torch's varlen for half-precision
    compute, else sdpa, whose cuDNN path is switched off at load). Explicit choices are kept."""
    if name != "auto":
        return name
    return auto_candidates(device, compute_dtype)[0].name


def auto_candidates(device: Any, compute_dtype: Any = None) -> list[Kernel]:
    """The kernels ``auto`` may pick on this device type and compute dtype, in order of preference (a model's
    features may rule out the first: ``prefpack.model.attention.auto``)."""
    found = [k for k in KERNELS if k.available(device.type, compute_dtype)]
    if not found:
        raise ValueError(f"no attention kernel is available on {device.type}")
    return found
