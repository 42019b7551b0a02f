"""prepare: layouts, round trips, BOS/EOS rules, bad input, atomic writes, corrupt stores."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import HH, NEOX, read_jsonl, write_jsonl

from prefpack.cli import main as cli_main
from prefpack.data import store as store_mod
from prefpack.data import store_writer
from prefpack.data.prepare import PrepareError, PrepareOptions, prepare
from prefpack.data.store import Store, StoreError, StoreWriter, token_dtype
from prefpack.tokenizer import load_tokenizer, tokenizer_hash


def run(inputs, tok, out, **kw):
    kw.setdefault("workers", 1)
    opts = PrepareOptions(inputs=[str(i) for i in inputs], tokenizer=str(tok), output=str(out), **kw)
    return prepare(opts, log=lambda m: None)


def decoded(store: Store, tok, i: int) -> dict:
    ex = store.pair(i) if store.kind == "pairs" else store.unpaired(i)
    return {k: tok.decode([int(t) for t in v]) for k, v in ex._asdict().items() if isinstance(v, np.ndarray)}


PAIRS = [
    {"prompt": "What is the capital of France?", "chosen": " Paris.", "rejected": " Lyon, I think."},
    {"prompt": "Name a colour.", "chosen": " Blue", "rejected": " Seven"},
    {"prompt": "Say hi in French.", "chosen": " Bonjour ü ❤", "rejected": " Hola"},
]


# ---------------------------------------------------------------- layouts and round trips


@pytest.mark.parametrize("style", ["llama", "neox", "chatml"])
def test_pairs_round_trip_and_special_tokens(tmp_path, toy_tokenizers, style):
    src = write_jsonl(tmp_path / "d.jsonl", PAIRS)
    report = run([src], toy_tokenizers[style], tmp_path / "s")
    assert report.layout == "pairs" and report.examples == 3
    tok = load_tokenizer(toy_tokenizers[style])
    st = Store(tmp_path / "s")
    eos = tok.eos_token
    bos = "<s>" if style == "llama" else ""
    for i, row in enumerate(PAIRS):
        d = decoded(st, tok, i)
        assert d["prompt"] == bos + row["prompt"]
        assert d["chosen"] == row["chosen"] + eos
        assert d["rejected"] == row["rejected"] + eos
        pair = st.pair(i)
        # exactly one EOS per completion, at the end; BOS only as the very first prompt token
        for comp in (pair.chosen, pair.rejected):
            assert comp[-1] == tok.eos_token_id and (comp == tok.eos_token_id).sum() == 1
        if style == "llama":
            assert pair.prompt[0] == tok.bos_token_id and (pair.prompt == tok.bos_token_id).sum() == 1
        else:
            assert tok.bos_token_id is None or pair.prompt[0] != tok.bos_token_id


def test_bos_and_eos_never_doubled(tmp_path, toy_tokenizers):
    rows = [{"prompt": "<s>Hello there", "chosen": " fine</s>", "rejected": " bad"}]
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    run([src], toy_tokenizers["llama"], tmp_path / "s")
    tok = load_tokenizer(toy_tokenizers["llama"])
    pair = Store(tmp_path / "s").pair(0)
    assert list(pair.prompt).count(tok.bos_token_id) == 1 and pair.prompt[0] == tok.bos_token_id
    assert list(pair.chosen).count(tok.eos_token_id) == 1 and pair.chosen[-1] == tok.eos_token_id
    assert list(pair.rejected).count(tok.eos_token_id) == 1


def test_prompt_and_completion_tokenised_apart(tmp_path, toy_tokenizers):
    # "Hello" + "world" tokenised joined may merge across the boundary; apart, the split is exact
    rows = [{"prompt": "The answer is", "chosen": "n't clear", "rejected": "s here"}]
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    run([src], toy_tokenizers["neox"], tmp_path / "s")
    tok = load_tokenizer(toy_tokenizers["neox"])
    pair = Store(tmp_path / "s").pair(0)
    assert list(pair.prompt) == tok("The answer is", add_special_tokens=False)["input_ids"]
    assert list(pair.chosen[:-1]) == tok("n't clear", add_special_tokens=False)["input_ids"]


def test_text_pairs_and_field_overrides(tmp_path, toy_tokenizers):
    rows = [{"text": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]} for r in PAIRS]
    report = run([write_jsonl(tmp_path / "a.jsonl", rows)], toy_tokenizers["neox"], tmp_path / "s1")
    assert report.layout == "text-pairs"
    renamed = [{"q": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in PAIRS]
    report = run([write_jsonl(tmp_path / "b.jsonl", renamed)], toy_tokenizers["neox"], tmp_path / "s2",
                 fields={"prompt": "q", "chosen": "good", "rejected": "bad"})
    assert report.layout == "pairs"
    a, b = Store(tmp_path / "s1"), Store(tmp_path / "s2")
    assert np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


def test_messages_layout_with_chat_template(tmp_path, toy_tokenizers):
    rows = [{
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": r["prompt"]}],
        "chosen": [{"role": "assistant", "content": r["chosen"].strip()}],
        "rejected": [{"role": "assistant", "content": r["rejected"].strip()}],
    } for r in PAIRS]
    report = run([write_jsonl(tmp_path / "m.jsonl", rows)], toy_tokenizers["chatml"], tmp_path / "s")
    assert report.layout == "messages"
    tok = load_tokenizer(toy_tokenizers["chatml"])
    st = Store(tmp_path / "s")
    for i, row in enumerate(rows):
        d = decoded(st, tok, i)
        assert d["prompt"] == tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        assert d["prompt"].endswith("<|im_start|>assistant\n")
        assert d["chosen"] == row["chosen"][0]["content"] + "<|im_end|>\n"  # template's EOS kept, not doubled
        full = tok.apply_chat_template(row["prompt"] + row["chosen"], tokenize=False)
        assert d["prompt"] + d["chosen"] == full
        assert list(st.pair(i).chosen).count(tok.eos_token_id) == 1


def test_template_not_prefix_stable_is_reported(tmp_path, toy_tokenizers):
    tok = load_tokenizer(toy_tokenizers["chatml"])
    # marks the last message: the prompt's last turn renders differently once a reply follows
    tok.chat_template = ("{% for m in messages %}{% if loop.last %}[LAST]{% endif %}<|im_start|>{{ m['role'] }}\n"
                         "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(tmp_path / "tok")
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "a"}],
             "rejected": [{"role": "assistant", "content": "b"}]}]
    # each reply still follows, after the generation prompt, exactly the context the template prompts with: stored
    # turn by turn (docs/data.md), the reply what the template renders after its generation prompt
    run([write_jsonl(tmp_path / "m.jsonl", rows)], tmp_path / "tok", tmp_path / "s")
    st = Store(tmp_path / "s")
    assert tok.decode([int(t) for t in st.pair(0).prompt]).startswith("[LAST]<|im_start|>user")
    assert tok.decode([int(t) for t in st.pair(0).chosen]) == "a<|im_end|>\n"
    # marking the reply's own header instead: no rendering shows the reply after the generation prompt
    tok.chat_template = tok.chat_template.replace("{% if loop.last %}[LAST]{% endif %}<|im_start|>{{ m['role'] }}",
                                                  "<|im_start|>{{ m['role'] }}{% if loop.last %}[LAST]{% endif %}")
    tok.save_pretrained(tmp_path / "tok")
    with pytest.raises(PrepareError, match="not prefix-stable"):
        run([write_jsonl(tmp_path / "m.jsonl", rows)], tmp_path / "tok", tmp_path / "s2")


def test_implicit_string_layout_on_real_hh_rlhf(tmp_path):
    """The raw conversations' implicit prompt must equal the published prompt/chosen/rejected split."""
    raw = HH / "raw_train_500.jsonl.gz"
    report = run([raw], NEOX, tmp_path / "s", skip_invalid=True)
    assert report.layout == "implicit"
    split = read_jsonl(HH / "train_2k.jsonl.gz")[:500]
    tok = load_tokenizer(NEOX)
    st = Store(tmp_path / "s")
    rows = st.column("source_row")
    assert report.examples + sum(report.skipped.values()) == 500
    for i in range(len(st)):
        want = split[int(rows[i])]
        d = decoded(st, tok, i)
        assert d["prompt"] == want["prompt"]
        assert d["chosen"] == want["chosen"] + "<|endoftext|>"
        assert d["rejected"] == want["rejected"] + "<|endoftext|>"


