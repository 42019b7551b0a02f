"""One GRPO loss step (forward + backward, no optimizer step), tokens/s and peak memory: prefpack's
``train.objective=policy_gradient`` with each prompt laid out once for its k completions, the same with every
completion alone (its own copy of the prompt), and TRL 1.16's ``GRPOTrainer._compute_loss`` + backward on the same
model and samples. Generation is excluded on both sides. Not a test: run it by hand, paste the table into
benchmarks/README.md.

Samples (seeded): ``--prompts`` P prompts of random ids, each ``--prompt-len LO,HI`` tokens long, each with k
completions of ``--completion-len LO,HI`` random ids ending with EOS, and a random reward per completion. They are
written as a ranked store with prefpack's ``StoreWriter`` (as tests/test_pg_trl.py does) and handed to TRL as the
same ids through its ``rollout_func`` hook, so TRL's own ``_generate_and_score_completions`` builds its padded batch
(prompts left-padded, completions right-padded, GRPO advantages from the rewards), as benchmarks/trl_pg.py does.

Model: a Qwen2-style causal LM from a config (``--model-size``; or ``--model PATH``), saved once; the old policy is
a seeded perturbation of it (so ratios differ from 1 and the clip acts). Both sides read the old policy's per-token
log-probs computed before the timed steps (prefpack: ``GroupPolicyTask._start``, ``loss.old_logprobs=recompute``;
TRL: its ``_get_per_token_logps_and_entropies`` on the old model into ``old_per_token_logps``), not timed. Same
loss on both sides: ``--loss`` (grpo: per-completion token mean), ``scale_rewards=group``, epsilon 0.2, beta 0 (no
reference model), no gradient checkpointing (TRL's GRPOConfig default is on: set off), dropout off. Float32 on
CPU; on CUDA bf16 autocast over float32 weights on both sides (TRL ``bf16=True``, prefpack ``model.dtype=auto``).

Micro-batches (``--micro-batch``): ``step`` (default) = the step is ONE micro-batch on every side: TRL
``per_device_train_batch_size = P x k``, gradient accumulation 1 (one forward over the padded [P*k, Pmax + Cmax]
batch); prefpack's budgets (``train.micro_batch_tokens``, ``data.max_tokens_per_row``) set to hold the whole step in
one packed row (``--row-tokens N``: rows of at most N positions, a prompt's group never split). ``prompt`` = one
prompt's k samples a micro-batch, P of them: TRL per-device batch k with gradient accumulation P
(``current_gradient_accumulation_steps = P``, k-row slices of the batch padded once, as TRL slices its generation
batch); prefpack one prompt's group planned per micro-batch (the step's counts from ``plan_step`` over all P, as the
loop does). The same loss either way. Attention: sdpa for TRL, prefpack's CPU default ``packed_sdpa`` (``varlen``
on CUDA).

Each side runs in its own process. Per k and side: ``--warmup`` untimed steps, then ``--steps`` timed steps
(median and min-max; ``--repeats N``: the sides alternate N times and each keeps its run with the fastest median,
as on a shared machine the load moves between runs). tokens/s counts real tokens (prompt + completion of every
sample, the same on every side) over the median step; "positions" is what the body computed per step (TRL: its
padded batch; prefpack: its packed rows, padding included). Peak memory: on CPU the process's RSS high-water mark
over the timed steps less its RSS before them (the mark reset through /proc/self/clear_refs); on CUDA
``torch.cuda.max_memory_allocated`` less the allocation before the steps (both given). The first step's loss of
every side is printed; prefpack's must equal TRL's within ``--loss-tol`` (float32) or 100 times it (bf16), else the
script says the losses differ.

    PYTHONPATH=/tmp/trl116:. python benchmarks/grpo_step.py [--k 8,16] [--steps 3] [--device cpu] [--json PATH]
    # the figures in benchmarks/README.md: --k 8,16 --prompts 2 --threads 1 (15 minutes on 2 shared cores)

Without TRL importable the two prefpack sides run and one line says TRL is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NEOX = REPO / "examples" / "tokenizers" / "gpt-neox-20b"  # bundled: TRL needs a tokenizer (pad id, decoding)
SIDES = ("once", "alone", "trl")
LABEL = {"once": "prefpack, prompts once", "alone": "prefpack, each sample alone", "trl": "TRL 1.16 GRPOTrainer"}
# Qwen2-style configs: (hidden, layers, heads, kv heads, intermediate, vocabulary, tied embeddings)
SIZES = {"tiny": (64, 2, 4, 2, 128, 32000, False), "small": (256, 4, 4, 2, 1024, 32000, False),
         "0.5b": (896, 24, 14, 2, 4864, 151936, True)}  # 0.5b = Qwen2.5-0.5B's shape (494M parameters)
EPSILON = 0.2


def rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak(device: str) -> float:
    """Reset the peak memory mark; returns the memory held now (MiB)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**20
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    except OSError:
        pass
    return rss_mib("VmRSS")


