"""run.report_to: TensorBoard, W&B and MLflow mirrors of metrics.jsonl (W&B faked, or real and offline when installed;
MLflow real, in a local file store, when installed)."""

from __future__ import annotations

import math
import sys
import types

import pytest
from conftest import prepare_hh_splits, tiny_llama

from prefpack.cli import main as cli_main
from prefpack.config import Config, ConfigError, config_to_dict, load_config
from prefpack.metrics import (
    BACKENDS,
    MLFLOW_ID_FILE,
    WANDB_ID_FILE,
    MetricsLogger,
    MetricsSetupError,
    check_report_to,
    read_metrics,
    report_targets,
)

INSTALL_HINT = "pip install 'prefpack[wandb]'"
MLFLOW_HINT = "pip install 'prefpack[mlflow]'"


class FakeRun:
    def __init__(self, calls: list, kwargs: dict, starting_step: int, offline: bool) -> None:
        self.calls, self.id, self.starting_step, self.offline = calls, kwargs["id"], starting_step, offline

    def log(self, data, step=None):
        self.calls.append(("log", self.id, dict(data), step))

    def finish(self):
        self.calls.append(("finish", self.id))


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in ``wandb`` module: ``calls`` records init kwargs, logs and finishes in order."""
    calls: list = []
    mod = types.ModuleType("wandb")
    mod.starting_step = 0  # what a resumed run reports as its next step (0: new, or offline)

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun(calls, kwargs, mod.starting_step if kwargs.get("resume") else 0, offline=False)

    mod.init = init
    mod.calls = calls
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return mod


def run_cfg(run_dir, *overrides: str) -> Config:
    return load_config(None, [f"run.output_dir={run_dir}", *overrides])


def of(calls, kind):
    return [c for c in calls if c[0] == kind]


# ------------------------------------------------------------------------------------ config semantics


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], {"auto"}),  # the default: TensorBoard when installed, not a word when not
    (["run.report_to=[auto, wandb]"], {"auto", "wandb"}),
    (["run.report_to=[auto, tensorboard]"], {"tensorboard"}),  # asked for by name
    (["run.report_to=wandb"], {"wandb"}),  # a bare name is a one-item list
    (["run.report_to=[wandb, tensorboard]"], {"wandb", "tensorboard"}),
    (["run.report_to=none"], set()),
    (["run.report_to=[none]"], set()),
    (["run.report_to=[]"], set()),
    (["run.tensorboard=false"], set()),  # an old config's switch still turns TensorBoard off (auto too)
    (["run.tensorboard=true"], {"tensorboard"}),
    (["run.report_to=[wandb]", "run.tensorboard=true"], {"wandb", "tensorboard"}),  # true adds it
    (["run.report_to=[wandb, tensorboard]", "run.tensorboard=false"], {"wandb"}),  # false removes it
    (["run.report_to=mlflow"], {"mlflow"}),
    (["run.report_to=[auto, wandb, mlflow]"], {"auto", "wandb", "mlflow"}),
])
def test_report_targets(tmp_path, overrides, expected):
    cfg = run_cfg(tmp_path, *overrides)
    cfg.validate(training=False)
    assert report_targets(cfg.run) == expected


def test_report_to_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"run\.report_to: expected one of 'tensorboard', 'wandb', 'mlflow', 'none'"):
        run_cfg(tmp_path, "run.report_to=wandbb")
    with pytest.raises(ConfigError, match=r"run\.report_to: expected"):
        run_cfg(tmp_path, "run.report_to=[tensorboard, comet]")
    for bad in (["run.report_to=[none, wandb]"], ["run.report_to=none", "run.tensorboard=true"],
                ["run.report_to=[mlflow, none]"]):
        with pytest.raises(ConfigError, match="'none' turns TensorBoard, W&B and MLflow off, so it must be alone"):
            run_cfg(tmp_path, *bad).validate(training=False)


def test_report_to_choices_are_the_backend_table():
    """The config's report_to choices are the names of the metrics backend table, then none and auto, and its help
    names each: a backend added to the table without its config choice (or the reverse) fails here, by name."""
    from dataclasses import fields
    from typing import get_args

    from prefpack.config.schema import ReportTo, RunConfig

    assert get_args(ReportTo) == (*BACKENDS, "none", "auto")
    [help_text] = [f.metadata["help"] for f in fields(RunConfig) if f.name == "report_to"]
    assert [name for name in BACKENDS if name not in help_text] == []


def test_a_backend_in_the_table_is_started_fed_and_closed(tmp_path, monkeypatch):
    """A new mirror is a ``Backend`` subclass and its name in ``BACKENDS``: the logger does the rest."""
    from prefpack.metrics import Backend

    calls: list = []

    class Fake(Backend):
        name = "fake"

        @classmethod
        def start(cls, setup):
            calls.append(("start", setup.named, setup.resume))
            return cls()

        def log(self, record):
            calls.append(("log", record["step"], record["split"], record["loss"]))

        def truncate_after(self, step):
            calls.append(("truncate", step))
            return 0

        def close(self, status="FINISHED"):
            calls.append(("close", status))

    monkeypatch.setitem(BACKENDS, "fake", Fake)
    logger = MetricsLogger(tmp_path, report_to={"fake"}, resume=True)
    assert list(logger.mirrors) == ["fake"] and logger.notice is None and not logger.tensorboard_active
    logger.log(1, {"loss": 0.5})
    logger.log(2, {"loss": math.nan}, split="eval")
    assert logger.truncate_after(1) == 1  # what metrics.jsonl dropped
    logger.close("KILLED")
    assert calls == [("start", True, True), ("log", 1, "train", 0.5), ("log", 2, "eval", None), ("truncate", 1),
                     ("close", "KILLED")]


def test_old_config_without_report_to_keeps_its_tensorboard_setting(tmp_path):
    """A config.yaml written before report_to existed (tensorboard: true/false, no report_to) means what it did."""
    for value, expected in (("true", {"tensorboard"}), ("false", set())):
        path = tmp_path / f"old-{value}.yaml"
        path.write_text(f"run:\n  output_dir: {tmp_path / 'r'}\n  tensorboard: {value}\n  plot: false\n")
        cfg = load_config(path, [])
        assert cfg.run.report_to == ["auto"] and report_targets(cfg.run) == expected


def test_report_to_round_trips_through_config_yaml(tmp_path):
    from prefpack.config import save_config

    cfg = run_cfg(tmp_path, "run.report_to=[wandb, tensorboard]", "run.wandb_project=my-proj")
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml", [])
    assert again.run.report_to == ["wandb", "tensorboard"] and again.run.wandb_project == "my-proj"
    assert again.run.tensorboard is None and config_to_dict(again) == config_to_dict(cfg)


# ------------------------------------------------------------------------------------ W&B with a fake module


def test_wandb_gets_every_record_with_its_step_and_the_config(tmp_path, fake_wandb):
    run_dir = tmp_path / "my-run"
    cfg = run_cfg(run_dir, "run.report_to=[wandb]", "run.wandb_project=proj-x", "loss.beta=0.25")
    logger = MetricsLogger.from_config(cfg)
    assert logger.wandb_active and not logger.tensorboard_active and logger.notice is None
    [init] = of(fake_wandb.calls, "init")
    kwargs = init[1]
    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    assert kwargs["id"] == run_id == logger.wandb_run_id and len(run_id) == 8
    assert kwargs["project"] == "proj-x" and kwargs["name"] == "my-run" and kwargs["dir"] == str(run_dir)
    assert "resume" not in kwargs  # a new run
    assert kwargs["config"] == config_to_dict(cfg) and kwargs["config"]["loss"]["beta"] == 0.25
    assert kwargs["config"]["run"]["report_to"] == ["wandb"]

    logger.log(0, {"loss": 0.69, "rewards/accuracies": 0.5}, split="eval")
    logger.log(1, {"loss": 0.6, "grad_norm": math.nan, "lr": 1e-3, "rewards/margins": 0.1})
    logger.log(2, {"loss": 0.5, "grad_norm": 2.0, "lr": 1e-3, "rewards/margins": 0.2})
    logger.log(2, {"loss": 0.55, "rewards/accuracies": 0.75}, split="eval")
    logger.log(3, {"grad_norm": math.inf})  # nothing finite: nothing to send, as TensorBoard writes nothing
    logger.close()
    assert fake_wandb.calls[1:] == [
        ("log", run_id, {"eval/loss": 0.69, "eval/rewards/accuracies": 0.5}, 0),
        ("log", run_id, {"train/loss": 0.6, "train/lr": 1e-3, "train/rewards/margins": 0.1}, 1),  # NaN left out
        ("log", run_id, {"train/loss": 0.5, "train/grad_norm": 2.0, "train/lr": 1e-3, "train/rewards/margins": 0.2}, 2),
        ("log", run_id, {"eval/loss": 0.55, "eval/rewards/accuracies": 0.75}, 2),
        ("finish", run_id),
    ]
    # metrics.jsonl is written as always, with the records W&B got (and the all-null one)
    assert [(r["step"], r["split"]) for r in read_metrics(run_dir)] == [(0, "eval"), (1, "train"), (2, "train"),
                                                                      (2, "eval"), (3, "train")]


def test_wandb_and_tensorboard_get_the_same_scalars(tmp_path, fake_wandb, monkeypatch):
    tb: list = []

    class FakeWriter:
        def __init__(self, log_dir, **kwargs):
            pass

        def add_scalar(self, tag, value, step):
            tb.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter))
    logger = MetricsLogger.from_config(run_cfg(tmp_path / "r", "run.report_to=[tensorboard, wandb]"))
    assert logger.tensorboard_active and logger.wandb_active
    logger.log(1, {"loss": 0.6, "rewards/chosen": -0.1, "grad_norm": math.nan, "tokens/s": 1000})
    logger.log(1, {"loss": 0.7, "logps/chosen": -12.5}, split="eval")
    logger.log(2, {"loss": 0.4, "nll": 3.0})
    logger.close()
    sent = [(tag, value, c[3]) for c in of(fake_wandb.calls, "log") for tag, value in c[2].items()]
    assert sent == tb and len(tb) == 7
    assert ("train/rewards/chosen", -0.1, 1) in tb and ("eval/logps/chosen", -12.5, 1) in tb


def test_wandb_resume_reuses_the_run_id(tmp_path, fake_wandb):
    run_dir = tmp_path / "run"
    cfg = run_cfg(run_dir, "run.report_to=wandb")
    first = MetricsLogger.from_config(cfg)
    for step in (1, 2, 3):
        first.log(step, {"loss": 1.0 / step})
    first.close()
    run_id = first.wandb_run_id

    # --resume from the checkpoint at step 2, while W&B already holds steps up to 3 (an online run)
    fake_wandb.starting_step = 4
    second = MetricsLogger.from_config(cfg, resume=True)
    init = of(fake_wandb.calls, "init")[-1][1]
    assert init["id"] == run_id and init["resume"] == "allow" and init["name"] == "run"
    assert (run_dir / WANDB_ID_FILE).read_text().strip() == run_id
    assert "already holds steps up to 3" in second.notice and str(run_dir / "metrics.jsonl") in second.notice
    assert second.truncate_after(2) == 1
    for step in (3, 4, 5):
        second.log(step, {"loss": 1.0 / step})
    second.close()
    logged = [(c[1], c[3]) for c in of(fake_wandb.calls, "log")]
    assert logged == [(run_id, 1), (run_id, 2), (run_id, 3), (run_id, 4), (run_id, 5)]  # step 3 once: W&B had it
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5]  # the file has the replayed step 3

    # a resumed offline run starts a new local segment at step 0: everything after the checkpoint goes to it
    fake_wandb.starting_step = 0
    third = MetricsLogger.from_config(cfg, resume=True)
    third.log(5, {"loss": 0.2})
    assert of(fake_wandb.calls, "log")[-1][1:] == (run_id, {"train/loss": 0.2}, 5)
    third.close()

    # a new run (no --resume) in a folder that held one gets a new W&B run, and its id replaces the old one
    fresh = MetricsLogger.from_config(cfg)
    new_id = of(fake_wandb.calls, "init")[-1][1]["id"]
    assert "resume" not in of(fake_wandb.calls, "init")[-1][1]
    assert new_id != run_id and fresh.wandb_run_id == new_id
    assert (run_dir / WANDB_ID_FILE).read_text().strip() == new_id
    fresh.close()


def test_wandb_resume_without_a_stored_id_starts_a_new_run(tmp_path, fake_wandb):
    """A run that did not report to W&B before and is resumed with report_to=wandb."""
    logger = MetricsLogger.from_config(run_cfg(tmp_path / "r", "run.report_to=wandb"), resume=True)
    init = of(fake_wandb.calls, "init")[0][1]
    assert "resume" not in init and init["id"] == (tmp_path / "r" / WANDB_ID_FILE).read_text().strip()
    assert "goes on in a new W&B run" in logger.notice
    logger.close()


def test_logging_after_close_continues_the_same_wandb_run(tmp_path, fake_wandb):
    logger = MetricsLogger.from_config(run_cfg(tmp_path / "r", "run.report_to=wandb"))
    logger.log(1, {"loss": 1.0})
    logger.close()
    logger.log(2, {"loss": 0.5})
    logger.close()
    inits = of(fake_wandb.calls, "init")
    assert len(inits) == 2 and inits[1][1]["id"] == inits[0][1]["id"] and inits[1][1]["resume"] == "allow"
    assert [c[0] for c in fake_wandb.calls] == ["init", "log", "finish", "init", "log", "finish"]


def test_only_the_enabled_rank_starts_wandb(tmp_path, fake_wandb):
    logger = MetricsLogger.from_config(run_cfg(tmp_path / "rank1", "run.report_to=wandb"), enabled=False)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert fake_wandb.calls == [] and not (tmp_path / "rank1").exists()


def test_wandb_init_failure_is_a_clear_error(tmp_path, monkeypatch):
    mod = types.ModuleType("wandb")

    def init(**kwargs):
        raise RuntimeError("api_key not configured (no-tty)")

    mod.init = init
    monkeypatch.setitem(sys.modules, "wandb", mod)
    with pytest.raises(MetricsSetupError, match=r"api_key not configured.*WANDB_MODE=offline"):
        MetricsLogger.from_config(run_cfg(tmp_path / "r", "run.report_to=wandb"))
    with pytest.raises(MetricsSetupError, match="run.wandb_project must name a W&B project"):
        MetricsLogger.from_config(run_cfg(tmp_path / "s", "run.report_to=wandb", "run.wandb_project=' '"))


# ------------------------------------------------------------------------------------ wandb not installed


def test_wandb_not_installed_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    # TensorBoard importable (a stand-in): missing, it is refused as well (test_metrics_plot)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=object))
    with pytest.raises(MetricsSetupError) as info:
        MetricsLogger.from_config(run_cfg(tmp_path / "r", "run.report_to=[tensorboard, wandb]"))
    assert isinstance(info.value, ConfigError)
    assert INSTALL_HINT in str(info.value) and "run.report_to" in str(info.value)
    assert not (tmp_path / "r" / WANDB_ID_FILE).exists() and not (tmp_path / "r" / "metrics.jsonl").exists()
    with pytest.raises(MetricsSetupError, match=r"pip install 'prefpack\[wandb\]'"):  # the early check says the same
        check_report_to(run_cfg(tmp_path / "r", "run.report_to=wandb").run)
    check_report_to(run_cfg(tmp_path / "r", "run.report_to=none").run)  # nothing to import
    # without wandb in report_to nothing imports it
    MetricsLogger.from_config(run_cfg(tmp_path / "s", "run.report_to=none")).log(1, {"loss": 1.0})
    assert read_metrics(tmp_path / "s")[0]["loss"] == 1.0


# ------------------------------------------------------------------------------------ through `prefpack train`


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_tokenizers, hh_train):
    root = tmp_path_factory.mktemp("report_to")
    tok = toy_tokenizers["llama"]
    stores = prepare_hh_splits(root, tok, hh_train, {"train": 16, "eval": 6})
    return {**stores, "policy": tiny_llama(tok, root / "policy", 1)}


def train_args(world, run_dir, *extra):
    return [f"model.name_or_path={world['policy']}", f"data.train={world['train']}", f"data.eval={world['eval']}",
            f"run.output_dir={run_dir}", "optim.lr=1.0e-3", "optim.schedule=constant", "train.global_batch_pairs=4",
            "train.max_steps=4", "run.save_every=2", "run.plot=false", "run.report_to=[wandb]",
            "train.micro_batch_tokens=4096", "data.max_tokens_per_row=1024", *extra]


@pytest.mark.usefixtures("one_thread")
def test_train_and_resume_report_to_wandb(world, tmp_path, fake_wandb):
    from prefpack.training import TrainingInterrupted, train

    run_dir = tmp_path / "wb-run"
    cfg = load_config(None, train_args(world, run_dir))
    with pytest.raises(TrainingInterrupted):
        train(cfg, stop_after_steps=3, progress=False, log=lambda m: None)
    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    [init] = of(fake_wandb.calls, "init")
    assert init[1]["id"] == run_id and init[1]["name"] == "wb-run" and init[1]["dir"] == str(run_dir)
    assert init[1]["config"] == config_to_dict(cfg)
    first = [(c[3], sorted({k.split("/")[0] for k in c[2]})) for c in of(fake_wandb.calls, "log")]
    assert first == [(0, ["eval"]), (1, ["train"]), (2, ["train"]), (3, ["train"])]
    assert fake_wandb.calls[-1] == ("finish", run_id)

    n = len(fake_wandb.calls)
    train(load_config(None, train_args(world, run_dir)), resume=True, progress=False, log=lambda m: None)
    resumed = fake_wandb.calls[n:]
    assert resumed[0][0] == "init" and resumed[0][1]["id"] == run_id and resumed[0][1]["resume"] == "allow"
    # resumed from the checkpoint at step 2: steps 3 and 4, then the final eval at 4 (the same W&B step)
    assert [(c[3], sorted({k.split("/")[0] for k in c[2]})) for c in of(resumed, "log")] == [
        (3, ["train"]), (4, ["train"]), (4, ["eval"])]
    assert resumed[-1] == ("finish", run_id)
    # what W&B got is what metrics.jsonl holds
    wb = {(c[3], k): v for c in of(fake_wandb.calls, "log") for k, v in c[2].items()}
    for rec in read_metrics(run_dir):
        for k, v in rec.items():
            if k not in ("step", "split", "time") and v is not None:
                assert wb[(rec["step"], f"{rec['split']}/{k}")] == v


def test_cli_train_without_wandb_stops_before_training(world, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)
    run_dir = tmp_path / "run"
    assert cli_main(["train", *train_args(world, run_dir), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert INSTALL_HINT in err and "Traceback" not in err
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()


# ------------------------------------------------------------------------------------ the real wandb, offline


def wandb_records(path):
    """The records of a ``run-ID.wandb`` transaction log (LevelDB log blocks of W&B protobuf records)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if data[:4] != b":W&B" or struct.unpack("<HB", data[4:7]) != (0xBEE1, 0):
        pytest.skip(f"this wandb writes another transaction log format ({data[:7]!r})")
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


