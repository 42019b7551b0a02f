"""Every unknown config key in one error, with TRL's and LLaMA-Factory's names mapped (issue 51, item 7).

A config migrated from TRL or LLaMA-Factory holds many names prefpack does not have; all of them (the file's and the
overrides' together) are answered in one error, one line each: another trainer's top-level name mapped to prefpack's
key with the value (prefpack.config.foreign), a prepare flag for a data name, else the nearest key. The LLaMA-Factory
table of docs/coming-from-trl.md is checked against that mapping and against the config and the command line.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest
from test_trl_mapping import cli_options, config_keys, problems_in, split_cells

from prefpack.config import Config, ConfigError, load_config
from prefpack.config.foreign import FOREIGN, LF

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "coming-from-trl.md"
LF_HEADING = "## Coming from LLaMA-Factory: its DPO, KTO and reward-model arguments"

# A flat TRL DPOConfig YAML (TRL's CLI reads DPOConfig, ScriptArguments and ModelConfig from one flat file)
TRL_YAML = """\
model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct
dataset_name: trl-lib/ultrafeedback_binarized
beta: 0.1
loss_type: sigmoid
learning_rate: 5.0e-7
num_train_epochs: 1
per_device_train_batch_size: 2
gradient_accumulation_steps: 8
max_length: 1024
output_dir: Qwen2-0.5B-DPO
"""

# hiyouga/LLaMA-Factory @ ff6d4d12eeb0, examples/train_lora/qwen3_lora_{dpo,kto,reward}.yaml: their keys and values
# (comments and the commented-out eval block left out)
LF_DPO = """\
model_name_or_path: Qwen/Qwen3-4B-Instruct-2507
trust_remote_code: true
stage: dpo
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all
pref_beta: 0.1
pref_loss: sigmoid
dataset: dpo_en_demo
template: qwen3_nothink
cutoff_len: 2048
max_samples: 1000
preprocessing_num_workers: 16
dataloader_num_workers: 4
output_dir: saves/qwen3-4b/lora/dpo
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 5.0e-6
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null
"""
LF_KTO = LF_DPO.replace("stage: dpo", "stage: kto").replace("pref_loss: sigmoid\n", "").replace(
    "dpo_en_demo", "kto_en_demo").replace("save_only_model: false\n", "").replace("resume_from_checkpoint: null\n", "")
LF_RM = LF_DPO.replace("stage: dpo", "stage: rm").replace("pref_beta: 0.1\npref_loss: sigmoid\n", "").replace(
    "learning_rate: 5.0e-6", "learning_rate: 1.0e-4")


def error_of(tmp_path: Path, text: str, overrides: list[str] | None = None) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides or [])
    return str(err.value)


def lines_of(message: str) -> list[str]:
    return [line[4:] for line in message.splitlines() if line.startswith("  - ")]


def test_ten_unknown_keys_are_one_error_listing_all_ten(tmp_path):
    message = error_of(tmp_path, TRL_YAML)
    assert message.startswith("10 unknown keys (in "), message
    lines = lines_of(message)
    assert [line.split(" ", 1)[0] for line in lines] == [line.split(":")[0] for line in TRL_YAML.splitlines()]
    assert all(" -> " in line and "(TRL" in line for line in lines), message
    want = {
        "beta": "loss.beta: 0.1",
        "loss_type": "loss.terms: [{name: sigmoid}]",
        "learning_rate": "optim.lr: 5.0e-07",
        "num_train_epochs": "train.epochs: 1",
        "per_device_train_batch_size": "train.global_batch_pairs: 16 x your GPU count",
        "output_dir": "run.output_dir: Qwen2-0.5B-DPO",
        "model_name_or_path": "model.name_or_path: Qwen/Qwen2.5-0.5B-Instruct",
    }
    for name, text in want.items():
        assert any(line.startswith(name + " ") and text in line for line in lines), (name, message)


def test_trl_max_length_and_dataset_name_point_at_prepare(tmp_path):
    lines = {line.split(" ", 1)[0]: line for line in lines_of(error_of(tmp_path, TRL_YAML))}
    assert "max_length (TRL) -> not a train key: prefpack prepare --max-length 1024" in lines["max_length"]
    assert "prepare's input: prefpack prepare FILES -o STORE" in lines["dataset_name"]
    assert "data.train: STORE" in lines["dataset_name"]
    with pytest.raises(ConfigError, match=r"^unknown key 'max_length' \(TRL\) -> not a train key: prefpack prepare "
                                          r"--max-length 512 .*\(in override 'max_length=512'\)$"):
        load_config(None, ["max_length=512"])


def test_the_file_and_the_overrides_in_one_error(tmp_path):
    message = error_of(tmp_path, "pref_beta: 0.2\noptim:\n  learning_rate: 1.0e-6\n  lr: 1.0e-6\n",
                       ["cutoff_len=4096", "train.sed=3", "loss.beta=0.3"])
    assert message.startswith("4 unknown keys (in ") and "the overrides' marked" in message, message
    assert lines_of(message) == [
        "pref_beta (LLaMA-Factory) -> loss.beta: 0.2",
        "optim.learning_rate (did you mean 'optim.lr'?)",
        "cutoff_len (LLaMA-Factory) -> not a train key: prefpack prepare --max-length 4096 (prompt + completion, cut "
        "once when the store is written; default no limit, LLaMA-Factory's 2048) (in override 'cutoff_len=4096')",
        "train.sed (did you mean 'train.seed'?) (in override 'train.sed=3')",
    ]
    assert "TRL's and LLaMA-Factory's names are mapped (docs/coming-from-trl.md" in message.splitlines()[0]


@pytest.mark.parametrize("key,value,want", [
    ("pref_beta", "0.1", "loss.beta: 0.1"),
    ("pref_loss", "sigmoid", "loss.terms: [{name: sigmoid}]"),
    ("pref_loss", "hinge", "loss.terms: [{name: hinge}]"),
    ("pref_loss", "ipo", "loss.terms: [{name: ipo}]"),
    ("pref_loss", "orpo", "loss.terms: [{name: orpo}]"),
    ("pref_loss", "simpo", "loss.terms: [{name: simpo}]"),
    ("pref_loss", "kto_pair", "loss.terms: [{name: kto}] with data.paired_as_kto: true"),
    ("pref_ftx", "0.5", "loss.terms: [{name: sigmoid}, {name: nll, weight: 0.5}]"),
    ("pref_bco_weight", "1.0", "loss.terms: [{name: sigmoid, weight: 0.5}, {name: bco_pair_running, weight: 0.5}]"),
    ("simpo_gamma", "1.0", "loss.simpo_gamma: 1.0"),
    ("dpo_label_smoothing", "0.1", "loss.label_smoothing: 0.1"),
    ("kto_chosen_weight", "1.5", "loss.desirable_weight: 1.5"),
    ("kto_rejected_weight", "0.5", "loss.undesirable_weight: 0.5"),
    ("cutoff_len", "2048", "not a train key: prefpack prepare --max-length 2048"),
    ("learning_rate", "5.0e-6", "optim.lr: 5.0e-06"),
    ("num_train_epochs", "3.0", "train.epochs: 3.0"),
    ("per_device_train_batch_size", "4", "train.global_batch_pairs: 32 x your GPU count (per_device_train_batch_size "
                                         "4 x gradient_accumulation_steps 8"),
    ("lr_scheduler_type", "cosine", "optim.schedule: cosine"),
    ("lr_scheduler_type", "constant_with_warmup", "optim.schedule: constant"),
    ("warmup_ratio", "0.1", "optim.warmup_ratio: 0.1"),
    ("finetuning_type", "lora", "lora.enabled: true"),
    ("finetuning_type", "full", "lora.enabled: false"),
    ("lora_rank", "16", "lora.r: 16"),
    ("lora_alpha", "32", "lora.alpha: 32"),
    ("lora_dropout", "0.05", "lora.dropout: 0.05"),
    ("lora_target", "all", "lora.target_modules: all-linear"),
    ("lora_target", "q_proj,v_proj", "lora.target_modules: [q_proj, v_proj]"),
    ("output_dir", "saves/x", "run.output_dir: saves/x"),
    ("model_name_or_path", "Qwen/Qwen3-4B", "model.name_or_path: Qwen/Qwen3-4B"),
    ("dataset", "dpo_en_demo", "prefpack prepare DATASET_DIR/FILE -o STORE"),
    ("dataset_dir", "data", "prefpack prepare DATASET_DIR/FILE -o STORE"),
    ("template", "qwen3_nothink", "prefpack prepare --chat-template FILE.jinja"),
    ("stage", "dpo", "train.objective: preference"),
    ("stage", "kto", "loss.terms: [{name: kto}] on an unpaired store (prefpack prepare --format kto-messages)"),
    ("stage", "rm", "train.objective: reward"),
    ("ref_model", "base", "reference.model: base"),
    ("quantization_bit", "4", "model.quantization: nf4"),
])
def test_each_llama_factory_key_is_mapped(key, value, want):
    overrides = [f"{key}={value}"] + (["gradient_accumulation_steps=8"] if key == "per_device_train_batch_size"
                                      else [])
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    line = str(err.value).splitlines()[0] if len(overrides) == 1 else lines_of(str(err.value))[0]
    assert re.search(rf"{key}'? \((TRL, )?LLaMA-Factory\) -> ", line), line
    assert want in line, line


@pytest.mark.parametrize("text", [LF_DPO, LF_KTO, LF_RM], ids=["dpo", "kto", "reward"])
def test_llama_factory_example_configs_are_mapped_key_by_key(tmp_path, text):
    """Every key of LLaMA-Factory's own LoRA DPO, KTO and reward examples is recognised as its name, in one error."""
    keys = [line.split(":")[0] for line in text.splitlines()]
    message = error_of(tmp_path, text)
    lines = lines_of(message)
    assert message.startswith(f"{len(keys)} unknown keys"), message
    assert [line.split(" ", 1)[0] for line in lines] == keys
    bare = [line for line in lines if not re.search(r" \((TRL, )?LLaMA-Factory\) -> ", line)]
    assert not bare, "\n".join(bare)


