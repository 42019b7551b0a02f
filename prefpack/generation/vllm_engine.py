"""The vLLM engine: a client of a vLLM server's OpenAI-compatible completions API, prompts sent as token ids and
completions read back as token ids (``return_token_ids``; from ``logprobs`` tokens written ``token_id:N`` on
servers before it), never as text. One request per prompt (``n`` samples, the prompt's own seed, so samples do not
depend on how requests are grouped), a few in flight at once, which vLLM batches itself.

vLLM pins its own torch and transformers, so it runs in its own environment: either a server the user started
(``url``), or one prefpack starts from a command (``server.VllmServer``) and stops after. Only the standard
library speaks HTTP here. A server that does not answer, answers with an error, or dies mid-round is one line
naming the URL (and the command, when prefpack started it).
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from prefpack.generation.engine import GenerationError, PromptJob, Sample, SamplingSettings, prompt_seed

DEFAULT_REQUEST_TIMEOUT = 600.0  # seconds one completions request may take (n long samples of a big model)
DEFAULT_CONCURRENCY = 32  # requests in flight; vLLM batches them
CHUNK_REQUESTS = 8  # prompts per call of generate, in units of the concurrency (rows are written after each call)

TRANSPORT_ERRORS = (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout, TimeoutError,
                    OSError)


def base_url(url: str) -> str:
    """``http://host:port`` from what a user may give (with or without ``/v1``, a trailing slash)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise GenerationError(f"vLLM URL {url!r} must start with http:// or https://")
    return url.removesuffix("/v1")


def http_json(url: str, body: dict | None = None, *, timeout: float) -> dict:
    """GET (no body) or POST one JSON request; an HTTP error status raises ``urllib.error.HTTPError`` with its
    body readable."""
    data = None if body is None else json.dumps(body).encode("utf-8")
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (http(s) only: base_url checks)
        return json.loads(resp.read().decode("utf-8"))


