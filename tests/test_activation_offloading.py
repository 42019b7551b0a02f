"""``train.activation_offloading``: the policy's saved activations go to host memory and back, and nothing else changes.

On CPU nothing moves in a run (the activations already are in host memory), so the unit tests store a copy on pack
(``copy_on_host``): a real round trip, whose gradients must equal those without hooks bitwise. The memory saving is a
GPU matter and is not measured here.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict

import pytest
import torch
from conftest import final_weights, metrics_lines, prepare_hh_splits
from test_packing import _value_and_grads, collate_packed, make_model, random_pairs
from torch import nn
from torch.utils.checkpoint import checkpoint

from prefpack.engine import budgets as b
from prefpack.model import offload_activations as oa
from prefpack.model.logprobs import completion_logprobs

CPU = torch.device("cpu")


def _round_trip(**kw):
    return oa.offload_saved_tensors(CPU, min_bytes=0, copy_on_host=True, **kw)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.SiLU(),
                         nn.Linear(64, 8))


class _Block(nn.Module):
    """A residual MLP block: a decoder layer's shape of work, in a class of this file (dynamo compiles no frame of
    torch's own modules at top level), with a graph break as prefpack's packed_sdpa kernel has (``.tolist()``): the
    op at the break runs eagerly while dynamo's frame hook is set, and calls the pack hook from there."""

    def __init__(self, width: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        h = nn.functional.gelu(self.up(self.norm(x)))
        h = h * h[h > 0].mean()  # a data-dependent shape: the graph breaks, the indexing runs eagerly
        return x + self.down(h)


def _grads(model, forward, ctx):
    model.zero_grad(set_to_none=True)
    with ctx as counts:
        loss = forward()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()], counts


