"""The loss registry: one registration per loss feeds config validation, the reference decision, the reward
metrics and `prefpack eval`'s flags; eval --config scores exactly as the run trained."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import cfg_for, metrics_lines
from test_train import world as world  # noqa: F401 - a module-scoped fixture shared with test_train

from prefpack.cli import build_parser
from prefpack.cli import main as cli_main
from prefpack.config import ConfigError, LossConfig, load_config
from prefpack.loss_params import LOSS_PARAMS
from prefpack.losses import (
    PAIR_LOSSES,
    LossTerm,
    PairLogps,
    PairLossSpec,
    needs_reference,
    preference_loss,
    register_pair_loss,
)
from prefpack.training import train


def test_config_loss_section_is_the_parameter_table():
    defaults = LossConfig()
    assert {n: getattr(defaults, n) for n in LOSS_PARAMS} == {n: p.default for n, p in LOSS_PARAMS.items()}
    assert all(set(spec.params) <= set(LOSS_PARAMS) for spec in PAIR_LOSSES.values())


def test_eval_has_a_flag_for_every_loss_parameter():
    eval_parser = build_parser()._subparsers._group_actions[0].choices["eval"]
    flags = {opt for action in eval_parser._actions for opt in action.option_strings}
    assert {p.flag for p in LOSS_PARAMS.values()} <= flags and "--simpo-gamma" in flags


def test_one_registration_adds_a_loss():
    """A new loss: a pure function and one register call; config, reference needs and rewards follow."""
    register_pair_loss(PairLossSpec("squared_margin", lambda x: (1 - x.beta * (x.chosen_logratio
                                                                              - x.rejected_logratio)) ** 2,
                                    needs_reference=True, rewards="logratio"))
    try:
        load_config(None, ["model.name_or_path=m", "data.train=s",
                           "loss.terms=[{name: squared_margin, weight: 1.0}]"]).validate()
        terms = [LossTerm("squared_margin", 1.0)]
        assert needs_reference(terms)
        g = torch.Generator().manual_seed(0)
        pc, pr, rc, rr = (torch.randn(5, dtype=torch.float64, generator=g) * 3 for _ in range(4))
        n = torch.full((5,), 4.0, dtype=torch.float64)
        out = preference_loss(PairLogps(pc, pr, n, n, rc, rr), terms, beta=0.2)
        expected = (1 - 0.2 * ((pc - rc) - (pr - rr))) ** 2
        torch.testing.assert_close(out.loss, expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(out.metrics["rewards/chosen"], 0.2 * (pc - rc), rtol=0, atol=1e-12)
        with pytest.raises(ValueError, match="registered twice"):
            register_pair_loss(PAIR_LOSSES["squared_margin"])
    finally:
        PAIR_LOSSES.pop("squared_margin", None)
    with pytest.raises(ConfigError, match="unknown loss 'squared_margin'"):
        load_config(None, ["model.name_or_path=m", "data.train=s",
                           "loss.terms=[{name: squared_margin, weight: 1.0}]"]).validate()


def test_eval_with_the_run_config_scores_as_the_run_trained(world, tmp_path, capsys):  # noqa: F811
    """A run with two weighted terms and non-default parameters: its own final eval loss equals
    `prefpack eval --config RUN_DIR/config.yaml` on the same store, and the flags override it."""
    run = tmp_path / "run"
    train(cfg_for(world, run, "train.device=cpu", f"data.eval={world['eval']}", "loss.beta=0.3",
                  "loss.terms=[{name: sigmoid, weight: 1.0}, {name: nll, weight: 0.25}]"),
          log=lambda m: None, progress=False)
    trained = metrics_lines(run, split="eval")[-1]
    base = ["eval", "--model", str(run / "final"), "--ref", str(world["policy"]), "--data", str(world["eval"]),
            "--device", "cpu", "--json", "--config", str(run / "config.yaml")]
    assert cli_main(base) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["loss"] == pytest.approx(trained["loss"], abs=1e-6)
    assert got["loss/nll"] == pytest.approx(trained["loss/nll"], abs=1e-6)
    # without --config, RUN_DIR/final is scored with RUN_DIR/config.yaml's loss all the same (issue 51); a copy of
    # the model outside the run folder with the defaults (sigmoid alone, beta 0.1), another number
    assert cli_main(base[:-2]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(trained["loss"], abs=1e-6)
    shutil.copytree(run / "final", tmp_path / "alone")
    assert cli_main(["eval", "--model", str(tmp_path / "alone"), *base[3:-2]]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] != pytest.approx(trained["loss"], abs=1e-4)
    # --beta overrides the config
    assert cli_main([*base, "--beta", "0.1"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] != pytest.approx(trained["loss"], abs=1e-4)


def test_a_new_loss_parameter_is_one_row():
    """The config's loss section and eval's flags are built from LOSS_PARAMS: one row adds both."""
    import dataclasses

    from prefpack.config import schema
    from prefpack.loss_params import LossParam

    LOSS_PARAMS["margin_scale"] = LossParam("margin_scale", 2.5, "a test-only parameter")
    try:
        section = schema._loss_config()
        field = {f.name: f for f in dataclasses.fields(section)}["margin_scale"]
        assert section().margin_scale == 2.5 and field.metadata["help"] == "a test-only parameter"
        eval_parser = build_parser()._subparsers._group_actions[0].choices["eval"]
        assert "--margin-scale" in {opt for action in eval_parser._actions for opt in action.option_strings}
    finally:
        del LOSS_PARAMS["margin_scale"]
