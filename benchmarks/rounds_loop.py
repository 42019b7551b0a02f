"""Several on-policy rounds on CPU, in one training process against each round run as a separate training, on the
quickstart task of ``benchmarks/rounds.py``: seconds per round by phase (generate, score, train), whole-run seconds,
and how often a model was read from disk (``from_pretrained`` calls: the policy, its copied reference, and, when
each round is a separate training, each round's policy, reference and sampler again).

Both sides run ``rounds.optimizer=reset`` (the same arithmetic: their files are equal byte for byte,
``tests/test_rounds_live.py``), one after the other in this process, ``--threads`` torch threads.

    python benchmarks/rounds_loop.py [--rounds 3] [--prompts 32] [--k 4] [--max-new-tokens 8] [--steps 4]
                                     [--threads 1]

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SIDES = {"one process": ["rounds.in_process=true"], "a training per round": ["rounds.in_process=false"]}


def run_side(root: Path, name: str, args) -> dict:
    from transformers import PreTrainedModel

    from prefpack.config import load_config
    from prefpack.rounds import run_rounds

    run = root / name.replace(" ", "-")
    cfg = load_config(None, [
        f"model.name_or_path={root / 'init'}", "train.global_batch_pairs=8", "optim.lr=1e-3", "loss.beta=0.1",
        f"run.output_dir={run}", "run.report_to=none", "run.plot=false", "run.save_every=0",
        f"rounds.count={args.rounds}", f"rounds.prompts={root / 'prompts.jsonl'}", f"rounds.samples_per_prompt={args.k}",
        f"rounds.max_new_tokens={args.max_new_tokens}", "rounds.batch_size=16", "rounds.optimizer=reset",
        f"rounds.reward_fn={root / 'reward.py'}:reward", f"rounds.steps_per_round={args.steps}", *SIDES[name]])
    loads = []
    original = PreTrainedModel.from_pretrained.__func__

    def counted(cls, path, *a, **kw):
        loads.append(str(path))
        return original(cls, path, *a, **kw)

    PreTrainedModel.from_pretrained = classmethod(counted)
    t0 = time.perf_counter()
    try:
        result = run_rounds(cfg, log=lambda *_: None, progress=False)
    finally:
        PreTrainedModel.from_pretrained = classmethod(original)
    seconds = time.perf_counter() - t0
    rounds = [{"round": m["round"] + 1, **{p: m.get(f"seconds/{p}") for p in ("generate", "score", "train")}}
              for m in result.rounds]
    return {"side": name, "seconds": seconds, "model_loads": len(loads), "rounds": rounds,
            "reward_mean": [m["reward/mean"] for m in result.rounds]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    from benchmarks.rounds import build_task

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_task(root, args.prompts)
        sides = [run_side(root, name, args) for name in SIDES]
    print(f"{'side':<22} {'round':>5} {'generate s':>11} {'score s':>8} {'train s':>8}")
    for side in sides:
        for r in side["rounds"]:
            print(f"{side['side']:<22} {r['round']:>5} {r['generate'] or 0:>11.2f} {r['score'] or 0:>8.2f} "
                  f"{r['train'] or 0:>8.2f}")
    print()
    print(f"{'side':<22} {'whole run s':>12} {'model loads':>12}")
    for side in sides:
        print(f"{side['side']:<22} {side['seconds']:>12.2f} {side['model_loads']:>12}")
    same = sides[0]["reward_mean"] == sides[1]["reward_mean"]
    print(f"\nthe same sample rewards every round: {same}")
    print(json.dumps({"args": vars(args), "sides": sides, "same_rewards": same}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
