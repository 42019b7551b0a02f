"""The stages of :func:`prefpack.engine.core.build_engine`, in the order they run (see that module's doc)."""

from prefpack.engine.budgets import BudgetStage
from prefpack.engine.checkpointing import CheckpointingStage
from prefpack.engine.load import LoadStage
from prefpack.engine.lora import LoraStage
from prefpack.engine.quantize import QuantizeStage
from prefpack.engine.reference import ReferenceStage

# 4-bit first: transformers quantises while it loads, so the load stage reads what the quantize stage set
STAGES = (QuantizeStage(), LoadStage(), ReferenceStage(), LoraStage(), CheckpointingStage(), BudgetStage())
