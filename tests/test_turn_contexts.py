"""The turn-by-turn method alone (prefpack/data/turn_contexts.py) on small inline templates whose renderings are
written out here: a template dropping earlier reasoning once a user turn follows splits a reply into the sequences it
forces, each turn scored right after the context the template prompts with; a template rendering history otherwise
once the turn follows is read from its generation prompt; a turn it cannot show as written is refused with the cause.
"""

from __future__ import annotations

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from prefpack.data.turn_contexts import TurnRefused, split_by_turns, turn_text

# reasoning shown only after the last user message (as Qwen3.5, GLM-4.5, MiniMax-M2 do)
DROPS = ("{%- set ns = namespace(last=-1) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}"
         "{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
         "{%- for m in messages -%}{%- if m.role == 'assistant' -%}<A>"
         "{%- if m.reasoning_content and loop.index0 > ns.last -%}<t>{{ m.reasoning_content }}</t>{%- endif -%}"
         "{{ m.content }}<E>{%- else -%}<{{ m.role }}>{{ m.content }}<E>{%- endif -%}{%- endfor -%}"
         "{%- if add_generation_prompt -%}<A>{%- endif -%}")
# history marked <done> only once the conversation ends with an assistant turn (as Kimi keeps reasoning only inside
# an unfinished tool-call chain): the last turn still follows the generation prompt <A>
MARKS = ("{%- for m in messages -%}{%- if m.role == 'assistant' -%}<A>{{ m.content }}<E>"
         "{%- else -%}<{{ m.role }}>{{ m.content }}{%- if messages[-1].role == 'assistant' -%}<done>{%- endif -%}"
         "<E>{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}<A>{%- endif -%}")
# a generation prompt that opens <t> which a reply without reasoning never continues
OPENS = ("{%- for m in messages -%}{%- if m.role == 'assistant' -%}<A>{%- if m.reasoning_content -%}<t>"
         "{{ m.reasoning_content }}</t>{%- endif -%}{{ m.content }}<E>{%- else -%}<{{ m.role }}>{{ m.content }}<E>"
         "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}<A><t>{%- endif -%}")


def renderer(source: str):
    template = ImmutableSandboxedEnvironment().from_string(source)
    return lambda messages, gen: template.render(messages=messages, add_generation_prompt=gen)


PROMPT = [{"role": "user", "content": "q"}]
REPLY = [{"role": "assistant", "content": "call", "reasoning_content": "r0"}, {"role": "tool", "content": "out"},
         {"role": "assistant", "content": "ans", "reasoning_content": "r2"}, {"role": "user", "content": "more"},
         {"role": "assistant", "content": "fin", "reasoning_content": "r4"}]


def scored(seq) -> list[str]:
    return [seq.text[a:b] for a, b in seq.scored]


def test_a_template_dropping_earlier_reasoning_gives_two_sequences():
    seqs = split_by_turns(renderer(DROPS), PROMPT, REPLY, "assistant")
    assert [s.turns for s in seqs] == [[0, 2], [4]]
    assert seqs[0].text == "<user>q<E><A><t>r0</t>call<E><tool>out<E><A><t>r2</t>ans<E>"
    assert scored(seqs[0]) == ["<t>r0</t>call<E>", "<t>r2</t>ans<E>"]
    # the second sequence: the history as the template shows it at turn 4 (reasoning dropped), unscored
    assert seqs[1].text == "<user>q<E><A>call<E><tool>out<E><A>ans<E><user>more<E><A><t>r4</t>fin<E>"
    assert scored(seqs[1]) == ["<t>r4</t>fin<E>"]
    last = split_by_turns(renderer(DROPS), PROMPT, REPLY, "last")
    assert [s.turns for s in last] == [[4]] and last[0].text == seqs[1].text


def test_a_prefix_stable_reply_stays_one_sequence():
    reply = REPLY[:3]  # no user turn inside: nothing is dropped
    seqs = split_by_turns(renderer(DROPS), PROMPT, reply, "assistant")
    assert len(seqs) == 1 and scored(seqs[0]) == ["<t>r0</t>call<E>", "<t>r2</t>ans<E>"]


def test_history_rendered_otherwise_is_read_from_the_generation_prompt():
    reply = [{"role": "assistant", "content": "a0"}, {"role": "tool", "content": "out"},
             {"role": "assistant", "content": "a2"}]
    context, written = turn_text(renderer(MARKS), PROMPT, reply, 2)
    assert context == "<user>q<E><A>a0<E><tool>out<E><A>" and written == "a2<E>"
    seqs = split_by_turns(renderer(MARKS), PROMPT, reply, "assistant")
    # each turn as the model met it: turn 2's context continues turn 0's, though no one rendering holds both
    assert [s.turns for s in seqs] == [[0, 2]] and seqs[0].text == "<user>q<E><A>a0<E><tool>out<E><A>a2<E>"


