"""The JSON summary of one benchmarks/gpu/plan43.sh run: each step's exit status and time, the CUDA tests' tally and
the headline numbers of each benchmark, read from the logs in OUT (the benchmarks' own last JSON line).

    python benchmarks/gpu/plan43_summary.py OUT > OUT/summary.json
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

RUN_KEYS = ("tokens_per_s", "tokens_per_s_median", "peak_memory_mib", "mfu", "mfu_median", "timed_steps", "filling",
            "first_loss")


def last_json(log: Path, key: str) -> dict | None:
    """The last line of ``log`` that is a JSON object holding ``key``."""
    if not log.is_file():
        return None
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("{") and f'"{key}"' in line:
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def compare(log: Path) -> dict | None:
    rec = last_json(log, "bench")
    if rec is None:
        return None
    out = {k: rec.get(k) for k in ("device", "dtype", "matmul_peak_tflops", "torch", "transformers", "trl_version")}
    out["config"] = {k: rec["config"].get(k) for k in ("preset", "steps", "batch_pairs", "qlora")}
    for name, case in rec["cases"].items():
        out[name] = {"params": case["params"], "tokenisation_mismatches": len(case["tokenisation_mismatches"]),
                     "runs": {k: {x: r.get(x) for x in RUN_KEYS} for k, r in case["runs"].items()},
                     "vs_trl": case.get("vs_trl")}
    return out


def tests(log: Path) -> dict | None:
    if not log.is_file():
        return None
    text = log.read_text(errors="replace")
    tally = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|error)[^=\n]*?)\s*=*$", text, re.M)
    return {"tally": tally[-1] if tally else None,
            "failed": re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M),
            "skipped": re.findall(r"^SKIPPED \[\d+\] (.*)$", text, re.M)[:10]}


def grpo(log: Path) -> dict | None:
    """grpo_step.py's headline: per k and side tokens/s, step seconds, peak memory, first loss; the ratios."""
    rec = last_json(log, "bench")
    if rec is None:
        return None
    keys = ("tokens_per_s", "median_s", "min_s", "max_s", "positions", "peak_mib", "peak_delta_mib", "first_loss")
    return {**{k: rec.get(k) for k in ("device", "dtype", "gpu", "params", "micro_batch", "trl_version")},
            "cases": {k: {"real_tokens": c["real_tokens"], "loss_agrees": c.get("loss_agrees"), "ratios": c["ratios"],
                          "sides": {s: {x: r.get(x) for x in keys} for s, r in c["sides"].items()}}
                      for k, c in rec["cases"].items()}}


def main() -> None:
    out = Path(sys.argv[1])
    steps = {}
    for row in (out / "steps.tsv").read_text().splitlines():
        name, rc, secs, limit = row.split("\t")
        steps[name] = {"rc": rc, "seconds": int(secs), "limit_or_note": limit,
                       "timed_out": rc in ("124", "137")}
    env = (out / "env.txt").read_text().splitlines() if (out / "env.txt").is_file() else []
    summary = {"env": env, "carry": (out / "carry.txt").read_text().split("\n") if (out / "carry.txt").is_file()
               else [], "steps": steps, "tests": tests(out / "tests.log"),
               "compare_0.7b": compare(out / "compare.log"), "qlora": compare(out / "qlora.log"),
               "compare_1.3b": compare(out / "compare13.log"), "reward": last_json(out / "reward.log", "cases"),
               "vision": last_json(out / "vision.log", "bench"), "grpo": grpo(out / "grpo.log")}
    print(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
