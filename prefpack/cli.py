"""The `prefpack` entry point: builds the parser from `prefpack.commands` (one `add_X`/`run_X` pair per subcommand),
dispatches, and prints user errors without a traceback."""

from __future__ import annotations

import argparse
import sys

EXIT_USER_ERROR = 2


def _user_errors() -> tuple[type[BaseException], ...]:
    from prefpack.config import ConfigError
    from prefpack.data.formats import InvalidRow
    from prefpack.data.prepare import PrepareError
    from prefpack.data.sources import SourceError
    from prefpack.data.store import StoreError
    from prefpack.distributed import LaunchError
    from prefpack.metrics import MetricsWriteError
    from prefpack.model import ModelError
    from prefpack.plot import PlotError
    from prefpack.reference import ReferenceMismatch
    from prefpack.tokenizer import TokenizerError

    return (InvalidRow, PrepareError, SourceError, StoreError, TokenizerError, ConfigError, ModelError,
            ReferenceMismatch, PlotError, FileExistsError, LaunchError, MetricsWriteError)


def _commands() -> dict:
    from prefpack import commands

    return commands.COMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefpack", description="Packed, completion-only preference optimisation.")
    from prefpack import __version__

    parser.add_argument("--version", action="version", version=f"prefpack {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add, _ in _commands().values():
        add(sub)
    return parser


def _quiet_libraries() -> None:
    """prefpack prints its own progress; transformers' per-file loading bars only add noise."""
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "warning")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command in ("train", "eval", "precompute-ref", "quickstart"):
        _quiet_libraries()
    if extra:
        # `key.sub=value` overrides may follow options (argparse stops collecting positionals at the first flag)
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return _commands()[args.command][1](args, ["prefpack", *argv])
    except _user_errors() as exc:
        print(f"prefpack {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"prefpack {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
