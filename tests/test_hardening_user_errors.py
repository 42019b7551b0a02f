"""Issue 24, items 6-8: user errors told as messages naming the path and the fix, silent acceptances made loud,
and one huge row kept from raising prepare's memory."""

from __future__ import annotations

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
