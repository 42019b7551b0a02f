"""Agent rows through the reasoning templates of late 2026 (issue 52; tests/data/chat_templates, PROVENANCE.md there):
GLM-4.5, Kimi-K2-Thinking, MiniMax-M2, DeepSeek-V3.2, Nemotron-Nano-v2, Gemma 4 (interleaved; thinking off, its
default, and on), Seed-OSS, LFM2.5, each rendered with its own template (no prefpack training template exists for
them). Every case (a tool call, parallel calls, reasoning, a user turn inside the reply, all of them at once) under
--train-on assistant and last is either stored exactly or refused in one line naming the row, the template and the
cause, as OUTCOME says (docs/data.md's table). "Exactly" is checked against the template itself, independently of
how prepare renders: every scored run of tokens follows, in its own sequence (the prompt, then one segment), exactly
what the template prompts the model with before that turn (``render(messages before it, add_generation_prompt)``),
and is the end of what the template renders once the turn is written; the reply's own text is scored, tool results
and user turns are not. A template that rewrites earlier turns gives a reply several sequences (SEQUENCES). Text the
template itself never renders (earlier reasoning, Kimi's call names) is reported, as LEFT_OUT says.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import write_jsonl
from transformers.utils.chat_template_utils import render_jinja_template

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
FAMILIES["gemma-4-interleaved+thinking"] = FAMILIES["gemma-4-interleaved"]  # the same template, thinking on
KWARGS = {"gemma-4-interleaved+thinking": {"enable_thinking": True}}


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
REJECTED = [said("I do not know.", "No idea.")]

# the refusals' causes (each one line naming the row, the field and the template); every other case is stored
NO_REASONING = "always opens the model's reasoning after its generation prompt"  # MiniMax-M2 always reasons
THINKING_OFF = "with enable_thinking true it does"  # Gemma 4's default closes an empty thought channel no reply has
OUTCOME = {
    **{("minimax-m2", c, t): NO_REASONING for c in ("tool-call", "parallel-calls", "user-turn")
       for t in ("assistant", "last")},
    # llama.cpp's DeepSeek-V3.2 template appends a user turn to its generation prompt, which no reply continues
    **{("deepseek-v3.2", c, t): "is '<｜User｜>\\n<｜Assistant｜><think>', but it renders that message as"
       for c in CASES for t in ("assistant", "last")},
    # Nemotron-Nano-v2 prompts with <think> but renders a tool-call turn without one
    **{("nemotron-nano-v2", c, "assistant"): "is '<SPECIAL_11>Assistant\\n<think>\\n\\n', but it renders that message"
       for c in ("tool-call", "parallel-calls", "agent")},
    **{("gemma-4-interleaved", c, t): THINKING_OFF for c in CASES for t in ("assistant", "last")},
}
# how many sequences the chosen reply becomes where its template rewrites an earlier turn (1 elsewhere)
SEQUENCES = {k: v for k, v in {('glm-4.5', 'agent', 'assistant'): 2, ('kimi-k2-thinking', 'agent', 'assistant'): 2, ('minimax-m2', 'agent', 'assistant'): 2, ('nemotron-nano-v2', 'user-turn', 'assistant'): 2, ('lfm2.5', 'agent', 'assistant'): 2, ('gemma-4-interleaved+thinking', 'agent', 'assistant'): 2}.items()}
# what the template itself leaves out of the scored turns, reported in the summary: field, message, what
# (under `last`, earlier turns are context, shown as the template shows them, and not reported)
LEFT_OUT = {
    ('kimi-k2-thinking', 'tool-call', 'assistant'): ['chosen 0 tool call', 'rejected 0 reasoning'],
    ('kimi-k2-thinking', 'tool-call', 'last'): ['rejected 0 reasoning'],
    ('kimi-k2-thinking', 'parallel-calls', 'assistant'): ['chosen 0 tool call', 'rejected 0 reasoning'],
    ('kimi-k2-thinking', 'parallel-calls', 'last'): ['rejected 0 reasoning'],
    ('kimi-k2-thinking', 'reasoning', 'assistant'): ['chosen 0 reasoning', 'rejected 0 reasoning'],
    ('kimi-k2-thinking', 'reasoning', 'last'): ['chosen 0 reasoning', 'rejected 0 reasoning'],
    ('kimi-k2-thinking', 'user-turn', 'assistant'): ['rejected 0 reasoning'],
    ('kimi-k2-thinking', 'user-turn', 'last'): ['rejected 0 reasoning'],
    ('kimi-k2-thinking', 'agent', 'assistant'): ['chosen 0 tool call', 'chosen 3 reasoning', 'chosen 5 reasoning', 'rejected 0 reasoning'],
    ('kimi-k2-thinking', 'agent', 'last'): ['chosen 5 reasoning', 'rejected 0 reasoning'],
    ('nemotron-nano-v2', 'tool-call', 'last'): ['rejected 0 reasoning'],
    ('nemotron-nano-v2', 'parallel-calls', 'last'): ['rejected 0 reasoning'],
    ('nemotron-nano-v2', 'reasoning', 'assistant'): ['chosen 0 reasoning', 'rejected 0 reasoning'],
    ('nemotron-nano-v2', 'reasoning', 'last'): ['chosen 0 reasoning', 'rejected 0 reasoning'],
    ('nemotron-nano-v2', 'user-turn', 'assistant'): ['rejected 0 reasoning'],
    ('nemotron-nano-v2', 'user-turn', 'last'): ['rejected 0 reasoning'],
    ('nemotron-nano-v2', 'agent', 'last'): ['chosen 5 reasoning', 'rejected 0 reasoning'],
    ('gemma-4-interleaved+thinking', 'tool-call', 'assistant'): ['rejected 0 reasoning'],
    ('gemma-4-interleaved+thinking', 'tool-call', 'last'): ['rejected 0 reasoning'],
    ('gemma-4-interleaved+thinking', 'parallel-calls', 'assistant'): ['rejected 0 reasoning'],
    ('gemma-4-interleaved+thinking', 'parallel-calls', 'last'): ['rejected 0 reasoning'],
    ('gemma-4-interleaved+thinking', 'reasoning', 'assistant'): ['chosen 0 reasoning', 'rejected 0 reasoning'],
    ('gemma-4-interleaved+thinking', 'reasoning', 'last'): ['chosen 0 reasoning', 'rejected 0 reasoning'],
    ('gemma-4-interleaved+thinking', 'user-turn', 'assistant'): ['rejected 0 reasoning'],
    ('gemma-4-interleaved+thinking', 'user-turn', 'last'): ['rejected 0 reasoning'],
    ('gemma-4-interleaved+thinking', 'agent', 'assistant'): ['chosen 3 reasoning', 'chosen 5 reasoning', 'rejected 0 reasoning'],
    ('gemma-4-interleaved+thinking', 'agent', 'last'): ['chosen 5 reasoning', 'rejected 0 reasoning'],
}
# the exact scored text of the all-in-one agent row where it is stored
AGENT_SCORED = {
    ('glm-4.5', 'assistant'): '\n<think>I should call both tools.</think>\n<tool_call>get_weather<arg_key>city</arg_key>\n<arg_value>Paris</arg_value></tool_call>\n<tool_call>get_time<arg_key>city</arg_key>\n<arg_value>Paris</arg_value></tool_call>\n<think>Both results are in.</think>\nIt is sunny at noon.\n<think>The forecast says rain.</think>\nProbably rain.<|user|>',
    ('glm-4.5', 'last'): '\n<think>The forecast says rain.</think>\nProbably rain.<|user|>',
    ('kimi-k2-thinking', 'assistant'): '<think>I should call both tools.</think><|tool_calls_section_begin|><|tool_call_begin|><|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|><|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|><think></think>It is sunny at noon.<|im_end|><think></think>Probably rain.<|im_end|>',
    ('kimi-k2-thinking', 'last'): '<think></think>Probably rain.<|im_end|>',
    ('minimax-m2', 'assistant'): 'I should call both tools.\n</think>\n\n\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>\n<invoke name="get_time">\n<parameter name="city">Paris</parameter>\n</invoke>\n</minimax:tool_call>\n[e~[\nBoth results are in.\n</think>\n\nIt is sunny at noon.[e~[\nThe forecast says rain.\n</think>\n\nProbably rain.[e~[\n',
    ('minimax-m2', 'last'): 'The forecast says rain.\n</think>\n\nProbably rain.[e~[\n',
    ('nemotron-nano-v2', 'last'): 'Probably rain.\n<SPECIAL_12>\n\n',
    ('seed-oss', 'assistant'): '<seed:think>I should call both tools.</seed:think>\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n</seed:tool_call>\n<seed:tool_call>\n<function=get_time>\n<parameter=city>Paris</parameter>\n</function>\n</seed:tool_call><seed:eos><seed:think>Both results are in.</seed:think>\nIt is sunny at noon.<seed:eos><seed:think>The forecast says rain.</seed:think>\nProbably rain.<seed:eos>',
    ('seed-oss', 'last'): '<seed:think>The forecast says rain.</seed:think>\nProbably rain.<seed:eos>',
    ('lfm2.5', 'assistant'): "<think>I should call both tools.</think><|tool_call_start|>[get_weather(city='Paris'), get_time(city='Paris')]<|tool_call_end|><|im_end|>\n<think>Both results are in.</think>It is sunny at noon.<|im_end|>\n<think>The forecast says rain.</think>Probably rain.<|im_end|>\n",
    ('lfm2.5', 'last'): '<think>The forecast says rain.</think>Probably rain.<|im_end|>\n',
    ('gemma-4-interleaved+thinking', 'assistant'): '<|channel>thought\nI should call both tools.<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_call>call:get_time{city:<|"|>Paris<|"|>}<tool_call|><turn|>\nIt is sunny at noon.<turn|>\nProbably rain.<turn|>\n',
    ('gemma-4-interleaved+thinking', 'last'): 'Probably rain.<turn|>\n',
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
        tok.chat_template = template_source(name)
        path = tmp_path_factory.mktemp(name.replace("+", "-"))
        tok.save_pretrained(path)
        out[name] = path
    return out


def template_source(name: str) -> str:
    return (TEMPLATES / f"{name.split('+')[0]}.jinja").read_text(encoding="utf-8")


def own_text(message: dict) -> list[str]:
    names = [c["function"]["name"] for c in message.get("tool_calls") or []]
    return [p for p in (message.get("reasoning_content"), message.get("content"), *names) if p]


def runs(ids) -> list[tuple[int, int]]:
    """The [start, end) runs of scored tokens of a completion."""
    mask = scored_of(ids)
    mask = [True] * len(ids) if mask is None else list(mask)
    out, start = [], None
    for i, s in enumerate([*mask, False]):
        if s and start is None:
            start = i
        elif not s and start is not None:
            out.append((start, i))
            start = None
    return out


def sequences(ids) -> list[tuple[int, int]]:
    """The [start, end) token ranges of a completion's segments (one sequence each after the prompt)."""
    cuts = [0, *[int(k) for k in (getattr(ids, "segments", None) if getattr(ids, "segments", None) is not None
                                  else [])], len(ids)]
    return list(zip(cuts, cuts[1:]))


