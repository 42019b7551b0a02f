"""On-policy rounds (prefpack.rounds) on the quickstart task: the policy's own samples scored by a reward function
raise its reward over two rounds; a run killed in each phase and resumed writes the same round stores and final
weights as an uninterrupted run; the sampled token ids reach the store unchanged; the learning
rate follows one schedule over every round."""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import signal

import numpy as np
import pytest
import torch

from prefpack.config import load_config
from prefpack.data.store import Store
from prefpack.rounds import RoundsInterrupted, run_rounds
from tests.conftest import quiet, read_jsonl, write_jsonl

# The reward: how close the sampled answer is to the review's true label (difflib's ratio: 1.0 exactly when it names
# it). The plain "1 when it names the label" reward is too sparse for the untrained model: with a 400-token vocabulary
# none of its 64 first-round samples names a label, every prompt ties and there is nothing to train on.
REWARD = '''import difflib


def reward(prompt, completion, row):
    return difflib.SequenceMatcher(None, completion.strip().lower(), row["label"]).ratio()
'''
STEPS, ROUNDS, LR = 8, 2, 1e-2


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from prefpack.quickstart import _build_model, make_pairs
    from prefpack.toy_tokenizer import build_toy_tokenizer

    root = tmp_path_factory.mktemp("rounds")
    rows = make_pairs(400, 0)
    tok = build_toy_tokenizer([r["prompt"] + r["chosen"] for r in rows] + [" positive", " negative"],
                              style="llama", vocab_size=400)
    torch.manual_seed(0)
    _build_model(tok, root / "init", 0)
    label = [{"prompt": r["prompt"], "label": r["chosen"].strip()} for r in make_pairs(24, 2)]
    write_jsonl(root / "prompts.jsonl", label[:16])
    write_jsonl(root / "held_out.jsonl", label[16:])
    (root / "reward.py").write_text(REWARD)
    return root


def overrides(task, run: str, *extra: str) -> list[str]:
    return [
        f"model.name_or_path={task / 'init'}", "train.global_batch_pairs=8", f"optim.lr={LR}", "optim.schedule=cosine",
        "loss.beta=0.1", f"run.output_dir={task / run}", "run.report_to=none", "run.plot=false", "run.save_every=3",
        f"rounds.count={ROUNDS}", f"rounds.prompts={task / 'prompts.jsonl'}", "rounds.samples_per_prompt=4",
        f"rounds.eval_prompts={task / 'held_out.jsonl'}", "rounds.max_new_tokens=1", "rounds.batch_size=4",
        f"rounds.reward_fn={task / 'reward.py'}:reward", f"rounds.steps_per_round={STEPS}", *extra]


def config(task, run: str, *extra: str):
    return load_config(None, overrides(task, run, *extra))


@pytest.fixture(scope="module")
def straight(task, one_thread):
    return run_rounds(config(task, "straight"), log=quiet, progress=False)


