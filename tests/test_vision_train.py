"""Training runs on an image store end to end (issue 27): the vision tower's work per step, LoRA with the
adapter-off reference, a reference-free loss, `prefpack eval` and the final folder as a whole checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("PIL.Image")

from conftest import metrics_lines, quiet  # noqa: E402

from prefpack.cli import main as cli_main  # noqa: E402
from prefpack.config import load_config  # noqa: E402
from prefpack.data.store import Store  # noqa: E402
from prefpack.toy_vision import save_processor_dir, tiny_vlm, vision_rows, vision_tokenizer, write_jsonl  # noqa: E402
from prefpack.training import train  # noqa: E402

RUN = ["train.max_steps=2", "train.global_batch_pairs=8", "data.shuffle=false", "optim.lr=1.0e-3", "run.plot=false",
       "run.tensorboard=false", "train.micro_batch_tokens=8192", "data.max_tokens_per_row=4096"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-train")
    tok = vision_tokenizer()
    processor = save_processor_dir(root / "processor", "qwen2_vl", tok)
    src = write_jsonl(root / "train.jsonl", vision_rows(16, root / "images", seed=3, relative_to=root))
    assert cli_main(["prepare", str(src), "--processor", str(processor), "--output", str(root / "store"),
                     "--workers", "1"]) == 0
    tiny_vlm("qwen2_vl", tok, seed=1).save_pretrained(root / "model")
    save_processor_dir(root / "model", "qwen2_vl", tok)
    return {"root": root, "store": root / "store", "model": root / "model"}


def _cfg(assets, run_dir, *extra):
    return load_config(None, [f"model.name_or_path={assets['model']}", f"data.train={assets['store']}",
                              f"run.output_dir={run_dir}", *RUN, *extra])


@pytest.mark.parametrize("case", ["same_frozen", "other_reference", "tower_trained"])
def test_each_image_is_encoded_once_per_step_and_vision_weights(assets, tmp_path, monkeypatch, case):
    """One micro-batch per step, pairs laid out with their prompt twice: every image of the step's pairs is encoded
    once per distinct set of vision weights (TRL encodes each twice per model: once per sequence of its pair). A
    copied reference whose frozen vision weights are the policy's reads the policy's features (one encoding a step);
    a reference from another checkpoint, or a policy whose tower trains, encodes its own (two). The losses are those
    of a run that encodes everything twice."""
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen

    encoded = []
    forward = qwen.Qwen2VisionTransformerPretrainedModel.forward

    def counting(self, hidden_states, grid_thw, **kw):
        encoded.append(int(grid_thw.shape[0]))
        return forward(self, hidden_states, grid_thw, **kw)

    extra = {"same_frozen": [], "tower_trained": ["model.freeze_vision=false"],
             "other_reference": [f"reference.model={assets['root'] / 'other'}"]}[case]
    if case == "other_reference" and not (assets["root"] / "other").exists():
        tiny_vlm("qwen2_vl", vision_tokenizer(), seed=5).save_pretrained(assets["root"] / "other")
    monkeypatch.setattr(qwen.Qwen2VisionTransformerPretrainedModel, "forward", counting)
    cfg = _cfg(assets, tmp_path / "run", "reference.mode=copy", "data.prefix_sharing=false", *extra)
    train(cfg, progress=False, log=quiet)
    store = Store(assets["store"])
    per_step = [sum(len(store.images_of(i)) for i in range(s * 8, s * 8 + 8)) for s in range(2)]
    if case == "same_frozen":
        assert encoded == per_step
    else:  # policy, reference; step 1, step 2
        assert encoded == [per_step[0], per_step[0], per_step[1], per_step[1]]
    # the same run with the cache defeated (every model encodes its own): the same losses, bitwise
    from prefpack.model import vision

    monkeypatch.setattr(vision, "frozen_key", lambda parts: None)
    first = len(encoded)
    train(_cfg(assets, tmp_path / "plain", "reference.mode=copy", "data.prefix_sharing=false", *extra),
          progress=False, log=quiet)
    assert encoded[first:] == [per_step[0], per_step[0], per_step[1], per_step[1]]
    for a, b in zip(metrics_lines(tmp_path / "run"), metrics_lines(tmp_path / "plain"), strict=True):
        assert (a["loss"], a["rewards/margins"], a["grad_norm"]) == (b["loss"], b["rewards/margins"], b["grad_norm"])


def test_lora_with_the_adapter_reference_trains_only_the_language_model(assets, tmp_path):
    run = tmp_path / "lora"
    train(_cfg(assets, run, "lora.enabled=true", "reference.mode=adapter", "lora.r=4"), progress=False, log=quiet)
    lines = metrics_lines(run)
    assert len(lines) == 2 and lines[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # adapter off == policy
    # the final folder is a whole checkpoint: weights, tokenizer and the image processor the run preprocessed with
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    assert (run / "final" / "preprocessor_config.json").is_file()
    AutoImageProcessor.from_pretrained(run / "final")
    after = AutoModelForImageTextToText.from_pretrained(run / "final").state_dict()
    before = AutoModelForImageTextToText.from_pretrained(assets["model"]).state_dict()
    assert sorted(after) == sorted(before)
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    assert moved and all(k.startswith("model.language_model.") for k in moved)  # LoRA merged into the LM only


def test_a_reference_free_loss_and_prefpack_eval(assets, tmp_path, capsys):
    run = tmp_path / "simpo"
    train(_cfg(assets, run, "loss.terms=[{name: simpo}]", "reference.mode=none"), progress=False, log=quiet)
    assert [m["step"] for m in metrics_lines(run)] == [1, 2]
    capsys.readouterr()
    assert cli_main(["eval", "--model", str(run / "final"), "--data", str(assets["store"]), "--loss", "simpo", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["loss"] > 0 and -200 < out["logps/chosen"] < 0


def test_kto_encodes_each_image_once_for_its_kl_and_main_passes(tmp_path, monkeypatch):
    """KTO: an example's images serve its main sequence and (as the prompt of its KL sequence) the KL pass, in the
    policy and the copied reference: one encoding per image a step in all."""
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen

    from prefpack.toy_vision import unpaired_vision_rows

    tok = vision_tokenizer()
    processor = save_processor_dir(tmp_path / "processor", "qwen2_vl", tok)
    src = write_jsonl(tmp_path / "kto.jsonl", unpaired_vision_rows(10, tmp_path / "images", relative_to=tmp_path))
    assert cli_main(["prepare", str(src), "--processor", str(processor), "--output", str(tmp_path / "store"),
                     "--format", "unpaired", "--workers", "1"]) == 0
    tiny_vlm("qwen2_vl", tok, seed=1).save_pretrained(tmp_path / "model")
    encoded = []
    forward = qwen.Qwen2VisionTransformerPretrainedModel.forward
    monkeypatch.setattr(qwen.Qwen2VisionTransformerPretrainedModel, "forward",
                        lambda self, h, grid_thw, **kw: encoded.append(int(grid_thw.shape[0])) or forward(
                            self, h, grid_thw, **kw))
    cfg = load_config(None, [f"model.name_or_path={tmp_path / 'model'}", f"data.train={tmp_path / 'store'}",
                             f"run.output_dir={tmp_path / 'run'}", "loss.terms=[{name: kto}]",
                             "train.global_batch_pairs=10", "train.max_steps=1", "run.plot=false",
                             "run.tensorboard=false", "train.micro_batch_tokens=8192"])
    train(cfg, progress=False, log=quiet)
    store = Store(tmp_path / "store")
    assert encoded == [sum(len(store.images_of(i)) for i in range(len(store)))]
    assert metrics_lines(tmp_path / "run")[0]["kl"] >= 0


@pytest.mark.parametrize("kind", ["pairs", "kto"])
def test_image_evaluation_holds_a_few_micro_batches_at_a_time(assets, tmp_path, monkeypatch, kind):
    """Evaluating an image store collates EVAL_WINDOW micro-batches at a time (their pixels are large), with the
    same metrics as collating all of them first; KTO's KL reference point is still over the whole store."""
    from prefpack.training import build, evaluation

    extra = ["train.micro_batch_tokens=128", "data.max_tokens_per_row=128"]
    if kind == "kto":
        extra += ["loss.terms=[{name: kto}]", "data.paired_as_kto=true", "train.global_batch_pairs=16"]
    setup = build(_cfg(assets, tmp_path / "run", *extra), log=quiet)
    task = setup.train_task
    events = []
    collate, loss = task.collate, task.loss
    monkeypatch.setattr(task, "collate", lambda p: events.append("c") or collate(p))
    monkeypatch.setattr(task, "loss", lambda *a: events.append("l") or loss(*a))
    monkeypatch.setattr(evaluation, "EVAL_WINDOW", 2)
    windowed = evaluation.evaluate(setup.policy, setup.reference, task)
    held, most = 0, 0
    for e in events[events.index("l"):]:  # the loss pass: never more than a window collated ahead
        held = held + 1 if e == "c" else held - 1
        most = max(most, held)
    assert events.count("l") > 4 and most <= 2
    monkeypatch.setattr(evaluation, "_windows", lambda task, n: None)
    events.clear()
    whole = evaluation.evaluate(setup.policy, setup.reference, task)
    assert events[:events.count("c")] == ["c"] * events.count("c")  # all collated first
    assert sorted(windowed) == sorted(whole)
    for key in whole:
        assert windowed[key] == pytest.approx(whole[key], rel=1e-12, abs=1e-12), key


