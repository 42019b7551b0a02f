"""Reward models (issue 39, items 1-3): `train.objective=reward` trains a one-label sequence classifier by the
Bradley-Terry loss on prefpack's packed layouts, reads each completion's reward at its last scored token, and saves a
folder transformers loads as `AutoModelForSequenceClassification`.

Checked against: the loss written out in float64; the classifier run by transformers on each sequence alone; the
same pairs in every layout (packed, padded, flattened, prompt laid out once or repeated, a ranked store's prompt
groups); TRL 1.16's RewardTrainer on the same weights and pairs (tests/data/trl_reward.json, recorded by
benchmarks/trl_reward.py); an uninterrupted run (resume); the exported folder scoring a padded batch."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import final_weights, log_sigmoid, metrics_lines, quiet, write_jsonl

from prefpack.batching.collate import collate_groups
from prefpack.config import load_config
from prefpack.data.prepare import PrepareOptions, prepare
from prefpack.data.spans import ScoredTokens
from prefpack.data.store import Store
from prefpack.losses.reward import bradley_terry_loss
from prefpack.model.reward import sequence_rewards
from prefpack.objectives import StepTotals

DATA = Path(__file__).resolve().parent / "data"
TRL = json.loads((DATA / "trl_reward.json").read_text(encoding="utf-8"))
TRL_ASSETS = DATA / "trl_losses"  # tokenizer, the causal LM and the 16 pairs the TRL record was made on


def float64_classifier(seed: int = 0, vocab: int = 50):
    """A 2-layer float64 Llama reward model (one label) on the packed_sdpa kernel, in eval mode."""
    import transformers as tf

    from prefpack.model.attention.packed_sdpa import register

    register()
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1, initializer_range=0.5)
    cfg._attn_implementation = "packed_sdpa"
    torch.manual_seed(seed)
    return tf.LlamaForSequenceClassification(cfg).double().eval()


def alone(model, prompt, completion, scored=None) -> float:
    """The classifier's own reward of ``prompt + completion`` run alone, cut after its last scored token."""
    keep = len(completion) if scored is None else int(np.flatnonzero(scored)[-1]) + 1
    ids = torch.tensor([[*map(int, prompt), *map(int, completion[:keep])]])
    with torch.no_grad():
        return float(model(input_ids=ids, use_cache=False).logits[0, 0])


def test_bradley_terry_loss_and_its_metrics_equal_the_formula():
    g = torch.Generator().manual_seed(0)
    c, r, m = (torch.randn(7, generator=g, dtype=torch.float64) * 3 for _ in range(3))
    out = bradley_terry_loss(c, r, margin=m, center_rewards_coefficient=0.05)
    for i in range(7):
        want = -log_sigmoid(float(c[i] - r[i] - m[i])) + 0.05 * float(c[i] + r[i]) ** 2
        assert abs(float(out.loss[i]) - want) < 1e-12
    assert torch.equal(bradley_terry_loss(c, r).loss, -torch.nn.functional.logsigmoid(c - r))
    totals = StepTotals()
    totals.examples, totals.loss = 7, float(out.loss.sum())
    for k, v in out.metrics.items():
        totals.metrics[k], totals.counts[k] = float(v.sum()), float(v.numel())
    means = totals.means()
    assert means["rewards/accuracies"] == pytest.approx(float((c > r).double().mean()), abs=1e-12)
    assert means["rewards/margins"] == pytest.approx(float((c - r).mean()), abs=1e-12)
    assert means["rewards/chosen_std"] == pytest.approx(float(c.std(unbiased=False)), abs=1e-12)
    assert means["rewards/rejected_std"] == pytest.approx(float(r.std(unbiased=False)), abs=1e-12)
    assert not any(k.endswith("^2") for k in means)


def _groups():
    """Three prompt groups of random ids: a completion whose last tokens are unscored (a masked tail), and a
    one-token later completion (read at the first token of its own block when the prompt is laid out once)."""
    g = np.random.default_rng(0)

    def ids(n):
        return g.integers(3, 50, n)

    tail = ScoredTokens(ids(6), np.array([1, 0, 1, 1, 0, 0], bool))
    return [(ids(5), (ids(4), tail, ids(1))), (ids(3), (ids(2), ids(7))), (ids(6), (ids(1), ids(3), ids(5)))]


