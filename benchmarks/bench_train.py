"""Training throughput and peak memory: padded + full-logits (the common way) against packed + completion-only.

Same model (random Llama, GPT-NeoX vocabulary), same pairs (the bundled hh-rlhf sample, prepared with the
bundled GPT-NeoX tokenizer), same global batch, same DPO loss and reference (a frozen copy). Each mode runs
in its own process so that its peak RSS is its own. Prints a table and a JSON line with the ratios.

    python benchmarks/bench_train.py [--steps 4] [--pairs-per-step 8] [--layers 4] [--hidden 256]
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


def full_logits_pair_logps(model, batch):
    """The common way: logits for every position, full log-softmax, gather, mask, sum per sequence."""
    import torch

    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                use_cache=False)
    logp = torch.log_softmax(out.logits.float(), dim=-1)
    tgt = batch.target_ids.clamp(min=0)
    per_tok = logp.gather(-1, tgt[..., None]).squeeze(-1) * batch.loss_mask
    seq = torch.zeros(batch.num_sequences, dtype=per_tok.dtype)
    seq.index_add_(0, batch.seq_index[batch.loss_mask], per_tok[batch.loss_mask])
    return seq[0::2], seq[1::2]


def worker(args) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from prefpack.batching.collate import collate
    from prefpack.batching.plan import plan_micro_batches
    from prefpack.data.store import Store
    from prefpack.data.views import StorePairs
    from prefpack.losses import sigmoid_loss
    from prefpack.model import pair_logps, pick_attention
    from prefpack.model.attention.packed_sdpa import register as register_packed_attention

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    store = Store(args.store)
    packed = args.mode == "packed"
    # the padded baseline runs sdpa, what transformers picks; packed runs prefpack's CPU default (packed_sdpa)
    attn = pick_attention("auto", torch.device("cpu")) if packed else "sdpa"
    register_packed_attention()
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=attn)
    ref = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=attn)
    ref.eval().requires_grad_(False)
    policy.train()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    order = np.random.default_rng(0).permutation(len(store))
    real = computed = 0
    first_loss = None
    t_total = 0.0
    for step in range(args.steps + 1):  # step 0 warms up and is not timed
        ids = order[step * args.pairs_per_step : (step + 1) * args.pairs_per_step]
        pairs = StorePairs(store, ids)
        plan = plan_micro_batches(pairs.lengths(), token_budget=args.micro_batch_tokens, packing=packed,
                                  row_budget=min(args.row_tokens, args.micro_batch_tokens), seed=[0, step])
        t0 = time.perf_counter()
        opt.zero_grad()
        step_loss = 0.0
        for mb in plan:
            batch = collate(pairs, mb, packing=packed, pad_id=1)
            if packed:
                pol = pair_logps(policy, batch)
                with torch.no_grad():
                    rf = pair_logps(ref, batch)
                pc, pr, rc, rr = pol.chosen, pol.rejected, rf.chosen, rf.rejected
            else:
                pc, pr = full_logits_pair_logps(policy, batch)
                with torch.no_grad():
                    rc, rr = full_logits_pair_logps(ref, batch)
            loss = sigmoid_loss(pc - rc, pr - rr, 0.1).sum() / len(ids)
            loss.backward()
            step_loss += float(loss)
            if step > 0:
                real += batch.real_tokens
                computed += batch.computed_tokens
        opt.step()
        dt = time.perf_counter() - t0
        if step == 0:
            first_loss = step_loss
        else:
            t_total += dt
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": args.mode, "real_tokens": real, "computed_tokens": computed, "seconds": t_total,
            "tokens_per_s": real / t_total, "peak_rss_mib": peak_mib, "first_loss": first_loss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pairs-per-step", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--row-tokens", type=int, default=2048)
    ap.add_argument("--mode", choices=("padded", "packed"), help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:  # child process
        print(json.dumps(worker(args)))
        return

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from prefpack.data.prepare import PrepareOptions, prepare

    tmp = Path(tempfile.mkdtemp())
    prepare(PrepareOptions(inputs=[str(DATA)], tokenizer=str(TOKENIZER), output=str(tmp / "store"),
                           max_length=args.max_length, skip_invalid=True), log=lambda m: None)
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=max(args.hidden // 64, 1),
                      max_position_embeddings=args.max_length, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp / "model")
    results = {}
    for mode in ("padded", "packed"):
        cmd = [sys.executable, __file__, "--mode", mode, "--store", str(tmp / "store"), "--model", str(tmp / "model"),
               "--steps", str(args.steps), "--pairs-per-step", str(args.pairs_per_step),
               "--micro-batch-tokens", str(args.micro_batch_tokens), "--row-tokens", str(args.row_tokens)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    pad, pack = results["padded"], results["packed"]
    print(f"model: Llama {args.layers} layers, hidden {args.hidden}, vocab {len(tok)}; {args.steps} timed steps of "
          f"{args.pairs_per_step} pairs (hh-rlhf sample, max length {args.max_length}); cores: {os.cpu_count()}")
    print(f"{'mode':<34}{'tokens/s':>10}{'peak RSS MiB':>14}{'filling':>9}{'step-0 loss':>13}")
    for name, r in (("padded + full logits", pad), ("packed + completion-only", pack)):
        fill = r["real_tokens"] / max(r["computed_tokens"], 1)
        print(f"{name:<34}{r['tokens_per_s']:>10,.0f}{r['peak_rss_mib']:>14,.0f}{fill:>9.2f}{r['first_loss']:>13.6f}")
    speed = pack["tokens_per_s"] / pad["tokens_per_s"]
    mem = pack["peak_rss_mib"] / pad["peak_rss_mib"]
    print(f"speed-up {speed:.2f}x, memory {mem:.2f}x of padded, step-0 losses differ by "
          f"{abs(pack['first_loss'] - pad['first_loss']):.2e}")
    print(json.dumps({"bench": "train", "speedup": round(speed, 3), "memory_ratio": round(mem, 3),
                      "padded": pad, "packed": pack}))


if __name__ == "__main__":
    main()
