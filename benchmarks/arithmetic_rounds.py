"""On-policy rounds on the arithmetic task (``prefpack quickstart --task arithmetic``): the held-out mean sample
reward (exact answer) per round, per seed, for the preference objective (DPO rounds: ``rounds-dpo.yaml``) or the
group policy gradient (GRPO rounds: ``rounds-grpo.yaml``, ``train.objective: policy_gradient``).

For each seed the task is built anew (its split of the 100 additions, the tokenizer, the random model and the warm
start are all seeded) and the config the quickstart wrote is run with ``--set`` overrides on top. The held-out
reward of round r is the round line's ``eval_reward/mean``: the round's starting policy (round 1: the warm start)
sampling the held-out prompts (k samples each, temperature 1, seed ``rounds.seed + r``) and scored. The rounds do not
sample the final policy, so this script does (``final`` column: the last round's model, at the seed the next round
would use), as the rounds do.

    python benchmarks/arithmetic_rounds.py [--objective preference|policy_gradient] [--seeds 0,1,2]
                                           [--output-dir runs/arithmetic-bench] [--set rounds.count=3 ...]

Prints a table and, last, one JSON line. torch runs one thread (``--threads``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def one_seed(root: Path, objective: str, seed: int, overrides: list[str]) -> dict:
    from prefpack.arithmetic import build_arithmetic, sample_accuracy
    from prefpack.config import load_config
    from prefpack.rounds import run_rounds

    t0 = time.perf_counter()
    # this script's own folder, written again on each run (only an earlier quickstart's output is ever replaced)
    built = build_arithmetic(str(root / f"seed-{seed}"), seed=seed, overwrite=True, log=lambda m: None)
    config = built["dpo_config" if objective == "preference" else "grpo_config"]
    cfg = load_config(config, [*overrides, "run.plot=false"])
    t1 = time.perf_counter()
    result = run_rounds(cfg, log=lambda m: None, progress=False)
    t2 = time.perf_counter()
    lines = [json.loads(x) for x in (Path(cfg.run.output_dir) / "metrics.jsonl").read_text().splitlines()]
    rounds = sorted((x for x in lines if x.get("split") == "round"), key=lambda x: x["round"])
    held_out = [x.get("eval_reward/mean") for x in rounds]
    final = sample_accuracy(result.final_dir, Path(built["root"]) / "data" / "held_out_prompts.jsonl",
                            Path(cfg.run.output_dir) / "final_held_out.jsonl", n=cfg.rounds.samples_per_prompt,
                            seed=cfg.rounds.seed + cfg.rounds.count)
    return {"seed": seed, "warm_start_accuracy": built["held_out_accuracy"], "held_out": held_out + [final],
            "sample_reward": [x.get("reward/mean") for x in rounds], "pairs": [x.get("pairs") for x in rounds],
            "tied_prompts": [x.get("tied_prompts") for x in rounds],
            "seconds": {"build": round(t1 - t0, 1), "rounds": round(t2 - t1, 1)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objective", choices=("preference", "policy_gradient"), default="preference")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--output-dir", default="runs/arithmetic-bench")
    ap.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides on top of the quickstart's config (e.g. optim.lr=1e-3)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    root = Path(args.output_dir) / args.objective
    results = [one_seed(root, args.objective, int(s), args.overrides) for s in args.seeds.split(",")]

    count = len(results[0]["held_out"]) - 1
    heads = ["warm start (round 1)"] + [f"after round {r}" for r in range(1, count + 1)]
    print(f"held-out mean sample reward, {args.objective}" + (f" ({' '.join(args.overrides)})" if args.overrides else ""))
    print(f"{'seed':>4}  " + "  ".join(f"{h:>20}" for h in heads) + "  train-prompt sample reward per round")
    for r in results:
        print(f"{r['seed']:>4}  " + "  ".join(f"{v:>20.3f}" for v in r["held_out"])
              + "  " + " -> ".join(f"{v:.3f}" for v in r["sample_reward"]))
    mean = [sum(r["held_out"][i] for r in results) / len(results) for i in range(count + 1)]
    print(f"{'mean':>4}  " + "  ".join(f"{v:>20.3f}" for v in mean))
    print(json.dumps({"objective": args.objective, "overrides": args.overrides, "results": results,
                      "mean_held_out": mean}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
