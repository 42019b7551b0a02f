"""KTO on unpaired examples: the task the training loop runs, its batches, the KL pairing and its sidecar.

An example is (prompt, completion, label): label True for a desirable completion, False for an undesirable
one. It comes from an unpaired store (``prepare --format unpaired``), or from a pair store with
``data.paired_as_kto=true``: pair p gives example 2p (prompt, chosen, desirable) and 2p + 1 (prompt,
rejected, undesirable), so the store yields twice as many examples as pairs.

The KL reference point
----------------------
KTO compares each reward r = log pi(y|x) - log ref(y|x) with z0 = max(0, E[log pi(y'|x) - log ref(y'|x)]),
estimated on *mismatched* sequences: each example's prompt x with the completion y' of another example
(its "KL partner"), chosen by ``loss.kl_pairing`` (``prefpack.data.kl_pairing``: ``step``, the default as in
TRL, pairs inside the optimizer step; ``fixed`` gives each example one seeded partner, which a precomputed
reference and every evaluation pass use).

The KL sequences are scored in :meth:`KTOTask.begin_step`, under ``torch.no_grad`` for the policy and the
reference, over every micro-batch of the step before any loss: z0 needs the whole step, it is a constant for
the gradient, and a no-grad pass keeps no activations. The sum of ``policy - reference`` over the KL
sequences and their count are all-reduced across ranks (when ``torch.distributed`` is initialized) and then
divided, so z0 is the same on every rank and does not depend on how the step was dealt (padding micro-batches
that a distributed loop runs with weight 0 are excluded when their weights are passed to ``begin_step``).

Batches
-------
Laid out in ``prefpack.objectives.kto_batch`` (an example and its KL sequence always share a micro-batch; TRL's
key names).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from prefpack.batching.collate import Batch, collate_groups
from prefpack.batching.plan import computed_tokens, fit_runs, plan_groups
from prefpack.data.kl_pairing import SALT_STEP, fixed_kl_partners, step_kl_partners
from prefpack.data.store import Store, StoreError
from prefpack.data.views import UnpairedView
from prefpack.data.vision_inputs import ImagePrefetcher, attach_store_images, check_store_vision
from prefpack.distributed import SINGLE, Dist
from prefpack.losses.pairwise import LossOutput
from prefpack.losses.unpaired import (
    UNPAIRED_LOSS_NAMES,
    UNPAIRED_LOSSES_WITH_KL,
    UnpairedLogps,
    class_balance_warning,
    kl_reference_point,
    unpaired_loss,
)
from prefpack.objectives.base import Objective, StepState
from prefpack.objectives.kto_batch import KTOBatch, KTOPlanned, kl_rows_of_groups, shared_completion_mask
from prefpack.objectives.settings import RunSettings
from prefpack.reference import KeySpace, Reference, as_sequence_output, partners_tag

__all__ = ["KTOBatch", "KTOPlanned", "KTOStep", "KTOTask"]


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------------------
# The task


def _seed_key(seed: Any) -> list[int]:
    if isinstance(seed, int | np.integer):
        return [int(seed)]
    if isinstance(seed, Sequence) and all(isinstance(s, int | np.integer) for s in seed):
        return [int(s) for s in seed]
    raise TypeError(f"a KTO plan seed must be an int, a sequence of ints or None, got {seed!r}")


@dataclass
class KTOStep(StepState):
    """KTO's step-wide values: z0 and the sums it came from, and the step's (desirable, undesirable) counts."""

    class_counts: tuple[int, int]
    kl: float | None = None
    kl_sum: float = 0.0
    kl_count: float = 0.0


class KTOTask(Objective):
    """KTO / APO-zero-unpaired on unpaired examples (or a pair store with ``data.paired_as_kto``).

    Implements ``prefpack.objectives.base.Objective``: ``plan_step`` (the KL partners of a whole step), ``plan``
    (a share of the step's micro-batches, with those partners),
    ``collate`` (a :class:`KTOBatch`), ``begin_step`` (z0 over the whole step, all ranks) and ``loss``
    (one value per example). ``begin_step`` is a collective over the ``dist`` it is given (the loop's ranks): every
    rank must call it, with its own (possibly empty) share of the step's micro-batches.
    """

    kind = "unpaired"

    def __init__(self, store: Store, settings: RunSettings, terms: Sequence):
        self.store = store
        self.settings = settings
        check_store_vision(store, settings.vision)
        self.view = UnpairedView(store, paired_as_kto=settings.paired_as_kto)
        if len(terms) != 1 or terms[0].name not in UNPAIRED_LOSS_NAMES:
            raise ValueError(f"a KTO run takes exactly one loss term among {', '.join(UNPAIRED_LOSS_NAMES)}, "
                             f"got {[t.name for t in terms]}")
        self.loss_name = terms[0].name
        self.term_weight = float(terms[0].weight)
        self.needs_kl = self.loss_name in UNPAIRED_LOSSES_WITH_KL
        self.kl_pairing = settings.loss.kl_pairing
        self.seed = settings.seed
        self._fixed: np.ndarray | None = None
        self._images: ImagePrefetcher | None = None  # vision runs: micro-batches' images read ahead (prefetch)
        self._step: tuple[list[int], np.ndarray, np.ndarray] | None = None  # plan_step's (seed key, ids, partners)
        if self.needs_kl and len(self.view) < 2:
            raise StoreError(f"store {str(store.path)!r} holds {len(self.view)} example: KTO's KL term needs the "
                             "completion of another example; add examples or use loss apo_zero_unpaired")

    def forward_options(self) -> dict:
        """KTO reads the per-sequence sums (no MoE aux loss, LD-DPO or WPO: those are pair options), and logs the
        policy's mean token entropy."""
        return {"entropy": True}

    def __len__(self) -> int:
        return len(self.view)

    def counts(self) -> dict[str, int]:
        """Its examples (KTO scores examples, not pairs)."""
        return {"examples": len(self)}

    def class_balance_warning(self) -> str | None:
        n_d = int(self.view.labels.sum())
        lo = self.settings.loss
        return class_balance_warning(n_d, len(self.view) - n_d, lo.desirable_weight, lo.undesirable_weight)

    def key_space(self) -> KeySpace:
        """Example i at key i, its KL sequence at N + i; tagged with the view and (with a KL term) the fixed
        pairing, the only one a table can hold (step pairing draws partners per step)."""
        tags = {"view": self.view.source}
        if self.needs_kl:
            tags["kl_pairing"] = partners_tag(self.fixed_partners())
        flags = (" --kto" if self.view.paired else "") + (f" --seed {self.seed}" if self.needs_kl else "")
        return KeySpace("unpaired", 2 * len(self.view), tags=tags, labels={"kl_seed": str(self.seed)}, flags=flags)

    def reference_batches(self, batch: KTOBatch) -> list[Batch]:
        return [batch.main] if batch.kl is None else [batch.main, batch.kl]

    # ---- pairing

    def fixed_partners(self) -> np.ndarray:
        if self._fixed is None:
            self._fixed = fixed_kl_partners(self.view.groups, self.seed)
        return self._fixed

    def plan_step(self, ids: np.ndarray, *, seed: Any) -> None:
        """Draw the KL partners of the whole step (``kl_pairing: step``) before its examples are dealt to ranks, so
        a rank that plans only its share gets the partners one process would: the update depends neither on the
        number of ranks nor on the dealing."""
        if not self.needs_kl or self.kl_pairing == "fixed" or seed is None:
            return
        key = _seed_key(seed)
        ids = np.array(ids, dtype=np.int64)  # a copy: the state outlives the caller's array
        self._step = (key, ids, step_kl_partners(ids, self.view.groups, [*key, SALT_STEP], self.fixed_partners()))

    def partners_for(self, ids: np.ndarray, seed: Any) -> np.ndarray:
        """KL partners of ``ids`` (``seed`` as given to :meth:`plan`).

        * ``kl_pairing: fixed``, or ``seed=None`` (an evaluation pass over the store): the fixed pairing.
        * ``seed`` the key :meth:`plan_step` last saw (the training loop's ``StepKey(train.seed, step)``) and ``ids``
          inside that step: the partners drawn there for the *whole* step.
        * any other ``ids``/seed: a pairing inside ``ids`` seeded by ``seed``.
        """
        ids = np.asarray(ids, dtype=np.int64)
        if self.kl_pairing == "fixed" or seed is None:
            return self.fixed_partners()[ids]
        key = _seed_key(seed)
        if self._step is not None and self._step[0] == key:
            step_ids, partners = self._step[1:]
            order = np.argsort(step_ids, kind="stable")
            pos = np.searchsorted(step_ids, ids, sorter=order)
            pos = order[np.minimum(pos, len(order) - 1)]
            if len(step_ids) and np.array_equal(step_ids[pos], ids):
                return partners[pos]
        return step_kl_partners(ids, self.view.groups, [*key, SALT_STEP], self.fixed_partners())

    def schedule_groups(self) -> np.ndarray:
        """Examples of one prompt (a pair's two halves with ``data.paired_as_kto``, several completions of a prompt
        in an unpaired store) are shuffled as a block, so they share a step and, packed, one copy of the prompt.
        Stores whose prompts all differ shuffle exactly as before."""
        return self.view.groups

    def example_tokens(self, ids: np.ndarray) -> np.ndarray:
        """Tokens each example costs, for balancing ranks: its sequence, twice with a KL branch (the KL
        sequence has the same prompt and a completion of another example, of similar length on average)."""
        ids = np.asarray(ids, dtype=np.int64)
        main = self.view.prompt_len[ids] * (1 + self.view.extra_segments[ids]) + self.view.completion_len[ids]
        return 2 * main if self.needs_kl else main

    # ---- Task protocol

    @property
    def shares_prompts(self) -> bool:
        """A prompt group's examples laid out after one copy of their prompt (``data.prefix_sharing``, packed only)."""
        return self.settings.shares_prompts

    def _step_groups(self, ids: np.ndarray, partners: np.ndarray, capacity: int) -> list[np.ndarray]:
        """Positions in ``ids`` by prompt group (groups in order of first appearance, examples in ``ids`` order)
        when prompts are shared, so the planner keeps a group in one row; else one example per group. A group
        longer than a row (many completions of one prompt) is cut into runs that fit, in both passes."""
        if not self.shares_prompts:
            return [np.array([k]) for k in range(len(ids))]
        v = self.view
        _, first, inverse = np.unique(v.groups[ids], return_index=True, return_inverse=True)
        rank = np.argsort(np.argsort(first))[inverse]
        sizes = np.stack([v.completion_len[ids], v.completion_len[np.maximum(partners, 0)]], axis=1)
        return [run for g in np.split(np.argsort(rank, kind="stable"), np.cumsum(np.bincount(rank))[:-1])
                for run in fit_runs(g, int(v.prompt_len[ids[g[0]]]), sizes, capacity)]

    def plan(self, ids: np.ndarray, *, seed: Any) -> list[KTOPlanned]:
        s = self.settings
        ids = np.asarray(ids, dtype=np.int64)
        v = self.view
        main_len = v.prompt_len[ids] + v.completion_len[ids]
        partners = self.partners_for(ids, seed) if self.needs_kl else np.full(ids.shape[0], -1, dtype=np.int64)
        kl_len = v.prompt_len[ids] + v.completion_len[np.maximum(partners, 0)]
        # completions cut into segments: each extra segment is one more sequence (a padded row; unshared, one more
        # copy of the prompt); none without
        extra = v.extra_segments[ids]
        kl_extra = np.where(partners >= 0, v.extra_segments[np.maximum(partners, 0)], 0)
        main_real, kl_real = main_len + v.prompt_len[ids] * extra, kl_len + v.prompt_len[ids] * kl_extra
        m = s.multiple
        capacity = max((s.row_budget // m) * m, 1)
        groups = self._step_groups(ids, partners, capacity)
        # positions a group takes in a packed row: its prompt once, then each completion (one example: its sequence,
        # a prompt again per extra segment)
        prompt = v.prompt_len[ids[[g[0] for g in groups]]]
        completion, kl_completion = v.completion_len[ids], v.completion_len[np.maximum(partners, 0)]
        if not self.shares_prompts:
            completion = completion + v.prompt_len[ids] * extra
            kl_completion = kl_completion + v.prompt_len[ids] * kl_extra
        main_cost = prompt + np.array([completion[g].sum() for g in groups], dtype=np.int64)
        kl_cost = prompt + np.array([kl_completion[g].sum() for g in groups], dtype=np.int64)
        pieces = np.array([int((1 + extra[g]).sum()) for g in groups], dtype=np.int64)  # padded rows of a group
        out = []
        for mb in plan_groups(main_cost, token_budget=s.micro_batch_tokens, packing=s.packing,
                              row_budget=s.row_budget, pad_to_multiple_of=s.pad_to_multiple_of, seed=seed,
                              longest_sequence=None if not extra.any() else
                              np.array([int(main_len[g].max()) for g in groups], dtype=np.int64),
                              sequences_per_group=pieces):
            rows = [[int(k) for g in r for k in groups[g]] for r in mb]
            flat = [k for r in rows for k in r]
            if s.packing:
                main_rows = [int(main_cost[r].sum()) for r in mb]
            else:
                main_rows = [int(main_len[flat].max())] * int((1 + extra[flat]).sum())
            real = int(main_real[flat].sum())
            computed = computed_tokens(main_rows, m)
            kl_rows: list[list[int]] = []
            if self.needs_kl:
                if s.packing:
                    kl_rows, kl_row_sizes = kl_rows_of_groups([g for r in mb for g in r], groups, kl_cost, capacity)
                else:
                    kl_rows = [[k] for k in range(len(flat))]
                    kl_row_sizes = [int(kl_len[flat].max())] * int((1 + kl_extra[flat]).sum())
                real += int(kl_real[flat].sum())
                computed += computed_tokens(kl_row_sizes, m)
            out.append(KTOPlanned(rows=[[int(ids[k]) for k in r] for r in rows], real_tokens=real,
                                  computed_tokens=computed,
                                  kl_partners=[[int(partners[k]) for k in r] for r in rows],
                                  kl_rows=kl_rows))
        return out

    def collate(self, planned: KTOPlanned) -> KTOBatch:
        s = self.settings
        v = self.view
        flat = [i for r in planned.rows for i in r]
        partners = [p for r in planned.kl_partners for p in r]
        examples = [v[i] for i in flat]
        groups, group_rows = self._row_groups(planned.rows)
        if len(groups) < len(flat):  # some prompt is shared: one copy per group in both passes
            main, kl, cmask, kl_cmask = self._collate_shared(examples, flat, partners, groups, group_rows,
                                                             planned.kl_rows)
        else:
            main, cmask = collate_groups([(p, (c,)) for p, c, _ in examples], group_rows if s.packing else None,
                                         ids=flat, pad_id=s.pad_id, pad_to_multiple_of=s.pad_to_multiple_of,
                                         completion_mask=True)
            kl = kl_cmask = None
            if self.needs_kl:
                kl_groups = [(examples[k][0], (v.completion(partners[k]),)) for k in range(len(flat))]
                kl, kl_cmask = collate_groups(kl_groups, planned.kl_rows if s.packing else None, ids=flat,
                                              pad_id=s.pad_id, pad_to_multiple_of=s.pad_to_multiple_of,
                                              completion_mask=True)
        if s.vision is not None:  # both passes' groups read the same prompts: one preprocessing of their images
            rows_of, sizes = self.image_examples(planned)
            attach_store_images([main, kl], self.store, rows_of, sizes, s.vision, self._images)
        ids = torch.tensor(flat, dtype=torch.int64)  # example k is sequence k of both passes
        main.sequence_keys, main.key_store = ids, str(self.store.path)
        if kl is not None:
            kl.sequence_keys, kl.key_store = len(v) + ids, str(self.store.path)
        return KTOBatch(main=main, kl=kl, completion_mask=cmask, kl_completion_mask=kl_cmask,
                        label=torch.tensor([lab for _, _, lab in examples], dtype=torch.bool),
                        example_ids=torch.tensor(flat, dtype=torch.int64),
                        kl_ids=torch.tensor(partners, dtype=torch.int64))

    def image_examples(self, planned: KTOPlanned) -> tuple[list[int], list[int]]:
        """Per group of the micro-batch (an example, or with shared prompts a prompt group's examples of one row):
        the store row whose prompt (and images) it holds, and its sequences; the KL pass has the same groups."""
        flat = [int(i) for r in planned.rows for i in r]
        groups, _ = self._row_groups(planned.rows)
        return [self.prompt_row(flat[g[0]]) for g in groups], [len(g) for g in groups]

    def prompt_row(self, i: int) -> int:
        """The store row whose prompt (and images) example ``i`` holds (a pair's two halves: the pair's row)."""
        return int(i) // 2 if self.view.paired else int(i)

    def _row_groups(self, rows: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
        """The micro-batch's groups (positions in its flat example order) and each row's groups: with shared
        prompts, consecutive examples of one row with the same prompt (how :meth:`plan` lays a group out)."""
        groups: list[list[int]] = []
        group_rows: list[list[int]] = []
        at = 0
        for r in rows:
            group_rows.append([])
            for k, i in enumerate(r):
                if not (self.shares_prompts and k and self.view.groups[i] == self.view.groups[r[k - 1]]):
                    groups.append([])
                    group_rows[-1].append(len(groups) - 1)
                groups[-1].append(at + k)
            at += len(r)
        return groups, group_rows

    def _collate_shared(self, examples, flat, partners, groups, group_rows, kl_rows):
        """The main and KL batches and completion masks of :meth:`collate` with each group's prompt laid out once,
        in the main rows and in the KL rows (a group's KL sequences are its prompt with each partner's completion)."""
        s, v = self.settings, self.view
        main_parts = [(examples[g[0]][0], tuple(examples[k][1] for k in g)) for g in groups]
        group_ids = [int(v.groups[flat[g[0]]]) for g in groups]  # Batch.group_ids: the view's prompt group
        main = collate_groups(main_parts, group_rows, ids=group_ids, pad_id=s.pad_id,
                              pad_to_multiple_of=s.pad_to_multiple_of, share_prompts=True)
        kl = kl_cmask = None
        if self.needs_kl:
            of = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
            kl_group_rows = [list(dict.fromkeys(int(of[k]) for k in r)) for r in kl_rows]
            if sum(len(groups[g]) for r in kl_group_rows for g in r) != len(of):
                raise ValueError("a prompt group's KL sequences must share one KL row")
            kl_parts = [(examples[g[0]][0], tuple(v.completion(partners[k]) for k in g)) for g in groups]
            kl = collate_groups(kl_parts, kl_group_rows, ids=group_ids, pad_id=s.pad_id,
                                pad_to_multiple_of=s.pad_to_multiple_of, share_prompts=True)
            kl_cmask = shared_completion_mask(kl_parts, kl_group_rows, kl.input_ids.shape)
        return main, kl, shared_completion_mask(main_parts, group_rows, main.input_ids.shape), kl_cmask

    @staticmethod
    def _policy_logps(policy: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``policy`` maps a batch to per-sequence sums (``prefpack.model.forward.SequenceLogps``, maybe wrapped), their
        token counts and mean token entropies (None unless the forward gives them)."""
        n = int(batch.completion_tokens.shape[0])
        out = as_sequence_output(policy(batch))
        return out.logp_sum[:n], out.n_tokens[:n], None if out.entropy_mean is None else out.entropy_mean[:n]

    @torch.no_grad()
    def _reference_logps(self, reference: Reference, batch: KTOBatch, *, kl: bool, device, dtype) -> torch.Tensor:
        part = batch.kl if kl else batch.main
        out = reference.sequence_logps(part)
        if out is None:
            raise ValueError("this loss needs reference log-probs; reference.mode 'none' gives none")
        return out.logp_sum[:int(part.completion_tokens.shape[0])].to(device=device, dtype=dtype)

    def begin_step(self, policy: nn.Module, reference: Reference, batches: list[KTOBatch],
                   weights: Sequence[float] | None = None, dist: Dist = SINGLE) -> KTOStep:
        """Step-wide state, over every micro-batch of the step and every rank, before any loss:

        * ``kl`` = z0 = max(0, kl_sum / kl_count): the sum of (policy - reference) over the KL sequences and
          their count, under no_grad (z0 is a constant of the loss), all-reduced across ranks, then divided;
        * ``class_counts`` = (desirable, undesirable) examples of the step (for the margin and count metrics).

        ``weights`` (one per batch; default 1) lets a distributed loop run *padding* micro-batches (weight 0:
        duplicates that keep FSDP2's collective forwards in step) without counting them twice: their KL
        forward still runs, their values are not added. ``dist``: the run's ranks; every rank must call this with
        its own (possibly empty) share of the step, since the sums are all-reduced over them.
        """
        acc = self.step_sums(policy, reference, batches, weights)
        dist.all_reduce_sum(acc)
        return self.step_state(acc)

    def step_sums(self, policy: nn.Module, reference: Reference, batches: list[KTOBatch],
                  weights: Sequence[float] | None = None) -> torch.Tensor:
        """This rank's sums of :meth:`begin_step` (float64: kl_sum, kl_count, n_desirable, n_undesirable), before the
        all-reduce; a mixture of KTO stores adds its sources' sums, so z0 is the whole step's."""
        weights = [1.0] * len(batches) if weights is None else [float(w) for w in weights]
        if len(weights) != len(batches):
            raise ValueError(f"{len(weights)} weights for {len(batches)} micro-batches")
        device = _model_device(policy)
        acc = torch.zeros(4, dtype=torch.float64, device=device)  # kl_sum, kl_count, n_desirable, n_undesirable
        with torch.no_grad():
            for b, w in zip(batches, weights):
                n_d = int(b.label.sum())
                acc[2] += w * n_d
                acc[3] += w * (b.num_examples - n_d)
                if not self.needs_kl:
                    continue
                pol, _, _ = self._policy_logps(policy, b.kl)
                ref = self._reference_logps(reference, b, kl=True, device=pol.device, dtype=pol.dtype)
                acc[0] += w * (pol.double() - ref.double()).sum().to(device)
                acc[1] += w * pol.shape[0]
        return acc

    def step_state(self, acc: torch.Tensor) -> KTOStep:
        """The step's state from its sums over every rank (:meth:`step_sums`, all-reduced)."""
        kl_sum, kl_count, n_d, n_u = (float(x) for x in acc.cpu())
        step = KTOStep(class_counts=(int(round(n_d)), int(round(n_u))))
        if self.needs_kl:
            step.kl, step.kl_sum, step.kl_count = kl_reference_point(kl_sum, kl_count), kl_sum, kl_count
        return step

    def loss(self, policy: nn.Module, reference: Reference, batch: KTOBatch, step: StepState) -> LossOutput:
        if not isinstance(step, KTOStep) or (self.needs_kl and step.kl is None):
            raise RuntimeError("KTOTask.begin_step must run over the step's micro-batches before loss()")
        pol, tokens, entropy = self._policy_logps(policy, batch.main)
        ref = self._reference_logps(reference, batch, kl=False, device=pol.device, dtype=pol.dtype)
        label = batch.label.to(pol.device)
        logps = UnpairedLogps(policy=pol, reference=ref, label=label, tokens=tokens.to(pol.device))
        out = unpaired_loss(logps, self.loss_name, **self.settings.loss.keywords("unpaired"),
                            kl=float(step.kl or 0.0), weight=self.term_weight, class_counts=step.class_counts)
        if entropy is not None:  # the policy's mean token entropy: desirable examples as chosen, undesirable rejected
            desirable = label.bool()
            out.metrics["entropy/chosen"] = entropy[desirable].to(pol.dtype)
            out.metrics["entropy/rejected"] = entropy[~desirable].to(pol.dtype)
        return out
