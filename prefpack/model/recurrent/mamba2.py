"""Mamba-2 mixers (a selective state space with a short causal convolution): Nemotron-H, Granite-4 hybrid
(GraniteMoeHybrid), Bamba, Mamba-2, Falcon-H1 (its heads beside attention in every layer),
Zamba2 (a shared attention block wraps some of its Mamba layers). On CUDA their kernels are ``mamba_ssm``'s chunked scan and
``causal_conv1d``, both taking ``seq_idx``; transformers' CPU fallbacks do not."""

from prefpack.model.recurrent.kind import LayerKind

KIND = LayerKind(
    name="mamba2",
    classes=("NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer", "BambaMixer", "Mamba2Mixer", "FalconH1Mixer",
             "Zamba2MambaMixer"),
    families=("nemotron_h", "granitemoehybrid", "bamba", "mamba2", "falcon_h1", "zamba2"),
    packages=("mamba_ssm", "causal_conv1d"),
    boundary_keywords=lambda layout: {"seq_idx": layout.seq_idx},
)
