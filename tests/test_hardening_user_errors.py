"""Issue 24, items 6-8: user errors told as messages naming the path and the fix, silent acceptances made loud,
and one huge row kept from raising prepare's memory."""

from __future__ import annotations

import errno
import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import write_jsonl

from prefpack.cli import main as cli_main
from prefpack.data.prepare import PrepareOptions, prepare


def test_plot_skips_a_broken_line_in_the_middle_and_names_it(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    lines = [json.dumps({"step": s, "split": "train", "loss": 1.0 / s}) for s in range(1, 6)]
    lines[2] = lines[2][:15]  # a damaged line in the middle
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert cli_main(["plot", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "line 3" in err and "metrics.jsonl" in err and "skipped 1" in err
    assert (tmp_path / "curves.png").is_file()


def _pairs(n: int, long: str = "") -> list[dict]:
    return [{"prompt": f"Question number {i}: what is {i} plus {i}?", "chosen": f" It is {2 * i}.{long}",
             "rejected": f" Maybe {i}.{long}"} for i in range(n)]


def _prepare(*args) -> list[str]:
    return ["prepare", *map(str, args), "--workers", "1"]


@pytest.mark.parametrize("skip", [False, True])
def test_truncated_gzip_input_is_named_with_the_line_reached(tmp_path, toy_tokenizers, capsys, skip):
    full = gzip.compress("".join(json.dumps(r) + "\n" for r in _pairs(400)).encode())
    src = tmp_path / "in.jsonl.gz"
    src.write_bytes(full[: len(full) // 2])
    out = tmp_path / "store"
    args = _prepare(src, "--tokenizer", toy_tokenizers["neox"], "--output", out) + (["--skip-invalid"] if skip else [])
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert str(src) in err and "damaged or truncated after line" in err and "Traceback" not in err
    assert not out.exists()


def _no_leftovers(parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith(".store."))


def test_prepare_onto_a_full_disk_says_so_and_leaves_no_partial_store(tmp_path, toy_tokenizers, capsys, monkeypatch):
    from prefpack.data import store as store_mod

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.tmp / "tokens.bin"))

    monkeypatch.setattr(store_mod.StoreWriter, "append", full)
    src = write_jsonl(tmp_path / "in.jsonl", _pairs(20))
    out = tmp_path / "store"
    assert cli_main(_prepare(src, "--tokenizer", toy_tokenizers["neox"], "--output", out)) == 2
    err = capsys.readouterr().err
    assert "disk is full" in err and "tokens.bin" in err and "Traceback" not in err
    assert not out.exists() and _no_leftovers(tmp_path) == []


def test_prepare_into_an_unwritable_folder_names_it_and_the_fix(tmp_path, toy_tokenizers, capsys, monkeypatch):
    parent = tmp_path / "locked"
    parent.mkdir()
    src = write_jsonl(tmp_path / "in.jsonl", _pairs(5))
    if os.geteuid() == 0:  # root writes through chmod: stand in for the refusal
        from prefpack.data import store_writer as store_mod

        def denied(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))

        monkeypatch.setattr(store_mod, "write_owner", denied)
    else:
        parent.chmod(0o555)
    try:
        assert cli_main(_prepare(src, "--tokenizer", toy_tokenizers["neox"], "--output", parent / "store")) == 2
    finally:
        parent.chmod(0o755)
    err = capsys.readouterr().err
    assert "cannot write" in err and str(parent) in err and "--output in a folder you can write" in err
    assert os.listdir(parent) == []


def test_precompute_ref_on_a_read_only_store_is_refused_by_name(tmp_path, toy_tokenizers, monkeypatch, capsys):
    from safetensors import SafetensorError

    from prefpack.data.store import Store
    from prefpack.reference import (
        KeyedLogps,
        KeySpace,
        SidecarWriteError,
        check_sidecar_writable,
        write_keyed_sidecar,
    )

    src = write_jsonl(tmp_path / "in.jsonl", _pairs(4))
    prepare(PrepareOptions(inputs=[str(src)], tokenizer=str(toy_tokenizers["neox"]), output=str(tmp_path / "s"),
                           workers=1), log=lambda m: None)
    store = Store(tmp_path / "s")
    space = KeySpace("pairs", 2 * len(store))

    def refuse(*a, **k):
        raise SafetensorError("Error while serializing: IoError(Os { code: 30, kind: ReadOnlyFilesystem })")

    monkeypatch.setattr("safetensors.numpy.save_file", refuse)
    with pytest.raises(SidecarWriteError, match="cp -r") as info:
        write_keyed_sidecar(store, space, KeyedLogps(np.zeros(space.size)), reference_hash="w", reference_name="r")
    assert str(store.path) in str(info.value)
    monkeypatch.setattr("os.access", lambda *a, **k: False)
    with pytest.raises(SidecarWriteError, match="no write permission"):
        check_sidecar_writable(store)
    # the CLI refuses before any model is loaded (this model does not exist), by message
    code = cli_main(["precompute-ref", "--model", str(tmp_path / "no-model"), "--data", str(store.path)])
    err = capsys.readouterr().err
    assert code == 2 and "cannot write the reference sidecar" in err and "Traceback" not in err


def test_train_into_an_unwritable_folder_is_a_message(tmp_path, capsys, monkeypatch):
    """Any permission or full-disk error that reaches the CLI is told by path, without a traceback."""
    from prefpack import cli

    def denied(args, argv):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "locked" / "run"))

    monkeypatch.setattr(cli, "_commands", lambda: {"plot": (lambda sub: None, denied)})
    monkeypatch.setattr(cli, "build_parser", lambda: _plot_parser())
    assert cli.main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and str(tmp_path / "locked" / "run") in err and "run.output_dir" in err


