"""Distributed training on CPU: tokens/s with 1 and 2 processes, and how evenly ranks are loaded.

Rank imbalance is max / mean computed positions per rank per step (1.0 = perfectly even; a step lasts as
long as its slowest rank), for token-balanced dealing against plain pair-count dealing, on the bundled
real hh-rlhf sample. Throughput runs `prefpack train` with one process and under `torchrun` with two
(gloo), same model, pairs and global batch.

    python benchmarks/bench_distributed.py [--steps 6] [--global-batch 32] [--skip-throughput]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "examples" / "data" / "hh-rlhf-harmless-base" / "train_2k.jsonl.gz"
TOKENIZER = REPO / "examples" / "tokenizers" / "gpt-neox-20b"


def imbalance(store_dir: Path, *, global_batch: int, micro_tokens: int, row_tokens: int, steps: int) -> dict:
    from prefpack.batching.deal import deal_step, rank_tokens
    from prefpack.config import load_config
    from prefpack.data.store import Store
    from prefpack.objectives import PairTask, config_terms, settings_from_config

    # prompts shared as a CPU run shares them (data.prefix_sharing: auto on packed_sdpa)
    cfg = load_config(None, [f"train.micro_batch_tokens={micro_tokens}", f"data.max_tokens_per_row={row_tokens}",
                             "train.chunk_size=1024", "data.prefix_sharing=true"])
    task = PairTask(Store(store_dir), settings_from_config(cfg, pad_id=1), config_terms(cfg))
    out = {}
    for balance in ("count", "tokens"):
        ratios = []
        for step in range(steps):
            ids = np.random.default_rng([0, step]).permutation(len(task))[:global_batch]
            toks = rank_tokens(deal_step(task, ids, seed=[0, step], world=2, balance=balance))
            ratios.append(max(toks) / (sum(toks) / len(toks)))
        out[balance] = {"mean": float(np.mean(ratios)), "worst": float(np.max(ratios))}
    return out


def throughput(tmp: Path, store_dir: Path, args) -> dict:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                                 num_attention_heads=2, tie_word_embeddings=False)).save_pretrained(tmp / "model")
    overrides = [f"model.name_or_path={tmp / 'model'}", f"data.train={store_dir}", "optim.lr=1.0e-4",
                 f"train.global_batch_pairs={args.global_batch}", f"train.max_steps={args.steps}",
                 f"train.micro_batch_tokens={args.micro_batch_tokens}", f"data.max_tokens_per_row={args.row_tokens}",
                 "run.plot=false", "run.tensorboard=false"]
    results = {}
    for nproc in (1, 2):
        run_dir = tmp / f"run-{nproc}"
        base = ["-m", "prefpack", "train", *overrides, f"run.output_dir={run_dir}", "--no-progress"]
        if nproc == 1:
            cmd = [sys.executable, *base]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *base[1:]]
        subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
                       if nproc > 1 else dict(os.environ))
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        train = [m for m in lines if m["split"] == "train"][1:]  # the first step warms up
        results[nproc] = {"tokens_per_s": float(np.mean([m["tokens/s"] for m in train])),
                          "final_loss": train[-1]["loss"]}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batch-tokens", type=int, default=2048)
    ap.add_argument("--row-tokens", type=int, default=1024)
    ap.add_argument("--imbalance-steps", type=int, default=50)
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args()
    from prefpack.data.prepare import PrepareOptions, prepare

    tmp = Path(tempfile.mkdtemp())
    store_dir = tmp / "store"
    prepare(PrepareOptions(inputs=[str(DATA)], tokenizer=str(TOKENIZER), output=str(store_dir), max_length=512,
                           skip_invalid=True), log=lambda m: None)
    imb = imbalance(store_dir, global_batch=args.global_batch, micro_tokens=args.micro_batch_tokens,
                    row_tokens=args.row_tokens, steps=args.imbalance_steps)
    print(f"rank imbalance, 2 ranks, {args.imbalance_steps} steps of {args.global_batch} hh-rlhf pairs "
          f"(max/mean computed positions per rank; 1.00 = even)")
    print(f"{'dealing':<28}{'mean':>8}{'worst':>8}")
    print(f"{'pair count (per-rank pack)':<28}{imb['count']['mean']:>8.3f}{imb['count']['worst']:>8.3f}")
    print(f"{'token balanced (prefpack)':<28}{imb['tokens']['mean']:>8.3f}{imb['tokens']['worst']:>8.3f}")
    out = {"bench": "distributed", "imbalance": imb}
    if not args.skip_throughput:
        thr = throughput(tmp, store_dir, args)
        print(f"\nthroughput on {os.cpu_count()} CPU cores (Llama 2 layers, hidden 128, GPT-NeoX vocabulary)")
        print(f"{'processes':<12}{'tokens/s':>10}{'final loss':>12}")
        for n, r in thr.items():
            print(f"{n:<12}{r['tokens_per_s']:>10,.0f}{r['final_loss']:>12.6f}")
        out["throughput"] = thr
    print(json.dumps(out))


if __name__ == "__main__":
    main()
