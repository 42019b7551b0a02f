"""The model side of vision-language training (issue 27): per-sequence log-probs of packed rows with images equal each
sequence run alone through the model's own forward (float64, Qwen2-VL and LLaVA, every CPU kernel), the vision tower
runs once per micro-batch, freezing and LoRA leave the vision side alone, the packing-leak guard covers these models,
and other vision-language models are refused. Batches are built by hand (tests/vision_cases.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vision_cases import IMAGE_ID, TOK, Images, hf_sequence_logps, model, prompt_ids, vision_batch

from prefpack.model import ModelError, apply_freeze, checks, packing_leak, sequence_logps, vision_parts
from prefpack.model.vision import lora_targets
from prefpack.toy_vision import tiny_vlm

KINDS = ("qwen2_vl", "llava")
ALL_KINDS = (*KINDS, "qwen2_5_vl")  # Qwen2.5-VL: a tiny model built here (tests/vision_cases.py)
KERNELS = ("sdpa", "packed_sdpa", "varlen")  # varlen runs its per-sequence reference on CPU


def _case(kind: str, seed: int = 0):
    """Three groups: a pair whose prompt shows image 0 (laid out twice), one sequence with images 1 and 2, one text
    sequence; five images' worth of placeholders, three images."""
    rng = np.random.default_rng(seed)
    images = Images(kind, 3, seed=seed)
    group_images = [[0], [1, 2], []]
    comp = lambda: rng.integers(5, 250, int(rng.integers(2, 6)))  # noqa: E731
    groups = [(prompt_ids(images, group_images[0], rng), (comp(), comp())),
              (prompt_ids(images, group_images[1], rng), (comp(),)),
              (prompt_ids(images, group_images[2], rng), (comp(),))]
    return images, groups, group_images


