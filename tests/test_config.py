"""Tests for prefpack.config: defaults, YAML + overrides, error messages, round trip, validate()."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from prefpack.config import (
    Config,
    ConfigError,
    LossTermConfig,
    config_from_dict,
    config_to_dict,
    dump_config,
    load_config,
    parse_override,
    save_config,
)


def _write(tmp_path, text: str):
    path = tmp_path / "cfg.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _valid(**sections) -> Config:
    """A config that passes validate(), with some sections replaced."""
    cfg = load_config(None, ["model.name_or_path=m", "data.train=store"])
    for name, value in sections.items():
        setattr(cfg, name, value)
    return cfg


def test_defaults():
    cfg = load_config(None, [])
    assert cfg == Config()
    assert cfg.model.name_or_path is None and cfg.model.dtype == "auto"
    assert cfg.data.packing is True and cfg.data.max_tokens_per_row == "auto"
    assert cfg.train.micro_batch_tokens == cfg.train.chunk_size == "auto" and cfg.optim.master_dtype == "auto"
    assert load_config(None, ["train.micro_batch_tokens=8192"]).train.micro_batch_tokens == 8192
    with pytest.raises(ConfigError, match="train.chunk_size: expected an int or one of 'auto'"):
        load_config(None, ["train.chunk_size=big"])
    for text in ("nan", "inf", "-Infinity"):  # YAML reads these as strings on the command line
        with pytest.raises(ConfigError, match=f"optim.lr must be a finite number, got '{text}'"):
            load_config(None, [f"optim.lr={text}"])
    assert cfg.loss.terms == [LossTermConfig("sigmoid", 1.0)]
    assert cfg.reference.mode == "copy"
    assert cfg.lora.target_modules == "all-linear"
    assert cfg.optim.lr == 5e-7 and cfg.optim.betas == (0.9, 0.999) and cfg.optim.max_grad_norm == 1.0
    assert cfg.train.max_steps is None and cfg.run.output_dir == "runs/prefpack"
    # Defaults are not shared between instances.
    cfg.loss.terms.append(LossTermConfig("nll", 0.5))
    assert Config().loss.terms == [LossTermConfig("sigmoid", 1.0)]
    # An empty file and empty sections mean defaults too.
    assert config_from_dict({"lora": None, "optim": {}}) == Config()


def test_yaml_and_overrides(tmp_path):
    path = _write(tmp_path, """
model:
  name_or_path: my/model
data:
  train: stores/train
  packing: true
optim:
  lr: 1e-5          # PyYAML reads this as the string "1e-5"
  warmup_steps: 10
loss:
  terms:
    - {name: sigmoid, weight: 1}
    - {name: nll, weight: 0.2}
