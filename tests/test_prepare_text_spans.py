"""A text row's loss_masking_spans: character ranges of a completion that are not scored, mapped to tokens through
the tokenizer's offsets (a token touching a span is not scored), checked against byte ranges computed here from the
byte-level tokens themselves; each bad span is refused with file, line and field, or counted by --skip-invalid."""

from __future__ import annotations

import json

import pytest
from conftest import write_jsonl

from prefpack.data.prepare import PrepareError, PrepareOptions, prepare
from prefpack.data.spans import scored_of
from prefpack.data.store import Store
from prefpack.tokenizer import load_tokenizer

CHOSEN = " Héllo wörld, 日本語 is spoken here: the answer is forty-two."
REJECTED = " No idea, sorry about that."


def run(tmp_path, tok, rows, **kw):
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "store"
    prepare(PrepareOptions(inputs=[str(data)], tokenizer=str(tok), output=str(out), workers=1, overwrite=True, **kw),
            log=lambda m: None)
    return Store(out, verify=True)


def expected_mask(tok, text: str, ids, spans) -> list[bool]:
    """Per token: scored unless its bytes touch a span's bytes (byte-level tokens: one character per byte)."""
    pieces = tok.convert_ids_to_tokens([int(i) for i in ids])
    byte_spans = [(len(text[:s].encode()), len(text[:e].encode())) for s, e in spans]
    out, pos = [], 0
    for piece in pieces:
        n = len(piece) if piece != tok.eos_token else 0
        touched = any(pos < b and pos + max(n, 1) > a for a, b in byte_spans) if n else False
        out.append(not touched)
        pos += n
    return out


@pytest.mark.parametrize("spans", [[[2, 9]], [[8, 10], [14, 16]], [[0, 1], [20, 30]]])
def test_character_spans_map_to_the_tokens_they_touch(tmp_path, toy_tokenizers, spans):
    """Spans starting mid-token, on multi-byte characters (é, ö, 日本語), and at the very start."""
    tok = load_tokenizer(toy_tokenizers["llama"])
    row = {"prompt": "Question: what is spoken?", "chosen": CHOSEN, "rejected": REJECTED,
           "loss_masking_spans": {"chosen": spans}}
    st = run(tmp_path, toy_tokenizers["llama"], [row])
    chosen = st.pair(0).chosen
    want = expected_mask(tok, CHOSEN, chosen, spans)
    assert not all(want) and scored_of(chosen).tolist() == want
    assert scored_of(st.pair(0).rejected) is None
    assert int(chosen[-1]) == tok.eos_token_id and scored_of(chosen)[-1]  # the EOS prepare adds is scored
    # every character of a span lies in an unscored token
    unscored = tok.decode([int(t) for t, k in zip(chosen, scored_of(chosen)) if not k])
    assert all(CHOSEN[a:b] in unscored for a, b in spans)


def test_unpaired_rows_take_a_list(tmp_path, toy_tokenizers):
    tok = load_tokenizer(toy_tokenizers["llama"])
    rows = [{"prompt": "Say it.", "completion": CHOSEN, "label": True, "loss_masking_spans": [[13, 20]]},
            {"prompt": "Say it.", "completion": REJECTED, "label": False, "loss_masking_spans": None}]
    st = run(tmp_path, toy_tokenizers["llama"], rows)
    comp = st.unpaired(0).completion
    assert scored_of(comp).tolist() == expected_mask(tok, CHOSEN, comp, [[13, 20]])
    assert scored_of(st.unpaired(1).completion) is None


def test_a_renamed_spans_field(tmp_path, toy_tokenizers):
    row = {"prompt": "Q", "chosen": CHOSEN, "rejected": REJECTED, "mask": {"rejected": [[1, 3]]}}
    st = run(tmp_path, toy_tokenizers["llama"], [row], fields={"spans": "mask"})
    assert scored_of(st.pair(0).chosen) is None and not scored_of(st.pair(0).rejected).all()


BAD = [
    ({"chosen": [[5, 200]]}, "span_out_of_range", "loss_masking_spans.chosen"),
    ({"rejected": [[-1, 3]]}, "span_out_of_range", "loss_masking_spans.rejected"),
    ({"chosen": [[4, 9], [7, 12]]}, "spans_overlap", "loss_masking_spans.chosen"),
    ({"chosen": [[10, 12], [2, 4]]}, "spans_unsorted", "loss_masking_spans.chosen"),
    ({"chosen": [[0, len(CHOSEN)]]}, "no_scored_tokens", "loss_masking_spans.chosen"),
    ({"chosen": [[1, "x"]]}, "wrong_type", "loss_masking_spans.chosen"),
    ([[1, 2]], "wrong_type", "loss_masking_spans"),
]


@pytest.mark.parametrize("spans,reason,field", BAD)
def test_bad_spans_are_refused_with_file_row_and_field(tmp_path, toy_tokenizers, spans, reason, field):
    good = {"prompt": "Q", "chosen": CHOSEN, "rejected": REJECTED}
    rows = [good, {**good, "loss_masking_spans": spans}]
    with pytest.raises(PrepareError) as err:
        run(tmp_path, toy_tokenizers["llama"], rows)
    msg = str(err.value)
    assert "rows.jsonl line 2" in msg and f"field {field!r}" in msg and f"[{reason}]" in msg
    st = run(tmp_path, toy_tokenizers["llama"], rows, skip_invalid=True)
    assert len(st) == 1 and st.meta["counts"]["skipped"] == {reason: 1}
    skipped = [json.loads(line) for line in (st.path / "skipped.jsonl").read_text().splitlines()]
    assert skipped[0]["reason"] == reason and skipped[0]["field"] == field


def test_spans_on_chat_rows_are_refused(tmp_path, toy_tokenizers):
    row = {"prompt": [{"role": "user", "content": "Q"}], "chosen": [{"role": "assistant", "content": "a"}],
           "rejected": [{"role": "assistant", "content": "b"}], "loss_masking_spans": {"chosen": [[0, 1]]}}
    with pytest.raises(PrepareError, match="--train-on"):
        run(tmp_path, toy_tokenizers["chatml"], [row])
