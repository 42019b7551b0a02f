"""Sequence parallelism (Ulysses): the ranks of a group hold one micro-batch row split into contiguous token shards.

``distributed.sequence_parallel: N`` makes the world ``world / N`` data-parallel groups of N consecutive ranks (a
("data", "sequence") device mesh; ranks ``g * N .. g * N + N - 1`` form group g). The N ranks of a group plan and
collate the same micro-batches; each runs the token-wise layers (embeddings, norms, MLP, the completion-only head) on
its shard only. Attention needs whole sequences: :func:`all_to_all` turns ``[tokens / N, all heads]`` into
``[all tokens, heads / N]`` before the kernel and back after it (``prefpack.model.attention.sequence_parallel``).

Per-sequence sums are partial on each rank; :func:`group_sum` adds them over the group so every rank sees the same
losses. Its backward passes the gradient through unchanged (an all-reduce in backward, as
``torch.distributed.nn.functional.all_reduce`` does, would multiply by N): each rank's parameter gradients are then
its shard's share, and the data-parallel all-reduce (DDP, FSDP2 over the whole world, averaging) sums the shares of a
group, as the loop's ``world / units`` loss scale expects.

This module holds only the collectives and the layout; a run's layout travels inside its
:class:`prefpack.parallel.Parallel`, passed explicitly to dealing, evaluation, precompute-ref and the forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from prefpack.errors import PrefpackError

__all__ = ["SINGLE_SP", "SeqPar", "SequenceParallelError", "all_to_all", "check_heads", "group_sum", "kv_repeats",
           "layout_line", "make_layout"]


class SequenceParallelError(PrefpackError, ValueError):
    """``distributed.sequence_parallel`` cannot run with this world, model or kernel."""


@dataclass(frozen=True)
class SeqPar:
    """One rank's place in the layout: ``size`` ranks per sequence group, this rank's ``rank`` in its group, the group
    (None for one rank), and the data-parallel world the groups form."""

    size: int = 1
    rank: int = 0
    group: Any = None
    data_world: int = 1
    data_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.size > 1


SINGLE_SP = SeqPar()


def make_layout(size: int, world: int, rank: int, device_type: str = "cpu") -> SeqPar:
    """The layout of ``world`` ranks in groups of ``size`` (refused with the numbers when ``size`` does not divide
    the world); the groups come from a ("data", "sequence") device mesh. One rank per group needs no collective."""
    if size < 1:
        raise SequenceParallelError(f"distributed.sequence_parallel must be at least 1, got {size}")
    if world % size:
        raise SequenceParallelError(f"distributed.sequence_parallel={size} does not divide the {world} processes: "
                                    f"start a multiple of {size} processes, or choose a divisor of {world}")
    if size == 1:
        return SeqPar(1, 0, None, world, rank)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world // size, size), mesh_dim_names=("data", "sequence"))
    return SeqPar(size, rank % size, mesh.get_group("sequence"), world // size, rank // size)


def layout_line(sp: SeqPar, world: int) -> str:
    """What a run prints at start."""
    groups = [f"{g * sp.size}-{g * sp.size + sp.size - 1}" if sp.size > 1 else str(g) for g in range(sp.data_world)]
    return (f"sequence parallel: {world} processes = {sp.data_world} data-parallel group(s) of {sp.size} "
            f"(ranks {', '.join(groups)}); each row split into {sp.size} token shards, attention by all-to-all "
            "over heads")


def kv_repeats(kv_heads: int, size: int) -> int:
    """How often each key/value head is repeated so that the group's ranks split them evenly: 1 when ``size``
    divides them, else ``size / gcd`` (a query head's key/value head stays the same)."""
    return size // math.gcd(kv_heads, size)


def check_heads(heads: int, kv_heads: int, size: int) -> None:
    """Refuse a head count the group cannot split (with the numbers)."""
    if heads % size:
        raise SequenceParallelError(f"distributed.sequence_parallel={size} must divide the model's {heads} attention "
                                    f"heads (each rank attends with heads / {size} of them); choose a divisor of "
                                    f"{heads}")
    if heads % kv_heads or (heads // kv_heads) % kv_repeats(kv_heads, size):
        raise SequenceParallelError(f"{heads} attention heads over {kv_heads} key/value heads cannot be split "
                                    f"over {size} ranks")


class _AllToAll(torch.autograd.Function):
    """Split ``x`` in ``size`` equal parts along ``scatter``, send part j to rank j, concatenate what arrives along
    ``gather`` (in rank order); backward is the same exchange the other way."""

    @staticmethod
    def forward(ctx, x, group, size, scatter, gather):
        ctx.group, ctx.size, ctx.scatter, ctx.gather = group, size, scatter, gather
        return _exchange(x, group, size, scatter, gather)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group, ctx.size, ctx.gather, ctx.scatter), None, None, None, None


def _exchange(x: torch.Tensor, group, size: int, scatter: int, gather: int) -> torch.Tensor:
    parts = [p.contiguous() for p in x.chunk(size, dim=scatter)]
    if len(parts) != size or any(p.shape != parts[0].shape for p in parts):
        raise ValueError(f"cannot split dimension {scatter} of {tuple(x.shape)} into {size} equal parts")
    send = torch.stack(parts)  # [size, ...]: part j goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather)


def all_to_all(x: torch.Tensor, sp: SeqPar, *, scatter: int, gather: int) -> torch.Tensor:
    """Differentiable all-to-all over the group: ``scatter`` shrinks by ``sp.size``, ``gather`` grows by it."""
    if not sp.enabled:
        return x
    return _AllToAll.apply(x, sp.group, sp.size, scatter, gather)


class _GroupSum(torch.autograd.Function):
    """All-reduce (sum) over the group in forward; the gradient passes through unchanged (see the module doc)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def group_sum(x: torch.Tensor, sp: SeqPar) -> torch.Tensor:
    """The sum of ``x`` over the group's ranks, on every rank; each rank's gradient is the sum's gradient."""
    if not sp.enabled:
        return x
    if not x.requires_grad:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=sp.group)
        return out
    return _GroupSum.apply(x, sp.group)
