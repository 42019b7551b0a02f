"""TR-DPO: move the reference towards the policy every few optimizer steps (TRL's ``sync_ref_model``)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["sync_reference"]


def _reshard(wrapper: nn.Module | None) -> None:
    """Put every FSDP2-sharded module of ``wrapper`` back to its sharded parameters (a no-grad forward leaves the
    root's gathered copy registered; changing that copy would be lost at the next reshard)."""
    if wrapper is None:
        return
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return
    for sub in wrapper.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


@torch.no_grad()
def sync_reference(policy: nn.Module, reference: nn.Module, alpha: float, *,
                   wrappers: tuple[nn.Module | None, ...] = ()) -> int:
    """TR-DPO's soft update (Gorbatovski et al. 2024, arXiv:2404.09656, Eq. 6), in place on the reference:

        ref <- alpha * policy + (1 - alpha) * ref

    computed as TRL's ``SyncRefModelCallback`` does (``ref.mul_(1 - alpha).add_(policy, alpha=alpha)``, in the
    parameters' dtype). Parameters are matched by name, not by order. Under DDP both are whole copies on every
    rank, so every rank computes the same result; under FSDP2 both models are sharded the same way, so each rank
    updates its own shard (``to_local``) and no communication is needed. ``wrappers`` are the FSDP2 roots to
    reshard first. Returns the number of parameters updated.
    """
    for wrapper in wrappers:
        _reshard(wrapper)
    ref_params = dict(reference.named_parameters())
    pol_params = dict(policy.named_parameters())
    if ref_params.keys() != pol_params.keys():
        only_ref = sorted(ref_params.keys() - pol_params.keys())[:3]
        only_pol = sorted(pol_params.keys() - ref_params.keys())[:3]
        raise ValueError("reference.sync needs the reference and the policy to have the same parameters; "
                         f"only in the reference: {only_ref}, only in the policy: {only_pol}")
    for name, ref in ref_params.items():
        pol = pol_params[name]
        ref_t = ref.to_local() if hasattr(ref, "to_local") else ref
        pol_t = pol.to_local() if hasattr(pol, "to_local") else pol
        if ref_t.shape != pol_t.shape:
            raise ValueError(f"reference.sync: parameter {name} has shape {tuple(ref_t.shape)} in the reference and "
                             f"{tuple(pol_t.shape)} in the policy (they must be sharded the same way)")
        ref_t.mul_(1.0 - alpha).add_(pol_t.to(ref_t.dtype), alpha=alpha)
    for module in reference.modules():  # its vision weights' key (model.vision.frozen_key) is computed again
        module.__dict__.pop("_prefpack_vision_key", None)
    return len(ref_params)
