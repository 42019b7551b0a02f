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
from prefpack.model.logprobs import DEFAULT_CHUNK_SIZE, completion_logprobs, segment_sum
from prefpack.model.sharded import sharded_logps
from prefpack.model.sums import SequenceOutput, drawn_pair_tails, tail_mask, wpo_means, wpo_sums
from prefpack.model.sums import boundary_kwargs as _boundary_kwargs
from prefpack.model.sums import hidden_of as _hidden
from prefpack.model.sums import tail_mask as _tail_mask  # noqa: F401 - read by tests
from prefpack.precision import compute_context
from prefpack.sequence_parallel import current as sequence_layout

__all__ = [
    "PairSums",
    "SequenceOutput",
    "SequenceLogps",
    "check_against_model",
    "check_vision_against_model",
    "packing_leak",
    "pair_logps",
    "reads_prompt_groups",
    "router_aux_loss_coef",
    "router_aux_loss_func",
    "sequence_logps",
    "sibling_leak",
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
    moe = hasattr(text_config, "output_router_logits")
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
    gradient).
    """
    body, _ = body_and_head(model)
    spec = head_spec(model)
    device = spec.weight.device
    kernel = kernel_of(model)
    if flatten is None:
        flatten = kernel.flattens_rows
    if batch.score_positions is not None and not kernel.runs_prompt_groups(flatten):
        readers = " and ".join(k.name for k in KERNELS if k.reads_prompt_groups)
        raise ValueError(f"prompt-shared rows run on the {readers} kernels; this model's attention "
                         f"({kernel.name or '?'}{', flattened' if flatten else ''}) does not read prompt groups")
    extra = {}
    if batch.packed and flatten and kernel.boundary_kwargs:
        extra = _boundary_kwargs(batch.position_ids[batch.token_mask], device)
    aux = router_aux_loss_func(model) if router_aux else None
    if aux is not None:
        extra = {**extra, "output_router_logits": True}
    layout = sequence_layout()
    vision = _vision_of(model, batch)
    if layout.enabled:  # this rank's token shard of every row (distributed.sequence_parallel)
        if vision is not None:
            raise ValueError("images (and vision-language models) do not run on token shards yet "
                             "(distributed.sequence_parallel); set distributed.sequence_parallel=1")
        if aux is not None:
            raise ValueError("the MoE router loss is not computed over token shards (distributed.sequence_parallel)")
        with compute_context(model, device):
            return sharded_logps(body, spec, kernel, batch, layout, flatten=flatten, chunk_size=chunk_size,
                                 pair_tails=pair_tails, wpo=wpo, entropy=entropy)
    batch = batch.to(device, non_blocking=True)
    with compute_context(model, device):
        return _sequence_logps(body, spec, batch, flatten, chunk_size, extra, aux, pair_tails, wpo, entropy, vision)


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
        embeds = embeds[keep][None]
        positions = positions[..., keep][..., None, :] if positions.ndim == 3 else positions[keep][None]
    return {"inputs_embeds": embeds, "position_ids": positions}


def _aux_loss(out, aux, mask: torch.Tensor | None) -> torch.Tensor:
    """The model's load-balancing loss over its router logits; ``mask`` [B, L] is 1 on real tokens, 0 on padding
    (None: every position is real)."""
    func, n_experts, top_k = aux
    logits = getattr(out, "router_logits", None)
    if logits is None:
        raise ValueError("the model body returned no router_logits with output_router_logits=True")
    value = func(tuple(logits), n_experts, top_k, mask)
    return torch.as_tensor(value, dtype=torch.float32, device=logits[0].device).float()


def _sequence_logps(body, spec, batch: Batch, flatten: bool, chunk_size: int, extra: dict, aux=None,
                    pair_tails: bool = False, wpo: bool = False, entropy: bool = False, vision=None) -> SequenceOutput:
    mask = None
    if vision is not None:  # a vision-language model: embeddings with image features, its position ids
        inputs = _vision_inputs(body, vision, batch, flatten and batch.packed)
    shared = batch.score_positions is not None
    if batch.packed:
        input_ids, position_ids = batch.input_ids, batch.position_ids
        loss_mask, targets, seq_index = batch.loss_mask, batch.target_ids, batch.seq_index
        if flatten:
            keep = batch.token_mask
            input_ids, position_ids = input_ids[keep][None], position_ids[keep][None]
            loss_mask, targets, seq_index = loss_mask[keep][None], targets[keep][None], seq_index[keep][None]
        elif not bool(batch.token_mask.all()):
            mask = batch.token_mask.long()
        inputs = inputs if vision is not None else {"input_ids": input_ids, "position_ids": position_ids}
        out = body(**inputs, attention_mask=None, use_cache=False, **extra)
    else:
        loss_mask, targets, seq_index = batch.loss_mask, batch.target_ids, batch.seq_index
        inputs = inputs if vision is not None else {"input_ids": batch.input_ids, "position_ids": batch.position_ids}
        out = body(**inputs, attention_mask=batch.attention_mask, use_cache=False, **extra)
        mask = batch.attention_mask
    hidden = _hidden(out)
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
    if wpo or entropy:
        logp, *extras = logp
        log_sum_sq = extras[0] if wpo else None
        token_entropy = extras[-1] if entropy else None
    logp_sum = segment_sum(logp, index, batch.num_sequences)
    tail_sum = wpo_mean = None
    if pair_tails and batch.tail_pairs is not None:
        tail_sum = drawn_pair_tails(logp, index, batch.completion_tokens, batch.tail_pairs)
    elif pair_tails:
        tail_sum = segment_sum(logp * tail_mask(index, batch.completion_tokens).to(logp.dtype), index,
                               batch.num_sequences)
    if wpo:
        wpo_mean = wpo_means(wpo_sums(logp, log_sum_sq, index, batch.num_sequences), batch.completion_tokens)
    entropy_mean = None
    if entropy:
        sums = segment_sum(token_entropy, index, batch.num_sequences)
        entropy_mean = sums / batch.completion_tokens.to(sums.device, sums.dtype).clamp(min=1.0)
    return SequenceOutput(logp_sum, batch.completion_tokens, None if aux is None else _aux_loss(out, aux, mask),
                          tail_sum, wpo_mean, entropy_mean)


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

    ``router_aux``, ``pair_tails``, ``wpo``, ``entropy``: the optional outputs of :func:`sequence_logps`. The aux loss goes out
    through ``forward`` (not stashed on the module) so DDP / FSDP2 see its graph.
    """

    def __init__(self, model: nn.Module, chunk_size: int = DEFAULT_CHUNK_SIZE, flatten: bool | None = None,
                 router_aux: bool = False, pair_tails: bool = False, wpo: bool = False, entropy: bool = False):
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size
        self.flatten = flatten
        self.router_aux = router_aux
        self.pair_tails = pair_tails
        self.wpo = wpo
        self.entropy = entropy

    def forward(self, batch: Batch) -> SequenceOutput:
        return sequence_logps(self.model, batch, chunk_size=self.chunk_size, flatten=self.flatten,
                              router_aux=self.router_aux, pair_tails=self.pair_tails, wpo=self.wpo,
                              entropy=self.entropy)


