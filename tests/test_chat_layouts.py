"""Real chat data (issue 37): LLaMA-Factory's and UltraFeedback's layouts, Parquet / datasets rows as written,
template variables found by parsing, no EOS after a template's own end of turn, and a store's compatibility judged
by what its token ids mean (not by the chat template).

Each layout is checked against the same rows written by hand in prefpack's canonical layout: the two stores must be
byte for byte the same. Real templates and LLaMA-Factory's demo rows are in tests/data (PROVENANCE.md there).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import write_jsonl

from prefpack.data.prepare import PrepareError, PrepareOptions, prepare
from prefpack.data.store import Store
from prefpack.tokenizer import load_tokenizer, tokenizer_hash

DATA = Path(__file__).parent / "data"
TEMPLATES = DATA / "chat_templates"
ROLES = {"human": "user", "gpt": "assistant", "system": "system"}  # LLaMA-Factory's role names, written out here
# A ChatML template that reads tool calls (as Qwen's does)
TOOL_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}{%- if m.content %}{{- m.content }}{%- endif %}"
    "{%- for c in m.tool_calls or [] %}{{- '<tool_call>' + (c.function | tojson) + '</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def run(inputs, tok, out, log=lambda m: None, **kw):
    kw.setdefault("workers", 1)
    return prepare(PrepareOptions(inputs=[str(i) for i in inputs], tokenizer=str(tok), output=str(out), **kw), log=log)


def same_store(a: Path, b: Path) -> None:
    for name in ("tokens.bin", "index.bin"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "spans.bin").exists() == (b / "spans.bin").exists()
    if (a / "spans.bin").exists():
        assert (a / "spans.bin").read_bytes() == (b / "spans.bin").read_bytes()


def with_template(toy_tokenizers, tmp_path, template: str, name: str, specials=()) -> Path:
    tok = load_tokenizer(toy_tokenizers["chatml"])
    if specials:
        tok.add_special_tokens({"additional_special_tokens": list(specials)})
    tok.chat_template = template
    tok.save_pretrained(tmp_path / name)
    return tmp_path / name


def ids(tok, messages, **kw) -> list[int]:
    return [int(i) for i in tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)]


# ---------------------------------------------------------------- layouts


def test_sharegpt_rows_give_the_store_of_the_same_messages(tmp_path, toy_tokenizers):
    rows = json.loads((DATA / "llamafactory" / "dpo_en_demo_3.json").read_text())
    canonical = [{"prompt": [{"role": ROLES[m["from"]], "content": m["value"]} for m in r["conversations"]],
                  "chosen": [{"role": "assistant", "content": r["chosen"]["value"]}],
                  "rejected": [{"role": "assistant", "content": r["rejected"]["value"]}]} for r in rows]
    tok = toy_tokenizers["chatml"]
    got = run([DATA / "llamafactory" / "dpo_en_demo_3.json"], tok, tmp_path / "a")
    run([write_jsonl(tmp_path / "c.jsonl", canonical)], tok, tmp_path / "b")
    assert got.layout == "sharegpt" and got.examples == 3
    same_store(tmp_path / "a", tmp_path / "b")


def test_sharegpt_function_calls_and_observations_become_tool_messages(tmp_path, toy_tokenizers):
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    rows = [{"conversations": [{"from": "human", "value": "Weather in Paris?"},
                               {"from": "function_call", "value": json.dumps(call)},
                               {"from": "observation", "value": "21 C"}],
             "chosen": {"from": "gpt", "value": "It is 21 degrees."}, "rejected": {"from": "gpt", "value": "No idea."},
             "system": "Be brief."}]
    canonical = [{"prompt": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Weather in Paris?"},
                             {"role": "assistant", "tool_calls": [{"type": "function", "function": call}]},
                             {"role": "tool", "content": "21 C"}],
                  "chosen": [{"role": "assistant", "content": "It is 21 degrees."}],
                  "rejected": [{"role": "assistant", "content": "No idea."}]}]
    tok = with_template(toy_tokenizers, tmp_path, TOOL_TEMPLATE, "tooltok")
    assert run([write_jsonl(tmp_path / "s.jsonl", rows)], tok, tmp_path / "a").layout == "sharegpt"
    run([write_jsonl(tmp_path / "c.jsonl", canonical)], tok, tmp_path / "b")
    same_store(tmp_path / "a", tmp_path / "b")
    prompt = load_tokenizer(tok).decode([int(t) for t in Store(tmp_path / "a").pair(0).prompt])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt


def test_kto_messages_with_label_give_the_unpaired_store(tmp_path, toy_tokenizers):
    rows = json.loads((DATA / "llamafactory" / "kto_en_demo_3.json").read_text())
    canonical = [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:], "label": r["label"]} for r in rows]
    tok = toy_tokenizers["chatml"]
    got = run([DATA / "llamafactory" / "kto_en_demo_3.json"], tok, tmp_path / "a")
    run([write_jsonl(tmp_path / "c.jsonl", canonical)], tok, tmp_path / "b")
    assert got.layout == "kto-messages" and Store(tmp_path / "a").kind == "unpaired"
    same_store(tmp_path / "a", tmp_path / "b")


def test_alpaca_rows_render_through_the_template_or_say_they_are_raw_text(tmp_path, toy_tokenizers):
    rows = [{"instruction": "Translate to French.", "input": "Good morning", "chosen": "Bonjour", "rejected": "Hola"},
            {"instruction": "Say hi.", "input": "", "chosen": "Hi!", "rejected": "No."}]
    canonical = [{"prompt": [{"role": "user", "content": "Translate to French.\nGood morning"}],
                  "chosen": [{"role": "assistant", "content": "Bonjour"}],
                  "rejected": [{"role": "assistant", "content": "Hola"}]},
                 {"prompt": [{"role": "user", "content": "Say hi."}], "chosen": [{"role": "assistant", "content": "Hi!"}],
                  "rejected": [{"role": "assistant", "content": "No."}]}]
    src = write_jsonl(tmp_path / "a.jsonl", rows)
    assert run([src], toy_tokenizers["chatml"], tmp_path / "a").layout == "alpaca"
    run([write_jsonl(tmp_path / "c.jsonl", canonical)], toy_tokenizers["chatml"], tmp_path / "b")
    same_store(tmp_path / "a", tmp_path / "b")
    notes: list[str] = []  # the NeoX toy tokenizer has no chat template: raw text, and prepare says so
    run([src], toy_tokenizers["neox"], tmp_path / "raw", log=notes.append)
    assert any("stored as raw text" in n for n in notes)
    raw = [{"prompt": "Translate to French.\nGood morning", "chosen": "Bonjour", "rejected": "Hola"},
           {"prompt": "Say hi.", "chosen": "Hi!", "rejected": "No."}]
    run([write_jsonl(tmp_path / "r.jsonl", raw)], toy_tokenizers["neox"], tmp_path / "rb")
    same_store(tmp_path / "raw", tmp_path / "rb")


def test_ultrafeedback_binarized_is_read_as_implicit_and_pairs_names_the_fix(tmp_path, toy_tokenizers):
    user = {"role": "user", "content": "Name a colour."}
    rows = [{"prompt": "Name a colour.", "prompt_id": "x1", "score_chosen": 8.0, "score_rejected": 2.0,
             "chosen": [user, {"role": "assistant", "content": "Blue."}],
             "rejected": [user, {"role": "assistant", "content": "Seven."}],
             "messages": [user, {"role": "assistant", "content": "Blue."}]}]
    canonical = [{"prompt": [user], "chosen": [{"role": "assistant", "content": "Blue."}],
                  "rejected": [{"role": "assistant", "content": "Seven."}]}]
    src, tok = write_jsonl(tmp_path / "u.jsonl", rows), toy_tokenizers["chatml"]
    got = run([src], tok, tmp_path / "a")
    assert got.layout == "implicit" and "UltraFeedback" in got.layout_reason
    run([write_jsonl(tmp_path / "c.jsonl", canonical)], tok, tmp_path / "b")
    same_store(tmp_path / "a", tmp_path / "b")
    with pytest.raises(PrepareError, match=r"field 'chosen' is a whole conversation.*--format implicit"):
        run([src], tok, tmp_path / "p", layout="pairs")


# ---------------------------------------------------------------- what the template reads, and its end of turn


def test_smollm3_template_gets_tools_as_xml_tools(tmp_path, toy_tokenizers):
    """SmolLM3 reads `xml_tools`, never `tools`: the tools must reach it (the substring test passed `tools`)."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    prompt = [{"role": "user", "content": "Weather in Paris?"}]
    rows = [{"prompt": prompt, "chosen": [{"role": "assistant", "content": "Sunny."}],
             "rejected": [{"role": "assistant", "content": "Rain."}], "tools": [tool]}]
    path = with_template(toy_tokenizers, tmp_path, (TEMPLATES / "smollm3.jinja").read_text(), "smol")
    got = run([write_jsonl(tmp_path / "t.jsonl", rows)], path, tmp_path / "s")
    tok = load_tokenizer(path)
    stored = [int(t) for t in Store(tmp_path / "s").pair(0).prompt]
    assert stored == ids(tok, prompt, xml_tools=[tool], add_generation_prompt=True)
    assert "get_weather" in tok.decode(stored) and got.chat["with_tools"] == 1
    calls = [{**rows[0], "chosen": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {}}}]}]}]  # SmolLM3 never reads tool_calls: refused, not dropped
    with pytest.raises(PrepareError, match="template_ignores_tools"):
        run([write_jsonl(tmp_path / "c.jsonl", calls)], path, tmp_path / "c")
    with pytest.raises(PrepareError, match=r"never reads 'enable_thinkng'"):  # a typo'd variable changes nothing
        run([write_jsonl(tmp_path / "t2.jsonl", rows)], path, tmp_path / "k",
            chat_template_kwargs={"enable_thinkng": False})
    quiet = [{**rows[0], "chat_template_kwargs": {"reasoning_effort": "low"}}]
    got = run([write_jsonl(tmp_path / "q.jsonl", quiet)], path, tmp_path / "q")
    assert "'reasoning_effort' in 1 rows" in got.summary()