@pytest.mark.parametrize("layout", ["packed", "shared", "padded", "flattened"])
def test_rewards_equal_the_classifier_on_each_sequence_alone(layout):
    model = float64_classifier()
    groups = _groups()
    rows = None if layout == "padded" else [[0, 1], [2]]
    batch = collate_groups(groups, rows, ids=[0, 1, 2], share_prompts=layout == "shared")
    with torch.no_grad():
        got = sequence_rewards(model, batch, flatten=layout == "flattened")
    want = [alone(model, p, c, getattr(c, "scored", None)) for p, cs in groups for c in cs]
    assert got.shape == (8,)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-10)


RANKED = [
    {"prompt": "Human: What is two plus two? Assistant:",
     "completions": [{"text": " Four.", "score": 9}, {"text": " Five, I think.", "score": 2},
                     {"text": " It is four, because two and two make four.", "score": 8.5}]},
    {"prompt": "Human: Name a colour. Assistant:", "completions": [{"text": " Blue.", "rank": 1},
                                                                   {"text": " A dog.", "rank": 2}]},
    {"prompt": "Human: Hi there, how are you today? Assistant:",
     "completions": [{"text": " Hello!", "score": 5}, {"text": " Hey.", "score": 5}, {"text": " Go away.", "score": 1},
                     {"text": " Hi! I am well, thank you.", "score": 7}]},
]


