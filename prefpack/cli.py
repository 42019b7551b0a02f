"""The `prefpack` entry point: builds the parser from `prefpack.commands` (one `add_X`/`run_X` pair per subcommand),
dispatches, and prints user errors without a traceback."""

from __future__ import annotations

import argparse
import errno
import sys

from prefpack.errors import PrefpackError

EXIT_USER_ERROR = 2


# What the CLI prints as a message (no traceback): prefpack's own user errors, and quickstart refusing to write
# into a folder it did not make (a builtin FileExistsError).
USER_ERRORS: tuple[type[BaseException], ...] = (PrefpackError, FileExistsError)


_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)


def _os_error_message(exc: OSError) -> str:
    where = exc.filename if exc.filename is not None else "a file"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full writing {where} ({exc.strerror}); free space there, or write to another disk"
    return (f"cannot write {where} ({exc.strerror}); choose an output (--output, run.output_dir=...) in a folder you "
            "can write, or fix that folder's permissions")


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
    import logging
    import os

    # bitsandbytes says on import, on CPUs with AVX512-BF16, that an optional CPU kernel package is missing: noise for
    # every LoRA run (peft imports it), and a speed hint only for 4-bit weights on CPU (docs/gpu.md, Memory)
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "warning")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def _program(from_command_line: bool) -> str:
    """How the user called prefpack, for commands printed back to paste (``.venv/bin/prefpack`` as typed; else
    ``prefpack``)."""
    import os

    typed = sys.argv[0] if from_command_line and sys.argv else ""
    return typed if os.path.basename(typed) == "prefpack" else "prefpack"


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """The parsed arguments, as `main` runs them (tests/test_docs_commands.py parses the documented commands so)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # `key.sub=value` overrides may follow options (argparse stops collecting positionals at the first flag)
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    program = _program(argv is None)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_command_line(argv)
    if args.command in ("train", "eval", "precompute-ref", "quickstart", "generate", "score"):
        _quiet_libraries()
    try:
        return _commands()[args.command][1](args, [program, *argv])
    except USER_ERRORS as exc:
        print(f"prefpack {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as exc:  # a folder the user cannot write, a full disk: the path and the fix, not a traceback
        if exc.errno not in _WRITE_ERRNOS:
            raise
        print(f"prefpack {args.command}: error: {_os_error_message(exc)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"prefpack {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
