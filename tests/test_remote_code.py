"""No code a folder names runs unless the user turned on the one switch (model.trust_remote_code /
--trust-remote-code): a processor folder, a store's processor/ copy, a model or a tokenizer whose config names a
module (``auto_map``) is refused in one line before transformers reads it, with stdin closed as in a batch job (never
transformers' interactive prompt, never a traceback); with the switch on, every loader is passed
trust_remote_code=True (issue 36)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("PIL.Image")

from conftest import quiet  # noqa: E402

from prefpack.cli import main as cli_main  # noqa: E402
from prefpack.remote_code import RemoteCodeError  # noqa: E402
from prefpack.toy_vision import save_processor_dir, tiny_vlm, vision_rows, vision_tokenizer, write_jsonl  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A toy Qwen2-VL processor folder, vision rows, a store prepared from them and a tiny model."""
    root = tmp_path_factory.mktemp("remote-code")
    tok = vision_tokenizer()
    processor = save_processor_dir(root / "processor", "qwen2_vl", tok)
    src = write_jsonl(root / "train.jsonl", vision_rows(8, root / "images", seed=3, relative_to=root))
    assert cli_main(["prepare", str(src), "--processor", str(processor), "--output", str(root / "store"),
                     "--workers", "1"]) == 0
    tiny_vlm("qwen2_vl", tok, seed=1).save_pretrained(root / "model")
    save_processor_dir(root / "model", "qwen2_vl", tok)
    return {"root": root, "processor": processor, "rows": src, "store": root / "store", "model": root / "model"}


