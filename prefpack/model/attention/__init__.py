"""The attention registry: the kernels prefpack adds, each registered through transformers' ``AttentionInterface``.

``packed_sdpa`` (CPU default): one causal sdpa call per packed sequence. ``varlen`` (CUDA default without the
flash-attn package): torch's flash varlen kernel reading sequence boundaries instead of a mask. Which one a run
uses is chosen in ``prefpack.model.load.pick_attention``.
"""
