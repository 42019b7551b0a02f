"""A reward model's objective (``train.objective=reward``): each pair's two rewards from the reward forward
(``prefpack.model.reward``), the Bradley-Terry loss over them (``prefpack.losses.reward``), no reference.

The layouts are the DPO family's, unchanged: a pair store's pairs (:class:`RewardPairTask`, both completions of a
pair in one row, the prompt laid out once with ``data.prefix_sharing``), a ranked store's prompts or a pair store
grouped by prompt (:class:`RewardGroupTask`: a prompt and its completions laid out once, each completion's reward
computed once and gathered for every pair it is in). Planning, collation, dealing, mixtures and the step loop are
the DPO family's, so every invariance they hold (packed = padded, 1x8 = 8x1, ranks, resume) holds here too.

A pair store with margins (``margins.bin``: the rows' ``margin`` field, TRL's column) gives each pair its margin in
the loss, ``-logsigmoid(r_chosen - r_rejected - margin)``, read by the pair's store row (grouped by prompt too); a
store without (and a ranked store) trains with none.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from prefpack.data.store import StoreError
from prefpack.data.views import PairGroups
from prefpack.losses import LossOutput
from prefpack.losses.reward import bradley_terry_loss
from prefpack.objectives.base import StepState
from prefpack.objectives.groups import PromptGroupTask
from prefpack.objectives.pairs import PairTask
from prefpack.reference import KeySpace, Reference

__all__ = ["RewardGroupTask", "RewardPairTask"]


class _BradleyTerry:
    """The hooks both reward objectives share: the forward they read, the loss, and no reference."""

    def __init__(self, store, *args, **kwargs):
        store.require_whole_completions("a reward model does not train on: its reward is read at the last token of "
                                        "one sequence per completion; prepare the rows again with --train-on last, "
                                        "which renders each reply once, whole, in its last turn's context")
        super().__init__(store, *args, **kwargs)

    def forward_options(self) -> dict:
        return {"rewards": True}

    def key_space(self) -> KeySpace:
        raise StoreError("a reward model reads no reference: precompute-ref has nothing to record for it")

    def pair_rewards(self, rewards: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def loss(self, policy: nn.Module, reference: Reference, batch, step: StepState) -> LossOutput:
        rewards = policy(batch)  # [S]: SequenceRewards, maybe wrapped
        chosen, rejected, margin = self.pair_rewards(rewards, batch)
        return bradley_terry_loss(chosen, rejected, margin=margin,
                                  center_rewards_coefficient=self.settings.loss.center_rewards_coefficient)

    def margins_of(self, rows, device) -> torch.Tensor | None:
        """The margins of the pairs at store ``rows`` (None: the store has none)."""
        margins = self.store.margins if self.store.kind == "pairs" else None
        if margins is None:
            return None
        at = np.asarray(rows, dtype=np.int64)
        return torch.as_tensor(np.asarray(margins[at], dtype=np.float64), device=device)

    def end_step(self, totals) -> None:
        """No running state."""

    def state_dict(self) -> dict:
        return {}


class RewardPairTask(_BradleyTerry, PairTask):
    """Bradley-Terry on a pair store: sequence 2p is pair p's chosen, 2p + 1 its rejected."""

    def pair_rewards(self, rewards, batch):
        return rewards[0::2], rewards[1::2], self.margins_of(batch.group_ids.numpy(), rewards.device)


class RewardGroupTask(_BradleyTerry, PromptGroupTask):
    """Bradley-Terry on prompt groups: every pair a group's ranking yields (``data.ranked_pairs``; a reward run's
    auto is ``all_pairs``), each completion's reward computed once."""

    def pair_rewards(self, rewards, batch):
        groups = batch.group_ids.numpy()
        chosen, rejected, _ = self._drawn_pairs(groups)
        c = torch.as_tensor(chosen, dtype=torch.long, device=rewards.device)
        r = torch.as_tensor(rejected, dtype=torch.long, device=rewards.device)
        rows = [row for g in groups for row in self.view.pair_rows[int(g)]] if isinstance(self.view, PairGroups) \
            else None  # a pair store grouped by prompt: each drawn pair's store row, in the order drawn
        return rewards[c], rewards[r], None if rows is None else self.margins_of(rows, rewards.device)
