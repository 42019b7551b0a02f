"""Load-time self-checks of a model against prefpack's forward: the per-token log-probs equal the model's own
(:func:`check_against_model`, with an image for a vision-language model), and packed sequences or sibling completions
do not see each other (:func:`packing_leak`, :func:`sibling_leak`). Each runs once on tiny seeded inputs, so a model
that prefpack's forward would get silently wrong is refused at load instead.
"""

from __future__ import annotations

import torch
from torch import nn

from prefpack.model.attention.kernels import kernel_of, reads_prompt_groups
from prefpack.model.forward import _is_vlm, _vision_inputs
from prefpack.model.head import body_and_head, head_spec, model_body
from prefpack.model.logprobs import completion_logprobs
from prefpack.model.sums import boundary_kwargs as _boundary_kwargs
from prefpack.model.sums import hidden_of as _hidden
from prefpack.precision import compute_context

__all__ = ["check_against_model", "check_vision_against_model", "packing_leak", "sibling_leak"]


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
    body = model_body(model)  # a causal LM's or a reward model's
    device = model.get_input_embeddings().weight.device
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