@torch.no_grad()
def check_against_model(
    model: nn.Module, input_ids: torch.Tensor | None = None, chunk_size: int = 64
) -> float:
    """Max |difference| between our per-token log-probs and ``log_softmax(model(input_ids).logits)``.

    A one-off guard against a model whose head does something we do not model (an unknown logit scale). For a
    vision-language model (and no ``input_ids``) the sequence holds a random image too, run through the forward
    training runs (:func:`check_vision_against_model`).
    """
    if input_ids is None and _is_vlm(model):
        return check_vision_against_model(model, chunk_size=chunk_size)
    spec = head_spec(model)
    if input_ids is None:
        g = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, spec.weight.shape[0], (1, 16), generator=g)
    input_ids = input_ids.to(spec.weight.device)
    ref = model(input_ids=input_ids, use_cache=False).logits.float().log_softmax(-1)[:, :-1]
    targets = input_ids[:, 1:]
    ref = ref.gather(-1, targets[..., None]).squeeze(-1)
    body, _ = body_and_head(model)
    h = _hidden(body(input_ids=input_ids, use_cache=False))[:, :-1]
    ours = completion_logprobs(
        h.reshape(-1, h.shape[-1]),
        targets.reshape(-1),
        spec.weight,
        spec.bias,
        chunk_size=chunk_size,
        scale=spec.scale,
        softcap=spec.softcap,
    )
    return float((ours.view_as(ref).float() - ref).abs().max())


