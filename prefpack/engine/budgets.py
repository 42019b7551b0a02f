"""Token budgets sized to the device: micro-batch tokens, row length and head chunk for ``auto``.

A 2-core CPU wants micro-batches of a few thousand tokens; a GPU wants tens of thousands, or it waits on many
small kernels (at 4,096-token micro-batches and 1,024-token head chunks all matmuls were ~15% of an H100's time).
On CUDA the budgets come from the device's free memory less what the run will hold whatever the micro-batch (the
weights as held: 4-bit, sharded or offloaded; gradients, optimizer state: ``engine/memory.py``) and an estimate of
the activations one token keeps for backward; explicit values in the config are always kept.

``train.memory`` says what the free memory is for. ``first`` (the default) holds a run's peak under TRL's default
run of the same model: gradient checkpointing on (TRL's default too), 1,024-token head chunks and at most TRL's
default micro-batch (8 pairs x 2 sides x 1,024 tokens); on an H100 (2026-11-24) it peaked at 0.87x TRL's memory at
0.7B and 0.93x at 1.5B, at 12.8x and 6.2x its tokens/s. ``speed`` fills free memory: no checkpointing unless asked,
micro-batches and head chunks as large as the estimate allows (1.33x memory first's speed at 0.7B, at 1.5x its
memory; no faster at 1.5B, where the GPU, not the host, sets the pace).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from prefpack.engine.memory import Holding, device_bytes, estimate_memory, static_bytes

__all__ = ["CPU_BUDGETS", "Budgets", "activation_bytes_per_token", "checkpointing_on", "cuda_budgets",
           "host_free_bytes", "resolve_budgets"]


@dataclass(frozen=True)
class Budgets:
    micro_batch_tokens: int
    row_tokens: int
    chunk_size: int

    def describe(self) -> str:
        return (f"micro-batch {self.micro_batch_tokens:,} tokens, rows {self.row_tokens:,}, "
                f"head chunk {self.chunk_size:,}")


CPU_BUDGETS = Budgets(micro_batch_tokens=4096, row_tokens=2048, chunk_size=1024)
MAX_MICRO_BATCH_TOKENS = 65536
MIN_MICRO_BATCH_TOKENS = 4096
MEMORY_FIRST_MICRO_BATCH_TOKENS = 16384  # TRL's default micro-batch: 8 pairs, 2 sides, max_length 1,024
MEMORY_FIRST_CHUNK = 1024


def checkpointing_on(setting, device: torch.device, memory: str) -> bool:
    """``model.gradient_checkpointing`` resolved: ``auto`` is on on CUDA when memory comes first (as TRL's
    default), off on CPU (whose budgets are small anyway) and for speed."""
    if setting == "auto":
        return device.type == "cuda" and memory == "first"
    return bool(setting)


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def activation_bytes_per_token(config, *, autocast: bool, checkpointing: bool, offloaded: bool = False) -> int:
    """Bytes one token keeps on the device for backward through the decoder (an upper estimate for Llama-like blocks).

    Per layer: the normed inputs, q/k/v, attention output and MLP intermediates in the compute dtype, plus the
    float32 residual stream and rotary-promoted q/k under autocast. Gradient checkpointing keeps only each
    layer's input (and one layer's activations at a time, counted once). Offloaded activations
    (``train.activation_offloading``) wait in host memory: the device holds about a layer's being copied out in
    forward and a layer's brought back (or recomputed) in backward, counted as two layers (not measured on a GPU yet).
    """
    c = _text_config(config)
    hidden = int(getattr(c, "hidden_size", 0) or getattr(c, "n_embd", 0) or 1024)
    inter = int(getattr(c, "intermediate_size", 0) or 4 * hidden)
    layers = int(getattr(c, "num_hidden_layers", 0) or getattr(c, "n_layer", 0) or 1)
    per_layer = (34 * hidden + 10 * inter) if autocast else (20 * hidden + 8 * inter)
    if offloaded:
        return 2 * per_layer
    if checkpointing:
        return layers * (4 if autocast else 2) * hidden + per_layer
    return layers * per_layer


def host_free_bytes() -> int:
    """Host memory not in use (Linux: free physical pages), shared by the ranks of a node."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
    return free // max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)


