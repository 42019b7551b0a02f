"""prepare --processor: TRL's and RLAIF-V's vision preference rows stored with their encoded images and each image
placeholder expanded to the processor's own token count; bad image rows named or skipped; inspect; old stores still
open; training on an image store refused (docs/images.md)."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest

PIL_Image = pytest.importorskip("PIL.Image")
pq = pytest.importorskip("pyarrow.parquet")

from conftest import write_jsonl  # noqa: E402

from prefpack.data.inspect import inspect_store  # noqa: E402
from prefpack.data.prepare import PrepareError, PrepareOptions, prepare  # noqa: E402
from prefpack.data.store import Store, StoreError  # noqa: E402
from prefpack.objectives import open_store  # noqa: E402


def _processor():
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil()




def png(width: int, height: int, seed: int = 0, fmt: str = "PNG", **save) -> bytes:
    """A seeded random picture's bytes (``fmt``: any format Pillow writes; ``save``: its writer's options)."""
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PIL_Image.fromarray(pixels).save(buf, format=fmt, **save)
    return buf.getvalue()


def processor_count(data: bytes) -> int:
    """The image processor's own token count for an image: grid_t * grid_h * grid_w / merge_size**2."""
    proc = _processor()
    grid = proc(images=[PIL_Image.open(io.BytesIO(data))])["image_grid_thw"][0]
    return int(np.prod(grid)) // proc.merge_size ** 2


