"""What each ``train.objective`` is, in one torch-free table: the config, the engine, set-up and ``prefpack eval``
look a run's objective up here instead of testing its name (``tests/test_objective_table.py`` checks that the config's
``Objective`` choices are this table's rows and that no ``objective == "..."`` test is left elsewhere).

Torch-free, like ``reference/names.py``, so that ``prefpack.config`` can read it without loading torch
(``prefpack.objectives`` loads its other modules on first use). ``rows`` names rows of ``registry.OBJECTIVES``
(the classes that train each store layout), so a new objective is a row here, its classes and their registry rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

__all__ = ["LAYOUTS", "OBJECTIVE_NAMES", "PG_LOSS_NAMES", "TRAIN_OBJECTIVES", "TrainObjective", "train_objective"]

PG_LOSS_NAMES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "rloo")
"""``train.objective=policy_gradient``'s losses: GRPO's token-level aggregations by TRL's ``loss_type`` names, and
RLOO (sequence-level ratios, leave-one-out baseline)."""

LAYOUTS: tuple[str, ...] = ("pairs", "groups", "unpaired")
"""How a store is read: ``pairs`` one pair at a time, ``groups`` a prompt's completions together (a ranked store, or
a pair store with ``data.group_by_prompt``), ``unpaired`` one example at a time (the KTO family)."""


@dataclass(frozen=True)
class TrainObjective:
    """One value of ``train.objective`` and what the rest of prefpack asks of it."""

    name: str
    head: Literal["lm", "score"]
    """``lm``: per-sequence log-probs from the causal LM's head; ``score``: a one-label sequence classifier's score
    (the model loads as ``AutoModelForSequenceClassification``)."""
    rows: Mapping[str, str | None]
    """Store layout (``LAYOUTS``) -> the ``registry.OBJECTIVES`` row that trains it; None: the layout is refused."""
    reads_reference: bool
    """Whether its losses may read a reference model (False: ``reference.mode`` is ignored, set to none)."""
    lora_task: Literal["CAUSAL_LM", "SEQ_CLS"]
    """peft's task type (SEQ_CLS trains the new ``score`` head in full beside the adapters)."""
    ranked_pairs: Literal["best_vs_rest", "all_pairs"]
    """What ``data.ranked_pairs=auto`` resolves to."""
    reads_margins: bool = False
    """Whether a pair store's margins (``margins.bin``) are read."""
    sets_pad_token: bool = False
    """Whether the model's config must name a pad token (transformers' classifier finds each row's last token by it)."""
    token_shards: bool = True
    """Whether it runs with ``distributed.sequence_parallel`` > 1."""
    four_bit: bool = True
    """Whether it trains over 4-bit base weights (``model.quantization``)."""
    rounds: bool = False
    """Whether on-policy rounds (``rounds.count``) train it."""
    loss_names: tuple[str, ...] | None = None
    """The ``loss.terms`` names it trains (exactly one of them); None: the DPO and KTO families' registries."""
    per_token: bool = False
    """Whether its loss reads per-token log-probs (the policy's against the sampler's, a per-token KL to the
    reference): the reference then returns them, and a precomputed reference (per-sequence sums) cannot serve it."""
    round_output: Literal["pairs", "ranked"] = "pairs"
    """What an on-policy round writes of its scored samples: the pairs ``rounds.pairs`` draws, or every sample of
    every prompt with its score (a ranked store)."""

    @property
    def sequence_classifier(self) -> bool:
        """Whether the model loads as a sequence classifier (a score head) rather than a causal LM."""
        return self.head == "score"

    def row(self, layout: str) -> str | None:
        """The registry row that trains stores read as ``layout`` (None: this objective does not read them)."""
        return self.rows[layout]


TRAIN_OBJECTIVES: Mapping[str, TrainObjective] = MappingProxyType({o.name: o for o in (
    # the policy by its loss.terms: the DPO family over pairs or prompt groups, or the KTO family
    TrainObjective("preference", head="lm", rows={"pairs": "pairs", "groups": "groups", "unpaired": "kto"},
                   reads_reference=True, lora_task="CAUSAL_LM", ranked_pairs="best_vs_rest", rounds=True),
    # a reward model (docs/reward-models.md): Bradley-Terry over the same layouts, no reference, InstructGPT's pairs
    TrainObjective("reward", head="score", rows={"pairs": "reward", "groups": "reward_groups", "unpaired": None},
                   reads_reference=False, lora_task="SEQ_CLS", ranked_pairs="all_pairs", reads_margins=True,
                   sets_pad_token=True, token_shards=False, four_bit=False),
    # group policy gradients over a ranked store's (a round's) k scored samples per prompt (docs/losses.md): GRPO's
    # aggregations by TRL's names, RLOO's sequence-level surrogate
    TrainObjective("policy_gradient", head="lm", rows={"pairs": None, "groups": "pg_groups", "unpaired": None},
                   reads_reference=True, lora_task="CAUSAL_LM", ranked_pairs="best_vs_rest", rounds=True,
                   loss_names=PG_LOSS_NAMES, per_token=True, round_output="ranked"),
)})
"""Every ``train.objective`` by name; its order is the config's choices' order (the first is the default)."""

OBJECTIVE_NAMES: tuple[str, ...] = tuple(TRAIN_OBJECTIVES)


def train_objective(cfg_or_name) -> TrainObjective:
    """The row of a config's ``train.objective`` (or of a name). A config without the key (an older or partial one)
    trains the first row, the default."""
    name = cfg_or_name if isinstance(cfg_or_name, str) else getattr(cfg_or_name.train, "objective", OBJECTIVE_NAMES[0])
    try:
        return TRAIN_OBJECTIVES[name]
    except KeyError:
        raise ValueError(f"unknown train.objective {name!r}; choose one of {', '.join(OBJECTIVE_NAMES)}") from None
