"""Reference log-probs: a frozen copy, the policy with its adapter off, a precomputed sidecar, or none.

The reference never runs under autograd. The sidecar (`ref_logps.safetensors` beside the store) holds
one chosen and one rejected log-prob sum per pair (and, since LD-DPO, their sums past the shorter completion, so
one sidecar serves every `loss.ld_alpha`), tagged with the store's content hash and the
reference weights' hash, so training refuses a sidecar computed for other data or another model.
"""

from __future__ import annotations

from prefpack.lazy import lazy_exports

# Loaded on first use (prefpack.lazy): the config reads a torch-free name table from this package.
_EXPORTS = {
    "AdapterReference": "prefpack.reference.modes",
    "CopyReference": "prefpack.reference.modes",
    "KTO_SIDECAR_NAME": "prefpack.reference.sidecar",
    "KeyedLogps": "prefpack.reference.modes",
    "NoReference": "prefpack.reference.modes",
    "PrecomputedReference": "prefpack.reference.modes",
    "REFERENCE_MODES": "prefpack.reference.modes",
    "Reference": "prefpack.reference.modes",
    "ReferenceMismatch": "prefpack.reference.sidecar",
    "ReferenceSetup": "prefpack.reference.modes",
    "SIDECAR_FORMAT": "prefpack.reference.sidecar",
    "SIDECAR_NAME": "prefpack.reference.sidecar",
    "RANKED_SIDECAR_NAME": "prefpack.reference.sidecar",
    "compute_kto_store_logps": "prefpack.reference.scoring",
    "compute_pair_group_logps": "prefpack.reference.scoring_ranked",
    "compute_ranked_store_logps": "prefpack.reference.scoring_ranked",
    "compute_store_logps": "prefpack.reference.scoring",
    "iter_store_batches": "prefpack.reference.scoring",
    "as_sequence_output": "prefpack.reference.modes",
    "make_reference": "prefpack.reference.modes",
    "read_kto_sidecar": "prefpack.reference.sidecar",
    "read_ranked_sidecar": "prefpack.reference.sidecar",
    "read_sidecar": "prefpack.reference.sidecar",
    "store_hash": "prefpack.reference.sidecar",
    "sync_reference": "prefpack.reference.sync",
    "write_kto_sidecar": "prefpack.reference.sidecar",
    "write_ranked_sidecar": "prefpack.reference.sidecar",
    "write_sidecar": "prefpack.reference.sidecar",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
