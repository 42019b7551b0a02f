"""Mamba-1 mixers (a selective scan over a per-channel state, after a short causal convolution): Jamba, Mamba,
Falcon-Mamba. mamba_ssm's ``selective_scan_fn`` and ``mamba_inner_fn`` take no sequence boundaries (no
``seq_idx``, no ``cu_seqlens``), so on every device each block runs through the layer alone (``run_blocks``; on
CUDA that loop calls the layer's own kernels once per block). Their decoder layers call the mixer without their
keywords, hence ``relayed``."""

from prefpack.model.recurrent.kind import LayerKind

KIND = LayerKind(
    name="mamba1",
    classes=("JambaMambaMixer", "MambaMixer", "FalconMambaMixer"),
    families=("jamba", "mamba", "falcon_mamba"),
    packages=(),
    boundary_keywords=None,
    relayed=True,
)
