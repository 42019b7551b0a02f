"""What some options do to the log-probs before a pair loss reads them: f-DPO's scores in place of log-ratios,
LD-DPO's length-desensitised sums, WPO's pair weights. Pure functions."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["F_DIVERGENCES", "LOSS_OPTIONS", "LossOption", "f_divergence_scores", "length_desensitised", "wpo_weights"]


@dataclass(frozen=True)
class LossOption:
    """A config option that changes what the pair losses compute, with its source (docs/losses.md lists them)."""

    key: str  # the config key that turns it on
    name: str
    what: str
    paper: str  # 'Authors year, "Title"'
    arxiv: str


LOSS_OPTIONS: tuple[LossOption, ...] = (
    LossOption("loss.f_divergence_type", "f-DPO", "each log-ratio log u replaced by f'(u) before the loss",
               'Wang et al. 2023, "Beyond Reverse KL: Generalizing Direct Preference Optimization with Diverse '
               'Divergence Constraints"', "2309.16240"),
    LossOption("loss.ld_alpha", "LD-DPO", "tokens past the shorter completion weighted by alpha in every log-prob sum",
               'Liu et al. 2024, "Length Desensitization in Direct Preference Optimization"', "2409.06411"),
    LossOption("loss.use_weighting", "WPO", "each pair's loss weighted by how likely the policy finds the pair",
               'Zhou et al. 2024, "WPO: Enhancing RLHF with Weighted Preference Optimization"', "2406.11827"),
    # acts through the reference (prefpack.reference.sync), listed here with the other options a loss follows
    LossOption("reference.sync", "TR-DPO", "the reference mixed towards the policy every reference.sync_steps steps",
               'Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good Alignment"', "2404.09656"),
)


F_DIVERGENCES: tuple[str, ...] = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
"""``loss.f_divergence_type`` values, as TRL 1.16's ``DPOConfig.f_divergence_type``; reverse_kl is plain DPO."""

# TRL caps t = (alpha - 1) * logratio before exp so that the score stays representable after casting back.
_ALPHA_EXP_CAP = {torch.float16: 11.0}
_ALPHA_EXP_CAP_DEFAULT = 80.0


def f_divergence_scores(logratio: Tensor, divergence: str, alpha: float = 0.5) -> Tensor:
    """The f-DPO score f'(u) of a log-ratio ``logratio = log u = log pi(y|x) - log ref(y|x)``, per sequence.

    f-DPO, Wang et al. 2023, "Beyond Reverse KL: Generalizing Direct Preference Optimization with Diverse
    Divergence Constraints" (arXiv:2309.16240), Thm. 1: with an f-divergence regulariser the implicit reward is
    beta * f'(pi/ref) (+ a beta * log Z(x) term that cancels only in the chosen - rejected difference), so the
    pair losses built on that difference take f'(u_w) - f'(u_l) in place of h = log u_w - log u_l. As in
    TRL 1.16 (``DPOTrainer._compute_loss``), per divergence:

    * ``reverse_kl``: f'(u) = log u, the log-ratio itself (the same tensor is returned: plain DPO, bitwise);
    * ``forward_kl``: f'(u) = 1 - 1/u = 1 - exp(-logratio) (not capped: below about -88 in float32 it
      overflows to -inf, as in TRL);
    * ``js_divergence``: f'(u) = log(2u / (1 + u)) = log 2 + logsigmoid(logratio);
    * ``alpha_divergence``: f'(u) = (u^(alpha - 1) - 1) / (alpha - 1) with t = (alpha - 1) * logratio capped at
      80 (11 in float16) before exp, so the score is finite, and its gradient 0 beyond the cap; |alpha - 1| <
      1e-6 is the limit log u (reverse_kl). Half-precision inputs are exponentiated in float32 and cast back,
      as in TRL; float32 and float64 stay in their dtype (TRL 1.16 has no cap for float64 and fails on it).

    TRL's ``alpha`` (``f_alpha_divergence_coef``, default 0.5) is 1 - the paper's alpha: the paper writes the
    alpha-divergence as f'(u) = (1 - u^(-alpha)) / alpha, which is the formula above with alpha -> 1 - alpha.
    At the default 0.5 both agree; alpha -> 1 here (paper 0) is reverse KL and alpha -> 0 (paper 1) forward KL.
    """
    if divergence == "reverse_kl":
        return logratio
    if divergence == "forward_kl":
        return 1 - torch.exp(-logratio)
    if divergence == "js_divergence":
        return math.log(2) + F.logsigmoid(logratio)
    if divergence == "alpha_divergence":
        if not math.isfinite(alpha):
            raise ValueError(f"f_alpha_divergence_coef must be finite, got {alpha}")
        if abs(alpha - 1.0) < 1e-6:
            return logratio
        dtype = logratio.dtype
        t = (alpha - 1.0) * logratio
        work = t if dtype in (torch.float32, torch.float64) else t.float()
        cap = _ALPHA_EXP_CAP.get(dtype, _ALPHA_EXP_CAP_DEFAULT)
        return (torch.exp(torch.clamp(work, max=cap)) - 1.0).to(dtype) * (1.0 / (alpha - 1.0))
    raise ValueError(f"unknown f-divergence {divergence!r}; choose one of: {', '.join(F_DIVERGENCES)}")


def length_desensitised(total: Tensor, tail: Tensor, alpha: float) -> Tensor:
    """LD-DPO's log-prob (Liu et al. 2024, arXiv:2409.06411, Eq. 9; TRL 1.16's ``ld_alpha``): the tokens up to the
    shorter completion's length count fully, the rest with weight ``alpha``:

        logp_LD = sum_{t <= l_p} log p_t + alpha * sum_{t > l_p} log p_t = total - (1 - alpha) * tail

    with ``l_p = min(|y_w|, |y_l|)`` of the pair and ``tail`` the sum over ``t > l_p``."""
    return total - (1.0 - alpha) * tail


def wpo_weights(chosen_mean: Tensor, rejected_mean: Tensor) -> Tensor:
    """WPO's pair weight (Zhou et al. 2024, arXiv:2406.11827, Eq. 2, as TRL 1.16's ``use_weighting``): the product
    of the chosen and rejected completions' ``exp(mean_t [log p_t - log sum_v p_v^2])`` (``prefpack.model.forward``'s
    ``wpo_mean``; the probabilities renormalised by the policy's own sampling concentration). No gradient, no
    clamp (TRL 1.16 has none)."""
    return torch.exp(chosen_mean.detach() + rejected_mean.detach())
