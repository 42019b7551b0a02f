"""Memory options on CPU: peak RSS and tokens/s of one small model trained each way (issue 41).

Full fine-tuning in float32 (a frozen reference copy), LoRA in float32 (adapter reference), LoRA over a 4-bit NF4
base (QLoRA), full fine-tuning with activation offloading, and full fine-tuning under FSDP2 with CPU offload on 2
gloo ranks (2 processes: their peaks are listed per rank and summed). Each run is its own process, so its peak RSS
is its own (interpreter and imports included: about 400 MiB of it). The estimated peak per device that `prefpack
train` prints is listed beside it. On a CPU nothing leaves "the device": activation offloading and CPU offload move
no bytes here, and the GPU memory they save is not measured by this script.

    python benchmarks/bench_memory.py [--layers 4] [--hidden 256] [--steps 6] [--modes full,lora,qlora,act,offload]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "examples" / "data" / "hh-rlhf-harmless-base" / "train_2k.jsonl.gz"
TOKENIZER = REPO / "examples" / "tokenizers" / "gpt-neox-20b"

LORA = ("lora.enabled=true", "lora.r=16", "reference.mode=adapter")
MODES = {
    "full": ("full fine-tuning, float32", ()),
    "lora": ("LoRA r=16, float32 base", LORA),
    "qlora": ("LoRA r=16, 4-bit NF4 base", (*LORA, "model.quantization=nf4")),
    "act": ("full, activation offloading", ("train.activation_offloading=true",)),
    "offload": ("full, FSDP2 CPU offload, 2 ranks", ("distributed.strategy=fsdp2", "distributed.cpu_offload=true")),
}

# the child: one `prefpack train`, then its own peak RSS on stderr (under torchrun, one line per rank)
CHILD = """import json, os, resource, sys
from prefpack.cli import main
code = main(sys.argv[1:])
print("PEAK " + json.dumps({"rank": int(os.environ.get("RANK", "0")),
      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), file=sys.stderr, flush=True)
sys.exit(code)
"""


def run_mode(tmp: Path, name: str, base: list[str], extra: tuple[str, ...]) -> dict:
    child = tmp / "child.py"
    child.write_text(CHILD)
    run_dir = tmp / f"run-{name}"
    argv = ["train", *base, *extra, f"run.output_dir={run_dir}", "--no-progress", "--json"]
    nproc = 2 if name == "offload" else 1
    cmd = [sys.executable, str(child), *argv] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(child), *argv]
    env = {**os.environ, "OMP_NUM_THREADS": str(max((os.cpu_count() or 2) // nproc, 1))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    peaks = sorted((json.loads(x[5:]) for x in proc.stderr.splitlines() if x.startswith("PEAK ")),
                   key=lambda r: r["rank"])
    summary = json.loads([x for x in proc.stdout.splitlines() if x.startswith("{")][-1])
    estimate = next((x for x in proc.stderr.splitlines() if x.startswith("estimated peak per device")), "")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if m["split"] == "train"]
    later = train[1:] or train  # the first step warms up
    return {"mode": name, "what": MODES[name][0], "processes": nproc,
            "peak_rss_mib": [round(p["peak_rss_mib"]) for p in peaks],
            "peak_rss_mib_total": round(sum(p["peak_rss_mib"] for p in peaks)),
            "tokens_per_s": sum(m["tokens/s"] for m in later) / len(later),
            "run_tokens_per_s": summary["tokens"] / summary["seconds"],
            "estimated_total": (re.search(r"total ([0-9.]+ \w+)", estimate) or [None, None])[1],
            "estimate": estimate, "losses": [train[0]["loss"], train[-1]["loss"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch-tokens", type=int, default=2048)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from prefpack.data.prepare import PrepareOptions, prepare

    tmp = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    prepare(PrepareOptions(inputs=[str(DATA)], tokenizer=str(TOKENIZER), output=str(tmp / "store"), max_length=512,
                           skip_invalid=True), log=lambda m: None)
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=max(args.hidden // 64, 1),
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp / "model")
    del model
    base = [f"model.name_or_path={tmp / 'model'}", f"data.train={tmp / 'store'}", "optim.lr=1.0e-4",
            f"train.global_batch_pairs={args.global_batch}", f"train.max_steps={args.steps}",
            f"train.micro_batch_tokens={args.micro_batch_tokens}", "data.max_tokens_per_row=1024",
            "run.plot=false", "run.tensorboard=false", "run.save_every=0"]
    results = [run_mode(tmp, name, base, MODES[name][1]) for name in args.modes.split(",")]
    print(f"Llama, {args.layers} layers, hidden {args.hidden}, GPT-NeoX vocabulary ({params / 1e6:.1f}M parameters), "
          f"{args.steps} steps of {args.global_batch} hh-rlhf pairs, {os.cpu_count()} CPU cores")
    print(f"{'mode':<36}{'peak RSS MiB':>16}{'tokens/s':>10}{'estimate':>12}  loss first -> last")
    for r in results:
        rss = "+".join(str(x) for x in r["peak_rss_mib"])
        print(f"{r['what']:<36}{rss:>16}{r['tokens_per_s']:>10,.0f}{r['estimated_total'] or '':>12}  "
              f"{r['losses'][0]:.4f} -> {r['losses'][1]:.4f}")
    print(json.dumps({"bench": "memory", "params": params, "layers": args.layers, "hidden": args.hidden,
                      "steps": args.steps, "results": results}))


if __name__ == "__main__":
    main()
