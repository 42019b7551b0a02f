"""Checkpoints that never lose a run: checksums and fallback to the newest intact checkpoint, config changes on
resume, a full disk while writing, stale temporary folders, Ctrl-C (issue 11, items 3 to 7)."""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import cfg_for, final_weights, overrides, prepare_hh_splits, quiet, tiny_llama

from prefpack.cli import main as cli_main
from prefpack.config import ConfigError, load_config
from prefpack.training import TrainingInterrupted, train
from prefpack.training.checkpoint import (
    CHECKSUMS,
    CheckpointDamaged,
    CheckpointWriteError,
    list_checkpoints,
    remove_stale_temporaries,
    verify_checkpoint,
)
from prefpack.training.resume_check import config_changes, read_config_changes, write_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_tokenizers, hh_train):
    root = tmp_path_factory.mktemp("hardening")
    tok = toy_tokenizers["llama"]
    stores = prepare_hh_splits(root, tok, hh_train, {"train": 24, "eval": 6})
    return {"root": root, **stores, "settings": BASE, "policy": tiny_llama(tok, root / "policy", 1)}


BASE = ("optim.lr=1.0e-3", "optim.schedule=constant", "train.global_batch_pairs=8", "train.max_steps=4",
        "run.plot=false", "run.tensorboard=false", "run.save_every=1", "run.keep_checkpoints=3")


