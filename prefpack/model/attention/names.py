"""The attention choices a config may name, torch-free: ``auto`` and the rows of the kernel table (``kernels.py``,
which imports torch only when a rule runs)."""

from prefpack.model.attention.kernels import KERNELS

ATTENTION_CHOICES: tuple[str, ...] = ("auto", *(k.name for k in KERNELS))
