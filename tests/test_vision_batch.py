"""The vision fields of a collated micro-batch of an image store (issue 27, docs/images.md): Qwen2-VL's rope positions
equal ``Qwen2VLModel.get_rope_index`` on each sequence alone, in packed, padded and prompt-shared rows; every copy of
an image's placeholders maps to that image's feature rows; the images of a micro-batch are preprocessed once, and
their pixels are the processor's own output on the stored bytes; pairs, prompt groups and KTO examples with their KL
sequences; damaged counts fail clearly."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("PIL.Image")
pytest.importorskip("transformers")

from prefpack.batching.collate import collate_groups  # noqa: E402
from prefpack.batching.vision import (  # noqa: E402
    BatchImage,
    ImageLayoutError,
    VisionSettings,
    fill_vision,
    images_per_group,
    vision_fields,
)
from prefpack.data.prepare import PrepareOptions, prepare  # noqa: E402
from prefpack.data.store import Store, StoreError  # noqa: E402
from prefpack.data.views import PairGroups, UnpairedView  # noqa: E402
from prefpack.data.vision_inputs import (  # noqa: E402
    ImagePrefetcher,
    decode_image,
    read_batch_images,
    vision_settings,
)
from prefpack.loss_params import LOSS_PARAMS  # noqa: E402
from prefpack.objectives import KTOTask, LossParams, PairTask, RunSettings, Term  # noqa: E402
from prefpack.objectives.groups import PromptGroupTask  # noqa: E402
from prefpack.toy_vision import png_image, save_processor_dir, tiny_vlm, vision_rows, write_jsonl  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A pair store of vision rows: one or two images per prompt; rows 10 and 11 repeat row 0's prompt and image
    (a prompt group with row 0), row 12 has row 0's prompt tokens with another picture of the same size, row 13 has
    no image."""
    tmp = tmp_path_factory.mktemp("vision_batch")
    processor = save_processor_dir(tmp / "processor")
    rows = vision_rows(10, tmp / "images", seed=3)
    for answer in ("a red square", "two blue circles"):
        row = json.loads(json.dumps(rows[0]))
        row["rejected"][0]["content"][0]["text"] = answer
        rows.append(row)
    other = json.loads(json.dumps(rows[0]))
    w, h = decode_image((tmp / "images" / rows[0]["images"][0]).read_bytes()).size
    (tmp / "images" / "other.png").write_bytes(png_image(w, h, seed=99))
    other["images"] = ["other.png"]
    rows.append(other)
    text_only = json.loads(json.dumps(rows[1]))  # an image store's row without an image
    text_only["images"] = []
    text_only["prompt"][0]["content"] = [part for part in text_only["prompt"][0]["content"] if part["type"] == "text"]
    rows.append(text_only)
    src = write_jsonl(tmp / "images" / "rows.jsonl", rows)
    prepare(PrepareOptions(inputs=[str(src)], tokenizer=None, processor=str(processor), output=str(tmp / "store"),
                           workers=1), log=lambda _m: None)
    out = Store(tmp / "store")
    assert len(out) == 14 and out.images_of(13) == [] and len(out.images_of(2)) == 2
    return out


@pytest.fixture(scope="module")
def text_store(store, tmp_path_factory):
    """The text rows of a pair store (no images)."""
    tmp = tmp_path_factory.mktemp("text_store")
    src = write_jsonl(tmp / "rows.jsonl", [{"prompt": "what is it?", "chosen": " a cat", "rejected": " a dog"}] * 3)
    prepare(PrepareOptions(inputs=[str(src)], tokenizer=str(store.tokenizer_path()), output=str(tmp / "store"),
                           workers=1), log=lambda _m: None)
    return Store(tmp / "store")


@pytest.fixture(scope="module")
def model(store):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(store.tokenizer_path())
    return tiny_vlm("qwen2_vl", tok)


