"""Reward models on CPU: prefpack's reward training against TRL 1.16's RewardTrainer, and `prefpack score` against
scoring each (prompt, completion) padded. Not a test: run it by hand, paste the table into benchmarks/README.md.

Three cases, on one tiny random Llama (4 layers, hidden 256, the bundled gpt-neox-20b tokenizer; float32, sdpa for
TRL, prefpack's CPU default packed_sdpa), each run in its own process (its peak RSS is its own), one torch thread:

1. hh pairs: the bundled hh-rlhf sample's pairs (prepare --max-length 512 --truncation drop), the same pre-tokenised
   ids handed to TRL (`chosen_ids` / `rejected_ids`: prompt + completion as the store holds them), the same pairs a
   step, the same optimizer settings (AdamW, constant lr, no clipping).
2. ranked, 8 completions per prompt: hh prompt i with the chosen and rejected replies of rows i..i+3 (scores 8..1,
   no ties); prefpack trains the ranked store (`data.ranked_pairs=all_pairs`: 28 pairs a prompt, the prompt and
   each completion computed once), TRL the same 28 pairs a prompt written out as pairs.
3. scoring 8 completions per prompt with a one-label classifier: `prefpack score`'s scorer (packed rows, each prompt
   once) against the padded baseline (each prompt + completion its own sequence, sorted by length, left-padded in
   batches of 8192 padded tokens: prefpack's scorer before it was packed); the scores must agree.

"pair tokens/s" counts the tokens of the pairs trained (prompt + chosen and prompt + rejected per pair: what TRL
computes, whatever prefpack shares), pairs/s times the set's mean pair tokens, over steps 2..n; "positions / step"
is what the forward computed (TRL: its padded batch; prefpack: its packed rows).

    PYTHONPATH=/tmp/trl-1.16:. python benchmarks/reward_model.py [--pairs 64 --pair-batch 8 --prompts 12 --steps 4]
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
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HH = REPO / "examples" / "data" / "hh-rlhf-harmless-base" / "train_2k.jsonl.gz"
NEOX = REPO / "examples" / "tokenizers" / "gpt-neox-20b"
PER_PROMPT = 8
LR = 1e-5


def hh_rows() -> list[dict]:
    with gzip.open(HH, "rt", encoding="utf-8") as fh:
        rows = [json.loads(x) for x in fh]
    return [r for r in rows if r["chosen"].strip() and r["rejected"].strip() and r["chosen"] != r["rejected"]]


def ranked_rows(n: int) -> list[dict]:
    """Prompt i with the replies of rows i..i+3 (8 distinct texts), scored 8..1."""
    rows, out, i = hh_rows(), [], 0
    while len(out) < n:
        texts = [t for r in rows[i:i + PER_PROMPT // 2] for t in (r["chosen"], r["rejected"])]
        if len(set(texts)) == PER_PROMPT:
            out.append({"prompt": rows[i]["prompt"], "completions": texts,
                        "scores": list(range(PER_PROMPT, 0, -1))})
        i += PER_PROMPT // 2
    return out


def pair_ids(store_path: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt + chosen, prompt + rejected) ids of every pair a store yields at train time (a ranked store: all pairs
    of each prompt, as data.ranked_pairs=all_pairs draws them)."""
    from prefpack.data.store import Store
    from prefpack.data.views import group_pairs

    s = Store(store_path)
    if s.kind == "pairs":
        return [([*map(int, p), *map(int, c)], [*map(int, p), *map(int, r)]) for p, c, r in map(s.pair, range(len(s)))]
    out, starts, scores = [], s.group_starts(), s.scores()
    for g in range(len(starts) - 1):
        p, comps = s.ranked_group(g)
        for c, r in group_pairs(scores[starts[g]:starts[g + 1]], "all_pairs"):
            out.append(([*map(int, p), *map(int, comps[c])], [*map(int, p), *map(int, comps[r])]))
    return out


# ------------------------------------------------------------------------------------------------ workers