def test_ranked_store_all_pairs_prompts_once_equal_prompts_repeated(tmp_path, toy_tokenizers):
    """A reward run's ranked store: every pair of each ranking (ties give none), each completion's reward from one
    forward whatever the layout, the loss the Bradley-Terry formula over rewards computed alone."""
    from conftest import make_task

    from prefpack.model.reward import SequenceRewards
    from prefpack.objectives.base import Planned
    from prefpack.objectives.reward import RewardGroupTask
    from prefpack.reference import NoReference

    tok = toy_tokenizers["neox"]
    prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "r.jsonl", RANKED))], tokenizer=str(tok),
                           output=str(tmp_path / "ranked"), workers=1), log=quiet)
    store = Store(tmp_path / "ranked")
    model = float64_classifier(vocab=600)
    module = SequenceRewards(model)
    outs = {}
    for name, extra in {"shared": ["data.prefix_sharing=true"], "repeated": ["data.prefix_sharing=false"],
                        "padded": ["data.packing=false", "data.prefix_sharing=false"]}.items():
        cfg = load_config(None, ["train.objective=reward", "loss.center_rewards_coefficient=0.1", *extra])
        task = make_task(RewardGroupTask, store, cfg)
        rows = [[0, 1], [2]] if cfg.data.packing else [[0], [1], [2]]
        with torch.no_grad():
            outs[name] = task.loss(module, NoReference(), task.collate(Planned(rows, 0, 0)), None).loss
    assert task.settings.ranked_pairs == "all_pairs" and len(outs["shared"]) == 3 + 1 + 5  # 3 + 1 + (6 - 1 tie)
    np.testing.assert_allclose(outs["shared"].numpy(), outs["repeated"].numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(outs["shared"].numpy(), outs["padded"].numpy(), rtol=0, atol=1e-12)
    want = []
    for g in range(3):
        prompt, comps = store.ranked_group(g)
        scores = store.scores()[store.group_starts()[g]:][:len(comps)]
        r = [alone(model, prompt, c) for c in comps]
        want += [-log_sigmoid(r[i] - r[j]) + 0.1 * (r[i] + r[j]) ** 2 for i in range(len(r)) for j in range(len(r))
                 if scores[i] > scores[j]]
    assert sorted(outs["shared"].tolist()) == pytest.approx(sorted(want), abs=1e-10)


# ---------------------------------------------------------------- TRL 1.16, training, export, resume


@pytest.fixture(scope="module")
def trl_store(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl_reward") / "store"
    prepare(PrepareOptions(inputs=[str(TRL_ASSETS / "pairs.jsonl")], tokenizer=str(TRL_ASSETS / "tokenizer"),
                           output=str(out), max_length=512, workers=1), log=quiet)
    store = Store(out)
    ids = [[[*map(int, p), *map(int, c)], [*map(int, p), *map(int, r)]] for p, c, r in map(store.pair, range(16))]
    assert ids == TRL["token_ids"]  # TRL scored exactly the store's tokens
    return out


def _reward_cfg(run_dir, store, *extra):
    return load_config(None, [f"model.name_or_path={TRL_ASSETS / 'reference'}", f"data.train={store}",
                              f"data.eval={store}", "train.objective=reward", "train.global_batch_pairs=16",
                              f"optim.lr={TRL['lr']}", "optim.schedule=constant", "optim.max_grad_norm=null",
                              "train.seed=0", "run.plot=false", "run.report_to=none", f"run.output_dir={run_dir}",
                              "run.save_every=0", *extra])


def _trl_case(**case):
    return next(c for c in TRL["cases"] if c["case"] == case)


@pytest.mark.parametrize("center", [None, 0.05])
def test_training_and_export_equal_trl_reward_trainer(trl_store, tmp_path, one_thread, center):
    """One step from TRL's starting weights (the causal LM with a new head, seeded as TRL seeds it): eval before
    and the step's loss equal TRL's, the saved folder is a one-label classifier with a pad token whose rewards are
    TRL's after its step, a padded batch of 4 scores as one by one, and `prefpack eval` on it gives the run's
    final evaluation."""
    from transformers import AutoModelForSequenceClassification

    from prefpack.training import train
    from prefpack.training.scoring import EvalOptions, score_store

    rec = _trl_case(**({} if center is None else {"center_rewards_coefficient": center}))
    extra = [] if center is None else [f"loss.center_rewards_coefficient={center}"]
    res = train(_reward_cfg(tmp_path / "run", trl_store, "train.max_steps=1", *extra), progress=False, log=quiet)
    before, step = res.eval_before, metrics_lines(res.run_dir)[0]
    assert before["loss"] == pytest.approx(rec["eval"]["eval_loss"], abs=1e-5)
    assert step["loss"] == pytest.approx(rec["eval"]["eval_loss"], abs=1e-5)  # the step's pairs are the eval pairs
    assert before["rewards/accuracies"] == rec["eval"]["eval_accuracy"]
    assert before["rewards/margins"] == pytest.approx(rec["eval"]["eval_margin"], abs=1e-5)
    rb = rec["rewards_before"]
    assert before["rewards/chosen"] == pytest.approx(np.mean(rb["chosen"]), abs=1e-5)
    assert before["rewards/rejected_std"] == pytest.approx(np.std(rb["rejected"]), abs=1e-5)

    final = AutoModelForSequenceClassification.from_pretrained(res.final_dir).eval()
    assert final.config.num_labels == 1 and final.config.pad_token_id == rec["pad_token_id"]
    assert (res.final_dir / "tokenizer_config.json").is_file()
    seqs = [s for pair in TRL["token_ids"] for s in pair]
    with torch.no_grad():
        one_by_one = [float(final(input_ids=torch.tensor([s])).logits[0, 0]) for s in seqs]
        four = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))[::9][:4]  # four different lengths
        longest = max(len(seqs[i]) for i in four)
        padded = torch.tensor([seqs[i] + [rec["pad_token_id"]] * (longest - len(seqs[i])) for i in four])
        batch = final(input_ids=padded, attention_mask=(padded != rec["pad_token_id"]).long()).logits[:, 0]
    assert len({len(seqs[i]) for i in four}) == 4
    np.testing.assert_allclose(batch.numpy(), [one_by_one[i] for i in four], rtol=0, atol=1e-5)
    after = rec["rewards_after_one_step"]
    np.testing.assert_allclose(one_by_one[0::2], after["chosen"], rtol=0, atol=5e-5)
    np.testing.assert_allclose(one_by_one[1::2], after["rejected"], rtol=0, atol=5e-5)
    assert res.eval_after["rewards/chosen"] == pytest.approx(np.mean(one_by_one[0::2]), abs=1e-5)

    scored = score_store(EvalOptions(model=str(res.final_dir), data=str(trl_store), device="cpu"), log=quiet)
    for key in ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen_std") if center is None else ():
        assert scored[key] == pytest.approx(res.eval_after[key], abs=1e-6), key


