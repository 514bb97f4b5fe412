"""A real HTTP server speaking the OpenAI chat completions API over a tiny target, for the endpoint tests.

`POST /v1/chat/completions` renders the messages with the target's chat template and generation prompt (as vLLM and
SGLang do), decodes greedily with transformers' `generate` up to `max_tokens` or a stop token, and answers
`content`, `finish_reason` ("stop" / "length") and `usage.completion_tokens` (the stop token counted, as vLLM
does); `GET /v1/models` lists its one model. Faults on demand: the first `fail_first` attempts of every distinct
request answer 503, close the connection without an answer (`drop`), or answer after `slow_s` seconds (`slow`);
requests whose user messages contain `reject_word` get HTTP 400; `reasoning_field` splits the reply's first word off
into that field, as a reasoning parser would; `latency_s` delays every answer.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from decoding_helpers import hf_greedy
from dflash_trainer.data.chat import generation_prompt_ids
from dflash_trainer.targets.loader import LoadedTarget


class ChatServer:
    def __init__(
        self,
        target: LoadedTarget,
        *,
        model: str = "tiny-target",
        fault: str | None = None,
        fail_first: int = 0,
        slow_s: float = 0.0,
        reject_word: str | None = None,
        reasoning_field: str | None = None,
        latency_s: float = 0.0,
    ) -> None:
        self.target = target
        self.model = model
        self.fault = fault
        self.fail_first = fail_first
        self.slow_s = slow_s
        self.reject_word = reject_word
        self.reasoning_field = reasoning_field
        self.latency_s = latency_s
        self.attempts: Counter[str] = Counter()  # per distinct request (its messages)
        self.answered: list[list[dict[str, str]]] = []  # the messages of every request answered with a reply
        self.payloads: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()  # counters
        self._model_lock = threading.Lock()  # one generate at a time
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the client expects

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._answer(200, {"object": "list", "data": [{"id": server.model, "object": "model"}]})
                else:
                    self._answer(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/chat/completions":
                    self._answer(404, {"error": {"message": f"no route {self.path}"}})
                    return
                with server._lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    server._serve(self, body)
                finally:
                    with server._lock:
                        server.in_flight -= 1

            def _answer(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._handler = Handler
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        # A client that timed out has closed its end: the late answer's broken pipe is expected, not news.
        self._httpd.handle_error = lambda request, address: None  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def __enter__(self) -> ChatServer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _serve(self, handler: Any, body: dict[str, Any]) -> None:
        messages = body["messages"]
        key = json.dumps(messages)
        with self._lock:
            attempt = self.attempts[key]
            self.attempts[key] += 1
            self.payloads.append(body)
        if body.get("model") != self.model:
            handler._answer(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
            return
        if attempt < self.fail_first:
            if self.fault == "503":
                handler._answer(503, {"error": {"message": "server busy"}})
                return
            if self.fault == "drop":
                handler.close_connection = True  # no answer at all: the client sees the connection close
                return
            if self.fault == "slow":
                time.sleep(self.slow_s)
        if self.reject_word and any(self.reject_word in m["content"].split() for m in messages if m["role"] == "user"):
            handler._answer(400, {"object": "error", "message": "prompt too long for this server", "code": 400})
            return
        time.sleep(self.latency_s)  # a network and queue: requests overlap
        target = self.target
        (prompt,) = generation_prompt_ids(target.tokenizer, [messages])
        with self._model_lock:
            new = hf_greedy(target.model, prompt, body["max_tokens"], list(target.stop_token_ids))
        stopped = bool(new) and new[-1] in target.stop_token_ids
        text = target.tokenizer.decode(
            new[:-1] if stopped else new, skip_special_tokens=not body["skip_special_tokens"]
        )
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning_field:
            thought, _, answer = text.partition(" ")
            message = {"role": "assistant", "content": answer or None, self.reasoning_field: thought}
        with self._lock:
            self.answered.append(messages)
        handler._answer(
            200,
            {
                "id": "chatcmpl-test",
                "object": "chat.completion",
                "model": self.model,
                "choices": [{"index": 0, "message": message, "finish_reason": "stop" if stopped else "length"}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(new)},
            },
        )
