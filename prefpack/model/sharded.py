"""The forward of one rank of a sequence group (``distributed.sequence_parallel``, ``prefpack.sequence_parallel``).

Every rank of the group collates the same micro-batch. The row layout is the one the kernel runs without sharding
(flattened to one row of real tokens for a kernel that flattens rows), padded at the end to a multiple of N with
padding that is a block of its own (positions restart at 0; never scored). Rank r takes the r-th of N contiguous
token shards of every row: the body (embeddings, norms, MLP) runs on it with its global position ids, attention on
whole rows through the all-to-all wrapper (``attention/sequence_parallel.py``), and the completion-only head on the
shard's scored positions only. Per-sequence sums (log-probs, LD-DPO tails, WPO's sums) are partial on each rank and
summed over the group (``group_sum``), so every rank returns what one process running the whole row returns; token
counts come from the collated batch, which holds the whole row.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from prefpack.batching.collate import Batch
from prefpack.model.attention.kernels import Kernel
from prefpack.model.attention.sequence_parallel import SHARDS, TokenShards
from prefpack.model.head import HeadSpec
from prefpack.model.logprobs import completion_logprobs
from prefpack.model.sums import SequenceOutput, boundary_kwargs, hidden_of, reduce_sequences
from prefpack.sequence_parallel import SeqPar, group_sum

__all__ = ["ShardedRows", "shard_rows", "sharded_logps"]


class ShardedRows(NamedTuple):
    """One rank's share of a micro-batch (host tensors)."""

    input_ids: torch.Tensor  # [B, L / N] the shard
    position_ids: torch.Tensor  # [B, L / N] the shard's (global per sequence)
    row_position_ids: torch.Tensor  # [B, L] the whole padded rows', for the kernel
    at: torch.Tensor  # [n] the shard's scored positions, flat indices into [B * L / N]
    targets: torch.Tensor  # [n] their targets
    sequences: torch.Tensor  # [n] their sequences
    offset: torch.Tensor  # [S] each sequence's scored positions on earlier shards


def shard_rows(batch: Batch, sp: SeqPar, flatten: bool) -> ShardedRows:
    """Rank ``sp.rank``'s shard of ``batch`` in the layout the kernel reads (``flatten``: one row of real tokens)."""
    ids, pos = batch.input_ids, batch.position_ids
    if batch.score_positions is not None:  # prompt-shared rows: a prompt's last position is scored per completion
        at, targets, sequences = batch.score_positions, batch.score_targets, batch.score_sequences
    else:
        at = batch.loss_mask.reshape(-1).nonzero().squeeze(1)
        targets, sequences = batch.target_ids.reshape(-1)[at], batch.seq_index.reshape(-1)[at]
    if flatten:
        keep = batch.token_mask.reshape(-1)
        at = (keep.cumsum(0) - 1)[at]
        ids, pos = ids.reshape(-1)[keep][None], pos.reshape(-1)[keep][None]
    rows, length = ids.shape
    pad = (-length) % sp.size
    if pad:  # a block of its own at the end of every row
        ids = torch.cat([ids, ids.new_zeros(rows, pad)], 1)
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype).expand(rows, pad)], 1)
    width = (length + pad) // sp.size
    lo = sp.rank * width
    row, col = at // length, at % length
    shard = col // width
    mine = shard == sp.rank
    earlier = sequences[shard < sp.rank]
    offset = torch.zeros(batch.num_sequences, dtype=torch.long).index_add_(0, earlier, torch.ones_like(earlier))
    return ShardedRows(ids[:, lo:lo + width], pos[:, lo:lo + width], pos, row[mine] * width + col[mine] - lo,
                       targets[mine], sequences[mine], offset)


