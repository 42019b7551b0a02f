"""Kimi Delta Attention (KDA: a delta-rule state with a per-channel gate, after a short causal convolution):
Kimi-Linear. transformers' CPU fallbacks are plain torch; on CUDA it calls flash-linear-attention's ``chunk_kda``
and ``causal_conv1d`` with the layer's keywords, whose boundary names for this layer have not run on a GPU here,
so each block runs through the layer alone on every device (``run_blocks``: those kernels once per block)."""

from prefpack.model.recurrent.kind import LayerKind

KIND = LayerKind(
    name="kda",
    classes=("KimiLinearDeltaAttention",),
    families=("kimi_linear",),
    packages=(),
    boundary_keywords=None,
)
