"""The registry of pair losses: one entry per name (its function, whether it needs a reference, how rewards are
defined, which ``loss.*`` parameters it reads), and ``preference_loss``, the weighted sum of a run's terms. Config
validation, ``prefpack eval`` flags and the docs read everything from here, so a new loss is one pure function and
one ``register_pair_loss`` call (+ its float64 test)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from prefpack.loss_params import LOSS_PARAMS
from prefpack.losses.pairwise import (
    LossOutput,
    PairLogps,
    _check_beta,
    apo_down_loss,
    apo_zero_loss,
    bco_pair_loss,
    hinge_loss,
    ipo_loss,
    nll_loss,
    orpo_loss,
    robust_loss,
    sigmoid_loss,
    simpo_loss,
)
from prefpack.losses.pairwise_trl import (
    aot_loss,
    aot_unpaired_loss,
    discopop_loss,
    exo_pair_loss,
    nca_pair_loss,
    sft_loss,
    sigmoid_norm_loss,
    sppo_hard_loss,
)
from prefpack.losses.transforms import F_DIVERGENCES, f_divergence_scores, length_desensitised

__all__ = ["BATCH_COUPLED_LOSSES", "F_DIVERGENCE_COMPATIBLE", "F_DIVERGENCE_LOSSES", "LENGTH_NORMALISED_LOSSES",
           "LOSS_NAMES", "PAIR_LOSSES", "REFERENCE_FREE_LOSSES", "LossTerm", "PairInputs", "PairLossSpec",
           "needs_reference", "preference_loss", "register_pair_loss"]


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
    ``paper``, ``arxiv``: where the loss comes from (``python -m prefpack.docs`` lists them in docs/losses.md).
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
    paper: str = ""  # 'Authors year, "Title"' of the loss's source; "" = none (a plain NLL)
    arxiv: str = ""  # its arXiv id, e.g. "2305.18290"


PAIR_LOSSES: dict[str, PairLossSpec] = {}


def register_pair_loss(spec: PairLossSpec) -> PairLossSpec:
    if spec.name in PAIR_LOSSES:
        raise ValueError(f"pair loss {spec.name!r} is registered twice")
    unknown = [p for p in spec.params if p not in LOSS_PARAMS]
    if unknown:
        raise ValueError(f"pair loss {spec.name!r} reads unknown parameters {unknown}; add them to LOSS_PARAMS")
    PAIR_LOSSES[spec.name] = spec
    return spec


def _paper(paper: str, arxiv: str) -> dict[str, str]:
    return {"paper": paper, "arxiv": arxiv}


_PAPERS = {  # the sources the losses' docstrings cite, by short name
    "DPO": _paper('Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a '
                  'Reward Model"', "2305.18290"),
    "ROBUST": _paper('Chowdhury, Kini & Natarajan 2024, "Provably Robust DPO: Aligning Language Models with Noisy '
                     'Feedback"', "2403.00409"),
    "IPO": _paper('Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences"',
                  "2310.12036"),
    "SLIC": _paper('Zhao et al. 2023, "SLiC-HF: Sequence Likelihood Calibration with Human Feedback"', "2305.10425"),
    "BCO": _paper('Jung et al. 2024, "Binary Classifier Optimization for Large Language Model Alignment"',
                  "2404.04656"),
    "APO": _paper("D'Oosterlinck et al. 2024, \"Anchored Preference Optimization and Contrastive Revisions: "
                  "Addressing Underspecification in Alignment\"", "2408.06266"),
    "SIMPO": _paper('Meng, Xia & Chen 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward"',
                    "2405.14734"),
    "ORPO": _paper('Hong, Lee & Thorne 2024, "ORPO: Monolithic Preference Optimization without Reference Model"',
                   "2403.07691"),
    "RPO": _paper('Pang et al. 2024, "Iterative Reasoning Preference Optimization" (RPO: nll beside sigmoid)',
                  "2404.19733"),
    "EXO": _paper('Ji et al. 2024, "Towards Efficient Exact Optimization of Language Model Alignment"',
                  "2402.00856"),
    "NCA": _paper('Chen et al. 2024, "Noise Contrastive Alignment of Language Models with Explicit Rewards"',
                  "2402.05369"),
    "SPPO": _paper('Wu et al. 2024, "Self-Play Preference Optimization for Language Model Alignment"',
                   "2405.00675"),
    "AOT": _paper('Melnyk et al. 2024, "Distributional Preference Alignment of LLMs via Optimal Transport"',
                  "2406.05882"),
    "DISCOPOP": _paper('Lu et al. 2024, "Discovering Preference Optimization Algorithms with and for Large Language '
                       'Models"', "2406.08414"),
    "TULU3": _paper('Lambert et al. 2024, "Tulu 3: Pushing Frontiers in Open Language Model Post-Training"',
                    "2411.15124"),
}

for _spec in (
    PairLossSpec("sigmoid", lambda x: sigmoid_loss(x.chosen_score, x.rejected_score, x.beta, x.label_smoothing),
                 True, "logratio", ("beta", "label_smoothing"), summary="DPO; cDPO with label_smoothing",
                 **_PAPERS["DPO"],
                 f_divergence=True),
    PairLossSpec("sigmoid_ref_free", lambda x: sigmoid_loss(x.policy_chosen, x.policy_rejected, x.beta,
                                                            x.label_smoothing),
                 False, "logp", ("beta", "label_smoothing"), summary="DPO with the reference taken as 0",
                 **_PAPERS["DPO"]),
    PairLossSpec("robust", lambda x: robust_loss(x.chosen_score, x.rejected_score, x.beta, x.label_smoothing),
                 True, "logratio", ("beta", "label_smoothing"), summary="robust DPO (label-flip rate)",
                 **_PAPERS["ROBUST"],
                 f_divergence=True),
    PairLossSpec("ipo", lambda x: ipo_loss(x.chosen_score, x.rejected_score, x.chosen_tokens,
                                           x.rejected_tokens, x.beta),
                 True, "logratio", length_normalised=True, summary="IPO, per-token log-ratios",
                 **_PAPERS["IPO"], f_divergence=True),
    PairLossSpec("hinge", lambda x: hinge_loss(x.chosen_score, x.rejected_score, x.beta),
                 True, "logratio", summary="SLiC hinge",
                 **_PAPERS["SLIC"], f_divergence=True),
    PairLossSpec("bco_pair", lambda x: bco_pair_loss(x.chosen_logratio, x.rejected_logratio, x.beta),
                 True, "logratio", summary="paired BCO without reward shift (TRL 1.16)",
                 **_PAPERS["BCO"]),
    PairLossSpec("bco_pair_running", lambda x: bco_pair_loss(x.chosen_logratio, x.rejected_logratio, x.beta,
                                                             x.bco_delta),
                 True, "logratio", summary="paired BCO with a running-mean reward shift",
                 **_PAPERS["BCO"]),
    PairLossSpec("apo_zero", lambda x: apo_zero_loss(x.chosen_logratio, x.rejected_logratio, x.beta),
                 True, "logratio", summary="APO-zero",
                 **_PAPERS["APO"]),
    PairLossSpec("apo_down", lambda x: apo_down_loss(x.chosen_logratio, x.rejected_logratio, x.beta),
                 True, "logratio", summary="APO-down",
                 **_PAPERS["APO"]),
    PairLossSpec("simpo", lambda x: simpo_loss(x.policy_chosen, x.policy_rejected, x.chosen_tokens,
                                               x.rejected_tokens, x.beta, x.simpo_gamma, x.label_smoothing),
                 False, "mean_logp", ("beta", "simpo_gamma", "label_smoothing"), length_normalised=True,
                 summary="SimPO, reference-free",
                 **_PAPERS["SIMPO"]),
    PairLossSpec("orpo", lambda x: orpo_loss(x.policy_chosen, x.policy_rejected, x.chosen_tokens,
                                             x.rejected_tokens, x.beta),
                 False, "mean_logp", length_normalised=True, summary="ORPO (includes its NLL)",
                 **_PAPERS["ORPO"]),
    PairLossSpec("nll", lambda x: nll_loss(x.policy_chosen_plain, x.chosen_tokens), False, None, (),
                 length_normalised=True, summary="NLL of the chosen completion (RPO with sigmoid)",
                 **_PAPERS["RPO"]),
    PairLossSpec("exo_pair", lambda x: exo_pair_loss(x.chosen_score, x.rejected_score, x.beta,
                                                     x.label_smoothing),
                 True, "logratio", ("beta", "label_smoothing"), summary="EXO, pairwise (label_smoothing > 0)",
                 **_PAPERS["EXO"],
                 f_divergence=True),
    PairLossSpec("nca_pair", lambda x: nca_pair_loss(x.chosen_logratio, x.rejected_logratio, x.beta),
                 True, "logratio", summary="NCA, pairwise",
                 **_PAPERS["NCA"]),
    PairLossSpec("sppo_hard", lambda x: sppo_hard_loss(x.chosen_logratio, x.rejected_logratio, x.beta),
                 True, "logratio", summary="SPPO with hard win probabilities",
                 **_PAPERS["SPPO"]),
    PairLossSpec("aot", lambda x: aot_loss(x.policy_chosen, x.policy_rejected, x.ref_chosen, x.ref_rejected,
                                           x.beta, x.label_smoothing),
                 True, "logratio", ("beta", "label_smoothing"), batch_coupled=True,
                 summary="AOT, paired (sorts within the micro-batch)",
                 **_PAPERS["AOT"]),
    PairLossSpec("aot_unpaired", lambda x: aot_unpaired_loss(x.chosen_logratio, x.rejected_logratio, x.beta,
                                                             x.label_smoothing),
                 True, "logratio", ("beta", "label_smoothing"), batch_coupled=True,
                 summary="AOT, unpaired (sorts within the micro-batch)",
                 **_PAPERS["AOT"]),
    PairLossSpec("discopop", lambda x: discopop_loss(x.chosen_score, x.rejected_score, x.beta,
                                                     x.discopop_tau),
                 True, "logratio", ("beta", "discopop_tau"), summary="DiscoPOP (log-ratio modulated)",
                 **_PAPERS["DISCOPOP"],
                 f_divergence=True),
    PairLossSpec("sigmoid_norm", lambda x: sigmoid_norm_loss(x.chosen_score, x.rejected_score,
                                                             x.chosen_tokens, x.rejected_tokens, x.beta),
                 True, "logratio", length_normalised=True, summary="DPO on per-token log-ratios",
                 **_PAPERS["TULU3"],
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
