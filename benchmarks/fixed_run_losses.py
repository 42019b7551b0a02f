"""Per-step losses of fixed runs, printed to full precision, to show a refactor changes no number.

Every objective and layout the trainer has (pairs packed, shared, padded; LD-DPO + WPO; KTO unpaired, shared and
with a fixed pairing; a ranked store; a pair store grouped by prompt; a precomputed reference of each kind), three
steps each on a tiny Llama and the bundled hh sample, with a toy tokenizer built here (no downloads). Run it on two
trees and compare the JSON (it imports whichever prefpack is on the path):

    python benchmarks/fixed_run_losses.py --out /tmp/new.json
    PYTHONPATH=/tmp/old python benchmarks/fixed_run_losses.py --out /tmp/old.json
    cmp /tmp/old.json /tmp/new.json
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import io
import json
import tempfile
from pathlib import Path

import torch

HH = Path(__file__).resolve().parent.parent / "examples" / "data" / "hh-rlhf-harmless-base" / "train_2k.jsonl.gz"


def _rows() -> list[dict]:
    with gzip.open(HH, "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh][:120]
    return [r for r in rows if r["chosen"].strip() and r["rejected"].strip() and r["chosen"] != r["rejected"]]


def _data(rows: list[dict]) -> dict[str, tuple[list[dict], list[str]]]:
    """Each store's rows and its prepare options."""
    short = [{"prompt": f"Q{k}:{r['prompt'][-60:]}", "chosen": r["chosen"][:70], "rejected": r["rejected"][:70]}
             for k, r in enumerate(rows)]
    unpaired = [{"prompt": r["prompt"], "completion": r["chosen"] if k % 3 else r["rejected"], "label": bool(k % 3)}
                for k, r in enumerate(short[:21])]
    halves = [{"prompt": r["prompt"], "completion": r[key], "label": key == "chosen"}
              for r in short[:10] for key in ("chosen", "rejected")]
    ranked, grouped = [], []
    for k, (r, nxt) in enumerate(zip(short[:12], short[1:13])):
        texts = [r["chosen"], r["rejected"], nxt["chosen"][:50]]
        ranked.append({"prompt": r["prompt"], "completions": [{"text": t, "score": s} for t, s in zip(texts, (3, 1, 2))]})
        pairs = [(texts[0], texts[1]), (texts[0], texts[2]), (texts[2], texts[1])] if k % 2 == 0 else [texts[:2]]
        grouped.extend({"prompt": r["prompt"], "chosen": a, "rejected": b} for a, b in pairs)
    return {"pairs": (short[:24], []), "eval": (short[24:34], []), "unpaired": (unpaired, ["--format", "unpaired"]),
            "halves": (halves, ["--format", "unpaired"]), "ranked": (ranked, []), "grouped": (grouped, [])}


def _runs(s: dict[str, Path]) -> dict[str, tuple[str, list[str], list[list[str]]]]:
    """name -> (train store, overrides, precompute-ref argument lists to run first)."""
    kto_ref = ["--kto", "--seed", "0"]
    return {
        "pairs_shared": ("pairs", ["loss.terms=[{name: sigmoid}]", f"data.eval={s['eval']}"], []),
        "pairs_unshared": ("pairs", ["data.prefix_sharing=false"], []),
        "pairs_padded": ("pairs", ["data.packing=false", "data.pad_to_multiple_of=16"], []),
        "pairs_ld_wpo_ipo": ("pairs", ["loss.terms=[{name: ipo}, {name: nll, weight: 0.5}]", "loss.ld_alpha=0.5",
                                       "loss.use_weighting=true"], []),
        "pairs_small_micro": ("pairs", ["train.micro_batch_tokens=300", "data.max_tokens_per_row=300"], []),
        "pairs_precomputed_ld": ("pairs", ["reference.mode=precomputed", "loss.ld_alpha=0.3"], [[]]),
        "kto": ("unpaired", ["loss.terms=[{name: kto}]", "train.global_batch_pairs=5"], []),
        "kto_shared_fixed": ("halves", ["loss.terms=[{name: kto}]", "train.global_batch_pairs=5",
                                        "loss.kl_pairing=fixed"], []),
        "kto_precomputed": ("halves", ["loss.terms=[{name: kto}]", "train.global_batch_pairs=5",
                                       "loss.kl_pairing=fixed", "reference.mode=precomputed"], [kto_ref]),
        "kto_paired": ("pairs", ["loss.terms=[{name: kto}]", "data.paired_as_kto=true"], []),
        "ranked": ("ranked", ["train.global_batch_pairs=3", "data.ranked_pairs=all_pairs", "loss.ld_alpha=0.5"], []),
        "ranked_precomputed": ("ranked", ["train.global_batch_pairs=3", "reference.mode=precomputed"], [[]]),
        "grouped": ("grouped", ["train.global_batch_pairs=3", "data.group_by_prompt=true",
                                "loss.use_weighting=true"], []),
        "grouped_precomputed_ld": ("grouped", ["train.global_batch_pairs=3", "data.group_by_prompt=true",
                                               "reference.mode=precomputed", "loss.ld_alpha=0.5"], [[]]),
    }


