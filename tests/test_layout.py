"""The package's import graph between its top-level units (modules and sub-packages) has no circle, so it reads
top-down (ARCHITECTURE.md lists the floors). Read from the source with ast; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "prefpack"


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        src = unit(".".join(rel.parts))
        targets = graph.setdefault(src, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.startswith("prefpack.") and unit(name) != src:
                    targets.add(unit(name))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    colour: dict[str, int] = {}

    def visit(u: str, stack: list[str]) -> list[str] | None:
        colour[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if colour.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if not colour.get(v):
                found = visit(v, stack)
                if found:
                    return found
        stack.pop()
        colour[u] = 2
        return None

    for u in sorted(graph):
        if not colour.get(u):
            found = visit(u, [])
            if found:
                return found
    return None


def test_no_import_circle_between_units():
    graph = import_graph()
    assert {"training", "objectives", "reference", "batching", "data", "losses"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_checker_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_config_choices_are_the_registries():
    """The config's choice types list exactly what the code registers, so adding a reference mode, an f-divergence
    or an attention kernel without its config choice (or the reverse) fails here, by name."""
    from typing import get_args

    from prefpack.config.schema import AttnImpl, FDivergence, ReferenceMode
    from prefpack.losses import F_DIVERGENCES
    from prefpack.model.attention import packed_sdpa, varlen
    from prefpack.model.attention.kernels import KERNELS
    from prefpack.reference import REFERENCE_MODES

    assert get_args(ReferenceMode) == tuple(REFERENCE_MODES)  # the config offers the reference folder's modes
    assert get_args(FDivergence) == tuple(F_DIVERGENCES)
    ours = {packed_sdpa.NAME, varlen.NAME}
    transformers_own = {"sdpa", "eager", "flash_attention_2"}
    assert set(get_args(AttnImpl)) == {"auto"} | ours | transformers_own
    assert get_args(AttnImpl) == ("auto", *(k.name for k in KERNELS))  # the kernel table's rows, in its order


def test_the_config_loads_without_torch():
    """The config reads the registries' name tables, not the registries: `prefpack --help` stays fast."""
    import subprocess
    import sys

    code = "import sys, prefpack.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
