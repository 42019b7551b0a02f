"""Agent rows through the reasoning templates of late 2026 (issue 52; tests/data/chat_templates, PROVENANCE.md there):
GLM-4.5, Kimi-K2-Thinking, MiniMax-M2, DeepSeek-V3.2, Nemotron-Nano-v2, Gemma 4 (interleaved), Seed-OSS, LFM2.5,
each rendered with its own template (no prefpack training template exists for them). Every case (a tool call,
parallel calls, reasoning, a user turn inside the reply, all of them at once) under --train-on assistant and last
is either stored with masks checked against the row's own text (each piece of what the model wrote that the template
renders is scored; tool results, user turns and, under `last`, earlier assistant turns are not), or refused in one
line naming the row and the cause, as OUTCOME says: today's behaviour, recorded in docs/data.md's table. Text a
template itself leaves out (earlier reasoning, Kimi's call names it writes as call ids) is reported, as LEFT_OUT says.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import write_jsonl

from prefpack.data.prepare import PrepareError, PrepareOptions, prepare
from prefpack.data.spans import scored_of
from prefpack.data.store import Store
from prefpack.tokenizer import load_tokenizer

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
FAMILIES = {  # special tokens added to the toy ChatML tokenizer, EOS, BOS
    "glm-4.5": (["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"], "<|user|>", None),
    "kimi-k2-thinking": (["<|im_end|>", "<|im_middle|>", "<|im_system|>", "<|im_user|>", "<|im_assistant|>",
                          "<|tool_call_argument_begin|>", "<|tool_call_begin|>", "<|tool_call_end|>",
                          "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"], "<|im_end|>", None),
    "minimax-m2": (["]~!b[", "]~b]", "[e~[", "<minimax:tool_call>", "</minimax:tool_call>"], "[e~[", "]~!b["),
    "deepseek-v3.2": (["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
                      "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"),
    "nemotron-nano-v2": (["<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>"], "<SPECIAL_12>", None),
    "gemma-4-interleaved": (["<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>",
                             "<|tool_response>", "<tool_response|>", "<|tool>", "<tool|>", "<|think|>", "<bos>"],
                            "<turn|>", "<bos>"),
    "seed-oss": (["<seed:bos>", "<seed:eos>", "<seed:pad>", "<seed:think>", "</seed:think>", "<seed:tool_call>",
                  "</seed:tool_call>"], "<seed:eos>", "<seed:bos>"),
    "lfm2.5": (["<|im_start|>", "<|im_end|>", "<|tool_call_start|>", "<|tool_call_end|>", "<|startoftext|>"],
               "<|im_end|>", "<|startoftext|>"),
}


def call(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": {"city": "Paris"}}}


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name} of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def said(text: str, reasoning: str | None = None) -> dict:
    return {"role": "assistant", "content": text, **({"reasoning_content": reasoning} if reasoning else {})}


TOOLS = [tool("get_weather"), tool("get_time")]
PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]
SUNNY, NOON = {"role": "tool", "content": "TOOLOUT sunny"}, {"role": "tool", "content": "TOOLOUT noon"}
USER = {"role": "user", "content": "USERTURN tomorrow?"}
CASES = {  # reply, whether the row has tools
    "tool-call": ([{"role": "assistant", "content": "", "tool_calls": [call("get_weather")]}, SUNNY,
                   said("It is sunny.")], True),
    "parallel-calls": ([{"role": "assistant", "content": "", "tool_calls": [call("get_weather"), call("get_time")]},
                        SUNNY, NOON, said("It is sunny at noon.")], True),
    "reasoning": ([said("It is sunny.", "I should answer.")], False),
    "user-turn": ([said("It is sunny."), USER, said("Probably rain.")], False),
    "agent": ([{"role": "assistant", "content": "", "reasoning_content": "I should call both tools.",
                "tool_calls": [call("get_weather"), call("get_time")]}, SUNNY, NOON,
               said("It is sunny at noon.", "Both results are in."), USER,
               said("Probably rain.", "The forecast says rain.")], True),
}
PLAIN = [said("I do not know.")]

# the refusals' causes (each one line naming the row and field); every other case is stored exactly
OPENS_THINK = "is not how it renders the reply"  # the generation prompt opens a think block no reply continues
REWRITES = "the template rewrites an earlier turn"  # earlier reasoning dropped once later messages follow
OUTCOME = {
    **{("glm-4.5", "agent", "assistant"): "assistant message 0 of field 'chosen' renders as",
       ("kimi-k2-thinking", "agent", "assistant"): "assistant message 0 of field 'chosen' renders as"},
    **{("minimax-m2", c, t): OPENS_THINK for c in CASES for t in ("assistant", "last")},
    **{("deepseek-v3.2", c, t): OPENS_THINK if c in ("tool-call", "parallel-calls", "reasoning") else REWRITES
       for c in CASES for t in ("assistant", "last")},
    **{("nemotron-nano-v2", c, t): OPENS_THINK for c in CASES for t in ("assistant", "last") if c != "reasoning"},
    **{("gemma-4-interleaved", c, t): OPENS_THINK for c in CASES for t in ("assistant", "last")},
}
# what the template itself leaves out of stored rows, reported in the summary (a piece of each line)
LEFT_OUT = {
    ("glm-4.5", "agent", "last"): ["message 0's reasoning", "message 3's reasoning"],
    ("kimi-k2-thinking", "tool-call"): ["message 0's tool call 'get_weather'"],  # it writes the call's id, not name
    ("kimi-k2-thinking", "parallel-calls"): ["message 0's tool call 'get_time'"],
    ("kimi-k2-thinking", "reasoning"): ["message 0's reasoning"],  # kept only inside an unfinished tool-call chain
    ("kimi-k2-thinking", "agent", "last"): ["message 5's reasoning", "message 0's tool call"],
    ("nemotron-nano-v2", "reasoning"): ["message 0's reasoning"],  # reads reasoning only inside content
    ("lfm2.5", "agent"): ["message 0's reasoning", "message 3's reasoning"],
}
# the exact scored text of the all-in-one agent row where it is stored
AGENT_SCORED = {
    ("glm-4.5", "last"): "\n<think>The forecast says rain.</think>\nProbably rain.<|user|>",
    ("kimi-k2-thinking", "last"): "<think></think>Probably rain.<|im_end|>",
    ("seed-oss", "assistant"): (
        "<seed:think>I should call both tools.</seed:think>\n" + "".join(
            f"<seed:tool_call>\n<function={n}>\n<parameter=city>Paris</parameter>\n</function>\n</seed:tool_call>"
            + ("\n" if n == "get_weather" else "") for n in ("get_weather", "get_time"))
        + "<seed:eos><seed:think>Both results are in.</seed:think>\nIt is sunny at noon.<seed:eos>"
        "<seed:think>The forecast says rain.</seed:think>\nProbably rain.<seed:eos>"),
    ("seed-oss", "last"): "<seed:think>The forecast says rain.</seed:think>\nProbably rain.<seed:eos>",
    ("lfm2.5", "assistant"): ("<|tool_call_start|>[get_weather(city='Paris'), get_time(city='Paris')]"
                              "<|tool_call_end|><|im_end|>\nIt is sunny at noon.<|im_end|>\n"
                              "<think>The forecast says rain.</think>Probably rain.<|im_end|>\n"),
    ("lfm2.5", "last"): "<think>The forecast says rain.</think>Probably rain.<|im_end|>\n",
}


@pytest.fixture(scope="module")
def template_toks(toy_tokenizers, tmp_path_factory):
    out = {}
    for name, (specials, eos, bos) in FAMILIES.items():
        tok = load_tokenizer(toy_tokenizers["chatml"])
        tok.add_special_tokens({"additional_special_tokens": specials})
        tok.eos_token = eos
        if bos:
            tok.bos_token = bos
        tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
        path = tmp_path_factory.mktemp(name)
        tok.save_pretrained(path)
        out[name] = path
    return out


def own_text(message: dict) -> list[str]:
    names = [c["function"]["name"] for c in message.get("tool_calls") or []]
    return [p for p in (message.get("reasoning_content"), message.get("content"), *names) if p]


def decoded(tok, ids, keep) -> str:
    mask = scored_of(ids)
    mask = [True] * len(ids) if mask is None else mask
    return tok.decode([int(t) for t, s in zip(ids, mask) if s == keep])


PARAMS = [(n, c, t) for n in FAMILIES for c in CASES for t in ("assistant", "last")]


@pytest.mark.parametrize("name,case,train_on", PARAMS, ids=["-".join(p) for p in PARAMS])
def test_agent_rows_on_each_template(tmp_path, template_toks, name, case, train_on):
    reply, with_tools = CASES[case]
    row = {"prompt": PROMPT, "chosen": reply, "rejected": PLAIN, **({"tools": TOOLS} if with_tools else {})}
    data = write_jsonl(tmp_path / "rows.jsonl", [row])
    options = PrepareOptions(inputs=[str(data)], tokenizer=str(template_toks[name]), output=str(tmp_path / "s"),
                             workers=1, train_on=train_on)
    refusal = OUTCOME.get((name, case, train_on))
    if refusal:
        with pytest.raises(PrepareError) as err:
            prepare(options, log=lambda m: None)
        message = str(err.value)
        assert "\n" not in message and "rows.jsonl line 1, field '" in message and refusal in message
        assert "--chat-template FILE" in message
        return
    report = prepare(options, log=lambda m: None)
    tok = load_tokenizer(template_toks[name])
    ids = Store(tmp_path / "s").pair(0).chosen
    full, scored, hidden = tok.decode([int(t) for t in ids]), decoded(tok, ids, True), decoded(tok, ids, False)
    assistant = [m for m in reply if m["role"] == "assistant"]
    wanted = assistant if train_on == "assistant" else assistant[-1:]
    for piece in (p for m in wanted for p in own_text(m) if p in full):  # what the model wrote and the row shows
        assert piece in scored, (piece, scored)
    for m in reply:  # tool results and user turns are context, not scored
        if m["role"] in ("tool", "user"):
            assert m["content"] in hidden and m["content"] not in scored
    if train_on == "last":
        for piece in (p for m in assistant[:-1] for p in own_text(m) if p in full):
            assert piece not in scored, (piece, scored)
    if case == "agent":
        assert scored == AGENT_SCORED[(name, train_on)]
    left = LEFT_OUT.get((name, case, train_on), LEFT_OUT.get((name, case), []))
    assert all(words in (report.left_out or {}).get("first", "") for words in left), report.left_out
    assert bool(left) == bool(report.left_out and report.left_out.get("rows"))
