"""The text stores of the invariance tests (tests/invariance_cases.py) and the worlds built on them, one a kind:
the test modules (test_invariance_pairs.py, _kto.py, _groups.py) each build a family of them, so that
`make test`'s two workers share the families; test_entropy.py and test_mixtures.py reuse the rows."""

from __future__ import annotations

from conftest import prepare_hh_splits, store_with_spans, tiny_llama, write_jsonl

from prefpack.cli import main as cli_main
from prefpack.data.store import Store
from prefpack.data.views import PairGroups


def unpaired_rows(hh_train) -> dict[str, list[dict]]:
    """KTO examples from hh pairs: short, distinct prompts (the ends of real ones, numbered, so that truncation
    keeps them apart), two desirable examples in three."""
    rows = [{"prompt": f"Q{k}:{r['prompt'][-50:]}", "chosen": r["chosen"][:60], "rejected": r["rejected"][:60]}
            for k, r in enumerate(hh_train[:80])]
    rows = [r for r in rows if r["chosen"].strip() and r["rejected"].strip() and r["chosen"] != r["rejected"]]

    def unpaired(part):
        return [{"prompt": r["prompt"], "completion": r["chosen"] if k % 3 else r["rejected"], "label": bool(k % 3)}
                for k, r in enumerate(part)]

    return {"train": unpaired(rows[:19]), "eval": unpaired(rows[19:26])}


def unpaired_rows_shared(hh_train) -> dict[str, list[dict]]:
    """KTO examples whose prompts repeat: each pair's halves as two examples of one prompt (desirable, then
    undesirable), so prompt groups of two meet in steps and rows."""
    rows = [{"prompt": f"Q{k}:{r['prompt'][-50:]}", "chosen": r["chosen"][:60], "rejected": r["rejected"][:60]}
            for k, r in enumerate(hh_train[:80])]
    rows = [r for r in rows if r["chosen"].strip() and r["rejected"].strip() and r["chosen"] != r["rejected"]]

    def halves(part):
        return [{"prompt": r["prompt"], "completion": r[key], "label": key == "chosen"}
                for r in part for key in ("chosen", "rejected")]

    return {"train": halves(rows[:10]), "eval": halves(rows[10:14])}


def ranked_rows(hh_train) -> dict[str, list[dict]]:
    """Ranked rows from hh: a short prompt with its chosen, rejected and the next row's chosen reply (scores 3, 1, 2),
    and every third prompt a fourth reply (score 0), so that groups differ in size and in the pairs they yield."""
    rows = [r for r in hh_train[:60] if r["chosen"].strip() and r["rejected"].strip() and r["chosen"] != r["rejected"]]
    out = []
    for k, (r, nxt, far) in enumerate(zip(rows, rows[1:], rows[2:])):
        texts = [r["chosen"][:60], r["rejected"][:60], nxt["chosen"][:50]] + ([far["rejected"][:40]] if k % 3 == 0
                                                                              else [])
        if len(set(texts)) == len(texts):
            out.append({"prompt": f"Q{k}:{r['prompt'][-50:]}",
                        "completions": [{"text": t, "score": sc} for t, sc in zip(texts, (3, 1, 2, 0))]})
    return {"train": out[:8], "eval": out[8:12]}


def grouped_rows(hh_train) -> dict[str, list[dict]]:
    """Pair rows whose prompts repeat, interleaved: a short prompt with its chosen, rejected and the next row's chosen
    reply as pairs (chosen, rejected), (chosen, next), (next, rejected), every other prompt only the first pair."""
    rows = [r for r in hh_train[:60] if r["chosen"].strip() and r["rejected"].strip() and r["chosen"] != r["rejected"]]
    groups = []
    for k, (r, nxt) in enumerate(zip(rows, rows[1:])):
        p, c, j, n = f"Q{k}:{r['prompt'][-50:]}", r["chosen"][:60], r["rejected"][:60], nxt["chosen"][:50]
        if len({c, j, n}) == 3:
            pairs = [(c, j), (c, n), (n, j)] if k % 2 == 0 else [(c, j)]
            groups.append([{"prompt": p, "chosen": a, "rejected": b} for a, b in pairs])

    def interleaved(part):
        return [g[i] for i in range(3) for g in part if i < len(g)]

    return {"train": interleaved(groups[:8]), "eval": interleaved(groups[8:12])}


def reward_pair_rows(hh_train) -> dict[str, list[dict]]:
    """Pair rows for a reward model: short, distinct prompts (as unpaired_rows), and on two rows in three a per-pair
    `margin` (TRL's column: -0.5, 0, 0.5 or 1), so that each pair's margin must follow it through the layouts."""
    rows = [{"prompt": f"Q{k}:{r['prompt'][-50:]}", "chosen": r["chosen"][:60], "rejected": r["rejected"][:60]}
            for k, r in enumerate(hh_train[:60])]
    rows = [r for r in rows if r["chosen"].strip() and r["rejected"].strip() and r["chosen"] != r["rejected"]]
    rows = [{**r, **({"margin": (k % 4) * 0.5 - 0.5} if k % 3 else {})} for k, r in enumerate(rows)]
    return {"train": rows[:16], "eval": rows[16:22]}


