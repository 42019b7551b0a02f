"""prefpack against TRL's DPOTrainer: tokens/s, peak memory and the first step's loss, same model and pairs.

One randomly initialised Llama model is built from a config and saved; both frameworks train it from that
folder for the same optimizer steps, on the same pairs of the bundled hh-rlhf sample, with the same
tokenizer, global batch (pairs), beta, learning rate and schedule (linear, no warmup), gradient clipping
(1.0), AdamW settings and precision (float32), DPO sigmoid loss against a frozen copy of the initial model.
Each run is its own process, so its peak memory is its own (process RSS on CPU, max allocated on CUDA).

prefpack trains through its public path (`load_config(None, overrides)` + `train(cfg)`); TRL with its own
`DPOConfig` defaults except for what must be equal, once as is (gradient checkpointing on, TRL's default)
and once with gradient checkpointing off.

Equal tokenisation. prefpack tokenises prompt and completions apart and joins the ids; TRL tokenises
`prompt` and `prompt + completion + eos` and cuts where they diverge. The two differ on a pair whose
prompt + completion had to be truncated (prefpack cuts the prompt's start, TRL the sequence's end) or when
BPE merges across the boundary, so the benchmark uses only pairs that prepare did not truncate and whose
TRL-style ids equal the store's (counted and printed). The TRL process checks the ids its own
preprocessing produced against the store and reports every mismatch; the first step's losses are
compared only when there is none.

Vocabulary cases: `neox` is the bundled GPT-NeoX-20B tokenizer (50,277 tokens). `qwen` is a Qwen2.5-size
head (151,936 rows, as Qwen2.5's configs): with the Qwen2.5 tokenizer when one is found (`--qwen-tokenizer`,
default: shared/tokenizers/qwen2.5 beside the repository, as this project's machines have it), otherwise,
self-contained, the GPT-NeoX tokenizer with the model's vocabulary padded up to 151,936 rows (the extra rows
are never targets, but every log-softmax runs over them; the output says which was used).

    pip install -e '.[bench]'          # TRL, pinned
    python benchmarks/compare_trl.py [--cases neox,qwen] [--steps 2] [--repeats 1] [--device cpu]
    python benchmarks/compare_trl.py --device cuda --dtype bfloat16 --preset 0.7b --cases qwen --batch-pairs 32

The default run (2 steps, both cases, 6 processes) takes about 9 minutes on 2 CPU cores, most of it TRL's.

Precision: `--dtype bfloat16` runs TRL with `bf16=True` on float32 weights (its default mixed precision: float32
masters, bf16 autocast) and prefpack with `model.dtype=bfloat16` (float32 masters under bf16 autocast).
Presets: `cpu` (4 layers, hidden 256), `0.7b` (24 layers, hidden 1024) and `1.3b` (28 layers, hidden 1536),
intermediate 4x hidden, heads of 64.

MFU: useful FLOPs per real token of the pairs used (policy forward and backward 6N, reference forward 2N for the
N non-embedding parameters per token; the LM head 8 V h per completion token only; attention 4 l^2 h per layer and
sequence, causal counted as full, times 3 for the policy and 1 for the reference) times tokens/s, over the matmul
peak measured in the same run (bf16 on CUDA with --dtype bfloat16, else float32). Both frameworks are measured
against the same useful work: padding, recomputed prompts and full-vocabulary logits count as waste. "tokens/s"
and "MFU" are at the mean rate (timed tokens over timed seconds: one slow step weighs), "median" at the median
step's. `--qlora R` runs both as QLoRA (4-bit NF4 base, LoRA rank R on every linear, reference = adapter off); its
MFU still counts full fine-tuning's FLOPs (no weight gradients are computed), so read it only as a ratio.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "examples" / "data" / "hh-rlhf-harmless-base" / "train_2k.jsonl.gz"
NEOX = REPO / "examples" / "tokenizers" / "gpt-neox-20b"
QWEN_CANDIDATES = (REPO / "shared" / "tokenizers" / "qwen2.5", REPO.parent / "shared" / "tokenizers" / "qwen2.5")
QWEN_VOCAB = 151_936  # Qwen2.5's embedding rows (its tokenizer has 151,665 tokens)
RUNS = ("prefpack", "trl", "trl_no_gc")
LABELS = {"prefpack": "prefpack", "trl": "TRL (defaults: grad. ckpt on)", "trl_no_gc": "TRL (grad. ckpt off)"}
TARGET_SPEED, TARGET_MEMORY, TARGET_FILLING, LOSS_TOL = 3.0, 0.4, 0.95, 1e-4
PRESETS = {"cpu": (4, 256), "0.7b": (24, 1024), "1.3b": (28, 1536)}


def matmul_peak_flops(device: str, dtype: str) -> float:
    """Best of 10 square matmuls (8192 on CUDA, 1024 on CPU) in the compute dtype: the MFU denominator."""
    import torch

    n = 8192 if device == "cuda" else 1024
    dt = torch.bfloat16 if (dtype == "bfloat16" and device == "cuda") else torch.float32
    x, y = (torch.randn(n, n, device=device, dtype=dt) for _ in range(2))
    best = float("inf")
    for _ in range(10):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        x @ y
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def useful_flops_per_token(store_path: Path, *, layers: int, hidden: int, vocab: int, body_params: int) -> float:
    """DPO step FLOPs a perfect trainer spends per real token of these pairs (see the module docstring)."""
    from prefpack.data.store import Store

    store = Store(store_path)
    tokens = flops = 0.0
    for i in range(len(store)):
        pair = store.pair(i)
        p, c, r = len(pair.prompt), len(pair.chosen), len(pair.rejected)
        real = 2 * p + c + r
        attn = 4 * layers * hidden * ((p + c) ** 2 + (p + r) ** 2)
        flops += 8 * body_params * real + 8 * vocab * hidden * (c + r) + 4 * attn
        tokens += real
    return flops / max(tokens, 1)


# ------------------------------------------------------------------------------------------------ measuring


def peak_memory_mib(device: str) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def summarise(step_times: list[float], step_tokens: list[int], computed: list[int], losses: list[float],
              logps: list[tuple[float, float]]) -> dict:
    """tokens/s over every step but the first (warm-up: allocations, lazy initialisation)."""
    timed = slice(1, None) if len(step_times) > 1 else slice(None)
    secs, toks = sum(step_times[timed]), sum(step_tokens[timed])
    rates = [n / t for n, t in zip(step_tokens[timed], step_times[timed]) if t > 0]
    return {"tokens_per_s_median": statistics.median(rates) if rates else float("nan"),
            "steps": len(step_times), "timed_steps": len(step_times[timed]), "seconds": secs, "real_tokens": toks,
            "tokens_per_s": toks / secs if secs > 0 else float("nan"),
            "filling": sum(step_tokens) / max(sum(computed), 1), "losses": losses,
            "first_loss": losses[0] if losses else float("nan"), "step_seconds": step_times,
            "logps": [list(x) for x in logps]}


# ------------------------------------------------------------------------------------------------ workers


def run_prefpack(a) -> dict:
    import torch

    from prefpack.config import load_config
    from prefpack.training import train

    torch.set_num_threads(a.threads)
    overrides = [f"model.name_or_path={a.model}", f"data.train={a.store}", "data.shuffle=false",
                 f"train.global_batch_pairs={a.batch_pairs}", f"train.max_steps={a.steps}", "train.seed=0",
                 f"train.device={a.device}", f"model.dtype={a.dtype}", "model.attn_implementation=auto",
                 f"optim.lr={a.lr}", "optim.schedule=linear", "optim.warmup_steps=0", "optim.max_grad_norm=1.0",
                 "optim.weight_decay=0.0", f"loss.beta={a.beta}", "reference.mode=copy",
                 f"run.output_dir={a.out}", "run.plot=false", "run.tensorboard=false", *a.override]
    if a.qlora:
        overrides += ["lora.enabled=true", f"lora.r={a.qlora}", f"lora.alpha={2 * a.qlora}", "lora.dropout=0.0",
                      "lora.target_modules=all-linear", "model.quantization=nf4", "model.quantization_double=true",
                      "reference.mode=adapter"]
    cfg = load_config(None, overrides)
    train(cfg, progress=False, log=lambda m: None)
    recs = [json.loads(line) for line in (Path(a.out) / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["split"] == "train"]
    times = [a.batch_pairs / r["pairs/s"] for r in recs]
    tokens = [round(r["tokens/s"] * t) for r, t in zip(recs, times)]
    computed = [round(n / r["filling"]) for r, n in zip(recs, tokens)]
    return summarise(times, tokens, computed, [r["loss"] for r in recs],
                     [(r["logps/chosen"], r["logps/rejected"]) for r in recs])


def recording_trainer(record: dict):
    """A DPOTrainer subclass that appends each training step's loss, real and computed token counts and logps to
    ``record`` (lists under "losses", "real", "computed", "logps"); bench_vision.py uses it too."""
    from trl import DPOTrainer

    class Recorder(DPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            loss = out[0] if return_outputs else out
            if model.training:
                record["losses"].append(float(loss.detach()))
                record["real"].append(int(inputs["attention_mask"].sum()))
                record["computed"].append(int(inputs["input_ids"].numel()))
                m = self._metrics["train"]
                record["logps"].append((m["logps/chosen"][-1], m["logps/rejected"][-1]))
            return out

    return Recorder


def run_trl(a) -> dict:
    import numpy as np
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DPOConfig

    from prefpack.data.store import Store

    torch.set_num_threads(a.threads)
    rows = [json.loads(line) for line in Path(a.rows).read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    record: dict = {"losses": [], "real": [], "computed": [], "times": [], "logps": []}

    Recorder = recording_trainer(record)

    class Clock(TrainerCallback):
        """Step time from the end of the previous step (so collation counts, as in prefpack's step time)."""

        def on_train_begin(self, args, state, control, **kw):
            self.t = None

        def on_step_begin(self, args, state, control, **kw):
            if self.t is None:
                self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if a.device == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            record["times"].append(now - self.t)
            self.t = now

    args = DPOConfig(
        output_dir=a.out, per_device_train_batch_size=a.batch_pairs, gradient_accumulation_steps=1,
        max_steps=a.steps, learning_rate=a.lr, lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=1.0,
        weight_decay=0.0, beta=a.beta, loss_type=["sigmoid"], max_length=a.max_length,
        bf16=a.dtype == "bfloat16", fp16=False,
        use_cpu=a.device == "cpu", gradient_checkpointing=a.gradient_checkpointing, train_sampling_strategy="sequential",
        seed=0, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
    )
    peft = None
    if a.qlora:  # QLoRA as TRL's docs set it up: a 4-bit NF4 base, LoRA on every linear, reference = adapter off
        from peft import LoraConfig
        from transformers import BitsAndBytesConfig

        compute = torch.bfloat16 if a.dtype == "bfloat16" else torch.float32
        args.model_init_kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute)
        peft = LoraConfig(r=a.qlora, lora_alpha=2 * a.qlora, lora_dropout=0.0, target_modules="all-linear",
                          task_type="CAUSAL_LM")
    trainer = Recorder(model=a.model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                       peft_config=peft)
    trainer.add_callback(Clock())
    # Tokenisation check: the ids TRL's own preprocessing produced against the store's, pair by pair.
    store = Store(a.store)
    ds = trainer.train_dataset
    mismatches = []
    if len(ds) != len(store):
        mismatches.append(f"TRL kept {len(ds)} pairs, the store holds {len(store)}")
    for i in range(min(len(ds), len(store))):
        pair = store.pair(i)
        for part, ids in (("prompt", pair.prompt), ("chosen", pair.chosen), ("rejected", pair.rejected)):
            if list(ds[i][f"{part}_ids"]) != np.asarray(ids).tolist():
                mismatches.append(f"pair {i} {part}")
    trainer.train()
    times = record["times"]
    tokens = record["real"][: len(times)]
    n = len(times)
    out = summarise(times, tokens, record["computed"][:n], record["losses"][:n], record["logps"][:n])
    out.update({"trl_version": trl.__version__, "tokenisation_mismatches": mismatches,
                "gradient_checkpointing": bool(a.gradient_checkpointing)})
    return out


