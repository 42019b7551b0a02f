"""Every objective in one table: what it trains, which store kinds it reads, and what the forward returns for it.

The one place that answers "which objective does this run train?": :func:`trains_unpaired` decides the family from
the loss terms (the KTO family reads examples one at a time), and :func:`objective_for` picks, per store, the row that
trains it, as the run's ``train.objective`` (its row of ``names.TRAIN_OBJECTIVES``) names it. Set-up, ``prefpack eval``
and ``precompute-ref`` ask here; a new objective (a reward model's sequence scores, say) is its classes, their rows
here and its row in ``names.TRAIN_OBJECTIVES``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prefpack.losses import UNPAIRED_LOSS_NAMES
from prefpack.objectives.base import Objective
from prefpack.objectives.groups import PromptGroupTask
from prefpack.objectives.kto import KTOTask
from prefpack.objectives.names import OBJECTIVE_NAMES, train_objective
from prefpack.objectives.pairs import PairTask, pair_forward_options
from prefpack.objectives.pg import GroupPolicyTask, pg_forward_options
from prefpack.objectives.reward import RewardGroupTask, RewardPairTask

__all__ = ["OBJECTIVES", "ObjectiveSpec", "objective_for", "read_only_unpaired", "trains_unpaired"]


@dataclass(frozen=True)
class ObjectiveSpec:
    """One objective: its class (``make(store, settings, terms)``), the store kinds it reads, whether its losses are
    the unpaired (KTO) family's, and the forward's output it reads (``logps``: per-sequence log-prob sums)."""

    name: str
    make: Callable[..., Objective]
    reads: tuple[str, ...]
    unpaired: bool = False
    output: str = "logps"
    options: Callable[..., dict] | None = None
    """The forward's options from the run's settings alone (``forward_options`` before a store exists: a rounds
    feed wraps the forward before round 1's store is made); None: not trained by on-policy rounds."""


OBJECTIVES: dict[str, ObjectiveSpec] = {spec.name: spec for spec in (
    ObjectiveSpec("pairs", PairTask, ("pairs",), options=pair_forward_options),
    ObjectiveSpec("groups", PromptGroupTask, ("ranked", "pairs"), options=pair_forward_options),  # a pair store grouped by prompt, or ranked
    ObjectiveSpec("kto", KTOTask, ("unpaired", "pairs"), unpaired=True),  # a pair store read as KTO examples
    # a reward model (train.objective=reward): the pairs' and prompt groups' layouts, rewards instead of log-probs
    ObjectiveSpec("reward", RewardPairTask, ("pairs",), output="rewards"),
    ObjectiveSpec("reward_groups", RewardGroupTask, ("ranked", "pairs"), output="rewards"),
    # group policy gradients (train.objective=policy_gradient): a ranked store's prompts with all their samples
    ObjectiveSpec("pg_groups", GroupPolicyTask, ("ranked",), options=pg_forward_options),
)}
"""Every objective by name (``Objective.kind`` of its class is the store kind it lays out)."""


def trains_unpaired(terms: Iterable, *, paired_as_kto: bool = False) -> bool:
    """Whether loss terms (anything with a ``name``) train the KTO family: an unpaired loss term, or a pair store
    read as KTO examples (``data.paired_as_kto``)."""
    return any(t.name in UNPAIRED_LOSS_NAMES for t in terms) or bool(paired_as_kto)


def objective_for(store_kind: str, *, unpaired: bool, group_by_prompt: bool = False,
                  objective: str = OBJECTIVE_NAMES[0]) -> ObjectiveSpec:
    """The objective that trains a store of ``store_kind`` in a run of this family: KTO's examples, a ranked store's
    (or a grouped pair store's) prompt groups, else pairs, as the row of ``objective`` (``train.objective``,
    ``names.TRAIN_OBJECTIVES``) names it for that layout."""
    layout = "unpaired" if unpaired else "groups" if store_kind == "ranked" or group_by_prompt else "pairs"
    row = train_objective(objective).row(layout)
    if row is None:
        raise ValueError(f"train.objective={objective} does not train {layout} examples")
    return OBJECTIVES[row]


def read_only_unpaired(store_kind: str) -> bool:
    """Whether only the unpaired (KTO) family reads stores of this kind, so that a command given one and no loss
    scores it as KTO examples."""
    readers = [spec for spec in OBJECTIVES.values() if store_kind in spec.reads]
    return bool(readers) and all(spec.unpaired for spec in readers)
