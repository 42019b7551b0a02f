"""Mamba-2 mixers (a selective state space with a short causal convolution): Nemotron-H, Granite-4 hybrid
(GraniteMoeHybrid), Bamba. On CUDA their kernels are ``mamba_ssm``'s chunked scan and
``causal_conv1d``, both taking ``seq_idx``; transformers' CPU fallbacks do not."""

from prefpack.model.recurrent.kind import LayerKind

KIND = LayerKind(
    name="mamba2",
    classes=("NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer", "BambaMixer"),
    families=("nemotron_h", "granitemoehybrid", "bamba"),
    packages=("mamba_ssm", "causal_conv1d"),
    boundary_keywords=lambda layout: {"seq_idx": layout.seq_idx},
)