def test_implicit_message_layout(tmp_path, toy_tokenizers):
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Capital of France?"}]
    rows = [{"chosen": conv + [{"role": "assistant", "content": "Paris"}],
             "rejected": conv + [{"role": "assistant", "content": "Rome"}]}]
    report = run([write_jsonl(tmp_path / "m.jsonl", rows)], toy_tokenizers["chatml"], tmp_path / "s")
    assert report.layout == "implicit"
    tok = load_tokenizer(toy_tokenizers["chatml"])
    d = decoded(Store(tmp_path / "s"), tok, 0)
    assert d["prompt"] == tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert d["chosen"] == "Paris<|im_end|>\n" and d["rejected"] == "Rome<|im_end|>\n"


def test_unpaired_layout(tmp_path, toy_tokenizers):
    rows = [{"prompt": "Q1", "completion": " good", "label": True},
            {"prompt": "Q2", "completion": " bad", "label": False},
            {"prompt": "Q3", "completion": " ok", "label": 1}]
    report = run([write_jsonl(tmp_path / "u.jsonl", rows)], toy_tokenizers["llama"], tmp_path / "s")
    assert report.layout == "unpaired"
    st = Store(tmp_path / "s")
    assert st.kind == "unpaired" and list(st.column("label")) == [1, 0, 1]
    tok = load_tokenizer(toy_tokenizers["llama"])
    assert decoded(st, tok, 1) == {"prompt": "<s>Q2", "completion": " bad</s>"}


