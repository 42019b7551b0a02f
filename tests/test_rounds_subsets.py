"""Per-round prompt subsets (issue 40, ``rounds.prompts_per_round``) on tests/test_rounds.py's quickstart task: two
rounds of 8 of the 16 prompts sample disjoint rows covering all 16, each sample traced to its prompt file row (the
reward function's ``row``, the pair store's source rows); the held-out prompts stay whole; a run killed mid-generate
resumes to the uninterrupted run's files; a subset larger than the prompts is refused in one line."""

from __future__ import annotations

import difflib
import json
import math

import numpy as np
import pytest

from prefpack.config import ConfigError, load_config
from prefpack.data.store import Store
from prefpack.generation.engine import GenerationError
from prefpack.generation.subsets import PromptSubset
from prefpack.rounds import RoundsInterrupted, run_rounds
from tests.conftest import quiet, read_jsonl
from tests.test_rounds import overrides, task  # noqa: F401 - the quickstart fixture, built for this module too

EXTRA = ("rounds.prompts_per_round=8", "rounds.steps_per_round=2", "rounds.seed=5")


def _config(task, run, *extra):  # noqa: F811
    return load_config(None, overrides(task, run, *EXTRA, *extra))


@pytest.fixture(scope="module")
def straight(task, one_thread):  # noqa: F811
    return run_rounds(_config(task, "subsets"), log=quiet, progress=False)


def test_two_rounds_sample_disjoint_halves_traced_to_the_prompt_file(straight, task):  # noqa: F811
    prompts = read_jsonl(task / "prompts.jsonl")
    order = np.random.default_rng([5, 0]).permutation(16)  # the documented rule: pass 0's permutation, 2 slices
    taken = []
    for r, line in enumerate(straight.rounds):
        folder = task / "subsets" / "rounds" / f"{r + 1:03d}"
        samples = read_jsonl(folder / "samples.jsonl")
        rows = [s["row"] for s in samples]
        assert rows == sorted(int(i) for i in order[8 * r:8 * (r + 1)])
        meta = json.loads((folder / "samples.meta.json").read_text())["prompts"]["subset"]
        assert meta["rows"] == rows and (meta["of"], meta["pass"], meta["slice"]) == (16, 0, r)
        for s in samples:  # the row is the prompt file's: its text and its passthrough label
            assert prompts[s["row"]]["prompt"] in s["prompt"] and s["label"] == prompts[s["row"]]["label"]
        # the reward function saw each sample's own prompt row: the round's mean, recomputed from the prompt file
        scores = [difflib.SequenceMatcher(None, c.strip().lower(), prompts[s["row"]]["label"]).ratio()
                  for s in samples for c in s["completions"]]
        assert line["reward/mean"] == pytest.approx(math.fsum(scores) / len(scores))
        # the pair store's source rows are samples lines, whose row is the prompt file's
        store = Store(folder / "store")
        for pair, line_no in enumerate(store.column("source_row")):
            assert list(store.pair(pair).prompt) == samples[int(line_no)]["prompt_ids"]
        assert len(store) + line["tied_prompts"] == 8
        held_out = read_jsonl(folder / "eval_samples.jsonl")  # rounds.eval_prompts: every row, every round
        assert [s["row"] for s in held_out] == list(range(8))
        taken += rows
    assert sorted(taken) == list(range(16))  # disjoint, together every prompt


def test_a_resume_after_a_kill_mid_generate_equals_the_uninterrupted_run(straight, task):  # noqa: F811
    for stop in [(0, "generate", 1), (1, "generate", 1)]:
        with pytest.raises(RoundsInterrupted):
            run_rounds(_config(task, "subsets-resumed"), resume=stop[0] > 0, log=quiet, progress=False,
                       stop_at=stop)
    run_rounds(_config(task, "subsets-resumed"), resume=True, log=quiet, progress=False)
    for r in ("001", "002"):
        for name in ("samples.jsonl", "store/tokens.bin", "store/index.bin"):
            a, b = task / "subsets" / "rounds" / r / name, task / "subsets-resumed" / "rounds" / r / name
            assert a.read_bytes() == b.read_bytes(), f"round {r}: {name}"
    a = (task / "subsets" / "rounds" / "002" / "train" / "final" / "model.safetensors").read_bytes()
    assert a == (task / "subsets-resumed" / "rounds" / "002" / "train" / "final" / "model.safetensors").read_bytes()


def test_passes_cover_every_prompt_before_repeating_and_move_the_remainder():
    rows = [3, 5, 8, 13, 21, 34, 55, 89, 144, 233]  # a store's distinct prompts keep their (gapped) rows
    seen_by_pass: dict[int, list[int]] = {}
    for r in range(6):  # 10 prompts, 4 a round: 2 slices a pass, 2 prompts left out of each pass
        record = PromptSubset(4, 1, r).choose(rows)
        assert record["pass"] == r // 2 and record["left_out_of_pass"] == 2 and len(record["rows"]) == 4
        seen_by_pass.setdefault(record["pass"], []).extend(record["rows"])
    left_out = []
    for taken in seen_by_pass.values():
        assert len(set(taken)) == 8 and set(taken) <= set(rows)  # no repeat within a pass
        left_out.append(sorted(set(rows) - set(taken)))
    assert len({tuple(x) for x in left_out}) > 1  # the remainder is not the same prompts every pass


def test_a_subset_larger_than_the_prompts_is_refused_naming_both(task, tmp_path):  # noqa: F811
    cfg = load_config(None, overrides(task, "unused", "rounds.prompts_per_round=17",
                                      f"run.output_dir={tmp_path / 'run'}"))
    with pytest.raises(GenerationError) as err:
        run_rounds(cfg, log=quiet, progress=False)
    message = str(err.value)
    assert "\n" not in message and "rounds.prompts_per_round is 17" in message and "holds 16 prompts" in message
    assert not (tmp_path / "run").exists()  # refused before the run folder is written: a fixed config starts anew
    with pytest.raises(ConfigError, match=r"rounds.prompts_per_round must be >= 0 \(0 = every prompt each round\), "
                       "got -1"):
        load_config(None, overrides(task, "unused", "rounds.prompts_per_round=-1")).validate()