def test_two_rounds_raise_the_reward_of_the_policy_samples(straight, task):
    first, second = straight.rounds
    # every sample's reward, recomputed here from the samples file (the round line's mean is over all k samples)
    import difflib

    def mean_reward(name: str, r: int) -> float:
        values = [difflib.SequenceMatcher(None, c.strip().lower(), row["label"]).ratio()
                  for row in read_jsonl(task / "straight" / "rounds" / f"{r:03d}" / name) for c in row["completions"]]
        return math.fsum(values) / len(values)

    assert first["reward/mean"] == pytest.approx(mean_reward("samples.jsonl", 1))
    assert second["reward/mean"] == pytest.approx(mean_reward("samples.jsonl", 2))
    assert second["reward/mean"] > first["reward/mean"] + 0.05
    # the held-out prompts (never trained on) score higher too
    assert first["eval_reward/mean"] == pytest.approx(mean_reward("eval_samples.jsonl", 1))
    assert second["eval_reward/mean"] > first["eval_reward/mean"]
    table = straight.summary().splitlines()  # the end-of-run table shows the held-out reward beside the samples'
    assert table[0].split()[-2:] == ["held-out", "reward"]
    assert [float(row.split()[-1]) for row in table[1:3]] == pytest.approx(
        [first["eval_reward/mean"], second["eval_reward/mean"]], abs=1e-4)
    assert first["samples"] == 64 and first["cut_samples"] == 64  # one token each, no stop token: all cut, counted
    assert first["pairs"] + first["tied_prompts"] == 16
    lines = [json.loads(x) for x in (task / "straight" / "metrics.jsonl").read_text().splitlines()]
    rounds = [x for x in lines if x["split"] == "round"]
    assert [x["round"] for x in rounds] == [0, 1] and [x["step"] for x in rounds] == [0, STEPS]
    for key in ("reward/max", "reward/min", "reward/gap", "generate/tokens_per_s", "seconds/generate",
                "seconds/score", "seconds/train"):
        assert rounds[0][key] is not None, key
    from prefpack.plot import panels  # prefpack plot draws the per-round reward curve

    curve = dict(panels(lines))["policy sample reward (per on-policy round)"]
    mean = next(line for line in curve if line[0] == "reward/mean" and line[1] == "round")
    assert mean[3:] == ([0, STEPS], [first["reward/mean"], second["reward/mean"]])


def test_the_learning_rate_schedule_spans_every_round(straight, task):
    lines = [json.loads(x) for x in (task / "straight" / "metrics.jsonl").read_text().splitlines()]
    train = sorted((x["step"], x["lr"]) for x in lines if x["split"] == "train")
    total = ROUNDS * STEPS
    assert [s for s, _ in train] == list(range(1, total + 1))
    for step, lr in train:  # cosine over all rounds' steps, no warmup: step k trains at lr(k - 1)
        assert lr == pytest.approx(LR * 0.5 * (1 + math.cos(math.pi * (step - 1) / total)), rel=1e-9)


def _sequences(batch) -> dict[int, tuple[list[int], list[int]]]:
    """Each sequence of a collated batch read back from its layout: (prompt ids, completion ids). The completion is
    its scored targets; its prompt, the contiguous run of positions 0..p that ends where its first target is
    predicted (a shared prompt's last position, or its own)."""
    flat_inputs, flat_positions = batch.input_ids.flatten(), batch.position_ids.flatten()
    if batch.score_positions is not None:  # prompts laid out once
        where, targets, owner = batch.score_positions, batch.score_targets, batch.score_sequences
    else:
        where = torch.nonzero(batch.loss_mask.flatten()).flatten()
        targets, owner = batch.target_ids.flatten()[where], batch.seq_index.flatten()[where]
    out = {}
    for s in range(batch.num_sequences):
        at, completion = where[owner == s], targets[owner == s].tolist()
        first = int(at[0])
        prompt = flat_inputs[first - int(flat_positions[first]):first + 1].tolist()
        assert flat_inputs[at[1:]].tolist() == completion[:-1]  # each completion token is the next position's input
        out[s] = (prompt, completion)
    return out


def test_sampled_token_ids_reach_the_training_batches_unchanged(straight, task):
    """Round 2's pair store, planned and collated by the objective its training builds, holds exactly the samples
    file's prompt ids and, per prompt, its best and worst sample's ids (best_vs_worst, the rewards recomputed here)."""
    import difflib

    from prefpack.rounds import plan
    from prefpack.training.setup import build

    folder = task / "straight" / "rounds" / "002"
    rows = read_jsonl(folder / "samples.jsonl")
    store = Store(folder / "store")
    assert store.meta["pairs"]["pairs"] == len(store) == straight.rounds[1]["pairs"]
    source = store.column("source_row")
    objective = build(plan.train_config(config(task, "straight"), task / "straight", 1), log=quiet).feed.objective
    by_row, seen = {r["row"]: r for r in rows}, []
    for planned in objective.plan(np.arange(len(store)), seed=None):
        batch = objective.collate(planned)
        assert batch.score_positions is not None  # each pair's prompt laid out once for its two completions
        for s, (prompt, completion) in _sequences(batch).items():
            pair, side = divmod(int(batch.sequence_keys[s]), 2)  # pair p's chosen / rejected: keys 2p / 2p + 1
            row = by_row[int(source[pair])]
            scores = [difflib.SequenceMatcher(None, c.strip().lower(), row["label"]).ratio()
                      for c in row["completions"]]
            best = (max if side == 0 else min)(scores)
            assert prompt == row["prompt_ids"]
            assert completion in [ids for ids, x in zip(row["completion_ids"], scores) if x == best], (pair, side)
            seen.append((pair, side))
    assert sorted(seen) == [(p, side) for p in range(len(store)) for side in (0, 1)]  # every pair, each side once