lora:
""")
    cfg = load_config(path, [
        "optim.lr=2e-6", "data.packing=false", "loss.beta=0.05", "data.eval=stores/eval",
        "optim.betas=[0.9, 0.95]", "lora.target_modules=[q_proj, v_proj]", "optim={weight_decay: 0.1}",
        "data.train=2024",  # a number typed for a string field stays the text that was typed
    ])
    assert cfg.model.name_or_path == "my/model"
    assert cfg.optim.lr == 2e-6 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.warmup_steps == 10 and cfg.optim.weight_decay == 0.1  # section override merges
    assert cfg.data.packing is False and cfg.data.eval == "stores/eval" and cfg.data.train == "2024"
    assert cfg.loss.terms == [LossTermConfig("sigmoid", 1.0), LossTermConfig("nll", 0.2)]
    assert isinstance(cfg.loss.terms[0].weight, float)
    assert cfg.loss.beta == 0.05 and cfg.optim.betas == (0.9, 0.95)
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    cfg.validate()

    cfg = load_config(path, ["loss.terms=[{name: simpo, weight: 1.0}]", "reference.mode=none"])
    assert cfg.loss.terms == [LossTermConfig("simpo", 1.0)]
    cfg.validate()


def test_float_strings_ints_and_null():
    cfg = load_config(None, ["optim.lr=1e-5", "optim.eps=1E-8", "loss.beta=1", "optim.max_grad_norm=null"])
    assert cfg.optim.lr == 1e-5 and cfg.optim.eps == 1e-8
    assert cfg.loss.beta == 1.0 and isinstance(cfg.loss.beta, float)
    assert cfg.optim.max_grad_norm is None
    cfg = config_from_dict({"optim": {"lr": "3e-4"}, "model": {"tokenizer": None}, "train": {"max_steps": None}})
    assert cfg.optim.lr == 3e-4 and cfg.model.tokenizer is None and cfg.train.max_steps is None


def test_unknown_key_suggestions(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'optim\.learning_rate' \(did you mean 'optim\.lr'\?\)"):
        load_config(None, ["optim.learning_rate=1e-5"])
    with pytest.raises(ConfigError, match=r"unknown key 'optimizer' \(did you mean 'optim'\?\)"):
        load_config(None, ["optimizer.lr=1e-5"])
    with pytest.raises(ConfigError, match=r"unknown key 'data.max_token_per_row' \(did you mean 'data.max_tokens_per_row'"):
        load_config(None, ["data.max_token_per_row=10"])
    with pytest.raises(ConfigError, match=r"unknown key 'optim\.max_steps' \(did you mean 'train\.max_steps'\?\)"):
        load_config(None, ["optim.max_steps=3"])
    with pytest.raises(ConfigError, match=r"unknown key 'optim\.zzz'; valid keys in 'optim': lr, "):
        load_config(None, ["optim.zzz=3"])
    # From a file, the message names the file.
    path = _write(tmp_path, "train:\n  sed: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'train\.sed' \(did you mean 'train\.seed'\?\) \(in .*cfg\.yaml\)"):
        load_config(path, [])
    with pytest.raises(ConfigError, match=r"unknown key 'loss\.terms\[1\]\.wieght' \(did you mean 'loss\.terms\[1\]\.weight'"):
        config_from_dict({"loss": {"terms": [{"name": "sigmoid"}, {"name": "nll", "wieght": 1}]}})


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=abc", "optim.lr: expected a float, got 'abc' (str)"),
        ('data.packing="yes"', "data.packing: expected a bool (true/false), got 'yes' (str)"),
        ("data.packing=1", "data.packing: expected a bool (true/false), got 1 (int)"),
        ("model.dtype=fp16", "model.dtype: expected one of 'auto', 'float32', 'bfloat16', 'float16', got 'fp16'"),
        ("reference.mode=coppy", "reference.mode: expected one of 'copy', 'adapter', 'precomputed', 'none', "
                                 "got 'coppy' (str) (did you mean 'copy'?)"),
        ("train.seed=1.5", "train.seed: expected an int, got 1.5 (float)"),
        ("train.max_steps=ten", "train.max_steps: expected an int or null, got 'ten' (str)"),
        ("loss.terms=[{name: sigmoid, weight: 1.0}, {name: nll, weight: heavy}]",
         "loss.terms[1].weight: expected a float, got 'heavy' (str)"),
        ("loss.terms=[{name: sigmoid}, 3]", "loss.terms[1]: expected a mapping of keys to values, got 3 (int)"),
        ("loss.terms=[{weight: 1.0}]", "loss.terms[0].name: required key is missing"),
        ("loss.terms=sigmoid", "loss.terms: expected a list of mappings, got 'sigmoid' (str)"),
        ("optim.betas=[0.9]", "optim.betas: expected a list of 2 floats, got [0.9] (list)"),
        ("lora.target_modules=[q_proj, 7]", "lora.target_modules: expected a string or a list of strings"),
        ("optim=3", "optim: expected a mapping of keys to values, got 3 (int)"),
        ("optim.lr.x=1", "'optim.lr' is a value, not a section"),
        ("model.name_or_path", "must look like key.sub=value"),
        ("model.name_or_path=[unclosed", "the value is not valid YAML"),
    ],
)
def test_type_errors(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value)
    assert repr(override) in str(info.value)  # the message says which override was wrong


def test_type_errors_in_file(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.shuffle: expected a bool \(true/false\), got 'no' \(str\)"):
        load_config(_write(tmp_path, "data:\n  shuffle: 'no'\n"), [])
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(_write(tmp_path, "- a\n- b\n"), [])
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "model: [\n"), [])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml", [])


def test_parse_override():
    assert parse_override("optim.lr=1e-5") == ("optim.lr", "1e-5")
    assert parse_override("data.eval=") == ("data.eval", None)
    assert parse_override("model.name_or_path=a=b") == ("model.name_or_path", "a=b")
    assert parse_override("loss.terms=[{name: ipo, weight: 1}]") == ("loss.terms", [{"name": "ipo", "weight": 1}])


def test_save_load_round_trip(tmp_path):
    cfg = load_config(None, [
        "model.name_or_path=org/model", "data.train=runs/x #1", "data.eval='null'", "run.output_dir='yes'",
        "loss.terms=[{name: sigmoid, weight: 1.0}, {name: nll, weight: 0.25}]", "optim.lr=3e-7",
        "optim.max_grad_norm=null", "lora.target_modules=[q_proj, 'k: proj']", "model.tokenizer=\"a\\nb\"",
        "train.max_steps=100", "optim.betas=[0.8, 0.9]",
    ])
    assert cfg.data.eval == "null" and cfg.run.output_dir == "yes" and cfg.model.tokenizer == "a\nb"
    path = save_config(cfg, tmp_path / "out" / "config.yaml")
    text = path.read_text()
    assert "# peak learning rate" in text  # fields are documented in the saved file
    assert load_config(path, []) == cfg
    assert yaml.safe_load(text) == config_to_dict(cfg)
    assert config_to_dict(cfg)["optim"]["betas"] == [0.8, 0.9]
    assert load_config(None, []) == config_from_dict(yaml.safe_load(dump_config(Config())))


def test_validate_ok_and_partial():
    _valid().validate()
    Config().validate(training=False)  # partial config for eval / tests: no model or store needed
    with pytest.raises(ConfigError, match="model.name_or_path is required"):
        Config().validate()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optim.lr=0"], "optim.lr must be > 0, got 0.0"),
        (["optim.lr=.nan"], "optim.lr must be a finite number, got nan"),
        (["loss.beta=-1"], "loss.beta must be > 0"),
        (["loss.label_smoothing=0.5"], "loss.label_smoothing must be in [0, 0.5)"),
        (["train.global_batch_pairs=0"], "train.global_batch_pairs must be >= 1"),
        (["train.micro_batch_tokens=1", "data.packing=false"], "train.micro_batch_tokens must be >= 2"),
        (["train.chunk_size=0"], "train.chunk_size must be >= 1"),
        (["optim.master_dtype=bfloat16", "model.dtype=float32"], "optim.master_dtype bfloat16 with model.dtype"),
        (["loss.terms=[{name: exo_pair}]"], "loss exo_pair needs loss.label_smoothing > 0"),
        (["loss.discopop_tau=0"], "loss.discopop_tau must be > 0"),
        (["data.max_tokens_per_row=1"], "data.max_tokens_per_row must be >= 2"),
        (["optim.warmup_ratio=1.0"], "optim.warmup_ratio must be in [0, 1)"),
        (["train.epochs=0"], "train.epochs must be > 0"),
        (["train.max_steps=0"], "train.max_steps must be >= 1"),
        (["optim.max_grad_norm=0"], "optim.max_grad_norm must be > 0"),
        (["loss.terms=[{name: sigmoidd, weight: 1}]"], "unknown loss 'sigmoidd' (did you mean 'sigmoid'?)"),
        (["loss.terms=[{name: dpo}]"], "unknown loss 'dpo' (did you mean 'sigmoid'?)"),  # TRL's DPO, not ipo
        (["loss.terms=[]"], "loss.terms is empty"),
        (["loss.terms=[{name: ipo}, {name: ipo}]"], "more than once"),
        (["loss.terms=[{name: ipo, weight: 0}]"], "nothing would train"),
        (["loss.terms=[{name: ipo, weight: -1}]"], "loss.terms[0].weight must be finite and >= 0"),
        (["reference.mode=none"], "reference.mode is 'none' but loss 'sigmoid' needs a reference"),
        (["reference.mode=adapter"], "set lora.enabled=true"),
        (["reference.mode=none", "reference.model=x", "loss.terms=[{name: orpo}]"], "reference.model is only used"),
        (["run.eval_every=10"], "data.eval is null"),
        (["train.device=cpu", "model.attn_implementation=flash_attention_2"], "needs CUDA"),
    ],
)
def test_validate_errors(overrides, message):
    cfg = load_config(None, ["model.name_or_path=m", "data.train=store", *overrides])
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    assert message in str(info.value)


def test_validate_lists_every_problem_and_allows_ref_free_with_copy():
    cfg = load_config(None, ["optim.lr=0", "loss.beta=0"])
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    text = str(info.value)
    assert text.startswith("invalid config:") and "optim.lr" in text and "loss.beta" in text
    assert "model.name_or_path is required" in text and "data.train is required" in text

    cfg = _valid()
    cfg.loss.terms = [LossTermConfig("simpo", 1.0)]
    cfg.validate()  # allowed, but worth a warning
    assert cfg.needs_reference() is False
    assert any("reference.mode=none" in w for w in cfg.warnings())
    assert _valid().warnings() == []
    assert _valid(lora=dataclasses.replace(Config().lora, enabled=True)).lora.enabled


def test_loss_terms_helper():
    cfg = load_config(None, ["loss.terms=[{name: sigmoid, weight: 1}, {name: nll, weight: 0.5}]"])
    terms = cfg.loss_terms()
    assert [(t.name, t.weight) for t in terms] == [("sigmoid", 1.0), ("nll", 0.5)]
    assert cfg.needs_reference() is True
