"""prepare --max-length says what it cut (prompts and completions, tokens removed), refuses or drops a row whose
prompt would keep less than --min-prompt-keep, and leaves cut prompts out of the repeated-prompt advice (issue 25)."""

from __future__ import annotations

import json

import pytest
from conftest import write_jsonl

from prefpack.cli import main as cli_main
from prefpack.data.inspect import format_text, length_stats
from prefpack.data.prepare import PrepareError, PrepareOptions, prepare
from prefpack.data.store import Store


def the(n: int) -> str:
    """n tokens for the toy tokenizers: " the" is one token and never merges with the next."""
    return " the" * n


def run(rows, tok, out, **kw):
    src = write_jsonl(out.parent / f"{out.name}.jsonl", rows)
    kw.setdefault("workers", 1)
    return prepare(PrepareOptions(inputs=[str(src)], tokenizer=str(tok), output=str(out), **kw), log=lambda m: None)


# With the llama toy tokenizer a prompt of the(n) is n + 1 tokens (BOS), a completion n + 1 (EOS). At --max-length 24:
PAIRS = [
    {"prompt": the(30), "chosen": the(2), "rejected": the(1)},    # 31 + 3: the prompt cut to 24 - 3 = 21 (-10)
    {"prompt": the(1), "chosen": the(40), "rejected": the(3)},    # 2 + 41: chosen cut to 24 - 2 = 22 (-19)
    {"prompt": the(16), "chosen": the(10), "rejected": the(4)},   # 17 + 11: the prompt cut to 13 (-4)
    {"prompt": the(3), "chosen": the(2), "rejected": the(1)},     # fits
]


def test_cuts_are_counted_with_the_tokens_they_removed(tmp_path, toy_tokenizers):
    r = run(PAIRS, toy_tokenizers["llama"], tmp_path / "s", max_length=24)
    want = {"prompts": {"cut": 2, "tokens_removed": 14, "mean_cut": 7.0, "largest_cut": 10,
                        "least_kept_share": round(21 / 31, 4)},
            "completions": {"cut": 1, "tokens_removed": 19, "mean_cut": 19.0, "largest_cut": 19,
                            "least_kept_share": round(22 / 41, 4)}}
    want = {"policy": "prompt-left", "rows_cut": 3, "tokens_removed": 33, "chat_prompts_cut": 0, **want}
    assert r.examples == 4 and r.cuts == want and r.truncated == {"prompt": 2, "completion": 1}
    store = Store(tmp_path / "s")
    assert store.meta["counts"]["truncation"] == want and store.meta["args"]["min_prompt_keep"] == 0.5
    assert [len(store.pair(i).prompt) for i in range(4)] == [21, 2, 13, 4]
    line = ("cut to --max-length 24: 3 rows, 33 tokens removed; prompts cut from the left: 2 (14 tokens removed: mean "
            "7.0, largest 10; the most cut kept 68%); completions cut at the end: 1 (19 tokens removed: mean 19.0, "
            "largest 19)")
    assert line in r.summary().splitlines()
    assert line in format_text(store, length_stats(store), None)  # `prefpack inspect` shows it too
    uncut = run(PAIRS[3:], toy_tokenizers["llama"], tmp_path / "u", max_length=24)
    assert uncut.cuts["prompts"]["cut"] == 0 and "cut to" not in uncut.summary()


def test_ranked_rows_count_a_prompt_once_and_each_completion(tmp_path, toy_tokenizers):
    rows = [{"prompt": the(30), "completions": [{"text": t, "score": s} for t, s in ((the(2), 1), (the(1), 0),
                                                                                    (the(3), 2))]},
            {"prompt": the(1), "completions": [{"text": t, "score": s} for t, s in ((the(30), 1), (the(25), 0),
                                                                                   (the(1), 2))]}]
    r = run(rows, toy_tokenizers["llama"], tmp_path / "r", max_length=24)
    # row 1: 31 + 4 -> the prompt keeps 20 (-11); row 2: 2 + 31 -> completions cut to 22 (31 -> -9, 26 -> -4)
    assert r.cuts["prompts"] == {"cut": 1, "tokens_removed": 11, "mean_cut": 11.0, "largest_cut": 11,
                                 "least_kept_share": round(20 / 31, 4)}
    assert (r.cuts["completions"]["cut"], r.cuts["completions"]["tokens_removed"]) == (2, 13)