@torch.no_grad()
def check_vision_against_model(model: nn.Module, chunk_size: int = 64, seed: int = 0) -> float:
    """Max |difference| between the per-token log-probs prefpack's forward gives a sequence with an image (its
    features written at the placeholders, Qwen2-VL's 4-row positions) and those of the model's own forward.

    The image is random pixels of the shape the vision tower takes (Qwen2-VL: a 4 x 4 patch grid, 4 image tokens;
    LLaVA: one ``image_size`` image), between 4 and 6 random text tokens: no processor needed.
    """
    from prefpack.batching.collate import collate_groups
    from prefpack.model.vision import family_module, image_features, vision_parts

    parts = vision_parts(model)
    family = family_module(parts)
    hf = parts.model
    spec = head_spec(model)
    device = spec.weight.device
    g = torch.Generator().manual_seed(seed)
    pixels, grid = family.sample_image(parts, g)
    pixels = pixels.to(device, spec.weight.dtype)
    grid = None if grid is None else grid.to(device)
    n_image = int(image_features(parts, pixels, grid).shape[0])
    vocab = int(model.get_input_embeddings().weight.shape[0])
    text = torch.randint(0, vocab, (10,), generator=g)
    text[text == parts.image_token_id] = 0
    ids = torch.cat([text[:4], torch.full((n_image,), parts.image_token_id), text[4:]])
    extra, rope_positions = family.reference_inputs(parts, ids, grid, device)
    ref = hf(input_ids=ids[None].to(device), pixel_values=pixels, use_cache=False, **extra).logits.float()
    ref = ref.log_softmax(-1)[0, :-1].gather(-1, ids[1:, None].to(device))[:, 0]
    batch = collate_groups([(ids[:1].numpy(), (ids[1:].numpy(),))], [[0]], ids=[0])
    batch.pixel_values, batch.image_grid_thw = pixels, grid
    batch.image_positions = (ids == parts.image_token_id).nonzero().squeeze(1)
    batch.image_feature_rows = torch.arange(n_image)
    batch.rope_positions = rope_positions
    batch = batch.to(device)
    body, _ = body_and_head(model)
    with compute_context(model, device):
        hidden = _hidden(body(**_vision_inputs(body, parts, batch, False), attention_mask=None, use_cache=False))
        ours = completion_logprobs(hidden[0, :-1], ids[1:].to(device), spec.weight, spec.bias, chunk_size=chunk_size,
                                   scale=spec.scale, softcap=spec.softcap)
    return float((ours.float() - ref).abs().max())


def packing_leak(model: nn.Module, *, siblings: bool = True) -> float:
    """How far a sequence's hidden states move when the OTHER sequence of its packed row changes (0 when
    attention stays within sequences, as packing needs); with ``siblings`` and a kernel that reads prompt groups,
    the larger of that and :func:`sibling_leak`.

    Models whose attention ignores position-id boundaries (ALiBi models such as Bloom, custom code) would
    otherwise train on pairs that see each other, silently. Two tiny seeded rows, no gradients.
    """
    g = torch.Generator().manual_seed(0)
    first, other, second = (_random_ids(model, n, g) for n in (5, 5, 6))
    position_ids = torch.cat([torch.arange(5), torch.arange(6)])
    leak = _moved(model, [torch.cat([head, second]) for head in (first, other)], position_ids, slice(5, None))
    return max(leak, sibling_leak(model)) if siblings else leak


def sibling_leak(model: nn.Module) -> float:
    """How far a completion's hidden states move when a SIBLING of its prompt group changes: the row
    ``prompt, c1, c2`` (positions of both completions continuing from the prompt), c1 changed. 0 when siblings
    never see each other, as prompt sharing needs; 0.0 at once for a kernel that does not read prompt groups.

    The kernel runs with the keywords training hands it (varlen: the gathered keys computed on the host), so a
    wrong key gather shows here, at load, rather than as pairs that silently see each other.
    """
    if not reads_prompt_groups(model):
        return 0.0
    g = torch.Generator().manual_seed(1)
    prompt, c1, other, c2 = (_random_ids(model, n, g) for n in (4, 3, 3, 5))
    position_ids = torch.cat([torch.arange(7), torch.arange(4, 9)])
    return _moved(model, [torch.cat([prompt, c, c2]) for c in (c1, other)], position_ids, slice(7, None))


def _random_ids(model: nn.Module, n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, int(model.get_input_embeddings().weight.shape[0]), (n,), generator=g)


@torch.no_grad()
def _moved(model: nn.Module, rows: list[torch.Tensor], position_ids: torch.Tensor, part: slice) -> float:
    """Max |difference| of the hidden states at ``part`` between two one-row inputs (relative to their size), run
    as training runs them: eval mode, the compute dtype, the kernel's keywords for a flattened row."""
    body, _ = body_and_head(model)
    device = head_spec(model).weight.device
    extra = _boundary_kwargs(position_ids, device) if kernel_of(model).boundary_kwargs else {}
    pos = _guard_positions(model, position_ids[None].to(device))
    outs = []
    was_training = model.training
    model.eval()
    try:
        with compute_context(model, device):  # the kernel training will run, in its dtype
            for ids in rows:
                out = body(input_ids=ids[None].to(device), position_ids=pos, attention_mask=None, use_cache=False,
                           **extra)
                outs.append(_hidden(out)[0, part].float())
    finally:
        model.train(was_training)
    scale = 1.0 + float(outs[0].abs().max())
    return float((outs[0] - outs[1]).abs().max()) / scale


def _guard_positions(model: nn.Module, position_ids: torch.Tensor) -> torch.Tensor:
    """The position ids the leak guards hand the body, as training does: [4, 1, L] for a model with 3-D rotary
    positions (Qwen2-VL family: row 0 is what its mask and the kernels read), else as they are."""
    if not _is_vlm(model):
        return position_ids
    from prefpack.model.vision import body_positions

    return body_positions(model, position_ids)
