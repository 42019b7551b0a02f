"""`prefpack quickstart --task arithmetic`: a verifiable-reward example for on-policy rounds, with no downloads.

The task: single-digit additions ("3+4=", answer " 7"). The 100 problems A+B (A, B in 0..9) are shuffled by the seed
and cut into held-out prompts (20) and training prompts (80): disjoint, so the held-out reward measures what the
policy learned, not what it saw. The reward is exact: 1.0 when the completion's first number is the sum
(``prefpack/arithmetic_reward.py``, copied as ``reward.py``), else 0.0.

A random-weight model samples its ~300 tokens almost uniformly, so no sample is right, every prompt's samples tie
and a round has nothing to learn from. The quickstart therefore warm-starts the tiny model with a few SFT steps on
the training prompts' right answers, stopped early: the warm start answers with a number, right on some held-out
prompts but not most (its held-out sample accuracy is printed, and measured in docs/on-policy.md), which leaves
rounds something to learn.

Written to ``output_dir`` (default ``runs/arithmetic``): ``data/train_prompts.jsonl`` and
``data/held_out_prompts.jsonl`` (``{"prompt": "3+4=", "answer": "7"}``), ``data/warm.jsonl`` (the warm start's
pairs), ``tokenizer/``, ``init-model/`` (random weights), ``warm/final`` (the warm start: the rounds' starting
model), ``reward.py``, and two configs for ``prefpack train``: ``rounds-dpo.yaml`` (rounds with the default
preference objective: best vs worst sample of each prompt) and ``rounds-grpo.yaml`` (group policy gradient on each
round's k scored samples: ``train.objective: policy_gradient``).
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

from prefpack.quickstart import MARKER, _build_model, _fresh_folder, _one_thread, _write_jsonl

ARITHMETIC_DIR = "runs/arithmetic"
OPERANDS = range(10)  # A and B of "A+B="
HELD_OUT = 20  # of the 100 problems; the other 80 are the training prompts
WARM_STEPS = 120  # SFT steps of the warm start (8 examples each, lr 1e-3): see docs/on-policy.md for the measurement
WARM_LR = 1e-3
SAMPLES, MAX_NEW_TOKENS = 8, 4  # rounds.samples_per_prompt, rounds.max_new_tokens of the configs


def problem(a: int, b: int) -> dict:
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def make_problems(seed: int = 0, held_out: int = HELD_OUT) -> tuple[list[dict], list[dict]]:
    """(training prompts, held-out prompts): every A+B with A, B in ``OPERANDS``, shuffled by ``seed`` and cut;
    disjoint, each row ``{"prompt": "A+B=", "answer": "S"}``."""
    rows = [problem(a, b) for a in OPERANDS for b in OPERANDS]
    random.Random(seed).shuffle(rows)
    return rows[held_out:], rows[:held_out]


def warm_pairs(rows: list[dict], seed: int = 0) -> list[dict]:
    """The warm start's rows: each prompt with its right answer (chosen, what SFT trains on) and a wrong one
    (rejected: a nearby wrong sum, unused by SFT, there so the file is a pair file prepare and DPO read too)."""
    rng = random.Random(seed)
    out = []
    for r in rows:
        answer = int(r["answer"])
        wrong = rng.choice([n for n in range(max(0, answer - 3), answer + 4) if n != answer])
        out.append({"prompt": r["prompt"], "chosen": f" {answer}", "rejected": f" {wrong}"})
    return out


def rounds_config(root: Path, objective: str, *, count: int = 3, steps: int = 24, seed: int = 0) -> str:
    """The YAML of a rounds run from the warm start: ``preference`` (DPO on best-vs-worst pairs, runs today) or
    ``policy_gradient`` (GRPO on each round's groups of k samples, with a KL to the warm start: measured over seeds
    0-4, held-out reward 0.186 -> 0.310 after 3 rounds with loss.kl_coef 0.05, 0.183 -> 0.242 over seeds 0-2 without;
    benchmarks/README.md)."""
    head = {"preference": "# On-policy rounds with DPO (best vs worst sample of each prompt) on the arithmetic task.",
            "policy_gradient": "# On-policy rounds with GRPO (group policy gradient on each round's k scored samples "
                               "per prompt)\n# on the arithmetic task."}[objective]
    from prefpack.objectives.names import OBJECTIVE_NAMES, TRAIN_OBJECTIVES

    group = TRAIN_OBJECTIVES[objective].loss_names is not None  # a group policy gradient (GRPO), not pairs (DPO)
    pg = f"objective: {objective}, " if objective != OBJECTIVE_NAMES[0] else ""
    train = f"train: {{{pg}global_batch_pairs: 16, micro_batch_tokens: 1024, seed: {seed}}}"
    loss = ("loss: {terms: [{name: grpo}], kl_coef: 0.05}" if group
            else "loss: {beta: 0.1, terms: [{name: sigmoid}, {name: nll, weight: 0.2}]}")
    reference = "reference: {mode: copy}\n"
    name = "grpo" if group else "dpo"
    return f"""{head}
