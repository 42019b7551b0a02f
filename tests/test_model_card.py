"""The model card ``save_final`` writes (``final/README.md``, ``prefpack.training.checkpoint.card``): its YAML header
parses with the peers' fields, policies, LoRA adapters and reward models name their method and its citation, a
user's README is kept, and a reward model loads as a transformers ``text-classification`` pipeline whose scores, by
the call its card shows, equal prefpack's own (plain text rows, and chat rows with the template in the tokenizer)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import make_task, metrics_lines, quiet, tiny_llama, write_jsonl

from prefpack.config import load_config
from prefpack.data.prepare import PrepareOptions, prepare
from prefpack.data.store import Store
from prefpack.training import train
from prefpack.training.checkpoint.card import MARKER

DATA = Path(__file__).parent / "data"
TRL_ASSETS = DATA / "trl_losses"  # a tiny causal LM, its tokenizer and 16 hh pairs
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def card(folder: Path) -> tuple[dict, str]:
    """(YAML header, body) of ``folder/README.md``."""
    text = (folder / "README.md").read_text(encoding="utf-8")
    assert text.startswith("---\n")
    head, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(head), body


def scoring_call(body: str) -> str:
    """The pipeline call the card's quick start prints the score of."""
    found = re.search(r'print\((rm\(.*\))\[0\]\["score"\]\)', body)
    assert found, body
    return found.group(1)


def prefpack_rewards(final: Path, store: Path, n: int) -> list[float]:
    """Rewards of the store's first ``n`` pairs (chosen, rejected, ...) by prefpack's own forward."""
    from prefpack.model.load import load_causal_lm
    from prefpack.model.reward import SequenceRewards
    from prefpack.objectives.base import Planned
    from prefpack.objectives.reward import RewardPairTask

    model = load_causal_lm(str(final), attn_implementation="packed_sdpa", device=torch.device("cpu"),
                           reward=True).eval()
    task = make_task(RewardPairTask, Store(store), load_config(None, ["train.objective=reward"]))
    with torch.no_grad():
        return SequenceRewards(model)(task.collate(Planned([list(range(n))], 0, 0))).tolist()


def _reward_run(store: Path, model: Path, out: Path, *extra: str):
    return train(load_config(None, [f"model.name_or_path={model}", f"data.train={store}", f"data.eval={store}",
                                    "train.objective=reward", "train.global_batch_pairs=8", "train.max_steps=2",
                                    "optim.lr=1e-3", "run.plot=false", "run.report_to=none", "run.save_every=0",
                                    f"run.output_dir={out}", *extra]), progress=False, log=quiet)


def test_reward_model_card_and_pipeline_scores_equal_prefpack(tmp_path, one_thread):
    """A reward model trained on text pairs: its card's header and body, and `pipeline("text-classification")` on
    four pairs, called as the card shows (prompt + completion + EOS), equal to prefpack's rewards of the store."""
    from transformers import pipeline

    store = tmp_path / "store"
    prepare(PrepareOptions(inputs=[str(TRL_ASSETS / "pairs.jsonl")], tokenizer=str(TRL_ASSETS / "tokenizer"),
                           output=str(store), max_length=512, workers=1), log=quiet)
    res = _reward_run(store, TRL_ASSETS / "reference", tmp_path / "run")
    head, body = card(res.final_dir)
    assert head["library_name"] == "transformers" and head["pipeline_tag"] == "text-classification"
    assert head["tags"][:2] == ["prefpack", "reward-model"] and "base_model" not in head  # a local folder: no hub id
    assert "datasets" not in head  # a local JSONL file: no hub dataset
    assert MARKER in body and "Bradley-Terry" in body and "2203.02155" in body and "@misc{ouyang2022training" in body
    last = metrics_lines(res.run_dir, "eval")[-1]
    assert "### Last evaluation (step 2)" in body and f"| rewards/accuracies | {last['rewards/accuracies']:.6g} |" in body
    assert "- PyTorch: " in body and "- Transformers: " in body and "| `optim.lr` | 0.001 |" in body

    call = scoring_call(body)
    assert call == "rm(prompt + completion + tok.eos_token)"
    rm = pipeline("text-classification", model=str(res.final_dir), function_to_apply="none")
    assert rm.model.config.num_labels == 1 and rm.model.config.pad_token_id is not None
    rows = [json.loads(line) for line in (TRL_ASSETS / "pairs.jsonl").read_text(encoding="utf-8").splitlines()[:4]]
    scores = [eval(call, {"rm": rm, "tok": rm.tokenizer, "prompt": r["prompt"], "completion": c})[0]["score"]
              for r in rows for c in (r["chosen"], r["rejected"])]
    ours = prefpack_rewards(res.final_dir, store, 4)
    assert scores == pytest.approx(ours, abs=1e-5)
    no_eos = [rm(r["prompt"] + r["chosen"])[0]["score"] for r in rows]
    assert no_eos != pytest.approx(ours[0::2], abs=1e-3)  # what the card's EOS is for
    batched = [o["score"] for o in rm([r["prompt"] + c + rm.tokenizer.eos_token for r in rows
                                       for c in (r["chosen"], r["rejected"])])]  # padded batches: the pad token
    assert batched == pytest.approx(ours, abs=1e-5)


