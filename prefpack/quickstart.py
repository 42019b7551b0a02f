"""`prefpack quickstart`: the whole pipeline on a small, benign, learnable task, with no downloads.

The task: short generated product/place reviews ("Review: The soup was lovely and fresh. Is this review
positive or negative? Answer:"); the chosen answer is the right label, the rejected one the wrong label.
A randomly initialised model picks " positive" or " negative" regardless of the review (about half right);
DPO teaches it to read the adjectives, and it generalises to held-out reviews with new combinations.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

SUBJECTS = ["The soup", "The service", "The room", "The film", "The book", "The concert", "The coffee", "The garden",
            "The train ride", "The museum", "The hotel", "The bakery", "The park", "The lecture", "The game",
            "The bread", "The music", "The beach", "The tour", "The pasta", "The market", "The show", "The cake",
            "The walk", "The hike", "The library", "The shop", "The salad", "The team", "The app"]
POSITIVE = ["lovely", "wonderful", "delightful", "excellent", "superb", "charming", "brilliant", "pleasant",
            "fantastic", "cozy", "fresh", "friendly", "beautiful", "great", "amazing", "tasty", "warm", "clean",
            "relaxing", "inspiring"]
NEGATIVE = ["awful", "dreadful", "terrible", "bland", "dull", "noisy", "disappointing", "mediocre", "tiresome",
            "cold", "stale", "rude", "ugly", "boring", "dirty", "slow", "greasy", "crowded", "confusing", "broken"]
TEMPLATES = ["{s} was {a} and {b}.", "{s} was {a}, really {b}.", "Honestly, {s_l} was {a} and quite {b}.",
             "{s} felt {a} and {b}.", "I found {s_l} {a} and {b}."]
QUESTION = "\nIs this review positive or negative?\nAnswer:"
MARKER = ".prefpack-quickstart"


def make_pairs(n: int, seed: int) -> list[dict]:
    """Reviews with two adjectives of one polarity; chosen = the right label, rejected = the wrong one."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        positive = rng.random() < 0.5
        words = POSITIVE if positive else NEGATIVE
        a, b = rng.sample(words, 2)
        s = rng.choice(SUBJECTS)
        review = rng.choice(TEMPLATES).format(s=s, s_l=s[0].lower() + s[1:], a=a, b=b)
        good, bad = (" positive", " negative") if positive else (" negative", " positive")
        rows.append({"prompt": f"Review: {review}{QUESTION}", "chosen": good, "rejected": bad})
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return path


def _build_model(tokenizer, out: Path, seed: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=96, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def run_quickstart(output_dir: str = "runs/quickstart", *, steps: int | None = None, seed: int = 0,
                   log=print) -> dict:
    from prefpack.config import load_config
    from prefpack.data.prepare import PrepareOptions, prepare
    from prefpack.toy_tokenizer import build_toy_tokenizer
    from prefpack.training import train

    t_start = time.perf_counter()
    root = Path(output_dir)
    if root.exists():
        if not (root / MARKER).exists():
            raise FileExistsError(f"{root} exists and was not made by quickstart; choose another --output-dir")
        shutil.rmtree(root)
    (root / "data").mkdir(parents=True)
    (root / MARKER).write_text("made by prefpack quickstart; safe to delete\n")

    log("1/5 generating the task: label short reviews as positive or negative")
    train_rows, eval_rows = make_pairs(2000, seed), make_pairs(300, seed + 1)
    _write_jsonl(root / "data" / "train.jsonl", train_rows)
    _write_jsonl(root / "data" / "eval.jsonl", eval_rows)
    ex = train_rows[0]
    log(f"    example prompt: {ex['prompt']!r}\n    chosen: {ex['chosen']!r}  rejected: {ex['rejected']!r}")

    log("2/5 building a byte-level BPE tokenizer (Llama-style: adds BOS) from the training text")
    texts = [r["prompt"] + r["chosen"] for r in train_rows] + [" positive", " negative"]
    tok = build_toy_tokenizer(texts, style="llama", vocab_size=400)
    tok.save_pretrained(root / "tokenizer")

    log("3/5 prepare: tokenising into binary stores")
    for name in ("train", "eval"):
        rep = prepare(PrepareOptions(inputs=[str(root / "data" / f"{name}.jsonl")], tokenizer=str(root / "tokenizer"),
                                     output=str(root / f"{name}-store"), workers=1), log=lambda m: None)
        log(f"    {name}: {rep.examples} pairs, {rep.tokens} tokens")

    log("4/5 building a small Llama model (2 layers, hidden 96) with random weights")
    _build_model(tok, root / "init-model", seed)

    overrides = [
        f"model.name_or_path={root / 'init-model'}", f"data.train={root / 'train-store'}",
        f"data.eval={root / 'eval-store'}", "data.max_tokens_per_row=512", "train.micro_batch_tokens=1024",
        "train.global_batch_pairs=16", "train.epochs=1", f"train.seed={seed}", "optim.lr=1.0e-3",
        "optim.warmup_steps=10", "optim.schedule=cosine", "loss.beta=0.1", "reference.mode=copy",
        f"run.output_dir={root / 'run'}", "run.eval_every=25",
    ]
    if steps is not None:
        overrides.append(f"train.max_steps={steps}")
    cfg = load_config(None, overrides)
    log("5/5 DPO training on packed batches (reference: a frozen copy of the initial model)")
    result = train(cfg, log=log)
    before, after = result.eval_before, result.eval_after
    rows = [("loss", "loss"), ("preference accuracy (policy prefers chosen)", "logps/accuracies"),
            ("reward accuracy", "rewards/accuracies"), ("reward margin", "rewards/margins"),
            ("log p(chosen)", "logps/chosen"), ("log p(rejected)", "logps/rejected")]
    log("")
    log(f"held-out evaluation ({len(eval_rows)} pairs never seen in training)")
    log(f"{'metric':<46}{'before':>10}{'after':>10}")
    for label, key in rows:
        log(f"{label:<46}{before[key]:>10.3f}{after[key]:>10.3f}")
    log("")
    log(f"packed rows were {result.last_train['filling']:.0%} real tokens; {result.steps} steps in "
        f"{time.perf_counter() - t_start:.0f}s in all")
    log(f"metrics: {result.run_dir / 'metrics.jsonl'}   curves: {result.run_dir / 'curves.png'}")
    log(f"trained model: {result.final_dir} (load with AutoModelForCausalLM.from_pretrained)")
    return {"before": before, "after": after, "run_dir": str(result.run_dir), "final_dir": str(result.final_dir)}
