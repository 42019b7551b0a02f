"""A stand-in for a vLLM server's OpenAI-compatible API, standard library only: ``/v1/models`` and
``/v1/completions`` with token-id prompts, answering with token ids drawn from the request's seed (so a test can
recompute them: ``stub_choice``). Used in a thread by tests/test_generate_vllm.py, and run as a script for the
server prefpack starts from a command (``--die-after N`` exits abruptly on request N+1, as a crashed server)."""

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
        return {"index": k, "text": "", "token_ids": ids, "finish_reason": "stop", "stop_reason": ids[-1]}
    return {"index": k, "text": "", "token_ids": ids, "finish_reason": "length", "stop_reason": None}


class StubServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int = 0, *, die_after: int | None = None, drop_stop_tokens: bool = False):
        super().__init__(("127.0.0.1", port), Handler)
        self.requests: list[dict] = []
        self.die_after, self.drop_stop_tokens, self.lock = die_after, drop_stop_tokens, threading.Lock()

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

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send({"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]})
        else:
            self._send({"error": "not found"}, 404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server: StubServer = self.server
        with server.lock:
            server.requests.append(body)
            dying = server.die_after is not None and len(server.requests) > server.die_after
        if dying:
            if __name__ == "__main__":
                os._exit(1)  # the process dies mid-round, its connections with it
            self.close_connection = True
            self.connection.shutdown(2)  # the server drops the request unanswered
            return
        choices = [stub_choice(body, k) for k in range(body["n"])]
        if server.drop_stop_tokens:  # a server that leaves the stop token out of token_ids (stop_reason names it)
            for c in choices:
                if c["finish_reason"] == "stop":
                    c["token_ids"] = c["token_ids"][:-1]
        self._send({"id": "cmpl-stub", "object": "text_completion", "model": MODEL_ID,
                    "choices": [dict(c, prompt_token_ids=body["prompt"]) for c in choices]})


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--die-after", type=int, default=None)
    a = ap.parse_args()
    StubServer(a.port, die_after=a.die_after).serve_forever()
