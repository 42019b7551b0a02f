"""The `prefpack` command line: one subcommand per job, user errors printed without a traceback."""

from __future__ import annotations

import argparse
import sys

from prefpack.data.formats import LAYOUTS

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


def _add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="tokenise preference data into a binary store",
                       description="Read JSONL/JSON/Parquet/CSV files (or globs) or datasets folders, tokenise "
                       "prompt and completions apart, and write a binary store to --output.")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files, globs or datasets.save_to_disk folders")
    p.add_argument("--tokenizer", required=True, help="tokenizer folder or hub id")
    p.add_argument("--output", "-o", required=True, help="store folder to create")
    p.add_argument("--format", choices=LAYOUTS, default=None, help="input layout (default: detect from the first row)")
    for name in ("prompt", "chosen", "rejected", "completion", "label"):
        p.add_argument(f"--{name}-field", default=None, help=f"name of the {name} field")
    p.add_argument("--split", default=None, help="split to read from a DatasetDict folder")
    p.add_argument("--max-length", type=int, default=None,
                   help="longest prompt+completion sequence in tokens (default: no limit)")
    p.add_argument("--truncation", choices=("prompt-left", "drop"), default="prompt-left",
                   help="over-long examples: cut the prompt from the left, then completions from the right "
                   "(prompt-left, default), or drop them; every cut or drop is counted")
    p.add_argument("--workers", type=int, default=0, help="tokeniser processes (default: all cores)")
    p.add_argument("--skip-invalid", action="store_true",
                   help="skip bad rows (counted by reason and written to skipped.jsonl) instead of stopping")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output store")
    p.add_argument("--allow-duplicate-inputs", action="store_true",
                   help="store a file reached twice (by name, glob or link) twice, on purpose")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom tokenizer code from the hub")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="template variables for every chat row, as a JSON object, e.g. '{\"enable_thinking\": false}'; "
                   "a row's own chat_template_kwargs column overrides them key by key")
    p.add_argument("--tools", default=None, metavar="FILE",
                   help="JSON file holding a list of tool (function) definitions, passed to the chat template for "
                   "chat rows with no tools column value of their own")


def _run_prepare(args, argv: list[str]) -> int:
    from prefpack.data.prepare import PrepareOptions, prepare

    fields = {n: getattr(args, f"{n}_field") for n in ("prompt", "chosen", "rejected", "completion", "label")}
    opts = PrepareOptions(
        inputs=args.inputs, tokenizer=args.tokenizer, output=args.output, layout=args.format, fields=fields,
        split=args.split, max_length=args.max_length, truncation=args.truncation, workers=args.workers,
        skip_invalid=args.skip_invalid, overwrite=args.overwrite, trust_remote_code=args.trust_remote_code,
        allow_duplicate_inputs=args.allow_duplicate_inputs,
        chat_template_kwargs=args.chat_template_kwargs, tools=args.tools,
        argv=argv,
    )
    report = prepare(opts, log=lambda m: print(m, file=sys.stderr))
    print(report.summary())
    return 0


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="show a store's meta, length statistics and one decoded example")
    p.add_argument("store", metavar="DIR")
    p.add_argument("--row", type=int, default=None, help="decode this example (0-based)")
    p.add_argument("--json", action="store_true", help="print one JSON object (keys meta, stats, row)")
    p.add_argument("--tokenizer", default=None, help="decode with this tokenizer (default: the store's copy)")
    p.add_argument("--verify", action="store_true", help="also check file hashes and token ranges (reads everything)")


def _run_inspect(args, argv: list[str]) -> int:
    from prefpack.data.inspect import inspect_store

    print(inspect_store(args.store, row=args.row, as_json=args.json, tokenizer=args.tokenizer, verify=args.verify))
    return 0


def _commands() -> dict:
    from prefpack import commands

    return {"prepare": (_add_prepare, _run_prepare), "inspect": (_add_inspect, _run_inspect), **commands.COMMANDS}


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