def test_parquet_csv_json_array_and_datasets_folder(tmp_path, toy_tokenizers):
    import datasets

    ds = datasets.Dataset.from_list(PAIRS)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    (tmp_path / "d.json").write_text(json.dumps(PAIRS))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    tok = toy_tokenizers["neox"]
    ref = run([write_jsonl(tmp_path / "d.jsonl", PAIRS)], tok, tmp_path / "ref")
    want = np.asarray(Store(ref.path).tokens)
    for name in ("d.parquet", "d.csv", "d.json"):
        r = run([tmp_path / name], tok, tmp_path / f"s-{name}")
        assert np.array_equal(np.asarray(Store(r.path).tokens), want), name
    r = run([tmp_path / "dd"], tok, tmp_path / "s-dd", split="train")
    assert np.array_equal(np.asarray(Store(r.path).tokens), want)
    with pytest.raises(Exception, match="several splits"):
        run([tmp_path / "dd"], tok, tmp_path / "s-dd2")
    # a glob over two files keeps both, in name order, with per-file sources
    r = run([str(tmp_path / "d.js*")], tok, tmp_path / "s-glob")
    meta = Store(r.path).meta
    assert r.examples == 6 and [s["rows"] for s in meta["sources"]] == [3, 3]


def test_parallel_workers_write_the_same_store(tmp_path, hh_train, toy_tokenizers):
    src = write_jsonl(tmp_path / "d.jsonl", hh_train[:200] + [{"prompt": "no replies"}] + hh_train[200:400])
    a = run([src], toy_tokenizers["llama"], tmp_path / "a", workers=1, chunk_rows=64, skip_invalid=True)
    b = run([src], toy_tokenizers["llama"], tmp_path / "b", workers=2, chunk_rows=64, skip_invalid=True)
    for name in ("tokens.bin", "index.bin", "skipped.jsonl"):
        assert (a.path / name).read_bytes() == (b.path / name).read_bytes(), name


