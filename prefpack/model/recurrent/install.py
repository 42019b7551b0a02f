"""Install sequence boundaries in a model's recurrent layers, so packed sequences (and the completions of a prompt
laid out once) never carry a state into each other.

A packed forward reaches the layers as hooks see it: the body (the module holding the decoder layers) gets
``position_ids`` with ``attention_mask=None``; a pre-hook reads its blocks once (:func:`read_segments`, one host
transfer), a pre-hook on each decoder layer adds them to the layer's keywords (and the position ids to a layer that
does not take them, GraniteMoeHybrid's, so its attention reads them as the packed kernels do), and each recurrent
layer's forward, replaced on the instance, runs its blocks apart (``kind.run_blocks`` / ``run_gathered``). The
blocks travel as a keyword, inside the layer's call, so activation checkpointing replays them with the layer.
Anything else (a cache, a padding mask, one sequence per row) runs the layer's own forward unchanged.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types

import torch
from torch import nn

from prefpack.model.recurrent.kind import LayerKind, run_blocks, run_gathered
from prefpack.model.recurrent.layout import Segments, read_segments
from prefpack.model.recurrent.relay import HELD, relay
from prefpack.model.recurrent.table import kind_of, looks_recurrent

__all__ = ["KERNEL_DEVICES", "SEGMENTS", "has_recurrent_boundaries", "install_boundaries", "installed_kinds", "uncovered_layers"]

SEGMENTS = "prefpack_segments"  # the layer keyword carrying a packed forward's blocks
# Device types whose hidden states take the boundary-aware kernels (one gathered call, ``run_gathered``) when the
# kind's packages import. A test adds "cpu", with stand-ins of the packages, to run that wiring where no GPU is.
KERNEL_DEVICES = ("cuda",)
_MARK = "_prefpack_recurrent_kind"  # on a recurrent layer whose forward keeps boundaries: its LayerKind


class _Current:
    """The blocks and position ids of the body's forward in progress (None outside a packed forward)."""

    def __init__(self) -> None:
        self.value: tuple[Segments, torch.Tensor] | None = None


def install_boundaries(model: nn.Module) -> list[str]:
    """Keep every recurrent layer of ``model`` that prefpack knows (``table.KINDS``) within sequence boundaries;
    returns the names of the kinds it holds (empty: none). Idempotent. Uncovered recurrent layers are left as they
    are, for the load-time leak guard to refuse."""
    parents = {child: parent for parent in model.modules() for child in parent.children()}
    kinds: dict[str, LayerKind] = {}
    bodies: dict[int, tuple[nn.Module, nn.ModuleList]] = {}
    for module in list(model.modules()):
        kind = kind_of(module)
        if kind is None or module.__dict__.get(_MARK) is not None:
            continue
        layer = parents.get(module)
        listed = layer if isinstance(parents.get(layer), nn.ModuleList) else parents.get(layer)  # Zamba2: a hybrid
        layers = parents.get(listed)  # layer holds the decoder layer (both hand their keywords on)
        body = parents.get(layers)
        if layer is None or not isinstance(layers, nn.ModuleList) or body is None:
            continue  # not inside a list of decoder layers: nothing reaches it with the blocks
        kinds[kind.name] = kind
        setattr(module, _MARK, kind)
        module.forward = types.MethodType(_boundary_forward, module)
        if kind.relayed:  # its decoder layer keeps its keywords to itself (relay.py)
            relay(layer, SEGMENTS, _MARK)
        bodies[id(body)] = body, layers
    for body, layers in bodies.values():  # once every layer is marked: the hooks read which layers are recurrent
        _hook_body(body, layers)
    return sorted(kinds)


def has_recurrent_boundaries(module: nn.Module) -> bool:
    """Whether ``module`` holds recurrent layers kept within boundaries (token shards cannot run them)."""
    return any(m.__dict__.get("_prefpack_current") is not None for m in module.modules())


def installed_kinds(model: nn.Module) -> list[str]:
    return sorted({m.__dict__[_MARK].name for m in model.modules() if m.__dict__.get(_MARK) is not None})


