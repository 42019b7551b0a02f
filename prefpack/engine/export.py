"""What the final folder holds the weights in (the save itself, atomic and rank-aware, is
``prefpack.training.checkpoint.save_final``)."""

from __future__ import annotations

import torch

from prefpack.model import source_dtype
from prefpack.precision import DTYPES, Precision


def final_dtype(cfg, precision: Precision) -> torch.dtype:
    """``run.save_dtype``: auto = the dtype of the source checkpoint (a bfloat16 model trained with float32 masters
    is saved in bfloat16), else the dtype it trained in."""
    if cfg.run.save_dtype != "auto":
        return DTYPES[cfg.run.save_dtype]
    return source_dtype(cfg.model.name_or_path, trust_remote_code=cfg.model.trust_remote_code) or precision.weights