@pytest.mark.parametrize("attn", KERNELS)
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_packed_rows_equal_each_sequence_alone(kind, attn):
    m = model(kind, attn)
    images, groups, group_images = _case(kind)
    want = hf_sequence_logps(m, images, groups, group_images)
    for rows in ([[0, 1, 2]], [[0, 1], [2]], [[1], [2, 0]]):
        batch = vision_batch(m, images, groups, rows, group_images)
        with torch.no_grad():
            got = sequence_logps(m, batch, chunk_size=7)
        torch.testing.assert_close(got.logp_sum, want, rtol=0, atol=1e-10)
        if attn == "packed_sdpa":  # flattened to one row of real tokens too
            with torch.no_grad():
                flat = sequence_logps(m, batch, flatten=True)
            torch.testing.assert_close(flat.logp_sum, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_padded_layout_equals_each_sequence_alone(kind):
    m = model(kind, "sdpa")
    images, groups, group_images = _case(kind, seed=3)
    batch = vision_batch(m, images, groups, None, group_images, padded=True)
    with torch.no_grad():
        got = sequence_logps(m, batch)
    torch.testing.assert_close(got.logp_sum, hf_sequence_logps(m, images, groups, group_images), rtol=0, atol=1e-10)


@pytest.mark.parametrize("attn", ("packed_sdpa", "varlen"))
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_prompt_shared_rows_equal_each_sequence_alone(kind, attn):
    """A pair's prompt (with its image) laid out once, both completions reading it: rope positions continue from
    the prompt as in the unshared sequence."""
    m = model(kind, attn)
    images, groups, group_images = _case(kind, seed=5)
    batch = vision_batch(m, images, groups, [[0, 1], [2]], group_images, share_prompts=True)
    assert batch.image_positions.numel() == sum(images.tokens[i] for g in group_images for i in g)
    with torch.no_grad():
        got = sequence_logps(m, batch)
    torch.testing.assert_close(got.logp_sum, hf_sequence_logps(m, images, groups, group_images), rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_vision_tower_runs_once_per_micro_batch(kind):
    """One call of the tower over the batch's three images, though image 0's placeholders appear twice (the pair's
    prompt is laid out for both sides): both copies take the same feature rows."""
    m = model(kind, "packed_sdpa")
    images, groups, group_images = _case(kind)
    batch = vision_batch(m, images, groups, [[0, 1, 2]], group_images)
    calls = []
    handle = vision_parts(m).tower.register_forward_hook(lambda mod, args, out: calls.append(1))
    try:
        with torch.no_grad():
            sequence_logps(m, batch)
    finally:
        handle.remove()
    assert len(calls) == 1
    first = images.tokens[0]
    assert batch.image_positions.numel() == 2 * first + images.tokens[1] + images.tokens[2]
    rows = batch.image_feature_rows.tolist()
    assert rows[:first] == rows[first:2 * first] == list(range(first))  # the pair's two copies of image 0
    if kind != "llava":
        assert batch.image_grid_thw.shape[0] == 3  # each image preprocessed once
    else:
        assert batch.pixel_values.shape[0] == 3


def _grads(m, batch) -> dict[str, bool]:
    """Which parts got a gradient from a backward of the batch's summed log-probs."""
    m.zero_grad(set_to_none=True)
    sequence_logps(m, batch).logp_sum.sum().backward()
    parts = vision_parts(m)
    got = lambda mods: any(p.grad is not None for mod in mods for p in mod.parameters())  # noqa: E731
    return {"encoder": got(parts.encoder), "projector": got(parts.projector),
            "language_model": got([parts.language_model])}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("freeze_vision", "freeze_projector"), [(True, True), (False, True), (True, False),
                                                                 (False, False)])
def test_freeze_settings_decide_which_parts_learn(kind, freeze_vision, freeze_projector):
    m = model(kind, "packed_sdpa")
    images, groups, group_images = _case(kind)
    batch = vision_batch(m, images, groups, [[0, 1], [2]], group_images)
    apply_freeze(m, freeze_vision=freeze_vision, freeze_projector=freeze_projector)
    outputs = []
    handle = vision_parts(m).projector[0].register_forward_hook(lambda mod, args, out: outputs.append(out))
    try:
        got = _grads(m, batch)
    finally:
        handle.remove()
    assert got == {"encoder": not freeze_vision, "projector": not freeze_projector, "language_model": True}
    assert outputs[0].requires_grad == (not (freeze_vision and freeze_projector))  # both frozen: under no_grad


@pytest.mark.parametrize("kind", KINDS)
def test_lora_adapts_the_language_model_only(kind):
    from peft import LoraConfig, get_peft_model

    m = model(kind, "packed_sdpa")
    images, groups, group_images = _case(kind)
    batch = vision_batch(m, images, groups, [[0, 1, 2]], group_images)
    with torch.no_grad():
        base = sequence_logps(m, batch).logp_sum
    prefixes = vision_parts(m).prefixes()
    targets = lora_targets(m, "all-linear")
    vision_side = prefixes["encoder"] + prefixes["projector"]
    assert targets and not any(t.startswith(p) for t in targets for p in vision_side)
    assert "lm_head" not in targets
    unfrozen = lora_targets(m, "all-linear", freeze_vision=False)
    assert any(t.startswith(p) for t in unfrozen for p in prefixes["encoder"])
    assert lora_targets(m, ["q_proj"]) and all(t.endswith("q_proj") for t in lora_targets(m, ["q_proj"]))
    peft_model = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    adapted = [n for n, _ in peft_model.named_modules() if n.endswith("lora_A")]
    assert adapted and not any(".visual." in n or ".vision_tower." in n or "projector" in n or ".merger." in n
                               for n in adapted)
    out = sequence_logps(peft_model, batch)  # the adapter starts at zero: the base model's numbers
    torch.testing.assert_close(out.logp_sum.detach(), base, rtol=0, atol=1e-10)
    out.logp_sum.sum().backward()
    trained = {n for n, p in peft_model.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained)


@pytest.mark.parametrize("mode", ("copy", "adapter"))
def test_reference_modes_run_image_batches(mode):
    from peft import LoraConfig, get_peft_model

    from prefpack.reference.modes import make_reference

    kind = "qwen2_vl"
    m = model(kind, "packed_sdpa")
    images, groups, group_images = _case(kind)
    batch = vision_batch(m, images, groups, [[0, 1], [2]], group_images)
    want = hf_sequence_logps(m, images, groups, group_images)
    if mode == "copy":
        ref = make_reference("copy", model=model(kind, "packed_sdpa"))
    else:
        ref = make_reference("adapter")
        ref.bind_policy(get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=lora_targets(m, "all-linear"),
                                                     init_lora_weights=False)))
    torch.testing.assert_close(ref.sequence_logps(batch).logp_sum, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("attn", KERNELS)
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_leak_guard_covers_vision_language_models(kind, attn, monkeypatch):
    """The guard hands Qwen2-VL's body 4-row positions, as training does, and finds no leak; given 2-D positions that
    body reads no boundaries and lets packed sequences attend to each other, and the guard sees it (varlen reads the
    boundaries the forward computes on the host, so it keeps them apart either way)."""
    m = model(kind, attn)
    assert packing_leak(m) < 1e-12
    monkeypatch.setattr(checks, "_guard_positions", lambda model, position_ids: position_ids)
    leak = packing_leak(m)
    if kind != "llava" and attn != "varlen":
        assert leak > 1e-2
    else:
        assert leak < 1e-12


def test_text_batches_on_qwen2_vl_keep_sequences_apart():
    """A micro-batch without images on a Qwen2-VL model (text rows of a vision run) is packed safely too: its body
    still gets the 4-row positions."""
    m = model("qwen2_vl", "packed_sdpa")
    images, groups, group_images = _case("qwen2_vl")
    text = [groups[2], (groups[2][0][::-1].copy(), groups[2][1])]
    from prefpack.batching.collate import collate_groups

    batch = collate_groups(text, [[0, 1]], ids=[0, 1])
    with torch.no_grad():
        got = sequence_logps(m, batch).logp_sum
    torch.testing.assert_close(got, hf_sequence_logps(m, images, text, [[], []]), rtol=0, atol=1e-10)


def test_images_refused_under_sequence_parallelism():
    class Layout:
        enabled = True

    m = model("llava", "packed_sdpa")
    images, groups, group_images = _case("llava")
    batch = vision_batch(m, images, groups, [[0, 1, 2]], group_images)
    with pytest.raises(ValueError, match="sequence_parallel"):
        sequence_logps(m, batch, seq=Layout())
    # and at start, with the user's error type (one line from the CLI; precompute-ref --sequence-parallel reads it)
    from prefpack.model.sharded import check_model
    from prefpack.sequence_parallel import SequenceParallelError

    Layout.size = 2
    with pytest.raises(SequenceParallelError, match="vision-language model, and those do not run on token shards"):
        check_model(m, Layout())


def test_loading_gives_the_language_model_the_kernel(tmp_path):
    from prefpack.model import load_causal_lm

    for kind in KINDS:
        tiny_vlm(kind, TOK).save_pretrained(tmp_path / kind)
        m = load_causal_lm(str(tmp_path / kind), attn_implementation="packed_sdpa", device=torch.device("cpu"))
        assert type(m).__name__ == {"qwen2_vl": "Qwen2VLForConditionalGeneration",
                                    "llava": "LlavaForConditionalGeneration"}[kind]
        assert m.config._attn_implementation == m.config.text_config._attn_implementation == "packed_sdpa"
        assert m.config.vision_config._attn_implementation == "sdpa"
        assert all(p.dtype == torch.float32 for p in m.parameters())


def test_other_vision_language_models_are_refused(tmp_path):
    from transformers import CLIPVisionConfig, LlavaNextConfig, Qwen2Config

    from prefpack.model import load_causal_lm

    LlavaNextConfig(text_config=Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            intermediate_size=32),
                    vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                   num_attention_heads=2, image_size=28, patch_size=14),
                    ).save_pretrained(tmp_path / "next")
    with pytest.raises(ModelError, match="'llava_next'.*Qwen2-VL, Qwen2.5-VL, LLaVA"):
        load_causal_lm(str(tmp_path / "next"), attn_implementation="packed_sdpa", device=torch.device("cpu"))