def test_ranked_image_prompts_train_the_same_shared_and_padded(tmp_path):
    """A ranked store's images belong to its prompts (stored with each group's first row): prompts laid out once
    with every completion of the group continuing from them give the padded layout's steps."""
    tok = vision_tokenizer()
    processor = save_processor_dir(tmp_path / "processor", "qwen2_vl", tok)
    other = [{"role": "assistant", "content": [{"type": "text", "text": "no idea"}]}]
    ranked = [{"images": r["images"], "prompt": r["prompt"], "scores": [2.0, 1.0, 0.5],
               "completions": [r["chosen"], r["rejected"], other]}
              for r in vision_rows(8, tmp_path / "images", relative_to=tmp_path)]
    assert cli_main(["prepare", str(write_jsonl(tmp_path / "ranked.jsonl", ranked)), "--processor", str(processor),
                     "--output", str(tmp_path / "store"), "--format", "ranked", "--workers", "1"]) == 0
    tiny_vlm("qwen2_vl", tok, seed=1).save_pretrained(tmp_path / "model")
    runs = {"shared": ["data.prefix_sharing=true"], "padded": ["data.packing=false", "data.prefix_sharing=false"]}
    for name, extra in runs.items():
        train(load_config(None, [f"model.name_or_path={tmp_path / 'model'}", f"data.train={tmp_path / 'store'}",
                                 f"run.output_dir={tmp_path / name}", "train.global_batch_pairs=3", "train.max_steps=2",
                                 "run.plot=false", "run.tensorboard=false", "data.ranked_pairs=all_pairs",
                                 "optim.lr=1.0e-3", *extra]), progress=False, log=quiet)
    shared, padded = metrics_lines(tmp_path / "shared"), metrics_lines(tmp_path / "padded")
    assert len(shared) == len(padded) == 2 and shared[0]["positions"] < shared[0]["tokens"]
    for a, b in zip(shared, padded):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                  rel=1e-5)


