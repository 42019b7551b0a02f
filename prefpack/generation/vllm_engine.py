"""The vLLM engine: a client of a vLLM server's OpenAI-compatible completions API, prompts sent as token ids and
completions read back as token ids (``return_token_ids``; from ``logprobs`` tokens written ``token_id:N`` on
servers before it), never as text, with each sampled token's log-prob (``logprobs: 0``: ``output_logprobs``). One
request per prompt (``n`` samples, the prompt's own seed, so samples do not depend on how requests are grouped), a
few in flight at once, which vLLM batches itself.

vLLM pins its own torch and transformers, so it runs in its own environment: either a server the user started
(``url``), or one prefpack starts from a command (``server.VllmServer``) and stops after. Only the standard
library speaks HTTP here. A server that does not answer, answers with an error, or dies mid-round is one line
naming the URL (and the command, when prefpack started it).

A live server serves every round: ``update_weights`` reloads full weights through the worker extension
(``vllm_worker``, over vLLM's dev-mode ``/collective_rpc``), ``load_adapter`` loads a LoRA adapter at run time, and
``check_version`` refuses a server that cannot confirm the version; several servers: ``vllm_pool``.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from prefpack.generation.engine import (
    GenerationError,
    PromptJob,
    Sample,
    SamplingSettings,
    logprobs_problem,
    prompt_seed,
)
from prefpack.generation.vllm_worker import EXTENSION, RELOAD_METHOD, VERSION_METHOD, weight_files

DEFAULT_REQUEST_TIMEOUT = 600.0  # seconds one completions request may take (n long samples of a big model)
DEFAULT_CONCURRENCY = 32  # requests in flight; vLLM batches them
CHUNK_REQUESTS = 8  # prompts per call of generate, in units of the concurrency (rows are written after each call)

TRANSPORT_ERRORS = (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout, TimeoutError,
                    OSError)
ADAPTER_PREFIX = "prefpack-"  # a round's LoRA adapter is served as prefpack-<version>
FULL_WEIGHTS_START = f"--worker-extension-cls {EXTENSION} with VLLM_SERVER_DEV_MODE=1 in its environment"
ADAPTER_START = "--enable-lora with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment"


class ServerUnreachable(GenerationError):
    """A server that did not answer (refused, reset, timed out; or a completions request answered 5xx, vLLM's
    engine dead): a pool deals its prompts to the others."""


def adapter_name(version: str) -> str:
    return f"{ADAPTER_PREFIX}{version}"


def base_url(url: str) -> str:
    """``http://host:port`` from what a user may give (with or without ``/v1``, a trailing slash)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise GenerationError(f"vLLM URL {url!r} must start with http:// or https://")
    return url.removesuffix("/v1")


def http_json(url: str, body: dict | None = None, *, timeout: float) -> dict:
    """GET (no body) or POST one JSON request; an HTTP error status raises ``urllib.error.HTTPError`` with its
    body readable."""
    return json.loads(http_text(url, body, timeout=timeout))


MAX_ANSWER_BYTES = 64 << 20  # an answer larger than this is refused unread (a round's n samples are far smaller)


class AnswerTooLarge(http.client.HTTPException):
    """An answer past ``MAX_ANSWER_BYTES``: read no further (a server, or something posing as one, sending
    without end)."""


