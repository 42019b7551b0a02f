"""Several completions per prompt: a ranked store against the same pairs written out as a pair store, read pair by
pair and grouped by prompt (``data.group_by_prompt``).

Builds UltraFeedback-shaped data from the bundled hh sample: prompt i gets four completions (its own chosen and
rejected, and row i+1's chosen and rejected as two more replies of realistic length; scores 4, 1, 3, 2, so no
ties). The pairs `data.ranked_pairs` draws from them (`all_pairs`: 6 per prompt; `best_vs_rest`: 3) are also
written as a pair store, so both runs train the same pairs, in the same steps, with the same losses. Each run is
its own process (its peak RSS is its own); prefpack's default CPU path, DPO sigmoid against a frozen copy.

    python benchmarks/bench_ranked.py [--prompts 48] [--per-step 4] [--steps 4] [--mode all_pairs]

Prints a table and, last, one JSON line: pairs/s (mean of steps 2..n), positions computed per step, the losses.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HH = REPO / "examples" / "data" / "hh-rlhf-harmless-base" / "train_2k.jsonl.gz"
NEOX = REPO / "examples" / "tokenizers" / "gpt-neox-20b"
SCORES = (4.0, 1.0, 3.0, 2.0)


def ranked_rows(n: int) -> list[dict]:
    with gzip.open(HH, "rt", encoding="utf-8") as fh:
        rows = [json.loads(x) for x in fh]
    rows = [r for r in rows if r["chosen"].strip() and r["rejected"].strip() and r["chosen"] != r["rejected"]]
    out = []
    for i in range(n):
        a, b = rows[i], rows[i + 1]
        texts = [a["chosen"], a["rejected"], b["chosen"], b["rejected"]]
        if len(set(texts)) < 4:
            continue
        out.append({"prompt": a["prompt"], "completions": [{"text": t, "score": s} for t, s in zip(texts, SCORES)]})
    return out


def pair_rows(rows: list[dict], mode: str) -> list[dict]:
    import numpy as np

    from prefpack.data.views import group_pairs

    out = []
    for r in rows:
        texts = [c["text"] for c in r["completions"]]
        scores = np.array([c["score"] for c in r["completions"]])
        out += [{"prompt": r["prompt"], "chosen": texts[c], "rejected": texts[j]} for c, j in group_pairs(scores, mode)]
    return out


def worker(a) -> None:
    import torch

    from prefpack.config import load_config
    from prefpack.training import train

    torch.set_num_threads(a.threads)
    cfg = load_config(None, [f"model.name_or_path={a.model}", f"data.train={a.store}", "data.shuffle=false",
                             f"data.ranked_pairs={a.mode}", f"data.prefix_sharing={a.sharing}",
                             f"data.group_by_prompt={a.group}",
                             f"train.global_batch_pairs={a.batch}", f"train.max_steps={a.steps}", "train.device=cpu",
                             "optim.lr=1e-6", "optim.warmup_steps=0", "reference.mode=copy",
                             f"run.output_dir={a.out}", "run.plot=false", "run.tensorboard=false"])
    t0 = time.perf_counter()
    train(cfg, progress=False, log=lambda m: None)
    recs = [json.loads(x) for x in (Path(a.out) / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["split"] == "train"]
    timed = recs[1:] or recs  # the first step warms up (allocations, lazy initialisation)
    secs = sum(a.pairs_per_step / r["pairs/s"] for r in timed)
    pairs = a.pairs_per_step * len(timed)
    print(json.dumps({"pairs_per_s": pairs / secs, "positions_per_step": sum(r["positions"] for r in recs) / len(recs),
                      "tokens_per_step": sum(r["tokens"] for r in recs) / len(recs),
                      "losses": [r["loss"] for r in recs], "wall_s": time.perf_counter() - t0,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--per-step", type=int, default=4, help="prompts per optimizer step")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--mode", choices=("all_pairs", "best_vs_rest"), default="all_pairs")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    for hidden in ("--worker", "--model", "--store", "--out", "--batch", "--sharing", "--group", "--pairs-per-step"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        a.steps, a.batch, a.threads, a.pairs_per_step = int(a.steps), int(a.batch), int(a.threads), int(a.pairs_per_step)
        return worker(a)

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import write_jsonl

    from prefpack.data.prepare import PrepareOptions, prepare

    work = Path(tempfile.mkdtemp(prefix="bench_ranked_"))
    rows = ranked_rows(a.prompts)
    pairs = pair_rows(rows, a.mode)
    per_prompt = len(pairs) / len(rows)
    for name, data in (("ranked", rows), ("pairs", pairs)):
        prepare(PrepareOptions(inputs=[str(write_jsonl(work / f"{name}.jsonl", data))], tokenizer=str(NEOX),
                               output=str(work / name), max_length=512, truncation="drop"), log=lambda m: None)
    tok = AutoTokenizer.from_pretrained(NEOX)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                      num_hidden_layers=a.layers, num_attention_heads=max(a.hidden // 64, 1),
                      num_key_value_heads=max(a.hidden // 64, 1), max_position_embeddings=1024,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(work / "model")
    runs = {  # name: (store, global batch, sharing, group_by_prompt)
        "pair store, prompt once per pair": ("pairs", round(a.per_step * per_prompt), "true", "false"),
        "pair store, grouped by prompt": ("pairs", a.per_step, "true", "true"),
        "ranked, prompt per completion": ("ranked", a.per_step, "false", "false"),
        "ranked, prompt once per group": ("ranked", a.per_step, "true", "false"),
    }
    results = {}
    for name, (store, batch, sharing, group) in runs.items():
        cmd = [sys.executable, __file__, "--worker", "1", "--model", str(work / "model"), "--store", str(work / store),
               "--out", str(work / f"run-{len(results)}"), "--batch", str(batch), "--sharing", sharing, "--group", group,
               "--steps", str(a.steps), "--threads", str(a.threads), "--mode", a.mode,
               "--pairs-per-step", str(round(a.per_step * per_prompt))]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        results[name] = json.loads(out)
    print(f"{len(rows)} prompts x 4 completions, {a.mode}: {per_prompt:g} pairs per prompt; {a.per_step} prompts "
          f"({round(a.per_step * per_prompt)} pairs) per step, {a.steps} steps, {a.layers}L/{a.hidden}h, "
          f"{a.threads} threads")
    print(f"{'run':<36}{'pairs/s':>9}{'positions/step':>16}{'peak RSS MiB':>14}  losses (first, last)")
    for name, r in results.items():
        print(f"{name:<36}{r['pairs_per_s']:>9.2f}{r['positions_per_step']:>16,.0f}{r['peak_rss_mib']:>14,.0f}  "
              f"{r['losses'][0]:.7f}, {r['losses'][-1]:.7f}")
    print(json.dumps({"mode": a.mode, "prompts": len(rows), "per_step": a.per_step, "results": results}))


if __name__ == "__main__":
    main()
