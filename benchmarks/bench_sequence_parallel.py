"""Sequence parallelism on CPU (gloo): peak memory per rank, tokens/s and the all-to-all share, N=1 against N=2.

One generated pair per step (a long prompt, two long completions), a small Llama built from a config, for several
pair lengths; each length trains ``--steps`` steps with one process (``distributed.sequence_parallel=1``) and with
two ranks of one sequence group (``distributed.sequence_parallel=2``, each rank holding half of every row). Every
rank reports its own peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``), its RSS before the run (Python, torch
and prefpack imported) and the difference (the run: model, optimizer, activations), and the wall time spent in the
all-to-all calls (a timer around ``prefpack.sequence_parallel._exchange``; gloo is synchronous, so it includes the
wait for the other rank), its share of the steps' time, and the loop phase during which each rank's RSS peaked (a
thread sampling ``/proc/self/statm``). tokens/s is the mean of the steps after the first (``metrics.jsonl``: tokens
of both sides, the prompt counted per side). Each length runs with the prompt laid out once per pair (prompt groups,
the CPU default) and once per side. The table ends with the longest pair whose runs stay within ``--budget-mib`` of
peak RSS per rank.

    python benchmarks/bench_sequence_parallel.py [--lengths 8192,16384] [--prompt once,per-side] [--steps 2]
        [--hidden 128] [--layers 2] [--heads 4] [--budget-mib 1024]

CPU only: multi-GPU NCCL is not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "pe", "ro", "su", "ta", "vi", "zo")
         for b in ("ba", "de", "fi", "go", "hu", "ja", "ke", "li", "mo", "ne", "po", "ri", "se", "tu", "wa")]


# ------------------------------------------------------------------------------------------- on each rank


def worker(report: Path, argv: list[str]) -> None:
    """One rank: ``prefpack`` with ``argv``, the all-to-all timed; writes this rank's figures to ``report``-RANK."""
    import resource

    import prefpack.sequence_parallel as sp_mod
    from prefpack.cli import main as cli_main

    rank = int(os.environ.get("RANK", "0"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    spent = {"s": 0.0, "calls": 0}
    exchange = sp_mod._exchange

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return exchange(*args, **kwargs)
        finally:
            spent["s"] += time.perf_counter() - t0
            spent["calls"] += 1

    sp_mod._exchange = timed
    phases = _watch_phases()
    t0 = time.perf_counter()
    status = cli_main(argv)
    wall = time.perf_counter() - t0
    phases["stop"] = True
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(f"{report}-{rank}").write_text(json.dumps({"rank": rank, "peak_mib": peak, "start_mib": before,
                                                    "a2a_s": spent["s"], "a2a_calls": spent["calls"],
                                                    "wall_s": wall, "peak_phase": phases["at_peak"]}))
    sys.exit(status)


def _watch_phases() -> dict:
    """Which of the loop's phases (its ``record_function`` names: begin_step = the reference forward, forward_loss,
    backward, optimizer) holds the highest RSS: a thread samples ``/proc/self/statm`` every 2 ms."""
    import contextlib
    import threading

    import prefpack.training.loop as loop

    state = {"phase": "start-up", "at_peak": None, "max": 0, "stop": False}
    page = os.sysconf("SC_PAGE_SIZE")
    inner = loop.record_function

    @contextlib.contextmanager
    def named(name, *args, **kwargs):
        before, state["phase"] = state["phase"], name.removeprefix("prefpack.")
        try:
            with inner(name, *args, **kwargs):
                yield
        finally:
            state["phase"] = before

    def sample():
        while not state["stop"]:
            with open("/proc/self/statm") as fh:
                rss = int(fh.read().split()[1]) * page
            if rss > state["max"]:
                state["max"], state["at_peak"] = rss, state["phase"]
            time.sleep(0.002)

    loop.record_function = named
    threading.Thread(target=sample, daemon=True).start()
    return state


# ------------------------------------------------------------------------------------------- the driver


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def build(tmp: Path, lengths: list[int], args) -> dict[int, tuple[Path, int]]:
    """A tokenizer, a model and one store per length (pairs: prompt half the tokens, each completion a quarter);
    returns each length's store and its measured tokens per pair (prompt once + both completions)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from prefpack.data.prepare import PrepareOptions, prepare
    from prefpack.toy_tokenizer import build_toy_tokenizer

    rng = random.Random(0)
    tok = build_toy_tokenizer([text(rng, 2000) for _ in range(20)], style="llama", vocab_size=512)
    tok.save_pretrained(tmp / "tok")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                 num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                 num_key_value_heads=args.heads, max_position_embeddings=max(lengths) * 2,
                                 tie_word_embeddings=False)).save_pretrained(tmp / "model")
    tok.save_pretrained(tmp / "model")
    stores = {}
    for n in lengths:
        rows = []
        for _ in range(args.steps):
            rows.append({"prompt": text(rng, n // 2), "chosen": " " + text(rng, n // 4),
                         "rejected": " " + text(rng, n // 4)})
        path = tmp / f"d{n}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        report = prepare(PrepareOptions(inputs=[str(path)], tokenizer=str(tmp / "tok"), output=str(tmp / f"s{n}"),
                                        max_length=4 * n, workers=1), log=lambda _m: None)
        stores[n] = (tmp / f"s{n}", len(tok(rows[0]["prompt"] + rows[0]["chosen"])["input_ids"])
                     + len(tok(rows[0]["rejected"])["input_ids"]))
        del report
    return stores


LAYOUTS = {"once": "true", "per-side": "false"}  # the prompt laid out once per pair, or once per side


def run(tmp: Path, store: Path, n: int, nproc: int, layout: str, args) -> dict:
    out = tmp / f"run-{store.name}-{layout}-{nproc}"
    report = tmp / f"report-{store.name}-{layout}-{nproc}"
    room = 2 * n + 64  # the row holds the whole pair (prompt once), with room to spare
    argv = ["train", f"model.name_or_path={tmp / 'model'}", f"data.train={store}", f"run.output_dir={out}",
            "--no-progress", f"train.max_steps={args.steps}", "train.global_batch_pairs=1",
            f"train.micro_batch_tokens={room}", f"data.max_tokens_per_row={room}", "data.shuffle=false",
            "run.save_every=0", "run.plot=false", "run.tensorboard=false", "model.attn_implementation=packed_sdpa",
            f"data.prefix_sharing={LAYOUTS[layout]}", f"distributed.sequence_parallel={nproc}", *args.override]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(Path(__file__).resolve()), "--worker", str(report), "--", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)}\nfailed:\n{proc.stderr[-3000:]}")
    ranks = [json.loads(Path(f"{report}-{r}").read_text()) for r in range(nproc)]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if m["split"] == "train"]
    timed = train[1:] or train  # the first step warms up
    step_s = sum(m["tokens"] / m["tokens/s"] for m in timed)
    all_s = sum(m["tokens"] / m["tokens/s"] for m in train)
    return {"tokens_per_s": sum(m["tokens/s"] for m in timed) / len(timed), "loss": train[-1]["loss"],
            "tokens": train[0]["tokens"], "ranks": ranks, "train_s": all_s, "step_s": step_s,
            "a2a_share": max(r["a2a_s"] for r in ranks) / all_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8192,16384", help="pair lengths in tokens (prompt once + both "
                    "completions), comma-separated")
    ap.add_argument("--steps", type=int, default=2, help="steps per run, one pair each (the first is a warm-up)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--prompt", default="once,per-side", help="prompt layouts, comma-separated: once (prompt "
                    "groups: data.prefix_sharing=true, the CPU default) and/or per-side (data.prefix_sharing=false)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (OMP_NUM_THREADS)")
    ap.add_argument("--budget-mib", type=float, default=1024.0, help="peak RSS per rank the longest pair must fit")
    ap.add_argument("--override", action="append", default=[], help="a prefpack config override, KEY=VALUE")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        stores = build(tmp, lengths, args)
        for layout in args.prompt.split(","):
            for n in lengths:
                store, pair_tokens = stores[n]
                for nproc in (1, 2):
                    r = run(tmp, store, n, nproc, layout, args)
                    results.append({"length": n, "pair_tokens": pair_tokens, "prompt": layout, "sp": nproc, **r})
                    peaks = ", ".join(f"{x['peak_mib']:.0f}" for x in r["ranks"])
                    print(f"  {pair_tokens} tokens, prompt {layout}, N={nproc}: peak RSS {peaks} MiB, "
                          f"{r['tokens_per_s']:.0f} tokens/s", file=sys.stderr, flush=True)
    print("| prompt | pair tokens | N | peak RSS per rank (MiB) | run above start per rank (MiB) | peak during | tokens/s | "
          "all-to-all share | loss |")
    print("|---|---:|---:|---|---|---|---:|---:|---:|")
    for r in results:
        peaks = " / ".join(f"{x['peak_mib']:.0f}" for x in r["ranks"])
        above = " / ".join(f"{x['peak_mib'] - x['start_mib']:.0f}" for x in r["ranks"])
        share = f"{100 * r['a2a_share']:.1f}%" if r["sp"] > 1 else "-"
        during = " / ".join(sorted({str(x["peak_phase"]) for x in r["ranks"]}))
        print(f"| {r['prompt']} | {r['pair_tokens']} | {r['sp']} | {peaks} | {above} | {during} | {r['tokens_per_s']:.0f} | {share} | "
              f"{r['loss']:.6f} |")
    longest = {}
    for layout in args.prompt.split(","):
        for nproc in (1, 2):
            fit = [r["pair_tokens"] for r in results if r["prompt"] == layout and r["sp"] == nproc
                   and max(x["peak_mib"] for x in r["ranks"]) <= args.budget_mib]
            longest[f"{layout}/N={nproc}"] = max(fit) if fit else None
    print(f"\nlongest pair (of those run) within {args.budget_mib:.0f} MiB of peak RSS per rank: "
          + ", ".join(f"prompt {k}: {v}" for k, v in longest.items()))
    print(json.dumps({"benchmark": "sequence_parallel", "device": "cpu", "backend": "gloo",
                      "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads},
                      "threads_per_rank": args.threads, "budget_mib": args.budget_mib,
                      "longest_within_budget": longest,
                      "runs": [{k: v for k, v in r.items()} for r in results]}))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        rest = sys.argv[3:]
        worker(Path(sys.argv[2]), rest[1:] if rest[:1] == ["--"] else rest)
    else:
        main()