def http_text(url: str, body: dict | None = None, *, timeout: float, post: bool = False,
              max_bytes: int | None = None) -> str:
    """The answer's body as text (vLLM's admin endpoints answer plain text, or nothing). ``timeout`` bounds the whole
    exchange, not each read (a server that sends a byte a second is cut off at the deadline); a redirect is not
    followed (its answer would not be the server's) and an error status raises ``urllib.error.HTTPError`` with its
    body readable; an answer over ``max_bytes`` raises :class:`AnswerTooLarge`."""
    import io
    import threading
    import urllib.parse

    max_bytes = MAX_ANSWER_BYTES if max_bytes is None else max_bytes
    data = None if body is None else json.dumps(body).encode("utf-8")
    if data is None and post:
        data = b""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = connection(parts.hostname, parts.port, timeout=timeout)
    expired, held = threading.Event(), []

    def expire() -> None:  # the deadline: the socket shut, so a read blocked on it returns at once
        expired.set()
        for sock in [conn.sock, *held]:  # the response keeps the socket after the connection lets it go
            try:
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        conn.request("GET" if data is None else "POST", path, body=data,
                     headers={"Content-Type": "application/json"})
        held.append(conn.sock)
        resp = conn.getresponse()
        raw = resp.read(max_bytes + 1)
        if len(raw) > max_bytes:
            raise AnswerTooLarge(f"an answer over {max_bytes} bytes")
        if 300 <= resp.status < 400:
            raise urllib.error.HTTPError(url, resp.status, f"{resp.reason} (a redirect to "
                                         f"{resp.getheader('Location')!r}, not followed)", resp.headers, io.BytesIO())
        if resp.status >= 400:
            raise urllib.error.HTTPError(url, resp.status, resp.reason, resp.headers, io.BytesIO(raw))
        if expired.is_set():
            raise TimeoutError(f"no answer before the timeout ({timeout:g} s for the whole answer)")
        return raw.decode("utf-8")
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set() and not isinstance(exc, urllib.error.HTTPError):
            raise TimeoutError(f"no answer before the timeout ({timeout:g} s for the whole answer)") from None
        raise
    finally:
        timer.cancel()
        conn.close()


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
        return str(exc) if str(exc).startswith("no answer before") else "no answer before the timeout"
    if isinstance(exc, AnswerTooLarge):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def served_model(url: str, *, timeout: float) -> str:
    """The id of the model the server at ``url`` serves (``/v1/models``, the base model first); raises the
    transport error as is."""
    models = listed_models(url, timeout=timeout)
    if not models:
        raise GenerationError(f"the server at {url} lists no model at /v1/models")
    return models[0]


def listed_models(url: str, *, timeout: float) -> list[str]:
    """Every id ``/v1/models`` lists: the base model, then the LoRA adapters loaded."""
    listing = http_json(f"{url}/v1/models", timeout=timeout)
    data = listing.get("data") if isinstance(listing, dict) else None
    return [m["id"] for m in data or [] if isinstance(m, dict) and isinstance(m.get("id"), str)]


