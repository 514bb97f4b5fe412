"""Answer chat prompts through an OpenAI-compatible server (vLLM, SGLang): the client of `prepare.engine: openai`.

Protocol (the chat completions API, not streamed; standard library HTTP only):

    POST {base_url}/chat/completions
      {"model", "messages": [{"role", "content"}, ...], "max_tokens", "temperature", "top_p", "seed", "n": 1,
       "stream": false, "skip_special_tokens": false}
    200 {"choices": [{"message": {"content", "reasoning_content" | "reasoning"}, "finish_reason"}],
         "usage": {"completion_tokens"}}
    GET {base_url}/models  ->  {"data": [{"id"}, ...]}   (the served names; `ChatEndpoint.check_model`)

The server renders the conversation with the target's chat template and the generation prompt, as our engine does;
temperature 0 is greedy. `finish_reason` "stop": the model ended its turn (the content stops before the stop
token); "length": cut at `max_tokens`. A server that runs a reasoning parser returns the model's thinking apart from
its answer, as `reasoning_content` (SGLang, older vLLM) or `reasoning` (newer vLLM): `ChatReply.reasoning`.
`skip_special_tokens: false` (vLLM and SGLang read it; other servers ignore it) decodes the reply as our engine does.
An API key, when the server wants one (`vllm serve --api-key`), is read from the environment (`OPENAI_API_KEY`).

Failures. Retried `retries` times, `backoff_s` after the first failure and twice as long after each further one (at
most `MAX_BACKOFF_S`): a connection refused, reset or closed before the answer; no answer within `timeout_s`; HTTP
408, 429, 500, 502, 503, 504; a finish reason other than stop and length (an aborted request). Then the request
fails: `EndpointError`, naming the server, the request and the last problem. Not retried: HTTP 401/403 (the key)
and 404 (the URL or the model name) fail at once; an answer that is not a chat completion fails at once; any other
4xx (e.g. a prompt longer than the server's context) rejects that request only: `ChatReply.rejected` holds the
server's message and the caller decides (regeneration: the record fails the run or is skipped, per `on_error`).

Concurrency. `EndpointPool` answers up to `concurrency` requests at once on daemon worker threads, each with its own
keep-alive connection. The caller submits at most that many before it takes a reply (`submit` refuses more), so
nothing queues without bound; replies come back in the order they finish. A worker's failure is raised by `take`;
`close` stops the workers (a request in progress is abandoned with its daemon thread).
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ..config import EndpointConfig
from ..errors import UserError

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
FATAL_STATUSES = frozenset({401, 403, 404})
MAX_BACKOFF_S = 60.0
API_KEY_ENV = "OPENAI_API_KEY"
# Characters of a server's error message kept in our messages.
MESSAGE_CHARS = 300
T = TypeVar("T")


class EndpointError(UserError, RuntimeError):
    """The server cannot be reached, refuses the key or model, or keeps failing a request."""


@dataclass(frozen=True)
class ChatRequest:
    key: Hashable
    label: str  # names the request in errors, e.g. "record HumanEval/0, turn 1"
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass(frozen=True)
class ChatReply:
    key: Hashable
    content: str = ""
    reasoning: str = ""
    stopped: bool = False  # the model ended its turn (False: cut at max_tokens)
    completion_tokens: int = 0
    rejected: str | None = None  # the server's message when it refused this request (HTTP 4xx)


class _Retry(Exception):
    """A failure worth another attempt; the message says what happened."""


class _Connection:
    """One keep-alive HTTP(S) connection, opened on first use and again after any failure."""

    def __init__(self, endpoint: ChatEndpoint) -> None:
        self.endpoint = endpoint
        self._conn: http.client.HTTPConnection | None = None

    def exchange(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, bytes]:
        endpoint = self.endpoint
        if self._conn is None:
            kind = http.client.HTTPSConnection if endpoint.scheme == "https" else http.client.HTTPConnection
            self._conn = kind(endpoint.host, endpoint.port, timeout=endpoint.settings.timeout_s)
        try:
            self._conn.request(method, path, body=body, headers=headers)
            response = self._conn.getresponse()
            data = response.read()
        except BaseException:
            self.close()
            raise
        if response.will_close:
            self.close()
        return response.status, data

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class ChatEndpoint:
    """The server at `settings.base_url`; `model` is the served name requests ask for."""

    def __init__(self, settings: EndpointConfig, *, api_key: str | None = None) -> None:
        parts = urlsplit(settings.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EndpointError(f"prepare.endpoint.base_url: {settings.base_url!r} is not an http(s) URL")
        self.settings = settings
        self.url = settings.base_url.rstrip("/")
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = parts.port
        self.path = parts.path.rstrip("/")
        self.model = settings.model
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"

    def check_model(self) -> str:
        """The model name requests will use: `settings.model`, checked against the served names when the server
        lists them, or the one name it serves when `settings.model` is empty. Fails early on an unreachable
        server, a wrong URL or key, or an unknown name."""
        connection = _Connection(self)
        try:
            names = self._call(connection, "GET", "/models", None, "listing the models", _served_names)
        finally:
            connection.close()
        if self.model:
            if names is not None and self.model not in names:
                raise EndpointError(
                    f"{self.url}: serves {sorted(names)}, not {self.model!r} (--model, prepare.endpoint.model)"
                )
            return self.model
        if names is None or len(names) != 1:
            listed = "no list of models" if names is None else f"the models {sorted(names)}"
            raise EndpointError(f"{self.url}: serves {listed}; name the target's (--model, prepare.endpoint.model)")
        self.model = names[0]
        return self.model

    def complete(self, request: ChatRequest, connection: _Connection) -> ChatReply:
        """One chat completion, retried as the module docstring says."""
        payload = {
            "model": self.model,
            "messages": request.messages,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "n": 1,
            "stream": False,
            "skip_special_tokens": False,
        }
        if request.seed is not None:
            payload["seed"] = request.seed

        def parse(status: int, raw: bytes) -> ChatReply:
            if 400 <= status < 500:
                return ChatReply(request.key, rejected=f"HTTP {status}: {_server_message(raw)}")
            return self._chat_reply(request, raw)

        return self._call(connection, "POST", "/chat/completions", payload, request.label, parse)

    def _chat_reply(self, request: ChatRequest, raw: bytes) -> ChatReply:
        try:
            answer = json.loads(raw)
            choice = answer["choices"][0]
            message = choice["message"]
            finish = choice.get("finish_reason")
            content = message.get("content") or ""
            reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
            usage = answer.get("usage") or {}
            tokens = int(usage.get("completion_tokens") or 0)
            if not isinstance(content, str) or not isinstance(reasoning, str):
                raise TypeError("content and reasoning must be strings")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as error:
            raise EndpointError(
                f"{self.url}: {request.label}: the answer is not a chat completion ({error}): {raw[:MESSAGE_CHARS]!r}"
            ) from None
        if finish not in ("stop", "length"):
            raise _Retry(f"finish_reason {finish!r}")
        return ChatReply(request.key, content, reasoning, stopped=finish == "stop", completion_tokens=tokens)

    def _call(
        self,
        connection: _Connection,
        method: str,
        path: str,
        payload: dict[str, Any] | None,
        label: str,
        parse: Callable[[int, bytes], T],
    ) -> T:
        body = None if payload is None else json.dumps(payload, ensure_ascii=False).encode("utf-8")
        attempts = self.settings.retries + 1
        problem = ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(min(self.settings.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
            try:
                status, raw = connection.exchange(method, self.path + path, body, self.headers)
                if status in RETRY_STATUSES:
                    raise _Retry(f"HTTP {status}: {_server_message(raw)}")
                if status in FATAL_STATUSES or (status >= 300 and not 400 <= status < 500):
                    raise EndpointError(f"{self.url}{path}: {label}: HTTP {status}: {_server_message(raw)}")
                return parse(status, raw)
            except _Retry as retry:
                problem = str(retry)
            except (OSError, http.client.HTTPException) as error:  # refused, reset, closed early, timed out
                problem = f"{type(error).__name__}: {error}".rstrip(": ")
        raise EndpointError(
            f"{self.url}: {label}: no answer after {attempts} attempt(s), the last: {problem} (is the server up? "
            "more attempts or time: --retries / --timeout, prepare.endpoint.retries / timeout_s)"
        )


def _served_names(status: int, raw: bytes) -> list[str] | None:
    """The model ids of a `/models` answer; None when the server has no such list."""
    if status >= 400:
        return None
    try:
        return [str(entry["id"]) for entry in json.loads(raw)["data"]]
    except (ValueError, KeyError, TypeError):
        return None


def _server_message(raw: bytes) -> str:
    """The error message of a server's answer: OpenAI's {"error": {"message"}}, vLLM's {"message"}, or the text."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        answer = json.loads(text)
        error = answer.get("error", answer) if isinstance(answer, dict) else answer
        message = error.get("message", error) if isinstance(error, dict) else error
        text = str(message)
    except ValueError:
        pass
    return " ".join(text.split())[:MESSAGE_CHARS] or "(no message)"


