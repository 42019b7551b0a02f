"""Peak memory of one forward and backward over a prompt-shared row on the CPU (`packed_sdpa`): each prompt group's
mask built once per forward and shared by the layers (prefpack's way) against a mask built in every layer (sdpa
keeps its mask for backward, so that holds one copy per layer). Each setting in its own process.

    python benchmarks/bench_prompt_mask_memory.py [--prompt 4096] [--completion 2048] [--layers 4]

Prints one line per setting: peak RSS and the peak above the RSS before the forward, in MiB.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys


def worker(a) -> None:
    import torch
    import transformers as tf

    from prefpack.model.attention import packed_sdpa as ps

    torch.set_num_threads(1)
    ps.register()
    if a.mode == "per-layer":  # what every layer building its own mask costs
        ps._CACHE.mask = lambda p, n, w, d, dt: ps._prefix_mask(p, n, w, d, dt)
    cfg = tf.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=a.layers,
                         num_attention_heads=4, max_position_embeddings=a.prompt + 2 * a.completion)
    cfg._attn_implementation = ps.NAME
    model = tf.LlamaForCausalLM(cfg)
    # one prompt group: the prompt and its first completion, then the second completion after the same prompt
    pos = torch.cat([torch.arange(a.prompt + a.completion), torch.arange(a.prompt, a.prompt + a.completion)])[None]
    ids = torch.randint(0, 1000, pos.shape)
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model(input_ids=ids, position_ids=pos, use_cache=False).logits[0, :, :5].sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{a.mode:<10} peak {peak:,.0f} MiB, {peak - start:,.0f} MiB above the start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--completion", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.mode:
        return worker(a)
    print(f"prompt {a.prompt} + 2 completions of {a.completion} tokens, {a.layers} layers, hidden 128")
    for mode in ("per-layer", "shared"):
        subprocess.run([sys.executable, __file__, "--mode", mode, "--prompt", str(a.prompt), "--completion",
                        str(a.completion), "--layers", str(a.layers)], check=True)


if __name__ == "__main__":
    main()
