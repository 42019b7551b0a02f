"""Reference log-probs precomputed once per store ("sidecars" beside the store), so a run can train without a
reference model in memory.

Pair sidecar (``ref_logps.safetensors``): one chosen and one rejected log-prob sum per pair, and (since LD-DPO)
their sums past the shorter completion, so one sidecar serves every ``loss.ld_alpha``. KTO sidecar
(``ref_logps_kto.safetensors``): every example's completion and its fixed KL sequence, with the pairing's seed.
Ranked sidecar (``ref_logps_ranked.safetensors``): every completion of a ranked store once, whatever pairs it
joins. All are tagged with the store's content hash and the reference weights' hash, written atomically (temporary
name, then rename), and read through one check (:func:`_open`), so training refuses a sidecar computed for other
data or another model, by name and with the command that fixes it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from prefpack.data.store import Store
from prefpack.data.views import UnpairedView
from prefpack.errors import PrefpackError

__all__ = ["KTO_SIDECAR_NAME", "RANKED_SIDECAR_NAME", "SIDECAR_FORMAT", "SIDECAR_NAME", "ReferenceMismatch",
           "read_kto_sidecar", "read_ranked_sidecar", "read_sidecar", "store_hash", "write_kto_sidecar",
           "write_ranked_sidecar", "write_sidecar"]

SIDECAR_NAME = "ref_logps.safetensors"
SIDECAR_FORMAT = "prefpack-ref-logps"
SIDECAR_VERSION = "1"
KTO_SIDECAR_NAME = "ref_logps_kto.safetensors"
KTO_SIDECAR_VERSION = "1"
RANKED_SIDECAR_NAME = "ref_logps_ranked.safetensors"
RANKED_SIDECAR_VERSION = "1"


class ReferenceMismatch(PrefpackError, ValueError):
    """A sidecar that is missing, corrupt or does not match the store or the reference model."""


def store_hash(store: Store) -> str:
    files = store.meta.get("files", {})
    return f"{files.get('tokens.bin', {}).get('sha256', '')}:{files.get('index.bin', {}).get('sha256', '')}"


def _write(path: str | Path, tensors: dict[str, np.ndarray], meta: dict[str, str]) -> Path:
    """Write a safetensors file atomically: a temporary name in the same folder, then a rename."""
    from safetensors.numpy import save_file

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return path


def _open(path: Path, store: Store, *, what: str, required: tuple[str, ...], optional: tuple[str, ...] = (),
          version: str, rows: int, missing: str, kind: str | None = None,
          reference_hash: str | None) -> tuple[dict[str, np.ndarray | None], dict[str, str]]:
    """The checks every sidecar passes: it exists, reads, is ours in this version (and kind), holds ``rows`` values
    per tensor for this store's content and, when ``reference_hash`` is given, these reference weights."""
    from safetensors import safe_open

    if not path.is_file():
        raise ReferenceMismatch(f"no precomputed {what} at {str(path)!r}; run `{missing}` first")
    try:
        with safe_open(str(path), framework="numpy") as fh:
            meta = fh.metadata() or {}
            names = set(fh.keys())
            table = {k: fh.get_tensor(k) for k in required}
            table.update({k: fh.get_tensor(k) if k in names else None for k in optional})
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise ReferenceMismatch(f"{path}: cannot read {what} ({exc})") from exc
    if meta.get("format") != SIDECAR_FORMAT or meta.get("version") != version or \
            (kind is not None and meta.get("kind") != kind):
        label = {"unpaired": "KTO reference sidecar", "ranked": "ranked reference sidecar"}.get(kind,
                                                                                                "reference sidecar")
        raise ReferenceMismatch(f"{path}: not a prefpack {label} of version {version}")
    if meta.get("store_hash") != store_hash(store) or any(len(table[k]) != rows for k in required):
        raise ReferenceMismatch(f"{path} was computed for other data than the store {str(store.path)!r}; run "
                                "precompute-ref again on this store")
    if reference_hash is not None and meta.get("reference_hash") != reference_hash:
        raise ReferenceMismatch(
            f"{path} was computed with other reference weights ({meta.get('reference')!r}) than this run's "
            "reference; run precompute-ref again with the reference model of this run")
    return table, meta


# ------------------------------------------------------------------------------------------------ pairs


def write_sidecar(path: str | Path, store: Store, chosen: np.ndarray, rejected: np.ndarray, *,
                  reference_hash: str, reference_name: str, chosen_tail: np.ndarray | None = None,
                  rejected_tail: np.ndarray | None = None) -> Path:
    """Write a pair store's sidecar; the tails are optional (LD-DPO)."""
    meta = {"format": SIDECAR_FORMAT, "version": SIDECAR_VERSION, "store_hash": store_hash(store),
            "reference_hash": reference_hash, "reference": reference_name, "pairs": str(len(store))}
    tensors = {"chosen": chosen, "rejected": rejected, "chosen_tail": chosen_tail, "rejected_tail": rejected_tail}
    return _write(path, {k: np.ascontiguousarray(v, dtype=np.float64) for k, v in tensors.items() if v is not None},
                  meta)


