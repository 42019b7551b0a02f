"""Issue 51, what a newcomer meets: a quickstart that refuses to replace an earlier one (and picks one torch thread
by itself), an eval of a run's final model that scores with the run's loss, rounds that say they ignore
data.train, and the small messages and help texts that misled."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import write_jsonl
from test_chat_masks import family_toks  # noqa: F401  (a fixture: the chat families' tokenizers)

from prefpack.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- quickstart: an existing folder, threads


@pytest.mark.parametrize("task", ["reviews", "arithmetic"])
def test_quickstart_refuses_an_earlier_quickstart_folder_unless_overwrite(tmp_path, capsys, task):
    from prefpack.quickstart import MARKER, _fresh_folder

    root = tmp_path / "qs"
    (root / "run" / "final").mkdir(parents=True)
    (root / MARKER).write_text("made by prefpack quickstart\n")
    (root / "run" / "final" / "model.safetensors").write_text("weights")
    assert cli_main(["quickstart", "--task", task, "--output-dir", str(root)]) == 2
    err = _one_line_error(capsys)
    assert f"{root} holds an earlier quickstart's output (a trained model in run/final;" in err, err
    assert "--overwrite" in err
    assert (root / "run" / "final" / "model.safetensors").exists()  # nothing removed
    assert _fresh_folder(str(root), overwrite=True) == root and not root.exists()  # --overwrite: replaced


def test_quickstart_trains_on_one_thread_on_cpu(tmp_path, monkeypatch):
    from prefpack import quickstart, training

    seen = {}

    class Stop(Exception):
        pass

    def fake_train(cfg, log=print, **kw):
        seen["threads"] = torch.get_num_threads()
        raise Stop

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(training, "train", fake_train)
    monkeypatch.setattr(quickstart, "make_pairs", lambda n, seed, _make=quickstart.make_pairs: _make(min(n, 40), seed))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    lines = []
    try:
        with pytest.raises(Stop):
            quickstart.run_quickstart(str(tmp_path / "qs"), log=lines.append)
        assert seen["threads"] == 1
        assert torch.get_num_threads() == 2  # restored for the caller
        assert any(line.startswith("torch threads: 1 of 2") and "OMP_NUM_THREADS" in line for line in lines), lines
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice is kept, and said
        lines.clear()
        with pytest.raises(Stop):
            quickstart.run_quickstart(str(tmp_path / "qs2"), log=lines.append)
        assert seen["threads"] == 2 and any("OMP_NUM_THREADS=2" in line for line in lines), lines
    finally:
        torch.set_num_threads(threads)


def _quickstart_dir(words: list[str]) -> str:
    from prefpack.cli import parse_command_line

    args = parse_command_line(words)
    if args.output_dir:
        return args.output_dir
    if args.task == "arithmetic":
        return "runs/arithmetic"
    if args.images:
        return "runs/quickstart-images"
    return "runs/quickstart-small" if args.model_size == "small" else "runs/quickstart"


def test_readme_quickstarts_run_after_make_demo():
    """After `make demo` (runs/quickstart), every quickstart README and docs/ show in a block runs as written: none
    writes a folder `make demo` or an earlier command of the page wrote, unless it says --overwrite."""
    from test_docs_commands import fenced_commands, prefpack_words

    makefile = (REPO / "Makefile").read_text()
    demo = re.search(r"^demo:.*\n\t(.*)$", makefile, re.M).group(1).split()
    assert demo[1:] == ["quickstart"], demo
    found = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        written = {_quickstart_dir(demo[1:])}
        for number, line, env in fenced_commands(page.read_text()):
            words = prefpack_words(line, env)
            if words[:1] != ["quickstart"]:
                continue
            folder = _quickstart_dir(words)
            if folder in written and "--overwrite" not in words:
                found.append(f"{page.name}:{number}: {line}: {folder} exists")
            written.add(folder)
    assert not found, found


# ---------------------------------------------------------------- eval --model RUN_DIR/final: the run's loss


@pytest.fixture(scope="module")
def eval_world(tmp_path_factory, toy_tokenizers):
    """A run folder (RUN/config.yaml of an IPO run, RUN/final a tiny Llama) and a small pair store."""
    from conftest import tiny_llama

    root = tmp_path_factory.mktemp("eval51")
    tok = toy_tokenizers["llama"]
    tiny_llama(tok, root / "run" / "final", seed=0)
    (root / "run" / "config.yaml").write_text("train:\n  objective: preference\nloss:\n  terms:\n"
                                              "    - {name: ipo, weight: 1.0}\n  beta: 0.1\n")
    rows = [{"prompt": f"Question {i}?", "chosen": f" yes {i}", "rejected": " no"} for i in range(6)]
    src = write_jsonl(root / "pairs.jsonl", rows)
    assert cli_main(["prepare", str(src), "--tokenizer", str(tok), "--output", str(root / "store"),
                     "--workers", "1"]) == 0
    return root


def _eval(capsys, *argv) -> tuple[dict, list[str]]:
    import json

    capsys.readouterr()
    assert cli_main(["eval", *argv, "--json", "--no-progress", "--device", "cpu"]) == 0
    out = capsys.readouterr()
    return json.loads(out.out.strip().splitlines()[-1]), out.err.strip().splitlines()


def test_eval_of_a_run_final_scores_with_the_run_loss(eval_world, capsys, one_thread):
    run, store = eval_world / "run", str(eval_world / "store")
    model = str(run / "final")
    result, err = _eval(capsys, "--model", model, "--ref", model, "--data", store)
    assert result["loss"] == pytest.approx(25.0)  # IPO with the policy as its reference: (0 - 1/(2 beta))^2
    assert f"scoring with the run's loss from {run / 'config.yaml'}: ipo, beta 0.1" in err, err
    result, err = _eval(capsys, "--model", model, "--ref", model, "--data", store, "--beta", "0.5")
    assert result["loss"] == pytest.approx(1.0) and any("ipo, beta 0.5 (--beta as given here)" in e for e in err)
    result, _ = _eval(capsys, "--model", model, "--ref", model, "--data", store, "--loss", "sigmoid")
    assert result["loss"] == pytest.approx(0.693147, abs=1e-5)  # an explicit flag still wins

    bare = eval_world / "bare"  # a model folder outside a run: the defaults, said
    if not bare.exists():
        import shutil

        shutil.copytree(run / "final", bare)
    result, err = _eval(capsys, "--model", str(bare), "--ref", str(bare), "--data", store)
    assert result["loss"] == pytest.approx(0.693147, abs=1e-5)
    assert any(e.startswith("scoring with the default loss: sigmoid, beta 0.1") and "--config" in e for e in err), err


# ---------------------------------------------------------------- rounds with data.train


def test_rounds_with_data_train_warn_that_the_store_is_ignored(tmp_path):
    from prefpack.config import load_config

    base = ["model.name_or_path=m", "rounds.count=2", "rounds.prompts=p.jsonl", "rounds.reward_fn=r.py:f"]
    cfg = load_config(None, [*base, "data.train=stores/train"])
    said = [w for w in cfg.warnings() if "data.train" in w]
    assert len(said) == 1 and "stores/train" in said[0] and "not read by rounds" in said[0], cfg.warnings()
    assert not [w for w in load_config(None, base).warnings() if "data.train" in w]


# ---------------------------------------------------------------- item 6: small messages


def test_a_budget_warning_does_not_say_leave_it_auto_when_it_is_auto(tmp_path, toy_tokenizers):
    from prefpack.config import load_config
    from prefpack.data.prepare import PrepareOptions, prepare
    from prefpack.data.store import Store
    from prefpack.objectives import PairTask, config_terms, settings_from_config
    from prefpack.objectives.select import batch_warnings

    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Q {i}?", "chosen": " yes", "rejected": " no"}
                                              for i in range(4)])
    prepare(PrepareOptions(inputs=[str(src)], tokenizer=str(toy_tokenizers["llama"]), output=str(tmp_path / "s"),
                           workers=1), log=lambda m: None)
    store = Store(tmp_path / "s")
    for given, auto in (("3", False), ("auto", True)):
        cfg = load_config(None, ["loss.terms=[{name: sigmoid}]", "train.global_batch_pairs=2",
                                 f"train.micro_batch_tokens={given}"])
        settings = settings_from_config(cfg, pad_id=0, micro_batch_tokens=3, row_tokens=2048, chunk_size=1024,
                                        shares_prompts=False)
        [warning] = batch_warnings(PairTask(store, settings, config_terms(cfg)))
        if auto:
            assert "leave it auto" not in warning and "train.micro_batch_tokens(auto: 3)" in warning, warning
            assert "auto sized it for this device" in warning
        else:
            assert "train.micro_batch_tokens=3 is smaller" in warning and "leave it auto" in warning, warning


def test_enable_thinking_false_on_a_reasoning_row_names_the_row_and_the_kwarg(tmp_path, family_toks):  # noqa: F811
    from test_chat_masks import PLAIN, PROMPT, no_reasoning, run

    from prefpack.data.prepare import PrepareError

    with pytest.raises(PrepareError) as err:
        run(tmp_path, family_toks["qwen3"], [{"prompt": PROMPT, "chosen": PLAIN, "rejected": no_reasoning(PLAIN)}],
            chat_template_kwargs={"enable_thinking": False})
    msg = str(err.value)
    assert "field 'chosen''s assistant reply holds reasoning ('No idea.')" in msg, msg
    assert "enable_thinking is false" in msg and "not prefix-stable" not in msg, msg


def test_a_reward_model_run_is_neither_titled_nor_warned_about_as_sigmoid(tmp_path):
    import yaml

    from prefpack.config import load_config
    from prefpack.plot import run_title

    cfg = load_config(None, ["model.name_or_path=m", "data.train=stores/hh", "train.objective=reward",
                             "reference.mode=copy"])
    assert not [w for w in cfg.warnings() if "sigmoid" in w], cfg.warnings()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": {"name_or_path": "m"}, "data": {"train": "hh"},
                                                          "train": {"objective": "reward"},
                                                          "loss": {"terms": [{"name": "sigmoid", "weight": 1.0}]}}))
    title = run_title(tmp_path)
    assert "sigmoid" not in title and "reward model" in title, title


def test_a_suggested_torchrun_command_runs_prefpack_as_a_module():
    """`torchrun ... prefpack train` asks torchrun to run a file named prefpack in the working directory (there is
    one only at the repository's root, a folder): every torchrun command in messages and docs has `-m prefpack`."""
    bad = re.compile(r"torchrun[^`\n]*?\s(?:\S*/)?prefpack (?:train|eval|precompute-ref|generate|score)")
    found = []
    for path in [*sorted((REPO / "prefpack").rglob("*.py")), REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if bad.search(line) and not re.search(r"-m prefpack|\$\(which prefpack\)", line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, found


def test_report_to_tensorboard_without_tensorboard_is_refused_as_wandb_without_wandb(tmp_path, monkeypatch):
    import sys

    from prefpack.config import load_config
    from prefpack.metrics import MetricsSetupError, check_report_to

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # not installed
    monkeypatch.setitem(sys.modules, "wandb", None)
    for name in ("tensorboard", "wandb"):
        with pytest.raises(MetricsSetupError) as info:
            check_report_to(load_config(None, [f"run.output_dir={tmp_path}", f"run.report_to={name}"]).run)
        msg = str(info.value)
        assert msg.startswith(f"run.report_to has '{name}' but") and "\n" not in msg, msg
        assert f"remove '{name}' from run.report_to" in msg
    check_report_to(load_config(None, [f"run.output_dir={tmp_path}"]).run)  # the default, auto: no word


def test_inspect_of_a_run_folder_says_what_it_is_and_what_inspect_reads(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "config.yaml").write_text("data:\n  train: stores/train\n")
    (run / "metrics.jsonl").write_text("")
    assert cli_main(["inspect", str(run)]) == 2
    err = _one_line_error(capsys)
    assert "is a training run's folder" in err and "prefpack prepare --output DIR" in err, err
    assert "this run trained on stores/train" in err and "prepare again" not in err
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert cli_main(["inspect", str(tmp_path / "model")]) == 2
    assert "is a model folder (config.json), not a prepared store" in _one_line_error(capsys)


def _help(command: str) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli_main([command, "--help"])
    return " ".join(out.getvalue().split())


def test_help_texts_say_what_happens():
    assert "one decoded example" not in _help("inspect") and "without it no example is decoded" in _help("inspect")
    text = _help("eval")
    assert "(default from the model)" not in text and "else null" in text
    assert "RUN_DIR/config.yaml" in text
    score = _help("score")
    assert "required for text rows" not in score and "--reward-model folder's own tokenizer" in score
    quickstart = _help("quickstart")
    assert "--overwrite" in quickstart


def test_precompute_ref_keeps_an_identical_sidecar_unless_overwrite(eval_world, capsys, one_thread):
    import json

    model, store = str(eval_world / "run" / "final"), eval_world / "store"
    argv = ["precompute-ref", "--model", model, "--data", str(store), "--device", "cpu"]
    assert cli_main(argv) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    sidecar = Path(first["sidecar"])
    stamp = sidecar.stat().st_mtime_ns
    assert cli_main(argv) == 0
    out = capsys.readouterr()
    again = json.loads(out.out.strip().splitlines()[-1])
    notes = [line for line in out.err.splitlines() if "already holds these reference log-probs" in line]
    assert len(notes) == 1 and "--overwrite" in notes[0], out.err
    assert again["skipped"] is True and again["mean_logp"] == first["mean_logp"]
    assert sidecar.stat().st_mtime_ns == stamp  # not written again
    assert cli_main([*argv, "--dtype", "bfloat16"]) == 0  # other settings: scored again
    assert "skipped" not in json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert cli_main(argv) == 0  # float32 again after the bfloat16 one: scored again
    assert "skipped" not in json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert cli_main([*argv, "--overwrite"]) == 0
    assert "skipped" not in json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_template_that_writes_the_date_is_named_at_prepare(tmp_path, family_toks):  # noqa: F811
    import datetime

    from test_chat_masks import PLAIN, PROMPT

    from prefpack.data.prepare import PrepareOptions, prepare

    data = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": PROMPT, "chosen": PLAIN,
                                                  "rejected": [{"role": "assistant", "content": "No."}]}])
    for family, dated in (("gpt-oss", True), ("qwen3", False)):
        lines: list[str] = []
        prepare(PrepareOptions(inputs=[str(data)], tokenizer=str(family_toks[family]), output=str(tmp_path / family),
                               workers=1), log=lines.append)
        said = [line for line in lines if "strftime_now" in line]
        if dated:
            assert len(said) == 1 and datetime.date.today().isoformat() in said[0], lines
        else:
            assert not said, said