def _plot_parser():
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("plot").add_argument("run_dir")
    return parser


def test_a_pair_made_identical_by_max_length_is_counted_and_dropped(tmp_path, toy_tokenizers):
    same = " The answer is four, because two and two make four"
    rows = [{"prompt": "What is two plus two?", "chosen": same + " exactly.", "rejected": same + " I guess."},
            {"prompt": "Name a colour.", "chosen": " Blue", "rejected": " Seven"}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report = prepare(PrepareOptions(inputs=[str(src)], tokenizer=str(toy_tokenizers["neox"]),
                                    output=str(tmp_path / "s"), workers=1, max_length=12, min_prompt_keep=0),
                     log=lambda m: None)
    assert report.examples == 1
    assert report.dropped == {"identical_after_truncation": 1}
    assert "identical_after_truncation=1" in report.summary()


def test_a_mistyped_tokenizer_offline_is_answered_at_once(tmp_path, capsys, monkeypatch):
    import time

    from prefpack import tokenizer

    monkeypatch.setattr(tokenizer, "hub_reachable", lambda: False)
    src = write_jsonl(tmp_path / "in.jsonl", _pairs(3))
    t0 = time.perf_counter()
    assert cli_main(_prepare(src, "--tokenizer", "quickstrat/init-model", "--output", tmp_path / "s")) == 2
    assert time.perf_counter() - t0 < 5
    err = capsys.readouterr().err
    assert "'quickstrat/init-model'" in err and "cannot be reached" in err
    (tmp_path / "models").mkdir()
    assert cli_main(_prepare(src, "--tokenizer", tmp_path / "models" / "init-modle", "--output", tmp_path / "s")) == 2
    assert "does not exist" in capsys.readouterr().err


def test_batch_sizes_that_do_nothing_useful_are_warned_with_numbers(tmp_path, toy_tokenizers):
    from conftest import make_task

    from prefpack.config import load_config
    from prefpack.data.store import Store
    from prefpack.objectives import PairTask
    from prefpack.objectives.select import make_objectives
    from prefpack.reference import NoReference

    src = write_jsonl(tmp_path / "in.jsonl", _pairs(20))
    prepare(PrepareOptions(inputs=[str(src)], tokenizer=str(toy_tokenizers["neox"]), output=str(tmp_path / "s"),
                           workers=1), log=lambda m: None)
    store = Store(tmp_path / "s")
    cfg = load_config(None, ["loss.terms=[{name: sigmoid}]", "train.global_batch_pairs=100000",
                             "train.micro_batch_tokens=3", "reference.mode=none"])
    task = make_task(PairTask, store, cfg)
    lines: list[str] = []
    make_objectives(task.settings, task.terms, store, None, NoReference(), kto=False, log=lines.append)
    text = "\n".join(lines)
    assert "train.global_batch_pairs=100000" in text and "gives 20 examples" in text
    assert "train.micro_batch_tokens=3 is smaller than 20 of the 20 examples" in text
    cfg = load_config(None, ["loss.terms=[{name: sigmoid}]", "train.global_batch_pairs=4",
                             "train.micro_batch_tokens=4096"])
    task = make_task(PairTask, store, cfg)
    lines.clear()
    make_objectives(task.settings, task.terms, store, None, NoReference(), kto=False, log=lines.append)
    assert not [w for w in lines if w.startswith("warning")]


class _Spy:
    """A tokenizer whose backend records the longest text it was asked to encode."""

    def __init__(self, tok):
        self._tok, self.longest = tok, 0
        outer = self

        class Backend:
            def __getattr__(self, name):
                real = getattr(tok.backend_tokenizer, name)
                if not name.startswith("encode"):
                    return real

                def encode(texts, *a, **k):
                    lengths = [len(texts)] if isinstance(texts, str) else [len(t) for t in texts]
                    outer.longest = max([outer.longest, *lengths])
                    return real(texts, *a, **k)
                return encode

        self.backend_tokenizer = Backend()

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_one_huge_row_is_cut_before_tokenising_and_keeps_the_same_tokens(toy_tokenizers, monkeypatch):
    from prefpack.data import tokenize
    from prefpack.data.formats import Example
    from prefpack.tokenizer import load_tokenizer, special_tokens

    tok = load_tokenizer(toy_tokenizers["neox"])
    words = "the answer is four because two and two make four ".split()
    huge = " ".join(words[i % len(words)] for i in range(100_000))  # about 500,000 characters
    examples = [Example(prompt=huge, completions=(huge, " no."), chat=False, completion_fields=("chosen", "rejected")),
                Example(prompt="Short?", completions=(" Yes" + huge, " No"), chat=False,
                    completion_fields=("chosen", "rejected"))]
    cfg = tokenize.TokenizeConfig(max_length=256)
    spy = _Spy(tok)
    got = tokenize.ExampleTokenizer(spy, special_tokens(tok), cfg)(examples)
    assert spy.longest <= tokenize.CUT_CHARS_PER_TOKEN * 256 + 1024  # never the whole 500 kB text
    monkeypatch.setattr(tokenize, "CUT_CHARS_PER_TOKEN", 10**9)  # the whole text tokenised, as before
    want = tokenize.ExampleTokenizer(tok, special_tokens(tok), cfg)(examples)
    for g, w in zip(got, want):
        assert (g.prompt, g.completions, g.truncated) == (w.prompt, w.completions, w.truncated)
        assert len(g.prompt) + max(map(len, g.completions)) <= 256
    assert [g.cut for g in got] == [2, 1]
