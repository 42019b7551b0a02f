"""Group policy gradients (``train.objective=policy_gradient``) over a ranked store: each prompt with its k scored
completions is one example, laid out like the DPO family's prompt groups (the prompt once, every completion once),
and every completion is one loss unit.

- Advantages come from the store's scores, once, over the whole store (GRPO's group- or batch-scaled mean-centring,
  RLOO's leave-one-out baseline): ``prefpack.losses.pg``.
- The token-level losses (``grpo``, ``dr_grpo``, ``dapo``, ``bnpo``) reach the forward as a
  :class:`~prefpack.model.sums.TokenTerm`: the clipped surrogate against the old policy's per-token log-probs, the
  k3 KL to the reference when ``loss.kl_coef`` > 0, summed per completion inside the forward, so packed, padded,
  prompt-shared and token-sharded layouts give the same sums. ``rloo`` clips the whole completion's ratio.
- The old policy's log-probs (``loss.old_logprobs``): ``recompute`` = the policy's own, computed over the whole store
  before the first step of the objective (the sampling policy of an on-policy round; TRL does the same); ``sampler`` =
  the sampler's, recorded at generation in the store (``logprobs.bin``); ``current`` = the policy's at each step,
  detached (exact only when every completion trains in its round's first step: TRL's shortcut). Where the store holds
  the sampler's, their gap to the trainer's forward is reported (``sampler_gap``, per token: the train/rollout
  mismatch), and ``loss.sampling_correction`` weights each token's surrogate by old / sampler (TRL 1.16's
  importance-sampling correction of vLLM's samples; ``auto``: on, ``sequence_mask``, for a vLLM-sampled store).
- Each completion's value is the one its aggregation's mean over the step's completions makes the loss of
  (``losses.pg.completion_values``); ``dapo``/``bnpo`` read the step's scored tokens per completion, counted over
  the whole step in :meth:`plan_step` before it is dealt to ranks, so ranks and accumulation do not change it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from prefpack.data.store import Store, StoreError
from prefpack.data.store_format import FLAG_COMPLETION_TRUNCATED
from prefpack.data.views import RankedGroups
from prefpack.data.vision_inputs import check_store_vision
from prefpack.losses import LossOutput
from prefpack.losses.pg import (
    SURROGATES,
    clipped_token_terms,
    completion_values,
    group_advantages,
    rloo_advantages,
    sampling_weights,
    sequence_clipped_loss,
    sequence_ratio_loss,
    sequence_token_terms,
)
from prefpack.model.sums import TokenTerm
from prefpack.objectives.base import StepState
from prefpack.objectives.groups import PromptGroupTask
from prefpack.objectives.settings import RunSettings
from prefpack.reference import Reference, as_sequence_output

__all__ = ["GroupPolicyTask", "pg_forward_options"]


def pg_forward_options(settings: RunSettings | None = None) -> dict:
    """What the policy forward returns for group policy gradients: each token's log-prob (the old policy's, recomputed
    by the policy), the entropy reported, and a MoE model's router loss (``loss.router_aux_loss_coef``)."""
    aux = bool(settings is not None and settings.router_aux_loss_coef)
    return {"entropy": True, "token_logps": True, "router_aux": aux}


_STORE, _OLD, _ADVANTAGES = "pg_store", "pg_old_logprobs", "pg_advantages"  # state_dict keys


def _current_old(logp, *, fn, **inputs):
    """The surrogate with the policy's own detached log-probs as the old policy's (ratio 1, gradient A)."""
    return fn(logp, old=logp.detach(), **inputs)