def trl_row(images: list, parts: int | None = None, text: str = "what is in the picture?") -> dict:
    n = len(images) if parts is None else parts
    content = [{"type": "image"}] * n + [{"type": "text", "text": text}]
    return {"images": images, "prompt": [{"role": "user", "content": content}],
            "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "a cat on a mat"}]}],
            "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "a dog"}]}]}


def run(tmp_path, inputs, processor_dir, name="store", **kw):
    opts = PrepareOptions(inputs=[str(p) for p in inputs], tokenizer=None, processor=str(processor_dir),
                          output=str(tmp_path / name), workers=1, **kw)
    return prepare(opts, log=lambda _m: None)


def check_images(store: Store, row: int, expected: list[bytes], counts: list[int] | None = None) -> None:
    """Stored bytes equal the input's; each run of image tokens has the processor's count (Qwen2-VL's unless
    `counts` are given), at its position."""
    images = store.images_of(row)
    assert [im["data"] for im in images] == expected
    tid = store.meta["processor"]["image_token_id"]
    offset, prompt_len = int(store.index[row, 0]), int(store.index[row, 1])
    prompt_start = offset - prompt_len if store.kind == "ranked" else offset  # ranked: the prompt precedes its row
    prompt = np.asarray(store.tokens[prompt_start:prompt_start + prompt_len])
    assert int((prompt == tid).sum()) == sum(im["tokens"] for im in images)
    for k, (im, data) in enumerate(zip(images, expected)):
        assert im["tokens"] == (processor_count(data) if counts is None else counts[k])
        assert (im["width"], im["height"]) == PIL_Image.open(io.BytesIO(data)).size
        run_ = np.asarray(store.tokens[im["position"]:im["position"] + im["tokens"]])
        assert (run_ == tid).all() and store.tokens[im["position"] - 1] != tid
        assert store.tokens[im["position"] + im["tokens"]] != tid


def test_trl_layout_round_trip(tmp_path, processor_dir):
    a, b, c = png(64, 48, 0), png(100, 200, 1, "JPEG"), png(30, 30, 2)
    (tmp_path / "b.jpg").write_bytes(b)
    rows = [trl_row([{"bytes": a, "path": None}, {"bytes": None, "path": "b.jpg"}]),
            trl_row([{"bytes": c, "path": "ignored.png"}], text="and this one?"),
            trl_row([], text="no image here")]
    src = tmp_path / "in.parquet"
    pq.write_table(__import__("pyarrow").Table.from_pylist(rows), src)
    report = run(tmp_path, [src], processor_dir, chunk_rows=1)  # a block per row: offsets carried across blocks
    assert report.layout == "messages" and report.images == 3 and "images: 3 stored" in report.summary()
    store = Store(tmp_path / "store", verify=True)
    m = store.meta
    assert m["format_version"] == 3 and m["num_images"] == 3 and set(m["files"]) >= {"images.bin", "image_index.bin"}
    assert m["processor"]["class"].startswith("Qwen2VLImageProcessor") and len(m["processor"]["hash"]) == 64
    assert m["processor"]["settings"]["merge_size"] == 2 and (store.path / "processor").is_dir()
    check_images(store, 0, [a, b])
    check_images(store, 1, [c])
    assert store.images_of(2) == []
    text = inspect_store(str(store.path), row=0)
    assert f"<|image_pad|> x {processor_count(a)}" in text and f"<|image_pad|> x {processor_count(b)}" in text
    assert "image 0: 64x48 pixels" in text and "image 1: 100x200 pixels" in text and "images     3 (" in text
    # the same rows prepared again give the same processor hash; another processor setting another one
    assert run(tmp_path, [src], processor_dir, "again").path and \
        Store(tmp_path / "again").meta["processor"]["hash"] == m["processor"]["hash"]
    other = tmp_path / "other_processor"
    shutil.copytree(processor_dir, other)
    config = json.loads((other / "preprocessor_config.json").read_text())
    config["size"]["shortest_edge"] = 56 * 56 * 4  # a larger least image: more tokens for small images
    (other / "preprocessor_config.json").write_text(json.dumps(config))
    run(tmp_path, [src], other, "other")
    changed = Store(tmp_path / "other")
    assert changed.meta["processor"]["hash"] != m["processor"]["hash"]
    assert changed.images_of(1)[0]["tokens"] > store.images_of(1)[0]["tokens"]


def test_rlaif_v_layout(tmp_path, processor_dir):
    imgs = [png(56, 56, 3), png(80, 40, 4)]
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "0.png").write_bytes(imgs[0])
    (tmp_path / "imgs" / "1.png").write_bytes(imgs[1])
    rows = [{"ds_name": "x", "image": "imgs/0.png", "question": "what is it?", "chosen": "a cat", "rejected": "a dog",
             "image_path": "imgs/0.png"},
            {"ds_name": "x", "image": {"bytes": None, "path": "imgs/1.png"}, "question": "and it?", "chosen": "a mat",
             "rejected": "a fog", "image_path": "imgs/1.png"}]
    report = run(tmp_path, [write_jsonl(tmp_path / "rlaif.jsonl", rows)], processor_dir)
    assert report.layout == "rlaif-v" and report.images == 2 and report.unused_columns == ["ds_name", "image_path"]
    store = Store(tmp_path / "store")
    check_images(store, 0, imgs[:1])
    check_images(store, 1, imgs[1:])
    assert "what is it?" in inspect_store(str(store.path), row=0)
    # without --processor the same rows are refused, not trained text-only
    with pytest.raises(PrepareError, match="vision-language data is not supported yet without `prepare --processor"):
        prepare(PrepareOptions(inputs=[str(tmp_path / "rlaif.jsonl")], tokenizer=str(processor_dir),
                               output=str(tmp_path / "text"), workers=1), log=lambda _m: None)


