"""Where a prefpack training step spends its GPU time: torch.profiler around ``train()`` on compare_trl's model.

Builds the same random Llama and the same hh pairs as ``benchmarks/compare_trl.py`` (its helpers), trains
``--steps`` steps through the public path and prints the per-step tokens/s and peak memory, then the kernels
sorted by CUDA time over the steady steps (the first ``--warmup`` steps are not recorded).

    python benchmarks/gpu/profile_train.py --preset 0.7b --qwen-tokenizer .gpu/qwen2.5 [--override KEY=VALUE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import compare_trl as ct  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=tuple(ct.PRESETS), default="0.7b")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch-pairs", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--qwen-tokenizer", default=None)
    ap.add_argument("--override", action="append", default=[])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=40, help="kernel rows to print")
    a = ap.parse_args()
    a.layers, a.hidden = ct.PRESETS[a.preset]
    a.seed = 0

    import torch

    from prefpack.config import load_config
    from prefpack.training import train

    work = Path(tempfile.mkdtemp(prefix="profile_train-"))
    q = ct.find_qwen(a.qwen_tokenizer)
    tokenizer, vocab = (str(q), ct.QWEN_VOCAB) if q else (str(ct.NEOX), ct.QWEN_VOCAB)
    _, store, info = ct.select_pairs(work, tokenizer, a, print)
    ct.build_model(work / "model", max(vocab, info["tokenizer_vocab"]), a)
    overrides = [f"model.name_or_path={work / 'model'}", f"data.train={store}", "data.shuffle=false",
                 f"train.global_batch_pairs={a.batch_pairs}", f"train.max_steps={a.steps}", f"train.device={a.device}",
                 f"model.dtype={a.dtype}", "optim.lr=1e-6", "optim.schedule=linear", "optim.warmup_steps=0",
                 "optim.weight_decay=0.0", "reference.mode=copy", f"run.output_dir={work / 'run'}",
                 "run.plot=false", "run.tensorboard=false", *a.override]
    cfg = load_config(None, overrides)

    steps_seen = {"n": 0}
    cuda = a.device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                              torch.profiler.ProfilerActivity.CUDA])
    import prefpack.metrics as metrics_mod

    orig_log = metrics_mod.MetricsLogger.log

    def log_step(self, step, metrics, split="train"):  # record the steps after the warm-up
        out = orig_log(self, step, metrics, split)
        if split == "train":
            steps_seen["n"] += 1
            if steps_seen["n"] in (a.warmup, a.steps):
                sync()
                prof.start() if steps_seen["n"] == a.warmup else prof.stop()
        return out

    metrics_mod.MetricsLogger.log = log_step
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    train(cfg, progress=False, log=print)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    recs = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        if r.get("split") == "train":
            print(f"step {r['step']}: loss {r['loss']:.6f} tokens/s {r['tokens/s']:,.0f} filling {r['filling']:.3f}")
    print(f"peak allocated {peak:.2f} GiB; {info['tokens_used']:,} tokens in {info['pairs_used']} pairs")
    table = prof.key_averages()
    if cuda:
        print(table.table(sort_by="self_cuda_time_total", row_limit=a.rows, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=a.rows, max_name_column_width=60))
    print(table.table(sort_by="cpu_time_total", row_limit=a.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
