"""One on-policy round on CPU with the in-process (transformers) engine, on the quickstart task: time and tokens/s per
phase (generate, score, train), and the training phase on the round's pairs with prompts laid out once (the round's
own layout: a prompt's pairs as one prompt group, each distinct completion computed once) against each pair laid out
alone (``data.group_by_prompt=false data.prefix_sharing=false``: the prompt twice per pair, a completion once per
pair it is in, as a trainer without prompt sharing lays them out).

The task is the README's: the quickstart's untrained model (Llama, 2 layers, hidden 96), its review prompts, the
difflib reward of the answer against the true label. Every sample gets ``--max-new-tokens`` tokens (the untrained
model seldom ends early); pairs are ``--pairs`` (all_pairs: every pair of a prompt's samples whose scores differ, so
the pairs per prompt grow with k, which is what prompt sharing saves on). Each comparison trains one epoch over the
same store in this process, alternating the two layouts ``--repeats`` times and keeping each one's best time.

Like with like: both layouts train the whole store once in the same number of steps (``--epoch-steps``), so the same
pairs per step on average. Prompts once counts prompt groups per step (``PairGroups``: a round's prompt with its k
samples is one group while it fits 2,048 positions, as here), so its batch is ``ceil(groups / steps)`` groups and each
pair alone's ``ceil(pairs / steps)`` pairs. torch runs ``--threads`` threads (default 1): on a machine shared with other jobs, two threads that wait for
each other at every parallel region made the same epoch 5 to 25 times slower from one run to the next.

    python benchmarks/rounds.py [--prompts 64] [--ks 4,8] [--max-new-tokens 16] [--pairs all_pairs] [--repeats 2]
                                [--epoch-steps 8] [--threads 1]

Prints a table per part and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

REWARD = '''import difflib


def reward(prompt, completion, row):
    return difflib.SequenceMatcher(None, completion.strip().lower(), row["label"]).ratio()
'''


def build_task(root: Path, prompts: int) -> None:
    """The quickstart's tokenizer and untrained model, ``prompts`` review prompts with their labels, the reward."""
    import torch

    from prefpack.quickstart import _build_model, make_pairs
    from prefpack.toy_tokenizer import build_toy_tokenizer

    rows = make_pairs(2000, 0)
    tok = build_toy_tokenizer([r["prompt"] + r["chosen"] for r in rows] + [" positive", " negative"],
                              style="llama", vocab_size=400)
    torch.manual_seed(0)
    _build_model(tok, root / "init", 0)
    with open(root / "prompts.jsonl", "w", encoding="utf-8") as fh:
        for r in make_pairs(prompts, 1):
            fh.write(json.dumps({"prompt": r["prompt"], "label": r["chosen"].strip()}) + "\n")
    (root / "reward.py").write_text(REWARD)


def one_round(root: Path, k: int, args) -> dict:
    """``prefpack train`` with one round (k samples per prompt); the seconds and tokens of each phase."""
    from prefpack.config import load_config
    from prefpack.metrics import read_metrics
    from prefpack.rounds import run_rounds

    run = root / f"round-k{k}"
    cfg = load_config(None, [
        f"model.name_or_path={root / 'init'}", "train.global_batch_pairs=8", "optim.lr=1e-3", "loss.beta=0.1",
        f"run.output_dir={run}", "run.report_to=none", "run.plot=false", "run.log_every=1", "rounds.count=1",
        f"rounds.prompts={root / 'prompts.jsonl'}", f"rounds.samples_per_prompt={k}",
        f"rounds.max_new_tokens={args.max_new_tokens}", "rounds.batch_size=16", f"rounds.pairs={args.pairs}",
        f"rounds.reward_fn={root / 'reward.py'}:reward", f"rounds.steps_per_round={args.round_steps}"])
    result = run_rounds(cfg, log=lambda *_: None, progress=False)
    folder = run / "rounds" / "001"
    phases = json.loads((folder / "phases.json").read_text())
    line = result.rounds[0]
    train_lines = [x for x in read_metrics(run / "metrics.jsonl") if x.get("split") == "train"]  # the one round's
    sample_tokens = 0
    with open(folder / "samples.jsonl", encoding="utf-8") as fh:
        for row in map(json.loads, fh):
            sample_tokens += sum(len(row["prompt_ids"]) + len(c) for c in row["completion_ids"])
    return {"k": k, "store": str(folder / "store"), "pairs": line["pairs"], "tied_prompts": line["tied_prompts"],
            "reward_mean": line["reward/mean"],
            "generate_s": phases["generate"]["seconds"], "generate_tokens": phases["generate"]["tokens"],
            "score_s": phases["score"]["seconds"], "score_samples": line["samples"], "score_tokens": sample_tokens,
            "train_s": phases["train"]["seconds"], "train_steps": len(train_lines),
            "train_tokens": sum(x["tokens"] for x in train_lines)}


LAYOUTS = {  # name -> overrides
    "prompts once": ["data.group_by_prompt=true"],
    "each pair alone": ["data.group_by_prompt=false", "data.prefix_sharing=false"],
}