class GroupPolicyTask(PromptGroupTask):
    """GRPO / Dr. GRPO / DAPO / BNPO / RLOO over a ranked store's prompt groups (see the module docstring)."""

    kind = "groups"

    def __init__(self, store: Store, settings: RunSettings, terms: Sequence):
        if store.kind != "ranked":
            raise StoreError(f"store {str(store.path)!r} holds {store.kind}; train.objective=policy_gradient trains on "
                             "a ranked store (k scored completions per prompt): prefpack score's output, or a round's")
        self.store, self.settings = store, settings
        check_store_vision(store, settings.vision)
        self._images = None
        if len(terms) != 1:
            raise ValueError(f"train.objective=policy_gradient takes one loss term, got {[t.name for t in terms]}")
        self.loss_name = terms[0].name
        self.weight = float(terms[0].weight)
        self.view = RankedGroups(store, "best_vs_rest", keep_ties=True)
        lo = settings.loss
        self.epsilon_low = float(lo.epsilon)
        self.epsilon_high = float(lo.epsilon if lo.epsilon_high is None else lo.epsilon_high)
        self.kl_coef = float(lo.kl_coef or 0.0)
        self.delta = None if lo.delta is None else float(lo.delta)
        self.sequence_ratio = lo.importance_sampling_level == "sequence" and self.loss_name != "rloo"
        self.surrogate = SURROGATES.get(self.loss_name, "clip")
        self.off_policy = None if lo.off_policy_mask_threshold is None else float(lo.off_policy_mask_threshold)
        self.old_mode = lo.old_logprobs
        self.scores = store.scores().astype(np.float64)
        self.starts = store.group_starts()
        self.advantages = self._advantages(None)
        flags = store.column("flags")
        truncated = (flags & FLAG_COMPLETION_TRUNCATED) != 0
        self.keep = np.where(truncated & bool(lo.mask_truncated_completions), 0.0, 1.0)
        self.scored_masks = self._scored_masks()
        self.scored = np.asarray([int(m.sum()) for m in self.scored_masks], dtype=np.int64)
        self.max_completion_length = int(lo.max_completion_length or self._longest_allowed())
        self.sampler = self._sampler_logprobs() if getattr(store, "sampler_logprobs", None) is not None else None
        if self.old_mode == "sampler" and self.sampler is None:
            raise StoreError(f"loss.old_logprobs=sampler reads the sampler's log-probs, which store "
                             f"{str(store.path)!r} does not hold (no logprobs.bin): use loss.old_logprobs=recompute")
        self.old: list[np.ndarray] | None = self.sampler if self.old_mode == "sampler" else None
        self.correction = self._sampling_correction()
        self._step_tokens_per_completion: float | None = None

    # ---- what the store gives, once -------------------------------------------------------------------------

    def _sampling_correction(self) -> str | None:
        """``loss.sampling_correction`` resolved: ``auto`` is TRL 1.16's default where TRL applies it (vLLM's samples,
        the old policy recomputed): ``sequence_mask``; else none. An explicit mode needs what it reads."""
        mode = self.settings.loss.sampling_correction
        engine = ((self.store.meta.get("samples") or {}).get("generation") or {}).get("engine")
        if mode == "auto":
            usable = self.sampler is not None and self.old_mode == "recompute" and self.loss_name != "rloo"
            return "sequence_mask" if usable and engine == "vllm" else None
        if mode == "none":
            return None
        if self.loss_name == "rloo":
            raise ValueError(f"loss.sampling_correction={mode} weights the grpo family's per-token surrogate; loss "
                             "rloo has none (TRL's RLOO applies no such correction): set loss.sampling_correction=none")
        if self.sampler is None:
            raise StoreError(f"loss.sampling_correction={mode} reads the sampler's log-probs, which store "
                             f"{str(self.store.path)!r} does not hold (no logprobs.bin): set "
                             "loss.sampling_correction=none")
        if self.old_mode != "recompute":
            raise ValueError(f"loss.sampling_correction={mode} compares the recomputed old policy with the sampler: "
                             f"it needs loss.old_logprobs=recompute (with {self.old_mode} the weights would not "
                             "correct anything)")
        return mode

    def _advantages(self, kl: np.ndarray | None) -> np.ndarray:
        lo = self.settings.loss
        if self.loss_name == "rloo":
            scores = self.scores if kl is None else self.scores - self.kl_coef * kl
            return rloo_advantages(scores, self.starts, bool(lo.normalize_advantages))
        return group_advantages(self.scores, self.starts, lo.scale_rewards)

    def _scored_masks(self) -> list[np.ndarray]:
        """Per store row, which of its completion tokens are scored (a store's unscored spans: tool output)."""
        out: list[np.ndarray] = [np.zeros(0, bool)] * len(self.store)
        for i in range(len(self.view)):
            _, comps = self.view[i]
            for row, c in zip(self.view.rows(i), comps):
                mask = getattr(c, "scored", None)
                out[int(row)] = np.ones(len(c), bool) if mask is None else np.asarray(mask, bool)
        return out

    def _longest_allowed(self) -> int:
        """dr_grpo's constant: the sampling's max_new_tokens where the store records it, else its longest
        completion."""
        settings = ((self.store.meta.get("samples") or {}).get("generation") or {}).get("settings") or {}
        new = settings.get("max_new_tokens")
        if isinstance(new, int) and new > 0:
            return new
        return int(self.store.column("completion_len").max())

    def _sampler_logprobs(self) -> list[np.ndarray]:
        """Per store row, the sampler's log-probs of its scored tokens (float64)."""
        out = []
        for row in range(len(self.store)):
            values = self.store.completion_logprobs(row)
            if values is None or np.isnan(values).any():
                raise StoreError(f"store {str(self.store.path)!r}: row {row} has no sampler log-probs for every "
                                 "token in logprobs.bin (a store mixing sampled and unsampled completions); use "
                                 "loss.old_logprobs=recompute")
            out.append(np.asarray(values, dtype=np.float64)[self.scored_masks[row]])
        return out

    # ---- the loop's hooks -----------------------------------------------------------------------------------

    def run_note(self) -> str | None:
        ties = sum(1 for i in range(len(self.view)) if not self.view.pairs[i])
        if not ties:
            return None
        moves = "only the KL term moves them" if self.kl_coef else "nothing moves them"
        return (f"{ties} of {len(self.view)} prompts of {self.store.path} have completions whose scores all tie: "
                f"their advantages are 0 ({moves}; they count in every average, as in TRL)")

    def forward_options(self) -> dict:
        return pg_forward_options(self.settings)

    def units(self, ids: np.ndarray) -> int:
        """A step's loss units: its completions."""
        return int(self.view.sizes[np.asarray(ids, dtype=np.int64)].sum())

    def counts(self) -> dict[str, int]:
        return {"prompts": len(self), "completions": int(self.view.sizes.sum())}

    def _rows_of(self, ids: np.ndarray) -> np.ndarray:
        return np.concatenate([self.view.rows(int(i)) for i in ids]) if len(ids) else np.zeros(0, np.int64)

    def plan_step(self, ids: np.ndarray, *, seed: Any) -> None:
        """The whole step's scored tokens per completion (``dapo``/``bnpo``'s normaliser), before dealing."""
        rows = self._rows_of(np.asarray(ids, dtype=np.int64))
        self._step_tokens_per_completion = float((self.scored[rows] * self.keep[rows]).sum()) / max(len(rows), 1)

    def begin_step(self, policy: nn.Module, reference: Reference, batches: list[Any], weights=None,
                   dist=None) -> StepState:
        if self.old is None and self.old_mode == "recompute" or self._rloo_kl_pending():
            self._start(policy, reference)
        return StepState()

    def as_evaluation(self) -> None:
        """Evaluating a held-out store: the old policy is the policy as it stands at each evaluation (ratio 1), so
        every evaluation scores the policy of its step, not the one of the first."""
        self.old_mode, self.old, self.correction = "current", None, None

    def end_step(self, totals) -> None:
        """No running state: the advantages are the store's."""

    def _identity(self) -> str:
        return f"{self.store.path}:{len(self.store)}:{self.store.num_tokens}"

    def state_dict(self) -> dict:
        """The old policy's log-probs it recomputed (and RLOO's advantages with their KL), as tensors a checkpoint
        keeps beside the optimizer's, tagged with the store: a run resumed inside this objective's steps goes on
        with the ratios it started with, as an uninterrupted run does."""
        out: dict[str, Any] = {}
        if self.old is not None and self.old_mode == "recompute":
            out[_OLD] = torch.as_tensor(np.concatenate(self.old) if self.old else np.zeros(0))
        if getattr(self, "_rloo_kl_done", False):
            out[_ADVANTAGES] = torch.as_tensor(self.advantages)
        return {_STORE: self._identity(), **out} if out else {}

    def load_state_dict(self, state: dict) -> None:
        """A state saved by this objective over this store (another round's, or the training objective's handed to
        an evaluation store, is not this one's: it recomputes its own)."""
        unknown = set(state) - {_STORE, _OLD, _ADVANTAGES}
        if unknown:
            raise ValueError(f"GroupPolicyTask: unknown state {sorted(unknown)}")
        if state.get(_STORE) != self._identity():
            return
        if _OLD in state:
            flat = state[_OLD].double().numpy()
            if flat.size != int(self.scored.sum()):
                raise ValueError(f"checkpointed old log-probs: {flat.size} values for {int(self.scored.sum())} "
                                 f"scored tokens of {self.store.path}")
            self.old = np.split(flat, np.cumsum(self.scored)[:-1])
        if _ADVANTAGES in state:
            self.advantages = state[_ADVANTAGES].double().numpy()
            self._rloo_kl_done = True

    def _rloo_kl_pending(self) -> bool:
        return self.loss_name == "rloo" and self.kl_coef > 0 and not getattr(self, "_rloo_kl_done", False)

    @torch.no_grad()
    def _start(self, policy: nn.Module, reference: Reference) -> None:
        """Before the first step: the old policy's per-token log-probs over the whole store (every rank the same),
        and RLOO's KL penalty in the rewards (the old policy's sums less the reference's, TRL's estimate)."""
        old: list[np.ndarray] = [np.zeros(0)] * len(self.store)
        ref_sums = np.zeros(len(self.store))
        need_ref = self._rloo_kl_pending()
        was_training = policy.training
        policy.eval()
        try:
            for planned in self.plan(np.arange(len(self)), seed=None):
                batch = self.collate(planned)
                out = as_sequence_output(policy(batch))
                matrix = out.token_logp.double().cpu().numpy()
                rows = batch.sequence_keys.numpy()
                for s, row in enumerate(rows):
                    old[int(row)] = matrix[s, : int(self.scored[row])].copy()
                if need_ref:
                    ref = reference.sequence_logps(batch)
                    if ref is None:
                        raise ValueError("loss=rloo with loss.kl_coef > 0 needs a reference (reference.mode copy, "
                                         "adapter or precomputed)")
                    ref_sums[rows] = ref.logp_sum.double().cpu().numpy()
        finally:
            policy.train(was_training)
        if self.old_mode == "recompute":
            self.old = old
        if need_ref:
            old_source = self.old if self.old is not None else old
            kl = np.asarray([o.sum() for o in old_source]) - ref_sums
            self.advantages = self._advantages(kl)
            self._rloo_kl_done = True

    def _off_policy_keep(self, sums: dict, advantage: torch.Tensor, n: torch.Tensor,
                         metrics: dict) -> torch.Tensor | None:
        """DeepSeek-V3.2's off-policy sequence mask (TRL's ``get_off_policy_mask``), per completion: 1 where its
        advantage is >= 0 or its mean log-ratio of the sampler (else the old policy) to the policy is at most
        ``loss.off_policy_mask_threshold``, else 0; None when the mask is off. Reported as ``off_policy_masked``."""
        if self.off_policy is None or "off_policy_gap" not in sums:
            return None
        gap = sums["off_policy_gap"] / n
        adv = advantage.to(gap.device, gap.dtype)
        keep = ((adv >= 0) | (gap <= self.off_policy)).to(gap.dtype).detach()
        metrics["off_policy_masked"] = 1.0 - keep
        return keep

    def _tokens_per_completion(self, n_tokens: torch.Tensor, keep: torch.Tensor, rows: np.ndarray) -> float:
        """dapo/bnpo's normaliser: the step's scored tokens per completion (plan_step's); in an evaluation (no
        plan_step), the batch's own."""
        if self._step_tokens_per_completion is not None:
            return self._step_tokens_per_completion
        return float((n_tokens.double() * keep.double().cpu()).sum()) / max(len(rows), 1)

    def _sampling_weights(self, rows: np.ndarray) -> list[np.ndarray]:
        """Per store row (those of ``rows`` filled): the sampling correction's weights from the recomputed old policy
        and the sampler (``losses.pg.sampling_weights``); a list indexed like ``self.old``."""
        lo = self.settings.loss
        out: list[np.ndarray] = [np.zeros(0)] * len(self.store)
        for row in rows:
            out[int(row)] = sampling_weights(self.old[int(row)], self.sampler[int(row)], self.correction,
                                             ratio_min=lo.sampling_ratio_min, ratio_max=lo.sampling_ratio_max)
        return out

    def _matrix(self, values: list[np.ndarray], rows: np.ndarray, n_tokens: torch.Tensor) -> torch.Tensor:
        """[S, W] per-token values of the batch's sequences (sequence s's k-th scored token at [s, k])."""
        width = max(int(n_tokens.max()) if n_tokens.numel() else 0, 1)
        out = np.zeros((len(rows), width), dtype=np.float64)
        for s, row in enumerate(rows):
            v = values[int(row)]
            if len(v) != int(n_tokens[s]):
                raise ValueError(f"store {str(self.store.path)!r} row {int(row)}: {len(v)} old log-probs for "
                                 f"{int(n_tokens[s])} scored tokens")
            out[s, : len(v)] = v
        return torch.as_tensor(out)

    def loss(self, policy: nn.Module, reference: Reference, batch, step: StepState) -> LossOutput:
        if self.old is None and self.old_mode != "current":  # never the policy's own in their place, silently
            raise ValueError("GroupPolicyTask.loss before begin_step: the old policy's log-probs are not computed yet")
        rows = batch.sequence_keys.numpy()
        n_tokens = batch.completion_tokens
        advantage = torch.as_tensor(self.advantages[rows])
        token_inputs: dict[str, torch.Tensor] = {}
        rloo = self.loss_name == "rloo"
        if not rloo and self.kl_coef > 0:
            ref = reference.sequence_logps(dataclasses.replace(batch, token_term=None))
            if ref is None or ref.token_logp is None:
                raise ValueError("loss.kl_coef > 0 reads the reference's per-token log-probs: use reference.mode "
                                 "copy or adapter")
            token_inputs["ref"] = ref.token_logp
        if self.sampler is not None:
            token_inputs["sampler"] = self._matrix(self.sampler, rows, n_tokens)
        if rloo:
            fn = partial(_gap_only)
            sequence_inputs: dict[str, torch.Tensor] = {}
        elif self.sequence_ratio:  # GSPO: the ratio is the completion's, taken after the forward from its sums
            fn = partial(sequence_token_terms, linear=self.surrogate == "cispo")
            sequence_inputs = {}
            if self.correction is not None:
                token_inputs["weight"] = self._matrix(self._sampling_weights(rows), rows, n_tokens)
        else:
            lo = self.settings.loss
            surrogate = partial(clipped_token_terms, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
                                kl_coef=self.kl_coef, delta=self.delta,
                                kl_ratio=bool(self.settings.loss.use_bias_correction_kl), surrogate=self.surrogate,
                                temperature_pos=float(lo.sapo_temperature_pos),
                                temperature_neg=float(lo.sapo_temperature_neg))
            if self.old is None:
                fn = partial(_current_old, fn=surrogate)
            else:
                fn = surrogate
                token_inputs["old"] = self._matrix(self.old, rows, n_tokens)
            if self.correction is not None:
                token_inputs["weight"] = self._matrix(self._sampling_weights(rows), rows, n_tokens)
            sequence_inputs = {"advantage": advantage}
        if not rloo and self.off_policy is not None:  # the off-policy mask's evidence: the sampler's, else the old's
            source = self.sampler if self.sampler is not None else self.old
            if source is not None:
                token_inputs["gap_source"] = self._matrix(source, rows, n_tokens)
        batch.token_term = TokenTerm(fn, token_inputs, sequence_inputs)
        try:
            out = as_sequence_output(policy(batch))
        finally:
            batch.token_term = None
        sums = out.term_sums or {}
        device, dtype = out.logp_sum.device, out.logp_sum.dtype
        keep = torch.as_tensor(self.keep[rows], device=device, dtype=dtype)
        n = n_tokens.to(device, dtype).clamp(min=1.0)
        metrics: dict[str, torch.Tensor] = {}
        old_sum = out.logp_sum.detach() if self.old is None else torch.as_tensor(
            np.asarray([self.old[int(r)].sum() for r in rows]), device=device, dtype=dtype)
        if rloo:
            value, low, high = sequence_clipped_loss(out.logp_sum, old_sum, advantage.to(device, dtype),
                                                     epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high)
            value = value * keep
        elif self.sequence_ratio:
            lo = self.settings.loss
            loss_sum, low, high = sequence_ratio_loss(
                out.logp_sum, old_sum, n_tokens, advantage.to(device, dtype), epsilon_low=self.epsilon_low,
                epsilon_high=self.epsilon_high, delta=self.delta, kl_coef=self.kl_coef, kl_sum=sums.get("kl"),
                kl_ratio=bool(lo.use_bias_correction_kl), weight_sum=sums.get("sampling_ratio"),
                surrogate=self.surrogate, temperature_pos=float(lo.sapo_temperature_pos),
                temperature_neg=float(lo.sapo_temperature_neg), keep=self._off_policy_keep(sums, advantage, n, metrics),
                weighted_logp_sum=sums.get("weighted_logp"))
            value = completion_values(loss_sum * keep, n_tokens, self.loss_name,
                                      max_completion_length=self.max_completion_length,
                                      tokens_per_completion=self._tokens_per_completion(n_tokens, keep, rows))
            if "kl" in sums:  # as TRL logs it: the sequence ratio broadcast onto the per-token KL
                ratio = torch.exp((out.logp_sum - old_sum) / n) if self.settings.loss.use_bias_correction_kl else 1.0
                metrics["kl"] = (sums["kl"] * ratio / n).detach()
        else:
            loss_sum = sums["loss"]
            off = self._off_policy_keep(sums, advantage, n, metrics)
            if off is not None:  # the surrogate of an off-policy completion of negative advantage dropped, not its KL
                kl_loss = sums.get("kl_loss", torch.zeros_like(loss_sum))
                loss_sum = (loss_sum - kl_loss) * off + kl_loss
            value = completion_values(loss_sum * keep, n_tokens, self.loss_name,
                                      max_completion_length=self.max_completion_length,
                                      tokens_per_completion=self._tokens_per_completion(n_tokens, keep, rows))
            low, high = sums["clip_low"] / n, sums["clip_high"] / n
            if "kl" in sums:
                metrics["kl"] = (sums["kl"] / n).detach()
        metrics.update({"clip_ratio/low": low.detach(), "clip_ratio/high": high.detach(),
                        "clip_ratio/region": (low + high).detach(),
                        "reward": torch.as_tensor(self.scores[rows], device=device, dtype=dtype),
                        "advantage": advantage.to(device, dtype),
                        "completion_length": n_tokens.to(device, dtype)})
        if "sampler_gap" in sums:
            metrics["sampler_gap"] = (sums["sampler_gap"] / n).detach()
        if "sampling_ratio" in sums:  # a completion's mean weight (sequence modes: its ratio) and tokens dropped
            metrics["sampling_ratio"] = (sums["sampling_ratio"] / n).detach()
            metrics["sampling_masked"] = (sums["sampling_masked"] / n).detach()
        if out.entropy_mean is not None:
            metrics["entropy"] = out.entropy_mean.detach()
        value = self.weight * value
        coef = self.settings.router_aux_loss_coef
        if out.aux_loss is not None and coef:  # as the pair objectives: coef * aux on every unit of the micro-batch
            aux = out.aux_loss.to(value.device, value.dtype)
            value = value + coef * aux
            metrics["aux_loss"] = aux.detach().expand(value.shape[0])
        return LossOutput(value, metrics)


def _gap_only(logp, *, sampler=None):
    """RLOO's per-token term: only the train/rollout gap (its surrogate is per completion)."""
    if sampler is None:
        return {}
    return {"sampler_gap": (logp.detach() - sampler).abs()}