def test_trl_margin_column_formula_on_prefpack_rewards(trl_store, tmp_path):
    """TRL's per-pair `margin` column (and with centring): its loss over prefpack's rewards of TRL's weights, loaded
    as a run loads them (the new head initialised as TRL's after the same seed); and the reward objective on the
    same pairs prepared with their `margin` field (margins.bin) gives TRL's loss."""
    from conftest import make_task

    from prefpack.model.load import load_causal_lm
    from prefpack.model.reward import SequenceRewards
    from prefpack.objectives.base import Planned
    from prefpack.objectives.reward import RewardPairTask

    torch.manual_seed(TRL["seed"])
    model = load_causal_lm(str(TRL_ASSETS / "reference"), attn_implementation="packed_sdpa",
                           device=torch.device("cpu"), reward=True).eval()
    assert torch.equal(model.score.weight.reshape(-1), torch.tensor(TRL["cases"][0]["score_weight"]))  # TRL's init
    task = make_task(RewardPairTask, Store(trl_store), load_config(None, ["train.objective=reward"]))
    with torch.no_grad():
        rewards = SequenceRewards(model)(task.collate(Planned([list(range(16))], 0, 0)))
    np.testing.assert_allclose(rewards[0::2].numpy(), TRL["cases"][0]["rewards_before"]["chosen"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(rewards[1::2].numpy(), TRL["cases"][0]["rewards_before"]["rejected"], rtol=0, atol=1e-5)
    margin = torch.tensor(TRL["margins"], dtype=torch.float32)
    for center in (None, 0.05):
        rec = _trl_case(margin=True, **({} if center is None else {"center_rewards_coefficient": center}))
        out = bradley_terry_loss(rewards[0::2], rewards[1::2], margin=margin, center_rewards_coefficient=center)
        assert float(out.loss.mean()) == pytest.approx(rec["eval"]["eval_loss"], abs=1e-5)
    rows = [{**json.loads(line), "margin": m} for line, m in
            zip((TRL_ASSETS / "pairs.jsonl").read_text(encoding="utf-8").splitlines(), TRL["margins"])]
    prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "m.jsonl", rows))], tokenizer=str(TRL_ASSETS /
                           "tokenizer"), output=str(tmp_path / "m"), max_length=512, workers=1), log=quiet)
    task = make_task(RewardPairTask, Store(tmp_path / "m"), load_config(None, ["train.objective=reward"]))
    with torch.no_grad():
        out = task.loss(SequenceRewards(model), None, task.collate(Planned([list(range(16))], 0, 0)), None)
    assert float(out.loss.mean()) == pytest.approx(_trl_case(margin=True)["eval"]["eval_loss"], abs=1e-5)
    from prefpack.training.setup import build  # a DPO run on the same store is told its margins are not read

    said: list[str] = []
    build(load_config(None, [f"model.name_or_path={TRL_ASSETS / 'reference'}", f"data.train={tmp_path / 'm'}",
                             "data.eval=null", "run.report_to=none", f"run.output_dir={tmp_path / 'run'}"]),
          log=said.append)
    assert any(line.startswith(f"note: {tmp_path / 'm'} gives 16 pairs a margin") and "ignore it" in line
               for line in said), said


def test_lora_reward_resume_equals_uninterrupted_and_exports_merged(trl_store, tmp_path, one_thread):
    from transformers import AutoModelForSequenceClassification

    from prefpack.training import TrainingInterrupted, train

    args = ("train.max_steps=2", "run.save_every=1", "lora.enabled=true", "lora.r=4", "train.global_batch_pairs=4",
            "data.eval=null", "optim.lr=1e-2")
    full, broken = tmp_path / "full", tmp_path / "broken"
    train(_reward_cfg(full, trl_store, *args), progress=False, log=quiet)
    with pytest.raises(TrainingInterrupted):
        train(_reward_cfg(broken, trl_store, *args), stop_after_steps=1, progress=False, log=quiet)
    train(_reward_cfg(broken, trl_store, *args), resume=True, progress=False, log=quiet)
    wa, wb = final_weights(full), final_weights(broken)
    assert sorted(wa) == sorted(wb) and not any("lora" in k for k in wa)  # merged
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert [m["loss"] for m in metrics_lines(full)] == [m["loss"] for m in metrics_lines(broken)]
    model = AutoModelForSequenceClassification.from_pretrained(full / "final")
    initial = torch.tensor(TRL["cases"][0]["score_weight"])
    assert not torch.allclose(model.score.weight.reshape(-1), initial)  # the new head trained (modules_to_save)
    assert math.isfinite(metrics_lines(full)[-1]["loss"])


# ---------------------------------------------------------------- the per-pair margin column (margins.bin)

MARGIN_PAIRS = [  # two prompts shared by two pairs each (data.group_by_prompt groups them), one row with no margin
    {"prompt": "Q: two plus two?\nA:", "chosen": " Four.", "rejected": " Five.", "margin": 0.75},
    {"prompt": "Q: two plus two?\nA:", "chosen": " It is four.", "rejected": " Five.", "margin": -1.5},
    {"prompt": "Q: a colour?\nA:", "chosen": " Blue.", "rejected": " A dog.", "margin": 2},
    {"prompt": "Q: a colour?\nA:", "chosen": " Red.", "rejected": " A dog."},
    {"prompt": "Q: hello?\nA:", "chosen": " Hi!", "rejected": " Go away.", "margin": 0.25},
]


