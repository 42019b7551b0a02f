"""Issue 50, item 4: folders are what they claim. A sequence classifier (a reward model) given as the policy to train
or sample is refused in one line (transformers would load it under a random language-model head); a LoRA adapter is
read only as prefpack reads weights: a pickled adapter_model.bin, a damaged safetensors file, a config of another
adapter type, and an adapter of another base are each one line naming the setting and the folder."""

from __future__ import annotations

import json

import pytest
import torch

from prefpack.generation.engine import GenerationError
from prefpack.model import ModelError


@pytest.fixture(scope="module")
def folders(tmp_path_factory, toy_tokenizers):
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("claims")
    tok = tf.AutoTokenizer.from_pretrained(toy_tokenizers["llama"])

    def llama(hidden: int):
        return tf.LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                              pad_token_id=tok.eos_token_id)

    torch.manual_seed(0)
    tf.LlamaForCausalLM(llama(16)).save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    tf.LlamaForSequenceClassification(llama(16)).save_pretrained(root / "classifier")
    tok.save_pretrained(root / "classifier")
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    get_peft_model(tf.LlamaForCausalLM(llama(16)), lora).save_pretrained(root / "adapter")
    get_peft_model(tf.LlamaForCausalLM(llama(32)), lora).save_pretrained(root / "other_base_adapter")
    return root


def sample_with(folders, tmp_path, toy_tokenizers, model: str, adapter: str | None = None):
    from prefpack.generation.run import GenerateOptions, generate

    rows = tmp_path / "prompts.jsonl"
    rows.write_text(json.dumps({"prompt": "Human: hi?\n\nAssistant:"}) + "\n")
    generate(GenerateOptions(output=str(tmp_path / "s.jsonl"), model=model, adapter=adapter, inputs=[str(rows)],
                             tokenizer=str(toy_tokenizers["llama"]), n=1, temperature=0, max_new_tokens=2,
                             device="cpu"), log=lambda *_: None)


def test_a_classifier_given_as_the_policy_is_refused_in_one_line(folders, tmp_path, toy_tokenizers):
    with pytest.raises(ModelError) as err:
        sample_with(folders, tmp_path, toy_tokenizers, str(folders / "classifier"))
    assert "\n" not in str(err.value) and "sequence classifier (LlamaForSequenceClassification" in str(err.value)
    from prefpack.model.weights import WeightSpec, load_weights

    with pytest.raises(ModelError, match="not a causal language model"):  # the training policy's load too
        load_weights(WeightSpec(str(folders / "classifier"), "train", torch.device("cpu"), dtype=torch.float32,
                                attn="sdpa", packed=False))
    sample_with(folders, tmp_path, toy_tokenizers, str(folders / "base"))  # the causal LM itself loads


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("damage, words", [
    ("pickle", "only adapter_model.bin, a pickle"),
    ("truncated", "adapter_model.safetensors is damaged"),
    ("prefix_tuning", "describes a 'PREFIX_TUNING' adapter"),
    ("not_json", "adapter_config.json is not readable JSON"),
    ("other_base", "the adapter does not fit this base model"),
])
def test_an_adapter_that_is_not_what_it_claims_is_refused_in_one_line(folders, tmp_path, toy_tokenizers, damage,
                                                                       words):
    adapter = _copy(folders / ("other_base_adapter" if damage == "other_base" else "adapter"), tmp_path / "a")
    weights = adapter / "adapter_model.safetensors"
    if damage == "pickle":
        torch.save({"x": torch.zeros(1)}, adapter / "adapter_model.bin")
        weights.unlink()
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:40])
    elif damage == "prefix_tuning":
        config = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "PREFIX_TUNING"}))
    elif damage == "not_json":
        (adapter / "adapter_config.json").write_text("{not json")
    with pytest.raises(GenerationError) as err:
        sample_with(folders, tmp_path, toy_tokenizers, str(folders / "base"), adapter=str(adapter))
    message = str(err.value)
    assert "\n" not in message and words in message and "--adapter" in message, message


def test_eval_of_a_reward_model_says_which_settings_do_not_apply(folders, tmp_path, toy_tokenizers, capsys):
    """A reward model evaluated with a DPO run's --config, --ref and --beta: scored by its own objective, and one note
    names what of those it did not use."""
    import transformers as tf

    from prefpack.cli import main
    from prefpack.config import load_config, save_config
    from prefpack.data.prepare import PrepareOptions, prepare

    tok = tf.AutoTokenizer.from_pretrained(toy_tokenizers["llama"])
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.eos_token_id)
    tf.LlamaForSequenceClassification(cfg).save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    rows = tmp_path / "pairs.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Human: {i}?\n\nAssistant:", "chosen": " yes", "rejected": " no"})
                            + "\n" for i in range(4)))
    prepare(PrepareOptions(inputs=[str(rows)], output=str(tmp_path / "store"), tokenizer=str(toy_tokenizers["llama"])))
    run_cfg = load_config(None, ["loss.beta=0.3", "reference.mode=copy"])
    save_config(run_cfg, tmp_path / "run.yaml")
    code = main(["eval", "--model", str(tmp_path / "rm"), "--data", str(tmp_path / "store"), "--config",
                 str(tmp_path / "run.yaml"), "--ref", str(folders / "base"), "--beta", "0.2"])
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "is a reward model" in line]
    assert code == 0 and len(notes) == 1, err
    assert "--ref" in notes[0] and "--beta" in notes[0] and "run.yaml's loss terms" in notes[0]


def test_a_reward_model_of_another_tokenizer_reads_the_text_with_its_own(tmp_path, toy_tokenizers, capsys):
    """Issue 50: a reward model saved with its own tokenizer scored another tokenizer's ids as if they were its own;
    issue 51: it re-tokenises the rows' text with its own tokenizer instead, said in one line (the scores: tests/
    test_score_rm_tokenizer.py)."""
    import transformers as tf

    from prefpack.cli import main

    own = tf.AutoTokenizer.from_pretrained(toy_tokenizers["llama"])
    cfg = tf.LlamaConfig(vocab_size=2 * len(own), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=own.eos_token_id)
    tf.LlamaForSequenceClassification(cfg).save_pretrained(tmp_path / "rm")
    own.save_pretrained(tmp_path / "rm")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "Human: hi?\n\nAssistant:", "completions": [" yes", " no"]}) + "\n")
    args = ["score", str(rows), "-o", str(tmp_path / "scored.jsonl"), "--reward-model", str(tmp_path / "rm"),
            "--format", "jsonl", "--tokenizer"]
    capsys.readouterr()
    assert main([*args, str(toy_tokenizers["neox"])]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(err) == 1 and "the reward model's tokenizer differs from the input rows'" in err[0]
    assert main([*args, str(toy_tokenizers["llama"]), "--overwrite"]) == 0  # its own tokenizer's ids score
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
