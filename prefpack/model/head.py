"""Model plumbing for the log-prob op: where a causal LM's body ends and its head begins.

``body_and_head`` finds the decoder body (final normed hidden states) and the linear output embedding, through DDP
and torch.compile wrappers; ``head_spec`` reads the head's weight, bias and the logit transforms transformers
applies after it, so ``prefpack.model.logprobs.completion_logprobs`` computes the model's own log-probs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["HeadSpec", "body_and_head", "head_spec", "is_reward_model", "model_body", "score_head"]


@dataclass(frozen=True)
class HeadSpec:
    """How a model turns its final hidden state into logits: ``softcap(scale * (h W^T + b))``."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    scale: float = 1.0
    softcap: float | None = None


def _unwrap(model: nn.Module) -> nn.Module:
    """DDP / torch.compile wrappers hide the HF model behind ``.module`` / ``._orig_mod``."""
    for _ in range(4):
        if hasattr(model, "get_output_embeddings"):
            break
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model


def body_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """Return ``(decoder body, output embedding)`` of a causal LM, tied or untied.

    The body must return the final (normed) hidden states; the head must be a plain linear layer
    (``.weight`` [V, H], optional ``.bias``). A LoRA-adapted head is refused: the chunked op reads the
    base weight only and would silently ignore the adapter.
    """
    model = _unwrap(model)
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    if head is None:
        raise TypeError(
            f"{type(model).__name__} exposes no output embedding (get_output_embeddings() is None or missing): "
            "prefpack needs a causal LM with an lm_head"
        )
    if hasattr(head, "base_layer") or hasattr(head, "lora_A"):
        raise NotImplementedError(
            "an adapter on the LM head is not supported: leave lm_head out of the LoRA targets"
        )
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        raise TypeError(
            f"the output embedding {type(head).__name__} has no 2-D .weight; prefpack needs a linear head"
        )

    body = None
    get_dec = getattr(model, "get_decoder", None)
    if callable(get_dec):
        try:
            body = get_dec()
        except (AttributeError, NotImplementedError, ValueError):
            body = None
    if body is None or body is model:
        for name in ("model", "transformer", "gpt_neox", "base_model"):
            cand = getattr(model, name, None)
            if isinstance(cand, nn.Module) and cand is not model:
                body = cand
                break
        else:
            body = None
    if body is None or body is model:
        raise TypeError(
            f"cannot find the decoder body of {type(model).__name__}: expected get_decoder() or a .model attribute "
            "returning the module that outputs the final hidden states"
        )
    return body, head


def _hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP / torch.compile / peft wrappers (peft's own ``.model`` is not the body)."""
    model = _unwrap(model)
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


def is_reward_model(model: nn.Module) -> bool:
    """Whether ``model`` is a sequence classifier with one label (``AutoModelForSequenceClassification``,
    ``num_labels=1``): a reward model, whose forward ends at ``score`` instead of a vocabulary head."""
    m = _hf_model(model)
    return isinstance(getattr(m, "score", None), nn.Module) and getattr(m.config, "num_labels", None) == 1


def score_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``(decoder body, score head)`` of a reward model (transformers' ``XForSequenceClassification``: the body at
    ``base_model_prefix``, ``score`` a linear layer hidden -> 1); under peft the trained copy of ``score`` (its
    ``modules_to_save`` wrapper calls it)."""
    m = _hf_model(model)
    body = getattr(m, getattr(m, "base_model_prefix", "model"), None)
    score = getattr(m, "score", None)
    if not isinstance(body, nn.Module) or not isinstance(score, nn.Module):
        raise TypeError(f"{type(m).__name__} is not a sequence classifier with a body and a `score` head "
                        "(AutoModelForSequenceClassification of a decoder model)")
    return body, score


def model_body(model: nn.Module) -> nn.Module:
    """The decoder body of a causal LM or of a reward model: the module that returns the final hidden states."""
    return score_head(model)[0] if is_reward_model(model) else body_and_head(model)[0]


def _config_value(model: nn.Module, name: str):
    config = getattr(_unwrap(model), "config", None)
    if config is None:
        return None
    value = getattr(config, name, None)
    if value is None and hasattr(config, "get_text_config"):
        try:
            value = getattr(config.get_text_config(), name, None)
        except (AttributeError, TypeError, ValueError):
            value = None
    return value


def head_spec(model: nn.Module) -> HeadSpec:
    """Head weight, bias and the logit transforms that transformers applies after ``lm_head``.

    Known transforms: Cohere ``logit_scale`` (multiply), Granite ``logits_scaling`` (divide), Gemma-2/3
    ``final_logit_softcapping``, a head's own per-token ``logit_scale`` vector (Dory: folded into the weight). Use ``prefpack.model.checks.check_against_model`` once to catch any other.
    """
    _, head = body_and_head(model)
    scale = 1.0
    logit_scale = _config_value(model, "logit_scale")
    if isinstance(logit_scale, (int, float)) and not isinstance(logit_scale, bool):
        scale *= float(logit_scale)
    logits_scaling = _config_value(model, "logits_scaling")
    if isinstance(logits_scaling, (int, float)) and not isinstance(logits_scaling, bool):
        if logits_scaling == 0:
            raise ValueError("config.logits_scaling is 0")
        scale /= float(logits_scaling)
    softcap = _config_value(model, "final_logit_softcapping")
    if softcap is not None:
        softcap = float(softcap)
        if not (softcap > 0 and math.isfinite(softcap)):
            raise NotImplementedError(f"unsupported final_logit_softcapping={softcap}")
    weight, bias = head.weight, getattr(head, "bias", None)
    per_token = getattr(head, "logit_scale", None)
    if isinstance(per_token, torch.Tensor) and per_token.ndim == 1:
        # Dory (transformers 5.24): logits * (logit_scale * logit_scale_factor), one learned scale per token; folded
        # into the weight's rows (the product is differentiable, so both get their gradients)
        rows = per_token * float(getattr(head, "logit_scale_factor", 1.0))
        weight = weight * rows.to(weight.dtype)[:, None]
        bias = None if bias is None else bias * rows.to(bias.dtype)
    return HeadSpec(weight=weight, bias=bias, scale=scale, softcap=softcap)