def name_code(folder: Path, marker: Path, file: str = "preprocessor_config.json", key: str = "AutoImageProcessor",
              **changes) -> Path:
    """Make ``folder/file`` name a module of the folder that writes ``marker`` when imported (and drop the class
    transformers has built in, so that transformers would need the module)."""
    config = json.loads((folder / file).read_text()) if (folder / file).exists() else {}
    config.pop("image_processor_type", None)
    # a tokenizer's entry is [slow class, fast class]
    config.update(changes, auto_map={key: [None, "custom.Custom"] if key == "AutoTokenizer" else "custom.Custom"})
    (folder / file).write_text(json.dumps(config))
    (folder / "custom.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                                      "from transformers import Qwen2VLImageProcessorPil as Custom\n")
    return folder


def batch_job(*argv) -> subprocess.CompletedProcess:
    """``prefpack ARGV`` as a batch job runs it: stdin closed, no terminal."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "prefpack", *map(str, argv)], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300, env=env)


def assert_refused(proc: subprocess.CompletedProcess, folder: Path, file: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "[y/N]" not in proc.stdout + proc.stderr
    assert len(lines) == 1 and str(folder) in lines[0] and file in lines[0] and "auto_map" in lines[0], lines
    assert "--trust-remote-code" in lines[0] and "model.trust_remote_code=true" in lines[0]


def test_prepare_refuses_a_processor_folder_naming_code(assets, tmp_path):
    marker = tmp_path / "marker"
    folder = name_code(Path(shutil.copytree(assets["processor"], tmp_path / "processor")), marker)
    proc = batch_job("prepare", assets["rows"], "--processor", folder, "--output", tmp_path / "out", "--workers", 1)
    assert_refused(proc, folder, "preprocessor_config.json")
    assert not marker.exists() and not (tmp_path / "out").exists()
    # processor_config.json names code the same way (AutoProcessor)
    shutil.rmtree(folder)
    folder = name_code(Path(shutil.copytree(assets["processor"], folder)), marker, "processor_config.json",
                       "AutoProcessor", processor_class="CustomProcessor")
    from prefpack.data.prepare import PrepareOptions, prepare

    with pytest.raises(RemoteCodeError, match=r"processor_config\.json names custom code"):
        prepare(PrepareOptions(inputs=[str(assets["rows"])], tokenizer=None, output=str(tmp_path / "out"),
                               processor=str(folder)), log=quiet)
    assert not marker.exists()


def test_train_and_eval_refuse_a_store_whose_processor_copy_names_code(assets, tmp_path):
    """The store's processor/ altered after prepare: train stops at set-up, eval too, and nothing runs."""
    marker = tmp_path / "marker"
    store = Path(shutil.copytree(assets["store"], tmp_path / "store"))
    name_code(store / "processor", marker)
    run = tmp_path / "run"
    proc = batch_job("train", f"model.name_or_path={assets['model']}", f"data.train={store}", f"run.output_dir={run}",
                     "train.max_steps=1", "train.global_batch_pairs=4", "run.plot=false", "run.tensorboard=false")
    assert_refused(proc, store / "processor", "preprocessor_config.json")
    assert not (run / "checkpoints").exists() and not (run / "final").exists()
    proc = batch_job("eval", "--model", assets["model"], "--data", store, "--loss", "sigmoid_ref_free")
    assert_refused(proc, store / "processor", "preprocessor_config.json")
    assert not marker.exists()


def test_a_model_folder_naming_code_is_refused_before_transformers_reads_it(assets, tmp_path, monkeypatch):
    import transformers

    from prefpack.model import load_causal_lm

    marker = tmp_path / "marker"
    model = Path(shutil.copytree(assets["model"], tmp_path / "model"))
    name_code(model, marker, "config.json", "AutoModelForCausalLM", model_type="custom_lm")

    def asked(*args, **kwargs):
        raise AssertionError("transformers was asked")

    for cls in (transformers.AutoConfig, transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
        monkeypatch.setattr(cls, "from_pretrained", asked)
    import torch

    with pytest.raises(RemoteCodeError, match=r"config\.json names custom code .*auto_map.*--trust-remote-code"):
        load_causal_lm(str(model), attn_implementation="sdpa", device=torch.device("cpu"))
    assert not marker.exists()


def test_a_config_that_also_names_a_built_in_class_loads_without_its_code(assets, tmp_path):
    """As transformers does with the switch off: a folder naming a model type (tokenizer class) it has built in
    loads with that class and the folder's module is never imported (many hub models ship both)."""
    import torch

    from prefpack.model import load_causal_lm
    from prefpack.tokenizer import load_tokenizer

    marker = tmp_path / "marker"
    model = Path(shutil.copytree(assets["model"], tmp_path / "model"))
    name_code(model, marker, "config.json", "AutoModelForImageTextToText")
    name_code(model, marker, "tokenizer_config.json", "AutoTokenizer")
    load_causal_lm(str(model), attn_implementation="sdpa", device=torch.device("cpu"), packed=False)
    load_tokenizer(model)
    assert not marker.exists()


def test_a_tokenizer_folder_naming_code_is_refused(assets, tmp_path):
    marker = tmp_path / "marker"
    folder = name_code(Path(shutil.copytree(assets["processor"], tmp_path / "tok")), marker, "tokenizer_config.json",
                       "AutoTokenizer", tokenizer_class="CustomTokenizer")
    proc = batch_job("prepare", assets["rows"], "--tokenizer", folder, "--output", tmp_path / "out")
    assert_refused(proc, folder, "tokenizer_config.json")
    assert not marker.exists()


class Capture:
    """A ``from_pretrained`` that records its keyword arguments and loads with the class transformers has built in
    (the folder's module is never imported)."""

    def __init__(self, monkeypatch, cls, builtin):
        self.kwargs: list[dict] = []
        real = builtin.from_pretrained

        def from_pretrained(path, *args, **kwargs):
            self.kwargs.append(kwargs)
            return real(path, *args, **{k: v for k, v in kwargs.items() if k != "trust_remote_code"})

        monkeypatch.setattr(cls, "from_pretrained", from_pretrained)


def test_the_switch_passes_trust_remote_code_true_to_every_loader(assets, tmp_path, monkeypatch):
    import transformers

    from prefpack.config import load_config
    from prefpack.data.prepare import PrepareOptions, prepare
    from prefpack.training.precompute import PrecomputeOptions, precompute_reference
    from prefpack.training.scoring import EvalOptions, eval_config
    from prefpack.training.setup import build

    marker = tmp_path / "marker"
    processor = name_code(Path(shutil.copytree(assets["processor"], tmp_path / "processor")), marker)
    images = Capture(monkeypatch, transformers.AutoImageProcessor, transformers.Qwen2VLImageProcessorPil)
    prepare(PrepareOptions(inputs=[str(assets["rows"])], tokenizer=None, output=str(tmp_path / "store"),
                           processor=str(processor), workers=1, trust_remote_code=True), log=quiet)
    assert [k.get("trust_remote_code") for k in images.kwargs] == [True]
    # train and eval set up on it with model.trust_remote_code, precompute-ref with --trust-remote-code
    images.kwargs.clear()
    cfg = load_config(None, [f"model.name_or_path={assets['model']}", f"data.train={tmp_path / 'store'}",
                             f"run.output_dir={tmp_path / 'run'}", "model.trust_remote_code=true",
                             "train.global_batch_pairs=4", "run.plot=false", "run.tensorboard=false"])
    build(cfg, log=quiet)
    assert [k.get("trust_remote_code") for k in images.kwargs] == [True]
    assert eval_config(EvalOptions(model=str(assets["model"]), data=str(tmp_path / "store"), loss="simpo",
                                   trust_remote_code=True)).model.trust_remote_code
    images.kwargs.clear()
    precompute_reference(PrecomputeOptions(model=str(assets["model"]), data=str(tmp_path / "store"),
                                           micro_batch_tokens=4096, chunk_size=64, trust_remote_code=True),
                         log=quiet, progress=False)
    assert [k.get("trust_remote_code") for k in images.kwargs] == [True]
    assert not marker.exists()


def test_every_from_pretrained_passes_trust_remote_code():
    """Read from the source: no loader in prefpack leaves the switch to transformers' default (which prompts)."""
    missing = []
    for path in (REPO / "prefpack").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_pretrained"
                    # peft's adapter loader reads a config and weights (safetensors), never code, and has no switch
                    and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "PeftModel")
                    and not any(k.arg == "trust_remote_code" for k in node.keywords)):
                missing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not missing, missing


