"""Activation offloading: what a forward saves for backward waits in host memory, and comes back when backward reads it.

Why: without gradient checkpointing a decoder keeps every layer's activations on the device from forward to backward,
most of a step's memory at long rows; with checkpointing it still keeps each layer's input. Parity with TRL 1.16's
``activation_offloading`` (its DPO, KTO and reward trainers), written here from torch's documented mechanism.

How: :func:`torch.autograd.graph.saved_tensors_hooks`. ``pack`` gets each tensor an op saves; an activation (a plain
tensor of at least ``min_bytes`` on the device, not a parameter, not a leaf that requires grad, not a view or cast of
a weight: those stay on the device anyway) is copied to pinned host memory on a side stream, and the device copy is
released once the copy is done (a tensor several ops save, as the input of q, k and v projections, is sent once;
under autocast each projection saves its own cast of it, sent each). ``unpack`` (in backward) waits for that copy and
brings the tensor back, same dtype, shape and strides, on the stream backward runs on. Nothing else changes: gradients
are bitwise those without it. The hooks run outside torch.compile (compiled layers call them; they are not traced).

On a CPU device nothing moves (the activations already are in host memory): the hooks still run and count, which is
what CPU tests check; ``copy_on_host=True`` makes pack store a copy, so a test sees a real round trip.

Composes with non-reentrant gradient checkpointing: inside a checkpointed block torch's own hooks win (nothing is
saved, it recomputes), and the block's inputs, which torch saves outside its hooks, are offloaded by these.

Unmeasured here (no GPU): backward brings tensors back when it reads them, without prefetching one layer ahead, so a
GPU run trades step time for memory; how much is for a GPU benchmark to say.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MIN_BYTES", "TOTALS", "OffloadCounts", "offload_saved_tensors", "offloading_device",
           "set_activation_offloading"]

MIN_BYTES = 64 * 1024  # smaller tensors cost more in copies and events than they free
MAX_IN_FLIGHT = 8  # device copies waiting for their host copy before forward waits for the oldest
# grad_fn nodes a weight passes through before an op saves it (autocast's cast, the transpose of a linear, views)
_WEIGHT_PATH = frozenset({"TBackward0", "ToCopyBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
                          "ExpandBackward0", "UnsafeViewBackward0", "AliasBackward0", "UnsqueezeBackward0",
                          "SqueezeBackward0", "SqueezeBackward1"})
_ATTR = "_prefpack_offload_activations"


@dataclass
class OffloadCounts:
    """Tensors sent to host memory (``offloaded``, ``bytes``), brought back at least once (``restored``), saves of a
    tensor already sent (``shared``: one copy serves them all, e.g. the input of q, k and v projections), and saved
    tensors left where they were (``kept``: small ones, weights, other devices)."""

    offloaded: int = 0
    restored: int = 0
    bytes: int = 0
    shared: int = 0
    kept: int = 0



TOTALS = OffloadCounts()  # over every offloading context of the process (tests and logs read it)


def set_activation_offloading(model: nn.Module, device: torch.device | None) -> None:
    """Mark ``model``'s training forward (``SequenceLogps``) to offload its saved activations from ``device`` (None:
    not). The engine's choice, read where the forward runs, as ``prefpack.precision`` records the compute dtype."""
    setattr(model, _ATTR, None if device is None else torch.device(device))


def offloading_device(model: nn.Module) -> torch.device | None:
    """The device ``model``'s forward offloads activations from, or None."""
    return getattr(model, _ATTR, None)


class _Saved:
    """One offloaded tensor: its host copy, the device it returns to, the event its copy out recorded."""

    __slots__ = ("device", "event", "restored", "tensor")

    def __init__(self, tensor: torch.Tensor, device: torch.device, event) -> None:
        self.tensor, self.device, self.event, self.restored = tensor, device, event, False


def _weight_derived(t: torch.Tensor) -> bool:
    """A parameter seen through a view or a cast (what linear and autocast save): it stays on the device anyway."""
    if isinstance(t._base, nn.Parameter):
        return True
    fn = t.grad_fn
    if fn is None:
        return t.requires_grad  # a leaf that requires grad: an input the caller holds
    for _ in range(4):
        name = type(fn).__name__
        if name == "AccumulateGrad":
            return True
        nexts = [f for f, _ in fn.next_functions if f is not None]
        if name not in _WEIGHT_PATH or len(nexts) != 1:
            return False
        fn = nexts[0]
    return False


