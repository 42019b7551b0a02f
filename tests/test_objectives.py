"""The objective interface (issue "one design for every objective"): typed hooks, the running state a checkpoint
saves and evaluation reads, and reference modes as objects that answer the same questions."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import cfg_for, metrics_lines, quiet
from test_train import world  # noqa: F401 - a module-scoped fixture shared with test_train

from prefpack.objectives import PairTask, StepState
from prefpack.reference import (
    AdapterReference,
    CopyReference,
    NoReference,
    PrecomputedReference,
    ReferenceMismatch,
    make_reference,
)
from prefpack.training import build, evaluate, train


def test_evaluation_scores_bco_pair_running_with_the_training_mean(world, tmp_path):  # noqa: F811
    """The loop hands the objective's running state to the eval objective: the eval logged at step 2 equals an
    evaluation of the step-2 weights with the step-2 checkpoint's running mean, not with a mean of 0."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    extra = ["loss.terms=[{name: bco_pair_running}]", "loss.beta=1.0", f"data.eval={world['eval']}",
             f"reference.model={world['ref']}",
             "train.max_steps=3", "run.eval_every=2", "run.save_every=2", "run.keep_checkpoints=5"]
    train(cfg_for(world, run, *extra), progress=False, log=quiet)
    logged = next(m for m in metrics_lines(run, "eval") if m["step"] == 2)
    ckpt = run / "checkpoints" / "step-00000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert abs(state["bco_delta"]) > 1e-3 and state["bco_count"] == 2 * 8 * 2  # 2 steps of 8 pairs, 2 rewards each

    setup = build(cfg_for(world, tmp_path / "unused", *extra), log=quiet)
    setup.policy.load_state_dict(load_file(str(ckpt / "model.safetensors")))
    task = setup.eval_task
    task.load_state_dict({k: v for k, v in state.items() if k not in ("step", "plan_signature")})  # the objective's own
    with_mean = evaluate(setup.policy, setup.reference, task)
    task.load_state_dict({})
    without = evaluate(setup.policy, setup.reference, task)
    # the mean moves the loss little here (chosen and rejected rewards nearly cancel in it), so compare the gaps
    gap = abs(with_mean["loss"] - without["loss"])
    assert gap > 2e-5, (state, with_mean["loss"], without["loss"])
    assert abs(logged["loss"] - with_mean["loss"]) < gap / 20, (logged["loss"], with_mean["loss"], without["loss"])


def test_objective_state_is_typed_and_checked():
    from types import SimpleNamespace

    store = SimpleNamespace(index=np.zeros((3, 4), dtype=np.int64), path="fake", __len__=lambda: 3)
    task = PairTask.__new__(PairTask)
    task.store, task.running, task.bco = store, {}, False
    assert task.state_dict() == {}
    with pytest.raises(ValueError, match="unknown pair-objective state"):
        task.load_state_dict({"kl": 1.0})
    assert isinstance(task.begin_step(None, NoReference(), []), StepState)


@pytest.mark.parametrize("balance", ["tokens", "count"])
@pytest.mark.parametrize("n_world", [1, 2])
def test_deal_step_calls_plan_step_once_per_step_with_the_whole_step(n_world, balance):
    """``plan_step`` sees each step's examples once, all of them, before any rank plans its share."""
    from prefpack.batching.deal import deal_step
    from prefpack.batching.schedule import StepKey
    from prefpack.objectives import Objective, Planned

    class Recording(Objective):
        def __init__(self):
            self.calls = []

        def __len__(self):
            return 12

        def example_tokens(self, ids):
            return np.asarray(ids) % 5 + 3

        def plan_step(self, ids, *, seed):
            self.calls.append(("plan_step", sorted(np.asarray(ids).tolist()), seed))

        def plan(self, ids, *, seed):
            self.calls.append(("plan", sorted(np.asarray(ids).tolist()), seed))
            return [Planned(rows=[[int(i)] for i in ids], real_tokens=len(ids), computed_tokens=len(ids))]

    task = Recording()
    for step, ids in enumerate([np.array([7, 2, 9, 0, 4]), np.array([11]), np.arange(12)]):
        task.calls.clear()
        key = StepKey(3, step)
        deal_step(task, ids, seed=key, world=n_world, balance=balance)
        assert task.calls[0] == ("plan_step", sorted(ids.tolist()), key)  # first, with the whole step
        assert [c[0] for c in task.calls].count("plan_step") == 1
        planned = sorted(i for name, part, _ in task.calls[1:] for i in part)
        assert planned == sorted(ids.tolist())  # the ranks' shares (at most n_world plans) cover the step once
        assert 1 <= len(task.calls) - 1 <= n_world
    task.calls.clear()
    deal_step(task, np.arange(12), seed=None, world=n_world, balance=balance)  # an evaluation pass: one step too
    assert [c[:1] for c in task.calls].count(("plan_step",)) == 1 and task.calls[0][2] is None


