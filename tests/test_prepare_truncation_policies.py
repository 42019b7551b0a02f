"""prepare --truncation: the default's stores unchanged, and the peers' rules by name (issue 51): TRL's keep_start
(trl-keep-start) and LLaMA-Factory's cutoff_len (llamafactory), each cut counted (rows, tokens) and flagged; and
LLaMA-Factory's own DPO demo, which the default stops on at --max-length 2048, prepared as its peers cut it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, write_jsonl

from prefpack.cli import main as cli_main
from prefpack.data.prepare import PrepareError, PrepareOptions, prepare
from prefpack.data.store import FLAG_COMPLETION_TRUNCATED, FLAG_PROMPT_TRUNCATED, Store
from prefpack.data.truncation import infer_seqlen
from prefpack.tokenizer import load_tokenizer

DATA = Path(__file__).parent / "data"
SHARED = REPO.parent / "shared"  # the workplace's shared folder, beside the checkout (absent from a fresh clone)
DEMO = SHARED / "data" / "realworld" / "llamafactory" / "dpo_en_demo.json"
QWEN = SHARED / "tokenizers" / "qwen2.5"


def the(n: int) -> str:
    """n tokens for the toy tokenizers: " the" is one token and never merges with the next."""
    return " the" * n


def run(rows, tok, out, **kw):
    src = write_jsonl(out.parent / f"{out.name}.jsonl", rows)
    kw.setdefault("workers", 1)
    return prepare(PrepareOptions(inputs=[str(src)], tokenizer=str(tok), output=str(out), **kw), log=lambda m: None)


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def files(store: Path) -> dict[str, bytes]:
    """Every file of a store but meta.json (which holds the time it was written) and the tokenizer copy."""
    return {f.name: f.read_bytes() for f in sorted(store.iterdir()) if f.is_file() and f.name != "meta.json"}


# With the llama toy tokenizer a prompt of the(n) is n + 1 tokens (BOS), a completion n + 1 (EOS). At --max-length 24:
PAIRS = [
    {"prompt": the(31), "chosen": the(2), "rejected": the(1)},         # P 32, C 3
    {"prompt": the(1), "chosen": the(40), "rejected": the(3)},           # P 2, C 41
    {"prompt": the(16), "chosen": the(10), "rejected": the(4)},          # P 17, C 11
    {"prompt": the(19), "chosen": the(19), "rejected": the(5)},          # P 20, C 20
    {"prompt": the(3), "chosen": the(2), "rejected": the(1)},            # fits
]


def test_the_default_store_is_byte_for_byte_what_it_was(tmp_path, toy_tokenizers):
    """The default (prompt-left, --min-prompt-keep 0.5 unless told) writes the store it wrote before the peers'
    policies: the same files as an explicit --truncation prompt-left, and the same ids as today's rule built by hand
    (BOS kept, the prompt's last tokens, completions' first tokens)."""
    tok_dir = toy_tokenizers["llama"]
    tok = load_tokenizer(str(tok_dir))
    bos, eos = tok.bos_token_id, tok.eos_token_id
    default = run(PAIRS, tok_dir, tmp_path / "d", max_length=24, min_prompt_keep=0)
    run(PAIRS, tok_dir, tmp_path / "e", max_length=24, min_prompt_keep=0, truncation="prompt-left")
    assert files(tmp_path / "d") == files(tmp_path / "e")
    store = Store(tmp_path / "d")
    for i, row in enumerate(PAIRS):
        prompt, comps = [bos, *ids(tok, row["prompt"])], [ids(tok, row[k]) + [eos] for k in ("chosen", "rejected")]
        longest = max(map(len, comps))
        room = max(24 - longest, 2)
        if len(prompt) > room:
            prompt = [bos, *prompt[len(prompt) - room + 1:]]
        comps = [c[: 24 - len(prompt)] for c in comps]
        got = store.pair(i)
        assert [list(map(int, x)) for x in got] == [prompt, *comps], i
    assert default.cuts["policy"] == "prompt-left" and store.meta["args"]["truncation"] == "prompt-left"


def test_prompt_left_cuts_the_start_keeps_the_end_and_counts(tmp_path, toy_tokenizers):
    tok = load_tokenizer(str(toy_tokenizers["llama"]))
    r = run(PAIRS[:1], toy_tokenizers["llama"], tmp_path / "s", max_length=24)
    store = Store(tmp_path / "s")
    prompt, chosen, rejected = (list(map(int, x)) for x in store.pair(0))
    whole = ids(tok, PAIRS[0]["prompt"])
    assert prompt == [tok.bos_token_id, *whole[-20:]] and len(prompt) + len(chosen) == 24  # its last tokens kept
    assert chosen == ids(tok, the(2)) + [tok.eos_token_id] and rejected == ids(tok, the(1)) + [tok.eos_token_id]
    assert r.cuts["rows_cut"] == 1 and r.cuts["tokens_removed"] == 11 and r.cuts["prompts"]["cut"] == 1
    assert store.column("flags").tolist() == [FLAG_PROMPT_TRUNCATED]
    assert store.meta["counts"]["truncation"]["rows_cut"] == 1


def test_trl_keep_start_never_cuts_the_prompt_and_drops_a_prompt_that_fills_the_length(tmp_path, toy_tokenizers):
    """TRL 1.16's DPO default: DataCollatorForPreference slices prompt + completion to [:max_length], and
    _prepare_dataset drops rows with len(prompt_ids) >= max_length."""
    tok = load_tokenizer(str(toy_tokenizers["llama"]))
    eos = tok.eos_token_id
    r = run(PAIRS, toy_tokenizers["llama"], tmp_path / "s", max_length=24, truncation="trl-keep-start")
    # row 1: P 32 >= 24; row 4: both completions cut to the same 4 tokens, which TRL keeps (a pair with no gradient
    # under DPO's loss) and prefpack drops under every policy, counted
    assert r.examples == 3 and r.dropped == {"prompt_too_long": 1, "identical_after_truncation": 1}
    store = Store(tmp_path / "s")
    for i, row in enumerate(PAIRS[1:3] + PAIRS[4:]):
        prompt = [tok.bos_token_id, *ids(tok, row["prompt"])]
        want = [(prompt + ids(tok, row[k]) + [eos])[:24] for k in ("chosen", "rejected")]  # TRL's slice
        p, c, rj = (list(map(int, x)) for x in store.pair(i))
        assert p == prompt and [p + c, p + rj] == want
    # rows 2 and 3 cut (completions 41 -> 22, 11 -> 7), no prompt cut
    assert r.cuts["prompts"]["cut"] == 0 and r.cuts["rows_cut"] == 2
    assert r.cuts["completions"]["tokens_removed"] == (41 - 22) + (11 - 7)
    assert store.column("flags").tolist() == [FLAG_COMPLETION_TRUNCATED] * 2 + [0]
    assert "(--truncation trl-keep-start): 2 rows" in r.summary() and "prompt_too_long=1" in r.summary()


@pytest.mark.parametrize(("p", "c", "limit", "want"), [
    (32, 3, 24, (21, 3)),     # a completion under half the limit: kept whole, the prompt gets the rest
    (2, 41, 24, (2, 22)),     # a prompt under half the limit: kept whole, the completions get the rest
    (20, 20, 24, (12, 12)),   # both over half: in proportion, int(24 * 20 / 40) for the completions
    (3000, 414, 2048, (1634, 414)),  # the demo's row 224 with Qwen2.5's tokenizer: its prompt keeps 49%
    (3000, 1500, 2048, (1366, 682)),
    (100, 5, 2048, (100, 5)),
])
def test_infer_seqlen_shares_the_length_as_llamafactory_does(p, c, limit, want):
    assert infer_seqlen(p, c, limit) == want


def test_llamafactory_keeps_the_start_of_prompt_and_completions(tmp_path, toy_tokenizers):
    tok = load_tokenizer(str(toy_tokenizers["llama"]))
    eos = tok.eos_token_id
    r = run(PAIRS, toy_tokenizers["llama"], tmp_path / "s", max_length=24, truncation="llamafactory")
    assert r.examples == 5 and not r.dropped
    store = Store(tmp_path / "s")
    for i, row in enumerate(PAIRS):
        prompt = [tok.bos_token_id, *ids(tok, row["prompt"])]
        comps = [ids(tok, row[k]) + [eos] for k in ("chosen", "rejected")]
        keep_p, keep_c = infer_seqlen(len(prompt), max(map(len, comps)), 24) if i < 4 else (len(prompt), 99)
        p, c, rj = (list(map(int, x)) for x in store.pair(i))
        assert p == prompt[:keep_p] and [c, rj] == [x[:keep_c] for x in comps], i
    assert [len(store.pair(i).prompt) for i in range(4)] == [21, 2, 13, 12]
    assert store.column("flags").tolist() == [FLAG_PROMPT_TRUNCATED, FLAG_COMPLETION_TRUNCATED, FLAG_PROMPT_TRUNCATED,
                                              FLAG_PROMPT_TRUNCATED | FLAG_COMPLETION_TRUNCATED, 0]
    assert r.cuts["rows_cut"] == 4 and r.cuts["prompts"]["cut"] == 3
    assert r.cuts["prompts"]["tokens_removed"] == (32 - 21) + (17 - 13) + (20 - 12)
    assert "prompts cut at the end: 3" in r.summary()


def test_peer_policies_with_a_text_far_over_the_limit(tmp_path, toy_tokenizers):
    """A prompt far over --max-length: trl-keep-start drops it (its start, cut before tokenising, is still over the
    limit); llamafactory tokenises it whole (its budgets read the whole length) and keeps its first tokens."""
    rows = [{"prompt": the(1250), "chosen": the(1), "rejected": the(2)}]
    with pytest.raises(PrepareError, match=r"no examples left.*'prompt_too_long': 1"):
        run(rows, toy_tokenizers["llama"], tmp_path / "t", max_length=8, truncation="trl-keep-start")
    r = run(rows + [{"prompt": the(1), "chosen": the(1), "rejected": the(2)}], toy_tokenizers["llama"], tmp_path / "l",
            max_length=8, truncation="llamafactory")
    assert r.truncated == {"prompt": 1} and r.cuts["prompts"]["tokens_removed"] == 1251 - 5
    assert len(Store(tmp_path / "l").pair(0).prompt) == 5


def test_an_unknown_policy_is_refused_in_one_line(tmp_path, toy_tokenizers):
    with pytest.raises(PrepareError, match="--truncation must be one of prompt-left, drop, trl-keep-start, "
                                           "llamafactory, not 'keep_end'"):
        run(PAIRS, toy_tokenizers["llama"], tmp_path / "s", max_length=24, truncation="keep_end")


def test_chat_prompts_cut_by_tokens_are_said_so(tmp_path, toy_tokenizers):
    user = [{"role": "user", "content": the(40)}]
    chat = [{"prompt": user, "chosen": [{"role": "assistant", "content": the(3)}],
             "rejected": [{"role": "assistant", "content": the(2)}]}]
    r = run(chat, toy_tokenizers["chatml"], tmp_path / "c", max_length=40)
    assert r.cuts["chat_prompts_cut"] == 1
    assert "1 chat prompts were cut by tokens, not at a message boundary: each starts inside a message" in r.summary()
    r = run(chat, toy_tokenizers["chatml"], tmp_path / "l", max_length=40, truncation="llamafactory")
    assert "each ends inside a message, without the generation prompt" in r.summary()


def test_llamafactory_demo_rows_prepare_with_each_peer_policy(tmp_path, toy_tokenizers, capsys):
    """The bundled slice of LLaMA-Factory's DPO demo (ShareGPT rows) at a length that cuts them: prepared through the
    CLI under each peer policy, every cut counted in meta.json."""
    src = DATA / "llamafactory" / "dpo_en_demo_3.json"
    argv = ["prepare", str(src), "--tokenizer", str(toy_tokenizers["chatml"]), "--max-length", "96", "--workers", "1"]
    for policy in ("llamafactory", "trl-keep-start"):
        assert cli_main([*argv, "--truncation", policy, "--output", str(tmp_path / policy)]) == 0, policy
        counts = json.loads((tmp_path / policy / "meta.json").read_text())["counts"]
        assert counts["truncation"]["policy"] == policy and counts["truncation"]["rows_cut"] >= 1
        assert counts["examples"] + sum(counts["dropped"].values()) == 3
    assert "(--truncation llamafactory)" in capsys.readouterr().out


@pytest.mark.skipif(not (DEMO.is_file() and QWEN.is_dir()), reason="the shared LLaMA-Factory demo and Qwen2.5 "
                    "tokenizer are not beside this checkout")
def test_the_llamafactory_dpo_demo_at_2048_completes_as_the_peers_cut_it(tmp_path, capsys):
    """LLaMA-Factory's data/dpo_en_demo.json (300 rows, @ ff6d4d12eeb0) with Qwen2.5's tokenizer at --max-length 2048:
    the default stops at row 224 (its prompt would keep 49%); --truncation llamafactory, trl-keep-start and
    prompt-left with --min-prompt-keep 0 complete, counting what they cut."""
    argv = ["prepare", str(DEMO), "--tokenizer", str(QWEN), "--max-length", "2048", "--workers", "2"]
    assert cli_main([*argv, "--output", str(tmp_path / "default")]) != 0
    assert "row 224, field 'conversations'" in capsys.readouterr().err
    got = {}
    for name, extra in (("llamafactory", ["--truncation", "llamafactory"]),
                        ("trl-keep-start", ["--truncation", "trl-keep-start"]),
                        ("prompt-left", ["--truncation", "prompt-left", "--min-prompt-keep", "0"])):
        assert cli_main([*argv, *extra, "--output", str(tmp_path / name)]) == 0, name
        counts = Store(tmp_path / name).meta["counts"]
        got[name] = (counts["examples"], counts["dropped"], counts["truncation"]["rows_cut"])
    assert got["llamafactory"][:2] == (300, {}) and got["prompt-left"][:2] == (300, {})
    assert got["llamafactory"][2] == got["prompt-left"][2] == 8  # every completion < 1024 tokens: the prompt is cut
    assert got["trl-keep-start"][1] == {"prompt_too_long": 2} and got["trl-keep-start"][0] == 298
    lf, pl = Store(tmp_path / "llamafactory"), Store(tmp_path / "prompt-left")
    cut = [i for i in range(300) if lf.column("flags")[i] & FLAG_PROMPT_TRUNCATED]
    assert len(cut) == 8 and all(len(lf.pair(i).prompt) == len(pl.pair(i).prompt) for i in cut)
    assert all(list(lf.pair(i).chosen) == list(pl.pair(i).chosen) for i in cut)  # completions untouched by both
