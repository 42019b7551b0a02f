"""Recurrent layers (linear attention, state-space mixers, short convolutions) in packed forwards: each packed
sequence starts from a zero state, convolution window included, and a completion laid out after its shared prompt
starts from the prompt's final state. ``table``: the kinds covered, one module each (``gated_deltanet``, ``kda``,
``mamba1``, ``mamba2``, ``short_conv``); ``layout``: the blocks of a packed forward; ``kind``: how a layer runs them;
``install``: the hooks that bring the blocks to the layers (``relay``: through decoder layers that keep their
keywords)."""

from prefpack.model.recurrent.install import SEGMENTS, install_boundaries, installed_kinds, uncovered_layers
from prefpack.model.recurrent.table import KINDS, kind_of, packed_families

__all__ = ["KINDS", "SEGMENTS", "install_boundaries", "installed_kinds", "kind_of", "packed_families", "uncovered_layers"]