PARAMS = [(n, c, t) for n in FAMILIES for c in CASES for t in ("assistant", "last")]


@pytest.mark.parametrize("name,case,train_on", PARAMS, ids=["-".join(p) for p in PARAMS])
def test_agent_rows_on_each_template(tmp_path, template_toks, name, case, train_on):
    reply, with_tools = CASES[case]
    row = {"prompt": PROMPT, "chosen": reply, "rejected": REJECTED, **({"tools": TOOLS} if with_tools else {})}
    data = write_jsonl(tmp_path / "rows.jsonl", [row])
    options = PrepareOptions(inputs=[str(data)], tokenizer=str(template_toks[name]), output=str(tmp_path / "s"),
                             workers=1, train_on=train_on, chat_template_kwargs=KWARGS.get(name))
    refusal = OUTCOME.get((name, case, train_on))
    if refusal:
        with pytest.raises(PrepareError) as err:
            prepare(options, log=lambda m: None)
        message = str(err.value)
        assert "\n" not in message and "rows.jsonl line 1, field '" in message and refusal in message
        assert "the chat template (the tokenizer's own, " in message and "--chat-template FILE" in message
        return
    report = prepare(options, log=lambda m: None)
    tok = load_tokenizer(template_toks[name])
    pair = Store(tmp_path / "s").pair(0)
    prompt = [int(t) for t in pair.prompt]
    for field, messages, ids in (("chosen", reply, pair.chosen), ("rejected", REJECTED, pair.rejected)):
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        turns = turns[-1:] if train_on == "last" else turns
        if field == "chosen":
            assert len(sequences(ids)) == SEQUENCES.get((name, case, train_on), 1)
        scored_runs = runs(ids)
        assert len(scored_runs) == len(turns), (field, scored_runs)
        for k, (s, e) in zip(turns, scored_runs):  # turn k after exactly the context the template gives it
            a = next(a for a, b in sequences(ids) if a <= s < b)  # the sequence (segment) holding the run
            assert e <= next(b for a, b in sequences(ids) if a <= s < b)
            context, written = tok.decode(prompt + [int(t) for t in ids[a:s]]), tok.decode([int(t) for t in ids[s:e]])
            assert context == render(name, messages[:k], with_tools, True), (field, k)
            whole = render(name, messages[:k + 1], with_tools, False)  # prepare may append EOS to the reply's end
            assert whole.endswith(written) or (whole + tok.eos_token).endswith(written), (field, k, written)
            shown = [p for p in own_text(messages[k]) if p in whole and p not in context]  # what the turn adds
            assert all(p in written for p in shown), (field, k, shown, written)
            assert not any(m["content"] in written for m in messages if m["role"] in ("tool", "user"))
    if case == "agent":
        scored = "".join(tok.decode([int(t) for t in pair.chosen[s:e]]) for s, e in runs(pair.chosen))
        assert scored == AGENT_SCORED[(name, train_on)]
    left = sorted(LEFT_OUT.get((name, case, train_on), []))
    reported = report.left_out.get("first", "") if report.left_out else ""
    found = sorted({f"{f} {m} {w}" for f, m, w in re.findall(r"field '(\w+)': message (\d+)'s ([a-z ]+?) '",
                                                             reported)})
    assert found == left, reported
    assert bool(left) == bool(report.left_out and report.left_out.get("rows"))


