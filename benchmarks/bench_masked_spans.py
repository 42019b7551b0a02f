"""Agent-style preference data (tool results are most of each reply): `prepare --train-on assistant` (only what the
model wrote is scored) against `--train-on all` (every completion token scored, as TRL does), same data, same model.

Builds multi-turn rows from the bundled hh sample: the prompt is the user's turn; each reply calls a tool, reads a
long tool result, calls again, reads again, then answers (chosen: hh's chosen answer, rejected: hh's rejected one).
A ChatML template with tool calls is set on a copy of the bundled gpt-neox tokenizer. Each run is its own process
(its peak RSS is its own); prefpack's default CPU path, DPO sigmoid against a frozen copy; one step is profiled
(`torch.profiler`) for the share of the step spent in the LM head (`prefpack.head`).

    python benchmarks/bench_masked_spans.py [--prompts 32] [--per-step 4] [--steps 4] [--tool-words 120] [--device cuda]

Prints a table and, last, one JSON line: scored and laid-out positions per step, pairs/s (mean of steps 2..n),
head milliseconds per step and its share, peak RSS, the losses.
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
CHATML_TOOLS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.get('content') %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def agent_rows(n: int, tool_words: int) -> list[dict]:
    with gzip.open(HH, "rt", encoding="utf-8") as fh:
        rows = [json.loads(x) for x in fh]
    rows = [r for r in rows if r["chosen"].strip() and r["rejected"].strip() and r["chosen"] != r["rejected"]]
    words = " ".join(r["chosen"] for r in rows[n : n + 200]).split()

    def result(k: int) -> str:  # a long tool result: text the model did not write
        start = (k * 37) % max(len(words) - tool_words, 1)
        return " ".join(words[start : start + tool_words])

    def reply(i: int, answer: str) -> list[dict]:
        call = [{"type": "function", "function": {"name": "search", "arguments": {"query": f"q{i}"}}}]
        return [{"role": "assistant", "content": "", "tool_calls": call}, {"role": "tool", "content": result(2 * i)},
                {"role": "assistant", "content": "", "tool_calls": call}, {"role": "tool", "content": result(2 * i + 1)},
                {"role": "assistant", "content": answer[:300]}]

    return [{"prompt": [{"role": "user", "content": r["prompt"][-300:]}], "chosen": reply(i, r["chosen"]),
             "rejected": reply(i, r["rejected"])} for i, r in enumerate(rows[:n])]


def worker(a) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from prefpack.config import load_config
    from prefpack.training import train

    torch.set_num_threads(a.threads)
    base = [f"model.name_or_path={a.model}", f"data.train={a.store}", "data.shuffle=false",
            f"train.global_batch_pairs={a.batch}", f"train.device={a.device}", "optim.lr=1e-6", "optim.warmup_steps=0",
            "reference.mode=copy", "run.plot=false", "run.tensorboard=false"]
    t0 = time.perf_counter()
    train(load_config(None, [*base, f"train.max_steps={a.steps}", f"run.output_dir={a.out}"]), progress=False,
          log=lambda m: None)
    wall = time.perf_counter() - t0
    recs = [json.loads(x) for x in (Path(a.out) / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["split"] == "train"]
    timed = recs[1:] or recs  # the first step warms up
    secs = sum(a.batch / r["pairs/s"] for r in timed)
    if a.device != "cpu":  # the head's share is a CPU-time figure; on a GPU the step rate is what is measured
        print(json.dumps({"pairs_per_s": a.batch * len(timed) / secs, "positions_per_step": recs[0]["positions"],
                          "scored_per_step": recs[0].get("scored"), "losses": [r["loss"] for r in recs],
                          "head_ms": None, "step_ms": None, "wall_s": wall, "peak_rss_mib": 0.0}))
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # one more step, profiled
        train(load_config(None, [*base, "train.max_steps=1", f"run.output_dir={a.out}-profiled"]), progress=False,
              log=lambda m: None)
    events = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages()}
    step_ms = sum(v for k, v in events.items() if k.startswith("prefpack.") and k != "prefpack.head")  # the step's parts
    backward = [v for k, v in events.items() if k.startswith("autograd::engine::evaluate_function")
                and "ChunkedTokenLogprob" in k]
    head_ms = events["prefpack.head"] + sum(backward) if "prefpack.head" in events else None  # forward + backward
    print(json.dumps({"pairs_per_s": a.batch * len(timed) / secs, "positions_per_step": recs[0]["positions"],
                      "scored_per_step": recs[0].get("scored"), "losses": [r["loss"] for r in recs],
                      "head_ms": head_ms, "step_ms": step_ms, "wall_s": wall,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--per-step", type=int, default=4, help="pairs per optimizer step")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tool-words", type=int, default=120, help="words in each tool result")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the device's defaults: bfloat16, varlen)")
    for hidden in ("--worker", "--model", "--store", "--out", "--batch"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        a.steps, a.batch, a.threads = int(a.steps), int(a.batch), int(a.threads)
        return worker(a)

    import numpy as np
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import write_jsonl

    from prefpack.data.prepare import PrepareOptions, prepare
    from prefpack.data.spans import scored_of
    from prefpack.data.store import Store

    work = Path(tempfile.mkdtemp(prefix="bench_masked_"))
    tok = AutoTokenizer.from_pretrained(NEOX)
    tok.chat_template = CHATML_TOOLS
    tok.save_pretrained(work / "tok")
    src = write_jsonl(work / "agent.jsonl", agent_rows(a.prompts, a.tool_words))
    scored_share = {}
    for mode in ("all", "assistant"):
        prepare(PrepareOptions(inputs=[str(src)], tokenizer=str(work / "tok"), output=str(work / mode), max_length=2048,
                               truncation="drop", train_on=mode), log=lambda m: None)
        store = Store(work / mode)
        sides = [c for i in range(len(store)) for c in store.pair(i)[1:]]
        scored = sum(int(scored_of(c).sum()) if scored_of(c) is not None else len(c) for c in sides)
        scored_share[mode] = scored / sum(len(c) for c in sides)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                      num_hidden_layers=a.layers, num_attention_heads=max(a.hidden // 64, 1),
                      num_key_value_heads=max(a.hidden // 64, 1), max_position_embeddings=2048,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(work / "model")
    results = {}
    for mode in ("all", "assistant"):
        cmd = [sys.executable, __file__, "--worker", "1", "--model", str(work / "model"), "--store", str(work / mode),
               "--out", str(work / f"run-{mode}"), "--batch", str(a.per_step), "--steps", str(a.steps),
               "--threads", str(a.threads), "--device", a.device]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"the --train-on {mode} run failed ({done.returncode}):\n{done.stderr[-4000:]}")
        out = done.stdout.strip().splitlines()[-1]
        results[mode] = json.loads(out) | {"scored_share": scored_share[mode]}
    print(f"{a.prompts} agent rows (2 tool calls, {a.tool_words}-word results), {a.per_step} pairs a step, {a.steps} "
          f"steps, {a.layers}L/{a.hidden}h, {a.threads} threads, {a.device}, vocabulary {len(tok):,}")
    print(f"{'--train-on':<12}{'scored':>8}{'positions/step':>16}{'pairs/s':>9}{'head ms':>9}{'head share':>12}"
          f"{'peak RSS MiB':>14}  losses (first, last)")
    for mode, r in results.items():
        head = r["head_ms"]
        share = f"{head / r['step_ms']:.1%}" if head is not None and r["step_ms"] else "n/a"
        print(f"{mode:<12}{r['scored_share']:>8.1%}{r['positions_per_step']:>16,.0f}{r['pairs_per_s']:>9.2f}"
              f"{(f'{head:.0f}' if head is not None else 'n/a'):>9}{share:>12}{r['peak_rss_mib']:>14,.0f}  "
              f"{r['losses'][0]:.7f}, {r['losses'][-1]:.7f}")
    print(json.dumps({"prompts": a.prompts, "tool_words": a.tool_words, "per_step": a.per_step,
                      "results": results, "speedup": float(np.float64(results["assistant"]["pairs_per_s"])
                                                           / results["all"]["pairs_per_s"])}))


if __name__ == "__main__":
    main()