def test_two_ranks_equal_one_when_a_rank_has_no_image(tmp_path):
    """A store mixing image and text-only pairs, dealt so that one rank's micro-batch holds no image: that rank still
    runs the vision tower (a blank placeholder, times 0), so FSDP2's gathers and DDP's gradient buckets match across
    ranks (before, gloo failed on a collective mismatch), and two ranks train exactly as one: the tower trained (DDP,
    FSDP2), or frozen with the copied reference reading the policy's features (FSDP2)."""
    from conftest import run_here, run_prefpack

    tok = vision_tokenizer()
    processor = save_processor_dir(tmp_path / "processor", "qwen2_vl", tok)
    rows = vision_rows(8, tmp_path / "images", relative_to=tmp_path)
    for i in (1, 3, 5, 7):  # text-only pairs: with 2 pairs a step in store order, rank 1 gets no image
        rows[i] = {"images": [], "prompt": [{"role": "user", "content": [{"type": "text", "text": "say something"}]}],
                   "chosen": rows[i]["chosen"], "rejected": rows[i]["rejected"]}
    assert cli_main(["prepare", str(write_jsonl(tmp_path / "mixed.jsonl", rows)), "--processor", str(processor),
                     "--output", str(tmp_path / "store"), "--workers", "1"]) == 0
    tiny_vlm("qwen2_vl", tok, seed=1).save_pretrained(tmp_path / "model")

    def args(run, frozen, *extra):
        return ["train", f"model.name_or_path={tmp_path / 'model'}", f"data.train={tmp_path / 'store'}",
                f"run.output_dir={tmp_path / run}", "train.global_batch_pairs=2", "train.max_steps=3",
                "data.shuffle=false", f"model.freeze_vision={frozen}", "optim.lr=1.0e-3", "optim.eps=1.0e-3",
                "run.plot=false", "run.tensorboard=false", *extra, "--no-progress"]

    # trained tower: DDP and FSDP2; frozen tower (the copied reference reads the policy's features): FSDP2
    run_here(args("one-trained", "false"), args("one-frozen", "true"))
    runs = {"ddp-trained": "one-trained", "fsdp2-trained": "one-trained", "fsdp2-frozen": "one-frozen"}
    run_prefpack(*(args(r, r.endswith("frozen"), f"distributed.strategy={r.split('-')[0]}") for r in runs), nproc=2,
                 timeout=240)
    from transformers import AutoModelForImageTextToText

    start = AutoModelForImageTextToText.from_pretrained(tmp_path / "model").state_dict()
    for run, base in runs.items():
        one = AutoModelForImageTextToText.from_pretrained(tmp_path / base / "final").state_dict()
        trained = any(not torch.equal(one[k], start[k]) for k in one if k.startswith("model.visual.blocks"))
        assert trained == base.endswith("trained"), base
        for a, b in zip(metrics_lines(tmp_path / base), metrics_lines(tmp_path / run), strict=True):
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["grad_norm"] == pytest.approx(
                b["grad_norm"], rel=1e-5), (run, a["step"])
        other = AutoModelForImageTextToText.from_pretrained(tmp_path / run / "final").state_dict()
        for k in one:
            torch.testing.assert_close(other[k], one[k], atol=1e-5, rtol=0, msg=lambda m, k=k, r=run: f"{r} {k}: {m}")


