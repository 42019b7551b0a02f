"""prepare: tools, tool calls and chat_template_kwargs through the chat template; implicit-prompt markers.

Every stored example is checked against ids computed here independently: `apply_chat_template` on the whole
conversation with the same tools and template variables must give exactly the stored prompt ids followed by
the stored completion ids.
"""

from __future__ import annotations

import json

import pytest
from conftest import write_jsonl

from prefpack.cli import main as cli_main
from prefpack.data.formats import ASSISTANT_MARKERS, implicit_prompt
from prefpack.data.prepare import PrepareError, PrepareOptions, prepare
from prefpack.data.store import Store
from prefpack.tokenizer import load_tokenizer

# A small ChatML template with tool use, in the manner of Qwen's: tools are listed in a system turn, assistant
# tool calls are rendered as <tool_call> JSON, tool results get their own turn, and `enable_thinking=false` adds an
# empty think block to every assistant turn (generation prompt included, so the template stays prefix-stable).
TOOL_TEMPLATE = (
    "{%- set no_think = enable_thinking is defined and enable_thinking is false %}"
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if no_think %}{{- '<think></think>\\n' }}{%- endif %}"
    "{%- if m.content %}{{- m.content }}{%- endif %}"
    "{%- for c in m.tool_calls or [] %}{{- '<tool_call>' + (c.function | tojson) + '</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>tool\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if no_think %}{{- '<think></think>\\n' }}{%- endif %}{%- endif %}"
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
USER = {"role": "user", "content": "What is the weather in Paris?"}


@pytest.fixture(scope="module")
def tool_tok(toy_tokenizers, tmp_path_factory):
    tok = load_tokenizer(toy_tokenizers["chatml"])
    tok.chat_template = TOOL_TEMPLATE
    path = tmp_path_factory.mktemp("tooltok")
    tok.save_pretrained(path)
    return path


def run(inputs, tok, out, **kw):
    kw.setdefault("workers", 1)
    opts = PrepareOptions(inputs=[str(i) for i in inputs], tokenizer=str(tok), output=str(out), **kw)
    return prepare(opts, log=lambda m: None)


def template_ids(tok, messages, tools=None, add_generation_prompt=False, **kwargs) -> list[int]:
    ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False,
                                  add_generation_prompt=add_generation_prompt, **kwargs)
    return [int(i) for i in ids]


def check_pair(st, tok, i, prompt, replies, tools=None, **kwargs):
    """The stored example i equals the template's own rendering of the same conversation, id for id."""
    pair = st.pair(i)
    assert [int(t) for t in pair.prompt] == template_ids(tok, prompt, tools, add_generation_prompt=True, **kwargs)
    for stored, reply in zip((pair.chosen, pair.rejected), replies):
        full = template_ids(tok, prompt + reply, tools, **kwargs)
        assert [int(t) for t in pair.prompt] + [int(t) for t in stored] == full
        assert list(stored).count(tok.eos_token_id) == 1  # the template's <|im_end|>, not doubled


# ---------------------------------------------------------------- tools and tool calls


