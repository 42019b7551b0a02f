"""The in-process engine: transformers' ``generate`` on batches of left-padded prompts, ``num_return_sequences`` =
n, on CPU or GPU; the default. It also takes a model already in memory: :meth:`TransformersEngine.of_policy`, the
training policy of in-process rounds, sampled in eval mode with sdpa attention (the kernel a loaded folder samples
with) and put back as it was after each call.

Sampling draws from torch's global generator, seeded per batch from ``(seed, first row of the batch)`` inside
``fork_rng`` (the caller's random state is left as it was): the same seed and batch size give the same samples;
another batch size gives other (equally valid) samples, since a batch's prompts share one stream of draws.

Each sample's log-probs (``Sample.logprobs``, raw: before temperature and top-p) are read from the model's own
logits at each step, by hooks on its forward (:class:`_RawLogprobs`): the step's log-softmax is kept until the next
forward shows which token was sampled, so one [rows, vocabulary] tensor is held, not every step's logits
(``output_logits=True`` would hold steps x rows x vocabulary floats: gigabytes for a 150k vocabulary).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch

from prefpack.generation.engine import (
    GenerationError,
    PromptJob,
    Sample,
    SamplingSettings,
    finish,
    prompt_seed,
)

DEFAULT_BATCH_PROMPTS = 8


class TransformersEngine:
    name = "transformers"
    batch_dependent = True  # a batch shares one stream of random draws

    def __init__(self, model, *, pad_id: int, batch_size: int = DEFAULT_BATCH_PROMPTS, source: str | None = None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise GenerationError(f"batch size (prompts per generate call) must be a positive integer, not "
                                  f"{batch_size!r}")
        self.model, self.pad_id, self.batch_prompts, self.source = model, int(pad_id), batch_size, source
        self.device = next(model.parameters()).device
        self.max_positions = getattr(model.config, "max_position_embeddings", None)

    @classmethod
    def load(cls, path: str, *, pad_id: int, batch_size: int = DEFAULT_BATCH_PROMPTS, device: str = "auto",
             dtype: str = "auto", trust_remote_code: bool = False, adapter: str | None = None,
             four_bit: str | None = None, double_quant: bool = True) -> TransformersEngine:
        """A model folder loaded for sampling: sdpa attention, bfloat16 on CUDA and float32 on CPU by default;
        ``adapter``: a LoRA adapter folder run over it unmerged (the weights a LoRA run trains); ``four_bit`` (nf4 |
        fp4): its linear weights loaded in 4 bits, as a QLoRA run holds its base (``engine/quantize.py``). Loaded through
        the one loading seam (``prefpack.model.weights.load_weights``, purpose ``sample``)."""
        from prefpack.model.load import pick_device
        from prefpack.model.weights import FourBit, WeightSpec, load_weights

        dev = pick_device(device)
        if dtype == "auto":
            dtype = "bfloat16" if dev.type == "cuda" else "float32"
        model = load_weights(WeightSpec(path, "sample", dev, dtype=getattr(torch, dtype), attn="sdpa",
                                        trust_remote_code=trust_remote_code, packed=False,
                                        four_bit=FourBit(four_bit, double=double_quant) if four_bit else None,
                                        adapter=adapter or None, adapter_key="--adapter",
                                        adapter_error=GenerationError))
        return cls(model.eval(), pad_id=pad_id, batch_size=batch_size,
                   source=path if not adapter else f"{path} + adapter {adapter}")

    @classmethod
    def of_policy(cls, model, *, pad_id: int, batch_size: int = DEFAULT_BATCH_PROMPTS,
                  source: str | None = None) -> TransformersEngine:
        """The training policy in memory (LoRA-wrapped or not), sampled as a saved copy of it loaded by
        :meth:`load` would be: eval mode and sdpa attention during each call, its training mode and kernel put back
        after (the caller gives weights already in the dtype a saved copy holds)."""
        engine = cls(model, pad_id=pad_id, batch_size=batch_size, source=source)
        engine.borrowed = True
        return engine

    borrowed = False  # a model the caller trains: its mode and attention kernel are put back after each call

    def describe(self) -> dict:
        return {"model": self.source, "batch_size": self.batch_prompts, "device": str(self.device),
                "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch.")}

    def close(self) -> None:
        self.model = None

    def generate(self, jobs: Sequence[PromptJob], settings: SamplingSettings) -> list[list[Sample]]:
        out: list[list[Sample]] = []
        with _sampling_mode(self.model) if self.borrowed else _as_is():
            for start in range(0, len(jobs), self.batch_prompts):
                out.extend(self._batch(jobs[start:start + self.batch_prompts], settings))
        return out

    def _batch(self, jobs: Sequence[PromptJob], s: SamplingSettings) -> list[list[Sample]]:
        from transformers import GenerationConfig

        width = max(len(j.ids) for j in jobs)
        if self.max_positions and width + s.max_new_tokens > self.max_positions:
            long = max(jobs, key=lambda j: len(j.ids))
            fits = self.max_positions - len(long.ids)
            raise GenerationError(f"row {long.row}: its prompt ({len(long.ids)} tokens) and max_new_tokens "
                                  f"({s.max_new_tokens}) exceed the model's {self.max_positions} positions; "
                                  + (f"lower max_new_tokens to {fits} or less (--max-new-tokens, or "
                                     "rounds.max_new_tokens)" if fits > 0 else "the prompt alone fills them"))
        ids = torch.full((len(jobs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for i, job in enumerate(jobs):  # left padding: every prompt ends where generation starts
            ids[i, width - len(job.ids):] = torch.tensor(job.ids, dtype=torch.long)
            mask[i, width - len(job.ids):] = 1
        sample = s.temperature > 0
        config = GenerationConfig(do_sample=sample, temperature=s.temperature if sample else None,
                                  top_p=s.top_p if sample else None, top_k=0 if sample else None,
                                  max_new_tokens=s.max_new_tokens, num_return_sequences=s.n,
                                  eos_token_id=list(s.stop_token_ids), pad_token_id=self.pad_id)
        devices = [self.device] if self.device.type == "cuda" else []
        # transformers fills what a given config leaves unset from the model's generation_config (a folder's min_p,
        # repetition penalty...): blanked for the call, so the settings alone say what is sampled
        holder = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model  # under peft
        own, holder.generation_config = holder.generation_config, GenerationConfig()
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                torch.manual_seed(prompt_seed(s.seed, jobs[0].row))
                with _RawLogprobs(holder) as raw:
                    out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                              generation_config=config)
                new_ids = out[:, width:]
                logprobs = raw.collect(new_ids)
                del out
        finally:
            holder.generation_config = own
        new, lps = new_ids.tolist(), logprobs.tolist()
        return [[finish(new[i * s.n + k], s.stop_token_ids, lps[i * s.n + k]) for k in range(s.n)]
                for i in range(len(jobs))]


class _RawLogprobs:
    """Each sampled token's raw log-prob, read by hooks on the model's forward while ``generate`` runs: after a
    forward its last position's log-softmax is kept; the next forward's last input id is the token sampled from it
    (read then), and the last token's after ``generate`` returns (:meth:`collect`)."""

    def __init__(self, model):
        self.model, self.prev, self.cols, self.handles = model, None, [], []

    def __enter__(self) -> _RawLogprobs:
        self.handles = [self.model.register_forward_pre_hook(self._before, with_kwargs=True),
                        self.model.register_forward_hook(self._after, with_kwargs=True)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _before(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.prev is not None and ids is not None:
            self.cols.append(self.prev.gather(1, ids[:, -1:].to(self.prev.device)).double().cpu())

    def _after(self, module, args, kwargs, output):
        logits = output.logits if hasattr(output, "logits") else output[0]
        self.prev = torch.log_softmax(logits[:, -1].float(), dim=-1)

    def collect(self, new_ids: torch.Tensor) -> torch.Tensor:
        """[rows, steps] float64, one per sampled token (a row's steps after its stop token hold its padding's
        values, cut by ``finish``)."""
        if self.prev is not None and new_ids.shape[1]:
            self.cols.append(self.prev.gather(1, new_ids[:, -1:].to(self.prev.device)).double().cpu())
        self.prev = None
        out = torch.cat(self.cols, dim=1) if self.cols else torch.zeros(new_ids.shape, dtype=torch.float64)
        self.cols = []
        if tuple(out.shape) != tuple(new_ids.shape):
            raise GenerationError(f"the sampler's log-probs: {tuple(out.shape)} for {tuple(new_ids.shape)} sampled "
                                  "tokens (the model's generate did not run one forward per token)")
        return out


@contextmanager
def _as_is():
    yield


@contextmanager
def _sampling_mode(model):
    """A training model switched to sampling: eval mode (no dropout, no activation checkpointing) and sdpa attention
    in every config that names a kernel (prefpack's packed kernels read packed position ids, not a padding mask)."""
    configs = list({id(m.config): m.config for m in model.modules()
                    if hasattr(getattr(m, "config", None), "_attn_implementation")}.values())  # each once
    kernels = [c._attn_implementation for c in configs]
    training = model.training
    model.eval()
    for c in configs:
        c._attn_implementation = "sdpa"
    try:
        yield
    finally:
        for c, kernel in zip(configs, kernels):
            c._attn_implementation = kernel
        model.train(training)

