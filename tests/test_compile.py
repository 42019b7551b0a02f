"""``model.compile``: each decoder layer through torch.compile gives the eager values and gradients.

The speed is a GPU matter (benchmarks/README.md: GPU table); here the compiled path must compute the same thing.
The tests compile with the ``aot_eager`` backend (dynamo's graph capture and AOT autograd, without inductor's code
generation, which needs a C++ compiler and minutes on 2 cores): what can break correctness is the tracing of the
layer with prefpack's attention functions and keyword arguments, which this backend does exactly as inductor.
"""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from conftest import prepare_hh_splits, tiny_llama
from test_packing import _value_and_grads, collate_packed, make_model, random_pairs
from test_varlen import FakeKernel

from prefpack.config import ConfigError, load_config
from prefpack.model import compile as compile_mod
from prefpack.model.attention import varlen as va
from prefpack.model.compile import compile_decoder_layers, decoder_layers, wants_compile


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_auto_compiles_on_cuda_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert wants_compile("auto", cuda) == "auto" and wants_compile("auto", cpu) is False
    assert wants_compile(True, cpu) is True and wants_compile(False, cuda) is False
    assert wants_compile("auto", cuda, world_size=2) is False  # under torchrun: not measured yet
    assert wants_compile(True, cuda, world_size=2) is True


def test_config_takes_true_false_auto_and_refuses_other_words():
    assert load_config(None, []).model.compile == "auto"
    assert load_config(None, ["model.compile=true"]).model.compile is True
    assert load_config(None, ["model.compile=false"]).model.compile is False
    with pytest.raises(ConfigError, match="model.compile"):
        load_config(None, ["model.compile=fast"])


def test_decoder_layers_are_found():
    model = make_model("llama")
    assert decoder_layers(model) is model.model.layers
    assert decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None


@pytest.mark.parametrize("attn", ["packed_sdpa", "varlen"])
def test_compiled_layers_equal_eager_values_and_grads(attn, monkeypatch):
    """Packed rows (several rows, row padding, one-token blocks) in float64: compiled = eager to 1e-10."""
    if attn == "varlen":
        kernel = FakeKernel(has_gqa=False)  # torch 2.11's contract: heads repeated in the traced graph
        monkeypatch.setattr(va, "_usable_kernel", lambda q: (kernel, False, True))
        va.register()
    pairs = random_pairs(7, seed=3)
    packed = collate_packed(pairs, [[0, 1, 2], [3], [4, 5, 6]], pad_to_multiple_of=8)
    eager_v, eager_g = _value_and_grads(make_model("llama", False, attn), packed, chunk_size=5)
    model = make_model("llama", False, attn)
    assert compile_decoder_layers(model, backend="aot_eager") == 2
    compiled_v, compiled_g = _value_and_grads(model, packed, chunk_size=5)
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames > 0, "nothing went through the compiler"
    torch.testing.assert_close(compiled_v, eager_v, rtol=0, atol=1e-10)
    assert compiled_g.keys() == eager_g.keys()
    for name in eager_g:
        torch.testing.assert_close(compiled_g[name], eager_g[name], rtol=0, atol=1e-10, msg=name)


def test_training_with_compile_equals_eager(tmp_path, toy_tokenizers, hh_train, monkeypatch, one_thread):
    """Three steps of DPO through `train()` with model.compile=true (policy and reference) = eager, per step."""
    from prefpack.training import train

    monkeypatch.setattr(compile_mod, "compile_decoder_layers",
                        partial(compile_decoder_layers, backend="aot_eager"))
    stores = prepare_hh_splits(tmp_path, toy_tokenizers["llama"], hh_train, {"train": 12})
    model = tiny_llama(toy_tokenizers["llama"], tmp_path / "model", seed=0)
    runs = {}
    for flag in ("false", "true"):
        cfg = load_config(None, [f"model.name_or_path={model}", f"data.train={stores['train']}",
                                 "train.global_batch_pairs=4", "train.max_steps=3", "train.device=cpu",
                                 "optim.lr=1e-2", f"model.compile={flag}", f"run.output_dir={tmp_path / flag}",
                                 "run.plot=false", "run.tensorboard=false"])
        logged = []
        train(cfg, progress=False, log=logged.append)
        assert any("compiled" in m for m in logged) == (flag == "true")
        runs[flag] = [json.loads(x) for x in (tmp_path / flag / "metrics.jsonl").read_text().splitlines()]
    eager, compiled = ([r["loss"] for r in runs[k] if r["split"] == "train"] for k in ("false", "true"))
    assert len(eager) == 3 and eager[-1] != eager[0]  # the weights moved
    assert compiled == pytest.approx(eager, abs=1e-6)
