"""A prompt of an image store is its tokens AND its images: two images of one size expand to the same placeholder
tokens, so prepare's repeated-prompt count and data.group_by_prompt's groups must tell them apart by their bytes."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL.Image")

from prefpack.data.prepare import PrepareOptions, prepare  # noqa: E402
from prefpack.data.store import Store  # noqa: E402
from prefpack.data.views import PairGroups  # noqa: E402
from prefpack.toy_vision import png_image, save_processor_dir, write_jsonl  # noqa: E402


def _row(image: str, chosen: str, rejected: str) -> dict:
    return {"images": [image], "prompt": [{"role": "user", "content": [{"type": "image"},
                                                                      {"type": "text", "text": "what is it?"}]}],
            "chosen": [{"role": "assistant", "content": [{"type": "text", "text": chosen}]}],
            "rejected": [{"role": "assistant", "content": [{"type": "text", "text": rejected}]}]}


def test_same_text_same_size_different_images_are_different_prompts(tmp_path):
    proc = save_processor_dir(tmp_path / "proc")
    for name, seed in (("a.png", 1), ("b.png", 2)):
        (tmp_path / name).write_bytes(png_image(56, 56, seed=seed))
    # rows 0 and 2 share image a (one prompt); row 1 has image b: same size, same text, same tokens
    rows = [_row("a.png", "a cat", "a dog"), _row("b.png", "a cat", "a dog"), _row("a.png", "a mat", "a dog")]
    report = prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "rows.jsonl", rows))], tokenizer=None,
                                    processor=str(proc), output=str(tmp_path / "store"), workers=1), log=lambda m: None)
    assert report.repeated_prompts == {"prompts": 1, "pairs": 2}
    store = Store(tmp_path / "store")
    assert store.pair(0).prompt.tolist() == store.pair(1).prompt.tolist()  # the tokens alone cannot tell them apart
    groups = PairGroups(store)
    assert sorted(sorted(int(x) for x in r) for r in groups.pair_rows) == [[0, 2], [1]]