def test_vision_parts_refuse_a_text_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    text = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=16))
    with pytest.raises(ValueError, match="not a vision-language model"):
        vision_parts(text)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_check_against_model_with_an_image(kind, monkeypatch):
    """The one-off check runs a random image through both forwards; it has teeth: features written one place off
    are seen."""
    from prefpack.model import check_against_model

    m = model(kind, "packed_sdpa")
    assert check_against_model(m) < 1e-5  # compared in float32, as for text models
    real = checks._vision_inputs

    def shifted(body, vision, batch, flatten):
        batch.image_positions = batch.image_positions + 1
        return real(body, vision, batch, flatten)

    monkeypatch.setattr(checks, "_vision_inputs", shifted)
    assert check_against_model(m) > 1e-3


@pytest.fixture(scope="module")
def vlm_world(tmp_path_factory):
    """Model folders (tiny Qwen2-VL and LLaVA, with the toy vision tokenizer) and a text store of that tokenizer."""
    from conftest import write_jsonl

    from prefpack.data.prepare import PrepareOptions, prepare

    root = tmp_path_factory.mktemp("vlm")
    for kind in KINDS:
        tiny_vlm(kind, TOK).save_pretrained(root / kind)
        TOK.save_pretrained(root / kind)
    rows = [{"prompt": f"user: what is in picture {i}? assistant:", "chosen": " a cat on a mat.",
             "rejected": " a dog in the fog."} for i in range(4)]
    prepare(PrepareOptions(inputs=[str(write_jsonl(root / "t.jsonl", rows))], tokenizer=str(root / "qwen2_vl"),
                           output=str(root / "store"), workers=1), log=lambda _m: None)
    return root