def offline_history(segment, run_id):
    import json

    records = wandb_records(segment / f"run-{run_id}.wandb")
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {}
    for r in records:
        if r.WhichOneof("record_type") == "config":
            config.update({i.key: json.loads(i.value_json) for i in r.config.update})
    config.update({i.key: json.loads(i.value_json) for i in run.config.update})
    history = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.append({k: v for k, v in row.items() if not k.startswith("_")} | {"step": row["_step"]})
    return run, config, history


def test_real_wandb_offline_writes_under_the_run_folder(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for key in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_PROJECT", "WANDB_NAME"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")  # leave the repository alone
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for key, sub in (("WANDB_CONFIG_DIR", "cfg"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(key, str(tmp_path / "home" / sub))
    run_dir = tmp_path / "offline-run"
    cfg = run_cfg(run_dir, "run.report_to=wandb", "run.wandb_project=pp-test", "loss.beta=0.25")
    logger = MetricsLogger.from_config(cfg)
    assert wandb.run is not None and wandb.run.id == logger.wandb_run_id
    logger.log(0, {"loss": 0.69}, split="eval")
    for step in (1, 2, 3):
        logger.log(step, {"loss": 1.0 / step, "lr": 1e-3, "grad_norm": math.nan if step == 2 else 0.5})
    logger.log(3, {"loss": 0.7}, split="eval")
    logger.close()
    assert wandb.run is None  # finished
    run_id = logger.wandb_run_id
    segments = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert len(segments) == 1
    assert not list((tmp_path / "home").glob("**/offline-run-*"))  # nothing outside the run folder
    run, config, history = offline_history(segments[0], run_id)
    assert run.run_id == run_id and run.project == "pp-test" and run.display_name == "offline-run"
    assert config["loss"]["beta"] == 0.25 and config["run"]["report_to"] == "wandb"
    assert {k: config[k] for k in config_to_dict(cfg)} == config_to_dict(cfg)
    assert history == [
        {"step": 0, "eval/loss": 0.69},
        {"step": 1, "train/loss": 1.0, "train/lr": 1e-3, "train/grad_norm": 0.5},
        {"step": 2, "train/loss": 0.5, "train/lr": 1e-3},  # the NaN grad_norm is left out, as in TensorBoard
        {"step": 3, "train/loss": 1.0 / 3, "train/lr": 1e-3, "train/grad_norm": 0.5, "eval/loss": 0.7},
    ]

    # --resume from a checkpoint at step 2: the same id, in a second offline folder (`wandb sync` them in order)
    again = MetricsLogger.from_config(cfg, resume=True)
    assert again.wandb_run_id == run_id and "offline" in again.notice
    again.truncate_after(2)
    again.log(3, {"loss": 0.3})
    again.log(4, {"loss": 0.2})
    again.close()
    segments = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert len(segments) == 2
    newest = max(segments, key=lambda p: p.stat().st_mtime_ns)
    run, _, history = offline_history(newest, run_id)
    assert run.run_id == run_id
    assert history == [{"step": 3, "train/loss": 0.3}, {"step": 4, "train/loss": 0.2}]


# ------------------------------------------------------------------------------------ MLflow


def hide_mlflow(monkeypatch, names=("mlflow", "mlflow.entities", "mlflow.tracking")):
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)  # makes `import mlflow...` fail, installed or not


def test_mlflow_not_installed_is_a_config_error(tmp_path, monkeypatch):
    hide_mlflow(monkeypatch)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=object))
    with pytest.raises(MetricsSetupError) as info:
        MetricsLogger.from_config(run_cfg(tmp_path / "r", "run.report_to=[tensorboard, mlflow]"))
    assert isinstance(info.value, ConfigError)
    assert MLFLOW_HINT in str(info.value) and "run.report_to" in str(info.value)
    assert not (tmp_path / "r" / MLFLOW_ID_FILE).exists() and not (tmp_path / "r" / "metrics.jsonl").exists()
    with pytest.raises(MetricsSetupError, match=r"pip install 'prefpack\[mlflow\]'"):  # the early check says the same
        check_report_to(run_cfg(tmp_path / "r", "run.report_to=mlflow").run)
    # a rank that does not log never imports it
    logger = MetricsLogger.from_config(run_cfg(tmp_path / "rank1", "run.report_to=mlflow"), enabled=False)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "rank1").exists()


