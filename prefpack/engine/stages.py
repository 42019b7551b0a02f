"""The stages of :func:`prefpack.engine.core.build_engine`, in the order they run (see that module's doc)."""

from prefpack.engine.activation_offloading import ActivationOffloadingStage
from prefpack.engine.budgets import BudgetStage
from prefpack.engine.checkpointing import CheckpointingStage
from prefpack.engine.load import LoadStage
from prefpack.engine.lora import LoraStage
from prefpack.engine.offload import OffloadStage
from prefpack.engine.reference import ReferenceStage

STAGES = (OffloadStage(), LoadStage(), ReferenceStage(), LoraStage(), CheckpointingStage(), ActivationOffloadingStage(),
          BudgetStage())
