"""KTO's micro-batches: what a planned one holds and the batch it collates to (read like TRL's KTO batch).

A micro-batch holds whole examples with their KL sequences (an example and its KL sequence always land in
the same micro-batch). Packed (default): main sequences are packed into rows of at most
``data.max_tokens_per_row`` tokens, ``train.micro_batch_tokens // max_tokens_per_row`` rows per micro-batch
(the budget of the gradient pass; ``prefpack.batching``'s one planner and collator, an example being a group of
one sequence); the micro-batch's KL sequences are packed into their own rows under the
same row budget for the no-grad pass. With ``data.prefix_sharing`` (packed only) the step's examples are planned by
prompt group (``UnpairedView.groups``: a pair's two halves under ``paired_as_kto``, or repeated prompts of an
unpaired store): a group's examples share one row (cut into runs where they would not fit one), its prompt laid
out once then each completion, and their KL sequences (the same prompt with each partner's completion) are laid
out the same way in the KL rows. Examples are numbered in group order, so example k is still sequence k of both
passes; a micro-batch whose groups are all single examples keeps the unshared layout. Padded
(``data.packing=false``): one sequence per row. Either way the batch reads with the key names TRL's KTO collator
uses: ``input_ids``, ``attention_mask``, ``completion_mask`` for the policy branch, ``KL_input_ids``,
``KL_attention_mask``, ``KL_completion_mask`` for the KL branch, and ``label``. ``completion_mask`` is 1 where the
*input* token is a completion token (TRL's meaning; ``Batch.loss_mask`` is the same thing shifted onto the position
that predicts it); a completion token a store marks unscored (``prefpack.data.spans``) is 0, since the mask says
which tokens count.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from prefpack.batching.collate import Batch
from prefpack.batching.plan import balanced_rows
from prefpack.data.spans import scored_of
from prefpack.objectives.base import Planned

__all__ = ["KTOBatch", "KTOPlanned", "kl_rows_of_groups", "shared_completion_mask"]


def kl_rows_of_groups(mb_groups: list[int], groups: list[np.ndarray], kl_cost: np.ndarray,
             capacity: int) -> tuple[list[list[int]], list[int]]:
    """A micro-batch's KL rows (positions in its flat example order) and their sizes: whole prompt groups
    (``mb_groups``, in flat order) balanced over rows, so a group's KL sequences can share their prompt too."""
    starts = np.cumsum([0] + [len(groups[g]) for g in mb_groups])
    sizes = kl_cost[mb_groups]
    rows = balanced_rows(sizes, capacity)
    return ([[int(k) for j in r for k in range(starts[j], starts[j + 1])] for r in rows],
            [int(sizes[r].sum()) for r in rows])


def shared_completion_mask(parts, rows: list[list[int]], shape) -> torch.Tensor:
    """TRL's ``completion_mask`` (1 where the input token is a scored completion token, as ``collate_groups`` marks
    it) of a prompt-shared layout: each group's prompt, then its completions back to back
    (``collate_groups(share_prompts=True)``)."""
    mask = torch.zeros(shape, dtype=torch.int64)
    for r, row in enumerate(rows):
        at = 0
        for g in row:
            prompt, completions = parts[g]
            at += len(prompt)
            for c in completions:
                scored = scored_of(c)
                mask[r, at : at + len(c)] = 1 if scored is None else torch.from_numpy(scored.astype(np.int64))
                at += len(c)
    return mask


@dataclass
class KTOPlanned(Planned):
    """A planned KTO micro-batch: ``rows`` of example ids (the main pass), each example's KL partner
    (aligned with ``rows``; -1 without a KL branch) and the KL rows (indices into the micro-batch's examples
    in row order; with shared prompts a prompt group's examples sit together in one KL row, as in ``rows``)."""

    kl_partners: list[list[int]]
    kl_rows: list[list[int]]


_TRL_KEYS = {
    "input_ids": ("main", "input_ids"),
    "attention_mask": ("main", "attention_mask"),
    "position_ids": ("main", "position_ids"),
    "completion_mask": ("completion_mask", None),
    "KL_input_ids": ("kl", "input_ids"),
    "KL_attention_mask": ("kl", "attention_mask"),
    "KL_position_ids": ("kl", "position_ids"),
    "KL_completion_mask": ("kl_completion_mask", None),
    "label": ("label", None),
}


@dataclass
class KTOBatch:
    """One KTO micro-batch: the main sequences (with grad), the KL sequences (no grad) and the labels.

    Example k of the micro-batch is sequence k of ``main`` and sequence k of ``kl``. Reads like TRL's KTO
    batch: ``batch["input_ids"]``, ``batch["KL_completion_mask"]``, ``batch["label"]`` ... (see ``keys()``);
    ``attention_mask`` and ``KL_attention_mask`` are None in the packed layout, where attention follows
    ``position_ids``.
    """

    main: Batch
    kl: Batch | None
    completion_mask: torch.Tensor  # [B, L] int64, 1 where input_ids is a completion token
    kl_completion_mask: torch.Tensor | None
    label: torch.Tensor  # [n] bool, True = desirable
    example_ids: torch.Tensor  # [n] int64, index in the task's view of the store
    kl_ids: torch.Tensor  # [n] int64, the KL partner of each example (-1 without a KL branch)

    @property
    def packed(self) -> bool:
        return self.main.packed

    @property
    def num_examples(self) -> int:
        return int(self.label.shape[0])

    @property
    def real_tokens(self) -> int:
        return self.main.real_tokens + (self.kl.real_tokens if self.kl is not None else 0)

    @property
    def computed_tokens(self) -> int:
        return self.main.computed_tokens + (self.kl.computed_tokens if self.kl is not None else 0)

    @property
    def positions(self) -> int:
        return self.main.positions + (self.kl.positions if self.kl is not None else 0)

    @property
    def scored_positions(self) -> int:
        return self.main.scored_positions + (self.kl.scored_positions if self.kl is not None else 0)

    def keys(self) -> list[str]:
        return [k for k in _TRL_KEYS if self.kl is not None or not k.startswith("KL_")]

    def __getitem__(self, key: str):
        if key not in _TRL_KEYS:
            raise KeyError(f"{key!r}; a KTO batch has the keys {self.keys()}")
        part, name = _TRL_KEYS[key]
        obj = getattr(self, part)
        if name is None or obj is None:
            return obj
        return getattr(obj, name)

    def as_dict(self) -> dict[str, torch.Tensor | None]:
        return {k: self[k] for k in self.keys()}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KTOBatch:
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Batch | torch.Tensor):
                v = v.to(device, non_blocking=non_blocking)
            moved[f.name] = v
        kl = moved["kl"]
        if kl is not None and self.main.pixel_values is not None and self.kl.pixel_values is self.main.pixel_values:
            kl.pixel_values = moved["main"].pixel_values  # the images both passes read: one copy on the device
        return KTOBatch(**moved)
