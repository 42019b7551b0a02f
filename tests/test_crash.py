"""`prefpack train` killed at random moments (SIGKILL: no cleanup at all) or interrupted with Ctrl-C, then resumed:
the final weights equal an uninterrupted run's, bit for bit, and nothing temporary is left behind."""

from __future__ import annotations

import os
import random
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import tiny_llama, write_jsonl

from prefpack.cli import main as cli_main
from prefpack.config import load_config
from prefpack.data.prepare import PrepareOptions, prepare
from prefpack.training import train
from prefpack.training.checkpoint import checkpoint_step, list_checkpoints

STEPS = 10


# killed runs (subprocesses, OMP_NUM_THREADS=1) and their resumption (here) must run the same kernels
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_tokenizers, hh_train):
    root = tmp_path_factory.mktemp("crash")
    tok_dir = toy_tokenizers["llama"]
    rows = [r for r in hh_train[:40] if r["chosen"].strip() and r["chosen"] != r["rejected"]][:24]
    prepare(PrepareOptions(inputs=[str(write_jsonl(root / "train.jsonl", rows))], tokenizer=str(tok_dir),
                           output=str(root / "train"), max_length=48, min_prompt_keep=0, workers=1),
            log=lambda m: None)  # most prompts cut to almost nothing: allowed here
    tiny_llama(tok_dir, root / "policy", 3)
    full = root / "full"
    train(load_config(None, overrides(root, full)), progress=False, log=lambda m: None)
    return {"root": root, "full": full}


def overrides(root, run_dir) -> list[str]:
    return [f"model.name_or_path={root / 'policy'}", f"data.train={root / 'train'}", f"run.output_dir={run_dir}",
            "optim.lr=1.0e-3", "optim.schedule=cosine", "optim.warmup_steps=2", "train.global_batch_pairs=6",
            f"train.max_steps={STEPS}", "run.save_every=1", "run.keep_checkpoints=2", "run.plot=false",
            "run.tensorboard=false"]


def command(root, run_dir, *extra) -> list[str]:
    return [sys.executable, "-m", "prefpack", "train", *overrides(root, run_dir), "--no-progress", *extra]


def start(cmd) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # Ctrl-C as in a terminal: a suite started in the background (`cmd &`) inherits SIGINT ignored, which the
    # child would inherit too and never see the interrupt
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_checkpoint(proc, run_dir, at_least=1, timeout=120.0) -> None:
    """Until the run has written its first checkpoint (the training loop is then running)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        found = list_checkpoints(run_dir)
        if found and checkpoint_step(found[-1]) >= at_least:
            return
        time.sleep(0.005)
    if proc.poll() is not None:
        raise AssertionError(f"prefpack train ended early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
    raise AssertionError("no checkpoint appeared")


def assert_same_final_weights(a, b) -> None:
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "final" / "model.safetensors")), load_file(str(b / "final" / "model.safetensors"))
    assert sorted(wa) == sorted(wb)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def leftovers(run_dir) -> list[str]:
    return sorted(p.name for folder in (run_dir, run_dir / "checkpoints") if folder.is_dir()
                  for p in folder.iterdir() if ".tmp-" in p.name or ".old-" in p.name or p.name.startswith("damaged-"))


def wait_for_a_checkpoint_write(proc, run_dir, timeout=60.0) -> None:
    """Until a checkpoint is being written (its temporary folder exists)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if any(".tmp-" in p.name for p in (run_dir / "checkpoints").iterdir()):
            return
        time.sleep(0.001)
    raise AssertionError("no checkpoint write was seen")


@pytest.mark.parametrize("seed", [0, 1, "during-a-checkpoint-write"])
def test_sigkill_at_a_random_moment_then_resume_equals_the_uninterrupted_run(world, tmp_path, seed):
    run = tmp_path / "run"
    proc = start(command(world["root"], run))
    wait_for_checkpoint(proc, run)
    if seed == "during-a-checkpoint-write":
        wait_for_a_checkpoint_write(proc, run)
    else:
        time.sleep(random.Random(seed).uniform(0.0, 0.6))  # a step (and its checkpoint) takes about 0.05-0.2 s
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    if seed == "during-a-checkpoint-write":
        assert any(".tmp-" in name for name in leftovers(run))  # what the killed process left behind
    logs = []
    train(load_config(None, overrides(world["root"], run)), resume=True, progress=False, log=logs.append)
    assert leftovers(run) == [], logs  # a temporary folder of the killed process is removed by the resume
    assert_same_final_weights(world["full"], run)


def test_ctrl_c_exits_130_without_a_traceback_and_prints_the_resume_command(world, tmp_path):
    # The 10-step run can end between its second checkpoint and the signal on a busy machine (exit 0, a finished
    # run); that is the test's race, not an interrupted run, so such an attempt starts over.
    err = ""
    for attempt in range(3):
        run = tmp_path / f"run{attempt}"
        proc = start(command(world["root"], run))
        try:
            wait_for_checkpoint(proc, run, at_least=2)
        except AssertionError:
            if proc.returncode != 0:
                raise
            continue  # it ended before the wait saw its second checkpoint
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        if not (proc.returncode == 0 and (run / "final").is_dir()):
            break
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    assert "prefpack train: interrupted; the last checkpoint is step" in err
    last = checkpoint_step(list_checkpoints(run)[-1])
    assert f"the last checkpoint is step {last} " in err
    words = shlex.split(err.split("continue with:")[1].strip().splitlines()[0])
    assert words[:2] == ["prefpack", "train"] and words[-1] == "--resume"
    assert leftovers(run) == []
    assert cli_main(words[1:]) == 0  # the printed command, as the user would paste it
    assert_same_final_weights(world["full"], run)