def test_valid_configs_are_unaffected(tmp_path):
    for path in sorted((REPO / "examples" / "configs").glob("*.yaml")):
        load_config(path, [])
    path = tmp_path / "ok.yaml"
    path.write_text("model:\n  name_or_path: m\nloss:\n  beta: 0.2\n  terms: [{name: sigmoid}, {name: nll, "
                    "weight: 0.5}]\ndata:\n  train: [{path: a, weight: 1}]\n", encoding="utf-8")
    cfg = load_config(path, ["optim.lr=1e-6", "lora={enabled: true, r: 4}"])
    assert (cfg.loss.beta, cfg.optim.lr, cfg.lora.r, cfg.loss.terms[1].weight) == (0.2, 1e-6, 4, 0.5)
    # a type error is still its own one-line error, unknown keys first only when there are some
    with pytest.raises(ConfigError, match=r"^optim\.lr: expected a float"):
        load_config(path, ["optim.lr=abc"])


def test_one_unknown_key_keeps_its_one_line_form():
    with pytest.raises(ConfigError, match=r"^unknown key 'optim\.learning_rate' \(did you mean 'optim\.lr'\?\) "
                                          r"\(in override 'optim\.learning_rate=1'\)$"):
        load_config(None, ["optim.learning_rate=1"])
    with pytest.raises(ConfigError, match=r"^unknown key 'data\.train\[1\]\.wieght'"):
        load_config(None, ["data.train=[{path: a}, {path: b, wieght: 2}]"])


