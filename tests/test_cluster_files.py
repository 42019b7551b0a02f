"""The run folder on a shared cluster (issue 24): file modes under the user's umask, the run folder's lock, the
user's own files kept, resume of the same run only, eval against a store's precomputed reference."""

from __future__ import annotations

import os
import stat

import pytest
from conftest import cfg_for, prepare_hh_splits, quiet, tiny_llama

from prefpack.training import TrainingInterrupted, train

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = ("optim.lr=1.0e-3", "optim.schedule=constant", "train.global_batch_pairs=8", "train.max_steps=2",
        "run.plot=false", "run.tensorboard=false", "run.save_every=1", "run.keep_checkpoints=3")


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_tokenizers, hh_train):
    root = tmp_path_factory.mktemp("cluster")
    tok = toy_tokenizers["llama"]
    stores = prepare_hh_splits(root, tok, hh_train, {"train": 16, "eval": 6})
    return {"root": root, **stores, "settings": BASE, "policy": tiny_llama(tok, root / "policy", 1)}


def _modes(folder) -> dict[str, int]:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*") if p.is_file()}


# ---------------------------------------------------------------- file modes (item 10)


def test_every_file_of_a_run_gets_the_users_umask(world, tmp_path):
    old = os.umask(0o022)
    try:
        run = tmp_path / "run"
        train(cfg_for(world, run), progress=False, log=quiet)
    finally:
        os.umask(old)
    modes = _modes(run)
    assert "final/model.safetensors" in modes and "checkpoints/step-00000001/model.safetensors" in modes
    assert {k: v for k, v in modes.items() if v != 0o644} == {}


# ---------------------------------------------------------------- eval with a store's sidecar (item 13)