def test_a_prompt_cut_below_the_minimum_is_refused_naming_file_row_and_field(tmp_path, toy_tokenizers):
    rows = [PAIRS[3], {"question": the(30), "chosen": the(20), "rejected": the(1)}]  # 31 + 21: 3 of 31 tokens kept
    rows[0] = {"question": rows[0]["prompt"], "chosen": rows[0]["chosen"], "rejected": rows[0]["rejected"]}
    with pytest.raises(PrepareError) as err:
        run(rows, toy_tokenizers["llama"], tmp_path / "s", max_length=24, fields={"prompt": "question"})
    msg = str(err.value)
    assert "s.jsonl line 2, field 'question'" in msg and "[prompt_cut_below_minimum]" in msg
    assert "from 31 to 3 tokens (keeping 10% of it" in msg and "--min-prompt-keep 0.5" in msg
    assert not (tmp_path / "s").exists()
    # --skip-invalid: counted, written to skipped.jsonl, and said in the summary
    r = run(rows, toy_tokenizers["llama"], tmp_path / "k", max_length=24, fields={"prompt": "question"},
            skip_invalid=True)
    assert r.examples == 1 and r.skipped == {"prompt_cut_below_minimum": 1}
    skipped = [json.loads(x) for x in (tmp_path / "k" / "skipped.jsonl").read_text().splitlines()]
    assert [(s["line"], s["field"]) for s in skipped] == [(2, "question")]
    assert "prompt_cut_below_minimum=1" in r.summary()
    # --truncation drop drops it (and every over-long row), counted; 0 allows the cut; 1 refuses any prompt cut
    r = run(rows, toy_tokenizers["llama"], tmp_path / "d", max_length=24, fields={"prompt": "question"},
            truncation="drop")
    assert r.examples == 1 and r.dropped == {"too_long": 1} and "too_long=1" in r.summary()
    r = run(rows, toy_tokenizers["llama"], tmp_path / "z", max_length=24, fields={"prompt": "question"},
            min_prompt_keep=0)
    assert r.examples == 2 and r.cuts["prompts"]["least_kept_share"] == round(3 / 31, 4)
    with pytest.raises(PrepareError, match="from 31 to 21 tokens"):
        run([PAIRS[0]], toy_tokenizers["llama"], tmp_path / "one", max_length=24, min_prompt_keep=1)
    with pytest.raises(PrepareError, match="--min-prompt-keep is a share"):
        run([PAIRS[0]], toy_tokenizers["llama"], tmp_path / "bad", max_length=24, min_prompt_keep=1.5)


def test_the_minimum_holds_for_unpaired_chat_and_implicit_rows(tmp_path, toy_tokenizers):
    unpaired = [{"prompt": the(3), "completion": the(2), "label": True},
                {"prompt": the(30), "completion": the(20), "label": False}]
    with pytest.raises(PrepareError, match=r"u\.jsonl line 2, field 'prompt'.*keeping 10%"):
        run(unpaired, toy_tokenizers["llama"], tmp_path / "u", max_length=24)
    dropped = run(unpaired, toy_tokenizers["llama"], tmp_path / "ud", max_length=24, truncation="drop")
    assert dropped.examples == 1 and dropped.dropped == {"too_long": 1}
    user = [{"role": "user", "content": the(40)}]
    chat = [{"prompt": user, "chosen": [{"role": "assistant", "content": the(30)}],
             "rejected": [{"role": "assistant", "content": the(2)}]}]
    with pytest.raises(PrepareError, match=r"c\.jsonl line 1, field 'prompt'.*prompt_cut_below_minimum"):
        run(chat, toy_tokenizers["chatml"], tmp_path / "c", max_length=48)
    implicit = [{"chosen": "\n\nHuman:" + the(40) + "\n\nAssistant:" + the(30),
                 "rejected": "\n\nHuman:" + the(40) + "\n\nAssistant:" + the(2)}]
    with pytest.raises(PrepareError, match=r"i\.jsonl line 1, field 'chosen'.*prompt_cut_below_minimum"):
        run(implicit, toy_tokenizers["llama"], tmp_path / "i", max_length=48)


