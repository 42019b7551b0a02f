"""Several training stores in one run (`data.train` as a list, docs/mixtures.md): the mixture's shares, its
invariances (1x8 == 8x1, resume == uninterrupted, two ranks == one rank), a one-entry list == the store itself,
and the per-source metrics summing back to the totals."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import final_weights, metrics_lines, prepare_hh_splits, quiet, run_prefpack, tiny_llama
from invariance_worlds import prepare_splits, ranked_rows, unpaired_rows

from prefpack.batching.mixture import MixtureSchedule, epoch_counts
from prefpack.batching.schedule import StepSchedule
from prefpack.cli import main as cli_main
from prefpack.config import ConfigError, load_config
from prefpack.config.schema import TrainSource
from prefpack.metrics import read_metrics
from prefpack.plot import eval_store_names
from prefpack.training import TrainingInterrupted, train
from prefpack.training.resume_check import store_identity

RUN = ("optim.lr=1.0e-3", "optim.schedule=constant", "train.max_steps=3", "run.plot=false", "run.tensorboard=false",
       "train.micro_batch_tokens=4096", "data.max_tokens_per_row=1024", "train.global_batch_pairs=6",
       "loss.terms=[{name: sigmoid}]")
NAMES = ("hh", "ranked", "few")


@pytest.fixture(scope="module")
def mix(tmp_path_factory, toy_tokenizers, hh_train, one_thread):
    """Three stores of one tokenizer: 16 hh pairs (weight 2), 8 ranked prompts (weight 1), 6 other hh pairs (a
    fixed 2 a epoch), a policy and a different reference."""
    root = tmp_path_factory.mktemp("mixtures")
    tok = toy_tokenizers["llama"]
    pairs = prepare_hh_splits(root, tok, hh_train, {"hh": 16, "few": 6})
    ranked = prepare_splits(root, tok, {"ranked": ranked_rows(hh_train)["train"]})["ranked"]
    train_list = (f"[{{path: {pairs['hh']}, weight: 2}}, {{path: {ranked}, weight: 1}}, "
                  f"{{path: {pairs['few']}, pairs: 2}}]")
    return {"root": root, "policy": tiny_llama(tok, root / "policy", 1), "ref": tiny_llama(tok, root / "ref", 2),
            "hh": pairs["hh"], "few": pairs["few"], "ranked": ranked, "train": train_list}


def _args(w, run_dir, *extra) -> list[str]:
    return [f"model.name_or_path={w['policy']}", f"reference.model={w['ref']}", f"data.train={w['train']}",
            f"run.output_dir={run_dir}", *RUN, *extra]


def _cfg(w, run_dir, *extra):
    return load_config(None, _args(w, run_dir, *extra))


def _same(a, b, *, exact=False, atol=1e-5, keys=("loss", "rewards/margins", *(f"{n}/loss" for n in NAMES)),
          names=NAMES):
    la, lb = metrics_lines(a), metrics_lines(b)
    assert [m["step"] for m in la] == [m["step"] for m in lb]
    for x, y in zip(la, lb):
        assert sorted(x) == sorted(y)  # a source not drawn in a step has only NAME/pairs (0), in both runs
        for k in (*keys, *(f"{n}/pairs" for n in names)):
            if k in x:
                assert (x[k] == y[k]) if exact else x[k] == pytest.approx(y[k], abs=atol), (x["step"], k)
    wa, wb = final_weights(a), final_weights(b)
    for k in wa:
        if exact:
            assert torch.equal(wa[k], wb[k]), k
        else:
            torch.testing.assert_close(wa[k], wb[k], atol=2e-5, rtol=1e-4)
    return la


# ---------------------------------------------------------------- the schedule alone


def test_mixture_shares_follow_weights_and_counts():
    sizes, weights, fixed = [300, 120, 50], [1.0, 2.0, None], [None, None, 40]
    counts = epoch_counts(sizes, weights, fixed)
    assert counts == [140, 280, 40]  # the weighted stores share their 420 examples 1:2; `pairs` is exact
    sched = MixtureSchedule(sizes, counts, 32, seed=5)
    src = sched.source_of(np.concatenate([sched.epoch_order(e) for e in range(3)]))
    assert np.bincount(src).tolist() == [3 * c for c in counts]  # per epoch, exactly
    # within a step the shares follow the weights up to sampling error (hypergeometric draws of 32)
    step_src = sched.source_of(sched.pairs_for_step(4)[1])
    share = np.bincount(step_src, minlength=3) / 32
    assert np.all(np.abs(share - np.array(counts) / sum(counts)) < 4 * np.sqrt(0.25 / 32))
    # a store drawn more or less than its size per epoch goes through all of it before repeating (its stream)
    order = np.concatenate([sched.epoch_order(e) for e in range(5)])  # 5 x 40 draws of 50 pairs: 4 passes
    assert np.bincount(order[sched.source_of(order) == 2] - 420).tolist() == [4] * 50
    # deterministic from the seed, another seed another order; one source is exactly StepSchedule's order
    assert np.array_equal(MixtureSchedule(sizes, counts, 32, seed=5).epoch_order(1), sched.epoch_order(1))
    assert not np.array_equal(MixtureSchedule(sizes, counts, 32, seed=6).epoch_order(1), sched.epoch_order(1))
    one, plain = MixtureSchedule([37], [37], 8, seed=3), StepSchedule(37, 8, 3)
    assert all(np.array_equal(one.pairs_for_step(s)[1], plain.pairs_for_step(s)[1]) for s in range(12))
    # data.shuffle=false: each store in order, spread evenly over the epoch (here 1:2:1)
    ordered = MixtureSchedule([4, 8, 4], [4, 8, 4], 4, seed=0, shuffle=False)
    assert ordered.source_of(ordered.epoch_order(0)).tolist() == [1, 0, 2, 1] * 4
    assert ordered.epoch_order(0)[ordered.source_of(ordered.epoch_order(0)) == 1].tolist() == list(range(4, 12))


def test_mixture_config_errors_name_the_entry():
    base = ["model.name_or_path=m"]
    with pytest.raises(ConfigError, match=r"data.train\[1\] gives both weight and pairs"):
        load_config(None, [*base, "data.train=[{path: a}, {path: b, weight: 1, pairs: 3}]"]).validate()
    with pytest.raises(ConfigError, match=r"data.train\[1\]: the name 'x'"):
        load_config(None, [*base, "data.train=[{path: a/x}, {path: b/x}]"]).validate()
    with pytest.raises(ConfigError, match=r"data.train\[0\].weight must be"):
        load_config(None, [*base, "data.train=[{path: a, weight: 0}]"]).validate()
    with pytest.raises(ConfigError, match=r"unknown key 'data.train\[0\].wieght'"):
        load_config(None, [*base, "data.train=[{path: a, wieght: 2}]"])


# ---------------------------------------------------------------- training on a mixture


@pytest.fixture(scope="module")
def baseline(mix):
    run = mix["root"] / "baseline"
    lines = []  # two stores evaluated before and after training, as eval/few/... and eval/ranked/...
    train(_cfg(mix, run, f"data.eval={{few: {mix['few']}, ranked: {mix['ranked']}}}"), progress=False,
          log=lines.append)
    mix["log"] = lines
    return run


def test_mixture_prints_and_counts_its_sources(mix, baseline):
    text = "\n".join(mix["log"])
    # per epoch: hh and ranked share their 24 examples 2:1 (16, 8), few gives 2
    assert "mixture of 3 store(s): 26 examples per epoch, 5 steps of 6" in text
    assert "hh: 16 pairs per epoch" in text and "ranked: 8 prompt groups per epoch" in text
    assert "few: 2 pairs per epoch" in text
    for m in metrics_lines(baseline):
        pairs = {n: m[f"{n}/pairs"] for n in NAMES}
        # per-source metrics sum back to the totals, weighted by pairs
        assert all(f"{n}/loss" in m for n in NAMES if pairs[n]) and not any(f"{n}/loss" in m for n in NAMES
                                                                            if not pairs[n])
        total = sum(pairs.values())
        assert total > 6  # ranked prompts give several pairs each
        for key in ("loss", "rewards/margins", "rewards/accuracies", "entropy/chosen", "entropy/rejected"):
            got = sum(pairs[n] * m[f"{n}/{key}"] for n in NAMES if pairs[n])
            assert got == pytest.approx(total * m[key], rel=1e-6, abs=1e-9), key


def test_mixture_accumulation_1x8_equals_8x1(mix, baseline, tmp_path):
    many = tmp_path / "many"
    train(_cfg(mix, many, "train.micro_batch_tokens=16", "data.max_tokens_per_row=16"), progress=False, log=quiet)
    _same(baseline, many)


def test_one_entry_list_trains_like_the_store(mix, tmp_path):
    plain, listed = tmp_path / "plain", tmp_path / "listed"
    train(_cfg(mix, plain, f"data.train={mix['hh']}", "train.max_steps=2"), progress=False, log=quiet)
    train(_cfg(mix, listed, f"data.train=[{{path: {mix['hh']}}}]", "train.max_steps=2"), progress=False, log=quiet)
    for x, y in zip(metrics_lines(plain), metrics_lines(listed), strict=True):
        assert x["loss"] == y["loss"] and x["grad_norm"] == y["grad_norm"]
        assert y["hh/pairs"] == 6 and y["hh/loss"] == pytest.approx(y["loss"], rel=1e-12)
    wa, wb = final_weights(plain), final_weights(listed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # a run's data: a one-entry list is its store (a resume may switch between the two), a mixture its own
    assert store_identity([TrainSource(str(mix["hh"]))]) == store_identity(str(mix["hh"]))
    two = [TrainSource(str(mix["hh"])), TrainSource(str(mix["few"]))]
    assert store_identity(two)["store_hash"] not in (store_identity(str(mix["hh"]))["store_hash"],
                                                     store_identity(two[::-1])["store_hash"])


def test_mixture_resume_equals_uninterrupted(mix, tmp_path):
    full, broken = tmp_path / "full", tmp_path / "broken"
    args = ("train.max_steps=4", "run.save_every=2")
    train(_cfg(mix, full, *args), progress=False, log=quiet)
    with pytest.raises(TrainingInterrupted):
        train(_cfg(mix, broken, *args), stop_after_steps=3, progress=False, log=quiet)
    train(_cfg(mix, broken, *args), resume=True, progress=False, log=quiet)
    _same(full, broken, exact=True)


@pytest.fixture(scope="module")
def kto_mix(mix, toy_tokenizers, hh_train):
    """Two unpaired stores (19 and 7 examples) as a KTO mixture: the first by weight, 3 of the second per epoch."""
    data = unpaired_rows(hh_train)
    stores = prepare_splits(mix["root"], toy_tokenizers["llama"], {"ua": data["train"], "ub": data["eval"]},
                             "--format", "unpaired")
    listed = f"[{{path: {stores['ua']}, weight: 1}}, {{path: {stores['ub']}, pairs: 3}}]"
    return {**mix, "train": listed}


KTO = ("loss.terms=[{name: kto}]", "train.global_batch_pairs=5")


def test_kto_mixture_accumulation_1x8_equals_8x1(kto_mix):
    """A KTO mixture: z0 (the KL reference point) and the class counts are the whole step's, over its sources."""
    root = kto_mix["root"]
    train(_cfg(kto_mix, root / "kto-one", *KTO), progress=False, log=quiet)
    train(_cfg(kto_mix, root / "kto-many", *KTO, "train.micro_batch_tokens=16", "data.max_tokens_per_row=16"),
          progress=False, log=quiet)
    lines = _same(root / "kto-one", root / "kto-many", keys=("loss", "kl", "ua/loss", "ub/loss"), names=("ua", "ub"))
    assert any(m["kl"] > 0 for m in lines)
    assert [m["ua/pairs"] + m["ub/pairs"] for m in lines] == [5, 5, 5]


