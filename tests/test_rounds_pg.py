"""On-policy rounds with group policy gradients (``train.objective=policy_gradient``) on tests/test_rounds.py's
quickstart task (16 prompts, 4 samples of two tokens each, 2 rounds of 3 steps of 8 prompts): each round writes a
ranked store of every sample of every prompt, tied prompts included, with the sampler's per-token log-probs
(``logprobs.bin``); the in-process sampler is the policy, so those log-probs are the trainer's own to float32
rounding, whether read as the old policy (``loss.old_logprobs=sampler``) or recomputed before a round's first step
(``recompute``, kept in checkpoints); a run stopped inside a round's training and resumed writes the uninterrupted
run's stores and weights; rounds in one process with a fresh optimizer each write exactly the files of rounds run as
separate trainings (``rounds.in_process=false``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from prefpack.config import load_config
from prefpack.data.store import Store
from prefpack.rounds import RoundsInterrupted, run_rounds
from tests.conftest import quiet, read_jsonl
from tests.test_rounds import overrides, task  # noqa: F401 - task: the quickstart fixture, built for this module too

# test_rounds' difflib closeness to the label, made coarse (1 when at least 0.3, else 0) so that some prompts' four
# samples all tie (8 of 16 in round 1, 5 in round 2): the ranked store must keep them
REWARD = '''import difflib


def reward(prompt, completion, row):
    return float(difflib.SequenceMatcher(None, completion.strip().lower(), row["label"]).ratio() >= 0.3)
'''
ROUNDS, STEPS = 2, 3
# 8 of the 16 prompts a step (step 3 wraps into the store's second epoch: the old log-probs stay the round's start's);
# small clips, so that steps 2-3's ratios clip; a checkpoint every step (one inside each round)
PG = ("train.objective=policy_gradient", "loss.terms=[{name: grpo}]", "loss.epsilon=0.02", "rounds.max_new_tokens=2",
      f"rounds.count={ROUNDS}", f"rounds.steps_per_round={STEPS}", "rounds.eval_prompts=null", "run.save_every=1",
      "run.keep_checkpoints=100", "rounds.optimizer=reset")
FILES = ("samples.jsonl", "samples.meta.json", "store/tokens.bin", "store/index.bin", "store/logprobs.bin")
# |trainer's log-prob - sampler's| per token for the same weights: the sampler's cached, padded forward against the
# trainer's packed one, float32. Measured: the recomputed old log-probs within 9.5e-7 of the sampler's on every token;
# sampler_gap (the mean over a step's tokens) 1.6e-7 at each round's first step, 0.2-0.35 at its later steps (lr 1e-2)
GAP = 1e-5


def pg_config(task, run: str, *extra: str):  # noqa: F811
    reward = task / "pg_reward.py"
    reward.write_text(REWARD)
    return load_config(None, overrides(task, run, *PG, f"rounds.reward_fn={reward}:reward", *extra))


def train_lines(run) -> list[dict]:
    return [x for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if x["split"] == "train"]


def sampler_logprobs(folder) -> np.ndarray:
    """A round's samples' log-probs as the sampler recorded them (samples.jsonl), in store order, float32."""
    return np.asarray([v for row in read_jsonl(folder / "samples.jsonl") for lp in row["logprobs"] for v in lp],
                      np.float32)


@pytest.fixture(scope="module")
def straight(task, one_thread):  # noqa: F811
    return run_rounds(pg_config(task, "pg_straight"), log=quiet, progress=False)


def test_each_round_store_ranks_every_sample_with_the_sampler_logprobs(straight, task):  # noqa: F811
    import difflib

    tied = []
    for r in range(1, ROUNDS + 1):
        folder = task / "pg_straight" / "rounds" / f"{r:03d}"
        rows = read_jsonl(folder / "samples.jsonl")
        store = Store(folder / "store")
        assert store.kind == "ranked" and (folder / "store" / "logprobs.bin").is_file()
        assert len(store.group_starts()) - 1 == len(rows) == 16
        assert len(store) == sum(len(row["completion_ids"]) for row in rows) == 64
        scores, ties = store.scores(), 0
        for g, row in enumerate(rows):
            prompt, comps = store.ranked_group(g)
            want = [float(difflib.SequenceMatcher(None, c.strip().lower(), row["label"]).ratio() >= 0.3)
                    for c in row["completions"]]
            ties += len(set(want)) == 1
            assert [int(t) for t in prompt] == row["prompt_ids"]
            # every sample, in the samples' order, with its own score (a tied prompt's too)
            assert [[int(t) for t in c] for c in comps] == row["completion_ids"], (r, g)
            start = store.group_starts()[g]
            assert scores[start:start + len(want)].tolist() == want, (r, g)
        tied.append(ties)
        got = np.concatenate([store.completion_logprobs(i) for i in range(len(store))])
        assert np.array_equal(got, sampler_logprobs(folder)), r  # float32, bit for bit
        line = straight.rounds[r - 1]  # the round line counts every sample; a ranked round draws no pairs
        assert (line["prompts"], line["samples"]) == (16, 64) and "pairs" not in line
    assert tied[0] > 0 and all(t < 16 for t in tied)  # tied prompts are kept, and every round has some to train


def test_the_recomputed_old_logprobs_are_the_sampler_s(straight, task):  # noqa: F811
    """``recompute``: the old log-probs the objective computed before each round's first step (checkpointed at the
    round's first step) equal the sampler's recorded ones to float32 rounding; the ratios clip after a round's first
    step (the policy has moved from them)."""
    run = task / "pg_straight"
    gaps = []
    for r in range(1, ROUNDS + 1):
        state = torch.load(run / "checkpoints" / f"step-{(r - 1) * STEPS + 1:08d}" / "training_state.pt",
                           weights_only=True)["objective"]
        old = state["pg_old_logprobs"].numpy()
        want = sampler_logprobs(run / "rounds" / f"{r:03d}")
        assert old.shape == want.shape == (128,)
        gaps.append(float(np.abs(old - want).max()))
    assert max(gaps) < GAP, gaps
    lines = train_lines(run)
    assert [m["step"] for m in lines] == list(range(1, ROUNDS * STEPS + 1))
    for r in range(ROUNDS):
        first, *later = lines[r * STEPS:(r + 1) * STEPS]
        assert first["clip_ratio/region"] == 0.0 and max(m["clip_ratio/region"] for m in later) > 0
        assert first["sampler_gap"] < GAP


def test_the_sampler_s_logprobs_as_the_old_policy_train_as_recomputed_ones(straight, task, one_thread):  # noqa: F811
    """``sampler``: the run trains (its round-1 store is the recompute run's: the same initial policy and seed) and
    reports the train/rollout gap: within float32 rounding at each round's first step, then growing as the policy
    moves; its losses are the recompute run's to that gap's effect."""
    run = task / "pg_sampler"
    result = run_rounds(pg_config(task, "pg_sampler", "loss.old_logprobs=sampler"), log=quiet, progress=False)
    assert len(result.rounds) == ROUNDS
    a, b = (load_file(str(d / "model.safetensors")) for d in (task / "init", result.final_dir))
    assert any(not torch.equal(a[k], b[k]) for k in a)  # it trained
    for name in FILES:
        assert (run / "rounds" / "001" / name).read_bytes().replace(bytes(run), bytes(task / "pg_straight")) == \
            (task / "pg_straight" / "rounds" / "001" / name).read_bytes(), name
    lines, recomputed = train_lines(run), train_lines(task / "pg_straight")
    assert [m["step"] for m in lines] == list(range(1, ROUNDS * STEPS + 1))
    for r in range(ROUNDS):
        first, *later = lines[r * STEPS:(r + 1) * STEPS]
        assert 0 <= first["sampler_gap"] < GAP
        assert all(m["sampler_gap"] > 10 * GAP for m in later)  # the policy moved after the round's first step
    for a, b in zip(lines[:STEPS], recomputed[:STEPS]):  # round 1: the same samples, old log-probs within GAP
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)  # measured: within 3.1e-6


def test_a_run_stopped_inside_a_round_s_training_resumes_to_the_uninterrupted_run(straight, task):  # noqa: F811
    """Stopped after round 2's first step (its checkpoint holds the old log-probs recomputed before that step) and
    resumed: round 2's last steps use those, not the resumed weights' (which would change the ratios and so the
    weights), and the run ends with the uninterrupted run's stores and final weights, bit for bit."""
    run = task / "pg_resumed"
    with pytest.raises(RoundsInterrupted):
        run_rounds(pg_config(task, "pg_resumed"), log=quiet, progress=False, stop_at=(1, "train", 1))
    assert (run / "checkpoints" / f"step-{STEPS + 1:08d}").is_dir()
    assert not (run / "checkpoints" / f"step-{STEPS + 2:08d}").exists()
    result = run_rounds(pg_config(task, "pg_resumed"), resume=True, log=quiet, progress=False)
    for r in range(1, ROUNDS + 1):
        for name in FILES[:1] + FILES[2:]:  # samples.meta.json names its policy's folder
            a, b = task / "pg_straight" / "rounds" / f"{r:03d}" / name, run / "rounds" / f"{r:03d}" / name
            assert a.read_bytes() == b.read_bytes(), (r, name)
    a = load_file(str(straight.final_dir / "model.safetensors"))
    b = load_file(str(result.final_dir / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    la, lb = train_lines(task / "pg_straight"), train_lines(run)
    assert [m["step"] for m in lb] == list(range(1, ROUNDS * STEPS + 1))
    for key in ("loss", "clip_ratio/region", "grad_norm", "sampler_gap"):
        assert [m[key] for m in la] == [m[key] for m in lb], key


def test_rounds_in_one_process_with_a_reset_optimizer_write_the_files_of_separate_trainings(straight, task,  # noqa: F811
                                                                                             one_thread):
    live, restart = task / "pg_straight", task / "pg_restart"
    result = run_rounds(pg_config(task, "pg_restart", "rounds.in_process=false"), log=quiet, progress=False)
    for r in range(1, ROUNDS + 1):
        folder = f"rounds/{r:03d}"
        for name in FILES:  # a meta names its policy's folder: round 2's is in the run's own folder
            a, b = (live / folder / name).read_bytes(), (restart / folder / name).read_bytes()
            assert a.replace(bytes(live), bytes(restart)) == b, f"round {r}: {name}"
        a, b = (load_file(str(run / folder / "train" / "final" / "model.safetensors")) for run in (live, restart))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"round {r}: final weights"
    assert [m["reward/mean"] for m in result.rounds] == [m["reward/mean"] for m in straight.rounds]