class VllmEngine:
    """Samples through the completions API of the server at ``url``; ``server`` (a ``VllmServer`` prefpack started)
    is stopped by ``close`` and named in errors. A live server (docs/generate.md) is given each round's weights by
    ``update_weights`` (full weights) or ``load_adapter`` (LoRA); from then on every ``generate`` first checks that
    the server still serves that version, so stale weights are never sampled silently."""

    name = "vllm"
    batch_dependent = False  # each request carries its prompt's seed

    def __init__(self, url: str, *, model: str | None = None, request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
                 concurrency: int = DEFAULT_CONCURRENCY, server=None, connect_timeout: float = 10.0):
        self.url, self.server, self.timeout = base_url(url), server, float(request_timeout)
        self.concurrency = max(1, int(concurrency))
        self.batch_prompts = CHUNK_REQUESTS * self.concurrency  # the pool keeps `concurrency` of them in flight
        self.version: str | None = None  # the weights version set by update_weights / load_adapter
        self.adapter: str | None = None  # the LoRA adapter name requests use (load_adapter)
        try:
            self.model = served_model(self.url, timeout=connect_timeout) if model is None else model
        except TRANSPORT_ERRORS as exc:
            raise ServerUnreachable(self._where(f"did not answer GET /v1/models ({describe_failure(exc)})")) \
                from None
        self.base_model = self.model

    def _where(self, what: str, hint: str = "check that it runs and serves the completions API") -> str:
        if self.server is not None:
            return self.server.failure(f"the vLLM server at {self.url} {what}")
        return f"the vLLM server at {self.url} {what}; {hint}"

    def _failed(self, exc: BaseException, what: str, hint: str) -> GenerationError:
        """An admin request the server answered with an error status (any: vLLM answers 500 to an RPC method its
        workers lack, or to an adapter without --enable-lora) is refused with ``hint`` (how to start it); one it
        did not answer is ``ServerUnreachable``."""
        reason = f"{what} ({describe_failure(exc)})"
        if isinstance(exc, urllib.error.HTTPError):
            return GenerationError(self._where(reason, f"start it with {hint}"))
        return ServerUnreachable(self._where(reason))

    def describe(self) -> dict:
        out = {"model": self.model, "url": self.url, "concurrency": self.concurrency}
        if self.version is not None:
            out["weights_version"] = self.version
        if self.server is not None:
            out.update(self.server.describe())
        return out

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()

    def rpc(self, method: str, *args: str, what: str, hint: str) -> list[dict]:
        """Each worker's answer to ``method`` of the worker extension, through ``POST /collective_rpc`` (vLLM's
        dev-mode endpoint: ``{"method", "args", "kwargs", "timeout"}`` in, ``{"results": [one per worker]}``
        out)."""
        body = {"method": method, "args": [str(a) for a in args], "kwargs": {}, "timeout": self.timeout}
        try:
            answer = json.loads(http_text(f"{self.url}/collective_rpc", body, timeout=self.timeout + 30))
        except TRANSPORT_ERRORS as exc:
            raise self._failed(exc, what, hint) from None
        except ValueError as exc:
            raise GenerationError(self._where(f"{what}: /collective_rpc answered other than JSON ({exc})",
                                              f"start it with {hint}")) from None
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list) or not results or not all(isinstance(r, dict) for r in results):
            raise GenerationError(self._where(f"{what}: /collective_rpc answered {str(answer)[:200]}",
                                              f"start it with {hint}"))
        return results

    def update_weights(self, folder: str | os.PathLike, version: str) -> None:
        """Load the full weights of ``folder`` (``*.safetensors``, a path the server's machine sees too) into the
        running server, record ``version``, and empty its prefix cache (KV computed by the old weights)."""
        version, folder = check_version_name(version), os.path.abspath(folder)
        try:
            weight_files(folder)
        except FileNotFoundError as exc:
            raise GenerationError(str(exc)) from None
        what = f"did not reload weights version {version!r} from {folder}"
        results = self.rpc(RELOAD_METHOD, folder, version, what=what, hint=FULL_WEIGHTS_START)
        got = sorted({str(r.get("version")) for r in results})
        if got != [version]:
            raise GenerationError(self._where(f"{what}: its workers answered version(s) {', '.join(got)}",
                                              f"start it with {FULL_WEIGHTS_START}"))
        try:
            http_text(f"{self.url}/reset_prefix_cache", timeout=self.timeout, post=True)
        except TRANSPORT_ERRORS as exc:
            raise self._failed(exc, "did not reset its prefix cache after a reload", FULL_WEIGHTS_START) from None
        self.version, self.adapter, self.model = version, None, self.base_model

    def load_adapter(self, folder: str | os.PathLike, version: str) -> None:
        """Serve the LoRA adapter of ``folder`` (peft's ``adapter_config.json`` and weights) as
        ``prefpack-<version>``, unloading the adapters an earlier round loaded; later requests name it as model."""
        version, folder = check_version_name(version), os.path.abspath(folder)
        if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
            raise GenerationError(f"{folder}: no adapter_config.json, so no LoRA adapter to load")
        name = adapter_name(version)
        for old in self._listed(f"did not list its models before loading adapter {name}"):
            if old.startswith(ADAPTER_PREFIX):
                self._lora("unload", {"lora_name": old}, f"did not unload the earlier adapter {old}")
        self._lora("load", {"lora_name": name, "lora_path": folder}, f"did not load adapter {name} from {folder}")
        self.adapter, self.version, self.model = name, version, name
        self.check_version(version)

    def _lora(self, action: str, body: dict, what: str) -> None:
        try:  # vLLM answers these with a line of text, not JSON
            http_text(f"{self.url}/v1/{action}_lora_adapter", body, timeout=self.timeout)
        except TRANSPORT_ERRORS as exc:
            raise self._failed(exc, what, ADAPTER_START) from None

    def _listed(self, what: str) -> list[str]:
        try:
            return listed_models(self.url, timeout=self.timeout)
        except TRANSPORT_ERRORS as exc:
            raise self._failed(exc, what, ADAPTER_START) from None
        except ValueError as exc:
            raise GenerationError(self._where(f"{what}: /v1/models answered other than JSON ({exc})")) from None

    def check_version(self, expected: str) -> None:
        """Refuse, in one line, a server that cannot confirm it serves weights version ``expected``: the adapter
        ``prefpack-<expected>`` listed at ``/v1/models``, else the worker extension's version equal to it."""
        expected = check_version_name(expected)
        name = adapter_name(expected)
        cannot = f"cannot confirm it serves weights version {expected!r}"
        models = self._listed(cannot)
        if name in models:
            self.adapter, self.version, self.model = name, expected, name
            return
        if self.adapter is not None:
            raise GenerationError(self._where(f"{cannot}: /v1/models lists {', '.join(models)}, not the adapter "
                                              f"{name}", f"start it with {ADAPTER_START}"))
        hint = f"{FULL_WEIGHTS_START} (full weights) or {ADAPTER_START} (LoRA adapters)"
        results = self.rpc(VERSION_METHOD, what=cannot, hint=hint)
        got = sorted({str(r.get("version")) for r in results})
        if got != [expected]:
            raise GenerationError(self._where(f"{cannot}: it serves version {', '.join(got)} (None: the weights "
                                              "it was started on)", "update its weights first"))
        self.version, self.model = expected, self.base_model

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

    def check_served(self) -> None:
        """Before sampling: the version set by an update is still the one served (a restarted server is not)."""
        if self.version is not None:
            self.check_version(self.version)

    def generate(self, jobs: Sequence[PromptJob], settings: SamplingSettings) -> list[list[Sample]]:
        if not jobs:
            return []
        self.check_served()
        pool = ThreadPoolExecutor(max_workers=min(self.concurrency, len(jobs)))
        try:
            futures = [pool.submit(self.sample, job, settings) for job in jobs]
            return [f.result() for f in futures]
        finally:  # on a failure, the requests not yet sent are not sent
            pool.shutdown(wait=True, cancel_futures=True)

    def sample(self, job: PromptJob, s: SamplingSettings) -> list[Sample]:
        """One prompt's ``n`` samples (one request); ``ServerUnreachable`` when the server did not answer."""
        try:
            answer = http_json(f"{self.url}/v1/completions", self.request(job, s), timeout=self.timeout)
        except TRANSPORT_ERRORS as exc:
            cls = GenerationError if answered(exc) else ServerUnreachable
            raise cls(self._where(f"failed on row {job.row} ({describe_failure(exc)})")) from None
        except ValueError as exc:  # not JSON
            raise GenerationError(self._where(f"answered row {job.row} with something other than JSON ({exc})")) \
                from None
        return parse_choices(answer, job, s, self.url)


