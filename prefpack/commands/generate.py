"""`prefpack generate`: k completions per prompt as token ids, by the policy in process or by a vLLM server."""

from __future__ import annotations

import json
import sys

REMOTE_CODE_HELP = ("run Python code that the model or tokenizer folder names in its config (auto_map); off, such a "
                    "folder is refused")


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="sample n completions per prompt (token ids) with a model, in process or "
                       "through a vLLM server",
                       description="Read prompts from a prepared store (--store, the exact ids training reads) or "
                       "from rows of prompts / chat messages (rendered as prepare renders them), sample --n "
                       "completions of each, and write OUTPUT.jsonl (one row per prompt) and OUTPUT.meta.json. A "
                       "rerun with the same settings continues a file a killed run left (docs/generate.md).")
    p.add_argument("inputs", nargs="*", metavar="INPUT", help="files of prompt rows: a 'prompt' (string or message "
                   "list) or 'messages' field (--prompt-field names another); other fields are passed through")
    p.add_argument("--store", default=None, metavar="DIR", help="sample the prompts of this prepared store instead")
    p.add_argument("--output", "-o", required=True, help="samples file to write (.jsonl)")
    p.add_argument("--model", default=None, help="model folder: sampled by --engine transformers, or served by "
                   "--vllm-command")
    p.add_argument("--adapter", default=None, metavar="DIR", help="a LoRA adapter folder (a LoRA run's final/adapter) "
                   "sampled over --model, its base (--engine transformers)")
    p.add_argument("--tokenizer", default=None, help="tokenizer of the input rows (default: the --model folder's; a "
                   "store's prompts are read with the store's copy)")
    p.add_argument("--prompt-field", default=None, help="field holding each row's prompt (default: prompt, else "
                   "messages)")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON", help="template variables, as prepare takes "
                   "them")
    p.add_argument("--tools", default=None, metavar="FILE", help="JSON file of tool definitions, as prepare takes it")
    p.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                   help="transformers: in this process, batched (default); vllm: a vLLM server's completions API")
    p.add_argument("--n", type=int, default=4, help="completions per prompt (default 4)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0 is greedy (default 1)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest completion; a longer one is cut and "
                   "marked truncated (default 256)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0); see docs/generate.md for what "
                   "else the samples depend on")
    p.add_argument("--stop-token-ids", default=None, metavar="ID,ID", help="more ids that end a completion, besides "
                   "the chat template's end-of-turn and EOS")
    p.add_argument("--batch-size", type=int, default=8, help="transformers: prompts per generate call (default 8; "
                   "the samples depend on it)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where the transformers engine "
                   "runs (default auto: CUDA when there is a GPU, else CPU)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="transformers: weights' dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--vllm-url", action="append", default=None, metavar="URL", help="a running vLLM server "
                   "(http://host:port); repeat the flag, or separate URLs by commas, to deal the prompts over several")
    p.add_argument("--vllm-command", default=None, metavar="CMD", help="start this server on --model and stop it "
                   "after, e.g. '/opt/vllm/bin/vllm serve {model} --port {port}' ({model}, {port}, {host} filled in)")
    p.add_argument("--vllm-start-timeout", type=float, default=900.0, metavar="S",
                   help="seconds --vllm-command's server may take to answer (default 900)")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="vllm: seconds one prompt's request may take (default 600)")
    p.add_argument("--concurrency", type=int, default=32, help="vllm: requests in flight (default 32)")
    p.add_argument("--overwrite", action="store_true", help="replace OUTPUT instead of continuing it")
    p.add_argument("--trust-remote-code", action="store_true", help=REMOTE_CODE_HELP)


def run_generate(args, argv: list[str]) -> int:
    from prefpack.errors import PrefpackError
    from prefpack.generation.run import GenerateOptions, generate
    from prefpack.stop_signal import Terminated

    kwargs = tools = None
    try:
        if args.chat_template_kwargs:
            kwargs = json.loads(args.chat_template_kwargs)
        if args.tools:
            with open(args.tools, encoding="utf-8") as fh:
                tools = json.load(fh)
        stops = [int(x) for x in args.stop_token_ids.split(",") if x.strip()] if args.stop_token_ids else []
    except (OSError, ValueError) as exc:
        raise PrefpackError(f"--chat-template-kwargs, --tools or --stop-token-ids: {exc}") from None
    if kwargs is not None and not isinstance(kwargs, dict):
        raise PrefpackError("--chat-template-kwargs must be a JSON object")
    opts = GenerateOptions(
        output=args.output, model=args.model, adapter=args.adapter, store=args.store, inputs=list(args.inputs), tokenizer=args.tokenizer,
        prompt_field=args.prompt_field, chat_template_kwargs=kwargs, tools=tools, engine=args.engine, n=args.n,
        temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens, seed=args.seed,
        stop_token_ids=stops, batch_size=args.batch_size, device=args.device, dtype=args.dtype,
        vllm_url=args.vllm_url, vllm_command=args.vllm_command, vllm_start_timeout=args.vllm_start_timeout,
        request_timeout=args.request_timeout, concurrency=args.concurrency, overwrite=args.overwrite,
        trust_remote_code=args.trust_remote_code)
    try:
        report = generate(opts, log=lambda m: print(m, file=sys.stderr))
    except Terminated as term:  # SIGTERM or Ctrl-C: the samples end at a whole row; the same command continues them
        print(stopped_hint("generate", term, argv), file=sys.stderr)
        return 128 + term.signum  # 143 for SIGTERM, 130 for Ctrl-C, as if the signal had killed it
    print(report.summary())
    return 0


def stopped_hint(command: str, term, argv: list[str]) -> str:
    """One line: what a signalled run had done, and the command that continues it (the same command)."""
    import shlex

    return f"prefpack {command}: {term}; continue with the same command:\n  {shlex.join(argv)}"
