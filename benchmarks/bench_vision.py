"""prefpack against TRL 1.16's DPOTrainer on image pairs (issue 27): tokens/s, peak memory, vision-tower work per
pair and the losses step by step, same tiny Qwen2-VL and the same pairs, on CPU (or CUDA).

Model: the tiny Qwen2-VL of tests/data/trl_vision (benchmarks/trl_vision_losses.py; `prefpack.toy_vision.tiny_vlm`
with re-drawn weights): the `policy` folder is trained, the `reference` folder is the frozen reference of both
(TRL: `ref_model`; prefpack: `reference.mode=copy`, `reference.model`), so the first step's loss is not ln 2 and
already shows whether both compute the same thing. Pairs: `--pairs` rows in TRL's vision layout generated here
(trl_vision_losses.make_rows: 1 or 2 blocky PNGs of `--sizes` px per prompt), prepared for prefpack with
`prepare --processor tests/data/trl_vision/processor`; TRL reads the same rows with the images loaded (PIL) and a
Qwen2VLProcessor over the same folder. The TRL run checks the ids its collator produced against the store.
`--model llava` runs the tiny LLaVA of tests/data/trl_vision/llava (its LlavaProcessor folder) instead; while
`prepare --processor` does not read a LlavaProcessor folder there is no store, so the prefpack side and the ids
check are skipped.

Both train `--steps` optimizer steps of `--batch-pairs` pairs in file order (TRL `train_sampling_strategy=
"sequential"`, prefpack `data.shuffle=false`), AdamW lr `--lr` linear to 0, no warmup, weight decay 0, clipping 1.0,
float32, DPO sigmoid beta 0.1. The vision tower and the merger are frozen in both (prefpack's default
`model.freeze_vision` / `model.freeze_projector`; TRL trains them unless told, so their parameters get
`requires_grad=False` there); `--train-vision` trains them in both. TRL runs as it comes (gradient checkpointing
on, its default) and with it off. Each run is its own process (peak memory = process RSS on CPU, max allocated on
CUDA; the table also shows the RSS peak less the RSS just before the trainer is built, after the imports: about
450 MiB of the peak is torch, transformers and datasets alone).

Vision-tower work is counted by wrapping Qwen2-VL's vision tower forward (the class, so every instance: policy
and reference) in each process: calls, images and patches encoded, per step and per pair. TRL encodes each prompt's
images once per sequence, i.e. twice per pair, in the policy and again in the reference: 4 encodings per image;
prefpack aims at one per image per model (2 with a copy reference).

tokens/s counts real tokens (prompt + chosen and prompt + rejected of each pair, image tokens included) over every
step but the first (warm-up); a step is timed from the end of the previous one, so collation (TRL decodes and
preprocesses the images in its collator) counts for both.

The prefpack side needs `prefpack train` on image stores (the training half of issue 27): until
`prefpack.objectives.select.open_store` accepts an image store it is skipped with that message, and only the TRL
runs are measured.

    pip install -e '.[bench]'
    python benchmarks/bench_vision.py [--model qwen2_vl|llava] [--pairs 64] [--batch-pairs 8] [--steps 8]
        [--repeats 1] [--runs prefpack,trl,trl_no_gc] [--train-vision] [--device cpu] [--threads 1]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trl_vision_losses import KINDS, make_rows, quiet_env, trl_dataset, trl_processor  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RUNS = ("prefpack", "trl", "trl_no_gc")
LABELS = {"prefpack": "prefpack", "trl": "TRL (defaults: grad. ckpt on)", "trl_no_gc": "TRL (grad. ckpt off)"}


# ------------------------------------------------------------------------------------------------ measuring


class VisionCounter:
    """Counts the vision tower's forward calls, images and patches, over every instance of the tower's class:
    Qwen2-VL's vision transformer (flattened patches and a (t, h, w) grid per image) or LLaVA's CLIP vision model
    (one [3, H, W] image per row)."""

    def __init__(self, kind: str):
        self.calls = self.images = self.patches = 0
        self.by_module: dict[int, int] = {}
        if kind == "qwen2_vl":
            from transformers.models.qwen2_vl.modeling_qwen2_vl import (
                Qwen2VisionTransformerPretrainedModel as cls,
            )
        else:
            from transformers.models.clip.modeling_clip import CLIPVisionModel as cls
        original = cls.forward
        counter = self

        @functools.wraps(original)
        def counted(module, *args, **kwargs):
            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("pixel_values"))
            counter.calls += 1
            counter.by_module[id(module)] = counter.by_module.get(id(module), 0) + 1
            if kind == "qwen2_vl":
                grid = args[1] if len(args) > 1 else kwargs.get("grid_thw")
                counter.images += int(grid.shape[0]) if grid is not None else 0
                counter.patches += int(x.shape[0])
            else:
                patch = module.config.patch_size
                counter.images += int(x.shape[0])
                counter.patches += int(x.shape[0]) * (x.shape[-2] // patch) * (x.shape[-1] // patch)
            return original(module, *args, **kwargs)

        cls.forward = counted

    def snapshot(self) -> tuple[int, int, int]:
        return self.calls, self.images, self.patches


def current_rss_mib() -> float:
    """This process's resident memory now (Linux), to set the peak against what the imports alone hold."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def peak_memory_mib(device: str) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def summarise(step_times, step_tokens, computed, losses, logps, vision_steps, pairs_per_step,
              images_per_pair: float) -> dict:
    """tokens/s over every step but the first (warm-up)."""
    timed = slice(1, None) if len(step_times) > 1 else slice(None)
    secs, toks = sum(step_times[timed]), sum(step_tokens[timed])
    calls = sum(v[0] for v in vision_steps)
    images = sum(v[1] for v in vision_steps)
    patches = sum(v[2] for v in vision_steps)
    pairs = max(pairs_per_step * len(vision_steps), 1)
    rates = sorted(n / t for n, t in zip(step_tokens[timed], step_times[timed]) if t > 0)
    return {"tokens_per_s_median": rates[len(rates) // 2] if rates else float("nan"), "steps": len(step_times), "timed_steps": len(step_times[timed]), "seconds": secs, "real_tokens": toks,
            "tokens_per_s": toks / secs if secs > 0 else float("nan"),
            "filling": sum(step_tokens) / max(sum(computed), 1) if computed else None,
            "losses": losses, "first_loss": losses[0] if losses else float("nan"), "step_seconds": step_times,
            "logps": [list(x) for x in logps],
            "vision": {"calls_per_step": calls / max(len(vision_steps), 1), "calls_per_pair": calls / pairs,
                       "images_encoded_per_pair": images / pairs, "patches_per_pair": patches / pairs,
                       "encodings_per_image": images / pairs / images_per_pair if images_per_pair else None,
                       "per_step": [list(v) for v in vision_steps]}}


# ------------------------------------------------------------------------------------------------ workers


def images_per_pair(rows_path: str, pairs_seen: int) -> float:
    """Prompt images per pair over the pairs the run's steps read (in file order, starting over at the end)."""
    counts = [len(json.loads(x)["images"]) for x in Path(rows_path).read_text().splitlines() if x.strip()]
    seen = [counts[i % len(counts)] for i in range(pairs_seen)]
    return sum(seen) / max(len(seen), 1)


def prefpack_refusal(store: str) -> str | None:
    """Why prefpack cannot train on an image store yet (None once it can)."""
    from prefpack.data.store import StoreError
    from prefpack.objectives.select import open_store

    try:
        open_store(store, "train", unpaired=False)
    except StoreError as exc:
        if "image" in str(exc):
            return str(exc)
        raise
    return None


def run_prefpack(a) -> dict:
    import dataclasses

    import torch

    from prefpack.config import load_config
    from prefpack.config.schema import ModelConfig
    from prefpack.training import train

    torch.set_num_threads(a.threads)
    counter = VisionCounter(a.model)
    folder = KINDS[a.model][0]
    overrides = [f"model.name_or_path={folder / start_folder(a)}", f"data.train={a.store}", "data.shuffle=false",
                 f"train.global_batch_pairs={a.batch_pairs}", f"train.max_steps={a.steps}", "train.seed=0",
                 f"train.device={a.device}", "model.dtype=float32", "model.attn_implementation=auto",
                 f"optim.lr={a.lr}", "optim.schedule=linear", "optim.warmup_steps=0", "optim.max_grad_norm=1.0",
                 "optim.weight_decay=0.0", f"loss.beta={a.beta}", "reference.mode=copy",
                 f"reference.model={folder / 'reference'}",
                 f"run.output_dir={a.out}", "run.plot=false", "run.tensorboard=false", *a.override]
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for key in ("freeze_vision", "freeze_projector"):
        if key in fields:
            overrides.append(f"model.{key}={'false' if a.train_vision else 'true'}")
        elif a.train_vision:
            raise SystemExit(f"--train-vision: this prefpack has no model.{key}")
    cfg = load_config(None, overrides)
    rss_before = current_rss_mib()
    train(cfg, progress=False, log=lambda m: None)
    recs = [json.loads(line) for line in (Path(a.out) / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["split"] == "train"]
    times = [a.batch_pairs / r["pairs/s"] for r in recs]
    tokens = [round(r["tokens/s"] * t) for r, t in zip(recs, times)]
    computed = [round(n / r["filling"]) for r, n in zip(recs, tokens)] if recs and "filling" in recs[0] else []
    # prefpack's metrics are per optimizer step; the vision counts cover the whole run (no per-step split)
    calls, images, patches = counter.snapshot()
    n = max(len(recs), 1)
    per_step = [(calls / n, images / n, patches / n)] * len(recs)
    out = summarise(times, tokens, computed, [r["loss"] for r in recs],
                    [(r["logps/chosen"], r["logps/rejected"]) for r in recs], per_step, a.batch_pairs,
                    images_per_pair(a.rows, a.steps * a.batch_pairs))
    out["rss_before_mib"] = rss_before
    out["vision"]["models_calling"] = len(counter.by_module)
    return out


def run_trl(a) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForImageTextToText, TrainerCallback
    from trl import DPOConfig

    from prefpack.data.store import Store

    torch.set_num_threads(a.threads)
    counter = VisionCounter(a.model)
    folder = KINDS[a.model][0]
    rows = [json.loads(line) for line in Path(a.rows).read_text().splitlines() if line.strip()]
    record: dict = {"losses": [], "real": [], "computed": [], "times": [], "logps": [], "vision": []}

    from compare_trl import recording_trainer

    Recorder = recording_trainer(record)

    class Clock(TrainerCallback):
        """Step time from the end of the previous step (collation counts); vision work per step."""

        def on_train_begin(self, args, state, control, **kw):
            self.t = None
            self.v = counter.snapshot()

        def on_step_begin(self, args, state, control, **kw):
            if self.t is None:
                self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if a.device == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            record["times"].append(now - self.t)
            self.t = now
            v = counter.snapshot()
            record["vision"].append(tuple(x - y for x, y in zip(v, self.v)))
            self.v = v

    def load(name):
        model = AutoModelForImageTextToText.from_pretrained(folder / name, dtype=torch.float32,
                                                            attn_implementation="sdpa")
        if name == start_folder(a) and not a.train_vision:
            if a.model == "qwen2_vl":
                model.model.visual.requires_grad_(False)  # tower and merger (Qwen2-VL's merger lives in visual)
            else:
                model.model.vision_tower.requires_grad_(False)
                model.model.multi_modal_projector.requires_grad_(False)
        return model

    args = DPOConfig(
        output_dir=a.out, per_device_train_batch_size=a.batch_pairs, gradient_accumulation_steps=1,
        max_steps=a.steps, learning_rate=a.lr, lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=1.0,
        weight_decay=0.0, beta=a.beta, loss_type=["sigmoid"], bf16=False, fp16=False,
        use_cpu=a.device == "cpu", gradient_checkpointing=a.gradient_checkpointing,
        train_sampling_strategy="sequential", seed=0, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0,
    )
    ds = trl_dataset(rows, Path(a.rows).parent)
    rss_before = current_rss_mib()
    trainer = Recorder(model=load(start_folder(a)), ref_model=load("reference"), args=args, train_dataset=ds,
                       processing_class=trl_processor(folder / "processor", a.model))
    trainer.add_callback(Clock())
    # the ids TRL's collator produces against the store's, pair by pair (one collator call per batch of pairs)
    from trl_vision_losses import batch_ids

    mismatches = []
    store = Store(a.store) if a.store else None
    if store is None:
        mismatches.append("not checked: no prefpack store (prepare --processor refused this processor)")
    elif len(ds) != len(store):
        mismatches.append(f"TRL has {len(ds)} pairs, the store holds {len(store)}")
    for s in range(0, min(len(ds), len(store)) if store is not None else 0, a.batch_pairs):
        chunk = [ds[i] for i in range(s, min(s + a.batch_pairs, len(ds)))]
        for j, got in enumerate(batch_ids(trainer.data_collator(chunk))):
            pair = store.pair(s + j)
            for part in ("prompt", "chosen", "rejected"):
                if got[part] != np.asarray(getattr(pair, part)).tolist():
                    mismatches.append(f"pair {s + j} {part}")
    counter.calls = counter.images = counter.patches = 0
    trainer.train()
    out = summarise(record["times"], record["real"], record["computed"], record["losses"], record["logps"],
                    record["vision"], a.batch_pairs, images_per_pair(a.rows, a.steps * a.batch_pairs))
    out["tokenisation_mismatches"] = mismatches
    out["rss_before_mib"] = rss_before
    out["vision"]["models_calling"] = len(counter.by_module)
    return out


def start_folder(a) -> str:
    """The folder the trained model starts from: `policy` (the reference plus noise; default), or with
    `--same-start` the reference itself, as most runs start (the reference is a copy of the starting model)."""
    return "reference" if a.same_start else "policy"


def worker(a) -> None:
    t0 = time.perf_counter()
    res = run_prefpack(a) if a.worker == "prefpack" else run_trl(a)
    res["peak_memory_mib"] = peak_memory_mib(a.device)
    res["wall_s"] = time.perf_counter() - t0
    print("RESULT " + json.dumps(res))


def launch(kind: str, a, work: Path, store: Path, rows: Path, tag: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "prefpack" if kind == "prefpack" else "trl", "--model", a.model,
           "--store", str(store or ""), "--rows", str(rows), "--out", str(work / f"run-{tag}"), "--steps", str(a.steps),
           "--batch-pairs", str(a.batch_pairs), "--lr", repr(a.lr), "--beta", repr(a.beta), "--device", a.device,
           "--threads", str(a.threads)]
    if kind == "trl":
        cmd.append("--gradient-checkpointing")
    if a.train_vision:
        cmd.append("--train-vision")
    if a.same_start:
        cmd.append("--same-start")
    for o in a.override:
        cmd += ["--override", o]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"{kind} run failed (exit {proc.returncode}): {' '.join(cmd)}")
    return json.loads(lines[-1][len("RESULT "):])


# ------------------------------------------------------------------------------------------------ main


def prepare_pairs(a, work: Path) -> tuple[Path, Path | None, dict]:
    """The rows (TRL reads them) and prefpack's store of them; no store (None, and why in the info) when this
    prefpack's prepare does not read the model kind's processor."""
    import numpy as np

    from prefpack.data.prepare import PrepareOptions, prepare
    from prefpack.data.store import Store
    from prefpack.errors import PrefpackError

    rows = make_rows(a.pairs, work, seed=a.seed, sizes=a.sizes)
    rows_path = work / "pairs.jsonl"
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    store = work / "store"
    try:
        prepare(PrepareOptions(inputs=[str(rows_path)], tokenizer=None, processor=str(KINDS[a.model][0] / "processor"),
                               output=str(store), overwrite=True, workers=1), log=lambda m: None)
    except PrefpackError as exc:
        if a.model == "qwen2_vl":
            raise
        return rows_path, None, {"pairs": len(rows), "images": sum(len(r["images"]) for r in rows),
                                 "no_store": f"prepare --processor refused the {a.model} processor: {exc}"}
    st = Store(store)
    lens = np.asarray(st.index[:, 1:4])
    image_tokens = int(np.asarray(st.image_index[:, 6]).sum())
    info = {"pairs": len(st), "images": st.num_images, "tokens": int((2 * lens[:, 0] + lens[:, 1] + lens[:, 2]).sum()),
            "image_tokens_per_pair_prompt": image_tokens / max(len(st), 1),
            "prompt_tokens_mean": float(lens[:, 0].mean()), "completion_tokens_mean": float(lens[:, 1:].mean())}
    return rows_path, store, info


def print_table(res: dict, device: str) -> None:
    mem = "peak alloc MiB" if device == "cuda" else "peak RSS MiB"
    print(f"\n{'run':<32}{'tokens/s':>10}{'median':>9}{mem:>15}{'- at start':>12}{'tower calls':>13}"
          f"{'encodings':>11}{'step-1 loss':>13}{'last loss':>12}")
    print(f"{'':<32}{'':>10}{'':>9}{'':>15}{'':>12}{'/ step':>13}{'/ image':>11}")
    for k in RUNS:
        if k in res:
            r = res[k]
            print(f"{LABELS[k]:<32}{r['tokens_per_s']:>10,.0f}{r['tokens_per_s_median']:>9,.0f}"
                  f"{r['peak_memory_mib']:>15,.0f}"
                  f"{r['peak_memory_mib'] - r['rss_before_mib']:>12,.0f}{r['vision']['calls_per_step']:>13.1f}"
                  f"{r['vision']['encodings_per_image']:>11.2f}"
                  f"{r['first_loss']:>13.7f}{r['losses'][-1]:>12.7f}")
    steps = max(len(r["losses"]) for r in res.values())
    print("\nloss by step: " + "  ".join(f"{k}" for k in RUNS if k in res))
    for s in range(steps):
        print(f"  step {s + 1:>2}: " + "  ".join(f"{res[k]['losses'][s]:.7f}" if s < len(res[k]["losses"]) else "-"
                                            for k in RUNS if k in res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=tuple(KINDS), default="qwen2_vl",
                    help="the tiny model kind of tests/data/trl_vision (llava: its llava/ folder)")
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--batch-pairs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per run; the first is not timed")
    ap.add_argument("--sizes", default="56,84,112", help="image widths/heights (px, multiples of 28) drawn from")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run each this many times, alternating, and keep its fastest run (median tokens/s)")
    ap.add_argument("--train-vision", action="store_true",
                    help="train the vision tower and merger in both (default: frozen in both)")
    ap.add_argument("--same-start", action="store_true",
                    help="train from the reference's own weights (the usual run: the reference is a copy of the "
                    "starting model; prefpack's copied reference then reads the policy's frozen image features)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)}")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per run (default 1: the tiny model's ops are too small to split, and one "
                    "thread is far steadier on a shared machine)")
    ap.add_argument("--override", action="append", default=[], help="extra prefpack config override KEY=VALUE")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--worker", choices=("prefpack", "trl"), help=argparse.SUPPRESS)
    for hidden in ("--store", "--rows", "--out"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--gradient-checkpointing", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    quiet_env(cpu_only=a.device == "cpu")
    a.sizes = tuple(int(x) for x in str(a.sizes).split(",")) if isinstance(a.sizes, str) else a.sizes
    if a.worker:
        worker(a)
        return
    try:
        import trl
    except ImportError:
        raise SystemExit("TRL is not installed: pip install -e '.[bench]'") from None
    import shutil

    import torch
    import transformers

    runs = [r.strip() for r in a.runs.split(",") if r.strip()]
    if [r for r in runs if r not in RUNS]:
        raise SystemExit(f"unknown run in {runs}; choose from {RUNS}")
    folder = KINDS[a.model][0]
    if not (folder / "policy" / "model.safetensors").is_file():
        raise SystemExit(f"{folder} is missing: run python benchmarks/trl_vision_losses.py --models {a.model} first")
    work = Path(tempfile.mkdtemp(prefix="bench_vision-"))
    device = torch.cuda.get_device_name(0) if a.device == "cuda" else f"{os.cpu_count()}-core CPU"
    print(f"bench_vision: prefpack vs TRL {trl.__version__} DPOTrainer (torch {torch.__version__}, transformers "
          f"{transformers.__version__}) on {device}, float32; tiny {a.model} of {folder.relative_to(REPO)}; "
          f"{a.pairs} pairs, {a.batch_pairs} pairs/step, {a.steps} steps (first not timed), lr {a.lr} linear, "
          f"beta {a.beta}; vision tower {'trained' if a.train_vision else 'frozen'}")
    res: dict[str, dict] = {}
    skipped = {}
    t0 = time.perf_counter()
    try:
        rows, store, info = prepare_pairs(a, work)
        if store is None:
            print(f"  pairs: {info['pairs']} with {info['images']} images; no prefpack store: {info['no_store']}")
        else:
            print(f"  pairs: {info['pairs']} with {info['images']} images ({info['image_tokens_per_pair_prompt']:.1f} "
                  f"image tokens per prompt; prompt {info['prompt_tokens_mean']:.1f}, completion "
                  f"{info['completion_tokens_mean']:.1f} tokens on average), {info['tokens']:,} real tokens")
        if a.pairs < a.steps * a.batch_pairs:
            print(f"  note: {a.steps} steps of {a.batch_pairs} pairs need {a.steps * a.batch_pairs} pairs; both "
                  "frameworks start the pairs over")
        if "prefpack" in runs:
            why = prefpack_refusal(str(store)) if store is not None else info["no_store"]
            if why:
                skipped["prefpack"] = f"prefpack train does not accept image stores yet (issue 27): {why}"
                print(f"  prefpack   skipped: {skipped['prefpack']}")
                runs.remove("prefpack")
        for rep, kind in ((rep, kind) for rep in range(a.repeats) for kind in runs):
            r = launch(kind, a, work, store, rows, f"{kind}-{rep}")
            if kind not in res or r["tokens_per_s_median"] > res[kind]["tokens_per_s_median"]:
                res[kind] = r
            print(f"  {kind:<10} run {rep + 1}: {r['tokens_per_s']:8,.0f} tokens/s (median step "
                  f"{r['tokens_per_s_median']:,.0f}), peak {r['peak_memory_mib']:,.0f} MiB, "
                  f"each prompt image encoded {r['vision']['encodings_per_image']:.2f} times, step-1 loss "
                  f"{r['first_loss']:.7f} ({r['wall_s']:.0f} s)")
            if r.get("tokenisation_mismatches") and store is not None:
                print(f"  TOKENISATION MISMATCHES: {r['tokenisation_mismatches'][:10]}: the losses are not "
                      "comparable")
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work folder kept: {work}")
    if res:
        print_table(res, a.device)
    comparison = {}
    if "prefpack" in res:
        p = res["prefpack"]
        for k in ("trl", "trl_no_gc"):
            if k in res:
                t = res[k]
                comparison[f"vs_{k}"] = {
                    "speed": p["tokens_per_s"] / t["tokens_per_s"],
                    "memory": p["peak_memory_mib"] / t["peak_memory_mib"],
                    "images_encoded_per_pair": (p["vision"]["images_encoded_per_pair"],
                                                t["vision"]["images_encoded_per_pair"]),
                    "max_loss_abs_diff": max(abs(u - v) for u, v in zip(p["losses"], t["losses"]))}
                print(f"prefpack / {LABELS[k]}: speed {comparison[f'vs_{k}']['speed']:.2f}x, memory "
                      f"{comparison[f'vs_{k}']['memory']:.2f}x, largest loss difference over the steps "
                      f"{comparison[f'vs_{k}']['max_loss_abs_diff']:.1e}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    print(json.dumps({"bench": "bench_vision", "trl_version": trl.__version__, "torch": torch.__version__,
                      "transformers": transformers.__version__, "device": device, "dtype": "float32",
                      "config": {k: getattr(a, k) for k in ("model", "pairs", "batch_pairs", "steps", "sizes", "lr", "beta",
                                                            "seed", "train_vision", "repeats", "override")},
                      "data": info, "skipped": skipped, "runs": res, "comparison": comparison}, default=str))


if __name__ == "__main__":
    main()