def answered(exc: BaseException) -> bool:
    """Whether the server answered (an HTTP status below 500: the request's fault, any server would refuse it),
    as opposed to not answering or failing itself (5xx: vLLM's engine died)."""
    return isinstance(exc, urllib.error.HTTPError) and exc.code < 500


VERSION_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def check_version_name(version: str) -> str:
    """A weights version is part of an adapter's name: letters, digits, ``.``, ``_`` and ``-`` only."""
    if not isinstance(version, str) or not version or not set(version) <= VERSION_CHARS:
        raise GenerationError(f"weights version {version!r}: use a non-empty name of letters, digits, '.', '_' or "
                              "'-' (e.g. round-3)")
    return version


def parse_choices(answer: dict, job: PromptJob, s: SamplingSettings, url: str) -> list[Sample]:
    """A completions answer's ``n`` choices as samples, in choice order, each checked before anything is written:
    its prompt ids the ids sent (a server that re-tokenised or added BOS is refused), its output token ids integers
    of at most ``max_new_tokens`` ending where it says (a stop token, or the length limit)."""
    where = f"the vLLM server at {url} answered row {job.row} with"
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != s.n:
        raise GenerationError(f"{where} {len(choices) if isinstance(choices, list) else 'no'} choices, not n={s.n}")
    if not all(isinstance(c, dict) for c in choices):
        raise GenerationError(f"{where} choices that are not objects")
    indices = [c.get("index", k) for k, c in enumerate(choices)]
    if sorted(indices) != list(range(s.n)):
        raise GenerationError(f"{where} choice indices {indices}, not 0..{s.n - 1}")
    out = []
    for choice in sorted(choices, key=lambda c: c.get("index", 0)):
        sent = choice.get("prompt_token_ids", answer.get("prompt_token_ids"))
        if sent is not None and list(sent) != list(job.ids):
            raise GenerationError(f"the vLLM server at {url} generated row {job.row} from other prompt ids than "
                                  f"sent ({len(sent) if isinstance(sent, list) else sent!r} tokens, not "
                                  f"{len(job.ids)}): it re-tokenised the prompt")
        ids = output_ids(choice, where)
        if ids is None:
            raise GenerationError(f"the vLLM server at {url} returned no output token ids for row {job.row} (neither "
                                  "token_ids, asked with return_token_ids, nor token_id:N logprobs): use vLLM >= "
                                  "0.10.2")
        if len(ids) > s.max_new_tokens:
            raise GenerationError(f"{where} a sample of {len(ids)} tokens, past max_new_tokens={s.max_new_tokens}")
        reason, stop = choice.get("finish_reason"), choice.get("stop_reason")
        if reason not in ("stop", "length"):
            raise GenerationError(f"the vLLM server at {url} stopped a sample of row {job.row} for {reason!r}")
        sent = list(ids)  # the output ids as answered, which its log-probs are of
        if reason == "stop" and isinstance(stop, int) and not isinstance(stop, bool) and (not ids or ids[-1] != stop):
            ids.append(stop)  # a server that leaves the stop token out of the output ids
        if reason == "stop" and (not ids or ids[-1] not in s.stop_token_ids):
            raise GenerationError(f"{where} a sample said to stop at a stop token that ends "
                                  f"{'with token ' + str(ids[-1]) if ids else 'empty'}, not one of the stop ids "
                                  f"{list(s.stop_token_ids)}")
        if reason == "length" and not ids:
            raise GenerationError(f"{where} an empty sample said to be cut by the length limit")
        logprobs = output_logprobs(choice, sent, where)
        if len(ids) != len(sent):  # a stop token put back has no log-prob: the sample has none, never a guessed one
            logprobs = None
        out.append(Sample(tuple(ids), reason == "length", logprobs))
    return out


