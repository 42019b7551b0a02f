"""`prefpack generate` with the in-process engine: prompts start from exactly the ids training reads (a store's,
or rows rendered as prepare renders them), greedy samples equal a plain argmax loop over each prompt alone (left
padding changes nothing), a completion ends at its first stop token or is marked cut, the same seed gives the same
file, and a killed run continued gives the uninterrupted run's file."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import quiet, tiny_llama, write_jsonl
from transformers import GenerationConfig

from prefpack.data.prepare import PrepareOptions, prepare
from prefpack.data.store import Store
from prefpack.generation.engine import GenerationError, PromptJob, SamplingSettings, finish
from prefpack.generation.hf_engine import TransformersEngine
from prefpack.generation.prompts import RowPrompts, StorePrompts
from prefpack.generation.run import model_eos_ids, sample_prompts
from prefpack.generation.stops import stop_token_ids

CHATS = [[{"role": "user", "content": c}] for c in ("How do I bake bread?", "Hi",
                                                   "What is the capital of France, and why?", "Tell me a joke")]


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_tokenizers, one_thread):
    """A ChatML pair store of chat rows, the rows' file, and a tiny Llama for the tokenizer."""
    root = tmp_path_factory.mktemp("gen")
    rows = [{"prompt": c, "chosen": [{"role": "assistant", "content": "Sure."}],
             "rejected": [{"role": "assistant", "content": "No."}], "label": i} for i, c in enumerate(CHATS)]
    rows_file = write_jsonl(root / "rows.jsonl", rows)
    prepare(PrepareOptions(inputs=[str(rows_file)], tokenizer=str(toy_tokenizers["chatml"]), output=str(root / "store"),
                           workers=1), log=quiet)
    model = tiny_llama(toy_tokenizers["chatml"], root / "model", 0)
    engine = TransformersEngine.load(str(model), pad_id=0, batch_size=3)
    return {"root": root, "rows": rows_file, "store": root / "store", "engine": engine, "model": model}