def test_tools_and_tool_calls_go_through_the_template(tmp_path, tool_tok):
    rows = [
        {  # the chosen reply is a pure tool call (content null), the rejected one guesses
            "prompt": [USER],
            "chosen": [{"role": "assistant", "content": None, "tool_calls": [CALL]}],
            "rejected": [{"role": "assistant", "content": "It is sunny."}],
            "tools": [WEATHER, TIME],
        },
        {  # the prompt holds the call and its result; tools given as a JSON string (as Parquet often stores them)
            "prompt": [USER, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                       {"role": "tool", "name": "get_weather", "tool_call_id": "c1", "content": '{"temp": 21}'}],
            "chosen": [{"role": "assistant", "content": "21 degrees in Paris."}],
            "rejected": [{"role": "assistant", "content": "I could not find out."}],
            "tools": json.dumps([WEATHER]),
        },
        {  # no tools for this row: rendered without the tools turn
            "prompt": [USER], "chosen": [{"role": "assistant", "content": "Let me guess: mild."}],
            "rejected": [{"role": "assistant", "content": "No."}], "tools": None,
        },
    ]
    report = run([write_jsonl(tmp_path / "t.jsonl", rows)], tool_tok, tmp_path / "s")
    assert report.layout == "messages" and report.examples == 3
    assert report.chat == {"examples": 3, "with_tools": 2}
    tok = load_tokenizer(tool_tok)
    st = Store(tmp_path / "s")
    tools = [[WEATHER, TIME], [WEATHER], None]
    for i, row in enumerate(rows):
        check_pair(st, tok, i, row["prompt"], (row["chosen"], row["rejected"]), tools[i])
    first = st.pair(0)
    prompt_text = tok.decode([int(t) for t in first.prompt])
    assert '"name": "get_weather"' in prompt_text and '"name": "get_time"' in prompt_text
    assert tok.decode([int(t) for t in first.chosen]) == (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>\n')
    assert "Tools:" not in tok.decode([int(t) for t in st.pair(2).prompt])
    assert "<|im_start|>tool\n" in tok.decode([int(t) for t in st.pair(1).prompt])
    assert st.meta["counts"]["examples_with_tools"] == 2 and st.meta["counts"]["chat_examples"] == 3


def test_implicit_and_unpaired_chat_rows_with_tools(tmp_path, tool_tok):
    shared = [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "content": '{"temp": 21}'}]
    rows = [{"chosen": shared + [{"role": "assistant", "content": "21 degrees."}],
             "rejected": shared + [{"role": "assistant", "content": "Cold."}], "tools": [WEATHER]}]
    run([write_jsonl(tmp_path / "i.jsonl", rows)], tool_tok, tmp_path / "si")
    tok = load_tokenizer(tool_tok)
    st = Store(tmp_path / "si")
    assert st.meta["layout"] == "implicit"
    # the shared call and its result stay in the prompt
    check_pair(st, tok, 0, shared, ([rows[0]["chosen"][-1]], [rows[0]["rejected"][-1]]), [WEATHER])

    rows = [{"prompt": [USER], "completion": [{"role": "assistant", "content": None, "tool_calls": [CALL]}],
             "label": True, "tools": [WEATHER]}]
    run([write_jsonl(tmp_path / "u.jsonl", rows)], tool_tok, tmp_path / "su")
    ex = Store(tmp_path / "su").unpaired(0)
    prompt_ids = template_ids(tok, [USER], [WEATHER], add_generation_prompt=True)
    assert [int(t) for t in ex.prompt] == prompt_ids
    assert prompt_ids + [int(t) for t in ex.completion] == template_ids(tok, [USER] + rows[0]["completion"], [WEATHER])