def test_inspect_refuses_a_store_tokenizer_naming_code_and_has_the_switch(assets, tmp_path, monkeypatch):
    """`inspect --row` decodes with the store's tokenizer copy: one naming code is refused in one line, and the switch
    the message names exists on inspect (it passes trust_remote_code=True to the loader; the code is not run here)."""
    import transformers

    marker = tmp_path / "marker"
    store = Path(shutil.copytree(assets["store"], tmp_path / "store"))
    name_code(store / "tokenizer", marker, "tokenizer_config.json", "AutoTokenizer", tokenizer_class="CustomTokenizer")
    proc = batch_job("inspect", store, "--row", "0")
    assert_refused(proc, store / "tokenizer", "tokenizer_config.json")
    assert "inspect" in proc.stderr.split("--trust-remote-code")[1].split(")")[0]  # the switch's list names inspect
    calls = Capture(monkeypatch, transformers.AutoTokenizer, transformers.PreTrainedTokenizerFast)
    from prefpack.data.inspect import inspect_store

    (store / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {k: v for k, v in json.loads((store / "tokenizer" / "tokenizer_config.json").read_text()).items()
         if k not in ("auto_map", "tokenizer_class")}))
    inspect_store(str(store), row=0, trust_remote_code=True)
    assert [k.get("trust_remote_code") for k in calls.kwargs] == [True]
    assert not marker.exists()


def test_an_adapter_name_that_is_no_local_folder_is_refused_before_peft_looks_anywhere(tmp_path, monkeypatch):
    """`lora.adapter` and `generate --adapter` read only a local adapter folder: a hub-style name or a folder without
    adapter_config.json is one line, and peft (which would try the hub) is never called."""
    import peft
    import torch

    from prefpack.engine.lora import continued_adapter
    from prefpack.errors import PrefpackError
    from prefpack.generation.engine import GenerationError
    from prefpack.model.weights import load_adapter

    def sampled(model, folder):  # generate --adapter's load (TransformersEngine.load's adapter step)
        return load_adapter(model, folder, key="--adapter", error=GenerationError)

    def never(*args, **kwargs):
        raise AssertionError("peft was asked to load")

    monkeypatch.setattr(peft.PeftModel, "from_pretrained", never)
    model = torch.nn.Linear(2, 2)
    for name in ("someone/adapter", str(tmp_path)):
        for load in (continued_adapter, sampled):
            with pytest.raises(PrefpackError, match="adapter_config.json"):
                load(model, name)
