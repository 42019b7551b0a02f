"""A reward model's forward: one scalar per sequence of a packed micro-batch, the body run once and its ``score``
head (hidden -> 1) applied only at each completion's last scored token; the vocabulary head never runs.

The read position is where ``AutoModelForSequenceClassification`` reads a sequence run alone (its last token,
for a completion whose last token is scored): packed rows, a flattened row, padded rows and prompt-shared rows
(a prompt laid out once for its completions) all give the same rewards. A completion's unscored tail (a masked
span at its end) is not read: its reward is read at its last *scored* token.

:func:`sequence_rewards` is the public entry point (``prefpack score`` calls it with prefpack's ``Batch``);
:class:`SequenceRewards` wraps it as a module for DDP / FSDP2, as ``SequenceLogps`` wraps the log-prob forward.
"""

from __future__ import annotations

import torch
from torch import nn

from prefpack.batching.collate import Batch
from prefpack.model.attention.kernels import kernel_of
from prefpack.model.forward import SequenceLogps, body_forward, resolve_flatten
from prefpack.model.head import is_reward_model, score_head
from prefpack.model.sums import boundary_kwargs
from prefpack.precision import compute_context
from prefpack.sequence_parallel import SINGLE_SP, SeqPar

__all__ = ["SequenceRewards", "forward_module", "read_positions", "sequence_rewards", "set_pad_token"]


def read_positions(batch: Batch) -> torch.Tensor:
    """[S] flat indices into the batch's [B * L] tokens: where each sequence's last scored completion token sits.

    The last scored token is the target of the sequence's last scored position q, so it sits at q + 1, except in a
    prompt-shared row when q is the shared prompt's last position and the sequence is not the group's first
    completion (its first token is its last scored one): then it is the first token of the sequence's own block.
    """
    seq_flat = batch.seq_index.reshape(-1)
    n = batch.num_sequences
    if batch.score_positions is not None:
        pos, seq = batch.score_positions.long(), batch.score_sequences.long()
    else:
        pos = batch.loss_mask.reshape(-1).nonzero().squeeze(1)
        seq = seq_flat[pos]
    last = torch.full((n,), -1, dtype=torch.long, device=pos.device).scatter_reduce(0, seq, pos, "amax")
    if bool((last < 0).any()):
        empty = int((last < 0).nonzero()[0])
        raise ValueError(f"sequence {empty} of the micro-batch has no scored completion token: a reward model reads "
                         "its score at the last scored token")
    if batch.score_positions is None:  # every other layout: the last scored position's next token
        return last + 1
    where = torch.arange(seq_flat.numel(), device=seq_flat.device)
    real = seq_flat >= 0
    first = torch.full((n,), seq_flat.numel(), dtype=torch.long, device=seq_flat.device)
    first = first.scatter_reduce(0, seq_flat[real], where[real], "amin")
    after = last + 1
    own = seq_flat[after] == torch.arange(n, device=after.device)
    # a later completion of a prompt group whose last scored token is its first: the first position of its own
    # block (the shared prompt's positions carry the group's first sequence)
    return torch.where(own, after, first)


def sequence_rewards(model: nn.Module, batch: Batch, *, flatten: bool | None = None,
                     seq: SeqPar = SINGLE_SP) -> torch.Tensor:
    """[S] rewards (float32; float64 for a float64 model) of a micro-batch's sequences (sequence ``2p`` / ``2p + 1``: pair p's chosen / rejected;
    a prompt group's completions in order), with gradient under autograd.

    ``model`` is a reward model (``AutoModelForSequenceClassification`` with ``num_labels=1``, maybe LoRA-wrapped):
    its body runs on the batch in its layout, the hidden states are gathered at :func:`read_positions`, and only
    those go through ``score``. ``flatten`` as in ``prefpack.model.forward.sequence_logps`` (default: the kernel's).
    """
    if seq.enabled:
        raise ValueError("a reward model does not run on token shards yet (distributed.sequence_parallel); set "
                         "distributed.sequence_parallel=1")
    if batch.pixel_values is not None:
        raise ValueError("a reward model reads text batches only (no images)")
    body, score = score_head(model)
    device = score.weight.device if hasattr(score, "weight") else next(model.parameters()).device
    kernel = kernel_of(model)
    flatten = resolve_flatten(kernel, batch, flatten)
    at = read_positions(batch)
    flatten = flatten and batch.packed
    extra = boundary_kwargs(batch.position_ids[batch.token_mask], device) if flatten and kernel.boundary_kwargs else {}
    if flatten:  # indices into [B * L] -> into the flattened real tokens
        at = (batch.token_mask.reshape(-1).cumsum(0) - 1)[at]
    batch = batch.to(device, non_blocking=True)
    with compute_context(model, device):
        _, hidden, _ = body_forward(body, batch, flatten, extra)
        h = hidden.reshape(-1, hidden.shape[-1])[at.to(device)]
        out = score(h).squeeze(-1)
    return out if out.dtype == torch.float64 else out.float()  # bfloat16 compute: float32 rewards for the loss


class SequenceRewards(nn.Module):
    """``nn.Module`` wrapper of :func:`sequence_rewards`, so DDP / FSDP2 wrap the whole computation (the body and
    the score head are called directly, bypassing the model's own ``forward``)."""

    def __init__(self, model: nn.Module, flatten: bool | None = None, seq: SeqPar = SINGLE_SP):
        super().__init__()
        self.model = model
        self.flatten = flatten
        self.seq = seq

    def forward(self, batch: Batch) -> torch.Tensor:
        return sequence_rewards(self.model, batch, flatten=self.flatten, seq=self.seq)


def forward_module(model: nn.Module, *, chunk_size: int, seq: SeqPar = SINGLE_SP, rewards: bool = False,
                   **options) -> nn.Module:
    """The forward an objective reads (``Objective.forward_options()``): rewards for a reward model
    (``rewards=True``), else per-sequence log-prob sums with the options it asks for."""
    if rewards:
        if not is_reward_model(model):
            raise ValueError(f"{type(model).__name__} is not a reward model (AutoModelForSequenceClassification with "
                             "num_labels=1)")
        return SequenceRewards(model, seq=seq)
    return SequenceLogps(model, chunk_size=chunk_size, seq=seq, **options)


def set_pad_token(model: nn.Module, pad_id: int, eos_id: int | None = None) -> str | None:
    """Set the reward model's ``config.pad_token_id`` (saved with it), without which transformers' classifier refuses
    batches of more than one sequence; it reads each sequence at its rightmost token that is not ``pad_id``.
    Returns a warning when ``pad_id`` is the EOS token, which completions end with: a padded batch then reads the
    token before a final EOS, where prefpack reads the EOS itself (use a tokenizer with its own pad token)."""
    config = model.config
    for c in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        c.pad_token_id = int(pad_id)
    if eos_id is not None and int(pad_id) == int(eos_id):
        return (f"the tokenizer pads with its EOS token (id {pad_id}): transformers' classifier reads a sequence at "
                "its last token that is not the pad token, so on a completion ending with EOS it reads the token "
                "before, while prefpack reads the EOS; give the tokenizer a pad token of its own for exported "
                "scores equal to training's")
    return None
