"""The reward model's loss: Bradley-Terry over the pairs' scalar rewards, as TRL 1.16's ``RewardTrainer``
computes it (``-logsigmoid(r_chosen - r_rejected - margin)``, plus ``coef * (r_chosen + r_rejected)^2`` when
``center_rewards_coefficient`` is set), per pair, so the loop's mean over a step's pairs is TRL's batch mean."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from prefpack.losses.pairwise import LossOutput

__all__ = ["SQUARED", "bradley_terry_loss", "reward_std"]

SQUARED = "^2"  # a metric named NAME^2 is NAME's square: the step and eval means report NAME_std from it


def bradley_terry_loss(chosen: Tensor, rejected: Tensor, *, margin: Tensor | None = None,
                       center_rewards_coefficient: float | None = None) -> LossOutput:
    """Per-pair Bradley-Terry loss of rewards ``chosen`` and ``rejected`` ([P] each, with gradient).

    ``margin`` [P]: how much the chosen must beat the rejected by (TRL's ``margin`` column; None = 0).
    ``center_rewards_coefficient``: adds ``coef * (r_c + r_r)^2`` per pair (TRL adds ``coef * mean(...)`` per batch:
    the same mean). Metrics per pair: the rewards, their squares (for the standard deviations), the margin
    ``r_c - r_r`` and the accuracy ``r_c > r_r`` (ties count as wrong, as in TRL).
    """
    if chosen.shape != rejected.shape or chosen.ndim != 1:
        raise ValueError(f"chosen and rejected rewards must be [P] each, got {tuple(chosen.shape)} and "
                         f"{tuple(rejected.shape)}")
    diff = chosen - rejected
    logits = diff if margin is None else diff - margin.to(diff.device, diff.dtype)
    loss = -F.logsigmoid(logits)
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * (chosen + rejected) ** 2
    c, r = chosen.detach(), rejected.detach()
    metrics = {"rewards/chosen": c, "rewards/rejected": r, "rewards/margins": c - r,
               "rewards/accuracies": (c > r).to(c.dtype), f"rewards/chosen{SQUARED}": c * c,
               f"rewards/rejected{SQUARED}": r * r}
    if margin is not None:
        metrics["rewards/target_margin"] = margin.detach().to(c.device, c.dtype)
    return LossOutput(loss, metrics)


def reward_std(mean: float, mean_of_squares: float) -> float:
    """A standard deviation from the mean of values and of their squares (population std, as numpy's)."""
    return max(mean_of_squares - mean * mean, 0.0) ** 0.5