def render(name: str, messages: list[dict], with_tools: bool, generation_prompt: bool) -> str:
    """The template's own rendering of the prompt and ``messages`` (as apply_chat_template renders), independent of
    prepare's renderer."""
    specials, eos, bos = FAMILIES[name]
    out, _ = render_jinja_template([list(PROMPT) + list(messages)], tools=TOOLS if with_tools else None,
                                   chat_template=template_source(name), add_generation_prompt=generation_prompt,
                                   bos_token=bos or "", eos_token=eos, **KWARGS.get(name, {}))
    return out[0]


def test_split_replies_train_and_are_reported(tmp_path, template_toks, one_thread):
    """Rows a template forces into several sequences (GLM-4.5's agent row under `assistant`, MiniMax-M2's under
    `last` whose prompt stops before its generation prompt) are counted in the summary and meta.json, shown by
    inspect, trained and evaluated through the CLI; generate does not sample a prompt stored without its generation
    prompt, and says so."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from prefpack.cli import main as cli_main
    from prefpack.generation.prompts import StorePrompts

    reply, _ = CASES["agent"]
    row = {"prompt": PROMPT, "chosen": reply, "rejected": REJECTED, "tools": TOOLS}
    data = write_jsonl(tmp_path / "rows.jsonl", [row] * 4)
    options = PrepareOptions(inputs=[str(data)], tokenizer=str(template_toks["glm-4.5"]), output=str(tmp_path / "s"),
                             workers=1)
    summary = prepare(options, log=lambda m: None).summary()
    assert "scored turn by turn: 4 rows' replies became 4 more sequences" in summary
    store = Store(tmp_path / "s")
    assert store.meta["counts"]["rows_split_by_turns"] == 4 and store.meta["format_version"] == 5
    model = tmp_path / "model"  # the templates' tool schemas make 900-token sequences of the toy tokenizer
    LlamaForCausalLM(LlamaConfig(vocab_size=len(load_tokenizer(template_toks["glm-4.5"])), hidden_size=32,
                                 intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=2048)).save_pretrained(model)
    run = tmp_path / "run"
    assert cli_main(["train", f"model.name_or_path={model}", f"data.train={tmp_path / 's'}", "train.max_steps=2",
                     "train.global_batch_pairs=2", "train.device=cpu", f"run.output_dir={run}", "--no-progress"]) == 0
    assert cli_main(["precompute-ref", "--model", str(model), "--data", str(tmp_path / "s")]) == 0
    assert cli_main(["eval", "--model", str(run / "final"), "--data", str(tmp_path / "s"), "--json"]) == 0
    last = PrepareOptions(inputs=[str(data)], tokenizer=str(template_toks["minimax-m2"]), output=str(tmp_path / "m"),
                          workers=1, train_on="last")
    prepare(last, log=lambda m: None)
    opened = Store(tmp_path / "m")  # one sequence per reply, but prompts stopping before the generation prompt:
    assert opened.num_segments == 0 and opened.meta["format_version"] == 5  # version 5, so older readers refuse
    assert (opened.column("flags") & 4).all()
    prompts = StorePrompts(str(tmp_path / "m"))
    assert list(prompts) == [] and "4 examples not sampled" in " ".join(prompts.notes)
