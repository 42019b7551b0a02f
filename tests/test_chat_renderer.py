"""What renders a store's chat rows (issue 52 item 3): meta.json records the transformers and Jinja versions beside
the template's sha256 (and `inspect` shows them), a run whose stores share a template but not its renderer warns in
one line naming both versions, and a RAG row's `documents` reach a template that reads them (masks exact, the
documents in the prompt's tokens) or are refused, like tools, by a template that never reads them."""

from __future__ import annotations

import json

import jinja2
import pytest
import transformers
from conftest import tiny_llama, write_jsonl

from prefpack.data.inspect import inspect_store
from prefpack.data.prepare import PrepareError, PrepareOptions, prepare
from prefpack.data.renderer import renderer_warnings
from prefpack.data.spans import scored_of
from prefpack.data.store import Store
from prefpack.tokenizer import load_tokenizer

# ChatML that lists the row's documents in a system turn (as Command-R's and Granite's templates read `documents`);
# GEN marks assistant text with {% generation %} (masks from one rendering), else per-message cuts.
DOC_TEMPLATE = (
    "{%- if documents %}{{- '<|im_start|>system\\nDocuments:' }}"
    "{%- for d in documents %}{{- '\\n[' + d.title + '] ' + d.text }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}GEN_OPEN{{- m.content + '<|im_end|>\\n' }}GEN_END"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PLAIN_TEMPLATE = (  # ChatML that never reads `documents`
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
DOCS = [{"title": "Atlas", "text": "Paris is the capital of France."},
        {"title": "Guide", "text": "Lyon is a city in France."}]
PROMPT = [{"role": "user", "content": "Where is Paris?"}]
CHOSEN = [{"role": "assistant", "content": "Paris is in France."}, {"role": "user", "content": "And Lyon?"},
          {"role": "assistant", "content": "Also France."}]
REJECTED = [{"role": "assistant", "content": "I do not know."}]


def _tok(toy_tokenizers, tmp_path_factory, template: str, name: str):
    tok = load_tokenizer(toy_tokenizers["chatml"])
    tok.chat_template = template
    path = tmp_path_factory.mktemp(name)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def toks(toy_tokenizers, tmp_path_factory):
    tagged = DOC_TEMPLATE.replace("GEN_OPEN", "{% generation %}").replace("GEN_END", "{% endgeneration %}")
    untagged = DOC_TEMPLATE.replace("GEN_OPEN", "").replace("GEN_END", "")
    return {"tagged": _tok(toy_tokenizers, tmp_path_factory, tagged, "doc_tagged"),
            "cuts": _tok(toy_tokenizers, tmp_path_factory, untagged, "doc_cuts"),
            "plain": _tok(toy_tokenizers, tmp_path_factory, PLAIN_TEMPLATE, "plain")}


def run(tmp_path, tok, rows, name="store", log=None, **kw) -> Store:
    data = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    out = tmp_path / name
    prepare(PrepareOptions(inputs=[str(data)], tokenizer=str(tok), output=str(out), workers=1, **kw),
            log=log or (lambda m: None))
    return Store(out, verify=True)


def scored_text(tok, ids) -> str:
    mask = scored_of(ids)
    return tok.decode([int(t) for t, s in zip(ids, mask if mask is not None else [True] * len(ids)) if s])


# ------------------------------------------------------------------------------------------------ documents


@pytest.mark.parametrize("kind", ["tagged", "cuts"])
def test_documents_reach_a_template_that_reads_them(tmp_path, toks, kind):
    """The row's documents are in the prompt's tokens (apply_chat_template(documents=...) id for id) and the
    masks score exactly what the model wrote, whether they come from {% generation %} tags or per-message cuts."""
    rows = [{"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED, "documents": DOCS},
            {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED, "documents": json.dumps(DOCS[:1])}]
    st = run(tmp_path, toks[kind], rows)
    tok = load_tokenizer(str(toks[kind]))
    for i, docs in enumerate((DOCS, DOCS[:1])):
        pair = st.pair(i)
        prompt = [int(t) for t in pair.prompt]
        want = tok.apply_chat_template(PROMPT, documents=docs, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
        assert prompt == [int(t) for t in want]
        text = tok.decode(prompt)
        assert all(f"[{d['title']}] {d['text']}" in text for d in docs)
        for stored, reply in ((pair.chosen, CHOSEN), (pair.rejected, REJECTED)):
            full = tok.apply_chat_template(PROMPT + reply, documents=docs, tokenize=True, return_dict=False)
            assert prompt + [int(t) for t in stored] == [int(t) for t in full]
        assert scored_text(tok, pair.chosen) == "Paris is in France.<|im_end|>\nAlso France.<|im_end|>\n"
        assert scored_text(tok, pair.rejected) == "I do not know.<|im_end|>\n"
    assert st.meta["counts"]["examples_with_documents"] == 2


def test_documents_for_a_template_that_never_reads_them_are_refused(tmp_path, toks):
    """As tools: the row is refused naming the field (they would vanish from the prompt), or with --skip-invalid
    skipped and counted under its reason; a row without documents is stored."""
    rows = [{"prompt": PROMPT, "chosen": REJECTED, "rejected": CHOSEN[:1], "documents": DOCS},
            {"prompt": PROMPT, "chosen": REJECTED, "rejected": CHOSEN[:1]}]
    with pytest.raises(PrepareError, match=r"field 'documents': the row has documents but the chat template never "
                                           r"reads `documents`.*\[template_ignores_documents\]"):
        run(tmp_path, toks["plain"], rows)
    st = run(tmp_path, toks["plain"], rows, name="skipped", skip_invalid=True)
    assert len(st) == 1 and st.meta["counts"]["skipped"] == {"template_ignores_documents": 1}


@pytest.mark.parametrize("row, words", [
    ({"prompt": "Where is Paris?", "chosen": "France.", "rejected": "Spain.", "documents": DOCS},
     r"field 'documents' is set but this row's prompt and replies are plain strings"),
    ({"prompt": PROMPT, "chosen": REJECTED, "rejected": CHOSEN[:1], "documents": [DOCS[0], "text"]},
     r"field 'documents': document 1 must be a JSON object"),
    ({"prompt": PROMPT, "chosen": REJECTED, "rejected": CHOSEN[:1], "documents": {"title": "x"}},
     r"field 'documents' must be a list of documents"),
    ({"prompt": PROMPT, "chosen": REJECTED, "rejected": CHOSEN[:1], "chat_template_kwargs": {"documents": DOCS}},
     r"key 'documents' is set by prepare itself.*'documents' column"),
])
def test_bad_documents_name_the_field(tmp_path, toks, row, words):
    with pytest.raises(PrepareError, match=words):
        run(tmp_path, toks["tagged"], [row])


def test_null_keys_arrow_fills_into_documents_are_dropped(tmp_path, toks):
    """Parquet gives every document the keys of all (a url on one, null on the others); they are dropped as in
    tools, so the template sees each document as the row wrote it."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = [{"title": "Atlas", "text": "Paris is the capital of France.", "url": "https://a.example"},
            {"title": "Guide", "text": "Lyon is a city in France."}]
    template = DOC_TEMPLATE.replace("GEN_OPEN", "").replace("GEN_END", "").replace(
        "{{- '\\n[' + d.title + '] ' + d.text }}", "{{- '\\n' + (d | tojson) }}")
    tok = load_tokenizer(str(toks["cuts"]))
    tok.chat_template = template
    tok.save_pretrained(tmp_path / "tok")
    table = pa.Table.from_pylist([{"prompt": PROMPT, "chosen": REJECTED, "rejected": CHOSEN[:1], "documents": docs}])
    pq.write_table(table, tmp_path / "rows.parquet")
    out = tmp_path / "store"
    prepare(PrepareOptions(inputs=[str(tmp_path / "rows.parquet")], tokenizer=str(tmp_path / "tok"),
                           output=str(out), workers=1), log=lambda m: None)
    st = Store(out)
    text = tok.decode([int(t) for t in st.pair(0).prompt])
    assert "null" not in text and '"url": "https://a.example"' in text
    assert st.meta["counts"]["null_keys_dropped"]


# ------------------------------------------------------------------------------------------------ the renderer


def test_meta_records_the_renderer_and_inspect_shows_it(tmp_path, toks):
    st = run(tmp_path, toks["tagged"], [{"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}])
    assert st.meta["renderer"] == {"transformers": transformers.__version__, "jinja2": jinja2.__version__}
    assert st.meta["chat_template"]["sha256"]
    shown = inspect_store(str(st.path))
    assert f"renderer   transformers {transformers.__version__}, jinja2 {jinja2.__version__}" in shown
    text = run(tmp_path, toks["tagged"], [{"prompt": "a", "chosen": "b", "rejected": "c"}], name="text")
    assert text.meta["renderer"] is None  # plain strings: nothing was rendered


def _meta(sha: str | None, transformers_version: str | None, jinja: str = "3.1.6") -> dict:
    return {"chat_template": {"sha256": sha} if sha else None,
            "renderer": {"transformers": transformers_version, "jinja2": jinja} if transformers_version else None}


def test_renderer_warnings_compare_stores_of_one_template():
    same = [("a", _meta("f" * 64, "5.23.0")), ("b", _meta("f" * 64, "5.23.0"))]
    assert renderer_warnings(same) == []
    assert renderer_warnings([("a", _meta("f" * 64, "5.23.0")), ("b", _meta("e" * 64, "5.24.0"))]) == []
    assert renderer_warnings([("a", _meta("f" * 64, "5.23.0")), ("b", _meta("f" * 64, None))]) == []  # unrecorded
    assert renderer_warnings([("a", _meta(None, None)), ("b", _meta("f" * 64, "5.24.0"))]) == []  # text store
    lines = renderer_warnings([("a", _meta("f" * 64, "5.23.0")), ("b", _meta("f" * 64, "5.24.0")),
                               ("c", _meta("f" * 64, "5.24.0")), ("d", _meta("f" * 64, "5.23.0", "3.2.0"))])
    assert len(lines) == 2  # b and c once (the same versions), d
    assert lines[0].startswith("warning: b and a were rendered with the same chat template (sha256 ffffffffffff)")
    assert "transformers 5.24.0, jinja2 3.1.6 against transformers 5.23.0, jinja2 3.1.6" in lines[0]
    assert "same rows may have been rendered differently" in lines[0]
    assert "jinja2 3.2.0" in lines[1]


def test_a_mixture_rendered_by_other_versions_warns_once(tmp_path, toks, one_thread):
    """Two stores of one template, one of them recorded as rendered by another transformers (4.99.0, whatever is
    installed): the run is built (the tokens are what they are) and says so in one line naming both versions; and so
    does an eval store."""
    from prefpack.config import load_config
    from prefpack.training.setup import build

    rows = [{"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}] * 4
    a = run(tmp_path, toks["tagged"], rows, name="a").path
    b = run(tmp_path, toks["tagged"], rows, name="b").path
    meta = json.loads((b / "meta.json").read_text())
    meta["renderer"]["transformers"] = "4.99.0"
    (b / "meta.json").write_text(json.dumps(meta))
    model = tiny_llama(toks["tagged"], tmp_path / "model", 1)
    base = [f"model.name_or_path={model}", "train.device=cpu", f"run.output_dir={tmp_path / 'run'}"]
    for data in ([f"data.train=[{{path: {a}}}, {{path: {b}}}]"], [f"data.train={a}", f"data.eval={b}"]):
        said: list[str] = []
        build(load_config(None, base + data), log=said.append)
        warned = [line for line in said if "rendered with the same chat template" in line]
        assert len(warned) == 1, said
        assert f"transformers 4.99.0, jinja2 {jinja2.__version__} against transformers {transformers.__version__}" \
            in warned[0]
        assert str(b) in warned[0] and str(a) in warned[0]
    said = []
    build(load_config(None, base + [f"data.train=[{{path: {a}}}, {{path: {a}}}]"]), log=said.append)
    assert not [line for line in said if "rendered with the same chat template" in line]


def test_a_null_message_key_renders_as_apply_chat_template_does(tmp_path, toy_tokenizers, tmp_path_factory):
    """A message key whose value is null (`content: null` beside tool calls, an API's `name: null`): transformers'
    `apply_chat_template` drops it before rendering (5.23 and 5.24), and so does prefpack, which calls the renderer
    itself: the stored prompt is what `apply_chat_template` renders (it read `(None)` before)."""
    template = ("{%- for m in messages %}{{- '<|im_start|>' + m.role }}{%- if m.name is defined %}"
                "{{- ' (' + (m.name | string) + ')' }}{%- endif %}{{- '\\n' + m.content + '<|im_end|>\\n' }}"
                "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    tok_dir = _tok(toy_tokenizers, tmp_path_factory, template, "null_keys")
    prompt = [{"role": "user", "content": "Where is Paris?", "name": None}]
    store = run(tmp_path, tok_dir, [{"prompt": prompt, "chosen": [{"role": "assistant", "content": "In France."}],
                                     "rejected": [{"role": "assistant", "content": "No idea."}]}])
    tok = load_tokenizer(tok_dir)
    want = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert tok.decode([int(t) for t in store.pair(0).prompt]) == want


def test_a_template_that_fails_to_render_is_one_line_naming_it_and_the_row(tmp_path, toy_tokenizers,
                                                                            tmp_path_factory):
    """A template with an error only some rows reach (here: `tools=None` read as a list, a common bug) is refused in
    one line naming the file, the row and the template."""
    from prefpack.data.prepare import PrepareError

    template = ("{%- if messages[0].content == 'tools' %}{{- tools | length }}{%- endif %}"
                "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    tok_dir = _tok(toy_tokenizers, tmp_path_factory, template, "breaks_on_tools")
    good = {"prompt": PROMPT, "chosen": CHOSEN[:1], "rejected": REJECTED}
    bad = {**good, "prompt": [{"role": "user", "content": "tools"}]}
    with pytest.raises(PrepareError) as err:
        run(tmp_path, tok_dir, [good, bad])
    message = str(err.value)
    assert "\n" not in message and "line 2" in message and "[template_error]" in message
    assert f"the chat template (the tokenizer's own, {tok_dir}) failed on the prompt: TypeError" in message
