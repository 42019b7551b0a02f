"""Shared fixtures: bundled real data and small locally built tokenizers (no network, no ../shared); and the
helpers several test modules use (imported as ``from conftest import ...``)."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# The suite checks CPU exactness (float32/float64 against formulas); on a machine with a GPU, `train.device: auto`
# would run it in bfloat16 on CUDA and miss those tolerances. Tests that need CUDA say so and run only with
# PREFPACK_TEST_CUDA=1 (subprocesses such as torchrun inherit the hidden device too).
if os.environ.get("PREFPACK_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import numpy as np
import pytest
import torch

# `make test` runs the suite in two processes (pytest-xdist, one module's tests in one process): one torch thread
# each, so that they share the cores instead of fighting over them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

from prefpack.config import load_config
from prefpack.toy_tokenizer import build_toy_tokenizer


def _freeze_imported_objects() -> None:
    """Every training run calls ``gc.collect()`` twice (``release_freed_memory``, so freed memory leaves the RSS);
    in a test process that walks ~400k objects of torch and transformers each time (0.2 s a call, about 40% of an
    invariance module's time). The modules' objects live as long as the process: moved out of the collector's
    reach (``gc.freeze``), a collection walks only what the tests made."""
    import gc

    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401 - the model classes the suite builds most

    import prefpack.training  # noqa: F401

    gc.collect()
    gc.freeze()


_freeze_imported_objects()

REPO = Path(__file__).resolve().parent.parent
HH = REPO / "examples" / "data" / "hh-rlhf-harmless-base"
NEOX = REPO / "examples" / "tokenizers" / "gpt-neox-20b"


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return path


def quiet(*_args, **_kwargs) -> None:
    """A ``log`` callback that drops the messages."""
    return None


def log_sigmoid(x: float) -> float:
    """log(1 / (1 + e^-x)) in plain float math, without overflow for large |x| (the formulas' reference)."""
    if x >= 0:
        return -math.log1p(math.exp(-x))
    return x - math.log1p(math.exp(x))


@pytest.fixture(scope="session")
def hh_train() -> list[dict]:
    return read_jsonl(HH / "train_2k.jsonl.gz")


@pytest.fixture(scope="session")
def toy_tokenizers(tmp_path_factory, hh_train) -> dict[str, Path]:
    """Folders holding a Llama-style, a NeoX-style and a ChatML tokenizer trained on bundled text."""
    texts = [r["prompt"] + r["chosen"] for r in hh_train[:300]]
    root = tmp_path_factory.mktemp("toks")
    out = {}
    for style in ("llama", "neox", "chatml"):
        tok = build_toy_tokenizer(texts, style=style, vocab_size=600)
        tok.save_pretrained(root / style)
        out[style] = root / style
    return out


def run_prefpack(*commands: list[str] | dict, nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """``prefpack`` command lines (argument lists) run in turn in one new process, or in one torchrun launch of
    ``nproc`` ranks on one torch thread each (tests/cli_runs.py): start-up is paid once; a dict between them is a
    test's own step (cli_runs.py says how). Asserts they all exited with 0 and returns the finished process (its
    stdout holds what rank 0 printed)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump([argv if isinstance(argv, dict) else [str(a) for a in argv] for argv in commands], fh)
    script = str(Path(__file__).with_name("cli_runs.py"))
    cmd = [sys.executable, script, fh.name]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *cmd[1:]]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        os.unlink(fh.name)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def run_here(*commands: list) -> list[str]:
    """``prefpack`` command lines (argument lists) run in turn in this process on one torch thread, as
    :func:`run_prefpack` runs them in a new one (and as each torchrun rank runs), without its seconds of start-up and
    imports: for a test that needs what the commands compute, not the entry point. Asserts they all exited with 0;
    returns the lines they printed."""
    import contextlib
    import io

    from prefpack.cli import main

    out, threads = io.StringIO(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out):
            for argv in commands:
                assert main([str(a) for a in argv]) == 0, argv
    finally:
        torch.set_num_threads(threads)
    return out.getvalue().strip().splitlines()


def tiny_llama(tok_dir, out, seed):
    """A 2-layer Llama (hidden 32, grouped-query heads) for a tokenizer folder, saved to ``out``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: tiny models gain nothing from threads and slow 10x on shared cores; and a
    killed subprocess (OMP_NUM_THREADS=1) and its in-process resumption then run the same kernels."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def float64_llama(tok_dir, seed):
    """A 2-layer float64 Llama on the packed_sdpa kernel for the toy tokenizers (600 ids), in eval mode."""
    import transformers as tf

    from prefpack.model.attention.packed_sdpa import register

    register()
    cfg = tf.LlamaConfig(vocab_size=600, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    cfg._attn_implementation = "packed_sdpa"
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(cfg).double().eval()


def task_settings(cfg, *, pad_id: int = 0):
    """The ``RunSettings`` of an objective a test builds itself, resolved as ``build`` resolves them on CPU: ``auto``
    budgets are CPU's (``budgets.CPU_BUDGETS``) and ``auto`` prefix sharing is on (packed_sdpa reads prompt groups)."""
    from prefpack.engine.budgets import CPU_BUDGETS
    from prefpack.objectives import settings_from_config

    def number(value, cpu: int) -> int:
        return cpu if value == "auto" else int(value)

    return settings_from_config(
        cfg, pad_id=pad_id, micro_batch_tokens=number(cfg.train.micro_batch_tokens, CPU_BUDGETS.micro_batch_tokens),
        row_tokens=number(cfg.data.max_tokens_per_row, CPU_BUDGETS.row_tokens),
        chunk_size=number(cfg.train.chunk_size, CPU_BUDGETS.chunk_size),
        shares_prompts=cfg.data.prefix_sharing in (True, "auto"))


def make_task(cls, store, cfg, *, pad_id: int = 0):
    """``cls(store, settings, terms)`` for a test config (see :func:`task_settings`)."""
    from prefpack.objectives import config_terms

    return cls(store, task_settings(cfg, pad_id=pad_id), config_terms(cfg))


def reference_table(model, store, *, kto: bool = False, seed: int = 0, micro_batch_tokens: int = 4096,
                    row_tokens: int = 2048, chunk_size: int = 1024, group_by_prompt: bool | None = None,
                    shares_prompts: bool | None = None):
    """What precompute-ref writes for ``store`` with ``model`` (a ``KeyedLogps`` by sequence key), without the CLI;
    prompts shared where the model's kernel reads prompt groups, unless ``shares_prompts`` says."""
    from prefpack.model import kernel_of
    from prefpack.training.precompute import record_reference, scoring_objective

    share = kernel_of(model).reads_prompt_groups if shares_prompts is None else shares_prompts
    task = scoring_objective(store, kto=kto, seed=seed, micro_batch_tokens=micro_batch_tokens, row_tokens=row_tokens,
                             chunk_size=chunk_size, shares_prompts=share, group_by_prompt=group_by_prompt)
    return record_reference(task, model)


def group_and_pair_losses(tok_dir, group_store, pair_store, cfg, *, ld: bool, rows=None):
    """The per-pair losses of the same pairs read as prompt groups (``PromptGroupTask``: 3 groups in two packed
    rows, or a padded row each; ``rows`` to say otherwise) and pair by pair (``PairTask``: one row, or a padded row
    each), by one float64 policy against a float64 copy reference, with WPO means (and LD-DPO tails with ``ld``). Returns the policy and
    both ``LossOutput``s."""
    from prefpack.model import SequenceLogps
    from prefpack.objectives.base import Planned
    from prefpack.objectives.groups import PromptGroupTask
    from prefpack.objectives.pairs import PairTask
    from prefpack.reference import CopyReference

    policy, reference = float64_llama(tok_dir, 0), CopyReference(float64_llama(tok_dir, 1))
    reference.configure(chunk_size=7, pair_tails=ld)
    module = SequenceLogps(policy, chunk_size=7, wpo=True, pair_tails=ld)
    g_task, p_task = make_task(PromptGroupTask, group_store, cfg), make_task(PairTask, pair_store, cfg)
    n = len(pair_store)
    g_rows = rows or ([[0, 1], [2]] if cfg.data.packing else [[0], [1], [2]])
    p_rows = [list(range(n))] if cfg.data.packing else [[i] for i in range(n)]
    g_out = g_task.loss(module, reference, g_task.collate(Planned(g_rows, 0, 0)), None)
    p_out = p_task.loss(module, reference, p_task.collate(Planned(p_rows, 0, 0)), None)
    return policy, g_task, g_out, p_out


def prepare_hh_splits(root, tok_dir, hh_rows, sizes: dict[str, int], max_length: int = 48) -> dict:
    """Consecutive splits (``{"train": 24, "eval": 10}``) of usable hh pairs, each prepared into ``root / name``; at
    48 tokens most prompts are cut to almost nothing, which these training tests allow (``min_prompt_keep=0``)."""
    from prefpack.data.prepare import PrepareOptions, prepare

    rows = [r for r in hh_rows[:100] if r["chosen"].strip() and r["chosen"] != r["rejected"]]
    out, start = {}, 0
    for name, n in sizes.items():
        part = rows[start:start + n]
        start += n
        prepare(PrepareOptions(inputs=[str(write_jsonl(root / f"{name}.jsonl", part))], tokenizer=str(tok_dir),
                               output=str(root / name), max_length=max_length, min_prompt_keep=0, workers=1),
                log=lambda m: None)
        out[name] = root / name
    return out


# ---------------------------------------------------------------- the order `make test` deals modules in

@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory):
    """A processor folder: a toy ChatML tokenizer with Qwen2-VL's image tokens, and Qwen2-VL's image processor."""
    from transformers import Qwen2VLImageProcessorPil

    from prefpack.toy_tokenizer import add_vision_tokens, build_toy_tokenizer

    path = tmp_path_factory.mktemp("processor")
    texts = ["what is in the picture? a cat on a mat, a dog in the fog"] * 20
    add_vision_tokens(build_toy_tokenizer(texts, style="chatml", vocab_size=300)).save_pretrained(path)
    Qwen2VLImageProcessorPil().save_pretrained(path)
    return path


# ---------------------------------------------------------------- a training test's world and run folder


def overrides(world, run_dir, *extra) -> list[str]:
    """Config overrides of a run in ``run_dir`` on a test world (a dict with ``policy`` and ``train`` paths, and
    ``settings``: the module's own overrides), then ``extra`` (later ones win)."""
    return [f"model.name_or_path={world['policy']}", f"data.train={world['train']}", f"run.output_dir={run_dir}",
            *world["settings"], *extra]


def cfg_for(world, run_dir, *extra):
    """The parsed (not yet validated) config of ``overrides(world, run_dir, *extra)``."""
    return load_config(None, overrides(world, run_dir, *extra))


def metrics_lines(run_dir, split="train") -> list[dict]:
    """The rows of a run's metrics.jsonl of one split, in order."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == split]


def final_weights(run_dir) -> dict:
    """The state dict a run saved in ``final/``."""
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "model.safetensors"))


def seq_logp_f64(model, prompt, completion) -> float:
    """A completion's log-probability after its prompt, by one plain forward in float64 (the reference the
    packed, chunked computation is checked against)."""
    ids = torch.tensor([[int(t) for t in prompt] + [int(t) for t in completion]])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.double()
    logp = torch.log_softmax(logits[0, :-1], -1)
    targets = ids[0, 1:]
    return float(logp[torch.arange(len(targets)), targets][len(prompt) - 1 :].sum())


# ---------------------------------------------------------------- unscored spans inside completions (issue 23)


def default_unscored(row: int, side: int, n: int) -> list[tuple[int, int]]:
    """Unscored ranges [start, end) inside a completion of ``n`` tokens (side 0 chosen / a KTO completion, 1 rejected):
    the first token, or a few tokens inside, by row and side, always leaving its last token scored."""
    if n < 3:
        return []
    if (row + side) % 2 == 0:
        return [(0, 1)] + ([(n // 2, min(n // 2 + 2, n - 1))] if n >= 6 else [])
    return [(1, min(3, n - 1))]


def store_with_spans(src, dst, unscored=default_unscored):
    """A copy of the prepared store ``src`` at ``dst`` with ``spans.bin`` written by hand (format version 2), as
    tests/test_spans.py does: ``unscored(row, side, n)`` gives each completion's unscored ranges, relative to it.
    Pair, unpaired and ranked stores. Returns ``dst``."""
    import shutil

    from prefpack.data.store import Store

    shutil.copytree(src, dst)
    store = Store(dst)
    spans = []
    for row in range(len(store)):
        off, p, c = (int(x) for x in store.index[row, :3])
        if store.kind == "pairs":
            r = int(store.index[row, 3])
            completions = [(off + p, c), (off + p + c, r)]
        elif store.kind == "unpaired":
            completions = [(off + p, c)]
        else:  # ranked: the offset column is the completion's own
            completions = [(off, c)]
        for side, (start, n) in enumerate(completions):
            spans.extend((start + a, start + b) for a, b in unscored(row, side, n) if b > a)
    table = np.asarray(sorted(spans), dtype=np.int64).reshape(-1, 2)
    table.tofile(Path(dst) / "spans.bin")
    meta = json.loads((Path(dst) / "meta.json").read_text())
    # version 2 at least (a version 4 store, with margins.bin, stays 4)
    meta.update(format_version=max(2, int(meta["format_version"])), num_spans=len(table))
    (Path(dst) / "meta.json").write_text(json.dumps(meta))
    return Path(dst)


def scored_logps_f64(model, prompt, completion, scored=None) -> np.ndarray:
    """The log-probs of a completion's scored tokens after its prompt (in token order), by one plain float64 forward
    of the sequence alone: the definition masked sums, lengths, tails and means are checked against."""
    ids = torch.tensor([[int(t) for t in prompt] + [int(t) for t in completion]])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.double()
    logp = torch.log_softmax(logits[0, :-1], -1)
    per_token = logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]][len(prompt) - 1:].numpy()
    return per_token if scored is None else per_token[np.asarray(scored, dtype=bool)]
