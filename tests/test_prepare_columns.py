"""prepare never drops a column silently: unused input columns are reported once by name; images, video and
multimodal content parts are refused (vision-language data is not supported yet)."""

from __future__ import annotations

import pytest
from conftest import write_jsonl

from prefpack.data.prepare import PrepareError, PrepareOptions, prepare
from prefpack.data.store import Store

PAIR = {"prompt": "Q: two plus two?", "chosen": " Four.", "rejected": " Five."}


def run(tmp_path, tok, rows, log=None, **kw):
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "store"
    return prepare(PrepareOptions(inputs=[str(data)], tokenizer=str(tok), output=str(out), workers=1,
                                  overwrite=True, **kw), log=log or (lambda m: None))


def test_unused_columns_are_reported_once_by_name(tmp_path, toy_tokenizers):
    lines: list[str] = []
    rows = [{**PAIR, "source": "web", "score_diff": 2}, {**PAIR, "source": "x", "id": 7}, dict(PAIR)]
    report = run(tmp_path, toy_tokenizers["llama"], rows, log=lines.append, chunk_rows=1)
    notes = [m for m in lines if "not used" in m]
    assert len(notes) == 1 and all(repr(c) in notes[0] for c in ("id", "score_diff", "source"))
    assert report.unused_columns == ["id", "score_diff", "source"] and "not used" not in report.summary()  # said once
    assert Store(report.path).meta["unused_columns"] == ["id", "score_diff", "source"]


def test_read_columns_are_not_reported(tmp_path, toy_tokenizers):
    lines: list[str] = []
    row = {**PAIR, "loss_masking_spans": {"chosen": [[1, 3]]}}
    report = run(tmp_path, toy_tokenizers["llama"], [row], log=lines.append)
    assert report.unused_columns == [] and not any("not used" in m for m in lines)


@pytest.mark.parametrize("column", ["images", "image", "videos"])
def test_an_image_column_is_refused(tmp_path, toy_tokenizers, column):
    with pytest.raises(PrepareError, match="vision-language data is not supported yet") as err:
        run(tmp_path, toy_tokenizers["llama"], [{**PAIR, column: ["img.png"]}])
    assert f"field {column!r}" in str(err.value) and "line 1" in str(err.value)


def test_an_empty_image_column_is_only_reported(tmp_path, toy_tokenizers):
    report = run(tmp_path, toy_tokenizers["llama"], [{**PAIR, "images": []}])
    assert report.unused_columns == ["images"]


def test_a_multimodal_content_part_is_refused(tmp_path, toy_tokenizers):
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    row = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "A cat."}],
           "rejected": [{"role": "assistant", "content": "A dog."}]}
    with pytest.raises(PrepareError, match="vision-language data is not supported yet") as err:
        run(tmp_path, toy_tokenizers["chatml"], [row])
    assert "field 'prompt'" in str(err.value) and "content part" in str(err.value)
    row["prompt"] = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
    with pytest.raises(PrepareError, match="vision-language data is not supported yet"):
        run(tmp_path, toy_tokenizers["chatml"], [row])
