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


def _fresh_folder(output_dir: str, overwrite: bool = False) -> Path:
    """``output_dir``, new; an earlier quickstart's folder (its marker file) is emptied with ``overwrite`` only (it may
    hold a trained model), and refused without it; a folder quickstart did not make is refused, never deleted."""
    root = Path(output_dir)
    if root.exists():
        if not (root / MARKER).exists():
            raise FileExistsError(f"{root} exists and was not made by quickstart; choose another --output-dir")
        if not overwrite:
            raise FileExistsError(f"{root} holds an earlier quickstart's output ({_what_is_in(root)}); add "
                                  "--overwrite to replace it, or choose another --output-dir")
        shutil.rmtree(root)
    return root


def _what_is_in(root: Path) -> str:
    """An earlier quickstart folder's contents in a few words: its trained model first."""
    models = [str(p.relative_to(root)) for p in sorted(root.glob("**/final")) if p.is_dir()]
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir() if p.name != MARKER)
    what = f"a trained model in {', '.join(models)}; " if models else ""
    return what + (", ".join(names) if names else "empty")


def _one_thread(log):
    """One torch thread for the toy models on CPU, unless the user chose (OMP_NUM_THREADS): a 2-layer model gains
    nothing from more, and on a busy machine every extra thread waits for a core (the demo took 2 m 28 s at load 4.6
    on 2 cores with torch's default, 25 s with one). Returns a function that restores the previous count."""
    import os

    import torch

    before = torch.get_num_threads()
    if torch.cuda.is_available():
        log("torch threads: left as they are (the model trains on the GPU)")
        return lambda: None
    if os.environ.get("OMP_NUM_THREADS"):
        log(f"torch threads: {before} (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}; one is fastest for this "
            "tiny model, 3-6x on a busy machine)")
        return lambda: None
    torch.set_num_threads(1)
    if before > 1:
        log(f"torch threads: 1 of {before} (a tiny model on CPU gains nothing from more, and runs 3-6x slower with "
            "them on a busy machine; set OMP_NUM_THREADS to choose)")
    return lambda: torch.set_num_threads(before)


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
                   overwrite: bool = False, log=print) -> dict:
    """The demo in ``output_dir`` (refused when it exists, unless ``overwrite`` and an earlier quickstart made it),
    on one torch thread on CPU unless OMP_NUM_THREADS says otherwise."""
    t_start = time.perf_counter()
    root = _fresh_folder(output_dir, overwrite)
    restore_threads = _one_thread(log)
    try:
        return _run_quickstart(root, steps, seed, t_start, log)
    finally:
        restore_threads()


def _run_quickstart(root: Path, steps: int | None, seed: int, t_start: float, log) -> dict:
    from prefpack.config import load_config
    from prefpack.data.prepare import PrepareOptions, prepare
    from prefpack.toy_tokenizer import build_toy_tokenizer
    from prefpack.training import train

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


# ------------------------------------------------------------------ --model-size small: a model for real data

HH_SAMPLE = Path(__file__).resolve().parents[1] / "examples" / "data" / "hh-rlhf-harmless-base" / "train_2k.jsonl.gz"
SMALL_MODEL_DIR = "runs/quickstart-small"
SMALL_POSITIONS = 2048  # above prepare's usual --max-length 1024 (TRL's max_length)
SMALL_STEPS = 30  # language-model steps of SMALL_BATCH x SMALL_BLOCK tokens (74-164 s on 2 shared CPU cores)
SMALL_BATCH, SMALL_BLOCK = 8, 512


