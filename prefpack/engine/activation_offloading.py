"""The activation-offloading stage (``train.activation_offloading``): the policy's training forward keeps what it saves
for backward in host memory (``prefpack.model.offload_activations``); the reference runs without autograd and saves
nothing, so it is left alone. Runs after checkpointing (they compose) and before budgets (which count it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefpack.model.offload_activations import MIN_BYTES, set_activation_offloading

if TYPE_CHECKING:
    from prefpack.engine.core import Engine

__all__ = ["ActivationOffloadingStage"]


class ActivationOffloadingStage:
    name = "activation_offloading"

    def apply(self, engine: Engine, log) -> None:
        if not engine.cfg.train.activation_offloading:
            return
        set_activation_offloading(engine.policy, engine.device)
        if engine.device.type == "cpu":
            log("note: train.activation_offloading on cpu: the activations already are in host memory, so nothing "
                "moves and no memory is saved (the hooks still run); it pays off on CUDA")
        else:
            log(f"activation offloading: the policy's saved activations (tensors of {MIN_BYTES // 1024} KiB or more) "
                f"wait in pinned host memory between forward and backward")