def _build(world, tmp_path, kind, *extra):
    from prefpack.config import load_config
    from prefpack.training.setup import build

    cfg = load_config(None, [f"model.name_or_path={world / kind}", f"data.train={world / 'store'}",
                             f"run.output_dir={tmp_path / 'run'}", "train.device=cpu", *extra])
    cfg.validate()
    lines = []
    return build(cfg, log=lines.append), lines


@pytest.mark.parametrize("kind", KINDS)
def test_build_applies_the_freeze_settings(vlm_world, tmp_path, kind):
    setup, lines = _build(vlm_world, tmp_path, kind, "model.freeze_projector=false")
    parts = vision_parts(setup.policy)
    trainable = lambda mods: {p.requires_grad for m in mods for p in m.parameters()}  # noqa: E731
    assert trainable(parts.encoder) == {False} and trainable(parts.projector) == {True}
    assert trainable([parts.language_model]) == {True}
    assert any("vision encoder frozen, projector trained" in line for line in lines)


@pytest.mark.parametrize("kind", KINDS)
def test_build_with_lora_adapts_the_language_model_only(vlm_world, tmp_path, kind):
    setup, _ = _build(vlm_world, tmp_path, kind, "lora.enabled=true", "reference.mode=adapter")
    names = [n for n, p in setup.policy.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n and "language_model" in n for n in names)


def test_build_refuses_unfreezing_on_a_text_model(tmp_path, toy_tokenizers):
    from conftest import tiny_llama, write_jsonl

    from prefpack.data.prepare import PrepareOptions, prepare

    tok = toy_tokenizers["llama"]
    model_dir = tiny_llama(tok, tmp_path / "llama", 0)
    rows = [{"prompt": "q?", "chosen": " a cat", "rejected": " a dog"}] * 2
    prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "t.jsonl", rows))], tokenizer=str(tok),
                           output=str(tmp_path / "store"), workers=1), log=lambda _m: None)
    from prefpack.config import load_config
    from prefpack.training.setup import build

    cfg = load_config(None, [f"model.name_or_path={model_dir}", f"data.train={tmp_path / 'store'}",
                             f"run.output_dir={tmp_path / 'run'}", "train.device=cpu", "model.freeze_vision=false"])
    with pytest.raises(ModelError, match="model.freeze_vision=false: .* is a text model"):
        build(cfg, log=lambda _m: None)