def train_epoch(root: Path, store: str, layout: str, batch: int, tag: str) -> dict:
    """One epoch over ``store`` in ``layout``: seconds of the step loop, real tokens, computed positions, pairs."""
    from prefpack.config import load_config
    from prefpack.metrics import read_metrics
    from prefpack.training import train

    out = root / f"train-{tag}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = load_config(None, [
        f"model.name_or_path={root / 'init'}", f"data.train={store}", f"train.global_batch_pairs={batch}",
        "train.epochs=1", "optim.lr=1e-3", "loss.beta=0.1", f"run.output_dir={out}", "run.report_to=none",
        "run.plot=false", "run.log_every=1", "run.save_every=0", *LAYOUTS[layout]])
    result = train(cfg, log=lambda *_: None, progress=False)
    lines = [x for x in read_metrics(out / "metrics.jsonl") if x.get("split") == "train"]
    steady = lines[1:] or lines  # the first step warms up
    seconds = sum(x["tokens"] / x["tokens/s"] for x in steady)
    return {"layout": layout, "steps": len(lines), "loop_s": result.seconds,
            "tokens": sum(x["tokens"] for x in lines), "positions": sum(x["positions"] for x in lines),
            "pairs_per_s": sum(x["pairs/s"] * x["tokens"] / x["tokens/s"] for x in steady) / seconds,
            "tokens_per_s": sum(x["tokens"] for x in steady) / seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--ks", default="4,8", help="samples per prompt, one round each")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--pairs", default="all_pairs", choices=("best_vs_worst", "best_vs_rest", "all_pairs"))
    ap.add_argument("--round-steps", type=int, default=8, help="the round's own training steps (8 pairs each)")
    ap.add_argument("--epoch-steps", type=int, default=8,
                    help="comparison: steps of the one epoch, in both layouts (so the same pairs per step on average)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steady times on a shared machine)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()

    import torch

    from prefpack.data.store import Store
    from prefpack.data.views import PairGroups

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    root = Path(tempfile.mkdtemp(prefix="prefpack-rounds-bench-"))
    report = {"date": time.strftime("%Y-%m-%d"), "torch_threads": torch.get_num_threads(), "args": vars(args),
              "load_before": os.getloadavg(), "rounds": [], "layouts": []}
    try:
        build_task(root, args.prompts)
        for k in (int(x) for x in args.ks.split(",")):
            report["rounds"].append(one_round(root, k, args))
        print(f"{'k':>3} {'pairs':>6} {'generate s':>10} {'gen tok/s':>10} {'score s':>8} {'samples/s':>10} "
              f"{'train s':>8} {'steps':>6} {'train tok/s':>11}")
        for r in report["rounds"]:
            print(f"{r['k']:>3} {r['pairs']:>6} {r['generate_s']:>10.2f} {r['generate_tokens'] / r['generate_s']:>10.0f}"
                  f" {r['score_s']:>8.2f} {r['score_samples'] / r['score_s']:>10.0f} {r['train_s']:>8.2f}"
                  f" {r['train_steps']:>6} {r['train_tokens'] / r['train_s']:>11.0f}")
        print("(train s: the whole phase, loading the policy and its reference and saving the final model included)")
        for r in report["rounds"]:
            store = Store(r["store"])
            groups = len(PairGroups(store))
            batches = {"prompts once": math.ceil(groups / args.epoch_steps),
                       "each pair alone": math.ceil(len(store) / args.epoch_steps)}
            best: dict[str, dict] = {}
            for rep in range(args.repeats):
                for layout in LAYOUTS:
                    got = train_epoch(root, r["store"], layout, batches[layout], f"k{r['k']}-{rep}")
                    if layout not in best or got["loop_s"] < best[layout]["loop_s"]:
                        best[layout] = got
            for layout, got in best.items():
                report["layouts"].append({"k": r["k"], "pairs": len(store), "groups": groups,
                                          "batch": batches[layout], **got})
        report["load_after"] = os.getloadavg()
        print(f"\n{'k':>3} {'pairs':>6} {'groups':>6} {'layout':<16} {'batch':>5} {'steps':>5} {'pairs/step':>10} "
              f"{'epoch s':>8} {'tokens':>8} {'positions':>10} {'pairs/s':>8} {'tokens/s':>9}")
        for x in report["layouts"]:
            print(f"{x['k']:>3} {x['pairs']:>6} {x['groups']:>6} {x['layout']:<16} {x['batch']:>5} {x['steps']:>5} "
                  f"{x['pairs'] / x['steps']:>10.1f} {x['loop_s']:>8.2f} {x['tokens']:>8.0f} {x['positions']:>10.0f} "
                  f"{x['pairs_per_s']:>8.1f} {x['tokens_per_s']:>9.0f}")
        print(f"load average (1, 5, 15 min): before {report['load_before']}, after {report['load_after']}")
        for r in report["rounds"]:
            r.pop("store")
        print(json.dumps(report))
    finally:
        if args.keep:
            print(f"work folder: {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
