"""The attention kernels: one descriptor row each in ``kernels.py`` (what a kernel needs and does; ``pick_attention``
reads it for ``auto``), and a module per kernel prefpack adds through transformers' ``AttentionInterface``.

``packed_sdpa`` (CPU default): one causal sdpa call per packed sequence. ``varlen`` (CUDA default without the
flash-attn package): torch's flash varlen kernel reading sequence boundaries instead of a mask.
"""