def flatnonzero(mask: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(mask.reshape(-1)).reshape(-1)


class Counting:
    """A preprocess callable that counts its calls and the images it saw."""

    def __init__(self, fn):
        self.fn, self.calls, self.images, self.threads = fn, 0, 0, []

    def __call__(self, images):
        self.calls += 1
        self.threads.append(threading.current_thread().name)
        self.images += len(images)
        return self.fn(images)


def settings_for(store, *, packing=True, shares=False, paired_as_kto=False, vision=None) -> RunSettings:
    params = {n: p.default for n, p in LOSS_PARAMS.items()} | {"f_divergence_type": "reverse_kl",
                                                                "use_weighting": False, "kl_pairing": "fixed"}
    if vision is None:
        vision = vision_settings(store)
    return RunSettings(micro_batch_tokens=1024, row_tokens=512, chunk_size=64, packing=packing,
                       pad_to_multiple_of=None, shares_prompts=shares, pad_id=0, global_batch=4, seed=0,
                       ranked_pairs="best_vs_rest", paired_as_kto=paired_as_kto, loss=LossParams(**params),
                       vision=vision)


def counting_settings(store):
    v = vision_settings(store)
    counter = Counting(v.preprocess)
    return VisionSettings(v.image_token_id, v.mrope, v.merge_size, counter), counter


def batches(task, ids=None):
    ids = np.arange(len(task)) if ids is None else np.asarray(ids)
    return [task.collate(p) for p in task.plan(ids, seed=1)]


# ---- reference readings of a batch


def sequence_spans(batch):
    """Per sequence: (row, flat indices of its whole sequence in token order, how many of them are its own tokens at
    the end). A prompt-shared later completion's sequence is its group's prompt (in the first completion) + its
    tokens."""
    b, length = batch.input_ids.shape
    seq, pos = batch.seq_index.reshape(-1).numpy(), batch.position_ids.reshape(-1).numpy()
    out = []
    for s in range(batch.num_sequences):
        own = np.flatnonzero(seq == s)
        row = int(own[0]) // length
        p0 = int(pos[own[0]])
        if p0 == 0:
            out.append((row, own, len(own)))
            continue
        at = int(own[0]) - 1
        while pos[at] != 0 or seq[at] < 0:  # back to where the shared prompt starts
            at -= 1
        prompt = np.arange(at, at + p0)
        assert (pos[prompt] == np.arange(p0)).all()
        out.append((row, np.concatenate([prompt, own]), len(own)))
    return out


def image_of_rows(batch):
    """Each feature row's image (from ``image_grid_thw``: image i's tokens are rows starts[i]..starts[i + 1] - 1)."""
    counts = (batch.image_grid_thw.prod(dim=1) // 4).numpy()
    return np.repeat(np.arange(len(counts)), counts), np.concatenate([[0], np.cumsum(counts)])


def check_rope(batch, model):
    """rope_positions of every sequence's own tokens equal get_rope_index on that sequence alone."""
    tid = model.config.image_token_id
    ids = batch.input_ids.reshape(-1)
    rope = batch.rope_positions.reshape(3, -1)
    feature_of = dict(zip(batch.image_positions.tolist(), batch.image_feature_rows.tolist()))
    image_of, _ = image_of_rows(batch)
    checked = 0
    for _, flat, own in sequence_spans(batch):
        tokens = ids[flat]
        images = list(dict.fromkeys(int(image_of[feature_of[int(f)]]) for f in flat if int(ids[f]) == tid))
        grid = batch.image_grid_thw[images] if images else None
        ref, _ = model.model.get_rope_index(tokens[None], (tokens == tid).int()[None], image_grid_thw=grid)
        assert torch.equal(rope[:, flat[-own:]], ref[:, 0, -own:])
        checked += 1
    assert checked == batch.num_sequences


def check_features(batch, store, examples, group_sizes):
    """Every copy of a group's placeholders takes its images' feature rows, images in order; the pixels are the
    processor's own output on the stored bytes of the batch's images (each once, in first-appearance order)."""
    tid = store.meta["processor"]["image_token_id"]
    seq = batch.seq_index.reshape(-1)
    ids = batch.input_ids.reshape(-1)
    flat_images = flatnonzero((ids == tid) & (seq >= 0))
    assert torch.equal(batch.image_positions, flat_images)  # every image token of the batch, every copy
    rows = dict(zip(batch.image_positions.tolist(), batch.image_feature_rows.tolist()))
    order = list(dict.fromkeys(int(e) for e in examples))
    stored = [im for e in order for im in store.images_of(e)]
    starts = np.concatenate([[0], np.cumsum([im["tokens"] for im in stored])])
    first_image = {e: sum(len(store.images_of(x)) for x in order[:order.index(e)]) for e in order}
    offsets = np.concatenate([[0], np.cumsum(group_sizes)])
    shared = batch.score_positions is not None
    for g, e in enumerate(examples):
        k = first_image[int(e)]
        n = len(store.images_of(int(e)))
        expected = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in range(k, k + n)]) if n else []
        for s in range(offsets[g], offsets[g + 1]):
            got = [rows[int(f)] for f in flatnonzero((seq == s) & (ids == tid))]
            if shared and s > offsets[g]:
                assert got == []
            else:
                assert got == list(expected)
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(store.path / "processor")
    want = proc(images=[decode_image(im["data"]) for im in stored], return_tensors="pt")
    assert torch.equal(batch.pixel_values, want["pixel_values"])
    assert torch.equal(batch.image_grid_thw, want["image_grid_thw"])


