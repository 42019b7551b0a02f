"""A row's images are untrusted input (issue 36, docs/images.md "What prepare reads"): only files inside the input
file's folder or --image-root, regular files only, at most --max-image-bytes, no URL; decoded by the PNG, JPEG,
WebP, GIF, BMP and TIFF plugins only (an EPS never reaches Ghostscript); EXIF orientation applied at prepare and at
train time alike; sizes the processor refuses, pixel bombs and the image token's text in a row are bad rows naming
file, row and field."""

from __future__ import annotations

import io
import json
import os
import signal

import numpy as np
import pytest

PIL_Image = pytest.importorskip("PIL.Image")

from conftest import write_jsonl  # noqa: E402
from test_prepare_vision import png  # noqa: E402

from prefpack.batching.vision import VisionSettings  # noqa: E402
from prefpack.data.prepare import PrepareError, PrepareOptions, prepare  # noqa: E402
from prefpack.data.store import Store  # noqa: E402
from prefpack.data.vision_inputs import decode_image, processor_preprocess, read_batch_images  # noqa: E402


def row(image, question: str = "what is it?", chosen: str = "a cat") -> dict:
    return {"image": image, "question": question, "chosen": chosen, "rejected": "a dog"}


def run(tmp_path, src, processor_dir, name="store", **kw):
    opts = PrepareOptions(inputs=[str(src)], tokenizer=None, processor=str(processor_dir),
                          output=str(tmp_path / name), workers=1, overwrite=True, **kw)
    return prepare(opts, log=lambda _m: None)


def skipped(report) -> list[tuple[int, str, str, str]]:
    lines = (report.path / "skipped.jsonl").read_text().splitlines()
    return [(s["line"], s["field"], s["reason"], s["message"]) for s in map(json.loads, lines)]


@pytest.fixture
def folders(tmp_path):
    """data/ holds the rows and good.png; outside/ a picture the rows must not reach by default."""
    data, outside = tmp_path / "data", tmp_path / "outside"
    data.mkdir()
    outside.mkdir()
    (data / "good.png").write_bytes(png(40, 40, 1))
    (outside / "o.png").write_bytes(png(40, 40, 2))
    (data / "link.png").symlink_to(outside / "o.png")
    return data, outside


def test_paths_leading_out_of_the_input_folder_or_urls_are_bad_rows(tmp_path, processor_dir, folders):
    data, outside = folders
    rows = [row("good.png"), row("../outside/o.png"), row(str(outside / "o.png")), row("link.png"),
            row("/etc/passwd"), row({"bytes": None, "path": "../outside/o.png"}), row("http://example.com/a.png"),
            row("data:image/png;base64,iVBORw0KGgo="), row("a\0b.png")]
    src = write_jsonl(data / "rows.jsonl", rows)
    with pytest.raises(PrepareError, match=r"rows.jsonl line 2, field 'image': field 'image': image 0: the path "
                       r"'\.\./outside/o\.png' leads outside the input file's folder .*--image-root DIR.*"
                       r"\[image_outside\]"):
        run(tmp_path, src, processor_dir)
    report = run(tmp_path, src, processor_dir, skip_invalid=True)
    assert report.examples == 1 and report.skipped == {"image_outside": 5, "image_url": 2, "missing_image": 1}
    got = skipped(report)
    assert [(line, field, reason) for line, field, reason, _ in got] == [
        (2, "image", "image_outside"), (3, "image", "image_outside"), (4, "image", "image_outside"),
        (5, "image", "image_outside"), (6, "image", "image_outside"), (7, "image", "image_url"),
        (8, "image", "image_url"), (9, "image", "missing_image")]
    assert "a symbolic link to" in got[2][3] and "downloads nothing" in got[5][3] and "NUL" in got[7][3]
    assert Store(report.path).images_of(0)[0]["data"] == (data / "good.png").read_bytes()
    # --image-root allows that folder (by ../, absolute path or link), and still nothing else
    report = run(tmp_path, src, processor_dir, skip_invalid=True, image_root=str(outside))
    assert report.examples == 5 and report.skipped == {"image_outside": 1, "image_url": 2, "missing_image": 1}
    store = Store(report.path)
    assert [store.images_of(i)[0]["data"] for i in range(1, 5)] == [(outside / "o.png").read_bytes()] * 4
    with pytest.raises(PrepareError, match="--image-root .* is not a folder"):
        run(tmp_path, src, processor_dir, image_root=str(outside / "o.png"))