def test_mlflow_without_its_local_database_is_a_config_error(tmp_path, mlflow_env, monkeypatch):
    """mlflow-skinny alone cannot write RUN_DIR/mlruns (an SQLite store): the extra brings SQLAlchemy and Alembic."""
    hide_mlflow(monkeypatch, ["sqlalchemy"])
    with pytest.raises(MetricsSetupError, match=r"sqlalchemy.*pip install 'prefpack\[mlflow\]'"):
        check_report_to(run_cfg(tmp_path / "r", "run.report_to=mlflow").run)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # a server needs neither: no check
    check_report_to(run_cfg(tmp_path / "r", "run.report_to=mlflow").run)


def test_cli_train_without_mlflow_stops_before_training(world, tmp_path, monkeypatch, capsys):
    hide_mlflow(monkeypatch)
    run_dir = tmp_path / "run"
    assert cli_main(["train", *train_args(world, run_dir), "run.report_to=[auto, mlflow]", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert MLFLOW_HINT in err and "Traceback" not in err
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()


@pytest.fixture
def mlflow_env(monkeypatch):
    """The real mlflow (skipped when not installed), with no tracking settings from the environment."""
    pytest.importorskip("mlflow")
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(key, raising=False)


def local_store(run_dir):
    return f"sqlite:///{(run_dir / 'mlruns' / 'mlflow.db').resolve()}"


def mlflow_history(client, run_id):
    """{key: [(step, value), ...]} of an MLflow run, read back with MLflow's own client."""
    run = client.get_run(run_id)
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in run.data.metrics}


def test_mlflow_logs_to_a_local_folder_and_resume_continues_the_run(tmp_path, mlflow_env, monkeypatch):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "ml-run"
    cfg = run_cfg(run_dir, "run.report_to=[mlflow]", "loss.beta=0.25")
    logger = MetricsLogger.from_config(cfg)
    assert logger.mlflow_active and logger.notice is None
    run_id = (run_dir / MLFLOW_ID_FILE).read_text().strip()
    assert run_id == logger.mlflow_run_id and logger.mlflow_tracking_uri == local_store(run_dir)
    logger.log(0, {"loss": 0.69}, split="eval")
    for step in (1, 2, 3):
        logger.log(step, {"loss": 1.0 / step, "lr": 1e-3, "grad_norm": math.nan if step == 2 else 0.5})
    logger.log(3, {"loss": 0.7, "code/rewards/accuracies": 0.75}, split="eval")
    logger.log(4, {"grad_norm": math.inf})  # nothing finite: nothing sent
    logger.close()

    client = MlflowClient(tracking_uri=local_store(run_dir))
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "ml-run"
    assert client.get_experiment(run.info.experiment_id).name == "prefpack"
    assert run.data.params["loss.beta"] == "0.25" and run.data.params["run.report_to"] == '["mlflow"]'
    assert run.data.params["run.output_dir"] == str(run_dir)
    [artifact] = client.list_artifacts(run_id)
    assert artifact.path == "config.yaml"
    assert load_config(run_dir / "mlruns" / "artifacts" / run.info.run_id / "artifacts" / "config.yaml", []) == cfg
    assert not list(tmp_path.glob("mlartifacts")) and not list(tmp_path.glob("*.db"))  # all in the run folder
    assert mlflow_history(client, run_id) == {
        "eval/loss": [(0, 0.69), (3, 0.7)],
        "eval/code/rewards/accuracies": [(3, 0.75)],
        "train/loss": [(1, 1.0), (2, 0.5), (3, 1.0 / 3)],
        "train/lr": [(1, 1e-3), (2, 1e-3), (3, 1e-3)],
        "train/grad_norm": [(1, 0.5), (3, 0.5)],  # the NaN left out, as in TensorBoard and W&B
    }

    # --resume from the checkpoint at step 2: the same run; step 3 it holds already, steps after go on
    again = MetricsLogger.from_config(cfg, resume=True)
    assert again.mlflow_run_id == run_id and "already holds steps up to 3" in again.notice
    assert client.get_run(run_id).info.status == "RUNNING"
    again.truncate_after(2)
    for step in (3, 4):
        again.log(step, {"loss": 0.1 * step})
    again.close()
    again.log(5, {"loss": 0.05})  # logging after close() goes on in the same run
    again.close()
    assert (run_dir / MLFLOW_ID_FILE).read_text().strip() == run_id
    assert [r.info.run_id for r in client.search_runs([run.info.experiment_id])] == [run_id]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert mlflow_history(client, run_id)["train/loss"] == [(1, 1.0), (2, 0.5), (3, 1.0 / 3), (4, 0.4), (5, 0.05)]
    assert client.get_run(run_id).data.params["loss.beta"] == "0.25"

    # a new run (no --resume) in the same folder: a new MLflow run, whose id replaces the old one
    fresh = MetricsLogger.from_config(cfg)
    assert fresh.mlflow_run_id != run_id and (run_dir / MLFLOW_ID_FILE).read_text().strip() == fresh.mlflow_run_id
    fresh.close()

    # MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME, when set, are used instead of RUN_DIR/mlruns and "prefpack"
    # (here the first run's store again, to spare a second database, with the experiment made beforehand: one made
    # by the logger in a store of one's own keeps its artifacts where that store's default says)
    elsewhere = local_store(run_dir)
    MlflowClient(tracking_uri=elsewhere).create_experiment("my-exp", (tmp_path / "exp-artifacts").as_uri())
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "my-exp")
    other = MetricsLogger.from_config(run_cfg(tmp_path / "other", "run.report_to=mlflow"))
    other.log(1, {"loss": 1.0})
    other.close()
    assert other.mlflow_tracking_uri == elsewhere and not (tmp_path / "other" / "mlruns").exists()
    assert [p.name for p in (tmp_path / "exp-artifacts").glob("*/artifacts/*")] == ["config.yaml"]
    stored = MlflowClient(tracking_uri=elsewhere).get_run(other.mlflow_run_id)
    assert stored.data.metrics == {"train/loss": 1.0}
    assert MlflowClient(tracking_uri=elsewhere).get_experiment(stored.info.experiment_id).name == "my-exp"


