"""TRL 1.16's DPOTrainer loss for every loss type, on fixed tiny weights and pairs: the numbers
tests/test_trl_numbers.py checks `prefpack eval --loss NAME` against (TRL stays an optional dependency).

What it builds (once; later runs reuse the files so the numbers always belong to the committed weights, unless
`--rebuild-assets`), all under tests/data/trl_losses/:

- `tokenizer/`: a Llama-style byte-level BPE of 300 tokens (`prefpack.toy_tokenizer`, adds BOS) trained on
  the bundled hh-rlhf sample;
- `reference/`: a 2-layer Llama (hidden 16, 4 heads, 2 KV heads, untied head) from a config with seed 0 and
  `initializer_range` 0.5 (a peaked, far from uniform, next-token distribution), float32 safetensors;
- `policy/`: the reference plus seeded Gaussian noise (std 0.03 * the std of each weight tensor), so every
  log-ratio policy - reference is non-zero (about -10 to 12 nats per completion; beta * margin from -0.9 to
  1.9, and 10 of 16 pairs have the chosen reward above the rejected);
- `policy_sppo/`: that policy after float64 Adam steps (31) on TRL's own sppo_hard objective, until its mean is
  at most 0.25 (the log-ratios within about half a nat of the targets +-0.5/beta = +-5). sppo_hard is the one
  ill-conditioned loss: it squares summed log-ratios, so an error e in a log-prob sum of about -170 (float32:
  about 3e-5) moves it by 2 |logratio -+ 5| e. On `policy` (log-ratios up to 11 nats from the targets, sppo_hard
  75.87) TRL's own float32 value is 2.0e-4 from its float64 value and prefpack's 2.1e-4 the other way, so 1e-4
  would test float32 rounding, not the formula; on `policy_sppo` they are 8e-6 and 4e-6 from float64;
- `pairs.jsonl`: 16 short pairs of examples/data/hh-rlhf-harmless-base/train_2k.jsonl.gz that `prefpack
  prepare --max-length 512` leaves untruncated and that TRL tokenises exactly as prefpack's store (selection:
  `compare_trl.trl_style_ids`, then checked on TRL's own preprocessed ids, which are recorded in the JSON).

Then, for every loss type TRL 1.16's DPOConfig accepts, with TRL's defaults (beta 0.1, label_smoothing 0,
discopop_tau 0.05; exo_pair needs label_smoothing > 0 and gets 1e-3, the EXO paper's value TRL's error
message names) and a few non-default variants of the parameters a loss reads, it builds a DPOTrainer (the
policy from its folder, `policy_sppo` for sppo_hard; the reference as `ref_model`; float32 on CPU:
`bf16=False`, sdpa attention) and calls `trainer.evaluate()` on the 16 pairs as ONE eval batch
(`per_device_eval_batch_size=16`): no training step, eval mode, dropout off. TRL reduces each loss type by
`per_sequence_loss.mean()` over that batch, i.e. the mean over pairs, which is what `prefpack eval` reports.
Two loss types are batch-level and so depend on the batch holding every pair (it does, here and in the test):

- `sft`: the mean of -log p over every chosen completion token of the batch (a token mean, not a mean of
  per-pair means);
- `aot`, `aot_unpaired`: the policy and reference margins (or chosen and rejected log-ratios) are each sorted
  over the batch before they are paired up.

Each case is also run in float64 (the same TRL code on float64 copies of the weights) and recorded beside the
float32 value: the gap is the float32 rounding of TRL's number (8.4e-6 for sppo_hard, at most 3.8e-6 for the
others), so a difference of 1e-4 from prefpack is a difference in what is computed, not rounding.

Writes tests/data/trl_losses.json: TRL/torch/transformers versions, the command, the model and pair settings,
the token ids TRL scored, and per case {trl_loss_type, prefpack_loss, policy, settings, reads, reduction, loss,
loss_float64, metrics}.

    pip install -e '.[bench]'
    python benchmarks/trl_losses.py                    # about 15 s on 2 CPU cores
    python benchmarks/trl_losses.py --rebuild-assets   # also rebuild tokenizer, weights and pairs
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "examples" / "data" / "hh-rlhf-harmless-base" / "train_2k.jsonl.gz"
ASSETS = REPO / "tests" / "data" / "trl_losses"
OUT = REPO / "tests" / "data" / "trl_losses.json"

N_PAIRS = 16
MAX_LENGTH = 512  # prefpack prepare --max-length; TRL keeps its default max_length 1024 (nothing is truncated)
MAX_SEQ_TOKENS = 96  # each prompt + completion at most this many tokens: small, fast, still varied
VOCAB = 300
SEED = 0
MODEL = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 512, "initializer_range": 0.5,
         "tie_word_embeddings": False}
NOISE = 0.03  # policy = reference + NOISE * std(weight) * N(0, 1), per weight tensor

# TRL 1.16's DPOConfig loss hyper-parameters and their defaults (dpo_config.py)
TRL_DEFAULTS = {"beta": 0.1, "label_smoothing": 0.0, "discopop_tau": 0.05}
# which of them each loss type's formula reads (dpo_trainer.py, DPOTrainer._compute_loss); TRL 1.16's sigmoid
# ignores label_smoothing (no cDPO), and sft reads none
READS = {
    "sigmoid": ("beta",), "hinge": ("beta",), "ipo": ("beta",), "exo_pair": ("beta", "label_smoothing"),
    "nca_pair": ("beta",), "robust": ("beta", "label_smoothing"), "bco_pair": ("beta",), "sppo_hard": ("beta",),
    "aot": ("beta", "label_smoothing"), "aot_unpaired": ("beta", "label_smoothing"), "apo_zero": ("beta",),
    "apo_down": ("beta",), "discopop": ("beta", "discopop_tau"), "sft": (), "sigmoid_norm": ("beta",),
}
REDUCTION = {
    "sft": "token mean of -log p over every chosen completion token of the batch (one value for the batch)",
    "aot": "mean over pairs of a loss on policy and reference margins each sorted over the whole batch",
    "aot_unpaired": "mean over pairs of a loss on chosen and rejected log-ratios each sorted over the whole batch",
}
SPPO_POLICY_TARGET = 0.25  # policy_sppo: Adam steps on sppo_hard until its float64 mean is at most this
# (loss type, settings different from TRL_DEFAULTS); the first entry of each loss type uses TRL's defaults
CASES = [(t, {}) for t in READS if t != "exo_pair"] + [
    ("exo_pair", {"label_smoothing": 1e-3}),  # TRL refuses 0 for exo_pair; 1e-3 is the value it recommends
    ("sigmoid", {"beta": 0.5}),
    ("robust", {"label_smoothing": 0.1}),
    ("exo_pair", {"label_smoothing": 0.1}),
    ("aot", {"label_smoothing": 0.1}),
    ("aot_unpaired", {"label_smoothing": 0.1}),
    ("discopop", {"discopop_tau": 0.2}),
    # DPO options on top of a loss type (TRL_OPTIONS): LD-DPO, WPO, f-DPO
    ("sigmoid", {"ld_alpha": 0.5}),
    ("ipo", {"ld_alpha": 0.3}),
    ("sft", {"ld_alpha": 0.5}),  # TRL's sft reads the raw token log-probs: ld_alpha must not change it
    ("sigmoid", {"use_weighting": True}),
    # ("sft", {"use_weighting": True}) is not recorded: TRL 1.16 raises ("more than one element of the written-to
    # tensor refers to a single memory location": it multiplies the expanded sft scalar in place)
    ("hinge", {"use_weighting": True, "ld_alpha": 0.5}),
    ("sigmoid", {"f_divergence_type": "js_divergence"}),
    ("sigmoid", {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3}),
]
# DPOConfig options (not loss hyper-parameters) a case may set, each read by every loss type it is given with
TRL_OPTIONS = ("ld_alpha", "use_weighting", "f_divergence_type", "f_alpha_divergence_coef")
# the prefpack loss that corresponds to a TRL loss type, where the name differs (none today)
PREFPACK_NAME: dict[str, str] = {}
# the policy folder a loss type is scored with (see the module docstring)
POLICY = {"sppo_hard": "policy_sppo"}


def case_id(loss_type: str, changed: dict) -> str:
    def show(v):
        return str(v) if isinstance(v, (bool, str)) else f"{v:g}"

    return loss_type + ("[" + ",".join(f"{k}={show(v)}" for k, v in sorted(changed.items())) + "]" if changed else "")


# ------------------------------------------------------------------------------------------------ assets


def build_tokenizer(rows: list[dict], out: Path):
    from prefpack.toy_tokenizer import build_toy_tokenizer

    tok = build_toy_tokenizer([r["prompt"] + r["chosen"] for r in rows[:300]], style="llama", vocab_size=VOCAB)
    tok.save_pretrained(out)
    return out


def select_pairs(rows: list[dict], tokenizer: Path, work: Path, log) -> list[dict]:
    """The first N_PAIRS short pairs (in a seeded order) that prefpack stores untruncated and TRL tokenises alike."""
    import numpy as np
    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compare_trl import trl_style_ids

    from prefpack.data.prepare import PrepareOptions, prepare
    from prefpack.data.store import Store

    prepare(PrepareOptions(inputs=[str(DATA)], tokenizer=str(tokenizer), output=str(work / "full"),
                           max_length=MAX_LENGTH, skip_invalid=True, overwrite=True, workers=1), log=lambda m: None)
    store = Store(work / "full")
    tok = AutoTokenizer.from_pretrained(tokenizer)
    flags, src = np.asarray(store.index[:, 4]), np.asarray(store.index[:, 6])
    picked, differ = [], 0
    for i in np.random.default_rng(SEED).permutation(len(store)):
        row = rows[int(src[i])]
        pair = store.pair(int(i))
        ours = tuple(np.asarray(x).tolist() for x in (pair.prompt, pair.chosen, pair.rejected))
        p, c, r = (len(x) for x in ours)
        if flags[i] != 0 or not row["chosen"].strip() or row["chosen"] == row["rejected"]:
            continue
        if p + max(c, r) > MAX_SEQ_TOKENS or min(c, r) < 2:
            continue
        if trl_style_ids(tok, row["prompt"], row["chosen"], row["rejected"]) != ours:
            differ += 1
            continue
        picked.append({"prompt": row["prompt"], "chosen": row["chosen"], "rejected": row["rejected"]})
        if len(picked) == N_PAIRS:
            break
    if len(picked) < N_PAIRS:
        raise SystemExit(f"only {len(picked)} usable pairs")
    log(f"  picked {N_PAIRS} pairs of {len(store)} ({differ} short ones TRL would tokenise differently skipped)")
    return picked


def build_models(tokenizer: Path, ref_dir: Path, policy_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer)
    torch.manual_seed(SEED)
    cfg = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, **MODEL)
    ref = LlamaForCausalLM(cfg).float().eval()
    ref.save_pretrained(ref_dir)
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for _, p in sorted(ref.named_parameters()):
            scale = float(p.std()) if p.numel() > 1 and float(p.std()) > 0 else 1.0
            p.add_(NOISE * scale * torch.randn(p.shape, generator=gen))
    ref.save_pretrained(policy_dir)


def completion_logps(model, ids: list[dict]):
    """Chosen and rejected completion log-prob sums of every pair ([P] each), one right-padded batch."""
    import torch

    seqs = [(p["prompt"] + p[k], len(p["prompt"])) for p in ids for k in ("chosen", "rejected")]
    width = max(len(x) for x, _ in seqs)
    x = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(x)
    target = torch.zeros(len(seqs), width - 1, dtype=torch.bool)  # positions whose next token is a completion's
    for i, (seq, n) in enumerate(seqs):
        x[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        target[i, n - 1 : len(seq) - 1] = True
    logp = torch.log_softmax(model(input_ids=x, attention_mask=mask, use_cache=False).logits[:, :-1], -1)
    per_token = logp.gather(-1, x[:, 1:].unsqueeze(-1)).squeeze(-1) * target
    sums = per_token.sum(1)
    return sums[0::2], sums[1::2]


def build_sppo_policy(ids: list[dict], ref_dir: Path, policy_dir: Path, out: Path, log) -> None:
    """`policy` moved by float64 Adam steps on TRL's sppo_hard objective (beta 0.1) until its mean is at most
    SPPO_POLICY_TARGET, so that sppo_hard's float32 rounding is far below 1e-4 (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    beta = TRL_DEFAULTS["beta"]
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float64, attn_implementation="eager").eval()
    pol = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float64, attn_implementation="eager").eval()
    with torch.no_grad():
        ref_c, ref_r = completion_logps(ref, ids)
    opt = torch.optim.Adam(pol.parameters(), lr=3e-3)
    steps = 0
    while True:
        pc, pr = completion_logps(pol, ids)
        loss = (((pc - ref_c) - 0.5 / beta) ** 2 + ((pr - ref_r) + 0.5 / beta) ** 2).mean()
        if float(loss.detach()) <= SPPO_POLICY_TARGET:
            break
        if steps == 500:
            raise SystemExit(f"policy_sppo: sppo_hard still {float(loss.detach()):.3f} after 500 steps")
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    log(f"  policy_sppo: {steps} Adam steps, sppo_hard (float64) {float(loss.detach()):.3f}")
    pol.float().save_pretrained(out)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


