"""Run a causal LM on a packed or padded micro-batch and return per-sequence log-prob sums.

Packed batches are passed with ``attention_mask=None``, ``position_ids`` restarting at 0 for every sequence
and ``use_cache=False``. transformers (5.23) then builds the attention from the position ids:

* sdpa / eager / flex: ``masking_utils.find_packed_sequence_indices`` cuts each row wherever consecutive
  position ids do not step by +1 and ANDs a per-row block-diagonal mask with the causal mask. It works per
  row, so batches of several rows are correct (measured here, sdpa and eager, see tests/test_packing.py).
  It is skipped when a cache is passed, hence ``use_cache=False`` (with a cache the second sequence of a
  row silently attends to the first).
* flash-attention 2/3: boundaries are read from position ids only when the batch has ONE row
  (``modeling_flash_attention_utils._is_packed_sequence`` requires batch size 1); with several rows it
  would run plain causal attention across sequences. So for kernels whose descriptor says ``flattens_rows``
  (flash implementations and prefpack's ``varlen``; ``flatten=None`` reads it) the micro-batch is flattened to one
  row ``[1, real tokens]``, dropping row padding. For a kernel with ``boundary_kwargs`` (``varlen``) the sequence
  boundaries (``cu_seq_lens_q``) are computed here, once per forward and on the host, and handed to every layer;
  for prompt-shared rows also the key boundaries (``cu_seq_lens_k``) and the key gather index
  (``varlen.KEY_INDEX``) that let a completion read its prompt. The descriptors: ``model/attention/kernels.py``.

Prompt-shared rows (``Batch.score_positions``) need a kernel that reads prompt groups from position ids
(:func:`reads_prompt_groups`: ``packed_sdpa``, ``varlen``); other flattening kernels (flash-attn) refuse them.

The model runs in its recorded compute dtype (``prefpack.precision``: autocast over float32 master weights).

Only hidden states whose next token is a completion token are gathered, before the LM head; the head
and log-softmax run chunked (``prefpack.model.logprobs``, with the head found by ``prefpack.model.head``).

MoE router load-balancing loss (``router_aux=True``, see :func:`router_aux_loss_coef`): ``model(...)`` adds it when
called with ``output_router_logits=True``; since the body is called directly here, the body is asked for its router
logits and the model's own ``load_balancing_loss_func`` (from its modeling module) is applied over the real tokens
only (row padding of a packed or padded batch is masked out). :func:`sequence_logps` then returns a third value,
the scalar aux loss.

Vision-language models (``prefpack.model.vision``: the Qwen2-VL / Qwen2.5-VL family and LLaVA): the body runs on
``inputs_embeds``, the embedded input ids with the batch's image features written at ``Batch.image_positions`` (the
vision tower called once per micro-batch, however many sequences show an image), and the Qwen2-VL family's body gets
position ids [4, B, L] (the 1-D text positions the kernels and masks read, then ``Batch.rope_positions``), on text
batches too: given 2-D ones it reads no sequence boundaries. Flattening kernels get both flattened with the token
mask. Text models take the plain path, unchanged. Images do not run on token shards (sequence parallelism).

What a forward returns is a :class:`SequenceOutput`; the optional fields are filled only when asked for, so a
plain forward costs nothing more: ``pair_tails`` (LD-DPO) and ``wpo`` (WPO weights) are read by pair losses.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
from torch import nn
from torch.profiler import record_function

from prefpack.batching.collate import Batch
from prefpack.model.attention.kernels import KERNELS, kernel_of, reads_prompt_groups, uses_flash_attention
from prefpack.model.head import body_and_head, head_spec
from prefpack.model.logprobs import DEFAULT_CHUNK_SIZE, completion_logprobs
from prefpack.model.offload_activations import offload_saved_tensors, offloading_device
from prefpack.model.recurrent.install import has_recurrent_boundaries
from prefpack.model.sharded import sharded_logps
from prefpack.model.sums import SequenceOutput, reduce_sequences
from prefpack.model.sums import boundary_kwargs as _boundary_kwargs
from prefpack.model.sums import hidden_of as _hidden
from prefpack.model.sums import tail_mask as _tail_mask  # noqa: F401 - read by tests
from prefpack.precision import compute_context
from prefpack.sequence_parallel import SINGLE_SP, SeqPar, SequenceParallelError

__all__ = [
    "PairSums",
    "body_forward",
    "SequenceOutput",
    "SequenceLogps",
    "pair_logps",
    "reads_prompt_groups",
    "router_aux_loss_coef",
    "router_aux_loss_func",
    "sequence_logps",
    "split_pairs",
    "uses_flash_attention",
]


class PairSums(NamedTuple):
    """Per-pair log-prob sums and completion token counts, in the batch's pair order."""

    chosen: torch.Tensor  # [P]
    rejected: torch.Tensor  # [P]
    chosen_tokens: torch.Tensor  # [P]
    rejected_tokens: torch.Tensor  # [P]


