"""The estimated peak memory of one device: the weights as a run holds them, their gradients and AdamW state, and the
activations of a micro-batch. ``auto`` budgets (``engine/budgets.py``) give activations what the rest leaves, and
``prefpack train`` prints the estimate before the first step.

Why an estimate from sizes rather than a measurement: the budgets are chosen before anything trains, and the
weights may not be on the device yet (CPU offload keeps them in host memory; FSDP2 has not sharded them). What it
counts, per device:

- weights: every parameter's bytes as held (a bitsandbytes 4-bit weight: its packed bytes, half a byte a weight,
  plus its quantisation state, which FSDP2 leaves whole on every rank), of the policy and a reference copy; under autocast the compute-dtype copies of the
  trained float32 weights that backward keeps. Under FSDP2 over several ranks, a 1/world shard of each (none with
  ``distributed.cpu_offload``: the shards live in host memory) plus the unsharded layers in flight: the root group
  (embeddings, head, final norm; FSDP2 keeps it gathered from forward to backward) and two decoder layers (the one
  computing and the one prefetched). Buffers (rotary tables) are not counted.
- gradients: the trained weights' bytes (1/world of them under FSDP2; one layer's in flight with CPU offload).
- optimizer state: AdamW's two moments, twice the trained weights' bytes (1/world; none on the device with CPU
  offload, where the optimizer steps on the CPU).
- activations: ``activation_bytes_per_token`` at the micro-batch (two layers' worth per token with activation
  offloading), plus the head's chunk of logits (8 bytes a logit at its peak in backward).

On a CPU device the host is the device: offloading moves nothing there, and the estimate counts it as not offloaded.
Not measured on a GPU yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Holding", "MemoryEstimate", "device_bytes", "estimate_memory", "static_bytes", "tensor_bytes"]

HEAD_BYTES_PER_LOGIT = 8  # the float32 logits, turned in place into their gradient, and a compute-dtype copy


@dataclass(frozen=True)
class Holding:
    """How a run holds its weights on a device: the compute dtype and whether autocast casts to it, the number of
    ranks, FSDP2 sharding over them (``sharded``; ``cast_per_layer``: FSDP2's mixed precision gathers layers in the
    compute dtype), FSDP2 CPU offload, and whether anything trains (precompute-ref only scores)."""

    compute: torch.dtype = torch.float32
    autocast: bool = False
    world: int = 1
    sharded: bool = False
    cast_per_layer: bool = False
    cpu_offload: bool = False
    training: bool = True


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device, by part."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    micro_batch_tokens: int

    @property
    def static(self) -> int:
        """What the run holds whatever the micro-batch."""
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.static + self.activations

    def describe(self, device: torch.device) -> str:
        return (f"estimated peak per device ({device.type}; an estimate from the model's sizes, not a measurement): "
                f"weights {_gib(self.weights)}, gradients {_gib(self.grads)}, optimizer state "
                f"{_gib(self.optimizer)}, activations {_gib(self.activations)} at {self.micro_batch_tokens:,}-token "
                f"micro-batches, total {_gib(self.total)}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def _quant_state_bytes(state) -> int:
    """A bitsandbytes ``QuantState``'s tensors (absmax, code, offset, and with double quantisation its own state)."""
    total = 0
    for value in vars(state).values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif type(value).__name__ == "QuantState":
            total += _quant_state_bytes(value)
    return total


def tensor_bytes(t: torch.Tensor) -> int:
    """A parameter's bytes as held; a 4-bit weight's quantisation state included."""
    quant = getattr(t, "quant_state", None)
    return t.numel() * t.element_size() + (_quant_state_bytes(quant) if quant is not None else 0)


def device_bytes(models, device: torch.device) -> int:
    """Bytes of the models' parameters now on ``device`` (what free memory already lacks)."""
    return sum(tensor_bytes(p) for m in models if m is not None for p in m.parameters()
               if p.device.type == device.type)


def _bytes(params, holding: Holding, *, gathered: bool = False) -> int:
    """The parameters' bytes; ``gathered``: as FSDP2's mixed precision gathers them (float weights in the compute
    dtype)."""
    total = 0
    for p in params:
        if gathered and holding.cast_per_layer and p.is_floating_point():
            total += p.numel() * min(p.element_size(), holding.compute.itemsize)
        else:
            total += tensor_bytes(p)
    return total


def _layers(model: nn.Module) -> list[nn.Module]:
    from prefpack.distributed import decoder_layers

    try:
        return decoder_layers(model)
    except ValueError:  # no layers to shard by: FSDP2 would refuse it; count the model as one group
        return []


def _held(model: nn.Module, holding: Holding, *, trained: bool) -> tuple[int, int]:
    """``(weights, gradients)`` one model keeps on the device; ``trained``: its trained weights have gradients."""
    params = list(model.parameters())
    grads = [p for p in params if p.requires_grad] if trained and holding.training else []
    if not (holding.sharded and holding.world > 1):
        copies = sum(p.numel() * holding.compute.itemsize for p in grads if holding.autocast
                     and p.is_floating_point() and p.element_size() > holding.compute.itemsize)
        return _bytes(params, holding) + copies, _bytes(grads, holding)
    layers = _layers(model)
    in_layer = {id(p) for layer in layers for p in layer.parameters()}
    root = [p for p in params if id(p) not in in_layer]
    biggest = max(layers, key=lambda m: _bytes(m.parameters(), holding, gathered=True), default=None)
    layer_params = list(biggest.parameters()) if biggest is not None else []
    in_flight = _bytes(root, holding, gathered=True) + 2 * _bytes(layer_params, holding, gathered=True)
    layer_grads = _bytes([p for p in layer_params if p.requires_grad], holding) if grads else 0
    if holding.cpu_offload:
        return in_flight, layer_grads
    quant = sum(tensor_bytes(p) - p.numel() * p.element_size() for p in params)  # whole on every rank, not sharded
    shards = (_bytes(params, holding) - quant) // holding.world + quant
    return shards + in_flight, _bytes(grads, holding) // holding.world + layer_grads


def static_bytes(policy: nn.Module, reference: nn.Module | None, holding: Holding) -> tuple[int, int, int]:
    """``(weights, gradients, optimizer state)`` on one device for the policy (trained) and a frozen reference copy."""
    weights, grads = _held(policy, holding, trained=True)
    if reference is not None:
        weights += _held(reference, holding, trained=False)[0]
    trained = [p for p in policy.parameters() if p.requires_grad] if holding.training else []
    optimizer = 0 if holding.cpu_offload and holding.sharded else 2 * _bytes(trained, holding)
    if holding.sharded and holding.world > 1:
        optimizer //= holding.world
    return weights, grads, optimizer


def estimate_memory(policy: nn.Module, reference: nn.Module | None, holding: Holding, *, activation_per_token: int,
                    micro_batch_tokens: int, chunk_size: int) -> MemoryEstimate:
    """The estimated peak of one device at this micro-batch and head chunk (see the module doc)."""
    weights, grads, optimizer = static_bytes(policy, reference, holding)
    from prefpack.model.head import is_reward_model

    # a reward model's head is one number per sequence: no chunk of vocabulary logits is ever made
    vocab = 0 if is_reward_model(policy) else int(policy.get_input_embeddings().weight.shape[0])
    activations = activation_per_token * micro_batch_tokens + chunk_size * vocab * HEAD_BYTES_PER_LOGIT
    return MemoryEstimate(weights, grads, optimizer, activations, micro_batch_tokens)
