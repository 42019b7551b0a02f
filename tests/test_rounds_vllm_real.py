"""Opt-in: on-policy rounds with ``rounds.engine: vllm`` and a real vLLM server prefpack starts from
``PREFPACK_VLLM_COMMAND`` (as in test_generate_vllm_real.py: vLLM in its own environment, docs/generate.md; under the
suite put ``env -u CUDA_VISIBLE_DEVICES`` in front). Skipped without the variable: a server's start takes a minute or
more on CPU.

Rounds in one process (the default): three rounds from ONE server start (on the initial model, with prefpack's worker
extension and dev mode; LoRA: ``--enable-lora`` and runtime updating), each round's policy given to it in place (the
full weights reloaded from the round's exported folder, or the round's adapter loaded) under a version each round's
samples record; the server's whole process group is gone after the run. A round per training
(``rounds.in_process: false``): each round's server started on that round's policy folder and stopped before the
round is scored. Either way round r's samples come from round r's policy (seeded sampling cannot be replayed in
process, so by likelihood: round 1's samples are likelier under the initial model, round 2's under round 1's, each to
a margin), and the pair stores pass ``Store.verify`` and hold the samples file's ids. Each round's seconds per phase
are printed (run with ``-s``)."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
from conftest import quiet, read_jsonl, write_jsonl

COMMAND = os.environ.get("PREFPACK_VLLM_COMMAND")
pytestmark = pytest.mark.skipif(not COMMAND, reason="set PREFPACK_VLLM_COMMAND to test against a real vLLM server")

# distinct characters of the reply: varied enough across a random model's samples that few prompts tie
REWARD = "def reward(prompt, completion, row):\n    return float(len(set(completion)))\n"


def _live_members(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that still run (zombies left to an init that does not reap are not)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(pid))
    return out


def _completion_logps(folder: Path, rows: list[dict]) -> list[float]:
    """Each sample's summed log-probability under the model in ``folder`` (transformers, float64, teacher-forced)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    out = []
    with torch.no_grad():
        for row in rows:
            for ids in row["completion_ids"]:
                seq = torch.tensor([row["prompt_ids"] + ids])
                logp = torch.log_softmax(model(seq).logits[0, :-1], -1)
                start = len(row["prompt_ids"]) - 1
                out.append(float(logp[start:].gather(1, seq[0, start + 1:, None]).sum()))
    return out


