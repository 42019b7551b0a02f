"""prepare --train-on: in a chat reply only what the model wrote is scored. Round trips on a ChatML and a Llama-3-style
template built here on the toy tokenizer, and on the real Qwen2.5 template when ../shared holds it: the decoded
scored tokens of each completion are exactly the assistant messages' rendered text plus end-of-turn."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import write_jsonl

from prefpack.data.prepare import PrepareError, PrepareOptions, prepare
from prefpack.data.spans import scored_of
from prefpack.data.store import Store
from prefpack.tokenizer import load_tokenizer

CHATML = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}{%- if m.content %}{{- m.content }}{%- endif %}"
    "{%- for c in m.tool_calls or [] %}{{- '<tool_call>' + (c.function | tojson) + '</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3 = (
    "{%- for m in messages %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' }}"
    "{%- if m.content %}{{- m.content }}{%- endif %}"
    "{%- for c in m.tool_calls or [] %}{{- (c.function | tojson) }}{%- endfor %}{{- '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
_REPO = Path(__file__).resolve().parent.parent
QWEN = next((p for p in (_REPO / "shared" / "tokenizers" / "qwen2.5", _REPO.parent / "shared" / "tokenizers" / "qwen2.5")
             if p.is_dir()), _REPO.parent / "shared" / "tokenizers" / "qwen2.5")  # beside the repository, if anywhere

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]
AGENT = [{"role": "assistant", "content": "", "tool_calls": [CALL]},
         {"role": "tool", "content": "{\"temp\": 21, \"sky\": \"clear and sunny all day long\"}"},
         {"role": "user", "content": "And in short?"},
         {"role": "assistant", "content": "It is 21 degrees and sunny in Paris."}]
PLAIN = [{"role": "assistant", "content": "I cannot look that up."}]


def own_text(style: str, m: dict) -> str:
    """An assistant message as the template renders it after its header, end-of-turn included (written out here)."""
    calls = "".join((f"<tool_call>{json.dumps(c['function'])}</tool_call>" if style == "chatml" else
                     json.dumps(c["function"])) for c in m.get("tool_calls") or [])
    return (m["content"] or "") + calls + ("<|im_end|>\n" if style == "chatml" else "<|eot_id|>")


@pytest.fixture(scope="module")
def chat_toks(toy_tokenizers, tmp_path_factory):
    out = {}
    for style, template in (("chatml", CHATML), ("llama3", LLAMA3)):
        tok = load_tokenizer(toy_tokenizers["chatml"])
        if style == "llama3":
            tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>",
                                                                  "<|eot_id|>"]})
            tok.eos_token = "<|eot_id|>"
        tok.chat_template = template
        path = tmp_path_factory.mktemp(style)
        tok.save_pretrained(path)
        out[style] = path
    return out


def run(tmp_path, tok, rows, train_on=None, **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / f"store-{train_on}"
    prepare(PrepareOptions(inputs=[str(data)], tokenizer=str(tok), output=str(out), workers=1, train_on=train_on,
                           overwrite=True, **kw), log=lambda m: None)
    return Store(out, verify=True)


def scored_text(tok, ids) -> str:
    mask = scored_of(ids)
    keep = [int(t) for t, s in zip(ids, mask if mask is not None else [True] * len(ids)) if s]
    return tok.decode(keep, skip_special_tokens=False)


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_assistant_and_last_score_exactly_the_assistant_messages(tmp_path, chat_toks, style):
    tok = load_tokenizer(chat_toks[style])
    row = {"prompt": PROMPT, "chosen": AGENT, "rejected": PLAIN}
    plain = run(tmp_path, chat_toks[style], [row], "all")
    assert plain.spans.shape == (0, 2) and scored_of(plain.pair(0).chosen) is None
    st = run(tmp_path, chat_toks[style], [row], None)  # assistant, the default
    assert st.meta["train_on"] == "assistant" and st.meta["num_spans"] >= 1
    pair, before = st.pair(0), plain.pair(0)
    for a, b in zip(pair, before):  # the same tokens as --train-on all; only the mask differs
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert scored_text(tok, pair.chosen) == own_text(style, AGENT[0]) + own_text(style, AGENT[3])
    assert scored_of(pair.rejected) is None  # one assistant message: all scored
    unscored = tok.decode([int(t) for t, s in zip(pair.chosen, scored_of(pair.chosen)) if not s])
    assert "clear and sunny" in unscored and "And in short?" in unscored and "assistant" in unscored
    last = run(tmp_path, chat_toks[style], [row], "last")
    assert last.meta["train_on"] == "last"
    assert scored_text(tok, last.pair(0).chosen) == own_text(style, AGENT[3])


def test_kto_completion_and_cli_flag(tmp_path, chat_toks, capsys):
    from prefpack.cli import main as cli_main

    tok = load_tokenizer(chat_toks["chatml"])
    data = write_jsonl(tmp_path / "kto.jsonl", [{"prompt": PROMPT, "completion": AGENT, "label": True},
                                                {"prompt": PROMPT, "completion": PLAIN, "label": False}])
    out = tmp_path / "kto"
    assert cli_main(["prepare", str(data), "--tokenizer", str(chat_toks["chatml"]), "-o", str(out), "--workers",
                     "1", "--train-on", "last"]) == 0
    st = Store(out)
    assert st.meta["train_on"] == "last" and st.meta["args"]["train_on"] == "last"
    assert scored_text(tok, st.unpaired(0).completion) == own_text("chatml", AGENT[3])
    assert scored_of(st.unpaired(1).completion) is None


def test_train_on_is_checked(tmp_path, chat_toks):
    with pytest.raises(PrepareError, match="--train-on must be one of"):
        run(tmp_path, chat_toks["chatml"], [{"prompt": PROMPT, "chosen": AGENT, "rejected": PLAIN}], "tools")


def test_a_template_unstable_inside_the_reply_is_refused(tmp_path, chat_toks):
    """A template that renders the last assistant message apart from earlier ones cannot have its turns cut out:
    the row is refused with file, line and field (the whole reply still renders as a prefix of itself)."""
    tok = load_tokenizer(chat_toks["chatml"])
    tok.chat_template = CHATML.replace("{%- for m in messages %}", "{%- for m in messages %}{%- if m.role != "
                                       "'assistant' or not loop.last %}").replace("{%- endfor %}{%- if add_gen",
                                                                                  "{%- endif %}{%- endfor %}{%- if add_gen")
    path = tmp_path / "tok"
    tok.save_pretrained(path)
    # chosen = [assistant, tool]: the assistant turn is dropped when last, so the cut after it is no prefix
    rows = [{"prompt": PROMPT, "chosen": [{"role": "assistant", "content": "x"}, {"role": "tool", "content": "t"}],
             "rejected": PLAIN}]
    with pytest.raises(PrepareError) as err:
        run(tmp_path, path, rows, None)
    assert "rows.jsonl line 1, field 'chosen'" in str(err.value) and "prefix-stable" in str(err.value)


@pytest.mark.skipif(not (QWEN / "tokenizer.json").is_file(), reason="needs the Qwen2.5 tokenizer in ../shared")
def test_qwen25_tools_template_round_trip(tmp_path):
    tok = load_tokenizer(QWEN)
    if not tok.chat_template:
        tok.chat_template = (QWEN / "chat_template.jinja").read_text()
    path = tmp_path / "qwen"
    tok.save_pretrained(path)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                               "parameters": {"type": "object", "properties": {}}}}]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    chosen = [{"role": "assistant", "content": "", "tool_calls": [call]},
              {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "21 C"},
              {"role": "assistant", "content": "Sunny, 21 C."}]
    row = {"prompt": PROMPT, "chosen": chosen, "rejected": PLAIN, "tools": tools}
    st = run(tmp_path, path, [row], None)
    want = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
            "Sunny, 21 C.<|im_end|>\n")
    assert scored_text(tok, st.pair(0).chosen) == want
    last = run(tmp_path, path, [row], "last")
    assert scored_text(tok, last.pair(0).chosen) == "Sunny, 21 C.<|im_end|>\n"


def test_inspect_shows_which_tokens_are_scored(tmp_path, chat_toks, capsys):
    from prefpack.cli import main as cli_main
    from prefpack.data.store import StoreError

    st = run(tmp_path, chat_toks["chatml"], [{"prompt": PROMPT, "chosen": AGENT, "rejected": PLAIN}])
    assert cli_main(["inspect", str(st.path), "--row", "0", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "train_on=assistant" in out and f"{st.meta['num_spans']} unscored spans" in out
    n, k = len(st.pair(0).chosen), int(scored_of(st.pair(0).chosen).sum())
    assert f"--- chosen ({n} tokens, {k} scored;" in out and "--- rejected (" in out and "all scored" in out
    assert "⟦<|im_start|>tool\n" in out and "It is 21 degrees and sunny in Paris.<|im_end|>\n" in out
    assert "⟦It is 21" not in out
    assert cli_main(["inspect", str(st.path), "--row", "0", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["row"]
    assert row["chosen_scored"] == scored_of(st.pair(0).chosen).tolist() and "rejected_scored" not in row
    spans = np.fromfile(st.path / "spans.bin", dtype=np.int64).reshape(-1, 2)
    spans[0] = spans[0][::-1]  # a reversed span: the hashes catch it first, so rewrite them too
    spans.tofile(st.path / "spans.bin")
    meta = json.loads((st.path / "meta.json").read_text())
    meta["files"].pop("spans.bin")
    (st.path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="spans.bin: span 0 is empty or reversed"):
        Store(st.path, verify=True)


def test_workers_and_chunks_give_the_same_spans(tmp_path, chat_toks):
    rows = [{"prompt": PROMPT, "chosen": AGENT if i % 2 else PLAIN, "rejected": PLAIN if i % 2 else AGENT}
            for i in range(7)]
    one = run(tmp_path / "a", chat_toks["chatml"], rows, None)
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    prepare(PrepareOptions(inputs=[str(data)], tokenizer=str(chat_toks["chatml"]), output=str(tmp_path / "many"),
                           workers=2, chunk_rows=2), log=lambda m: None)
    many = Store(tmp_path / "many", verify=True)
    assert one.meta["num_spans"] == 7 and np.array_equal(np.asarray(one.spans), np.asarray(many.spans))
    assert np.array_equal(np.asarray(one.tokens), np.asarray(many.tokens))


def test_ranked_and_implicit_chat_rows_are_masked(tmp_path, chat_toks):
    tok = load_tokenizer(chat_toks["chatml"])
    ranked = run(tmp_path / "r", chat_toks["chatml"], [{"prompt": PROMPT, "completions": [AGENT, PLAIN],
                                                        "scores": [2.0, 1.0]}], None)
    _, comps = ranked.ranked_group(0)
    assert scored_text(tok, comps[0]) == own_text("chatml", AGENT[0]) + own_text("chatml", AGENT[3])
    assert scored_of(comps[1]) is None
    implicit = run(tmp_path / "i", chat_toks["chatml"], [{"chosen": PROMPT + AGENT, "rejected": PROMPT + PLAIN}],
                   "last")
    assert scored_text(tok, implicit.pair(0).chosen) == own_text("chatml", AGENT[3])


def test_max_length_cuts_the_mask_with_the_tokens(tmp_path, chat_toks):
    row = {"prompt": PROMPT, "chosen": AGENT, "rejected": PLAIN}
    full = run(tmp_path / "f", chat_toks["chatml"], [row], None)
    c = len(full.pair(0).chosen)
    cut = run(tmp_path / "c", chat_toks["chatml"], [row], None, max_length=c - 5,
              min_prompt_keep=0)  # the prompt cut to 1 token (allowed: the default minimum refuses it)
    chosen = cut.pair(0).chosen
    assert cut.meta["counts"]["truncated"] == {"prompt": 1, "completion": 1} and len(chosen) == c - 6
    assert scored_of(chosen).tolist() == scored_of(full.pair(0).chosen).tolist()[: len(chosen)]