def test_reference_modes_answer_the_same_questions():
    from pathlib import Path
    from types import SimpleNamespace

    from prefpack.reference import KeyedLogps

    batch = SimpleNamespace(completion_tokens=torch.ones(4), sequence_keys=torch.tensor([2, 3, 0, 1]), key_store="s",
                            tail_pairs=None, tail_keys=None)
    none = make_reference("none")
    assert isinstance(none, NoReference) and none.sequence_logps(batch) is None
    with pytest.raises(ValueError, match="computes no log-probs"):
        none.outputs(batch)

    pre = make_reference("precomputed")
    with pytest.raises(ReferenceMismatch, match="no precomputed reference log-probs loaded"):
        pre.sequence_logps(batch)
    # pair 0 = (-1, -3), pair 1 = (-2, -4) at keys 2p / 2p + 1; the batch holds pair 1 then pair 0
    pre.tables[Path("s")] = KeyedLogps(np.array([-1.0, -3.0, -2.0, -4.0]), np.array([-0.5, -1.5, -1.0, -2.0]))
    out = pre.sequence_logps(batch)
    assert out.logp_sum.tolist() == [-2.0, -4.0, -1.0, -3.0] and out.tail_sum is None  # tails only when asked
    pre.configure(chunk_size=8, pair_tails=True)
    assert pre.sequence_logps(batch).tail_sum.tolist() == [-1.0, -2.0, -0.5, -1.5]
    drawn = SimpleNamespace(**{**vars(batch), "tail_pairs": torch.tensor([[0], [3]]), "tail_keys": torch.tensor([[0], [1]])})
    assert pre.sequence_logps(drawn).tail_sum.tolist() == [[-0.5], [-1.5]]  # a drawn pair's tails by its own keys
    with pytest.raises(ValueError, match="sequence keys"):
        pre.sequence_logps(SimpleNamespace(**{**vars(batch), "sequence_keys": None}))
    assert isinstance(pre, PrecomputedReference) and pre.model is None

    model = torch.nn.Linear(2, 2)
    copy = make_reference("copy", model=model)
    assert isinstance(copy, CopyReference) and copy.model is model and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    copy.release()
    assert copy.model is None and copy.module is None
    assert isinstance(make_reference("adapter"), AdapterReference)
    with pytest.raises(ValueError, match="unknown reference mode"):
        make_reference("frozen")


def test_bco_pair_running_resume_equals_uninterrupted(world, tmp_path):  # noqa: F811
    """The running mean goes through the checkpoint: a resumed run continues with it, bit for bit."""
    from prefpack.training import TrainingInterrupted

    extra = ["loss.terms=[{name: bco_pair_running}]", f"reference.model={world['ref']}", "train.max_steps=4",
             "run.save_every=2"]
    train(cfg_for(world, tmp_path / "full", *extra), progress=False, log=quiet)
    broken = tmp_path / "broken"
    with pytest.raises(TrainingInterrupted):
        train(cfg_for(world, broken, *extra), progress=False, log=quiet, stop_after_steps=2)
    train(cfg_for(world, broken, *extra), progress=False, log=quiet, resume=True)
    a, b = metrics_lines(tmp_path / "full"), metrics_lines(broken)
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        assert x["loss"] == y["loss"], (x, y)
    assert math.isfinite(a[-1]["loss"])


