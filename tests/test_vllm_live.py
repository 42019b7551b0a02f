"""A vLLM server that lives across rounds, against the stand-in server (tests/vllm_stub.py, shaped as vLLM's
endpoints): the weight reload through /collective_rpc and the prefix-cache reset, LoRA adapters loaded at run time,
the version checked before sampling and a server that cannot confirm it refused in one line; several servers
(VllmPool) dealt prompts with the samples of one server, a server dying mid-round replaced by the others; and the
worker extension itself, imported where transformers, numpy and peft are missing and reloading a real safetensors
file into a stand-in model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm_stub import MODEL_ID, StubServer

from prefpack.generation.engine import GenerationError, PromptJob, SamplingSettings, prompt_seed
from prefpack.generation.run import GenerateOptions, build_engine, vllm_urls
from prefpack.generation.vllm_engine import VllmEngine
from prefpack.generation.vllm_pool import VllmPool
from prefpack.generation.vllm_worker import EXTENSION, PrefpackWorkerExtension

SETTINGS = SamplingSettings(n=2, temperature=0.7, top_p=0.9, max_new_tokens=5, seed=3, stop_token_ids=(2,))
JOBS = [PromptJob(row, tuple(range(row + 3, row + 8))) for row in range(9)]
START_HINTS = (f"--worker-extension-cls {EXTENSION}", "VLLM_SERVER_DEV_MODE=1", "--enable-lora",
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")


@pytest.fixture
def stubs():
    made = []

    def make(**kwargs) -> StubServer:
        made.append(StubServer(**kwargs).start())
        return made[-1]

    yield make
    for server in made:
        server.shutdown()
        server.server_close()


@pytest.fixture
def weights(tmp_path) -> Path:
    from safetensors.torch import save_file

    folder = tmp_path / "round-1"
    folder.mkdir()
    save_file({"model.embed.weight": torch.arange(6.0).reshape(2, 3)}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"lm_head.weight": torch.ones(2, 3), "model.norm.weight": torch.zeros(3)},
              str(folder / "model-00002-of-00002.safetensors"))
    return folder


def adapter(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    return folder


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_update_weights_reloads_resets_the_cache_and_checks_before_sampling(stubs, weights):
    stub = stubs()
    engine = VllmEngine(stub.url, request_timeout=7)
    assert "weights_version" not in engine.describe()
    engine.update_weights(weights, "round-1")
    assert stub.admin == [("/collective_rpc", {"method": "prefpack_reload_weights", "args": [str(weights), "round-1"],
                                               "kwargs": {}, "timeout": 7.0}),
                          ("/reset_prefix_cache", {})]
    assert (stub.loaded_from, stub.version) == (str(weights), "round-1")
    assert engine.describe()["weights_version"] == "round-1"  # into the samples' meta
    stub.admin.clear()
    out = engine.generate(JOBS[:2], SETTINGS)
    assert len(out) == 2 and [p for p, _ in stub.admin] == ["/collective_rpc"]  # the version, checked first
    assert stub.admin[0][1]["method"] == "prefpack_weights_version"
    assert all(r["model"] == MODEL_ID for r in stub.requests)
    stub.version, sent = None, len(stub.requests)  # the server restarted on its first weights behind our back
    with pytest.raises(GenerationError) as err:
        engine.generate(JOBS[2:4], SETTINGS)
    msg = one_line(err)
    assert stub.url in msg and "cannot confirm it serves weights version 'round-1'" in msg and "None" in msg
    assert len(stub.requests) == sent  # nothing sampled from the stale weights


def test_a_server_without_the_extension_or_lora_is_refused_in_one_line(stubs, weights, tmp_path):
    bare = stubs(dev_mode=False, lora=False)
    engine = VllmEngine(bare.url)
    assert len(engine.generate(JOBS[:1], SETTINGS)) == 1  # a plain server still samples, no version asked
    with pytest.raises(GenerationError) as err:
        engine.update_weights(weights, "round-1")
    msg = one_line(err)
    assert bare.url in msg and "HTTP 404" in msg and all(h in msg for h in START_HINTS[:2])
    with pytest.raises(GenerationError) as err:
        engine.check_version("round-1")
    msg = one_line(err)
    assert bare.url in msg and all(h in msg for h in START_HINTS)
    with pytest.raises(GenerationError) as err:
        engine.load_adapter(adapter(tmp_path, "a1"), "round-1")
    assert all(h in one_line(err) for h in START_HINTS[2:])
    assert engine.version is None and bare.version is None


def test_an_answered_error_is_a_refusal_not_a_dead_server(stubs, weights, tmp_path):
    """vLLM answers 500 to an RPC method its workers lack (dev mode, no extension), and to an adapter load without
    --enable-lora: refused with the start hint, and a pool does not drop the server as dead."""
    no_ext, no_lora = stubs(extension=False), stubs(lora="no --enable-lora")
    with pytest.raises(GenerationError) as err:
        VllmEngine(no_ext.url).update_weights(weights, "round-1")
    msg = one_line(err)
    assert "HTTP 500" in msg and START_HINTS[0] in msg and no_ext.version is None
    pool = VllmPool.from_urls([no_ext.url, no_lora.url])
    with pytest.raises(GenerationError) as err:
        pool.load_adapter(adapter(tmp_path, "a1"), "round-1")
    assert "HTTP 500" in one_line(err) and START_HINTS[2] in str(err.value)
    with pytest.raises(GenerationError, match="HTTP 500"):
        pool.update_weights(weights, "round-1")
    assert len(pool.live) == 2 and pool.notes == []


def test_a_server_serving_another_version_is_refused(stubs, weights):
    stub = stubs(workers=2)
    engine = VllmEngine(stub.url)
    engine.update_weights(weights, "round-1")
    engine.check_version("round-1")
    with pytest.raises(GenerationError) as err:
        engine.check_version("round-2")
    msg = one_line(err)
    assert stub.url in msg and "'round-2'" in msg and "it serves version round-1" in msg
    with pytest.raises(GenerationError, match="weights version 'a b'"):
        engine.update_weights(weights, "a b")  # a version is part of an adapter name
    with pytest.raises(GenerationError, match="no \\*.safetensors"):
        engine.update_weights(weights.parent, "round-2")  # refused here, before the server is asked


def test_lora_adapters_are_loaded_named_by_version_and_replaced(stubs, tmp_path):
    stub = stubs()
    engine = VllmEngine(stub.url)
    first, second = adapter(tmp_path, "a1"), adapter(tmp_path, "a2")
    engine.load_adapter(first, "round-1")
    assert stub.admin == [("/v1/load_lora_adapter", {"lora_name": "prefpack-round-1", "lora_path": str(first)})]
    engine.generate(JOBS[:2], SETTINGS)
    assert {r["model"] for r in stub.requests} == {"prefpack-round-1"}
    stub.admin.clear()
    engine.load_adapter(second, "round-2")
    assert stub.admin == [("/v1/unload_lora_adapter", {"lora_name": "prefpack-round-1"}),
                          ("/v1/load_lora_adapter", {"lora_name": "prefpack-round-2", "lora_path": str(second)})]
    assert stub.adapters == {"prefpack-round-2": str(second)}
    assert engine.describe().items() >= {"model": "prefpack-round-2", "weights_version": "round-2"}.items()
    fresh = VllmEngine(stub.url)  # a new process (a resumed driver) finds the adapter by its version
    fresh.check_version("round-2")
    assert fresh.model == "prefpack-round-2"
    stub.adapters.clear()  # the server lost it (restarted)
    with pytest.raises(GenerationError) as err:
        engine.generate(JOBS[:1], SETTINGS)
    msg = one_line(err)
    assert "not the adapter prefpack-round-2" in msg and "--enable-lora" in msg


def test_two_servers_are_dealt_the_prompts_and_give_one_servers_samples(stubs, weights):
    a, b, single = stubs(), stubs(), stubs()
    pool = VllmPool.from_urls([a.url, b.url], concurrency=2)
    assert pool.batch_prompts == 2 * VllmEngine(single.url, concurrency=2).batch_prompts
    pool.update_weights(weights, "round-1")
    assert (a.version, b.version) == ("round-1", "round-1") and a.loaded_from == b.loaded_from == str(weights)
    out = pool.generate(JOBS, SETTINGS)
    assert a.requests and b.requests and len(a.requests) + len(b.requests) == len(JOBS)
    assert out == VllmEngine(single.url).generate(JOBS, SETTINGS)
    assert pool.describe()["urls"] == [a.url, b.url] and pool.describe()["weights_version"] == "round-1"
    b.version = "round-0"
    with pytest.raises(GenerationError, match=f"{b.url} cannot confirm it serves weights version 'round-1'"):
        pool.check_version("round-1")
    assert pool.notes == []


def test_a_server_dying_mid_round_leaves_its_prompts_to_the_others(stubs):
    dying, healthy, single = stubs(die_after=2), stubs(), stubs()
    pool = VllmPool.from_urls([dying.url, healthy.url], concurrency=1, request_timeout=5)
    out = pool.generate(JOBS, SETTINGS)
    assert out == VllmEngine(single.url).generate(JOBS, SETTINGS)
    answered = {r["seed"] for r in dying.requests[:2]} | {r["seed"] for r in healthy.requests}
    assert answered == {prompt_seed(SETTINGS.seed, j.row) for j in JOBS}
    assert len(pool.notes) == 1 and "\n" not in pool.notes[0]
    assert dying.url in pool.notes[0] and "dropped" in pool.notes[0] and "1 of 2 servers remain" in pool.notes[0]
    assert pool.live == [pool.engines[1]] and pool.batch_prompts == 8
    sent = len(dying.requests)
    pool.generate(JOBS[:3], SETTINGS)  # the next chunk goes to the healthy server only
    assert len(dying.requests) == sent


def test_every_server_dead_is_one_line_naming_each(stubs):
    a, b = stubs(die_after=0), stubs(die_after=1)
    pool = VllmPool.from_urls([a.url, b.url], concurrency=1, request_timeout=5)
    with pytest.raises(GenerationError) as err:
        pool.generate(JOBS, SETTINGS)
    msg = one_line(err)
    assert msg.startswith("no vLLM server is left") and a.url in msg and b.url in msg


def test_vllm_url_takes_a_list_or_commas(stubs, tmp_path, toy_tokenizers):
    from prefpack.cli import main

    a, b, single = stubs(), stubs(), stubs()
    assert vllm_urls(f"{a.url}/v1/, {b.url}") == vllm_urls([a.url, b.url]) == [a.url, b.url]
    with pytest.raises(GenerationError, match="more than once"):
        vllm_urls([a.url, f"{a.url},{b.url}"])
    engine = build_engine(GenerateOptions(output="x", engine="vllm", vllm_url=[a.url, b.url]), source=None)
    assert isinstance(engine, VllmPool) and [e.url for e in engine.engines] == [a.url, b.url]
    assert isinstance(build_engine(GenerateOptions(output="x", engine="vllm", vllm_url=a.url), source=None),
                      VllmEngine)
    rows = tmp_path / "p.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Human: question {i}\n\nAssistant:"}) + "\n" for i in range(6)))
    base = [str(rows), "--tokenizer", str(toy_tokenizers["llama"]), "--engine", "vllm", "--n", "2",
            "--max-new-tokens", "5", "--stop-token-ids", "2"]
    assert main(["generate", *base, "-o", str(tmp_path / "two.jsonl"), "--vllm-url", a.url, "--vllm-url", b.url]) == 0
    assert main(["generate", *base, "-o", str(tmp_path / "one.jsonl"), "--vllm-url", single.url]) == 0
    assert (tmp_path / "two.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()
    assert a.requests and b.requests
    meta = json.loads((tmp_path / "two.meta.json").read_text())
    assert meta["generation"]["urls"] == [a.url, b.url]


def test_the_worker_extension_imports_without_prefpacks_dependencies_and_reloads(weights):
    """In vLLM's own environment transformers, numpy or peft may be missing (torch and safetensors are there): the
    module imports, and a reload reads every tensor of the folder's files into the model's load_weights."""
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('transformers', 'numpy', 'peft'):
            raise ModuleNotFoundError('blocked ' + name, name=name)
sys.meta_path.insert(0, Block())
from prefpack.generation.vllm_worker import PrefpackWorkerExtension
assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'safetensors')], 'imported torch at import time'
class Model:
    def load_weights(self, weights):
        self.got = {{name: t.tolist() for name, t in weights}}
class Worker(PrefpackWorkerExtension):
    model_runner = type('Runner', (), {{'model': Model()}})()
w = Worker()
assert w.prefpack_weights_version() == {{'version': None}}
print(w.prefpack_reload_weights({str(weights)!r}, 'round-1'))
print(sorted(w.model_runner.model.got.items()))
print(w.prefpack_weights_version())
print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'numpy', 'peft')))
"""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[0] == str({"version": "round-1", "tensors": 3})
    assert lines[1] == str([("lm_head.weight", [[1.0] * 3] * 2), ("model.embed.weight", [[0.0, 1.0, 2.0],
                                                                                         [3.0, 4.0, 5.0]]),
                            ("model.norm.weight", [0.0] * 3)])
    assert lines[2:] == [str({"version": "round-1"}), "[]"]