def _read_texts(path: Path) -> list[str]:
    """Whole conversations from a pairs file (prompt + chosen, prompt + rejected) or a `text` column."""
    import gzip

    from prefpack.errors import PrefpackError

    if not path.is_file():
        raise PrefpackError(f"--data {str(path)!r} does not exist (the bundled hh sample is "
                            "examples/data/hh-rlhf-harmless-base/train_2k.jsonl.gz in a clone of prefpack)")
    opener = gzip.open if path.suffix == ".gz" else open
    texts = []
    with opener(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            if "text" in row:
                texts.append(row["text"])
            else:
                texts += [row.get("prompt", "") + row[k] for k in ("chosen", "rejected") if isinstance(row.get(k), str)]
    if not texts:
        raise PrefpackError(f"--data {str(path)!r} has no rows with text, or prompt and chosen/rejected")
    return texts


def build_small_model(output_dir: str = SMALL_MODEL_DIR, *, steps: int | None = None, seed: int = 0,
                      data: str | None = None, overwrite: bool = False, log=print) -> dict:
    """A small but real starting point for `prefpack train` on real data, with no downloads: a byte-level BPE
    tokenizer (4,096 tokens, Llama-style) trained on the data, and a 4-layer Llama (hidden 128, 2,048 positions)
    trained as a language model on its conversations for ``steps`` steps of 8 x 512 tokens. Written to
    ``output_dir/model`` (model and tokenizer in one folder, as a hub checkpoint)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from prefpack.toy_tokenizer import build_toy_tokenizer

    t_start = time.perf_counter()
    steps = SMALL_STEPS if steps is None else steps
    root = _fresh_folder(output_dir, overwrite)
    source = Path(data) if data else HH_SAMPLE
    texts = _read_texts(source)
    root.mkdir(parents=True)
    (root / MARKER).write_text("made by prefpack quickstart --model-size small; safe to delete\n")

    log(f"1/3 building a byte-level BPE tokenizer (4,096 tokens, Llama-style) from {len(texts)} conversations "
        f"of {source.name}")
    tok = build_toy_tokenizer(texts, style="llama", vocab_size=4096)

    log(f"2/3 building a 4-layer Llama (hidden 128, {SMALL_POSITIONS} positions) with random weights")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=SMALL_POSITIONS, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)

    batch_size, block = SMALL_BATCH, SMALL_BLOCK
    ids = [i for t in texts[::2] for i in tok(t)["input_ids"] + [tok.eos_token_id]]  # prompt + chosen
    while len(ids) < 4 * batch_size * (block + 1):  # a small --data file is repeated
        ids = ids * 2
    flat = torch.tensor(ids)
    held_out = flat[-batch_size * (block + 1):].view(batch_size, block + 1)
    flat = flat[: -batch_size * (block + 1)]
    log(f"3/3 language-model training on {len(flat):,} tokens ({steps} steps of {batch_size} x {block} tokens)")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))

    def held_out_loss() -> float:
        model.eval()
        with torch.no_grad():
            out = model(input_ids=held_out[:, :-1], labels=held_out[:, :-1]).loss.item()
        model.train()
        return out

    before = held_out_loss()
    model.train()
    for step in range(1, steps + 1):
        starts = torch.randint(0, len(flat) - block, (batch_size,), generator=gen)
        batch = torch.stack([flat[s:s + block] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps:
            log(f"    step {step}/{steps}: loss {loss.item():.3f}")
    after = held_out_loss()
    out = root / "model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    log("")
    log(f"held-out next-token loss {before:.3f} -> {after:.3f} ({time.perf_counter() - t_start:.0f}s in all)")
    log(f"model and tokenizer: {out}  ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
        f"{SMALL_POSITIONS} positions)")
    log(f"next: README's 'Train your own' with MODEL_DIR={out}")
    return {"model_dir": str(out), "loss_before": before, "loss_after": after}


# ------------------------------------------------------------------ --images: a vision-language example

IMAGES_DIR = "runs/quickstart-images"


def build_image_example(output_dir: str = IMAGES_DIR, *, train_pairs: int = 256, eval_pairs: int = 32, seed: int = 0,
                        kind: str = "qwen2_vl", overwrite: bool = False, log=print) -> dict:
    """Everything README's "Images" section trains on, generated offline: a task whose answer needs the image (each
    picture is mostly one colour; chosen names it, rejected another: ``toy_vision.colour_rows``) as pairs in TRL's
    vision layout (``data/train.jsonl``, ``data/eval.jsonl``, the PNGs beside them), a processor folder (a toy
    ChatML tokenizer with Qwen2-VL's image tokens and Qwen2-VL's image processor) and a tiny random-weight Qwen2-VL
    (``model/``, with the processor's files so it is a complete checkpoint). No training: the README's commands do
    that."""
    from prefpack.toy_vision import colour_rows, save_processor_dir, tiny_vlm, vision_tokenizer, write_jsonl

    root = _fresh_folder(output_dir, overwrite)
    (root / "data").mkdir(parents=True)
    (root / MARKER).write_text("made by prefpack quickstart; safe to delete\n")
    tok = vision_tokenizer()
    write_jsonl(root / "data" / "train.jsonl", colour_rows(train_pairs, root / "data" / "images", seed=seed,
                                                           relative_to=root / "data"))
    write_jsonl(root / "data" / "eval.jsonl", colour_rows(eval_pairs, root / "data" / "eval-images", seed=seed + 1,
                                                          relative_to=root / "data"))
    save_processor_dir(root / "processor", kind, tok)
    model = tiny_vlm(kind, tok, seed=seed)
    model.save_pretrained(root / "model")
    save_processor_dir(root / "model", kind, tok)
    log(f"wrote {train_pairs} train and {eval_pairs} eval image pairs (name the picture's colour) to {root / 'data'}, "
        f"a processor folder "
        f"{root / 'processor'} and a tiny {kind} model {root / 'model'}")
    return {"root": str(root), "processor": str(root / "processor"), "model": str(root / "model")}