# Written by `prefpack quickstart --task arithmetic`; run it with `prefpack train {root / f'rounds-{name}.yaml'}`.
# Each round samples {SAMPLES} completions of each training prompt, scores them with reward.py:exact_answer
# (1.0 when the first number is the sum) and trains; the held-out prompts are sampled and scored each round
# (eval_reward/mean in the round lines of run/metrics.jsonl), never trained on.
model: {{name_or_path: {root / 'warm' / 'final'}}}
{train}
{loss}
{reference}optim: {{lr: 1.0e-3, schedule: constant, warmup_steps: 0}}
rounds:
  count: {count}
  steps_per_round: {steps}
  prompts: {root / 'data' / 'train_prompts.jsonl'}
  eval_prompts: {root / 'data' / 'held_out_prompts.jsonl'}
  reward_fn: {root / 'reward.py'}:exact_answer
  samples_per_prompt: {SAMPLES}
  temperature: 1.0
  max_new_tokens: {MAX_NEW_TOKENS}
  batch_size: 16
  seed: {seed}
run: {{output_dir: {root / f'run-{name}'}, report_to: none}}
"""


def sample_accuracy(model_dir: str | Path, prompts: Path, out: Path, *, n: int = SAMPLES, seed: int = 0,
                    log=print) -> float:
    """The mean exact-answer reward of ``n`` samples (temperature 1, ``MAX_NEW_TOKENS``) of each prompt of
    ``prompts``: what a round's ``eval_reward/mean`` measures. The samples and scores are written beside ``out``."""
    from prefpack.generation.run import GenerateOptions, generate
    from prefpack.rewards.run import ScoreOptions, score

    generate(GenerateOptions(output=str(out), model=str(model_dir), inputs=[str(prompts)], n=n, temperature=1.0,
                             max_new_tokens=MAX_NEW_TOKENS, seed=seed, batch_size=32, device="cpu",
                             overwrite=True), log=lambda m: None)
    scored = out.with_name(out.stem + ".scores.jsonl")
    summary = score(ScoreOptions(input=str(out), output=str(scored), format="jsonl", overwrite=True,
                                 reward_fn=f"{Path(__file__).with_name('arithmetic_reward.py')}:exact_answer",
                                 device="cpu", progress=False), log=lambda m: None)
    del summary
    return _mean_of(scored)


def _mean_of(scored: Path) -> float:
    import json

    values = [s for line in scored.read_text().splitlines() if line.strip() for s in json.loads(line)["scores"]]
    return sum(values) / len(values)


def build_arithmetic(output_dir: str = ARITHMETIC_DIR, *, seed: int = 0, warm_steps: int = WARM_STEPS,
                     overwrite: bool = False, log=print) -> dict:
    """Everything above, in ``output_dir`` (refused when it exists, unless ``overwrite`` and an earlier quickstart
    made it), on one torch thread on CPU unless OMP_NUM_THREADS says otherwise; returns its paths and the warm
    start's held-out sample accuracy."""
    t_start = time.perf_counter()
    root = _fresh_folder(output_dir, overwrite)
    restore_threads = _one_thread(log)
    try:
        return _build_arithmetic(root, seed, warm_steps, t_start, log)
    finally:
        restore_threads()


