"""The weights of a run and how they are held: an :class:`Engine` filled by ordered stages.

``build_engine`` runs :data:`STAGES` in order; each stage reads its own config section and refuses what it cannot
do, so a new way of holding weights (4-bit base weights, CPU offload) is one stage file and one row here:

    CPU offload's rules -> 4-bit -> load -> reference weights -> LoRA -> activation checkpointing ->
    activation offloading -> budgets      (then, once the objectives are known: wrap for the ranks (ddp | fsdp2
    [+ CPU offload]) -> optimizer, ``engine/wrap.py``; the final dtype, ``engine/export.py``)

The reference's weights are set up before LoRA wraps the policy: a sidecar's tag is the hash of the unwrapped
policy's weights, and a copied reference is loaded exactly like the policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from prefpack.objectives.names import train_objective
from prefpack.parallel import Parallel
from prefpack.precision import Precision
from prefpack.reference import Reference

if TYPE_CHECKING:
    from prefpack.model.weights import FourBit

__all__ = ["Engine", "Stage", "build_engine"]


@dataclass
class Engine:
    """What the stages built: the policy (maybe LoRA-wrapped), its reference, device, precision, attention kernel,
    whether layers are compiled, and the token budgets. ``module`` is the policy's forward wrapped for the ranks
    (set by :func:`prefpack.engine.wrap.wrap_forward`)."""

    cfg: Any  # the run's config (each stage reads its own section)
    parallel: Parallel
    device: torch.device
    unpaired: bool = False  # the run trains the KTO family (the objective registry decided)
    check_sidecar_reference: bool = True  # False: a precomputed reference is taken whatever weights computed it
    training: bool = True  # False (eval): scored only, so no gradients nor optimizer state are held
    precision: Precision | None = None
    attn: str = ""
    compile_layers: bool | str = False
    quantization: FourBit | None = None  # the 4-bit base weights every load holds (engine/quantize.py)
    load_device: torch.device | None = None  # where the weights load when not on ``device`` (CPU offload: the host)
    policy: nn.Module | None = None
    reference: Reference | None = None
    budgets: Any = None  # prefpack.engine.budgets.Budgets
    module: nn.Module | None = None

    def load_like_policy(self, path: str, *, device: torch.device | None = None, packed: bool | None = None,
                         purpose: str = "train"):
        """A model loaded as the policy is (precision, kernel, compiled layers, 4-bit), through the one loading seam
        (``prefpack.model.weights``): the policy itself, and the reference (``purpose="reference"``; on another
        ``device``, e.g. only to be hashed: uncompiled); on ``load_device`` where a stage set one."""
        from prefpack.model import WeightSpec, kernel_named, load_weights

        cfg = self.cfg
        host = self.load_device if self.load_device is not None and not kernel_named(self.attn).needs_cuda else None
        packed = cfg.data.packing if packed is None else packed
        return load_weights(WeightSpec(path, purpose, device or host or self.device, precision=self.precision,
                                       attn=self.attn, trust_remote_code=cfg.model.trust_remote_code, packed=packed,
                                       compile_layers=self.compile_layers if device is None else False,
                                       four_bit=self.quantization,
                                       reward=train_objective(cfg).sequence_classifier))


class Stage(Protocol):
    """One step of holding the weights: reads ``engine.cfg``'s section it owns, changes the engine."""

    name: str

    def apply(self, engine: Engine, log) -> None: ...


def build_engine(cfg, parallel: Parallel, device: torch.device, *, unpaired: bool, log=print,
                 check_sidecar_reference: bool = True, training: bool = True) -> Engine:
    """The run's weights, as the stages hold them (see the module doc)."""
    from prefpack.engine.stages import STAGES

    engine = Engine(cfg, parallel, device, unpaired=unpaired, check_sidecar_reference=check_sidecar_reference,
                    training=training)
    for stage in STAGES:
        stage.apply(engine, log)
    return engine