class EndpointPool:
    """Up to `concurrency` requests answered at once; see the module docstring."""

    def __init__(self, endpoint: ChatEndpoint, concurrency: int) -> None:
        self.endpoint = endpoint
        self.concurrency = concurrency
        self.in_flight = 0
        # Bounded by `submit`: never more than `concurrency` requests in it.
        self._inbox: queue.Queue[ChatRequest | None] = queue.Queue()
        self._outbox: queue.Queue[ChatReply | BaseException] = queue.Queue()
        self._workers: list[threading.Thread] = []

    def submit(self, request: ChatRequest) -> None:
        if self.in_flight >= self.concurrency:
            raise RuntimeError(f"{self.in_flight} requests in flight already (concurrency {self.concurrency})")
        self.in_flight += 1
        if len(self._workers) < self.in_flight:  # a worker per request in flight, started as they are needed
            worker = threading.Thread(target=self._work, name=f"endpoint-{len(self._workers)}", daemon=True)
            worker.start()
            self._workers.append(worker)
        self._inbox.put(request)

    def take(self) -> ChatReply:
        """The next reply to finish (blocks); a worker's failure is raised here."""
        if not self.in_flight:
            raise RuntimeError("no request in flight")
        item = self._outbox.get()
        self.in_flight -= 1
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        for _ in self._workers:
            self._inbox.put(None)

    def _work(self) -> None:
        connection = _Connection(self.endpoint)
        try:
            while (request := self._inbox.get()) is not None:
                try:
                    self._outbox.put(self.endpoint.complete(request, connection))
                except BaseException as error:  # handed to the caller, who stops the run
                    self._outbox.put(error)
        finally:
            connection.close()
