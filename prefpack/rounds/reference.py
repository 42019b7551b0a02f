"""``reference.mode: precomputed`` in rounds: before a round trains, its pair store's reference log-probs are
computed (``prefpack precompute-ref``) with the weights ``rounds.reference`` names (``plan.reference_of``), and in
the first round the held-out stores' (``data.eval``: the initial reference serves every round). Training then reads
the sidecars, checked against the same weights' hash; no reference model is held while it trains."""

from __future__ import annotations

import time
from pathlib import Path

from prefpack.rounds import plan
from prefpack.rounds.metrics import PHASES_FILE, read_json, record_phase

PHASE = "reference"


def precompute_round_reference(cfg, run_dir: Path, r: int, log) -> None:
    """The round's sidecars, once (a resumed run finds the phase recorded and skips it)."""
    from prefpack.training.precompute import PrecomputeOptions, precompute_reference

    folder = plan.round_dir(run_dir, r)
    if PHASE in read_json(folder / PHASES_FILE):
        return
    t0 = time.perf_counter()
    model = plan.reference_of(cfg, run_dir, r)
    evals = cfg.data.eval if isinstance(cfg.data.eval, dict) else {"": cfg.data.eval} if cfg.data.eval else {}
    stores = [folder / "store", *(evals.values() if r == 0 else ())]
    for store in stores:
        report = precompute_reference(PrecomputeOptions(
            model=model, data=str(store), seed=cfg.train.seed, micro_batch_tokens=cfg.train.micro_batch_tokens,
            chunk_size=cfg.train.chunk_size, device=cfg.train.device, dtype=cfg.model.dtype,
            trust_remote_code=cfg.model.trust_remote_code), log=log, progress=False)
        log(f"round {r + 1}: reference log-probs of {store} computed with {model} ({report['sequences']} sequences)")
    record_phase(folder, PHASE, seconds=time.perf_counter() - t0)


def precompute_from_policy(cfg, run_dir: Path, r: int, policy, parallel, log) -> str:
    """``rounds.reference: round_start`` in one process: the round's sidecar computed with the policy in memory at the
    round's first step (what a training per round reads back from the last round's final model), once, every rank
    scoring its share with its whole copy (``parallel``; rank 0 writes); returns the weights hash it is tagged with,
    recorded with the phase (a resume mid-round reads it there)."""
    from prefpack.training.precompute import PrecomputeOptions, precompute_reference

    folder = plan.round_dir(run_dir, r)
    done = read_json(folder / PHASES_FILE).get(PHASE)
    if done:
        return done["reference_hash"]
    t0 = time.perf_counter()
    # named by the folder that holds the same weights (the last round's final model), where rounds keep one
    name = plan.policy_of(cfg, run_dir, r) if cfg.rounds.save_each_round else \
        f"the policy in memory at step {r * cfg.rounds.steps_per_round}"
    report = precompute_reference(PrecomputeOptions(
        model=name, data=str(folder / "store"), seed=cfg.train.seed,
        micro_batch_tokens=cfg.train.micro_batch_tokens, chunk_size=cfg.train.chunk_size, device=cfg.train.device,
        dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code), parallel=parallel, log=log,
        progress=False, model=policy)
    ctx = parallel.dist
    if ctx.is_main:
        log(f"round {r + 1}: reference log-probs of {folder / 'store'} computed with the policy in memory "
            f"({report['sequences']} sequences)")
        record_phase(folder, PHASE, seconds=time.perf_counter() - t0, reference_hash=report["reference_hash"])
    ctx.barrier()
    return read_json(folder / PHASES_FILE)[PHASE]["reference_hash"]