def test_no_eos_after_gemma3s_end_of_turn(tmp_path, toy_tokenizers):
    """Gemma 3 ends a turn with <end_of_turn>\\n; its EOS (<eos> here the toy's) is not scored after it (TRL adds
    none to conversational rows): prompt + chosen is exactly the template's rendering."""
    path = with_template(toy_tokenizers, tmp_path, (TEMPLATES / "gemma3.jinja").read_text(), "gemma",
                         specials=("<start_of_turn>", "<end_of_turn>"))
    prompt = [{"role": "user", "content": "Hello there"}]
    replies = ([{"role": "assistant", "content": "Hi."}], [{"role": "assistant", "content": "Go away."}])
    rows = [{"prompt": prompt, "chosen": replies[0], "rejected": replies[1]}]
    run([write_jsonl(tmp_path / "g.jsonl", rows)], path, tmp_path / "s")
    tok, pair = load_tokenizer(path), Store(tmp_path / "s").pair(0)
    for stored, reply in zip((pair.chosen, pair.rejected), replies):
        assert [int(t) for t in pair.prompt] + [int(t) for t in stored] == ids(tok, prompt + reply)
        assert tok.decode([int(t) for t in stored]).endswith("<end_of_turn>\n")


# ---------------------------------------------------------------- Parquet and datasets rows as the user wrote them