def test_the_reload_goes_through_vllms_in_place_reload_where_the_worker_has_it(weights):
    """vLLM 0.32's workers have reload_weights (it restores parameters processed after loading): used when there."""
    class Worker(PrefpackWorkerExtension):
        def reload_weights(self, weights_iterator, is_checkpoint_format):
            self.got = (sorted(name for name, _ in weights_iterator), is_checkpoint_format)

    w = Worker()
    assert w.prefpack_reload_weights(str(weights), "round-2") == {"version": "round-2", "tensors": 3}
    assert w.got == (["lm_head.weight", "model.embed.weight", "model.norm.weight"], True)


def test_a_reload_that_fails_serves_no_known_version(tmp_path):
    class Worker(PrefpackWorkerExtension):
        model_runner = type("Runner", (), {"model": type("M", (), {"load_weights": lambda self, weights: list(
            weights)})()})()

    w = Worker()
    w._prefpack_version = "round-1"
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        w.prefpack_reload_weights(str(tmp_path), "round-2")
    assert w.prefpack_weights_version() == {"version": None}


def test_generate_reports_a_dropped_server_as_a_note(stubs, tmp_path, toy_tokenizers):
    from prefpack.generation.run import generate

    dying, healthy = stubs(die_after=1), stubs()
    rows = tmp_path / "p.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Human: question {i}\n\nAssistant:"}) + "\n" for i in range(6)))
    report = generate(GenerateOptions(output=str(tmp_path / "s.jsonl"), inputs=[str(rows)], engine="vllm",
                                      tokenizer=str(toy_tokenizers["llama"]), n=2, max_new_tokens=5,
                                      stop_token_ids=[2], vllm_url=f"{dying.url},{healthy.url}", concurrency=1,
                                      request_timeout=5), log=lambda m: None)
    assert report.prompts == 6 and len(report.notes) == 1 and dying.url in report.summary().splitlines()[-1]