def test_a_margin_column_is_stored_and_the_reward_loss_reads_it(tmp_path, toy_tokenizers, capsys):
    """prepare stores each pair's `margin` (0 where a row has none; --margin-field renames it) in a version-4 store;
    the reward objective's per-pair loss is -logsigmoid(r_c - r_r - margin) (+ centring) over rewards of each
    sequence alone, in float64, pairs read alone or grouped by prompt; the same rows without margins make a store as
    before (version 2, no margins.bin) that trains with margin 0; a bad margin names its row and field."""
    from conftest import make_task

    from prefpack.data.prepare import PrepareError
    from prefpack.model.reward import SequenceRewards
    from prefpack.objectives.base import Planned
    from prefpack.objectives.reward import RewardGroupTask, RewardPairTask
    from prefpack.reference import NoReference

    tok = str(toy_tokenizers["neox"])
    renamed = [{("gap" if k == "margin" else k): v for k, v in r.items()} for r in MARGIN_PAIRS]
    prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "m.jsonl", renamed))], tokenizer=tok,
                           output=str(tmp_path / "margins"), fields={"margin": "gap"}, workers=1), log=quiet)
    plain = [{k: v for k, v in r.items() if k != "margin"} for r in MARGIN_PAIRS]
    prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "p.jsonl", plain))], tokenizer=tok,
                           output=str(tmp_path / "plain"), workers=1), log=quiet)
    with_m, without = Store(tmp_path / "margins", verify=True), Store(tmp_path / "plain", verify=True)
    want_m = [float(r.get("margin", 0.0)) for r in MARGIN_PAIRS]
    assert with_m.meta["format_version"] == 4 and with_m.meta["num_margins"] == 4
    assert with_m.margins.dtype == np.float64 and with_m.margins.tolist() == want_m
    assert without.meta["format_version"] == 2 and without.margins is None
    assert not (tmp_path / "plain" / "margins.bin").exists()
    from prefpack.cli import main

    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "margins")]) == 0
    assert "margins    4 of 5 pairs give one (the others 0): min -1.5, mean 0.3, max 2" in capsys.readouterr().out

    model = float64_classifier(vocab=600)
    module = SequenceRewards(model)
    for store, margins in ((with_m, want_m), (without, [0.0] * 5)):
        r = [[alone(model, p, c) for c in (c, rj)] for p, c, rj in map(store.pair, range(len(store)))]
        want = [-log_sigmoid(rc - rr - m) + 0.1 * (rc + rr) ** 2 for (rc, rr), m in zip(r, margins)]
        for cls, extra in ((RewardPairTask, []), (RewardGroupTask, ["data.group_by_prompt=true"])):
            cfg = load_config(None, ["train.objective=reward", "loss.center_rewards_coefficient=0.1", *extra])
            task = make_task(cls, store, cfg)
            examples = list(range(len(task)))
            with torch.no_grad():
                out = task.loss(module, NoReference(), task.collate(Planned([examples], 0, 0)), None)
            drawn = [row for i in examples for row in task.view.pair_rows[i]] if cls is RewardGroupTask else examples
            assert len(task) == (3 if cls is RewardGroupTask else 5)
            np.testing.assert_allclose(out.loss.numpy(), [want[i] for i in drawn], rtol=0, atol=1e-10)
            assert ("rewards/target_margin" in out.metrics) == (store is with_m)

    bad = [*MARGIN_PAIRS[:2], {**MARGIN_PAIRS[2], "margin": "wide"}]
    with pytest.raises(PrepareError, match=r"bad.jsonl line 3, field 'margin': field 'margin' must be a finite number"):
        prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "bad.jsonl", bad))], tokenizer=tok,
                               output=str(tmp_path / "bad"), workers=1), log=quiet)


def test_a_margin_field_no_row_holds_is_named(tmp_path, toy_tokenizers):
    """Issue 50: --margin-field nosuchfield wrote a plain store and said nothing; the report names the field."""
    plain = [{k: v for k, v in r.items() if k != "margin"} for r in MARGIN_PAIRS]
    report = prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "p.jsonl", plain))],
                                    tokenizer=str(toy_tokenizers["neox"]), output=str(tmp_path / "s"),
                                    fields={"margin": "nosuchfield"}, workers=1), log=quiet)
    text = report.summary()
    assert "warning: --margin-field 'nosuchfield': no row holds it" in text
    assert Store(tmp_path / "s").margins is None
