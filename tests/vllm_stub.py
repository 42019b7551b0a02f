"""A stand-in for a vLLM server's OpenAI-compatible API, standard library only: ``/v1/models`` and
``/v1/completions`` with token-id prompts, answering with token ids drawn from the request's seed (so a test can
recompute them: ``stub_choice``) and, asked with ``logprobs``, a log-prob per token in vLLM's format
(``stub_logprobs``; ``logprobs=False``: a server that gives none). Used in a thread by tests/test_generate_vllm.py,
and run as a script for the server prefpack starts from a command (``--die-after N`` exits abruptly on request N+1,
as a crashed server).

A live server's admin endpoints, shaped as vLLM's (tests/test_vllm_live.py): ``POST /collective_rpc`` (dev mode,
``{"method", "args", "kwargs", "timeout"}`` in, ``{"results": [one per worker]}`` out) answering the prefpack worker
extension's reload and version methods, ``POST /reset_prefix_cache`` (empty answer), and, with ``lora``, ``POST
/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (a line of text) with the adapters listed at ``/v1/models``.
``dev_mode=False`` is a server started without VLLM_SERVER_DEV_MODE (404 on /collective_rpc), ``extension=False``
one without the worker extension (500: its workers lack the method), ``lora="no --enable-lora"`` one with runtime
LoRA updating but no LoRA support (500)."""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL_ID = "stub-model"


def stub_choice(body: dict, k: int) -> dict:
    """Choice ``k`` of a request: 1..max_tokens tokens from ids 3..49 drawn from (seed, k); ended by the first
    stop id when shorter than max_tokens (finish_reason stop), else cut (finish_reason length)."""
    rng = random.Random(body["seed"] * 1009 + k)
    limit = body["max_tokens"]
    length = rng.randint(1, limit)
    ids = [rng.randrange(3, 50) for _ in range(length)]
    if length < limit:
        ids[-1] = body["stop_token_ids"][0]
        choice = {"index": k, "text": "", "token_ids": ids, "finish_reason": "stop", "stop_reason": ids[-1]}
    else:
        choice = {"index": k, "text": "", "token_ids": ids, "finish_reason": "length", "stop_reason": None}
    if body.get("logprobs") is not None:  # asked: vLLM's CompletionLogProbs, one entry per output token
        choice["logprobs"] = stub_logprobs(ids)
    return choice


def stub_logprobs(ids: list[int]) -> dict:
    """vLLM's ``logprobs`` object of a completions choice asked with ``logprobs: 0`` and
    ``return_tokens_as_token_ids`` (vllm 0.32.0, ``CompletionLogProbs``): the sampled tokens as ``token_id:N``, each
    one's log-prob, the same in ``top_logprobs``, and the tokens' text offsets; the values here are made up from the
    ids (``stub_logprob``)."""
    tokens = [f"token_id:{t}" for t in ids]
    values = [stub_logprob(t, j) for j, t in enumerate(ids)]
    offsets = [sum(len(x) for x in tokens[:j]) for j in range(len(ids))]
    return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens,
            "top_logprobs": [{tok: v} for tok, v in zip(tokens, values)]}


def stub_logprob(token: int, position: int) -> float:
    return -0.05 * (1 + (token * 7 + position) % 97)


MISANSWERS = ("float_ids", "string_ids", "negative", "out_of_vocab", "too_long", "empty", "wrong_stop", "not_objects",
              "redirect", "huge", "dribble", "nan_logprob", "logprob_count", "positive_logprob", "logprob_tokens")


class StubServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # a round's requests connect at once (uvicorn's backlog is 2048; the default 5 resets)

    def __init__(self, port: int = 0, *, die_after: int | None = None, drop_stop_tokens: bool = False,
                 answer: str | None = None, logprobs: bool = True,
                 dev_mode: bool = True, extension: bool = True, lora: bool = True, workers: int = 1):
        super().__init__(("127.0.0.1", port), Handler)
        self.requests: list[dict] = []  # completions requests
        self.die_after, self.drop_stop_tokens, self.lock = die_after, drop_stop_tokens, threading.Lock()
        self.answer = answer  # a misbehaving answer (MISANSWERS), for tests of what prefpack refuses
        self.logprobs = logprobs  # False: a server that answers without log-probs (logprobs null), as an older one
        self.dev_mode, self.extension, self.lora, self.workers = dev_mode, extension, lora, workers
        self.admin: list[tuple[str, dict]] = []  # (path, body) of each admin request, in order
        self.version: str | None = None  # what the workers say they serve (None: the weights started on)
        self.loaded_from: str | None = None  # the folder the last reload read
        self.adapters: dict[str, str] = {}  # LoRA adapters loaded: name -> path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> StubServer:
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, obj: dict, code: int = 200) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _text(self, text: str, code: int = 200) -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            cards = [{"id": MODEL_ID, "object": "model"}] + [
                {"id": name, "object": "model", "root": path, "parent": MODEL_ID}
                for name, path in self.server.adapters.items()]
            self._send({"object": "list", "data": cards})
        else:
            self._send({"error": "not found"}, 404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        server: StubServer = self.server
        if self.path != "/v1/completions":
            with server.lock:
                dead = server.die_after is not None and len(server.requests) > server.die_after
                if not dead:
                    server.admin.append((self.path, body))
                    self._admin(server, body)
            if dead:  # a dead server answers nothing
                self.close_connection = True
                self.connection.shutdown(2)
            return
        with server.lock:
            server.requests.append(body)
            dying = server.die_after is not None and len(server.requests) > server.die_after
        if not dying and body["model"] not in (MODEL_ID, *server.adapters):
            self._send({"error": {"message": f"The model `{body['model']}` does not exist.", "code": 404}}, 404)
            return
        if dying:
            if __name__ == "__main__":
                os._exit(1)  # the process dies mid-round, its connections with it
            self.close_connection = True
            self.connection.shutdown(2)  # the server drops the request unanswered
            return
        choices = [stub_choice(body, k) for k in range(body["n"])]
        if server.answer is not None:
            self._misanswer(server.answer, body, choices)
            return
        if server.drop_stop_tokens:  # a server that leaves the stop token out of token_ids (stop_reason names it)
            for c in choices:
                if c["finish_reason"] == "stop":
                    c["token_ids"] = c["token_ids"][:-1]
                    if "logprobs" in c:
                        c["logprobs"] = stub_logprobs(c["token_ids"])
        if not server.logprobs:
            for c in choices:
                c["logprobs"] = None
        self._send({"id": "cmpl-stub", "object": "text_completion", "model": MODEL_ID,
                    "choices": [dict(c, prompt_token_ids=body["prompt"]) for c in choices]})

    def _misanswer(self, how: str, body: dict, choices: list[dict]) -> None:
        """A wrong answer of kind ``how`` (see ``MISANSWERS``)."""
        import time

        if how == "redirect":
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:9/v1/completions")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if how == "dribble":  # the whole answer, a byte at a time, 0.1 s apart
            data = json.dumps({"choices": [dict(c, prompt_token_ids=body["prompt"]) for c in choices]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            for b in data:
                self.wfile.write(bytes([b]))
                self.wfile.flush()
                time.sleep(0.1)
            return
        for c in choices:
            c["prompt_token_ids"] = body["prompt"]
            ids = c["token_ids"]
            if how == "float_ids":
                c["token_ids"] = [t + 0.7 for t in ids]
            elif how == "string_ids":
                c["token_ids"] = [str(t) for t in ids]
            elif how == "negative":
                c["token_ids"] = [-5, *ids]
            elif how == "out_of_vocab":
                c["token_ids"] = [123456, *ids[1:]]
            elif how == "too_long":
                c["token_ids"], c["finish_reason"], c["stop_reason"] = ids * 60, "length", None
            elif how == "empty":
                c["token_ids"], c["finish_reason"], c["stop_reason"] = [], "length", None
            elif how == "wrong_stop":
                c["token_ids"], c["finish_reason"], c["stop_reason"] = [5, 6], "stop", None
            elif how == "huge":
                c["text"] = "x" * 5000
            elif how == "nan_logprob":
                c["logprobs"]["token_logprobs"][-1] = float("nan")  # json.dumps writes NaN
            elif how == "logprob_count":
                c["logprobs"]["token_logprobs"].append(-1.0)
            elif how == "positive_logprob":
                c["logprobs"]["token_logprobs"][0] = 0.5
            elif how == "logprob_tokens":
                c["logprobs"]["tokens"][0] = f"token_id:{ids[0] + 1}"
            if c["token_ids"] is not ids:  # wrong ids come without log-probs (an older server's): only the ids are
                c["logprobs"] = None  # wrong, and the answer no larger than it was
        if how == "not_objects":
            choices = ["x"] * len(choices)
        self._send({"id": "cmpl-stub", "object": "text_completion", "model": MODEL_ID, "choices": choices})

    def _admin(self, server: StubServer, body: dict) -> None:
        """The admin endpoints, answered as vLLM answers them."""
        if self.path == "/collective_rpc" and server.dev_mode:
            method, args = body.get("method"), body.get("args", [])
            if not server.extension:  # the workers lack the method: vLLM's engine raises, the server answers 500
                self._text("Internal Server Error", 500)
            elif method == "prefpack_reload_weights":
                server.loaded_from, server.version = args
                self._send({"results": [{"version": server.version, "tensors": 3}] * server.workers})
            elif method == "prefpack_weights_version":
                self._send({"results": [{"version": server.version}] * server.workers})
            else:
                self._send({"error": {"message": f"AttributeError: no method {method}", "code": 500}}, 500)
        elif self.path == "/reset_prefix_cache" and server.dev_mode:
            self._text("")
        elif self.path == "/v1/load_lora_adapter" and server.lora == "no --enable-lora":
            self._send({"error": {"message": "LoRA is not enabled", "code": 500}}, 500)
        elif self.path == "/v1/load_lora_adapter" and server.lora:
            if body["lora_name"] in server.adapters:
                self._send({"error": {"message": f"The lora adapter '{body['lora_name']}' has already been loaded.",
                                      "code": 400}}, 400)
                return
            server.adapters[body["lora_name"]] = body["lora_path"]
            self._text(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")
        elif self.path == "/v1/unload_lora_adapter" and server.lora:
            if server.adapters.pop(body["lora_name"], None) is None:
                self._send({"error": {"message": "cannot be found", "code": 404}}, 404)
                return
            self._text(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")
        else:
            self._send({"detail": "Not Found"}, 404)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--die-after", type=int, default=None)
    a = ap.parse_args()
    print(f"stub server started on port {a.port}", flush=True)  # a line per start, in the log prefpack keeps
    StubServer(a.port, die_after=a.die_after).serve_forever()
