"""What the training loop trains: the pair objective (DPO family) and the unpaired one (KTO family) behind one
interface (``base.Objective``), the table of them (``registry``) and the choice for a config (``select``)."""

from prefpack.objectives.base import Objective, Planned, StepState, StepTotals, release_images
from prefpack.objectives.kto import KTOBatch, KTOStep, KTOTask
from prefpack.objectives.pairs import PairTask
from prefpack.objectives.registry import (
    OBJECTIVES,
    ObjectiveSpec,
    objective_for,
    read_only_unpaired,
    trains_unpaired,
)
from prefpack.objectives.select import make_objectives, open_store, uses_unpaired_loss
from prefpack.objectives.settings import LossParams, RunSettings, Term, config_terms, settings_from_config

__all__ = ["OBJECTIVES", "KTOBatch", "KTOStep", "KTOTask", "LossParams", "Objective", "ObjectiveSpec", "PairTask",
           "Planned", "RunSettings", "StepState", "StepTotals", "Term", "config_terms", "make_objectives",
           "objective_for", "open_store", "read_only_unpaired", "release_images", "settings_from_config", "trains_unpaired",
           "uses_unpaired_loss"]