# ---- pairs


@pytest.mark.parametrize("packing,shares", [(True, False), (False, False), (True, True)])
def test_pairs(store, model, packing, shares):
    vision, counter = counting_settings(store)
    task = PairTask(store, settings_for(store, packing=packing, shares=shares, vision=vision), [Term("sigmoid")])
    got = batches(task)
    assert counter.calls == len(got) and counter.images == store.num_images  # once per micro-batch
    for batch in got:
        assert batch.packed == packing and (batch.score_positions is not None) == shares
        assert batch.rope_positions.shape == (3, *batch.input_ids.shape)
        check_rope(batch, model)
        check_features(batch, store, batch.pair_indices.tolist(), [2] * batch.num_pairs)


def test_shared_rows_give_the_unshared_numbers(store):
    """A completion of a prompt-shared row has the rotary positions it has laid out after its own prompt copy."""
    unshared = batches(PairTask(store, settings_for(store), [Term("sigmoid")]))
    shared = batches(PairTask(store, settings_for(store, shares=True), [Term("sigmoid")]))
    by_seq = {}
    for batch in unshared:
        rope = batch.rope_positions.reshape(3, -1)
        keys = batch.sequence_keys.tolist()
        for s, (_, flat, _own) in enumerate(sequence_spans(batch)):
            by_seq[keys[s]] = rope[:, flat]
    n = 0
    for batch in shared:
        rope = batch.rope_positions.reshape(3, -1)
        for s, (_, flat, own) in enumerate(sequence_spans(batch)):
            assert torch.equal(rope[:, flat[-own:]], by_seq[int(batch.sequence_keys[s])][:, -own:])
            n += 1
    assert n == len(by_seq) == 2 * len(store)


# ---- prompt groups and KTO


def test_prompt_groups(store, model):
    """A pair store grouped by prompt: rows 0, 10 and 11 are one group (the same prompt and picture); row 12, the
    same tokens with another picture, is not in it."""
    view = PairGroups(store)
    group0 = next(i for i in range(len(view)) if 0 in view.pair_rows[i])
    assert sorted(view.pair_rows[group0]) == [0, 10, 11]
    for shares in (False, True):
        vision, counter = counting_settings(store)
        task = PromptGroupTask(store, settings_for(store, shares=shares, vision=vision), [Term("sigmoid")])
        got = batches(task)
        assert counter.calls == len(got) and counter.images == store.num_images - 2  # rows 10, 11 share row 0's
        for batch in got:
            ids = batch.group_ids.tolist()
            check_rope(batch, model)
            check_features(batch, store, [task.prompt_row(i) for i in ids], [int(view.sizes[i]) for i in ids])