def uncovered_layers(model: nn.Module) -> list[str]:
    """Class names of the layers that look recurrent and keep no boundaries (for a refusal to name)."""
    names = {type(m).__name__ for m in model.modules()
             if m.__dict__.get(_MARK) is None and kind_of(m) is None and looks_recurrent(m)}
    return sorted(names)


def _hook_body(body: nn.Module, layers: nn.ModuleList) -> None:
    if body.__dict__.get("_prefpack_current") is not None:
        return
    current = _Current()
    body._prefpack_current = current

    def read(module, args, kwargs):
        current.value = _packed_blocks(kwargs)

    def done(module, args, kwargs, output):
        current.value = None

    body.register_forward_pre_hook(read, with_kwargs=True)
    body.register_forward_hook(done, with_kwargs=True)
    for layer in layers:
        recurrent = any(m.__dict__.get(_MARK) is not None for m in layer.modules())
        takes_positions = "position_ids" in inspect.signature(layer.forward).parameters
        layer.register_forward_pre_hook(_layer_hook(current, recurrent, takes_positions), with_kwargs=True)


def _packed_blocks(kwargs: dict) -> tuple[Segments, torch.Tensor] | None:
    """The blocks of a packed forward, None for any other (no position ids, a padding mask, a cache, or one
    sequence per row: the layers' own forward is right and faster there)."""
    positions = kwargs.get("position_ids")
    if positions is None or kwargs.get("attention_mask") is not None or kwargs.get("past_key_values") is not None \
            or kwargs.get("use_cache"):
        return None
    if positions.ndim == 3:  # [4, B, L] (text row first) of the Qwen-VL families' 3-D rotary positions
        positions = positions[0]
    positions = positions.reshape(-1, positions.shape[-1])
    segments = read_segments(positions)
    if len(segments.pieces) == segments.rows and not segments.shares_prompts:
        return None
    return segments, positions


def _layer_hook(current: _Current, recurrent: bool, takes_positions: bool):
    def hook(module, args, kwargs):
        if current.value is None:
            return None
        segments, positions = current.value
        kwargs = dict(kwargs)
        if recurrent:
            kwargs[SEGMENTS] = segments
        if not takes_positions and kwargs.get("position_ids") is None:
            kwargs["position_ids"] = positions
        return args, kwargs

    return hook


def _boundary_forward(self: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """A recurrent layer's forward that keeps a packed forward's blocks apart (installed on the instance)."""
    segments = kwargs.pop(SEGMENTS, None) or self.__dict__.get(HELD)
    kind: LayerKind = self.__dict__[_MARK]
    if (segments is None or args or kwargs.get(kind.cache_keyword) is not None
            or kwargs.get("cache") is not None  # transformers >= 5.24 passes every kind's cache as ``cache``
            or kwargs.get("attention_mask") is not None):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    if segments.rows * segments.length != hidden_states.shape[0] * hidden_states.shape[1]:
        raise ValueError(f"{type(self).__name__}: {hidden_states.shape[0]} x {hidden_states.shape[1]} hidden states "
                         f"for a packed layout of {segments.rows} x {segments.length} positions")
    return _run(self, kind, hidden_states, segments)


def _run(layer: nn.Module, kind: LayerKind, hidden: torch.Tensor, segments: Segments) -> torch.Tensor:
    if "torch._dynamo" in sys.modules and torch.compiler.is_compiling():  # inside a compiled decoder layer
        return _eager_run()(layer, kind, hidden, segments)
    if hidden.device.type in KERNEL_DEVICES and _kernels(kind):
        return run_gathered(layer, kind, hidden, segments)
    return run_blocks(layer, hidden, segments)


@functools.cache
def _eager_run():
    """``_run`` kept out of a compiled graph (a loop over host-read blocks): made when first compiled, so a run
    that never compiles never imports the compiler."""
    return torch.compiler.disable(_run)


@functools.cache
def _kernels(kind: LayerKind) -> bool:
    return kind.kernels_installed()