def cuda_budgets(model: nn.Module, device: torch.device, *, autocast: bool, checkpointing: bool, flattened: bool,
                 memory_first: bool = False, offloaded: bool = False, holding: Holding | None = None,
                 reference: nn.Module | None = None) -> tuple[Budgets, int]:
    """``(budgets, free bytes)`` for a CUDA device.

    What the run holds whatever the micro-batch (``engine/memory.py``: the weights as ``holding`` says they are held,
    4-bit or sharded or offloaded, of the policy and a ``reference`` copy; the trained weights' gradients and AdamW
    state) comes off the free memory, counting back what of it is already on the device. Of what is left, 60% goes
    to activations and 8% to the head's chunk of logits (about 8 bytes per logit at its peak in backward). Rows:
    with a flattened micro-batch (a kernel whose descriptor flattens rows: varlen, flash) a row only limits the
    longest packed line, so 8,192; masked sdpa pays row^2 per row, so 2,048. With ``memory_first`` the micro-batch
    is at most TRL's default one and the head chunk stays at 1,024. With ``offloaded`` activations the device keeps
    about two layers' worth per token, and the host, which holds the rest, gives them at most half of its free
    memory (:func:`host_free_bytes`).
    """
    holding = holding or Holding(compute=torch.bfloat16 if autocast else torch.float32, autocast=autocast)
    free, _ = torch.cuda.mem_get_info(device)
    room_all = max(free + device_bytes([model, reference], device) - sum(static_bytes(model, reference, holding)), 0)
    room = room_all * 0.6
    per_token = activation_bytes_per_token(model.config, autocast=autocast, checkpointing=checkpointing,
                                           offloaded=offloaded)
    micro = int(room // max(per_token, 1)) // 1024 * 1024
    if offloaded:
        on_host = activation_bytes_per_token(model.config, autocast=autocast, checkpointing=checkpointing)
        micro = min(micro, int(host_free_bytes() * 0.5 // max(on_host, 1)) // 1024 * 1024)
    most = MEMORY_FIRST_MICRO_BATCH_TOKENS if memory_first else MAX_MICRO_BATCH_TOKENS
    micro = max(MIN_MICRO_BATCH_TOKENS, min(most, micro))
    vocab = int(model.get_input_embeddings().weight.shape[0])
    chunk = MEMORY_FIRST_CHUNK
    while not memory_first and chunk < 16384 and 2 * chunk * vocab * 8 <= 0.08 * room_all:
        chunk *= 2
    row = min(micro, 8192 if flattened else 2048)
    return Budgets(micro, row, chunk), free


def resolve_budgets(train_cfg, data_cfg, model: nn.Module, device: torch.device, **kwargs) -> tuple[Budgets, str]:
    """The run's budgets (explicit config values kept, ``auto`` filled) and a line saying where they came from."""
    if device.type == "cuda":
        auto, free = cuda_budgets(model, device, **kwargs)
        first = "memory first" if kwargs.get("memory_first") else "speed first"
        offloaded = ", activations offloaded to host memory" if kwargs.get("offloaded") else ""
        source = f"{first}, from {free / 2**30:.1f} GiB free on {device}{offloaded}"
    else:
        auto, source = CPU_BUDGETS, f"{device.type} defaults"

    def pick(value, default: int) -> int:
        return default if value == "auto" else int(value)

    budgets = Budgets(pick(train_cfg.micro_batch_tokens, auto.micro_batch_tokens),
                      pick(data_cfg.max_tokens_per_row, auto.row_tokens),
                      pick(train_cfg.chunk_size, auto.chunk_size))
    return budgets, f"budgets ({source}): {budgets.describe()}"


class BudgetStage:
    """``train.micro_batch_tokens`` / ``data.max_tokens_per_row`` / ``train.chunk_size``: the config's numbers,
    ``auto`` ones sized for this device from the memory the weights as now held leave free."""

    name = "budgets"

    def apply(self, engine, log) -> None:
        from prefpack.model import attention_name, uses_flash_attention

        cfg, policy, device = engine.cfg, engine.policy, engine.device
        on_gpu = device.type != "cpu"  # on a CPU the host is the device: offloading there holds nothing elsewhere
        checkpointing = checkpointing_on(cfg.model.gradient_checkpointing, device, cfg.train.memory)
        offloaded = bool(cfg.train.activation_offloading) and on_gpu
        holding = run_holding(engine)
        reference = engine.reference.model if engine.reference is not None else None
        engine.budgets, line = resolve_budgets(
            cfg.train, cfg.data, policy, device, autocast=engine.precision.autocast, checkpointing=checkpointing,
            memory_first=cfg.train.memory == "first", flattened=uses_flash_attention(policy), offloaded=offloaded,
            holding=holding, reference=reference)
        log(f"{line}; precision: {engine.precision.describe()}; attention: {attention_name(policy) or engine.attn}")
        per_token = activation_bytes_per_token(policy.config, autocast=engine.precision.autocast,
                                               checkpointing=checkpointing, offloaded=offloaded)
        log(estimate_memory(policy, reference, holding, activation_per_token=per_token,
                            micro_batch_tokens=engine.budgets.micro_batch_tokens,
                            chunk_size=engine.budgets.chunk_size).describe(device))


def run_holding(engine) -> Holding:
    """How this run holds its weights on each device (``engine/memory.py``)."""
    cfg, world, precision = engine.cfg, engine.parallel.world, engine.precision
    sharded = cfg.distributed.strategy == "fsdp2" and world > 1
    return Holding(training=engine.training, compute=precision.compute, autocast=precision.autocast, world=world,
                   sharded=sharded,
                   cast_per_layer=precision.sharded_mixed,
                   cpu_offload=sharded and bool(cfg.distributed.cpu_offload) and engine.device.type != "cpu")