@pytest.mark.parametrize("attn", ("packed_sdpa", "varlen"))
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_gradients_equal_each_sequence_alone(kind, attn):
    """Everything trained (encoder and projector too): the gradients of a weighted sum of a packed batch's log-probs
    equal those of the same sum over each sequence run alone, though the batch encodes the pair's image once and
    both its copies take the same features (their gradients add up in the one tower call)."""
    m = model(kind, attn)
    apply_freeze(m, freeze_vision=False, freeze_projector=False)
    images, groups, group_images = _case(kind, seed=2)
    batch = vision_batch(m, images, groups, [[0, 1], [2]], group_images)
    w = torch.randn(batch.num_sequences, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    m.zero_grad(set_to_none=True)
    (sequence_logps(m, batch).logp_sum * w).sum().backward()
    ours = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    (hf_sequence_logps(m, images, groups, group_images, grad=True) * w).sum().backward()
    theirs = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    assert ours.keys() == theirs.keys() and any(".visual." in n or ".vision_tower." in n for n in ours)
    for name in ours:  # the vision towers apply their rotary embedding in float32, whatever the model's dtype
        atol = 1e-6 * float(theirs[name].abs().max()) if ".visual." in name else 1e-10
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=atol, msg=name)


def test_compiled_layers_are_the_language_models():
    """model.compile compiles the language model's decoder layers, not the vision tower's blocks (which a model may
    have more of)."""
    from prefpack.model.compile import decoder_layers

    for kind in ALL_KINDS:
        m = model(kind)
        assert decoder_layers(m) is vision_parts(m).language_model.layers


def test_image_batches_refused_where_they_cannot_run():
    """A batch with images for a text model, and feature rows the images do not have, are named."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    m = model("llava", "packed_sdpa")
    images, groups, group_images = _case("llava")
    batch = vision_batch(m, images, groups, [[0, 1, 2]], group_images)
    text = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(TOK), hidden_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, intermediate_size=16))
    with pytest.raises(ValueError, match="a batch with images for Qwen2ForCausalLM: .*not a vision-language model"):
        sequence_logps(text, batch)
    batch.pixel_values = batch.pixel_values[:2]  # one image short
    with pytest.raises(ValueError, match="give 8 feature rows but image_feature_rows reads row 11"):
        sequence_logps(m, batch)


def test_store_processor_checked_against_the_model(tmp_path):
    """A store's processor record (meta.json) must fit the model: its image token and its patch grid."""
    from prefpack.model.vision import check_processor
    from prefpack.toy_vision import image_processor

    m = model("qwen2_vl")
    record = {"image_token": "<|image_pad|>", "image_token_id": IMAGE_ID, "settings": image_processor().to_dict()}
    check_processor(m, record)
    with pytest.raises(ValueError, match="token id 7 .* model's image token id is"):
        check_processor(m, {**record, "image_token_id": 7})
    with pytest.raises(ValueError, match="merge_size is 3, but the model's vision tower has spatial_merge_size=2"):
        check_processor(m, {**record, "settings": {**record["settings"], "merge_size": 3}})
    llava = model("llava")
    check_processor(llava, {"image_token_id": IMAGE_ID, "settings": {"crop_size": {"height": 28, "width": 28}}})
    with pytest.raises(ValueError, match="crop is 336"):
        check_processor(llava, {"image_token_id": IMAGE_ID, "settings": {"crop_size": {"height": 336, "width": 336}}})
    # the other family's store (prepare records the processor's kind): refused by name before any pixel is read
    check_processor(llava, {"image_token_id": IMAGE_ID, "kind": "llava", "settings": {}})
    with pytest.raises(ValueError, match="prepared with a qwen2_vl processor, .* LLaVA"):
        check_processor(llava, {**record, "kind": "qwen2_vl"})
    with pytest.raises(ValueError, match="prepared with a llava processor, .* Qwen2-VL"):
        check_processor(m, {**record, "kind": "llava"})


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_bfloat16_autocast_over_float32_masters(kind):
    """Training's precision (float32 weights, bfloat16 autocast; on CPU here): the tower's bfloat16 features are
    written into the float32 embeddings, and the sums stay near float32's."""
    from prefpack.precision import Precision, set_compute_dtype

    m = model(kind, "packed_sdpa").float()
    images, groups, group_images = _case(kind)
    batch = vision_batch(m, images, groups, [[0, 1], [2]], group_images)
    batch.pixel_values = batch.pixel_values.float()
    with torch.no_grad():
        full = sequence_logps(m, batch).logp_sum
        set_compute_dtype(m, Precision(torch.float32, torch.bfloat16, autocast=True))
        half = sequence_logps(m, batch).logp_sum
    assert half.dtype == torch.float32 and torch.isfinite(half).all()
    torch.testing.assert_close(half, full, rtol=0.02, atol=0.5)
