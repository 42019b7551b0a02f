"""TRL 1.16's DPOTrainer loss on image pairs with a tiny Qwen2-VL: the numbers tests/test_trl_vision_numbers.py
checks `prefpack eval` against (issue 27; TRL stays an optional dependency, as for tests/data/trl_losses.json).

What it builds (once; later runs reuse the files so the numbers always belong to the committed weights, unless
`--rebuild-assets`), all under tests/data/trl_vision/:

- `processor/`: `prefpack.toy_vision.save_processor_dir`: the toy ChatML tokenizer with Qwen2-VL's image tokens
  and a chat template that writes an image part as `<|vision_start|><|image_pad|><|vision_end|>`, and Qwen2-VL's
  image processor (default settings: 14 px patches, 2x2 merge, so 28 px per image token). prefpack reads the folder
  (`prepare --processor`); TRL needs a `ProcessorMixin`, built in memory by `trl_processor` (a Qwen2VLProcessor
  without its video processor, which would need torchvision) from the same folder, with the tokenizer's template;
- `reference/`: `toy_vision.tiny_vlm("qwen2_vl")` (2 text layers, hidden 32, a one-block vision tower with
  embed 16 and 2x2 merging, 3-D rotary positions with mrope_section [2, 1, 1]) with every matrix of the
  language model re-drawn from N(0, TEXT_STD^2) and every matrix of the vision tower and merger from
  N(0, VISION_STD^2) (seeded): a peaked next-token distribution, and image features large enough that a
  misplaced image or a wrong rotary position moves the log-probs by far more than 1e-4 (the script checks:
  `image_sensitivity` in the JSON);
- `policy/`: the reference plus seeded Gaussian noise (NOISE * the std of each weight tensor), vision tower and
  merger included, so every log-ratio policy - reference is non-zero;
- `images/*.png` and `pairs.jsonl`: N_PAIRS rows in TRL's vision layout (`images`: paths relative to the file;
  the prompt's content parts `{"type": "image"}` and `{"type": "text"}`; `chosen`/`rejected` assistant messages),
  1 or 2 images per row of 56..112 px (4..16 image tokens each), blocky PNGs (7 px cells) so that they compress
  to a few KB each. Odd rows put the question before the image(s), so the image tokens sit at varied positions.

Then, for each case (loss types sigmoid = TRL's default, ipo and hinge; beta 0.1 and one beta 0.5), it builds
a DPOTrainer (`processing_class` = that processor; the policy and the reference loaded from their folders;
float32 on CPU, `bf16=False`, sdpa) and calls `trainer.evaluate()` on the N_PAIRS pairs as ONE eval batch: TRL's
DataCollatorForVisionPreference renders each row with the chat template, runs the processor over the prompt
texts and images (each prompt twice, once per completion, so the vision tower sees each image twice) and tokenises
the completions apart. Every case is also run on float64 copies of both models (`loss_float64`).

The token ids TRL scored are read from its own eval batch (prompt = the tokens before the completion mask,
chosen / rejected = the completion tokens) and compared with the store `prefpack prepare --processor` writes for
the same rows: they must be equal (they are: same template, no BOS, the reply is `text<|im_end|>\\n` in both,
the image placeholders expanded to the same counts), else the script stops.

Writes tests/data/trl_vision_losses.json: versions, the command, the model and pair settings, the ids TRL
scored, per pair each prompt image's token count (and Qwen2-VL's (t, h, w) grids), how far rearranged pixels and
flattened positions move the log-probs (`image_sensitivity`), the policy's and reference's chosen / rejected
log-prob sums per pair (float32 and float64; for diagnosing a mismatch), and per case {id, trl_loss_type,
prefpack_loss, settings, loss, loss_float64, metrics}.

A second model kind, `--models llava` (or `qwen2_vl,llava`): `toy_vision.tiny_vlm("llava")` (a one-layer CLIP
tower on 28 px images, a two-layer projector, a 2-layer Qwen2 language model), weights drawn the same way, under
tests/data/trl_vision/llava/ with `processor/` = a LlavaProcessor's save_pretrained (the same tokenizer and
template; CLIP's image processor resizing the shortest edge to 28 px and cropping 28 x 28; patch 14, the CLS
feature dropped: 4 image tokens per image), on the same pairs and images; numbers in
tests/data/trl_vision_llava_losses.json. Its ids are compared with prefpack's store when `prepare --processor`
reads a LlavaProcessor folder; otherwise the JSON says they were not compared (`prefpack_store`).

    pip install -e '.[bench]'
    python benchmarks/trl_vision_losses.py [--models qwen2_vl,llava]   # about 10 s per kind on 2 CPU cores
    python benchmarks/trl_vision_losses.py --rebuild-assets            # also rebuild processor, weights, images
                                                                       # and pairs (bit for bit the same files)
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "tests" / "data" / "trl_vision"  # pairs.jsonl and images/, shared by every model kind
# per model kind: its folder (processor/, reference/, policy/) and the JSON its numbers go to
KINDS = {"qwen2_vl": (ASSETS, REPO / "tests" / "data" / "trl_vision_losses.json"),
         "llava": (ASSETS / "llava", REPO / "tests" / "data" / "trl_vision_llava_losses.json")}
OUT = KINDS["qwen2_vl"][1]
# the toy LLaVA processor (as prefpack.toy_vision's): CLIP's image processor at the tiny LLaVA's 28 px (shortest
# edge resized to 28, 28 x 28 crop), 14 px patches, the CLS feature dropped: 4 image tokens per image
LLAVA_SIZE = 28
LLAVA_SETTINGS = dict(patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1,
                      image_token="<|image_pad|>")
VISION_PREFIXES = (".visual.", ".vision_tower.", ".multi_modal_projector.")  # Qwen2-VL's tower + merger; LLaVA's

N_PAIRS = 8
SEED = 0
TEXT_STD = 0.5  # the language model's matrices (embedding, attention, MLP, head)
VISION_STD = 0.2  # the vision tower's and the merger's matrices
NOISE = 0.03  # policy = reference + NOISE * std(weight) * N(0, 1), per weight tensor
SIZES = (56, 84, 112)  # image widths and heights drawn from these (multiples of 28: no resize rounding)
CELL = 7  # pixels per random colour cell of an image
TRL_DEFAULTS = {"beta": 0.1}
CASES = [("sigmoid", {}), ("ipo", {}), ("hinge", {}), ("sigmoid", {"beta": 0.5})]
PREFPACK_NAME: dict[str, str] = {}
REDUCTION = "mean over pairs of a per-pair loss"


def case_id(loss_type: str, changed: dict) -> str:
    return loss_type + ("[" + ",".join(f"{k}={v:g}" for k, v in sorted(changed.items())) + "]" if changed else "")


def quiet_env(cpu_only: bool = True) -> None:
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    for k, v in {**env, **({"CUDA_VISIBLE_DEVICES": ""} if cpu_only else {})}.items():
        os.environ.setdefault(k, v)
    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", UserWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars


# ------------------------------------------------------------------------------------------------ assets


def trl_processor(folder: str | Path, kind: str = "qwen2_vl"):
    """A transformers ProcessorMixin (what TRL's vision collator needs) from a processor folder. qwen2_vl: Qwen2-VL's
    processor with the folder's image processor and tokenizer, the tokenizer's chat template, and no video processor
    (Qwen2VLProcessor insists on one, and Qwen2-VL's video processor needs torchvision). llava: the folder is a
    LlavaProcessor's own save_pretrained."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    if kind == "llava":
        return AutoProcessor.from_pretrained(folder)

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = None
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    tok = AutoTokenizer.from_pretrained(folder)
    return ImageOnlyQwen2VLProcessor(image_processor=AutoImageProcessor.from_pretrained(folder), tokenizer=tok,
                                     chat_template=tok.chat_template)


def blocky_png(width: int, height: int, seed: int) -> bytes:
    """A PNG of random colour cells of CELL x CELL pixels (compresses to a few KB, unlike per-pixel noise)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    cells = rng.integers(0, 256, (-(-height // CELL), -(-width // CELL), 3), dtype=np.uint8)
    pixels = cells.repeat(CELL, 0).repeat(CELL, 1)[:height, :width]
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def make_rows(n: int, folder: Path, *, seed: int = SEED, subdir: str = "images", sizes=SIZES) -> list[dict]:
    """n rows in TRL's vision layout; images written to folder/subdir, named relative to folder. Every third row
    has two images; odd rows put the question before the images."""
    import numpy as np

    from prefpack.toy_vision import _QUESTIONS, _WORDS

    (folder / subdir).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        names = []
        for k in range(2 if i % 3 == 2 else 1):
            w, h = (int(rng.choice(sizes)) for _ in range(2))
            name = f"{subdir}/img_{i:04d}_{k}.png"
            (folder / name).write_bytes(blocky_png(w, h, seed=seed * 100003 + i * 7 + k))
            names.append(name)
        chosen, rejected = rng.choice(len(_WORDS), size=2, replace=False)
        question = [{"type": "text", "text": _QUESTIONS[int(rng.integers(len(_QUESTIONS)))]}]
        images = [{"type": "image"}] * len(names)
        rows.append({"images": names,
                     "prompt": [{"role": "user", "content": question + images if i % 2 else images + question}],
                     "chosen": [{"role": "assistant", "content": [{"type": "text", "text": _WORDS[chosen]}]}],
                     "rejected": [{"role": "assistant", "content": [{"type": "text", "text": _WORDS[rejected]}]}]})
    return rows


def save_llava_processor(tokenizer_dir: Path, out: Path) -> None:
    """A LlavaProcessor folder (LLAVA_SETTINGS, CLIP's image processor at LLAVA_SIZE px) around the tokenizer."""
    from transformers import AutoTokenizer, LlavaProcessor

    try:
        from transformers import CLIPImageProcessorPil as CLIPImageProcessor
    except ImportError:  # transformers before the PIL / torchvision split
        from transformers import CLIPImageProcessor

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    image = CLIPImageProcessor(size={"shortest_edge": LLAVA_SIZE}, crop_size={"height": LLAVA_SIZE,
                                                                               "width": LLAVA_SIZE})
    LlavaProcessor(image_processor=image, tokenizer=tok, chat_template=tok.chat_template,
                   **LLAVA_SETTINGS).save_pretrained(out)


def build_models(kind: str, processor_dir: Path, ref_dir: Path, policy_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    from prefpack.toy_vision import tiny_vlm

    tok = AutoTokenizer.from_pretrained(processor_dir)
    ref = tiny_vlm(kind, tok, seed=SEED)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(ref.named_parameters()):
            if p.dim() >= 2:  # matrices (and the patch embedding's convolution); norms and biases keep their init
                std = VISION_STD if any(x in f".{name}" for x in VISION_PREFIXES) else TEXT_STD
                p.copy_(std * torch.randn(p.shape, generator=gen))
    ref.save_pretrained(ref_dir)
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for _, p in sorted(ref.named_parameters()):
            scale = float(p.std()) if p.numel() > 1 and float(p.std()) > 0 else 1.0
            p.add_(NOISE * scale * torch.randn(p.shape, generator=gen))
    ref.save_pretrained(policy_dir)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def ensure_shared(rebuild: bool, log) -> None:
    """The shared pairs and images, with the Qwen2-VL processor folder (whose tokenizer every kind uses); built only
    when missing or with --rebuild-assets."""
    import shutil

    from prefpack.toy_vision import save_processor_dir

    shared = [ASSETS / "processor" / "preprocessor_config.json", ASSETS / "pairs.jsonl"]
    if rebuild or not all(p.is_file() for p in shared):
        log(f"building {ASSETS.relative_to(REPO)}: processor, images, pairs")
        for name in ("processor", "images"):
            shutil.rmtree(ASSETS / name, ignore_errors=True)
        ASSETS.mkdir(parents=True, exist_ok=True)
        save_processor_dir(ASSETS / "processor")
        write_jsonl(ASSETS / "pairs.jsonl", make_rows(N_PAIRS, ASSETS))


def ensure_kind(kind: str, rebuild: bool, log) -> None:
    """A model kind's processor folder (LLaVA's; Qwen2-VL's is the shared one) and weights."""
    import shutil

    folder = KINDS[kind][0]
    parts = [folder / "processor" / "tokenizer.json", *(folder / m / "model.safetensors" for m in ("reference",
                                                                                                "policy"))]
    if not rebuild and all(p.is_file() for p in parts):
        log(f"reusing {folder.relative_to(REPO)} ({kind}: processor, weights) and the shared pairs and images; "
            "--rebuild-assets builds them again")
        return
    log(f"building {folder.relative_to(REPO)}/ ({kind}: weights{', processor' if kind == 'llava' else ''})")
    for name in ("reference", "policy") + (("processor",) if kind == "llava" else ()):
        shutil.rmtree(folder / name, ignore_errors=True)
    if kind == "llava":
        save_llava_processor(ASSETS / "processor", folder / "processor")
    build_models(kind, folder / "processor", folder / "reference", folder / "policy")


# ------------------------------------------------------------------------------------------------ prefpack's ids


def store_ids(pairs_file: Path, processor_dir: Path, out: Path) -> list[dict]:
    """The ids `prefpack prepare --processor` stores for the rows (what TRL's own ids must equal)."""
    import numpy as np

    from prefpack.data.prepare import PrepareOptions, prepare
    from prefpack.data.store import Store

    prepare(PrepareOptions(inputs=[str(pairs_file)], tokenizer=None, processor=str(processor_dir), output=str(out),
                           overwrite=True, workers=1), log=lambda m: None)
    store = Store(out)
    assert not np.asarray(store.index[:, 4]).any(), "prepare truncated a pair"
    return [{k: np.asarray(getattr(store.pair(i), k)).tolist() for k in ("prompt", "chosen", "rejected")}
            for i in range(len(store))]


def id_differences(used: list[dict], ours: list[dict], tok=None) -> list[str]:
    if len(used) != len(ours):
        return [f"TRL scored {len(used)} pairs, the store holds {len(ours)}"]
    bad = []
    for i, (u, o) in enumerate(zip(used, ours)):
        for k in ("prompt", "chosen", "rejected"):
            if u[k] != o[k]:
                show = (lambda x: repr(tok.decode(x))) if tok is not None else str
                bad.append(f"pair {i} {k}: TRL {show(u[k])} != prefpack {show(o[k])}")
    return bad


# ------------------------------------------------------------------------------------------------ TRL


def trl_dataset(rows: list[dict], folder: Path):
    """A datasets.Dataset of the rows with their images loaded (PIL), as TRL's vision examples hold them."""
    from datasets import Dataset
    from PIL import Image

    def load(name):
        with Image.open(folder / name) as im:
            im.load()
            return im.copy()

    return Dataset.from_list([{**r, "images": [load(n) for n in r["images"]]} for r in rows])


def batch_ids(batch) -> list[dict]:
    """prompt / chosen / rejected ids of every pair of a TRL eval batch ([chosen rows; rejected rows])."""
    ids, attn, comp = (batch[k].tolist() for k in ("input_ids", "attention_mask", "completion_mask"))
    n = len(ids) // 2

    def split(r):
        real = [(t, c) for t, a, c in zip(ids[r], attn[r], comp[r]) if a]
        prompt = [t for t, c in real if not c]
        done = [t for t, c in real if c]
        return prompt, done

    out = []
    for i in range(n):
        (p, c), (p2, r) = split(i), split(n + i)
        assert p == p2, "a pair's prompt differs between its chosen and rejected rows"
        out.append({"prompt": p, "chosen": c, "rejected": r})
    return out


def per_pair_logps(trainer, model, batch) -> tuple[list[float], list[float]]:
    """The chosen and rejected completion log-prob sums TRL's loss reads (its own forward, its fused head)."""
    import torch

    kw = {k: v for k, v in batch.items() if k not in ("completion_mask",)}
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    with torch.no_grad():
        lp = model(**kw, labels=labels, use_cache=False, fused_lm_head=True).log_probs.sum(1)
    c, r = lp.chunk(2)
    return c.tolist(), r.tolist()


def make_trainer(kind: str, loss_type: str, settings: dict, ds, work: Path, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForImageTextToText, PrinterCallback
    from trl import DPOTrainer

    folder = KINDS[kind][0]

    def load(name):
        return AutoModelForImageTextToText.from_pretrained(folder / name, dtype=getattr(torch, dtype),
                                                           attn_implementation="sdpa")

    from trl_losses import one_batch_eval_config

    args = one_batch_eval_config(work, loss_type, settings, len(ds), dtype)
    # TRL's ordinary path loads the policy from its folder; its model_init_kwargs refuse float64, so the float64
    # diagnostic hands it the loaded model
    model = str(folder / "policy") if dtype == "float32" else load("policy")
    trainer = DPOTrainer(model=model, ref_model=load("reference"), args=args, train_dataset=ds, eval_dataset=ds,
                         processing_class=trl_processor(folder / "processor", kind))
    trainer.remove_callback(PrinterCallback)
    return trainer


def image_runs(ids: list[int], image_token_id: int) -> list[int]:
    """The lengths of the runs of the image token in a prompt: each image's token count, in prompt order."""
    runs, n = [], 0
    for t in ids + [None]:
        if t == image_token_id:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def trl_case(kind: str, loss_type: str, settings: dict, ds, work: Path, dtype: str = "float32"):
    """TRL's eval metrics of one case on every pair in one batch, and what the batch held."""
    trainer = make_trainer(kind, loss_type, settings, ds, work, dtype)
    batches = list(trainer.get_eval_dataloader())
    assert len(batches) == 1 and batches[0]["input_ids"].shape[0] == 2 * len(ds), "not one batch of all pairs"
    batch = batches[0]
    metrics = trainer.evaluate()
    ids = batch_ids(batch)
    image_token_id = trainer.processing_class.image_token_id
    seen = {"ids": ids, "image_tokens": [image_runs(x["prompt"], image_token_id) for x in ids],
            "grids": batch["image_grid_thw"].tolist() if "image_grid_thw" in batch else None,
            "policy": per_pair_logps(trainer, trainer.model, batch),
            "reference": per_pair_logps(trainer, trainer.ref_model, batch), "batch": batch, "trainer": trainer,
            "max_length": trainer.args.max_length, "processor": type(trainer.processing_class).__name__,
            "image_processor": type(trainer.processing_class.image_processor).__name__}
    return metrics, seen


def image_sensitivity(kind: str, seen: dict) -> dict:
    """How much the reference's log-probs move when the images are wrong: every image's pixels rearranged (the
    order of its patches reversed for Qwen2-VL, mirrored left-right for LLaVA: same shapes, other content at each
    position), and for Qwen2-VL every 3-D rotary position flattened to the 1-D text positions. Each must be far
    above 1e-4 for the recorded numbers to test image placement and positions."""
    import torch

    trainer, batch = seen["trainer"], seen["batch"]
    model = trainer.ref_model
    base = torch.tensor(per_pair_logps(trainer, model, batch))
    pv = batch["pixel_values"].clone()
    if kind == "qwen2_vl":
        start = 0
        for t, h, w in batch["image_grid_thw"].tolist():
            n = t * h * w
            pv[start:start + n] = pv[start:start + n].flip(0)
            start += n
    else:
        pv = pv.flip(-1)
    moved = torch.tensor(per_pair_logps(trainer, model, {**batch, "pixel_values": pv}))
    out = {"pixels_rearranged_max_abs_logp_change": float((moved - base).abs().max())}
    if kind == "qwen2_vl":  # 1-D positions instead of Qwen2-VL's 3-D ones, the same for t, h and w
        kw = {k: v for k, v in batch.items() if k != "completion_mask"}
        pos = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        with torch.no_grad():
            flat = model(**kw, position_ids=pos[None].expand(3, -1, -1), labels=labels, use_cache=False,
                         fused_lm_head=True).log_probs.sum(1)
        out["positions_1d_max_abs_logp_change"] = float((torch.stack(flat.chunk(2)) - base).abs().max())
    return out


def record_kind(kind: str, rows: list[dict], ds, out: Path, rebuild: bool, log) -> None:
    """TRL's numbers for one model kind, written to `out`."""
    import torch
    import transformers
    import trl

    from prefpack.errors import PrefpackError

    t0 = time.perf_counter()
    ensure_kind(kind, rebuild, log)
    folder = KINDS[kind][0]
    tok = trl_processor(folder / "processor", kind).tokenizer
    results, record = [], None
    with tempfile.TemporaryDirectory(prefix="trl_vision-") as tmp:
        work = Path(tmp)
        try:
            ours, store_note = store_ids(ASSETS / "pairs.jsonl", folder / "processor", work / "store"), None
        except PrefpackError as exc:  # a processor this prefpack's prepare does not support yet
            if kind == "qwen2_vl":
                raise
            ours, store_note = None, f"not compared: prefpack prepare refused the processor ({exc})"
            log(f"  [{kind}] the ids TRL scores are {store_note}")
        for loss_type, changed in CASES:
            settings = {**TRL_DEFAULTS, **changed}
            metrics, seen = trl_case(kind, loss_type, settings, ds, work)
            bad = id_differences(seen["ids"], ours, tok) if ours is not None else []
            if bad:
                raise SystemExit(f"[{kind}] TRL tokenised the pairs unlike prefpack's store:\n  " + "\n  ".join(bad))
            metrics64, seen64 = trl_case(kind, loss_type, settings, ds, work, dtype="float64")
            if record is None:
                record = {**{k: seen[k] for k in ("ids", "image_tokens", "grids", "max_length", "processor",
                                                  "image_processor")},
                          "sensitivity": image_sensitivity(kind, seen),
                          "logps": {f"{m}/{side}": seen[m][k] for m in ("policy", "reference")
                                    for k, side in enumerate(("chosen", "rejected"))},
                          "logps_float64": {f"{m}/{side}": seen64[m][k] for m in ("policy", "reference")
                                            for k, side in enumerate(("chosen", "rejected"))}}
            cid = case_id(loss_type, changed)
            loss, exact = float(metrics["eval_loss"]), float(metrics64["eval_loss"])
            log(f"  [{kind}] {cid:<18} TRL loss {loss:.7f} (float64: {exact:.7f}, float32 error "
                f"{loss - exact:+.1e}); margins {metrics['eval_rewards/margins']:+.4f}, accuracy "
                f"{metrics['eval_rewards/accuracies']:.3f}")
            results.append({
                "id": cid, "trl_loss_type": loss_type, "prefpack_loss": PREFPACK_NAME.get(loss_type, loss_type),
                "trl_defaults": not changed, "settings": settings, "reduction": REDUCTION, "loss": loss,
                "loss_float64": exact,
                "metrics": {k.removeprefix("eval_"): v for k, v in sorted(metrics.items())
                            if k.startswith(("eval_rewards/", "eval_logps/"))},
            })
    sens = record["sensitivity"]
    log(f"  [{kind}] image sensitivity (reference log-probs, max over sequences, nats): "
        + ", ".join(f"{k.removesuffix('_max_abs_logp_change')} {v:.3g}" for k, v in sens.items()))
    if min(sens.values()) < 100 * 1e-4:
        raise SystemExit(f"[{kind}] the images barely move the log-probs ({sens}): a test at 1e-4 would not see a "
                         "misplaced image or wrong positions; draw larger vision weights (VISION_STD)")
    lr = [c - r for c, r in zip(record["logps"]["policy/chosen"], record["logps"]["reference/chosen"])]
    log(f"  [{kind}] chosen log-ratios policy - reference: {min(lr):+.3f} .. {max(lr):+.3f} nats")
    n_images = sum(len(r["images"]) for r in rows)
    proc_note = ("Qwen2VLProcessor (image processor + tokenizer of processor/, no video processor)"
                 if kind == "qwen2_vl" else "LlavaProcessor (processor/ is its save_pretrained)")
    doc = {
        "what": f"TRL DPOTrainer.evaluate() loss on the image pairs of {ASSETS.relative_to(REPO)} and the tiny "
                f"{kind} weights in {folder.relative_to(REPO)} (one eval batch holding every pair; float32, CPU, "
                "sdpa; loss_float64: the same on float64 copies of the weights); checked by "
                "tests/test_trl_vision_numbers.py",
        "command": "python benchmarks/trl_vision_losses.py" + (" " + shlex.join(sys.argv[1:]) if sys.argv[1:] else ""),
        "model_kind": kind,
        "trl_version": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "trl_config": {"bf16": False, "attn_implementation": "sdpa", "dtype": "float32", "device": "cpu",
                       "per_device_eval_batch_size": len(rows), "max_length": record["max_length"],
                       "collator": "DataCollatorForVisionPreference", "processor": proc_note,
                       "image_processor": record["image_processor"]},
        "assets": {"dir": str(folder.relative_to(REPO)), "processor": "processor",
                   "pairs_dir": str(ASSETS.relative_to(REPO)), "pairs_file": "pairs.jsonl",
                   "model": {"type": kind, "builder": f"prefpack.toy_vision.tiny_vlm({kind!r})",
                             "text_std": TEXT_STD, "vision_std": VISION_STD, "seed": SEED, "policy_noise": NOISE},
                   "pairs": len(rows), "images": n_images},
        "prefpack_store": store_note or "prepare --processor stores exactly these ids",
        "token_ids": record["ids"],
        "image_tokens": record["image_tokens"],  # per pair, each prompt image's token count, in prompt order
        "image_sensitivity": sens,
        "per_pair_logps": record["logps"],
        "per_pair_logps_float64": record["logps_float64"],
        "cases": results,
    }
    if record["grids"] is not None:
        doc["image_grid_thw"] = record["grids"][:n_images]  # the batch's first half: every pair's prompt images
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    log(f"  [{kind}] wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out} ({len(results)} cases) in "
        f"{time.perf_counter() - t0:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2_vl",
                    help=f"comma list of {', '.join(KINDS)} (llava: see the module docstring)")
    ap.add_argument("--rebuild-assets", action="store_true",
                    help="build the processor, weights, images and pairs again (else reuse tests/data/trl_vision/)")
    ap.add_argument("--output-dir", default=None,
                    help="write the JSONs here instead of tests/data/ (same file names)")
    a = ap.parse_args()
    kinds = [k.strip() for k in a.models.split(",") if k.strip()]
    if not kinds or [k for k in kinds if k not in KINDS]:
        raise SystemExit(f"--models: choose from {', '.join(KINDS)}")
    quiet_env()
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("TRL is not installed: pip install -e '.[bench]'") from None
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    log = print
    ensure_shared(a.rebuild_assets, log)
    rows = [json.loads(x) for x in (ASSETS / "pairs.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]
    for kind in kinds:
        out = KINDS[kind][1] if a.output_dir is None else Path(a.output_dir) / KINDS[kind][1].name
        record_kind(kind, rows, trl_dataset(rows, ASSETS), out, a.rebuild_assets, log)


if __name__ == "__main__":
    main()