def test_bad_image_rows_named_or_skipped(tmp_path, processor_dir):
    good = png(40, 40, 5)
    rows = [{"image": "missing.png", "question": "q?", "chosen": "a cat", "rejected": "a dog"},
            {"image": {"bytes": None, "path": "bad.png"}, "question": "q?", "chosen": "a cat", "rejected": "a dog"},
            {"image": "good.png", "question": "q?", "chosen": "a cat", "rejected": "a dog"}]
    (tmp_path / "bad.png").write_bytes(good[:60])  # a truncated PNG
    (tmp_path / "good.png").write_bytes(good)
    src = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(PrepareError, match=r"rows.jsonl line 1, field 'image': field 'image': image 0: cannot read "
                       r"the file .*missing.png.* \[missing_image\]"):
        run(tmp_path, [src], processor_dir)
    write_jsonl(src, rows[1:])
    with pytest.raises(PrepareError, match=r"rows.jsonl line 1, field 'image'.*cannot be decoded.*\[undecodable_image\]"):
        run(tmp_path, [src], processor_dir)
    trl = tmp_path / "trl.parquet"
    pq.write_table(__import__("pyarrow").Table.from_pylist([trl_row([{"bytes": good, "path": None}], parts=2),
                                                             trl_row([{"bytes": b"not an image", "path": None}]),
                                                             trl_row([{"bytes": good, "path": None}])]), trl)
    with pytest.raises(PrepareError, match=r"trl.parquet row 0, field 'images'.*holds 1 image\(s\) but the prompt "
                       r"'prompt' has 2.*\[image_count_mismatch\]"):
        run(tmp_path, [trl], processor_dir)
    report = run(tmp_path, [trl], processor_dir, skip_invalid=True)
    assert report.skipped == {"image_count_mismatch": 1, "undecodable_image": 1} and report.examples == 1
    skipped = [json.loads(line) for line in (report.path / "skipped.jsonl").read_text().splitlines()]
    assert [(s["row"], s["field"], s["reason"]) for s in skipped] == [
        (0, "images", "image_count_mismatch"), (1, "images", "undecodable_image")]
    assert "<12 bytes>" in json.dumps(skipped[1]["data"])  # image bytes are not dumped into skipped.jsonl
    check_images(Store(report.path, verify=True), 0, [good])
    write_jsonl(src, rows)
    report = run(tmp_path, [src], processor_dir, "rlaif", skip_invalid=True)
    assert report.skipped == {"missing_image": 1, "undecodable_image": 1} and report.examples == 1
    check_images(Store(report.path, verify=True), 0, [good])


def test_max_length_never_cuts_an_image(tmp_path, processor_dir):
    img = png(200, 200, 6)
    src = write_jsonl(tmp_path / "r.jsonl", [{"image": "i.png", "question": "q?", "chosen": "a cat", "rejected": "a dog"}])
    (tmp_path / "i.png").write_bytes(img)
    with pytest.raises(PrepareError, match=r"--max-length would cut this prompt, which holds 1 image.*\[image_prompt_cut\]"):
        run(tmp_path, [src], processor_dir, max_length=processor_count(img), min_prompt_keep=0)
    with pytest.raises(PrepareError, match=r"no examples left.*dropped: \{'too_long': 1\}"):
        run(tmp_path, [src], processor_dir, max_length=processor_count(img), truncation="drop", name="d")
    report = run(tmp_path, [src], processor_dir, max_length=processor_count(img) + 40, name="fits")
    assert report.examples == 1 and not report.truncated


def test_text_stores_unchanged_and_old_stores_open(tmp_path, processor_dir):
    src = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "what is it?", "chosen": "a cat", "rejected": "a dog"}])
    report = prepare(PrepareOptions(inputs=[str(src)], tokenizer=str(processor_dir), output=str(tmp_path / "s"),
                                    workers=1), log=lambda _m: None)
    meta_path = report.path / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["format_version"] == 2 and "num_images" not in meta and not (report.path / "images.bin").exists()
    assert Store(report.path).num_images == 0
    meta["format_version"] = 1  # a store from before spans.bin
    meta_path.write_text(json.dumps(meta))
    store = Store(report.path, verify=True)
    assert store.num_images == 0 and store.images_of(0) == [] and len(open_store(str(report.path), "train",
                                                                                 unpaired=False)) == 1


def test_an_image_store_opens_for_training_and_a_damaged_index_is_caught(tmp_path, processor_dir):
    (tmp_path / "i.png").write_bytes(png(32, 32, 7))
    src = write_jsonl(tmp_path / "r.jsonl", [{"image": "i.png", "question": "q?", "chosen": "a cat", "rejected": "a dog"}])
    path = run(tmp_path, [src], processor_dir).path
    for what in ("train", "eval", "reference"):
        assert open_store(str(path), what, unpaired=False).num_images == 1
    # a damaged image index is caught when the store opens
    meta = json.loads((path / "meta.json").read_text())
    meta["files"]["images.bin"]["bytes"] += 1
    (path / "images.bin").write_bytes((path / "images.bin").read_bytes()[:-1])
    with pytest.raises(StoreError, match="images.bin has"):
        Store(path)


