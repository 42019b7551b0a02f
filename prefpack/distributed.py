"""Several processes under `torchrun`: process group, DDP/FSDP2 wrapping, dealing micro-batches to ranks.

Every rank plans the same optimizer step from the same seed (planning reads lengths only, so it is cheap),
then takes its share of the micro-batches:
- `balance: tokens` deals the step's pairs largest first to the rank with the fewest tokens so far, then
  each rank packs its own (no rank waits for a longer one);
- `balance: count` splits the step's pairs evenly by count and lets each rank pack its own (the usual
  DistributedSampler way; kept to measure the difference).
Both use every pair of the step exactly once. Ranks that end up with fewer micro-batches run *padding*
micro-batches with weight 0, because FSDP2 needs every rank to run the same number of forward and backward
passes (each gathers parameters collectively); with DDP only the last micro-batch synchronises gradients.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from prefpack.errors import PrefpackError


class LaunchError(PrefpackError, ValueError):
    """torchrun asked for something this machine cannot give (more GPU processes than GPUs)."""


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over ranks (in place; a no-op with one process). CPU tensors go through gloo."""
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


SINGLE = Dist()


def init_from_env(device_name: str = "auto") -> Dist:
    """Join the process group torchrun describes in the environment; one process needs no launcher."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise LaunchError(f"process {rank} (local rank {local_rank}) has no GPU of its own: this machine shows "
                               f"{torch.cuda.device_count()} CUDA device(s); start torchrun with --nproc-per-node at "
                               "most that, or set train.device=cpu to run every process on the CPU")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world > 1:
        if not dist.is_initialized():
            # Imported before the group exists on purpose: its functions take `group=group.WORLD` as a default
            # argument, so a later import (transformers does one while loading a model) holds the group forever,
            # `destroy_process_group` cannot free it, and its gloo threads race interpreter exit (see shutdown).
            importlib.import_module("torch.distributed.nn.functional")

            dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        if not use_cuda:
            # ranks on one machine share its cores; without this each would start one thread per core
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return Dist(rank=rank, world=world, local_rank=local_rank, device=device)


def shutdown() -> None:
    """Leave the process group, freeing it and joining its worker threads while Python is fully alive.

    A gloo worker thread that releases a finished collective's tensors after the interpreter has begun to exit
    aborts the process ("terminate called without an active exception"; pytorch issue 190489): the release needs
    the GIL, which the main thread holds until it blocks. That happened in about 1 of 6 two-rank `eval` runs while
    the group outlived `destroy_process_group` (see init_from_env). After FSDP2, torch's DTensor planning caches
    still hold the mesh and so the group (torch 2.13); the short sleep gives its idle workers the GIL to finish.
    On success callers `barrier()` first so no rank leaves while another is still in a collective; error paths
    skip it (the other ranks may never reach it)."""
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------------ wrapping


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 shards one by one (transformers names their classes in _no_split_modules)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard with FSDP2 "
                         "(it lists no _no_split_modules); use distributed.strategy=ddp")
    return layers


def wrap(module: nn.Module, base: nn.Module, strategy: str, ctx: Dist, *, trainable: bool,
         compute_dtype: torch.dtype | None = None, offload_policy: Any = None) -> nn.Module:
    """Wrap a SequenceLogps module for the strategy; `base` is the causal LM inside it. With FSDP2 a
    ``compute_dtype`` casts the float32 shards to it per layer (gradients reduced in float32), and an
    ``offload_policy`` (FSDP2's ``CPUOffloadPolicy``, chosen by the engine) keeps the shards in host memory."""
    if offload_policy is not None and strategy != "fsdp2":
        raise ValueError(f"an offload policy shards with FSDP2; distributed.strategy is {strategy!r}")
    if not ctx.enabled:
        return module
    if strategy == "ddp":
        if not trainable:
            return module  # a frozen replica needs no wrapper: nothing to synchronise
        device_ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(module, device_ids=device_ids)
    if strategy == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kwargs: dict[str, Any] = {}
        if compute_dtype is not None and compute_dtype != torch.float32:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if offload_policy is not None:
            kwargs["offload_policy"] = offload_policy
        for layer in decoder_layers(base):
            fully_shard(layer, **kwargs)
        fully_shard(module, **kwargs)
        return module
    raise ValueError(f"unknown distributed.strategy {strategy!r}; choose ddp or fsdp2")


@contextlib.contextmanager
def grad_sync(module: nn.Module, enabled: bool):
    """Synchronise gradients only on the last micro-batch of a step."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        ctx = contextlib.nullcontext() if enabled else module.no_sync()
        with ctx:
            yield
        return
    if hasattr(module, "set_requires_gradient_sync"):  # an FSDP2 module
        module.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
        return
    yield


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, *, to_host: bool = True) -> float | torch.Tensor:
    """Global gradient norm (before clipping), correct for sharded DTensor gradients too.

    FSDP2's gradients are DTensor shards whose norm is a partial sum over ranks. It is summed on the device type
    of their mesh: with CPU offload the shards live on the CPU while an NCCL group cannot reduce a CPU tensor."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if hasattr(norm, "full_tensor"):
        from torch.distributed.tensor import DTensor

        mesh = norm.device_mesh
        norm = DTensor.from_local(norm.to_local().to(mesh.device_type), mesh, norm.placements,
                                  run_check=False).full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm) if to_host else norm  # to_host=False: the caller reads it with other values, in one transfer