def sharded_logps(body: nn.Module, spec: HeadSpec, kernel: Kernel, batch: Batch, sp: SeqPar, *, flatten: bool,
                  chunk_size: int, pair_tails: bool = False, wpo: bool = False,
                  entropy: bool = False, token_logps: bool = False) -> SequenceOutput:
    """``forward.sequence_logps`` on this rank's token shard, its sums over the group (under the compute context)."""
    if not batch.packed:
        raise ValueError("sequence parallelism runs packed micro-batches (data.packing)")
    if not kernel.shards_sequences:
        raise ValueError(f"the {kernel.name or '?'} attention kernel does not run on token shards")
    if batch.segmented and batch.score_positions is not None and (pair_tails or token_logps or batch.token_term):
        # a later segment's first token is scored at the shared prompt's last position, on an earlier shard than its
        # completion's earlier tokens: a token's place in its completion (tails, per-token terms) would be wrong
        raise ValueError(f"store {batch.key_store!r}: completions cut into segments (segments.bin) in prompt-shared "
                         "rows give LD-DPO tails and per-token terms on token shards in the wrong order; set "
                         "data.prefix_sharing=false (or distributed.sequence_parallel=1)")
    device = spec.weight.device
    rows = shard_rows(batch, sp, flatten)
    row_kwargs = {"position_ids": rows.row_position_ids.to(device)}
    if flatten and kernel.boundary_kwargs:
        row_kwargs.update(boundary_kwargs(rows.row_position_ids, device))
    out = body(input_ids=rows.input_ids.to(device), position_ids=rows.position_ids.to(device), attention_mask=None,
               use_cache=False, **{SHARDS: TokenShards(sp, row_kwargs)})
    hidden = hidden_of(out)
    h = hidden.reshape(-1, hidden.shape[-1])[rows.at.to(device)]
    index = rows.sequences.to(device)
    logp = completion_logprobs(h, rows.targets.to(device), spec.weight, spec.bias, chunk_size=chunk_size,
                               scale=spec.scale, softcap=spec.softcap, with_log_sum_sq=wpo, with_entropy=entropy)
    return reduce_sequences(logp, index, batch.num_sequences, batch.completion_tokens, wpo=wpo, entropy=entropy,
                            pair_tails=pair_tails, tail_pairs=batch.tail_pairs, offset=rows.offset.to(device),
                            reduce=partial(group_sum, sp=sp), term=batch.token_term, token_logps=token_logps)


def check_model(model: nn.Module, sp: SeqPar, *, router_aux: bool = False) -> None:
    """Refuse, at start and with the numbers, a model the group cannot shard: its kernel does not run on token shards
    (only the kernels registered ``shardable`` do), its head counts do not split over the group, or the run adds the
    MoE router loss (``router_aux``: not a per-sequence sum)."""
    if not sp.enabled:
        return
    from prefpack.model.attention.kernels import KERNELS, kernel_of
    from prefpack.sequence_parallel import SequenceParallelError, check_heads

    if router_aux:
        raise SequenceParallelError("the MoE router load-balancing loss is not computed over token shards "
                                    "(distributed.sequence_parallel); set loss.router_aux_loss_coef=0")
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    if getattr(config, "vision_config", None) is not None:
        raise SequenceParallelError(f"{type(model).__name__} is a vision-language model, and those do not run on "
                                    "token shards yet: set distributed.sequence_parallel=1 (--sequence-parallel 1)")

    from prefpack.model.attention import features

    if features.has_sinks(model):  # each rank holds a share of the heads; their sinks are not split with them yet
        raise SequenceParallelError(f"{type(model).__name__} has attention sinks (gpt-oss), which do not run on token "
                                    "shards yet: set distributed.sequence_parallel=1 (--sequence-parallel 1)")
    kernel = kernel_of(model)
    if not kernel.shards_sequences:
        able = " or ".join(k.name for k in KERNELS if k.shards_sequences)
        raise SequenceParallelError(f"distributed.sequence_parallel={sp.size} runs attention on token shards with the "
                                    f"{able} kernel; this model's is {kernel.name or '?'}: set "
                                    "model.attn_implementation to one of those")
    config = getattr(model, "config", None)
    get = getattr(config, "get_text_config", None)
    config = get() if callable(get) else config
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    if not heads:
        raise SequenceParallelError(f"cannot tell the attention head count of {type(model).__name__} "
                                    "(config.num_attention_heads) to split over distributed.sequence_parallel")
    check_heads(heads, int(getattr(config, "num_key_value_heads", None) or heads), sp.size)
