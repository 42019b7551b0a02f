"""Training core: eval against a float64 formula, accumulation, packing, resume, reference modes, CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import cfg_for, final_weights, metrics_lines, prepare_hh_splits, seq_logp_f64, tiny_llama

from prefpack.cli import main as cli_main
from prefpack.config import load_config
from prefpack.data.store import Store
from prefpack.training import build, train

# what `cfg_for(world, ...)` sets besides the model, the train store and the run folder
SETTINGS = ("optim.lr=1.0e-3", "optim.schedule=constant", "train.global_batch_pairs=8", "train.max_steps=3",
            "run.plot=false", "run.tensorboard=false", "train.micro_batch_tokens=4096", "data.max_tokens_per_row=1024")


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_tokenizers, hh_train):
    """A 24-pair train store, a 10-pair eval store, a policy and a different reference (tiny Llamas)."""
    root = tmp_path_factory.mktemp("train")
    tok = toy_tokenizers["llama"]
    stores = prepare_hh_splits(root, tok, hh_train, {"train": 24, "eval": 10})
    return {"root": root, "tok": tok, **stores, "settings": SETTINGS,
            "policy": tiny_llama(tok, root / "policy", 1), "ref": tiny_llama(tok, root / "ref", 2)}


# ---------------------------------------------------------------- eval against an independent formula


def test_eval_matches_float64_formula(world, capsys):
    from transformers import AutoModelForCausalLM

    code = cli_main(["eval", "--model", str(world["policy"]), "--ref", str(world["ref"]), "--data",
                     str(world["eval"]), "--beta", "0.3", "--json"])
    assert code == 0
    got = json.loads(capsys.readouterr().out)
    pol = AutoModelForCausalLM.from_pretrained(world["policy"], dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(world["ref"], dtype=torch.float32).eval()
    store = Store(world["eval"])
    losses, accs, margins = [], [], []
    for i in range(len(store)):
        p = store.pair(i)
        pc, pr = seq_logp_f64(pol, p.prompt, p.chosen), seq_logp_f64(pol, p.prompt, p.rejected)
        rc, rr = seq_logp_f64(ref, p.prompt, p.chosen), seq_logp_f64(ref, p.prompt, p.rejected)
        z = 0.3 * ((pc - rc) - (pr - rr))
        losses.append(math.log1p(math.exp(-z)))  # -log sigmoid(z)
        accs.append(float((pc - rc) > (pr - rr)))
        margins.append(z)
    n = len(store)
    assert got["pairs"] == n
    assert got["loss"] == pytest.approx(sum(losses) / n, abs=1e-5)
    assert got["rewards/accuracies"] == pytest.approx(sum(accs) / n)
    assert got["rewards/margins"] == pytest.approx(sum(margins) / n, abs=1e-5)


# ---------------------------------------------------------------- the loop


def test_tokenizer_handle_reloads_the_same_tokenizer_and_refuses_a_changed_one(world, tmp_path):
    """The trainer drops the tokenizer after its checks and loads it again to save it with the final model."""
    import shutil

    from prefpack.model import ModelError, TokenizerHandle
    from prefpack.tokenizer import load_tokenizer, tokenizer_hash

    folder = shutil.copytree(world["tok"], tmp_path / "tok")
    handle = TokenizerHandle.of(load_tokenizer(folder))
    assert handle.source == str(folder)
    assert tokenizer_hash(handle.load()) == handle.content_hash
    config = folder / "tokenizer_config.json"
    conf = json.loads(config.read_text())
    conf["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    config.write_text(json.dumps(conf))
    with pytest.raises(ModelError, match="changed while the run was training"):
        handle.load()


def test_tiny_train_lowers_loss_changes_weights_and_saves_loadable_model(world, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    res = train(cfg_for(world, run, "train.max_steps=8", f"data.eval={world['eval']}", "run.plot=true",
                        "train.global_batch_pairs=24"), progress=False, log=lambda m: None)
    train_losses = [m["loss"] for m in metrics_lines(run)]
    assert train_losses[0] == pytest.approx(math.log(2), abs=1e-5)  # policy == reference at step 0
    assert train_losses[-1] < train_losses[0] - 0.05
    before = load_file(str(world["policy"] / "model.safetensors"))
    after = final_weights(run)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    model = AutoModelForCausalLM.from_pretrained(res.final_dir)
    assert model.config.vocab_size == after["model.embed_tokens.weight"].shape[0]
    from prefpack.tokenizer import load_tokenizer, tokenizer_hash

    assert tokenizer_hash(load_tokenizer(res.final_dir)) == Store(world["train"]).meta["tokenizer"]["hash"]
    assert (run / "config.yaml").exists() and (run / "curves.png").stat().st_size > 1000
    assert res.eval_before["loss"] == pytest.approx(math.log(2), abs=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected", "nll", "lr", "grad_norm", "tokens/s", "pairs/s", "filling"):
        assert key in metrics_lines(run)[-1], key


@pytest.mark.parametrize("name", ["bco_pair", "bco_pair_running"])
def test_bco_pair_accumulation_1x8_equals_8x1(world, tmp_path, name):
    """TRL 1.16's bco_pair has no running mean, and bco_pair_running's is updated once per step from the step's
    sums over all ranks: neither update depends on the micro-batch split."""
    one, many = tmp_path / "one", tmp_path / "many"
    bco = [f"loss.terms=[{{name: {name}}}]", f"reference.model={world['ref']}", "train.max_steps=4"]
    train(cfg_for(world, one, *bco, "train.micro_batch_tokens=4096"), progress=False, log=lambda m: None)
    train(cfg_for(world, many, *bco, "train.micro_batch_tokens=16", "data.max_tokens_per_row=16"), progress=False,
          log=lambda m: None)
    for a, b in zip(metrics_lines(one), metrics_lines(many), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    wa, wb = final_weights(one), final_weights(many)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=2e-5, rtol=1e-4)


def test_tokenizer_mismatch_is_refused(world, tmp_path, toy_tokenizers):
    import shutil

    model = tmp_path / "m"
    shutil.copytree(world["policy"], model)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(toy_tokenizers["neox"]).save_pretrained(model)
    cfg = cfg_for(world, tmp_path / "r", f"model.name_or_path={model}")
    with pytest.raises(Exception, match="allow_tokenizer_mismatch"):
        build(cfg, log=lambda m: None)


def test_train_cli_reports_config_errors_cleanly(world, tmp_path, capsys):
    conf = tmp_path / "c.yaml"
    conf.write_text(f"model:\n  name_or_path: {world['policy']}\ndata:\n  train: {world['train']}\noptim:\n  learning_rate: 1\n")
    assert cli_main(["train", str(conf)]) == 2
    err = capsys.readouterr().err
    assert "optim.learning_rate" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    from prefpack.quickstart import run_quickstart

    root = tmp_path_factory.mktemp("quickstart") / "qs"
    return root, run_quickstart(str(root), steps=60, log=lambda m: None)


def test_quickstart_learns_the_bundled_task(quickstart_run):
    _, out = quickstart_run
    assert 0.3 < out["before"]["logps/accuracies"] < 0.7  # a random model picks a label regardless of the review
    assert out["after"]["logps/accuracies"] >= 0.9 and out["after"]["rewards/accuracies"] >= 0.9
    assert out["after"]["loss"] < 0.4


def test_a_reward_model_from_the_quickstart_model_learns_the_task(quickstart_run, tmp_path):
    """README's "Reward models" example: a reward model trained from the quickstart's untrained model on its pairs
    (one epoch, the toy config) prefers the right label on the held-out pairs (issue 39: >= 0.95)."""
    root, _ = quickstart_run
    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / "configs" / "quickstart.yaml", [
        f"model.name_or_path={root / 'init-model'}", f"data.train={root / 'train-store'}",
        f"data.eval={root / 'eval-store'}", "train.objective=reward", "reference.mode=none",
        f"run.output_dir={tmp_path / 'rm'}", "run.plot=false", "run.eval_every=0", "run.save_every=0"])
    result = train(cfg, progress=False, log=lambda m: None)
    assert result.eval_before["rewards/accuracies"] < 0.75  # the new head starts near chance
    assert result.eval_after["rewards/accuracies"] >= 0.95, result.eval_after


def test_lora_adapter_reference(world, tmp_path):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "lora"
    res = train(cfg_for(world, run, "lora.enabled=true", "reference.mode=adapter", "lora.r=4", "train.max_steps=4",
                        "optim.lr=5.0e-3"), progress=False, log=lambda m: None)
    losses = [m["loss"] for m in metrics_lines(run)]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5)  # LoRA starts as a no-op: policy == reference
    assert losses[-1] < losses[0]
    merged = AutoModelForCausalLM.from_pretrained(res.final_dir)
    assert not any("lora" in k for k in merged.state_dict())
    assert (res.final_dir / "adapter" / "adapter_config.json").exists()
