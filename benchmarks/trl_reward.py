"""TRL 1.16's RewardTrainer on fixed tiny weights and pairs: the numbers tests/test_reward_trl.py checks prefpack's
reward model against (TRL stays an optional dependency: the numbers are recorded once, here).

Reuses the assets of benchmarks/trl_losses.py (tests/data/trl_losses/): its Llama-style toy tokenizer (pad token
of its own), its `reference/` causal LM (2 layers, hidden 16, `initializer_range` 0.5) and its 16 hh-rlhf pairs.
The pairs are handed to TRL already tokenised (`chosen_ids` / `rejected_ids`: prompt + completion ids exactly as
`prefpack prepare --max-length 512` stores them, EOS included), so both score the same tokens; a `margin` column
(seeded, in [-1, 1]) is given too.

For each case RewardTrainer loads the causal LM as AutoModelForSequenceClassification(num_labels=1) after
`set_seed(0)` (its new `score` head is recorded), and `trainer.evaluate()` scores the 16 pairs as ONE eval batch
(float32, CPU, sdpa, dropout off): its loss (mean over pairs of -logsigmoid(r_c - r_r [- margin]) [+ coef *
mean((r_c + r_r)^2)]), accuracy, margin and mean reward; the per-sequence rewards are the model's own logits on
that batch. Then one optimizer step (AdamW, lr 1e-2, the 16 pairs as one batch, no warmup, no clipping... as set
below) and the rewards after it.

    PYTHONPATH=/path/to/trl-1.16:. python benchmarks/trl_reward.py      # about 10 s on 2 CPU cores
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "tests" / "data" / "trl_losses"
OUT = REPO / "tests" / "data" / "trl_reward.json"
SEED = 0
LR = 1e-2
CASES = [{}, {"margin": True}, {"center_rewards_coefficient": 0.05}, {"margin": True, "center_rewards_coefficient": 0.05}]


def store_ids(work: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt + chosen, prompt + rejected) ids of the 16 pairs as prefpack's store holds them."""
    from prefpack.data.prepare import PrepareOptions, prepare
    from prefpack.data.store import Store

    prepare(PrepareOptions(inputs=[str(ASSETS / "pairs.jsonl")], tokenizer=str(ASSETS / "tokenizer"),
                           output=str(work / "store"), max_length=512, workers=1), log=lambda m: None)
    store = Store(work / "store")
    out = []
    for i in range(len(store)):
        p, c, r = store.pair(i)
        out.append(([int(t) for t in p] + [int(t) for t in c], [int(t) for t in p] + [int(t) for t in r]))
    return out


def run_case(case: dict, ids, margins, work: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    rows = {"chosen_ids": [c for c, _ in ids], "rejected_ids": [r for _, r in ids]}
    if case.get("margin"):
        rows["margin"] = margins
    data = Dataset.from_dict(rows)
    args = RewardConfig(output_dir=str(work / "out"), seed=SEED, per_device_eval_batch_size=len(ids),
                        per_device_train_batch_size=len(ids), learning_rate=LR, lr_scheduler_type="constant",
                        warmup_steps=0, max_grad_norm=0.0, weight_decay=0.0, max_steps=1, bf16=False,
                        use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, dataloader_drop_last=False,
                        center_rewards_coefficient=case.get("center_rewards_coefficient"),
                        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
                        remove_unused_columns=False)
    tok = AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    trainer = RewardTrainer(model=str(ASSETS / "reference"), args=args, train_dataset=data, eval_dataset=data,
                            processing_class=tok)
    model = trainer.model
    head = model.score.weight.detach().clone()
    collated = trainer.data_collator([data[i] for i in range(len(data))])

    def rewards() -> list[float]:
        model.eval()
        with torch.no_grad():
            out = model(input_ids=collated["input_ids"], attention_mask=collated["attention_mask"], use_cache=False)
        return [float(x) for x in out.logits.squeeze(-1)]

    before = rewards()
    metrics = trainer.evaluate()
    trainer.train()
    after = rewards()
    n = len(ids)
    return {"case": case, "score_weight": [float(x) for x in head.reshape(-1)],
            "pad_token_id": int(model.config.pad_token_id), "eval": {k: float(v) for k, v in metrics.items()
                                                                     if isinstance(v, (int, float))},
            "rewards_before": {"chosen": before[:n], "rejected": before[n:]},
            "rewards_after_one_step": {"chosen": after[:n], "rejected": after[n:]}}


def main() -> None:
    import torch
    import transformers
    import trl

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ids = store_ids(work)
        rng = random.Random(SEED)
        margins = [round(rng.uniform(-1.0, 1.0), 3) for _ in ids]
        cases = [run_case(c, ids, margins, work) for c in CASES]
    record = {"what": "TRL RewardTrainer.evaluate() and one train step on the 16 pairs of tests/data/trl_losses "
                      "(pre-tokenised as prefpack's store holds them) from tests/data/trl_losses/reference loaded as a "
                      "one-label sequence classifier after set_seed(0); checked by tests/test_reward_trl.py",
              "command": "PYTHONPATH=<trl 1.16>:. python benchmarks/trl_reward.py", "trl_version": trl.__version__,
              "torch": torch.__version__, "transformers": transformers.__version__, "seed": SEED, "lr": LR,
              "token_ids": ids, "margins": margins, "cases": cases}
    OUT.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