@pytest.mark.parametrize("shares", [False, True])
def test_kto_with_kl_sequences(store, model, shares):
    """KTO on the pair store's halves: an example and its KL sequence (its prompt, another example's completion)
    read the same images, preprocessed once for both passes."""
    vision, counter = counting_settings(store)
    task = KTOTask(store, settings_for(store, shares=shares, paired_as_kto=True, vision=vision), [Term("kto")])
    assert task.needs_kl
    got = batches(task)
    assert counter.calls == len(got)
    view = UnpairedView(store, paired_as_kto=True)
    read = 0
    for kb in got:
        assert kb.kl is not None and kb.kl.pixel_values is kb.main.pixel_values
        on = kb.to("meta")
        assert on.kl.pixel_values is on.main.pixel_values and on.main.pixel_values.device.type == "meta"
        assert torch.equal(kb.kl.image_grid_thw, kb.main.image_grid_thw)
        flat = kb.example_ids.tolist()
        if kb.main.score_positions is None:
            examples, sizes = [i // 2 for i in flat], [1] * len(flat)
        else:  # groups: consecutive examples of one prompt
            groups = [int(view.groups[i]) for i in flat]
            starts = [k for k in range(len(flat)) if k == 0 or groups[k] != groups[k - 1]]
            examples = [flat[k] // 2 for k in starts]
            sizes = np.diff(starts + [len(flat)]).tolist()
        read += sum(len(store.images_of(e)) for e in set(examples))  # a pair's two halves: its images once
        for part in (kb.main, kb.kl):
            check_rope(part, model)
            check_features(part, store, examples, sizes)
    assert counter.images == read


# ---- the functions alone


def test_hand_made_groups_and_damage():
    """vision_fields on hand-laid groups: a prompt of text, image (2x2 merged grid), text, image (1x3); packed and
    padded; a run whose length is not the image's stored count, or a sequence missing its images, fails clearly."""
    tid = 9
    prompt = np.array([1, 2, tid, tid, tid, tid, 3, tid, tid, tid, 4])
    groups = [(prompt, (np.array([5, 6]), np.array([7]))), (np.array([1, 2]), (np.array([5]),))]
    images = images_per_group([[((1, 4, 4), 4), ((1, 2, 6), 3)], []])
    settings = VisionSettings(tid, mrope=True, merge_size=2)
    for rows in ([[0, 1]], [[1], [0]], None):
        batch = collate_groups(groups, rows, ids=[0, 1])
        fields = vision_fields(batch, images, [2, 1], settings)
        rope = fields.rope_positions.reshape(3, -1)
        for s in range(2):  # both sequences of group 0: the same numbers on the prompt
            flat = flatnonzero(batch.seq_index.reshape(-1) == s)
            t, h, w = rope[:, flat[:11]].tolist()
            # text 0, 1; image 1 at 2: (2,2,2) (2,2,3) (2,3,2) (2,3,3); text at 2 + 2 = 4; image 2 at 5: w 5..7;
            # text at 5 + 3 = 8
            assert t == [0, 1, 2, 2, 2, 2, 4, 5, 5, 5, 8] and h == [0, 1, 2, 2, 3, 3, 4, 5, 5, 5, 8]
            assert w == [0, 1, 2, 3, 2, 3, 4, 5, 6, 7, 8]
            rows_of = dict(zip(fields.image_positions.tolist(), fields.image_feature_rows.tolist()))
            assert [rows_of[int(f)] for f in flat if int(batch.input_ids.reshape(-1)[f]) == tid] == list(range(7))
        assert rope[:, flatnonzero(batch.seq_index.reshape(-1) == 0)[11:]].tolist() == [[9, 10]] * 3
        assert rope[:, flatnonzero(batch.seq_index.reshape(-1) == 1)[11:]].tolist() == [[9]] * 3
    batch = collate_groups(groups, [[0, 1]], ids=[0, 1])
    with pytest.raises(ImageLayoutError, match="damaged"):
        vision_fields(batch, images_per_group([[((1, 4, 4), 4), ((1, 2, 8), 4)], []]), [2, 1], settings)
    with pytest.raises(ImageLayoutError, match=r"runs of \[4, 3\]"):
        vision_fields(batch, images_per_group([[((1, 2, 6), 3), ((1, 4, 4), 4)], []]), [2, 1], settings)
    with pytest.raises(ImageLayoutError, match="grid"):
        vision_fields(batch, images_per_group([[((1, 4, 4), 4), ((1, 2, 4), 3)], []]), [2, 1], settings)
    with pytest.raises(ImageLayoutError, match="0 image tokens"):
        vision_fields(batch, images_per_group([[((1, 4, 4), 4), ((1, 2, 6), 3)], [((1, 2, 2), 1)]]), [2, 1],
                      settings)
    # groups without images (an image store's text rows): no pixels, no positions, rope = the text positions
    text = collate_groups([(np.array([1, 2]), (np.array([5]), np.array([6, 7])))], [[0]], ids=[0])
    fill_vision(text, [[]], [2], settings, pixel_values=None)
    assert text.pixel_values is None and text.image_positions.numel() == 0
    assert torch.equal(text.rope_positions, text.position_ids.expand(3, -1, -1))
    # without mrope (a LLaVA-style tower): positions and rows only, no grid needed
    plain = vision_fields(batch, images_per_group([[(None, 4), (None, 3)], []]), [2, 1],
                          VisionSettings(tid, mrope=False))
    assert plain.rope_positions is None and plain.image_feature_rows.tolist() == list(range(7)) * 2


def test_prompt_shared_hand_made_and_shared_images():
    """A prompt-shared group of three completions (its later completions continue the prompt's rope) and a second
    group that reads the same image as the first (one feature row range for both)."""
    tid = 9
    prompt = np.array([1, tid, tid, 2])
    groups = [(prompt, (np.array([5, 6]), np.array([7]), np.array([8, 8, 8]))), (prompt, (np.array([4]),))]
    image = BatchImage(0, 2, (1, 2, 4))
    batch = collate_groups(groups, [[0, 1]], ids=[0, 1], share_prompts=True)
    fill_vision(batch, [[image], [image]], [3, 1], VisionSettings(tid, mrope=True, merge_size=2),
                pixel_values=torch.zeros(8, 3), image_grid_thw=[[1, 2, 4]])
    rope, seq = batch.rope_positions.reshape(3, -1), batch.seq_index.reshape(-1)
    # prompt: 0, image (1,1,1) (1,1,2), text at 1 + 2 = 3; completions from 4
    assert rope[:, seq == 0].tolist() == [[0, 1, 1, 3, 4, 5], [0, 1, 1, 3, 4, 5], [0, 1, 2, 3, 4, 5]]
    assert rope[:, seq == 1].tolist() == [[4]] * 3 and rope[:, seq == 2].tolist() == [[4, 5, 6]] * 3
    assert rope[:, seq == 3].tolist() == [[0, 1, 1, 3, 4], [0, 1, 1, 3, 4], [0, 1, 2, 3, 4]]
    assert batch.image_feature_rows.tolist() == [0, 1, 0, 1]
    with pytest.raises(ImageLayoutError, match="numbered"):
        vision_fields(batch, [[BatchImage(1, 2, (1, 2, 4))], []], [3, 1], VisionSettings(tid))


def test_processor_that_disagrees_with_the_store(store, tmp_path):
    """A processor folder whose settings give other token counts than the store holds fails on the first batch."""
    damaged = tmp_path / "store"
    shutil.copytree(store.path, damaged)
    config_path = damaged / "processor" / "preprocessor_config.json"
    config = json.loads(config_path.read_text())
    config["size"]["shortest_edge"] = 56 * 56 * 4
    config_path.write_text(json.dumps(config))
    other = Store(damaged)
    with pytest.raises(ImageLayoutError, match="the store holds"):
        read_batch_images(other, [0, 1], vision_settings(other))


def test_prefetcher_and_text_runs(store, text_store):
    """The prefetcher gives what a direct read gives (computed on its thread ahead of time), also through an
    objective's ``prefetch`` (pairs, KTO); a text run's batches (vision None) carry no vision fields."""
    v = vision_settings(store)
    pre = ImagePrefetcher(store, v)
    try:
        pre.submit([3, 1, 3])
        got, direct = pre.get([3, 1, 3]), read_batch_images(store, [3, 1, 3], v)
        assert torch.equal(got.pixel_values, direct.pixel_values) and got.group_images == direct.group_images
        assert got.group_images[0] == got.group_images[2]  # one example read twice: its images once
        assert pre.get([2]).num_images == len(store.images_of(2))  # not submitted: computed on the spot
    finally:
        pre.close()
    for cls, kw, terms in ((PairTask, {}, [Term("sigmoid")]), (KTOTask, {"paired_as_kto": True}, [Term("kto")])):
        vision, counter = counting_settings(store)
        task = cls(store, settings_for(store, shares=True, vision=vision, **kw), terms)
        planned = task.plan(np.arange(len(task)), seed=1)
        task.prefetch(planned)
        ahead = [task.collate(p) for p in planned]
        assert counter.calls == len(planned) and all(t.startswith("prefpack-images") for t in counter.threads)
        plain = batches(cls(store, settings_for(store, shares=True, **kw), terms))
        for a, b in zip(ahead, plain):
            a, b = (a, b) if cls is PairTask else (a.kl, b.kl)
            for name in ("pixel_values", "image_grid_thw", "image_positions", "image_feature_rows", "rope_positions"):
                assert torch.equal(getattr(a, name), getattr(b, name))
        task._images.close()
    text = dataclasses.replace(settings_for(store), vision=None)
    with pytest.raises(StoreError, match="needs the run's vision settings"):  # an image store in a text run
        PairTask(store, text, [Term("sigmoid")])
    with pytest.raises(StoreError, match="marks images with token"):
        KTOTask(store, dataclasses.replace(settings_for(store, paired_as_kto=True),
                                           vision=VisionSettings(3, mrope=True, merge_size=2)), [Term("kto")])
    batch = batches(PairTask(text_store, text, [Term("sigmoid")]))[0]
    assert batch.pixel_values is None and batch.image_positions is None and batch.rope_positions is None


def test_imports_stay_light():
    """The batching package (a low import floor) and the data module load neither transformers nor Pillow."""
    import subprocess
    import sys

    code = ("import sys, prefpack.batching.vision, prefpack.data.vision_inputs, prefpack.objectives.settings; "
            "print(sorted(m for m in ('transformers', 'PIL') if m in sys.modules))")
    root = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("packing", [True, False])
def test_fields_drive_the_model_like_its_own_forward(store, model, packing):
    """The contract's forward, done by hand with transformers' pieces: the vision tower once over the batch's pixels,
    feature rows written at the image positions, the language model on [4, B, L] positions (row 0 the 1-D ones the
    packing mask reads); every sequence's logits equal Qwen2-VL's own forward on that sequence alone."""
    task = PairTask(store, settings_for(store, packing=packing), [Term("sigmoid")])
    batch = batches(task)[0]
    inner = model.model
    with torch.no_grad():
        features = torch.cat(inner.get_image_features(batch.pixel_values, batch.image_grid_thw).pooler_output)
        embeds = inner.get_input_embeddings()(batch.input_ids)
        flat = embeds.view(-1, embeds.shape[-1]).clone()
        flat[batch.image_positions] = features[batch.image_feature_rows]
        positions = torch.cat([batch.position_ids[None], batch.rope_positions])
        hidden = inner.language_model(inputs_embeds=flat.view_as(embeds), position_ids=positions,
                                      attention_mask=batch.attention_mask, use_cache=False).last_hidden_state
        logits = model.lm_head(hidden).reshape(-1, model.lm_head.out_features)
        tid = model.config.image_token_id
        patches = np.concatenate([[0], np.cumsum(batch.image_grid_thw.prod(dim=1).numpy())])
        image_of, _ = image_of_rows(batch)
        rows = dict(zip(batch.image_positions.tolist(), batch.image_feature_rows.tolist()))
        for _, seq_flat, _own in sequence_spans(batch):
            ids = batch.input_ids.reshape(-1)[seq_flat][None]
            at = seq_flat[(ids[0] == tid).numpy()]
            images = list(dict.fromkeys(int(image_of[rows[int(f)]]) for f in at))
            kw = {}
            if images:
                kw = {"pixel_values": torch.cat([batch.pixel_values[patches[i]:patches[i + 1]] for i in images]),
                      "image_grid_thw": batch.image_grid_thw[images], "mm_token_type_ids": (ids == tid).int()}
            want = model(input_ids=ids, **kw).logits[0]
            torch.testing.assert_close(logits[seq_flat], want, rtol=1e-4, atol=1e-4)
