"""prefpack: packed, completion-only preference optimisation for causal language models."""

__version__ = "0.1.0"
