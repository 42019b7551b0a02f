"""What a forward computes around the model: the kernel's boundary keywords for a flattened row, the final hidden
states, and the per-sequence values read from per-token log-probs (:func:`reduce_sequences`: their sums, LD-DPO's
tails, WPO's means, entropy means). Shared by the whole-row forward (``forward``) and the sharded one (``sharded``),
so both reduce in the same order.

A sequence's scored tokens are contiguous and in order in every layout (packed, flattened, padded, prompt-shared);
a token's place in its completion is its offset from the sequence's first gathered token, plus ``offset`` (the
sequence's scored tokens on earlier shards, sequence parallelism; None: none).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from prefpack.model.attention import varlen
from prefpack.model.logprobs import segment_sum

__all__ = [
    "SequenceOutput",
    "TokenTerm",
    "boundary_kwargs",
    "drawn_pair_tails",
    "hidden_of",
    "reduce_sequences",
    "tail_mask",
    "wpo_means",
    "wpo_sums",
]


class SequenceOutput(NamedTuple):
    """Per-sequence results of one forward over a micro-batch (sequence ``2p``/``2p + 1`` = pair p's chosen/rejected
    in a pair batch). Optional fields are None unless requested."""

    logp_sum: torch.Tensor  # [S] completion log-prob sums (with gradient under autograd)
    n_tokens: torch.Tensor  # [S] completion token counts (host tensor)
    aux_loss: torch.Tensor | None = None  # scalar MoE router load-balancing loss (``router_aux``)
    tail_sum: torch.Tensor | None = None  # [S] sum over the tokens past the shorter completion of the pair (LD-DPO);
    # [2, P] per drawn pair (chosen, rejected) when the batch gives ``tail_pairs`` (ranked stores)
    wpo_mean: torch.Tensor | None = None  # [S] detached mean over tokens of log p - log sum_v p_v^2 (WPO)
    entropy_mean: torch.Tensor | None = None  # [S] detached mean over scored tokens of the policy's entropy
    term_sums: dict[str, torch.Tensor] | None = None  # [S] each: the batch's TokenTerm values summed per sequence
    token_logp: torch.Tensor | None = None  # [S, W] detached per-token log-probs, sequence s's k-th scored token at
    # [s, k] (0 past its last): W the batch's most scored tokens of one sequence (``token_logps``)


@dataclass
class TokenTerm:
    """A per-token term an objective asks the forward to sum per sequence (group policy gradients: the clipped
    surrogate against the sampling policy's log-probs, and the reference's k3 KL).

    ``fn(logp, **token_inputs, **sequence_inputs)`` gets the policy's log-probs of the scored tokens [N] (with
    gradient) and, per token, the value of each ``token_inputs`` tensor at that token ([S, W] as ``token_logp``
    lays them out: sequence s's k-th scored token at [s, k]) and of each ``sequence_inputs`` tensor [S] at its
    sequence; it returns named per-token tensors [N], each summed per sequence into ``SequenceOutput.term_sums``.
    Summing keeps every layout (packed, padded, prompt-shared, token shards) giving the same per-sequence values."""

    fn: Callable[..., Mapping[str, torch.Tensor]]
    token_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    sequence_inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device, non_blocking: bool = False) -> TokenTerm:
        def move(d: dict) -> dict:
            return {k: v.to(device, non_blocking=non_blocking) for k, v in d.items()}

        return TokenTerm(self.fn, move(self.token_inputs), move(self.sequence_inputs))

    def values(self, logp: torch.Tensor, index: torch.Tensor, places: torch.Tensor) -> Mapping[str, torch.Tensor]:
        """``fn`` at the gathered tokens (``index`` [N] each token's sequence, ``places`` [N] its place in it)."""
        per_token = {k: v.to(logp.device)[index, places].to(logp.dtype) for k, v in self.token_inputs.items()}
        per_sequence = {k: v.to(logp.device)[index].to(logp.dtype) for k, v in self.sequence_inputs.items()}
        return self.fn(logp, **per_token, **per_sequence)


def boundary_kwargs(position_ids: torch.Tensor, device: torch.device) -> dict:
    """transformers' flash keyword arguments for a flattened row, computed on the host (no device sync); with
    prompt groups also the gathered keys' boundaries and index (tensors and ints: a compiled layer sees the same
    kinds of inputs every step)."""
    b = varlen.group_bounds(position_ids.cpu())
    cu = b.cu_q.to(device, non_blocking=True)
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": b.max_q, "max_length_k": b.max_q}
    if b.key_index is not None:
        kwargs.update({"cu_seq_lens_k": b.cu_k.to(device, non_blocking=True), "max_length_k": b.max_k,
                       varlen.KEY_INDEX: b.key_index.to(device, non_blocking=True)})
    return kwargs


def hidden_of(out) -> torch.Tensor:
    """The final hidden states of a body's output."""
    h = getattr(out, "last_hidden_state", None)
    if h is None:
        h = out[0]
    return h


def _places(index: torch.Tensor, num_sequences: int, offset: torch.Tensor | None) -> torch.Tensor:
    """Each gathered token's place in its completion (0 for its first scored token)."""
    where = torch.arange(index.numel(), device=index.device)
    first = torch.full((num_sequences,), index.numel(), dtype=torch.long, device=index.device)
    first = first.scatter_reduce(0, index, where, "amin")
    place = where - first[index]
    return place if offset is None else place + offset.to(index.device).long()[index]


def tail_mask(index: torch.Tensor, n_tokens: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """1 at the completion tokens past ``min(len chosen, len rejected)`` of their pair, else 0 (float).

    ``index`` [N] gives each gathered token's sequence. Pair p owns sequences 2p and 2p + 1. Computed on the device
    without a host sync.
    """
    n = n_tokens.to(index.device)
    if n.numel() % 2:
        raise ValueError(f"pair tails need a pair batch (chosen, rejected alternating), got {n.numel()} sequences")
    shared = torch.minimum(n[0::2], n[1::2]).repeat_interleave(2)
    index = index.long()
    return (_places(index, n.numel(), offset) >= shared[index]).float()


def drawn_pair_tails(logp: torch.Tensor, index: torch.Tensor, n_tokens: torch.Tensor, pairs: torch.Tensor,
                     offset: torch.Tensor | None = None) -> torch.Tensor:
    """[2, P]: for pair p = (a, b) = ``pairs[:, p]`` (sequence indices), the sums of ``logp`` over a's and over b's
    completion tokens past ``min(len a, len b)``: LD-DPO's tails when one completion is in several pairs.

    Each sequence's log-probs are laid out in a row of a [S, longest + 1] matrix whose reversed cumulative sum gives
    every suffix sum; a pair reads its two at its cut. Linear in ``logp``: shards' results add up.
    """
    n = n_tokens.to(index.device).long()
    index = index.long()
    width = int(n.max()) + 1 if n.numel() else 1
    rows = logp.new_zeros(n.numel(), width).index_put((index, _places(index, n.numel(), offset)), logp)
    suffix = rows.flip(1).cumsum(1).flip(1)  # suffix[s, k]: sum over sequence s's tokens from the k-th on
    pairs = pairs.to(index.device).long()
    cut = torch.minimum(n[pairs[0]], n[pairs[1]])
    return torch.stack([suffix[pairs[0], cut], suffix[pairs[1], cut]])


def wpo_sums(logp: torch.Tensor, log_sum_sq: torch.Tensor, index: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """Per sequence, the sum over its tokens of ``log p(token) - log sum_v p_v^2``, without gradient."""
    return segment_sum(logp.detach() - log_sum_sq, index, num_sequences)


def wpo_means(sums: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
    """WPO (Zhou et al. 2024, arXiv:2406.11827, Eq. 2, as TRL 1.16 computes it): per sequence, the mean over its
    completion tokens of ``log p(token) - log sum_v p_v^2`` (:func:`wpo_sums`), without gradient (a pair's weight
    is the exp of its chosen + rejected means)."""
    return sums / n_tokens.to(sums.device, sums.dtype).clamp(min=1.0)


def _whole(x: torch.Tensor) -> torch.Tensor:
    return x


def token_matrix(logp: torch.Tensor, index: torch.Tensor, completion_tokens: torch.Tensor,
                 offset: torch.Tensor | None = None) -> torch.Tensor:
    """[S, W] detached: sequence s's k-th scored token's ``logp`` at [s, k], 0 elsewhere (W: the most scored tokens
    of a sequence, read from the host-side counts). Linear: shards' matrices add up."""
    n = completion_tokens.long()
    width = int(n.max()) if n.numel() else 0
    index = index.long()
    return logp.detach().new_zeros(n.numel(), max(width, 1)).index_put(
        (index, _places(index, n.numel(), offset)), logp.detach())


def reduce_sequences(scored, index: torch.Tensor, num_sequences: int, completion_tokens: torch.Tensor, *,
                     wpo: bool = False, entropy: bool = False, pair_tails: bool = False,
                     tail_pairs: torch.Tensor | None = None, offset: torch.Tensor | None = None,
                     reduce: Callable[[torch.Tensor], torch.Tensor] = _whole, term: TokenTerm | None = None,
                     token_logps: bool = False) -> SequenceOutput:
    """The per-sequence values of one forward from its head's per-token output, ``aux_loss`` left None.

    ``scored`` is what ``completion_logprobs`` returned with ``with_log_sum_sq=wpo, with_entropy=entropy``; ``index``
    [N] each scored token's sequence. ``pair_tails``: LD-DPO's tails, per drawn pair when ``tail_pairs`` is given.
    ``reduce`` turns a per-sequence sum over this process's tokens into the sum over the whole rows (sequence
    parallelism: the group's sum, with ``offset`` the sequence's scored tokens on earlier shards); by default the
    tokens are the whole rows already. ``term``: an objective's per-token term, summed per sequence (``term_sums``);
    ``token_logps``: also the detached per-token log-probs as an [S, W] matrix. Every value is a sum first, so
    sharded and whole forwards agree.
    """
    log_sum_sq = token_entropy = None
    if wpo or entropy:
        logp, *extras = scored
        log_sum_sq = extras[0] if wpo else None
        token_entropy = extras[-1] if entropy else None
    else:
        logp = scored
    logp_sum = reduce(segment_sum(logp, index, num_sequences))
    tail_sum = wpo_mean = entropy_mean = None
    if pair_tails and tail_pairs is not None:
        tail_sum = reduce(drawn_pair_tails(logp, index, completion_tokens, tail_pairs, offset))
    elif pair_tails:
        tail = tail_mask(index, completion_tokens, offset).to(logp.dtype)
        tail_sum = reduce(segment_sum(logp * tail, index, num_sequences))
    if wpo:
        wpo_mean = wpo_means(reduce(wpo_sums(logp, log_sum_sq, index, num_sequences)), completion_tokens)
    if entropy:
        sums = reduce(segment_sum(token_entropy, index, num_sequences))
        entropy_mean = sums / completion_tokens.to(sums.device, sums.dtype).clamp(min=1.0)
    term_sums = matrix = None
    if term is not None:
        values = term.values(logp, index.long(), _places(index.long(), num_sequences, offset))
        term_sums = {k: reduce(segment_sum(v, index, num_sequences)) for k, v in values.items()}
    if token_logps:
        matrix = reduce(token_matrix(logp, index, completion_tokens, offset))
    return SequenceOutput(logp_sum, completion_tokens, None, tail_sum, wpo_mean, entropy_mean, term_sums, matrix)
