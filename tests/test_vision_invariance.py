"""The invariances of tests/invariance_cases.py on image stores (issue 27): packed == padded, 1x8 == 8x1
accumulation, resume == uninterrupted, a copied reference == its precomputed log-probs, two ranks (gloo, DDP and
FSDP2) == one rank, for

* img_pairs: DPO on 24 image pairs of a tiny Qwen2-VL (3-D rotary positions), vision encoder and projector frozen
  (the default);
* img_pairs_shared: the same with each prompt (and its images) laid out once, and the vision encoder and projector
  TRAINED, so gradients flow through the tower and the feature scatter;
* llava_pairs_shared: a tiny LLaVA (1-D positions, a CLIP tower and a projector), projector trained;
* kto_img_shared: KTO on 20 unpaired image examples (each with its KL sequence, whose prompt holds its images).

The test bodies are invariance_cases' own, as for the text stores (test_invariance_pairs.py, ...); only the
`world` fixture differs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("PIL.Image")

from conftest import write_jsonl  # noqa: E402
from invariance_cases import (  # noqa: E402, F401 - the tests and fixtures run here with this module's `world`
    assert_same_runs,
    baseline,
    one_rank,
    precomputed,
    rank_runs,
    test_accumulation_1x8_equals_8x1,
    test_copy_and_precomputed_reference_agree,
    test_packed_equals_padded,
    test_resume_equals_uninterrupted,
    test_two_ranks_equal_one_rank,
    two_ranks,
)
from invariance_worlds import RUN  # noqa: E402

from prefpack.cli import main as cli_main  # noqa: E402
from prefpack.data.store import Store  # noqa: E402
from prefpack.toy_vision import (  # noqa: E402
    save_processor_dir,
    tiny_vlm,
    vision_rows,
    vision_tokenizer,
)


def _prepare(root, processor, rows, name, *args) -> str:
    src = write_jsonl(root / f"{name}.jsonl", rows)
    assert cli_main(["prepare", str(src), "--processor", str(processor), "--output", str(root / name),
                     "--workers", "1", *args]) == 0
    return root / name


def _model(kind, tok, processor, out, seed):
    tiny_vlm(kind, tok, seed=seed).save_pretrained(out)
    save_processor_dir(out, kind, tok)  # a complete checkpoint: tokenizer and image processor beside the weights
    return out


def _kto_rows(prompts: int, image_dir, seed: int, root) -> list[dict]:
    """Two unpaired examples per prompt: its chosen reply (desirable) and its rejected one, interleaved with the
    other prompts' so that a prompt's examples are not neighbours in the store."""
    rows = vision_rows(prompts, image_dir, seed=seed, relative_to=root)
    first = [{"images": r["images"], "prompt": r["prompt"], "completion": r["chosen"], "label": True} for r in rows]
    second = [{"images": r["images"], "prompt": r["prompt"], "completion": r["rejected"], "label": False}
              for r in rows]
    return first + second


KINDS = ["img_pairs", "img_pairs_shared", "llava_pairs_shared", "kto_img_shared"]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    return {kind: _world(kind, tmp_path_factory) for kind in KINDS}


@pytest.fixture(scope="module", params=KINDS)
def world(request, worlds):
    return worlds[request.param]


def _world(kind, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp(f"vision-invariance-{kind}")
    tok = vision_tokenizer()
    arch = "llava" if kind.startswith("llava") else "qwen2_vl"
    processor = save_processor_dir(root / "processor", arch, tok)
    shared = "true" if kind.endswith("_shared") else "false"
    if kind == "kto_img_shared":
        train_rows = _kto_rows(10, root / "images", 0, root)  # 10 prompts (with their images), two replies each
        eval_rows = _kto_rows(3, root / "eval-images", 1, root)
        stores = {"train": _prepare(root, processor, train_rows, "train", "--format", "unpaired"),
                  "eval": _prepare(root, processor, eval_rows, "eval", "--format", "unpaired")}
        settings = {
            "size": 20, "sidecar": "ref_logps_kto.safetensors", "precompute": ["--seed", "0"],
            "base": ["loss.terms=[{name: kto}]", "train.global_batch_pairs=5", f"data.prefix_sharing={shared}"],
            "keys": ("loss", "kl", "rewards/margins", "count/chosen", "count/rejected"),
            "precomputed": ["loss.kl_pairing=fixed"],
            "ranks": ["train.global_batch_pairs=3", "train.micro_batch_tokens=96", "data.max_tokens_per_row=96",
                      "loss.beta=0.5"],
        }
    else:
        stores = {"train": _prepare(root, processor, vision_rows(24, root / "images", seed=0, relative_to=root),
                                    "train"),
                  "eval": _prepare(root, processor, vision_rows(8, root / "eval-images", seed=1, relative_to=root),
                                   "eval")}
        base = ["loss.terms=[{name: sigmoid}]", "train.global_batch_pairs=8", f"data.prefix_sharing={shared}"]
        if kind == "img_pairs_shared":
            base += ["model.freeze_vision=false", "model.freeze_projector=false"]
        if kind == "llava_pairs_shared":
            base += ["model.freeze_projector=false"]
        settings = {
            "size": 24, "sidecar": "ref_logps.safetensors", "precompute": [], "base": base,
            "keys": ("loss", "rewards/margins", "rewards/chosen"), "precomputed": [],
            "ranks": ["train.global_batch_pairs=10", "train.micro_batch_tokens=256", "data.max_tokens_per_row=256",
                      "optim.schedule=cosine", "optim.warmup_steps=1"],
        }
    assert Store(stores["train"]).num_images >= settings["size"]
    policy = _model(arch, tok, processor, root / "policy", 1)
    ref = _model(arch, tok, processor, root / "ref", 2)
    # AdamW's eps at 1e-3 (as invariance_cases' two-rank runs): a reference laid out another way (precompute-ref
    # shares prompts, a copy in an unshared run does not) differs by float32 rounding, which eps 1e-8 turns into
    # full-size updates of weights whose gradients are near zero
    run_settings = [f"reference.model={ref}", *RUN, "optim.eps=1.0e-3", *settings.pop("base")]
    return {"kind": kind, "root": root, "tok": processor, **stores, **settings, "settings": run_settings,
            "policy": policy, "ref": ref}