def assert_same_weights(a, b):
    wa, wb = final_weights(a), final_weights(b)
    assert sorted(wa) == sorted(wb)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def temporaries(run_dir) -> list[str]:
    return sorted(p.name for folder in (run_dir, run_dir / "checkpoints") if folder.is_dir()
                  for p in folder.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


@pytest.fixture(scope="module")
def full(world):
    run = world["root"] / "full"
    train(cfg_for(world, run), progress=False, log=quiet)
    return run


@pytest.fixture(scope="module")
def cut(world):
    """A run stopped after step 3 of 4, with checkpoints at steps 1, 2 and 3."""
    run = world["root"] / "cut"
    with pytest.raises(TrainingInterrupted):
        train(cfg_for(world, run), stop_after_steps=3, progress=False, log=quiet)
    assert [p.name for p in list_checkpoints(run)] == ["step-00000001", "step-00000002", "step-00000003"]
    return run


def clone(cut, tmp_path):
    return shutil.copytree(cut, tmp_path / "run")


# ---------------------------------------------------------------- checksums


def test_every_file_of_a_checkpoint_has_a_checksum(cut):
    import hashlib

    ckpt = cut / "checkpoints" / "step-00000003"
    listed = json.loads((ckpt / CHECKSUMS).read_text())["files"]
    on_disk = sorted(p.name for p in ckpt.iterdir() if p.name != CHECKSUMS)
    assert sorted(listed) == on_disk == ["model.safetensors", "train_store.json", "trainer_state.json",
                                         "training_state.pt"]
    for name, entry in listed.items():
        data = (ckpt / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify_checkpoint(ckpt).status == "ok"


def _truncate_weights(ckpt):
    p = ckpt / "model.safetensors"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _empty_training_state(ckpt):
    (ckpt / "training_state.pt").write_bytes(b"")


def _broken_trainer_state(ckpt):
    p = ckpt / "trainer_state.json"
    text = p.read_text()
    p.write_text(text[: len(text) - 3] + "}}}")  # same length, not JSON


def _flip_a_bit(ckpt):
    p = ckpt / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[-1] ^= 0x40  # the high exponent bit of the last float32 of the last tensor
    p.write_bytes(bytes(data))


DAMAGE = {"truncated-safetensors": (_truncate_weights, "model.safetensors"),
          "empty-training-state": (_empty_training_state, "training_state.pt"),
          "broken-trainer-state": (_broken_trainer_state, "trainer_state.json"),
          "flipped-bit": (_flip_a_bit, "model.safetensors")}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(world, full, cut, tmp_path, kind):
    run = clone(cut, tmp_path)
    damage, name = DAMAGE[kind]
    damage(run / "checkpoints" / "step-00000003")
    logs = []
    train(cfg_for(world, run), resume=True, progress=False, log=logs.append)
    said = "\n".join(logs)
    assert f"step-00000003 is damaged: {name}" in said
    assert "resumed from" in said and "step-00000002 at step 2" in said
    assert (run / "checkpoints" / "damaged-step-00000003" / name).exists()  # kept, not deleted, not a checkpoint
    assert_same_weights(full, run)  # bitwise: steps 3 and 4 were trained again from step 2
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_old_checkpoints_without_checksums_are_accepted_and_still_fall_back(world, full, cut, tmp_path):
    run = clone(cut, tmp_path)
    for ckpt in list_checkpoints(run):
        (ckpt / CHECKSUMS).unlink(missing_ok=True)
    _truncate_weights(run / "checkpoints" / "step-00000003")
    logs = []
    train(cfg_for(world, run), resume=True, progress=False, log=logs.append)
    said = "\n".join(logs)
    assert "cannot be verified" in said and "step-00000003 cannot be read" in said
    assert "step-00000002 at step 2" in said
    assert_same_weights(full, run)


def test_no_intact_checkpoint_is_a_clear_error_and_changes_nothing(world, cut, tmp_path, capsys):
    run = clone(cut, tmp_path)
    for ckpt, (damage, _) in zip(list_checkpoints(run), DAMAGE.values(), strict=False):
        damage(ckpt)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(CheckpointDamaged) as info:
        train(cfg_for(world, run), resume=True, progress=False, log=quiet)
    msg = str(info.value)
    assert "no intact checkpoint" in msg
    for name in ("step-00000001: model.safetensors", "step-00000002: training_state.pt",
                 "step-00000003: trainer_state.json"):
        assert name in msg, msg
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert not (run / "final").exists()
    # the command line prints it without a traceback
    assert cli_main(["train", *overrides(world, run), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no intact checkpoint" in err and "Traceback" not in err


def test_a_distributed_format_checkpoint_hashes_every_shard_file(world, tmp_path):
    """torch.distributed.checkpoint's folder (shards + .metadata) is covered file by file."""
    from prefpack.distributed import Dist
    from prefpack.training import build, make_optimizer
    from prefpack.training.checkpoint import load_checkpoint_distributed, save_checkpoint_distributed

    cfg = cfg_for(world, tmp_path / "dcp")
    setup = build(cfg, log=quiet)
    params = [p for p in setup.policy.parameters() if p.requires_grad]
    opt = make_optimizer(params, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ctx = Dist(world=1)
    path = save_checkpoint_distributed(tmp_path / "dcp", 5, setup.policy, opt, sched, {}, 2, ctx)
    listed = json.loads((path / CHECKSUMS).read_text())["files"]
    shards = sorted(p.relative_to(path).as_posix() for p in (path / "dcp").rglob("*") if p.is_file())
    assert shards and ".metadata" in {s.split("/")[-1] for s in shards}
    assert sorted(listed) == sorted([*shards, "trainer_state.json", "training_state.pt"])
    assert verify_checkpoint(path).status == "ok"
    assert load_checkpoint_distributed(path, setup.policy, opt, sched, ctx)["step"] == 5
    shard = next(p for p in (path / "dcp").iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    verdict = verify_checkpoint(path)
    assert verdict.status == "damaged" and shard.name in verdict.describe()
    assert temporaries(tmp_path / "dcp") == []


# ---------------------------------------------------------------- config changes on resume


def test_a_changed_config_is_refused_with_every_key_listed(world, cut, tmp_path, capsys):
    run = clone(cut, tmp_path)
    saved = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError) as info:
        train(cfg_for(world, run, "optim.lr=2.0e-3", "loss.beta=0.2", f"data.train={world['eval']}"), resume=True,
              progress=False, log=quiet)
    msg = str(info.value)
    assert "optim.lr: 0.001 -> 0.002" in msg and "loss.beta: 0.1 -> 0.2" in msg
    assert f'data.train: "{world["train"]}" -> "{world["eval"]}"' in msg
    assert "--allow-config-change" in msg
    assert (run / "config.yaml").read_text() == saved
    assert cli_main(["train", *overrides(world, run, "optim.lr=2.0e-3"), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "optim.lr: 0.001 -> 0.002" in err and "Traceback" not in err


def test_allow_config_change_prints_records_and_updates_the_config(world, cut, tmp_path, capsys):
    run = clone(cut, tmp_path)
    args = overrides(world, run, "optim.lr=2.0e-3", "loss.beta=0.2")
    assert cli_main(["train", *args, "--resume", "--no-progress", "--allow-config-change"]) == 0
    err = capsys.readouterr().err
    assert "config change from step 3: optim.lr: 0.001 -> 0.002" in err
    assert "config change from step 3: loss.beta: 0.1 -> 0.2" in err
    (record,) = read_config_changes(run)
    assert record["step"] == 3
    assert record["changes"]["optim.lr"] == {"old": 0.001, "new": 0.002, "changes_result": True}
    assert record["changes"]["loss.beta"] == {"old": 0.1, "new": 0.2, "changes_result": True}
    saved = load_config(run / "config.yaml", [])
    assert saved.optim.lr == 0.002 and saved.loss.beta == 0.2
    assert (run / "final").is_dir()
    # from now on the new config is the run's: resuming with it again is accepted without the flag
    train(load_config(None, args), resume=True, progress=False, log=quiet)


def test_keys_that_cannot_change_the_result_may_change(world, cut, tmp_path):
    """With a constant schedule, more steps give exactly the uninterrupted run of that length; logging,
    evaluation, saving and the run folder's place never change the weights."""
    longer = world["root"] / "full-6"
    if not longer.exists():
        train(cfg_for(world, longer, "train.max_steps=6"), progress=False, log=quiet)
    run = clone(cut, tmp_path)  # also moved: run.output_dir differs from the saved one
    logs = []
    train(cfg_for(world, run, "train.max_steps=6", "run.log_every=2", "run.eval_every=1", "run.save_every=2",
                  "run.keep_checkpoints=1", f"data.eval={world['eval']}"), resume=True, progress=False,
          log=logs.append)
    said = "\n".join(logs)
    assert "train.max_steps: 4 -> 6" in said and "run.output_dir" in said
    assert_same_weights(longer, run)
    assert read_config_changes(run) == []
    assert load_config(run / "config.yaml", []).train.max_steps == 6


def test_schedule_length_changes_the_result_unless_the_schedule_is_constant():
    def cfg(*extra):
        return load_config(None, ["train.max_steps=4", *extra])

    def changed(a, b):
        return {c.key: c.changes_result for c in config_changes(a, b)}

    assert changed(cfg("optim.schedule=cosine"), cfg("optim.schedule=cosine", "train.max_steps=6")) == \
        {"train.max_steps": True}
    assert changed(cfg("optim.schedule=constant"), cfg("optim.schedule=constant", "train.max_steps=6")) == \
        {"train.max_steps": False}
    # a warmup given as a fraction of all steps depends on the length too
    warm = ("optim.schedule=constant", "optim.warmup_ratio=0.5")
    assert changed(cfg(*warm), cfg(*warm, "train.max_steps=6")) == {"train.max_steps": True}
    # epochs do not count while max_steps is set; they set the length when it is not
    assert changed(cfg("optim.schedule=cosine"), cfg("optim.schedule=cosine", "train.epochs=2")) == \
        {"train.epochs": False}
    epochs = load_config(None, ["optim.schedule=linear"])
    assert changed(epochs, load_config(None, ["optim.schedule=linear", "train.epochs=2"])) == {"train.epochs": True}
    assert changed(cfg(), cfg("run.log_every=5", "run.plot=false")) == {"run.log_every": False, "run.plot": False}


def test_a_resume_with_the_same_config_writes_no_config(world, full, cut, tmp_path, monkeypatch):
    """On a full disk a resume must not die writing config.yaml: an unchanged config is not written again."""
    import prefpack.config

    run = clone(cut, tmp_path)
    cfg = load_config(run / "config.yaml", [f"run.output_dir={run}"])
    write_config(cfg, run / "config.yaml")  # the clone's own folder, so the config is the run's exactly

    def no_write(*_a, **_k):
        raise AssertionError("config.yaml written again")

    monkeypatch.setattr(prefpack.config, "save_config", no_write)
    train(cfg, resume=True, progress=False, log=quiet)
    assert_same_weights(full, run)


def test_a_failed_config_write_keeps_the_old_file_and_leaves_no_temporary(world, tmp_path, monkeypatch):
    from pathlib import Path

    path = tmp_path / "config.yaml"
    write_config(load_config(None, ["optim.lr=1.0e-3"]), path)
    before = path.read_text()
    real = Path.write_text

    def half_then_full(self, text, *a, **k):
        real(self, text[: len(text) // 2], *a, **k)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_full)
    with pytest.raises(CheckpointWriteError, match=r"no space left on device writing .*config.yaml.*unchanged"):
        write_config(load_config(None, ["optim.lr=2.0e-3"]), path)
    monkeypatch.undo()
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


# ---------------------------------------------------------------- a full disk


def _fail_second_call(monkeypatch, owner, name, exc):
    real = getattr(owner, name)
    calls = []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            real(*a, **k)  # a partial file, as on a disk that fills up mid-write
            raise exc
        return real(*a, **k)

    monkeypatch.setattr(owner, name, flaky)


@pytest.mark.parametrize("writer", ["safetensors", "torch"])
def test_a_full_disk_while_checkpointing_leaves_a_resumable_run(world, full, tmp_path, monkeypatch, writer):
    import safetensors.torch

    run = tmp_path / "run"
    if writer == "safetensors":
        _fail_second_call(monkeypatch, safetensors.torch, "save_model", OSError(errno.ENOSPC, "No space left on device"))
    else:  # torch.save reports a full disk without errno; the free space tells
        _fail_second_call(monkeypatch, torch, "save",
                          RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4160 vs 4054"))
        real_usage = shutil.disk_usage
        monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=12345))
    with pytest.raises(CheckpointWriteError) as info:
        train(cfg_for(world, run), progress=False, log=quiet)
    monkeypatch.undo()
    msg = str(info.value)
    assert "no space left on device writing" in msg and "step-00000002: needs about" in msg
    assert " MiB free" in msg and "resumed from step-00000001" in msg
    assert temporaries(run) == []
    assert [p.name for p in list_checkpoints(run)] == ["step-00000001"]
    train(cfg_for(world, run), resume=True, progress=False, log=quiet)
    assert_same_weights(full, run)


def test_a_full_disk_while_saving_the_final_model_leaves_no_temporary(world, tmp_path, monkeypatch):
    import transformers.modeling_utils

    run = tmp_path / "run"

    def full_disk(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    with pytest.raises(CheckpointWriteError, match=r"no space left on device writing .*final: needs about [\d.]+ MiB"):
        train(cfg_for(world, run), progress=False, log=quiet)
    assert temporaries(run) == [] and not (run / "final").exists()


def test_the_cli_reports_a_full_disk_without_a_traceback(world, tmp_path, monkeypatch, capsys):
    import safetensors.torch

    _fail_second_call(monkeypatch, safetensors.torch, "save_model", OSError(errno.ENOSPC, "No space left on device"))
    assert cli_main(["train", *overrides(world, tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "error: no space left on device writing" in err and "Traceback" not in err


# ---------------------------------------------------------------- stale temporary folders


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_of_dead_processes_are_removed_and_live_ones_kept(world, full, cut, tmp_path):
    run = clone(cut, tmp_path)
    dead = _dead_pid()
    stale = [run / "checkpoints" / f".step-00000004.tmp-{dead}", run / f".final.tmp-{dead}",
             run / "checkpoints" / f".step-00000001.old-{dead}"]
    live = run / "checkpoints" / f".step-00000009.tmp-{os.getpid()}"
    for p in [*stale, live]:
        p.mkdir()
        (p / "model.safetensors").write_bytes(b"x" * 1000)
    logs = []
    train(cfg_for(world, run), resume=True, progress=False, log=logs.append)
    said = "\n".join(logs)
    assert "removed 3 temporary entries left by a process that is gone" in said
    assert all(not p.exists() for p in stale)
    assert live.is_dir() and "is still running" in said
    assert_same_weights(full, run)
    shutil.rmtree(live)
    assert remove_stale_temporaries(run, log=quiet) == []


# ---------------------------------------------------------------- Ctrl-C


def test_ctrl_c_says_how_to_resume_and_the_command_works(world, full, tmp_path, monkeypatch, capsys):
    import prefpack.training.loop

    real = prefpack.training.loop.save_checkpoint

    def interrupted_after_step_2(run_dir, step, *a, **k):
        out = real(run_dir, step, *a, **k)
        if step == 2:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(prefpack.training.loop, "save_checkpoint", interrupted_after_step_2)
    run = tmp_path / "run"
    assert cli_main(["train", *overrides(world, run), "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "the last checkpoint is step 2" in err
    command = err.split("continue with:")[1].strip().splitlines()[0]
    words = shlex.split(command)
    assert words[:2] == ["prefpack", "train"] and words[-1] == "--resume"
    monkeypatch.undo()
    assert cli_main(words[1:]) == 0
    assert_same_weights(full, run)
