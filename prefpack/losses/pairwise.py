"""Pairwise preference losses (DPO family, SimPO, ORPO, NLL) as pure functions.

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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from prefpack.loss_params import LOSS_PARAMS, LossParam

__all__ = [
    "LENGTH_NORMALISED_LOSSES",
    "LOSS_NAMES",
    "LOSS_PARAMS",
    "PAIR_LOSSES",
    "REFERENCE_FREE_LOSSES",
    "LossOutput",
    "LossParam",
    "LossTerm",
    "PairInputs",
    "PairLogps",
    "PairLossSpec",
    "BATCH_COUPLED_LOSSES",
    "F_DIVERGENCE_COMPATIBLE",
    "F_DIVERGENCE_LOSSES",
    "F_DIVERGENCES",
    "aot_loss",
    "aot_unpaired_loss",
    "apo_down_loss",
    "apo_zero_loss",
    "bco_pair_loss",
    "discopop_loss",
    "exo_pair_loss",
    "f_divergence_scores",
    "hinge_loss",
    "ipo_loss",
    "length_desensitised",
    "nca_pair_loss",
    "needs_reference",
    "nll_loss",
    "orpo_loss",
    "preference_loss",
    "register_pair_loss",
    "robust_loss",
    "sft_loss",
    "sigmoid_loss",
    "sigmoid_norm_loss",
    "simpo_loss",
    "sppo_hard_loss",
    "wpo_weights",
]

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
    parts of those sums over the tokens past the shorter completion of the pair (``prefpack.forward``'s
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
class LossTerm:
    """One weighted term of the total loss, e.g. ``LossTerm("sigmoid", 1.0)``.

    A weight of 0 is allowed: the term is still computed and logged under ``loss/<name>`` but does not train.
    """

    name: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in PAIR_LOSSES:
            raise ValueError(f"unknown loss {self.name!r}; valid names are: {', '.join(PAIR_LOSSES)}")
        if not math.isfinite(self.weight) or self.weight < 0:
            raise ValueError(f"loss {self.name!r}: weight must be finite and >= 0, got {self.weight}")


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
      running mean of every reward beta * logratio (chosen and rejected) seen so far. This function is pure,
      so the caller owns that running mean (``PairTask.after_micro_batch`` updates it from ``rewards/chosen``
      and ``rewards/rejected``) and passes it in as ``bco_delta``.

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


# --------------------------------------------------------------------------------------------------------
# TRL 1.16 DPOTrainer loss types (trl/trainer/dpo_trainer.py, `_compute_loss`), under TRL's names. Where TRL's
# code and the paper differ, the docstring says so and the code follows TRL.
# --------------------------------------------------------------------------------------------------------


def exo_pair_loss(
    chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float, label_smoothing: float
) -> Tensor:
    """EXO-pref for two completions, Ji et al. 2024, "Towards Efficient Exact Optimization of Language Model
    Alignment" (arXiv:2402.00856), Eq. 16 (the equation TRL cites), as TRL's ``exo_pair``:

        L = KL(q || p) = q_w * (log q_w - log(1 - eps)) + q_l * (log q_l - log eps),
        q_w = sigma(beta * h),  q_l = sigma(-beta * h),  p = (1 - eps, eps)

    i.e. the reverse KL from the policy's two-way distribution softmax(beta * logratio) over {chosen,
    rejected} to the label-smoothed preference distribution. ``label_smoothing`` is eps and must be in
    (0, 1): at eps = 0 the target puts zero mass on the rejected completion and log eps is -inf (TRL refuses
    eps = 0 for the same reason; the paper recommends eps = 1e-3). ``beta`` is the paper's beta_pi; the
    pairwise form has no separate reward temperature beta_r. Only the K = 2 preference form is implemented,
    not EXO with K > 2 sampled completions. (TRL builds eps as a float32 tensor, so its log(eps) and
    log(1 - eps) carry float32 rounding, about 1e-8 relative, even in a float64 run; here they are exact.)
    """
    _check_beta(beta)
    if not 0.0 < label_smoothing < 1.0:
        raise ValueError(
            f"exo_pair: label_smoothing (eps) must be in (0, 1), got {label_smoothing}; EXO's target puts eps on "
            "the rejected completion and log(0) is -inf (the EXO paper recommends 1e-3)"
        )
    logits = beta * (chosen_logratio - rejected_logratio)
    log_qw, log_ql = F.logsigmoid(logits), F.logsigmoid(-logits)
    qw, ql = torch.sigmoid(logits), torch.sigmoid(-logits)
    return qw * (log_qw - math.log1p(-label_smoothing)) + ql * (log_ql - math.log(label_smoothing))


def nca_pair_loss(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float) -> Tensor:
    """NCA for pairwise preferences, Chen et al. 2024, "Noise Contrastive Alignment of Language Models with
    Explicit Rewards" (arXiv:2402.05369), the binary-preference (K = 2) NCA loss, as TRL's ``nca_pair``:

        L = -log sigma(r_w) - 1/2 * log sigma(-r_w) - 1/2 * log sigma(-r_l),   r = beta * logratio

    Unlike DPO it scores each completion's absolute reward r (not only the margin), which keeps the chosen
    likelihood from falling. TRL's code cites no equation number; the formula above is TRL's code.
    """
    _check_beta(beta)
    chosen_reward = beta * chosen_logratio
    rejected_reward = beta * rejected_logratio
    return -F.logsigmoid(chosen_reward) - 0.5 * F.logsigmoid(-chosen_reward) - 0.5 * F.logsigmoid(-rejected_reward)


def sppo_hard_loss(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float) -> Tensor:
    """SPPO with hard probabilities, Wu et al. 2024, "Self-Play Preference Optimization for Language Model
    Alignment" (arXiv:2405.00675), Eq. (4.7) of Algorithm 1, as TRL's ``sppo_hard``:

        L = (chosen_logratio - 1 / (2 * beta))**2 + (rejected_logratio + 1 / (2 * beta))**2

    The paper's square loss is (log pi(y)/pi_t(y) - eta * (P(y > pi_t) - 1/2))**2 with P estimated by a
    preference model (PairRM) and eta = 1/beta. TRL's (and this) version sets the winner's P to 1 and the
    loser's to 0, so the targets are +-eta/2; the log-ratios are summed over completion tokens (not
    length-normalised), as in TRL.
    """
    _check_beta(beta)
    target = 0.5 / beta
    return (chosen_logratio - target) ** 2 + (rejected_logratio + target) ** 2


def _smoothed_logistic(logits: Tensor, label_smoothing: float) -> Tensor:
    loss = -F.logsigmoid(logits)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-logits)
    return loss


def aot_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> Tensor:
    """AOT, paired, Melnyk et al. 2024, "Distributional Preference Alignment of LLMs via Optimal Transport"
    (arXiv:2406.05882), as TRL's ``aot``: the policy's chosen-vs-rejected log-likelihood ratio should
    dominate the reference's in the first order, a 1-D optimal transport problem solved by sorting:

        m = sort(policy_chosen - policy_rejected),  m_ref = sort(ref_chosen - ref_rejected)  (over the pairs)
        L_j = -(1 - eps) * log sigma(beta * (m_j - m_ref_j)) - eps * log sigma(-beta * (m_j - m_ref_j))

    with the logistic cost and TRL's cDPO-style ``label_smoothing`` eps (the paper allows other convex
    costs and soft sorting; TRL implements hard sorting with this cost, and so does prefpack).

    Batch coupling. The per-pair values are not per pair: the sort couples every pair passed in the same
    call, and entry j belongs to the j-th order statistics, not to pair j. prefpack calls the loss once per
    micro-batch and divides the sum by the step's pair count, so the loss is TRL's exactly when a prefpack
    micro-batch holds the same pairs as one of TRL's per-device micro-batches (TRL too sorts within one
    forward pass, per device and per accumulation micro-batch, never over the whole optimizer batch).
    prefpack fills micro-batches up to a token budget (``train.micro_batch_tokens``), so the sort runs over a
    different and varying number of pairs than TRL's fixed ``per_device_train_batch_size``, and unlike every
    per-pair loss the result depends on how pairs are split into micro-batches (and ranks). A micro-batch of
    one pair reduces to the smoothed logistic loss of that pair's margins. Larger micro-batches estimate the
    distributional objective better (TRL's documentation: larger per-GPU batch sizes help).
    """
    _check_beta(beta)
    _check_smoothing(label_smoothing, upper=0.5, inclusive=True, loss="aot")
    margins, _ = torch.sort(policy_chosen - policy_rejected, dim=0)
    ref_margins, _ = torch.sort((ref_chosen - ref_rejected).detach(), dim=0)
    return _smoothed_logistic(beta * (margins - ref_margins), label_smoothing)


def aot_unpaired_loss(
    chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float, label_smoothing: float = 0.0
) -> Tensor:
    """AOT, unpaired, Melnyk et al. 2024 (arXiv:2406.05882), as TRL's ``aot_unpaired``: the distribution of
    chosen log-ratios should dominate that of rejected log-ratios in the first order (pairing is ignored):

        c = sort(chosen_logratio),  r = sort(rejected_logratio)   (each over the pairs)
        L_j = -(1 - eps) * log sigma(beta * (c_j - r_j)) - eps * log sigma(-beta * (c_j - r_j))

    Batch coupling exactly as for ``aot`` (see :func:`aot_loss`): entry j is the j-th order statistics, the
    sort runs over the pairs of one micro-batch, and the loss equals TRL's only when that micro-batch holds
    the same pairs as one of TRL's per-device micro-batches; it depends on how pairs are split.
    """
    _check_beta(beta)
    _check_smoothing(label_smoothing, upper=0.5, inclusive=True, loss="aot_unpaired")
    chosen_sorted, _ = torch.sort(chosen_logratio, dim=0)
    rejected_sorted, _ = torch.sort(rejected_logratio, dim=0)
    return _smoothed_logistic(beta * (chosen_sorted - rejected_sorted), label_smoothing)


def discopop_loss(chosen_logratio: Tensor, rejected_logratio: Tensor, beta: float, tau: float) -> Tensor:
    """DiscoPOP (log-ratio modulated loss, LRML), Lu et al. 2024, "Discovering Preference Optimization
    Algorithms with and for Large Language Models" (arXiv:2406.08414), Eq. 5 (the equation TRL cites), as
    TRL's ``discopop``:

        x = beta * h,  w = sigma(x / tau)
        L = (1 - w) * (-log sigma(x)) + w * exp(-x)

    a blend of the logistic (DPO) and exponential losses, weighted by the log-ratio difference itself.
    ``tau`` is ``loss.discopop_tau`` (TRL's ``discopop_tau``, default 0.05, the paper's value). The
    exponential term is evaluated as exp(log sigma(x / tau) - x), which is the same number wherever TRL's
    ``exp(-x) * sigma(x / tau)`` is finite; TRL's form overflows to inf * 0 = NaN for very negative x (about
    x < -89 in float32), this one stays finite for tau < 1 (it decays like exp(x * (1/tau - 1))).
    """
    _check_beta(beta)
    if not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"discopop: tau (loss.discopop_tau) must be finite and > 0, got {tau}")
    logits = beta * (chosen_logratio - rejected_logratio)
    logistic = -F.logsigmoid(logits)
    exponential = torch.exp(F.logsigmoid(logits / tau) - logits)  # = sigma(x / tau) * exp(-x)
    return torch.sigmoid(-logits / tau) * logistic + exponential


def sigmoid_norm_loss(
    chosen_logratio: Tensor,
    rejected_logratio: Tensor,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float,
) -> Tensor:
    """Length-normalised DPO, as TRL's ``sigmoid_norm``: DPO on log-ratios averaged per completion token,

        L = -log sigma(beta * (chosen_logratio / |y_w| - rejected_logratio / |y_l|))

    This is the length-normalised DPO of the Tulu 3 report, Lambert et al. 2024 (arXiv:2411.15124),
    Sec. 5.1.2, Eq. 6 (the source named by the TRL pull request that added it; Tulu 3 credits SimPO, Meng et al.
    2024, arXiv:2405.14734, Sec. 2.2). It keeps the reference model, unlike SimPO. Difference from TRL: TRL
    clamps a zero token count to 1; prefpack raises on a zero-length completion (see the module notes).
    """
    _check_beta(beta)
    h = _per_token(chosen_logratio, chosen_tokens, what="sigmoid_norm") - _per_token(
        rejected_logratio, rejected_tokens, what="sigmoid_norm"
    )
    return -F.logsigmoid(beta * h)


def sft_loss(policy_chosen: Tensor, chosen_tokens: Tensor) -> Tensor:
    """TRL's ``sft`` term: the NLL of the chosen completions as one token mean over the pairs passed in.

    TRL 1.16 computes, per forward pass (one per-device micro-batch of B pairs),
        L_TRL = -sum_i logp(y_w,i) / sum_i |y_w,i|                (mean over every chosen completion token)
    and broadcasts that scalar to the B pairs. prefpack sums per-pair values and divides by the step's pair
    count, so the per-pair value here is the same token mean rescaled by the number of pairs P in the call:
        L_i = -logp(y_w,i) * P / sum_j |y_w,j|                    (j over the P pairs of the call)
    so that mean_i L_i = L_TRL exactly for the pairs given together, and each pair's gradient weight is
    P / sum_j |y_w,j| (longer completions weigh more, as in a token mean). Over a step, prefpack's value is
    sum_mb (P_mb / P_step) * L_TRL(mb): the pair-weighted mean of micro-batch token means, which is what TRL
    computes across accumulation steps and devices (its micro-batches all have B pairs). So it equals TRL's
    ``sft`` when prefpack's micro-batches hold the same pairs as TRL's; with packing to a token budget they
    generally do not, and the value depends on how pairs are split into micro-batches. For an NLL that does
    not depend on the split, use ``nll`` (each sequence's own token mean).

    Raises on a zero-length chosen completion (TRL would just count zero tokens for it), like every
    length-normalised loss here, so that whether a run raises does not depend on micro-batch composition.
    The MPO recipe (Wang et al. 2024, arXiv:2411.10442) combines ``sigmoid``, ``bco_pair`` and ``sft``.
    """
    _per_token(policy_chosen, chosen_tokens, what="sft")  # refuses zero-length chosen completions
    total_tokens = chosen_tokens.to(policy_chosen.dtype).sum()
    return -policy_chosen * (policy_chosen.shape[0] / total_tokens)


# --------------------------------------------------------------------------------------------------------
# f-divergence regularisers (f-DPO)
# --------------------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------------------
# Combined entry point
# --------------------------------------------------------------------------------------------------------


def needs_reference(terms: Sequence[LossTerm]) -> bool:
    """Whether any term reads reference log-probs (so the trainer must run or precompute the reference)."""
    return any(PAIR_LOSSES[term.name].needs_reference for term in terms)


def _reward_kind(terms: Sequence[LossTerm], has_reference: bool) -> str:
    """How ``rewards/*`` are defined: by the first term that defines rewards; see ``preference_loss``."""
    for term in terms:
        kind = PAIR_LOSSES[term.name].rewards
        if kind is not None:
            return kind
    return "logratio" if has_reference else "logp"


def length_desensitised(total: Tensor, tail: Tensor, alpha: float) -> Tensor:
    """LD-DPO's log-prob (Liu et al. 2024, arXiv:2409.06411, Eq. 9; TRL 1.16's ``ld_alpha``): the tokens up to the
    shorter completion's length count fully, the rest with weight ``alpha``:

        logp_LD = sum_{t <= l_p} log p_t + alpha * sum_{t > l_p} log p_t = total - (1 - alpha) * tail

    with ``l_p = min(|y_w|, |y_l|)`` of the pair and ``tail`` the sum over ``t > l_p``."""
    return total - (1.0 - alpha) * tail


def wpo_weights(chosen_mean: Tensor, rejected_mean: Tensor) -> Tensor:
    """WPO's pair weight (Zhou et al. 2024, arXiv:2406.11827, Eq. 2, as TRL 1.16's ``use_weighting``): the product
    of the chosen and rejected completions' ``exp(mean_t [log p_t - log sum_v p_v^2])`` (``prefpack.forward``'s
    ``wpo_mean``; the probabilities renormalised by the policy's own sampling concentration). No gradient, no
    clamp (TRL 1.16 has none)."""
    return torch.exp(chosen_mean.detach() + rejected_mean.detach())


def preference_loss(
    logps: PairLogps,
    terms: Sequence[LossTerm],
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    bco_delta: float | Tensor = 0.0,
    discopop_tau: float = LOSS_PARAMS["discopop_tau"].default,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = LOSS_PARAMS["f_alpha_divergence_coef"].default,
    ld_alpha: float | None = None,
    pair_weights: Tensor | None = None,
) -> LossOutput:
    """Weighted sum of the configured loss terms, per pair, plus detached per-pair metrics.

    ``terms`` e.g. ``[LossTerm("sigmoid", 1.0), LossTerm("nll", 0.2)]`` (= RPO). Each name may appear once.
    ``beta`` is shared by all terms (it is lambda for ``orpo``); ``label_smoothing`` is eps for ``sigmoid``,
    ``sigmoid_ref_free``, ``simpo``, ``aot``, ``aot_unpaired`` (cDPO smoothing), ``robust`` (flip rate) and
    ``exo_pair`` (target mass on the rejected completion); ``simpo_gamma`` is SimPO's absolute margin;
    ``bco_delta`` is the caller-owned running reward mean for ``bco_pair_running`` (``bco_pair`` ignores it);
    ``discopop_tau`` is DiscoPOP's temperature. ``ld_alpha`` (LD-DPO, :func:`length_desensitised`) replaces every
    policy and reference sum by its length-desensitised form (the ``*_tail`` fields are then required) in every term
    except ``nll`` and ``sft``, which stay token means of the plain sums (as TRL's ``sft`` reads raw token log-probs).
    ``pair_weights`` (WPO, :func:`wpo_weights`, detached) multiply each pair's total; for ``sft``, whose TRL value is
    one scalar per micro-batch, they multiply that scalar (so the micro-batch mean is TRL's ``mean(w) * sft``).
    ``loss/<name>`` metrics are the terms as weighted; ``wpo/weight`` is logged when weights are given.
    ``f_divergence_type`` (``F_DIVERGENCES``) replaces the log-ratios
    by their f-DPO scores ``f_divergence_scores`` in the terms that TRL 1.16 generalises (``F_DIVERGENCE_LOSSES``);
    with any other term (except the reference-free auxiliary ``nll``/``sft``) a value other than ``reverse_kl``
    raises. ``f_alpha_divergence_coef`` is alpha of ``alpha_divergence``. Reward metrics stay beta * log-ratio.

    Reward metrics follow the first non-``nll`` term (so they mean the same thing as in TRL's trainer for it):
      * reference-based losses: beta * (policy - ref), completion sums (TRL DPOTrainer; for ``ipo`` too);
      * ``simpo`` / ``orpo``: beta * policy / tokens (mean token log-prob; TRL CPOTrainer / ORPOTrainer);
      * ``sigmoid_ref_free``: beta * policy (the DPO reward with the reference taken as 0);
      * only ``nll``: beta * (policy - ref) if the reference is given, else beta * policy.
    ``rewards/accuracies`` is (chosen reward > rejected reward) as float. The ``nll`` metric always divides
    by max(tokens, 1) so an empty completion cannot make the metric NaN (the ``nll`` loss term still raises).
    """
    if not terms:
        raise ValueError(f"no loss terms given; choose from: {', '.join(PAIR_LOSSES)}")
    names = [term.name for term in terms]
    for name in names:
        if name not in PAIR_LOSSES:  # LossTerm validates too; this guards duck-typed terms
            raise ValueError(f"unknown loss {name!r}; valid names are: {', '.join(PAIR_LOSSES)}")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"loss terms listed more than once: {', '.join(duplicates)}; merge their weights")
    _check_beta(beta)
    if f_divergence_type not in F_DIVERGENCES:
        raise ValueError(f"unknown f-divergence {f_divergence_type!r}; choose one of: {', '.join(F_DIVERGENCES)}")
    if f_divergence_type != "reverse_kl":
        refused = [name for name in names if name not in F_DIVERGENCE_COMPATIBLE]
        if refused:
            raise ValueError(f"f_divergence_type {f_divergence_type!r} works only with the losses "
                             f"{', '.join(sorted(F_DIVERGENCE_LOSSES))} (as in TRL 1.16; nll and sft may be added); "
                             f"{', '.join(refused)} {'has' if len(refused) == 1 else 'have'} no f-divergence form")
    missing_ref = [name for name in names if PAIR_LOSSES[name].needs_reference]
    if missing_ref and not logps.has_reference:
        raise ValueError(
            f"loss {', '.join(repr(n) for n in missing_ref)} needs reference log-probs but ref_chosen/"
            f"ref_rejected are None; provide them or use a reference-free loss "
            f"({', '.join(sorted(n for n, spec in PAIR_LOSSES.items() if not spec.needs_reference))})"
        )

    pc, pr = logps.policy_chosen, logps.policy_rejected
    nc, nr = logps.chosen_tokens, logps.rejected_tokens
    plain_chosen = pc
    ref_chosen, ref_rejected = logps.ref_chosen, logps.ref_rejected
    if ld_alpha is not None:
        if not (math.isfinite(ld_alpha) and 0.0 <= ld_alpha <= 1.0):
            raise ValueError(f"ld_alpha must be in [0, 1], got {ld_alpha}")
        tails = [logps.policy_chosen_tail, logps.policy_rejected_tail]
        if logps.has_reference:
            tails += [logps.ref_chosen_tail, logps.ref_rejected_tail]
        if any(t is None for t in tails):
            raise ValueError("ld_alpha needs the tail sums of every policy (and reference) log-prob in PairLogps")
        pc = length_desensitised(pc, logps.policy_chosen_tail, ld_alpha)
        pr = length_desensitised(pr, logps.policy_rejected_tail, ld_alpha)
        if logps.has_reference:
            ref_chosen = length_desensitised(ref_chosen, logps.ref_chosen_tail, ld_alpha)
            ref_rejected = length_desensitised(ref_rejected, logps.ref_rejected_tail, ld_alpha)
    if pair_weights is not None:
        if pair_weights.shape != pc.shape:
            raise ValueError(f"pair_weights has shape {tuple(pair_weights.shape)}, expected {tuple(pc.shape)}")
        sorting = [name for name in names if name in ("aot", "aot_unpaired")]
        if sorting:
            raise ValueError(f"pair weights (WPO) cannot weight {', '.join(sorting)}: those losses sort the pairs, "
                             "so a pair's weight would meet another pair's loss")
        pair_weights = pair_weights.detach().to(pc.dtype)
    if logps.has_reference:
        assert ref_chosen is not None and ref_rejected is not None
        chosen_lr = pc - ref_chosen.detach()
        rejected_lr = pr - ref_rejected.detach()
    else:
        chosen_lr = rejected_lr = None
    chosen_score, rejected_score = chosen_lr, rejected_lr  # reverse_kl: the log-ratios themselves
    if chosen_lr is not None and f_divergence_type != "reverse_kl":
        chosen_score = f_divergence_scores(chosen_lr, f_divergence_type, f_alpha_divergence_coef)
        rejected_score = f_divergence_scores(rejected_lr, f_divergence_type, f_alpha_divergence_coef)

    inputs = PairInputs(pc, pr, nc, nr, chosen_lr, rejected_lr, beta=beta, label_smoothing=label_smoothing,
                        simpo_gamma=simpo_gamma, bco_delta=bco_delta, discopop_tau=discopop_tau,
                        ref_chosen=None if ref_chosen is None else ref_chosen.detach(),
                        ref_rejected=None if ref_rejected is None else ref_rejected.detach(),
                        chosen_score=chosen_score, rejected_score=rejected_score, policy_chosen_plain=plain_chosen)
    total = torch.zeros_like(pc)
    metrics: dict[str, Tensor] = {}
    for term in terms:
        name = term.name
        value = PAIR_LOSSES[name].compute(inputs)
        if pair_weights is not None:
            value = pair_weights * (value.mean() if PAIR_LOSSES[name].micro_batch_scalar else value)
        total = total + term.weight * value
        metrics[f"loss/{name}"] = value.detach()
    if pair_weights is not None:
        metrics["wpo/weight"] = pair_weights

    with torch.no_grad():
        kind = _reward_kind(terms, logps.has_reference)
        if kind == "logratio":
            chosen_reward, rejected_reward = beta * chosen_lr, beta * rejected_lr
        elif kind == "mean_logp":
            chosen_reward = beta * pc / nc.to(pc.dtype)
            rejected_reward = beta * pr / nr.to(pr.dtype)
        else:
            chosen_reward, rejected_reward = beta * pc, beta * pr
        metrics["rewards/chosen"] = chosen_reward.detach()
        metrics["rewards/rejected"] = rejected_reward.detach()
        metrics["rewards/margins"] = (chosen_reward - rejected_reward).detach()
        metrics["rewards/accuracies"] = (chosen_reward > rejected_reward).to(pc.dtype)
        metrics["logps/chosen"] = pc.detach()
        metrics["logps/rejected"] = pr.detach()
        metrics["nll"] = (-plain_chosen / nc.clamp(min=1).to(pc.dtype)).detach()
    return LossOutput(loss=total, metrics=metrics)


# --------------------------------------------------------------------------------------------------------
# The registry: one entry per loss name. Adding a loss = a pure function above + one register_pair_loss call
# below (+ its float64 test); config validation, `prefpack eval`, the reference decision and the reward
# metrics read everything from here.
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairInputs:
    """What a pair loss may read: per-pair ``[P]`` tensors (log-ratios None without a reference) and the
    shared ``loss.*`` parameters."""

    policy_chosen: Tensor
    policy_rejected: Tensor
    chosen_tokens: Tensor
    rejected_tokens: Tensor
    chosen_logratio: Tensor | None
    rejected_logratio: Tensor | None
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    bco_delta: float | Tensor = 0.0
    discopop_tau: float = LOSS_PARAMS["discopop_tau"].default
    ref_chosen: Tensor | None = None  # detached reference sums (``aot`` sorts reference margins itself)
    ref_rejected: Tensor | None = None
    # f-DPO scores f'(pi/ref) of the log-ratios (``f_divergence_scores``); the log-ratios under reverse_kl
    chosen_score: Tensor | None = None
    rejected_score: Tensor | None = None
    # the chosen sum without LD-DPO's weighting (``nll`` and ``sft`` are token means of it); policy_chosen otherwise
    policy_chosen_plain: Tensor | None = None

    def __post_init__(self) -> None:
        if self.chosen_score is None and self.rejected_score is None:  # reverse_kl: the log-ratios themselves
            object.__setattr__(self, "chosen_score", self.chosen_logratio)
            object.__setattr__(self, "rejected_score", self.rejected_logratio)
        if self.policy_chosen_plain is None:
            object.__setattr__(self, "policy_chosen_plain", self.policy_chosen)


@dataclass(frozen=True)
class PairLossSpec:
    """A registered pair loss.

    ``rewards``: how ``rewards/*`` are defined when this is the first term that defines them: ``logratio``
    (beta * (policy - ref), TRL's DPOTrainer), ``mean_logp`` (beta * policy / tokens, TRL's CPO/ORPO),
    ``logp`` (beta * policy), or None (an auxiliary term such as ``nll``). ``params``: the ``loss.*``
    parameters it reads (see ``LOSS_PARAMS``). ``batch_coupled``: the values of one call depend on every pair
    in it (a sort, a token mean over the call), so the loss depends on how pairs are split into micro-batches.
    ``f_divergence``: it is built on the chosen - rejected reward difference and reads the f-DPO scores
    (``PairInputs.chosen_score``) in place of the log-ratios, so ``loss.f_divergence_type`` applies to it (TRL 1.16's
    list: sigmoid, sigmoid_norm, hinge, ipo, exo_pair, robust, discopop). ``micro_batch_scalar``: TRL's value is
    one scalar per micro-batch spread over its pairs (``sft``), so WPO's pair weights multiply that scalar.
    """

    name: str
    compute: Callable[[PairInputs], Tensor]
    needs_reference: bool
    rewards: str | None
    params: tuple[str, ...] = ("beta",)
    length_normalised: bool = False
    summary: str = ""
    batch_coupled: bool = False
    f_divergence: bool = False
    micro_batch_scalar: bool = False


PAIR_LOSSES: dict[str, PairLossSpec] = {}


def register_pair_loss(spec: PairLossSpec) -> PairLossSpec:
    if spec.name in PAIR_LOSSES:
        raise ValueError(f"pair loss {spec.name!r} is registered twice")
    unknown = [p for p in spec.params if p not in LOSS_PARAMS]
    if unknown:
        raise ValueError(f"pair loss {spec.name!r} reads unknown parameters {unknown}; add them to LOSS_PARAMS")
    PAIR_LOSSES[spec.name] = spec
    return spec


for _spec in (
    PairLossSpec("sigmoid", lambda x: sigmoid_loss(x.chosen_score, x.rejected_score, x.beta, x.label_smoothing),
                 True, "logratio", ("beta", "label_smoothing"), summary="DPO; cDPO with label_smoothing",
                 f_divergence=True),
    PairLossSpec("sigmoid_ref_free", lambda x: sigmoid_loss(x.policy_chosen, x.policy_rejected, x.beta,
                                                            x.label_smoothing),
                 False, "logp", ("beta", "label_smoothing"), summary="DPO with the reference taken as 0"),
    PairLossSpec("robust", lambda x: robust_loss(x.chosen_score, x.rejected_score, x.beta, x.label_smoothing),
                 True, "logratio", ("beta", "label_smoothing"), summary="robust DPO (label-flip rate)",
                 f_divergence=True),
    PairLossSpec("ipo", lambda x: ipo_loss(x.chosen_score, x.rejected_score, x.chosen_tokens,
                                           x.rejected_tokens, x.beta),
                 True, "logratio", length_normalised=True, summary="IPO, per-token log-ratios", f_divergence=True),
    PairLossSpec("hinge", lambda x: hinge_loss(x.chosen_score, x.rejected_score, x.beta),
                 True, "logratio", summary="SLiC hinge", f_divergence=True),
    PairLossSpec("bco_pair", lambda x: bco_pair_loss(x.chosen_logratio, x.rejected_logratio, x.beta),
                 True, "logratio", summary="paired BCO without reward shift (TRL 1.16)"),
    PairLossSpec("bco_pair_running", lambda x: bco_pair_loss(x.chosen_logratio, x.rejected_logratio, x.beta,
                                                             x.bco_delta),
                 True, "logratio", summary="paired BCO with a running-mean reward shift"),
    PairLossSpec("apo_zero", lambda x: apo_zero_loss(x.chosen_logratio, x.rejected_logratio, x.beta),
                 True, "logratio", summary="APO-zero"),
    PairLossSpec("apo_down", lambda x: apo_down_loss(x.chosen_logratio, x.rejected_logratio, x.beta),
                 True, "logratio", summary="APO-down"),
    PairLossSpec("simpo", lambda x: simpo_loss(x.policy_chosen, x.policy_rejected, x.chosen_tokens,
                                               x.rejected_tokens, x.beta, x.simpo_gamma, x.label_smoothing),
                 False, "mean_logp", ("beta", "simpo_gamma", "label_smoothing"), length_normalised=True,
                 summary="SimPO, reference-free"),
    PairLossSpec("orpo", lambda x: orpo_loss(x.policy_chosen, x.policy_rejected, x.chosen_tokens,
                                             x.rejected_tokens, x.beta),
                 False, "mean_logp", length_normalised=True, summary="ORPO (includes its NLL)"),
    PairLossSpec("nll", lambda x: nll_loss(x.policy_chosen_plain, x.chosen_tokens), False, None, (),
                 length_normalised=True, summary="NLL of the chosen completion (RPO with sigmoid)"),
    PairLossSpec("exo_pair", lambda x: exo_pair_loss(x.chosen_score, x.rejected_score, x.beta,
                                                     x.label_smoothing),
                 True, "logratio", ("beta", "label_smoothing"), summary="EXO, pairwise (label_smoothing > 0)",
                 f_divergence=True),
    PairLossSpec("nca_pair", lambda x: nca_pair_loss(x.chosen_logratio, x.rejected_logratio, x.beta),
                 True, "logratio", summary="NCA, pairwise"),
    PairLossSpec("sppo_hard", lambda x: sppo_hard_loss(x.chosen_logratio, x.rejected_logratio, x.beta),
                 True, "logratio", summary="SPPO with hard win probabilities"),
    PairLossSpec("aot", lambda x: aot_loss(x.policy_chosen, x.policy_rejected, x.ref_chosen, x.ref_rejected,
                                           x.beta, x.label_smoothing),
                 True, "logratio", ("beta", "label_smoothing"), batch_coupled=True,
                 summary="AOT, paired (sorts within the micro-batch)"),
    PairLossSpec("aot_unpaired", lambda x: aot_unpaired_loss(x.chosen_logratio, x.rejected_logratio, x.beta,
                                                             x.label_smoothing),
                 True, "logratio", ("beta", "label_smoothing"), batch_coupled=True,
                 summary="AOT, unpaired (sorts within the micro-batch)"),
    PairLossSpec("discopop", lambda x: discopop_loss(x.chosen_score, x.rejected_score, x.beta,
                                                     x.discopop_tau),
                 True, "logratio", ("beta", "discopop_tau"), summary="DiscoPOP (log-ratio modulated)",
                 f_divergence=True),
    PairLossSpec("sigmoid_norm", lambda x: sigmoid_norm_loss(x.chosen_score, x.rejected_score,
                                                             x.chosen_tokens, x.rejected_tokens, x.beta),
                 True, "logratio", length_normalised=True, summary="DPO on per-token log-ratios",
                 f_divergence=True),
    PairLossSpec("sft", lambda x: sft_loss(x.policy_chosen_plain, x.chosen_tokens), False, None, (),
                 length_normalised=True, batch_coupled=True, micro_batch_scalar=True,
                 summary="chosen NLL as one token mean over the micro-batch (TRL's sft)"),
):
    register_pair_loss(_spec)

LOSS_NAMES: tuple[str, ...] = tuple(PAIR_LOSSES)
"""Every pair loss name accepted by :class:`LossTerm` (a view of ``PAIR_LOSSES``)."""

REFERENCE_FREE_LOSSES: frozenset[str] = frozenset(n for n, s in PAIR_LOSSES.items() if not s.needs_reference)
"""Losses that never read the reference log-probs (all others raise if they are missing)."""

LENGTH_NORMALISED_LOSSES: frozenset[str] = frozenset(n for n, s in PAIR_LOSSES.items() if s.length_normalised)
"""Losses that divide by the completion token count and therefore reject zero-length completions."""

BATCH_COUPLED_LOSSES: frozenset[str] = frozenset(n for n, s in PAIR_LOSSES.items() if s.batch_coupled)
"""Losses whose values depend on every pair of the call (one micro-batch), so on how pairs are split."""

F_DIVERGENCE_LOSSES: frozenset[str] = frozenset(n for n, s in PAIR_LOSSES.items() if s.f_divergence)
"""Losses that read the f-DPO scores, so ``loss.f_divergence_type`` changes them (TRL 1.16's list)."""

F_DIVERGENCE_COMPATIBLE: frozenset[str] = F_DIVERGENCE_LOSSES | frozenset(
    n for n, s in PAIR_LOSSES.items() if s.rewards is None)
"""Losses allowed beside a non-default ``loss.f_divergence_type``: the f-DPO ones and the auxiliary terms that read
no log-ratio (``nll``, ``sft``; TRL allows its ``sft`` too). Every other loss is refused, as TRL refuses it."""
