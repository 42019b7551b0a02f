"""The one sidecar format (reference sums by sequence key, version 2), and the version-1 sidecars it replaced: a
pair, KTO and ranked sidecar written before still reads as the same keyed table, and every mismatch is refused by
name with the command that fixes it. The tables here are random numbers: what is checked is where each lands."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from conftest import make_task, write_jsonl

from prefpack.config import load_config
from prefpack.data.prepare import PrepareOptions, prepare
from prefpack.data.store import Store
from prefpack.objectives import KTOTask, PairTask
from prefpack.objectives.groups import PromptGroupTask
from prefpack.reference import (
    KeyedLogps,
    PrecomputedReference,
    ReferenceMismatch,
    read_keyed_sidecar,
    sidecar_path,
    store_hash,
    write_keyed_sidecar,
)


@pytest.fixture(scope="module")
def stores(tmp_path_factory, toy_tokenizers, hh_train):
    root = tmp_path_factory.mktemp("sidecar")
    rows = [r for r in hh_train[:30] if r["chosen"].strip() and r["rejected"].strip() and r["chosen"] != r["rejected"]]
    rows = [{"prompt": f"Q{k}:{r['prompt'][-40:]}", "chosen": r["chosen"][:40], "rejected": r["rejected"][:40]}
            for k, r in enumerate(rows[:6])]
    unpaired = [{"prompt": r["prompt"], "completion": r["chosen"], "label": k % 3 != 0} for k, r in enumerate(rows)]
    ranked = [{"prompt": r["prompt"], "completions": [{"text": r["chosen"], "score": 2},
                                                      {"text": r["rejected"], "score": 1 if k else 2}]}
              for k, r in enumerate(rows[:4])]  # the first prompt's scores tie: it yields no pair
    out = {}
    for name, part, fmt in (("pairs", rows, []), ("unpaired", unpaired, ["unpaired"]), ("ranked", ranked, ["ranked"])):
        prepare(PrepareOptions(inputs=[str(write_jsonl(root / f"{name}.jsonl", part))],
                               tokenizer=str(toy_tokenizers["llama"]), output=str(root / name), workers=1,
                               layout=fmt[0] if fmt else None), log=lambda m: None)
        out[name] = Store(root / name)
    out["root"] = root
    return out


def _task(kind, store, *extra):
    cls = {"pairs": PairTask, "unpaired": KTOTask, "ranked": PromptGroupTask}[kind]
    terms = "loss.terms=[{name: kto}]" if kind == "unpaired" else "loss.terms=[{name: sigmoid}]"
    return make_task(cls, store, load_config(None, [terms, "loss.kl_pairing=fixed", *extra]))


def _write_v1(path, tensors: dict, meta: dict) -> None:
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata=meta)


def _v1(kind: str, store: Store, table: np.ndarray, task) -> tuple[dict, dict]:
    """A version-1 sidecar of ``table`` as prefpack wrote it before sequence keys (one layout per store kind)."""
    meta = {"format": "prefpack-ref-logps", "version": "1", "store_hash": store_hash(store), "reference_hash": "w",
            "reference": "ref"}
    n = len(store)
    if kind == "pairs":
        return {"chosen": table[0::2], "rejected": table[1::2], "chosen_tail": -table[0::2],
                "rejected_tail": -table[1::2]}, meta
    if kind == "ranked":
        return {"completion": table}, {**meta, "kind": "ranked"}
    return ({"completion": table[:n], "kl": table[n:], "kl_partner": task.fixed_partners()},
            {**meta, "kind": "unpaired", "view": "unpaired", "kl_seed": "0", "examples": str(n)})


@pytest.mark.parametrize("kind", ["pairs", "unpaired", "ranked"])
def test_a_version_1_sidecar_reads_as_the_keyed_table_it_holds(stores, kind, tmp_path):
    store = Store(shutil.copytree(stores[kind].path, tmp_path / kind))
    task = _task(kind, store)
    space = task.key_space()
    table = np.random.default_rng(0).normal(size=space.size)
    tensors, meta = _v1(kind, store, table, task)
    _write_v1(sidecar_path(store, space), tensors, meta)
    got = read_keyed_sidecar(store, space, reference_hash="w", need_tails=kind == "pairs")
    np.testing.assert_array_equal(got.logps, table)
    if kind == "pairs":
        np.testing.assert_array_equal(got.tails, -table)
    # the same table written as version 2 reads back the same
    write_keyed_sidecar(store, space, got, reference_hash="w", reference_name="ref")
    again = read_keyed_sidecar(store, space, reference_hash="w")
    np.testing.assert_array_equal(again.logps, table)
    with pytest.raises(ReferenceMismatch, match="other reference weights"):
        read_keyed_sidecar(store, space, reference_hash="other")


def test_kto_sidecars_are_refused_for_another_pairing_or_view(stores, tmp_path):
    store = Store(shutil.copytree(stores["unpaired"].path, tmp_path / "u"))
    task = _task("unpaired", store)
    space = task.key_space()
    table = np.random.default_rng(1).normal(size=space.size)
    for version in (1, 2):
        if version == 1:
            _write_v1(sidecar_path(store, space), *_v1("unpaired", store, table, task))
        else:
            write_keyed_sidecar(store, space, KeyedLogps(table), reference_hash="w", reference_name="ref")
        np.testing.assert_array_equal(read_keyed_sidecar(store, space, reference_hash=None).logps, table)
        other = _task("unpaired", store, "train.seed=5").key_space()
        with pytest.raises(ReferenceMismatch, match=r"pairing of seed 0.*--seed 5"):
            read_keyed_sidecar(store, other, reference_hash=None)
        # apo_zero_unpaired reads no KL sequence: any pairing's sidecar serves it
        apo = make_task(KTOTask, store, load_config(None, ["loss.terms=[{name: apo_zero_unpaired}]",
                                                           "train.seed=5"])).key_space()
        np.testing.assert_array_equal(read_keyed_sidecar(store, apo, reference_hash=None).logps, table)


def test_version_2_refusals_name_the_fix(stores, tmp_path):
    store = Store(shutil.copytree(stores["pairs"].path, tmp_path / "p"))
    space = _task("pairs", store).key_space()
    with pytest.raises(ReferenceMismatch, match=f"precompute-ref --model REF --data {store.path}"):
        read_keyed_sidecar(store, space, reference_hash=None)  # none yet
    table = np.random.default_rng(2).normal(size=space.size)
    write_keyed_sidecar(store, space, KeyedLogps(table), reference_hash="w", reference_name="ref")
    with pytest.raises(ReferenceMismatch, match="ld_alpha.*precompute-ref again"):
        read_keyed_sidecar(store, space, reference_hash=None, need_tails=True)  # written without tails
    # another store's sidecar, a truncated file and another kind's file are refused
    other = Store(shutil.copytree(stores["unpaired"].path, tmp_path / "u"))
    shutil.copy(sidecar_path(store, space), other.path / "ref_logps_kto.safetensors")
    kto_space = _task("unpaired", other).key_space()
    with pytest.raises(ReferenceMismatch, match="not a prefpack KTO reference sidecar"):
        read_keyed_sidecar(other, kto_space, reference_hash=None)
    path = sidecar_path(store, space)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ReferenceMismatch, match="cannot read"):
        read_keyed_sidecar(store, space, reference_hash=None)


def test_a_key_that_was_not_scored_is_refused_when_read(stores, tmp_path):
    """A ranked prompt whose scores all tie yields no pair: its rows hold NaN, which a batch never reads; a
    batch that did would be refused rather than trained on NaN."""
    store = Store(shutil.copytree(stores["ranked"].path, tmp_path / "r"))
    task = _task("ranked", store)
    space = task.key_space()
    assert len(task) == 3 and space.size == 8
    table = np.random.default_rng(3).normal(size=space.size)
    table[:2] = np.nan  # the first prompt's two completions
    write_keyed_sidecar(store, space, KeyedLogps(table), reference_hash="w", reference_name="ref")
    reference = PrecomputedReference()
    reference.load(store, space)
    batch = task.collate(task.plan(np.arange(len(task)), seed=None)[0])
    got = reference.sequence_logps(batch).logp_sum
    torch.testing.assert_close(got, torch.as_tensor(table[batch.sequence_keys.numpy()]))
    batch.sequence_keys = torch.tensor([0, 2])
    with pytest.raises(ReferenceMismatch, match="no reference log-probs for some sequences"):
        reference.sequence_logps(batch)