def test_a_micro_batchs_kept_features_are_dropped_after_its_loss(assets, tmp_path, monkeypatch):
    """The loop drops each micro-batch's kept image features once its loss and backward ran (the step's other
    micro-batches, collated up front, would otherwise keep theirs on the device until the step ends); a KTO batch's
    main and KL passes share one cache."""
    from types import SimpleNamespace

    from prefpack.objectives import base, release_images
    from prefpack.training import loop

    shared = {"key": torch.zeros(1)}
    release_images(SimpleNamespace(main=SimpleNamespace(vision_cache=shared), kl=SimpleNamespace(vision_cache=shared)))
    assert shared == {}
    seen = []
    monkeypatch.setattr(loop, "release_images", lambda b: (seen.append(dict(b.vision_cache)),
                                                           base.release_images(b), seen.append(b.vision_cache)))
    train(_cfg(assets, tmp_path / "run", "reference.mode=copy"), progress=False, log=quiet)
    assert len(seen) == 4 and all(len(s) == 1 for s in seen[0::2]) and seen[1::2] == [{}, {}]


def test_an_image_damaged_after_prepare_is_named(assets, tmp_path, capsys):
    """images.bin damaged in place (same size, so the store still opens): the first micro-batch that reads the
    image stops the run with one line naming the store, the example and the image, not a Pillow traceback."""
    import shutil

    store = shutil.copytree(assets["store"], tmp_path / "store")
    first = Store(store).images_of(0)[0]
    data = bytearray((store / "images.bin").read_bytes())
    data[first["offset"]:first["offset"] + first["bytes"]] = b"\0" * first["bytes"]
    (store / "images.bin").write_bytes(bytes(data))
    capsys.readouterr()
    assert cli_main(["train", f"model.name_or_path={assets['model']}", f"data.train={store}",
                     f"run.output_dir={tmp_path / 'run'}", *RUN, "--no-progress"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert "image 0 of example 0" in err[-1] and "images.bin is damaged" in err[-1] and str(store) in err[-1], err