def test_chat_template_kwargs_from_the_cli_and_per_row(tmp_path, tool_tok, capsys):
    reply = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    rows = [
        {"prompt": [USER], "chosen": reply("Mild."), "rejected": reply("Hot.")},  # the CLI's value
        {"prompt": [USER], "chosen": reply("Mild."), "rejected": reply("Hot."),
         "chat_template_kwargs": {"enable_thinking": True}},  # the row's own value wins for its key
        {"prompt": [USER], "chosen": reply("Mild."), "rejected": reply("Hot."), "tools": [WEATHER],
         "chat_template_kwargs": {"enable_thinking": None}},  # null (a Parquet fill) leaves the CLI's value
        {"prompt": [USER], "chosen": reply("Mild."), "rejected": reply("Hot."),
         "chat_template_kwargs": json.dumps({"enable_thinking": True})},  # a JSON string works too
    ]
    src = write_jsonl(tmp_path / "k.jsonl", rows)
    code = cli_main(["prepare", str(src), "--tokenizer", str(tool_tok), "-o", str(tmp_path / "s"), "--workers", "1",
                     "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert code == 0, capsys.readouterr().err
    tok = load_tokenizer(tool_tok)
    st = Store(tmp_path / "s")
    effective = [False, True, False, True]
    tools = [None, None, [WEATHER], None]
    for i, row in enumerate(rows):
        check_pair(st, tok, i, row["prompt"], (row["chosen"], row["rejected"]), tools[i],
                   enable_thinking=effective[i])
        prompt_text = tok.decode([int(t) for t in st.pair(i).prompt])
        assert prompt_text.endswith("<think></think>\n") is (not effective[i])
    # without the variable the template adds no think block: the kwargs really reached it
    assert template_ids(tok, [USER], add_generation_prompt=True) != [int(t) for t in st.pair(0).prompt]
    args = st.meta["args"]
    assert args["chat_template_kwargs"] == {"enable_thinking": False} and args["tools"] is None
    assert "--chat-template-kwargs" in st.meta["argv"]


def test_tools_file_applies_to_rows_without_their_own(tmp_path, tool_tok, capsys):
    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps([WEATHER]))
    reply = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    rows = [{"prompt": [USER], "chosen": [{"role": "assistant", "content": None, "tool_calls": [CALL]}],
             "rejected": reply("Sunny.")},
            {"prompt": [USER], "chosen": reply("Mild."), "rejected": reply("Hot."), "tools": [TIME]}]
    src = write_jsonl(tmp_path / "f.jsonl", rows)
    code = cli_main(["prepare", str(src), "--tokenizer", str(tool_tok), "-o", str(tmp_path / "s"), "--workers", "1",
                     "--tools", str(tools_file)])
    assert code == 0, capsys.readouterr().err
    tok = load_tokenizer(tool_tok)
    st = Store(tmp_path / "s")
    check_pair(st, tok, 0, rows[0]["prompt"], (rows[0]["chosen"], rows[0]["rejected"]), [WEATHER])
    check_pair(st, tok, 1, rows[1]["prompt"], (rows[1]["chosen"], rows[1]["rejected"]), [TIME])
    assert st.meta["args"]["tools"] == str(tools_file) and len(st.meta["args"]["tools_sha256"]) == 64


def test_prefix_stability_is_still_checked_with_tools(tmp_path, tool_tok):
    tok = load_tokenizer(tool_tok)
    # lists the tools only when a reply is to be generated: the prompt is no prefix of the whole conversation
    tok.chat_template = TOOL_TEMPLATE.replace("{%- if tools %}", "{%- if tools and add_generation_prompt %}")
    tok.save_pretrained(tmp_path / "tok")
    rows = [{"prompt": [USER], "chosen": [{"role": "assistant", "content": "a"}],
             "rejected": [{"role": "assistant", "content": "b"}], "tools": [WEATHER]}]
    src = write_jsonl(tmp_path / "m.jsonl", rows)
    with pytest.raises(PrepareError, match="not prefix-stable"):
        run([src], tmp_path / "tok", tmp_path / "s")
    run([src], tool_tok, tmp_path / "ok")  # the stable template takes the same row


# ---------------------------------------------------------------- bad input


GOOD = {"prompt": [USER], "chosen": [{"role": "assistant", "content": "Mild."}],
        "rejected": [{"role": "assistant", "content": "Hot."}]}
BAD_TOOLS = [
    ({"tools": {"type": "function"}}, "tools", "must be a list of function definitions"),
    ({"tools": [WEATHER, "get_time"]}, "tools", "tool 1 must be a JSON object"),
    ({"tools": "get_weather(city)"}, "tools", "not JSON"),
    ({"tools": 3}, "tools", "got a number"),
    ({"chat_template_kwargs": [["enable_thinking", False]]}, "chat_template_kwargs", "must be a JSON object"),
    ({"chat_template_kwargs": "thinking off"}, "chat_template_kwargs", "not JSON"),
    ({"chat_template_kwargs": {"add_generation_prompt": True}}, "chat_template_kwargs", "set by prepare itself"),
    ({"chosen": [{"role": "assistant", "content": None, "tool_calls": {"name": "x"}}]}, "chosen", "'tool_calls'"),
    ({"chosen": [{"role": "assistant", "content": None}]}, "chosen", "content may be null only beside"),
    # a call that names no function (issue 50): the template would render "name": "" or "None"
    ({"chosen": [{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
        "arguments": "{}"}}]}]}, "chosen", "tool call 0 names no function (its name is missing or null)"),
    ({"chosen": [{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
        "name": None, "arguments": "{}"}}]}]}, "chosen", "names no function (its name is missing or null)"),
    ({"chosen": [{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
        "name": " ", "arguments": "{}"}}]}]}, "chosen", "names no function (its name is empty)"),
]


@pytest.mark.parametrize("change,field,words", BAD_TOOLS, ids=[f"{c[1]}-{i}" for i, c in enumerate(BAD_TOOLS)])
def test_malformed_tools_and_kwargs_name_the_row_and_field(tmp_path, tool_tok, change, field, words):
    src = write_jsonl(tmp_path / "d.jsonl", [GOOD, {**GOOD, **change}, GOOD])
    with pytest.raises(PrepareError) as err:
        run([src], tool_tok, tmp_path / "s")
    msg = str(err.value)
    assert str(src) in msg and "line 2" in msg and f"field {field!r}" in msg and words in msg
    assert "wrong_type" in msg
    assert not (tmp_path / "s").exists()
    r = run([src], tool_tok, tmp_path / "s", skip_invalid=True)
    assert r.examples == 2 and r.skipped == {"wrong_type": 1}
    skipped = [json.loads(x) for x in (r.path / "skipped.jsonl").read_text().splitlines()]
    assert skipped[0]["line"] == 2 and skipped[0]["field"] == field