def test_resume_after_a_kill_in_each_phase_equals_the_uninterrupted_run(straight, task, monkeypatch, capsys):
    from prefpack.cli import main
    from prefpack.rounds.stopped import where_stopped
    from prefpack.training.cadence import Cadence

    run = task / "resumed"
    stops = [(0, "generate", 2), (0, "score", 8), (1, "generate", 1), (1, "train", 4)]
    where = ["round 1 of 2 (%s) stopped while sampling its prompts: 8 prompts are sampled",
             "round 1 of 2 (%s) stopped while scoring its samples: 8 rows are scored",
             "round 2 of 2 (%s) stopped while sampling its prompts: 4 prompts are sampled",
             "round 2 of 2 (%s) stopped in training; the run's last checkpoint is step 12"]
    for k, stop in enumerate(stops):
        with pytest.raises(RoundsInterrupted):
            run_rounds(config(task, "resumed"), resume=k > 0, log=quiet, progress=False, stop_at=stop)
        assert where_stopped(config(task, "resumed")).startswith(where[k] % (run / "rounds" / f"{stop[0] + 1:03d}"))
    # SIGTERM in round 2's training, through the command line: a checkpoint of that step in the run's folder (rounds
    # in one process count steps from round 1's first), and the printed command (`prefpack train ... --resume`)
    # continues the run to the uninterrupted run's end
    after_step = Cadence.after_step

    def terminate_at_step_6(self, done, last):
        after_step(self, done, last)
        if done == STEPS + 6:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(Cadence, "after_step", terminate_at_step_6)
    capsys.readouterr()
    assert main(["train", *overrides(task, "resumed"), "--resume", "--no-progress"]) == 128 + signal.SIGTERM
    hint = capsys.readouterr().err.strip().splitlines()
    checkpoint = run / "checkpoints" / f"step-{STEPS + 6:08d}"
    assert hint[-2].startswith(f"prefpack train: terminated by signal 15 after step {STEPS + 6} of round 2; round 2 "
                               "of 2")
    assert hint[-2].endswith(f"last checkpoint is step {STEPS + 6} ({checkpoint}); continue with:")
    assert checkpoint.is_dir()
    command = shlex.split(hint[-1])
    assert command[:2] == ["prefpack", "train"] and "--resume" in command
    monkeypatch.setattr(Cadence, "after_step", after_step)
    assert main(["train", *command[2:]]) == 0
    assert f"resumed from {checkpoint} at step {STEPS + 6}" in capsys.readouterr().err
    result = run_rounds(config(task, "resumed"), resume=True, log=quiet, progress=False)  # every round done: read back
    for r in ("001", "002"):
        for name in ("samples.jsonl", "store/tokens.bin", "store/index.bin"):  # meta.json names its own paths
            a, b = task / "straight" / "rounds" / r / name, run / "rounds" / r / name
            assert a.read_bytes() == b.read_bytes(), f"round {r}: {name}"
    from safetensors.torch import load_file

    a = load_file(str(straight.final_dir / "model.safetensors"))
    b = load_file(str(result.final_dir / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [m["reward/mean"] for m in result.rounds] == [m["reward/mean"] for m in straight.rounds]
    shutil.rmtree(run)


def test_sigterm_while_a_round_samples_stops_at_a_whole_batch_with_the_resume_hint(task, tmp_path, monkeypatch,
                                                                                  capsys, one_thread):
    """Issue 40: the generate phase acts on SIGTERM between batches (the training loop's own handler covers train);
    the samples end at a whole row and continue to the uninterrupted phase's file."""
    from prefpack.cli import main
    from prefpack.generation.hf_engine import TransformersEngine
    from prefpack.rounds.driver import _generate

    generate = TransformersEngine.generate

    def terminated_in_the_first_batch(self, jobs, settings):
        os.kill(os.getpid(), signal.SIGTERM)
        return generate(self, jobs, settings)

    monkeypatch.setattr(TransformersEngine, "generate", terminated_in_the_first_batch)
    capsys.readouterr()
    assert main(["train", *overrides(task, "signalled"), "--no-progress"]) == 128 + signal.SIGTERM
    hint = capsys.readouterr().err.strip().splitlines()
    folder = task / "signalled" / "rounds" / "001"
    assert hint[-2] == (f"prefpack train: terminated by signal 15; round 1 of 2 ({folder}) stopped while sampling its "
                        "prompts: 4 prompts are sampled in samples.jsonl, and resuming samples the rest; continue with:")
    assert shlex.split(hint[-1])[-1] == "--resume"
    monkeypatch.setattr(TransformersEngine, "generate", generate)
    cfg = config(task, "signalled")
    _generate(cfg, task / "signalled", 0, cfg.rounds.prompts, folder / "samples.jsonl", "generate", None, quiet)
    _generate(cfg, tmp_path, 0, cfg.rounds.prompts, tmp_path / "whole.jsonl", "generate", None, quiet)
    assert (folder / "samples.jsonl").read_bytes() == (tmp_path / "whole.jsonl").read_bytes()
    shutil.rmtree(task / "signalled")


# difflib's ratio until round 1 is done (its round.json, written last), then 1.0 for every sample: every prompt of
# rounds 2 and 3 ties. Read from the run's own files, so a resumed run scores exactly what an uninterrupted one does.
TIED_AFTER_ROUND_1 = '''import difflib
from pathlib import Path

ROUND_1_DONE = Path({done!r})


def reward(prompt, completion, row):
    if ROUND_1_DONE.is_file():
        return 1.0
    return difflib.SequenceMatcher(None, completion.strip().lower(), row["label"]).ratio()
'''


def _tied_config(task, run: str):
    reward = task / f"{run}-reward.py"
    reward.write_text(TIED_AFTER_ROUND_1.format(done=str(task / run / "rounds" / "001" / "round.json")))
    return config(task, run, "rounds.count=3", f"rounds.reward_fn={reward}:reward")


def test_a_later_round_whose_samples_all_tie_trains_nothing_and_its_policy_carries_over(task, tmp_path, one_thread):
    """Issue 40: rounds 2 and 3 tie on every prompt; each is recorded (0 pairs, its rewards), trains nothing, and
    round 3 samples round 1's policy; the final model is round 1's. Then a run killed in round 2's scoring, its
    held-out sampling and round 3's sampling resumes to the uninterrupted run's files."""
    import dataclasses

    from prefpack.generation.run import generate
    from prefpack.rounds import plan
    from prefpack.rounds.stopped import where_stopped

    logs: list[str] = []
    cfg = _tied_config(task, "tied")
    result = run_rounds(cfg, log=logs.append, progress=False)
    run = task / "tied"
    first = result.rounds[0]
    assert first["pairs"] > 0 and (run / "rounds" / "001" / "train" / "final").is_dir()
    for r, line in enumerate(result.rounds[1:], 2):
        folder = run / "rounds" / f"{r:03d}"
        samples = sum(len(row["completions"]) for row in read_jsonl(folder / "samples.jsonl"))
        assert samples == 64 and line["samples"] == 64
        assert (line["pairs"], line["tied_prompts"], line["reward/mean"], line["reward/min"], line["reward/max"]) == \
            (0, 16, 1.0, 1.0, 1.0)
        assert "reward/gap" not in line and line["seconds/generate"] > 0 and "seconds/score" in line
        assert "seconds/train" not in line and not any(k.startswith("eval/") for k in line)
        assert not (folder / "train").exists() and not (folder / "store").exists()
        assert not (folder / "store.partial").exists()
        assert f"round {r}: every prompt's samples tie (reward mean 1.000): nothing to train on; the policy " \
               "carries over" in logs
    # round 3 sampled round 1's final model: a standalone generate of that folder at round 3's seed writes its file
    opts = plan.generate_options(cfg, tmp_path, 0, prompts=cfg.rounds.prompts, output=tmp_path / "again.jsonl")
    generate(dataclasses.replace(opts, model=str(run / "rounds" / "001" / "train" / "final"),
                                 seed=cfg.rounds.seed + 2), log=quiet)
    assert (tmp_path / "again.jsonl").read_bytes() == (run / "rounds" / "003" / "samples.jsonl").read_bytes()
    assert result.final_dir == run / "rounds" / "001" / "train" / "final"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["split"] == "round"] == [0, STEPS, 2 * STEPS]
    assert [x["step"] for x in lines if x["split"] == "train"] == list(range(1, STEPS + 1))

    resumed = task / "tied-resumed"
    stops = [(1, "score", 8), (1, "eval_prompts", 1), (2, "generate", 1)]
    for k, stop in enumerate(stops):
        with pytest.raises(RoundsInterrupted):
            run_rounds(_tied_config(task, "tied-resumed"), resume=k > 0, log=quiet, progress=False, stop_at=stop)
        if k == 1:  # scored and found tied, killed while sampling its held-out prompts
            assert (resumed / "rounds" / "002" / plan.NO_PAIRS_FILE).is_file()
            assert "stopped while sampling and scoring its held-out" in where_stopped(_tied_config(task, "tied-resumed"))
    again = run_rounds(_tied_config(task, "tied-resumed"), resume=True, log=quiet, progress=False)
    for r in ("001", "002", "003"):
        for name in ("samples.jsonl", "eval_samples.jsonl", "eval_scores.jsonl"):
            assert (run / "rounds" / r / name).read_bytes() == (resumed / "rounds" / r / name).read_bytes(), (r, name)
    assert [{k: v for k, v in m.items() if not k.startswith(("seconds/", "generate/"))} for m in again.rounds] == \
        [{k: v for k, v in m.items() if not k.startswith(("seconds/", "generate/"))} for m in result.rounds]
    assert again.final_dir == resumed / "rounds" / "001" / "train" / "final"
    shutil.rmtree(run)
    shutil.rmtree(resumed)


def test_a_first_round_whose_samples_all_tie_stops_with_the_error(task, tmp_path, one_thread):
    """Round 1 ties under a constant reward: the reward is too sparse for the initial policy, so no round can train."""
    from prefpack.rounds.driver import RoundsError

    (tmp_path / "one.py").write_text("def reward(prompt, completion, row):\n    return 1.0\n")
    cfg = load_config(None, overrides(task, "all-tied", f"rounds.reward_fn={tmp_path / 'one.py'}:reward",
                                      "rounds.eval_prompts=null", f"run.output_dir={tmp_path / 'run'}"))
    with pytest.raises(RoundsError, match=r"^round 1: no preference pair to train on .*every row was skipped "
                                          r"\(\{'tied': 16\}\).*use a finer reward$"):
        run_rounds(cfg, log=quiet, progress=False)
    assert not (tmp_path / "run" / "rounds" / "001" / "round.json").exists()
    assert not (tmp_path / "run" / "rounds" / "001" / "no_pairs.json").exists()