def test_pairs_that_share_a_prompt_are_counted_and_reported(tmp_path, toy_tokenizers):
    """A pair store whose prompts repeat across pairs (each prompt is then computed once per pair) says so, counted
    over the token ids across chunks, with data.group_by_prompt as the remedy; distinct prompts report none."""
    rows = [*PAIRS, {**PAIRS[0], "chosen": " Paris, of course."}, {**PAIRS[1], "rejected": " Loud"},
            {**PAIRS[0], "rejected": " Marseille."}]
    report = run([write_jsonl(tmp_path / "d.jsonl", rows)], toy_tokenizers["llama"], tmp_path / "s", chunk_rows=2)
    assert report.repeated_prompts == {"prompts": 2, "pairs": 5}
    assert Store(tmp_path / "s").meta["counts"]["repeated_prompts"] == {"prompts": 2, "pairs": 5}
    assert "5 pairs share 2 prompts with other pairs" in report.summary()
    assert "data.group_by_prompt=true" in report.summary()
    from prefpack.data.inspect import format_text, length_stats

    store = Store(tmp_path / "s")
    shown = format_text(store, length_stats(store), None)
    assert "repeated_prompts=pairs:5 prompts:2" in shown and "data.group_by_prompt=true" in shown
    alone = run([write_jsonl(tmp_path / "e.jsonl", PAIRS)], toy_tokenizers["llama"], tmp_path / "t")
    assert alone.repeated_prompts == {"prompts": 0, "pairs": 0} and "prompts with other pairs" not in alone.summary()


# ---------------------------------------------------------------- truncation


def test_max_length_prompt_left_then_completion_right(tmp_path, toy_tokenizers):
    tok = load_tokenizer(toy_tokenizers["llama"])
    long_prompt = " ".join(f"word{i}" for i in range(60))
    rows = [{"prompt": long_prompt, "chosen": " short", "rejected": " x " * 40}, PAIRS[1]]
    r = run([write_jsonl(tmp_path / "d.jsonl", rows)], toy_tokenizers["llama"], tmp_path / "s", max_length=48,
            min_prompt_keep=0)  # the prompt keeps a few of its tokens (the default minimum refuses that)
    st = Store(tmp_path / "s")
    pair = st.pair(0)
    assert len(pair.prompt) + max(len(pair.chosen), len(pair.rejected)) <= 48
    assert pair.prompt[0] == tok.bos_token_id  # BOS survives a left cut
    full_prompt = tok(long_prompt, add_special_tokens=False)["input_ids"]
    assert list(pair.prompt[1:]) == full_prompt[len(full_prompt) - (len(pair.prompt) - 1):]
    assert r.truncated.get("prompt") == 1
    assert st.column("flags")[0] != 0 and st.column("flags")[1] == 0
    r = run([write_jsonl(tmp_path / "d.jsonl", rows)], toy_tokenizers["llama"], tmp_path / "s2", max_length=48,
            truncation="drop")
    assert r.dropped == {"too_long": 1} and r.examples == 1
    # a completion longer than the limit: the prompt keeps its floor and the completion is cut
    rows = [{"prompt": "Hi", "chosen": " y" * 80, "rejected": " n"}]
    r = run([write_jsonl(tmp_path / "e.jsonl", rows)], toy_tokenizers["llama"], tmp_path / "s3", max_length=20)
    pair = Store(tmp_path / "s3").pair(0)
    assert len(pair.prompt) + len(pair.chosen) == 20 and len(pair.prompt) >= 2
    assert r.truncated.get("completion") == 1


# ---------------------------------------------------------------- bad input


BAD_CASES = [
    ('{"prompt": "a", "chosen": "b", "rejected": ', "line 2", None, "malformed_json"),
    ({"prompt": "a", "chosen": "b"}, "line 2", "rejected", "missing_field"),
    ({"prompt": "a", "chosen": 3, "rejected": "c"}, "line 2", "chosen", "wrong_type"),
    ({"prompt": "a", "chosen": " same", "rejected": " same"}, "line 2", "rejected", "identical_completions"),
    ('{"prompt": "a", "chosen": "b\\ud800", "rejected": "c"}', "line 2", "chosen", "undecodable_text"),
]


@pytest.mark.parametrize("bad,where,field,reason", BAD_CASES, ids=[c[3] for c in BAD_CASES])
def test_bad_rows_stop_with_location_or_are_skipped_and_kept(tmp_path, toy_tokenizers, bad, where, field, reason):
    rows = [PAIRS[0], bad, PAIRS[1]]
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(PrepareError) as err:
        run([src], toy_tokenizers["neox"], tmp_path / "s")
    msg = str(err.value)
    assert str(src) in msg and where in msg and reason in msg
    if field:
        assert f"field {field!r}" in msg
    assert not (tmp_path / "s").exists()
    r = run([src], toy_tokenizers["neox"], tmp_path / "s", skip_invalid=True)
    assert r.examples == 2 and r.skipped == {reason: 1}
    skipped = [json.loads(x) for x in (r.path / "skipped.jsonl").read_text().splitlines()]
    assert len(skipped) == 1 and skipped[0]["line"] == 2 and skipped[0]["reason"] == reason
    assert skipped[0]["data"] is not None  # the row itself is kept, nothing silently lost
    assert Store(r.path).meta["counts"]["skipped"] == {reason: 1}


