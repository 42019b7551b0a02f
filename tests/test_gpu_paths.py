"""Each feature landed since the first GPU run, on its CUDA path once (issue 29, item 5): unscored spans on torch's
varlen kernel with prompts laid out once, KTO, LoRA, a precomputed reference, and image pairs (Qwen2-VL, LLaVA). Each CUDA run (bfloat16 autocast)
is checked against the same run on the CPU in float32: the same tokens and scored positions, and losses within
bfloat16's rounding.

Skipped without CUDA (CI has none); on a GPU: ``PREFPACK_TEST_CUDA=1 pytest tests/test_gpu_paths.py``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import metrics_lines, prepare_hh_splits, quiet, store_with_spans, tiny_llama

from prefpack.config import load_config
from prefpack.training import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: PREFPACK_TEST_CUDA=1 on a GPU")

CPU = ["train.device=cpu", "model.attn_implementation=packed_sdpa"]
CUDA = ["train.device=cuda", "model.attn_implementation=varlen", "model.compile=false"]


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_tokenizers, hh_train):
    root = tmp_path_factory.mktemp("gpu_paths")
    tok = toy_tokenizers["llama"]
    stores = prepare_hh_splits(root, tok, hh_train, {"train": 24})
    return {"root": root, "tok": tok, "train": stores["train"],
            "spans": store_with_spans(stores["train"], root / "spans"),
            "policy": tiny_llama(tok, root / "policy", 0), "ref": tiny_llama(tok, root / "ref", 1)}


def run(world, out, *extra) -> list[dict]:
    cfg = load_config(None, [f"model.name_or_path={world['policy']}", f"data.train={world['train']}",
                             f"run.output_dir={out}", "train.global_batch_pairs=8", "train.max_steps=3",
                             "optim.lr=1e-2", "optim.warmup_steps=0", "data.shuffle=false", "run.plot=false",
                             "run.tensorboard=false", *extra])
    train(cfg, progress=False, log=quiet)
    return metrics_lines(out)


def same_run(cpu: list[dict], cuda: list[dict], tol: float = 2e-2) -> None:
    assert [r["tokens"] for r in cuda] == [r["tokens"] for r in cpu]
    assert [r.get("scored") for r in cuda] == [r.get("scored") for r in cpu]
    assert [r["loss"] for r in cuda] == pytest.approx([r["loss"] for r in cpu], abs=tol)


@pytest.mark.parametrize("sharing", ["true", "false"])
def test_unscored_spans_on_varlen_match_the_cpu(world, tmp_path, sharing):
    extra = [f"data.train={world['spans']}", f"data.prefix_sharing={sharing}"]
    cpu = run(world, tmp_path / "cpu", *CPU, *extra)
    cuda = run(world, tmp_path / "cuda", *CUDA, *extra)
    assert all(r["scored"] < r["tokens"] for r in cuda)
    same_run(cpu, cuda)


def test_kto_on_cuda_matches_the_cpu(world, tmp_path):
    extra = ["loss.terms=[{name: kto}]", "data.paired_as_kto=true", f"reference.model={world['ref']}"]
    same_run(run(world, tmp_path / "cpu", *CPU, *extra), run(world, tmp_path / "cuda", *CUDA, *extra))


def test_lora_with_the_adapter_off_as_reference_on_cuda_matches_the_cpu(world, tmp_path):
    extra = ["lora.enabled=true", "lora.r=8", "reference.mode=adapter", "optim.lr=5e-2"]
    same_run(run(world, tmp_path / "cpu", *CPU, *extra), run(world, tmp_path / "cuda", *CUDA, *extra))


def test_precomputed_reference_on_cuda_gives_the_copied_references_losses(world, tmp_path):
    import shutil

    from prefpack.cli import main

    store = shutil.copytree(world["spans"], tmp_path / "store")
    assert main(["precompute-ref", "--model", str(world["policy"]), "--data", str(store), "--device", "cuda"]) == 0
    copied = run(world, tmp_path / "copy", *CUDA, f"data.train={store}", "reference.mode=copy")
    pre = run(world, tmp_path / "precomputed", *CUDA, f"data.train={store}", "reference.mode=precomputed")
    same_run(copied, pre)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Image stores and tiny models of both families (prefpack.toy_vision): Qwen2-VL (3-D rotary positions) and
    LLaVA (a CLIP tower, 1-D positions)."""
    pytest.importorskip("PIL.Image")
    from prefpack.cli import main
    from prefpack.toy_vision import save_processor_dir, tiny_vlm, vision_rows, vision_tokenizer, write_jsonl

    root = tmp_path_factory.mktemp("gpu_images")
    tok = vision_tokenizer()
    rows = write_jsonl(root / "rows.jsonl", vision_rows(16, root / "images", relative_to=root))
    out = {}
    for kind in ("qwen2_vl", "llava"):
        processor = save_processor_dir(root / f"processor-{kind}", kind, tok)
        assert main(["prepare", str(rows), "--processor", str(processor), "--output", str(root / f"store-{kind}"),
                     "--workers", "1"]) == 0
        tiny_vlm(kind, tok, seed=0).save_pretrained(root / f"model-{kind}")
        out[kind] = (root / f"model-{kind}", root / f"store-{kind}")
    return out


# Written and run on CPU stand-ins only (2026-11-25, no GPU in that session): the first GPU session runs it.
@pytest.mark.parametrize("kind", ["qwen2_vl", "llava"])
@pytest.mark.parametrize("settings", [["data.prefix_sharing=true"],
                                      ["data.prefix_sharing=false", "model.freeze_vision=false",
                                       "model.freeze_projector=false"]], ids=["shared-frozen", "unshared-trained"])
def test_images_on_varlen_match_the_cpu(images, tmp_path, kind, settings):
    """Image pairs on CUDA (varlen, bfloat16 autocast; the vision tower on sdpa) against the CPU in float32: the same
    tokens and losses within bfloat16's rounding, prompts shared or not, the tower frozen or trained."""
    model, store = images[kind]

    def run_images(out, *extra):
        cfg = load_config(None, [f"model.name_or_path={model}", f"data.train={store}", f"run.output_dir={out}",
                                 "train.global_batch_pairs=8", "train.max_steps=2", "optim.lr=1e-3",
                                 "data.shuffle=false", "run.plot=false", "run.tensorboard=false", *settings, *extra])
        train(cfg, progress=False, log=quiet)
        return metrics_lines(out)

    same_run(run_images(tmp_path / "cpu", *CPU), run_images(tmp_path / "cuda", *CUDA))
