"""The stages of :func:`prefpack.engine.core.build_engine`, in the order they run (see that module's doc)."""

from prefpack.engine.activation_offloading import ActivationOffloadingStage
from prefpack.engine.budgets import BudgetStage
from prefpack.engine.checkpointing import CheckpointingStage
from prefpack.engine.load import LoadStage
from prefpack.engine.lora import LoraStage
from prefpack.engine.offload import OffloadStage
from prefpack.engine.quantize import QuantizeStage
from prefpack.engine.reference import ReferenceStage

# the refusals that need no weights first (CPU offload's world, 4-bit's rules); 4-bit before load: transformers
# quantises while it loads, so the load stage reads what the quantize stage set
STAGES = (OffloadStage(), QuantizeStage(), LoadStage(), ReferenceStage(), LoraStage(), CheckpointingStage(),
          ActivationOffloadingStage(), BudgetStage())
