"""The TRL 1.16 `DPOConfig` fields a DPO user sets, with TRL's defaults: the list docs/coming-from-trl.md's
table must cover row for row (tests/test_trl_mapping.py checks it without TRL installed).

Which fields:

- every dataclass field of `trl.DPOConfig` that `transformers.TrainingArguments` does not have (what DPO adds);
- the `TrainingArguments` fields TRL's own config classes declare again with their own default (`DPOConfig`
  and its base `_BaseConfig`: learning_rate, logging_steps, gradient_checkpointing, bf16, ...);
- a fixed list of `TrainingArguments` fields that a preference run sets (`COMMON` below); a name of that list
  this transformers does not have (transformers 5 folded `warmup_ratio` into `warmup_steps`) is recorded under
  `header.not_in_this_transformers` instead.

Defaults are the dataclass defaults, before `__post_init__` resolves them (`bf16=None` then becomes True unless
`fp16`; `pad_to_multiple_of='auto'` becomes None off AWS Neuron), written as Python `repr` strings.

Writes tests/data/trl_dpo_config_fields.json:

    pip install -e '.[bench]'
    python benchmarks/trl_config_fields.py
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "data" / "trl_dpo_config_fields.json"

# TrainingArguments fields a preference run reaches for (kept even when TRL does not redeclare them).
COMMON = (
    "output_dir", "num_train_epochs", "max_steps", "per_device_train_batch_size", "per_device_eval_batch_size",
    "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type", "warmup_ratio", "warmup_steps",
    "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "optim", "seed", "bf16", "fp16",
    "gradient_checkpointing", "logging_steps", "eval_strategy", "eval_steps", "save_strategy", "save_steps",
    "save_total_limit", "report_to", "run_name", "resume_from_checkpoint", "use_cpu", "disable_tqdm",
    "torch_compile", "fsdp", "deepspeed",
)


def default_of(f: dataclasses.Field) -> str:
    """The field's default as a string (Python repr; enum members by value)."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if isinstance(value, enum.Enum):
        value = value.value
    return repr(value)


def collect() -> dict:
    try:
        import trl
    except ImportError:
        raise SystemExit("TRL is not installed: pip install -e '.[bench]'") from None
    import transformers
    from transformers import TrainingArguments
    from trl import DPOConfig

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    dpo = {f.name: f for f in dataclasses.fields(DPOConfig)}
    # the classes between DPOConfig and TrainingArguments (DPOConfig, trl's _BaseConfig) and what each declares
    trl_classes = [c for c in DPOConfig.__mro__ if issubclass(c, TrainingArguments) and c is not TrainingArguments]
    declared_by: dict[str, str] = {}
    for cls in reversed(trl_classes):  # the most derived class wins
        for name in cls.__dict__.get("__annotations__", {}):
            if name in dpo:
                declared_by[name] = f"{cls.__module__.split('.')[0]}.{cls.__name__}"

    chosen = {n for n in dpo if n not in base} | {n for n in declared_by if n in base} | {
        n for n in COMMON if n in dpo}
    fields = {}
    for name in sorted(chosen):
        fields[name] = {"default": default_of(dpo[name]),
                        "declared_by": declared_by.get(name, "transformers.TrainingArguments"),
                        "dpo_specific": name not in base}
    return {
        "header": {
            "what": "TRL DPOConfig fields a DPO user sets, with TRL's dataclass defaults (repr strings, before "
                    "__post_init__): every field TrainingArguments lacks, the TrainingArguments fields TRL's config "
                    "classes redeclare, and a fixed list of common TrainingArguments fields; docs/coming-from-trl.md's "
                    "table has one row per field (tests/test_trl_mapping.py)",
            "command": "python benchmarks/trl_config_fields.py" + (
                " " + shlex.join(sys.argv[1:]) if sys.argv[1:] else ""),
            "trl_version": trl.__version__,
            "transformers_version": transformers.__version__,
            "not_in_this_transformers": sorted(n for n in COMMON if n not in dpo),
        },
        "fields": fields,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", default=str(OUT), help="where the JSON goes (default: %(default)s)")
    a = ap.parse_args()
    doc = collect()
    Path(a.output).write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    n = len(doc["fields"])
    specific = sum(v["dpo_specific"] for v in doc["fields"].values())
    print(f"wrote {a.output}: {n} fields ({specific} DPO-specific, {n - specific} from TrainingArguments); "
          f"trl {doc['header']['trl_version']}, transformers {doc['header']['transformers_version']}; "
          f"not in this transformers: {', '.join(doc['header']['not_in_this_transformers']) or 'none'}")


if __name__ == "__main__":
    main()
