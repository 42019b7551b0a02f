"""What prefpack reads from rows it does not trust: Parquet files and `save_to_disk` folders read raw (an Image
feature's bad image is a bad row, its URL never fetched; Arrow's unified tool structs lose their filler nulls); one
store named twice in a config; a damaged spans.bin; a reply with nothing left to score (issue 36)."""

from __future__ import annotations

import json

import numpy as np
import pytest

PIL_Image = pytest.importorskip("PIL.Image")
datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from conftest import write_jsonl  # noqa: E402
from test_prepare_vision import png  # noqa: E402

from prefpack.data.prepare import PrepareError, PrepareOptions, prepare  # noqa: E402
from prefpack.data.store import Store  # noqa: E402
from prefpack.tokenizer import load_tokenizer  # noqa: E402


def quiet(_m):
    return None






MESSAGES = datasets.List({"role": datasets.Value("string"),
                          "content": datasets.List({"type": datasets.Value("string"), "text": datasets.Value("string")})})


def image_rows(images: list) -> list[dict]:
    return [{"images": [im], "prompt": [{"role": "user", "content": [{"type": "image", "text": None},
                                                                     {"type": "text", "text": "what is it?"}]}],
             "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "a cat"}]}],
             "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "a dog"}]}]} for im in images]


def image_dataset(images: list):
    """A `datasets` Dataset whose `images` column is a list of the `Image` feature (as on the hub)."""
    features = datasets.Features({"images": datasets.List(datasets.Image()), "prompt": MESSAGES, "chosen": MESSAGES,
                                  "rejected": MESSAGES})
    return datasets.Dataset.from_list(image_rows(images), features=features)


@pytest.fixture
def image_inputs(tmp_path, monkeypatch):
    """The same rows (a good image, bytes that are not an image, a URL with no bytes) as a `save_to_disk` folder
    and as a Parquet file that carries the Image feature in its metadata."""
    good = png(40, 40)
    ds = image_dataset([{"bytes": good, "path": None}, {"bytes": b"not an image", "path": None},
                        {"bytes": None, "path": "https://example.invalid/cat.png"}])
    import datasets.arrow_dataset as arrow_dataset

    # save_to_disk sizes the files an Image path names (it would fetch the URL); here, writing the fixture only
    monkeypatch.setattr(arrow_dataset, "xgetsize", lambda *_a, **_k: 0)
    ds.save_to_disk(str(tmp_path / "folder"))
    ds.to_parquet(str(tmp_path / "hub.parquet"))
    monkeypatch.undo()
    assert b"Image" in pq.read_schema(tmp_path / "hub.parquet").metadata[b"huggingface"]
    return good, [tmp_path / "folder", tmp_path / "hub.parquet"]


def test_arrow_image_rows_are_checked_row_by_row(tmp_path, processor_dir, image_inputs, monkeypatch):
    import fsspec

    def no_fetch(*_a, **_k):
        raise AssertionError("an image URL was fetched")

    monkeypatch.setattr(fsspec, "open", no_fetch)
    monkeypatch.setattr(fsspec.core, "url_to_fs", no_fetch)
    good, inputs = image_inputs
    for src in inputs:
        name = src.name
        opts = dict(inputs=[str(src)], tokenizer=None, processor=str(processor_dir), workers=1)
        with pytest.raises(PrepareError, match=rf"{name} row 1, field 'images'.*image 0 \(12 bytes\) cannot be "
                           r"decoded.*\[undecodable_image\]"):
            prepare(PrepareOptions(output=str(tmp_path / f"s-{name}"), **opts), log=quiet)
        report = prepare(PrepareOptions(output=str(tmp_path / f"skip-{name}"), skip_invalid=True, **opts), log=quiet)
        assert report.skipped == {"undecodable_image": 1, "image_url": 1} and report.examples == 1
        skipped = [json.loads(line) for line in (report.path / "skipped.jsonl").read_text().splitlines()]
        assert [(s["row"], s["reason"]) for s in skipped] == [(1, "undecodable_image"), (2, "image_url")]
        assert "downloads nothing" in skipped[1]["message"] and "https://example.invalid/cat.png" in skipped[1]["message"]
        assert [im["data"] for im in Store(report.path, verify=True).images_of(0)] == [good]


def test_image_url_in_a_json_row_is_a_bad_row(tmp_path, processor_dir):
    rows = [{"image": "http://example.invalid/a.png", "question": "q?", "chosen": "a cat", "rejected": "a dog"}]
    with pytest.raises(PrepareError, match=r"rows.jsonl line 1, field 'image'.*'http://example.invalid/a.png'.*downloads "
                       r"nothing.*\[image_url\]"):
        prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "rows.jsonl", rows))], tokenizer=None,
                               processor=str(processor_dir), output=str(tmp_path / "s"), workers=1), log=quiet)