def _text_config(model: nn.Module):
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def router_aux_loss_coef(model: nn.Module, coef: float | None) -> float:
    """The effective weight of the MoE load-balancing loss, TRL 1.16's rule (``DPOTrainer.__init__``).

    ``coef`` is ``loss.router_aux_loss_coef``: None = the model config's ``router_aux_loss_coef`` (0.0 when the
    config declares none, e.g. a dense model); a number overrides it, 0.0 disables. The loss is added only for
    models whose config has ``output_router_logits`` (MoE); a non-zero ``coef`` for another model is an error.
    Returns 0.0 when nothing is to be added.
    """
    text_config = _text_config(model)
    value = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
    experts = [getattr(text_config, k, None) for k in ("num_local_experts", "num_experts")]
    # a MoE family's config with 0 experts is a dense model (Granite 4 hybrid's dense sizes): no router to balance
    moe = hasattr(text_config, "output_router_logits") and not any(n == 0 for n in experts)
    if coef and not moe:
        raise ValueError(f"loss.router_aux_loss_coef is {coef} but {type(model).__name__} is not a Mixture-of-Experts "
                         "model that returns its router logits, so there is no auxiliary loss to weight")
    return float(value or 0.0) if moe else 0.0


def router_aux_loss_func(model: nn.Module):
    """``(load_balancing_loss_func, num_experts, top_k)`` of a MoE causal LM, from its own modeling module."""
    base = getattr(model, "get_base_model", None)
    base = base() if callable(base) else model  # peft: the transformers model inside
    func = None
    for cls in type(base).__mro__:
        func = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
        if func is not None:
            break
    if func is None:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as func
    text_config = _text_config(base)
    n_experts = getattr(base, "num_experts", None) or getattr(text_config, "num_local_experts", None) \
        or getattr(text_config, "num_experts", None)
    top_k = getattr(base, "num_experts_per_tok", None) or getattr(text_config, "num_experts_per_tok", None)
    if n_experts is None or top_k is None:
        raise ValueError(f"{type(base).__name__}: cannot tell its number of experts / experts per token")
    return func, int(n_experts), int(top_k)


def sequence_logps(
    model: nn.Module,
    batch: Batch,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    flatten: bool | None = None,
    router_aux: bool = False,
    pair_tails: bool = False,
    wpo: bool = False,
    entropy: bool = False,
    seq: SeqPar = SINGLE_SP,
    token_logps: bool = False,
) -> SequenceOutput:
    """Completion log-prob sum and completion token count per sequence, and what the options ask for.

    Sequence ``2p`` is the chosen and ``2p + 1`` the rejected sequence of the batch's p-th pair. Gradients
    flow to the model when called under autograd. ``flatten`` (packed batches only; default: only for flash
    attention) runs the micro-batch as a single row without its padding. ``router_aux`` (MoE models only):
    also return the router load-balancing loss over the micro-batch's real tokens (``aux_loss``, a float32 scalar, as
    ``model(..., output_router_logits=True).aux_loss`` computes it). ``pair_tails`` (pair batches): also the sum over
    each completion's tokens past the length of the shorter completion of its pair (``tail_sum``; LD-DPO weights it).
    ``wpo``: also WPO's per-sequence ``wpo_mean`` (see :func:`prefpack.model.sums.wpo_means`). ``entropy``: also each
    sequence's mean token entropy over its scored tokens (``entropy_mean``, from the head's own logits, without
    gradient). ``token_logps``: also every scored token's log-prob, detached, as an [S, W] matrix (``token_logp``).
    A batch that carries a ``token_term`` (``prefpack.model.sums.TokenTerm``) also gets its per-sequence sums
    (``term_sums``). ``seq``: this rank's sequence group (``distributed.sequence_parallel``); a group of several ranks runs
    this rank's token shards of every row and sums over the group.
    """
    body, _ = body_and_head(model)
    spec = head_spec(model)
    device = spec.weight.device
    kernel = kernel_of(model)
    flatten = resolve_flatten(kernel, batch, flatten)
    extra = {}
    if batch.packed and flatten and kernel.boundary_kwargs:
        extra = _boundary_kwargs(batch.position_ids[batch.token_mask], device)
    aux = router_aux_loss_func(model) if router_aux else None
    if aux is not None:
        extra = {**extra, "output_router_logits": True}
    vision = _vision_of(model, batch)
    if seq.enabled:  # this rank's token shard of every row (distributed.sequence_parallel)
        if vision is not None:
            raise ValueError("images (and vision-language models) do not run on token shards yet "
                             "(distributed.sequence_parallel); set distributed.sequence_parallel=1")
        if aux is not None:
            raise ValueError("the MoE router loss is not computed over token shards (distributed.sequence_parallel)")
        if has_recurrent_boundaries(body):  # a shard's sequences would start without the state the rank before holds
            raise SequenceParallelError(f"{type(model).__name__} has recurrent layers, which do not run on token "
                                        "shards (distributed.sequence_parallel); set distributed.sequence_parallel=1")
        with compute_context(model, device):
            return sharded_logps(body, spec, kernel, batch, seq, flatten=flatten, chunk_size=chunk_size,
                                 pair_tails=pair_tails, wpo=wpo, entropy=entropy, token_logps=token_logps)
    batch = batch.to(device, non_blocking=True)
    with compute_context(model, device):
        return _sequence_logps(body, spec, batch, flatten, chunk_size, extra, aux, pair_tails, wpo, entropy, vision,
                               token_logps)


