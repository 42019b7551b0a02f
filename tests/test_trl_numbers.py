"""`prefpack eval --loss NAME` against TRL 1.16's own DPOTrainer loss, for every TRL loss type, to 1e-4.

TRL's numbers were recorded once by benchmarks/trl_losses.py into tests/data/trl_losses.json (TRL is an
optional dependency and is not imported here): DPOTrainer.evaluate() on the 16 pairs of
tests/data/trl_losses/pairs.jsonl as one eval batch, float32 on CPU, with the saved toy tokenizer, the
reference tests/data/trl_losses/reference and the policy tests/data/trl_losses/policy (the reference plus
seeded noise, so every log-ratio is non-zero). sppo_hard is scored with policy_sppo instead, whose log-ratios
sit near sppo_hard's targets +-0.5/beta: sppo_hard squares summed log-ratios, and 12 nats away from its targets
float32 rounding alone moves it by 2e-4 (see the script). TRL's defaults (beta 0.1, label_smoothing 0,
discopop_tau 0.05; exo_pair with 1e-3, as TRL refuses 0) and a few non-default variants.

Reductions: TRL reduces every loss type by the mean over the batch's pairs, as `prefpack eval` does. `sft` (a
token mean over every chosen token of the batch) and `aot`/`aot_unpaired` (sorted over the batch) are
batch-level, so prefpack scores the whole store in one micro-batch here (`--micro-batch-tokens` above the
store's token count), as TRL's single batch holds every pair.

A TRL loss type whose prefpack name is not registered in `prefpack.losses.PAIR_LOSSES` is skipped, by name,
with TRL's value in the reason; a non-default TRL parameter prefpack has no flag for is skipped the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from prefpack.cli import main as cli_main
from prefpack.data.store import Store
from prefpack.loss_params import LOSS_PARAMS
from prefpack.losses import PAIR_LOSSES

DATA = Path(__file__).resolve().parent / "data"
ASSETS = DATA / "trl_losses"
RECORD = json.loads((DATA / "trl_losses.json").read_text(encoding="utf-8"))
CASES = RECORD["cases"]
TOL = 1e-4
TRL = f"TRL {RECORD['trl_version']}"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """`prefpack prepare` of the recorded pairs with the saved tokenizer; its ids must be the ones TRL scored."""
    out = tmp_path_factory.mktemp("trl_numbers") / "store"
    code = cli_main(["prepare", str(ASSETS / "pairs.jsonl"), "--tokenizer", str(ASSETS / "tokenizer"),
                     "--output", str(out), "--max-length", str(RECORD["assets"]["prepare_max_length"])])
    assert code == 0
    st = Store(out)
    ids = [{k: np.asarray(getattr(st.pair(i), k)).tolist() for k in ("prompt", "chosen", "rejected")}
           for i in range(len(st))]
    if ids != RECORD["token_ids"]:
        bad = [f"pair {i} {k}" for i, (a, b) in enumerate(zip(ids, RECORD["token_ids"])) for k in a if a[k] != b[k]]
        pytest.fail(f"prefpack prepare tokenises the pairs unlike the ids {TRL} scored ({len(ids)} pairs stored, "
                    f"{len(RECORD['token_ids'])} recorded; differing: {bad[:10]}): the losses are not comparable")
    tokens = int(sum(2 * len(x["prompt"]) + len(x["chosen"]) + len(x["rejected"]) for x in ids))
    return {"path": out, "pairs": len(ids), "tokens": tokens}


def prefpack_eval(store, capsys, loss: str, flags: list[str], policy: str = "policy") -> dict:
    capsys.readouterr()
    code = cli_main(["eval", "--model", str(ASSETS / policy), "--ref", str(ASSETS / "reference"),
                     "--data", str(store["path"]), "--loss", loss, "--json", "--device", "cpu",
                     "--dtype", "float32", "--micro-batch-tokens", str(max(store["tokens"], 4096)), *flags])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out.strip().splitlines()[-1])


def flags_for(case) -> list[str]:
    """prefpack flags for TRL's settings; skips when TRL read a non-default setting prefpack has no flag for."""
    flags = []
    for key, value in case["settings"].items():
        if key in LOSS_PARAMS:
            flags += [LOSS_PARAMS[key].flag, repr(float(value))]
        elif key == "use_weighting":
            flags += ["--use-weighting" if value else "--no-use-weighting"]
        elif key == "f_divergence_type":
            flags += ["--f-divergence-type", value]
        elif key in case["reads"] and not case["trl_defaults"]:
            pytest.skip(f"{case['id']}: prefpack has no loss.{key} parameter to pass {TRL}'s {key}={value} "
                        f"({TRL} loss {case['loss']:.7f})")
    return flags


def test_record_covers_every_trl_loss_type():
    """Every loss type TRL accepts has a case with TRL's defaults (the JSON is what the script wrote)."""
    with_defaults = {c["trl_loss_type"] for c in CASES if c["trl_defaults"]}
    exo = [c for c in CASES if c["trl_loss_type"] == "exo_pair"]  # TRL refuses exo_pair with label_smoothing 0
    assert with_defaults | {"exo_pair"} == set(RECORD["trl_loss_types"]) and exo
    assert len(RECORD["trl_loss_types"]) == 15 and RECORD["assets"]["pairs"] == len(RECORD["token_ids"])


def test_log_probs_match_trl(store, capsys):
    """The sequence log-probs under both models agree first (else every loss below differs for that reason)."""
    trl = next(c for c in CASES if c["id"] == "sigmoid")
    got = prefpack_eval(store, capsys, "sigmoid", ["--beta", "0.1"])
    assert got["pairs"] == store["pairs"]
    for key in ("logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert got[key] == pytest.approx(trl["metrics"][key], abs=TOL), key
    assert got["rewards/accuracies"] == trl["metrics"]["rewards/accuracies"]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_prefpack_eval_gives_trls_loss(case, store, capsys):
    name = case["prefpack_loss"]
    if name not in PAIR_LOSSES:
        pytest.skip(f"{case['id']}: no prefpack pair loss {name!r} registered yet ({TRL} loss {case['loss']:.7f})")
    got = prefpack_eval(store, capsys, name, flags_for(case), case["policy"])
    assert got["pairs"] == store["pairs"]
    diff = got["loss"] - case["loss"]
    # WPO's weights make these losses tiny on the toy models (about 4e-5): also hold them to 0.1% of their value
    tol = min(TOL, 1e-3 * abs(case["loss"])) if case["settings"].get("use_weighting") else TOL
    assert abs(diff) <= tol, (
        f"{case['id']}: prefpack eval --loss {name} gives {got['loss']:.7f}, {TRL} gives {case['loss']:.7f} "
        f"(float64: {case['loss_float64']:.7f}) with {case['policy']}; difference {diff:+.2e} > {tol:g}. "
        f"TRL's reduction: {case['reduction']}; settings {case['settings']} (TRL reads {case['reads']})")