def describe_failure(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        try:
            detail = exc.read().decode("utf-8", "replace").strip().replace("\n", " ")[:300]
        except Exception:  # the body may be gone with the connection
            detail = ""
        return f"HTTP {exc.code} {exc.reason}" + (f": {detail}" if detail else "")
    if isinstance(exc, urllib.error.URLError):
        exc = exc.reason if isinstance(exc.reason, BaseException) else exc
    if isinstance(exc, socket.timeout | TimeoutError):
        return "no answer before the timeout"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def served_model(url: str, *, timeout: float) -> str:
    """The id of the model the server at ``url`` serves (``/v1/models``); raises the transport error as is."""
    listing = http_json(f"{url}/v1/models", timeout=timeout)
    models = [m.get("id") for m in listing.get("data", []) if isinstance(m, dict)]
    if not models or not isinstance(models[0], str):
        raise GenerationError(f"the server at {url} lists no model at /v1/models (got {str(listing)[:200]})")
    return models[0]


class VllmEngine:
    """Samples through the completions API of the server at ``url``; ``server`` (a ``VllmServer`` prefpack started)
    is stopped by ``close`` and named in errors."""

    name = "vllm"
    batch_dependent = False  # each request carries its prompt's seed

    def __init__(self, url: str, *, model: str | None = None, request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
                 concurrency: int = DEFAULT_CONCURRENCY, server=None, connect_timeout: float = 10.0):
        self.url, self.server, self.timeout = base_url(url), server, float(request_timeout)
        self.concurrency = max(1, int(concurrency))
        self.batch_prompts = CHUNK_REQUESTS * self.concurrency  # the pool keeps `concurrency` of them in flight
        try:
            self.model = served_model(self.url, timeout=connect_timeout) if model is None else model
        except TRANSPORT_ERRORS as exc:
            raise GenerationError(self._where(f"did not answer GET /v1/models ({describe_failure(exc)})")) from None

    def _where(self, what: str) -> str:
        if self.server is not None:
            return self.server.failure(f"the vLLM server at {self.url} {what}")
        return f"the vLLM server at {self.url} {what}; check that it runs and serves the completions API"

    def describe(self) -> dict:
        out = {"model": self.model, "url": self.url, "concurrency": self.concurrency}
        if self.server is not None:
            out.update(self.server.describe())
        return out

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()

    def request(self, job: PromptJob, s: SamplingSettings) -> dict:
        """The completions request for one prompt (its ids as the prompt, the prompt's own seed)."""
        body = {"model": self.model, "prompt": list(job.ids), "n": s.n, "max_tokens": s.max_new_tokens,
                "temperature": s.temperature, "top_p": s.top_p, "seed": prompt_seed(s.seed, job.row),
                "stop_token_ids": list(s.stop_token_ids), "ignore_eos": False, "return_token_ids": True,
                # off, whatever the model's generation_config.json says (vLLM applies it by default)
                "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0,
                "logprobs": 0, "return_tokens_as_token_ids": True, "skip_special_tokens": False}
        return body

    def generate(self, jobs: Sequence[PromptJob], settings: SamplingSettings) -> list[list[Sample]]:
        if not jobs:
            return []
        pool = ThreadPoolExecutor(max_workers=min(self.concurrency, len(jobs)))
        try:
            futures = [pool.submit(self._one, job, settings) for job in jobs]
            return [f.result() for f in futures]
        finally:  # on a failure, the requests not yet sent are not sent
            pool.shutdown(wait=True, cancel_futures=True)

    def _one(self, job: PromptJob, s: SamplingSettings) -> list[Sample]:
        try:
            answer = http_json(f"{self.url}/v1/completions", self.request(job, s), timeout=self.timeout)
        except TRANSPORT_ERRORS as exc:
            raise GenerationError(self._where(f"failed on row {job.row} ({describe_failure(exc)})")) from None
        except ValueError as exc:  # not JSON
            raise GenerationError(self._where(f"answered row {job.row} with something other than JSON ({exc})")) \
                from None
        return parse_choices(answer, job, s, self.url)


def parse_choices(answer: dict, job: PromptJob, s: SamplingSettings, url: str) -> list[Sample]:
    """A completions answer's ``n`` choices as samples, in choice order; refuses an answer whose prompt ids are not
    the ids sent (a server that re-tokenised or added BOS) or that lacks output token ids."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != s.n:
        raise GenerationError(f"the vLLM server at {url} answered row {job.row} with "
                              f"{len(choices) if isinstance(choices, list) else 'no'} choices, not n={s.n}")
    out = []
    for choice in sorted(choices, key=lambda c: c.get("index", 0)):
        sent = choice.get("prompt_token_ids", answer.get("prompt_token_ids"))
        if sent is not None and list(sent) != list(job.ids):
            raise GenerationError(f"the vLLM server at {url} generated row {job.row} from other prompt ids than "
                                  f"sent ({len(sent)} tokens, not {len(job.ids)}): it re-tokenised the prompt")
        ids = output_ids(choice)
        if ids is None:
            raise GenerationError(f"the vLLM server at {url} returned no output token ids for row {job.row} (neither "
                                  "token_ids, asked with return_token_ids, nor token_id:N logprobs): use vLLM >= "
                                  "0.10.2")
        reason, stop = choice.get("finish_reason"), choice.get("stop_reason")
        if reason not in ("stop", "length"):
            raise GenerationError(f"the vLLM server at {url} stopped a sample of row {job.row} for {reason!r}")
        if reason == "stop" and isinstance(stop, int) and not isinstance(stop, bool) and (not ids or ids[-1] != stop):
            ids.append(stop)  # a server that leaves the stop token out of the output ids
        out.append(Sample(tuple(ids), reason == "length"))
    return out


def output_ids(choice: dict) -> list[int] | None:
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return [int(t) for t in ids]
    tokens = (choice.get("logprobs") or {}).get("tokens")
    if isinstance(tokens, list) and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        return [int(t.removeprefix("token_id:")) for t in tokens]
    return None