def test_mixture_two_ranks_equal_one_rank(mix, kto_mix):
    """Pair and ranked stores, and a KTO mixture, on two ranks (one torchrun launch) == one process."""
    extra = ("train.max_steps=2", "optim.eps=1.0e-3", "train.micro_batch_tokens=256", "data.max_tokens_per_row=256")
    kto = (*KTO, "train.global_batch_pairs=3", "train.micro_batch_tokens=64", "data.max_tokens_per_row=64")
    root = mix["root"]
    train(_cfg(mix, root / "one-rank", *extra), progress=False, log=quiet)
    train(_cfg(kto_mix, root / "kto-one-rank", *extra, *kto), progress=False, log=quiet)
    run_prefpack(["train", *_args(mix, root / "two-ranks", *extra, "distributed.strategy=ddp"), "--no-progress"],
                 ["train", *_args(kto_mix, root / "kto-two-ranks", *extra, *kto, "distributed.strategy=ddp"),
                  "--no-progress"], nproc=2)
    _same(root / "one-rank", root / "two-ranks", atol=1e-6)
    _same(root / "kto-one-rank", root / "kto-two-ranks", atol=1e-5, keys=("loss", "kl", "ua/loss", "ub/loss"),
          names=("ua", "ub"))


def test_each_eval_store_equals_prefpack_eval_on_it(mix, baseline, capsys):
    before = metrics_lines(baseline, "eval")[0]
    assert before["step"] == 0 and "loss" not in before
    capsys.readouterr()
    assert cli_main(["eval", "--model", str(mix["policy"]), "--ref", str(mix["ref"]), "--data", str(mix["few"]),
                     "--data", str(mix["ranked"]), "--json"]) == 0
    alone = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [r["data"] for r in alone] == [str(mix["few"]), str(mix["ranked"])]
    for name, result in zip(("few", "ranked"), alone):
        for key in ("loss", "rewards/accuracies", "rewards/margins", "logps/chosen"):
            assert before[f"{name}/{key}"] == pytest.approx(result[key], abs=1e-6), (name, key)
    assert eval_store_names(read_metrics(baseline / "metrics.jsonl")) == ["few", "ranked"]


