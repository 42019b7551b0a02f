"""Issue 11 for data: never delete a user's files, never train on ids outside the vocabulary, never leave
temporary folders forever, never store a file twice unasked, keep real rows TRL keeps, and hash the
tokenizer by what it does rather than by the class that loaded it."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import HH, NEOX, write_jsonl

from prefpack.cli import main as cli_main
from prefpack.data.prepare import PrepareOptions, prepare
from prefpack.data.sources import SourceError
from prefpack.data.store import Store, StoreError, StoreWriter
from prefpack.stale import OWNER_FILE, remove_stale_tmp
from prefpack.tokenizer import load_tokenizer, tokenizer_hash, tokenizer_matches

PAIRS = [
    {"prompt": "What is the capital of France?", "chosen": " Paris.", "rejected": " Lyon, I think."},
    {"prompt": "Name a colour.", "chosen": " Blue", "rejected": " Seven"},
    {"prompt": "Say hi in French.", "chosen": " Bonjour", "rejected": " Hola"},
]


def run(inputs, tok, out, log=None, **kw):
    kw.setdefault("workers", 1)
    opts = PrepareOptions(inputs=[str(i) for i in inputs], tokenizer=str(tok), output=str(out), **kw)
    return prepare(opts, log=log or (lambda m: None))


def prepare_cli(*args) -> list[str]:
    return ["prepare", *map(str, args), "--workers", "1"]


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith(f".{name}."))


@pytest.fixture()
def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return int(proc.stdout)


@pytest.fixture()
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()
    proc.wait()


# ---------------------------------------------------------------- 1. --overwrite never deletes a user's files


def test_overwrite_refuses_a_folder_that_is_not_a_store(tmp_path, toy_tokenizers, capsys):
    src = write_jsonl(tmp_path / "good.jsonl", PAIRS)
    user = tmp_path / "userdir"
    user.mkdir()
    (user / "notes.txt").write_text("x\n")
    code = cli_main(prepare_cli(src, "--tokenizer", toy_tokenizers["neox"], "--output", user, "--overwrite"))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "not a prefpack store" in err and "notes.txt" in err and str(user) in err
    assert (user / "notes.txt").read_text() == "x\n" and os.listdir(user) == ["notes.txt"]
    assert leftovers(tmp_path, "userdir") == []


def test_overwrite_refuses_a_store_holding_user_files(tmp_path, toy_tokenizers):
    src = write_jsonl(tmp_path / "good.jsonl", PAIRS)
    run([src], toy_tokenizers["neox"], tmp_path / "s")
    (tmp_path / "s" / "my-analysis.ipynb").write_text("{}")
    with pytest.raises(StoreError, match="my-analysis.ipynb"):
        run([src], toy_tokenizers["neox"], tmp_path / "s", overwrite=True)
    assert (tmp_path / "s" / "my-analysis.ipynb").exists() and len(Store(tmp_path / "s")) == 3


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_existing_file_at_the_output_is_refused(tmp_path, toy_tokenizers, capsys, overwrite):
    src = write_jsonl(tmp_path / "good.jsonl", PAIRS)
    out = tmp_path / "out"
    out.write_text("precious")
    flags = ["--overwrite"] if overwrite else []
    code = cli_main(prepare_cli(src, "--tokenizer", toy_tokenizers["neox"], "--output", out, *flags))
    err = capsys.readouterr().err
    assert code == 2 and "is a file" in err and "Traceback" not in err
    assert out.read_text() == "precious" and leftovers(tmp_path, "out") == []


def test_overwrite_replaces_a_store_or_an_empty_folder_and_leaves_nothing_behind(tmp_path, toy_tokenizers):
    src = write_jsonl(tmp_path / "good.jsonl", PAIRS)
    one = write_jsonl(tmp_path / "one.jsonl", PAIRS[:1])
    (tmp_path / "empty").mkdir()
    run([src], toy_tokenizers["neox"], tmp_path / "empty", overwrite=True)
    run([src], toy_tokenizers["neox"], tmp_path / "s", skip_invalid=True)
    (tmp_path / "s" / "ref_logps.safetensors").write_bytes(b"sidecar")  # prefpack's own: replaced with the store
    run([one], toy_tokenizers["neox"], tmp_path / "s", overwrite=True)
    assert len(Store(tmp_path / "s")) == 1 and len(Store(tmp_path / "empty")) == 3
    assert not (tmp_path / "s" / "ref_logps.safetensors").exists()
    assert leftovers(tmp_path, "s") == [] and leftovers(tmp_path, "empty") == []


def test_output_that_changes_while_writing_is_not_deleted(tmp_path):
    out = tmp_path / "s"
    out.mkdir()
    w = StoreWriter(out, kind="pairs", vocab_size=100, overwrite=True)  # empty: may be replaced
    w.append(np.arange(6), np.array([[0, 2, 2, 2, 0, 0, 0]]))
    (out / "notes.txt").write_text("written meanwhile")
    with pytest.raises(StoreError, match="notes.txt"):
        w.commit({"tokenizer": {"vocab_size": 100}, "sources": []}, overwrite=True)
    w.abort()
    assert os.listdir(out) == ["notes.txt"] and leftovers(tmp_path, "s") == []


def test_killed_between_the_renames_of_an_overwrite_the_old_store_comes_back(tmp_path, toy_tokenizers, dead_pid):
    src = write_jsonl(tmp_path / "good.jsonl", PAIRS)
    run([src], toy_tokenizers["neox"], tmp_path / "s")
    old_tokens = (tmp_path / "s" / "tokens.bin").read_bytes()
    # what a kill after `s -> .s.old-PID` and before `.s.tmp-PID -> s` leaves
    os.replace(tmp_path / "s", tmp_path / f".s.old-{dead_pid}")
    messages: list[str] = []
    with pytest.raises(StoreError, match="already exists"):
        run([write_jsonl(tmp_path / "one.jsonl", PAIRS[:1])], toy_tokenizers["neox"], tmp_path / "s",
            log=messages.append)
    assert any("restored" in m for m in messages)
    assert (tmp_path / "s" / "tokens.bin").read_bytes() == old_tokens and leftovers(tmp_path, "s") == []


def test_input_inside_the_output_is_refused(tmp_path, toy_tokenizers):
    run([write_jsonl(tmp_path / "good.jsonl", PAIRS)], toy_tokenizers["neox"], tmp_path / "s", skip_invalid=True)
    inner = write_jsonl(tmp_path / "s" / "skipped.jsonl", PAIRS)
    with pytest.raises(Exception, match="inside the output"):
        run([inner], toy_tokenizers["neox"], tmp_path / "s", overwrite=True)
    assert inner.exists()


# ---------------------------------------------------------------- 2. token ids outside the vocabulary


def _flip_token(store: Path, example: int, value: int) -> int:
    st = Store(store)
    pos = int(st.index[example, 0]) + int(st.index[example, 1]) + 1  # second token of the chosen reply
    toks = np.fromfile(store / "tokens.bin", dtype=st.dtype)
    toks[pos] = value
    toks.tofile(store / "tokens.bin")
    return pos


def test_token_id_outside_the_vocabulary_is_found_without_verify(tmp_path, toy_tokenizers, capsys):
    out = run([write_jsonl(tmp_path / "good.jsonl", PAIRS)], toy_tokenizers["neox"], tmp_path / "s").path
    _flip_token(out, 1, 60_000)  # the toy vocabulary has 600 ids; uint16 holds the flipped value
    st = Store(out)  # sizes and offsets still agree
    for chunk in (3, 1 << 22):  # the culprit is found whichever chunk holds it
        with pytest.raises(StoreError) as err:
            st.check_token_ids(chunk_tokens=chunk)
        msg = str(err.value)
        assert str(out) in msg and "example 1 (chosen, token 1" in msg and "60000" in msg and "row 1" in msg
    assert cli_main(["inspect", str(out)]) == 2
    err = capsys.readouterr().err
    assert "example 1" in err and "60000" in err and "Traceback" not in err
    with pytest.raises(StoreError, match="sha256"):  # --verify also stops it (first by its hash)
        Store(out, verify=True)


def test_in_range_flip_passes_the_cheap_check_but_not_verify(tmp_path, toy_tokenizers):
    out = run([write_jsonl(tmp_path / "good.jsonl", PAIRS)], toy_tokenizers["neox"], tmp_path / "s").path
    _flip_token(out, 2, 5)
    Store(out).check_token_ids()  # documented limit: an in-range id is a valid id
    with pytest.raises(StoreError, match="sha256"):
        Store(out, verify=True)


# ---------------------------------------------------------------- 3. stale temporary folders


def test_prepare_removes_temporary_folders_of_dead_processes_only(tmp_path, toy_tokenizers, dead_pid, live_pid):
    for pid in (dead_pid, live_pid):
        (tmp_path / f".s.tmp-{pid}").mkdir()
        (tmp_path / f".s.tmp-{pid}" / "tokens.bin").write_bytes(b"\0" * 10)
    (tmp_path / f".other.tmp-{dead_pid}").mkdir()  # another output's: not ours to judge here
    messages: list[str] = []
    run([write_jsonl(tmp_path / "good.jsonl", PAIRS)], toy_tokenizers["neox"], tmp_path / "s", log=messages.append)
    assert not (tmp_path / f".s.tmp-{dead_pid}").exists()
    assert (tmp_path / f".s.tmp-{live_pid}").exists() and (tmp_path / f".other.tmp-{dead_pid}").exists()
    assert any(f".s.tmp-{dead_pid}" in m and "removed" in m for m in messages)


def test_remove_stale_tmp_helper(tmp_path, dead_pid, live_pid):
    for name in (f".step-00000050.tmp-{dead_pid}", f".step-00000060.tmp-{live_pid}", f".final.tmp-{dead_pid}",
                 f".step-00000070.tmp-{dead_pid}", ".step-00000080.tmp"):
        (tmp_path / name).mkdir()
    (tmp_path / f".step-00000070.tmp-{dead_pid}" / OWNER_FILE).write_text("another-host")  # shared filesystem
    (tmp_path / f".step-00000090.tmp-{dead_pid}").write_text("a file")
    logged: list[str] = []
    removed = remove_stale_tmp(tmp_path, ".step-*", log=logged.append)
    assert sorted(p.name for p in removed) == [f".step-00000050.tmp-{dead_pid}", f".step-00000090.tmp-{dead_pid}"]
    assert len(logged) == 2 and str(dead_pid) in logged[0]
    assert sorted(os.listdir(tmp_path)) == sorted([f".step-00000060.tmp-{live_pid}", f".final.tmp-{dead_pid}",
                                                   f".step-00000070.tmp-{dead_pid}", ".step-00000080.tmp"])
    assert [p.name for p in remove_stale_tmp(tmp_path, ".final", log=None)] == [f".final.tmp-{dead_pid}"]


# ---------------------------------------------------------------- 4. the same input twice


def test_same_input_twice_is_refused_unless_allowed(tmp_path, toy_tokenizers):
    data = tmp_path / "data"
    data.mkdir()
    a = write_jsonl(data / "a.jsonl", PAIRS)
    (tmp_path / "link.jsonl").symlink_to(a)
    for inputs in ([a, a], [a, str(data / "*.jsonl")], [a, tmp_path / "link.jsonl"]):
        with pytest.raises(SourceError) as err:
            run(inputs, toy_tokenizers["neox"], tmp_path / "s")
        assert str(a) in str(err.value) and "--allow-duplicate-inputs" in str(err.value)
        assert not (tmp_path / "s").exists()
    r = run([a, a], toy_tokenizers["neox"], tmp_path / "s", allow_duplicate_inputs=True)
    assert r.examples == 6


# ---------------------------------------------------------------- 5. rows TRL trains on are kept


def test_whitespace_only_and_empty_completions_are_kept_like_trl(tmp_path, toy_tokenizers):
    rows = [PAIRS[0], {"prompt": "Tell me a slur.", "chosen": " ", "rejected": " Sure"},
            {"prompt": "Say nothing.", "chosen": "", "rejected": " Something"}]
    r = run([write_jsonl(tmp_path / "d.jsonl", rows)], toy_tokenizers["neox"], tmp_path / "s")
    tok = load_tokenizer(toy_tokenizers["neox"])
    st = Store(r.path)
    assert r.examples == 3 and r.skipped == {}
    assert list(st.pair(1).chosen) == tok(" ", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert list(st.pair(2).chosen) == [tok.eos_token_id]  # TRL: tokenizer("") + [eos]
    assert st.meta["counts"]["empty_completions"] == {"chosen": 2} and "chosen=2" in r.summary()
    from prefpack.data.inspect import inspect_store

    assert "counted    empty_completions=chosen:2" in inspect_store(str(r.path))
    # a reply list with no message at all is still malformed
    msgs = [{"prompt": [{"role": "user", "content": "hi"}], "chosen": [], "rejected": [{"role": "assistant",
                                                                                        "content": "b"}]}]
    with pytest.raises(Exception, match="no reply message"):
        run([write_jsonl(tmp_path / "m.jsonl", msgs)], toy_tokenizers["chatml"], tmp_path / "m")


def test_bundled_data_prepares_without_skip_invalid(tmp_path, capsys):
    """The README's commands on the bundled hh-rlhf sample (four whitespace-only chosen replies)."""
    data = tmp_path / "data.jsonl"
    with gzip.open(HH / "train_2k.jsonl.gz", "rb") as fh:
        data.write_bytes(fh.read())
    code = cli_main(prepare_cli(data, "--tokenizer", NEOX, "--output", tmp_path / "stores/train", "--max-length",
                                "1024"))
    out = capsys.readouterr()
    assert code == 0, out.err
    st = Store(tmp_path / "stores/train")
    assert len(st) == 2000 and st.meta["counts"]["empty_completions"] == {"chosen": 4}
    assert list(st.pair(86).chosen) == [209, 0]  # " " then <|endoftext|>
    st.check_token_ids()