def test_every_mapping_names_real_keys_and_flags():
    keys = config_keys()
    sections = "|".join(f.name for f in fields(Config))
    options = cli_options()
    everywhere = set().union(*options.values())
    bad = []
    for name, entry in FOREIGN.items():
        if entry.key is not None and entry.key not in keys:
            bad.append(f"{name}: no config key {entry.key!r}")
        for value in (1, "x", None, True, [1]):  # any value renders (an odd one still names the key)
            text = entry.render(value, {name: value})
            if entry.key is not None and entry.key not in text:
                bad.append(f"{name}: the line does not name {entry.key!r}: {text}")
            bad += [f"{name}: no config key {k!r}" for k in re.findall(rf"\b(?:{sections})\.[a-z_]+", text)
                    if k not in keys and k.rsplit(".", 1)[0] not in keys]
            bad += [f"{name}: no option {f}" for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)
                    if f not in everywhere]
            for sub in re.findall(r"prefpack ([a-z-]+)", text):
                if sub not in options:
                    bad.append(f"{name}: no subcommand {sub}")
    assert not bad, "\n".join(bad)


def lf_rows() -> list[list[str]]:
    text = PAGE.read_text(encoding="utf-8")
    assert text.count(LF_HEADING) == 1
    rows = []
    for line in text.split(LF_HEADING, 1)[1].splitlines():
        if line.startswith("## "):
            break
        if line.startswith("| `"):
            cells = split_cells(line)
            assert len(cells) == 3, line
            rows.append(cells)
    return rows


def test_llama_factory_table_matches_the_mapping_and_names_what_exists():
    rows = lf_rows()
    names = [re.fullmatch(r"`([a-z_0-9]+)`", r[0]).group(1) for r in rows]
    assert len(names) == len(set(names)), "a LLaMA-Factory key with two rows"
    mapped_lf = {n for n, e in FOREIGN.items() if LF in e.origin}
    assert not set(names) - set(FOREIGN), f"rows the error does not map: {sorted(set(names) - set(FOREIGN))}"
    assert not {n for n, e in FOREIGN.items() if e.origin == LF} - set(names), "LLaMA-Factory-only names with no row"
    keys, options = config_keys(), cli_options()
    sections = {f.name for f in fields(Config)}
    bad = []
    for name, (_, ours, notes) in zip(names, rows):
        entry = FOREIGN[name]
        if entry.key is not None and f"`{entry.key}`" not in ours:
            bad.append(f"{name}: the table says {ours}, the error {entry.key}")
        if ours == "—" and not notes:
            bad.append(f"{name}: maps to nothing and says not why")
        for cell in (ours, notes):
            bad += [f"{name}: {p}" for p in problems_in(cell, keys, options, sections)[0]]
    assert not bad, "\n".join(bad)
    for key in ("pref_beta", "pref_loss", "pref_ftx", "simpo_gamma", "dpo_label_smoothing", "kto_chosen_weight",
                "kto_rejected_weight", "cutoff_len", "stage", "finetuning_type", "lora_rank", "lora_target",
                "template", "dataset", "dataset_dir"):
        assert key in names and key in mapped_lf, key
