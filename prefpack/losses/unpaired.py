"""Unpaired preference losses (KTO, APO-zero unpaired) as pure functions.

Every example is one (prompt, completion, label) with ``label`` True for a desirable completion and False
for an undesirable one. The inputs are per-example log-prob sums over the completion tokens; the outputs
are one loss value per example (shape ``[N]``, never reduced), so the trainer can divide by the number of
examples in the whole optimizer step, whatever the packing. Nothing here reads model outputs, keeps state
or syncs across devices: the KL reference point ``z0`` is computed by the caller (over the whole step and
all ranks, see ``prefpack.objectives.kto``) and passed in as a detached number.

Conventions (as in ``prefpack.losses.pairwise``):

* ``logratio r = policy_logp - ref_logp`` (sums over completion tokens), reference detached.
* ``1 - sigmoid(x)`` is computed as ``sigmoid(-x)`` (no cancellation for large x).
* Computation stays in the input dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from prefpack.losses.pairwise import LossOutput

__all__ = [
    "KTO_RECOMMENDED_RATIO",
    "UNPAIRED_LOSSES_WITH_KL",
    "UNPAIRED_LOSSES",
    "UNPAIRED_LOSS_NAMES",
    "UnpairedLossSpec",
    "UnpairedLogps",
    "apo_zero_unpaired_loss",
    "class_balance_warning",
    "kl_reference_point",
    "kto_loss",
    "unpaired_loss",
]


@dataclass(frozen=True)
class UnpairedLossSpec:
    """An unpaired loss as the docs list it: what it is, the ``loss.*`` parameters it reads, whether it reads the
    KL reference point z0, and its source (``paper``: 'Authors year, "Title"'; ``arxiv``: the id)."""

    name: str
    summary: str
    params: tuple[str, ...]
    reads_kl: bool
    paper: str
    arxiv: str


_APO = ("D'Oosterlinck et al. 2024, \"Anchored Preference Optimization and Contrastive Revisions: Addressing "
        "Underspecification in Alignment\"")
UNPAIRED_LOSSES: dict[str, UnpairedLossSpec] = {s.name: s for s in (
    UnpairedLossSpec("kto", "KTO: each example against the KL reference point z0", ("beta", "desirable_weight",
                     "undesirable_weight"), True, 'Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect '
                     'Theoretic Optimization"', "2402.01306"),
    UnpairedLossSpec("apo_zero_unpaired", "APO-zero per example, anchored at the reference (no z0)",
                     ("beta", "desirable_weight", "undesirable_weight"), False, _APO, "2408.06266"),
)}

UNPAIRED_LOSS_NAMES: tuple[str, ...] = tuple(UNPAIRED_LOSSES)
"""Losses of unpaired (prompt, completion, label) examples; they need a reference model."""

UNPAIRED_LOSSES_WITH_KL: frozenset[str] = frozenset(n for n, s in UNPAIRED_LOSSES.items() if s.reads_kl)
"""Unpaired losses that read the KL reference point z0 (and so need the extra KL forward)."""

KTO_RECOMMENDED_RATIO: tuple[float, float] = (1.0, 4.0 / 3.0)
"""KTO paper Eq. 8: desirable_weight * n_D / (undesirable_weight * n_U) should lie in this range."""


def _check_beta(beta: float) -> None:
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta must be finite and > 0, got {beta}")


def _check_weights(desirable_weight: float, undesirable_weight: float) -> None:
    for name, w in (("desirable_weight", desirable_weight), ("undesirable_weight", undesirable_weight)):
        if not (math.isfinite(w) and w > 0):
            raise ValueError(f"{name} must be finite and > 0, got {w}")


def _label_mask(label: Tensor, like: Tensor) -> Tensor:
    if label.shape != like.shape:
        raise ValueError(f"label has shape {tuple(label.shape)}, expected {tuple(like.shape)}")
    return label.to(device=like.device, dtype=torch.bool)


def _class_weights(like: Tensor, desirable: Tensor, w_d: float, w_u: float) -> Tensor:
    """w_D where desirable, w_U elsewhere, in the dtype of ``like`` (no float32 rounding of the weights)."""
    return torch.full_like(like, float(w_u)).masked_fill(desirable, float(w_d))


def kto_loss(
    logratio: Tensor,
    label: Tensor,
    kl: float | Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> Tensor:
    """KTO, Ethayarajh et al. 2024 (arXiv:2402.01306), Eq. 7 (the loss form of TRL's ``loss_type="kto"``):

        desirable:    L = w_D * (1 - sigma(beta * (r - z0)))
        undesirable:  L = w_U * (1 - sigma(beta * (z0 - r)))

    ``r = policy - reference`` (completion sums) per example, ``label`` True for desirable, ``kl`` the
    reference point z0 = max(0, E[policy - reference] over mismatched prompt/completion pairs), treated as
    a constant (detached). The paper's lambda_D / lambda_U are ``desirable_weight`` / ``undesirable_weight``
    (TRL's names). The paper writes L = lambda_y - v(x, y); the constant lambda_y is dropped (it changes
    no gradient), so the loss lies in [0, w].
    """
    _check_beta(beta)
    _check_weights(desirable_weight, undesirable_weight)
    desirable = _label_mask(label, logratio)
    if isinstance(kl, Tensor):
        kl = kl.detach().to(logratio.dtype)
    margin = beta * (logratio - kl)
    # 1 - sigma(m) = sigma(-m) for desirable; 1 - sigma(-m) = sigma(m) for undesirable.
    value = torch.sigmoid(torch.where(desirable, -margin, margin))
    return _class_weights(value, desirable, desirable_weight, undesirable_weight) * value


def apo_zero_unpaired_loss(
    logratio: Tensor,
    label: Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> Tensor:
    """APO-zero, unpaired variant, D'Oosterlinck et al. 2024 (arXiv:2408.06266), Eq. 7 applied per example
    (TRL's ``loss_type="apo_zero_unpaired"``):

        desirable:    L = w_D * (1 - sigma(beta * r))
        undesirable:  L = w_U * sigma(beta * r)

    Anchors each example at the reference (no KL reference point): raise the likelihood of desirable
    completions, lower that of undesirable ones. Weights as in :func:`kto_loss` (TRL applies them too).
    """
    _check_beta(beta)
    _check_weights(desirable_weight, undesirable_weight)
    desirable = _label_mask(label, logratio)
    z = beta * logratio
    value = torch.sigmoid(torch.where(desirable, -z, z))
    return _class_weights(value, desirable, desirable_weight, undesirable_weight) * value


def kl_reference_point(kl_sum: float | Tensor, kl_count: float | Tensor) -> float:
    """z0 = max(0, kl_sum / kl_count): the KTO reference point from the sum of ``policy - reference`` over
    the KL sequences and their count (both already summed over every micro-batch and rank). 0 when there
    are no KL sequences. Returns a plain float (detached by construction)."""
    s, c = float(kl_sum), float(kl_count)
    if c <= 0:
        return 0.0
    return max(0.0, s / c)


def class_balance_warning(
    n_desirable: int, n_undesirable: int, desirable_weight: float = 1.0, undesirable_weight: float = 1.0
) -> str | None:
    """A warning (or None) when the weighted class ratio is outside KTO's recommended range.

    KTO paper, Eq. 8: with n_D desirable and n_U undesirable examples, choose the weights so that
    ``w_D * n_D / (w_U * n_U)`` lies in [1, 4/3]. The message gives the ranges of ``desirable_weight``
    (keeping ``undesirable_weight``) and of ``undesirable_weight`` (keeping ``desirable_weight``) that do.
    """
    if n_desirable <= 0 or n_undesirable <= 0:
        missing = "desirable" if n_desirable <= 0 else "undesirable"
        return (f"the data holds no {missing} examples ({n_desirable} desirable, {n_undesirable} undesirable); "
                "KTO learns from both classes")
    lo, hi = KTO_RECOMMENDED_RATIO
    ratio = desirable_weight * n_desirable / (undesirable_weight * n_undesirable)
    if lo - 1e-9 <= ratio <= hi + 1e-9:
        return None
    d_lo = lo * undesirable_weight * n_undesirable / n_desirable
    d_hi = hi * undesirable_weight * n_undesirable / n_desirable
    u_lo = desirable_weight * n_desirable / (hi * n_undesirable)
    u_hi = desirable_weight * n_desirable / (lo * n_undesirable)
    return (f"imbalanced KTO classes: {n_desirable} desirable and {n_undesirable} undesirable examples give "
            f"desirable_weight * n_D / (undesirable_weight * n_U) = {ratio:.3f}, outside the recommended "
            f"[1, 4/3] (KTO paper, Eq. 8); set loss.desirable_weight in [{d_lo:.3g}, {d_hi:.3g}] or "
            f"loss.undesirable_weight in [{u_lo:.3g}, {u_hi:.3g}]")


@dataclass(frozen=True)
class UnpairedLogps:
    """Per-example completion log-prob sums; every tensor has shape ``[N]``.

    ``label`` is True for desirable examples. ``tokens`` are the completion token counts (for the
    per-token NLL metric only).
    """

    policy: Tensor
    reference: Tensor
    label: Tensor
    tokens: Tensor

    def __post_init__(self) -> None:
        if self.policy.dim() != 1:
            raise ValueError(f"UnpairedLogps: expected 1-D [N] tensors, got policy of shape {tuple(self.policy.shape)}")
        for name in ("reference", "label", "tokens"):
            value = getattr(self, name)
            if value.shape != self.policy.shape:
                raise ValueError(f"UnpairedLogps: {name} has shape {tuple(value.shape)}, expected "
                                 f"{tuple(self.policy.shape)}")


def unpaired_loss(
    logps: UnpairedLogps,
    name: str = "kto",
    *,
    beta: float = 0.1,
    kl: float = 0.0,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    weight: float = 1.0,
    class_counts: tuple[int, int] | None = None,
) -> LossOutput:
    """Per-example loss (``[N]``, weighted by ``weight``) and the metrics TRL's KTOTrainer logs.

    ``kl`` is z0 (ignored by ``apo_zero_unpaired``). ``class_counts`` = (desirable, undesirable) examples in
    the whole optimizer step (all micro-batches and ranks); default: the counts of this call. Metrics, each
    a tensor whose elements are averaged by the trainer over the step (``StepTotals`` divides every metric
    by its own element count):

    * ``rewards/chosen`` [n_D] and ``rewards/rejected`` [n_U]: beta * r of desirable / undesirable examples;
    * ``logps/chosen`` [n_D], ``logps/rejected`` [n_U]: policy completion log-prob sums;
    * ``rewards/margins`` [N]: per-example terms whose step mean is mean(rewards/chosen) -
      mean(rewards/rejected) (TRL's margin): r_i * N / n_D for desirable, -r_i * N / n_U for undesirable
      examples, with the step's counts (a class missing from the step contributes 0);
    * ``kl`` [1] (kto only) and ``count/chosen``, ``count/rejected`` [1]: step constants, so their mean over
      micro-batches is the value itself;
    * ``loss/<name>`` [N]: the loss values; ``nll`` [n_D]: per-token NLL of desirable completions.
    """
    if name not in UNPAIRED_LOSS_NAMES:
        raise ValueError(f"unknown unpaired loss {name!r}; valid names are: {', '.join(UNPAIRED_LOSS_NAMES)}")
    pol = logps.policy
    logratio = pol - logps.reference.detach().to(pol.dtype)
    label = _label_mask(logps.label, pol)
    if name == "kto":
        value = kto_loss(logratio, label, kl, beta, desirable_weight, undesirable_weight)
    else:
        value = apo_zero_unpaired_loss(logratio, label, beta, desirable_weight, undesirable_weight)
    metrics: dict[str, Tensor] = {f"loss/{name}": value.detach()}
    with torch.no_grad():
        n_d, n_u = (int(label.sum()), int((~label).sum())) if class_counts is None else map(int, class_counts)
        n = n_d + n_u
        reward = beta * logratio.detach()
        metrics["rewards/chosen"] = reward[label]
        metrics["rewards/rejected"] = reward[~label]
        scale = torch.where(label, n / max(n_d, 1), -n / max(n_u, 1)).to(reward.dtype)
        metrics["rewards/margins"] = reward * scale
        metrics["logps/chosen"] = pol.detach()[label]
        metrics["logps/rejected"] = pol.detach()[~label]
        metrics["nll"] = (-pol.detach() / logps.tokens.clamp(min=1).to(pol.dtype))[label]
        if name in UNPAIRED_LOSSES_WITH_KL:
            metrics["kl"] = torch.tensor([float(kl)], dtype=pol.dtype, device=pol.device)
        metrics["count/chosen"] = torch.tensor([float(n_d)], dtype=pol.dtype, device=pol.device)
        metrics["count/rejected"] = torch.tensor([float(n_u)], dtype=pol.dtype, device=pol.device)
    return LossOutput(loss=weight * value, metrics=metrics)