def read_sidecar(path: str | Path, store: Store, *, reference_hash: str | None,
                 need_tails: bool = False) -> tuple[np.ndarray, ...]:
    """Load a sidecar as ``(chosen, rejected, chosen_tail, rejected_tail)``, refusing one made for another store or
    (when given) other reference weights; the tails are None in a sidecar written before LD-DPO (refused when
    ``need_tails``)."""
    path = Path(path)
    table, _ = _open(path, store, what="reference log-probs", required=("chosen", "rejected"),
                     optional=("chosen_tail", "rejected_tail"), version=SIDECAR_VERSION, rows=len(store),
                     missing=f"prefpack precompute-ref --model REF --data {store.path}", reference_hash=reference_hash)
    tails = (table["chosen_tail"], table["rejected_tail"])
    if any(t is not None and len(t) != len(store) for t in tails) or (tails[0] is None) != (tails[1] is None):
        raise ReferenceMismatch(f"{path}: its tail log-probs do not match its pairs; run precompute-ref again")
    if need_tails and tails[0] is None:
        raise ReferenceMismatch(f"{path} was written by an earlier prefpack without the log-probs past the shorter "
                                "completion that loss.ld_alpha (LD-DPO) needs; run precompute-ref again on this store")
    return table["chosen"], table["rejected"], *tails


# ------------------------------------------------------------------------------------------------ KTO


def write_kto_sidecar(path: str | Path, view: UnpairedView, arrays: dict[str, np.ndarray], *, seed: int,
                      reference_hash: str, reference_name: str) -> Path:
    """Write the KTO sidecar; tagged with the store's and the weights' hashes, the view and seed."""
    meta = {"format": SIDECAR_FORMAT, "version": KTO_SIDECAR_VERSION, "kind": "unpaired",
            "view": view.source, "store_hash": store_hash(view.store), "reference_hash": reference_hash,
            "reference": reference_name, "examples": str(len(view)), "kl_seed": str(int(seed))}
    tensors = {"completion": np.ascontiguousarray(arrays["completion"], dtype=np.float64),
               "kl": np.ascontiguousarray(arrays["kl"], dtype=np.float64),
               "kl_partner": np.ascontiguousarray(arrays["kl_partner"], dtype=np.int64)}
    return _write(path, tensors, meta)


def read_kto_sidecar(path: str | Path, view: UnpairedView, *, reference_hash: str | None,
                     partners: np.ndarray | None) -> dict[str, np.ndarray]:
    """Load a KTO sidecar, refusing one made for other data, another view, other reference weights or
    (when ``partners`` is given) another KL pairing."""
    path = Path(path)
    store = view.store
    kto_flag = " --kto" if view.paired else ""
    table, meta = _open(path, store, what="KTO reference log-probs", required=("completion", "kl", "kl_partner"),
                        version=KTO_SIDECAR_VERSION, kind="unpaired", rows=len(view),
                        missing=f"prefpack precompute-ref --model REF --data {store.path}{kto_flag}",
                        reference_hash=None)
    if meta.get("view") != view.source:
        raise ReferenceMismatch(f"{path} scores the store as {meta.get('view')!r} examples but this run reads it "
                                f"as {view.source!r}; run precompute-ref again{kto_flag}")
    if reference_hash is not None and meta.get("reference_hash") != reference_hash:
        raise ReferenceMismatch(
            f"{path} was computed with other reference weights ({meta.get('reference')!r}) than this run's "
            "reference; run precompute-ref again with the reference model of this run")
    if partners is not None:
        if not np.array_equal(table["kl_partner"], partners) or np.isnan(table["kl"]).any():
            raise ReferenceMismatch(
                f"{path} holds KL log-probs for the fixed pairing of seed {meta.get('kl_seed')}, not this run's "
                f"(train.seed); run `prefpack precompute-ref --model REF --data {store.path}{kto_flag} "
                "--seed TRAIN_SEED`")
    return table


# ------------------------------------------------------------------------------------------------ ranked


def write_ranked_sidecar(path: str | Path, store: Store, completion: np.ndarray, *, reference_hash: str,
                         reference_name: str) -> Path:
    """Write a ranked store's sidecar: one reference sum per completion (store row)."""
    meta = {"format": SIDECAR_FORMAT, "version": RANKED_SIDECAR_VERSION, "kind": "ranked",
            "store_hash": store_hash(store), "reference_hash": reference_hash, "reference": reference_name,
            "completions": str(len(store))}
    return _write(path, {"completion": np.ascontiguousarray(completion, dtype=np.float64)}, meta)


def read_ranked_sidecar(path: str | Path, store: Store, *, reference_hash: str | None) -> dict[str, np.ndarray]:
    """Load a ranked sidecar, refusing one made for other data or (when given) other reference weights."""
    table, _ = _open(Path(path), store, what="reference log-probs of the ranked completions", required=("completion",),
                     version=RANKED_SIDECAR_VERSION, kind="ranked", rows=len(store),
                     missing=f"prefpack precompute-ref --model REF --data {store.path}", reference_hash=reference_hash)
    return table
