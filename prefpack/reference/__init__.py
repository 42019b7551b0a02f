"""Reference log-probs: a frozen copy, the policy with its adapter off, a precomputed sidecar, or none.

The reference never runs under autograd. A sidecar beside the store holds the reference's sum of every sequence by
its key (and, for pairs, LD-DPO's sums past the shorter completion, so one sidecar serves every `loss.ld_alpha`),
tagged with the store's content hash and the reference weights' hash, so training refuses a sidecar computed for
other data or another model. `prefpack precompute-ref` writes it (`prefpack.training.precompute`).
"""

from __future__ import annotations

from prefpack.lazy import lazy_exports

# Loaded on first use (prefpack.lazy): the config reads a torch-free name table from this package.
_EXPORTS = {
    "AdapterReference": "prefpack.reference.modes",
    "CopyReference": "prefpack.reference.modes",
    "KTO_SIDECAR_NAME": "prefpack.reference.sidecar",
    "KeyedLogps": "prefpack.reference.sidecar",
    "KeySpace": "prefpack.reference.sidecar",
    "SIDECAR_NAMES": "prefpack.reference.sidecar",
    "partners_tag": "prefpack.reference.sidecar",
    "read_keyed_sidecar": "prefpack.reference.sidecar",
    "sidecar_path": "prefpack.reference.sidecar",
    "write_keyed_sidecar": "prefpack.reference.sidecar",
    "existing_sidecar": "prefpack.reference.sidecar",
    "check_sidecar_writable": "prefpack.reference.sidecar",
    "SidecarWriteError": "prefpack.reference.sidecar",
    "NoReference": "prefpack.reference.modes",
    "PrecomputedReference": "prefpack.reference.modes",
    "REFERENCE_MODES": "prefpack.reference.modes",
    "Reference": "prefpack.reference.modes",
    "ReferenceMismatch": "prefpack.reference.sidecar",
    "ReferenceSetup": "prefpack.reference.modes",
    "SIDECAR_FORMAT": "prefpack.reference.sidecar",
    "SIDECAR_NAME": "prefpack.reference.sidecar",
    "RANKED_SIDECAR_NAME": "prefpack.reference.sidecar",
    "as_sequence_output": "prefpack.reference.modes",
    "make_reference": "prefpack.reference.modes",
    "store_hash": "prefpack.reference.sidecar",
    "sync_reference": "prefpack.reference.sync",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
