"""4-bit base weights with LoRA (``model.quantization``, issue 41 item 1) on CPU: a zero adapter is exactly the
4-bit base, the training invariances hold over it (packed = padded, 1x8 = 8x1, resume = uninterrupted), the final
folder is LoRA merged into the de-quantised base and reloads with plain transformers, and what cannot work is
refused in one line."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from conftest import (
    cfg_for,
    metrics_lines,
    prepare_hh_splits,
    quiet,
    reference_table,
    seq_logp_f64,
    tiny_llama,
)
from invariance_cases import (  # noqa: F401 - the invariances run here on this module's 4-bit `world`
    baseline,
    test_accumulation_1x8_equals_8x1,
    test_packed_equals_padded,
    test_resume_equals_uninterrupted,
)

from prefpack.config import ConfigError
from prefpack.data.store import Store
from prefpack.model import ModelError
from prefpack.training import build, train

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

SETTINGS = ("optim.lr=5.0e-3", "optim.schedule=constant", "train.global_batch_pairs=8", "train.max_steps=3",
            "run.plot=false", "run.tensorboard=false", "train.micro_batch_tokens=4096", "data.max_tokens_per_row=1024",
            "lora.enabled=true", "lora.r=4", "reference.mode=adapter", "model.quantization=nf4")


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_tokenizers, hh_train, one_thread):
    """A 24-pair train store and a tiny Llama policy, trained with LoRA over its 4-bit (NF4) weights."""
    root = tmp_path_factory.mktemp("qlora")
    tok = toy_tokenizers["llama"]
    stores = prepare_hh_splits(root, tok, hh_train, {"train": 24})
    return {"root": root, "tok": tok, **stores, "settings": SETTINGS, "policy": tiny_llama(tok, root / "policy", 1),
            "kind": "pairs_shared", "keys": ("loss", "rewards/margins", "rewards/chosen")}




def four_bit_base(path, kind="nf4"):
    """The policy's 4-bit base as transformers itself loads it (no prefpack, no adapter), on bitsandbytes'
    training kernel (``one_cpu_kernel``: no eval-mode repacking)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from prefpack.model.load import one_cpu_kernel

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=q, dtype=torch.float32,
                                                 device_map={"": "cpu"}).eval()
    one_cpu_kernel(model)
    return model


def own_logps(model, store, n=8) -> list[float]:
    """Chosen and rejected log-probs of the first ``n`` pairs by the model's own plain forward (logits in float64)."""
    out = []
    for i in range(n):
        p = store.pair(i)
        out += [seq_logp_f64(model, p.prompt, p.chosen), seq_logp_f64(model, p.prompt, p.rejected)]
    return out


# ---------------------------------------------------------------- a zero adapter is the 4-bit base


def test_zero_adapter_gives_exactly_the_four_bit_base_log_probs(world, tmp_path):
    from transformers import AutoModelForCausalLM

    lines = []
    setup = build(cfg_for(world, tmp_path / "run"), log=lines.append)
    policy, store = setup.policy, Store(world["train"])
    assert any("4-bit base weights (nf4, double quantisation" in line for line in lines)
    trained = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    assert all(p.dtype == torch.float32 for p in policy.parameters() if p.requires_grad)  # float32 adapters

    with_adapter = reference_table(policy, store).logps  # prefpack's packed, chunked forward
    with policy.disable_adapter():  # what reference.mode=adapter computes
        adapter_off = reference_table(policy, store).logps
    # exactly: B = 0 adds exact zeros to each 4-bit layer's output
    assert with_adapter.tobytes() == adapter_off.tobytes()

    base = four_bit_base(world["policy"])
    four_bit = [name for name, m in base.named_modules() if type(m).__name__ == "Linear4bit"]
    assert len(four_bit) == 14  # 7 linear layers a block, 2 blocks (the head stays as loaded)
    for name in four_bit:  # the same 4-bit weights as transformers' own load
        ours = policy.get_base_model().get_submodule(name).get_base_layer().weight
        assert ours.dtype == torch.uint8 and torch.equal(ours, base.get_submodule(name).weight), name
    own = own_logps(base, store)
    ours = [float(x) for x in with_adapter[: len(own)]]
    assert ours == pytest.approx(own, abs=2e-4)  # packed, chunked float32 sums against one plain forward
    full = own_logps(AutoModelForCausalLM.from_pretrained(world["policy"], dtype=torch.float32).eval(), store)
    assert max(abs(a - b) for a, b in zip(own, full)) > 1e-2  # the 4 bits are real: not the full-precision model