def test_each_mode_sets_itself_up_from_only_what_it_needs():
    from prefpack.model import ModelError
    from prefpack.reference import REFERENCE_MODES, ReferenceSetup

    calls = []
    model = torch.nn.Linear(2, 2)

    def setup(lora=False):
        return ReferenceSetup(load=lambda: calls.append("load") or model,
                              weights_hash=lambda: calls.append("hash") or "h", lora=lora)

    assert isinstance(REFERENCE_MODES["none"].set_up(setup()), NoReference) and calls == []
    copy = REFERENCE_MODES["copy"].set_up(setup())
    assert isinstance(copy, CopyReference) and copy.model is model and calls == ["load"]
    pre = REFERENCE_MODES["precomputed"].set_up(setup())
    assert isinstance(pre, PrecomputedReference) and pre.reference_hash == "h" and calls == ["load", "hash"]
    with pytest.raises(ModelError, match="lora.enabled=true"):
        REFERENCE_MODES["adapter"].set_up(setup())
    adapter = REFERENCE_MODES["adapter"].set_up(setup(lora=True))
    adapter.bind_policy(model)
    assert isinstance(adapter, AdapterReference) and adapter.policy is model and calls == ["load", "hash"]
    assert {m for m, cls in REFERENCE_MODES.items() if cls.reads_weights} == {"copy", "precomputed"}


def test_build_resolves_settings_once_and_leaves_the_config_alone(world, tmp_path):  # noqa: F811
    """`build` resolves every `auto` into the objectives' RunSettings and never writes into the config; the
    objectives plan with the resolved sharing, also where `auto` resolves to off (a kernel that reads no prompt
    groups), which the old `bool(cfg.data.prefix_sharing)` read as on."""
    import copy

    from prefpack.objectives import RunSettings, settings_from_config

    for attn, shared in (("packed_sdpa", True), ("sdpa", False)):
        cfg = cfg_for(world, tmp_path / attn, f"model.attn_implementation={attn}", f"data.eval={world['eval']}",
                      "train.micro_batch_tokens=auto", "data.max_tokens_per_row=auto", "train.chunk_size=auto")
        before = copy.deepcopy(cfg)
        setup = build(cfg, log=quiet)
        assert cfg == before and cfg.data.prefix_sharing == "auto" and cfg.train.chunk_size == "auto"
        s = setup.settings
        assert isinstance(s, RunSettings) and setup.train_task.settings is s and setup.eval_task.settings is s
        assert (s.micro_batch_tokens, s.row_tokens, s.chunk_size) == (4096, 2048, 1024)  # CPU's auto budgets
        assert s.shares_prompts is shared and setup.train_task.shares_prompts is shared
        batch = setup.train_task.collate(setup.train_task.plan(np.arange(4), seed=None)[0])
        assert (batch.score_positions is not None) is shared  # the layout follows the resolved value
        assert s.loss.beta == cfg.loss.beta and s.pad_id == setup.pad_id
    with pytest.raises(ValueError, match="data.prefix_sharing is 'auto'"):
        settings_from_config(cfg, pad_id=0, micro_batch_tokens=64, row_tokens=64, chunk_size=8)
    with pytest.raises(ValueError, match="train.chunk_size is 'auto'"):
        settings_from_config(cfg, pad_id=0, micro_batch_tokens=64, row_tokens=64, shares_prompts=False)


def test_loss_keywords_come_from_the_table():
    """Every loss.* parameter reaches the loss function that reads it (LOSS_PARAMS' read_by), and no other."""
    import inspect

    from prefpack.loss_params import LOSS_PARAMS
    from prefpack.losses import preference_loss, unpaired_loss
    from prefpack.objectives import LossParams

    params = LossParams(**{n: float(i + 1) for i, n in enumerate(LOSS_PARAMS)}, f_divergence_type="forward_kl",
                        use_weighting=True, kl_pairing="fixed")
    for reader, fn in (("pair", preference_loss), ("unpaired", unpaired_loss)):
        kw = params.keywords(reader)
        accepted = set(inspect.signature(fn).parameters)
        assert set(kw) <= accepted, (reader, set(kw) - accepted)
        assert all(kw[n] == getattr(params, n) for n in kw)
        # a table row that the function takes as a keyword is passed to it
        assert {n for n in LOSS_PARAMS if n in accepted} <= set(kw), reader
    assert params.keywords("pair")["f_divergence_type"] == "forward_kl"
    assert "desirable_weight" not in params.keywords("pair") and "ld_alpha" not in params.keywords("unpaired")
