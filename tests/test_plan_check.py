"""A resumed run trains the batches it started with: each checkpoint records its run's plan and a resume whose
plan differs (another prefpack grouping or shuffling the same store otherwise) is refused unless allowed."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import cfg_for, overrides, prepare_hh_splits, quiet, tiny_llama

from prefpack.batching.schedule import StepSchedule
from prefpack.config import ConfigError
from prefpack.training import TrainingInterrupted, train
from prefpack.training.plan_check import PLAN_KEY, check_plan, plan_signature

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = ("optim.lr=1.0e-3", "optim.schedule=constant", "train.global_batch_pairs=8", "train.max_steps=3",
        "run.plot=false", "run.tensorboard=false", "run.save_every=1", "run.keep_checkpoints=3")


class _Groups:
    """An objective as the signature reads it: prompt groups of known token counts."""

    kind = "groups"

    def __init__(self, tokens, groups=None):
        self.tokens, self.groups = np.asarray(tokens), groups

    def __len__(self) -> int:
        return len(self.tokens)

    def example_tokens(self, ids):
        return self.tokens[ids]

    def schedule_groups(self):
        return self.groups


def _feed(tokens, seed=0, batch=2):
    task = _Groups(tokens)
    return SimpleNamespace(objective=task, schedule=StepSchedule(len(task), batch, seed, True, task.groups))


def _refusal(old, new) -> str:
    with pytest.raises(ConfigError) as err:
        check_plan(plan_signature(old), plan_signature(new), "CKPT", allow_change=False, log=quiet)
    return str(err.value)


def test_the_signature_tells_what_changed_in_the_plan():
    base = [5, 6, 7, 8, 9, 10]
    check_plan(plan_signature(_feed(base)), plan_signature(_feed(list(base))), "CKPT", allow_change=False)
    msg = _refusal(_feed(base), _feed([11, 15, 19]))  # the same tokens in fewer, larger groups
    assert msg.startswith("cannot resume from CKPT: ") and "\n" not in msg
    assert "the store's prompt groups: 3 now, 6 when the run started" in msg
    assert "pass --allow-config-change to continue with the new plan, or start a new run" in msg
    assert "steps per epoch: 2 now, 3 when" in _refusal(_feed(base, batch=2), _feed(base, batch=3))
    assert "prompt groups themselves" in _refusal(_feed(base), _feed([5, 6, 7, 8, 9, 11]))
    assert "the order the steps take" in _refusal(_feed(base, seed=0), _feed(base, seed=1))
    said = []
    check_plan(plan_signature(_feed(base)), plan_signature(_feed(base[:3])), "CKPT", allow_change=True,
               log=said.append)
    assert len(said) == 1 and "continuing with the new plan (--allow-config-change)" in said[0]
    check_plan(None, plan_signature(_feed(base)), "CKPT", allow_change=False, log=said.append)
    assert "CKPT records no plan signature" in said[-1]
    assert plan_signature(SimpleNamespace(objective=_Groups(base))) is None  # on-policy feeds: nothing to replay


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_tokenizers, hh_train):
    root = tmp_path_factory.mktemp("plan")
    tok = toy_tokenizers["llama"]
    stores = prepare_hh_splits(root, tok, hh_train, {"train": 16})
    return {"root": root, **stores, "settings": BASE, "policy": tiny_llama(tok, root / "policy", 1)}


def _cut_and_edit(world, run, edit):
    """A run stopped after step 1 of 3, its checkpoint's trainer state edited as an older prefpack would have
    written it (checksums written again, so only the plan differs)."""
    from prefpack.training.checkpoint.files import write_checksums

    with pytest.raises(TrainingInterrupted):
        train(cfg_for(world, run), stop_after_steps=1, progress=False, log=quiet)
    ckpt = run / "checkpoints" / "step-00000001"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    edit(state)
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (ckpt / "checksums.json").unlink()
    write_checksums(ckpt)
    return ckpt


def test_a_checkpoint_of_another_plan_is_refused_unless_allowed(world, tmp_path, capsys):
    from prefpack.cli import main as cli_main

    run, seen = tmp_path / "run", {}

    def regroup(state):
        seen.update(state[PLAN_KEY])
        state[PLAN_KEY]["examples"] = 288

    ckpt = _cut_and_edit(world, run, regroup)
    assert (seen["unit"], seen["examples"], seen["per_epoch"], seen["steps_per_epoch"]) == ("pairs", 16, 16, 2)
    with pytest.raises(ConfigError, match=f"cannot resume from {ckpt}: .*the store's pairs: 16 now, 288 when the run "
                                          r"started\); pass --allow-config-change"):
        train(cfg_for(world, run), resume=True, progress=False, log=quiet)
    args = ["train", *overrides(world, run), "--resume", "--no-progress"]
    assert cli_main(args) == 2
    assert "the store's pairs: 16 now, 288 when the run started" in capsys.readouterr().err
    assert cli_main([*args, "--allow-config-change"]) == 0
    assert "continuing with the new plan (--allow-config-change)" in capsys.readouterr().err
    final_state = json.loads((run / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert final_state[PLAN_KEY] == seen  # the run's checkpoints now record the plan it goes on with


def test_a_checkpoint_without_a_plan_signature_resumes_and_says_so(world, tmp_path):
    run, said = tmp_path / "run", []
    ckpt = _cut_and_edit(world, run, lambda state: state.pop(PLAN_KEY))
    train(cfg_for(world, run), resume=True, progress=False, log=said.append)
    assert (run / "final").is_dir()
    assert [line for line in said if "plan signature" in line] == [
        f"note: {ckpt} records no plan signature (written by an older prefpack), so this resume cannot check that "
        "its steps train the batches the run started with"]