def test_train_setup_refuses_an_image_store_for_a_text_model(tmp_path, processor_dir):
    """A text model cannot read images: `prefpack train` / `eval` say so at set-up, naming the store."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from prefpack.config import load_config
    from prefpack.training.setup import build

    (tmp_path / "i.png").write_bytes(png(32, 32, 8))
    src = write_jsonl(tmp_path / "r.jsonl", [{"image": "i.png", "question": "q?", "chosen": "a cat", "rejected": "a dog"}])
    path = run(tmp_path, [src], processor_dir).path
    tok = AutoTokenizer.from_pretrained(processor_dir)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "llama")
    tok.save_pretrained(tmp_path / "llama")
    cfg = load_config(None, [f"model.name_or_path={tmp_path / 'llama'}", f"data.train={path}",
                             f"run.output_dir={tmp_path / 'run'}"])
    with pytest.raises(StoreError, match="train store .* holds 1 images, but the model is a text model"):
        build(cfg, log=lambda _m: None)


def kto_row(images: list, label, text: str = "what is in the picture?", reply: str = "a cat on a mat") -> dict:
    """TRL's unpaired (KTO) vision layout: images, a message prompt with image parts, a completion and a label."""
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
    return {"images": images, "prompt": [{"role": "user", "content": content}],
            "completion": [{"role": "assistant", "content": [{"type": "text", "text": reply}]}], "label": label}


def test_unpaired_kto_rows_round_trip(tmp_path, processor_dir):
    a, b, c = png(64, 48, 10), png(90, 30, 11, "JPEG"), png(28, 56, 12)
    (tmp_path / "b.jpg").write_bytes(b)
    rows = [kto_row([{"bytes": a, "path": None}, {"bytes": None, "path": "b.jpg"}], True),
            kto_row([], False, text="no image", reply="a dog"),
            kto_row([{"bytes": c, "path": None}], False, reply="a dog in the fog"),
            {"images": [], "prompt": "plain text prompt", "completion": "a plain reply", "label": True}]
    src = tmp_path / "kto.parquet"
    pq.write_table(__import__("pyarrow").Table.from_pylist(rows[:3]), src)
    text_src = write_jsonl(tmp_path / "text.jsonl", rows[3:])
    report = run(tmp_path, [src, text_src], processor_dir, layout="unpaired", chunk_rows=2)
    assert report.layout == "unpaired" and report.images == 3 and report.examples == 4 and not report.unused_columns
    store = Store(tmp_path / "store", verify=True)
    assert store.kind == "unpaired" and store.meta["num_images"] == 3
    check_images(store, 0, [a, b])
    assert store.images_of(1) == [] and store.images_of(3) == []
    check_images(store, 2, [c])
    assert [store.unpaired(i).label for i in range(4)] == [1, 0, 0, 1]
    assert store.prompt_images(2) == store.images_of(2)
    text = inspect_store(str(store.path), row=0)
    assert f"<|image_pad|> x {processor_count(a)}" in text and "image 1: 90x30 pixels" in text
    # detected without --format, from the first row's prompt / completion / label
    detected = run(tmp_path, [src], processor_dir, "detected")
    assert detected.layout == "unpaired" and detected.images == 3


def reply(text: str) -> list:
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


def test_ranked_rows_with_images(tmp_path, processor_dir):
    a, b = png(56, 56, 13), png(40, 80, 14)
    row = trl_row([{"bytes": a, "path": None}, {"bytes": b, "path": None}])
    ranked = [{"images": row["images"], "prompt": row["prompt"], "scores": [2.0, 1.0, 0.5],
               "completions": [row["chosen"], row["rejected"], reply("nothing")]},
              {"images": [], "prompt": [{"role": "user", "content": [{"type": "text", "text": "no image"}]}],
               "scores": [1, 0], "completions": [reply("yes"), reply("no")]}]
    src = tmp_path / "ranked.parquet"
    pq.write_table(__import__("pyarrow").Table.from_pylist(ranked), src)
    report = run(tmp_path, [src], processor_dir)
    assert report.layout == "ranked" and report.groups == 2 and report.examples == 5 and report.images == 2
    store = Store(tmp_path / "store", verify=True)
    check_images(store, 0, [a, b])  # stored once, with the group's first row, which its prompt precedes
    assert store.images_of(1) == store.images_of(2) == [] and store.images_of(3) == []
    assert [im["data"] for im in store.prompt_images(2)] == [a, b] and store.prompt_images(4) == []
    prompt, _ = store.ranked_group(0)
    tid = store.meta["processor"]["image_token_id"]
    assert int((np.asarray(prompt) == tid).sum()) == processor_count(a) + processor_count(b)
    assert "image 1: 40x80 pixels" in inspect_store(str(store.path), row=2)


