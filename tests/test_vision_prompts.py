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


def test_a_processor_folders_own_chat_template_is_read(tmp_path):
    """A vision-language processor folder may keep its chat template in chat_template.json, apart from a tokenizer
    that has none (what processor.apply_chat_template, and so TRL, renders with): prepare reads it, and so does the
    tokenizer check at train time (the same loader), so the store and the model folder agree."""
    import json

    from prefpack.tokenizer import load_tokenizer, tokenizer_hash
    from prefpack.toy_vision import vision_tokenizer

    tok = vision_tokenizer()
    template = tok.chat_template
    tok.chat_template = None
    proc = save_processor_dir(tmp_path / "proc", tokenizer=tok)
    (proc / "chat_template.jinja").unlink(missing_ok=True)
    assert not load_tokenizer(proc).chat_template  # no template anywhere: image rows cannot be rendered
    (proc / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    loaded = load_tokenizer(proc)
    assert loaded.chat_template == template
    (tmp_path / "a.png").write_bytes(png_image(56, 56, seed=1))
    src = write_jsonl(tmp_path / "rows.jsonl", [_row("a.png", "a cat", "a dog")])
    prepare(PrepareOptions(inputs=[str(src)], tokenizer=None, processor=str(proc), output=str(tmp_path / "store"),
                           workers=1), log=lambda m: None)
    store = Store(tmp_path / "store")
    assert store.num_images == 1 and store.meta["tokenizer"]["hash"] == tokenizer_hash(loaded)
