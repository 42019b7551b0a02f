"""precompute-ref with prompts laid out once (issue 13, item 5), and the progress bar's saving (item 3).

A kernel that reads prompt groups (packed_sdpa on CPU) scores each pair after one copy of its prompt. The sidecar's
values (chosen, rejected and their LD-DPO tails) must equal each sequence scored alone by the model's own forward
(``log_softmax(model(prompt + completion).logits)``), in float64 through the library call and in float32 through
the CLI.
"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
import torch
from conftest import prepare_hh_splits, tiny_llama

from prefpack.data.store import Store


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_tokenizers, hh_train):
    root = tmp_path_factory.mktemp("scoring_shared")
    stores = prepare_hh_splits(root, toy_tokenizers["llama"], hh_train, {"train": 10})
    return {"root": root, "store": stores["train"], "model": tiny_llama(toy_tokenizers["llama"], root / "model", 0)}


def _load(path, attn: str, dtype=torch.float64):
    import transformers as tf

    from prefpack.model.attention.packed_sdpa import register

    register()
    return tf.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=dtype).eval()


@torch.no_grad()
def _alone(model, store: Store) -> dict[str, np.ndarray]:
    """Each pair's chosen and rejected completion scored alone, after its own copy of the prompt, by the model's
    full forward; tails: the tokens past the shorter completion's length."""
    out = {k: np.zeros(len(store)) for k in ("chosen", "rejected", "chosen_tail", "rejected_tail")}
    for i in range(len(store)):
        pair = store.pair(i)
        prompt = torch.tensor(pair.prompt, dtype=torch.long)  # a copy: the store is read-only
        shorter = min(len(pair.chosen), len(pair.rejected))
        for key in ("chosen", "rejected"):
            completion = torch.tensor(getattr(pair, key), dtype=torch.long)
            ids = torch.cat([prompt, completion])[None]
            logp = model(input_ids=ids, use_cache=False).logits[0, :-1].double().log_softmax(-1)
            per_token = logp.gather(-1, ids[0, 1:, None])[:, 0][prompt.numel() - 1:]
            out[key][i] = float(per_token.sum())
            out[f"{key}_tail"][i] = float(per_token[shorter:].sum())
    return out


@pytest.fixture
def scored(monkeypatch):
    """(prompt-shared?, positions, real tokens) of every micro-batch precompute-ref's reference runs (its objective
    lays a pair store out pair by pair or, for a store whose pairs repeat prompts, by prompt group)."""
    from prefpack.reference import CopyReference

    seen = []
    outputs = CopyReference.outputs

    def recording(self, batch):
        seen.append((batch.score_positions is not None, batch.positions, batch.real_tokens))
        return outputs(self, batch)

    monkeypatch.setattr(CopyReference, "outputs", recording)
    return seen


def _by_side(table) -> dict[str, np.ndarray]:
    return {"chosen": table.logps[0::2], "rejected": table.logps[1::2], "chosen_tail": table.tails[0::2],
            "rejected_tail": table.tails[1::2]}


def test_store_scored_with_shared_prompts_equals_each_sequence_alone(world, scored, one_thread):
    from conftest import reference_table

    store = Store(world["store"])
    model = _load(world["model"], "packed_sdpa")
    got = _by_side(reference_table(model, store, micro_batch_tokens=160, row_tokens=80, chunk_size=7))
    lengths = store.index[:, 1:4].astype(int)
    assert len(scored) > 1 and all(shared for shared, _, _ in scored)  # several micro-batches, every one shared
    assert sum(p for _, p, _ in scored) == int(lengths.sum())  # each prompt laid out once
    assert sum(t for _, _, t in scored) == int(lengths.sum() + lengths[:, 0].sum())
    want = _alone(model, store)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-10, err_msg=key)
    assert (want["chosen_tail"] != 0).any() or (want["rejected_tail"] != 0).any()  # the tails are exercised


def test_precompute_ref_cli_writes_the_shared_scores(world, tmp_path, scored, one_thread):
    import shutil

    from prefpack.cli import main as cli_main
    from prefpack.reference import KeySpace, read_keyed_sidecar

    store_dir = tmp_path / "store"
    shutil.copytree(world["store"], store_dir)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["precompute-ref", "--model", str(world["model"]), "--data", str(store_dir),
                         "--device", "cpu"]) == 0
    printed = json.loads(out.getvalue().strip().splitlines()[-1])
    assert printed["rows"] == 10 and printed["sequences"] == 20 and printed["kind"] == "pairs"
    assert scored and all(shared for shared, _, _ in scored)  # packed_sdpa, the CPU default, reads prompt groups
    store = Store(store_dir)
    got = _by_side(read_keyed_sidecar(store, KeySpace("pairs", 20, tails=True), reference_hash=None))
    want = _alone(_load(world["model"], "sdpa"), store)  # float64, no prompt groups: an independent computation
    for key, values in got.items():
        np.testing.assert_allclose(np.asarray(values, dtype=np.float64), want[key], rtol=1e-6, atol=2e-5,
                                   err_msg=key)


def _train(world, tmp_path, name, *extra):
    from prefpack.config import load_config
    from prefpack.training import train

    cfg = load_config(None, [f"model.name_or_path={world['model']}", f"data.train={world['store']}",
                             "train.global_batch_pairs=4", "train.max_steps=2", "train.device=cpu",
                             f"run.output_dir={tmp_path / name}", "run.plot=false", "run.tensorboard=false", *extra])
    train(cfg, progress=True, log=lambda m: None)
    return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("terminal", [True, False], ids=["bar", "log-lines"])
def test_progress_shows_the_positions_saved_only_when_sharing(world, tmp_path, capsys, one_thread, monkeypatch,
                                                              terminal):
    """On a terminal the bar's postfix says ``saved=9%``; off one (a batch job's log) each plain line says
    ``saved 9%``."""
    import prefpack.training.cadence as cadence

    monkeypatch.setattr(cadence, "_is_terminal", lambda stream: terminal)
    mark = "saved=" if terminal else "saved "
    rows = _train(world, tmp_path, "shared", "data.prefix_sharing=true")
    out = capsys.readouterr().err
    saved = 1 - rows[-1]["positions"] / rows[-1]["tokens"]
    assert 0.05 < saved < 0.5  # max_length 48: the prompts are cut short
    last = [x for x in out.replace("\r", "\n").splitlines() if "loss" in x][-1]  # the last step's progress
    assert f"{mark}{saved:.0%}" in last
    _train(world, tmp_path, "plain", "data.prefix_sharing=false")
    out = capsys.readouterr().err
    assert ("fill=" in out if terminal else "tokens/s" in out) and mark not in out