def _vision_of(model: nn.Module, batch: Batch):
    """None for a text model's forward (nothing changes for it); for a vision-language model (or a batch with images)
    its :class:`prefpack.model.vision.VisionParts`."""
    if batch.pixel_values is None and not _is_vlm(model):
        return None
    from prefpack.model.vision import vision_parts

    try:
        return vision_parts(model)
    except ValueError as exc:
        if batch.pixel_values is not None:
            raise ValueError(f"a batch with images for {type(model).__name__}: {exc}") from None
        raise


def _several_ranks() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _is_vlm(model: nn.Module) -> bool:
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    return getattr(config, "vision_config", None) is not None


def _vision_inputs(body, vision, batch: Batch, flatten: bool) -> dict:
    """The body's keywords for a vision-language model: ``inputs_embeds`` with the batch's image features written at
    its image positions (the vision tower run once over the micro-batch), and the position ids its language model
    reads (``prefpack.model.vision.body_positions``), flattened to one row of real tokens with ``flatten``."""
    from prefpack.model.vision import body_positions, cached_image_features

    embed = body.get_input_embeddings()
    embeds = embed(batch.input_ids)  # [B, L, H]
    if batch.pixel_values is not None:
        if batch.image_positions is None or batch.image_feature_rows is None:
            raise ValueError("a batch with pixel_values needs image_positions and image_feature_rows")
        with record_function("prefpack.vision"):
            feats = cached_image_features(vision, batch.pixel_values, batch.image_grid_thw, batch.vision_cache)
        rows = batch.image_feature_rows
        # else an index error; checked where it costs no device sync (collate checked every count against the grid)
        if rows.device.type == "cpu" and rows.numel() and int(rows.max()) >= feats.shape[0]:
            raise ValueError(f"the batch's images give {feats.shape[0]} feature rows but image_feature_rows reads row "
                             f"{int(rows.max())}: placeholder counts and the processor's output disagree")
        flat = embeds.reshape(-1, embeds.shape[-1])
        flat = flat.index_put((batch.image_positions,), feats[batch.image_feature_rows].to(flat.dtype))
        embeds = flat.view_as(embeds)
    elif batch.image_positions is not None and batch.image_positions.numel():
        raise ValueError("a batch with image positions but no pixel_values")
    elif _several_ranks():
        # A micro-batch without images while other ranks' have some: the tower still runs (on a blank placeholder,
        # its features added times 0), so every rank makes the same collective calls (FSDP2 gathers the tower's
        # shards) and a trained tower gets a (zero) gradient on every rank (DDP). Adds exactly 0 to the embeddings.
        from prefpack.model.vision import placeholder_pixels

        pixels, grid = placeholder_pixels(vision, embeds.device)
        with record_function("prefpack.vision"):
            feats = cached_image_features(vision, pixels, grid, batch.vision_cache)
        embeds = embeds + 0.0 * feats.sum().to(embeds.dtype)
    if vision.mrope and batch.pixel_values is not None and batch.rope_positions is None:
        raise ValueError(f"{type(vision.model).__name__} needs Batch.rope_positions (3-D rotary positions) for images")
    positions = body_positions(vision, batch.position_ids, batch.rope_positions)
    if flatten:
        keep = batch.token_mask
        embeds = real_tokens(embeds, batch)
        positions = positions[..., keep][..., None, :] if positions.ndim == 3 else positions[keep][None]
    return {"inputs_embeds": embeds, "position_ids": positions}


