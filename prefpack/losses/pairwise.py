"""Pairwise preference losses (DPO family, SimPO, ORPO, NLL) as pure functions, and the types they share.

Every loss here is a function of per-sequence log-probabilities (log p summed over the completion tokens)
and completion lengths, and returns one value per pair (shape ``[P]``, never reduced). The trainer sums
these and divides by the number of pairs in the whole optimizer step, so the result does not depend on how
pairs are split into micro-batches. Nothing here reads model outputs, keeps state or syncs across devices.
Exceptions: the batch-coupled losses (``BATCH_COUPLED_LOSSES``: ``aot``, ``aot_unpaired``, ``sft``) combine,
as TRL's do, all pairs passed in one call (a sort over them, or one token mean over them); prefpack calls
them once per micro-batch, so their result depends on how pairs are split (see their docstrings).

Conventions shared by all losses:

* ``logratio = policy_logp - ref_logp`` (sums over completion tokens). Reference log-probs are detached:
  the reference model is a constant, so gradients reach only the policy inputs.
* ``h = chosen_logratio - rejected_logratio`` is the DPO "implicit reward" margin divided by ``beta``.
* Length-normalised losses (``ipo``, ``sigmoid_norm``, ``simpo``, ``orpo``, ``nll``, ``sft``) divide by the
  completion token count and raise ``ValueError`` on a zero-length completion instead of clamping (an empty
  completion is a data bug, and dividing by a clamped 1 would silently train on it).
* Numerics use ``F.logsigmoid`` / ``sigmoid(-x)`` rather than ``log(sigmoid(x))`` / ``1 - sigmoid(x)`` so
  large-magnitude margins give finite losses and gradients. Computation stays in the input dtype.

The losses TRL 1.16 added are in ``pairwise_trl``, the transforms some options apply to the log-probs before a
loss reads them (f-DPO, LD-DPO, WPO) in ``transforms``, and the registry that names every loss in ``registry``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["LossOutput", "PairLogps", "apo_down_loss", "apo_zero_loss", "bco_pair_loss", "hinge_loss", "ipo_loss",
           "nll_loss", "orpo_loss", "robust_loss", "sigmoid_loss", "simpo_loss"]

# ORPO's odds need log(1 - p) with p = exp(mean token log-prob); at p == 1 that is -inf and its gradient is
# NaN. The mean log-prob is clamped to at most this value inside the odds term only (the NLL part of ORPO is
# not clamped). It only changes sequences the policy already predicts with per-token probability > 1 - 1e-6.
_ORPO_MAX_MEAN_LOGP = -1e-6


# --------------------------------------------------------------------------------------------------------
# Inputs and outputs
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairLogps:
    """Per-pair sequence log-probs; every tensor has shape ``[P]``.

    ``policy_*`` / ``ref_*`` are sums of token log-probs over the completion only (prompt excluded).
    ``*_tokens`` are the completion token counts (int or float tensors). ``ref_*`` may be ``None`` when
    only reference-free losses are used; they are given together or not at all. ``*_tail`` (LD-DPO only) are the
    parts of those sums over the tokens past the shorter completion of the pair (``prefpack.model.forward``'s
    ``tail_sum``).
    """

    policy_chosen: Tensor
    policy_rejected: Tensor
    chosen_tokens: Tensor
    rejected_tokens: Tensor
    ref_chosen: Tensor | None = None
    ref_rejected: Tensor | None = None
    policy_chosen_tail: Tensor | None = None
    policy_rejected_tail: Tensor | None = None
    ref_chosen_tail: Tensor | None = None
    ref_rejected_tail: Tensor | None = None

    def __post_init__(self) -> None:
        if (self.ref_chosen is None) != (self.ref_rejected is None):
            raise ValueError("PairLogps: give both ref_chosen and ref_rejected, or neither")
        if not self.policy_chosen.is_floating_point() or not self.policy_rejected.is_floating_point():
            raise ValueError("PairLogps: policy log-probs must be floating-point tensors")
        shape = self.policy_chosen.shape
        if len(shape) != 1:
            raise ValueError(
                f"PairLogps: expected 1-D [P] tensors, got policy_chosen of shape {tuple(shape)}"
            )
        for name in ("policy_rejected", "chosen_tokens", "rejected_tokens", "ref_chosen", "ref_rejected",
                     "policy_chosen_tail", "policy_rejected_tail", "ref_chosen_tail", "ref_rejected_tail"):
            value = getattr(self, name)
            if value is not None and value.shape != shape:
                raise ValueError(
                    f"PairLogps: {name} has shape {tuple(value.shape)}, expected {tuple(shape)} "
                    "(same as policy_chosen)"
                )

    @property
    def has_reference(self) -> bool:
        return self.ref_chosen is not None


@dataclass(frozen=True)
class LossOutput:
    """Per-pair loss (``[P]``, with grad) and detached per-pair metrics (each ``[P]``).

    Metric keys: ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``,
    ``logps/chosen``, ``logps/rejected`` (completion sums), ``nll`` (per-token NLL of chosen) and
    ``loss/<name>`` (unweighted value of each configured term).
    """

    loss: Tensor
    metrics: dict[str, Tensor]


# --------------------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------------------


def _check_beta(beta: float) -> None:
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta must be finite and > 0, got {beta}")


def _check_smoothing(label_smoothing: float, *, upper: float, inclusive: bool, loss: str) -> None:
    ok = 0.0 <= label_smoothing <= upper if inclusive else 0.0 <= label_smoothing < upper
    if not ok:
        bracket = "]" if inclusive else ")"
        raise ValueError(f"{loss}: label_smoothing must be in [0, {upper}{bracket}, got {label_smoothing}")


def _per_token(logp_sum: Tensor, tokens: Tensor, *, what: str) -> Tensor:
    """Mean log-prob per completion token; refuses zero-length completions rather than producing NaN/inf."""
    if bool((tokens <= 0).any()):
        raise ValueError(
            f"{what}: zero-length completion (token count <= 0) in a length-normalised loss; "
            "drop empty completions before training"
        )
    return logp_sum / tokens.to(logp_sum.dtype)


# --------------------------------------------------------------------------------------------------------
# Individual losses. Each returns a [P] tensor.
# --------------------------------------------------------------------------------------------------------


def sigmoid_loss(
    chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float, label_smoothing: float = 0.0
) -> Tensor:
    """DPO logistic loss, optionally conservative (cDPO).

    DPO, Rafailov et al. 2023 (arXiv:2305.18290), Eq. 7:
        L = -log sigma(beta * h),  h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))
    cDPO, Mitchell 2023 ("A note on DPO with noisy preferences & relationship to IPO"): labels are flipped
    with probability eps, giving the cross-entropy against soft labels
        L = -(1 - eps) * log sigma(beta * h) - eps * log sigma(-beta * h)
    ``label_smoothing=0`` is plain DPO. Passing policy log-probs as the log-ratios (reference taken as 0)
    gives the reference-free variant.
    """
    _check_beta(beta)
    _check_smoothing(label_smoothing, upper=0.5, inclusive=True, loss="sigmoid")
    logits = beta * (chosen_logratio - rejected_logratio)
    loss = -F.logsigmoid(logits)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-logits)
    return loss


def robust_loss(
    chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float, label_smoothing: float
) -> Tensor:
    """Robust DPO (rDPO), Chowdhury, Kini & Natarajan 2024 (arXiv:2403.00409), the de-biased loss of Sec. 3.

        L = [-(1 - eps) * log sigma(beta * h) + eps * log sigma(-beta * h)] / (1 - 2 * eps)

    with eps the assumed label-flip rate (``label_smoothing``, must be < 0.5). Unlike cDPO it is an unbiased
    estimate of the clean DPO loss: (1 - eps) * L(h) + eps * L(-h) = -log sigma(beta * h). For eps > 0 it is
    unbounded below (it rewards pushing h up without limit), which is the paper's design, not a bug.
    """
    _check_beta(beta)
    _check_smoothing(label_smoothing, upper=0.5, inclusive=False, loss="robust")
    logits = beta * (chosen_logratio - rejected_logratio)
    clean = -(1.0 - label_smoothing) * F.logsigmoid(logits)
    flipped = label_smoothing * F.logsigmoid(-logits)
    return (clean + flipped) / (1.0 - 2.0 * label_smoothing)


def ipo_loss(
    chosen_logratio: Tensor,
    rejected_logratio: Tensor,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float,
) -> Tensor:
    """IPO, Azar et al. 2023 (arXiv:2310.12036), Eq. 17 with tau = ``beta``:

        L = (h_tok - 1 / (2 * beta)) ** 2,
        h_tok = (chosen_logratio / chosen_tokens) - (rejected_logratio / rejected_tokens)

    The log-ratios are length-normalised (mean per completion token), matching TRL, which averages the
    policy and reference log-probs per token for IPO. Why: the paper's h is a sequence-level quantity, but
    with summed token log-probs the squared loss and its fixed target 1/(2*beta) would scale with completion
    length, so beta would mean different things for short and long answers. Takes summed log-ratios and
    token counts; raises on zero-length completions (TRL clamps the count to 1 instead).
    """
    _check_beta(beta)
    h = _per_token(chosen_logratio, chosen_tokens, what="ipo") - _per_token(
        rejected_logratio, rejected_tokens, what="ipo"
    )
    return (h - 1.0 / (2.0 * beta)) ** 2


def hinge_loss(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float) -> Tensor:
    """SLiC-style hinge, Zhao et al. 2023 (SLiC-HF, arXiv:2305.10425), calibration loss max(0, delta - h).

    As in TRL, the reference-adjusted margin h is used and the margin is delta = 1/beta, scaled by beta:
        L = max(0, 1 - beta * h) = beta * max(0, 1/beta - h)
    """
    _check_beta(beta)
    return torch.relu(1.0 - beta * (chosen_logratio - rejected_logratio))


def bco_pair_loss(
    chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float, delta: float | Tensor = 0.0
) -> Tensor:
    """Paired Binary Classifier Optimization (BCO), Jung et al. 2024 (arXiv:2404.04656).

        L = -log sigma(beta * chosen_logratio - delta) - log sigma(-(beta * rejected_logratio - delta))

    Chosen and rejected are classified independently (chosen -> 1, rejected -> 0) against the reward shift
    ``delta``. Two registered names use this function:

    * ``bco_pair`` is TRL 1.16's ``bco_pair``: ``delta = 0`` (TRL 1.16 keeps no reward shift; its code is
      ``-logsigmoid(beta * chosen_logratios) - logsigmoid(-beta * rejected_logratios)``).
    * ``bco_pair_running`` is the paper's reward shift as earlier TRL versions kept it: ``delta`` is the
      running mean of every reward beta * logratio (chosen and rejected) of the steps before, over all ranks.
      This function is pure, so the caller owns that running mean (``PairTask.end_step`` updates it from the
      step's all-reduced ``rewards/chosen`` and ``rewards/rejected`` sums) and passes it in as ``bco_delta``.

    ``delta`` is treated as a constant (detached). Default 0 means no shift.
    """
    _check_beta(beta)
    if isinstance(delta, Tensor):
        delta = delta.detach()
    chosen_reward = beta * chosen_logratio - delta
    rejected_reward = beta * rejected_logratio - delta
    return -F.logsigmoid(chosen_reward) - F.logsigmoid(-rejected_reward)


def apo_zero_loss(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float) -> Tensor:
    """APO-zero, D'Oosterlinck et al. 2024 (arXiv:2408.06266), Eq. 7.

        L = (1 - sigma(beta * chosen_logratio)) + sigma(beta * rejected_logratio)

    Anchors each side at the reference: raise chosen likelihood, lower rejected. Use when chosen outputs are
    better than the model's own. 1 - sigma(x) is computed as sigma(-x) to avoid cancellation.
    """
    _check_beta(beta)
    return torch.sigmoid(-beta * chosen_logratio) + torch.sigmoid(beta * rejected_logratio)


def apo_down_loss(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float) -> Tensor:
    """APO-down, D'Oosterlinck et al. 2024 (arXiv:2408.06266), Eq. 8.

        L = sigma(beta * chosen_logratio) + (1 - sigma(beta * (chosen_logratio - rejected_logratio)))

    Lowers chosen likelihood and rejected likelihood more. Use when chosen outputs are worse than the model's
    own. 1 - sigma(x) is computed as sigma(-x).
    """
    _check_beta(beta)
    return torch.sigmoid(beta * chosen_logratio) + torch.sigmoid(
        -beta * (chosen_logratio - rejected_logratio)
    )


def simpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> Tensor:
    """SimPO, Meng, Xia & Chen 2024 (arXiv:2405.14734), Eq. 6. Reference-free and length-normalised:

        L = -log sigma(beta * (logp(y_w)/|y_w| - logp(y_l)/|y_l|) - gamma)

    ``gamma`` is the paper's absolute target margin gamma (same meaning as TRL's ``CPOConfig.simpo_gamma``).
    TRL's CPO code writes the same thing as beta * (delta - gamma/beta), i.e. it uses the ratio
    gamma/beta ("gamma_beta_ratio" in the SimPO reference code) internally; the loss value is identical.
    ``label_smoothing`` applies the cDPO-style smoothing that TRL's CPO trainer also applies to SimPO.
    """
    _check_beta(beta)
    _check_smoothing(label_smoothing, upper=0.5, inclusive=True, loss="simpo")
    if not math.isfinite(gamma):
        raise ValueError(f"simpo: gamma must be finite, got {gamma}")
    delta = _per_token(policy_chosen, chosen_tokens, what="simpo") - _per_token(
        policy_rejected, rejected_tokens, what="simpo"
    )
    logits = beta * delta - gamma
    loss = -F.logsigmoid(logits)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-logits)
    return loss


def _log_odds(mean_logp: Tensor) -> Tensor:
    """log(p / (1 - p)) for p = exp(mean_logp), stable for mean_logp near 0 and very negative."""
    x = mean_logp.clamp(max=_ORPO_MAX_MEAN_LOGP)
    # log(1 - e^x): log(-expm1(x)) is accurate near 0, log1p(-exp(x)) for x << 0 (Maechler 2012).
    # Both branches are finite with finite gradients on x <= -1e-6, so torch.where stays NaN-free.
    log1mexp = torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
    return x - log1mexp


def orpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float,
) -> Tensor:
    """ORPO, Hong, Lee & Thorne 2024 (arXiv:2403.07691), Eqs. 6-7. Reference-free; includes its own NLL.

        L = L_SFT + lambda * L_OR
        L_SFT = -logp(y_w) / |y_w|                       (per-token NLL of the chosen completion)
        L_OR  = -log sigma(log odds(y_w) - log odds(y_l)),  odds(y) = P(y) / (1 - P(y)),
        P(y)  = exp(logp(y) / |y|)                       (length-averaged likelihood)

    ``beta`` plays the role of lambda, as in TRL's ``ORPOConfig.beta``. Do not also add an ``nll`` term
    unless you want the chosen NLL counted twice. Differences from TRL: L_SFT here is a per-sequence token
    mean (as in the paper's Eq. 2) rather than TRL's token mean over the whole batch, and the mean log-prob
    is clamped to <= -1e-6 inside the odds (TRL is not clamped and gives NaN gradients at P == 1).
    """
    _check_beta(beta)
    chosen_mean = _per_token(policy_chosen, chosen_tokens, what="orpo")
    rejected_mean = _per_token(policy_rejected, rejected_tokens, what="orpo")
    odds_ratio_term = -F.logsigmoid(_log_odds(chosen_mean) - _log_odds(rejected_mean))
    return -chosen_mean + beta * odds_ratio_term


def nll_loss(policy_chosen: Tensor, chosen_tokens: Tensor) -> Tensor:
    """Negative log-likelihood of the chosen completion, normalised per token of that sequence:

        L_i = -logp(y_w,i) / |y_w,i|

    With weight alpha next to ``sigmoid`` this is RPO (Pang et al. 2024, arXiv:2404.19733; TRL's
    ``rpo_alpha``). Normalisation differs from TRL: TRL's rpo NLL is the cross-entropy averaged over all
    chosen tokens of the micro-batch, sum_i sum_t(-log p) / sum_i |y_w,i|, which weights long sequences more
    and depends on micro-batch composition. prefpack averages per sequence, so after the trainer's division
    by the pair count the step's NLL is the mean over pairs of per-sequence token means; the two agree when
    all chosen completions in a micro-batch have the same length. (Pang et al. normalise per sequence too,
    by prompt + completion length; prefpack uses completion tokens only.)
    """
    return -_per_token(policy_chosen, chosen_tokens, what="nll")
