"""The DPO family on a pair store: both halves of a pair in one row, per-pair losses from the loss registry."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from prefpack.batching.collate import collate, collate_packed
from prefpack.batching.plan import computed_tokens, plan_micro_batches
from prefpack.data.store import Store
from prefpack.data.views import StorePairs
from prefpack.data.vision_inputs import ImagePrefetcher, attach_store_images, check_store_vision
from prefpack.losses import LossOutput, LossTerm, PairLogps, preference_loss, wpo_weights
from prefpack.model import split_pairs
from prefpack.objectives.base import Objective, Planned, StepState, StepTotals
from prefpack.objectives.settings import RunSettings
from prefpack.reference import KeySpace, Reference, as_sequence_output

__all__ = ["PairTask", "pair_forward_options"]


def pair_forward_options(settings: RunSettings) -> dict:
    """The pair objectives' forward options from the run's settings alone (a feed whose stores are made during
    training wraps the forward before its first store exists)."""
    lo = settings.loss
    return {"router_aux": bool(settings.router_aux_loss_coef), "pair_tails": lo.ld_alpha is not None,
            "wpo": bool(lo.use_weighting), "entropy": True}


class PairTask(Objective):
    """The DPO family on a pair store: both halves of a pair in one row, per-pair losses."""

    kind = "pairs"

    def __init__(self, store: Store, settings: RunSettings, terms: Sequence):
        self.store = store
        self.settings = settings
        check_store_vision(store, settings.vision)
        self.pairs = StorePairs(store)
        self.terms = [LossTerm(t.name, float(t.weight)) for t in terms]
        self.bco = "bco_pair_running" in {t.name for t in self.terms}  # bco_pair (TRL 1.16) has no running mean
        self.running: dict[str, float] = {}  # bco_pair_running's reward mean and count (checkpointed)
        self._images: ImagePrefetcher | None = None  # vision runs: micro-batches' images read ahead (prefetch)

    @property
    def router_aux_loss_coef(self) -> float:
        """MoE load-balancing weight, resolved against the model by ``build`` (forward.router_aux_loss_coef); when
        non-zero the policy module must be SequenceLogps(..., router_aux=True)."""
        return self.settings.router_aux_loss_coef

    def forward_options(self) -> dict:
        """What the policy forward (``prefpack.model.forward.SequenceLogps``) must return besides the sums: the MoE aux
        loss, LD-DPO's tail sums, WPO's means. The reference forward needs only ``pair_tails``."""
        return pair_forward_options(self.settings)

    def __len__(self) -> int:
        return len(self.store)

    def key_space(self) -> KeySpace:
        """Pair p's chosen at key 2p, its rejected at 2p + 1, each with its LD-DPO tail."""
        return KeySpace("pairs", 2 * len(self.store), tails=True)

    def example_tokens(self, ids: np.ndarray) -> np.ndarray:
        """Tokens each pair costs (its prompt twice, both completions; a prompt again per extra segment), for
        balancing ranks."""
        lengths = self.pairs.lengths()[ids]
        extra = self.pairs.segment_lengths()[0][ids]
        return (2 + extra) * lengths[:, 0] + lengths[:, 1] + lengths[:, 2]

    def plan(self, ids: np.ndarray, *, seed: Any) -> list[Planned]:
        s = self.settings
        lengths = self.pairs.lengths()[ids]
        extra, longest = (x[ids] for x in self.pairs.segment_lengths())  # completions cut into segments
        share = self.shares_prompts
        plans = plan_micro_batches(lengths, token_budget=s.micro_batch_tokens, packing=s.packing,
                                   row_budget=s.row_budget, pad_to_multiple_of=s.pad_to_multiple_of, seed=seed,
                                   share_prompts=share, segments=(extra, longest) if extra.any() else None)
        totals = (2 + extra) * lengths[:, 0] + lengths[:, 1] + lengths[:, 2]  # each sequence's prompt + segment
        row_cost = lengths.sum(axis=1) if share else totals  # positions a pair takes in its row
        seq_max = lengths[:, 0] + longest
        out = []
        for mb in plans:
            real = int(sum(int(totals[r].sum()) for r in mb))
            if s.packing:
                rows = [int(row_cost[r].sum()) for r in mb]
            else:
                flat = [i for r in mb for i in r]
                rows = [int(seq_max[flat].max())] * int((2 + extra[flat]).sum())
            out.append(Planned([[int(ids[i]) for i in r] for r in mb], real, computed_tokens(rows, s.multiple)))
        return out

    @property
    def shares_prompts(self) -> bool:
        """A pair's prompt laid out once in its row (``data.prefix_sharing`` as resolved, packed rows only)."""
        return self.settings.shares_prompts

    def collate(self, planned: Planned):
        s = self.settings
        if self.shares_prompts:
            batch = collate_packed(self.pairs, planned.rows, pad_id=s.pad_id,
                                   pad_to_multiple_of=s.pad_to_multiple_of, share_prompts=True)
        else:
            batch = collate(self.pairs, planned.rows, packing=s.packing, pad_id=s.pad_id,
                            pad_to_multiple_of=s.pad_to_multiple_of)
        pairs = batch.pair_indices  # StorePairs over the whole store: local index == global id
        batch.sequence_keys = torch.stack([2 * pairs, 2 * pairs + 1], dim=1).reshape(-1)
        batch.key_store = str(self.store.path)
        if s.vision is not None:
            examples, sizes = self.image_examples(planned)
            attach_store_images([batch], self.store, examples, sizes, s.vision, self._images)
        return batch

    def image_examples(self, planned: Planned) -> tuple[list[int], list[int]]:
        """Per group of the micro-batch (in its group order): the store row whose prompt images it holds, and its
        sequences (a pair: its own row, two)."""
        flat = [int(i) for r in planned.rows for i in r]
        return flat, [2] * len(flat)

    def pair_sums(self, policy: nn.Module, reference: Reference, batch) -> tuple[PairLogps, torch.Tensor | None,
                                                                                 torch.Tensor | None, Any]:
        """The batch's pairs as :class:`PairLogps` (policy and reference sums), their WPO weights (or None), the
        MoE aux loss (or None) and the policy's mean token entropies (chosen, rejected) or None: sequence ``2p`` is
        pair p's chosen, ``2p + 1`` its rejected."""
        lo = self.settings.loss
        out = as_sequence_output(policy(batch))  # `policy`: SequenceLogps, maybe wrapped
        pol = split_pairs(out.logp_sum, out.n_tokens)
        tail, wpo_mean = out.tail_sum, out.wpo_mean
        ld = lo.ld_alpha is not None
        if ld and tail is None:
            raise ValueError("loss.ld_alpha needs the policy forward to return tail sums (SequenceLogps(pair_tails=True))")
        if lo.use_weighting and wpo_mean is None:
            raise ValueError("loss.use_weighting needs the policy forward to return WPO means (SequenceLogps(wpo=True))")
        device, dtype = pol.chosen.device, pol.chosen.dtype
        ref = reference.sequence_logps(batch)
        ref_sum = None if ref is None else ref.logp_sum.to(device, dtype)
        ref_tail = None if ref is None or ref.tail_sum is None or not ld else ref.tail_sum.to(device, dtype)
        logps = PairLogps(
            policy_chosen=pol.chosen,
            policy_rejected=pol.rejected,
            chosen_tokens=pol.chosen_tokens.to(device),
            rejected_tokens=pol.rejected_tokens.to(device),
            ref_chosen=None if ref_sum is None else ref_sum[0::2],
            ref_rejected=None if ref_sum is None else ref_sum[1::2],
            policy_chosen_tail=None if tail is None else tail[0::2],
            policy_rejected_tail=None if tail is None else tail[1::2],
            ref_chosen_tail=None if ref_tail is None else ref_tail[0::2],
            ref_rejected_tail=None if ref_tail is None else ref_tail[1::2],
        )
        weights = None
        if lo.use_weighting:
            weights = wpo_weights(wpo_mean[0::2], wpo_mean[1::2]).to(device, dtype)
        ent = out.entropy_mean
        return logps, weights, out.aux_loss, None if ent is None else (ent[0::2], ent[1::2])

    def loss(self, policy: nn.Module, reference: Reference, batch, step: StepState) -> LossOutput:
        logps, weights, aux, entropy = self.pair_sums(policy, reference, batch)
        pol_chosen, pol_rejected = logps.policy_chosen, logps.policy_rejected
        out = preference_loss(logps, self.terms, **self.settings.loss.keywords("pair"),
                              bco_delta=self.running.get("bco_delta", 0.0), pair_weights=weights)
        # Whether the policy itself ranks chosen above rejected (meaningful even when the reference equals it).
        out.metrics["logps/accuracies"] = (pol_chosen.detach() > pol_rejected.detach()).to(pol_chosen.dtype)
        if entropy is not None:  # the policy's mean token entropy over each completion's scored tokens
            out.metrics["entropy/chosen"], out.metrics["entropy/rejected"] = (e.to(pol_chosen.dtype) for e in entropy)
        if aux is not None and self.router_aux_loss_coef:
            # MoE router load-balancing loss (TRL: loss + coef * aux_loss, per forward). Losses here are per pair and
            # the loop divides the step's sum by its pair count, so coef * aux is added to EVERY pair of this
            # micro-batch: the micro-batch adds P_micro * coef * aux, and a step whose micro-batches share one aux
            # value adds exactly coef * aux (otherwise the pair-weighted mean of the micro-batches' aux values).
            aux = aux.to(out.loss.device, out.loss.dtype)
            out = LossOutput(out.loss + self.router_aux_loss_coef * aux, out.metrics)
            out.metrics["aux_loss"] = aux.detach().expand(out.loss.shape[0])
        return out

    def end_step(self, totals: StepTotals) -> None:
        """bco_pair_running's delta: the running mean of every reward (chosen and rejected, beta * log-ratio) of the
        steps so far, from the step's sums all-reduced over ranks, so every rank holds the same value and the
        update of a step does not depend on its micro-batches or ranks (older TRL releases kept such a running
        moment for bco_pair; TRL 1.16's bco_pair has none, and prefpack's bco_pair follows it)."""
        if not self.bco:
            return
        state = self.running
        total = totals.metrics.get("rewards/chosen", 0.0) + totals.metrics.get("rewards/rejected", 0.0)
        k = int(round(totals.counts.get("rewards/chosen", 0.0) + totals.counts.get("rewards/rejected", 0.0)))
        n_old = int(state.get("bco_count", 0))
        state["bco_delta"] = (float(state.get("bco_delta", 0.0)) * n_old + total) / max(n_old + k, 1)
        state["bco_count"] = n_old + k

    def state_dict(self) -> dict:
        return dict(self.running)

    def load_state_dict(self, state: dict) -> None:
        unknown = sorted(set(state) - {"bco_delta", "bco_count"})
        if unknown:
            raise ValueError(f"unknown pair-objective state {unknown}")
        self.running = dict(state)