# ---------------------------------------------------------------- 6. tokenizer hash: content, not class


def _neox_with_config(tmp_path: Path, model_type: str) -> Path:
    d = tmp_path / model_type
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(NEOX / name, d / name)
    (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    return d


@pytest.mark.parametrize("model_type", ["mistral", "phi3", "olmo2"])
def test_same_tokenizer_next_to_another_config_hashes_the_same(tmp_path, model_type):
    base = load_tokenizer(NEOX)
    tok = load_tokenizer(_neox_with_config(tmp_path, model_type))
    text = "Hello\n\nWorld  it's 1234 ü<|endoftext|>"
    assert tok(text)["input_ids"] == base(text)["input_ids"]
    assert tokenizer_hash(tok) == tokenizer_hash(base)


def test_a_real_difference_is_still_refused(tmp_path):
    base = load_tokenizer(NEOX)
    qwen_like = load_tokenizer(_neox_with_config(tmp_path, "qwen2"))  # Qwen2's pre-tokeniser, same vocabulary
    assert qwen_like("Hello\n\nWorld")["input_ids"] != base("Hello\n\nWorld")["input_ids"]
    assert tokenizer_hash(qwen_like) != tokenizer_hash(base)


def test_stores_hashed_the_old_way_still_match(tmp_path, toy_tokenizers):
    r = run([write_jsonl(tmp_path / "d.jsonl", PAIRS)], toy_tokenizers["neox"], tmp_path / "s")
    tok, other = load_tokenizer(toy_tokenizers["neox"]), load_tokenizer(toy_tokenizers["llama"])
    new = Store(r.path).meta["tokenizer"]
    assert new["hash_version"] == 3 and tokenizer_matches(tok, new) and not tokenizer_matches(other, new)
    old = {k: v for k, v in new.items() if k != "hash_version"}  # as written before version 2
    old["hash"] = tokenizer_hash(tok, 1)
    assert tokenizer_matches(tok, old) and not tokenizer_matches(other, old)
    assert old["hash"] != new["hash"]
    v2 = {**new, "hash_version": 2, "hash": tokenizer_hash(tok, 2)}  # as written before version 3
    assert tokenizer_matches(tok, v2) and not tokenizer_matches(other, v2) and v2["hash"] != new["hash"]