def _nulls(value) -> int:
    if isinstance(value, dict):
        return sum(v is None for v in value.values()) + sum(_nulls(v) for v in value.values())
    return sum(_nulls(v) for v in value) if isinstance(value, list) else 0


def test_parquet_and_datasets_tool_rows_give_the_jsonl_store(tmp_path, toy_tokenizers):
    """Arrow unifies structs across rows: every message gets `tool_calls`/`content`/`name` null, every call the other
    calls' arguments. Llama 3.1's template reads `'tool_calls' in message`, so a null left in would fail the row."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    search = {"type": "function", "function": {"name": "search", "description": "Search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
    user = {"role": "user", "content": "Weather in Paris?"}

    def call(name, args):
        return {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}
    rows = [
        {"prompt": [user], "chosen": [call("get_weather", {"city": "Paris"})],
         "rejected": [call("search", {"query": "Paris weather"})], "tools": [weather, search]},
        {"prompt": [user, call("get_weather", {"city": "Paris"}),
                    {"role": "tool", "name": "get_weather", "content": "21 C"}],
         "chosen": [{"role": "assistant", "content": "21 degrees."}],
         "rejected": [{"role": "assistant", "content": "No idea."}], "tools": [weather]},
    ]
    path = with_template(toy_tokenizers, tmp_path, (TEMPLATES / "llama3_1.jinja").read_text(), "llama31")
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "rows.parquet")
    datasets.Dataset(table).save_to_disk(str(tmp_path / "rows_ds"))
    want = run([write_jsonl(tmp_path / "rows.jsonl", rows)], path, tmp_path / "j")
    assert want.null_keys == {}
    filled = _nulls(table.select(["prompt", "chosen", "rejected", "tools"]).to_pylist())
    assert filled > 0
    for name in ("rows.parquet", "rows_ds"):
        got = run([tmp_path / name], path, tmp_path / f"s_{name}")
        same_store(tmp_path / f"s_{name}", tmp_path / "j")
        assert got.null_keys == {"keys": filled, "rows": 2} and "null keys dropped" in got.summary()
    rendered = load_tokenizer(path).decode([int(t) for t in Store(tmp_path / "j").pair(0).chosen])
    assert '"city": "Paris"' in rendered and "null" not in rendered


# ---------------------------------------------------------------- compatibility: what the ids mean


def test_a_store_prepared_with_another_template_trains_with_the_models_tokenizer(tmp_path, toy_tokenizers):
    """The store's tokenizer copy differs from the model's only by its chat template: same ids, so it trains; the
    template used is recorded and shown. A store written before (hash version 2, which covered the template) is
    judged by its own saved copy; another vocabulary is still refused."""
    from conftest import tiny_llama

    from prefpack.data.inspect import inspect_store
    from prefpack.model.load import ModelError, resolve_tokenizer
    from prefpack.training import train

    model = tiny_llama(toy_tokenizers["chatml"], tmp_path / "model", 0)
    load_tokenizer(toy_tokenizers["chatml"]).save_pretrained(model)
    copy = with_template(toy_tokenizers, tmp_path, TOOL_TEMPLATE, "training-template")
    assert tokenizer_hash(load_tokenizer(copy), 2) != tokenizer_hash(load_tokenizer(model), 2)
    user = {"role": "user", "content": "Name a colour."}
    rows = [{"prompt": [user], "chosen": [{"role": "assistant", "content": c}],
             "rejected": [{"role": "assistant", "content": r}]} for c, r in [("Blue.", "Seven."), ("Red.", "A dog.")]]
    store = tmp_path / "store"
    run([write_jsonl(tmp_path / "d.jsonl", rows)], copy, store)
    meta = Store(store).meta
    assert meta["tokenizer"]["hash_version"] == 3 and meta["chat_template"]["name"] == "the tokenizer's own"
    assert f"sha256 {meta['chat_template']['sha256'][:12]}" in inspect_store(str(store))
    tok = resolve_tokenizer(str(model), meta, Store(store).tokenizer_path())
    assert tok.chat_template == load_tokenizer(model).chat_template  # the model's own
    with pytest.raises(ModelError, match="token ids would mean different things"):
        resolve_tokenizer(toy_tokenizers["neox"], meta, Store(store).tokenizer_path())
    # as prepare wrote it before version 3: the hash covered the template
    old = {**meta, "tokenizer": {**meta["tokenizer"], "hash_version": 2,
                                 "hash": tokenizer_hash(load_tokenizer(copy), 2)}}
    old.pop("chat_template")
    (store / "meta.json").write_text(json.dumps(old))
    res = train(_config(model, store, tmp_path / "run"), progress=False, log=lambda m: None)
    assert res.final_dir is not None and (tmp_path / "run" / "metrics.jsonl").exists()
    tampered = {**old, "tokenizer": {**old["tokenizer"], "hash": "0" * 64}}  # a copy that is not the recorded one
    with pytest.raises(ModelError, match="token ids would mean different things"):
        resolve_tokenizer(str(model), tampered, Store(store).tokenizer_path())


def _config(model, store, run_dir):
    from prefpack.config.io import load_config

    return load_config(None, [f"model.name_or_path={model}", f"data.train={store}", f"run.output_dir={run_dir}",
                              "train.max_steps=1", "train.global_batch_pairs=2", "run.plot=false",
                              "run.tensorboard=false", "train.micro_batch_tokens=1024"])
