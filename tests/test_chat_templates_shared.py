"""Every real chat template in the workplace's shared folder (../shared/data/realworld/templates: 22 families with
their provenance; absent from a fresh clone, where this module is skipped: tests/test_chat_agent_templates.py runs
the eight newest from tests/data) through the agent cases of test_chat_agent_templates, as the tokenizer's own
template, under --train-on assistant and last. Each case is either refused in one line that names the template,
or rendered so that every scored piece follows exactly the context the template itself prompts with before that
turn (``render(messages before it, add_generation_prompt=True)``, rendered here apart from prepare's renderer) and
is the end of what the template renders once the turn is written. No case ends in a traceback.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_chat_agent_templates import CASES, PROMPT, REJECTED, TOOLS
from transformers.utils.chat_template_utils import render_jinja_template

from prefpack.data.chat_masks import render_chat
from prefpack.data.formats import Example, InvalidRow

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "realworld" / "templates"
TEMPLATES = sorted(SHARED.glob("*.jinja")) if SHARED.is_dir() else []
BOS, EOS = "<BOS>", "<EOS>"

pytestmark = pytest.mark.skipif(not TEMPLATES, reason="the shared real chat templates (../shared) are not here")


@pytest.fixture(scope="module")
def tok(toy_tokenizers):
    from prefpack.tokenizer import load_tokenizer

    out = load_tokenizer(toy_tokenizers["chatml"])
    out.bos_token, out.eos_token = BOS, EOS  # plain text to the toy tokenizer: what the templates render matters
    return out


def own_render(source: str, messages: list[dict], tools, generation_prompt: bool) -> str:
    """The template's own rendering, as apply_chat_template gives it (None keys dropped; xml_tools for SmolLM3)."""
    clean = [{k: v for k, v in m.items() if v is not None} for m in list(PROMPT) + list(messages)]
    extra = {"xml_tools": tools} if tools and "xml_tools" in source else {}
    out, _ = render_jinja_template([clean], tools=tools, chat_template=source, add_generation_prompt=generation_prompt,
                                   bos_token=BOS, eos_token=EOS, **extra)
    return out[0]


def scored_runs(text: str, unscored) -> list[tuple[int, int]]:
    keep = [True] * len(text)
    for a, b in unscored or []:
        keep[a:b] = [False] * (b - a)
    runs, start = [], None
    for i, k in enumerate([*keep, False]):
        if k and start is None:
            start = i
        elif not k and start is not None:
            runs.append((start, i))
            start = None
    return runs


@pytest.mark.parametrize("path", TEMPLATES, ids=[p.stem for p in TEMPLATES])
def test_every_case_is_exact_or_refused_in_one_line(tok, path):
    source = path.read_text(encoding="utf-8")
    tok.chat_template = source
    stored = refused = 0
    for case, (reply, with_tools) in CASES.items():
        tools = TOOLS if with_tools else None
        for train_on in ("assistant", "last"):
            ex = Example(prompt=PROMPT, completions=(reply, REJECTED), chat=True,
                         completion_fields=("chosen", "rejected"), tools=tools)
            try:
                rc = render_chat(tok, ex, {}, None, train_on)
            except InvalidRow as err:
                assert "\n" not in err.message and "the chat template (the tokenizer's own" in err.message, err.message
                refused += 1
                continue
            stored += 1
            for messages, text, unscored, segments in zip((reply, REJECTED), rc.completions, rc.unscored,
                                                          rc.segments):
                turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
                turns = turns[-1:] if train_on == "last" else turns
                runs = scored_runs(text, unscored)
                assert len(runs) == len(turns), (case, train_on, runs)
                starts = [0, *(segments or [])]
                for k, (s, e) in zip(turns, runs):
                    a = max(c for c in starts if c <= s)  # the sequence holding the run
                    where = (path.stem, case, train_on, k)
                    assert rc.prompt + text[a:s] == own_render(source, messages[:k], tools, True), where
                    assert own_render(source, messages[:k + 1], tools, False).endswith(text[s:e]), where
    assert stored + refused == 2 * len(CASES)