def test_a_turn_the_template_cannot_show_is_refused_with_the_cause():
    with pytest.raises(TurnRefused, match="generation prompt before assistant message 0 is '<A><t>'"):
        split_by_turns(renderer(OPENS), PROMPT, [{"role": "assistant", "content": "x"}], "assistant")
    ok = split_by_turns(renderer(OPENS), PROMPT, [{"role": "assistant", "content": "x", "reasoning_content": "r"}],
                        "assistant")
    assert scored(ok[0]) == ["r</t>x<E>"]


def test_a_header_found_only_in_history_is_not_taken_for_the_turn():
    """A turn rendered without the generation prompt's header, while an earlier turn in the history has it: the
    header found there would bring the tool result into the turn's text, so the turn is refused instead."""
    source = OPENS.replace("{%- if m.reasoning_content -%}", "{%- if m.reasoning_content and not loop.last -%}")
    reply = [{"role": "assistant", "content": "a0", "reasoning_content": "r"}, {"role": "tool", "content": "out"},
             {"role": "assistant", "content": "a2", "reasoning_content": "r2"}]
    with pytest.raises(TurnRefused):
        turn_text(renderer(source), PROMPT, reply, 2)


def test_a_header_found_at_an_earlier_assistant_turn_is_not_taken_for_the_turn():
    """The last assistant message rendered without any header, right after another assistant message: the header
    found before the earlier one would bring that message into the turn's text; refused."""
    source = ("{%- for m in messages -%}{%- if m.role == 'assistant' -%}{%- if not loop.last -%}<A>{%- endif -%}"
              "{{ m.content }}<E>{%- else -%}<{{ m.role }}>{{ m.content }}<E>{%- endif -%}{%- endfor -%}"
              "{%- if add_generation_prompt -%}<A>{%- endif -%}")
    reply = [{"role": "assistant", "content": "first"}, {"role": "assistant", "content": "second"}]
    with pytest.raises(TurnRefused):
        turn_text(renderer(source), PROMPT, reply, 1)


def test_a_reply_past_the_turn_limit_is_refused_before_rendering(monkeypatch):
    """Each turn renders its conversation twice, so a hostile row of thousands of turns would run for hours: past
    MAX_TURNS it is refused at once, naming the limit."""
    from prefpack.data import turn_contexts

    calls = []

    def render(messages, gen):
        calls.append(1)
        return renderer(DROPS)(messages, gen)

    monkeypatch.setattr(turn_contexts, "MAX_TURNS", 3)
    reply = [{"role": "assistant", "content": f"a{k}"} for k in range(4)]
    with pytest.raises(TurnRefused, match="4 scored assistant turns are past the 3"):
        split_by_turns(render, PROMPT, reply, "assistant")
    assert not calls
    assert len(split_by_turns(render, PROMPT, reply, "last")) == 1  # one scored turn: within the limit


def test_a_prefix_stable_reply_past_the_turn_limit_is_refused_in_one_line(tmp_path, monkeypatch, toy_tokenizers):
    """The per-message cuts of a prefix-stable template render the conversation up to each turn too: a reply past
    MAX_TURNS is one counted bad row, not hours of rendering."""
    from conftest import write_jsonl

    from prefpack.data import chat_masks
    from prefpack.data.prepare import PrepareOptions, prepare

    monkeypatch.setattr(chat_masks, "MAX_TURNS", 3)
    turns = [m for k in range(4) for m in ({"role": "assistant", "content": f"a{k}"}, {"role": "tool", "content": "t"})]
    rows = [{"prompt": PROMPT, "chosen": turns[:-1], "rejected": [{"role": "assistant", "content": "no"}]},
            {"prompt": PROMPT, "chosen": turns[:3], "rejected": [{"role": "assistant", "content": "no"}]}]
    report = prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "r.jsonl", rows))], output=str(tmp_path / "s"),
                                    tokenizer=str(toy_tokenizers["chatml"]), workers=1, skip_invalid=True),
                     log=lambda m: None)
    assert report.examples == 1 and report.skipped == {"too_many_turns": 1}


def test_a_header_inside_the_message_itself_is_not_taken_for_the_turn():
    """A message whose own text holds the generation prompt's header: the last one found would cut the message, so
    where the template renders history otherwise (the header is searched for), the turn is refused, never scored
    in part."""
    reply = [{"role": "assistant", "content": "a0"}, {"role": "tool", "content": "out"},
             {"role": "assistant", "content": "see <A> here"}]
    with pytest.raises(TurnRefused):
        turn_text(renderer(MARKS), PROMPT, reply, 2)