def test_undecodable_bytes(tmp_path, toy_tokenizers):
    src = tmp_path / "d.jsonl"
    src.write_bytes(json.dumps(PAIRS[0]).encode() + b"\n" + b'{"prompt": "\xff\xfe", "chosen": "b", "rejected": "c"}\n')
    with pytest.raises(PrepareError, match="line 2.*undecodable_text"):
        run([src], toy_tokenizers["neox"], tmp_path / "s")


def test_cli_error_has_no_traceback_and_exit_code_2(tmp_path, toy_tokenizers, capsys):
    src = write_jsonl(tmp_path / "d.jsonl", [PAIRS[0], {"prompt": "a"}])
    code = cli_main(["prepare", str(src), "--tokenizer", str(toy_tokenizers["neox"]), "-o", str(tmp_path / "s"),
                     "--workers", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "line 2" in err and "Traceback" not in err
    assert cli_main(["inspect", str(tmp_path / "nope")]) == 2


def test_existing_output_refused_without_overwrite(tmp_path, toy_tokenizers):
    src = write_jsonl(tmp_path / "d.jsonl", PAIRS)
    run([src], toy_tokenizers["neox"], tmp_path / "s")
    with pytest.raises(StoreError, match="--overwrite"):
        run([src], toy_tokenizers["neox"], tmp_path / "s")
    r = run([write_jsonl(tmp_path / "e.jsonl", PAIRS[:1])], toy_tokenizers["neox"], tmp_path / "s", overwrite=True)
    assert len(Store(r.path)) == 1


# ---------------------------------------------------------------- atomic writes and corrupt stores


def test_crash_while_writing_leaves_no_openable_store(tmp_path, toy_tokenizers, monkeypatch, hh_train):
    src = write_jsonl(tmp_path / "d.jsonl", hh_train[:300])
    calls = {"n": 0}
    real_append = StoreWriter.append

    def failing_append(self, tokens, index):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated crash")
        real_append(self, tokens, index)

    monkeypatch.setattr(StoreWriter, "append", failing_append)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run([src], toy_tokenizers["neox"], tmp_path / "s", chunk_rows=50, skip_invalid=True)
    assert not (tmp_path / "s").exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".s")] == []
    # a process killed mid-write leaves a temporary folder without meta.json: it never opens as a store
    w = StoreWriter(tmp_path / "t", kind="pairs", vocab_size=100)
    w.append(np.arange(6), np.array([[0, 2, 2, 2, 0, 0, 0]]))
    w._close_files()
    with pytest.raises(StoreError, match="meta.json missing"):
        Store(w.tmp)
    assert not (tmp_path / "t").exists()


@pytest.fixture()
def small_store(tmp_path, toy_tokenizers):
    return run([write_jsonl(tmp_path / "d.jsonl", PAIRS)], toy_tokenizers["neox"], tmp_path / "s").path


def test_truncated_token_file_is_refused(small_store):
    data = (small_store / "tokens.bin").read_bytes()
    (small_store / "tokens.bin").write_bytes(data[:-2])
    with pytest.raises(StoreError, match="truncated or corrupt"):
        Store(small_store)


def test_corrupt_index_is_refused(small_store):
    idx = np.fromfile(small_store / "index.bin", dtype=np.int64).reshape(3, -1)
    idx[1, 0] += 1
    idx.tofile(small_store / "index.bin")
    with pytest.raises(StoreError, match="offsets"):
        Store(small_store)


def test_wrong_version_and_bad_meta_are_refused(small_store):
    meta = json.loads((small_store / "meta.json").read_text())
    meta["format_version"] = 99
    (small_store / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="version 99"):
        Store(small_store)
    (small_store / "meta.json").write_text("{not json")
    with pytest.raises(StoreError, match="corrupt meta.json"):
        Store(small_store)