def reward_unscored(row: int, side: int, n: int) -> list[tuple[int, int]]:
    """Unscored ranges for a reward model's completions: on a third of them the last two tokens (the reward is then
    read at the last scored token, two earlier), on another third the first token, the rest none."""
    if n < 4:
        return []
    return [[(n - 2, n)], [(0, 1)], []][(row + side) % 3]


def prepare_splits(root, tok, splits: dict[str, list[dict]], *args) -> dict:
    """Each split's rows prepared (`prefpack prepare`, 64 tokens at most) into ``root / name``."""
    for name, rows in splits.items():
        assert cli_main(["prepare", str(write_jsonl(root / f"{name}.jsonl", rows)), *args, "--tokenizer", str(tok),
                         "--output", str(root / name), "--max-length", "64", "--workers", "1"]) == 0
    return {name: root / name for name in splits}


# every world's run settings, before those of its objective (its "base")
RUN = ("optim.lr=1.0e-3", "optim.schedule=constant", "train.max_steps=3", "run.plot=false", "run.tensorboard=false",
       "train.micro_batch_tokens=4096", "data.max_tokens_per_row=1024")


def text_world(kind, tmp_path_factory, toy_tokenizers, hh_train) -> dict:
    """One objective's train and eval stores, a policy, a different reference (tiny Llamas) and its settings:

    * pairs: 24 train and 10 eval hh pairs, loss `sigmoid`, 8 pairs a step;
    * pairs_shared: the same with each pair's prompt laid out once (`data.prefix_sharing=true`);
    * kto: 19 unpaired train examples (12 desirable) and 7 eval ones, loss `kto`, 5 examples a step;
    * kto_shared: 20 train examples, 10 prompts with two completions each (and 8 eval ones), prompts laid out once;
    * ranked_shared: 8 train prompts (4 eval) with 3 or 4 scored completions, `data.ranked_pairs=all_pairs` (3 or 6
      pairs a prompt), 3 prompts a step, prompts laid out once;
    * grouped_shared: a pair store whose 8 train prompts (4 eval) have 3 or 1 pairs each, interleaved, read with
      `data.group_by_prompt=true` (each prompt and distinct completion once), 3 prompts a step;
    * spans_shared: pairs_shared's stores with unscored spans (``conftest.default_unscored``: a completion's first
      token, or a few inside), loss `sigmoid` + `ipo` (its per-token log-ratios count scored tokens);
    * kto_spans_shared: kto_shared's stores with unscored spans (in the main and the KL sequences);
    * reward_pairs_shared: a reward model (`train.objective=reward`, no reference) on 16 train pairs (no eval
      store) with a margin on two in three and unscored spans (``reward_unscored``: a third of the completions end
      unscored), prompts laid out once, 8 pairs a step;
    * reward_ranked_shared: a reward model on ranked_shared's train store (all pairs of each ranking, each completion's
      reward computed once), 3 prompts a step.
    """
    root = tmp_path_factory.mktemp(f"invariance-{kind}")
    tok = toy_tokenizers["llama"]
    if kind in ("pairs", "pairs_shared", "spans_shared"):
        stores = prepare_hh_splits(root, tok, hh_train, {"train": 24, "eval": 10})
        terms = "[{name: sigmoid}]"
        if kind == "spans_shared":
            stores = {name: store_with_spans(path, root / f"{name}_spans") for name, path in stores.items()}
            assert int(Store(stores["train"]).meta["num_spans"]) >= 24
            terms = "[{name: sigmoid}, {name: ipo, weight: 0.1}]"
        settings = {
            "size": 24, "sidecar": "ref_logps.safetensors", "precompute": [],
            "base": [f"loss.terms={terms}", "train.global_batch_pairs=8",
                     f"data.prefix_sharing={'false' if kind == 'pairs' else 'true'}"],
            "keys": ("loss", "rewards/margins", "rewards/chosen"),
            "precomputed": [],  # what reference.mode=precomputed needs besides the sidecar
            # several pairs a micro-batch, the last step wraps into the second epoch
            "ranks": ["train.global_batch_pairs=10", "train.micro_batch_tokens=256", "data.max_tokens_per_row=256",
                      "optim.schedule=cosine", "optim.warmup_steps=1"],
        }
    elif kind == "grouped_shared":
        stores = prepare_splits(root, tok, grouped_rows(hh_train))
        assert sorted(PairGroups(Store(stores["train"])).num_pairs.tolist()) == [1, 1, 1, 1, 3, 3, 3, 3]
        settings = {
            "size": len(grouped_rows(hh_train)["train"]), "sidecar": "ref_logps.safetensors",
            "precompute": [],
            "base": ["loss.terms=[{name: sigmoid}]", "train.global_batch_pairs=3", "data.group_by_prompt=true"],
            "keys": ("loss", "rewards/margins", "rewards/chosen"),
            "precomputed": [],
            "ranks": ["train.micro_batch_tokens=256", "data.max_tokens_per_row=256"],
        }
    elif kind == "ranked_shared":
        stores = prepare_splits(root, tok, ranked_rows(hh_train))
        settings = {
            "size": sum(len(r["completions"]) for r in ranked_rows(hh_train)["train"]),
            "sidecar": "ref_logps_ranked.safetensors", "precompute": [],
            "base": ["loss.terms=[{name: sigmoid}]", "train.global_batch_pairs=3", "data.ranked_pairs=all_pairs"],
            "keys": ("loss", "rewards/margins", "rewards/chosen"),
            "precomputed": [],
            # 3 prompts a step over two ranks: one rank holds twice the pairs of the other, which the step's
            # normalisation (by all its pairs) must not notice
            "ranks": ["train.micro_batch_tokens=256", "data.max_tokens_per_row=256"],
        }
    elif kind in ("reward_pairs_shared", "reward_ranked_shared"):
        data = reward_pair_rows(hh_train) if kind == "reward_pairs_shared" else ranked_rows(hh_train)
        # no eval store: only the reference tests (skipped for a reward model) read one
        stores = prepare_splits(root, tok, {"train": data["train"]})
        keys = ("loss", "rewards/margins", "rewards/accuracies", "rewards/chosen", "rewards/rejected_std")
        if kind == "reward_pairs_shared":
            stores = {name: store_with_spans(path, root / f"{name}_spans", reward_unscored)
                      for name, path in stores.items()}
            assert int(Store(stores["train"]).meta["format_version"]) == 4  # margins.bin, and spans.bin
            assert int(Store(stores["train"]).meta["num_spans"]) >= 16
            keys = (*keys, "rewards/target_margin")
        size = len(data["train"]) if kind == "reward_pairs_shared" else sum(len(r["completions"])
                                                                            for r in data["train"])
        settings = {
            "size": size, "sidecar": None, "precompute": [], "precomputed": [], "keys": keys,
            "base": ["train.objective=reward", "reference.mode=none", "data.prefix_sharing=true",
                     f"train.global_batch_pairs={8 if kind == 'reward_pairs_shared' else 3}"],
            # several pairs (prompts) a micro-batch over two ranks; the pairs' last step wraps into a second epoch
            "ranks": ["train.micro_batch_tokens=256", "data.max_tokens_per_row=256",
                      *(["train.global_batch_pairs=10", "optim.schedule=cosine", "optim.warmup_steps=1"]
                        if kind == "reward_pairs_shared" else [])],
        }
    else:
        data = unpaired_rows(hh_train) if kind == "kto" else unpaired_rows_shared(hh_train)
        stores = prepare_splits(root, tok, data, "--format", "unpaired")
        if kind == "kto_spans_shared":
            stores = {name: store_with_spans(path, root / f"{name}_spans") for name, path in stores.items()}
        settings = {
            "size": len(data["train"]), "sidecar": "ref_logps_kto.safetensors",
            "precompute": ["--seed", "0"],
            "base": ["loss.terms=[{name: kto}]", "train.global_batch_pairs=5",
                     f"data.prefix_sharing={'false' if kind == 'kto' else 'true'}"],
            "keys": ("loss", "kl", "rewards/margins", "count/chosen", "count/rejected"),
            # the sidecar holds the KL log-probs of the fixed pairing of train.seed 0 (precompute-ref --seed 0)
            "precomputed": ["loss.kl_pairing=fixed"],
            # 3 examples a step, one a micro-batch: one of the two ranks runs a weight-0 duplicate, which the KL
            # reference point (all-reduced sum and count) must not count
            "ranks": ["train.global_batch_pairs=3", "train.micro_batch_tokens=64", "data.max_tokens_per_row=64",
                      "loss.beta=0.5"],
        }
    reward = kind.startswith("reward")  # a reward model reads no reference: none to build
    policy, ref = tiny_llama(tok, root / "policy", 1), None if reward else tiny_llama(tok, root / "ref", 2)
    # what `cfg_for(world, ...)` sets besides the model, the train store and the run folder
    run_settings = [*([] if reward else [f"reference.model={ref}"]), *RUN, *settings.pop("base")]
    return {"kind": kind, "root": root, "tok": tok, **stores, **settings, "settings": run_settings,
            "policy": policy, "ref": ref}
