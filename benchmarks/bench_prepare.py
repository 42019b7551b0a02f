"""tokens/s of `prefpack prepare` against tokenising the same rows one example at a time with datasets.map.

The baseline is what most preference trainers do: load the JSONL with `datasets`, then `map` a function that
tokenises prompt, chosen and rejected of one row per call (TRL's tokenize_row pattern). Both run end to end
from the same file with the same tokenizer; the sample is repeated to amortise start-up costs, and each method
runs several times, alternating, keeping its fastest run (the machine may be shared).

    python benchmarks/bench_prepare.py [--repeat 5] [--workers 0] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "examples" / "data" / "hh-rlhf-harmless-base" / "train_2k.jsonl.gz"
TOKENIZER = REPO / "examples" / "tokenizers" / "gpt-neox-20b"


def baseline(path: Path, tokenizer: str) -> tuple[float, int]:
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(tokenizer)
    ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=tempfile.mkdtemp())

    def tokenize_row(row):
        p = tok(row["prompt"], add_special_tokens=False)["input_ids"]
        c = tok(row["chosen"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        r = tok(row["rejected"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return {"prompt_ids": p, "chosen_ids": c, "rejected_ids": r}

    out = ds.map(tokenize_row, remove_columns=ds.column_names)
    n = sum(len(p) + len(c) + len(r) for p, c, r in zip(out["prompt_ids"], out["chosen_ids"], out["rejected_ids"]))
    return time.perf_counter() - t0, n


def ours(path: Path, tokenizer: str, workers: int, out: Path) -> tuple[float, int]:
    from prefpack.data.prepare import PrepareOptions, prepare

    t0 = time.perf_counter()
    report = prepare(PrepareOptions(inputs=[str(path)], tokenizer=tokenizer, output=str(out), workers=workers,
                                    skip_invalid=True, overwrite=True), log=lambda m: None)
    return time.perf_counter() - t0, report.tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="repeat the 2,000-row sample this many times")
    ap.add_argument("--workers", type=int, default=0, help="prepare workers (0 = all cores)")
    ap.add_argument("--tokenizer", default=str(TOKENIZER))
    ap.add_argument("--trials", type=int, default=3, help="run each method this many times; report the fastest")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    rows = [json.loads(x) for x in gzip.open(DATA, "rt", encoding="utf-8")]
    # rows with an empty reply are skipped by prepare; drop them from both sides so both tokenise the same rows
    rows = [r for r in rows if r["chosen"].strip() and r["rejected"].strip() and r["chosen"] != r["rejected"]]
    src = tmp / "rows.jsonl"
    with open(src, "w", encoding="utf-8") as fh:
        for _ in range(args.repeat):
            for r in rows:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    # alternate the two methods so that a noisy neighbour slows both alike; keep each one's fastest run
    runs_base, runs_ours = [], []
    for _ in range(args.trials):
        runs_base.append(baseline(src, args.tokenizer))
        runs_ours.append(ours(src, args.tokenizer, args.workers, tmp / "store"))
    t_base, n_base = min(runs_base)
    t_ours, n_ours = min(runs_ours)
    if n_base != n_ours:
        print(f"warning: token counts differ (baseline {n_base}, prefpack {n_ours})", file=sys.stderr)
    base_tps, ours_tps = n_base / t_base, n_ours / t_ours
    print(f"rows: {len(rows) * args.repeat}, cores: {os.cpu_count()}, tokenizer: {Path(args.tokenizer).name}, "
          f"fastest of {args.trials} runs each")
    print(f"{'method':<34}{'seconds':>9}{'tokens':>11}{'tokens/s':>12}")
    print(f"{'datasets.map, one row per call':<34}{t_base:>9.2f}{n_base:>11}{base_tps:>12,.0f}")
    print(f"{'prefpack prepare':<34}{t_ours:>9.2f}{n_ours:>11}{ours_tps:>12,.0f}")
    print(f"ratio: {ours_tps / base_tps:.2f}x (target >= 3x)")
    print(json.dumps({"bench": "prepare", "rows": len(rows) * args.repeat, "baseline_tokens_per_s": round(base_tps),
                      "prefpack_tokens_per_s": round(ours_tps), "ratio": round(ours_tps / base_tps, 2),
                      "tokens_equal": n_base == n_ours}))


if __name__ == "__main__":
    main()
