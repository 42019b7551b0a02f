"""Training, one job a module: `setup` (build: an engine and a feed), `feed` (what each step trains on), `loop` (train), `cadence` (what is due between steps), `evaluation`,
`checkpoint`, `resume_check`, `run_folder` (the run folder's lock; `train` here runs under it).

Import the public API from here.
"""

from prefpack.engine import final_dtype, make_optimizer
from prefpack.training.cadence import TrainingInterrupted
from prefpack.training.evaluation import evaluate
from prefpack.training.feed import Feed, FeedStep, StoreFeed, check_lengths, total_steps
from prefpack.training.loop import TrainResult, lr_lambda, warmup_steps
from prefpack.training.run_folder import RunFolderLocked, train
from prefpack.training.setup import Setup, build

__all__ = [
    "Feed",
    "FeedStep",
    "RunFolderLocked",
    "StoreFeed",
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
