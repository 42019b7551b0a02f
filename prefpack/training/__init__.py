"""Training, one job a module: `setup` (build), `loop` (train), `evaluate`, `checkpoint`, `resume_check`.

Import the public API from here.
"""

from prefpack.training.evaluation import evaluate
from prefpack.training.loop import (
    TrainingInterrupted,
    TrainResult,
    lr_lambda,
    total_steps,
    train,
    warmup_steps,
)
from prefpack.training.setup import Setup, build, check_lengths, final_dtype, make_optimizer, open_pair_store

__all__ = [
    "Setup",
    "TrainResult",
    "TrainingInterrupted",
    "build",
    "check_lengths",
    "evaluate",
    "final_dtype",
    "lr_lambda",
    "make_optimizer",
    "open_pair_store",
    "total_steps",
    "train",
    "warmup_steps",
]