# ---------------------------------------------------------------- Arrow's unified tool structs

TEMPLATE = ("{%- if tools %}{{- 'Tools:' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
            "{{- '\\n' }}{%- endif %}"
            "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}{%- if m.content %}{{- m.content }}"
            "{%- endif %}{%- for c in m.tool_calls or [] %}{{- '<tool_call>' + (c.function | tojson) + '</tool_call>' }}"
            "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def tool(name: str, param: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {param: {"type": "string"}}, "required": [param]}}}


def test_arrow_tool_structs_lose_the_nulls_of_other_rows(tmp_path, toy_tokenizers):
    tok = load_tokenizer(toy_tokenizers["chatml"])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(tmp_path / "tok")
    rows = []
    for name, param, value in (("get_weather", "city", "Paris"), ("get_time", "zone", "UTC")):
        call = {"type": "function", "function": {"name": name, "arguments": {param: value}}}
        rows.append({"prompt": [{"role": "user", "content": f"{name}?"}],
                     "chosen": [{"role": "assistant", "content": None, "tool_calls": [call]}],
                     "rejected": [{"role": "assistant", "content": "no idea", "tool_calls": None}],
                     "tools": [tool(name, param)]})
    table = pa.Table.from_pylist(rows)  # one struct type for both rows: each row gets the other's keys as null
    assert table.to_pylist()[0]["tools"][0]["function"]["parameters"]["properties"]["zone"] is None
    pq.write_table(table, tmp_path / "tools.parquet")
    write_jsonl(tmp_path / "tools.jsonl", rows)
    for src in ("tools.parquet", "tools.jsonl"):
        prepare(PrepareOptions(inputs=[str(tmp_path / src)], tokenizer=str(tmp_path / "tok"),
                               output=str(tmp_path / f"s-{src}"), workers=1), log=quiet)
        st = Store(tmp_path / f"s-{src}")
        for i, row in enumerate(rows):
            pair = st.pair(i)
            expect = tok.apply_chat_template(row["prompt"], tools=row["tools"], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
            assert [int(t) for t in pair.prompt] == [int(t) for t in expect], src
            text = tok.decode([int(t) for t in pair.chosen])
            assert "null" not in text and json.dumps(row["chosen"][0]["tool_calls"][0]["function"]) in text, src


# ---------------------------------------------------------------- one store named twice in a config


def test_the_same_store_twice_in_data_train_is_refused_and_in_data_eval_warned(tmp_path, monkeypatch):
    from prefpack.config import ConfigError, load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "stores" / "hh").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "stores")
    base = ["model.name_or_path=m"]
    with pytest.raises(ConfigError, match=r"data.train\[1\] \('./stores/hh/'\) is the same store as data.train\[0\] "
                       r"\('stores/hh'\).*twice per epoch.*a larger weight"):
        load_config(None, [*base, "data.train=[{path: stores/hh}, {path: ./stores/hh/, name: again}]"]).validate()
    with pytest.raises(ConfigError, match=r"data.train\[2\] \('link/hh'\) is the same store as data.train\[0\]"):
        load_config(None, [*base, "data.train=[{path: stores/hh, weight: 2}, {path: stores/uf}, "
                                  "{path: link/hh, name: other, pairs: 3}]"]).validate()
    load_config(None, [*base, "data.train=[{path: stores/hh}, {path: stores/uf}]"]).validate()  # two stores: fine
    cfg = load_config(None, [*base, "data.train=stores/hh", "data.eval={a: stores/hh, b: link/hh, c: stores/uf}"])
    cfg.validate()
    assert cfg.warnings() == ["data.eval.b ('link/hh') is the same store as data.eval.a ('stores/hh'): it is "
                              "evaluated twice, the same numbers under both names"]