def test_tools_on_plain_string_rows_are_refused(tmp_path, tool_tok):
    rows = [{"prompt": "Weather?", "chosen": " Mild", "rejected": " Hot"},
            {"prompt": "Weather?", "chosen": " Mild", "rejected": " Hot", "tools": [WEATHER]}]
    with pytest.raises(PrepareError, match=r"line 2, field 'tools'.*plain strings.*tools_without_chat"):
        run([write_jsonl(tmp_path / "p.jsonl", rows)], tool_tok, tmp_path / "s")
    with pytest.raises(PrepareError, match="apply to chat rows"):
        run([write_jsonl(tmp_path / "q.jsonl", rows[:1])], tool_tok, tmp_path / "s",
            chat_template_kwargs={"enable_thinking": False})


def test_template_without_tool_support_refuses_tools(tmp_path, toy_tokenizers):
    """The plain ChatML template never reads `tools` or `tool_calls`: they would vanish silently."""
    with_tools = {**GOOD, "tools": [WEATHER]}
    with pytest.raises(PrepareError, match=r"line 1, field 'tools'.*never reads `tools`"):
        run([write_jsonl(tmp_path / "a.jsonl", [with_tools])], toy_tokenizers["chatml"], tmp_path / "s")
    with_call = {**GOOD, "chosen": [{"role": "assistant", "content": "", "tool_calls": [CALL]}]}
    with pytest.raises(PrepareError, match=r"line 1, field 'chosen'.*never reads `tool_calls`"):
        run([write_jsonl(tmp_path / "b.jsonl", [with_call])], toy_tokenizers["chatml"], tmp_path / "s")


def test_template_failure_is_a_row_error(tmp_path, tool_tok):
    tok = load_tokenizer(tool_tok)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    tok.save_pretrained(tmp_path / "tok")
    with pytest.raises(PrepareError, match=r"line 1.*roles must alternate.*template_error"):
        run([write_jsonl(tmp_path / "a.jsonl", [GOOD])], tmp_path / "tok", tmp_path / "s")


@pytest.mark.parametrize("value,words", [
    ("[1, 2]", "must be a JSON object"),
    ("enable_thinking=false", "is not JSON"),
    ('{"tools": []}', "--tools"),
])
def test_bad_cli_chat_template_kwargs(tmp_path, tool_tok, capsys, value, words):
    src = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    code = cli_main(["prepare", str(src), "--tokenizer", str(tool_tok), "-o", str(tmp_path / "s"), "--workers", "1",
                     "--chat-template-kwargs", value])
    err = capsys.readouterr().err
    assert code == 2 and "--chat-template-kwargs" in err and words in err and "Traceback" not in err