def worker(a) -> None:
    t0 = time.perf_counter()
    result = run_prefpack(a) if a.worker == "prefpack" else run_trl(a)
    result.update({"peak_memory_mib": peak_memory_mib(a.device), "wall_s": time.perf_counter() - t0})
    print("RESULT " + json.dumps(result))


# ------------------------------------------------------------------------------------------------ set-up


def read_rows(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def trl_style_ids(tok, prompt: str, chosen: str, rejected: str) -> tuple[list, list, list]:
    """What TRL 1.x's DPOTrainer preprocessing makes of a plain-text pair (used to pick pairs; TRL checks)."""
    eos = tok.eos_token

    def cpl(x: list, y: list) -> int:
        n = 0
        for u, v in zip(x, y):
            if u != v:
                break
            n += 1
        return n

    c = chosen if chosen.endswith(eos) else chosen + eos
    r = rejected if rejected.endswith(eos) else rejected + eos
    p_ids, pc_ids, pr_ids = (tok(t)["input_ids"] for t in (prompt, prompt + c, prompt + r))
    n = min(cpl(p_ids, pc_ids), cpl(p_ids, pr_ids))
    return p_ids[:n], pc_ids[n:], pr_ids[n:]


def select_pairs(work: Path, tokenizer: str, a, log) -> tuple[Path, Path, dict]:
    """Prepare the sample, keep pairs both frameworks tokenise identically, write them and their store."""
    import numpy as np
    from transformers import AutoTokenizer

    from prefpack.data.prepare import PrepareOptions, prepare
    from prefpack.data.store import Store

    rows = read_rows(DATA)
    full = work / "store-full"
    prepare(PrepareOptions(inputs=[str(DATA)], tokenizer=tokenizer, output=str(full), max_length=a.max_length,
                           skip_invalid=True, overwrite=True, workers=1), log=lambda m: None)
    store = Store(full)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    flags, src = np.asarray(store.index[:, 4]), np.asarray(store.index[:, 6])
    need = a.steps * a.batch_pairs
    order = np.random.default_rng(a.seed).permutation(len(store))
    chosen_ids, differ = [], 0
    truncated = int((flags != 0).sum())
    for i in order:
        if flags[i] != 0:
            continue
        row = rows[int(src[i])]
        pair = store.pair(int(i))
        ours = tuple(np.asarray(x).tolist() for x in (pair.prompt, pair.chosen, pair.rejected))
        if trl_style_ids(tok, row["prompt"], row["chosen"], row["rejected"]) != ours:
            differ += 1
            continue
        chosen_ids.append(int(i))
        if len(chosen_ids) == need:
            break
    if len(chosen_ids) < need:
        raise SystemExit(f"only {len(chosen_ids)} usable pairs for {need}; use fewer --steps")
    rows_path = work / "pairs.jsonl"
    with open(rows_path, "w", encoding="utf-8") as fh:
        for i in chosen_ids:
            r = rows[int(src[i])]
            fh.write(json.dumps({"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]}) + "\n")
    sub = work / "store"
    prepare(PrepareOptions(inputs=[str(rows_path)], tokenizer=tokenizer, output=str(sub), max_length=a.max_length,
                           skip_invalid=False, overwrite=True, workers=1), log=lambda m: None)
    s2 = Store(sub)
    assert len(s2) == need and all(
        np.array_equal(getattr(s2.pair(k), f), getattr(store.pair(i), f))
        for k, i in enumerate(chosen_ids) for f in ("prompt", "chosen", "rejected")), "subset store differs"
    lens = np.asarray(s2.index[:, 1:4])
    info = {"store_pairs": len(store), "truncated_excluded": truncated, "tokenisation_differs_excluded": differ,
            "pairs_used": need, "tokens_used": int((2 * lens[:, 0] + lens[:, 1] + lens[:, 2]).sum()),
            "tokenizer_vocab": len(tok)}
    log(f"  pairs: {need} of {len(store)} prepared ({truncated} truncated by --max-length and {differ} that TRL "
        f"would tokenise differently were skipped before drawing)")
    return rows_path, sub, info


def build_model(path: Path, vocab: int, a) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(a.seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                      num_hidden_layers=a.layers, num_attention_heads=max(a.hidden // 64, 1),
                      num_key_value_heads=max(a.hidden // 64, 1), max_position_embeddings=a.max_length,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def find_qwen(explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit) if explicit != "none" else None
    for cand in QWEN_CANDIDATES:
        if (cand / "tokenizer.json").is_file():
            return cand
    return None


def launch(kind: str, case: dict, a, work: Path, tag: str) -> dict:
    out = work / f"run-{tag}"
    cmd = [sys.executable, __file__, "--worker", "prefpack" if kind == "prefpack" else "trl",
           "--model", str(case["model"]), "--store", str(case["store"]), "--rows", str(case["rows"]),
           "--tokenizer", case["tokenizer"], "--out", str(out), "--steps", str(a.steps),
           "--batch-pairs", str(a.batch_pairs), "--lr", repr(a.lr), "--beta", repr(a.beta),
           "--max-length", str(a.max_length), "--device", a.device, "--threads", str(a.threads), "--dtype", a.dtype,
           "--qlora", str(a.qlora)]
    if kind == "trl":
        cmd.append("--gradient-checkpointing")
    for o in a.override:
        cmd += ["--override", o]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"{kind} run failed (exit {proc.returncode}): {' '.join(cmd)}")
    return json.loads(lines[-1][len("RESULT "):])


# ------------------------------------------------------------------------------------------------ report


def ratio(x: float, y: float) -> float:
    return x / y if y else float("nan")


def report_case(name: str, case: dict, res: dict[str, dict]) -> dict:
    p = res["prefpack"]
    out = {"tokenizer": case["tokenizer_note"], "model_vocab": case["vocab"], "params": case["params"],
           **case["info"], "runs": res}
    mism = sorted({m for k in ("trl", "trl_no_gc") if k in res for m in res[k]["tokenisation_mismatches"]})
    out["tokenisation_mismatches"] = mism
    for k in ("trl", "trl_no_gc"):
        if k not in res:
            continue
        t = res[k]
        d = abs(p["first_loss"] - t["first_loss"])
        lp = max(abs(u - v) for u, v in zip(p["logps"][0], t["logps"][0]))
        out[f"vs_{k}"] = {"speed": ratio(p["tokens_per_s"], t["tokens_per_s"]),
                          "speed_median": ratio(p["tokens_per_s_median"], t["tokens_per_s_median"]),
                          "memory": ratio(p["peak_memory_mib"], t["peak_memory_mib"]),
                          "first_loss_abs_diff": d,
                          "max_loss_abs_diff": max(abs(u - v) for u, v in zip(p["losses"], t["losses"])),
                          "first_logps_abs_diff": lp,
                          "first_logps_rel_diff": lp / max(abs(x) for x in p["logps"][0])}
    return out


def print_case(name: str, rep: dict, mem_label: str) -> None:
    runs = rep["runs"]
    print(f"\n[{name}] tokenizer: {rep['tokenizer']}; model vocabulary {rep['model_vocab']:,}, "
          f"{rep['params'] / 1e6:.1f}M parameters; {rep['pairs_used']} pairs, {rep['tokens_used']:,} tokens")
    print(f"{'run':<32}{'tokens/s':>10}{'median':>9}{mem_label:>15}{'filling':>9}{'MFU':>7}{'median':>7}"
          f"{'step-1 loss':>14}"
          f"{'last loss':>12}")
    for k in RUNS:
        if k in runs:
            r = runs[k]
            print(f"{LABELS[k]:<32}{r['tokens_per_s']:>10,.0f}{r['tokens_per_s_median']:>9,.0f}"
                  f"{r['peak_memory_mib']:>15,.0f}{r['filling']:>9.3f}"
                  f"{r['mfu']:>7.1%}{r['mfu_median']:>7.1%}{r['first_loss']:>14.7f}{r['losses'][-1]:>12.7f}")
    for k in ("trl", "trl_no_gc"):
        v = rep.get(f"vs_{k}")
        if v:
            print(f"prefpack / {LABELS[k]:<30} speed {v['speed']:5.2f}x (median {v['speed_median']:.2f}x)  memory {v['memory']:5.2f}x  |loss diff| "
                  f"step 1 {v['first_loss_abs_diff']:.1e}, any step {v['max_loss_abs_diff']:.1e}; step-1 mean "
                  f"log-probs differ by {v['first_logps_abs_diff']:.1e} ({v['first_logps_rel_diff']:.0e} relative)")
    if rep["tokenisation_mismatches"]:
        print(f"TOKENISATION MISMATCHES ({len(rep['tokenisation_mismatches'])}): "
              f"{', '.join(rep['tokenisation_mismatches'][:10])}: TRL trained on other ids than prefpack, so the "
              "losses are not comparable")
    elif any(rep[f"vs_{k}"]["first_loss_abs_diff"] > LOSS_TOL for k in ("trl", "trl_no_gc") if f"vs_{k}" in rep):
        print(f"the step-1 losses differ by more than {LOSS_TOL:g} although the ids agree: look at the precision "
              "and attention settings of both runs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="neox,qwen", help="comma list of neox (50k vocab) and qwen (152k vocab)")
    ap.add_argument("--steps", type=int, default=3,
                    help="optimizer steps per run; the first is not timed (a single timed step is mostly noise)")
    ap.add_argument("--batch-pairs", type=int, default=8)
    ap.add_argument("--preset", choices=tuple(PRESETS), default=None,
                    help="model size: cpu (4x256), 0.7b (24x1024), 1.3b (28x1536); overrides --layers/--hidden")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="compute dtype of both: bfloat16 = TRL bf16=True and prefpack model.dtype=bfloat16, both "
                    "with float32 master weights")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run each framework this many times, alternating, and keep its fastest run")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)}")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--qwen-tokenizer", help="Qwen2.5 tokenizer folder; 'none' = pad the GPT-NeoX vocabulary")
    ap.add_argument("--qlora", type=int, default=0, metavar="R",
                    help="both as QLoRA: 4-bit NF4 base (bitsandbytes), LoRA rank R (alpha 2R) on every linear, "
                    "reference = the adapter off; 0 = full fine-tuning")
    ap.add_argument("--override", action="append", default=[], help="extra prefpack config override KEY=VALUE")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (models, stores, runs)")
    ap.add_argument("--worker", choices=("prefpack", "trl"), help=argparse.SUPPRESS)
    for hidden in ("--model", "--store", "--rows", "--tokenizer", "--out"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--gradient-checkpointing", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.preset:
        a.layers, a.hidden = PRESETS[a.preset]
    if a.worker:
        worker(a)
        return

    try:
        import trl
    except ImportError:
        raise SystemExit("TRL is not installed: pip install -e '.[bench]'") from None
    import shutil

    import torch
    import transformers

    import prefpack

    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    runs = [r.strip() for r in a.runs.split(",") if r.strip()]
    bad = [c for c in cases if c not in ("neox", "qwen")] + [r for r in runs if r not in RUNS]
    if bad or "prefpack" not in runs:
        raise SystemExit(f"unknown case/run {bad}, or prefpack missing from --runs")
    work = Path(tempfile.mkdtemp(prefix="compare_trl-"))
    log = print
    device = torch.cuda.get_device_name(0) if a.device == "cuda" else f"{os.cpu_count()}-core CPU"
    log(f"compare_trl: prefpack {getattr(prefpack, '__version__', '?')} vs TRL {trl.__version__} DPOTrainer "
        f"(torch {torch.__version__}, transformers {transformers.__version__}) on {device}, {a.dtype}")
    peak = matmul_peak_flops(a.device, a.dtype)
    log(f"matmul peak measured here: {peak / 1e12:.2f} TFLOP/s ({a.dtype if a.device == 'cuda' else 'float32'})")
    log(f"Llama {a.layers} layers, hidden {a.hidden}; {a.batch_pairs} pairs/step, {a.steps} steps (first not "
        f"timed), beta {a.beta}, lr {a.lr} linear, max length {a.max_length}; repeats {a.repeats}")
    reports: dict[str, dict] = {}
    t_start = time.perf_counter()
    try:
        for name in cases:
            if name == "neox":
                tokenizer, vocab, note = str(NEOX), None, "GPT-NeoX-20B (bundled)"
            else:
                q = find_qwen(a.qwen_tokenizer)
                if q is not None:
                    tokenizer, vocab, note = str(q), QWEN_VOCAB, f"Qwen2.5 ({q})"
                else:
                    tokenizer, vocab, note = str(NEOX), QWEN_VOCAB, ("GPT-NeoX-20B, model vocabulary padded to "
                                                                     f"{QWEN_VOCAB:,} (no Qwen2.5 tokenizer found)")
            log(f"[{name}] preparing pairs with {note}")
            cwork = work / name
            cwork.mkdir()
            rows, store, info = select_pairs(cwork, tokenizer, a, log)
            vocab = max(vocab or 0, info["tokenizer_vocab"])
            params = build_model(cwork / "model", vocab, a)
            case = {"model": cwork / "model", "store": store, "rows": rows, "tokenizer": tokenizer, "vocab": vocab,
                    "params": params, "info": info, "tokenizer_note": note}
            body = params - 2 * vocab * a.hidden  # untied embedding and head
            per_token = useful_flops_per_token(store, layers=a.layers, hidden=a.hidden, vocab=vocab,
                                               body_params=body)
            best: dict[str, dict] = {}
            for rep in range(a.repeats):
                for kind in runs:
                    r = launch(kind, case, a, cwork, f"{kind}-{rep}")
                    log(f"  {kind:<10} run {rep + 1}: {r['tokens_per_s']:8,.0f} tokens/s, peak "
                        f"{r['peak_memory_mib']:,.0f} MiB, step-1 loss {r['first_loss']:.7f} ({r['wall_s']:.0f} s)")
                    r["mfu"] = r["tokens_per_s"] * per_token / peak  # at the mean rate (timed tokens / seconds)
                    r["mfu_median"] = r["tokens_per_s_median"] * per_token / peak
                    if kind not in best or r["tokens_per_s"] > best[kind]["tokens_per_s"]:
                        best[kind] = r
            reports[name] = report_case(name, case, best)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    mem_label = "peak alloc MiB" if a.device == "cuda" else "peak RSS MiB"
    for name, rep in reports.items():
        print_case(name, rep, mem_label)
    print("\nThe step-1 loss is ln 2 for both by construction (the policy starts equal to its reference, every "
          "reward is 0); the step-1 log-probs (policy, chosen and rejected, mean over the step's pairs) and the "
          "later steps' losses are what show that both compute the same thing.")

    targets = {}
    for name, rep in reports.items():
        v = rep.get("vs_trl") or rep.get("vs_trl_no_gc")
        fill = rep["runs"]["prefpack"]["filling"]
        targets[f"{name}: filling >= {TARGET_FILLING}"] = fill >= TARGET_FILLING
        if v:
            targets[f"{name}: speed >= {TARGET_SPEED}x TRL"] = all(
                rep[f"vs_{k}"]["speed"] >= TARGET_SPEED for k in ("trl", "trl_no_gc") if f"vs_{k}" in rep)
            ok_loss = not rep["tokenisation_mismatches"] and all(
                rep[f"vs_{k}"]["first_loss_abs_diff"] <= LOSS_TOL for k in ("trl", "trl_no_gc") if f"vs_{k}" in rep)
            targets[f"{name}: step-1 loss within {LOSS_TOL:g}"] = ok_loss
            if name == "qwen":
                targets[f"{name}: memory <= {TARGET_MEMORY}x TRL"] = all(
                    rep[f"vs_{k}"]["memory"] <= TARGET_MEMORY for k in ("trl", "trl_no_gc") if f"vs_{k}" in rep)
    print("\ntargets: " + "; ".join(f"{k}: {'met' if ok else 'NOT met'}" for k, ok in targets.items()))
    print(f"total {time.perf_counter() - t_start:.0f} s")
    print(json.dumps({"bench": "compare_trl", "trl_version": trl.__version__, "torch": torch.__version__,
                      "transformers": transformers.__version__, "device": device, "dtype": a.dtype,
                      "matmul_peak_tflops": peak / 1e12,
                      "config": {k: getattr(a, k) for k in ("steps", "batch_pairs", "layers", "hidden", "max_length",
                                                            "lr", "beta", "repeats", "override", "preset", "qlora")},
                      "targets": targets, "cases": reports}, default=str))


if __name__ == "__main__":
    main()
