"""A newcomer's first commands offline: a placeholder model path is answered in one line at once, and
`prefpack quickstart --model-size small` builds a model with enough positions for --max-length 1024."""

from __future__ import annotations

import json
import time

import pytest
from conftest import HH, write_jsonl

from prefpack.cli import main as cli_main


@pytest.fixture
def offline(monkeypatch):
    """No hub: HF_HUB_OFFLINE for transformers, and the reachability check answers at once."""
    from prefpack import tokenizer
    from prefpack.model import load

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(load, "_hub_reachable", lambda: False)
    monkeypatch.setattr(tokenizer, "hub_reachable", lambda: False)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_a_placeholder_model_path_is_one_line_at_once(offline, tmp_path, capsys, monkeypatch, toy_tokenizers):
    monkeypatch.chdir(tmp_path)
    config = HH.parents[1] / "configs" / "dpo.yaml"
    t0 = time.perf_counter()
    assert cli_main(["train", str(config), "model.name_or_path=MODEL_DIR", f"run.output_dir={tmp_path / 'r'}"]) == 2
    err = _one_line_error(capsys)
    assert err.startswith("prefpack train: error: model.name_or_path 'MODEL_DIR': no such folder here, and the "
                          "model hub cannot be reached"), err
    assert "prefpack quickstart --model-size small writes one to runs/quickstart-small/model" in err
    assert cli_main(["train", str(config), "model.name_or_path=./models/mine"]) == 2  # looks local: no hub asked
    assert "model.name_or_path './models/mine': no such folder;" in _one_line_error(capsys)

    src = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Q?", "chosen": " yes", "rejected": " no"}])
    assert cli_main(["prepare", str(src), "--tokenizer", "MODEL_DIR", "--output", str(tmp_path / "s"),
                     "--workers", "1"]) == 2
    err = _one_line_error(capsys)
    assert "tokenizer 'MODEL_DIR': no such folder here" in err and "quickstart --model-size small" in err

    store = tmp_path / "s2"
    assert cli_main(["prepare", str(src), "--tokenizer", str(toy_tokenizers["llama"]), "--output", str(store),
                     "--workers", "1"]) == 0
    capsys.readouterr()
    assert cli_main(["eval", "--model", "MODEL_DIR", "--data", str(store)]) == 2
    assert "--model 'MODEL_DIR': no such folder here" in _one_line_error(capsys)
    assert time.perf_counter() - t0 < 10  # hub retries took ~50 s


def test_small_model_has_positions_for_max_length_1024(tmp_path, monkeypatch):
    from prefpack import quickstart

    monkeypatch.setattr(quickstart, "SMALL_BATCH", 2)  # the shape of the real one, a few tokens of training
    monkeypatch.setattr(quickstart, "SMALL_BLOCK", 32)
    data = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": f"\n\nHuman: question {i}?\n\nAssistant:", "chosen": f" answer {i}", "rejected": " no"}
        for i in range(40)])
    out = quickstart.build_small_model(str(tmp_path / "small"), steps=3, data=str(data), log=lambda m: None)
    model_dir = tmp_path / "small" / "model"
    assert out["model_dir"] == str(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["max_position_embeddings"] >= 1024 and config["num_hidden_layers"] == 4
    assert (model_dir / "tokenizer.json").exists() and out["loss_after"] < out["loss_before"]
    (tmp_path / "mine").mkdir()
    with pytest.raises(FileExistsError):  # a folder quickstart did not make is never removed
        quickstart.build_small_model(str(tmp_path / "mine"), steps=1, data=str(data), log=lambda m: None)


def test_readme_images_example_runs_as_written(tmp_path, monkeypatch, capsys):
    """README's "Images" commands, read from the README and run in order in an empty folder (prefpack in this
    process): the held-out reward accuracy rises well above chance, which only the pictures can give."""
    import re
    import shlex

    pytest.importorskip("PIL.Image")
    repo = HH.parents[2]
    text = (repo / "README.md").read_text()
    block = re.search(r"## Images\n.*?```bash\n(.*?)```", text, re.S).group(1)
    env = {}
    commands = []
    for line in block.splitlines():
        line = line.split("  #")[0].strip()
        if re.fullmatch(r"[A-Z]+=\S+", line):
            name, value = line.split("=", 1)
            env[name] = value
            continue
        argv = shlex.split(line)
        assert argv[0] == "$P", line
        commands.append([re.sub(r"\$([A-Z]+)", lambda m: env[m.group(1)], a) for a in argv[1:]])
    assert [c[0] for c in commands] == ["quickstart", "prepare", "prepare", "train", "eval"]
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        argv = [str(repo / a) if a.startswith("examples/") else a for a in argv]  # the clone's example config
        capsys.readouterr()
        assert cli_main(argv) == 0, argv
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["rewards/accuracies"] >= 0.7 and result["loss"] < 0.65, result