def ensure_assets(rebuild: bool, log) -> None:
    from compare_trl import read_rows

    parts = [ASSETS / "tokenizer" / "tokenizer.json", ASSETS / "pairs.jsonl",
             *(ASSETS / m / "model.safetensors" for m in ("reference", "policy", "policy_sppo"))]
    if not rebuild and all(p.is_file() for p in parts):
        log(f"reusing {ASSETS.relative_to(REPO)} (tokenizer, weights, pairs); --rebuild-assets builds them again")
        return
    import shutil

    log(f"building {ASSETS.relative_to(REPO)}")
    shutil.rmtree(ASSETS, ignore_errors=True)
    ASSETS.mkdir(parents=True)
    rows = read_rows(DATA)
    tok = build_tokenizer(rows, ASSETS / "tokenizer")
    with tempfile.TemporaryDirectory(prefix="trl_losses-") as work:
        pairs = select_pairs(rows, tok, Path(work), log)
    write_jsonl(ASSETS / "pairs.jsonl", pairs)
    build_models(tok, ASSETS / "reference", ASSETS / "policy")
    with tempfile.TemporaryDirectory(prefix="trl_losses-") as work:
        ids = store_ids(Path(work))
    build_sppo_policy(ids, ASSETS / "reference", ASSETS / "policy", ASSETS / "policy_sppo", log)


