"""The verifiable-reward example (`prefpack quickstart --task arithmetic`, docs/on-policy.md "Verifiable rewards"):
its prompts are seeded and the held-out ones never trained on, its reward function scores what its docstring says,
and it works standalone under `prefpack score --reward-fn`."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefpack.arithmetic import make_problems, warm_pairs
from prefpack.arithmetic_reward import exact_answer, expected_answer, first_number
from tests.conftest import read_jsonl, run_here, write_jsonl


def test_problems_are_seeded_and_held_out_prompts_are_disjoint():
    train, held_out = make_problems(0)
    assert (train, held_out) == make_problems(0)  # seeded
    assert make_problems(1) != (train, held_out)
    assert len(train) == 80 and len(held_out) == 20
    prompts = [r["prompt"] for r in train + held_out]
    assert len(set(prompts)) == 100 and not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    for r in train + held_out:
        a, b = r["prompt"].rstrip("=").split("+")
        assert int(r["answer"]) == int(a) + int(b) and 0 <= int(a) <= 9 and 0 <= int(b) <= 9
    for pair in warm_pairs(train, 0):  # the warm start trains on the training prompts only: right vs wrong answer
        assert pair["prompt"] in {r["prompt"] for r in train}
        assert first_number(pair["chosen"]) == expected_answer(pair["prompt"]) != first_number(pair["rejected"])


ROW = {"answer": "7"}


@pytest.mark.parametrize("completion", [" 7", "7", "  7  ", "7</s>", " 7\n3+1=4", "= 7.", "7.0", " 7 8", "x7"])
def test_the_first_number_right_scores_1(completion):
    assert exact_answer("3+4=", completion, ROW) == 1.0


@pytest.mark.parametrize("completion", [" 8", "17", " 70", "-7", "7.5", " 8 7", "1 7"])
def test_the_first_number_wrong_scores_0(completion):
    assert exact_answer("3+4=", completion, ROW) == 0.0


@pytest.mark.parametrize("completion", ["", "   ", "\n", "</s>", "seven", "+=", " =", "<pad>"])
def test_no_number_scores_0(completion):
    assert exact_answer("3+4=", completion, ROW) == 0.0


def test_the_answer_comes_from_the_row_else_from_the_prompt():
    assert exact_answer("whatever", " 12", {"answer": 12}) == 1.0  # the row's answer wins (an int is fine too)
    assert exact_answer("3+4=", " 7", {"answer": "8"}) == 0.0
    assert exact_answer("<s>3+4=", " 7") == 1.0  # no row: the prompt's trailing A+B= (a BOS before it ignored)
    assert exact_answer("<s>3 + 4 = ", " 7", {}) == 1.0
    assert exact_answer("9-2=", "7", {"label": "x"}) == 1.0
    assert exact_answer("9-12=", "-3") == 1.0
    assert exact_answer("What is 3+4?", " 7") == 0.0  # no A+B= at the end, no answer field: nothing to match


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("arith") / "arithmetic"
    lines = run_here(["quickstart", "--task", "arithmetic", "--output-dir", root])
    return root, lines


def test_quickstart_writes_the_task_the_reward_and_the_configs(built):
    from prefpack.config import load_config

    root, lines = built
    train, held_out = make_problems(0)
    assert read_jsonl(root / "data" / "train_prompts.jsonl") == train
    assert read_jsonl(root / "data" / "held_out_prompts.jsonl") == held_out
    # reward.py is the package's file, copied whole: standalone (standard library only)
    assert (root / "reward.py").read_bytes() == (Path(__file__).parents[1] / "prefpack" / "arithmetic_reward.py"
                                                 ).read_bytes()
    # the warm start answers some held-out prompts right, not most: groups of samples that do not all tie
    accuracy = float(next(x for x in lines if "mean exact-answer reward" in x).split()[-1])
    assert 0.05 < accuracy < 0.6, lines
    cfg = load_config(str(root / "rounds-dpo.yaml"), [])
    assert cfg.rounds.count == 3 and cfg.rounds.samples_per_prompt == 8 and cfg.rounds.temperature == 1.0
    assert cfg.rounds.reward_fn == f"{root.resolve() / 'reward.py'}:exact_answer"
    assert Path(cfg.model.name_or_path) == (root / "warm" / "final").resolve()
    grpo = (root / "rounds-grpo.yaml").read_text()
    assert "objective: policy_gradient" in grpo and "{name: grpo}" in grpo and "samples_per_prompt: 8" in grpo


def test_prefpack_score_with_the_reward_function(built, tmp_path):
    root, _ = built
    samples = root / "warm" / "held_out.jsonl"  # the warm start's samples of the held-out prompts (generate's file)
    out = tmp_path / "scored.jsonl"
    run_here(["score", samples, "--reward-fn", f"{root / 'reward.py'}:exact_answer", "--format", "jsonl",
              "--output", out])
    rows = read_jsonl(out)
    assert len(rows) == 20 and all(len(r["scores"]) == 8 for r in rows)
    for r in rows:  # the answer field passes through generate and score to the function's row
        assert r["scores"] == [exact_answer("", c, {"answer": r["answer"]}) for c in r["completions"]]
    assert 0 < sum(sum(r["scores"]) for r in rows) < 160

    # text rows (no samples file): {prompt, completions} with the answer beside them, tokenised by --tokenizer
    write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "3+4=", "completions": [" 7", " 8", "", "x"], "answer": "7"},
                                          {"prompt": "9+9=", "completions": [" 18", "18</s>"]}])
    run_here(["score", tmp_path / "rows.jsonl", "--tokenizer", root / "tokenizer", "--reward-fn",
              f"{root / 'reward.py'}:exact_answer", "--format", "jsonl", "--output", tmp_path / "rows-scored.jsonl"])
    assert [r["scores"] for r in read_jsonl(tmp_path / "rows-scored.jsonl")] == [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0]]


def test_the_docs_show_the_reward_function_as_it_is():
    page = (Path(__file__).parents[1] / "docs" / "on-policy.md").read_text()
    section = page[page.index("## Verifiable rewards: the arithmetic example"):]
    shown = section[section.index("```python\n") + len("```python\n"):]
    shown = shown[:shown.index("```")]
    code = (Path(__file__).parents[1] / "prefpack" / "arithmetic_reward.py").read_text()
    assert "def exact_answer(" in shown and code.endswith(shown)
