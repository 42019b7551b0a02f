"""A round's phases as functions, shared by the rounds in one process (``live``, ``feed``) and the round driver
(``driver``: each round a whole training run): sampling the round's prompts (``generate``; under torchrun the ranks'
parts), scoring them into the round's pair store (``score``), the held-out prompts (``eval_prompts``), the round's
record (``record``), the run folder, and the errors and result both report."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from prefpack.distributed import Dist
from prefpack.errors import PrefpackError
from prefpack.generation.run import GenerateReport, build_engine, prompt_source, sample_prompts, settings_of
from prefpack.generation.shards import merge_parts, part_files, part_path
from prefpack.rewards.output import NothingToWrite
from prefpack.rewards.partial import partial_path
from prefpack.rewards.run import ScoringInterrupted, score
from prefpack.rounds import plan
from prefpack.rounds.metrics import (
    PHASES_FILE,
    ROUND_FILE,
    read_json,
    record_phase,
    round_metrics,
    write_json,
)
from prefpack.rounds.ranks import Ranks
from prefpack.stop_signal import STOP_SIGNALS, StopSignal


class RoundsError(PrefpackError, ValueError):
    """A round that cannot go on (every prompt's samples tie, a run folder that holds another run)."""


class RoundsInterrupted(RuntimeError):
    """Raised by the ``stop_at`` test hook: the run stops as a kill would in that phase, its files kept."""


@dataclass
class RoundsResult:
    run_dir: Path
    rounds: list[dict] = field(default_factory=list)  # each round's metrics line
    final_dir: Path | None = None

    def summary(self) -> str:
        """The rounds as a table (a ranked round store, group policy gradients', has no pairs: '-')."""
        held_out = any("eval_reward/mean" in m for m in self.rounds)
        lines = [f"{'round':>5} {'reward mean':>12} {'min':>8} {'max':>8} {'pairs':>6} {'tied':>5} {'cut':>5}"
                 + (f" {'held-out reward':>16}" if held_out else "")]
        for m in self.rounds:
            lines.append(f"{m['round'] + 1:>5} {m['reward/mean']:>12.4f} {m['reward/min']:>8.3f} "
                         f"{m['reward/max']:>8.3f} {m.get('pairs', '-'):>6} {m.get('tied_prompts', '-'):>5} "
                         f"{m.get('cut_samples', '-'):>5}"
                         + (f" {m.get('eval_reward/mean', float('nan')):>16.4f}" if held_out else ""))
        lines.append(f"final model: {self.final_dir}   metrics: {self.run_dir / 'metrics.jsonl'}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"run_dir": str(self.run_dir), "final_model": str(self.final_dir), "rounds": self.rounds}


class _StopAfterCalls:
    """An engine that raises ``RoundsInterrupted`` once it has answered ``calls`` generate calls (test hook)."""

    def __init__(self, engine, calls: int):
        self.engine, self.calls = engine, calls
        self.name, self.batch_prompts = engine.name, engine.batch_prompts
        self.batch_dependent = getattr(engine, "batch_dependent", True)

    def generate(self, jobs, settings):
        if self.calls <= 0:
            raise RoundsInterrupted("stopped in generate")
        self.calls -= 1
        return self.engine.generate(jobs, settings)

    def describe(self) -> dict:
        return self.engine.describe()

    def close(self) -> None:
        self.engine.close()


def _quiet(*_args) -> None:
    pass


def _record(metrics, r: int, step: int, samples: Path, scored: dict, eval_after: dict | None,
            eval_scores: list[float] | None) -> None:
    """The round's line, logged at the step its samples were drawn, then its ``round.json`` (last: the round is
    done). ``scored``: the pair store's meta, or a tied round's ``no_pairs.json`` (its ``scoring`` and ``pairs``)."""
    folder = samples.parent
    line = round_metrics(r, read_json(samples.with_name("samples.meta.json")), scored, read_json(folder / PHASES_FILE),
                         eval_after, eval_scores)
    metrics.log(step, line, split="round")
    write_json(folder / ROUND_FILE, line)


def _score(cfg, r: int, samples: Path, store: Path, stop, log, scorer=None) -> None:
    """The round's samples scored into its pair store (rank 0); ``scorer``: one kept across rounds."""
    t0 = time.perf_counter()
    opts = plan.score_options(cfg, samples, store, pairs=True)
    if stop is not None and stop[0] == "score":
        opts.stop_after_rows, opts.checkpoint_rows = stop[1], stop[1]
    try:
        score(opts, log=log, scorer=scorer)
    except ScoringInterrupted as exc:
        raise RoundsInterrupted(str(exc)) from None
    except NothingToWrite as exc:
        if r == 0:  # the reward is too sparse for the initial policy: no round could train
            raise RoundsError(f"round {r + 1}: no preference pair to train on ({exc}); the policy's samples all tie "
                              "under the scorer: sample more (rounds.samples_per_prompt, rounds.temperature) or use "
                              "a finer reward") from None
        # a later round: the policy has learned these prompts; record what was scored, train nothing this round
        write_json(store.parent / plan.NO_PAIRS_FILE, {"scoring": exc.scoring, "pairs": exc.pairs})
        shutil.rmtree(partial_path(store), ignore_errors=True)  # its scores are in the file above
    record_phase(store.parent, "score", seconds=time.perf_counter() - t0)


def _generate(cfg, run_dir: Path, r: int, prompts, samples: Path, phase: str, stop, log,
              ranks: Ranks | None = None, sampler=None) -> None:
    """The round's policy samples ``prompts`` into ``samples`` (continued when a killed run left part of it); under
    torchrun the ranks share the transformers engine's chunks (merged by rank 0), and so they do vLLM's where each rank
    drives servers of its own (``plan.servers_per_rank``); else the vLLM servers are rank 0's.
    ``sampler(source)``: the engine (in-process rounds: the policy in memory); None: built from the options."""
    ranks = ranks if ranks is not None else Ranks(Dist())  # one process
    if read_json(samples.with_name(samples.name.removesuffix(".jsonl") + ".meta.json")).get("complete"):
        return
    t0 = time.perf_counter()
    opts = plan.generate_options(cfg, run_dir, r, prompts=prompts, output=samples, held_out=phase == "eval_prompts")
    what = f"sampling round {r + 1}'s {'held-out ' if phase == 'eval_prompts' else ''}prompts"
    shared = opts.engine == "transformers" or sampler is not None and plan.servers_per_rank(cfg, ranks.world)
    if ranks.world == 1 or not shared:
        def alone() -> None:
            report = _sample(opts, samples, stop, phase, log, sampler=sampler)
            for stale in part_files(samples):  # an earlier run's parts under torchrun: these rows are done
                stale.unlink(missing_ok=True)
            record_phase(samples.parent, phase, seconds=time.perf_counter() - t0, tokens=report.tokens)
            log(report.summary())

        ranks.main_only(what, alone)
        return
    rank, world = ranks.ctx.rank, ranks.world

    def part() -> list[int]:  # this rank's chunks into its own part file
        report = _sample(opts, part_path(samples, rank, world), stop, phase, log, shard=(rank, world),
                         sampler=sampler)
        return [report.tokens, report.written]

    tokens, written = ranks.together(what, part, size=2)

    def merge() -> None:
        counts = merge_parts(samples, world, opts.batch_size)["counts"]
        seconds = time.perf_counter() - t0
        record_phase(samples.parent, phase, seconds=seconds, tokens=int(tokens))
        log(GenerateReport(samples, counts["prompts"], int(written), counts["samples"], counts["truncated"],
                           int(tokens), seconds).summary())

    ranks.main_only(f"merging the ranks' samples of round {r + 1}", merge)


def _sample(opts, output: Path, stop, phase: str, log, shard: tuple[int, int] = (0, 1),
            sampler=None) -> GenerateReport:
    source = prompt_source(opts)
    settings = settings_of(opts, source)
    with StopSignal(signums=STOP_SIGNALS) as signalled:  # SIGTERM / Ctrl-C: Terminated at a whole batch
        engine = build_engine(opts, source, signalled) if sampler is None else sampler(source)
        if stop is not None and stop[0] == phase:
            engine = _StopAfterCalls(engine, stop[1])
        try:
            return sample_prompts(source, engine, settings, output, log=log, stop=signalled, shard=shard)
        finally:
            engine.close()


def _eval_prompts(cfg, run_dir: Path, r: int, stop, log, ranks: Ranks, sampler=None,
                  scorer=None) -> list[float] | None:
    """The held-out prompts sampled by the round's policy and scored (never trained on): their rewards (rank 0's;
    None on the others)."""
    import json

    folder = plan.round_dir(run_dir, r)
    samples, scored = folder / "eval_samples.jsonl", folder / "eval_scores.jsonl"
    _generate(cfg, run_dir, r, cfg.rounds.eval_prompts, samples, "eval_prompts", stop, log, ranks, sampler)
    if not scored.is_file():
        ranks.main_only(f"scoring round {r + 1}'s held-out samples",
                        lambda: score(plan.score_options(cfg, samples, scored, pairs=False), log=log, scorer=scorer))
    if not ranks.is_main:
        return None
    with open(scored, encoding="utf-8") as fh:
        return [s for line in fh if line.strip() for s in json.loads(line)["scores"]]


def _open_run_dir(cfg, resume: bool) -> Path:
    """RUN_DIR with the run's config.yaml; a folder that holds a run is continued only with --resume, and only with
    the config it was started with (rounds.reward_timeout aside: a run stopped by it continues under another)."""
    from prefpack.config import save_config
    from prefpack.training.resume_check import config_unchanged
    from prefpack.training.run_folder import LOCK_FILE

    run_dir = Path(cfg.run.output_dir)
    saved = run_dir / "config.yaml"
    if run_dir.exists() and any(p.name != LOCK_FILE for p in run_dir.iterdir()):  # the lock is this run's own
        if not resume:
            raise RoundsError(f"run folder {str(run_dir)!r} already holds a run; pass --resume to continue it or "
                              "choose another run.output_dir")
        if saved.is_file() and not config_unchanged(cfg, saved, ignore=("rounds.reward_timeout",)):
            raise RoundsError(f"{saved}: the config differs from the one this run was started with; a resumed run "
                              "takes the same config (its rounds' files were made with it)")
    run_dir.mkdir(parents=True, exist_ok=True)
    if not saved.is_file():
        save_config(cfg, saved)
    return run_dir


CHUNK_ROWS = 256  # rows a rank hands its scorer at once


class SharedScores:
    """A scorer whose scores were computed already (by the ranks, each its share): the real scorer's name and
    identity, so the store's meta is what one process writes."""

    def __init__(self, scorer, table: dict[int, list[float]]):
        self.scorer, self.table, self.name = scorer, table, scorer.name

    def identity(self) -> dict:
        return self.scorer.identity()

    def check_input(self, source, allow_mismatch: bool = False) -> str | None:
        check = getattr(self.scorer, "check_input", None)
        return check(source, allow_mismatch=allow_mismatch) if check is not None else None

    def score(self, rows) -> list[list[float]]:
        return [list(self.table[row.row]) for row in rows]


def scores_over_ranks(cfg, samples: Path, scorer, ranks: Ranks) -> dict[int, list[float]]:
    """Under torchrun every rank scores its share of the samples' rows (row i: rank i % world) with its own scorer
    (a reward model on its own device); the ranks' tables, each row's scores on one rank and zeros on the others,
    are summed, so every rank holds the whole table (adding zeros is exact)."""
    from prefpack.rewards.run import open_input

    opts = plan.score_options(cfg, samples, Path(), pairs=True)
    source = open_input(opts)
    if hasattr(scorer, "check_input"):  # a reward model of another tokenizer re-tokenises the texts (said by rank 0)
        scorer.check_input(source, allow_mismatch=opts.allow_tokenizer_mismatch)
    k, n = cfg.rounds.samples_per_prompt, source.count_rows()
    rank, world = ranks.ctx.rank, ranks.world

    def mine() -> list[float]:
        from prefpack.rewards.scorers import ScorerError

        table = [0.0] * (n * k)
        rows = [row for row in source.rows() if row.row % world == rank]
        for start in range(0, len(rows), CHUNK_ROWS):  # as score() hands a scorer its rows: a chunk at a time
            chunk = rows[start:start + CHUNK_ROWS]
            for row, values in zip(chunk, scorer.score(chunk)):
                if len(values) != k:
                    raise ScorerError(f"{scorer.name}: {len(values)} scores for the {k} completions of row {row.row}")
                table[row.row * k:(row.row + 1) * k] = [float(v) for v in values]  # a NaN is named by rank 0's check
        return table

    summed = ranks.together(f"scoring the samples of {samples.parent.name}", mine, size=n * k)
    return {i: summed[i * k:(i + 1) * k] for i in range(n)}
