"""Nothing in a checkpoint runs on --resume (issue 36): a sharded (torch.distributed.checkpoint) checkpoint whose
``dcp/.metadata`` or non-tensor values were crafted to run code, with checksums.json rewritten to match (whoever
can write the files can), is refused like a damaged checkpoint and the previous one is used; the data files it
names must be files of its own folder."""

from __future__ import annotations

import io
import json
import pathlib
import pickle
import shutil

import pytest
import torch
from conftest import prepare_hh_splits, run_prefpack

from prefpack.distributed import Dist
from prefpack.training.checkpoint import (
    CheckpointDamaged,
    CheckpointRefused,
    list_checkpoints,
    load_checkpoint_distributed,
    resume_from_checkpoints,
    save_checkpoint_distributed,
    verify_checkpoint,
    write_checksums,
)
from prefpack.training.checkpoint.dcp_read import read_dcp_metadata

pytestmark = pytest.mark.usefixtures("one_thread")


class Touch:
    """Unpickled, it creates ``path`` (pathlib.Path.touch): the stand-in for any command a crafted pickle runs."""

    def __init__(self, path: pathlib.Path):
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (self.path,))


def parts(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


@pytest.fixture
def run(tmp_path):
    """A run folder with two sharded-format checkpoints (steps 4 and 5) of a small model and its AdamW."""
    one = Dist(world=1)
    for step in (4, 5):
        model, opt, sched = parts(step)
        save_checkpoint_distributed(tmp_path, step, model, opt, sched, {"seen": step}, 2, one)
    return tmp_path


def newest(run) -> pathlib.Path:
    return list_checkpoints(run)[-1]


def rewrite_metadata(ckpt: pathlib.Path, change) -> None:
    """Change the (prefpack-written, so trusted here) metadata with ``change(meta)`` and re-pickle it, then rewrite
    checksums.json to match as an attacker would."""
    path = ckpt / "dcp" / ".metadata"
    meta = pickle.loads(path.read_bytes())
    change(meta)
    path.write_bytes(pickle.dumps(meta, protocol=4))
    (ckpt / "checksums.json").unlink()
    write_checksums(ckpt)
    assert verify_checkpoint(ckpt).status == "ok"


def resume(run):
    model, opt, sched = parts(0)
    logs = []
    found = resume_from_checkpoints(run, lambda p: load_checkpoint_distributed(p, model, opt, sched, Dist(world=1)),
                                    log=logs.append)
    return found, model, "\n".join(logs)


def test_the_checked_reader_reads_what_torch_wrote_and_resumes_exactly(run):
    ckpt = newest(run)
    meta = read_dcp_metadata(ckpt / "dcp")
    plain = pickle.loads((ckpt / "dcp" / ".metadata").read_bytes())
    assert meta.state_dict_metadata == plain.state_dict_metadata and meta.storage_data == plain.storage_data
    (path, state), model, _ = resume(run)
    assert path == ckpt and state == {"seen": 5, "step": 5}
    want, opt_want, _ = parts(5)
    for a, b in zip(model.state_dict().values(), want.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_crafted_metadata_is_refused_nothing_runs_and_the_previous_checkpoint_is_used(run, tmp_path_factory):
    marker = tmp_path_factory.mktemp("outside") / "ran"
    rewrite_metadata(newest(run), lambda meta: setattr(meta, "planner_data", Touch(marker)))
    (path, state), model, said = resume(run)
    assert not marker.exists()
    assert state["step"] == 4 and path.name == "step-00000004"
    assert "refused" in said and "pathlib.Path.touch" in said and "step-00000005/dcp/.metadata" in said
    assert (run / "checkpoints" / "damaged-step-00000005").is_dir()  # set aside like a damaged one
    want, _, _ = parts(4)
    for a, b in zip(model.state_dict().values(), want.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_the_refusal_is_one_line_naming_the_file(run, tmp_path):
    marker = tmp_path / "ran"
    rewrite_metadata(newest(run), lambda meta: setattr(meta, "planner_data", Touch(marker)))
    with pytest.raises(CheckpointRefused) as info:
        read_dcp_metadata(newest(run) / "dcp")
    msg = str(info.value)
    assert isinstance(info.value, CheckpointDamaged) and "\n" not in msg
    assert msg.startswith(str(newest(run) / "dcp" / ".metadata")) and "pathlib.Path.touch" in msg
    assert not marker.exists()


def test_checksums_are_checked_before_the_metadata_is_read(run, tmp_path):
    """Without the rewritten checksums.json the crafted file is a damaged checkpoint: it is never unpickled."""
    ckpt = newest(run)
    marker = tmp_path / "ran"
    meta = pickle.loads((ckpt / "dcp" / ".metadata").read_bytes())
    meta.planner_data = Touch(marker)
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(meta, protocol=4))
    (path, _), _, said = resume(run)
    assert path.name == "step-00000004" and "step-00000005 is damaged: dcp/.metadata" in said
    assert not marker.exists()


def test_a_crafted_non_tensor_value_is_refused(run, tmp_path):
    """A value that is not a tensor (the optimizer's lr) is read with weights_only=True: one made to run code is
    refused (torch's own DefaultLoadPlanner reads these with weights_only=False)."""
    ckpt = newest(run)
    marker = tmp_path / "ran"
    shard = next((ckpt / "dcp").glob("*.distcp"))
    evil = io.BytesIO()
    torch.save(Touch(marker), evil)
    offset = shard.stat().st_size
    with open(shard, "ab") as fh:
        fh.write(evil.getvalue())

    def point_lr_at_it(meta):
        index = next(i for i in meta.storage_data if i.fqn.endswith("param_groups.0.lr"))
        info = meta.storage_data[index]
        info.offset, info.length = offset, len(evil.getvalue())

    rewrite_metadata(ckpt, point_lr_at_it)
    (path, _), _, said = resume(run)
    assert not marker.exists()
    assert path.name == "step-00000004" and "refused" in said and "param_groups.0.lr" in said


@pytest.mark.parametrize("name", ["../../../outside.distcp", "/etc/hostname", "missing.distcp"])
def test_data_files_outside_the_checkpoint_are_refused(run, name):
    ckpt = newest(run)
    shard = next((ckpt / "dcp").glob("*.distcp"))
    shutil.copyfile(shard, run / "outside.distcp")  # a readable copy outside the checkpoint folder

    def elsewhere(meta):
        for info in meta.storage_data.values():
            info.relative_path = name

    rewrite_metadata(ckpt, elsewhere)
    with pytest.raises(CheckpointRefused, match="not a file of the checkpoint's folder"):
        read_dcp_metadata(ckpt / "dcp")
    (path, _), _, _ = resume(run)
    assert path.name == "step-00000004"


def test_a_metadata_that_is_not_metadata_is_refused(run):
    ckpt = newest(run)
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    (ckpt / "checksums.json").unlink()
    write_checksums(ckpt)
    with pytest.raises(CheckpointRefused, match="holds a dict, not a Metadata"):
        read_dcp_metadata(ckpt / "dcp")


# ---------------------------------------------------------------- the real thing: torchrun, FSDP2, --resume


@pytest.fixture(scope="module")
def fsdp2_world(tmp_path_factory, toy_tokenizers, hh_train):
    from conftest import tiny_llama

    root = tmp_path_factory.mktemp("untrusted")
    stores = prepare_hh_splits(root, toy_tokenizers["llama"], hh_train, {"train": 24})
    policy = tiny_llama(toy_tokenizers["llama"], root / "policy", 1)
    conf = root / "c.yaml"
    conf.write_text(f"model: {{name_or_path: {policy}}}\n"
                    f"data: {{train: {stores['train']}}}\n"
                    "optim: {lr: 1.0e-3, schedule: constant}\n"
                    "train: {global_batch_pairs: 8, max_steps: 4}\n"
                    "distributed: {strategy: fsdp2}\n"
                    "run: {plot: false, tensorboard: false, save_every: 1, keep_checkpoints: 3}\n")
    return {"root": root, "conf": conf}


def _train(world, run_dir, *extra):
    return ["train", str(world["conf"]), f"run.output_dir={run_dir}", "--no-progress", *extra]


def craft_planner_data(ckpt: str, marker: str) -> None:
    """Between two runs of the launch below (tests/cli_runs.py, rank 0): the checkpoint's metadata made to create
    ``marker`` when unpickled."""
    assert (pathlib.Path(ckpt) / "dcp" / ".metadata").is_file()
    rewrite_metadata(pathlib.Path(ckpt), lambda meta: setattr(meta, "planner_data", Touch(pathlib.Path(marker))))


def test_torchrun_resume_refuses_a_crafted_fsdp2_checkpoint_and_resumes_from_the_previous_one(fsdp2_world):
    from safetensors.torch import load_file

    root = fsdp2_world["root"]
    full, cut, marker = root / "full", root / "cut", root / "ran"
    craft = {"call": f"{__name__}:craft_planner_data", "args": [str(cut / "checkpoints" / "step-00000003"),
                                                                str(marker)]}
    # one launch: the uninterrupted run, the run stopped after step 3, its newest checkpoint crafted, --resume
    proc = run_prefpack(_train(fsdp2_world, full), _train(fsdp2_world, cut, "--stop-after-steps=3"), craft,
                        _train(fsdp2_world, cut, "--resume"), nproc=2)
    said = proc.stdout + proc.stderr
    assert not marker.exists()
    assert "step-00000003/dcp/.metadata: refused" in said and "step-00000002 at step 2" in said
    assert (cut / "checkpoints" / "damaged-step-00000003").is_dir()
    steps = [json.loads(x)["step"] for x in (cut / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["split"] == "train"]
    assert steps == [1, 2, 3, 4]
    w1, w2 = (load_file(str(r / "final" / "model.safetensors")) for r in (full, cut))
    for k in w1:
        assert torch.equal(w1[k], w2[k]), k
