"""The weights of a run and how they are held (``core``: an Engine filled by ordered stages, one file each:
``load``, ``reference``, ``lora``, ``checkpointing``, ``budgets``; then ``wrap`` for the ranks and the optimizer,
and ``export``'s final dtype)."""

from prefpack.engine.core import Engine, Stage, build_engine
from prefpack.engine.export import final_dtype
from prefpack.engine.wrap import make_optimizer, wrap_forward

__all__ = ["Engine", "Stage", "build_engine", "final_dtype", "make_optimizer", "wrap_forward"]
