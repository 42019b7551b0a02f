"""Group policy gradients (GRPO, Dr. GRPO, DAPO, BNPO, RLOO) as pure functions: advantages from a group's scores,
the clipped per-token surrogate with its k3 KL term, RLOO's sequence-level surrogate, and the per-completion values
whose mean over a step's completions is the loss each aggregation names.

Definitions follow TRL 1.16 (``GRPOTrainer._compute_loss``, ``RLOOTrainer._compute_loss``; tests/test_pg_trl.py
checks the numbers). Where prefpack differs it is said here and in docs/losses.md: every aggregation is a sum over
the optimizer step divided by a count of the whole step (its completions, or its scored tokens), so a step gives the
same loss and gradient however it is split into micro-batches and ranks (TRL's ``grpo`` and ``bnpo`` normalise per
micro-batch, so theirs change with the split).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["ADVANTAGE_EPS", "PG_AGGREGATIONS", "PG_LOSSES", "SAMPLING_CORRECTIONS", "PgLossSpec", "clipped_token_terms",
           "completion_values", "group_advantages", "rloo_advantages", "sampling_weights", "sequence_clipped_loss",
           "sequence_ratio_loss", "sequence_token_terms"]

ADVANTAGE_EPS = 1e-4
"""Added to a standard deviation before dividing by it (TRL's constant)."""

PG_AGGREGATIONS = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo")
"""The token-level losses by TRL's ``loss_type`` names (``rloo`` is sequence-level)."""

SURROGATES = {"cispo": "cispo", "sapo": "sapo"}
"""The losses whose per-token term is not GRPO's clipped surrogate (``clipped_token_terms``'s ``surrogate``)."""


@dataclass(frozen=True)
class PgLossSpec:
    """One ``train.objective=policy_gradient`` loss, for docs/losses.md (names: ``objectives.names.PG_LOSS_NAMES``)."""

    name: str
    summary: str
    advantages: str
    step_loss: str
    paper: str
    arxiv: str


PG_LOSSES: dict[str, PgLossSpec] = {s.name: s for s in (
    PgLossSpec("grpo", "clipped per-token ratio to the old policy, + k3 KL", "GRPO (loss.scale_rewards)",
               "mean over completions of each one's token mean",
               "Shao et al. 2024, \"DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models\"",
               "2402.03300"),
    PgLossSpec("dr_grpo", "grpo's per-token term", "GRPO (loss.scale_rewards; none is Dr. GRPO's)",
               "token sum / (completions x loss.max_completion_length)",
               "Liu et al. 2025, \"Understanding R1-Zero-Like Training: A Critical Perspective\"", "2503.20783"),
    PgLossSpec("dapo", "grpo's per-token term (clip-higher: loss.epsilon_high)", "GRPO (loss.scale_rewards)",
               "token sum / the step's scored tokens",
               "Yu et al. 2025, \"DAPO: An Open-Source LLM Reinforcement Learning System at Scale\"", "2503.14476"),
    PgLossSpec("bnpo", "grpo's per-token term", "GRPO (loss.scale_rewards)",
               "token sum / the step's scored tokens (TRL: the micro-batch's)",
               "Xiao et al. 2025, \"BNPO: Beta Normalization Policy Optimization\"", "2506.02864"),
    PgLossSpec("cispo", "the ratio clipped above at epsilon_high and detached, times A times log p (no clip of the "
               "advantage-weighted ratio)", "GRPO (loss.scale_rewards)", "token sum / the step's scored tokens",
               "MiniMax 2025, \"MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention\"",
               "2506.13585"),
    PgLossSpec("sapo", "a soft gate instead of the clip: sigmoid(tau (r - 1)) 4 / tau times A (loss.sapo_temperature_pos "
               "for A > 0, loss.sapo_temperature_neg otherwise)", "GRPO (loss.scale_rewards)",
               "mean over completions of each one's token mean",
               "Gao et al. 2025, \"Soft Adaptive Policy Optimization\"", "2511.20347"),
    PgLossSpec("luspo", "grpo's per-token term (meant with loss.importance_sampling_level: sequence)",
               "GRPO (loss.scale_rewards)", "mean over completions of each one's token sum",
               "\"Length-Unbiased Sequence Policy Optimization\" (LUSPO)", "2602.05261"),
    PgLossSpec("rloo", "clipped ratio of the whole completion (sequence level); KL in the reward",
               "leave-one-out baseline (loss.normalize_advantages)", "mean over completions",
               "Ahmadian et al. 2024, \"Back to Basics: Revisiting REINFORCE Style Optimization for Learning from "
               "Human Feedback in LLMs\"", "2402.14740"),
)}
"""Every group policy-gradient loss by name, in ``PG_LOSS_NAMES`` order."""


def _std(x: np.ndarray) -> float:
    """The sample standard deviation (ddof 1, as torch.std and TRL's nanstd); 0 for fewer than two values."""
    return float(np.std(x, ddof=1)) if x.size > 1 else 0.0


def group_advantages(scores: np.ndarray, starts: np.ndarray, scale: str = "group") -> np.ndarray:
    """GRPO's advantages (float64, one per completion): each score minus its group's mean, divided by the group's
    standard deviation (``group``), the whole batch's (``batch``) or nothing (``none``), + ``ADVANTAGE_EPS``.

    ``starts`` [G + 1]: where each group's completions start in ``scores`` (the last entry: its length). A group
    whose scores all tie gets advantages 0 (its completions still count in every average, as TRL's do)."""
    scores = np.asarray(scores, dtype=np.float64)
    out = np.empty_like(scores)
    batch_std = _std(scores)
    for a, b in zip(starts[:-1], starts[1:]):
        g = scores[a:b]
        centred = g - g.mean()
        if scale == "group":
            centred = centred / (_std(g) + ADVANTAGE_EPS)
        elif scale == "batch":
            centred = centred / (batch_std + ADVANTAGE_EPS)
        elif scale != "none":
            raise ValueError(f"unknown advantage scaling {scale!r}; choose group, batch or none")
        out[a:b] = centred
    return out


def rloo_advantages(scores: np.ndarray, starts: np.ndarray, normalize: bool = False) -> np.ndarray:
    """RLOO's advantages (Ahmadian et al. 2024, arXiv:2402.14740): each score minus the mean of the other scores of
    its group; with ``normalize``, then centred and divided by their standard deviation over the batch
    (+ ``ADVANTAGE_EPS``), as TRL's ``normalize_advantages``. A group of one completion gets 0."""
    scores = np.asarray(scores, dtype=np.float64)
    out = np.zeros_like(scores)
    for a, b in zip(starts[:-1], starts[1:]):
        k = b - a
        if k > 1:
            g = scores[a:b]
            out[a:b] = g - (g.sum() - g) / (k - 1)
    if normalize:
        out = (out - out.mean()) / (_std(out) + ADVANTAGE_EPS)
    return out


SAMPLING_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""How the sampler's mismatch is corrected (TRL 1.16's ``vllm_importance_sampling_mode`` values)."""


def sampling_weights(old: np.ndarray, sampler: np.ndarray, mode: str, *, ratio_min: float | None = None,
                     ratio_max: float | None = 3.0) -> np.ndarray:
    """One completion's importance weights (float64, one per scored token): the old policy's probability of what the
    sampler drew over the sampler's own, which corrects for the sampler not being the trained policy (another engine,
    precision or kernels: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training"; TRL 1.16's ``vllm_importance_sampling_correction``). ``token_*``: per token, exp(old - sampler);
    ``sequence_*``: the completion's exp(sum(old - sampler)) on each of its tokens. ``*_truncate`` clips the ratio
    to [ratio_min, ratio_max]; ``*_mask`` gives 0 where it lies outside. A NaN sampler log-prob counts as no gap
    (TRL's ``nan_to_num``); a bound of None is no bound."""
    diff = np.nan_to_num(np.asarray(old, dtype=np.float64) - np.asarray(sampler, dtype=np.float64), nan=0.0)
    if mode.startswith("sequence_"):
        ratio = np.full(diff.shape, np.exp(diff.sum()))
    elif mode.startswith("token_"):
        ratio = np.exp(diff)
    else:
        raise ValueError(f"unknown sampling correction {mode!r}; choose one of {', '.join(SAMPLING_CORRECTIONS)}")
    lo = -np.inf if ratio_min is None else ratio_min
    hi = np.inf if ratio_max is None else ratio_max
    if mode.endswith("_truncate"):
        return np.clip(ratio, lo, hi)
    if mode.endswith("_mask"):
        return np.where((ratio < lo) | (ratio > hi), 0.0, ratio)
    raise ValueError(f"unknown sampling correction {mode!r}; choose one of {', '.join(SAMPLING_CORRECTIONS)}")


def surrogate_loss(ratio: Tensor, advantage: Tensor, logp: Tensor, kind: str, *, epsilon_low: float,
                   epsilon_high: float, delta: float | None = None, temperature_pos: float = 1.0,
                   temperature_neg: float = 1.05) -> tuple[Tensor, Tensor, Tensor]:
    """One token's policy-gradient term given its ratio r to the old policy (per token, or its completion's under a
    sequence-level ratio), as TRL 1.16's ``_compute_loss``: ``clip`` (grpo, dapo, ...), ``-min(r A, clip(r, 1 -
    eps_low, 1 + eps_high) A)``, r capped at ``delta`` in the first term; ``cispo``, ``-min(r, eps_high)`` detached
    times A times log p; ``sapo``, ``-sigmoid(tau (r - 1)) 4 / tau`` times A, tau the positive or negative
    temperature by the sign of A. Returns the loss and the tokens clipped below and above (detached; cispo: above
    its cap where A > 0; sapo: none)."""
    if kind == "cispo":
        loss = -torch.clamp(ratio, max=epsilon_high).detach() * advantage * logp
        high = ((ratio > epsilon_high) & (advantage > 0)).to(logp.dtype).detach()
        return loss, torch.zeros_like(high), high
    if kind == "sapo":
        tau = torch.where(advantage > 0, torch.full_like(ratio, temperature_pos), torch.full_like(ratio, temperature_neg))
        loss = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * advantage
        none = torch.zeros_like(ratio).detach()
        return loss, none, none
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    loss = -torch.minimum(unclipped * advantage, clipped * advantage)
    low = ((ratio < 1.0 - epsilon_low) & (advantage < 0)).to(logp.dtype).detach()
    high = ((ratio > 1.0 + epsilon_high) & (advantage > 0)).to(logp.dtype).detach()
    return loss, low, high


def clipped_token_terms(logp: Tensor, old: Tensor, advantage: Tensor, *, epsilon_low: float, epsilon_high: float,
                        kl_coef: float = 0.0, ref: Tensor | None = None, delta: float | None = None,
                        kl_ratio: bool = True, sampler: Tensor | None = None,
                        weight: Tensor | None = None, surrogate: str = "clip", temperature_pos: float = 1.0,
                        temperature_neg: float = 1.05, gap_source: Tensor | None = None) -> dict[str, Tensor]:
    """Per scored token: GRPO's clipped surrogate loss ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` with
    ``r = exp(logp - old)`` (``delta``: r also capped above, two-sided clipping, TRL's ``delta``), plus
    ``kl_coef`` times the k3 estimate of KL(policy || reference), ``exp(ref - logp) - (ref - logp) - 1``, times the
    unclipped ratio r with ``kl_ratio`` (the importance correction of the estimate for samples drawn from the old
    policy: TRL 1.16's ``use_bias_correction_kl``, on by default there too).

    Every input is per token ([N], ``advantage`` its completion's). Returns ``loss`` (with gradient) and, detached,
    the tokens clipped below (ratio under 1 - eps_low where A < 0) and above (over 1 + eps_high where A > 0), ``kl``
    (when ``ref`` is given) and ``sampler_gap`` |logp - sampler| (when the sampler's own log-probs are given: the
    train/rollout mismatch). ``weight`` (per token, no gradient: ``sampling_weights``) multiplies the surrogate, not
    the KL, as TRL 1.16 applies its importance-sampling correction; it is reported summed (``sampling_ratio``) with
    the tokens it drops (``sampling_masked``: weight 0). ``surrogate`` (``surrogate_loss``): ``clip``, ``cispo`` or
    ``sapo``. ``gap_source`` (the sampler's log-probs, else the old policy's): their gap to the policy's, detached,
    summed as ``off_policy_gap`` (the off-policy mask's mean KL); the KL term is also given alone (``kl_loss``),
    so that a completion's surrogate can be masked apart from it. Each is summed per completion by the forward
    (``prefpack.model.sums``)."""
    ratio = torch.exp(logp - old)
    loss, low, high = surrogate_loss(ratio, advantage, logp, surrogate, epsilon_low=epsilon_low,
                                     epsilon_high=epsilon_high, delta=delta, temperature_pos=temperature_pos,
                                     temperature_neg=temperature_neg)
    if weight is not None:
        loss = loss * weight
    out = {"clip_low": low, "clip_high": high, **_reported(logp, sampler, weight, gap_source)}
    if ref is not None:
        diff = ref - logp
        kl = torch.exp(diff) - diff - 1.0
        if kl_ratio:
            kl = kl * ratio
        if kl_coef:
            out["kl_loss"] = kl_coef * kl
            loss = loss + out["kl_loss"]
        out["kl"] = kl.detach()
    out["loss"] = loss
    return out


@torch.no_grad()
def _reported(logp: Tensor, sampler: Tensor | None, weight: Tensor | None,
              gap_source: Tensor | None) -> dict[str, Tensor]:
    """The per-token values a step reports (detached): the train/rollout gap, the sampling weights and the tokens
    they drop, and the off-policy mask's evidence."""
    out: dict[str, Tensor] = {}
    if gap_source is not None:
        out["off_policy_gap"] = gap_source - logp
    if sampler is not None:
        out["sampler_gap"] = (logp - sampler).abs()
    if weight is not None:
        out["sampling_ratio"] = weight.to(logp.dtype)
        out["sampling_masked"] = (weight == 0).to(logp.dtype)
    return out


def sequence_clipped_loss(logp_sum: Tensor, old_sum: Tensor, advantage: Tensor, *, epsilon_low: float,
                          epsilon_high: float) -> tuple[Tensor, Tensor, Tensor]:
    """RLOO's per-completion surrogate (TRL 1.16's RLOOTrainer): the clipped ratio of the whole completion's
    probability, ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``, ``r = exp(sum logp - sum old)``; with the
    completions clipped below and above (detached)."""
    ratio = torch.exp(logp_sum - old_sum)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = -torch.minimum(ratio * advantage, clipped * advantage)
    low = ((ratio < 1.0 - epsilon_low) & (advantage < 0)).to(logp_sum.dtype).detach()
    high = ((ratio > 1.0 + epsilon_high) & (advantage > 0)).to(logp_sum.dtype).detach()
    return loss, low, high


def sequence_token_terms(logp: Tensor, *, ref: Tensor | None = None, sampler: Tensor | None = None,
                         weight: Tensor | None = None, gap_source: Tensor | None = None,
                         linear: bool = False) -> dict[str, Tensor]:
    """The per-token parts of a sequence-level ratio (``loss.importance_sampling_level=sequence``, GSPO), summed per
    completion by the forward: the k3 KL to the reference (with gradient; the ratio that corrects it is the
    completion's, applied by :func:`sequence_ratio_loss`), the sampling correction's weights, and the reported
    ``sampler_gap`` / ``sampling_masked`` / ``off_policy_gap`` (as :func:`clipped_token_terms`)."""
    out = _reported(logp, sampler, weight, gap_source)
    if ref is not None:
        diff = ref - logp
        out["kl"] = torch.exp(diff) - diff - 1.0
    if linear and weight is not None:  # cispo's term is linear in log p: its weighted sum, with gradient
        out["weighted_logp"] = weight * logp
    return out


def sequence_ratio_loss(logp_sum: Tensor, old_sum: Tensor, n_tokens: Tensor, advantage: Tensor, *,
                        epsilon_low: float, epsilon_high: float, delta: float | None = None, kl_coef: float = 0.0,
                        kl_sum: Tensor | None = None, kl_ratio: bool = True, weight_sum: Tensor | None = None,
                        surrogate: str = "clip", temperature_pos: float = 1.0, temperature_neg: float = 1.05,
                        keep: Tensor | None = None, weighted_logp_sum: Tensor | None = None
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO's per-completion token sum (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071;
    TRL 1.16's ``importance_sampling_level="sequence"``): one ratio per completion, s = exp(mean over its scored
    tokens of logp - old), clipped as GRPO's token ratio is, on each of its tokens: the surrogate ``-min(s A,
    clip(s, 1 - eps_low, 1 + eps_high) A)`` summed over the tokens (each weighted by the sampling correction, whose
    per-completion sum is ``weight_sum``; else their count), plus ``kl_coef`` times the summed k3 KL, times s with
    ``kl_ratio`` (TRL broadcasts the sequence ratio onto the per-token KL). ``surrogate`` as
    :func:`surrogate_loss` (cispo's term is linear in log p: its sum is the clipped ratio times A times the summed
    log-probs, weighted by the sampling correction when given, ``weighted_logp_sum``); ``keep`` (per completion,
    0 or 1: the off-policy mask) multiplies the surrogate, not the KL. Returns that sum (with gradient through s,
    log p and the KL) and, detached, whether the completion clipped below and above. The aggregations of
    :func:`completion_values` then apply as to the token-level sums."""
    n = n_tokens.to(logp_sum.device, logp_sum.dtype)
    ratio = torch.exp((logp_sum - old_sum) / n.clamp(min=1.0))
    if surrogate == "cispo":  # sum_t -min(s, eps_high) A log p_t
        linear = logp_sum if weighted_logp_sum is None else weighted_logp_sum
        per_token, low, high = surrogate_loss(ratio, advantage, linear, surrogate, epsilon_low=epsilon_low,
                                              epsilon_high=epsilon_high)
        loss = per_token
    else:
        per_token, low, high = surrogate_loss(ratio, advantage, logp_sum, surrogate, epsilon_low=epsilon_low,
                                              epsilon_high=epsilon_high, delta=delta,
                                              temperature_pos=temperature_pos, temperature_neg=temperature_neg)
        loss = per_token * (n if weight_sum is None else weight_sum)
    if keep is not None:
        loss = loss * keep
    if kl_sum is not None and kl_coef:
        loss = loss + kl_coef * kl_sum * (ratio if kl_ratio else 1.0)
    return loss, low, high


def completion_values(loss_sum: Tensor, n_tokens: Tensor, aggregation: str, *, max_completion_length: int = 0,
                      tokens_per_completion: float = 1.0) -> Tensor:
    """Per completion, the value whose mean over a step's completions is the step's loss:

    - ``grpo``: the completion's token mean (the step's loss: the mean over completions of their token means);
    - ``dr_grpo``: its token sum / ``max_completion_length`` (Liu et al. 2025, arXiv:2503.20783);
    - ``dapo``, ``bnpo`` and ``cispo``: its token sum / ``tokens_per_completion`` (the step's scored tokens over its
      completions), so the step's loss is its token sum over its token count (Yu et al. 2025, arXiv:2503.14476);
    - ``sapo``: as ``grpo``; ``luspo``: its token sum (the step's loss: the mean over completions of their sums).

    ``loss_sum`` [S]: each completion's summed per-token loss, ``n_tokens`` [S] its scored tokens."""
    n = n_tokens.to(loss_sum.device, loss_sum.dtype)
    if aggregation in ("grpo", "sapo"):
        return loss_sum / n.clamp(min=1.0)
    if aggregation == "luspo":
        return loss_sum
    if aggregation == "dr_grpo":
        if max_completion_length < 1:
            raise ValueError("dr_grpo needs max_completion_length >= 1")
        return loss_sum / float(max_completion_length)
    if aggregation in ("dapo", "bnpo", "cispo"):
        return loss_sum / max(float(tokens_per_completion), 1e-12)
    raise ValueError(f"unknown aggregation {aggregation!r}; choose one of {', '.join(PG_AGGREGATIONS)}")