def _weights_digest(path: Path) -> str:
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for k, v in sorted(load_file(str(path)).items()):
        h.update(k.encode())
        h.update(v.float().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the JSON here too")
    ap.add_argument("--only", nargs="*", help="run names to run (default: all)")
    args = ap.parse_args()
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from prefpack.cli import main as cli
    from prefpack.toy_tokenizer import build_toy_tokenizer

    torch.set_num_threads(1)
    rows = _rows()
    root = Path(tempfile.mkdtemp(prefix="fixed-runs-"))
    tok_dir = root / "tok"
    build_toy_tokenizer([r["prompt"] + r["chosen"] for r in rows], style="llama", vocab_size=600).save_pretrained(
        tok_dir)
    models = {}
    for name, seed in (("policy", 1), ("ref", 2)):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=len(AutoTokenizer.from_pretrained(tok_dir)), hidden_size=32,
                          intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256, tie_word_embeddings=False)
        LlamaForCausalLM(cfg).save_pretrained(root / name)
        models[name] = root / name
    stores = {}
    sink = io.StringIO()
    for name, (data, opts) in _data(rows).items():
        src = root / f"{name}.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in data))
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            assert cli(["prepare", str(src), *opts, "--tokenizer", str(tok_dir), "--output", str(root / name),
                        "--max-length", "96", "--workers", "1"]) == 0, sink.getvalue()[-2000:]
        stores[name] = root / name
    results = {}
    for name, (store, extra, precompute) in _runs(stores).items():
        if args.only and name not in args.only:
            continue
        run_dir = root / "runs" / name
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            for pre in precompute:
                assert cli(["precompute-ref", "--model", str(models["ref"]), "--data", str(stores[store]),
                            "--micro-batch-tokens", "2048", "--chunk-size", "64", *pre]) == 0, sink.getvalue()[-2000:]
            code = cli(["train", "--no-progress", f"model.name_or_path={models['policy']}",
                        f"reference.model={models['ref']}", f"data.train={stores[store]}", f"run.output_dir={run_dir}",
                        "optim.lr=1.0e-3", "optim.schedule=constant", "train.max_steps=3", "run.plot=false",
                        "run.report_to=none", "train.micro_batch_tokens=2048", "data.max_tokens_per_row=1024",
                        "train.chunk_size=64", *extra])
            assert code == 0, sink.getvalue()[-3000:]
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        results[name] = {
            "train": [[m["step"], repr(m["loss"]), repr(m["grad_norm"])] for m in lines if m["split"] == "train"],
            "eval": [repr(m["loss"]) for m in lines if m["split"] == "eval"],
            "weights": _weights_digest(run_dir / "final" / "model.safetensors"),
        }
        if precompute:
            sidecars = sorted(stores[store].glob("ref_logps*.safetensors"))
            results[name]["sidecars"] = {p.name: _weights_digest(p) for p in sidecars}
            for p in sidecars:  # the next run of the same store scores again
                p.unlink()
        print(name, json.dumps(results[name]), flush=True)
    text = json.dumps(results, indent=1, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