def test_chat_reward_model_carries_its_template_and_scores_conversations_as_prefpack(tmp_path, toy_tokenizers,
                                                                                      one_thread):
    """Chat rows rendered with `prepare --chat-template FILE` for a tokenizer without a template: the saved tokenizer
    carries that template, and the pipeline on `apply_chat_template(messages)`, called as the card shows, equals
    prefpack's rewards."""
    from transformers import pipeline

    rows = [{"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": c}],
             "rejected": [{"role": "assistant", "content": r}]}
            for q, c, r in [("What is two plus two?", "Four.", "Five."), ("Name a colour.", "Blue.", "A dog."),
                            ("Say hello.", "Hello!", "Go away."), ("Is ice cold?", "Yes, it is.", "No.")] * 2]
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML, encoding="utf-8")
    store = tmp_path / "store"
    prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "chat.jsonl", rows))],
                           tokenizer=str(toy_tokenizers["llama"]), output=str(store), chat_template=str(template),
                           workers=1), log=quiet)
    res = _reward_run(store, tiny_llama(toy_tokenizers["llama"], tmp_path / "model", 0), tmp_path / "run")
    rm = pipeline("text-classification", model=str(res.final_dir), function_to_apply="none")
    assert rm.tokenizer.chat_template == CHATML
    head, body = card(res.final_dir)
    assert "apply_chat_template(messages, tokenize=False)" in body
    call = scoring_call(body)
    scores = []
    for r in rows[:4]:
        for c in (r["chosen"], r["rejected"]):
            text = rm.tokenizer.apply_chat_template(r["prompt"] + c, tokenize=False)
            scores.append(eval(call, {"rm": rm, "tok": rm.tokenizer, "text": text})[0]["score"])
    assert scores == pytest.approx(prefpack_rewards(res.final_dir, store, 4), abs=1e-5)


@pytest.fixture(scope="module")
def policy_world(tmp_path_factory, toy_tokenizers, hh_train):
    """A pair store prepared from a file in the hub cache's layout (datasets--Anthropic--hh-rlhf), and a tiny policy
    whose own card names its base model and licence."""
    root = tmp_path_factory.mktemp("card")
    tok = toy_tokenizers["llama"]
    rows = [r for r in hh_train[:60] if r["chosen"].strip() and r["chosen"] != r["rejected"]][:16]
    cached = root / "hub" / "datasets--Anthropic--hh-rlhf" / "snapshots" / "0abc"
    cached.mkdir(parents=True)
    src = write_jsonl(cached / "train.jsonl", rows)
    prepare(PrepareOptions(inputs=[str(src)], tokenizer=str(tok), output=str(root / "store"), max_length=48,
                           min_prompt_keep=0, workers=1), log=quiet)
    policy = tiny_llama(tok, root / "policy", 1)
    (policy / "README.md").write_text("---\nbase_model: org/tiny-base\nlicense: apache-2.0\n---\n# a tiny model\n")
    return {"store": root / "store", "policy": policy}


def _policy_cfg(world, out, *extra):
    return load_config(None, [f"model.name_or_path={world['policy']}", f"data.train={world['store']}",
                              f"data.eval={world['store']}", "train.global_batch_pairs=8", "train.max_steps=1",
                              "optim.lr=1e-3", "optim.schedule=constant", "run.plot=false", "run.report_to=none",
                              f"run.output_dir={out}", *extra])


