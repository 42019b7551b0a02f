"""Unscored completion tokens as a store keeps them (``spans.bin``, format version 2) and as a completion carries
them (``ScoredTokens``): the mask follows the spans exactly, and a store of version 1 reads as before."""

from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import pytest
from conftest import prepare_hh_splits

from prefpack.data.spans import ScoredTokens, scored_mask, scored_of
from prefpack.data.store import Store


def test_scored_mask_covers_exactly_the_spans_inside_the_range():
    spans = np.array([[3, 5], [8, 9], [12, 20]], dtype=np.int64)
    assert scored_mask(spans, 0, 3) is None and scored_mask(spans, 5, 3) is None  # between spans
    assert scored_mask(np.zeros((0, 2), np.int64), 0, 10) is None
    got = scored_mask(spans, 4, 10)  # positions 4..13: 4 masked, 8 masked, 12 and 13 masked
    want = np.array([p not in (4, 8, 12, 13) for p in range(4, 14)])
    np.testing.assert_array_equal(got, want)


def test_scored_tokens_carry_their_mask_only_as_read():
    t = ScoredTokens(np.arange(5, dtype=np.uint16), [True, False, True, True, False])
    assert scored_of(t).tolist() == [True, False, True, True, False]
    assert len(t) == 5 and t.dtype == np.uint16 and int(t.sum()) == 10
    assert scored_of(t[1:]) is None and scored_of(np.asarray(t)) is None and scored_of(t.copy()) is None
    back = pickle.loads(pickle.dumps(t))
    assert back.tolist() == t.tolist() and scored_of(back).tolist() == scored_of(t).tolist()
    with pytest.raises(ValueError, match="score mask"):
        ScoredTokens(np.arange(3), [True])


def test_a_store_with_spans_gives_masked_completions(tmp_path, toy_tokenizers, hh_train):
    """spans.bin added to a prepared store (as a version-2 prepare writes it): each completion's mask is the spans
    inside it; a version-1 store gives plain arrays."""
    stores = prepare_hh_splits(tmp_path, toy_tokenizers["llama"], hh_train, {"train": 4})
    plain = Store(stores["train"])
    assert plain.spans.shape == (0, 2) and scored_of(plain.pair(0).chosen) is None
    path = tmp_path / "spans"
    shutil.copytree(stores["train"], path)
    off, p, c, r = (int(x) for x in plain.index[1, :4])
    spans = np.array([[off + p + 1, off + p + 3], [off + p + c, off + p + c + 1]], dtype=np.int64)
    spans.tofile(path / "spans.bin")
    meta = json.loads((path / "meta.json").read_text())
    meta.update(format_version=2, num_spans=len(spans))
    (path / "meta.json").write_text(json.dumps(meta))
    store = Store(path)
    pair = store.pair(1)
    assert scored_of(pair.chosen).tolist() == [k not in (1, 2) for k in range(c)]
    assert scored_of(pair.rejected).tolist() == [k != 0 for k in range(r)]
    np.testing.assert_array_equal(np.asarray(pair.chosen), plain.pair(1).chosen)
    assert scored_of(store.pair(0).chosen) is None and scored_of(store.pair(2).rejected) is None
    (path / "spans.bin").write_bytes(b"\0" * 8)
    with pytest.raises(Exception, match="spans.bin has 8 bytes"):
        Store(path)