def test_mixture_with_precomputed_references(mix, baseline, tmp_path):
    """Each store keeps its own sidecar: the baseline mixture (a copy reference) trains the same on copies of its
    stores with their reference log-probs precomputed; a store without one is refused by name."""
    stores = {}
    for name in NAMES:
        stores[name] = shutil.copytree(mix[name], tmp_path / name)
        with contextlib.redirect_stdout(io.StringIO()):
            assert cli_main(["precompute-ref", "--model", str(mix["ref"]), "--data", str(stores[name])]) == 0
    listed = (f"data.train=[{{path: {stores['hh']}, weight: 2}}, {{path: {stores['ranked']}, weight: 1}}, "
              f"{{path: {stores['few']}, pairs: 2}}]")
    train(_cfg(mix, tmp_path / "run", listed, "reference.mode=precomputed"), progress=False, log=quiet)
    for x, y in zip(metrics_lines(baseline), metrics_lines(tmp_path / "run"), strict=True):
        assert sorted(x) == sorted(y)
        for k in ("loss", "rewards/margins", *(f"{n}/loss" for n in NAMES)):
            if k in x:
                assert x[k] == pytest.approx(y[k], abs=1e-6), (x["step"], k)
    (stores["few"] / "ref_logps.safetensors").unlink()
    with pytest.raises(Exception, match=f"precompute-ref --model REF --data {stores['few']}"):
        train(_cfg(mix, tmp_path / "again", listed, "reference.mode=precomputed"), progress=False, log=quiet)


def test_mixture_stores_share_a_tokenizer(mix, toy_tokenizers, hh_train, tmp_path):
    other = prepare_hh_splits(tmp_path, toy_tokenizers["neox"], hh_train, {"neox": 4})["neox"]
    listed = f"data.train=[{{path: {mix['hh']}}}, {{path: {other}}}]"
    with pytest.raises(Exception, match=r"data.train\[1\]: store .*neox.* was prepared with another tokenizer than "
                                        r"data.train\[0\]"):
        train(_cfg(mix, tmp_path / "run", listed), progress=False, log=quiet)