def _tiny_llama(folder: Path, tokenizer: Path) -> None:
    """2 layers, head size 64 (vLLM's CPU attention has no kernel for smaller heads), float32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=600, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)).save_pretrained(folder)
    for f in os.listdir(tokenizer):
        shutil.copy(tokenizer / f, folder / f)


def _check_stores_and_policies(run: Path, init: Path, rounds: list[dict]) -> None:
    """The round stores hold the samples files' ids; round 1 sampled ``init``, round 2 round 1's final model."""
    from prefpack.data.store import Store

    policies = [init, run / "rounds" / "001" / "train" / "final"]
    samples = [read_jsonl(run / "rounds" / f"{r:03d}" / "samples.jsonl") for r in (1, 2)]
    for r, rows in enumerate(samples):
        assert [row["row"] for row in rows] == list(range(8)) and all(len(x["completion_ids"]) == 4 for x in rows)
        store = Store(run / "rounds" / f"{r + 1:03d}" / "store")
        store.verify()
        assert len(store) == rounds[r]["pairs"] == 8 - rounds[r]["tied_prompts"] > 0
        by_row = {row["row"]: row for row in rows}
        for i, source in enumerate(store.column("source_row")):  # each pair: the samples file's ids, unchanged
            prompt, chosen, rejected = store.pair(i)
            row = by_row[int(source)]
            assert prompt.tolist() == row["prompt_ids"]
            assert chosen.tolist() in row["completion_ids"] and rejected.tolist() in row["completion_ids"]

    # round 2 sampled round 1's policy: log p1 - log p0 per sample, summed, is negative for round 1's samples
    # (drawn from p0: minus a KL) and positive for round 2's (drawn from p1: plus a KL); about -/+0.9 nats per token
    # in process (rounds.engine=transformers), so 0.2 a token is a wide margin
    gain = [math.fsum(a - b for a, b in zip(_completion_logps(policies[1], rows), _completion_logps(init, rows)))
            for rows in samples]
    tokens = [sum(len(ids) for row in rows for ids in row["completion_ids"]) for rows in samples]
    assert gain[0] / tokens[0] < -0.2 and gain[1] / tokens[1] > 0.2, (gain, tokens)



def _run(tmp_path, toy_tokenizers, monkeypatch, count: int, *extra: str):
    """``count`` rounds on a tiny Llama; the servers' starts and stops and the rounds' scoring, in order."""
    from prefpack.config import load_config
    from prefpack.generation import server as server_module
    from prefpack.rounds import phases, run_rounds

    init, run = tmp_path / "init", tmp_path / "run"
    _tiny_llama(init, toy_tokenizers["chatml"])
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": [{"role": "user", "content": f"question {i}?"}]}
                                                       for i in range(8)])
    (tmp_path / "reward.py").write_text(REWARD)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent))  # the worker extension's import
    cfg = load_config(None, [
        f"model.name_or_path={init}", "train.global_batch_pairs=4", "optim.lr=1e-2", "loss.beta=0.1",
        f"run.output_dir={run}", "run.report_to=none", "run.plot=false", f"rounds.count={count}",
        f"rounds.prompts={prompts}", "rounds.samples_per_prompt=4", "rounds.max_new_tokens=8", "rounds.temperature=1.0",
        "rounds.seed=3", f"rounds.reward_fn={tmp_path / 'reward.py'}:reward", "rounds.steps_per_round=6",
        "rounds.engine=vllm", *extra])

    events: list[tuple] = []  # what happened, in order: each server's start and stop, each round's scoring
    start, stop, score = server_module.VllmServer.start, server_module.VllmServer.stop, phases._score

    def recorded_start(self, *a, **k):
        events.append(("start", self.command))
        out = start(self, *a, **k)
        events.append(("serving", self.proc.pid))
        return out

    def recorded_stop(self, *a, **k):
        pid = self.proc.pid if self.proc is not None else None
        stop(self, *a, **k)
        events.append(("stopped", pid, _live_members(pid) if pid else []))

    def recorded_score(cfg, r, *a, **k):
        events.append(("score", r))
        return score(cfg, r, *a, **k)

    monkeypatch.setattr(server_module.VllmServer, "start", recorded_start)
    monkeypatch.setattr(server_module.VllmServer, "stop", recorded_stop)
    for module in ("prefpack.rounds.phases", "prefpack.rounds.driver"):
        monkeypatch.setattr(f"{module}._score", recorded_score)
    result = run_rounds(cfg, log=quiet, progress=False)
    for line in result.rounds:
        print(f"round {line['round'] + 1}: " + ", ".join(
            f"{k} {line[k]:.1f}" for k in ("seconds/generate", "seconds/score", "seconds/train",
                                           "generate/tokens_per_s")) + f", {line['pairs']} pairs")
    return init, run, events, result


@pytest.mark.parametrize("lora", [False, True], ids=["full-weights", "lora"])
def test_three_rounds_in_one_process_from_one_server_start(tmp_path, toy_tokenizers, monkeypatch, one_thread, lora):
    from prefpack.generation.vllm_worker import EXTENSION
    from prefpack.rounds.sampler import weights_version

    flags = "--enable-lora --max-lora-rank 8" if lora else f"--worker-extension-cls {EXTENSION}"
    extra = ("lora.enabled=true", "lora.r=8", "lora.alpha=16", "reference.mode=adapter", "optim.lr=0.1") if lora \
        else ()
    init, run, events, result = _run(tmp_path, toy_tokenizers, monkeypatch, 3,
                                     f"rounds.vllm_command={COMMAND} {flags}", *extra)
    kinds = [e[0] for e in events]
    assert kinds == ["start", "serving", "score", "score", "score", "stopped"], events  # one start for every round
    assert str(init) in events[0][1].split()  # started on the initial model (LoRA: the base)
    assert events[-1][1] == events[1][1] and events[-1][2] == []  # the whole process group is gone
    for r in range(3):
        meta = json.loads((run / "rounds" / f"{r + 1:03d}" / "samples.meta.json").read_text())
        assert meta["complete"] and meta["generation"]["weights_version"] == weights_version(run, r)
    if not lora:  # the samples' likelihoods under the rounds' merged final models (LoRA: its adapter moves them less)
        _check_stores_and_policies(run, init, result.rounds)


def test_rounds_as_separate_trainings_start_a_server_on_each_round_policy(tmp_path, toy_tokenizers, monkeypatch,
                                                                         one_thread):
    init, run, events, result = _run(tmp_path, toy_tokenizers, monkeypatch, 2, f"rounds.vllm_command={COMMAND}",
                                     "rounds.in_process=false", "rounds.optimizer=reset")
    policies = [init, run / "rounds" / "001" / "train" / "final"]
    kinds = [e[0] for e in events]
    assert kinds == ["start", "serving", "stopped", "score"] * 2, events
    for r, policy in enumerate(policies):
        started, serving, stopped, scored = events[4 * r: 4 * r + 4]
        assert str(policy) in started[1].split(), (r, started)  # {model} filled in with the round's policy folder
        assert stopped[1] == serving[1] and stopped[2] == [], (r, stopped)  # the whole process group is gone
        assert scored == ("score", r)
        folder = run / "rounds" / f"{r + 1:03d}"
        meta = json.loads((folder / "samples.meta.json").read_text())
        assert meta["complete"] and str(policy) in meta["generation"]["command"].split(), meta["generation"]
        assert (folder / "samples.vllm.log").stat().st_size > 0
    _check_stores_and_policies(run, init, result.rounds)
