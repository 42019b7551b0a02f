"""docs/config.md and docs/losses.md are what `python -m prefpack.docs` writes from the code now, so a new config
key, loss or paper cannot land without its line in the reference pages."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from prefpack import docs

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.parametrize("name", sorted(docs.RENDERERS))
def test_generated_page_is_current(name):
    path = DOCS / name
    assert path.is_file(), f"docs/{name} is missing; run `{docs.COMMAND}` in the repository root and commit it"
    want, have = docs.RENDERERS[name](), path.read_text(encoding="utf-8")
    if have != want:
        diff = "".join(list(difflib.unified_diff(have.splitlines(True), want.splitlines(True), f"docs/{name}",
                                                 "generated"))[:40])
        pytest.fail(f"docs/{name} differs from what the code gives now; run `{docs.COMMAND}` in the repository "
                    f"root and commit the result. First lines of the difference:\n{diff}")


def test_every_loss_and_key_is_on_its_page():
    from dataclasses import fields

    from prefpack.config import Config
    from prefpack.losses import PAIR_LOSSES, UNPAIRED_LOSSES

    config_page, loss_page = docs.render_config(), docs.render_losses()
    for section in fields(Config):
        for f in fields(getattr(Config(), section.name)):
            assert f"| `{section.name}.{f.name}` |" in config_page
    for name in [*PAIR_LOSSES, *UNPAIRED_LOSSES]:
        assert f"| `{name}` |" in loss_page
    # every loss cites its source, except the plain token-mean NLL TRL calls sft
    uncited = sorted(n for n, s in [*PAIR_LOSSES.items(), *UNPAIRED_LOSSES.items()] if not (s.paper and s.arxiv))
    assert uncited == ["sft"], uncited


def test_check_mode_names_a_stale_page(tmp_path, capsys):
    assert docs.main(["--output-dir", str(tmp_path)]) == 0
    assert docs.main(["--output-dir", str(tmp_path), "--check"]) == 0
    (tmp_path / "losses.md").write_text("old\n", encoding="utf-8")
    capsys.readouterr()
    assert docs.main(["--output-dir", str(tmp_path), "--check"]) == 1
    out = capsys.readouterr().out
    assert "losses.md is out of date" in out and docs.COMMAND in out and "config.md" not in out
