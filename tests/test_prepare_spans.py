"""prepare's side of issue 23: the store writer keeps unscored spans (format version 2), and a version-1 store still
opens and reads as before."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import prepare_hh_splits

from prefpack.data.spans import check_spans, mask_to_spans, scored_of
from prefpack.data.store import Store, StoreError, StoreWriter


def test_mask_to_spans_gives_the_runs_of_unscored_tokens():
    assert mask_to_spans(np.array([True, False, False, True, False])).tolist() == [[1, 3], [4, 5]]
    assert mask_to_spans(np.ones(3, bool), 10).tolist() == []
    assert mask_to_spans(np.zeros(2, bool), 10).tolist() == [[10, 12]]


def test_writer_stores_spans_as_absolute_positions(tmp_path):
    w = StoreWriter(tmp_path / "s", kind="unpaired", vocab_size=50, log=None)
    # block 1: prompt 2 + completion 4, tokens 3..4 of the block unscored; block 2 the same shape, token 5 unscored
    w.append(np.arange(6), np.array([[0, 2, 4, 1, 0, 0, 0]]), np.array([[3, 5]]))
    w.append(np.arange(6), np.array([[0, 2, 4, 0, 0, 0, 1]]), np.array([[5, 6]]))
    path = w.commit({"tokenizer": {"vocab_size": 50}})
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format_version"] == 2 and meta["num_spans"] == 2 and "spans.bin" in meta["files"]
    st = Store(path, verify=True)
    assert st.spans.tolist() == [[3, 5], [11, 12]]
    assert scored_of(st.unpaired(0).completion).tolist() == [True, False, False, True]
    assert scored_of(st.unpaired(1).completion).tolist() == [True, True, True, False]


def test_writer_without_spans_writes_no_spans_file(tmp_path):
    w = StoreWriter(tmp_path / "s", kind="unpaired", vocab_size=50, log=None)
    w.append(np.arange(6), np.array([[0, 2, 4, 1, 0, 0, 0]]))
    path = w.commit({"tokenizer": {"vocab_size": 50}})
    assert not (path / "spans.bin").exists() and json.loads((path / "meta.json").read_text())["num_spans"] == 0


def test_writer_refuses_spans_out_of_order(tmp_path):
    w = StoreWriter(tmp_path / "s", kind="unpaired", vocab_size=50, log=None)
    w.append(np.arange(6), np.array([[0, 2, 4, 1, 0, 0, 0]]), np.array([[4, 6]]))
    with pytest.raises(StoreError, match="out of order"):
        w.append(np.arange(6), np.array([[0, 2, 4, 1, 0, 0, 0]]), np.array([[3, 1]]))
    w.abort()


def test_check_spans_names_each_fault():
    starts, ends = np.array([2, 6, 12]), np.array([6, 10, 15])
    assert check_spans(np.array([[2, 3], [7, 10]]), starts, ends) is None
    assert "unsorted or overlapping" in check_spans(np.array([[7, 9], [3, 4]]), starts, ends)
    assert "unsorted or overlapping" in check_spans(np.array([[2, 5], [4, 6]]), starts, ends)
    assert "not inside one completion" in check_spans(np.array([[5, 7]]), starts, ends)
    assert "not inside one completion" in check_spans(np.array([[10, 11]]), starts, ends)
    assert "empty" in check_spans(np.array([[3, 3]]), starts, ends)


def test_open_refuses_a_span_outside_the_completions(tmp_path, toy_tokenizers, hh_train):
    path = prepare_hh_splits(tmp_path, toy_tokenizers["llama"], hh_train, {"train": 3})["train"]
    np.array([[0, 1]], dtype=np.int64).tofile(path / "spans.bin")  # the first prompt token: not a completion's
    meta = json.loads((path / "meta.json").read_text())
    meta["num_spans"] = 1
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="not inside one completion"):
        Store(path)  # refused when it opens (a vector pass over spans.bin), not mid-training


def test_a_version_1_store_opens_and_reads_unchanged(tmp_path, toy_tokenizers, hh_train):
    path = prepare_hh_splits(tmp_path, toy_tokenizers["llama"], hh_train, {"train": 4})["train"]
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format_version"] == 2 and meta["num_spans"] == 0 and not (path / "spans.bin").exists()
    new = Store(path)
    pairs = [new.pair(i) for i in range(len(new))]
    del meta["num_spans"]
    meta["format_version"] = 1
    (path / "meta.json").write_text(json.dumps(meta))
    old = Store(path, verify=True)
    assert old.spans.shape == (0, 2)
    for i, pair in enumerate(pairs):
        for a, b in zip(old.pair(i), pair):
            assert scored_of(a) is None and np.array_equal(a, b)
