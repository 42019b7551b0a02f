"""On-policy rounds in one training process (prefpack.rounds.live, the default): three rounds read the policy from
disk once, at the start (each round samples the weights in memory), keep one optimizer whose state counts the steps
of every round, and with ``rounds.optimizer: reset`` write exactly the files of rounds run as separate trainings
(``rounds.in_process: false``: each round's policy saved, read back, sampled and trained with a fresh optimizer)."""

from __future__ import annotations

import pytest
import torch

from prefpack.config import load_config
from prefpack.rounds import run_rounds
from tests.conftest import quiet
from tests.test_rounds import overrides, task  # noqa: F401 - task: the quickstart fixture, built for this module too

ROUNDS, STEPS = 3, 4
LIVE = (f"rounds.count={ROUNDS}", f"rounds.steps_per_round={STEPS}", "rounds.eval_prompts=null", "run.save_every=100",
        "optim.schedule=linear")
FILES = ("samples.jsonl", "samples.meta.json", "store/tokens.bin", "store/index.bin", "train/final/model.safetensors")


def rounds_config(task, run: str, *extra: str):  # noqa: F811
    return load_config(None, overrides(task, run, *LIVE, *extra))


def optimizer_steps(checkpoint) -> int:
    state = torch.load(checkpoint / "training_state.pt", weights_only=True)["optimizer"]["state"]
    return int(next(iter(state.values()))["step"])


@pytest.fixture(scope="module")
def runs(task, one_thread):  # noqa: F811
    """The three runs, the first with every model load counted."""
    from transformers import PreTrainedModel

    loads: list[str] = []
    original = PreTrainedModel.from_pretrained.__func__

    def counted(cls, path, *args, **kwargs):
        loads.append(str(path))
        return original(cls, path, *args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(counted)
    try:
        keep = run_rounds(rounds_config(task, "live_keep"), log=quiet, progress=False)
    finally:
        PreTrainedModel.from_pretrained = classmethod(original)
    reset = run_rounds(rounds_config(task, "live_reset", "rounds.optimizer=reset"), log=quiet, progress=False)
    restart = run_rounds(rounds_config(task, "restart", "rounds.optimizer=reset", "rounds.in_process=false"),
                         log=quiet, progress=False)
    return {"keep": keep, "reset": reset, "restart": restart, "loads": loads}


def test_three_rounds_read_the_policy_once(runs, task):  # noqa: F811
    # the policy and its copied reference, both from the initial folder, before round 1: no round's final model is
    # ever read back (each is written, for the user and the record)
    assert runs["loads"] == [str(task / "init")] * 2
    for r in range(1, ROUNDS + 1):
        assert (task / "live_keep" / "rounds" / f"{r:03d}" / "train" / "final" / "model.safetensors").is_file()
    assert [m["round"] for m in runs["keep"].rounds] == list(range(ROUNDS))
    assert runs["keep"].final_dir == task / "live_keep" / "rounds" / f"{ROUNDS:03d}" / "train" / "final"


def test_one_optimizer_spans_the_rounds(runs, task):  # noqa: F811
    # each round's end is checkpointed; AdamW's step count there is every step so far (keep) or the round's (reset)
    for r in range(1, ROUNDS):
        step = r * STEPS
        assert optimizer_steps(task / "live_keep" / "checkpoints" / f"step-{step:08d}") == step
        assert optimizer_steps(task / "live_reset" / "checkpoints" / f"step-{step:08d}") == STEPS
    # a carried optimizer trains other weights than a fresh one from round 2 on
    from safetensors.torch import load_file

    def final(run: str, r: int) -> dict:
        return load_file(str(task / run / "rounds" / f"{r:03d}" / "train" / "final" / "model.safetensors"))

    a, b = final("live_keep", 1), final("live_reset", 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    a, b = final("live_keep", 2), final("live_reset", 2)
    assert not all(torch.equal(a[k], b[k]) for k in a)


def test_reset_in_one_process_writes_the_files_of_rounds_run_as_separate_trainings(runs, task):  # noqa: F811
    from safetensors.torch import load_file

    live, restart = task / "live_reset", task / "restart"
    for r in range(1, ROUNDS + 1):
        folder = f"rounds/{r:03d}"
        for name in FILES[:-1]:  # a meta names its policy's folder: round 2's is in the run's own folder
            a, b = (live / folder / name).read_bytes(), (restart / folder / name).read_bytes()
            assert a.replace(bytes(live), bytes(restart)) == b, f"round {r}: {name}"
        a, b = (load_file(str(run / folder / FILES[-1])) for run in (live, restart))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"round {r}: final weights"
    assert [m["reward/mean"] for m in runs["reset"].rounds] == [m["reward/mean"] for m in runs["restart"].rounds]
    # the same learning rate at every step: one schedule over the rounds either way
    import json

    def lrs(run) -> list[float]:
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [x["lr"] for x in lines if x["split"] == "train"]

    assert lrs(live) == pytest.approx(lrs(restart), rel=1e-12) and len(lrs(live)) == ROUNDS * STEPS


def test_a_run_folder_begun_with_a_training_per_round_resumes_as_it_was_begun(runs, task):  # noqa: F811
    """A run an older prefpack began (each round a training run: the rounds' own checkpoints and metrics, its
    config.yaml without the keys of rounds in one process), killed in round 2's training, resumed by this one with
    that config: it continues each round as a training run, to the uninterrupted one's files and weights."""
    from safetensors.torch import load_file

    from prefpack.config import save_config
    from prefpack.rounds import RoundsInterrupted, plan

    old = rounds_config(task, "begun_old", "rounds.optimizer=reset", "rounds.in_process=false", "run.save_every=2")
    with pytest.raises(RoundsInterrupted):
        run_rounds(old, log=quiet, progress=False, stop_at=(1, "train", 3))
    resumed = rounds_config(task, "begun_old", "run.save_every=2")  # the defaults: rounds in one process
    # the run's and the killed round's config.yaml as the older prefpack saved them: none of the new keys
    save_config(resumed, task / "begun_old" / "config.yaml")
    save_config(plan.train_config(resumed, task / "begun_old", 1), task / "begun_old" / "rounds" / "002" / "train" /
                "config.yaml")
    notes: list[str] = []
    run_rounds(resumed, resume=True, log=notes.append, progress=False)
    assert any("the run folder was started with each round a training run" in n for n in notes)
    assert not (task / "begun_old" / "checkpoints").exists()
    for r in range(1, ROUNDS + 1):
        a, b = (load_file(str(task / run / "rounds" / f"{r:03d}" / FILES[-1])) for run in ("restart", "begun_old"))
        assert all(torch.equal(a[k], b[k]) for k in a), r


def test_a_second_run_on_a_rounds_folder_in_use_is_refused_in_one_line(task, tmp_path):  # noqa: F811
    """The run folder's lock covers every phase of the rounds: a resume started while the run still samples is
    refused, naming the process that holds it (it read another's temporary files before)."""
    from prefpack.training.run_folder import RunFolderLocked, RunLock

    cfg = rounds_config(task, "locked")
    held = RunLock(task / "locked")  # as the running process holds it
    try:
        with pytest.raises(RunFolderLocked) as err:
            run_rounds(cfg, resume=True, log=quiet, progress=False)
    finally:
        held.release()
    assert "\n" not in str(err.value) and "is in use" in str(err.value)
