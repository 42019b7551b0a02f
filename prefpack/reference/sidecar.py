"""Reference log-probs precomputed once per store ("sidecars" beside the store), so a run can train without a
reference model in memory.

A sidecar is one table by sequence key (``Batch.sequence_keys``): ``logps[k]`` is the reference sum of sequence k,
and ``tails[k]`` (pair stores, for LD-DPO) its sum past the shorter completion of its pair, so one sidecar serves
every ``loss.ld_alpha``. A key no objective reads (a ranked prompt whose scores all tie, the KL sequence of a
one-example store) holds NaN. What the keys address is the objective's :class:`KeySpace`; each kind of key space
has its own file name, so a pair store may hold its pair sidecar and its KTO sidecar side by side.

Every sidecar is tagged with the store's content hash, the reference weights' hash and the key space's own tags
(KTO: the view and the KL pairing), written atomically (temporary name, then rename), and read through one check
(:func:`_open`), so training refuses a sidecar computed for other data, another model or another pairing, by name
and with the command that fixes it. Sidecars of format version 1 (one file layout per store kind) still read.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prefpack.data.store import Store
from prefpack.errors import PrefpackError
from prefpack.stale import apply_umask

__all__ = ["KTO_SIDECAR_NAME", "RANKED_SIDECAR_NAME", "SIDECAR_FORMAT", "SIDECAR_NAME", "SIDECAR_NAMES", "KeySpace",
           "KeyedLogps", "ReferenceMismatch", "existing_sidecar", "partners_tag", "read_keyed_sidecar", "sidecar_path", "store_hash",
           "write_keyed_sidecar"]

SIDECAR_NAME = "ref_logps.safetensors"
KTO_SIDECAR_NAME = "ref_logps_kto.safetensors"
RANKED_SIDECAR_NAME = "ref_logps_ranked.safetensors"
SIDECAR_NAMES = {"pairs": SIDECAR_NAME, "unpaired": KTO_SIDECAR_NAME, "ranked": RANKED_SIDECAR_NAME}
"""The file of each kind of key space (the names version 1 used, so an old sidecar is found where it was)."""
SIDECAR_FORMAT = "prefpack-ref-logps"
SIDECAR_VERSION = "2"
_LABELS = {"pairs": "reference sidecar", "unpaired": "KTO reference sidecar", "ranked": "ranked reference sidecar"}


class ReferenceMismatch(PrefpackError, ValueError):
    """A sidecar that is missing, corrupt or does not match the store or the reference model."""


@dataclass(frozen=True)
class KeyedLogps:
    """A store's reference sums by sequence key (``Batch.sequence_keys``), and LD-DPO's tails by the same keys
    (NaN: a key that was not scored)."""

    logps: np.ndarray
    tails: np.ndarray | None = None


@dataclass(frozen=True)
class KeySpace:
    """What an objective's sequence keys address: the table a sidecar of its store holds.

    ``kind`` names the file (:data:`SIDECAR_NAMES`); ``size`` keys 0..size-1; ``tails``: LD-DPO's tails are kept
    by the same keys; ``copies[k]``: the key whose sequence key k repeats (a completion a prompt group computes once
    for several pairs), so the table can be filled at every key; ``tags``: what else a sidecar must match (KTO's
    view and KL pairing); ``labels``: written beside the tags, never compared (what a refusal quotes: the KL seed);
    ``flags``: the precompute-ref flags that write this table (named in every refusal)."""

    kind: str
    size: int
    tails: bool = False
    copies: np.ndarray | None = None
    tags: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    flags: str = ""


def partners_tag(partners: np.ndarray) -> str:
    """A KL pairing as a tag: the hash of its partner ids (a sidecar's KL sums hold for exactly this pairing)."""
    return hashlib.sha256(np.ascontiguousarray(partners, dtype=np.int64).tobytes()).hexdigest()[:16]


def store_hash(store: Store) -> str:
    files = store.meta.get("files", {})
    return f"{files.get('tokens.bin', {}).get('sha256', '')}:{files.get('index.bin', {}).get('sha256', '')}"


def sidecar_path(store: Store, space: KeySpace) -> Path:
    return Path(store.path) / SIDECAR_NAMES[space.kind]


def _fix(store: Store, space: KeySpace) -> str:
    return f"prefpack precompute-ref --model REF --data {store.path}{space.flags}"


def _identity(store: Store, space: KeySpace, reference_hash: str, settings: str) -> dict[str, str]:
    """What makes two sidecars of a store the same table: format, key space and its tags, the store's content, the
    reference weights and the scoring settings (``settings``: precompute-ref's dtype and device)."""
    return {"format": SIDECAR_FORMAT, "version": SIDECAR_VERSION, "kind": space.kind, "keys": str(space.size),
            "store_hash": store_hash(store), "reference_hash": reference_hash, "settings": settings,
            "tails": "yes" if space.tails else "no", **{f"tag.{k}": v for k, v in {**space.labels, **space.tags}.items()}}


def write_keyed_sidecar(store: Store, space: KeySpace, table: KeyedLogps, *, reference_hash: str,
                        reference_name: str, settings: str = "") -> Path:
    """Write a store's table atomically (a temporary name in the same folder, then a rename)."""
    from safetensors.numpy import save_file

    meta = {**_identity(store, space, reference_hash, settings), "reference": reference_name}
    tensors = {"logps": table.logps} if table.tails is None else {"logps": table.logps, "tails": table.tails}
    path = sidecar_path(store, space)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file({k: np.ascontiguousarray(v, dtype=np.float64) for k, v in tensors.items()}, str(tmp), metadata=meta)
        apply_umask(tmp)  # safetensors creates its files 0600
        os.replace(tmp, path)
    except Exception as exc:  # safetensors' SafetensorError (an I/O error inside), PermissionError, a full disk
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise SidecarWriteError(_unwritable(store, path, f"{type(exc).__name__}: {exc}")) from None
    return path


def existing_sidecar(store: Store, space: KeySpace, *, reference_hash: str, settings: str) -> KeyedLogps | None:
    """The table already written for exactly this store, key space, reference weights and settings (what
    precompute-ref would write again), or None (none there, another one, or one that does not read)."""
    from safetensors import safe_open

    path = sidecar_path(store, space)
    if not path.is_file():
        return None
    want = _identity(store, space, reference_hash, settings)
    try:
        with safe_open(str(path), framework="numpy") as fh:
            meta = fh.metadata() or {}
            if any(meta.get(k) != v for k, v in want.items()):
                return None
            return KeyedLogps(fh.get_tensor("logps"), fh.get_tensor("tails") if space.tails else None)
    except Exception:  # a damaged file: written again
        return None


class SidecarWriteError(PrefpackError, OSError):
    """A store folder where the sidecar cannot be written (read-only, no permission, a full disk)."""


def _unwritable(store: Store, path: Path, why: str) -> str:
    return (f"cannot write the reference sidecar {path} ({why}): precompute-ref writes it inside the store folder "
            f"{store.path}, which is read-only, not yours to write, or on a full disk. Copy the store to a folder you "
            f"can write (`cp -r {store.path} NEW_STORE`) and run precompute-ref with --data NEW_STORE, or make the "
            "folder writable")


def check_sidecar_writable(store: Store) -> None:
    """Refuse at once, before any model is loaded, a store folder that the sidecar could not be written into."""
    if not os.access(store.path, os.W_OK):
        raise SidecarWriteError(_unwritable(store, Path(store.path) / "ref_logps*.safetensors", "no write permission"))


def read_keyed_sidecar(store: Store, space: KeySpace, *, reference_hash: str | None,
                       need_tails: bool = False) -> KeyedLogps:
    """A store's sidecar for ``space`` as a :class:`KeyedLogps`, refusing one made for other data, other reference
    weights (when ``reference_hash`` is given), another key space or its tags; ``need_tails`` (LD-DPO) refuses one
    without tails."""
    path = sidecar_path(store, space)
    tensors, meta = _open(path, store, space, reference_hash)
    if meta.get("version") == "1":
        table = _from_version_1(path, tensors, meta, store, space)
    else:
        if meta.get("keys") != str(space.size) or any(len(v) != space.size for v in tensors.values()):
            raise ReferenceMismatch(f"{path} holds {meta.get('keys')} sequences but this run's {space.kind} keys "
                                    f"number {space.size}; run `{_fix(store, space)}`")
        table = KeyedLogps(tensors["logps"], tensors.get("tails"))
    for name, want in space.tags.items():
        got = meta.get(f"tag.{name}")
        if got != want:
            raise ReferenceMismatch(_tag_mismatch(path, name, got, want, meta, store, space))
    if need_tails and table.tails is None:
        raise ReferenceMismatch(f"{path} holds no reference log-probs past the shorter completion of each pair, which "
                                f"loss.ld_alpha (LD-DPO) needs; run precompute-ref again: `{_fix(store, space)}`")
    return table


def _tag_mismatch(path: Path, name: str, got, want: str, meta: dict, store: Store, space: KeySpace) -> str:
    if name == "view":
        return (f"{path} scores the store as {got!r} examples but this run reads it as {want!r}; run "
                f"`{_fix(store, space)}`")
    if name == "kl_pairing":
        return (f"{path} holds KL log-probs for the fixed pairing of seed {meta.get('tag.kl_seed')}, not this run's "
                f"(train.seed); run `{_fix(store, space)}` with --seed TRAIN_SEED")
    return f"{path} was computed for {name}={got!r}, this run reads {name}={want!r}; run `{_fix(store, space)}`"


def _open(path: Path, store: Store, space: KeySpace,
          reference_hash: str | None) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The checks every sidecar passes: it exists, reads, is ours (a version this prefpack reads, of this kind of
    key space), was computed for this store's content and, when ``reference_hash`` is given, these weights."""
    from safetensors import safe_open

    if not path.is_file():
        raise ReferenceMismatch(f"no precomputed reference log-probs at {str(path)!r}; run `{_fix(store, space)}` "
                                "first")
    try:
        with safe_open(str(path), framework="numpy") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise ReferenceMismatch(f"{path}: cannot read reference log-probs ({exc})") from exc
    kind = meta.get("kind", "pairs")  # version 1 wrote no kind for pairs
    if meta.get("format") != SIDECAR_FORMAT or meta.get("version") not in ("1", SIDECAR_VERSION) or kind != space.kind:
        raise ReferenceMismatch(f"{path}: not a prefpack {_LABELS[space.kind]} this version reads; run precompute-ref "
                                f"again: `{_fix(store, space)}`")
    if meta.get("store_hash") != store_hash(store):
        raise ReferenceMismatch(f"{path} was computed for other data than the store {str(store.path)!r}; run "
                                "precompute-ref again on this store")
    if reference_hash is not None and meta.get("reference_hash") != reference_hash:
        raise ReferenceMismatch(
            f"{path} was computed with other reference weights ({meta.get('reference')!r}) than this run's "
            "reference; run precompute-ref again with the reference model of this run")
    return tensors, meta


def _from_version_1(path: Path, tensors: dict[str, np.ndarray], meta: dict[str, str], store: Store,
                    space: KeySpace) -> KeyedLogps:
    """A version-1 sidecar (one layout per store kind) as a keyed table; its KTO metadata becomes the tags."""
    def column(name: str, rows: int) -> np.ndarray:
        value = tensors.get(name)
        if value is None or len(value) != rows:
            raise ReferenceMismatch(f"{path} was computed for other data than the store {str(store.path)!r}; run "
                                    "precompute-ref again on this store")
        return np.asarray(value, dtype=np.float64)

    if space.kind == "pairs":
        n = space.size // 2
        logps = np.empty(space.size)
        logps[0::2], logps[1::2] = column("chosen", n), column("rejected", n)
        if "chosen_tail" not in tensors and "rejected_tail" not in tensors:
            return KeyedLogps(logps)  # written before LD-DPO
        tails = np.empty(space.size)
        tails[0::2], tails[1::2] = column("chosen_tail", n), column("rejected_tail", n)
        return KeyedLogps(logps, tails)
    if space.kind == "ranked":
        return KeyedLogps(column("completion", space.size))
    n = space.size // 2
    kl, partners = column("kl", n), tensors.get("kl_partner")
    meta["tag.view"] = meta.get("view", "")
    meta["tag.kl_seed"] = meta.get("kl_seed", "")
    if partners is not None and len(partners) == n and not np.isnan(kl).any():
        meta["tag.kl_pairing"] = partners_tag(partners)
    return KeyedLogps(np.concatenate([column("completion", n), kl]))