# ------------------------------------------------------------------------------------------------ TRL


def store_ids(work: Path) -> list[dict]:
    """The ids `prefpack prepare` stores for the pairs (what TRL's own ids must equal)."""
    import numpy as np

    from prefpack.data.prepare import PrepareOptions, prepare
    from prefpack.data.store import Store

    prepare(PrepareOptions(inputs=[str(ASSETS / "pairs.jsonl")], tokenizer=str(ASSETS / "tokenizer"),
                           output=str(work / "store"), max_length=MAX_LENGTH, overwrite=True, workers=1),
            log=lambda m: None)
    store = Store(work / "store")
    assert not np.asarray(store.index[:, 4]).any(), "prepare truncated a pair"
    return [{k: np.asarray(getattr(store.pair(i), k)).tolist() for k in ("prompt", "chosen", "rejected")}
            for i in range(len(store))]


def one_batch_eval_config(work: Path, loss_type: str, settings: dict, n: int, dtype: str):
    """TRL's DPOConfig for evaluating ``n`` pairs as ONE batch on the CPU (float32 models loaded by TRL itself in
    sdpa; float64 ones handed over loaded), no training, nothing saved or reported (trl_vision_losses.py too)."""
    from trl import DPOConfig

    return DPOConfig(
        output_dir=str(work / "trl"), loss_type=[loss_type], **settings,
        per_device_train_batch_size=n, per_device_eval_batch_size=n, prediction_loss_only=True,
        bf16=False, fp16=False, use_cpu=True, seed=SEED, report_to="none", disable_tqdm=True, save_strategy="no",
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": dtype, "attn_implementation": "sdpa"} if dtype == "float32" else None,
    )


