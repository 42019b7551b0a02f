"""Every relative link in README.md, ARCHITECTURE.md and docs/*.md points to a file that exists and, with a
#anchor, to a heading of that file (GitHub's slugs); and the README's table of main options shows the config's
real defaults."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "ARCHITECTURE.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, inline code spans blanked (a link or `#` in code is not one)."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lower case, punctuation dropped (not `-` or `_`), spaces to `-`."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    found = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        line = re.sub(r"`[^`]*`", "``", line)
        found += _LINK.findall(line)
    return found


def broken_links(path: Path) -> list[str]:
    bad = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    assert page.is_file()
    bad = broken_links(page)
    assert not bad, f"{page.relative_to(REPO)} has broken links:\n" + "\n".join(bad)


def test_the_docs_pages_are_linked_from_the_readme():
    readme = set(links(REPO / "README.md"))
    unlinked = [p.name for p in PAGES[2:] if p.name != "README.md" and f"docs/{p.name}" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path):
    assert slug("Set up and run (fresh machine, Python 3.11, no downloads beyond PyPI)") == \
        "set-up-and-run-fresh-machine-python-311-no-downloads-beyond-pypi"
    assert slug("`prefpack prepare`") == "prefpack-prepare"
    assert slug("Quick start: what `make demo` runs") == "quick-start-what-make-demo-runs"
    page = tmp_path / "a.md"
    page.write_text("# Top\n\n## Top\n\n```\n# not a heading\n```\n\n[ok](#top-1) [ok](b.md) `[code](nowhere.md)`\n"
                    "[bad](#not-a-heading) [bad](missing.md) [bad](b.md#nope) [web](https://example.com)\n",
                    encoding="utf-8")
    (tmp_path / "b.md").write_text("# B\n", encoding="utf-8")
    bad = broken_links(page)
    assert [b.split(":")[0] for b in bad] == ["#not-a-heading", "missing.md", "b.md#nope"], bad


def test_readme_main_options_show_the_config_defaults():
    from prefpack.config import Config
    from prefpack.config.io import _flow, _plain

    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Main options", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)\.([a-z_]+)` \| `([^`]*)` \|", section, flags=re.M)
    assert len(rows) >= 15, rows
    cfg = Config()
    wrong = [f"{s}.{k}: README says {shown}, the config's default is {_flow(_plain(getattr(getattr(cfg, s), k)))}"
             for s, k, shown in rows if _flow(_plain(getattr(getattr(cfg, s), k))) != shown]
    assert not wrong, "\n".join(wrong)
