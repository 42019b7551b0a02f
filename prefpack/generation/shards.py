"""Sampling split over torchrun's ranks, with the samples of one process.

One process samples the source's prompts in chunks of the engine's ``batch_prompts``, each chunk seeded from its
first row (``hf_engine``); under ``world`` ranks chunk k is sampled by rank k % world (``sample_prompts(shard=...)``)
into its own part file ``NAME.rank-R-of-W.jsonl``, the same chunks with the same seeds, so the parts' rows are the
rows one process writes. Rank 0 then merges them in chunk order into ``NAME.jsonl`` (+ its meta, complete) and
removes the parts. A killed rank's part continues like any samples file; parts of another world size are not
reused (their rows are sampled again, the same), and are removed with the others once the merge is done.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from prefpack.generation.engine import GenerationError
from prefpack.generation.samples import _write_json, meta_path, samples_record


def part_path(output: str | Path, rank: int, world: int) -> Path:
    """``round/samples.jsonl`` -> ``round/samples.rank-1-of-2.jsonl``: rank 1's part of two."""
    p = Path(output)
    return p.with_name(f"{p.name.removesuffix('.jsonl')}.rank-{rank}-of-{world}.jsonl")


def part_files(output: str | Path) -> list[Path]:
    """Every part file of ``output`` and its meta, of any world size."""
    p = Path(output)
    stem = p.name.removesuffix(".jsonl")
    return sorted(p.parent.glob(f"{stem}.rank-*-of-*.jsonl")) + sorted(p.parent.glob(f"{stem}.rank-*-of-*.meta.json"))


def merge_parts(output: str | Path, world: int, batch_prompts: int) -> dict:
    """Rank 0, once every rank finished its part: the parts' lines in chunk order into ``output``, its meta (rank 0's
    part's, with the counts summed) marked complete last; returns that meta. The parts are removed."""
    output = Path(output)
    parts = [part_path(output, r, world) for r in range(world)]
    metas = []
    for part in parts:
        meta = json.loads(meta_path(part).read_text(encoding="utf-8")) if meta_path(part).is_file() else {}
        if not meta.get("complete"):
            raise GenerationError(f"{part}: this rank's part of the samples is not complete; run again with --resume")
        metas.append(meta)
    counts = {k: sum(int(m["counts"][k]) for m in metas) for k in ("prompts", "samples", "truncated")}
    merged = dict(metas[0], complete=False)
    merged.pop("counts", None)
    if all(isinstance(m.get("samples"), dict) for m in metas):  # the merged file's own record, as one process writes
        merged["samples"] = samples_record(output, sum(int(m["samples"]["expected_rows"]) for m in metas))
    else:  # parts an older prefpack began
        merged.pop("samples", None)
    _write_json(meta_path(output), merged)  # incomplete first: a kill before the end leaves a file that continues
    tmp = output.with_name(output.name + ".tmp")
    handles = [open(part, "rb") for part in parts]
    sha = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            lines, rank, live = 0, 0, world
            while live:  # chunk k is rank k % world's: batch_prompts lines each, only the source's last chunk short
                taken = 0
                for line in handles[rank]:
                    out.write(line)
                    sha.update(line)
                    taken += 1
                    if taken == batch_prompts:
                        break
                lines += taken
                live = live - 1 if taken < batch_prompts else world
                rank = (rank + 1) % world
    finally:
        for fh in handles:
            fh.close()
    if lines != counts["prompts"]:
        raise GenerationError(f"{output}: the parts hold {lines} rows, their metas count {counts['prompts']}")
    os.replace(tmp, output)
    if "samples" in merged:
        merged["samples"].update(rows=lines, sha256=sha.hexdigest())
    merged.update(complete=True, counts=counts)
    _write_json(meta_path(output), merged)
    for path in part_files(output):
        path.unlink(missing_ok=True)
    return merged
