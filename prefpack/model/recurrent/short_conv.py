"""Short gated convolutions (a causal depthwise convolution over the last few tokens): LFM2, LFM3. Its window would read
the tail of the previous packed sequence. On CUDA ``causal_conv1d`` takes ``seq_idx``."""

from prefpack.model.recurrent.kind import LayerKind

KIND = LayerKind(
    name="short_conv",
    classes=("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv"),
    families=("lfm2", "lfm2_moe", "lfm3"),
    packages=("causal_conv1d",),
    boundary_keywords=lambda layout: {"seq_idx": layout.seq_idx},
    cache_keyword="past_key_values",
)