def test_only_regular_files_under_the_size_limit_are_read(tmp_path, processor_dir, folders):
    """A named pipe never blocks, a device is never read, a folder is named; a file or bytes value over
    --max-image-bytes is a bad row (at most the limit + 1 bytes read)."""
    data, _ = folders
    os.mkfifo(data / "pipe.png")
    (data / "sub").mkdir()
    big = png(64, 64, 3)
    (data / "big.png").write_bytes(big)
    rows = [row("good.png"), row("pipe.png"), row("/dev/zero"), row("sub"), row("big.png")]
    src = write_jsonl(data / "rows.jsonl", rows)
    old = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("prepare hung")))
    signal.alarm(60)
    try:
        report = run(tmp_path, src, processor_dir, skip_invalid=True, image_root="/dev",
                     max_image_bytes=len(big) - 1)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert report.examples == 1
    got = skipped(report)
    assert [(line, reason) for line, _, reason, _ in got] == [
        (2, "image_not_a_file"), (3, "image_not_a_file"), (4, "image_not_a_file"), (5, "image_too_large")]
    assert "is a named pipe" in got[0][3] and "is a device" in got[1][3] and "is a folder" in got[2][3]
    assert f"{len(big):,} bytes, over --max-image-bytes {len(big) - 1:,}" in got[3][3]
    # bytes in the row (a datasets Image feature), alike
    pq = pytest.importorskip("pyarrow.parquet")
    table = __import__("pyarrow").Table.from_pylist([row({"bytes": png(40, 40, 1), "path": None}),
                                                     row({"bytes": big, "path": None})])
    pq.write_table(table, data / "rows.parquet")
    report = run(tmp_path, data / "rows.parquet", processor_dir, skip_invalid=True, max_image_bytes=len(big) - 1)
    assert report.examples == 1 and report.skipped == {"image_too_large": 1}


def test_an_eps_is_never_rendered(tmp_path, processor_dir, monkeypatch):
    """Pillow's EPS plugin runs Ghostscript on the file: prepare and training decode the allowed formats only."""
    from PIL import EpsImagePlugin

    calls = []

    def ghostscript(*args, **kw):
        calls.append(args)
        raise OSError("Ghostscript must not run")

    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", ghostscript)
    buf = io.BytesIO()
    PIL_Image.new("RGB", (40, 40), "red").save(buf, format="EPS")
    eps = buf.getvalue()
    assert PIL_Image.open(io.BytesIO(eps)).format == "EPS"  # Pillow alone would take it for an EPS
    (tmp_path / "cat.png").write_bytes(eps)
    src = write_jsonl(tmp_path / "rows.jsonl", [row("cat.png")])
    with pytest.raises(PrepareError, match=r"rows.jsonl line 1, field 'image': .*image 0 \(.* bytes\) cannot be "
                       r"decoded: it is not a PNG, JPEG, WebP, GIF, BMP or TIFF image.*\[undecodable_image\]"):
        run(tmp_path, src, processor_dir)
    with pytest.raises(PIL_Image.UnidentifiedImageError):
        decode_image(eps)  # a store's bytes (training) go through the same allow-list
    assert calls == []


def exif_jpeg(width: int, height: int, orientation: int, seed: int = 0) -> bytes:
    exif = PIL_Image.Exif()
    exif[0x0112] = orientation
    return png(width, height, seed, "JPEG", exif=exif.tobytes())


def test_exif_orientation_is_applied_at_prepare_and_at_training(tmp_path, processor_dir):
    """As transformers' load_image: the stored size, the token count and the pixels training preprocesses are the
    oriented image's."""
    from PIL import ImageOps
    from transformers.image_utils import load_image

    data = exif_jpeg(112, 28, 6)  # a 112x28 picture to be turned a quarter: 28x112 as seen
    (tmp_path / "turned.jpg").write_bytes(data)
    src = write_jsonl(tmp_path / "rows.jsonl", [row("turned.jpg")])
    store = Store(run(tmp_path, src, processor_dir).path)
    image = store.images_of(0)[0]
    assert image["data"] == data  # the bytes as given
    assert (image["width"], image["height"]) == (28, 112) == load_image(str(tmp_path / "turned.jpg")).size
    preprocess, proc = processor_preprocess(store.path / "processor")
    want = proc(images=[ImageOps.exif_transpose(PIL_Image.open(io.BytesIO(data)))], return_tensors="pt")
    assert tuple(want["image_grid_thw"][0].tolist()) == (1, 8, 2)  # 112 rows of 28 pixels: 8 x 2 patches
    got = read_batch_images(store, [0], VisionSettings(image_token_id=store.meta["processor"]["image_token_id"],
                                                       mrope=True, merge_size=2, preprocess=preprocess))
    assert got.image_grid_thw.tolist() == want["image_grid_thw"].tolist()
    assert np.array_equal(got.pixel_values.numpy(), want["pixel_values"].numpy())
    assert decode_image(data).size == (28, 112)


