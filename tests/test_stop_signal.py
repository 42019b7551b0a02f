"""SIGTERM is never swallowed: one that arrives during the last step checkpoints and stops like any other (the run
resumes to the same final model), and one that arrives after the loop's last check reaches the handler outside."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import final_weights, overrides, prepare_hh_splits, tiny_llama

from prefpack.config import load_config
from prefpack.distributed import Dist
from prefpack.training import train
from prefpack.training.cadence import Cadence
from prefpack.training.checkpoint import checkpoint_step, list_checkpoints
from prefpack.training.guards import StopSignal, TrainingTerminated

STEPS = 3


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_tokenizers, hh_train):
    root = tmp_path_factory.mktemp("stop")
    stores = prepare_hh_splits(root, toy_tokenizers["llama"], hh_train, {"train": 12})
    tiny_llama(toy_tokenizers["llama"], root / "policy", 2)
    w = {"policy": root / "policy", "train": stores["train"],
         "settings": ["train.global_batch_pairs=4", f"train.max_steps={STEPS}", "run.plot=false", "optim.lr=1e-3",
                      "run.save_every=0"]}
    train(load_config(None, overrides(w, root / "full")), progress=False, log=lambda m: None)
    return {**w, "full": root / "full"}


def test_sigterm_during_the_last_step_checkpoints_it_and_the_resumed_run_ends_alike(world, tmp_path, monkeypatch):
    after_step = Cadence.after_step

    def signalled(self, done, last):
        if done == STEPS:  # as if the scheduler's SIGTERM came while the last step ran
            os.kill(os.getpid(), signal.SIGTERM)
        return after_step(self, done, last)

    monkeypatch.setattr(Cadence, "after_step", signalled)
    run = tmp_path / "run"
    with pytest.raises(TrainingTerminated) as stopped:
        train(load_config(None, overrides(world, run)), progress=False, log=lambda m: None)
    assert stopped.value.step == STEPS
    assert [checkpoint_step(c) for c in list_checkpoints(run)] == [STEPS] and not (run / "final").exists()
    monkeypatch.setattr(Cadence, "after_step", after_step)
    train(load_config(None, overrides(world, run)), resume=True, progress=False, log=lambda m: None)
    full, resumed = final_weights(world["full"]), final_weights(run)
    assert all((full[k] == resumed[k]).all() for k in full)


def test_a_signal_after_the_last_check_reaches_the_handler_outside_the_loop():
    got = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        with StopSignal(Dist()) as stop:
            assert not stop.due()  # the last step's check
            os.kill(os.getpid(), signal.SIGTERM)  # ... then the signal, before the loop's end
            assert got == []  # held by the loop's handler
        assert got == [signal.SIGTERM]  # delivered again once the outer handler is back
        with StopSignal(Dist()) as stop:  # a signal the loop acted on is not delivered twice
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.due()
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)
