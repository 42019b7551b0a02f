"""Training, one job a module: `setup` (build), `loop` (train), `cadence` (what is due between steps), `evaluation`,
`checkpoint`, `resume_check`, `run_folder` (the run folder's lock; `train` here runs under it).

Import the public API from here.
"""

from prefpack.training.cadence import TrainingInterrupted
from prefpack.training.evaluation import evaluate
from prefpack.training.loop import (
    TrainResult,
    lr_lambda,
    total_steps,
    warmup_steps,
)
from prefpack.training.run_folder import RunFolderLocked, train
from prefpack.training.setup import Setup, build, check_lengths, final_dtype, make_optimizer

__all__ = [
    "RunFolderLocked",
    "Setup",
    "TrainResult",
    "TrainingInterrupted",
    "build",
    "check_lengths",
    "evaluate",
    "final_dtype",
    "lr_lambda",
    "make_optimizer",
    "total_steps",
    "train",
    "warmup_steps",
]