def test_a_size_the_processor_refuses_is_a_bad_row(tmp_path, processor_dir):
    """Qwen2-VL's smart_resize raises for an aspect ratio of 200 or more: a bad row, not a traceback."""
    (tmp_path / "wide.png").write_bytes(png(28 * 201, 28, 4))
    (tmp_path / "ok.png").write_bytes(png(28 * 199, 28, 5))
    src = write_jsonl(tmp_path / "rows.jsonl", [row("ok.png"), row("wide.png")])
    with pytest.raises(PrepareError, match=r"rows.jsonl line 2, field 'image': field 'image': image 0 \(5628x28 "
                       r"pixels\) is refused by the image processor \(absolute aspect ratio must be smaller than 200"
                       r".*\[image_refused\]"):
        run(tmp_path, src, processor_dir)
    report = run(tmp_path, src, processor_dir, skip_invalid=True)
    assert report.examples == 1 and report.skipped == {"image_refused": 1}


def test_an_image_over_pillows_pixel_limit_is_a_bad_row(tmp_path, processor_dir, recwarn):
    """A 100-megapixel PNG (a few KiB) is refused before it is decoded, naming the row and the limit; over twice
    the limit (Pillow's own error) alike."""
    for name, side in (("huge.png", 10_000), ("huger.png", 14_000)):
        PIL_Image.new("1", (side, side)).save(tmp_path / name)
    (tmp_path / "ok.png").write_bytes(png(40, 40, 7))
    src = write_jsonl(tmp_path / "rows.jsonl", [row("huge.png"), row("huger.png"), row("ok.png")])
    limit = f"{PIL_Image.MAX_IMAGE_PIXELS:,}"
    with pytest.raises(PrepareError, match=rf"rows.jsonl line 1, field 'image': .*is 10000x10000 = 100,000,000 "
                       rf"pixels, over Pillow's limit of {limit} .*\[image_too_large\]"):
        run(tmp_path, src, processor_dir)
    report = run(tmp_path, src, processor_dir, skip_invalid=True)
    assert report.examples == 1 and report.skipped == {"image_too_large": 2}
    got = skipped(report)
    assert [(line, field) for line, field, _, _ in got] == [(1, "image"), (2, "image")]
    assert "196000000 pixels" in got[1][3] and "MAX_IMAGE_PIXELS" in got[1][3]
    assert not [w for w in recwarn if issubclass(w.category, PIL_Image.DecompressionBombWarning)]


def test_the_image_tokens_text_in_a_row_is_a_bad_row(tmp_path, processor_dir):
    """`<|image_pad|>` typed in a row's text would tokenise to image tokens with no image behind them (training then
    stops on a 'damaged' store): refused at prepare, naming the field, in every text column."""
    (tmp_path / "i.png").write_bytes(png(40, 40, 6))
    prompt = [{"role": "user", "content": [{"type": "text", "text": "what now?"}]}]
    rows = [row("i.png"), row("i.png", question="what is <|image_pad|> this?"),
            row("i.png", chosen="a cat <|image_pad|>")]
    src = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(PrepareError, match=r"rows.jsonl line 2, field 'question': field 'question' holds the text "
                       r"'<\|image_pad\|>', the processor's image placeholder.*\[image_token_in_text\]"):
        run(tmp_path, src, processor_dir)
    report = run(tmp_path, src, processor_dir, skip_invalid=True)
    assert [(line, field, reason) for line, field, reason, _ in skipped(report)] == [
        (2, "question", "image_token_in_text"), (3, "chosen", "image_token_in_text")]
    # a message row without images, the token in a reply's text part
    text_rows = [{"images": [], "prompt": prompt,
                  "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "x <|image_pad|>"}]}],
                  "rejected": [{"role": "assistant", "content": "a dog"}]}]
    src = write_jsonl(tmp_path / "msgs.jsonl", text_rows)
    with pytest.raises(PrepareError, match=r"msgs.jsonl line 1, field 'chosen'.*\[image_token_in_text\]"):
        run(tmp_path, src, processor_dir)


def test_the_cli_flags(tmp_path, processor_dir, folders, capsys):
    from prefpack.cli import main

    data, outside = folders
    src = write_jsonl(data / "rows.jsonl", [row("good.png"), row("link.png")])
    argv = ["prepare", str(src), "--processor", str(processor_dir), "--output", str(tmp_path / "s"), "--workers", "1"]
    assert main(argv + ["--image-root", str(outside)]) == 0
    meta = Store(tmp_path / "s").meta
    assert meta["num_images"] == 2 and meta["args"]["image_root"] == str(outside)
    assert main(argv + ["--overwrite", "--max-image-bytes", "10"]) != 0
    err = capsys.readouterr().err
    assert "rows.jsonl line 1, field 'image'" in err and "over --max-image-bytes 10" in err