def test_first_step_loss_is_ln2_and_bfloat16_autocast_trains_float32_adapters(world, tmp_path):
    run = tmp_path / "bf16"
    lines = []
    train(cfg_for(world, run, "model.dtype=bfloat16"), progress=False, log=lines.append)
    losses = [m["loss"] for m in metrics_lines(run)]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)  # policy == adapter-off reference at step 0
    assert all(math.isfinite(x) for x in losses) and losses[-1] != losses[0]
    # the start-up line says the base is 4-bit, not bfloat16 weights
    assert any("precision: 4-bit NF4 base weights (double quant), embeddings, norms and head bfloat16, compute "
               "bfloat16 (autocast), LoRA adapters float32;" in line for line in lines)


# ---------------------------------------------------------------- the final folder


def test_final_folder_is_lora_merged_into_the_dequantised_base(world, baseline):  # noqa: F811 - the fixture
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final = baseline / "final"
    config = json.loads((final / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"  # run.save_dtype auto: the source's
    merged = AutoModelForCausalLM.from_pretrained(final).eval()  # plain transformers, no bitsandbytes config
    assert not any("lora" in k or "absmax" in k for k in merged.state_dict())
    assert merged.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    # what training ended with: the 4-bit base under the trained adapter (saved beside it in adapter/)
    ended = PeftModel.from_pretrained(four_bit_base(world["policy"]), final / "adapter").eval()
    store = Store(world["train"])
    trained, reloaded = own_logps(ended, store), own_logps(merged, store)
    assert reloaded == pytest.approx(trained, abs=1e-5)  # W x + s B A x  vs  (W + s B A) x, in float32 (3e-7)
    with ended.disable_adapter():
        base = own_logps(ended, store)
    assert max(abs(a - b) for a, b in zip(trained, base)) > 1e-3  # the adapters did train


# ---------------------------------------------------------------- refusals, one line each


@pytest.mark.parametrize("extra, match", [
    (("lora.enabled=false", "reference.mode=copy"), "model.quantization=nf4 holds the base weights in 4 bits"),
    (("reference.mode=copy",), "use reference.mode=adapter"),
    (("distributed.strategy=fsdp2", "distributed.cpu_offload=true"), "distributed.cpu_offload with model.quantization"),
])
def test_refusals_are_one_line(world, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match) as err:
        cfg_for(world, tmp_path / "run", *extra).validate()
    assert "\n" not in str(err.value)


def test_unknown_quantization_and_missing_bitsandbytes_are_refused(world, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="model.quantization"):
        cfg_for(world, tmp_path / "a", "model.quantization=int3")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed
    with pytest.raises(ModelError, match=r"needs bitsandbytes: pip install 'prefpack\[qlora\]'") as err:
        build(cfg_for(world, tmp_path / "b"), log=quiet)
    assert "\n" not in str(err.value)


def test_eval_with_the_runs_config_scores_its_final_model_in_full_precision(world, baseline, tmp_path):  # noqa: F811
    """`prefpack eval --config RUN/config.yaml` of a QLoRA run: final/ holds the adapters merged into the
    de-quantised base, so it is scored as a plain model (no 4-bit rule refuses the run's own config), and its loss
    against the starting weights is the one a full-precision copy reference gives."""
    from prefpack.training import build, evaluate
    from prefpack.training.scoring import EvalOptions, eval_config, score_store

    opts = EvalOptions(model=str(baseline / "final"), data=str(world["train"]), config=str(baseline / "config.yaml"),
                       ref=str(world["policy"]), device="cpu")
    cfg = eval_config(opts)
    cfg.validate()
    assert cfg.model.quantization is None and cfg.reference.mode == "copy" and not cfg.lora.enabled
    scored = score_store(opts, log=quiet)
    plain = cfg_for(world, tmp_path / "plain", f"model.name_or_path={baseline / 'final'}", "model.quantization=null",
                    "lora.enabled=false", "reference.mode=copy", f"reference.model={world['policy']}")
    setup = build(plain, log=quiet)
    assert scored["loss"] == pytest.approx(evaluate(setup.policy, setup.reference, setup.train_task)["loss"], abs=1e-6)