def test_repeated_prompt_advice_counts_only_uncut_prompts(tmp_path, toy_tokenizers):
    # two different long prompts with the same end, cut to the same last tokens; and one short prompt in two pairs
    rows = [{"prompt": "Why" + the(30), "chosen": the(2), "rejected": the(1)},
            {"prompt": "How" + the(30), "chosen": the(2), "rejected": the(1)},
            {"prompt": "Hi", "chosen": the(2), "rejected": the(1)},
            {"prompt": "Hi", "chosen": the(3), "rejected": the(1)}]
    r = run(rows, toy_tokenizers["llama"], tmp_path / "s", max_length=24)
    store = Store(tmp_path / "s")
    assert list(store.pair(0).prompt) == list(store.pair(1).prompt)  # cut alike: they would have counted as shared
    assert r.repeated_prompts == {"prompts": 1, "pairs": 2}
    assert "2 pairs share 1 prompts with other pairs (prompts --max-length cut are not counted)" in r.summary()
    alone = run(rows[:2], toy_tokenizers["llama"], tmp_path / "t", max_length=24)
    assert alone.repeated_prompts == {"prompts": 0, "pairs": 0} and "group_by_prompt" not in alone.summary()


def test_hh_prompts_cut_to_almost_nothing_are_no_longer_silent(tmp_path, toy_tokenizers, hh_train, capsys):
    """The bundled hh sample at a small --max-length, in miniature: long replies leave the prompt its BOS and one
    token (hh's ``<s>:``); prepare now stops at the first such row, and when told to allow it, says so."""
    rows = [r for r in hh_train[:60] if len(r["chosen"]) > 250 and len(r["rejected"]) > 250
            and r["chosen"] != r["rejected"]][:3]
    src = write_jsonl(tmp_path / "hh.jsonl", rows)
    argv = ["prepare", str(src), "--tokenizer", str(toy_tokenizers["llama"]), "--max-length", "48", "--workers", "1"]
    assert cli_main([*argv, "--output", str(tmp_path / "s")]) != 0
    err = capsys.readouterr().err
    assert "hh.jsonl line 1, field 'prompt'" in err and "to 2 tokens" in err and "--min-prompt-keep" in err
    assert cli_main([*argv, "--output", str(tmp_path / "z"), "--min-prompt-keep", "0"]) == 0
    out = capsys.readouterr().out
    store = Store(tmp_path / "z")
    assert {tuple(store.pair(i).prompt.tolist()) for i in range(3)} == {tuple(store.pair(0).prompt.tolist())}
    assert len(store.pair(0).prompt) == 2 and store.meta["args"]["min_prompt_keep"] == 0
    assert "cut to --max-length 48: 3 rows, " in out and "prompts cut from the left: 3" in out
    assert "group_by_prompt" not in out


def test_a_prompt_cut_before_tokenising_counts_its_estimated_length(tmp_path, toy_tokenizers):
    """A text far over --max-length is cut before it is tokenised; its removed tokens are estimated from the part kept
    (here exactly: 5,000 characters of one 4-character token), and the summary says they are estimates."""
    rows = [{"prompt": the(1250), "chosen": the(1), "rejected": the(2)}]
    with pytest.raises(PrepareError, match="from 1251 to 5 tokens"):
        run(rows, toy_tokenizers["llama"], tmp_path / "s", max_length=8)
    r = run(rows, toy_tokenizers["llama"], tmp_path / "z", max_length=8, min_prompt_keep=0)
    assert r.truncated == {"prompt": 1, "cut_before_tokenising": 1}
    assert (r.cuts["prompts"]["cut"], r.cuts["prompts"]["tokens_removed"]) == (1, 1246)
    assert "(estimated for 1 texts cut before tokenising)" in r.summary()