def peak(device: str) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return rss_mib("VmHWM")


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------ set-up


def build(work: Path, a) -> dict:
    """The model folders (policy, old policy), the samples (ids, rewards) and one ranked store per k."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tok = AutoTokenizer.from_pretrained(NEOX)
    if a.model:
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    else:
        hidden, layers, heads, kv, inter, vocab, tied = SIZES[a.model_size]
        hidden, layers = a.hidden or hidden, a.layers or layers
        heads = max(1, hidden // 64) if a.hidden else heads
        kv = heads if a.hidden else kv
        mlp = (a.intermediate or 4 * hidden) if a.hidden else (a.intermediate or inter)
        cfg = Qwen2Config(vocab_size=a.vocab or vocab, hidden_size=hidden, intermediate_size=mlp,
                          num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=kv, max_position_embeddings=4096, tie_word_embeddings=tied,
                          initializer_range=0.1,  # peaked next-token distributions, so the old policy's ratios spread
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(work / "policy")
    tok.save_pretrained(work / "policy")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the old policy: every weight moved by a seeded --old-noise of its own spread
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (a.old_noise * float(p.float().std()) if p.numel() > 1 else 0))
    model.save_pretrained(work / "old")
    vocab = model.config.vocab_size
    params = sum(p.numel() for p in model.parameters())
    del model

    rng = random.Random(a.seed)
    draw = range(2, min(vocab, len(tok)))  # no BOS/EOS (0) nor pad (1) inside a prompt or completion
    kmax = max(a.k)
    prompts = [[rng.choice(draw) for _ in range(rng.randint(*a.prompt_len))] for _ in range(a.prompts)]
    completions = [[[rng.choice(draw) for _ in range(rng.randint(*a.completion_len) - 1)] + [tok.eos_token_id]
                    for _ in range(kmax)] for _ in range(a.prompts)]
    rewards = [[round(rng.uniform(0, 1), 4) for _ in range(kmax)] for _ in range(a.prompts)]
    samples = {"prompts": prompts, "completions": completions, "rewards": rewards, "vocab": vocab, "params": params,
               "eos": tok.eos_token_id, "pad": tok.pad_token_id}
    for k in a.k:
        write_store(work / f"ranked_k{k}", prompts, [c[:k] for c in completions], [r[:k] for r in rewards], tok)
    (work / "samples.json").write_text(json.dumps(samples))
    return samples


def write_store(path: Path, prompts, completions, rewards, tok) -> None:
    """The samples as ``prefpack score`` writes a ranked store (as tests/test_pg_trl.py's ``_ranked_store``)."""
    import numpy as np

    from prefpack.data.store import StoreWriter
    from prefpack.rewards.output import score_bits

    writer = StoreWriter(path, kind="ranked", vocab_size=len(tok), log=None)
    try:
        for g, prompt in enumerate(prompts):
            flat, index = list(prompt), []
            for ids, r in zip(completions[g], rewards[g]):
                index.append([len(flat), len(prompt), len(ids), score_bits(r), 0, 0, 0, g])
                flat.extend(ids)
            writer.append(np.asarray(flat, dtype=np.int64), np.asarray(index, dtype=np.int64), None)
        tok.save_pretrained(writer.tmp / "tokenizer")
        writer.commit({"layout": "scored", "tokenizer": {"vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
                                                         "eos_token_id": tok.eos_token_id,
                                                         "pad_token_id": tok.pad_token_id},
                       "sources": [{"path": "benchmarks/grpo_step.py", "rows": len(prompts)}]})
    except BaseException:
        writer.abort()
        raise


# ------------------------------------------------------------------------------------------------ workers


def time_steps(a, step, zero) -> dict:
    """``--warmup`` + ``--steps`` calls of ``step()`` (returns the loss), each after ``zero()``; peak memory over the
    timed ones."""
    first = None
    for _ in range(a.warmup):
        zero()
        loss = step()
        first = loss if first is None else first
    zero()
    held = reset_peak(a.device)
    times = []
    for _ in range(a.steps):
        zero()
        sync(a.device)
        t0 = time.perf_counter()
        loss = step()
        sync(a.device)
        times.append(time.perf_counter() - t0)
        first = loss if first is None else first
    top = peak(a.device)
    out = {"times": times, "first_loss": first, "held_mib": held, "peak_mib": top, "peak_delta_mib": top - held}
    if a.profile:  # one more step under torch.profiler: where the time goes, by op (self time)
        from torch.profiler import ProfilerActivity, profile

        zero()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
        with profile(activities=acts) as prof:
            step()
            sync(a.device)
        key = "self_cuda_time_total" if a.device == "cuda" else "self_cpu_time_total"
        out["profile"] = prof.key_averages().table(sort_by=key, row_limit=a.profile)
    return out


def run_prefpack(a, shared: bool) -> dict:
    import numpy as np
    import torch

    from prefpack.config import load_config
    from prefpack.data.store import Store
    from prefpack.model import SequenceLogps, load_causal_lm
    from prefpack.objectives import config_terms, settings_from_config
    from prefpack.objectives.pg import GroupPolicyTask
    from prefpack.precision import resolve_precision
    from prefpack.reference import NoReference

    device = torch.device(a.device)
    kernel = "varlen" if a.device == "cuda" else "packed_sdpa"
    precision = resolve_precision("auto", "auto", device)  # CPU: float32; CUDA: bf16 autocast, float32 weights
    store = Store(Path(a.work) / f"ranked_k{a.k_one}")
    whole = 1 << 30  # budgets that hold the whole step: one micro-batch of one packed row (unless --row-tokens)
    cfg = load_config(None, ["train.objective=policy_gradient", f"loss.terms=[{{name: {a.loss}}}]",
                             f"data.prefix_sharing={str(shared).lower()}", "data.packing=true",
                             f"loss.epsilon={EPSILON}", f"loss.epsilon_high={EPSILON}", "loss.kl_coef=0.0",
                             "loss.scale_rewards=group", f"loss.max_completion_length={a.completion_len[1]}",
                             "loss.old_logprobs=recompute"])
    settings = settings_from_config(cfg, pad_id=int(a.pad), micro_batch_tokens=whole,
                                    row_tokens=a.row_tokens or whole, chunk_size=a.chunk_size, shares_prompts=shared)
    task = GroupPolicyTask(store, settings, config_terms(cfg))
    old = load_causal_lm(str(Path(a.work) / "old"), attn_implementation=kernel, device=device, precision=precision)
    old.eval().requires_grad_(False)
    task._start(SequenceLogps(old, chunk_size=a.chunk_size, token_logps=True), NoReference())  # untimed
    del old
    model = load_causal_lm(str(Path(a.work) / "policy"), attn_implementation=kernel, device=device,
                           precision=precision)
    model.train()
    module = SequenceLogps(model, chunk_size=a.chunk_size, token_logps=True, entropy=True)
    reference = NoReference()
    ids = np.arange(len(task))
    t0 = time.perf_counter()
    task.plan_step(ids, seed=None)  # the whole step's counts (dapo/bnpo), before any split, as the loop does
    plans = task.plan(ids, seed=None) if a.micro_batch == "step" else [
        p for i in ids for p in task.plan(ids[i:i + 1], seed=None)]  # "prompt": one prompt's k samples each
    batches = [task.collate(p).to(device) for p in plans]
    collate_s = time.perf_counter() - t0
    units = task.units(ids)
    clip = []

    def step() -> float:
        total = 0.0
        for batch in batches:
            out = task.loss(module, reference, batch, None)
            loss = out.loss.sum() / units
            loss.backward()
            total += float(loss.detach())
            clip.append(float(out.metrics["clip_ratio/region"].double().mean()))
        return total

    result = time_steps(a, step, lambda: model.zero_grad(set_to_none=True))
    result.update(positions=int(sum(b.input_ids.numel() for b in batches)), micro_batches=len(plans),
                  rows=int(sum(b.input_ids.size(0) for b in batches)),
                  laid_out=int(sum(int(b.token_mask.sum()) for b in batches)), collate_s=collate_s,
                  clip_fraction=clip[0] if clip else None, kernel=kernel)
    return result


def run_trl(a) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    samples = json.loads((Path(a.work) / "samples.json").read_text())
    k = a.k_one
    prompts = samples["prompts"]
    completions = [c for group in samples["completions"] for c in group[:k]]
    rewards = [r for group in samples["rewards"] for r in group[:k]]
    names = [f"prompt {i}" for i in range(len(prompts))]
    by_name = dict(zip(names, prompts))
    tok = AutoTokenizer.from_pretrained(NEOX)
    cuda = a.device == "cuda"

    def rollout(batch_prompts, trainer):  # TRL's own hook: the fixed samples instead of generating
        return {"prompt_ids": [list(by_name[p]) for p in batch_prompts], "completion_ids": completions,
                "logprobs": None}

    def fixed_reward(completions, **kwargs):
        return list(rewards)

    args = GRPOConfig(output_dir=str(Path(a.work) / "trl_out"), per_device_train_batch_size=len(completions),
                      num_generations=k, max_completion_length=a.completion_len[1], gradient_accumulation_steps=1,
                      steps_per_generation=1, loss_type=a.loss, beta=0.0, epsilon=EPSILON, scale_rewards="group",
                      mask_truncated_completions=False, gradient_checkpointing=False, disable_dropout=True,
                      bf16=cuda, use_cpu=not cuda, report_to=[], seed=0, save_strategy="no", logging_steps=1,
                      disable_tqdm=True, use_vllm=False,
                      model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"})
    trainer = GRPOTrainer(model=str(Path(a.work) / "policy"), reward_funcs=fixed_reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": names}), processing_class=tok,
                          rollout_func=rollout)
    trainer.remove_callback(PrinterCallback)
    model = trainer.model
    model.train()
    split = len(prompts) if a.micro_batch == "prompt" else 1
    trainer.current_gradient_accumulation_steps = split
    rows = [{"prompt": n} for n in names for _ in range(k)]
    batch = trainer._generate_and_score_completions(rows)  # TRL's padded batch, advantages; not timed
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    keep = batch["completion_ids"].size(1)
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(Path(a.work) / "old", dtype=torch.float32,
                                               attn_implementation="sdpa").to(model.device).eval()
    from trl.trainer.utils import add_fused_lm_head  # as TRL sets up its own models (ref model included)

    add_fused_lm_head(old, temperature=trainer.temperature, cast_lm_head_to_fp32=args.cast_lm_head_to_fp32)
    with torch.no_grad():  # the old policy's per-token log-probs, TRL's own code, untimed
        batch["old_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
            old, input_ids, attention_mask, keep, batch_size=input_ids.size(0))[0]
    del old
    trainer._metrics["train"].clear()

    rows_all = input_ids.size(0)
    # "prompt": k rows a micro-batch (per_device_train_batch_size = k, gradient accumulation P), sliced from the
    # batch padded once, as TRL slices its generation batch
    parts = [{key: v[i * k:(i + 1) * k] if torch.is_tensor(v) and v.dim() and v.size(0) == rows_all else v
              for key, v in batch.items()} for i in range(split)] if split > 1 else [batch]

    def step() -> float:
        total = 0.0
        for part in parts:
            loss = trainer._compute_loss(model, part)
            loss.backward()
            total += float(loss.detach())
        return total

    result = time_steps(a, step, lambda: model.zero_grad(set_to_none=True))
    clip = trainer._metrics["train"].get("clip_ratio/region_mean")
    result.update(positions=int(input_ids.numel()), micro_batches=len(parts), rows=int(input_ids.size(0)),
                  padded_width=int(input_ids.size(1)), trl_version=trl.__version__,
                  clip_fraction=clip[0] if clip else None)
    return result


def worker(a) -> None:
    import torch

    torch.set_num_threads(a.threads)
    out = run_trl(a) if a.worker == "trl" else run_prefpack(a, shared=a.worker == "once")
    print("RESULT " + json.dumps(out))


def launch(a, side: str, k: int, work: Path, pad: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--k-one", str(k), "--work", str(work), "--pad", str(pad),
           "--device", a.device, "--threads", str(a.threads), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--loss", a.loss, "--completion-len", f"{a.completion_len[0]},{a.completion_len[1]}",
           "--row-tokens", str(a.row_tokens), "--chunk-size", str(a.chunk_size), "--micro-batch", a.micro_batch,
           "--profile", str(a.profile)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "PYTHONWARNINGS": "ignore", "TRL_EXPERIMENTAL_SILENCE": "1"}
    if a.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"{side} k={k} failed (exit {proc.returncode}): {' '.join(cmd)}")
    return json.loads(lines[-1][len("RESULT "):])


def trl_available() -> str | None:
    """TRL's version, or None where it is not importable (checked in a child, as the workers import it)."""
    proc = subprocess.run([sys.executable, "-c", "import trl, datasets; print(trl.__version__)"], capture_output=True,
                          text=True, env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"})
    return proc.stdout.strip() if proc.returncode == 0 else None


def pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", default="8,16", help="completions per prompt, comma-separated")
    ap.add_argument("--prompts", type=int, default=2, help="prompts P per step (the step: P x k samples)")
    ap.add_argument("--prompt-len", type=pair, default=(256, 512), help="prompt tokens, LO,HI (uniform)")
    ap.add_argument("--completion-len", type=pair, default=(64, 256), help="completion tokens, LO,HI (uniform)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per side, alternating; each side keeps its fastest (shared machines)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model-size", choices=tuple(SIZES), default="small",
                    help="Qwen2-style from a config: tiny (64h x 2L), small (256h x 4L; the CPU default), 0.5b "
                    "(Qwen2.5-0.5B's shape); vocabulary 32,000 (0.5b: 151,936)")
    ap.add_argument("--hidden", type=int, help="override the size's hidden (heads = hidden / 64, MLP 4 x hidden)")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--model", help="a causal LM folder instead of a config (its weights; the tokenizer stays the "
                    "bundled GPT-NeoX one, ids drawn below both vocabularies)")
    ap.add_argument("--loss", choices=("grpo", "dr_grpo", "dapo", "bnpo"), default="grpo")
    ap.add_argument("--sides", default=",".join(SIDES), help="once,alone,trl")
    ap.add_argument("--micro-batch", choices=("step", "prompt"), default="step",
                    help="step: the whole step in one micro-batch on every side (TRL per-device batch P x k); prompt: "
                    "one prompt's k samples a micro-batch (TRL per-device batch k, gradient accumulation P)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (1: shared cores)")
    ap.add_argument("--row-tokens", type=int, default=0,
                    help="prefpack's packed row budget (data.max_tokens_per_row); 0: the whole step in one row")
    ap.add_argument("--chunk-size", type=int, default=1024, help="prefpack's head chunk (train.chunk_size)")
    ap.add_argument("--loss-tol", type=float, default=1e-5, help="prefpack vs TRL first-step loss, absolute, float32")
    ap.add_argument("--old-noise", type=float, default=0.1,
                    help="the old policy: each weight + this fraction of its tensor's spread, seeded")
    ap.add_argument("--profile", type=int, default=0, help="N > 0: one more step per side under torch.profiler, "
                    "its N costliest ops (self time) printed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the result here")
    for hidden in ("--worker", "--work", "--k-one", "--pad"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        a.k_one = int(a.k_one)
        return worker(a)
    a.k = [int(x) for x in a.k.split(",")]
    sides = [s for s in a.sides.split(",") if s]
    trl_version = trl_available() if "trl" in sides else None
    if "trl" in sides and trl_version is None:
        print("TRL is missing (not importable: PYTHONPATH=/path/to/trl-1.16:. to add it): running prefpack's two "
              "sides only", flush=True)
        sides = [s for s in sides if s != "trl"]

    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="grpo_step_"))
    samples = build(work, a)
    import torch
    import transformers

    load = os.getloadavg()
    result = {"bench": "grpo_step", "date": date.today().isoformat(), "argv": sys.argv[1:], "device": a.device,
              "dtype": "bf16 autocast over float32" if a.device == "cuda" else "float32",
              "torch": torch.__version__, "transformers": transformers.__version__, "trl_version": trl_version,
              "machine": platform.machine(), "cpus": os.cpu_count(), "threads": a.threads,
              "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else None,
              "model": a.model or a.model_size, "params": samples["params"], "vocab": samples["vocab"],
              "prompts": a.prompts, "micro_batch": a.micro_batch, "prompt_len": a.prompt_len,
              "completion_len": a.completion_len, "loss": a.loss,
              "memory": "cuda max_memory_allocated" if a.device == "cuda" else "RSS high-water mark (VmHWM)",
              "load_before": load, "cases": {}}
    print(f"model {result['model']}: {samples['params'] / 1e6:.1f}M parameters, vocabulary {samples['vocab']:,}; "
          f"{a.prompts} prompts of {a.prompt_len[0]}-{a.prompt_len[1]} tokens, completions {a.completion_len[0]}-"
          f"{a.completion_len[1]}; {a.device} {result['dtype']}, {a.threads} threads; load {load[0]:.1f}", flush=True)
    for k in a.k:
        real = sum(len(p) + len(c) for p, group in zip(samples["prompts"], samples["completions"]) for c in group[:k])
        case = {"real_tokens": real, "samples": a.prompts * k, "sides": {}}
        for rep in range(a.repeats):  # the sides alternate; each keeps its run with the fastest median step
            for side in sides:
                r = launch(a, side, k, work, samples["pad"])
                med = statistics.median(r["times"])
                r.update(median_s=med, min_s=min(r["times"]), max_s=max(r["times"]), tokens_per_s=real / med,
                         tokens_per_position=real / r["positions"], load=os.getloadavg()[0])
                best = case["sides"].get(side)
                r["medians_of_runs"] = [*(best["medians_of_runs"] if best else []), med]
                if best is None or med < best["median_s"]:
                    case["sides"][side] = r
                else:
                    best["medians_of_runs"] = r["medians_of_runs"]
                table = r.pop("profile", None)
                if table:
                    print(f"  k={k} {LABEL[side]}: torch.profiler, one step\n{table}", flush=True)
                print(f"  k={k} {LABEL[side]} (run {rep + 1}): {med:.2f} s ({min(r['times']):.2f}-"
                      f"{max(r['times']):.2f}), loss {r['first_loss']:+.8f}, load {r['load']:.1f}", flush=True)
        s = case["sides"]
        ratios = {}
        if "once" in s and "alone" in s:
            ratios["once_vs_alone_speed"] = s["once"]["tokens_per_s"] / s["alone"]["tokens_per_s"]
            ratios["once_vs_alone_memory"] = s["once"]["peak_delta_mib"] / s["alone"]["peak_delta_mib"]
        tol = a.loss_tol * (1 if a.device == "cpu" else 100)
        for side in ("once", "alone"):
            if side in s and "trl" in s:
                ratios[f"{side}_vs_trl_speed"] = s[side]["tokens_per_s"] / s["trl"]["tokens_per_s"]
                ratios[f"{side}_vs_trl_memory"] = s[side]["peak_delta_mib"] / s["trl"]["peak_delta_mib"]
                diff = s[side]["first_loss"] - s["trl"]["first_loss"]
                ratios[f"{side}_loss_diff_vs_trl"] = diff
                case.setdefault("loss_agrees", True)
                case["loss_agrees"] = case["loss_agrees"] and abs(diff) <= tol
        case["ratios"], case["loss_tolerance"] = ratios, tol
        result["cases"][str(k)] = case

    mem = "peak alloc" if a.device == "cuda" else "peak RSS"
    print(f"\n{'k':>3} {'side':<28} {'tokens/s':>10} {'step s (min-max)':>18} {'positions':>10} {'tok/pos':>7} "
          f"{mem + ' +MiB':>14} {'(abs)':>8} {'first loss':>13}")
    for k, case in result["cases"].items():
        for side, r in case["sides"].items():
            print(f"{k:>3} {LABEL[side]:<28} {r['tokens_per_s']:>10,.0f} {r['median_s']:>7.2f} ({r['min_s']:.2f}-"
                  f"{r['max_s']:.2f}) {r['positions']:>10,} {r['tokens_per_position']:>7.2f} "
                  f"{r['peak_delta_mib']:>14,.0f} {r['peak_mib']:>8,.0f} {r['first_loss']:>+13.8f}")
        print(f"    {case['samples']} samples, {case['real_tokens']:,} real tokens a step; "
              + ", ".join(f"{n} {v:.2f}x" if "diff" not in n else f"{n} {v:+.1e}" for n, v in case["ratios"].items()))
        if "loss_agrees" in case:
            print(f"    first-step loss, prefpack vs TRL: {'agrees' if case['loss_agrees'] else 'DIFFERS'} within "
                  f"{case['loss_tolerance']:.0e} (absolute)")
    result["load_after"] = os.getloadavg()
    result["wall_s"] = time.perf_counter() - t_start
    line = json.dumps(result)
    if a.json:
        Path(a.json).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
