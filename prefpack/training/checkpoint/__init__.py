"""Checkpoints of a run and its final model: ``formats`` (one interface, ``save_checkpoint``/``load_checkpoint``,
for the single-process and the torchrun format; resume with fallback) and ``final`` (the final save), over
``files`` (checksums, listing, stale temporaries, failed-write reports); ``dcp_read`` reads a sharded checkpoint
without unpickling anything but its metadata's own classes."""

from prefpack.training.checkpoint.dcp_read import CheckpointRefused
from prefpack.training.checkpoint.files import (
    CHECKSUMS,
    CheckpointDamaged,
    CheckpointWriteError,
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    remove_stale_temporaries,
    verify_checkpoint,
    write_checksums,
)
from prefpack.training.checkpoint.final import save_final
from prefpack.training.checkpoint.formats import (
    Checkpointed,
    load_checkpoint,
    load_checkpoint_distributed,
    load_checkpoint_single,
    resume_from_checkpoints,
    save_checkpoint,
    save_checkpoint_distributed,
    save_checkpoint_single,
)

__all__ = [
    "CHECKSUMS",
    "CheckpointDamaged",
    "CheckpointRefused",
    "CheckpointWriteError",
    "Checkpointed",
    "checkpoint_step",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_checkpoint_distributed",
    "load_checkpoint_single",
    "remove_stale_temporaries",
    "resume_from_checkpoints",
    "save_checkpoint",
    "save_checkpoint_distributed",
    "save_checkpoint_single",
    "save_final",
    "verify_checkpoint",
    "write_checksums",
]
