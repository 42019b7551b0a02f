"""Reference log-probs: a frozen copy, the policy with its adapter off, a precomputed sidecar, or none.

The reference never runs under autograd. The sidecar (`ref_logps.safetensors` beside the store) holds
one chosen and one rejected log-prob sum per pair (and, since LD-DPO, their sums past the shorter completion, so
one sidecar serves every `loss.ld_alpha`), tagged with the store's content hash and the
reference weights' hash, so training refuses a sidecar computed for other data or another model.
"""

from prefpack.reference.modes import (
    REFERENCE_MODES,
    AdapterReference,
    CopyReference,
    NoReference,
    PrecomputedReference,
    Reference,
    ReferenceSetup,
    make_reference,
)
from prefpack.reference.scoring import compute_kto_store_logps, compute_store_logps, iter_store_batches
from prefpack.reference.sidecar import (
    KTO_SIDECAR_NAME,
    SIDECAR_FORMAT,
    SIDECAR_NAME,
    ReferenceMismatch,
    read_kto_sidecar,
    read_sidecar,
    store_hash,
    write_kto_sidecar,
    write_sidecar,
)
from prefpack.reference.sync import sync_reference

__all__ = [
    "REFERENCE_MODES",
    "AdapterReference",
    "CopyReference",
    "KTO_SIDECAR_NAME",
    "NoReference",
    "PrecomputedReference",
    "SIDECAR_FORMAT",
    "SIDECAR_NAME",
    "Reference",
    "ReferenceMismatch",
    "ReferenceSetup",
    "compute_kto_store_logps",
    "compute_store_logps",
    "iter_store_batches",
    "make_reference",
    "read_kto_sidecar",
    "read_sidecar",
    "store_hash",
    "sync_reference",
    "write_kto_sidecar",
    "write_sidecar",
]
