"""The package's import graph has no circle, between its top-level units (modules and sub-packages) nor between
the modules of any one package, so it reads top-down (ARCHITECTURE.md lists the floors). Read from the source with
ast; nothing is imported. Imports inside functions count (a deferred import hides a circle, it does not remove
it); imports under ``if TYPE_CHECKING:`` do not (they never run)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "prefpack"


def dotted(package_dir: Path) -> str:
    return ".".join(package_dir.relative_to(ROOT.parent).parts)


def runtime_imports(tree: ast.AST) -> Iterator[tuple[str, list[str]]]:
    """``(module, names imported from it)`` for each absolute import that can run (not under TYPE_CHECKING)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names)
        todo.extend(ast.iter_child_nodes(node))


def import_graph(package_dir: Path = ROOT) -> dict[str, set[str]]:
    """Which of the package's units (its modules and sub-packages, a sub-package as one node, its ``__init__``
    as one more) import which. ``from package import name`` reaches the module ``name`` if there is one, else
    the ``__init__`` (which re-exports)."""
    package = dotted(package_dir)
    children = {p.stem for p in package_dir.glob("*.py")} | {p.parent.name for p in package_dir.glob("*/__init__.py")}
    graph: dict[str, set[str]] = {}
    for path in package_dir.rglob("*.py"):
        src = path.relative_to(package_dir).with_suffix("").parts[0]
        targets = graph.setdefault(src, set())
        for module, names in runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if module == package:
                targets.update(n if n in children else "__init__" for n in names)
            elif module.startswith(package + "."):
                targets.add(module[len(package) + 1:].split(".")[0])
        targets.discard(src)
    return graph


def packages() -> list[Path]:
    return sorted(p.parent for p in ROOT.rglob("__init__.py"))


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


def test_no_import_circle_inside_a_package():
    assert {"prefpack.config", "prefpack.training", "prefpack.training.checkpoint", "prefpack.data"} <= {
        dotted(p) for p in packages()}
    for package_dir in packages():
        cycle = find_cycle(import_graph(package_dir))
        assert cycle is None, f"{dotted(package_dir)}: " + " -> ".join(cycle)


def test_the_checker_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_checker_reads_deferred_imports_and_skips_type_checking_ones():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import prefpack.a\n"
                     "def f():\n    from prefpack.b import c\n")
    assert sorted(m for m, _ in runtime_imports(tree)) == ["prefpack.b", "typing"]


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


def test_user_errors_share_one_base():
    """The CLI catches ``PrefpackError`` alone for prefpack's user errors, so a new one must derive from it; each
    keeps its builtin base so callers' ``except ValueError`` / ``except OSError`` still catch it."""
    from prefpack.cli import USER_ERRORS
    from prefpack.config import ConfigError
    from prefpack.data.formats import InvalidRow
    from prefpack.data.prepare import PrepareError
    from prefpack.data.sources import SourceError
    from prefpack.data.store import StoreError
    from prefpack.distributed import LaunchError
    from prefpack.errors import PrefpackError
    from prefpack.metrics import MetricsSetupError, MetricsWriteError
    from prefpack.model import ModelError
    from prefpack.plot import PlotError
    from prefpack.reference import ReferenceMismatch
    from prefpack.tokenizer import TokenizerError
    from prefpack.training.checkpoint.files import CheckpointDamaged, CheckpointWriteError

    assert PrefpackError in USER_ERRORS
    value_errors = (ConfigError, InvalidRow, PrepareError, SourceError, StoreError, LaunchError, MetricsSetupError,
                    ModelError, PlotError, ReferenceMismatch, TokenizerError, CheckpointDamaged, CheckpointWriteError)
    for cls in value_errors:
        assert issubclass(cls, PrefpackError) and issubclass(cls, ValueError), cls
    assert issubclass(MetricsWriteError, PrefpackError) and issubclass(MetricsWriteError, OSError)


def test_the_help_loads_without_torch():
    """``prefpack --help`` (the parser and the error classes the CLI catches) never loads torch."""
    import subprocess
    import sys

    code = ("import sys\nfrom prefpack.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"
