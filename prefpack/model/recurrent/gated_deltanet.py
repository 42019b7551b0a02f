"""Gated DeltaNet (linear attention with a delta-rule state and a short causal convolution): Qwen3.5, Qwen3-Next,
OLMo-hybrid, Lara-4-Mini (transformers 5.24). On CUDA its kernels are flash-linear-attention's chunked delta rule
(``cu_seqlens``) and ``causal_conv1d`` (``seq_idx``); transformers' CPU fallbacks read neither."""

from prefpack.model.recurrent.kind import LayerKind

KIND = LayerKind(
    name="gated_deltanet",
    classes=("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet", "OlmoHybridGatedDeltaNet",
             "LaraMiniGatedDeltaNet"),
    families=("qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "lara_mini"),
    packages=("fla", "causal_conv1d"),
    boundary_keywords=lambda layout: {"cu_seq_lens_q": layout.cu_seqlens, "seq_idx": layout.seq_idx},
)
