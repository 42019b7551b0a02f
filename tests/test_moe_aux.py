"""MoE router load-balancing loss (issue 14 item 2): prefpack's aux loss equals transformers' own, padding excluded."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import task_settings

from prefpack.batching.collate import collate
from prefpack.config import Config, LossTermConfig
from prefpack.data.store import Pair
from prefpack.losses import LossTerm
from prefpack.model import SequenceLogps, router_aux_loss_coef, sequence_logps
from prefpack.objectives import PairTask, StepState
from prefpack.reference import NoReference

VOCAB = 300


def tiny_mixtral(seed=0):
    import transformers as tf

    cfg = tf.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           router_aux_loss_coef=0.02)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = tf.MixtralForCausalLM(cfg).eval()  # float32: the grouped expert matmul refuses float64
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def tiny_llama():
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).double().eval()


def pairs(n=3, seed=0):
    rng = np.random.default_rng(seed)

    def ids(k):
        return rng.integers(1, VOCAB, size=k).astype(np.uint16)

    return [Pair(ids(4 + i), ids(5 + 2 * i), ids(3 + i)) for i in range(n)]


def router_weights(model):
    return {n: p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}


def test_aux_equals_transformers_on_one_unpadded_row():
    model = tiny_mixtral()
    batch = collate(pairs(), [[0, 1, 2]], packing=True, pad_id=0)
    assert batch.input_ids.shape[0] == 1 and bool(batch.token_mask.all())
    with torch.no_grad():
        logp, n, aux = sequence_logps(model, batch, chunk_size=16, router_aux=True)[:3]
        ref = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                    output_router_logits=True).aux_loss
        plain = sequence_logps(model, batch, chunk_size=16)
    assert aux.ndim == 0 and float(aux) > 0
    assert abs(float(aux) - float(ref)) < 1e-6
    assert plain.aux_loss is None and torch.equal(plain[0], logp) and torch.equal(plain[1], n)


def test_aux_excludes_row_padding():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = tiny_mixtral()
    batch = collate(pairs(), [[0], [1, 2]], packing=True, pad_id=0)
    assert not bool(batch.token_mask.all())  # the first row is padded
    with torch.no_grad():
        aux = sequence_logps(model, batch, chunk_size=16, router_aux=True, flatten=False)[2]
        flat = sequence_logps(model, batch, chunk_size=16, router_aux=True, flatten=True)[2]
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                       output_router_logits=True).router_logits
        want = load_balancing_loss_func(logits, 4, 2, batch.token_mask.long())
        with_padding = load_balancing_loss_func(logits, 4, 2, None)
    assert abs(float(aux) - float(want)) < 1e-6
    assert abs(float(flat) - float(want)) < 1e-6  # flattened (flash / varlen path): real tokens only too
    assert abs(float(aux) - float(with_padding)) > 1e-6  # the padding would have counted

    # padded (unpacked) batches: the padding mask is passed
    padded = collate(pairs(), [[0, 1]], packing=False, pad_id=0)
    with torch.no_grad():
        aux = sequence_logps(model, padded, chunk_size=16, router_aux=True)[2]
        ref = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask,
                    position_ids=padded.position_ids, use_cache=False, output_router_logits=True).aux_loss
    assert abs(float(aux) - float(ref)) < 1e-6


def pair_task(coef):
    cfg = Config()
    cfg.loss.terms = [LossTermConfig("simpo", 1.0)]  # reference-free
    task = PairTask.__new__(PairTask)  # no store: the test collates its own batches
    task.settings = dataclasses.replace(task_settings(cfg), router_aux_loss_coef=coef)
    task.bco, task.running, task.store = False, {}, None
    task.terms = [LossTerm("simpo", 1.0)]
    return task


def router_grads(model, coef, batch):
    model.zero_grad(set_to_none=True)
    module = SequenceLogps(model, chunk_size=16, router_aux=bool(coef))
    out = pair_task(coef).loss(module, NoReference(), batch, StepState())
    out.loss.sum().backward()
    return out, {n: p.grad.clone() for n, p in router_weights(model).items()}


def test_aux_loss_trains_the_router():
    model = tiny_mixtral().train()
    batch = collate(pairs(), [[0], [1, 2]], packing=True, pad_id=0)
    out0, g0 = router_grads(model, 0.0, batch)
    out1, g1 = router_grads(model, 0.5, batch)
    assert "aux_loss" not in out0.metrics and "aux_loss" in out1.metrics
    aux = out1.metrics["aux_loss"]
    assert aux.shape == out1.loss.shape and torch.all(aux == aux[0])
    # each pair carries coef * aux, so a step (sum / pair count) adds exactly coef * aux
    assert torch.allclose(out1.loss - out0.loss.detach(), 0.5 * aux, atol=1e-6)
    assert g0 and all(not torch.equal(g0[n], g1[n]) for n in g0)


def test_non_moe_unaffected():
    model = tiny_llama()
    batch = collate(pairs(), [[0], [1, 2]], packing=True, pad_id=0)
    task = pair_task(router_aux_loss_coef(model, None))
    assert task.router_aux_loss_coef == 0.0
    out = task.loss(SequenceLogps(model, chunk_size=16), NoReference(), batch, StepState())
    # the pre-MoE contract: a plain (logp_sum, n_tokens) callable
    before_out = pair_task(0.0).loss(lambda b: sequence_logps(model, b, chunk_size=16), NoReference(), batch, StepState())
    assert torch.equal(out.loss, before_out.loss) and "aux_loss" not in out.metrics
    with pytest.raises(ValueError, match="not a Mixture-of-Experts"):
        router_aux_loss_coef(model, 0.1)
    assert router_aux_loss_coef(model, 0.0) == 0.0


def test_moe_with_coef_zero_is_unchanged():
    model = tiny_mixtral()
    batch = collate(pairs(), [[0], [1, 2]], packing=True, pad_id=0)
    with torch.no_grad():
        a = pair_task(0.0).loss(SequenceLogps(model, chunk_size=16), NoReference(), batch, StepState())
        b = pair_task(0.0).loss(SequenceLogps(model, chunk_size=16, router_aux=True), NoReference(), batch, StepState())
    assert torch.equal(a.loss, b.loss) and "aux_loss" not in b.metrics


def test_coefficient_rule_follows_trl():
    model = tiny_mixtral()
    assert router_aux_loss_coef(model, None) == 0.02  # the model config's
    assert router_aux_loss_coef(model, 0.5) == 0.5
    assert router_aux_loss_coef(model, 0.0) == 0.0
    assert Config().loss.router_aux_loss_coef is None


def test_moe_families_without_routers_add_nothing():
    """A MoE family's config with 0 experts (Granite 4 hybrid's dense sizes) is not MoE for the coefficient; one
    whose layers are all dense (Qwen3-Next's ``mlp_only_layers``) returns no router logits: an aux loss of 0 (both
    used to fail: "cannot tell its number of experts", an IndexError in transformers' function)."""
    import transformers as tf

    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    granite = tf.GraniteMoeHybridForCausalLM(tf.GraniteMoeHybridConfig(
        **small, layer_types=["attention", "attention"], mamba_n_heads=4, num_local_experts=0,
        shared_intermediate_size=64))
    assert granite.config.router_aux_loss_coef > 0 and router_aux_loss_coef(granite, None) == 0.0
    torch.manual_seed(0)
    dense = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
        **small, head_dim=8, layer_types=["full_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, mlp_only_layers=[0, 1]))
    batch = collate(pairs(), [[0], [1, 2]], packing=True, pad_id=0)
    with torch.no_grad():
        out = sequence_logps(dense, batch, chunk_size=16, router_aux=True)
    assert router_aux_loss_coef(dense, None) > 0 and float(out.aux_loss) == 0.0
