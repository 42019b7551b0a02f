"""`prefpack prepare` and `prefpack inspect`: rows into a store, and a store shown."""

from __future__ import annotations

import sys

from prefpack.remote_code import REMOTE_CODE_HELP


def add_prepare(sub) -> None:
    from prefpack.data.formats import FIELD_HELP, LAYOUTS
    from prefpack.data.image_files import DEFAULT_MAX_IMAGE_BYTES
    from prefpack.data.truncation import DEFAULT_MIN_PROMPT_KEEP, TRUNCATION_POLICIES

    p = sub.add_parser("prepare", help="tokenise preference data into a binary store",
                       description="Read JSONL/JSON/Parquet/CSV files (or globs) or datasets folders, tokenise "
                       "prompt and completions apart, and write a binary store to --output.")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files, globs or datasets.save_to_disk folders")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id (default: the --processor folder)")
    p.add_argument("--output", "-o", required=True, help="store folder to create")
    p.add_argument("--processor", default=None, metavar="DIR",
                   help="a processor folder (image processor + tokenizer: the Qwen2-VL family, or a LlavaProcessor): "
                   "read vision rows (TRL's images column beside pair, unpaired and ranked message prompts, RLAIF-V's "
                   "image/question) and store their images, each placeholder expanded to the processor's token count, "
                   "for training a vision-language model (docs/images.md)")
    p.add_argument("--image-root", default=None, metavar="DIR",
                   help="with --processor, a folder image paths may also lead into; by default a row's image paths "
                   "(after symbolic links) must stay inside its input file's folder, and any other is a bad row")
    p.add_argument("--max-image-bytes", type=int, default=DEFAULT_MAX_IMAGE_BYTES, metavar="N",
                   help=f"with --processor, the largest image (file or bytes) a row may hold (default "
                   f"{DEFAULT_MAX_IMAGE_BYTES:,} bytes); a larger one is a bad row")
    p.add_argument("--format", choices=LAYOUTS, default=None, help="input layout (default: detect from the first row)")
    for name, what in FIELD_HELP.items():
        p.add_argument(f"--{name}-field", default=None, help=f"name of the {what} field")
    p.add_argument("--split", default=None, help="split to read from a DatasetDict folder")
    p.add_argument("--max-length", type=int, default=None,
                   help="longest prompt+completion sequence in tokens (default: no limit)")
    p.add_argument("--truncation", choices=TRUNCATION_POLICIES, default="prompt-left",
                   help="over-long examples (with --max-length): cut the prompt from the left, then completions from "
                   "the right (prompt-left, default); drop them (drop); as TRL's DPO/KTO keep_start does: never cut "
                   "the prompt, cut completions' ends, drop rows whose prompt alone fills --max-length "
                   "(trl-keep-start); or as LLaMA-Factory's cutoff_len does: share the length between prompt and "
                   "completions (infer_seqlen), keeping the start of each (llamafactory). Every cut or drop is "
                   "counted; docs/data.md has the exact rules")
    p.add_argument("--min-prompt-keep", type=float, default=DEFAULT_MIN_PROMPT_KEEP, metavar="SHARE",
                   help="with --truncation prompt-left, the least share of its prompt's tokens a row must keep "
                   f"(default {DEFAULT_MIN_PROMPT_KEEP:g}: the last half of a conversation still holds what the "
                   "completions answer); a row that would keep less is refused, naming its file, row and field "
                   "(counted and skipped with --skip-invalid). 0 allows any cut, 1 refuses every prompt cut")
    p.add_argument("--workers", type=int, default=0, help="tokeniser processes (default: all cores)")
    p.add_argument("--skip-invalid", action="store_true",
                   help="skip bad rows (counted by reason and written to skipped.jsonl) instead of stopping")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output store")
    p.add_argument("--allow-duplicate-inputs", action="store_true",
                   help="store a file reached twice (by name, glob or link) twice, on purpose")
    p.add_argument("--trust-remote-code", action="store_true", help=REMOTE_CODE_HELP)
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="template variables for every chat row, as a JSON object, e.g. '{\"enable_thinking\": false}'; "
                   "a row's own chat_template_kwargs column overrides them key by key")
    p.add_argument("--tools", default=None, metavar="FILE",
                   help="JSON file holding a list of tool (function) definitions, passed to the chat template for "
                   "chat rows with no tools column value of their own")
    p.add_argument("--train-on", choices=("assistant", "last", "all"), default=None,
                   help="chat replies (message lists): score each assistant message's own tokens, tool calls and "
                   "end-of-turn, not tool results, user turns or role headers (assistant, default); only the final "
                   "assistant message (last); or every completion token (all)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="render chat rows with this Jinja template instead (mark assistant text with {%% generation "
                   "%%} to take the scored tokens from one rendering); 'tokenizer': the tokenizer's own even where "
                   "prefpack ships a training template for it (default: Qwen3, Qwen3.5, DeepSeek-R1 and gpt-oss "
                   "templates are rendered with prefpack's training templates, others with their own)")
    p.add_argument("--earlier-reasoning", choices=("dropped", "kept", "scored"), default=None,
                   help="with a training template, the reasoning of assistant turns before the last user message: "
                   "dropped as the model's own template does (default), kept but not scored, or kept and scored")


def run_prepare(args, argv: list[str]) -> int:
    from prefpack.data.formats import FIELD_HELP
    from prefpack.data.prepare import PrepareOptions, prepare

    fields = {n: getattr(args, f"{n}_field") for n in FIELD_HELP}
    opts = PrepareOptions(
        inputs=args.inputs, tokenizer=args.tokenizer, output=args.output, layout=args.format, fields=fields,
        split=args.split, max_length=args.max_length, truncation=args.truncation, workers=args.workers,
        min_prompt_keep=args.min_prompt_keep,
        skip_invalid=args.skip_invalid, overwrite=args.overwrite, trust_remote_code=args.trust_remote_code,
        allow_duplicate_inputs=args.allow_duplicate_inputs,
        chat_template_kwargs=args.chat_template_kwargs, tools=args.tools, train_on=args.train_on,
        chat_template=args.chat_template, earlier_reasoning=args.earlier_reasoning,
        processor=args.processor, image_root=args.image_root, max_image_bytes=args.max_image_bytes, argv=argv,
    )
    report = prepare(opts, log=lambda m: print(m, file=sys.stderr))
    print(report.summary())
    return 0


def add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="show a prepared store's meta and length statistics; --row I decodes one "
                       "example")
    p.add_argument("store", metavar="DIR", help="a store folder written by `prefpack prepare --output DIR` (not a run "
                   "folder)")
    p.add_argument("--row", type=int, default=None, help="decode this example (0-based; without it no example is "
                   "decoded)")
    p.add_argument("--json", action="store_true", help="print one JSON object (keys meta, stats, row)")
    p.add_argument("--tokenizer", default=None, help="decode with this tokenizer (default: the store's copy)")
    p.add_argument("--verify", action="store_true", help="also check file hashes and token ranges (reads everything)")
    p.add_argument("--trust-remote-code", action="store_true", help=REMOTE_CODE_HELP + " (decoding --row with a "
                   "tokenizer that names its own code)")
    p.add_argument("--ranked-pairs", default=None, choices=("best_vs_rest", "all_pairs"),
                   help="a ranked store's --row: show the pairs this pairing draws from the row's prompt group "
                   "(default: the --config run's data.ranked_pairs, else best_vs_rest)")
    p.add_argument("--config", default=None, metavar="YAML",
                   help="a run's config: its data.ranked_pairs (auto: all_pairs for train.objective=reward, else "
                   "best_vs_rest) decides the pairs shown for a ranked store's --row")


def run_inspect(args, argv: list[str]) -> int:
    from prefpack.data.inspect import inspect_store

    print(inspect_store(args.store, row=args.row, as_json=args.json, tokenizer=args.tokenizer, verify=args.verify,
                        trust_remote_code=args.trust_remote_code, ranked_pairs=_ranked_pairs(args)))
    return 0


def _ranked_pairs(args) -> str:
    """The pairing a ranked row's group is shown under: --ranked-pairs, else the --config run's, resolved."""
    if args.ranked_pairs or not args.config:
        return args.ranked_pairs or "best_vs_rest"
    from prefpack.config import load_config
    from prefpack.objectives.settings import ranked_pairs

    return ranked_pairs(load_config(args.config, []))
