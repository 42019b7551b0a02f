"""The kernel table (prefpack/model/attention/kernels.py): every rule the package had by kernel name, read from the
descriptors, for the table's names and for names it does not know; no name tested outside model/attention/; one
sliding-window check run over the kernels prefpack registers."""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest
import torch
from test_packing import VOCAB
from test_varlen import FakeKernel

from prefpack.model.attention import varlen as va
from prefpack.model.attention.kernels import KERNELS, kernel_named, pick_attention

ROOT = Path(__file__).resolve().parent.parent / "prefpack"
NAMES = [k.name for k in KERNELS]  # a list: the same order in every process (pytest-xdist)


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for elt in node.elts for s in _strings(elt)]
    return []


def _names_kernel(texts: list[str]) -> bool:
    return any(s in NAMES or "flash" in s or "sdpa" in s or "varlen" in s for s in texts)


def kernel_name_tests(source: str) -> list[int]:
    """Lines comparing something with a kernel's name: a string that is (or mentions) one, a module constant
    holding such strings (``_TOWER_KERNELS = ("sdpa", ...)``), a name imported from model/attention/ or spelling one
    (``PACKED_SDPA``), or a module's ``NAME`` (``varlen.NAME``)."""
    tree = ast.parse(source)
    ours = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("prefpack.model.attention") for a in node.names}
    constants = {t.id: [s.lower() for s in _strings(node.value)] for node in tree.body if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name)}
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for operand in (node.left, *node.comparators):
            texts = [s.lower() for s in _strings(operand)]
            texts += [s for n in ast.walk(operand) if isinstance(n, ast.Name) for s in constants.get(n.id, ())]
            named = _names_kernel(texts)
            imported = any(isinstance(n, ast.Name) and (n.id in ours or n.id.lower() in NAMES)
                           for n in ast.walk(operand))
            if named or imported or (isinstance(operand, ast.Attribute) and operand.attr == "NAME"):
                lines.append(node.lineno)
                break
    return lines


