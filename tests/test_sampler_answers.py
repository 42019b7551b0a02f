"""Issue 50, item 1: a sampler's answer is checked before anything of it is written. A stand-in vLLM server
(tests/vllm_stub.py) answers wrongly in each way a server (or something posing as one) can: token ids that are
floats, strings, negative, outside the tokenizer, too many or none; a stop that is no stop token; choices that are
not objects; a redirect; an answer too large; an answer sent a byte at a time past the timeout. Each stops
`prefpack generate` with one line naming the server, the row where there is one, and what is wrong, and writes no row."""

from __future__ import annotations

import json
import time

import pytest
from vllm_stub import StubServer

from prefpack.generation import vllm_engine
from prefpack.generation.engine import GenerationError
from prefpack.generation.run import GenerateOptions, generate

WHAT = {"float_ids": "not a non-negative integer: ", "string_ids": "not a non-negative integer: '",
        "negative": "not a non-negative integer: -5", "out_of_vocab": "token id 123456, outside the tokenizer's",
        "too_long": "past max_new_tokens=4", "empty": "an empty sample said to be cut", "wrong_stop": "not one of the "
        "stop ids", "not_objects": "choices that are not objects", "redirect": "HTTP 302",
        "huge": "an answer over 2000 bytes", "dribble": "no answer before the timeout (1 s for the whole answer)"}


@pytest.mark.parametrize("how", list(WHAT))
def test_a_wrong_answer_stops_generate_in_one_line_and_writes_nothing(how, tmp_path, toy_tokenizers, monkeypatch):
    rows = tmp_path / "prompts.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Human: question {i}?\n\nAssistant:"}) + "\n" for i in range(3)))
    monkeypatch.setattr(vllm_engine, "MAX_ANSWER_BYTES", 2000)  # the stub's "huge" answer is 5000 bytes a choice
    server = StubServer(answer=how).start()
    out = tmp_path / "samples.jsonl"
    t0 = time.monotonic()
    try:
        with pytest.raises(GenerationError) as err:
            generate(GenerateOptions(output=str(out), inputs=[str(rows)], tokenizer=str(toy_tokenizers["llama"]),
                                     engine="vllm", vllm_url=server.url, n=2, max_new_tokens=4, request_timeout=1.0,
                                     concurrency=1), log=lambda *_: None)
    finally:
        server.shutdown()
        server.server_close()
    message = str(err.value)
    assert "\n" not in message and server.url in message and WHAT[how] in message, message
    if how not in ("redirect", "huge", "dribble"):
        assert "row 0" in message
    assert not out.exists() or out.read_text() == ""  # nothing of it written
    assert time.monotonic() - t0 < 15  # the dribbled answer is cut off at the timeout, not read for its 30 s


@pytest.mark.parametrize("field, flag", [("request_timeout", "--request-timeout"),
                                         ("vllm_start_timeout", "--vllm-start-timeout"),
                                         ("concurrency", "--concurrency")])
def test_a_limit_that_is_not_positive_is_refused_by_its_flag(field, flag, tmp_path, toy_tokenizers):
    import dataclasses

    rows = tmp_path / "prompts.jsonl"
    rows.write_text(json.dumps({"prompt": "Human: hi?\n\nAssistant:"}) + "\n")
    opts = GenerateOptions(output=str(tmp_path / "s.jsonl"), inputs=[str(rows)], tokenizer=str(toy_tokenizers["llama"]),
                           engine="vllm", vllm_url="http://127.0.0.1:9")
    with pytest.raises(GenerationError, match=f"^{flag} must be a positive"):
        generate(dataclasses.replace(opts, **{field: -1}), log=lambda *_: None)


def test_a_full_disk_while_sampling_names_the_samples_file(tmp_path):
    """Issue 50: a write that fails (a full disk) is one line naming the samples file, not a bare OSError."""
    import errno

    from prefpack.generation.samples import SamplesWriter

    writer = SamplesWriter(tmp_path / "samples.jsonl", {"generation": {}})

    class Full:
        closed = False

        def write(self, _text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

        def close(self):
            self.closed = True

    writer.fh = Full()
    with pytest.raises(GenerationError) as err:
        writer.write({"row": 0})
    assert str(err.value).startswith(f"cannot write {tmp_path / 'samples.jsonl'}: No space left on device")