def test_flipped_token_fails_verification(small_store):
    data = bytearray((small_store / "tokens.bin").read_bytes())
    data[0] ^= 1
    (small_store / "tokens.bin").write_bytes(bytes(data))
    Store(small_store)  # sizes and offsets still agree: the cheap checks pass
    with pytest.raises(StoreError, match="sha256"):
        Store(small_store, verify=True)


def test_uint32_tokens_for_large_vocabularies(tmp_path):
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    w = StoreWriter(tmp_path / "s", kind="pairs", vocab_size=152_000)
    toks = np.array([151_000, 70_000, 5, 151_999])
    w.append(toks, np.array([[0, 2, 1, 1, 0, 0, 0]]))
    w.commit({"tokenizer": {"vocab_size": 152_000}, "sources": []})
    st = Store(tmp_path / "s", verify=True)
    assert st.dtype == np.uint32 and list(st.pair(0).prompt) == [151_000, 70_000]


def test_tokenizer_hash_is_content_based(tmp_path, toy_tokenizers):
    tok = load_tokenizer(toy_tokenizers["chatml"])
    tok.save_pretrained(tmp_path / "a")
    load_tokenizer(tmp_path / "a").save_pretrained(tmp_path / "b")
    assert tokenizer_hash(tok) == tokenizer_hash(load_tokenizer(tmp_path / "b"))
    assert tokenizer_hash(tok) != tokenizer_hash(load_tokenizer(toy_tokenizers["neox"]))
    same = load_tokenizer(tmp_path / "b")
    same.backend_tokenizer.enable_truncation(16)  # a runtime setting, not content
    assert tokenizer_hash(same) == tokenizer_hash(tok)
    tok.chat_template = tok.chat_template + " "  # another template: the same ids (version 3; version 2 told it apart)
    assert tokenizer_hash(tok) == tokenizer_hash(load_tokenizer(tmp_path / "b"))
    assert tokenizer_hash(tok, 2) != tokenizer_hash(load_tokenizer(tmp_path / "b"), 2)
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>"]})  # a new special token: ids differ
    assert tokenizer_hash(tok) != tokenizer_hash(load_tokenizer(tmp_path / "b"))


# ---------------------------------------------------------------- inspect


def test_inspect_json(small_store, capsys):
    assert cli_main(["inspect", str(small_store), "--row", "2", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert set(obj) == {"meta", "stats", "row"}
    row = obj["row"]
    assert row["prompt"] == PAIRS[2]["prompt"] and row["chosen"] == PAIRS[2]["chosen"] + "<|endoftext|>"
    assert row["rejected_ids"][-1] == obj["meta"]["tokenizer"]["eos_id"]
    assert obj["stats"]["examples"] == 3 and obj["stats"]["chosen"]["max"] >= obj["stats"]["chosen"]["p50"]
    assert obj["meta"]["counts"]["rows_read"] == 3 and obj["meta"]["sources"][0]["sha256"]
    assert cli_main(["inspect", str(small_store), "--row", "3"]) == 2


def test_store_module_has_no_pickle():
    for module in (store_mod, store_writer):
        src = open(module.__file__).read()
        assert "pickle" not in src and "allow_pickle=True" not in src


def test_a_few_repeated_prompts_are_counted_without_advising_grouping(tmp_path, toy_tokenizers, hh_train):
    """4 of 2,000 pairs sharing prompts is not worth data.group_by_prompt; the count is still given. The columns no
    layout reads are said once (the note during prepare), not again in the summary."""
    rows = [r for r in hh_train if r["chosen"] != r["rejected"]][:100]
    rows = [*rows, {**rows[0], "chosen": " Another reply."}, {"extra": 1, **rows[1], "chosen": " And another."}]
    notes = []
    opts = PrepareOptions(inputs=[str(write_jsonl(tmp_path / "d.jsonl", rows))], tokenizer=str(toy_tokenizers["llama"]),
                          output=str(tmp_path / "s"), workers=1)
    report = prepare(opts, log=notes.append)
    assert report.repeated_prompts["pairs"] == 4
    assert "4 pairs share 2 prompts with other pairs (too few" in report.summary()
    assert "group_by_prompt=true" not in report.summary()
    assert "extra" not in report.summary() and sum("'extra'" in n for n in notes) == 1
