"""KTO: the loss against float64 formulas, the KL pairing, packed == padded, a tiny run, precomputed == copy,
a pair store read as KTO, and `prefpack eval` on an unpaired store."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import make_task, metrics_lines, quiet, seq_logp_f64, tiny_llama, write_jsonl

from prefpack.batching.schedule import StepKey, StepSchedule
from prefpack.cli import main as cli_main
from prefpack.config import ConfigError, load_config
from prefpack.data.kl_pairing import fixed_kl_partners, step_kl_partners
from prefpack.data.prepare import PrepareOptions, prepare
from prefpack.data.store import Store, StoreError
from prefpack.data.views import UnpairedView
from prefpack.losses import (
    UnpairedLogps,
    apo_zero_unpaired_loss,
    class_balance_warning,
    kl_reference_point,
    kto_loss,
    unpaired_loss,
)
from prefpack.model import SequenceLogps
from prefpack.objectives import KTOTask
from prefpack.training import build, train

# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def kworld(tmp_path_factory, toy_tokenizers, hh_train):
    """A 19-example unpaired train store (12 desirable), a 7-example eval store, a 6-pair store, two models."""
    root = tmp_path_factory.mktemp("kto")
    tok = toy_tokenizers["llama"]
    # short, distinct prompts (the ends of real ones, numbered) so that truncation keeps them apart
    rows = [{"prompt": f"Q{k}:{r['prompt'][-50:]}", "chosen": r["chosen"][:60], "rejected": r["rejected"][:60]}
            for k, r in enumerate(hh_train[:80])]
    rows = [r for r in rows if r["chosen"].strip() and r["rejected"].strip() and r["chosen"] != r["rejected"]]

    def unpaired(part):
        out = []
        for k, r in enumerate(part):
            good = k % 3 != 0
            out.append({"prompt": r["prompt"], "completion": r["chosen"] if good else r["rejected"], "label": good})
        return out

    parts = {"train": unpaired(rows[:19]), "eval": unpaired(rows[19:26]), "pairs": rows[26:32]}
    for name, part in parts.items():
        prepare(PrepareOptions(inputs=[str(write_jsonl(root / f"{name}.jsonl", part))], tokenizer=str(tok),
                               output=str(root / name), max_length=64, workers=1), log=lambda m: None)
    return {"root": root, "tok": tok, "train": root / "train", "eval": root / "eval", "pairs": root / "pairs",
            "policy": tiny_llama(tok, root / "policy", 1), "ref": tiny_llama(tok, root / "ref", 2)}


def kcfg(w, run_dir, *extra):
    base = [f"model.name_or_path={w['policy']}", f"data.train={w['train']}", f"run.output_dir={run_dir}",
            "loss.terms=[{name: kto}]", f"reference.model={w['ref']}", "optim.lr=1.0e-3",
            "optim.schedule=constant", "train.global_batch_pairs=5", "train.max_steps=3", "run.plot=false",
            "run.tensorboard=false", "train.micro_batch_tokens=4096", "data.max_tokens_per_row=1024"]
    return load_config(None, base + list(extra))


# ---------------------------------------------------------------- the loss as a pure function


def _sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_kto_and_apo_zero_unpaired_match_float64_formulas():
    g = torch.Generator().manual_seed(0)
    r = (torch.randn(9, generator=g, dtype=torch.float64) * 3).tolist()
    label = [True, False, True, True, False, False, True, False, True]
    beta, z0, wd, wu = 0.7, 0.4, 1.3, 0.8
    got = kto_loss(torch.tensor(r, dtype=torch.float64), torch.tensor(label), z0, beta, wd, wu)
    want = [wd * (1 - _sig(beta * (ri - z0))) if y else wu * (1 - _sig(beta * (z0 - ri))) for ri, y in zip(r, label)]
    assert got.shape == (9,) and got.dtype == torch.float64
    assert got.tolist() == pytest.approx(want, abs=1e-12)
    got = apo_zero_unpaired_loss(torch.tensor(r, dtype=torch.float64), torch.tensor(label), beta, wd, wu)
    want = [wd * (1 - _sig(beta * ri)) if y else wu * _sig(beta * ri) for ri, y in zip(r, label)]
    assert got.tolist() == pytest.approx(want, abs=1e-12)
    # large margins stay finite, and so do their gradients
    x = torch.tensor([800.0, -800.0], requires_grad=True)
    kto_loss(x, torch.tensor([True, False]), 0.0, 1.0).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_unpaired_loss_metrics_and_gradient():
    pol = torch.tensor([-5.0, -7.0, -3.0, -9.0, -4.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-6.0, -6.5, -3.5, -8.0, -4.0], dtype=torch.float64)
    label = torch.tensor([True, False, True, False, True])
    tokens = torch.tensor([5, 7, 3, 9, 4])
    beta, z0 = 0.5, 0.25
    out = unpaired_loss(UnpairedLogps(pol, ref, label, tokens), "kto", beta=beta, kl=z0, weight=2.0)
    r = (pol - ref).detach().tolist()
    want = [2.0 * (1 - _sig(beta * (x - z0)) if y else 1 - _sig(beta * (z0 - x))) for x, y in zip(r, label.tolist())]
    assert out.loss.tolist() == pytest.approx(want, abs=1e-12)
    # d/dr of w (1 - s), s = sigma(beta (r - z0)): -w beta s (1 - s); of w (1 - s), s = sigma(beta (z0 - r)): +w beta s (1 - s)
    out.loss.sum().backward()
    for i, (x, y) in enumerate(zip(r, label.tolist())):
        s = _sig(beta * (x - z0)) if y else _sig(beta * (z0 - x))
        assert float(pol.grad[i]) == pytest.approx((-2.0 if y else 2.0) * beta * s * (1 - s), abs=1e-12)
    m = out.metrics
    rd, ru = [beta * x for x, y in zip(r, label.tolist()) if y], [beta * x for x, y in zip(r, label.tolist()) if not y]
    assert m["rewards/chosen"].tolist() == pytest.approx(rd) and m["rewards/rejected"].tolist() == pytest.approx(ru)
    # StepTotals divides each metric by its own element count: the margin's mean must be mean(D) - mean(U)
    assert m["rewards/margins"].numel() == 5
    assert float(m["rewards/margins"].mean()) == pytest.approx(sum(rd) / 3 - sum(ru) / 2)
    assert m["logps/chosen"].tolist() == [-5.0, -3.0, -4.0] and m["logps/rejected"].tolist() == [-7.0, -9.0]
    assert float(m["kl"]) == z0 and float(m["count/chosen"]) == 3 and float(m["count/rejected"]) == 2
    apo = unpaired_loss(UnpairedLogps(pol.detach(), ref, label, tokens), "apo_zero_unpaired", beta=beta, kl=9.0)
    assert "kl" not in apo.metrics  # no reference point: z0 is not read
    assert apo.loss.tolist() == pytest.approx(apo_zero_unpaired_loss(pol.detach() - ref, label, beta).tolist())


def test_kl_reference_point_and_class_balance_warning():
    assert kl_reference_point(3.0, 4) == 0.75
    assert kl_reference_point(-3.0, 4) == 0.0  # z0 = max(0, mean)
    assert kl_reference_point(0.0, 0) == 0.0
    assert class_balance_warning(100, 90) is None  # 1.11 lies in [1, 4/3]
    assert class_balance_warning(100, 100) is None
    msg = class_balance_warning(300, 100)
    assert msg is not None and "3.000" in msg and "[1, 4/3]" in msg
    # the suggested range is right: its ends bring the ratio back into [1, 4/3]
    assert "loss.desirable_weight in [0.333, 0.444]" in msg
    assert class_balance_warning(300, 100, desirable_weight=0.4) is None
    assert class_balance_warning(100, 300, desirable_weight=3.5) is None
    assert "no undesirable" in class_balance_warning(10, 0)


# ---------------------------------------------------------------- the KL pairing


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 8, 19])
def test_step_pairing_never_matches_itself(size):
    n_store = 19
    groups = np.arange(n_store)
    fixed = fixed_kl_partners(groups, seed=0)
    assert (fixed != np.arange(n_store)).all() and (fixed >= 0).all()
    seen = set()
    for step in range(20):
        ids = np.random.default_rng(step).permutation(n_store)[:size]
        p = step_kl_partners(ids, groups, [0, step, 7], fixed)
        assert (p != ids).all(), (size, step)
        if size >= 2:
            assert set(p.tolist()) <= set(ids.tolist())  # the partner comes from the same step
        else:
            assert p[0] == fixed[ids[0]]  # one example: a deterministic other example of the store
        assert np.array_equal(p, step_kl_partners(ids, groups, [0, step, 7], fixed))  # deterministic
        seen.add(tuple(p.tolist()))
    if size >= 3:
        assert len(seen) > 1  # not the same shift every step


def test_pairing_of_a_pair_store_avoids_the_sibling():
    groups = np.repeat(np.arange(6), 2)  # 6 pairs read as 12 KTO examples
    fixed = fixed_kl_partners(groups, seed=3)
    assert (groups[fixed] != groups).all()
    for step in range(10):
        ids = np.random.default_rng(step).permutation(12)[:5]
        p = step_kl_partners(ids, groups, [3, step], fixed)
        assert (groups[p] != groups[ids]).all() and set(p.tolist()) <= set(ids.tolist())
    # a step holding only the two halves of one pair has no other completion: the fixed partners are used
    p = step_kl_partners(np.array([4, 5]), groups, [3, 0], fixed)
    assert np.array_equal(p, fixed[[4, 5]]) and (groups[p] != 2).all()
    # a single pair: the halves are each other's only other completion
    assert fixed_kl_partners(np.array([0, 0]), seed=0).tolist() == [1, 0]


def test_examples_sharing_a_prompt_are_not_kl_partners(kworld, tmp_path):
    rows = [{"prompt": "Q one", "completion": " yes", "label": True},
            {"prompt": "Q one", "completion": " no", "label": False},
            {"prompt": "Q one", "completion": " maybe", "label": True},
            {"prompt": "Q two", "completion": " fine", "label": True},
            {"prompt": "Q three", "completion": " bad", "label": False}]
    prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "u.jsonl", rows))], tokenizer=str(kworld["tok"]),
                           output=str(tmp_path / "s"), workers=1), log=quiet)
    task = make_task(KTOTask, Store(tmp_path / "s"), kcfg(kworld, "unused", f"data.train={tmp_path / 's'}"))
    groups = task.view.groups
    assert groups.tolist() == [0, 0, 0, 1, 2]
    assert (groups[task.fixed_partners()] != groups).all()
    for step in range(10):
        ids = np.random.default_rng(step).permutation(5)[:3]
        partners = task.partners_for(ids, [0, step])
        if len(set(groups[ids].tolist())) > 1:
            assert (groups[partners] != groups[ids]).all()
        else:  # a step of one prompt only: partners from the fixed pairing, with another prompt
            assert (groups[partners] != groups[ids]).all() and (partners != ids).all()


def _decode_sequences(batch, which):
    """{example position: token list} of the main or KL sequences of a KTOBatch (any layout)."""
    b = batch.main if which == "main" else batch.kl
    out = {}
    for k in range(batch.num_examples):
        sel = b.seq_index == k
        out[k] = b.input_ids[sel].tolist()
    return out


def test_collated_kl_sequences_across_accumulation(kworld):
    store = Store(kworld["train"])
    view = UnpairedView(store)
    ids = np.array([3, 11, 0, 17, 8])
    plans = {}
    for name, extra in (("one", []), ("many", ["train.micro_batch_tokens=16", "data.max_tokens_per_row=16"]),
                        ("padded", ["data.packing=false"])):
        task = make_task(KTOTask, store, kcfg(kworld, "unused", *extra))
        plans[name] = task.plan(ids, seed=StepKey(0, 4))
        partners = {}
        for planned in plans[name]:
            batch = task.collate(planned)
            main, kl = _decode_sequences(batch, "main"), _decode_sequences(batch, "kl")
            for k, (i, j) in enumerate(zip(batch.example_ids.tolist(), batch.kl_ids.tolist())):
                prompt, completion, label = view[i]
                assert i != j and j in ids.tolist()
                assert main[k] == prompt.tolist() + completion.tolist()
                assert kl[k] == prompt.tolist() + view.completion(j).tolist()
                assert bool(batch.label[k]) == label == bool(store.column("label")[i])
                partners[i] = j
        assert sorted(partners) == sorted(ids.tolist())
        plans[name] = partners
    small = kcfg(kworld, "u", "train.micro_batch_tokens=16", "data.max_tokens_per_row=16")
    assert len(make_task(KTOTask, store, small).plan(ids, seed=StepKey(0, 4))) == 5  # one example per micro-batch
    # the pairing depends on the step and the seed only, not on packing or accumulation
    assert plans["one"] == plans["many"] == plans["padded"]


def test_padded_batch_reads_with_trl_keys(kworld):
    store = Store(kworld["train"])
    view = UnpairedView(store)
    task = make_task(KTOTask, store, kcfg(kworld, "unused", "data.packing=false"))
    (planned,) = task.plan(np.array([2, 5, 6]), seed=None)
    batch = task.collate(planned)
    assert set(batch.keys()) >= {"input_ids", "attention_mask", "completion_mask", "KL_input_ids",
                                 "KL_attention_mask", "KL_completion_mask", "label"}
    for row, (i, j) in enumerate(zip(batch.example_ids.tolist(), batch.kl_ids.tolist())):
        prompt, completion, label = view[i]
        n, m = len(prompt) + len(completion), len(prompt) + len(view.completion(j))
        assert batch["input_ids"][row, :n].tolist() == prompt.tolist() + completion.tolist()
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
        assert batch["completion_mask"][row].tolist()[:n] == [0] * len(prompt) + [1] * len(completion)
        assert batch["KL_input_ids"][row, :m].tolist() == prompt.tolist() + view.completion(j).tolist()
        assert batch["KL_completion_mask"][row].sum() == len(view.completion(j))
        assert batch["KL_attention_mask"][row].sum() == m
        assert bool(batch["label"][row]) == label
    packed = make_task(KTOTask, store, kcfg(kworld, "unused"))
    pbatch = packed.collate(packed.plan(np.array([2, 5, 6]), seed=None)[0])
    assert pbatch["attention_mask"] is None and pbatch["input_ids"].shape[0] == 1  # one packed row


def test_begin_step_ignores_zero_weight_padding_batches(kworld):
    setup = build(kcfg(kworld, "unused"), log=quiet)
    task = setup.train_task
    module = SequenceLogps(setup.policy)
    batches = [task.collate(p) for p in task.plan(np.arange(9), seed=StepKey(0, 1))]
    ref = task.begin_step(module, setup.reference, batches)
    padded = task.begin_step(module, setup.reference, batches + [batches[0]], weights=[1.0] * len(batches) + [0.0])
    assert padded.kl_sum == pytest.approx(ref.kl_sum) and padded.kl_count == ref.kl_count == 9
    assert padded.class_counts == ref.class_counts == (int(Store(kworld["train"]).column("label")[:9].sum()),
                                                             9 - int(Store(kworld["train"]).column("label")[:9].sum()))


@pytest.mark.parametrize("balance", ["tokens", "count"])
def test_pairing_and_kl_sums_do_not_depend_on_the_number_of_ranks(kworld, balance):
    """Ranks plan only their share of a step (prefpack.distributed.deal_step); the KL partners are still
    those of the whole step, and the per-rank KL sums and counts add up to one process's (what the
    all-reduce in begin_step sums). Simulated without a process group: deal_step is pure."""
    from prefpack.batching.deal import deal_step

    setup = build(kcfg(kworld, "unused", "train.global_batch_pairs=7", "train.micro_batch_tokens=128",
                       "data.max_tokens_per_row=128"), log=quiet)
    task, module = setup.train_task, SequenceLogps(setup.policy)
    ids = np.random.default_rng([0, 0]).permutation(19)[:7]  # the schedule's step 0 (train.seed 0, shuffle)
    from prefpack.batching.schedule import StepSchedule

    assert np.array_equal(StepSchedule(19, 7, 0).pairs_for_step(0)[1], ids)

    def partners(shares):
        out = {}
        for share in shares:
            for planned, w in zip(share.planned, share.weights):
                if w:
                    out.update({i: j for r, q in zip(planned.rows, planned.kl_partners) for i, j in zip(r, q)})
        return out

    one = deal_step(task, ids, seed=StepKey(0, 0), world=1)
    assert sorted(partners(one)) == sorted(ids.tolist())
    for world in (2, 3, 7):
        shares = deal_step(task, ids, seed=StepKey(0, 0), world=world, balance=balance)
        assert partners(shares) == partners(one), world
    ref = task.begin_step(module, setup.reference, [task.collate(p) for p in one[0].planned])
    shares = deal_step(task, ids, seed=StepKey(0, 0), world=3, balance=balance)
    per_rank = [task.begin_step(module, setup.reference, [task.collate(p) for p in s.planned], weights=s.weights)
                for s in shares]
    assert sum(r.kl_count for r in per_rank) == ref.kl_count == 7
    assert sum(r.kl_sum for r in per_rank) == pytest.approx(ref.kl_sum, abs=1e-4)


@pytest.mark.parametrize("store", ["train", "pairs"])
def test_plan_step_draws_the_scheduled_steps_partners(kworld, store):
    """deal_step hands KTO the whole step (plan_step) before dealing: every rank's partners are those of
    step_kl_partners over the scheduled step's ids, seeded by (train.seed, step), for any world size and dealing;
    a pair store read as KTO (a pair's halves one prompt group) included."""
    from prefpack.batching.deal import deal_step
    from prefpack.data.kl_pairing import SALT_STEP

    extra = [f"data.train={kworld[store]}"] + (["data.paired_as_kto=true"] if store == "pairs" else [])
    task = make_task(KTOTask, Store(kworld[store]), kcfg(kworld, "unused", *extra, "train.micro_batch_tokens=128",
                                                         "data.max_tokens_per_row=128"))
    groups = UnpairedView(Store(kworld[store]), paired_as_kto=store == "pairs").groups
    sched = StepSchedule(len(groups), 5, 0, True, groups)  # the loop's schedule: global batch 5, seed 0, shuffled
    fixed = fixed_kl_partners(groups, 0)
    for step in range(2 * sched.steps_per_epoch):  # two epochs, the short last step of each included
        ids = sched.pairs_for_step(step)[1]
        expected = dict(zip(ids.tolist(), step_kl_partners(ids, groups, [0, step, SALT_STEP], fixed).tolist()))
        for world, balance in ((1, "tokens"), (2, "tokens"), (2, "count"), (3, "tokens")):
            got = {}
            for share in deal_step(task, ids, seed=StepKey(0, step), world=world, balance=balance):
                for planned, w in zip(share.planned, share.weights):
                    if w:
                        got.update({i: j for r, q in zip(planned.rows, planned.kl_partners) for i, j in zip(r, q)})
            assert got == expected, (step, world, balance)
        half = ids[: (len(ids) + 1) // 2]  # a share of the step planned on its own reads the step's partners
        assert task.partners_for(half, StepKey(0, step)).tolist() == [expected[i] for i in half.tolist()]


# ---------------------------------------------------------------- training


def test_tiny_kto_run_lowers_loss(kworld, tmp_path):
    run = tmp_path / "run"
    res = train(kcfg(kworld, run, "train.max_steps=8", "train.global_batch_pairs=19", "loss.beta=1.0",
                     f"reference.model={kworld['policy']}", f"data.eval={kworld['eval']}", "optim.lr=3.0e-3"),
                progress=False, log=quiet)
    lines = metrics_lines(run)
    losses = [m["loss"] for m in lines]
    assert losses[0] == pytest.approx(0.5, abs=1e-6)  # policy == reference: r = 0, z0 = 0, 1 - sigma(0)
    assert losses[-1] < losses[0] - 0.1
    assert res.eval_before["loss"] == pytest.approx(0.5, abs=1e-6)
    assert math.isfinite(res.eval_after["loss"])  # held-out labels carry no signal here: no direction asserted
    labels = Store(kworld["train"]).column("label")
    last = lines[-1]
    assert last["count/chosen"] == labels.sum() and last["count/rejected"] == len(labels) - labels.sum()
    assert last["rewards/margins"] == pytest.approx(last["rewards/chosen"] - last["rewards/rejected"], abs=1e-6)
    assert last["rewards/chosen"] > 0 > last["rewards/rejected"]
    for key in ("kl", "logps/chosen", "logps/rejected", "loss/kto", "nll", "lr", "grad_norm", "filling"):
        assert key in last, key


def test_pair_store_read_as_kto(kworld, tmp_path):
    pairs = Store(kworld["pairs"])
    cfg = kcfg(kworld, tmp_path / "r", f"data.train={kworld['pairs']}", "data.paired_as_kto=true")
    task = make_task(KTOTask, pairs, cfg)
    assert len(task) == 2 * len(pairs)
    for p in range(len(pairs)):
        pair = pairs.pair(p)
        for half, completion, label in ((0, pair.chosen, True), (1, pair.rejected, False)):
            prompt, got, lab = task.view[2 * p + half]
            assert lab is label and np.array_equal(got, completion) and np.array_equal(prompt, pair.prompt)
    assert task.view.labels.tolist() == [True, False] * len(pairs)
    # the whole pipeline: a step over every example, and a sibling is never a KL partner
    (planned,) = task.plan(np.arange(len(task)), seed=StepKey(0, 0))
    batch = task.collate(planned)
    assert (batch.example_ids // 2 != batch.kl_ids // 2).all()
    res = train(cfg, progress=False, log=quiet)
    first = metrics_lines(tmp_path / "r")[0]
    assert first["count/chosen"] + first["count/rejected"] == 5  # train.global_batch_pairs=5 examples per step
    assert res.steps == 3
    with pytest.raises(StoreError, match="paired_as_kto"):
        build(kcfg(kworld, tmp_path / "s", f"data.train={kworld['pairs']}"), log=quiet)
    with pytest.raises(ConfigError, match="paired_as_kto"):
        load_config(None, ["data.paired_as_kto=true"]).validate(training=False)
    with pytest.raises(ConfigError, match="only term"):
        load_config(None, ["loss.terms=[{name: kto}, {name: sigmoid}]"]).validate(training=False)


def test_imbalance_warning_is_logged(kworld, tmp_path):
    logged = []
    build(kcfg(kworld, tmp_path / "r", "loss.desirable_weight=3.0"), log=logged.append)
    assert any("imbalanced KTO classes" in m and "Eq. 8" in m for m in logged)


# ---------------------------------------------------------------- prefpack eval


def test_eval_cli_on_an_unpaired_store_matches_float64_formula(kworld, capsys):
    from transformers import AutoModelForCausalLM

    models = {k: AutoModelForCausalLM.from_pretrained(kworld[k], dtype=torch.float32).eval() for k in ("policy", "ref")}
    store = Store(kworld["eval"])
    view = UnpairedView(store)
    partners = make_task(KTOTask, store, kcfg(kworld, "unused")).partners_for(np.arange(len(view)), None)
    assert (partners != np.arange(len(view))).all()
    kl_logp = {k: [seq_logp_f64(m, view.prompt(i), view.completion(j)) for i, j in enumerate(partners)]
               for k, m in models.items()}
    # roles chosen so that E[policy - reference] > 0 on the KL sequences: z0 is not clamped to 0
    pol_name, ref_name = ("policy", "ref") if sum(kl_logp["policy"]) > sum(kl_logp["ref"]) else ("ref", "policy")
    assert cli_main(["eval", "--model", str(kworld[pol_name]), "--ref", str(kworld[ref_name]), "--data",
                     str(kworld["eval"]), "--beta", "0.3", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    pol, ref = models[pol_name], models[ref_name]
    z0 = max(0.0, sum(a - b for a, b in zip(kl_logp[pol_name], kl_logp[ref_name])) / len(view))
    assert z0 > 1e-3
    losses = []
    for i in range(len(view)):
        prompt, completion, good = view[i]
        r = seq_logp_f64(pol, prompt, completion) - seq_logp_f64(ref, prompt, completion)
        losses.append(1 - _sig(0.3 * (r - z0)) if good else 1 - _sig(0.3 * (z0 - r)))
    assert got["examples"] == len(view) == 7 and got["reference"] == "copy"
    assert got["kl"] == pytest.approx(z0, abs=1e-5)
    assert got["loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-5)


# ---------------------------------------------------------------- reference modes and the example config


def test_adapter_reference_and_none_refused(kworld, tmp_path):
    run = tmp_path / "lora"
    train(kcfg(kworld, run, "lora.enabled=true", "reference.mode=adapter", "lora.r=4", "train.max_steps=2",
               "reference.model=null"), progress=False, log=quiet)
    first = metrics_lines(run)[0]
    assert first["loss"] == pytest.approx(0.5, abs=1e-6) and first["kl"] == 0.0  # LoRA starts as a no-op
    with pytest.raises(ConfigError, match="needs a reference"):
        load_config(None, ["loss.terms=[{name: kto}]", "reference.mode=none"]).validate(training=False)


def test_example_config_is_valid():
    from conftest import REPO

    cfg = load_config(REPO / "examples" / "configs" / "kto.yaml", [])
    cfg.validate()
    assert cfg.loss.terms[0].name == "kto" and cfg.data.paired_as_kto


def test_the_shuffle_keeps_a_prompt_group_in_one_step_and_is_unchanged_without_groups():
    """StepSchedule with prompt groups: a group's examples stay adjacent (a pair's halves with paired_as_kto share a
    step and so their prompt); with every example its own group the order is exactly the plain permutation."""
    plain = StepSchedule(10, 4, 3)
    assert np.array_equal(StepSchedule(10, 4, 3, groups=np.arange(10)).epoch_order(2), plain.epoch_order(2))
    groups = np.repeat(np.arange(5), 2)
    order = StepSchedule(10, 4, 3, groups=groups).epoch_order(1)
    assert sorted(order.tolist()) == list(range(10))
    assert (groups[order[0::2]] == groups[order[1::2]]).all()  # halves side by side, so an even batch holds pairs
    assert not np.array_equal(order, np.arange(10))


def test_dealing_keeps_a_prompt_groups_examples_on_one_rank():
    """balance=tokens deals whole prompt groups (a pair's halves with paired_as_kto), largest first."""
    from types import SimpleNamespace

    from prefpack.batching.deal import deal_step

    groups = np.array([0, 0, 1, 1, 2, 3, 3, 3])
    sizes = np.array([5, 6, 1, 1, 9, 2, 2, 2])
    seen = []
    task = SimpleNamespace(schedule_groups=lambda: groups, example_tokens=lambda ids: sizes[ids],
                           plan=lambda ids, seed: seen.append(sorted(ids.tolist())) or [])
    deal_step(task, np.arange(8), seed=None, world=2, balance="tokens")
    assert sorted(seen) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # 11 + 2 tokens against 9 + 6
