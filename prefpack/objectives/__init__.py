"""What the training loop trains: the pair objective (DPO family) and the unpaired one (KTO family) behind one
interface (``base.Objective``), and the choice between them for a config (``select``)."""

from prefpack.objectives.base import Objective, Planned, StepState, StepTotals
from prefpack.objectives.kto import KTOBatch, KTOStep, KTOTask
from prefpack.objectives.pairs import PairTask
from prefpack.objectives.select import make_objectives, open_store, uses_unpaired_loss

__all__ = ["KTOBatch", "KTOStep", "KTOTask", "Objective", "PairTask", "Planned", "StepState", "StepTotals",
           "make_objectives", "open_store", "uses_unpaired_loss"]
