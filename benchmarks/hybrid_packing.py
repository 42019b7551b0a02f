"""Packing a hybrid model on CPU: a small Qwen3.5-style model (Gated DeltaNet layers and one full-attention layer
in four) trained padded (``data.packing=false``), packed, and packed with each prompt laid out once.

Same random model (GPT-NeoX vocabulary), same pairs (the bundled hh-rlhf sample, prepared with the bundled GPT-NeoX
tokenizer), same steps, DPO loss against a frozen copy; prefpack's own forward in all three (completion-only head),
so the rows differ only in layout. The model loads through ``load_causal_lm``, which installs the recurrent layers'
sequence boundaries (``prefpack.model.recurrent``) and runs the packing guard. Each mode runs in its own process so
its peak RSS is its own. Prints a table and a JSON line.

    python benchmarks/hybrid_packing.py [--steps 3] [--pairs-per-step 8] [--layers 4] [--hidden 256]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "examples" / "data" / "hh-rlhf-harmless-base" / "train_2k.jsonl.gz"
TOKENIZER = REPO / "examples" / "tokenizers" / "gpt-neox-20b"
MODES = {"padded": (False, False), "packed": (True, False), "packed, prompts once": (True, True)}


def worker(args) -> dict:
    import numpy as np
    import torch

    from prefpack.batching.collate import collate_packed, collate_padded
    from prefpack.batching.plan import plan_micro_batches
    from prefpack.data.store import Store
    from prefpack.data.views import StorePairs
    from prefpack.losses import sigmoid_loss
    from prefpack.model import load_causal_lm, sequence_logps, split_pairs
    from prefpack.model.recurrent import installed_kinds

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    packed, shared = MODES[args.mode]
    cpu = torch.device("cpu")
    load = dict(dtype=torch.float32, attn_implementation="packed_sdpa", device=cpu, packed=packed)
    policy, ref = load_causal_lm(args.model, **load), load_causal_lm(args.model, **load)
    assert installed_kinds(policy) == ["gated_deltanet"]
    ref.eval().requires_grad_(False)
    policy.train()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    store = Store(args.store)
    order = np.random.default_rng(0).permutation(len(store))
    real = computed = 0
    seconds, first_loss = 0.0, None
    for step in range(args.steps + 1):  # step 0 warms up and is not timed
        ids = order[step * args.pairs_per_step: (step + 1) * args.pairs_per_step]
        pairs = StorePairs(store, ids)
        plan = plan_micro_batches(pairs.lengths(), token_budget=args.micro_batch_tokens, packing=packed,
                                  row_budget=min(args.row_tokens, args.micro_batch_tokens), seed=[0, step])
        t0 = time.perf_counter()
        opt.zero_grad()
        step_loss = 0.0
        for mb in plan:
            if packed:
                batch = collate_packed(pairs, mb, pad_id=1, share_prompts=shared)
            else:
                batch = collate_padded(pairs, [p for row in mb for p in row], pad_id=1)
            pol = split_pairs(*sequence_logps(policy, batch)[:2])
            with torch.no_grad():
                rf = split_pairs(*sequence_logps(ref, batch)[:2])
            loss = sigmoid_loss(pol.chosen - rf.chosen, pol.rejected - rf.rejected, 0.1).sum() / len(ids)
            loss.backward()
            step_loss += float(loss)
            if step > 0:
                real += batch.real_tokens
                computed += batch.computed_tokens
        opt.step()
        if step == 0:
            first_loss = step_loss
        else:
            seconds += time.perf_counter() - t0
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": args.mode, "real_tokens": real, "computed_positions": computed, "seconds": seconds,
            "tokens_per_s": real / seconds, "peak_rss_mib": peak_mib, "first_loss": first_loss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--pairs-per-step", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--row-tokens", type=int, default=2048)
    ap.add_argument("--mode", choices=tuple(MODES), help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:  # child process
        print(json.dumps(worker(args)))
        return

    import torch
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from prefpack.data.prepare import PrepareOptions, prepare

    tmp = Path(tempfile.mkdtemp())
    prepare(PrepareOptions(inputs=[str(DATA)], tokenizer=str(TOKENIZER), output=str(tmp / "store"),
                           max_length=args.max_length, skip_invalid=True), log=lambda m: None)
    vocab = len(AutoTokenizer.from_pretrained(TOKENIZER))
    heads = max(args.hidden // 64, 2)
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.layers)]
    cfg = Qwen3_5TextConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                            num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=2,
                            head_dim=64, linear_num_key_heads=2, linear_num_value_heads=heads,
                            linear_key_head_dim=64, linear_value_head_dim=64, layer_types=types,
                            max_position_embeddings=args.max_length, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(cfg).save_pretrained(tmp / "model")
    results = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, "--mode", mode, "--store", str(tmp / "store"), "--model", str(tmp / "model"),
               "--steps", str(args.steps), "--pairs-per-step", str(args.pairs_per_step),
               "--micro-batch-tokens", str(args.micro_batch_tokens), "--row-tokens", str(args.row_tokens)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"mode {mode!r} failed:\n{proc.stderr[-3000:]}")
        out = proc.stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    print(f"model: Qwen3.5-style, {args.layers} layers ({types.count('linear_attention')} Gated DeltaNet), hidden "
          f"{args.hidden}, vocab {vocab}; {args.steps} timed steps of {args.pairs_per_step} pairs (hh-rlhf sample, "
          f"max length {args.max_length}); cores: {os.cpu_count()}")
    print(f"{'mode':<24}{'tokens/s':>10}{'peak RSS MiB':>14}{'tokens/position':>17}{'step-0 loss':>13}")
    for name, r in results.items():
        fill = r["real_tokens"] / max(r["computed_positions"], 1)
        print(f"{name:<24}{r['tokens_per_s']:>10,.0f}{r['peak_rss_mib']:>14,.0f}{fill:>17.2f}{r['first_loss']:>13.6f}")
    pad = results["padded"]
    ratios = {m: {"speedup": round(r["tokens_per_s"] / pad["tokens_per_s"], 3),
                  "memory_ratio": round(r["peak_rss_mib"] / pad["peak_rss_mib"], 3)} for m, r in results.items()}
    print(json.dumps({"bench": "hybrid_packing", "ratios": ratios, "results": results}))


if __name__ == "__main__":
    main()