# ---------------------------------------------------------------- a damaged spans.bin


@pytest.fixture
def span_store(tmp_path, toy_tokenizers):
    rows = [{"prompt": "Question: what is spoken here?", "chosen": " The answer is forty-two, said the machine.",
             "rejected": " No idea.", "loss_masking_spans": {"chosen": [[2, 12]]}}] * 2
    rows[1] = {**rows[1], "prompt": "Another question?"}
    prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "rows.jsonl", rows))],
                           tokenizer=str(toy_tokenizers["llama"]), output=str(tmp_path / "store"), workers=1), log=quiet)
    st = Store(tmp_path / "store", verify=True)
    assert len(st.spans) == 2
    return tmp_path / "store"


def test_a_damaged_spans_file_is_refused_when_the_store_opens(span_store):
    from prefpack.data.store import StoreError

    spans_bin = span_store / "spans.bin"
    good = spans_bin.read_bytes()
    spans = np.frombuffer(good, np.int64).reshape(-1, 2).copy()
    damaged = {
        "out of range": spans + [[0, 0], [10**6, 10**6]],  # the second span past tokens.bin's end
        "reversed": spans[:, ::-1],
        "in the prompt": spans - [[0, 0], [spans[1, 0] - Store(span_store).index[1, 0], 0]],
    }
    for what, values in damaged.items():
        spans_bin.write_bytes(np.ascontiguousarray(values, np.int64).tobytes())
        with pytest.raises(StoreError, match=r"store: spans.bin: span [01] .*: the store is corrupt; prepare it "
                           "again$"):
            Store(span_store)  # no verify: a plain open, as train, eval and precompute-ref do
        assert what
    spans_bin.write_bytes(good[:-8])  # truncated
    with pytest.raises(StoreError, match=r"store: spans.bin has 24 bytes but meta.json says 32: the store is "
                       "truncated or corrupt"):
        Store(span_store)
    spans_bin.write_bytes(good)
    Store(span_store, verify=True)


# ---------------------------------------------------------------- a reply with nothing scored


def test_a_reply_with_nothing_scored_is_a_bad_row_at_prepare_and_refused_in_a_store(tmp_path, span_store,
                                                                                     toy_tokenizers):
    from prefpack.data.store import StoreError

    # prepare: every token of a completion masked is a bad row naming file, line and field (a check prepare has
    # had since --train-on: kept here beside the store's own)
    row = {"prompt": "Q?", "chosen": " all of it masked", "rejected": " no",
           "loss_masking_spans": {"chosen": [[0, 17]]}}
    with pytest.raises(PrepareError, match=r"one.jsonl line 1, field 'loss_masking_spans.chosen': .*no token of the "
                       r"completion 'chosen' is left scored.*\[no_scored_tokens\]"):
        prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "one.jsonl", [row]))],
                               tokenizer=str(toy_tokenizers["llama"]), output=str(tmp_path / "s1"), workers=1),
                log=quiet)
    # a store whose spans.bin covers a whole completion (damaged, or not written by this prepare) is refused when
    # it opens, not met by a length-normalised loss (ipo) as a division by zero mid-step
    st = Store(span_store)
    start, end = (int(x) for x in (st.index[1, 0] + st.index[1, 1], st.index[1, 0] + st.index[1, 1] + st.index[1, 2]))
    spans = np.array(st.spans).copy()
    spans[1] = [start, end]
    (span_store / "spans.bin").write_bytes(spans.astype(np.int64).tobytes())
    with pytest.raises(StoreError, match=rf"store: spans.bin: completion 2 \[{start}, {end}\) has no scored token "
                       r"left \(spans cover all of it\): the store is corrupt; prepare it again$"):
        Store(span_store)
