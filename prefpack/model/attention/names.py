"""The attention choices a config may name, torch-free: ``auto``, transformers' own kernels and the ones this folder
registers (``packed_sdpa.NAME``, ``varlen.NAME``; tests/test_layout.py checks they agree)."""

ATTENTION_CHOICES: tuple[str, ...] = ("auto", "sdpa", "packed_sdpa", "varlen", "eager", "flash_attention_2")
