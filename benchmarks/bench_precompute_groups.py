"""`precompute-ref` on a pair store whose pairs repeat prompts: scoring pair by pair against scoring its prompt
groups (each prompt and each distinct completion once), same model, same store, one process, alternated.

Builds the all-pairs data of bench_ranked.py (each hh prompt with 4 completions, its 6 ordered pairs written as pair
rows) and the 4-layer/256 model of compare_trl.

    python benchmarks/bench_precompute_groups.py [--prompts 48] [--repeats 2]

Prints a table and, last, one JSON line: seconds per pass (each repeat), and the largest difference between the two
sidecars' values (absolute, and relative to the value).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()

    import numpy as np
    import torch
    from bench_ranked import NEOX, pair_rows, ranked_rows
    from conftest import write_jsonl
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from prefpack.data.prepare import PrepareOptions, prepare
    from prefpack.data.store import Store
    from prefpack.data.views import PairGroups
    from prefpack.model import load_causal_lm
    from prefpack.training.precompute import record_reference, scoring_objective

    work = Path(tempfile.mkdtemp(prefix="bench_precompute_"))
    prepare(PrepareOptions(inputs=[str(write_jsonl(work / "pairs.jsonl", pair_rows(ranked_rows(a.prompts), "all_pairs")))],
                           tokenizer=str(NEOX), output=str(work / "pairs"), max_length=512, truncation="drop"),
            log=lambda m: None)
    tok = AutoTokenizer.from_pretrained(NEOX)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                                 tie_word_embeddings=False)).save_pretrained(work / "model")
    store = Store(work / "pairs")
    view = PairGroups(store)
    model = load_causal_lm(str(work / "model"), device=torch.device("cpu"), attn_implementation="packed_sdpa")
    budgets = dict(kto=False, seed=0, micro_batch_tokens=4096, row_tokens=2048, chunk_size=1024, shares_prompts=True)
    runs = {"pair by pair": False, "prompt groups": True}  # precompute-ref's objective, ungrouped or grouped
    seconds, outs = {k: [] for k in runs}, {}
    for _ in range(a.repeats):
        for name, grouped in runs.items():
            t0 = time.perf_counter()
            table = record_reference(scoring_objective(store, group_by_prompt=grouped, **budgets), model)
            outs[name] = {"logps": table.logps, "tails": table.tails}
            seconds[name].append(time.perf_counter() - t0)
    keys = ("logps", "tails")
    diff = max(float(np.abs(outs["pair by pair"][k] - outs["prompt groups"][k]).max()) for k in keys)
    rel = max(float((np.abs(outs["pair by pair"][k] - outs["prompt groups"][k])
                     / np.maximum(np.abs(outs["pair by pair"][k]), 1.0)).max()) for k in keys)
    print(f"{len(store)} pairs, {len(view)} prompt groups, {int(view.sizes.sum())} distinct completions; "
          f"{torch.get_num_threads()} threads")
    print(f"{'scoring':<16}{'best s':>9}  all runs")
    for name, s in seconds.items():
        print(f"{name:<16}{min(s):>9.2f}  {', '.join(f'{x:.2f}' for x in s)}")
    print(f"largest difference of the sidecar values: {diff:.2e} ({rel:.1e} of the value)")
    print(json.dumps({"pairs": len(store), "groups": len(view), "seconds": seconds, "max_abs_diff": diff,
                      "max_rel_diff": rel}))


if __name__ == "__main__":
    main()
