"""Issue 24, items 6-8: user errors told as messages naming the path and the fix, silent acceptances made loud,
and one huge row kept from raising prepare's memory."""

from __future__ import annotations

import gzip
import json

import pytest

from prefpack.cli import main as cli_main


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
