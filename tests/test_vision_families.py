"""The vision-family table (prefpack/vision_families/): one descriptor per family, read everywhere in place of
family names; its model-side modules (prefpack/model/vision/) and toy assets keyed by the same names; torch-free
for prepare; no family's name tested outside its own modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from prefpack.vision_families import (
    FAMILIES,
    SUPPORTED,
    family_for_processor,
    family_named,
    family_of_model_type,
    family_of_store,
)

ROOT = Path(__file__).resolve().parent.parent / "prefpack"
NAMES = sorted({*FAMILIES, *SUPPORTED})


def test_every_family_has_its_model_side_and_toy():
    from prefpack.model.vision import FAMILY_MODULES
    from prefpack.model.vision.parts import FamilyModule
    from prefpack.toy_vision import VLM_KINDS

    assert list(FAMILY_MODULES) == list(FAMILIES) == list(VLM_KINDS)
    wanted = [n for n in dir(FamilyModule) if not n.startswith("_")]
    for name, module in FAMILY_MODULES.items():
        assert module.FAMILY is FAMILIES[name]
        assert module.__name__ == f"prefpack.model.vision.{name}"
        assert [n for n in wanted if not callable(getattr(module, n, None))] == [], name


def test_todays_families_keep_their_rules():
    """What the package said by name before the table: model types, 3-D rope, the names stores hold."""
    assert {t: family_of_model_type(t).name for t in SUPPORTED} == {"qwen2_vl": "qwen2_vl",
                                                                     "qwen2_5_vl": "qwen2_vl", "llava": "llava"}
    assert family_of_model_type("gemma3") is None
    assert [f.name for f in FAMILIES.values() if f.mrope] == ["qwen2_vl"]
    assert [f.name for f in FAMILIES.values() if not f.hashes_kind] == ["qwen2_vl"]  # its stores' hashes stay
    assert family_of_store({}).name == "qwen2_vl"  # stores from before meta.json named the family
    assert family_of_store({"kind": "llava"}).name == "llava"
    with pytest.raises(KeyError, match="unknown vision-language family 'gemma3'"):
        family_named("gemma3")


def test_a_processor_folder_is_matched_by_class_then_by_image_processor():
    grid = SimpleNamespace(merge_size=2, get_number_of_image_patches=lambda h, w, kw: 16)
    clip = SimpleNamespace(do_center_crop=True, crop_size={"height": 28, "width": 28})
    assert family_for_processor({}, grid).name == "qwen2_vl"
    assert family_for_processor({"processor_class": "LlavaProcessor"}, clip).name == "llava"
    assert family_for_processor({"processor_class": "LlavaProcessor"}, grid).name == "llava"  # the class decides
    assert family_for_processor({}, clip) is None
    assert family_for_processor({"processor_class": "Idefics3Processor"}, clip) is None
    assert FAMILIES["qwen2_vl"].count_tokens(grid, {}, 56, 56) == 4
    settings = {"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}
    assert FAMILIES["llava"].count_tokens(clip, settings, 100, 60) == 4


def test_prepare_side_loads_without_torch():
    code = ("import sys, prefpack.vision_families, prefpack.data.images, prefpack.data.inspect\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def family_name_tests(source: str) -> list[int]:
    """Lines comparing something with a family's name or a model type it trains: a string, or a name assigned such
    strings (a literal, a tuple, list or set of them, ``a if c else b``) anywhere in the module."""
    tree = ast.parse(source)

    def strings(node):
        return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]

    literal = (ast.Constant, ast.Tuple, ast.List, ast.Set, ast.IfExp)  # not a table (a dict) nor a call's result
    constants = {t.id: strings(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and isinstance(node.value, literal) for t in node.targets if isinstance(t, ast.Name)}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            texts = strings(node) + [s for n in ast.walk(node) if isinstance(n, ast.Name)
                                     for s in constants.get(n.id, ())]
            if any(s in NAMES for s in texts):
                lines.append(node.lineno)
    return lines


def test_no_family_name_is_tested_outside_its_modules():
    """A rule about a family goes in its descriptor or its model-side module, not in an ``if kind == ...``."""
    own = {ROOT / "vision_families", *(ROOT / "model" / "vision" / f"{name}.py" for name in FAMILIES)}
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path in own or path.parent in own:
            continue
        found += [f"{path.relative_to(ROOT.parent)}:{line}" for line in family_name_tests(path.read_text())]
    assert found == []


def test_the_checker_finds_family_tests():
    for source in ('want = "qwen2_vl" if mrope else "llava"\nok = kind != want', 'ok = proc.get("kind") == "llava"',
                   'MROPE_TYPES = ("qwen2_vl", "qwen2_5_vl")\nok = config.model_type in MROPE_TYPES'):
        assert family_name_tests(source), source
    assert family_name_tests('ok = family_of_model_type(t).mrope and kind == "pairs"') == []
    assert family_name_tests('TOYS = {"llava": 1}\nok = kind in TOYS') == []
