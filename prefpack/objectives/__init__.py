"""What the training loop trains: the pair objective (DPO family) and the unpaired one (KTO family) behind one
interface (``base.Objective``), and the choice between them for a config (``select``)."""

from prefpack.objectives.base import Objective, Planned, StepState, StepTotals, release_images
from prefpack.objectives.kto import KTOBatch, KTOStep, KTOTask
from prefpack.objectives.pairs import PairTask
from prefpack.objectives.select import make_objectives, open_store, uses_unpaired_loss
from prefpack.objectives.settings import LossParams, RunSettings, Term, config_terms, settings_from_config

__all__ = ["KTOBatch", "KTOStep", "KTOTask", "LossParams", "Objective", "PairTask", "Planned", "RunSettings",
           "StepState", "StepTotals", "Term", "release_images", "config_terms", "make_objectives", "open_store", "settings_from_config",
           "uses_unpaired_loss"]
