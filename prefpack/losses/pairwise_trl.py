"""The pair losses TRL 1.16 added to the DPO family, as pure functions: EXO, NCA, SPPO (hard), AOT (paired and
unpaired), DiscoPOP, sigmoid_norm and TRL's ``sft`` term. Conventions as in ``prefpack.losses.pairwise``; the
batch-coupled ones (``aot``, ``aot_unpaired``, ``sft``) combine every pair of one call, as TRL's do."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from prefpack.losses.pairwise import _check_beta, _check_smoothing, _per_token

__all__ = ["aot_loss", "aot_unpaired_loss", "discopop_loss", "exo_pair_loss", "nca_pair_loss", "sft_loss",
           "sigmoid_norm_loss", "sppo_hard_loss"]


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