def output_logprobs(choice: dict, ids: list[int], where: str) -> tuple[float, ...] | None:
    """A choice's sampled-token log-probs, asked with ``logprobs: 0``: vLLM's completions answer gives
    ``choices[i].logprobs = {"tokens": ["token_id:N", ...], "token_logprobs": [float, ...], "top_logprobs",
    "text_offset"}``, one entry per output token, the stop token included (vLLM >= 0.10.2 computes them from the raw
    logits by default, ``--logprobs-mode raw_logprobs``: ``engine.Sample``; a value of -inf is sent as -9999.0).
    None when the choice holds no ``logprobs`` object or no ``token_logprobs`` (a server that gives none: never
    guessed); else one finite number <= 0 per output id, the ``token_id:N`` tokens (when given) the ids themselves,
    or a one-line error."""
    block = choice.get("logprobs")
    if block is None:
        return None
    if not isinstance(block, dict):
        raise GenerationError(f"{where} logprobs that are not an object ({type(block).__name__})")
    values = block.get("token_logprobs")
    if values is None:
        return None
    problem = logprobs_problem(ids, values)
    if problem is not None:
        raise GenerationError(f"{where} a sample of {len(ids)} tokens with {problem}")
    tokens = block.get("tokens")
    if isinstance(tokens, list) and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens) and \
            [t.removeprefix("token_id:") for t in tokens] != [str(t) for t in ids]:
        raise GenerationError(f"{where} log-probs of other tokens than its token_ids (logprobs.tokens "
                              f"{tokens[:4]}..., token_ids {ids[:4]}...)")
    return tuple(float(x) for x in values)


def output_ids(choice: dict, where: str = "the vLLM server answered") -> list[int] | None:
    """A choice's output token ids (``token_ids``, or ``token_id:N`` logprob tokens); None when it holds neither;
    ids that are not non-negative integers (floats, strings, booleans) are refused, never rounded."""
    ids = choice.get("token_ids")
    if ids is None:
        tokens = (choice.get("logprobs") or {}).get("tokens") if isinstance(choice.get("logprobs"), dict) else None
        if not (isinstance(tokens, list) and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens)):
            return None
        ids = [t.removeprefix("token_id:") for t in tokens]
        if not all(t.isdigit() for t in ids):
            raise GenerationError(f"{where} token ids that are not integers: "
                                  f"{next(t for t in ids if not t.isdigit())!r}")
        return [int(t) for t in ids]
    if not isinstance(ids, list):
        raise GenerationError(f"{where} token_ids that are not a list ({type(ids).__name__})")
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or t < 0), None)
    if bad is not None or any(isinstance(t, bool) for t in ids):
        raise GenerationError(f"{where} a token id that is not a non-negative integer: {bad!r}")
    return list(ids)
