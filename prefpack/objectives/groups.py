"""The DPO family over prompt groups: each prompt with its completions is one example (a group); every completion
is computed once, and the group's pairs are gathered from the per-completion sums, so every pair loss works
unchanged and a completion shared by several pairs costs nothing more. The groups are a ranked store's prompts
with their scored completions (pairs by ``data.ranked_pairs``), or a pair store's pairs grouped by prompt
(``data.group_by_prompt``; a prompt's pairs form several groups where they pass what the store's data settings
allow, up to 2,048 positions, or its longest pair: ``PairGroups``). A step takes ``train.global_batch_pairs`` groups
and its loss is the mean over the pairs they yield."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from prefpack.batching.collate import collate_groups
from prefpack.batching.plan import computed_tokens, plan_groups
from prefpack.data.store import Store, StoreError
from prefpack.data.views import PairGroups, RankedGroups
from prefpack.data.vision_inputs import attach_store_images
from prefpack.losses import PairLogps, wpo_weights
from prefpack.objectives.base import Planned
from prefpack.objectives.pairs import PairTask
from prefpack.objectives.settings import RunSettings
from prefpack.reference import KeySpace, Reference, as_sequence_output

__all__ = ["PromptGroupTask"]


class PromptGroupTask(PairTask):
    """Pair losses over the pairs of prompt groups (see the module docstring)."""

    kind = "groups"

    def __init__(self, store: Store, settings: RunSettings, terms: Sequence):
        super().__init__(store, settings, terms)
        if store.kind == "ranked":
            self.view = RankedGroups(store, settings.ranked_pairs)
        else:
            self.view = PairGroups(store)
        if len(self.view) == 0:
            raise StoreError(f"store {str(store.path)!r}: no prompt yields a pair (every prompt's completions tie); "
                             "nothing to train on")

    def __len__(self) -> int:
        return len(self.view)

    def run_note(self) -> str | None:
        """What a run should be told: a pair store's grouping (how much it saves), or the ranked groups that give no
        pair (all their scores tie)."""
        if self.store.kind == "pairs":
            pairs, comps = len(self.store), int(self.view.sizes.sum())
            per_group, step = pairs / len(self.view), self.settings.global_batch
            cost = self.view.costs(np.arange(len(self.view)), shared=self.shares_prompts)[0]
            over = int((cost > self.settings.row_budget).sum()) if self.settings.packing else 0
            return (f"data.group_by_prompt: the {pairs} pairs of {self.store.path} read as {len(self.view)} prompt "
                    f"groups with {comps} distinct completions (of {2 * pairs}), each at most {self.view.cap} "
                    f"positions ({self.view.cap_source}); train.global_batch_pairs counts "
                    f"groups, {per_group:.2f} pairs each on average (a step of {step} holds about "
                    f"{per_group * step:.0f} pairs)"
                    + (f"; {over} groups pass the {self.settings.row_budget}-token row budget and each trains in a "
                       "row of its own" if over else ""))
        n = self.view.groups_without_pairs
        if not n:
            return None
        return (f"{n} of {n + len(self.view)} prompts of {self.store.path} give no pair (their completions' scores "
                "all tie) and are left out")

    def key_space(self) -> KeySpace:
        """A ranked store: each completion at its row (no tails: they depend on the pair, and a ranked row joins
        several). A pair store: the pair keys, each repeated completion filled from the one computed."""
        if isinstance(self.view, PairGroups):
            return KeySpace("pairs", 2 * len(self.store), tails=True, copies=self.view.copies)
        return KeySpace("ranked", len(self.store))

    def units(self, ids: np.ndarray) -> int:
        """The loss terms a step's examples give: the pairs of its prompt groups."""
        return int(self.view.num_pairs[np.asarray(ids, dtype=np.int64)].sum())

    def counts(self) -> dict[str, int]:
        """The pairs its prompts yield, and the prompts."""
        return {**super().counts(), "prompts": len(self)}

    def example_tokens(self, ids: np.ndarray) -> np.ndarray:
        return self.view.costs(np.asarray(ids, dtype=np.int64), shared=False)[0]

    def plan(self, ids: np.ndarray, *, seed: Any) -> list[Planned]:
        s = self.settings
        ids = np.asarray(ids, dtype=np.int64)
        cost, longest = self.view.costs(ids, shared=self.shares_prompts)
        real = self.view.real_tokens(ids)
        sizes = self.view.pieces(ids)  # padded rows: one per sequence, a completion's segments each one
        plans = plan_groups(cost, token_budget=s.micro_batch_tokens, packing=s.packing, row_budget=s.row_budget,
                            longest_sequence=longest, sequences_per_group=sizes,
                            pad_to_multiple_of=s.pad_to_multiple_of, seed=seed)
        out = []
        for mb in plans:
            if s.packing:
                rows = [int(cost[r].sum()) for r in mb]
            else:
                flat = [i for r in mb for i in r]
                rows = [int(longest[flat].max())] * int(sizes[flat].sum())
            out.append(Planned([[int(ids[i]) for i in r] for r in mb], int(sum(int(real[r].sum()) for r in mb)),
                               computed_tokens(rows, s.multiple)))
        return out

    def collate(self, planned: Planned):
        s = self.settings
        flat = [i for r in planned.rows for i in r]
        local, at = [], 0
        for r in planned.rows:
            local.append(list(range(at, at + len(r))))
            at += len(r)
        groups = [self.view[i] for i in flat]
        batch = collate_groups(groups, local if s.packing else None, ids=flat, pad_id=s.pad_id,
                               pad_to_multiple_of=s.pad_to_multiple_of, share_prompts=self.shares_prompts)
        # a pair store's groups count every pair's tokens (``PairGroups.real_tokens``), deduplicated ones included
        ids = np.asarray(flat, dtype=np.int64)
        batch.shared_tokens += int((self.view.real_tokens(ids) - self.view.costs(ids, shared=False)[0]).sum())
        chosen, rejected, rows = self._drawn_pairs(flat)
        batch.sequence_keys, batch.key_store = torch.as_tensor(rows, dtype=torch.long), str(self.store.path)
        # LD-DPO's tails depend on the pair: a forward asked for them (pair_tails) computes them per drawn pair
        batch.tail_pairs = torch.as_tensor(np.stack([chosen, rejected]), dtype=torch.long)
        if isinstance(self.view, PairGroups):  # the drawn store pairs' own keys, where a pair sidecar has tails
            drawn = torch.as_tensor(np.concatenate([self.view.pair_rows[i] for i in flat]), dtype=torch.long)
            batch.tail_keys = torch.stack([2 * drawn, 2 * drawn + 1])
        if s.vision is not None:
            examples, sizes = self.image_examples(planned)
            attach_store_images([batch], self.store, examples, sizes, s.vision, self._images)
        return batch

    def image_examples(self, planned: Planned) -> tuple[list[int], list[int]]:
        """Per prompt group of the micro-batch: the store row whose prompt (and images) it was read from, and its
        completions."""
        flat = [int(i) for r in planned.rows for i in r]
        return [self.prompt_row(i) for i in flat], [int(self.view.sizes[i]) for i in flat]

    def prompt_row(self, i: int) -> int:
        """The store row whose prompt (and images) example ``i`` holds: a pair store's group, its first pair; a
        ranked store's group, its first completion's row."""
        if isinstance(self.view, PairGroups):
            return int(self.view.keys[int(i)][0]) // 2
        return int(self.view.first_row[int(i)])

    def _drawn_pairs(self, examples) -> tuple[list[int], list[int], np.ndarray]:
        """The batch's pairs as sequence indices (chosen, rejected: each group's completions in order, groups in
        batch order) and the store rows of its sequences."""
        chosen, rejected, rows, at = [], [], [], 0
        for i in examples:
            chosen.extend(at + c for c, _ in self.view.pairs[i])
            rejected.extend(at + r for _, r in self.view.pairs[i])
            rows.append(self.view.rows(i))
            at += int(self.view.sizes[i])
        return chosen, rejected, np.concatenate(rows)

    def pair_sums(self, policy: nn.Module, reference: Reference, batch) -> tuple[PairLogps, torch.Tensor | None,
                                                                                 torch.Tensor | None, Any]:
        """Every completion's sums once, then each pair's chosen and rejected gathered from them."""
        out = as_sequence_output(policy(batch))
        logp, n_tokens, tail, wpo_mean = out.logp_sum, out.n_tokens, out.tail_sum, out.wpo_mean
        lo = self.settings.loss
        if lo.use_weighting and wpo_mean is None:
            raise ValueError("loss.use_weighting needs the policy forward to return WPO means (SequenceLogps(wpo=True))")
        ld = lo.ld_alpha is not None
        if ld and (tail is None or batch.tail_pairs is None):
            raise ValueError("loss.ld_alpha needs the batch's drawn pairs (PromptGroupTask.collate) and the policy "
                             "forward's tails (SequenceLogps(pair_tails=True))")
        chosen, rejected, _ = self._drawn_pairs(batch.group_ids.numpy())
        device, dtype = logp.device, logp.dtype
        c_idx, r_idx = (torch.as_tensor(x, dtype=torch.long, device=device) for x in (chosen, rejected))
        ref_out = reference.sequence_logps(batch)
        ref = None if ref_out is None else ref_out.logp_sum.to(device, dtype)
        ref_tail = None if ref_out is None or ref_out.tail_sum is None else ref_out.tail_sum.to(device, dtype)
        if ld and ref is not None and ref_tail is None:
            raise ValueError("loss.ld_alpha needs the reference's tails (reference.configure(pair_tails=True))")
        tokens = n_tokens.to(device)
        logps = PairLogps(policy_chosen=logp[c_idx], policy_rejected=logp[r_idx], chosen_tokens=tokens[c_idx],
                          rejected_tokens=tokens[r_idx], ref_chosen=None if ref is None else ref[c_idx],
                          ref_rejected=None if ref is None else ref[r_idx],
                          policy_chosen_tail=tail[0] if ld else None, policy_rejected_tail=tail[1] if ld else None,
                          ref_chosen_tail=ref_tail[0] if ld and ref is not None else None,
                          ref_rejected_tail=ref_tail[1] if ld and ref is not None else None)
        weights = None
        if lo.use_weighting:
            weights = wpo_weights(wpo_mean[c_idx], wpo_mean[r_idx]).to(device, dtype)
        ent = out.entropy_mean
        return logps, weights, out.aux_loss, None if ent is None else (ent[c_idx], ent[r_idx])
