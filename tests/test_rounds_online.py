"""Online training as rounds of one step (``rounds.steps_per_round: 1``, ``rounds.save_each_round: false``): every
step samples the policy as it stands, scores, and trains on the pairs, with no model exported nor checkpoint forced per
round (the last round's model only); a run killed mid-way resumes from its last checkpoint by replaying the rounds whose
stores it wrote, to the uninterrupted run's files and weights; a reward model (TRL's online DPO: 2 samples a prompt,
a reward model judges) is loaded once for every round; with vLLM each step's weights reach the live server."""

from __future__ import annotations

import json

import pytest
import torch

from prefpack.config import load_config
from prefpack.rounds import RoundsInterrupted, run_rounds
from tests.conftest import quiet, read_jsonl
from tests.test_rounds import overrides, task  # noqa: F401 - task: the quickstart fixture, built for this module too

ROUNDS = 6
ONLINE = (f"rounds.count={ROUNDS}", "rounds.steps_per_round=1", "rounds.save_each_round=false",
          "rounds.prompts_per_round=4", "rounds.samples_per_prompt=2", "rounds.eval_prompts=null",
          "train.global_batch_pairs=4", "run.save_every=2")


def online_config(task, run: str, *extra: str):  # noqa: F811
    return load_config(None, overrides(task, run, *ONLINE, *extra))


def lines(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def online(task, one_thread):  # noqa: F811
    return run_rounds(online_config(task, "online"), log=quiet, progress=False)


def test_each_step_samples_the_policy_as_it_stands(online, task):  # noqa: F811
    run = task / "online"
    assert len(online.rounds) == ROUNDS
    # the last round's model alone is exported; the checkpoints follow run.save_every, not the rounds
    finals = sorted(p.parent.parent.name for p in (run / "rounds").glob("*/train/final"))
    assert finals == [f"{ROUNDS:03d}"] and online.final_dir == run / "rounds" / f"{ROUNDS:03d}" / "train" / "final"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    for r in range(ROUNDS):
        meta = json.loads((run / "rounds" / f"{r + 1:03d}" / "samples.meta.json").read_text())
        assert meta["generation"]["model"] == f"the policy in memory at step {r}"
        assert meta["prompts"]["subset"]["rows"] and len(read_jsonl(run / "rounds" / f"{r + 1:03d}" /
                                                                    "samples.jsonl")) == 4
    train = [x for x in lines(run) if x["split"] == "train"]
    assert [x["step"] for x in train] == list(range(1, ROUNDS + 1)) and [x["round"] for x in train] == \
        list(range(ROUNDS))
    assert [x["round"] for x in lines(run) if x["split"] == "round"] == list(range(ROUNDS))


def test_a_killed_online_run_replays_its_rounds_to_the_uninterrupted_run(online, task):  # noqa: F811
    from safetensors.torch import load_file

    cfg = online_config(task, "online_resumed", "run.save_every=3")  # when checkpoints are written: not the result
    with pytest.raises(RoundsInterrupted):  # killed while round 6 samples: the last checkpoint is step 3
        run_rounds(cfg, log=quiet, progress=False, stop_at=(5, "generate", 0))
    assert (task / "online_resumed" / "rounds" / "005" / "round.json").is_file()
    # rounds 4 and 5 replayed from their stores (round 5's line, logged after step 3, recorded again), round 6 sampled
    run_rounds(cfg, resume=True, log=quiet, progress=False)
    run, again = task / "online", task / "online_resumed"
    for r in range(1, ROUNDS + 1):
        for name in ("samples.jsonl", "store/tokens.bin", "store/index.bin"):
            a, b = (x / "rounds" / f"{r:03d}" / name for x in (run, again))
            assert a.read_bytes() == b.read_bytes(), (r, name)
    a, b = (load_file(str(x / "rounds" / f"{ROUNDS:03d}" / "train" / "final" / "model.safetensors"))
            for x in (run, again))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # every round's line once, every step's once: the replayed round recorded again, its line not twice
    assert [x["round"] for x in lines(again) if x["split"] == "round"] == list(range(ROUNDS))
    assert [x["step"] for x in lines(again) if x["split"] == "train"] == list(range(1, ROUNDS + 1))


def test_trl_online_dpo_as_rounds_loads_its_reward_model_once(task, tmp_path, one_thread):  # noqa: F811
    """TRL's OnlineDPOTrainer: per step, 2 completions of each prompt of the batch, a reward model picks the chosen."""
    import transformers as tf

    from prefpack.rewards import run as score_run

    tok = tf.AutoTokenizer.from_pretrained(task / "init")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.eos_token_id)
    tf.LlamaForSequenceClassification(cfg).eval().save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    made = []
    make = score_run.make_scorer

    def counted(opts):
        made.append(opts.reward_model)
        return make(opts)

    score_run.make_scorer = counted
    try:
        result = run_rounds(load_config(None, overrides(task, "online_rm", *ONLINE, "rounds.reward_fn=null",
                                                        f"rounds.reward_model={tmp_path / 'rm'}")),
                            log=quiet, progress=False)
    finally:
        score_run.make_scorer = make
    assert made == [str(tmp_path / "rm")]  # one load for every round
    assert len(result.rounds) == ROUNDS and all(m["pairs"] > 0 for m in result.rounds)


def test_online_rounds_give_each_steps_weights_to_a_live_vllm_server(task, one_thread):  # noqa: F811
    from prefpack.rounds.sampler import weights_version
    from tests.vllm_stub import StubServer

    server = StubServer().start()
    try:
        run_rounds(online_config(task, "online_vllm", "rounds.engine=vllm", f"rounds.vllm_url={server.url}",
                                 "rounds.max_new_tokens=4"), log=quiet, progress=False)
    finally:
        server.shutdown()
    run = task / "online_vllm"
    reloads = [tuple(b["args"]) for p, b in server.admin if p == "/collective_rpc"
               and b["method"] == "prefpack_reload_weights"]
    versions = [weights_version(run, r) for r in range(ROUNDS)]
    assert reloads == [(str(run / "sampler" / v / "final"), v) for v in versions]  # each step's weights, in order
    assert [p.name for p in (run / "sampler").iterdir()] == [versions[-1]]  # older copies removed once replaced
