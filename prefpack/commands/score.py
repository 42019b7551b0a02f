"""``prefpack score``: completions scored by a reward model or a reward function, written as a ranked store (or the
pairs drawn from it, or JSONL); resumable (``prefpack.rewards``)."""

from __future__ import annotations

import argparse
import json
import sys

from prefpack.rewards.pairs import PAIR_MODES
from prefpack.rewards.partial import partial_path


def add_score(sub) -> None:
    p = sub.add_parser(
        "score", help="score completions with a reward model or a reward function into a ranked store or JSONL",
        description="Score every completion of INPUT: a samples file (prefpack generate's JSONL of token ids), JSONL "
        "rows {prompt, completions} or pairs (tokenised as prepare tokenises them), or a pair or ranked store. "
        "Token ids are scored as they are, except by a reward model of another tokenizer, which reads the texts with "
        "its own tokenizer and chat template (said in one line). Writes a ranked store with the scores (prefpack inspect shows them), a "
        "pair store with --pairs, or JSONL with --format jsonl. A killed run continues where it stopped when run "
        "again: its scores are checkpointed in OUTPUT.partial.")
    p.add_argument("input", metavar="INPUT", help="samples .jsonl, text .jsonl, or a store folder")
    p.add_argument("--output", "-o", required=True, help="store folder (or .jsonl file with --format jsonl) to create")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--reward-model", metavar="FOLDER",
                     help="a sequence-classification model folder with one label (num_labels=1): each prompt + "
                     "completion scored at its last token")
    who.add_argument("--reward-fn", metavar="FILE.py:FUNCTION",
                     help="a Python function called as FUNCTION(prompt, completion) or FUNCTION(prompt, completion, "
                     "row) (row: the input row, passthrough fields such as label included), returning a float. "
                     "The file is YOUR code: it is imported (run) only when this flag names it")
    p.add_argument("--reward-timeout", type=float, default=None, metavar="SECONDS",
                   help="--reward-fn: the longest one call may take, then it is stopped and the run fails naming the "
                   "row (default 60; 0: no limit)")
    p.add_argument("--tokenizer", default=None,
                   help="the input's tokenizer (default: a store's own copy; a samples file's recorded tokenizer when "
                   "it is a folder; else the --reward-model folder's own tokenizer when it holds one; needed only "
                   "when none of these is there)")
    p.add_argument("--format", choices=("store", "jsonl"), default="store",
                   help="store (default): a ranked store of every row's completions and scores; jsonl: the input rows "
                   "with a scores list")
    p.add_argument("--pairs", choices=PAIR_MODES, default=None,
                   help="write a pair store of these pairs instead: best_vs_worst (RLHFlow's max-min), best_vs_rest, "
                   "all_pairs; prompts left with no pair are skipped and counted")
    p.add_argument("--min-gap", type=float, default=0.0,
                   help="with --pairs, the least score gap a pair needs (default 0: any strict preference)")
    p.add_argument("--checkpoint-rows", type=int, default=64, metavar="N",
                   help="checkpoint the scores every N input rows (default 64)")
    p.add_argument("--batch-tokens", type=int, default=8192, metavar="N",
                   help="--reward-model: positions per forward, packed with each prompt laid out once for its completions "
                   "(default 8192)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where the reward model runs "
                   "(default auto: CUDA when there is a GPU, else CPU)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="the reward model's weights and compute (default float32)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--allow-unfinished", action="store_true", help="score a samples file generate has not finished "
                   "(its meta says complete: false): only the rows it holds; refused otherwise")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run Python code the reward model or tokenizer folder names in its config (auto_map)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (or progress lines off a terminal)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    # stops as if killed once N rows are checkpointed (to test resuming); not for everyday use
    p.add_argument("--stop-after-rows", type=int, default=None, help=argparse.SUPPRESS)


def run_score(args, argv: list[str]) -> int:
    from prefpack.commands.generate import stopped_hint
    from prefpack.rewards.run import ScoreOptions, ScoringInterrupted, score
    from prefpack.stop_signal import Terminated

    opts = ScoreOptions(input=args.input, output=args.output, reward_model=args.reward_model,
                        reward_fn=args.reward_fn, tokenizer=args.tokenizer, format=args.format, pairs=args.pairs,
                        min_gap=args.min_gap, checkpoint_rows=args.checkpoint_rows, overwrite=args.overwrite,
                        allow_unfinished=args.allow_unfinished,
                        device=args.device, dtype=args.dtype, batch_tokens=args.batch_tokens,
                        trust_remote_code=args.trust_remote_code, progress=not args.no_progress,
                        stop_after_rows=args.stop_after_rows, argv=argv,
                        **({} if args.reward_timeout is None else {"reward_timeout": args.reward_timeout}))
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    try:
        summary = score(opts, log=log)
    except ScoringInterrupted as stop:
        log(f"{stop}; run the same command again to continue from {partial_path(args.output)}")
        return 0
    except Terminated as term:  # SIGTERM or Ctrl-C: every checkpointed chunk is kept; the same command continues
        log(stopped_hint("score", term, argv))
        return 128 + term.signum
    if args.json:
        print(json.dumps(summary))
        return 0
    if args.format == "jsonl":
        head = f"{summary.get('examples', summary['rows'])} rows from {summary['rows']} input rows"
    elif args.pairs:
        head = f"{summary['examples']} pairs from {summary['rows']} input rows"
    else:  # a ranked store: one row per scored completion
        head = f"a ranked store of {summary['rows']} input rows"
    print(f"wrote {args.output}: {head} ({summary['completions']} completions scored)")
    if summary.get("skipped"):
        print("skipped: " + ", ".join(f"{k}={v}" for k, v in sorted(summary["skipped"].items())))
    return 0
