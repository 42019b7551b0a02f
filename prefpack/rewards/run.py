"""``prefpack score`` as a library call: an input's rows scored by one scorer, checkpointed in ``OUT.partial`` every
``checkpoint_rows`` rows (a killed run continues from there), then the output written in one pass over the input
and the checkpointed scores, so a resumed run writes exactly what an uninterrupted one writes."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prefpack.errors import PrefpackError
from prefpack.progress import is_terminal
from prefpack.rewards.output import ScoreOutputError, store_meta, write_jsonl, write_store
from prefpack.rewards.pairs import PAIR_MODES, PairSelection
from prefpack.rewards.partial import PartialScores
from prefpack.rewards.rows import ScoreInput, ScoreRow
from prefpack.rewards.scorers import RewardFunctionScorer, Scorer, ScorerError
from prefpack.rewards.user_call import DEFAULT_TIMEOUT, CallStopped
from prefpack.stop_signal import STOP_SIGNALS, StopSignal, Terminated

OUTPUT_FORMATS = ("store", "jsonl")


class ScoringInterrupted(Exception):
    """Raised by the ``stop_after_rows`` hook: the run stops as a kill would, its checkpoints kept."""


@dataclass
class ScoreOptions:
    input: str
    output: str
    reward_model: str | None = None
    reward_fn: str | None = None  # path/to/file.py:function (user code: imported only when given)
    reward_timeout: float = DEFAULT_TIMEOUT  # seconds one call of reward_fn may take (0: no limit)
    tokenizer: str | None = None  # the input's tokenizer (a store's own copy by default)
    format: str = "store"  # store (ranked, or pairs with `pairs`) | jsonl
    pairs: str | None = None  # write a pair store of these pairs (pairs.PAIR_MODES) instead of a ranked store
    min_gap: float = 0.0  # a pair's least score gap; prompts left with no pair are skipped and counted
    checkpoint_rows: int = 64
    overwrite: bool = False
    allow_unfinished: bool = False  # score a samples file generate has not finished (its meta: complete false)
    device: str = "auto"
    dtype: str = "float32"
    batch_tokens: int = 8192
    trust_remote_code: bool = False
    # a reward model whose own tokenizer is not the input's scores the input's ids as they are (not re-tokenised)
    allow_tokenizer_mismatch: bool = False
    progress: bool = True
    stop_after_rows: int | None = None  # tests: stop (as if killed) once this many rows are checkpointed
    argv: list[str] = field(default_factory=list)


def score(opts: ScoreOptions, log: Callable[[str], None] = print, scorer: Scorer | None = None) -> dict:
    """Score ``opts.input`` into ``opts.output``; returns a summary (rows, completions, the scores' spread, pairs).
    SIGTERM or Ctrl-C is acted on between checkpoints, or cuts a reward function's call off (the chunk in flight
    dropped): :class:`Terminated`, every scored chunk kept. ``scorer``: the
    one the options name, already made (on-policy rounds keep a reward model loaded across rounds)."""
    with StopSignal(signums=STOP_SIGNALS) as stop:
        return _score(opts, log, stop, scorer)


def open_input(opts: ScoreOptions) -> ScoreInput:
    """The input the options name, with the tokenizer it is read with."""
    return ScoreInput(opts.input, tokenizer=opts.tokenizer, fallback_tokenizer=_model_tokenizer(opts.reward_model),
                      trust_remote_code=opts.trust_remote_code, allow_unfinished=opts.allow_unfinished)


def _score(opts: ScoreOptions, log: Callable[[str], None], stop: StopSignal, scorer: Scorer | None = None) -> dict:
    _check(opts)
    source = open_input(opts)
    for note in source.notes:
        log(f"note: {note}")
    scorer = scorer if scorer is not None else make_scorer(opts)
    check = getattr(scorer, "check_input", None)  # a reward model: its own tokenizer against the input's
    note = check(source, allow_mismatch=opts.allow_tokenizer_mismatch) if check is not None else None
    if note:
        log(f"note: {note}")
    identity = scorer.identity()
    partial = PartialScores(opts.output, {"input": source.identity(), "scorer": identity}, log=log)
    total = source.count_rows()
    bar = Progress(total, len(partial), opts.progress, log)
    pending: list[ScoreRow] = []
    for row in source.rows():
        if row.row < len(partial):
            continue
        pending.append(row)
        if len(pending) == opts.checkpoint_rows:
            _stop_if_due(stop, partial, total, bar)
            _checkpoint(scorer, pending, partial, bar, opts, stop, total)
            pending = []
    if pending:
        _stop_if_due(stop, partial, total, bar)
        _checkpoint(scorer, pending, partial, bar, opts, stop, total)
    _stop_if_due(stop, partial, total, bar)  # a signal during the last chunk: stop before writing the output
    bar.close()
    scores = partial.scores
    summary = {"input": str(source.path), "output": opts.output, "rows": len(scores),
               "completions": sum(map(len, scores))}
    if opts.format == "jsonl":
        write_jsonl(_paired(source.rows(), scores), opts.output, overwrite=opts.overwrite)
    else:
        selection = PairSelection(opts.pairs, opts.min_gap) if opts.pairs else None
        args = {"input": opts.input, "reward_model": opts.reward_model, "reward_fn": opts.reward_fn,
                "pairs": opts.pairs, "min_gap": opts.min_gap}
        meta = store_meta(source, identity, scores, {**args, "argv": opts.argv})
        written = write_store(source, _paired(source.rows(), scores), opts.output, meta=meta, selection=selection,
                              overwrite=opts.overwrite, log=log)
        summary.update(examples=written["counts"]["examples"], skipped=written["counts"]["skipped"],
                       scores=written["scoring"], **({"pairs": written["pairs"]} if selection else {}))
    partial.remove()
    return summary


def make_scorer(opts: ScoreOptions) -> Scorer:
    """The one scorer the options name; the reward function's file is imported here, never otherwise."""
    if opts.reward_fn is not None:
        return RewardFunctionScorer(opts.reward_fn, timeout=opts.reward_timeout)
    from prefpack.rewards.reward_model import RewardModelScorer

    return RewardModelScorer(opts.reward_model, device=opts.device, dtype=opts.dtype, batch_tokens=opts.batch_tokens,
                             trust_remote_code=opts.trust_remote_code)