@pytest.mark.usefixtures("one_thread")
def test_train_and_resume_report_to_mlflow(world, tmp_path, mlflow_env):
    from mlflow.tracking import MlflowClient

    from prefpack.training import TrainingInterrupted, train

    run_dir = tmp_path / "ml-train"
    args = [*train_args(world, run_dir), "run.report_to=[mlflow]"]
    with pytest.raises(TrainingInterrupted):
        train(load_config(None, args), stop_after_steps=3, progress=False, log=lambda m: None)
    run_id = (run_dir / MLFLOW_ID_FILE).read_text().strip()
    client = MlflowClient(tracking_uri=local_store(run_dir))
    assert client.get_run(run_id).info.status == "KILLED"  # stopped after step 3
    train(load_config(None, args), resume=True, progress=False, log=lambda m: None)
    assert (run_dir / MLFLOW_ID_FILE).read_text().strip() == run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["train.max_steps"] == "4"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    history = mlflow_history(client, run_id)
    assert [s for s, _ in history["train/loss"]] == [1, 2, 3, 4]  # step 3 once: the resumed run held it
    assert [s for s, _ in history["eval/loss"]] == [0, 4]
    # what MLflow holds is what metrics.jsonl holds (its step 3 replayed after the checkpoint at 2 aside)
    for rec in read_metrics(run_dir):
        for k, v in rec.items():
            if k not in ("step", "split", "time") and v is not None and rec["step"] != 3:
                assert (rec["step"], pytest.approx(v)) in history[f"{rec['split']}/{k}"]