def test_policy_card_fields_and_a_users_readme_is_kept(policy_world, tmp_path, one_thread):
    """DPO: base model and licence from the policy folder's own card, the hub dataset from the store's source, the
    method and its citation, the settings; a resumed run writes its card again, and keeps the user's own."""
    run = tmp_path / "run"
    res = train(_policy_cfg(policy_world, run, "loss.beta=0.25"), progress=False, log=quiet)
    head, body = card(res.final_dir)
    assert head["base_model"] == "org/tiny-base" and head["license"] == "apache-2.0"
    assert head["datasets"] == ["Anthropic/hh-rlhf"] and head["library_name"] == "transformers"
    assert head["tags"] == ["prefpack", "dpo"]
    assert "Rafailov et al. 2023" in body and "2305.18290" in body and "@misc{rafailov2023direct" in body
    assert "| `loss.beta` | 0.25 |" in body and "| `loss.terms` | sigmoid (weight 1) |" in body
    assert "AutoModelForCausalLM.from_pretrained" in body and "### Last evaluation (step 1)" in body
    train(_policy_cfg(policy_world, run, "loss.beta=0.25", "train.max_steps=2"), resume=True, progress=False,
          log=quiet)
    assert "### Last evaluation (step 2)" in card(run / "final")[1]  # prefpack's card: written again
    (run / "final" / "README.md").write_text("# my model card\n")
    train(_policy_cfg(policy_world, run, "loss.beta=0.25", "train.max_steps=3"), resume=True, progress=False,
          log=quiet)
    assert (run / "final" / "README.md").read_text() == "# my model card\n"


def test_lora_kto_card_and_adapter_card(policy_world, tmp_path, one_thread):
    """A LoRA KTO run: the merged model's card (library transformers) and the adapter's (library peft), each naming
    KTO and its paper."""
    res = train(_policy_cfg(policy_world, tmp_path / "run", "lora.enabled=true", "lora.r=4",
                            "loss.terms=[{name: kto}]", "data.paired_as_kto=true", "data.eval=null"),
                progress=False, log=quiet)
    head, body = card(res.final_dir)
    assert head["library_name"] == "transformers" and head["tags"] == ["prefpack", "kto", "lora", "merged"]
    assert "Ethayarajh et al. 2024" in body and "2402.01306" in body and "| `lora` | r 4, alpha 16" in body
    assert "Last evaluation" not in body  # none was run
    ahead, abody = card(res.final_dir / "adapter")
    assert ahead["library_name"] == "peft" and ahead["base_model"] == "org/tiny-base"
    assert ahead["tags"] == ["prefpack", "kto", "lora"] and "2402.01306" in abody
    assert f'from_pretrained("{policy_world["policy"]}")' in abody and 'PeftModel.from_pretrained(base, "' in abody


@pytest.mark.parametrize(("overrides", "tags", "arxiv"), [
    (["train.objective=policy_gradient", "loss.terms=[{name: grpo}]"], ["grpo"], "2402.03300"),
    (["loss.terms=[{name: sigmoid}, {name: nll, weight: 0.2}]"], ["dpo", "rpo"], "2404.19733"),
    (["loss.terms=[{name: simpo}]", "reference.mode=none"], ["simpo"], "2405.14734"),
])
def test_method_and_citation_from_the_registries(overrides, tags, arxiv):
    from prefpack.training.checkpoint.card import CardFacts, _method, render

    m = _method(load_config(None, overrides), reward=False)
    assert m.tags == tags and arxiv in {a for _, a in m.papers}
    text = render(CardFacts("run", "policy", m), shown_path="run/final")
    assert yaml.safe_load(text.split("---\n")[1])["tags"] == ["prefpack", *tags]
    assert f"eprint = {{{arxiv}}}" in text


def test_base_model_is_a_hub_id_or_omitted(tmp_path):
    from prefpack.training.checkpoint.card import _base_model

    assert _base_model("Qwen/Qwen3-0.6B")[0] == "Qwen/Qwen3-0.6B"
    assert _base_model(str(tmp_path)) == (None, None)  # a local folder, no card
    cached = tmp_path / "models--org--name" / "snapshots" / "abc"
    cached.mkdir(parents=True)
    assert _base_model(str(cached))[0] == "org/name"
    assert _base_model("./not/a/hub id") == (None, None)
    shutil.rmtree(cached)