def train_prefpack(a) -> dict:
    from prefpack.config import load_config
    from prefpack.training import train

    cfg = load_config(None, [f"model.name_or_path={a.model}", f"data.train={a.store}", "train.objective=reward",
                             f"train.global_batch_pairs={a.batch}", f"train.max_steps={a.steps}", f"train.device={a.device}",
                             "train.seed=0", f"optim.lr={LR}", "optim.schedule=constant", "optim.warmup_steps=0",
                             "optim.max_grad_norm=null", "optim.weight_decay=0.0", f"run.output_dir={a.out}",
                             "run.plot=false", "run.report_to=none", "run.save_every=0"])
    train(cfg, progress=False, log=lambda m: None)
    recs = [json.loads(x) for x in (Path(a.out) / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["split"] == "train"]
    timed = recs[1:] or recs
    seconds = [a.pairs_per_step / r["pairs/s"] for r in timed]
    return {"pairs_per_s": a.pairs_per_step * len(timed) / sum(seconds),
            "positions_per_step": sum(r["positions"] for r in recs) / len(recs),
            "losses": [r["loss"] for r in recs]}


def train_trl(a) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import RewardConfig, RewardTrainer

    ids = pair_ids(Path(a.store))
    record: dict = {"times": [], "computed": [], "losses": []}

    class Recorder(RewardTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                record["computed"].append(int(inputs["input_ids"].numel()))
                record["losses"].append(float((out[0] if return_outputs else out).detach()))
            return out

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = getattr(self, "t", None) or time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if a.device == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            record["times"].append(now - self.t)
            self.t = now

    args = RewardConfig(output_dir=str(Path(a.out)), seed=0, per_device_train_batch_size=a.pairs_per_step,
                        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0,
                        weight_decay=0.0, max_steps=a.steps, bf16=a.device == "cuda", use_cpu=a.device == "cpu", report_to=[],
                        save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
                        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"})
    data = Dataset.from_dict({"chosen_ids": [c for c, _ in ids], "rejected_ids": [r for _, r in ids]})
    trainer = Recorder(model=a.model, args=args, train_dataset=data, processing_class=AutoTokenizer.from_pretrained(NEOX))
    trainer.add_callback(Clock())
    trainer.train()
    timed = record["times"][1:] or record["times"]
    return {"pairs_per_s": a.pairs_per_step * len(timed) / sum(timed),
            "positions_per_step": sum(record["computed"]) / len(record["computed"]), "losses": record["losses"],
            "trl_version": trl.__version__}


def score_packed(a) -> dict:
    from prefpack.rewards.reward_model import RewardModelScorer
    from prefpack.rewards.rows import ScoreInput

    scorer = RewardModelScorer(a.model, device=a.device)
    rows = list(ScoreInput(a.store).rows())
    t0 = time.perf_counter()
    scores = [s for i in range(0, len(rows), 64) for s in scorer.score(rows[i:i + 64])]
    return {"seconds": time.perf_counter() - t0, "scores": scores}


def score_padded(a) -> dict:
    import torch
    from transformers import AutoModelForSequenceClassification

    from prefpack.rewards.rows import ScoreInput

    model = AutoModelForSequenceClassification.from_pretrained(a.model, attn_implementation="sdpa").eval().to(a.device)
    model.config.pad_token_id = 0
    rows = list(ScoreInput(a.store).rows())
    t0 = time.perf_counter()
    scores = []
    for i in range(0, len(rows), 64):  # as the scorer is called: 64 rows a checkpoint
        chunk = rows[i:i + 64]
        flat = padded_scores(model, [r.prompt_ids + c for r in chunk for c in r.completion_ids], 8192, torch)
        at = 0
        for r in chunk:
            scores.append(flat[at:at + len(r.completion_ids)])
            at += len(r.completion_ids)
    return {"seconds": time.perf_counter() - t0, "scores": scores}


def padded_scores(model, sequences: list[list[int]], batch_tokens: int, torch) -> list[float]:
    """Each sequence scored at its last token, sorted by length, left-padded in batches of at most ``batch_tokens``
    padded tokens (prefpack's scorer before it was packed)."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    scores, embed, at = [0.0] * len(sequences), model.get_input_embeddings(), 0
    while at < len(order):
        end = at + 1
        while end < len(order) and len(sequences[order[end]]) * (end + 1 - at) <= batch_tokens:
            end += 1
        batch = [sequences[i] for i in order[at:end]]
        width = max(map(len, batch))
        ids = torch.zeros((len(batch), width), dtype=torch.long, device=embed.weight.device)
        mask = torch.zeros_like(ids)
        for b, s in enumerate(batch):
            ids[b, width - len(s):], mask[b, width - len(s):] = torch.tensor(s), 1
        with torch.no_grad():
            logits = model(inputs_embeds=embed(ids), attention_mask=mask,
                           position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        for i, v in zip(order[at:end], logits[:, 0].tolist()):
            scores[i] = v
        at = end
    return scores


WORKERS = {"train-prefpack": train_prefpack, "train-trl": train_trl, "score-packed": score_packed,
           "score-padded": score_padded}


def worker(a) -> None:
    import torch

    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    out = WORKERS[a.worker](a)
    peak = torch.cuda.max_memory_allocated() / 2**20 if a.device == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.update(peak_rss_mib=peak, wall_s=time.perf_counter() - t0)
    print("RESULT " + json.dumps(out))


def launch(a, kind: str, **kw) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--threads", str(a.threads), "--steps", str(a.steps),
           "--device", a.device,
           *[x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"{kind} failed (exit {proc.returncode}): {' '.join(cmd)}")
    return json.loads(lines[-1][len("RESULT "):])


# ------------------------------------------------------------------------------------------------ set-up, report


def build(work: Path, a) -> dict:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import write_jsonl

    from prefpack.data.prepare import PrepareOptions, prepare

    pairs = [{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]} for r in hh_rows()[:a.pairs]]
    for name, rows in (("pairs", pairs), ("ranked", ranked_rows(a.prompts)), ("scored", ranked_rows(a.score_prompts))):
        prepare(PrepareOptions(inputs=[str(write_jsonl(work / f"{name}.jsonl", rows))], tokenizer=str(NEOX),
                               output=str(work / name), max_length=512, truncation="drop", workers=1),
                log=lambda m: None)
    tok = AutoTokenizer.from_pretrained(NEOX)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                      num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64, num_key_value_heads=a.hidden // 64,
                      max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(work / "lm")
    torch.manual_seed(0)
    cfg.num_labels = 1
    LlamaForSequenceClassification(cfg).save_pretrained(work / "rm")
    return {name: pair_ids(work / name) for name in ("pairs", "ranked")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=64, help="hh pairs")
    ap.add_argument("--pair-batch", type=int, default=8, help="hh pairs a step")
    ap.add_argument("--prompts", type=int, default=12, help="ranked prompts (8 completions, 28 pairs each)")
    ap.add_argument("--prompt-batch", type=int, default=1, help="ranked prompts a step")
    ap.add_argument("--score-prompts", type=int, default=32, help="prompts scored (8 completions each)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: bf16 autocast over float32 weights for both (TRL bf16=True, prefpack model.dtype=auto); "
                    "the peak column is then max allocated, not RSS")
    for hidden in ("--worker", "--model", "--store", "--out", "--batch", "--pairs-per-step"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        a.batch = int(a.batch or 0)
        a.pairs_per_step = int(a.pairs_per_step or 0)
        return worker(a)

    work = Path(tempfile.mkdtemp(prefix="bench_reward_"))
    ids = build(work, a)
    mean_tokens = {k: sum(len(c) + len(r) for c, r in v) / len(v) for k, v in ids.items()}
    per_prompt = len(ids["ranked"]) // a.prompts
    cases = {"hh pairs": ("pairs", a.pair_batch, a.pair_batch), "ranked x8": ("ranked", a.prompt_batch,
                                                                           a.prompt_batch * per_prompt)}
    rows, result = [], {"date": date.today().isoformat(), "argv": sys.argv[1:], "cases": {}}
    for case, (store, batch, pairs_per_step) in cases.items():
        for who in ("trl", "prefpack"):
            r = launch(a, f"train-{who}", model=work / "lm", store=work / store, out=work / f"{who}-{store}",
                       batch=batch, pairs_per_step=pairs_per_step)
            r["pair_tokens_per_s"] = r["pairs_per_s"] * mean_tokens[store]
            result["cases"][f"{case} {who}"] = r
            rows.append((case, "TRL RewardTrainer" if who == "trl" else "prefpack", pairs_per_step,
                         r["pair_tokens_per_s"], r["positions_per_step"], r["peak_rss_mib"]))
    scored = {who: launch(a, f"score-{who}", model=work / "rm", store=work / "scored") for who in ("padded", "packed")}
    diff = max(abs(x - y) for p, q in zip(scored["packed"]["scores"], scored["padded"]["scores"]) for x, y in zip(p, q))
    n = sum(map(len, scored["packed"]["scores"]))
    for who, r in scored.items():
        result["cases"][f"score {who}"] = {k: v for k, v in r.items() if k != "scores"}
    print(f"\n{'case':<12} {'run':<18} {'pairs/step':>10} {'pair tokens/s':>14} {'positions/step':>15} {'peak MiB':>13}")
    for case, who, per_step, tps, pos, rss in rows:
        print(f"{case:<12} {who:<18} {per_step:>10} {tps:>14,.0f} {pos:>15,.0f} {rss:>13,.0f}")
    for who, r in scored.items():
        print(f"score x8     {who:<18} {n:>10} completions in {r['seconds']:.2f} s = {n / r['seconds']:.1f} /s, "
              f"peak {r['peak_rss_mib']:,.0f} MiB")
    print(f"scores agree to {diff:.2e} (max abs difference)")
    result["score_max_abs_diff"] = diff
    print(json.dumps(result))


if __name__ == "__main__":
    main()
