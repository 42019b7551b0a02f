"""SIGTERM under torchrun reaching one rank only (a scheduler need not signal every process at the same instant):
every rank stops after the same step, one checkpoint is written, and resuming equals an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_distributed
import torch
from conftest import run_prefpack
from test_distributed import _losses, _weights

from prefpack.training.checkpoint import checkpoint_step, list_checkpoints

world = test_distributed.world  # its store, tiny model and two-rank config
EXTRA = ("train.max_steps=30", "run.save_every=0", "run.log_every=1", "distributed.strategy=ddp")


def _descendants(pid: int) -> list[int]:
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _rank_pid(root: int, rank: int) -> int | None:
    for pid in _descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            return pid
    return None


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks' processes through /proc")
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(world):
    full, cut = world["root"] / "sigterm-full", world["root"] / "sigterm-cut"
    args = ["train", str(world["conf"]), "--no-progress", *EXTRA]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "prefpack",
           *args, f"run.output_dir={cut}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics, end = cut / "metrics.jsonl", time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < end:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.01)
    pid = _rank_pid(proc.pid, 1)
    assert pid is not None and proc.poll() is None
    os.kill(pid, signal.SIGTERM)  # rank 1 only
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, err[-3000:]
    assert "prefpack train: terminated by signal 15 after step" in err, err[-3000:]  # rank 0 says it
    step = int(err.split("after step ")[1].split(";")[0])
    assert [checkpoint_step(c) for c in list_checkpoints(cut)] == [step]
    assert 2 <= step < 30
    # rank 0 wrote metrics up to the step every rank stopped after, and no further
    assert [m["step"] for m in map(json.loads, metrics.read_text().splitlines())][-1] == step
    run_prefpack([*args, f"run.output_dir={full}"], [*args, f"run.output_dir={cut}", "--resume"], nproc=2)
    w1, w2 = _weights(full), _weights(cut)
    for k in w1:
        assert torch.equal(w1[k], w2[k]), k
    assert _losses(full) == _losses(cut)
