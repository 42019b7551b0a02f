"""Agent rows (parallel tool calls, tool results, reasoning, a user turn inside a reply) through the real chat templates
of Qwen3 (thinking on and off), DeepSeek-R1-Distill, gpt-oss and SmolLM3 (tests/data/chat_templates): the decoded
scored tokens of each stored completion are exactly what the model wrote plus its end-of-turn, written out here per
family. Qwen3, DeepSeek-R1-Distill and gpt-oss are rendered with prefpack's training templates (chosen from the
tokenizer's template); SmolLM3's own marks assistant text with {% generation %}. Text a template leaves out of a reply
(Llama 3.1: content beside a tool call) is reported, and a template no reply continues is refused naming the cause."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import write_jsonl

from prefpack.data.prepare import PrepareError, PrepareOptions, prepare
from prefpack.data.spans import scored_of
from prefpack.data.store import Store
from prefpack.tokenizer import load_tokenizer

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
FAMILIES = {  # template file, special tokens added to the toy ChatML tokenizer, EOS, BOS
    "qwen3": ("qwen3.jinja", [], "<|im_end|>", None),
    "deepseek": ("deepseek-r1-distill-qwen.jinja", ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                 "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                 "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                 "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"], "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"),
    "gpt-oss": ("gpt-oss.jinja", ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|call|>", "<|return|>"],
                "<|return|>", None),
    "smollm3": ("smollm3.jinja", [], "<|im_end|>", None),
    "llama3.1": ("llama3_1.jinja", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                    "<|eom_id|>", "<|python_tag|>"], "<|eot_id|>", "<|begin_of_text|>"),
}


def call(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": {"city": "Paris"}}}


PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]
# two parallel calls with reasoning, their results, an answer, a user turn inside the reply, a last answer
AGENT = [{"role": "assistant", "content": "", "reasoning_content": "I should call both tools.",
          "tool_calls": [call("get_weather"), call("get_time")]},
         {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "noon"},
         {"role": "assistant", "content": "It is sunny at noon.", "reasoning_content": "Both results are in."},
         {"role": "user", "content": "And tomorrow?"},
         {"role": "assistant", "content": "Probably rain.", "reasoning_content": "The forecast says rain."}]
PLAIN = [{"role": "assistant", "content": "I do not know.", "reasoning_content": "No idea."}]
ARGS = '{"city": "Paris"}'


def no_reasoning(reply: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "reasoning_content"} for m in reply]


@pytest.fixture(scope="module")
def family_toks(toy_tokenizers, tmp_path_factory):
    out = {}
    for name, (file, specials, eos, bos) in FAMILIES.items():
        tok = load_tokenizer(toy_tokenizers["chatml"])
        tok.add_special_tokens({"additional_special_tokens": specials} if specials else {})
        tok.eos_token = eos
        if bos:
            tok.bos_token = bos
        tok.chat_template = (TEMPLATES / file).read_text(encoding="utf-8")
        path = tmp_path_factory.mktemp(name)
        tok.save_pretrained(path)
        out[name] = path
    return out


def run(tmp_path, tok, rows, **kw) -> Store:
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "store"
    prepare(PrepareOptions(inputs=[str(data)], tokenizer=str(tok), output=str(out), workers=1, overwrite=True, **kw),
            log=lambda m: None)
    return Store(out, verify=True)


def scored_text(tok, ids) -> str:
    mask = scored_of(ids)
    return tok.decode([int(t) for t, s in zip(ids, mask if mask is not None else [True] * len(ids)) if s])


def unscored_text(tok, ids) -> str:
    mask = scored_of(ids)
    return "" if mask is None else tok.decode([int(t) for t, s in zip(ids, mask) if not s])


QWEN_CALLS = (f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>\n'
              f'<tool_call>\n{{"name": "get_time", "arguments": {ARGS}}}\n</tool_call>')
# family, chat_template_kwargs, --earlier-reasoning, reply, its expected scored text
CASES = {
    "qwen3-thinking": ("qwen3", None, None, AGENT,
                       QWEN_CALLS + "<|im_end|>\n" + "It is sunny at noon.<|im_end|>\n"
                       "<think>\nThe forecast says rain.\n</think>\n\nProbably rain.<|im_end|>\n"),
    "qwen3-thinking-scored": ("qwen3", None, "scored", AGENT,
                              "<think>\nI should call both tools.\n</think>\n\n" + QWEN_CALLS + "<|im_end|>\n"
                              "<think>\nBoth results are in.\n</think>\n\nIt is sunny at noon.<|im_end|>\n"
                              "<think>\nThe forecast says rain.\n</think>\n\nProbably rain.<|im_end|>\n"),
    "qwen3-no-thinking": ("qwen3", {"enable_thinking": False}, "kept", no_reasoning(AGENT),
                          QWEN_CALLS + "<|im_end|>\n" + "It is sunny at noon.<|im_end|>\n"
                          "Probably rain.<|im_end|>\n"),
    "deepseek-r1-distill": ("deepseek", None, "scored", AGENT,
                            "I should call both tools.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                            f"{ARGS}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
                            f"```json\n{ARGS}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
                            "Both results are in.\n</think>\n\nIt is sunny at noon.<｜end▁of▁sentence｜>"
                            "The forecast says rain.\n</think>\n\nProbably rain.<｜end▁of▁sentence｜>"),
    "gpt-oss": ("gpt-oss", None, "kept", AGENT,
                f" to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}<|call|>"
                f"<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{ARGS}<|call|>"
                "<|channel|>final<|message|>It is sunny at noon.<|end|>"
                "<|channel|>analysis<|message|>The forecast says rain.<|end|>"
                "<|start|>assistant<|channel|>final<|message|>Probably rain.<|return|>"),
}
REJECTED = {  # the one-message reply, scored whole
    "qwen3": "<think>\nNo idea.\n</think>\n\nI do not know.<|im_end|>\n",
    "deepseek": "No idea.\n</think>\n\nI do not know.<｜end▁of▁sentence｜>",
    "gpt-oss": "<|channel|>analysis<|message|>No idea.<|end|><|start|>assistant<|channel|>final<|message|>"
               "I do not know.<|return|>",
}


@pytest.mark.parametrize("case", list(CASES))
def test_agent_rows_score_what_the_model_wrote(tmp_path, family_toks, case):
    family, kwargs, earlier, reply, want = CASES[case]
    tok = load_tokenizer(family_toks[family])
    rejected = no_reasoning(PLAIN) if kwargs else PLAIN
    st = run(tmp_path, family_toks[family], [{"prompt": PROMPT, "chosen": reply, "rejected": rejected}],
             chat_template_kwargs=kwargs, earlier_reasoning=earlier)
    pair = st.pair(0)
    assert scored_text(tok, pair.chosen) == want
    hidden = unscored_text(tok, pair.chosen)
    assert "sunny" in hidden and "noon" in hidden and "And tomorrow?" in hidden  # tool results, the user turn
    if kwargs:
        assert scored_text(tok, pair.rejected) == "I do not know.<|im_end|>\n"
    else:
        assert scored_text(tok, pair.rejected) == REJECTED[family]
    meta = st.meta["chat_template"]
    assert meta["generation_markers"] and "training template" in meta["name"]
    assert meta["earlier_reasoning"] == (earlier or "dropped")
    if earlier == "kept" and not kwargs:  # shown, not scored
        assert "Both results are in." in hidden and "Both results are in." not in scored_text(tok, pair.chosen)
    assert load_tokenizer(st.path / "tokenizer").chat_template == tok.chat_template  # the model's own, unchanged


def test_smollm3_generation_tags_give_the_masks(tmp_path, family_toks):
    """SmolLM3's own template marks each assistant turn, header included: the header (its generation prompt) is
    left unscored, and so are tool results (SmolLM3 writes calls in the content) and the user turn."""
    tok = load_tokenizer(family_toks["smollm3"])
    reply = [{"role": "assistant", "content": "<tool_call>get_weather(Paris)</tool_call>"},
             {"role": "tool", "content": "sunny"},
             {"role": "assistant", "content": "It is sunny."},
             {"role": "user", "content": "And tomorrow?"},
             {"role": "assistant", "content": "<think>\nForecast.\n</think>\nProbably rain."}]
    for kwargs in (None, {"enable_thinking": False}):
        st = run(tmp_path, family_toks["smollm3"], [{"prompt": PROMPT, "chosen": reply, "rejected": PLAIN}],
                 chat_template_kwargs=kwargs)
        chosen = st.pair(0).chosen
        assert scored_text(tok, chosen) == (
            "<tool_call>get_weather(Paris)</tool_call><|im_end|>\nIt is sunny.<|im_end|>\n"
            "<think>\nForecast.\n</think>\nProbably rain.<|im_end|>\n")
        assert "<|im_start|>assistant\n" in unscored_text(tok, chosen) and "sunny<|im_end|>" in unscored_text(tok, chosen)
        t = st.meta["chat_template"]
        assert t == {"name": "the tokenizer's own", "sha256": t["sha256"], "chars": t["chars"], "generation_markers": True}


def test_text_a_template_leaves_out_is_reported(tmp_path, family_toks, capsys):
    """Llama 3.1 renders a tool call without the content beside it: the row is stored (its cuts check out) and the
    summary names the row and the text left out."""
    tok = load_tokenizer(family_toks["llama3.1"])
    reply = [{"role": "assistant", "content": "Let me check.", "tool_calls": [call("get_weather")]},
             {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]
    rows = [{"prompt": PROMPT, "chosen": reply, "rejected": [{"role": "assistant", "content": "No."}]}] * 2
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    report = prepare(PrepareOptions(inputs=[str(data)], tokenizer=str(family_toks["llama3.1"]),
                                    output=str(tmp_path / "s"), workers=1), log=print)
    assert report.left_out["rows"] == 2 and "rows.jsonl line 1" in report.left_out["first"]
    assert "message 0's content 'Let me check.'" in report.left_out["first"]
    assert "left out by the chat template: text of 2 rows' replies" in report.summary()
    st = Store(tmp_path / "s")
    assert st.meta["counts"]["template_left_out"] == 2
    assert scored_text(tok, st.pair(0).chosen) == (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>It is sunny.<|eot_id|>')


def test_a_generation_prompt_no_reply_continues_is_refused_naming_it(tmp_path, family_toks):
    """DeepSeek-R1-Distill's own template (forced with --chat-template tokenizer) opens the generation prompt with
    <think> which no rendered reply continues, even scored turn by turn: the refusal names that, not earlier turns,
    and the fix."""
    rows = [{"prompt": PROMPT, "chosen": [{"role": "assistant", "content": "Sunny."}],
             "rejected": [{"role": "assistant", "content": "Rain."}]}]
    with pytest.raises(PrepareError) as err:
        run(tmp_path, family_toks["deepseek"], rows, chat_template="tokenizer")
    msg = str(err.value)
    assert "generation prompt before assistant message 0 is '<｜Assistant｜><think>\\n'" in msg and "field 'chosen'" in msg
    assert "--chat-template FILE" in msg and "rows.jsonl line 1" in msg
    # Qwen3's own: a user turn in the reply drops the reasoning of the prompt's tool call
    with pytest.raises(PrepareError, match="rewrites an earlier turn once the reply in field 'chosen' follows"):
        run(tmp_path, family_toks["qwen3"], [{"prompt": PROMPT + AGENT[:3], "chosen": AGENT[3:], "rejected": PLAIN}],
            chat_template="tokenizer", train_on="all")
    # ... and a call rendered last gets an empty <think> block it loses once its tool result follows: no longer
    # refused, each turn is scored where the model wrote it, the answer in a second sequence after the prompt
    # (tests/test_chat_agent_templates.py checks such rows' contexts against the template)
    chosen = run(tmp_path, family_toks["qwen3"], [{"prompt": PROMPT, "chosen": no_reasoning(AGENT[:4]),
                                                   "rejected": PLAIN}], chat_template="tokenizer").pair(0).chosen
    assert len(getattr(chosen, "segments", None) or []) == 1
    assert "<think>\n\n</think>\n\n<tool_call>" in scored_text(load_tokenizer(family_toks["qwen3"]), chosen)
    # prefpack's DeepSeek training template with earlier reasoning dropped: a reply holding a user turn opens with a
    # turn rendered as history, which cannot continue "<think>\n"; the message names --earlier-reasoning kept
    with pytest.raises(PrepareError, match="holds a user turn.*--earlier-reasoning kept"):
        run(tmp_path, family_toks["deepseek"], [{"prompt": PROMPT, "chosen": AGENT, "rejected": PLAIN}])


def test_chat_template_file_and_bad_choices(tmp_path, family_toks):
    """--chat-template FILE renders with that file (a training template shipped with prefpack here); an unreadable
    file and an unknown --earlier-reasoning are one-line errors."""
    from prefpack.data import training_templates

    tok = load_tokenizer(family_toks["smollm3"])
    qwen3 = Path(training_templates.__file__).with_name("qwen3.jinja")
    st = run(tmp_path, family_toks["smollm3"], [{"prompt": PROMPT, "chosen": PLAIN, "rejected": AGENT[3:4]}],
             chat_template=str(qwen3))
    assert scored_text(tok, st.pair(0).chosen) == REJECTED["qwen3"]
    assert st.meta["chat_template"]["name"] == f"--chat-template {qwen3}"
    with pytest.raises(PrepareError, match="cannot read it"):
        run(tmp_path, family_toks["smollm3"], [{"prompt": PROMPT, "chosen": PLAIN, "rejected": AGENT[3:4]}],
            chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(PrepareError, match="--earlier-reasoning must be one of"):
        run(tmp_path, family_toks["qwen3"], [{"prompt": PROMPT, "chosen": PLAIN, "rejected": AGENT[3:4]}],
            earlier_reasoning="all")
