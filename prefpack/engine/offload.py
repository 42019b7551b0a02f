"""CPU offload under FSDP2 (``distributed.cpu_offload``): each rank's shards of the parameters, gradients and AdamW
state live in host memory, so a full fine-tune whose training state does not fit the devices still runs.

FSDP2's ``CPUOffloadPolicy`` copies a layer's shards to the device just before its all-gather, copies the reduced
gradient shards back, and the optimizer steps on the CPU (torchtitan's, NeMo-RL's and verl's way). A frozen
reference copy is offloaded too: it is as large as the policy's weights, and TR-DPO's sync mixes the two shard by
shard, which needs both on one device. One process has no FSDP2 (``distributed.wrap`` leaves it unwrapped), so
offload is refused there before any weights load, naming what fits one GPU instead.

The weights load into host memory (``Engine.load_device``), not onto the device: each rank would otherwise hold a
whole copy on its GPU before sharding, which is what does not fit. ``fully_shard`` then moves one decoder layer at a
time to the device, shards it and sends its shard back to the host (torch 2.13's ``_move_states_to_device`` skips
layers already sharded), so while the run is set up the device holds one layer at a time, then the embeddings and
head. A kernel that cannot run off CUDA (flash_attention_2) loads on the device as before: the load's packing check
runs the model with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from prefpack.distributed import Dist, LaunchError

if TYPE_CHECKING:
    from prefpack.engine.core import Engine

__all__ = ["OffloadStage", "offload_policy"]

ONE_PROCESS = ("distributed.cpu_offload holds FSDP2's shards in CPU memory, which needs several processes: start "
               "`torchrun --nproc-per-node=N -m prefpack train ...` with distributed.strategy=fsdp2; on one GPU use "
               "train.activation_offloading, LoRA (lora.enabled) on a 4-bit base, or reference.mode precomputed")


class OffloadStage:
    """Refuses ``distributed.cpu_offload`` where it cannot apply, before the weights load (the config's rule already
    asks for ``strategy: fsdp2``; the number of processes is known only here)."""

    name = "offload"

    def apply(self, engine: Engine, log) -> None:
        cfg = engine.cfg.distributed
        if not cfg.cpu_offload:
            return
        if not engine.parallel.dist.enabled:
            raise LaunchError(ONE_PROCESS)
        engine.load_device = torch.device("cpu")
        log("distributed.cpu_offload: the weights load into CPU memory, and the shards of the parameters, gradients "
            "and optimizer state (and of a reference copy) stay there; the optimizer steps on the CPU")


def offload_policy(cfg, ctx: Dist):
    """FSDP2's offload policy for this run (None: shards stay on the device). Pinned host memory only with CUDA:
    it lets the copies overlap compute, and a CPU-only torch cannot pin."""
    if not (cfg.distributed.cpu_offload and ctx.enabled):
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
