"""The run's metrics.jsonl in rounds: one ``round`` line per round (the policy's sample rewards, the pairs' reward
gap, tied prompts, cut samples, generation tokens/s, seconds per phase, the held-out evaluation after the round), and
each round's train and eval lines copied from its training run with their steps counted from the first round, so
``prefpack plot RUN_DIR`` draws the whole run. Every line carries ``round``; a resumed run first drops the lines of
rounds that did not finish (their ``round.json`` is missing), so no line is logged twice."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from prefpack.metrics import METRICS_FILE, read_metrics

ROUND_FILE = "round.json"  # written last in a round's folder: the round is done
PHASES_FILE = "phases.json"


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def record_phase(folder: Path, phase: str, **values) -> None:
    """A finished phase's seconds (and tokens), kept so that a resumed run still reports them."""
    phases = read_json(folder / PHASES_FILE)
    phases[phase] = values
    write_json(folder / PHASES_FILE, phases)


def drop_unfinished(run_dir: Path, finished: int) -> int:
    """Keep only the metrics lines of the first ``finished`` rounds; returns how many lines were dropped."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return 0
    records = read_metrics(path)
    kept = [r for r in records if isinstance(r, dict) and int(r.get("round", -1)) < finished]
    if len(kept) != len(records):
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, path)
    return len(records) - len(kept)


def copy_training_lines(metrics, train_dir: Path, r: int, offset: int) -> None:
    """Round ``r``'s train lines, and its eval lines after the first step (the eval before a later round's first step
    is the last round's final evaluation), with steps counted from the run's first step."""
    for rec in read_metrics(train_dir / METRICS_FILE):
        split, step = rec.get("split", "train"), int(rec.get("step", 0))
        if split not in ("train", "eval") or (split == "eval" and step == 0 and r > 0):
            continue
        values = {k: v for k, v in rec.items() if k not in ("step", "split", "time")}
        metrics.log(offset + step, {**values, "round": r}, split=split)


def round_metrics(r: int, samples_meta: dict, store_meta: dict, phases: dict, eval_after: dict | None,
                  eval_scores: list[float] | None) -> dict:
    """The round line: what the policy's samples scored, what the pairs kept, how long each phase took."""
    scoring, pairs = store_meta.get("scoring") or {}, store_meta.get("pairs") or {}
    counts = samples_meta.get("counts") or {}
    gen = phases.get("generate", {})
    out = {"round": r, "reward/mean": scoring.get("mean"), "reward/max": scoring.get("max"),
           "reward/min": scoring.get("min"), "reward/gap": pairs.get("mean_gap"), "pairs": pairs.get("pairs"),
           "prompts": counts.get("prompts"), "samples": counts.get("samples"),
           "tied_prompts": pairs.get("tied_prompts"), "cut_samples": counts.get("truncated"),
           "generate/tokens": gen.get("tokens"),
           "generate/tokens_per_s": gen.get("tokens", 0) / gen["seconds"] if gen.get("seconds") else None}
    for phase in ("generate", "score", "reference", "train", "eval_prompts"):
        if phase in phases:
            out[f"seconds/{phase}"] = phases[phase]["seconds"]
    if "waited" in gen:  # rounds.overlap: the part of the sampling the training did not hide
        out["seconds/generate_waited"] = gen["waited"]
    if eval_scores:
        out["eval_reward/mean"] = math.fsum(eval_scores) / len(eval_scores)
    for key, value in (eval_after or {}).items():
        out[f"eval/{key}"] = value
    return {k: v for k, v in out.items() if v is not None}  # a round that tied has no pairs' gap