def test_no_kernel_name_is_tested_outside_the_attention_folder():
    """A new rule about kernels goes in the table, not in an ``if name == ...`` elsewhere."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.parent.relative_to(ROOT).parts[:2] == ("model", "attention"):
            continue
        found += [f"{path.relative_to(ROOT.parent)}:{line}" for line in kernel_name_tests(path.read_text())]
    assert found == []


def test_the_checker_finds_name_tests():
    """What the package had before the table: each form is found; reading a descriptor is not."""
    for source in ('x = "flash" in impl.lower() or impl == varlen.NAME', "ok = name in (PACKED_SDPA, 'x')",
                   "from prefpack.model.attention.packed_sdpa import NAME as P\nok = n == P",
                   'ok = packing and name == "packed_sdpa"', 'ok = attn not in ("sdpa", "eager")',
                   '_TOWER_KERNELS = ("sdpa", "eager")\nok = attn if attn in _TOWER_KERNELS else "sdpa"'):
        assert kernel_name_tests(source), source
    assert kernel_name_tests('ok = kernel_of(model).flattens_rows and mode == "auto"') == []
    assert kernel_name_tests('MODES = ("a", "b")\nok = kernel_named(attn).runs_vision_tower and m in MODES') == []


# Today's rules, by name, as the package stated them before the table (forward.py, setup.py, rules.py).
def _flattens(name):
    return "flash" in name.lower() or name == "varlen"


@pytest.mark.parametrize("name", [*NAMES, "flash_attention_3", "flex_attention", "sdpa_paged",
                                  "kernels-community/flash-attn", "Flash_Custom", ""])
def test_every_name_keeps_its_rules(name):
    k = kernel_named(name)
    assert k.name == name
    assert k.flattens_rows == _flattens(name)
    assert k.reads_prompt_groups == (name in ("packed_sdpa", "varlen"))
    assert k.prefix_sharing_auto == (name in ("packed_sdpa", "varlen"))  # varlen: measured on an H100, 2026-11-24
    assert k.boundary_kwargs == (name == "varlen")
    assert k.needs_cuda == (name == "flash_attention_2")
    assert k.fallback == ("eager" if name in ("sdpa", "packed_sdpa") else None)
    assert k.cudnn_sdp_off == (name == "sdpa")
    assert [f for f, _ in k.refuses] == (["attn_logit_softcapping"] if name == "varlen" else [])
    # model/vision.py's list of the kernels a vision tower may run (transformers' own)
    assert k.runs_vision_tower == (name in ("sdpa", "eager", "flash_attention_2", "flash_attention_3"))
    for flatten in (False, True):  # forward: varlen either way, packed_sdpa unflattened only
        assert k.runs_prompt_groups(flatten) == (name == "varlen" or (name == "packed_sdpa" and not flatten))


def test_the_registered_kernels_are_the_modules_names():
    from prefpack.model.attention import packed_sdpa

    assert {k.name for k in KERNELS if k.register is not None} == {packed_sdpa.NAME, va.NAME}


def test_auto_reads_the_table_in_order(monkeypatch):
    cuda, cpu, mps = torch.device("cuda"), torch.device("cpu"), torch.device("mps")
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails: not installed
    assert pick_attention("auto", cpu, torch.bfloat16) == "packed_sdpa"
    assert pick_attention("auto", cpu) == "packed_sdpa"
    assert pick_attention("auto", mps, torch.float16) == "sdpa"
    assert pick_attention("auto", cuda, torch.float16) == ("varlen" if va.torch_varlen_kernel() else "sdpa")
    assert pick_attention("auto", cuda) == "sdpa"
    assert pick_attention("flex_attention", cuda) == "flex_attention"
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    assert pick_attention("auto", cuda, torch.float32) == "flash_attention_2"  # installed: first on CUDA
    assert pick_attention("auto", cpu, torch.float32) == "packed_sdpa"


@pytest.mark.parametrize("name", sorted(NAMES))
def test_the_config_refuses_a_cuda_only_kernel_on_cpu(name):
    from prefpack.config import ConfigError, load_config

    cfg = load_config(None, ["model.name_or_path=m", "data.train=store", "train.device=cpu",
                             f"model.attn_implementation={name}"])
    if kernel_named(name).needs_cuda:
        with pytest.raises(ConfigError, match=f"'{name}' needs CUDA but train.device is 'cpu'"):
            cfg.validate()
    else:
        cfg.validate()


CPU_KERNELS = [k.name for k in KERNELS if k.register is not None and not k.needs_cuda]


@pytest.mark.parametrize("attn", CPU_KERNELS)
def test_a_kernel_keeps_a_sliding_window(attn, monkeypatch):
    """Mistral with window 4: blocks longer than the window get the band, like sdpa's mask. varlen runs with the
    stand-in kernel (torch's runs only on CUDA), which must be handed window_size (3, 0)."""
    import transformers as tf

    stand_in = FakeKernel(True)
    monkeypatch.setattr(va, "_usable_kernel", lambda q: (stand_in, True, True))
    kernel_named(attn).register()
    cfg = tf.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(cfg).double().eval()
    position_ids = torch.cat([torch.arange(n) for n in (7, 3, 1, 9)])[None]
    ids = torch.randint(0, VOCAB, position_ids.shape)
    out = {}
    for name in ("sdpa", attn):
        model.set_attn_implementation(name)
        with torch.no_grad():
            out[name] = model.model(input_ids=ids, position_ids=position_ids, use_cache=False).last_hidden_state
    torch.testing.assert_close(out[attn], out["sdpa"], rtol=0, atol=1e-12)
    assert bool(stand_in.calls) == (attn == va.NAME)
    assert {c["window"] for c in stand_in.calls} <= {(3, 0)}
    model.config.sliding_window = None  # the window matters here: without it the states move by O(1)
    with torch.no_grad():
        unbanded = model.model(input_ids=ids, position_ids=position_ids, use_cache=False).last_hidden_state
    assert (unbanded - out["sdpa"]).abs().max() > 1e-2
