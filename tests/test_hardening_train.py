"""User errors around training named before any work: too-long sequences, rows, missing folders, GPU launches."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import cfg_for
from test_train import world as world  # noqa: F401 - a module-scoped fixture shared with test_train

from prefpack.distributed import LaunchError, init_from_env
from prefpack.model import ModelError, load_causal_lm
from prefpack.training import train


def test_sequences_longer_than_the_model_positions_are_refused(world, tmp_path):  # noqa: F811
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_pretrained(world["policy"])
    cfg.max_position_embeddings = 24  # the store was prepared with --max-length 48
    short = tmp_path / "short"
    LlamaForCausalLM(cfg).save_pretrained(short)
    run = cfg_for(world, tmp_path / "run", f"model.name_or_path={short}", "train.device=cpu")
    with pytest.raises(ModelError, match=r"train store .* have a sequence longer than the model's "
                                         r"max_position_embeddings \(24.*--max-length 24"):
        train(run, log=lambda m: None, progress=False)


def test_pairs_longer_than_a_row_are_counted_once(world, tmp_path):  # noqa: F811
    lines = []
    run = cfg_for(world, tmp_path / "run", "train.device=cpu", "data.max_tokens_per_row=60", "train.max_steps=1")
    train(run, log=lines.append, progress=False)
    notes = [x for x in lines if "longer than a row" in x]
    assert len(notes) == 1 and "data.max_tokens_per_row=60" in notes[0]
    n = int(notes[0].split("note: ")[1].split(" of ")[0])
    from prefpack.data.store import Store

    store = Store(world["train"])
    lengths = 2 * store.column("prompt_len") + store.column("chosen_len") + store.column("rejected_len")
    assert n == int((lengths > 60).sum()) > 0


def test_a_missing_model_folder_is_named_at_once(tmp_path):
    t = time.perf_counter()
    with pytest.raises(ModelError, match="model .*: no such folder; give a local model folder"):
        load_causal_lm(str(tmp_path / "no" / "such" / "model"), attn_implementation="sdpa",
                       device=torch.device("cpu"))
    assert time.perf_counter() - t < 15  # no hub retries (they took 25-96 s)


def test_more_gpu_processes_than_gpus_stop_with_a_message(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(LaunchError, match="--nproc-per-node at most that.*train.device=cpu"):
        init_from_env("cuda")



def test_a_hub_id_that_is_no_folder_is_named_at_once_when_the_hub_is_unreachable(world, tmp_path, monkeypatch):  # noqa: F811
    """`models/tiny` looks like a hub id; with no such folder and no hub, training says so before any retry."""
    from prefpack.model import load

    monkeypatch.setattr(load, "_hub_reachable", lambda: False)
    monkeypatch.chdir(tmp_path)
    run = cfg_for(world, tmp_path / "run", "model.name_or_path=models/tiny", "train.device=cpu")
    t = time.perf_counter()
    with pytest.raises(ModelError, match="model.name_or_path 'models/tiny': no such folder here, and the model hub cannot be reached"):
        train(run, log=lambda m: None, progress=False)
    assert time.perf_counter() - t < 15  # hub retries took 25-96 s
