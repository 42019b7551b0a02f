"""Every file in examples/configs loads with prefpack's own config loader and passes its validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefpack.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "examples" / "configs").glob("*.yaml"))
RECIPES = {"dpo", "quickstart", "trl_defaults", "kto", "simpo", "lora", "precomputed", "fsdp2", "images", "reward"}


def test_every_recipe_is_there():
    assert RECIPES <= {p.stem for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_config_is_valid(path):
    cfg = load_config(path, [])
    cfg.validate(training=True)
    assert not cfg.warnings(), cfg.warnings()
    text = path.read_text()
    assert text.startswith("#") and "prefpack train" in text  # says what it is for and how to run it
    if path.stem == "quickstart":  # the toy's lr, and it says so
        assert cfg.optim.lr == 1.0e-3 and "TOY ONLY" in text
    else:  # safe for a real model: nothing near the toy's lr
        assert cfg.optim.lr <= 1.0e-5, f"{path.name}: lr {cfg.optim.lr} is too high for a real model"


def test_trl_defaults_match_trl_1_16():
    """trl_defaults.yaml holds TRL 1.16 DPOConfig's values (tests/data/trl_dpo_config_fields.json)."""
    import json

    fields = json.loads((Path(__file__).parent / "data" / "trl_dpo_config_fields.json").read_text())["fields"]
    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / "configs" / "trl_defaults.yaml", [])
    trl = {k: v["default"] for k, v in fields.items()}
    assert cfg.optim.lr == float(trl["learning_rate"]) and cfg.loss.beta == float(trl["beta"])
    assert repr(cfg.optim.schedule) == trl["lr_scheduler_type"] and cfg.train.seed == int(trl["seed"])
    assert cfg.train.epochs == float(trl["num_train_epochs"]) and cfg.optim.warmup_steps == int(trl["warmup_steps"])
    assert cfg.train.global_batch_pairs == int(trl["per_device_train_batch_size"]) * int(
        trl["gradient_accumulation_steps"])
    assert cfg.optim.betas == (float(trl["adam_beta1"]), float(trl["adam_beta2"]))
    assert cfg.optim.eps == float(trl["adam_epsilon"]) and cfg.optim.weight_decay == float(trl["weight_decay"])
    assert cfg.optim.max_grad_norm == float(trl["max_grad_norm"])
    assert cfg.run.log_every == int(trl["logging_steps"]) and cfg.run.save_every == int(trl["save_steps"])
    assert cfg.run.report_to in ("none", ["none"]) and trl["report_to"] == "'none'"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_quick_check_docs_give_is_a_valid_config(path):
    """docs/train-your-own.md tells users to check each config with a one-step override: those overrides, as
    written there, must give a valid config for every example (once, the doc named a key that does not exist)."""
    import re
    import shlex

    doc = (Path(__file__).resolve().parents[1] / "docs" / "train-your-own.md").read_text()
    check = re.search(r"with `(train\.max_steps=1[^`]*)`", doc)
    assert check, "docs/train-your-own.md no longer gives the one-step check"
    cfg = load_config(path, shlex.split(check.group(1)))
    cfg.validate(training=True)
