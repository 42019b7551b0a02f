"""Weights & Biases: a W&B run named after the run folder, its files in ``RUN_DIR/wandb/``, its id in
``RUN_DIR/wandb_run_id`` so ``--resume`` continues it."""

from __future__ import annotations

import secrets
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefpack.metrics.base import Backend, MetricsSetupError, Setup, scalars, write_id

WANDB_ID_FILE = "wandb_run_id"
_WANDB_INSTALL = "pip install 'prefpack[wandb]'"


def import_wandb(project: str):
    """The ``wandb`` module, or ``MetricsSetupError`` naming the extra (or the missing project name)."""
    if not project or not project.strip():
        raise MetricsSetupError("run.wandb_project must name a W&B project when run.report_to has 'wandb'")
    try:
        import wandb
    except Exception as exc:  # ImportError, or a broken install (protobuf, pydantic versions)
        raise MetricsSetupError(
            f"run.report_to has 'wandb' but the wandb package cannot be imported ({type(exc).__name__}: "
            f"{exc}); install it with {_WANDB_INSTALL}, or remove 'wandb' from run.report_to") from None
    return wandb


def _new_run_id() -> str:
    """Eight lowercase letters and digits, as W&B's own run ids."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class WandB(Backend):
    """``wandb.init`` with ``project=run.wandb_project``, the run folder's name as run name, ``dir=RUN_DIR`` (its
    files go to ``RUN_DIR/wandb/``) and the resolved config as ``config``. The mode is W&B's own
    (``WANDB_MODE=offline`` writes ``RUN_DIR/wandb/offline-run-*`` and never uses the network). The run id is kept
    in ``RUN_DIR/wandb_run_id``: a new one for a new run, the same one on ``--resume``, where an online run that
    already holds later steps keeps them (W&B steps only go forward) and the replayed records go to
    ``metrics.jsonl`` only. W&B was asked for by name, so a missing package or a run that cannot start raises
    ``MetricsSetupError`` before any step."""

    name = "wandb"

    def __init__(self, wandb: Any, init: dict[str, Any], run_dir: Path) -> None:
        self._wandb = wandb  # the wandb module
        self._init = init  # wandb.init's arguments, to start the run again after close()
        self._run_dir = run_dir
        self._run = None  # the live run (None after close(); the next log() starts it again)
        self._floor = 0  # the first step the W&B run accepts (a resumed online run already has the earlier)
        self.run_id: str = init["id"]

    @classmethod
    def check(cls, run: Any) -> None:
        import_wandb(run.wandb_project)

    @classmethod
    def start(cls, setup: Setup) -> WandB:
        project = setup.cfg.run.wandb_project
        wandb = import_wandb(project)
        id_file = setup.run_dir / WANDB_ID_FILE
        run_id = None
        if setup.resume and id_file.exists():
            run_id = id_file.read_text(encoding="utf-8").strip() or None
            if run_id is None:
                setup.note(f"{id_file} is empty: this run goes on in a new W&B run")
        elif setup.resume:
            setup.note(f"no {id_file}: this run goes on in a new W&B run")
        resuming = run_id is not None
        if run_id is None:
            run_id = _new_run_id()
            write_id(id_file, run_id)
        init = {"project": project.strip(), "name": setup.run_dir.resolve().name, "dir": str(setup.run_dir),
                "id": run_id, "config": setup.config(), "allow_val_change": True}
        backend = cls(wandb, init, setup.run_dir)
        run = backend._start(resume="allow" if resuming else None)
        backend._floor = int(getattr(run, "starting_step", 0) or 0) if resuming else 0
        if resuming and backend._floor:
            setup.note(f"W&B: run {run_id} resumed; it already holds steps up to {backend._floor - 1}, so records "
                       f"of those steps logged again after the checkpoint go to {setup.path} only")
        elif resuming and getattr(run, "offline", False):
            setup.note(f"W&B: run {run_id} goes on offline in a new {setup.run_dir / 'wandb'}/offline-run-*-{run_id}* "
                       "folder; `wandb sync` those folders in order (oldest first)")
        elif resuming:
            setup.note(f"W&B: run {run_id} resumed")
        return backend

    def _start(self, resume: str | None):
        kwargs = dict(self._init)
        if resume is not None:
            kwargs["resume"] = resume
        try:
            self._run = self._wandb.init(**kwargs)
        except Exception as exc:  # no API key, server unreachable, bad project name...
            raise MetricsSetupError(
                f"W&B could not start run {kwargs['id']} in project {kwargs['project']!r} ({type(exc).__name__}: "
                f"{exc}); log in with `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline to keep "
                f"the run in {self._run_dir / 'wandb'} and `wandb sync` it later") from exc
        return self._run

    def log(self, record: Mapping[str, Any]) -> None:
        step = record["step"]
        if step < self._floor:
            return  # already in the resumed W&B run (W&B steps only go forward)
        data = scalars(record)
        if not data:
            return
        run = self._run or self._start(resume="allow")  # closed earlier: the same run goes on
        run.log(data, step=step)

    def close(self, status: str = "FINISHED") -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run.finish()