def _build_arithmetic(root: Path, seed: int, warm_steps: int, t_start: float, log) -> dict:
    from prefpack.config import load_config
    from prefpack.data.prepare import PrepareOptions, prepare
    from prefpack.toy_tokenizer import build_toy_tokenizer
    from prefpack.training import train

    (root / "data").mkdir(parents=True)
    (root / MARKER).write_text("made by prefpack quickstart --task arithmetic; safe to delete\n")
    root = root.resolve()

    train_rows, held_out = make_problems(seed)
    log(f"1/5 generating the task: {len(train_rows)} training and {len(held_out)} held-out additions "
        f"(A+B=, A and B in 0..9; disjoint)")
    _write_jsonl(root / "data" / "train_prompts.jsonl", train_rows)
    _write_jsonl(root / "data" / "held_out_prompts.jsonl", held_out)
    warm = warm_pairs(train_rows, seed)
    _write_jsonl(root / "data" / "warm.jsonl", warm)
    shutil.copyfile(Path(__file__).with_name("arithmetic_reward.py"), root / "reward.py")
    log(f"    example: {train_rows[0]['prompt']!r} -> {warm[0]['chosen']!r}; reward: {root / 'reward.py'}:exact_answer")

    log("2/5 building a byte-level BPE tokenizer (Llama-style) and a 2-layer Llama (hidden 96) with random weights")
    texts = [r["prompt"] + r["chosen"] for r in warm] + [f" {n}" for n in range(2 * max(OPERANDS) + 1)]
    tok = build_toy_tokenizer(texts, style="llama", vocab_size=400)
    tok.save_pretrained(root / "tokenizer")
    _build_model(tok, root / "init-model", seed)

    log(f"3/5 warm start: {warm_steps} SFT steps on the training prompts' right answers (stopped early on purpose)")
    prepare(PrepareOptions(inputs=[str(root / "data" / "warm.jsonl")], tokenizer=str(root / "tokenizer"),
                           output=str(root / "warm-store"), workers=1), log=lambda m: None)
    result = train(load_config(None, [
        f"model.name_or_path={root / 'init-model'}", f"data.train={root / 'warm-store'}",
        "loss.terms=[{name: sft}]", "reference.mode=none", f"train.max_steps={warm_steps}",
        "train.global_batch_pairs=8", f"optim.lr={WARM_LR}", "optim.warmup_steps=0", "optim.schedule=constant",
        f"train.seed={seed}", f"run.output_dir={root / 'warm'}", "run.report_to=none", "run.plot=false"]),
        log=lambda m: None, progress=False)
    model_dir = Path(result.final_dir)

    log(f"4/5 the warm start's held-out sample accuracy ({SAMPLES} samples a prompt, temperature 1)")
    accuracy = sample_accuracy(model_dir, root / "data" / "held_out_prompts.jsonl", root / "warm" / "held_out.jsonl",
                               seed=seed)
    log(f"    mean exact-answer reward: {accuracy:.3f}")

    log("5/5 writing the rounds configs")
    for name, objective in (("dpo", "preference"), ("grpo", "policy_gradient")):
        (root / f"rounds-{name}.yaml").write_text(rounds_config(root, objective, seed=seed))
    log(f"    {root / 'rounds-dpo.yaml'}   (DPO rounds: prefpack train {root / 'rounds-dpo.yaml'})")
    log(f"    {root / 'rounds-grpo.yaml'}  (GRPO rounds: train.objective policy_gradient)")
    log(f"done in {time.perf_counter() - t_start:.0f}s")
    return {"root": str(root), "model": str(model_dir), "held_out_accuracy": accuracy,
            "dpo_config": str(root / "rounds-dpo.yaml"), "grpo_config": str(root / "rounds-grpo.yaml")}