def test_bad_unpaired_and_reply_image_rows_named(tmp_path, processor_dir):
    """Unpaired image rows: a reply with an image part, images beside a string prompt, a bad label, an undecodable
    image are each named by file, row and field, or counted and skipped."""
    good = png(40, 40, 15)
    (tmp_path / "good.png").write_bytes(good)
    (tmp_path / "broken.png").write_bytes(good[:50])
    reply_image = kto_row(["good.png"], True)
    reply_image["completion"] = [{"role": "assistant", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
    rows = [kto_row(["good.png"], True),
            reply_image,
            {"images": ["good.png"], "prompt": "a string prompt", "completion": "x", "label": True},
            kto_row(["good.png"], "maybe"),
            kto_row(["broken.png"], False),
            kto_row(["good.png", "good.png"], False) | {"prompt": kto_row(["good.png"], False)["prompt"]}]
    cases = [(1, "completion", r"message 0 has a 'image' content part, which a reply cannot hold yet", "vision_not_supported"),
             (2, "images", r"the prompt 'prompt' is a plain string", "vision_not_supported"),
             (3, "label", r"must be a boolean", "wrong_type"),
             (4, "images", r"image 0 \(50 bytes\) cannot be decoded", "undecodable_image"),
             (5, "images", r"holds 2 image\(s\) but the prompt 'prompt' has 1", "image_count_mismatch")]
    for k, field, message, reason in cases:
        src = write_jsonl(tmp_path / f"bad{k}.jsonl", [rows[0], rows[k]])
        with pytest.raises(PrepareError, match=rf"bad{k}.jsonl line 2, field '{field}': .*{message}.*\[{reason}\]"):
            run(tmp_path, [src], processor_dir, layout="unpaired")
    report = run(tmp_path, [write_jsonl(tmp_path / "all.jsonl", rows)], processor_dir, skip_invalid=True)
    assert report.examples == 1 and report.skipped == {"vision_not_supported": 2, "wrong_type": 1,
                                                       "undecodable_image": 1, "image_count_mismatch": 1}
    skipped = [json.loads(line) for line in (report.path / "skipped.jsonl").read_text().splitlines()]
    assert [(s["row"], s["field"]) for s in skipped] == [(k, field) for k, field, *_ in cases]
    check_images(Store(report.path, verify=True), 0, [good])
    # a pair whose reply holds an image part is named the same way
    pair = trl_row(["good.png"])
    pair["rejected"] = [{"role": "assistant", "content": [{"type": "image"}]}]
    with pytest.raises(PrepareError, match=r"pair.jsonl line 1, field 'rejected': .*a reply cannot hold yet.*"
                       r"\[vision_not_supported\]"):
        run(tmp_path, [write_jsonl(tmp_path / "pair.jsonl", [pair])], processor_dir, "pair")


LLAVA_VARIANTS = {  # name: (LlavaProcessor settings, CLIP image processor settings)
    "toy": ({}, {}),  # the tiny LLaVA's: 28 x 28 crop, 14-pixel patches, CLS dropped: 4 tokens
    "full": ({"vision_feature_select_strategy": "full"}, {}),  # the CLS feature kept: 5
    "no_crop": ({}, {"do_center_crop": False}),  # shortest edge 28, the other scaled: depends on the image's shape
    "fixed": ({"num_additional_image_tokens": 0, "vision_feature_select_strategy": "full"},
              {"size": {"height": 42, "width": 56}, "do_center_crop": False}),
    "raw": ({}, {"do_resize": False, "do_center_crop": False}),  # the image's own size
    "padded": ({}, {"size": {"height": 28, "width": 28}, "do_center_crop": False, "do_pad": True,
                    "pad_size": {"height": 42, "width": 56}}),
}


@pytest.fixture(scope="module")
def llava_dirs(tmp_path_factory):
    from prefpack.toy_vision import save_processor_dir, vision_tokenizer

    tok = vision_tokenizer()
    root = tmp_path_factory.mktemp("llava")
    return {name: save_processor_dir(root / name, "llava", tok, image_settings=image, **settings)
            for name, (settings, image) in LLAVA_VARIANTS.items()}


def llava_count(folder, data: bytes) -> int:
    """LlavaProcessor's own expansion: how many image tokens it writes for one image placeholder."""
    from transformers import AutoProcessor, LlavaProcessor

    proc = AutoProcessor.from_pretrained(folder)
    assert isinstance(proc, LlavaProcessor)
    ids = proc(text=f"{proc.image_token} what is it?", images=[PIL_Image.open(io.BytesIO(data))])["input_ids"][0]
    return int((np.asarray(ids) == proc.image_token_id).sum())


def test_llava_counts_equal_the_processors_expansion(tmp_path, llava_dirs):
    from prefpack.data.images import load_vision
    from prefpack.toy_vision import vision_tokenizer

    sizes = [(28, 28), (56, 28), (10, 30), (100, 37), (300, 200), (64, 64)]
    images = [png(w, h, 20 + k, "JPEG" if k % 2 else "PNG") for k, (w, h) in enumerate(sizes)]
    for k, data in enumerate(images):
        (tmp_path / f"{k}.img").write_bytes(data)
    rows = [trl_row([f"{k}.img" for k in range(3)]), trl_row([f"{k}.img" for k in range(3, 6)])]
    src = write_jsonl(tmp_path / "rows.jsonl", rows)
    hashes = set()
    for name, folder in llava_dirs.items():
        vision = load_vision(str(folder), vision_tokenizer())
        counts = [llava_count(folder, data) for data in images]
        assert [vision.placeholder_tokens(w, h) for w, h in sizes] == counts, name
        if 0 in counts:  # "raw": the 10 x 30 image is smaller than a patch, a bad row
            assert name == "raw" and counts.index(0) == 2
            with pytest.raises(PrepareError, match=r"rows.jsonl line 1, field 'images': field 'images': image 2 "
                               r"\(10x30 pixels\) gets 0 image tokens .*\[image_too_small\]"):
                run(tmp_path, [src], folder, name)
            hashes.add(name)
            continue
        report = run(tmp_path, [src], folder, name)
        store = Store(report.path, verify=True)
        check_images(store, 0, images[:3], counts[:3])
        check_images(store, 1, images[3:], counts[3:])
        meta = store.meta["processor"]
        assert meta["kind"] == "llava" and meta["image_token"] == "<|image_pad|>"
        assert meta["processor_settings"]["patch_size"] == 14 and meta["class"].startswith("CLIPImageProcessor")
        hashes.add(meta["hash"])
        from transformers import AutoImageProcessor

        assert type(AutoImageProcessor.from_pretrained(store.path / "processor")).__name__.startswith("CLIPImage")
    assert len(hashes) == len(LLAVA_VARIANTS)  # every LlavaProcessor setting is in the processor's hash
    assert {llava_count(llava_dirs["toy"], data) for data in images} == {4}  # the tiny LLaVA's 2 x 2 patches


def test_llava_image_token_is_the_processors(tmp_path):
    """The image token is the processor's: a LlavaProcessor naming ``<|vision_start|>`` expands that token."""
    from prefpack.data.images import load_vision
    from prefpack.toy_vision import save_processor_dir, vision_tokenizer

    tok = vision_tokenizer()
    folder = save_processor_dir(tmp_path / "p", "llava", tok, image_token="<|vision_start|>")
    vision = load_vision(str(folder), tok)
    assert vision.image_token == "<|vision_start|>" and vision.image_token_id == tok.convert_tokens_to_ids(
        "<|vision_start|>")
    data = png(50, 50, 30)
    assert vision.placeholder_tokens(50, 50) == llava_count(folder, data) == 4


def test_unsupported_processors_refused_by_name(tmp_path, processor_dir):
    from prefpack.toy_vision import image_processor, save_processor_dir, vision_tokenizer

    src = write_jsonl(tmp_path / "r.jsonl", [{"image": "i.png", "question": "q?", "chosen": "a", "rejected": "b"}])
    clip = tmp_path / "clip"  # an image processor without a LlavaProcessor's settings
    vision_tokenizer().save_pretrained(clip)
    image_processor("llava").save_pretrained(clip)
    with pytest.raises(PrepareError, match=r"CLIPImageProcessor\w* is not supported yet; prefpack expands images for "
                       r"the Qwen2-VL family .* and LlavaProcessor"):
        run(tmp_path, [src], clip)
    other = save_processor_dir(tmp_path / "other", "llava")
    config = json.loads((other / "processor_config.json").read_text())
    (other / "processor_config.json").write_text(json.dumps({**config, "processor_class": "LlavaNextProcessor"}))
    with pytest.raises(PrepareError, match=r"LlavaNextProcessor with CLIPImageProcessor\w* is not supported yet"):
        run(tmp_path, [src], other)
    for key, value, message in (("patch_size", None, "must give the vision tower's patch_size"),
                                ("vision_feature_select_strategy", "cls", "must be 'default' or 'full'"),
                                ("image_token", "<no such token>", "the tokenizer has no '<no such token>' token")):
        (other / "processor_config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(PrepareError, match=rf"--processor .*{message}"):
            run(tmp_path, [src], other)


def test_toy_llava_store_fits_the_tiny_llava_model(tmp_path, llava_dirs):
    """The toy LLaVA folder's counts are the tiny LLaVA model's: its forward takes a stored prompt (image tokens as
    stored) with the pixels of the store's own image processor, and gives one feature per image token."""
    import torch
    from transformers import AutoImageProcessor

    from prefpack.toy_vision import tiny_vlm, vision_tokenizer

    data = [png(60, 40, 40), png(28, 90, 41)]
    src = tmp_path / "kto.parquet"
    pq.write_table(__import__("pyarrow").Table.from_pylist([kto_row([{"bytes": d, "path": None} for d in data],
                                                                    True)]), src)
    store = Store(run(tmp_path, [src], llava_dirs["toy"]).path)
    images = store.images_of(0)
    assert [im["tokens"] for im in images] == [4, 4]
    model = tiny_vlm("llava", vision_tokenizer())
    assert model.config.image_token_id == store.meta["processor"]["image_token_id"]
    pixels = AutoImageProcessor.from_pretrained(store.path / "processor")(
        [PIL_Image.open(io.BytesIO(im["data"])) for im in images], return_tensors="pt")["pixel_values"]
    ex = store.unpaired(0)
    ids = torch.tensor(np.concatenate([ex.prompt, ex.completion]).astype(np.int64))[None]
    with torch.no_grad():
        features = model.get_image_features(pixel_values=pixels)
        features = getattr(features, "pooler_output", features)
        assert sum(len(f) for f in features) == sum(im["tokens"] for im in images)
        assert model(input_ids=ids, pixel_values=pixels).logits.shape[1] == ids.shape[1]


def test_images_beside_string_pairs_named(tmp_path, processor_dir):
    (tmp_path / "i.png").write_bytes(png(32, 32, 50))
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q?", "chosen": "a cat", "rejected": "a dog",
                                              "images": ["i.png"]}])
    with pytest.raises(PrepareError, match=r"p.jsonl line 1, field 'images': .*images are read for the messages, "
                       r"rlaif-v, unpaired, ranked layouts only, not 'pairs' \[vision_not_supported\]"):
        run(tmp_path, [src], processor_dir)


def test_same_text_other_image_is_another_prompt(tmp_path, processor_dir):
    """Image tokens are the same placeholder ids whatever the image: prompts that differ only by their image are not
    repeated prompts (prepare's count) nor one prompt group (data.group_by_prompt)."""
    from prefpack.data.views import _prompt_groups

    a, b = png(56, 56, 60), png(56, 56, 61)  # same size: the same tokens
    rows = [trl_row([{"bytes": a, "path": None}]), trl_row([{"bytes": b, "path": None}]),
            trl_row([{"bytes": a, "path": None}])]
    src = tmp_path / "p.parquet"
    pq.write_table(__import__("pyarrow").Table.from_pylist(rows), src)
    report = run(tmp_path, [src], processor_dir)
    assert report.repeated_prompts == {"prompts": 1, "pairs": 2}  # rows 0 and 2 only
    store = Store(report.path)
    assert np.array_equal(store.pair(0).prompt, store.pair(1).prompt)
    assert store.image_key(0) == store.image_key(2) != store.image_key(1) and len(store.image_key(0)) == 16
    groups = _prompt_groups(store).tolist()
    assert groups[0] == groups[2] != groups[1]