def trl_case(loss_type: str, settings: dict, pairs: list[dict], work: Path, policy: str = "policy",
             dtype: str = "float32") -> tuple[dict, list[dict]]:
    """TRL's eval loss and metrics of one loss type on every pair in one batch, and the ids TRL used."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import DPOTrainer

    tok = AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    ref = AutoModelForCausalLM.from_pretrained(ASSETS / "reference", dtype=getattr(torch, dtype),
                                               attn_implementation="sdpa")
    args = one_batch_eval_config(work, loss_type, settings, len(pairs), dtype)
    ds = Dataset.from_list(pairs)
    # TRL's ordinary path loads the policy from its folder; its model_init_kwargs refuse float64, so the float64
    # diagnostic hands it the loaded model
    model = str(ASSETS / policy) if dtype == "float32" else AutoModelForCausalLM.from_pretrained(
        ASSETS / policy, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=ds, eval_dataset=ds,
                         processing_class=tok)
    trainer.remove_callback(PrinterCallback)  # disable_tqdm=True would print every metrics dict
    batches = list(trainer.get_eval_dataloader())
    assert len(batches) == 1 and batches[0]["input_ids"].shape[0] == 2 * len(pairs), "not one batch of all pairs"
    metrics = trainer.evaluate()
    used = [{k: list(trainer.eval_dataset[i][f"{k}_ids"]) for k in ("prompt", "chosen", "rejected")}
            for i in range(len(trainer.eval_dataset))]
    return metrics, used


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rebuild-assets", action="store_true",
                    help="build tokenizer, weights and pairs again (else reuse tests/data/trl_losses/)")
    ap.add_argument("--output", default=str(OUT), help="where the JSON goes (default: tests/data/trl_losses.json)")
    a = ap.parse_args()
    for k, v in {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
                 "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "CUDA_VISIBLE_DEVICES": ""}.items():
        os.environ.setdefault(k, v)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    warnings.simplefilter("ignore", FutureWarning)  # transformers' and TRL's deprecation notices
    try:
        import trl
    except ImportError:
        raise SystemExit("TRL is not installed: pip install -e '.[bench]'") from None
    import torch
    import transformers
    from trl.trainer.dpo_config import DPOConfig

    t0 = time.perf_counter()
    log = print
    defaults = DPOConfig(output_dir=tempfile.gettempdir(), use_cpu=True, report_to="none")
    got = {k: getattr(defaults, k) for k in TRL_DEFAULTS}
    if got != TRL_DEFAULTS:
        raise SystemExit(f"this TRL's DPOConfig defaults are {got}, the script expects {TRL_DEFAULTS}")
    ensure_assets(a.rebuild_assets, log)
    pairs = [json.loads(x) for x in (ASSETS / "pairs.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]
    results, used_ids = [], None
    with tempfile.TemporaryDirectory(prefix="trl_losses-") as tmp:
        work = Path(tmp)
        ours = store_ids(work)
        for loss_type, changed in CASES:
            settings = {**TRL_DEFAULTS, **changed}
            policy = POLICY.get(loss_type, "policy")
            metrics, used = trl_case(loss_type, settings, pairs, work, policy)
            if used != ours:
                bad = [f"pair {i} {k}" for i, (u, o) in enumerate(zip(used, ours)) for k in u if u[k] != o[k]]
                raise SystemExit(f"TRL tokenised the pairs unlike prefpack's store: {bad or 'pair count'}")
            used_ids = used
            cid = case_id(loss_type, changed)
            loss = float(metrics["eval_loss"])
            exact = float(trl_case(loss_type, settings, pairs, work, policy, dtype="float64")[0]["eval_loss"])
            log(f"  {cid:<38} TRL loss {loss:.7f} (float64: {exact:.7f}, float32 error {loss - exact:+.1e})")
            results.append({
                "id": cid, "trl_loss_type": loss_type, "prefpack_loss": PREFPACK_NAME.get(loss_type, loss_type),
                "policy": policy, "trl_defaults": not changed, "settings": settings, "reads": list(READS[loss_type]) + [k for k in changed if k in TRL_OPTIONS],
                "reduction": REDUCTION.get(loss_type, "mean over pairs of a per-pair loss"), "loss": loss,
                "loss_float64": exact,
                "metrics": {k.removeprefix("eval_"): v for k, v in sorted(metrics.items())
                            if k.startswith(("eval_rewards/", "eval_logps/"))},
            })
    accepted = sorted(READS)
    doc = {
        "what": "TRL DPOTrainer.evaluate() loss for each loss type on the pairs and weights in "
                "tests/data/trl_losses/ (one eval batch holding every pair; float32, CPU; loss_float64: the same "
                "on float64 copies of the weights); checked by tests/test_trl_numbers.py",
        "command": "python benchmarks/trl_losses.py" + (" " + shlex.join(sys.argv[1:]) if sys.argv[1:] else ""),
        "trl_version": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "trl_loss_types": accepted,
        "trl_config": {"bf16": False, "attn_implementation": "sdpa", "dtype": "float32", "device": "cpu",
                       "per_device_eval_batch_size": len(pairs), "max_length": defaults.max_length,
                       "ld_alpha": None, "f_divergence_type": "reverse_kl", "use_weighting": False},
        "assets": {"dir": str(ASSETS.relative_to(REPO)),
                   "tokenizer": f"toy llama-style byte-level BPE, {VOCAB} tokens",
                   "model": {"type": "llama", **MODEL, "seed": SEED, "policy_noise": NOISE,
                             "policy_sppo_target": SPPO_POLICY_TARGET},
                   "pairs": len(pairs), "source": str(DATA.relative_to(REPO)), "prepare_max_length": MAX_LENGTH},
        "token_ids": used_ids,
        "cases": results,
    }
    Path(a.output).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    log(f"wrote {a.output} ({len(results)} cases, {len(accepted)} loss types) in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