def _aux_loss(out, aux, mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The model's load-balancing loss over its router logits; ``mask`` [B, L] is 1 on real tokens, 0 on padding
    (None: every position is real)."""
    func, n_experts, top_k = aux
    logits = getattr(out, "router_logits", None)
    if logits is None:
        raise ValueError("the model body returned no router_logits with output_router_logits=True")
    if not logits:  # a MoE config whose layers are all dense (Qwen3-Next's mlp_only_layers): no router to balance
        return torch.zeros((), dtype=torch.float32, device=device)
    value = func(tuple(logits), n_experts, top_k, mask)
    return torch.as_tensor(value, dtype=torch.float32, device=logits[0].device).float()


def resolve_flatten(kernel, batch: Batch, flatten: bool | None) -> bool:
    """Whether to run ``batch``'s rows flattened into one (``None``: as the kernel prefers); refuses prompt-shared
    rows a kernel would not keep apart (every forward over prefpack's batches asks this first)."""
    if flatten is None:
        flatten = kernel.flattens_rows
    if batch.score_positions is not None and not kernel.runs_prompt_groups(flatten):
        readers = " and ".join(k.name for k in KERNELS if k.reads_prompt_groups)
        raise ValueError(f"prompt-shared rows run on the {readers} kernels; this model's attention "
                         f"({kernel.name or '?'}{', flattened' if flatten else ''}) does not read prompt groups")
    return flatten


def real_tokens(x: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``x[batch.token_mask][None]`` for a [B, L, ...] tensor: the real tokens as one flattened row, taken by the
    host-built ``batch.real_index`` when there is one (no device-to-host read of the mask's count)."""
    index = batch.real_index
    if index is None:
        return x[batch.token_mask][None]
    return x.reshape(-1, *x.shape[2:]).index_select(0, index.to(x.device))[None]


def _all_real(batch: Batch) -> bool:
    """Whether every position is a real token, from the host-built index's size when there is one (no sync)."""
    if batch.real_index is not None:
        return batch.real_index.numel() == batch.token_mask.numel()
    return bool(batch.token_mask.all())


def body_forward(body, batch: Batch, flatten: bool, extra: dict, vision=None):
    """The body run on a micro-batch as its layout asks (packed rows with restarting positions, a flattened row
    of real tokens, or padded rows with an attention mask): ``(output, final hidden states, real-token mask or None)``.
    The hidden states are [B, L, H], or [1, real tokens, H] for a flattened packed batch. The log-prob forward and
    the reward forward (``prefpack.model.reward``) both run the body through here."""
    mask = None
    if vision is not None:  # a vision-language model: embeddings with image features, its position ids
        inputs = _vision_inputs(body, vision, batch, flatten and batch.packed)
    if batch.packed:
        input_ids, position_ids = batch.input_ids, batch.position_ids
        if flatten:
            input_ids, position_ids = real_tokens(input_ids, batch), real_tokens(position_ids, batch)
        elif not _all_real(batch):
            mask = batch.token_mask.long()
        inputs = inputs if vision is not None else {"input_ids": input_ids, "position_ids": position_ids}
        out = body(**inputs, attention_mask=None, use_cache=False, **extra)
    else:
        inputs = inputs if vision is not None else {"input_ids": batch.input_ids, "position_ids": batch.position_ids}
        out = body(**inputs, attention_mask=batch.attention_mask, use_cache=False, **extra)
        mask = batch.attention_mask
    return out, _hidden(out), mask


def _sequence_logps(body, spec, batch: Batch, flatten: bool, chunk_size: int, extra: dict, aux=None,
                    pair_tails: bool = False, wpo: bool = False, entropy: bool = False, vision=None,
                    token_logps: bool = False) -> SequenceOutput:
    shared = batch.score_positions is not None
    out, hidden, mask = body_forward(body, batch, flatten, extra, vision)
    loss_mask, targets, seq_index = batch.loss_mask, batch.target_ids, batch.seq_index
    if batch.packed and flatten:
        loss_mask, targets, seq_index = (real_tokens(x, batch) for x in (loss_mask, targets, seq_index))
    if shared:  # a shared prompt's last position is scored once per completion it precedes
        at = batch.score_positions
        if flatten:  # indices into [B * L] -> into the flattened real tokens
            at = (batch.token_mask.reshape(-1).cumsum(0) - 1)[at]
        h = hidden.reshape(-1, hidden.shape[-1])[at]
        scored_targets, index = batch.score_targets, batch.score_sequences
    else:
        h = hidden[loss_mask]  # [N, H]: gathered before the head
        scored_targets, index = targets[loss_mask], seq_index[loss_mask]
    with record_function("prefpack.head"):  # the head's forward, for profiles (benchmarks/bench_masked_spans.py)
        logp = completion_logprobs(h, scored_targets, spec.weight, spec.bias, chunk_size=chunk_size, scale=spec.scale,
                                   softcap=spec.softcap, with_log_sum_sq=wpo, with_entropy=entropy)
    sums = reduce_sequences(logp, index, batch.num_sequences, batch.completion_tokens, wpo=wpo, entropy=entropy,
                            pair_tails=pair_tails, tail_pairs=batch.tail_pairs, term=batch.token_term,
                            token_logps=token_logps)
    return sums if aux is None else sums._replace(aux_loss=_aux_loss(out, aux, mask, hidden.device))


def split_pairs(logp_sum: torch.Tensor, n_tokens: torch.Tensor) -> PairSums:
    """Split per-sequence values (chosen at even, rejected at odd indices) into per-pair tensors."""
    return PairSums(logp_sum[0::2], logp_sum[1::2], n_tokens[0::2], n_tokens[1::2])


def pair_logps(
    model: nn.Module, batch: Batch, *, chunk_size: int = DEFAULT_CHUNK_SIZE, flatten: bool | None = None
) -> PairSums:
    """:func:`sequence_logps` split into chosen / rejected per pair."""
    out = sequence_logps(model, batch, chunk_size=chunk_size, flatten=flatten)
    return split_pairs(out.logp_sum, out.n_tokens)


class SequenceLogps(nn.Module):
    """``nn.Module`` wrapper so DDP / FSDP2 can wrap the whole computation.

    :func:`sequence_logps` calls the body and head submodules directly, bypassing the outer model's
    ``forward``; DDP's gradient hooks and FSDP2's root pre-forward run only through a wrapped ``forward``,
    so wrap this module, not the bare causal LM.

    ``router_aux``, ``pair_tails``, ``wpo``, ``entropy``, ``token_logps``: the optional outputs of
    :func:`sequence_logps`. The aux loss goes out
    through ``forward`` (not stashed on the module) so DDP / FSDP2 see its graph. ``seq``: the rank's sequence group.
    ``offload_activations`` (under autograd only; see ``prefpack.model.offload_activations``): None = as the engine
    marked the model (``train.activation_offloading``), False = never, True = from the marked device, else the head's.
    """

    def __init__(self, model: nn.Module, chunk_size: int = DEFAULT_CHUNK_SIZE, flatten: bool | None = None,
                 router_aux: bool = False, pair_tails: bool = False, wpo: bool = False, entropy: bool = False,
                 seq: SeqPar = SINGLE_SP, offload_activations: bool | None = None, token_logps: bool = False):
        super().__init__()
        self.token_logps = token_logps
        self.model = model
        self.seq = seq
        self.chunk_size = chunk_size
        self.flatten = flatten
        self.router_aux = router_aux
        self.pair_tails = pair_tails
        self.wpo = wpo
        self.entropy = entropy
        self.offload_activations = offload_activations

    def forward(self, batch: Batch) -> SequenceOutput:
        offload = self._offload_device()
        if offload is None:
            return self._forward(batch)
        with offload_saved_tensors(offload):
            return self._forward(batch)

    def _forward(self, batch: Batch) -> SequenceOutput:
        return sequence_logps(self.model, batch, chunk_size=self.chunk_size, flatten=self.flatten,
                              router_aux=self.router_aux, pair_tails=self.pair_tails, wpo=self.wpo,
                              entropy=self.entropy, seq=self.seq, token_logps=self.token_logps)

    def _offload_device(self) -> torch.device | None:
        """Where saved activations are offloaded from in this forward; None without autograd (nothing is saved)."""
        if self.offload_activations is False or not torch.is_grad_enabled():
            return None
        marked = offloading_device(self.model)
        if marked is None and self.offload_activations:
            return head_spec(self.model).weight.device
        return marked
