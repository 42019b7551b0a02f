"""The one interface both sampling engines answer (``GenerationEngine``), the sampling settings, and the rules they
share: how a prompt's seed is derived and where a sample ends.

An engine turns prompts (token ids, never text) into ``n`` completions each, as token ids. A completion ends at its
first stop token (the template's end-of-turn and EOS), which it keeps, as prepare keeps EOS at a completion's end;
one that reaches ``max_new_tokens`` without a stop token is marked ``truncated``. Each prompt's sampling is seeded
from ``(seed, row)`` so that an engine that can seed each prompt (vLLM) gives samples independent of batching.

A sample also carries the sampling policy's log-prob of each of its tokens (``Sample.logprobs``), for the importance
ratios of on-policy objectives (GRPO): the log-prob under the model's *raw* distribution, ``log_softmax`` of its
logits before temperature, top-p or any other processing (vLLM's default ``logprobs_mode``, ``raw_logprobs``). Raw,
because the trainer compares them with its own forward of the same tokens, which is un-tempered: a tempered value
would differ from the trainer's by the temperature alone, even for identical weights. An engine that cannot give
them (an older vLLM server that answers without ``token_logprobs``) leaves them None; they are never guessed.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from prefpack.data.store_format import LOGPROB_SLACK
from prefpack.errors import PrefpackError


class GenerationError(PrefpackError, ValueError):
    """A generation setting, prompt or engine (a server that does not start or answer) that stops generate."""


@dataclass(frozen=True)
class SamplingSettings:
    """How each prompt is sampled; the same settings mean the same thing to both engines."""

    n: int = 4  # completions per prompt
    temperature: float = 1.0  # 0: greedy (then n must be 1)
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # end-of-turn and EOS ids (stops.stop_token_ids)

    def check(self) -> SamplingSettings:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise GenerationError(f"n (completions per prompt) must be a positive integer, not {self.n!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise GenerationError(f"temperature must be 0 (greedy) or positive, not {self.temperature!r}")
        if self.temperature == 0 and self.n > 1:
            raise GenerationError(f"temperature 0 is greedy decoding: its {self.n} completions of a prompt would all "
                                  "be the same; use n=1 or a positive temperature")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], not {self.top_p!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be a positive integer, not {self.max_new_tokens!r}")
        if not self.stop_token_ids:
            raise GenerationError("no stop token: a completion could never end before max_new_tokens")
        return self

    def to_json(self) -> dict:
        out = asdict(self)
        out["stop_token_ids"] = list(self.stop_token_ids)
        return out


@dataclass(frozen=True)
class PromptJob:
    """One prompt to sample: its row (which seeds it) and its token ids, exactly as training reads them."""

    row: int
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Sample:
    """One completion: its token ids (ending with the stop token when one was sampled), whether the length limit cut
    it (no stop token), and the sampling model's raw log-prob of each of its tokens (one per id; None when the engine
    gave none)."""

    ids: tuple[int, ...]
    truncated: bool
    logprobs: tuple[float, ...] | None = None


class GenerationEngine(Protocol):
    """What generate (and the rounds driver) reads of an engine. ``generate`` returns, per job in order, ``n``
    samples; ``describe`` what the samples' meta records of it; ``close`` frees what it holds (a server it
    started)."""


    name: str
    batch_prompts: int  # prompts the loop hands ``generate`` at once (and the rows a killed run may redo)
    batch_dependent: bool  # whether a prompt's samples depend on the others in its call (then a redo is whole)

    def generate(self, jobs: Sequence[PromptJob], settings: SamplingSettings) -> list[list[Sample]]: ...

    def describe(self) -> dict: ...

    def close(self) -> None: ...


def prompt_seed(seed: int, row: int) -> int:
    """A 31-bit seed for one prompt, from the run's seed and the prompt's row: seeds of nearby rows and runs are
    unrelated (``seed + row`` would make seed 1 row 0 repeat seed 0 row 1)."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(row)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def finish(ids: Sequence[int], stop_ids: Sequence[int], logprobs: Sequence[float] | None = None) -> Sample:
    """A raw continuation cut after its first stop token (what follows is padding or never sampled); truncated when
    it holds none. ``logprobs`` (one per raw id) are cut with the ids."""
    stops = set(stop_ids)
    end, cut = len(ids), True
    for k, tid in enumerate(ids):
        if tid in stops:
            end, cut = k + 1, False
            break
    kept = None if logprobs is None else tuple(float(x) for x in logprobs[:end])
    return Sample(tuple(int(t) for t in ids[:end]), cut, kept)


def logprobs_problem(ids: Sequence[int], logprobs) -> str | None:
    """What is wrong with a sample's log-probs (None: nothing): one finite float <= 0 (``LOGPROB_SLACK`` above 0
    allowed, rounding) per token id."""
    if not isinstance(logprobs, list | tuple):
        return f"log-probs that are not a list ({type(logprobs).__name__})"
    if len(logprobs) != len(ids):
        return f"{len(logprobs)} log-probs for its {len(ids)} tokens"
    for k, x in enumerate(logprobs):
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) or x > LOGPROB_SLACK:
            return f"log-prob {x!r} at token {k}, not a finite number <= 0"
    return None