def greedy_alone(model, ids, steps):
    """Argmax continuation of one prompt, by full forwards of the growing sequence (no cache, no padding)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def test_store_prompts_are_the_ids_training_reads_and_greedy_continues_them(world):
    store = Store(world["store"])
    source = StorePrompts(str(world["store"]))
    prompts = list(source)
    assert [p.ids for p in prompts] == [tuple(int(t) for t in store.pair(i).prompt) for i in range(len(store))]
    assert {p.fields["source_row"] for p in prompts} == {0, 1, 2, 3}
    engine, model = world["engine"], world["engine"].model
    settings = SamplingSettings(n=1, temperature=0, max_new_tokens=5, stop_token_ids=(599,))
    out = engine.generate([PromptJob(p.row, p.ids) for p in prompts], settings)  # batches of 3, left-padded
    for p, (sample,) in zip(prompts, out):
        want = greedy_alone(model, p.ids, 5)
        if 599 in want:
            want = want[: want.index(599) + 1]
        assert list(sample.ids) == want


def test_rows_render_to_the_ids_prepare_gives(world, toy_tokenizers, tmp_path):
    store = Store(world["store"])
    rows = list(RowPrompts([str(world["rows"])], str(toy_tokenizers["chatml"])))
    assert [p.ids for p in rows] == [tuple(int(t) for t in store.pair(i).prompt) for i in range(len(store))]
    assert rows[2].messages == CHATS[2] and rows[2].fields["label"] == 2 and "chosen" in rows[2].fields
    # plain-text prompts with a tokenizer that adds BOS: the same convention as prepare (BOS once)
    text = [{"prompt": "\n\nHuman: what is rain?\n\nAssistant:", "chosen": " Water.", "rejected": " Fire."},
            {"prompt": "<s>\n\nHuman: hi\n\nAssistant:", "chosen": " Hello.", "rejected": " Go."}]
    path = write_jsonl(tmp_path / "text.jsonl", text)
    prepare(PrepareOptions(inputs=[str(path)], tokenizer=str(toy_tokenizers["llama"]), output=str(tmp_path / "s"),
                           workers=1), log=quiet)
    text_store = Store(tmp_path / "s")
    got = [p.ids for p in RowPrompts([str(path)], str(toy_tokenizers["llama"]))]
    assert got == [tuple(int(t) for t in text_store.pair(i).prompt) for i in range(2)]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"question": "where is the prompt?"}])
    with pytest.raises(GenerationError, match=r"bad.jsonl line 2: no prompt"):
        list(RowPrompts([str(bad)], str(toy_tokenizers["llama"])))


def test_a_sample_ends_at_its_first_stop_token_or_is_marked_cut(world):
    assert finish([5, 9, 2, 4, 2], (2, 7)) == finish([5, 9, 2], (7, 2))
    assert not finish([5, 9, 2], (2,)).truncated and finish([5, 9, 3], (2,)).truncated
    engine, model = world["engine"], world["engine"].model
    prompt = next(iter(StorePrompts(str(world["store"])))).ids
    greedy = greedy_alone(model, prompt, 6)
    k = next(i for i in range(1, 6) if greedy[i] not in greedy[:i])  # a token first sampled at step k
    settings = SamplingSettings(n=1, temperature=0, max_new_tokens=6, stop_token_ids=(greedy[k],))
    (ended,), = engine.generate([PromptJob(0, prompt)], settings)
    assert list(ended.ids) == greedy[: k + 1] and not ended.truncated
    short = SamplingSettings(n=1, temperature=0, max_new_tokens=k, stop_token_ids=(greedy[k],))
    (cut,), = engine.generate([PromptJob(0, prompt)], short)
    assert list(cut.ids) == greedy[:k] and cut.truncated


def test_stop_tokens_are_the_templates_end_of_turn_and_eos(toy_tokenizers):
    from transformers import AutoTokenizer

    chatml = AutoTokenizer.from_pretrained(toy_tokenizers["chatml"])
    assert stop_token_ids(chatml) == (chatml.convert_tokens_to_ids("<|im_end|>"),)  # end-of-turn is EOS there
    llama3 = AutoTokenizer.from_pretrained(toy_tokenizers["llama"])
    llama3.add_tokens(["<|eot_id|>"], special_tokens=True)
    llama3.chat_template = ("{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|eot_id|>"
                            "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
    eot = llama3.convert_tokens_to_ids("<|eot_id|>")
    assert stop_token_ids(llama3, [eot, 5]) == (eot, llama3.eos_token_id, 5)


def test_the_model_folders_generation_config_adds_stop_ids(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert model_eos_ids(str(tmp_path)) == [128001, 128009]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert model_eos_ids(str(tmp_path)) == [7] and model_eos_ids(None) == []


def read(path):
    return path.read_bytes()


def test_same_seed_same_file_and_a_killed_run_continues_to_it(world, tmp_path):
    source = StorePrompts(str(world["store"]))
    settings = SamplingSettings(n=3, max_new_tokens=8, seed=5, stop_token_ids=stop_token_ids(source.tok))
    engine = world["engine"]
    sample_prompts(source, engine, settings, tmp_path / "a.jsonl", log=quiet)
    sample_prompts(source, engine, settings, tmp_path / "b.jsonl", log=quiet)
    assert read(tmp_path / "a.jsonl") == read(tmp_path / "b.jsonl")
    rows = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(len(r["completion_ids"]) == 3 for r in rows)
    assert len({tuple(c) for r in rows for c in r["completion_ids"]}) == 12  # sampled, not copies
    other = SamplingSettings(n=3, max_new_tokens=8, seed=6, stop_token_ids=settings.stop_token_ids)
    sample_prompts(source, engine, other, tmp_path / "c.jsonl", log=quiet)
    assert read(tmp_path / "c.jsonl") != read(tmp_path / "a.jsonl")

    class Killed(Exception):
        pass

    class DiesAfterOneBatch:  # the engine, killed after its first batch (3 of 4 prompts)
        name, batch_prompts, calls = engine.name, engine.batch_prompts, 0

        def generate(self, jobs, s):
            self.calls += 1
            if self.calls > 1:
                raise Killed
            return engine.generate(jobs, s)

        def describe(self):
            return engine.describe()

    with pytest.raises(Killed):
        sample_prompts(source, DiesAfterOneBatch(), settings, tmp_path / "d.jsonl", log=quiet)
    with open(tmp_path / "d.jsonl", "a") as fh:
        fh.write('{"prompt_ids": [1, 2')  # and a partial line, as a kill mid-write leaves
    report = sample_prompts(source, engine, settings, tmp_path / "d.jsonl", log=quiet)
    assert report.written == 1 and report.samples == 12
    assert read(tmp_path / "d.jsonl") == read(tmp_path / "a.jsonl")
    assert json.loads((tmp_path / "d.meta.json").read_text())["counts"] == \
        json.loads((tmp_path / "a.meta.json").read_text())["counts"]
    with pytest.raises(GenerationError, match="other settings"):
        sample_prompts(source, engine, other, tmp_path / "d.jsonl", log=quiet)


def test_the_command_samples_a_stores_prompts(world, tmp_path, capsys):
    from prefpack.cli import main

    out = tmp_path / "round" / "samples.jsonl"
    argv = ["generate", "--store", str(world["store"]), "--model", str(world["model"]), "-o", str(out), "--n", "2",
            "--max-new-tokens", "4", "--seed", "3", "--batch-size", "2"]
    assert main(argv) == 0 and "wrote" in capsys.readouterr().out
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    store = Store(world["store"])
    assert [r["prompt_ids"] for r in rows] == [[int(t) for t in store.pair(i).prompt] for i in range(len(store))]
    assert all(len(c) <= 4 for r in rows for c in r["completion_ids"])
    assert [r["truncated"] for r in rows] == [[not c or c[-1] != 2 for c in r["completion_ids"]] for r in rows]
    meta = json.loads((tmp_path / "round" / "samples.meta.json").read_text())
    assert meta["complete"] and meta["tokenizer"] == store.meta["tokenizer"]
    assert meta["generation"]["settings"]["seed"] == 3 and meta["generation"]["batch_size"] == 2


def test_the_model_folders_sampling_defaults_do_not_leak_in(world):
    """A generation_config.json's min_p, repetition penalty... would change what is sampled behind the settings'
    back (transformers merges them into a given config); vLLM requests set them off too."""
    engine, model = world["engine"], world["engine"].model
    jobs = [PromptJob(p.row, p.ids) for p in StorePrompts(str(world["store"]))][:2]
    settings = SamplingSettings(n=3, max_new_tokens=6, seed=1, stop_token_ids=(599,))
    saved = model.generation_config
    try:
        model.generation_config = GenerationConfig()
        plain = engine.generate(jobs, settings)
        model.generation_config = GenerationConfig(min_p=0.999, repetition_penalty=50.0, top_k=1)
        assert engine.generate(jobs, settings) == plain
    finally:
        model.generation_config = saved
    assert len({s.ids for s in plain[0]}) == 3


def test_too_many_new_tokens_says_what_fits_and_the_corrected_command_then_runs(world, tmp_path, capsys):
    """A first try that fails before any row (max_new_tokens past the model's positions) names the most that fits,
    and leaves nothing the corrected command would be refused for continuing ("other settings")."""
    from prefpack.cli import main

    out, fresh = tmp_path / "samples.jsonl", tmp_path / "fresh.jsonl"
    argv = ["generate", "--store", str(world["store"]), "--model", str(world["model"]), "--n", "2", "--seed", "3"]
    longest = max(len(p.ids) for p in StorePrompts(str(world["store"])))
    assert main([*argv, "-o", str(out), "--max-new-tokens", "256"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"lower max_new_tokens to {256 - longest} or less" in err[0]
    assert main([*argv, "-o", str(out), "--max-new-tokens", "4"]) == 0
    assert main([*argv, "-o", str(fresh), "--max-new-tokens", "4"]) == 0
    assert read(out) == read(fresh) and len(read(out).splitlines()) == 4