def test_eval_of_a_trained_model_reads_the_initial_models_sidecar(world, toy_tokenizers, tmp_path, capsys):
    """`--ref`'s help says the sidecar is the default reference: a trained model is scored against it (the
    sidecar was computed with the initial model, whose hash differs from the evaluated one's)."""
    import json
    import shutil

    from prefpack.cli import main as cli_main

    store = shutil.copytree(world["train"], tmp_path / "store")
    assert cli_main(["precompute-ref", "--model", str(world["policy"]), "--data", str(store)]) == 0
    trained = tiny_llama(toy_tokenizers["llama"], tmp_path / "trained", 7)  # other weights than the sidecar's
    capsys.readouterr()
    assert cli_main(["eval", "--model", str(trained), "--data", str(store), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["reference"] == "precomputed" and result["pairs"] == 16
    # the initial model against its own sidecar: zero margin, so the sigmoid loss is log 2
    assert cli_main(["eval", "--model", str(world["policy"]), "--data", str(store), "--json"]) == 0
    same = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(same["loss"] - 0.6931471805599453) < 1e-4 and abs(result["loss"] - same["loss"]) > 1e-6


# ---------------------------------------------------------------- the run folder's lock (item 2)


def test_a_second_train_on_a_locked_run_folder_is_refused_and_a_dead_holders_lock_taken_over(world, tmp_path,
                                                                                               capsys):
    import subprocess
    import sys

    from conftest import overrides

    from prefpack.cli import main as cli_main
    from prefpack.training.run_folder import LOCK_FILE

    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from prefpack.training.run_folder import RunLock; "
         f"RunLock({str(run)!r}); print('locked', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert cli_main(["train", *overrides(world, run), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"process {holder.pid} on " in err and "is in use" in err and "Traceback" not in err
        assert not (run / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    assert (run / LOCK_FILE).exists()  # killed: its lock file stays, naming a process that is gone
    assert cli_main(["train", *overrides(world, run), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"took over the lock of run folder {str(run)!r} from process {holder.pid}" in err
    assert (run / "final").is_dir() and not (run / LOCK_FILE).exists()


def test_a_lock_held_in_this_process_refuses_train(world, tmp_path):
    from prefpack.training import RunFolderLocked
    from prefpack.training.run_folder import RunLock

    run = tmp_path / "run"
    lock = RunLock(run)
    try:
        with pytest.raises(RunFolderLocked, match=f"process {os.getpid()} on .* is training there"):
            train(cfg_for(world, run), progress=False, log=quiet)
    finally:
        lock.release()
    train(cfg_for(world, run), progress=False, log=quiet)  # released: the folder is free again


# ---------------------------------------------------------------- resume of the same run only (item 5)


def _cut(world, run, *extra):
    """A run stopped after step 1 of 2 (a checkpoint at step 1 unless run.save_every=0)."""
    with pytest.raises(TrainingInterrupted):
        train(cfg_for(world, run, *extra), stop_after_steps=1, progress=False, log=quiet)


def test_a_store_swapped_at_the_same_path_is_refused_on_resume(world, tmp_path, capsys):
    import shutil

    from conftest import overrides

    from prefpack.cli import main as cli_main
    from prefpack.data.store import StoreError

    store, run = shutil.copytree(world["train"], tmp_path / "store"), tmp_path / "run"
    _cut(world, run, f"data.train={store}")
    assert (run / "checkpoints" / "step-00000001" / "train_store.json").is_file()
    shutil.rmtree(store)
    shutil.copytree(world["eval"], store)  # other data at the same path
    with pytest.raises(StoreError, match=f"training store {str(store)!r} holds other data than the run was"):
        train(cfg_for(world, run, f"data.train={store}"), resume=True, progress=False, log=quiet)
    args = ["train", *overrides(world, run, f"data.train={store}"), "--resume", "--no-progress"]
    assert cli_main([*args, "--allow-config-change"]) == 2
    err = capsys.readouterr().err
    assert "content hash" in err and "--allow-config-change does not apply to the data" in err
    shutil.rmtree(store)
    shutil.copytree(world["train"], store)  # the run's data back: the resume goes on
    train(cfg_for(world, run, f"data.train={store}"), resume=True, progress=False, log=quiet)
    assert (run / "final").is_dir()


def test_a_checkpoint_written_before_store_identities_still_resumes(world, tmp_path):
    """A run folder and checkpoint from before `train_store.json` (so nothing records the store) resume as before,
    and the checkpoint still verifies against its own checksums."""
    from prefpack.training.checkpoint import verify_checkpoint
    from prefpack.training.checkpoint.files import write_checksums

    run = tmp_path / "run"
    _cut(world, run)
    ckpt = run / "checkpoints" / "step-00000001"
    for path in (run / "train_store.json", ckpt / "train_store.json"):
        path.unlink()
    (ckpt / "checksums.json").unlink()
    write_checksums(ckpt)  # the manifest an older prefpack wrote: no train_store.json in it
    assert verify_checkpoint(ckpt).status == "ok"
    train(cfg_for(world, run), resume=True, progress=False, log=quiet)
    assert (run / "final").is_dir()


def test_a_resume_without_the_runs_config_yaml_refuses_a_changed_config(world, tmp_path, capsys):
    from conftest import overrides

    from prefpack.cli import main as cli_main
    from prefpack.config import ConfigError

    run = tmp_path / "run"
    _cut(world, run)
    (run / "config.yaml").unlink()
    with pytest.raises(ConfigError, match="config.yaml is missing and .* holds checkpoints"):
        train(cfg_for(world, run, "optim.lr=2.0e-3"), resume=True, progress=False, log=quiet)
    args = ["train", *overrides(world, run, "optim.lr=2.0e-3"), "--resume", "--no-progress"]
    assert cli_main([*args, "--allow-config-change"]) == 0
    assert "config.yaml was missing; written with this config" in capsys.readouterr().err
    assert "lr: 0.002" in (run / "config.yaml").read_text()


def test_resume_without_a_checkpoint_starts_over_and_drops_the_old_metrics_lines(world, tmp_path):
    from conftest import metrics_lines

    run = tmp_path / "run"
    _cut(world, run, "run.save_every=0", "run.log_every=1")
    assert [r["step"] for r in metrics_lines(run)] == [1]
    logs = []
    train(cfg_for(world, run, "run.save_every=0", "run.log_every=1"), resume=True, progress=False, log=logs.append)
    assert [r["step"] for r in metrics_lines(run)] == [1, 2]
    assert any("lines an earlier start wrote" in line for line in logs)


# ---------------------------------------------------------------- the user's files in the run folder (item 4)


def test_the_users_config_in_the_run_folder_is_refused_never_replaced(world, tmp_path, capsys):
    from conftest import overrides

    from prefpack.cli import main as cli_main

    run = tmp_path / "exp"
    run.mkdir()
    mine = "# my experiment: keep these comments\noptim:\n  lr: 1.0e-3  # tuned by hand\n"
    (run / "config.yaml").write_text(mine)
    assert cli_main(["train", str(run / "config.yaml"), *overrides(world, run), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'config.yaml'} is not a config prefpack wrote" in err and "move your file out" in err
    assert (run / "config.yaml").read_text() == mine and not (run / "metrics.jsonl").exists()
    # moved next to the run folder, it trains; the run's config.yaml is prefpack's own, which a new start replaces
    (run / "config.yaml").rename(tmp_path / "exp.yaml")
    assert cli_main(["train", str(tmp_path / "exp.yaml"), *overrides(world, run), "--no-progress"]) == 0
    assert (tmp_path / "exp.yaml").read_text() == mine


def test_the_users_readme_in_final_is_kept_when_the_final_model_is_written_again(world, tmp_path):
    run = tmp_path / "run"
    train(cfg_for(world, run, "train.max_steps=1"), progress=False, log=quiet)
    (run / "final" / "README.md").write_text("# my model card\n")
    train(cfg_for(world, run, "train.max_steps=2", "optim.warmup_steps=0"), resume=True, progress=False, log=quiet)
    assert (run / "final" / "README.md").read_text() == "# my model card\n"
    assert (run / "final" / "model.safetensors").is_file()


def test_a_refused_config_leaves_no_run_folder_behind(world, tmp_path):
    from prefpack.config import ConfigError

    run = tmp_path / "new"
    with pytest.raises(ConfigError):
        train(cfg_for(world, run, "optim.lr=-1"), progress=False, log=quiet)
    assert not run.exists()