def _model_tokenizer(folder: str | None) -> str | None:
    """A reward model folder that holds its tokenizer (as an exported one does) reads text rows by default."""
    from pathlib import Path

    if folder and any((Path(folder) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return folder
    return None


def _check(opts: ScoreOptions) -> None:
    if (opts.reward_model is None) == (opts.reward_fn is None):
        raise PrefpackError("give one scorer: --reward-model FOLDER or --reward-fn path/to/file.py:function")
    if opts.format not in OUTPUT_FORMATS:
        raise PrefpackError(f"--format must be one of {', '.join(OUTPUT_FORMATS)}, not {opts.format!r}")
    if opts.pairs is not None and (opts.pairs not in PAIR_MODES or opts.format != "store"):
        raise PrefpackError(f"--pairs is one of {', '.join(PAIR_MODES)} and writes a pair store (--format store)")
    if not opts.min_gap >= 0:
        raise PrefpackError(f"--min-gap must be >= 0, not {opts.min_gap}")
    if not (math.isfinite(opts.reward_timeout) and opts.reward_timeout >= 0):
        raise PrefpackError(f"--reward-timeout must be a number of seconds >= 0 (0: no limit), not "
                            f"{opts.reward_timeout}")
    if opts.checkpoint_rows < 1:
        raise PrefpackError(f"--checkpoint-rows must be at least 1, not {opts.checkpoint_rows}")
    from pathlib import Path

    from prefpack.generation.samples import find_meta, same_file

    out = Path(opts.output).resolve()
    read = [Path(opts.input)] + ([m] if Path(opts.input).is_file() and (m := find_meta(opts.input)) else [])
    for inp in read:  # before anything is written: the output (a folder, replaced whole) must not hold the input
        if same_file(out, inp) or out.is_relative_to(inp.resolve()) or inp.resolve().is_relative_to(out):
            what = "the input" if inp == read[0] else "the input's meta"
            raise ScoreOutputError(f"--output {opts.output} is {what} {inp} (or holds it, or lies inside it): "
                                   "writing it would destroy what score reads; choose another output")
    if Path(opts.output).exists() and not opts.overwrite:  # before any scoring: refuse at once
        raise ScoreOutputError(f"output {opts.output!r} exists; pass --overwrite to replace it")


def _checkpoint(scorer: Scorer, rows: list[ScoreRow], partial: PartialScores, bar: Progress,
                opts: ScoreOptions, stop: StopSignal, total: int) -> None:
    try:
        scores = scorer.score(rows)
    except CallStopped as cut:  # a stop signal cut a reward function's call off: this chunk is dropped, as a kill
        stop.signum, stop.acted = stop.signum or cut.signum, True  # would; the checkpointed ones kept
        bar.close()
        raise Terminated(f"{len(partial)} of {total} rows are scored in {partial.path}", cut.signum) from None
    for row, values in zip(rows, scores):
        if len(values) != len(row.completion_ids):
            raise ScorerError(f"{scorer.name}: {len(values)} scores for the {len(row.completion_ids)} completions of "
                              f"row {row.row}")
        bad = next((k for k, v in enumerate(values) if not math.isfinite(v)), None)
        if bad is not None:
            raise ScorerError(f"{scorer.name}: row {row.row}, completion {bad}: score {values[bad]}, not a finite "
                              "number")
    partial.add([[float(v) for v in values] for values in scores])
    bar.update(len(rows), sum(len(r.completion_ids) for r in rows))
    if opts.stop_after_rows is not None and len(partial) >= opts.stop_after_rows:
        bar.close()
        raise ScoringInterrupted(f"stopped after {len(partial)} rows")


def _stop_if_due(stop: StopSignal, partial: PartialScores, total: int, bar: Progress) -> None:
    if stop.due():
        bar.close()
        raise Terminated(f"{len(partial)} of {total} rows are scored in {partial.path}", stop.signum)


def _paired(rows: Iterator[ScoreRow], scores: list[list[float]]) -> Iterator[tuple[ScoreRow, list[float]]]:
    for row in rows:
        yield row, scores[row.row]


class Progress:
    """A tqdm bar on a terminal; off one (a job's log file) a plain line at most every ``every`` seconds."""

    def __init__(self, total: int, done: int, enabled: bool, log: Callable[[str], None], every: float = 30.0):
        self.total, self.done, self.log, self.every = total, done, log, every
        self.bar, self.lines = None, False
        self.t0 = self.last = time.monotonic()
        self.start, self.completions = done, 0
        if enabled and is_terminal(sys.stderr):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, desc="score", unit="row", file=sys.stderr, dynamic_ncols=True)
        else:
            self.lines = enabled

    def update(self, rows: int, completions: int) -> None:
        self.done += rows
        self.completions += completions
        if self.bar is not None:
            self.bar.update(rows)
        elif self.lines and (time.monotonic() - self.last >= self.every or self.done == self.total):
            self.last = time.monotonic()
            rate = self.completions / max(self.last - self.t0, 1e-9)
            self.log(f"score: {self.done}/{self.total} rows ({rate:.1f} completions/s)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