def _assert_same(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_round_trip_gives_the_same_gradients_and_counts_every_move():
    model, x = _mlp(), torch.randn(32, 16)
    plain, _ = _grads(model, lambda: model(x).pow(2).sum(), contextlib.nullcontext())
    moved, counts = _grads(model, lambda: model(x).pow(2).sum(), _round_trip())
    _assert_same(moved, plain)
    assert counts.offloaded > 0 and counts.restored == counts.offloaded and counts.bytes > 0
    assert counts.kept > 0  # the linears' weights (saved as transposed views) stay where they are


def test_weights_and_their_autocast_casts_stay_activations_go():
    """Under autocast a linear saves its input (an activation) and the bfloat16 cast of its weight's transpose (not)."""
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with _round_trip() as counts, torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = first(x)  # x needs no grad: saved cast of x only
        before = asdict(counts)
        out = second(hidden)  # saves hidden (offloaded) and the weight cast's transpose (kept)
    out.float().sum().backward()
    assert before == {"offloaded": 1, "restored": 0, "bytes": 4 * 8 * 2, "shared": 0, "kept": 0}
    assert counts.offloaded == 2 and counts.kept == 1 and counts.restored == 2
    assert not oa._weight_derived(hidden) and oa._weight_derived(first.weight.t())


def test_a_tensor_saved_twice_is_sent_once():
    """The input of two projections (q, k and v's) is saved by each: one host copy serves both."""
    torch.manual_seed(0)
    first, left, right = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def forward():
        hidden = first(x)
        return (left(hidden) * right(hidden)).sum()

    model = nn.ModuleList([first, left, right])
    plain, _ = _grads(model, forward, contextlib.nullcontext())
    moved, counts = _grads(model, forward, _round_trip())
    _assert_same(moved, plain)
    # sent: x (saved by first), hidden (saved by left and right: once), both products (saved by the mul)
    assert (counts.offloaded, counts.shared, counts.restored) == (4, 1, 4)


def test_small_tensors_stay():
    model, x = _mlp(), torch.randn(32, 16)
    _, counts = _grads(model, lambda: model(x).pow(2).sum(), oa.offload_saved_tensors(CPU, min_bytes=1 << 30))
    assert counts.offloaded == 0 and counts.kept > 0


def test_composes_with_non_reentrant_checkpointing():
    """Inside a checkpointed block torch's own hooks win; the blocks' inputs (saved outside them) are offloaded and
    come back for the recomputation: the gradients are those of checkpointing alone."""
    model, x = _mlp(), torch.randn(32, 16)
    blocks = [model[:3], model[3:5], model[5:]]

    def forward():
        h = x
        for block in blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return h.pow(2).sum()

    plain, _ = _grads(model, lambda: model(x).pow(2).sum(), contextlib.nullcontext())
    ckpt, _ = _grads(model, forward, contextlib.nullcontext())
    both, counts = _grads(model, forward, _round_trip())
    _assert_same(both, ckpt)
    _assert_same(both, plain)
    _, alone = _grads(model, lambda: model(x).pow(2).sum(), _round_trip())
    assert 0 < counts.offloaded < alone.offloaded  # only what checkpointing keeps: the blocks' inputs
    assert counts.restored == counts.offloaded


def test_chunked_head_saves_through_the_hooks():
    """The completion-only head's autograd Function saves its hidden states with save_for_backward: offloaded, back,
    and the same gradients (its kept last chunk of logits is not a saved tensor and stays)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(50, 12, generator=g, requires_grad=True)
    w = nn.Parameter(torch.randn(40, 12, generator=g))
    t = torch.randint(0, 40, (50,), generator=g)

    def run(ctx):
        h.grad = w.grad = None
        with ctx as counts:
            hidden = h * 1.5  # an activation, not a leaf
            out = completion_logprobs(hidden, t, w, chunk_size=16)
        out.sum().backward()
        return [h.grad.clone(), w.grad.clone()], counts

    plain, _ = run(contextlib.nullcontext())
    moved, counts = run(_round_trip())
    _assert_same(moved, plain)
    assert counts.offloaded >= 1 and counts.restored == counts.offloaded


def test_model_forward_gives_the_same_values_and_gradients():
    """A Llama's packed forward (pair log-probs, as training runs it) with the round trip: the same values and
    gradients, bitwise."""
    packed = collate_packed(random_pairs(5, seed=1), [[0, 1, 2], [3, 4]])
    model = make_model("llama", False, "packed_sdpa")
    value, grads = _value_and_grads(model, packed, chunk_size=7)
    with _round_trip() as counts:
        moved_value, moved_grads = _value_and_grads(model, packed, chunk_size=7)
    assert torch.equal(moved_value, value) and moved_grads.keys() == grads.keys()
    assert all(torch.equal(moved_grads[k], grads[k]) for k in grads)
    assert counts.offloaded > 0 and counts.restored == counts.offloaded


def test_compiled_layers_call_the_hooks_without_recompiling():
    """Layers compiled as ``model.compile`` compiles decoder layers (one by one, dynamic shapes; aot_eager: dynamo and
    AOT autograd, as inductor traces) call the hooks from their compiled autograd functions: the same gradients, and
    no new graph however the counts change (dynamo must not compile the hooks themselves)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(_Block(16), _Block(16), nn.Linear(16, 4))
    for layer in model[:2]:
        layer.compile(backend="aot_eager", dynamic=True)
    x = torch.randn(32, 16)
    try:
        plain, _ = _grads(model, lambda: model(x).pow(2).sum(), contextlib.nullcontext())
        graphs = counters["stats"]["unique_graphs"]
        assert graphs > 0, "nothing went through the compiler"
        for _ in range(3):
            moved, counts = _grads(model, lambda: model(x).pow(2).sum(), _round_trip())
            _assert_same(moved, plain)
            assert counts.offloaded > 0 and counts.restored == counts.offloaded
        assert counters["stats"]["unique_graphs"] == graphs
    finally:
        torch._dynamo.reset()


def test_sequence_logps_offloads_only_under_autograd():
    from prefpack.model.forward import SequenceLogps

    model = make_model("llama", False, "packed_sdpa")
    packed = collate_packed(random_pairs(3, seed=2), [[0, 1, 2]])
    before = asdict(oa.TOTALS)
    with torch.no_grad():
        SequenceLogps(model, offload_activations=True)(packed)  # a reference's forward: nothing saved, no hooks
    assert asdict(oa.TOTALS) == before
    oa.set_activation_offloading(model, CPU)
    assert SequenceLogps(model)._offload_device() == CPU  # the engine's mark, read by the forward
    assert SequenceLogps(model, offload_activations=False)._offload_device() is None


def _run(tmp_path, model, store, name, *extra):
    from prefpack.config import load_config
    from prefpack.training import train

    out = tmp_path / name
    cfg = load_config(None, [f"model.name_or_path={model}", f"data.train={store}", "train.max_steps=3",
                             "train.global_batch_pairs=4", "optim.lr=1e-2", "train.device=cpu", f"run.output_dir={out}",
                             "run.plot=false", "run.report_to=none", "run.save_every=0", *extra])
    logged = []
    before = asdict(oa.TOTALS)
    train(cfg, progress=False, log=lambda *a, **k: logged.append(" ".join(map(str, a))))
    moved = {k: v - before[k] for k, v in asdict(oa.TOTALS).items()}
    return [m["loss"] for m in metrics_lines(out)], final_weights(out), moved, logged


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_tokenizers, hh_train):
    """A 2-layer Llama wide enough (hidden 128) that its activations pass the offloading size floor."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("actoff")
    tok_dir = toy_tokenizers["llama"]
    stores = prepare_hh_splits(root, tok_dir, hh_train, {"train": 12})
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(AutoTokenizer.from_pretrained(tok_dir)), hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(root / "model")
    return root / "model", stores["train"]


@pytest.mark.parametrize(("checkpointing", "lora"), [("false", False), ("true", False), ("true", True)])
def test_training_with_offloading_equals_without(tmp_path, world, one_thread, checkpointing, lora):
    """Three DPO steps through ``train()``: the same losses and final weights, bitwise, with and without
    offloading (with gradient checkpointing on both sides; with LoRA and its adapter-off reference); the hooks moved
    tensors and brought each back."""
    model, store = world
    same = [f"model.gradient_checkpointing={checkpointing}"]
    if lora:
        same += ["lora.enabled=true", "lora.r=4", "reference.mode=adapter"]
    losses, weights, moved, _ = _run(tmp_path, model, store, "off", *same)
    on_losses, on_weights, on_moved, logged = _run(tmp_path, model, store, "on", *same,
                                                    "train.activation_offloading=true")
    assert moved["offloaded"] == 0
    assert on_losses == losses and len(losses) == 3 and losses[-1] != losses[0]
    assert on_weights.keys() == weights.keys() and all(torch.equal(on_weights[k], weights[k]) for k in weights)
    assert on_moved["offloaded"] > 0 and on_moved["restored"] == on_moved["offloaded"]
    assert any("activation_offloading on cpu" in line for line in logged)


def test_budgets_count_offloaded_activations(monkeypatch):
    """On CUDA (simulated) offloaded activations leave the device: a larger auto micro-batch for speed, bounded by
    what the host can hold."""
    from test_budgets import _cuda, _model

    model = _model()
    monkeypatch.setattr(b, "host_free_bytes", lambda: 512 * 2**30)
    kept, _ = _cuda(monkeypatch, 20, model)
    offloaded, line = _cuda(monkeypatch, 20, model, offloaded=True)
    assert "activations offloaded to host memory" in line
    assert offloaded.micro_batch_tokens > kept.micro_batch_tokens
    config = model.config
    assert b.activation_bytes_per_token(config, autocast=True, checkpointing=True, offloaded=True) < \
        b.activation_bytes_per_token(config, autocast=True, checkpointing=True)
    monkeypatch.setattr(b, "host_free_bytes", lambda: 2 * 2**30)  # a small host: it bounds the micro-batch
    small_host, _ = _cuda(monkeypatch, 20, model, offloaded=True)
    assert small_host.micro_batch_tokens == b.MIN_MICRO_BATCH_TOKENS


def test_config_key_is_off_by_default():
    from prefpack.config import load_config

    assert load_config(None, []).train.activation_offloading is False
    assert load_config(None, ["train.activation_offloading=true"]).train.activation_offloading is True