class _Offloader:
    def __init__(self, device: torch.device, min_bytes: int, copy_on_host: bool, counts: OffloadCounts) -> None:
        self.device, self.min_bytes, self.copy_on_host, self.counts = device, min_bytes, copy_on_host, counts
        self.cuda = device.type == "cuda"
        self.stream = _side_stream(device) if self.cuda else None
        self.in_flight: deque = deque()  # (device tensor, event): released once the compute stream waited for it
        self.sent: dict[int, tuple[weakref.ref, int, _Saved]] = {}  # id(tensor) -> (the tensor, its version, copy)

    def wanted(self, t: torch.Tensor) -> bool:
        return (type(t) is torch.Tensor and t.layout == torch.strided and t.device == self.device
                and t.numel() * t.element_size() >= self.min_bytes and not _weight_derived(t))

    def count(self, **added: int) -> None:
        for counts in (self.counts, TOTALS):
            for name, n in added.items():
                setattr(counts, name, getattr(counts, name) + n)

    def pack(self, t: torch.Tensor):
        if not self.wanted(t):
            self.count(kept=1)
            return t
        known = self.sent.get(id(t))
        if known is not None and known[0]() is t and known[1] == t._version:
            self.count(shared=1)
            return known[2]
        self.count(offloaded=1, bytes=t.numel() * t.element_size())
        saved = self.send(t)
        self.sent[id(t)] = (weakref.ref(t), t._version, saved)
        return saved

    def send(self, t: torch.Tensor) -> _Saved:
        if not self.cuda:
            return _Saved(t.clone() if self.copy_on_host else t, t.device, None)
        host = torch.empty_like(t, device="cpu", pin_memory=True)  # same strides where t is dense
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # t is written
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            event = self.stream.record_event()
        self.in_flight.append((t, event))
        if len(self.in_flight) > MAX_IN_FLIGHT:
            self.release_oldest()
        return _Saved(host, t.device, event)

    def release_oldest(self) -> None:
        # the compute stream waits for the copy out; only then may the allocator hand t's memory to later kernels
        t, event = self.in_flight.popleft()
        torch.cuda.current_stream(self.device).wait_event(event)
        del t

    def close(self) -> None:
        self.sent.clear()
        while self.in_flight:
            self.release_oldest()

    def unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        if not saved.restored:
            saved.restored = True
            self.count(restored=1)
        if saved.event is None:
            return saved.tensor
        stream = torch.cuda.current_stream(saved.device)  # the stream backward runs this node on
        stream.wait_event(saved.event)
        return saved.tensor.to(saved.device, non_blocking=True)  # pinned: asynchronous; same strides


_STREAMS: dict[torch.device, object] = {}


def _side_stream(device: torch.device):
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


@contextlib.contextmanager
def offload_saved_tensors(device: torch.device | str, *, min_bytes: int = MIN_BYTES,
                          copy_on_host: bool = False) -> Iterator[OffloadCounts]:
    """Within the block, activations saved for backward on ``device`` wait in host memory (see the module doc).

    Yields this block's :class:`OffloadCounts` (``restored`` grows as backward runs, after the block); the process's
    :data:`TOTALS` get them too. ``device``: the device whose activations move (cuda: pinned host memory on a side
    stream; cpu: nothing moves, the hooks count). ``min_bytes``: smaller tensors stay. ``copy_on_host``: on a CPU
    device, store a copy (a test's round trip).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    counts = OffloadCounts()
    offloader = _Offloader(device, int(min_bytes), copy_on_host, counts)
    try:
        # torch.compile'd layers call the hooks from their compiled autograd functions while dynamo's frame hook is
        # set: without ``disable`` it would compile the hooks themselves, recompiling as the counts change
        with torch.autograd.graph.saved_tensors_hooks(torch.compiler.disable(offloader.pack),
                                                      torch.compiler.disable(offloader.unpack)):
            yield counts
    finally:
        offloader.close()

