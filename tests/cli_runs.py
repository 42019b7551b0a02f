"""Run several ``prefpack`` command lines one after another in one process: under torchrun, one launch whose ranks
run them in turn in one process group, so a test comparing runs pays the interpreter's, torch's and the launcher's
start-up once. Usage: ``cli_runs.py FILE`` where FILE holds a JSON list of argument lists; stops at the first that
exits non-zero, with its exit status. An entry ``{"call": "module:function", "args": [...]}`` instead runs a test's
own step between two commands (damaging a checkpoint, say): on rank 0, the other ranks waiting for it.

The group is left once, after the last command: a gloo group cannot be joined again under the same launch (the
second join reads the first one's addresses from torchrun's store and fails to connect), so each command's own
``shutdown`` is skipped; commands find the group already joined (``init_from_env``)."""

import importlib
import json
import sys

import torch.distributed as torch_dist

import prefpack.distributed as distributed
from prefpack.cli import main


def run_call(spec: dict) -> None:
    """``module:function(*args)`` on rank 0 (or the one process), then a barrier where a group is joined."""
    if not torch_dist.is_initialized() or torch_dist.get_rank() == 0:
        module, name = spec["call"].split(":")
        getattr(importlib.import_module(module), name)(*spec.get("args", []))
    if torch_dist.is_initialized():
        torch_dist.barrier()


def run_commands(path: str) -> None:
    """The command lines in the JSON file ``path``, in turn, in this process (group); exits with the first
    non-zero status."""
    with open(path, encoding="utf-8") as fh:
        runs = json.load(fh)
    leave = distributed.shutdown
    distributed.shutdown = lambda: None
    try:
        for argv in runs:
            if isinstance(argv, dict):
                run_call(argv)
                continue
            status = main(argv)
            if status:
                sys.exit(status)
    finally:
        leave()


if __name__ == "__main__":
    run_commands(sys.argv[1])
