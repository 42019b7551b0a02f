"""Issue 51, item 1: a reward model's own tokenizer is compared with the input's (``prefpack score --reward-model``,
``rounds.reward_model``). The same tokenizer: the ids are scored as before, byte for byte. Another: each prompt +
completion is re-tokenised from its text with the reward model's tokenizer and chat template (TRL's online trainers
do the same), said in one line; the scores equal the model run on those texts tokenised here by hand. A store, a
samples file of ids only, or chat messages for a tokenizer without a template: one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from conftest import write_jsonl

from prefpack.cli import main
from prefpack.rewards.run import ScoreOptions, score

# a Llama-2-like chat template for the toy Llama tokenizer (the "Llama-based reward model" of a Qwen-like policy)
LLAMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
                  "{{ ' ' + m['content'] + eos_token }}{% else %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
                  "{% endif %}{% endfor %}")
PLAIN = [("\n\nHuman: What is two plus two?\n\nAssistant:", [" Four.", " Five, I think.", " Four, or"],
          [False, False, True]),
         ("\n\nHuman: Name a colour.\n\nAssistant:", [" Blue.", " A dog that barks"], [False, True])]
CHATS = [([{"role": "user", "content": "What is two plus two?"}], ["Four.", "Five, I think."]),
         ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
           {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}],
          ["Red.", "A dog.", "Green, or perhaps a quiet grey."])]


def reward_model(folder, tok_dir, seed=0, template=None):
    """A one-layer Llama reward model saved with the tokenizer of ``tok_dir`` (and ``template`` as its chat
    template); returns the model (float64, eval) and its tokenizer."""
    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    if template is not None:
        tok.chat_template = template
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.eos_token_id)
    model = tf.LlamaForSequenceClassification(cfg).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model.double(), tok


def by_hand(model, ids: list[int]) -> float:
    """The model's head read at the sequence's last token, the sequence run alone."""
    with torch.no_grad():
        return model.score(model.model(torch.tensor([ids])).last_hidden_state[0, -1]).item()


def write_samples(folder, tok_dir, plain=True):
    """A samples file as prefpack generate writes it, from the policy tokenizer ``tok_dir``: plain prompts (the
    tokenizer's BOS, completions ending in EOS unless cut) or chat prompts (``messages`` kept, the policy's own
    template); returns the file."""
    from prefpack.tokenizer import HASH_VERSION, tokenizer_hash

    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    rows = []
    for i, (prompt, comps, *cut) in enumerate(PLAIN if plain else CHATS):
        cut = cut[0] if cut else [False] * len(comps)
        if plain:
            p = tok(prompt)["input_ids"]
            c = [tok(t, add_special_tokens=False)["input_ids"] + ([] if k else [tok.eos_token_id])
                 for t, k in zip(comps, cut)]
        else:
            p = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
            c = [tok(t + tok.eos_token, add_special_tokens=False)["input_ids"] for t in comps]
        row = {"prompt_ids": p, "completion_ids": c, "prompt": tok.decode(p, skip_special_tokens=False),
               "completions": [tok.decode(x, skip_special_tokens=True) for x in c], "truncated": cut, "row": i}
        rows.append(row if plain else {**row, "messages": prompt})
    path = write_jsonl(folder / "samples.jsonl", rows)
    (folder / "samples.meta.json").write_text(json.dumps(
        {"tokenizer": {"name": str(tok_dir), "hash": tokenizer_hash(tok), "hash_version": HASH_VERSION},
         "generation": {"n": 2, "temperature": 1.0}}))
    return path, rows


def run(tmp_path, samples, rm, out="scored.jsonl", **kw) -> tuple[list[dict], list[str]]:
    notes = []
    score(ScoreOptions(input=str(samples), output=str(tmp_path / out), reward_model=str(rm), format="jsonl",
                       dtype="float64", batch_tokens=64, progress=False, **kw), log=notes.append)
    return [json.loads(x) for x in (tmp_path / out).read_text().splitlines()], notes


def test_the_same_tokenizer_scores_the_ids_as_before(tmp_path, toy_tokenizers, one_thread):
    samples, rows = write_samples(tmp_path, toy_tokenizers["llama"])
    model, _ = reward_model(tmp_path / "rm", toy_tokenizers["llama"])
    got, notes = run(tmp_path, samples, tmp_path / "rm")
    assert notes == []
    for row, out in zip(rows, got):
        assert out["scores"] == pytest.approx([by_hand(model, row["prompt_ids"] + c) for c in row["completion_ids"]],
                                              rel=1e-10, abs=1e-12)
    # byte for byte what the same weights score with no tokenizer in their folder (no check: today's path)
    bare = tmp_path / "bare"
    tf.LlamaForSequenceClassification.from_pretrained(tmp_path / "rm").save_pretrained(bare)
    run(tmp_path, samples, bare, out="bare.jsonl")
    assert (tmp_path / "bare.jsonl").read_bytes() == (tmp_path / "scored.jsonl").read_bytes()


def test_another_tokenizer_rescores_plain_samples_from_their_text(tmp_path, toy_tokenizers, one_thread):
    """A Llama-style policy (BOS) scored by a NeoX-style reward model: the prompt's text without the policy's BOS,
    the completion's text, the reward model's EOS unless the completion was cut."""
    samples, rows = write_samples(tmp_path, toy_tokenizers["llama"])
    model, rm_tok = reward_model(tmp_path / "rm", toy_tokenizers["neox"])
    got, notes = run(tmp_path, samples, tmp_path / "rm")
    assert len(notes) == 1 and notes[0].startswith("note: the reward model's tokenizer differs from the samples' ("), notes
    assert "re-tokenising 5 completions from their text with its own tokenizer" in notes[0]
    assert "and chat template" not in notes[0] and "\n" not in notes[0]
    for (prompt, texts, cut), row, out in zip(PLAIN, rows, got):
        assert out["completion_ids"] == row["completion_ids"]  # the output keeps the samples' own ids
        expected = [by_hand(model, rm_tok(prompt)["input_ids"] + rm_tok(t, add_special_tokens=False)["input_ids"]
                            + ([] if k else [rm_tok.eos_token_id])) for t, k in zip(texts, cut)]
        assert out["scores"] == pytest.approx(expected, rel=1e-10, abs=1e-12)
        stale = [by_hand(model, row["prompt_ids"] + c) for c in row["completion_ids"]]  # the policy's ids: wrong
        assert out["scores"] != pytest.approx(stale, rel=1e-6)


@pytest.mark.parametrize("policy,rm,template", [("chatml", "llama", LLAMA_TEMPLATE), ("neox", "chatml", None)])
def test_another_tokenizer_renders_chat_samples_with_its_own_template(tmp_path, toy_tokenizers, one_thread, policy,
                                                                      rm, template):
    """A Qwen-like (ChatML) policy scored by a Llama-based reward model with its own template, and the other way:
    each completion scored as apply_chat_template(messages + [{"role": "assistant", "content": completion}]) with the
    reward model's tokenizer, as TRL's online trainers score it."""
    if policy == "neox":  # a policy without a template: its prompt ids from any text; the messages are what count
        tok = tf.AutoTokenizer.from_pretrained(toy_tokenizers["neox"])
        tok.chat_template = "{% for m in messages %}{{ m['content'] + '\n' }}{% endfor %}"
        tok.save_pretrained(tmp_path / "policy")
        policy_dir = tmp_path / "policy"
    else:
        policy_dir = toy_tokenizers[policy]
    samples, rows = write_samples(tmp_path, policy_dir, plain=False)
    model, rm_tok = reward_model(tmp_path / "rm", toy_tokenizers[rm], template=template)
    got, notes = run(tmp_path, samples, tmp_path / "rm")
    assert len(notes) == 1 and "re-tokenising 5 completions from their text with its own tokenizer and chat " \
        "template" in notes[0], notes
    for (messages, texts), out in zip(CHATS, got):
        expected = []
        for t in texts:
            text = rm_tok.apply_chat_template(messages + [{"role": "assistant", "content": t}], tokenize=False)
            expected.append(by_hand(model, rm_tok(text, add_special_tokens=False)["input_ids"]))
        assert out["scores"] == pytest.approx(expected, rel=1e-10, abs=1e-12)


def test_text_rows_of_another_tokenizer_are_read_again_with_the_reward_models(tmp_path, toy_tokenizers, one_thread):
    """JSONL text rows given with --tokenizer of another tokenizer: scored as if read with the reward model's (as
    prepare would tokenise them for it)."""
    model, _ = reward_model(tmp_path / "rm", toy_tokenizers["llama"])
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": p, "completions": c} for p, c, _ in PLAIN])
    got, notes = run(tmp_path, rows, tmp_path / "rm", tokenizer=str(toy_tokenizers["neox"]))
    assert len(notes) == 1 and "differs from the input rows'" in notes[0], notes
    same, none = run(tmp_path, rows, tmp_path / "rm", out="own.jsonl")  # read with the reward model's own tokenizer
    assert none == [] and [r["scores"] for r in got] == [r["scores"] for r in same]
    assert got[0]["completion_ids"] != same[0]["completion_ids"]  # each output keeps the ids of its own tokenizer


def test_allow_tokenizer_mismatch_scores_the_ids_as_they_are(tmp_path, toy_tokenizers, one_thread):
    samples, rows = write_samples(tmp_path, toy_tokenizers["llama"])
    model, _ = reward_model(tmp_path / "rm", toy_tokenizers["neox"])
    got, notes = run(tmp_path, samples, tmp_path / "rm", allow_tokenizer_mismatch=True)
    assert len(notes) == 1 and "scored as they are (allow_tokenizer_mismatch)" in notes[0], notes
    for row, out in zip(rows, got):
        assert out["scores"] == pytest.approx([by_hand(model, row["prompt_ids"] + c) for c in row["completion_ids"]],
                                              rel=1e-10, abs=1e-12)


def cli_error(capsys, *argv) -> str:
    capsys.readouterr()
    assert main(["score", *map(str, argv), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_what_cannot_be_re_tokenised_is_a_one_line_error(tmp_path, toy_tokenizers, capsys, one_thread):
    from prefpack.data.prepare import PrepareOptions, prepare

    reward_model(tmp_path / "rm", toy_tokenizers["llama"])
    # samples of ids only (no texts): the file and line named, and what to do
    samples, rows = write_samples(tmp_path, toy_tokenizers["neox"])
    write_jsonl(samples, [{k: v for k, v in r.items() if k not in ("prompt", "completions")} for r in rows])
    err = cli_error(capsys, samples, "-o", tmp_path / "out", "--reward-model", tmp_path / "rm")
    assert f"{samples} line 1 holds token ids without 'completions' texts" in err and "prefpack generate" in err
    # chat messages, and the reward model's tokenizer has no chat template
    (tmp_path / "chat").mkdir()
    chat, _ = write_samples(tmp_path / "chat", toy_tokenizers["chatml"], plain=False)
    err = cli_error(capsys, chat, "-o", tmp_path / "out", "--reward-model", tmp_path / "rm")
    assert "holds chat messages, but the reward model's tokenizer has no chat template" in err
    # a store: token ids only
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": p, "chosen": c[0], "rejected": c[1]} for p, c, _ in PLAIN])
    prepare(PrepareOptions(inputs=[str(pairs)], tokenizer=str(toy_tokenizers["neox"]), output=str(tmp_path / "store"),
                           workers=1), log=lambda m: None)
    err = cli_error(capsys, tmp_path / "store", "-o", tmp_path / "out", "--reward-model", tmp_path / "rm")
    assert "holds token ids only" in err and "score the rows it was prepared from" in err
    assert not (tmp_path / "out").exists()


def test_a_round_scores_with_a_reward_model_of_another_tokenizer(tmp_path, toy_tokenizers, one_thread):
    """rounds.reward_model goes through the same scorer: a Llama-style policy's samples scored by a NeoX-style reward
    model from their text (the round's rewards equal the texts scored by hand), said in the round's log."""
    import math

    from conftest import read_jsonl

    from prefpack.rounds import run_rounds
    from tests.test_rounds import config

    task_dir = tmp_path_factory_task(tmp_path)
    model, rm_tok = reward_model(tmp_path / "rm", toy_tokenizers["neox"])
    lines = []
    run_rounds(config(task_dir, "rm_rounds", "rounds.count=1", "rounds.steps_per_round=1", "rounds.eval_prompts=null",
                      "rounds.reward_fn=null", f"rounds.reward_model={tmp_path / 'rm'}", "rounds.max_new_tokens=3",
                      "rounds.samples_per_prompt=2"), log=lines.append, progress=False)
    said = [x for x in lines if "re-tokenising" in x]
    assert len(said) == 1 and "differs from the samples'" in said[0], lines
    folder = task_dir / "rm_rounds" / "rounds" / "001"
    values = []
    for row in read_jsonl(folder / "samples.jsonl"):
        prompt = row["prompt"].removeprefix("<s>")
        for text, cut in zip(row["completions"], row["truncated"]):
            ids = rm_tok(prompt)["input_ids"] + rm_tok(text, add_special_tokens=False)["input_ids"]
            values.append(by_hand(model, ids + ([] if cut else [rm_tok.eos_token_id])))
    line = json.loads((folder / "round.json").read_text())
    assert line["reward/mean"] == pytest.approx(math.fsum(values) / len(values), abs=1e-5)
    assert json.loads((folder / "store" / "meta.json").read_text())["scoring"]["tokens"] == "retokenised"


def tmp_path_factory_task(tmp_path):
    """The quickstart task of tests/test_rounds.py (a Llama-style toy policy and its prompts), built here."""
    from prefpack.quickstart import _build_model, make_pairs
    from prefpack.toy_tokenizer import build_toy_tokenizer

    rows = make_pairs(200, 0)
    tok = build_toy_tokenizer([r["prompt"] + r["chosen"] for r in rows] + [" positive", " negative"],
                              style="llama", vocab_size=400)
    torch.manual_seed(0)
    _build_model(tok, tmp_path / "init", 0)
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": r["prompt"]} for r in make_pairs(8, 2)])
    (tmp_path / "reward.py").write_text("def reward(prompt, completion):\n    return 0.0\n")
    return tmp_path


def test_the_exported_reward_model_scored_from_transformers_needs_the_eos(tmp_path, toy_tokenizers, one_thread):
    """docs/reward-models.md's two lines (prompt + completion + EOS, read by transformers' own pooling) equal prefpack
    score on the same rows; without the EOS the reward is read at another token."""
    _, tok = reward_model(tmp_path / "rm", toy_tokenizers["llama"])
    model = tf.AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").double().eval()
    model.config.pad_token_id = tok.pad_token_id  # the tokenizer's own pad token (docs: transformers reads the EOS)
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": p, "completions": c} for p, c, _ in PLAIN])
    got, _ = run(tmp_path, rows, tmp_path / "rm")
    for (prompt, texts, _), out in zip(PLAIN, got):
        for completion, value in zip(texts, out["scores"]):
            ids = tok(prompt)["input_ids"] + tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            with torch.no_grad():
                reward = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
                without = model(input_ids=torch.tensor([ids[:-1]])).logits[0, 0].item()
            assert value == pytest.approx(reward, rel=1e-10, abs=1e-12) and value != pytest.approx(without, rel=1e-6)


def test_samples_whose_meta_names_a_hub_tokenizer_are_read_with_it_not_the_reward_models(tmp_path, toy_tokenizers,
                                                                                         monkeypatch, capsys):
    """A samples meta naming its tokenizer by hub id (not a folder here): the reward model's own tokenizer reads the
    ids only when it is theirs; else the hub id is tried (here offline: a one-line error naming it), never the reward
    model's tokenizer in its place."""
    import prefpack.tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "hub_reachable", lambda: False)
    samples, rows = write_samples(tmp_path, toy_tokenizers["llama"])
    meta = json.loads((tmp_path / "samples.meta.json").read_text())
    meta["tokenizer"]["name"] = "some-org/the-policy"
    (tmp_path / "samples.meta.json").write_text(json.dumps(meta))
    reward_model(tmp_path / "rm", toy_tokenizers["neox"])
    err = cli_error(capsys, samples, "-o", tmp_path / "out", "--reward-model", tmp_path / "rm")
    assert "'some-org/the-policy'" in err and "cannot be reached" in err
    model, _ = reward_model(tmp_path / "own", toy_tokenizers["llama"])  # the samples' own tokenizer: it reads them
    got, notes = run(tmp_path, samples, tmp_path / "own")
    assert notes == [] and got[0]["scores"] == pytest.approx(
        [by_hand(model, rows[0]["prompt_ids"] + c) for c in rows[0]["completion_ids"]], rel=1e-10, abs=1e-12)