def test_bad_cli_tools_file(tmp_path, tool_tok, capsys):
    src = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    bad = tmp_path / "tools.json"
    bad.write_text(json.dumps({"tools": [WEATHER]}))
    code = cli_main(["prepare", str(src), "--tokenizer", str(tool_tok), "-o", str(tmp_path / "s"), "--workers", "1",
                     "--tools", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and str(bad) in err and "JSON list of function definitions" in err


# ---------------------------------------------------------------- implicit-prompt markers


# (family, conversation before the last reply, last-reply suffix): two turns, so the *last* marker must be found
MARKER_CASES = [
    ("hh-rlhf", "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Capital of France?\n\nAssistant:", " {}"),
    ("chatml", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
               "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n", "{}<|im_end|>\n"),
    ("llama-3", "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nCapital of France?<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n", "{}<|eot_id|>"),
    ("mistral", "<s>[INST] Hi [/INST] Hello!</s>[INST] Capital of France? [/INST]", " {}</s>"),
    ("gemma", "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
              "<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\n", "{}<end_of_turn>\n"),
    ("phi-3", "<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n<|user|>\nCapital of France?<|end|>\n"
              "<|assistant|>\n", "{}<|end|>\n"),
    ("zephyr", "<|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\nHello!</s>\n"
               "<|user|>\nCapital of France?</s>\n<|assistant|>\n", "{}</s>\n"),
    ("phi-3-no-newline", "<|user|>Hi<|end|><|assistant|>Hello!<|end|><|user|>Capital of France?<|end|>"
                         "<|assistant|>", "{}<|end|>"),
]


@pytest.mark.parametrize("family,prompt,reply_fmt", MARKER_CASES, ids=[c[0] for c in MARKER_CASES])
def test_implicit_prompt_ends_after_the_last_assistant_marker(tmp_path, toy_tokenizers, family, prompt, reply_fmt):
    # the replies share their first words, so the common prefix runs past the marker and must be cut back
    chosen_reply = reply_fmt.format("The capital is Paris.")
    rejected_reply = reply_fmt.format("The capital is Lyon, I believe.")
    chosen, rejected = prompt + chosen_reply, prompt + rejected_reply
    assert any(prompt.endswith(m) for m in ASSISTANT_MARKERS)
    assert implicit_prompt(chosen, rejected) == prompt

    report = run([write_jsonl(tmp_path / "c.jsonl", [{"chosen": chosen, "rejected": rejected}])],
                 toy_tokenizers["neox"], tmp_path / "s")
    assert report.layout == "implicit"
    tok = load_tokenizer(toy_tokenizers["neox"])
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    pair = Store(tmp_path / "s").pair(0)
    assert [int(t) for t in pair.prompt] == enc(prompt)
    assert [int(t) for t in pair.chosen] == enc(chosen_reply) + [tok.eos_token_id]
    assert [int(t) for t in pair.rejected] == enc(rejected_reply) + [tok.eos_token_id]
    assert tok.decode([int(t) for t in pair.prompt]) + tok.decode([int(t) for t in pair.chosen]) == (
        chosen + tok.eos_token)


def test_implicit_prompt_without_any_marker_is_cut_where_trl_cuts_it(tmp_path, toy_tokenizers):
    """No assistant marker: the prompt is the common prefix less the space the replies start with, as TRL's
    extract_prompt gives it (its own example: "The sky is" + " blue." / " green."), and the summary counts it."""
    rows = [{"chosen": "User: hi\nBot: hello", "rejected": "User: hi\nBot: go away"},
            {"chosen": "The sky is blue.", "rejected": "The sky is green."}]
    report = run([write_jsonl(tmp_path / "c.jsonl", rows)], toy_tokenizers["neox"], tmp_path / "s")
    assert report.chat["prompt_at_difference"] == 2 and "extract_prompt" in report.summary()
    tok = load_tokenizer(toy_tokenizers["neox"])
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    store = Store(tmp_path / "s")
    for i, (prompt, chosen, rejected) in enumerate([("User: hi\nBot:", " hello", " go away"),
                                                    ("The sky is", " blue.", " green.")]):
        pair = store.pair(i)
        assert [int(t) for t in pair.prompt] == enc(prompt)
        assert [int(t) for t in pair.chosen] == enc(chosen) + [tok.eos_token_id]
        assert [int(t) for t in pair.rejected] == enc(rejected) + [tok.eos_token_id]


def test_a_chat_template_that_does_not_parse_is_refused_once_naming_it(tmp_path, tool_tok):
    """Issue 50: a template with a syntax error was every row's error (with --skip-invalid every row "skipped");
    it is the template's, refused before any row, naming it and the line."""
    src = write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD])
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }\n{% endfor %}")
    for skip in (False, True):
        with pytest.raises(PrepareError) as err:
            run([src], tool_tok, tmp_path / "s", chat_template=str(broken), skip_invalid=skip)
        message = str(err.value)
        assert "\n" not in message and f"--chat-template {broken}" in message and "does not parse (line 1" in message
        assert not (tmp_path / "s").exists()


def test_a_template_that_renders_without_end_is_a_bad_row_naming_it(tmp_path, tool_tok, monkeypatch):
    """Issue 50: a template with an enormous loop hung prepare; its rendering is bounded (RENDER_SECONDS) and the
    row it hangs on is a bad row, skipped and counted with --skip-invalid."""
    from prefpack.data import chat_masks

    monkeypatch.setattr(chat_masks, "RENDER_SECONDS", 0.5)
    template = tmp_path / "loop.jinja"
    template.write_text("{% for m in messages %}{% if m.content == 'LOOP' %}{% for i in range(100000) %}"
                        "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
                        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    looping = {**GOOD, "chosen": [{"role": "assistant", "content": "LOOP"}]}
    src = write_jsonl(tmp_path / "d.jsonl", [GOOD, looping, GOOD])
    with pytest.raises(PrepareError) as err:
        run([src], tool_tok, tmp_path / "s", chat_template=str(template))
    assert "line 2" in str(err.value) and "ran past 0.5 s" in str(err.value)
    r = run([src], tool_tok, tmp_path / "s", chat_template=str(template), skip_invalid=True)
    assert r.examples == 2 and r.skipped == {"template_timeout": 1}
