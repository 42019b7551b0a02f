"""``train.objective`` is looked up in one table (``prefpack/objectives/names.py``): the config's choices are its rows,
its rows name registry rows that exist, and no module tests an objective's name (as ``tests/test_kernels.py`` and
``tests/test_vision_families.py`` check their tables)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from prefpack.config import load_config
from prefpack.config.schema import Objective
from prefpack.objectives.names import LAYOUTS, OBJECTIVE_NAMES, TRAIN_OBJECTIVES, train_objective

PACKAGE = Path(__file__).resolve().parent.parent / "prefpack"
TABLE = PACKAGE / "objectives" / "names.py"
_NAMES = "|".join(map(re.escape, OBJECTIVE_NAMES))
NAME_TEST = re.compile(rf"""^(?=.*objective).*((==|!=|\bin\b)\s*[(\[{{]?\s*["']({_NAMES})["']|["']({_NAMES})["']\s*(==|!=))""")
"""A line that compares something named ``objective`` with one of the table's names (``==``, ``!=``, ``in (...)``,
either side)."""


def test_the_config_offers_the_tables_rows():
    """Every ``Objective`` choice has a row and every row is a choice, in the table's order (the first the default)."""
    assert get_args(Objective) == tuple(TRAIN_OBJECTIVES) == OBJECTIVE_NAMES
    assert load_config(None, []).train.objective == OBJECTIVE_NAMES[0]
    for name, row in TRAIN_OBJECTIVES.items():
        assert row.name == name and train_objective(name) is row
        assert load_config(None, [f"train.objective={name}"]).train.objective == name
    with pytest.raises(ValueError, match="unknown train.objective 'nope'"):
        train_objective("nope")


def test_rows_name_registry_rows_that_read_their_layout():
    """Each row names, per store layout, a registry row (or None) whose output is the row's head's: log-probs for the
    LM head, rewards for a score head; an unpaired layout's row is an unpaired objective; every registry row is named."""
    from prefpack.objectives.registry import OBJECTIVES

    named = set()
    for row in TRAIN_OBJECTIVES.values():
        assert set(row.rows) == set(LAYOUTS), row.name
        assert row.head in ("lm", "score") and row.sequence_classifier == (row.head == "score")
        assert row.lora_task == ("SEQ_CLS" if row.sequence_classifier else "CAUSAL_LM")
        for layout, spec_name in row.rows.items():
            if spec_name is None:
                continue
            spec = OBJECTIVES[spec_name]
            named.add(spec_name)
            assert spec.output == ("rewards" if row.head == "score" else "logps"), (row.name, spec_name)
            assert spec.unpaired == (layout == "unpaired"), (row.name, layout)
            assert ("ranked" in spec.reads) == (layout == "groups"), (row.name, layout)
    assert named == set(OBJECTIVES)


@pytest.mark.parametrize(("objective", "kind", "unpaired", "grouped", "want"), [
    ("preference", "pairs", False, False, "pairs"),
    ("preference", "pairs", False, True, "groups"),
    ("preference", "ranked", False, False, "groups"),
    ("preference", "unpaired", True, False, "kto"),
    ("preference", "pairs", True, False, "kto"),  # data.paired_as_kto
    ("reward", "pairs", False, False, "reward"),
    ("reward", "pairs", False, True, "reward_groups"),
    ("reward", "ranked", False, False, "reward_groups"),
])
def test_objective_for_picks_the_rows_class(objective, kind, unpaired, grouped, want):
    from prefpack.objectives.registry import OBJECTIVES, objective_for

    assert objective_for(kind, unpaired=unpaired, group_by_prompt=grouped, objective=objective) is OBJECTIVES[want]


def test_a_layout_the_objective_does_not_read_is_refused():
    from prefpack.objectives.registry import objective_for

    with pytest.raises(ValueError, match="train.objective=reward does not train unpaired examples"):
        objective_for("unpaired", unpaired=True, objective="reward")


def test_what_the_rows_answer_for_a_config():
    """The lookups that replaced the name tests answer as the tests did: a reward model reads no reference and
    ranks all pairs; the preference objective reads one (if its losses do) and ranks best against the rest."""
    from prefpack.objectives.settings import ranked_pairs

    pref = load_config(None, [])
    reward = load_config(None, ["train.objective=reward"])
    assert pref.needs_reference() and not reward.needs_reference()
    assert ranked_pairs(pref) == "best_vs_rest" and ranked_pairs(reward) == "all_pairs"
    assert ranked_pairs(load_config(None, ["train.objective=reward", "data.ranked_pairs=best_vs_rest"])) == \
        "best_vs_rest"
    r = train_objective(reward)
    assert (r.reads_margins, r.sets_pad_token, r.token_shards, r.four_bit, r.rounds) == (True, True, False, False,
                                                                                          False)
    p = train_objective(pref)
    assert (p.reads_margins, p.sets_pad_token, p.token_shards, p.four_bit, p.rounds) == (False, False, True, True,
                                                                                          True)


def test_no_objective_name_is_tested_outside_the_table():
    """``objective == "reward"`` and the like live in no module but the table's: a new objective is a row, not a
    hunt for branches."""
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == TABLE:
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if NAME_TEST.search(line):
                hits.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}")
    assert hits == [], "\n".join(hits)
    for caught in ('if cfg.train.objective != "reward":', "getattr(cfg.train, 'objective', 'preference') == 'reward'",
                   'if cfg.train.objective in ("reward", "pg"):', 'if "preference" == cfg.train.objective:',
                   'reward=cfg.train.objective == "reward", log=log)'):
        assert NAME_TEST.search(caught), caught
    for fine in ('cfg.train.objective = "reward"  # a one-label classifier', 'log(f"train.objective=reward ...")'):
        assert NAME_TEST.search(fine) is None, fine


def test_the_objectives_package_loads_without_torch():
    """The config reads ``objectives/names.py``; the package loads its other modules on first use."""
    code = "import sys, prefpack.objectives.names, prefpack.objectives; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
