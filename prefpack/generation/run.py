"""`prefpack generate` as a library call: prompts from a store or rows, an engine, the samples file.

``sample_prompts`` is the loop the rounds driver calls with its own engine (the policy in memory); ``generate``
builds the prompt source and the engine from options, runs it and stops the engine (and a server it started).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from prefpack.generation.engine import (
    GenerationEngine,
    GenerationError,
    PromptJob,
    SamplingSettings,
    logprobs_problem,
)
from prefpack.generation.prompts import Prompt, PromptSource, RowPrompts, StorePrompts
from prefpack.generation.samples import SamplesWriter, check_not_inputs, meta_path, samples_record
from prefpack.generation.stops import stop_token_ids
from prefpack.generation.subsets import PromptSubset, SubsetPrompts
from prefpack.stop_signal import STOP_SIGNALS, StopSignal, Terminated

ENGINES = ("transformers", "vllm")


@dataclass
class GenerateOptions:
    output: str
    model: str | None = None  # the model folder (transformers; vLLM's {model} when prefpack starts the server)
    adapter: str | None = None  # a LoRA adapter folder sampled over ``model`` (transformers only)
    quantization: str | None = None  # the base loaded in 4 bits (nf4 | fp4, as model.quantization), under ``adapter``
    quantization_double: bool = True
    store: str | None = None  # prompts of a prepared store, or ...
    inputs: list[str] = field(default_factory=list)  # ... rows of prompts / messages
    tokenizer: str | None = None  # rows' tokenizer (default: the model folder's)
    prompt_field: str | None = None
    chat_template_kwargs: dict | None = None
    tools: list | None = None
    subset: PromptSubset | None = None  # only this part of the prompts (a round's: rounds.prompts_per_round)
    engine: str = "transformers"
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0
    stop_token_ids: list[int] = field(default_factory=list)  # besides end-of-turn and EOS
    batch_size: int = 8  # transformers: prompts per generate call
    device: str = "auto"
    dtype: str = "auto"
    vllm_url: str | list[str] | None = None  # one server, or several (a list, or URLs separated by commas)
    vllm_command: str | None = None  # e.g. "vllm serve {model} --port {port}"
    vllm_start_timeout: float = 900.0
    request_timeout: float = 600.0
    concurrency: int = 32
    overwrite: bool = False
    trust_remote_code: bool = False


@dataclass
class GenerateReport:
    path: Path
    prompts: int
    written: int  # rows this run wrote (the others were done before)
    samples: int
    truncated: int
    tokens: int  # completion tokens this run sampled
    seconds: float
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        resumed = f" ({self.prompts - self.written} done before, continued)" if self.written < self.prompts else ""
        lines = [f"wrote {self.path}: {self.prompts} prompts{resumed}, {self.samples} samples, {self.truncated} cut "
                 f"by max_new_tokens; {self.tokens} tokens in {self.seconds:.1f}s "
                 f"({self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s)"]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def prompt_source(opts: GenerateOptions) -> PromptSource:
    source = _all_prompts(opts)
    if opts.subset is None:
        return source
    return SubsetPrompts(source, opts.subset, repr(opts.store) if opts.store else ", ".join(map(repr, opts.inputs)))


def _all_prompts(opts: GenerateOptions) -> PromptSource:
    if bool(opts.store) == bool(opts.inputs):
        raise GenerationError("give prompts as --store DIR (a prepared store) or as input files, one of the two")
    if opts.store:
        return StorePrompts(opts.store, trust_remote_code=opts.trust_remote_code)
    tokenizer = opts.tokenizer or opts.model
    if not tokenizer:
        raise GenerationError("rows of prompts need a tokenizer: give --tokenizer (or --model, a folder holding one)")
    return RowPrompts(opts.inputs, tokenizer, field=opts.prompt_field, chat_template_kwargs=opts.chat_template_kwargs,
                      tools=opts.tools, trust_remote_code=opts.trust_remote_code)


def build_engine(opts: GenerateOptions, source: PromptSource, stop: StopSignal | None = None) -> GenerationEngine:
    """The engine the options name; ``stop``: a stop signal while a server prefpack starts loads stops it."""
    if opts.engine not in ENGINES:
        raise GenerationError(f"unknown engine {opts.engine!r}; choose {', '.join(ENGINES)}")
    if opts.engine == "transformers":
        if opts.vllm_url or opts.vllm_command:
            raise GenerationError("--vllm-url and --vllm-command go with --engine vllm")
        if not opts.model:
            raise GenerationError("--engine transformers needs --model (a model folder)")
        from prefpack.generation.hf_engine import TransformersEngine

        tok = source.tok
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return TransformersEngine.load(opts.model, pad_id=pad, batch_size=opts.batch_size, device=opts.device,
                                       dtype=opts.dtype, trust_remote_code=opts.trust_remote_code,
                                       adapter=opts.adapter, four_bit=opts.quantization,
                                       double_quant=opts.quantization_double)
    check_vllm_limits(opts)
    if opts.adapter:
        raise GenerationError("--adapter is sampled by --engine transformers; for vLLM serve a merged model folder "
                              "(a LoRA run's final/ holds one)")
    from prefpack.generation.vllm_engine import VllmEngine

    if bool(opts.vllm_url) == bool(opts.vllm_command):
        raise GenerationError("--engine vllm needs --vllm-url URL (a running server) or --vllm-command CMD (prefpack "
                              "starts it on --model), one of the two")
    if opts.vllm_url:
        urls = vllm_urls(opts.vllm_url)
        kwargs = {"request_timeout": opts.request_timeout, "concurrency": opts.concurrency}
        if len(urls) == 1:
            return VllmEngine(urls[0], **kwargs)
        from prefpack.generation.vllm_pool import VllmPool

        return VllmPool.from_urls(urls, **kwargs)
    if not opts.model:
        raise GenerationError("--vllm-command needs --model: the checkpoint it serves ({model} in the command)")
    from prefpack.generation.server import VllmServer

    server = VllmServer(opts.vllm_command, model=opts.model, log_path=vllm_log_path(opts.output),
                        start_timeout=opts.vllm_start_timeout)
    server.start(stop)
    try:
        return VllmEngine(server.url, request_timeout=opts.request_timeout, concurrency=opts.concurrency,
                          server=server)
    except BaseException:
        server.stop()
        raise


def check_vllm_limits(opts: GenerateOptions) -> None:
    """The vLLM engine's limits, each a positive number, refused by the flag's name (a negative timeout would reach
    the socket layer as an unexplained error)."""
    import math

    for flag, value in (("--request-timeout", opts.request_timeout), ("--vllm-start-timeout", opts.vllm_start_timeout),
                        ("--concurrency", opts.concurrency)):
        number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not number or value <= 0 or (flag == "--concurrency" and value != int(value)):
            what = "a positive whole number" if flag == "--concurrency" else "a positive number of seconds"
            raise GenerationError(f"{flag} must be {what}, not {value!r}")


def vllm_log_path(output: str | Path) -> Path:
    """``OUTPUT.vllm.log``: what a server ``--vllm-command`` starts prints."""
    return Path(output).with_name(Path(output).name.removesuffix(".jsonl") + ".vllm.log")


def written_paths(output: str | Path) -> list[tuple[str, Path]]:
    """What sampling into ``output`` writes: the samples file and its meta (what must not be an input)."""
    return [("--output", Path(output)), ("its meta", meta_path(output))]


def vllm_urls(value: str | list[str]) -> list[str]:
    """The servers' URLs from one string or a list, each possibly a comma-separated list; a URL given twice is
    refused (its server would be counted twice)."""
    from prefpack.generation.vllm_engine import base_url

    items = [value] if isinstance(value, str) else list(value)
    urls = [base_url(u) for item in items for u in str(item).split(",") if u.strip()]
    if not urls:
        raise GenerationError("--vllm-url names no server")
    twice = sorted({u for u in urls if urls.count(u) > 1})
    if twice:
        raise GenerationError(f"--vllm-url names {', '.join(twice)} more than once")
    return urls


def settings_of(opts: GenerateOptions, source: PromptSource) -> SamplingSettings:
    stops = stop_token_ids(source.tok, model_eos_ids(opts.model), opts.stop_token_ids)
    return SamplingSettings(n=opts.n, temperature=opts.temperature, top_p=opts.top_p,
                            max_new_tokens=opts.max_new_tokens, seed=opts.seed, stop_token_ids=stops).check()


def model_eos_ids(model: str | None) -> list[int]:
    """The EOS ids a model folder's generation_config.json names (Llama 3 Instruct lists its end-of-turn there
    too); vLLM stops at them by default, so the transformers engine does as well."""
    path = Path(model) / "generation_config.json" if model else None
    if path is None or not path.is_file():
        return []
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as exc:
        raise GenerationError(f"{path}: unreadable ({exc})") from None
    values = value if isinstance(value, list) else [] if value is None else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


def generate(opts: GenerateOptions, log: Callable[[str], None] = print) -> GenerateReport:
    """Raises :class:`Terminated` after SIGTERM / Ctrl-C, the samples file ending at a whole batch and a server
    prefpack started stopped."""
    with StopSignal(signums=STOP_SIGNALS) as stop:
        source = prompt_source(opts)
        writes = written_paths(opts.output)
        if opts.engine == "vllm" and opts.vllm_command:
            writes.append(("--vllm-command's log", vllm_log_path(opts.output)))
        check_not_inputs(writes, source.inputs(), "generate")  # before anything is opened for writing
        settings = settings_of(opts, source)
        engine = build_engine(opts, source, stop)
        try:
            report = sample_prompts(source, engine, settings, opts.output, overwrite=opts.overwrite, log=log,
                                    stop=stop)
            report.notes.extend(getattr(engine, "notes", []))  # a pool's servers dropped mid-round
            return report
        finally:
            engine.close()


def sample_prompts(source: PromptSource, engine: GenerationEngine, settings: SamplingSettings, output: str | Path, *,
                   overwrite: bool = False, log: Callable[[str], None] = print,
                   stop: StopSignal | None = None, shard: tuple[int, int] = (0, 1)) -> GenerateReport:
    """Every prompt of ``source`` sampled by ``engine`` into ``output``, in chunks of the engine's
    ``batch_prompts``; a chunk whose rows a previous run wrote is skipped, one it left part-done is made again
    whole (so the rows equal an uninterrupted run's) and only its missing rows written. ``shard`` = (rank, world):
    only chunks k with k % world == rank (a rank's part: prefpack.generation.shards), the same chunks and seeds.
    SIGTERM or Ctrl-C (``stop``, or this call's own handler) is acted on before each chunk: :class:`Terminated`,
    the file ending at a whole row."""
    with nullcontext(stop) if stop is not None else StopSignal(signums=STOP_SIGNALS) as stop:
        return _sample_prompts(source, engine, settings, output, overwrite, log, stop, shard)


def _sample_prompts(source, engine, settings, output, overwrite, log, stop: StopSignal,
                    shard: tuple[int, int]) -> GenerateReport:
    t0 = time.perf_counter()
    check_not_inputs(written_paths(output), source.inputs(), "generate")
    rank, world = shard
    meta = {"tokenizer": source.tokenizer_record(), "chat_template": source.chat_template_record(),
            "prompts": {**source.describe(), "sha256": source.content_sha256()},
            "generation": {"engine": engine.name, "settings": settings.to_json(), **engine.describe()},
            "samples": samples_record(output, shard_rows(source.count(), engine.batch_prompts, rank, world))}
    writer = SamplesWriter(output, meta, overwrite=overwrite)
    for note in writer.notes:
        log(f"note: {note}")
    if writer.torn:
        log(f"{output}: its last line was cut off by a kill mid-write ({writer.torn} bytes); dropped, its row is "
            "made again")
    if writer.done:
        log(f"continuing {output}: {len(writer.done)} rows were written by an earlier run")
    tok = source.tok
    counts = {"prompts": 0, "tokens": 0, "written": 0, **writer.prior}
    seen, index = 0, 0  # prompts of the source, chunks of the source
    try:
        chunk: list[Prompt] = []
        for prompt in source:
            seen += 1
            chunk.append(prompt)
            if len(chunk) == engine.batch_prompts:
                if index % world == rank:
                    _stop_if_due(stop, writer, source)
                    counts["prompts"] += len(chunk)
                    _chunk(chunk, engine, settings, writer, tok, counts)
                chunk, index = [], index + 1
        if chunk and index % world == rank:
            _stop_if_due(stop, writer, source)
            counts["prompts"] += len(chunk)
            _chunk(chunk, engine, settings, writer, tok, counts)
        if not seen:
            raise GenerationError("no prompt to sample: the source is empty")
        _stop_if_due(stop, writer, source)  # a signal during the last chunk: the file is whole, the meta not yet
        writer.finish({k: counts[k] for k in ("prompts", "samples", "truncated")})
    finally:
        writer.close()
    return GenerateReport(Path(output), counts["prompts"], counts["written"], counts["samples"], counts["truncated"],
                          counts["tokens"], time.perf_counter() - t0, list(source.notes))


def shard_rows(prompts: int, batch: int, rank: int, world: int) -> int:
    """How many of ``prompts`` prompts rank ``rank`` of ``world`` samples: chunk k of ``batch`` prompts is rank
    k % world's (all of them in one process)."""
    chunks = -(-prompts // batch) if prompts else 0
    return sum(min(batch, prompts - k * batch) for k in range(rank, chunks, world))


def _stop_if_due(stop: StopSignal, writer: SamplesWriter, source: PromptSource) -> None:
    if stop.due():
        writer.close()
        raise Terminated(f"{len(writer.done) + writer.written} of {source.count()} prompts are sampled in "
                         f"{writer.path}", stop.signum)


def _chunk(chunk: list[Prompt], engine, settings, writer: SamplesWriter, tok, counts: dict) -> None:
    todo = [p for p in chunk if p.row not in writer.done]
    if not todo:
        return
    asked = chunk if getattr(engine, "batch_dependent", True) else todo  # redo a batch whole where it matters
    results = engine.generate([PromptJob(p.row, p.ids) for p in asked], settings)
    check_answers(asked, results, settings, len(tok), _engine_name(engine))  # nothing of a wrong answer is written
    for prompt, samples in zip(asked, results):
        if prompt.row in writer.done:
            continue
        row = {"prompt_ids": list(prompt.ids), "completion_ids": [list(s.ids) for s in samples],
               "prompt": tok.decode(list(prompt.ids), skip_special_tokens=False),
               "completions": [tok.decode(list(s.ids), skip_special_tokens=True) for s in samples],
               "truncated": [s.truncated for s in samples], "row": prompt.row}
        if any(s.logprobs is not None for s in samples):  # the sampler's log-prob of each token (engine.Sample)
            row["logprobs"] = [None if s.logprobs is None else list(s.logprobs) for s in samples]
        if prompt.messages is not None:
            row["messages"] = prompt.messages
        row.update(prompt.fields)
        writer.write(row)
        counts["written"] += 1
        counts["tokens"] += sum(len(s.ids) for s in samples)
        counts["samples"] += len(samples)
        counts["truncated"] += sum(s.truncated for s in samples)


def _engine_name(engine) -> str:
    """The engine as errors name it: vllm at its server(s), transformers with its model."""
    told = engine.describe()
    where = told.get("url") or ", ".join(told.get("urls") or []) or told.get("model") or ""
    return f"{engine.name} engine ({where})" if where else f"{engine.name} engine"


def check_answers(prompts: list[Prompt], results: list, settings: SamplingSettings, vocab: int, engine: str) -> None:
    """An engine's answer before any of it is written: a list of ``n`` samples for each prompt asked, each of at most
    ``max_new_tokens`` ids inside the tokenizer's ``vocab``, with one finite log-prob <= 0 per id when it gives them
    (one line naming the engine, the row and what is wrong)."""
    if len(results) != len(prompts):
        raise GenerationError(f"the {engine} answered {len(results)} prompts of the {len(prompts)} asked")
    for prompt, samples in zip(prompts, results):
        if len(samples) != settings.n:
            raise GenerationError(f"the {engine} answered row {prompt.row} with {len(samples)} samples, not "
                                  f"n={settings.n}")
        for sample in samples:
            if len(sample.ids) > settings.max_new_tokens + 1:  # a stop token a server left out, put back: + 1
                raise GenerationError(f"the {engine} answered row {prompt.row} with a sample of "
                                      f"{len(sample.ids)} tokens, past max_new_tokens={settings.max_new_tokens}")
            bad = next((t for t in sample.ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise GenerationError(f"the {engine} answered row {prompt.row} with token id {bad}, outside the "
                                      f"tokenizer's {vocab} ids (another model or tokenizer than the prompts')")
            problem = None if sample.logprobs is None else logprobs_problem(sample.ids, sample.logprobs)
            if problem is not None:
                raise GenerationError(f"the {engine} answered row {prompt.row} with a sample of {len(sample.ids)} "
                                      f"tokens with {problem}")
