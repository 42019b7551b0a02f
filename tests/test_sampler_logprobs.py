"""The sampling policy's per-token log-probs (``Sample.logprobs``): the in-process engine's equal an independent
float64 forward of the model's raw (un-tempered) distribution, cut where the sample is; the vLLM engine reads them
from vLLM's completions format (tests/vllm_stub.py) and refuses a malformed one in one line; generate writes them to
samples.jsonl, score carries them to a ranked store's logprobs.bin (``Store.completion_logprobs``), and samples without
them give the store of before, byte for byte."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from conftest import quiet, write_jsonl
from vllm_stub import StubServer, stub_choice, stub_logprobs

from prefpack.data.store import Store, StoreError, StoreWriter
from prefpack.data.store_format import LOGPROBS_FILE
from prefpack.generation.engine import GenerationError, PromptJob, Sample, SamplingSettings, finish
from prefpack.generation.hf_engine import TransformersEngine
from prefpack.generation.run import GenerateOptions, check_answers, generate
from prefpack.generation.vllm_engine import VllmEngine
from prefpack.rewards.rows import ScoreInputError
from prefpack.rewards.run import ScoreOptions, score

REWARD_FN = "def reward(prompt, completion, row):\n    return float(len(completion) % 5) + 0.1 * row['row']\n"


@pytest.fixture
def stub():
    servers = []

    def start(**kw) -> StubServer:
        servers.append(StubServer(**kw).start())
        return servers[-1]

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


# ---------------------------------------------------------------- (a) the in-process engine


def test_transformers_logprobs_are_the_raw_distributions_cut_where_the_sample_is(one_thread):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    engine = TransformersEngine(model, pad_id=0, batch_size=2)  # 3 prompts: a left-padded batch of 2, then 1
    jobs = [PromptJob(0, (5, 6, 7, 8, 9)), PromptJob(1, (4, 11)), PromptJob(2, (12, 13, 14))]
    settings = SamplingSettings(n=4, temperature=0.7, top_p=1.0, max_new_tokens=6, seed=3, stop_token_ids=(3,))
    out = engine.generate(jobs, settings)
    reference = copy.deepcopy(model).double()
    worst, tempered_gap = 0.0, 0.0
    for job, samples in zip(jobs, out):
        for s in samples:
            assert s.logprobs is not None and len(s.logprobs) == len(s.ids)
            with torch.no_grad():  # one forward of prompt + sample, alone (no padding, no cache), in float64
                logits = reference(input_ids=torch.tensor([list(job.ids) + list(s.ids)])).logits[0].double()
            at = range(len(job.ids) - 1, len(job.ids) - 1 + len(s.ids))
            raw = torch.log_softmax(logits, -1)[list(at), list(s.ids)]
            tempered = torch.log_softmax(logits / 0.7, -1)[list(at), list(s.ids)]
            got = torch.tensor(s.logprobs, dtype=torch.float64)
            worst = max(worst, float((got - raw).abs().max()))
            tempered_gap = max(tempered_gap, float((got - tempered).abs().max()))
    assert worst < 1e-5, worst
    assert tempered_gap > 1e-2  # the recorded values are not the tempered distribution's
    flat = [s for samples in out for s in samples]
    assert any(s.truncated for s in flat) and any(not s.truncated and len(s.ids) < 6 for s in flat)  # both kinds
    assert finish([5, 3, 9], (3,), [-1.0, -2.0, -3.0]) == Sample((5, 3), False, (-1.0, -2.0))


# ---------------------------------------------------------------- (b) the vLLM engine

SETTINGS = SamplingSettings(n=3, temperature=0.7, top_p=0.9, max_new_tokens=6, seed=11, stop_token_ids=(2, 7))
JOBS = [PromptJob(row, tuple(range(row + 3, row + 8))) for row in range(4)]


def test_vllm_logprobs_are_read_from_the_completions_answer(stub):
    server = stub()
    out = VllmEngine(server.url, concurrency=2).generate(JOBS, SETTINGS)
    by_prompt = {tuple(r["prompt"]): r for r in server.requests}
    for job, samples in zip(JOBS, out):
        body = by_prompt[job.ids]
        assert body["logprobs"] == 0  # the sampled token's log-prob only
        want = [stub_logprobs(stub_choice(body, k)["token_ids"])["token_logprobs"] for k in range(3)]
        assert [list(s.logprobs) for s in samples] == want
    older = stub(logprobs=False)  # a server answering logprobs: null gives none, never guessed ones
    assert all(s.logprobs is None for samples in VllmEngine(older.url).generate(JOBS, SETTINGS) for s in samples)
    dropped = stub(drop_stop_tokens=True)  # a stop token put back has no log-prob: the sample has none
    samples = [s for ss in VllmEngine(dropped.url).generate(JOBS, SETTINGS) for s in ss]
    assert all((s.logprobs is None) == (not s.truncated) for s in samples)


@pytest.mark.parametrize("answer, expect", [
    ("nan_logprob", r"log-prob nan at token \d+, not a finite number <= 0"),
    ("logprob_count", r"a sample of (\d+) tokens with \d+ log-probs for its \1 tokens"),
    ("positive_logprob", r"log-prob 0.5 at token 0, not a finite number <= 0"),
    ("logprob_tokens", r"log-probs of other tokens than its token_ids"),
])
def test_a_malformed_vllm_logprob_answer_is_one_line_naming_the_row(stub, answer, expect):
    server = stub(answer=answer)
    with pytest.raises(GenerationError, match=expect) as err:
        VllmEngine(server.url, concurrency=1).generate(JOBS[2:3], SETTINGS)
    assert "\n" not in str(err.value) and "row 2" in str(err.value) and server.url in str(err.value)


def test_any_engines_log_probs_are_checked_before_a_row_is_written():
    from prefpack.generation.prompts import Prompt

    ok = Sample((5, 3), False, (-0.5, -1e-5))  # a hair above 0 is rounding
    check_answers([Prompt(4, (1, 2))], [[ok]], SamplingSettings(n=1, temperature=0, stop_token_ids=(3,)), 16, "x")
    for bad in (Sample((5, 3), False, (-0.5,)), Sample((5, 3), False, (-0.5, math.inf)),
                Sample((5, 3), False, (-0.5, 0.01))):
        with pytest.raises(GenerationError, match=r"^the x answered row 4 with a sample of 2 tokens with "):
            check_answers([Prompt(4, (1, 2))], [[bad]], SamplingSettings(n=1, temperature=0, stop_token_ids=(3,)),
                          16, "x")


# ---------------------------------------------------------------- (c), (d) generate -> score -> ranked store


def _generate_and_score(tmp_path, name, url, tok_dir) -> tuple[list[dict], Store]:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": [{"role": "user", "content": f"question {i}?"}]}
                                                       for i in range(5)])
    samples = tmp_path / f"{name}.jsonl"
    generate(GenerateOptions(output=str(samples), inputs=[str(prompts)], tokenizer=str(tok_dir), engine="vllm",
                             vllm_url=url, n=3, temperature=0.7, max_new_tokens=6, seed=5), log=quiet)
    fn = tmp_path / "fn.py"
    fn.write_text(REWARD_FN)
    score(ScoreOptions(input=str(samples), output=str(tmp_path / f"{name}-store"), reward_fn=f"{fn}:reward",
                       progress=False), log=quiet)
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    return rows, Store(tmp_path / f"{name}-store", verify=True)


def test_generate_score_keeps_the_samples_logprobs_in_the_ranked_store(tmp_path, toy_tokenizers, stub):
    tok = toy_tokenizers["chatml"]
    rows, store = _generate_and_score(tmp_path, "with", stub().url, tok)
    assert store.sampler_logprobs is not None and store.sampler_logprobs.dtype == np.float32
    assert len(store.sampler_logprobs) == store.num_tokens
    assert store.meta["num_logprobs"] == 15 and LOGPROBS_FILE in store.meta["files"]
    starts = store.group_starts()
    for g, row in enumerate(rows):
        assert len(row["logprobs"]) == 3 and all(len(lp) == len(ids) for lp, ids in
                                                 zip(row["logprobs"], row["completion_ids"]))
        for k, i in enumerate(range(int(starts[g]), int(starts[g + 1]))):
            got = store.completion_logprobs(i)
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, np.asarray(row["logprobs"][k], np.float32))
        off, p = int(store.index[starts[g], 0]), int(store.index[starts[g], 1])
        assert np.isnan(store.sampler_logprobs[off - p:off]).all()  # the group's prompt: none

    # (d) the same samples from a server that gives no log-probs: no logprobs in the rows, no logprobs.bin, and the
    # store's tokens and index byte-equal to the store with them
    plain_rows, plain = _generate_and_score(tmp_path, "without", stub(logprobs=False).url, tok)
    assert all("logprobs" not in r for r in plain_rows)
    assert [r["completion_ids"] for r in plain_rows] == [r["completion_ids"] for r in rows]
    assert plain.sampler_logprobs is None and plain.completion_logprobs(0) is None
    assert not (plain.path / LOGPROBS_FILE).exists() and "num_logprobs" not in plain.meta
    for name in ("tokens.bin", "index.bin"):
        assert (plain.path / name).read_bytes() == (store.path / name).read_bytes()

    # a damaged logprobs.bin: refused when the store is opened
    data = (store.path / LOGPROBS_FILE).read_bytes()
    (store.path / LOGPROBS_FILE).write_bytes(data[:-4])
    with pytest.raises(StoreError, match=rf"{LOGPROBS_FILE} has {len(data) - 4} bytes"):
        Store(store.path)
    (store.path / LOGPROBS_FILE).unlink()  # meta.json counts them: a store without the file is damaged too
    with pytest.raises(StoreError, match=rf"{LOGPROBS_FILE} is missing"):
        Store(store.path)


def _samples_file(tmp_path, tok_dir, logprobs: list) -> str:
    """A hand-written samples file (a meta without 'complete' is read as it is), 3 rows of 2 completions."""
    from transformers import AutoTokenizer

    from prefpack.tokenizer import HASH_VERSION, tokenizer_hash

    tok = AutoTokenizer.from_pretrained(tok_dir)
    rows = []
    for i, lp in enumerate(logprobs):
        comps = [[10 + i, 11, 12], [20, 21 + i]]
        rows.append({"prompt_ids": [5, 6, 7 + i], "completion_ids": comps, "prompt": "p", "completions": ["a", "bbb"],
                     "truncated": [False, True], "row": i, **({} if lp == "absent" else {"logprobs": lp})})
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    (tmp_path / "s.meta.json").write_text(json.dumps(
        {"tokenizer": {"name": str(tok_dir), "hash": tokenizer_hash(tok), "hash_version": HASH_VERSION}}))
    return str(path)


def test_stores_fill_the_groups_before_the_first_with_logprobs_and_bad_ones_are_one_line(tmp_path, toy_tokenizers):
    tok = toy_tokenizers["llama"]
    fn = tmp_path / "fn.py"
    fn.write_text(REWARD_FN)
    given = ["absent", [[-0.5, -0.25, -1.0], None], [[-1.5, -2.0, -0.125], [-3.0, -0.0]]]
    out = tmp_path / "mixed"
    score(ScoreOptions(input=_samples_file(tmp_path, tok, given), output=str(out), reward_fn=f"{fn}:reward",
                       progress=False), log=quiet)
    store = Store(out, verify=True)
    assert store.meta["num_logprobs"] == 3
    assert [store.completion_logprobs(i) is None for i in range(6)] == [True, True, False, True, False, False]
    np.testing.assert_array_equal(store.completion_logprobs(2), np.float32([-0.5, -0.25, -1.0]))
    np.testing.assert_array_equal(store.completion_logprobs(5), np.float32([-3.0, -0.0]))
    pairs = tmp_path / "pairs"  # a pair store keeps none
    score(ScoreOptions(input=_samples_file(tmp_path, tok, given), output=str(pairs), reward_fn=f"{fn}:reward",
                       pairs="best_vs_worst", progress=False), log=quiet)
    assert not (pairs / LOGPROBS_FILE).exists() and Store(pairs).sampler_logprobs is None
    cases = ((["absent", [[-0.5, -0.25], None], "absent"],
              r"line 2, field 'logprobs', completion 0: 2 log-probs for its 3 tokens"),
             (["absent", "absent", [[-1.0, -1.0, -1.0], [-1.0, 0.5]]],
              r"line 3, field 'logprobs', completion 1: log-prob 0.5 at token 1, not a finite number <= 0"),
             ([[None], "absent", "absent"], r"line 1, field 'logprobs': one list \(or null\) per completion, 2 in all"))
    for case, (bad, expect) in enumerate(cases):
        with pytest.raises(ScoreInputError, match=r"s\.jsonl " + expect) as err:
            score(ScoreOptions(input=_samples_file(tmp_path, tok, bad), output=str(tmp_path / f"bad{case}"),
                               reward_fn=f"{fn}:reward", progress=False), log=quiet)
        assert "\n" not in str(err.value)


def test_the_writer_checks_the_values_it_is_given(tmp_path):
    def block(values):
        w = StoreWriter(tmp_path / "w", kind="ranked", vocab_size=100, log=quiet)
        idx = [[2, 2, 2, 0, 0, 0, 0, 0], [4, 2, 1, 0, 0, 0, 0, 0]]  # a prompt of 2, completions of 2 and 1
        try:
            w.append(np.arange(5), np.asarray(idx), logprobs=np.asarray(values, np.float32))
        finally:
            w.abort()

    nan = math.nan
    block([nan, nan, -1.0, -2.0, nan])
    for values, expect in (([-1.0, nan, -1.0, -2.0, nan], "on prompt tokens"),
                           ([nan, nan, -1.0, nan, nan], "some of its tokens only"),
                           ([nan, nan, -1.0, 1.0, nan], "not finite numbers <= 0"),
                           ([nan, nan, -1.0], "3 sampler log-probs for a block of 5 tokens")):
        with pytest.raises(StoreError, match=expect):
            block(values)
    w = StoreWriter(tmp_path / "p", kind="pairs", vocab_size=100, log=quiet)
    with pytest.raises(StoreError, match="ranked store's"):
        w.append(np.arange(4), np.asarray([[0, 2, 1, 1, 0, 0, 0]]), logprobs=np.full(4, -1.0, np.float32))
    w.abort()
