"""A deterministic OpenAI-compatible HTTP server for tests, on 127.0.0.1 (port 0).

It answers ``POST /v1/chat/completions``, ``POST /v1/embeddings`` and ``GET /v1/models``
the way OpenAI, vLLM or Ollama would, so the real ``openai`` client can talk to it:

* completions are a deterministic function of the prompt (:func:`fake_completion`), so a
  build through this server is reproducible and two builds can be compared node by node;
* embeddings are :class:`raptor_core.testing.FakeEmbedder` vectors (texts sharing words are
  similar, so real clustering over them is meaningful), as floats or base64;
* knobs: a per-request ``delay``, a fault plan (429 with ``Retry-After``, 500, a response
  slower than the client's timeout, a dropped connection, an empty or truncated completion,
  401/400/404, and 200 responses with an invalid body: an HTML page, cut JSON, JSON without
  ``choices``/``data``, non-text content, a wrong count or size of embeddings, non-numbers),
  a required API key, a model list, and an ``on_request`` hook;
* it records every request (:class:`Record`) and the peak number of requests in flight;
* the Batch API: ``POST /v1/files`` (multipart upload), ``GET /v1/files/{id}/content``,
  ``POST /v1/batches``, ``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``.  A batch
  stays ``in_progress`` for ``batch_polls`` retrievals, then ends as ``batch_outcome`` says;
  a completed one answers each JSONL line through the same chat handler (per-line faults
  come from the fault plan with endpoint ``"batch"`` and the line's ``custom_id``:
  ``"error"``, ``"missing"``, ``"empty"``, ``"truncated"``).  ``batches`` and ``files``
  hold what was created, so tests can assert that no second batch was submitted;
* a rate-limit mode (:class:`RateLimit`): ``x-ratelimit-*`` headers on every chat and
  embeddings answer, and a 429 for a request over the window (counted in ``rate_limited``).

Use it as a context manager::

    with FakeOpenAIServer(delay=0.05) as server:
        llm = OpenAIChatLLM("fake-chat", base_url=server.url, api_key="sk-test")
"""

from __future__ import annotations

import base64
import contextlib
import email.parser
import email.policy
import hashlib
import importlib.util
import itertools
import json
import math
import random
import re
import socket
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest

from raptor_core.testing import FakeEmbedder

__all__ = [
    "CORPUS",
    "FAULTS",
    "INVALID_BODY_FAULTS",
    "LOCALHOST",
    "FakeOpenAIServer",
    "FaultPlan",
    "GroupClusterer",
    "RateLimit",
    "Record",
    "fake_completion",
    "fake_embedding",
    "fault_share",
    "faults_in_order",
    "openai_builder",
    "tree_signature",
]

#: Marks for a test that talks to this server: it passes ``pytest --disable-socket`` (the
#: offline unit-test mode) when pytest-socket is installed, and is harmless when it is not.
LOCALHOST = [pytest.mark.enable_socket] if importlib.util.find_spec("pytest_socket") else []

#: Fault kinds the server can inject.
FAULTS = (
    "429",
    "500",
    "slow",
    "drop",
    "empty",
    "truncated",
    "quota",
    "400",
    "401",
    "403",
    "404",
    "501",
    *(
        "html",  # 200 with an HTML page (base_url pointing at a web UI or a login proxy)
        "bad_json",  # 200 with the right JSON cut in half
        "no_choices",  # chat: 200 with JSON but no "choices"
        "bad_content",  # chat: 200 with a number as the message content
        "no_data",  # embeddings: 200 with JSON but no "data"
        "wrong_count",  # embeddings: one vector fewer than texts
        "wrong_dim",  # embeddings: the first vector one value short
        "not_numbers",  # embeddings: strings instead of numbers
    ),
)

#: Faults answered with HTTP 200 and a body the client must reject.
INVALID_BODY_FAULTS = {
    "chat": ("html", "bad_json", "no_choices", "bad_content", "empty"),
    "embeddings": ("html", "bad_json", "no_data", "wrong_count", "wrong_dim", "not_numbers"),
}

#: ``plan(endpoint, key, attempt) -> fault or None``; ``attempt`` counts earlier requests with
#: the same body (0 for the first), ``endpoint`` is ``"chat"`` or ``"embeddings"``.
FaultPlan = Callable[[str, str, int], "str | None"]

_WORD = re.compile(r"\w+", re.UNICODE)
_PAPER_PREFIX = "including as many key details as possible:"


def fake_completion(prompt: str, max_tokens: int | None = None) -> str:
    """The server's answer to ``prompt``: a hash tag and ten words of the context, in order."""
    digest = hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:8]
    context = prompt.split(_PAPER_PREFIX, 1)[-1]
    words = _WORD.findall(context)
    rng = random.Random(digest)
    picked = sorted(rng.sample(range(len(words)), min(10, len(words))))
    out = [f"S{digest}", *(words[i] for i in picked)]
    return " ".join(out[: max_tokens if max_tokens else len(out)])


_EMBEDDERS: dict[int, FakeEmbedder] = {}


def fake_embedding(text: str, dim: int = 32) -> np.ndarray:
    """The server's (unit) embedding of ``text``."""
    embedder = _EMBEDDERS.setdefault(dim, FakeEmbedder(dim))
    return embedder.embed_query(text)


def fault_share(
    kinds: Sequence[str],
    share: float,
    *,
    endpoints: Collection[str] = ("chat",),
    attempts: int = 1,
    seed: int = 0,
) -> FaultPlan:
    """Fault the first ``attempts`` tries of about ``share`` of the distinct requests.

    The kind is picked by a hash of the request, so a plan is reproducible, and every request
    eventually succeeds (with ``attempts`` <= the client's ``max_retries``).
    """

    def plan(endpoint: str, key: str, attempt: int) -> str | None:
        if endpoint not in endpoints or attempt >= attempts:
            return None
        h = int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest(), 16)
        if (h % 10_000) / 10_000 >= share:
            return None
        return kinds[(h // 10_000) % len(kinds)]

    return plan


def faults_in_order(*kinds: str | None, endpoint: str = "chat") -> FaultPlan:
    """The n-th request to ``endpoint`` gets ``kinds[n]`` (None: no fault); later ones none."""
    lock = threading.Lock()
    queue = list(kinds)

    def plan(ep: str, key: str, attempt: int) -> str | None:
        if ep != endpoint:
            return None
        with lock:
            return queue.pop(0) if queue else None

    return plan


@dataclass
class RateLimit:
    """Fixed-window limits of the server's rate-limit mode.

    Args:
        requests: requests allowed per window.
        tokens: tokens allowed per window (a request costs ceil(characters / 4) of its
            messages or inputs, plus its ``max_tokens``, as OpenAI's estimate does).
        window: window length in seconds; a window starts with the first request after the
            previous one ended.  Chat and embeddings have a window each (OpenAI limits each
            model on its own).
        enforce: answer 429 over the limit (False: only send the headers).
    """

    requests: int = 1_000_000
    tokens: int = 1_000_000_000
    window: float = 1.0
    enforce: bool = True


def _format_duration(seconds: float) -> str:
    """OpenAI's style: ``"20ms"``, ``"1.500s"``, ``"6m0.000s"``."""
    if seconds < 1.0:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60.0)
    return f"{int(minutes)}m{rest:.3f}s" if minutes else f"{rest:.3f}s"


@dataclass
class Record:
    """One request the server received."""

    endpoint: str
    body: dict[str, Any]
    key: str
    attempt: int
    fault: str | None = None
    status: int = 0
    ok: bool = False  # answered with a usable result (not faulted)
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    authorization: str = ""

    @property
    def prompt(self) -> str:
        """The user message of a chat request ("" otherwise)."""
        messages = self.body.get("messages") or []
        users = [m.get("content", "") for m in messages if m.get("role") == "user"]
        return users[-1] if users else ""

    @property
    def inputs(self) -> list[str]:
        """The texts of an embeddings request."""
        value = self.body.get("input", [])
        return [value] if isinstance(value, str) else list(value)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    fake: FakeOpenAIServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        path = self.path.rstrip("/")
        if path.endswith(("/files", "/batches")) or "/batches/" in path:
            self.server.fake._batch_api(self, "POST")
        else:
            self.server.fake._handle(self)

    def do_GET(self) -> None:
        fake = self.server.fake
        if "/files/" in self.path or "/batches/" in self.path:
            fake._batch_api(self, "GET")
        elif self.path.rstrip("/").endswith("/models"):
            names = sorted(fake.models) if fake.models is not None else ["fake-chat", "fake-embed"]
            fake._send(
                self, 200, {"object": "list", "data": [{"id": n, "object": "model"} for n in names]}
            )
        else:
            fake._send(self, 404, {"error": {"message": f"no route {self.path}"}})


class FakeOpenAIServer:
    """An OpenAI-compatible server on 127.0.0.1 with fault injection and a request log.

    Args:
        delay: seconds every chat request takes (before faults are applied).
        embed_delay: seconds every embeddings request takes.
        faults: a :data:`FaultPlan` (see :func:`fault_share`, :func:`faults_in_order`).
        api_key: when set, requests must carry ``Authorization: Bearer <api_key>``; others get
            a 401 whose message echoes the key they sent (a hostile server: the client must
            not repeat it).
        models: model names the server knows (None: any); others get a 404.
        dim: embedding dimension.
        retry_after: the ``Retry-After`` header sent with a 429 (a string, as on the wire).
        slow_seconds: how long a ``"slow"`` fault stalls before answering.
        on_request: called with each :class:`Record` before it is answered (for example to
            SIGKILL a client at a chosen request).
        batch_polls: retrievals a batch answers ``in_progress`` before it ends.
        batch_outcome: how batches end: ``"completed"``, ``"failed"``, ``"expired"``.
        batch_partial: lines an expired or cancelled batch answered before it ended (its
            output file holds them, as OpenAI's does).
        rate_limit: the rate-limit mode's windows (None: no headers, no limits).
        completion: ``completion(prompt, max_tokens) -> str`` writes the chat answers
            (:func:`fake_completion` by default; tests of LLM-guided search script JSON).
    """

    def __init__(
        self,
        *,
        delay: float = 0.0,
        embed_delay: float = 0.0,
        faults: FaultPlan | None = None,
        api_key: str | None = None,
        models: Collection[str] | None = None,
        dim: int = 32,
        retry_after: str = "0.05",
        slow_seconds: float = 1.0,
        on_request: Callable[[Record], None] | None = None,
        completion: Callable[[str, int | None], str] = fake_completion,
        batch_polls: int = 0,
        batch_outcome: str = "completed",
        batch_partial: int = 0,
        rate_limit: RateLimit | None = None,
    ) -> None:
        self.completion = completion
        self.batch_polls = batch_polls
        self.batch_outcome = batch_outcome
        self.batch_partial = batch_partial
        self.rate_limit = rate_limit
        self.rate_limited = 0  # requests answered 429 by the rate-limit mode
        self.batches: dict[str, dict[str, Any]] = {}
        self.files: dict[str, bytes] = {}
        self.batch_retrievals = 0
        self._batch_state: dict[str, int] = {}  # id -> retrievals left before it ends
        self._ids = itertools.count(1)
        # Per endpoint, as OpenAI limits each model on its own: (start, [requests, tokens]).
        self._windows: dict[str, tuple[float, list[int]]] = {}
        self.delay = delay
        self.embed_delay = embed_delay
        self.faults = faults
        self.api_key = api_key
        self.models = set(models) if models is not None else None
        self.dim = dim
        self.retry_after = retry_after
        self.slow_seconds = slow_seconds
        self.on_request = on_request
        self.log: list[Record] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._seen: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> FakeOpenAIServer:
        httpd = _Server(("127.0.0.1", 0), _Handler)
        httpd.fake = self
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._httpd is not None, "server not started"
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """The base URL to give the client (ends with ``/v1``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    # -- log -----------------------------------------------------------------------------------
    def requests(self, endpoint: str | None = None) -> list[Record]:
        """Every request received so far (of one endpoint, or all)."""
        with self._lock:
            return [r for r in self.log if endpoint is None or r.endpoint == endpoint]

    def successes(self, endpoint: str | None = None) -> list[Record]:
        """Requests answered with a usable result."""
        return [r for r in self.requests(endpoint) if r.ok]

    def reset(self) -> None:
        """Forget the log, the attempt counts and the in-flight peak."""
        with self._lock:
            self.log.clear()
            self._seen.clear()
            self.max_in_flight = self.in_flight

    # -- protocol ------------------------------------------------------------------------------
    @staticmethod
    def _send(
        handler: BaseHTTPRequestHandler,
        status: int,
        payload: dict[str, Any],
        headers: dict[str, str] | None = None,
    ) -> None:
        data = json.dumps(payload).encode("utf-8")
        FakeOpenAIServer._send_raw(handler, status, data, "application/json", headers)

    @staticmethod
    def _send_raw(
        handler: BaseHTTPRequestHandler,
        status: int,
        data: bytes,
        content_type: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", content_type)
            handler.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                handler.send_header(name, value)
            handler.end_headers()
            handler.wfile.write(data)
            handler.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            handler.close_connection = True  # the client went away (timeout, kill)

    @staticmethod
    def _error(code: int, message: str, kind: str, err_code: str | None = None) -> dict[str, Any]:
        return {"error": {"message": message, "type": kind, "code": err_code, "param": None}}

    def _handle(self, handler: _Handler) -> None:
        path = handler.path.rstrip("/")
        length = int(handler.headers.get("Content-Length") or 0)
        try:
            body = json.loads(handler.rfile.read(length) or b"{}")
        except json.JSONDecodeError:
            self._send(handler, 400, self._error(400, "invalid JSON body", "invalid_request_error"))
            return
        if path.endswith("/chat/completions"):
            endpoint, key = "chat", json.dumps(body.get("messages"), sort_keys=True)
        elif path.endswith("/embeddings"):
            endpoint, key = "embeddings", json.dumps(body.get("input"), sort_keys=True)
        else:
            self._send(handler, 404, self._error(404, f"no route {path}", "invalid_request_error"))
            return
        with self._lock:
            attempt = self._seen.get((endpoint, key), 0)
            self._seen[(endpoint, key)] = attempt + 1
            record = Record(
                endpoint=endpoint,
                body=body,
                key=key,
                attempt=attempt,
                authorization=handler.headers.get("Authorization", ""),
            )
            self.log.append(record)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.on_request is not None:
                self.on_request(record)
            self._respond(handler, endpoint, body, record)
        finally:
            with self._lock:
                self.in_flight -= 1
                record.finished = time.monotonic()

    def _respond(
        self, handler: _Handler, endpoint: str, body: dict[str, Any], record: Record
    ) -> None:
        if self.api_key is not None and record.authorization != f"Bearer {self.api_key}":
            sent = record.authorization.removeprefix("Bearer ")
            record.status = 401
            message = (
                f"Incorrect API key provided: {sent}. You can find your API key at your dashboard."
            )
            self._send(
                handler, 401, self._error(401, message, "invalid_request_error", "invalid_api_key")
            )
            return
        model = str(body.get("model", ""))
        if self.models is not None and model not in self.models:
            record.status = 404
            message = f"The model `{model}` does not exist or you do not have access to it."
            self._send(
                handler, 404, self._error(404, message, "invalid_request_error", "model_not_found")
            )
            return
        limit_headers = self._rate_limit(endpoint, body)
        if limit_headers is not None and limit_headers.pop("over", ""):
            record.status = 429
            self._send(
                handler,
                429,
                self._error(429, "Rate limit reached", "requests", "rate_limit_exceeded"),
                limit_headers,
            )
            return
        fault = (
            self.faults(endpoint, record.key, record.attempt) if self.faults is not None else None
        )
        record.fault = fault
        time.sleep(self.delay if endpoint == "chat" else self.embed_delay)
        if fault == "429":
            record.status = 429
            self._send(
                handler,
                429,
                self._error(
                    429, "Rate limit reached, please retry", "requests", "rate_limit_exceeded"
                ),
                {"Retry-After": self.retry_after},
            )
            return
        if fault == "quota":
            record.status = 429
            message = "You exceeded your current quota, please check your plan and billing details."
            self._send(
                handler, 429, self._error(429, message, "insufficient_quota", "insufficient_quota")
            )
            return
        if fault in {"500", "501", "400", "401", "403", "404"}:
            record.status = int(fault)
            self._send(
                handler,
                record.status,
                self._error(record.status, f"injected {fault}", "server_error"),
            )
            return
        if fault == "drop":
            record.status = -1
            handler.close_connection = True
            with contextlib.suppress(OSError):
                handler.connection.shutdown(socket.SHUT_RDWR)
            return
        if fault == "slow":
            time.sleep(self.slow_seconds)
        payload = self._chat(body, fault) if endpoint == "chat" else self._embeddings(body, fault)
        record.status = 200
        record.ok = fault is None
        if fault == "html":
            page = b"<!DOCTYPE html><html><head><title>Sign in</title></head><body>Sign in</body></html>"
            self._send_raw(handler, 200, page, "text/html; charset=utf-8")
        elif fault == "bad_json":
            data = json.dumps(payload).encode("utf-8")
            self._send_raw(handler, 200, data[: len(data) // 2], "application/json")
        else:
            self._send(handler, 200, payload, limit_headers)

    # -- rate-limit mode -------------------------------------------------------------------------
    @staticmethod
    def request_tokens(body: dict[str, Any]) -> int:
        """What the rate-limit mode charges for a request (see :class:`RateLimit`)."""
        if "messages" in body:
            texts = [str(m.get("content") or "") for m in body.get("messages") or []]
        else:
            raw = body.get("input", [])
            texts = [raw] if isinstance(raw, str) else [str(t) for t in raw]
        limit = body.get("max_tokens") or body.get("max_completion_tokens") or 0
        return sum(math.ceil(len(t) / 4) for t in texts) + int(limit)

    def _rate_limit(self, endpoint: str, body: dict[str, Any]) -> dict[str, str] | None:
        """Count the request in its endpoint's window; the headers (``"over"``: over it)."""
        limit = self.rate_limit
        if limit is None:
            return None
        tokens = self.request_tokens(body)
        with self._lock:
            now = time.monotonic()
            start, used = self._windows.get(endpoint, (-math.inf, [0, 0]))
            if now >= start + limit.window:
                start, used = now, [0, 0]
                self._windows[endpoint] = (start, used)
            over = used[0] + 1 > limit.requests or used[1] + tokens > limit.tokens
            if over and limit.enforce:
                self.rate_limited += 1
            else:
                used[0] += 1
                used[1] += tokens
            reset = _format_duration(start + limit.window - now)
            headers = {
                "x-ratelimit-limit-requests": str(limit.requests),
                "x-ratelimit-limit-tokens": str(limit.tokens),
                "x-ratelimit-remaining-requests": str(max(0, limit.requests - used[0])),
                "x-ratelimit-remaining-tokens": str(max(0, limit.tokens - used[1])),
                "x-ratelimit-reset-requests": reset,
                "x-ratelimit-reset-tokens": reset,
            }
            if over and limit.enforce:
                headers["over"] = "1"
            return headers

    # -- batch API -------------------------------------------------------------------------------
    def _batch_api(self, handler: _Handler, method: str) -> None:
        path = handler.path.rstrip("/").split("?", 1)[0]
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        record = Record(
            endpoint="batch-api", body={"method": method, "path": path}, key=path, attempt=0
        )
        with self._lock:
            self.log.append(record)
        parts = path.split("/")
        try:
            if method == "POST" and path.endswith("/files"):
                status, payload = self._upload(handler, raw)
            elif method == "GET" and parts[-1] == "content":
                data = self.files.get(parts[-2])
                if data is not None:
                    record.status, record.ok = 200, True
                    self._send_raw(handler, 200, data, "application/octet-stream")
                    return
                status, payload = 404, self._error(404, "no such file", "invalid_request_error")
            elif method == "POST" and path.endswith("/batches"):
                status, payload = self._create_batch(json.loads(raw or b"{}"))
            elif method == "POST" and parts[-1] == "cancel":
                status, payload = self._cancel_batch(parts[-2])
            elif method == "GET" and parts[-2] == "batches":
                status, payload = self._retrieve_batch(parts[-1])
            else:
                status, payload = 404, self._error(404, f"no route {path}", "invalid_request_error")
        except (ValueError, KeyError) as exc:
            status, payload = 400, self._error(400, f"bad request: {exc}", "invalid_request_error")
        record.status, record.ok = status, status == 200
        self._send(handler, status, payload)

    def _upload(self, handler: _Handler, raw: bytes) -> tuple[int, dict[str, Any]]:
        header = f"Content-Type: {handler.headers.get('Content-Type', '')}\r\n\r\n".encode()
        message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(header + raw)
        fields: dict[str, tuple[str | None, bytes]] = {}
        for part in message.iter_parts():  # type: ignore[attr-defined]
            name = part.get_param("name", header="content-disposition")
            data = part.get_payload(decode=True)
            fields[str(name)] = (part.get_filename(), data if isinstance(data, bytes) else b"")
        if fields.get("purpose", (None, b""))[1] != b"batch" or "file" not in fields:
            return 400, self._error(
                400, "expected a file and purpose=batch", "invalid_request_error"
            )
        filename, data = fields["file"]
        with self._lock:
            file_id = f"file-{next(self._ids)}"
            self.files[file_id] = data
        return 200, {
            "id": file_id,
            "object": "file",
            "bytes": len(data),
            "created_at": int(time.time()),
            "filename": filename or "upload.jsonl",
            "purpose": "batch",
            "status": "processed",
        }

    def _create_batch(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        input_id = str(body["input_file_id"])
        if input_id not in self.files:
            return 404, self._error(404, f"no file {input_id}", "invalid_request_error")
        if body.get("endpoint") != "/v1/chat/completions" or body.get("completion_window") != "24h":
            return 400, self._error(400, "unsupported endpoint or window", "invalid_request_error")
        lines = [x for x in self.files[input_id].decode("utf-8").splitlines() if x.strip()]
        for line in lines:
            json.loads(line)  # a broken line fails the request, as validation would
        with self._lock:
            batch_id = f"batch_{next(self._ids)}"
            batch = {
                "id": batch_id,
                "object": "batch",
                "endpoint": body["endpoint"],
                "errors": None,
                "input_file_id": input_id,
                "completion_window": body["completion_window"],
                "status": "in_progress",
                "output_file_id": None,
                "error_file_id": None,
                "created_at": int(time.time()),
                "request_counts": {"total": len(lines), "completed": 0, "failed": 0},
                "metadata": body.get("metadata"),
            }
            self.batches[batch_id] = batch
            self._batch_state[batch_id] = self.batch_polls
            return 200, dict(batch)

    def release_batches(self) -> None:
        """Let every batch still in progress end at its next retrieval."""
        with self._lock:
            for batch_id in self._batch_state:
                self._batch_state[batch_id] = 0

    def _cancel_batch(self, batch_id: str) -> tuple[int, dict[str, Any]]:
        with self._lock:
            batch = self.batches.get(batch_id)
            if batch is None:
                return 404, self._error(404, f"no batch {batch_id}", "invalid_request_error")
            if batch["status"] == "in_progress":
                self._run_batch(batch, limit=self.batch_partial, status="cancelled")
            return 200, dict(batch)

    def _retrieve_batch(self, batch_id: str) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.batch_retrievals += 1
            batch = self.batches.get(batch_id)
            if batch is None:
                return 404, self._error(404, f"no batch {batch_id}", "invalid_request_error")
            if batch["status"] != "in_progress":
                return 200, dict(batch)
            left = self._batch_state[batch_id]
            if left > 0:
                self._batch_state[batch_id] = left - 1
                return 200, dict(batch)
            if self.batch_outcome == "failed":
                batch["status"] = "failed"
                batch["errors"] = {
                    "object": "list",
                    "data": [{"code": "invalid_model", "message": "injected failure", "line": 1}],
                }
            elif self.batch_outcome == "expired":
                self._run_batch(batch, limit=self.batch_partial, status="expired")
            else:
                self._run_batch(batch)
            return 200, dict(batch)

    def _run_batch(
        self, batch: dict[str, Any], *, limit: int | None = None, status: str = "completed"
    ) -> None:
        """Answer the lines (the first ``limit``) with the chat handler (lock held)."""
        lines = list(filter(str.strip, self.files[batch["input_file_id"]].decode().splitlines()))
        out, errors = [], []
        for line in lines[:limit]:
            item = json.loads(line)
            custom_id = item["custom_id"]
            fault = self.faults("batch", custom_id, 0) if self.faults is not None else None
            if fault == "missing":
                continue
            row: dict[str, Any] = {"id": f"batch_req_{next(self._ids)}", "custom_id": custom_id}
            if fault == "error":
                error = self._error(500, "injected", "server_error")
                row["response"] = {"status_code": 500, "request_id": "req", "body": error}
                row["error"] = None
                errors.append(row)
                continue
            body = self._chat(item["body"], fault)
            row["response"] = {"status_code": 200, "request_id": "req", "body": body}
            row["error"] = None
            out.append(row)
        out.reverse()  # clients must match answers by custom_id, not by position
        for name, rows in (("output_file_id", out), ("error_file_id", errors)):
            if rows:
                file_id = f"file-{next(self._ids)}"
                self.files[file_id] = "".join(json.dumps(r) + "\n" for r in rows).encode()
                batch[name] = file_id
        batch["status"] = status
        batch["request_counts"] = {
            "total": len(lines),
            "completed": len(out),
            "failed": len(errors),
        }

    def _chat(self, body: dict[str, Any], fault: str | None) -> dict[str, Any]:
        messages = body.get("messages") or []
        prompt = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")
        limit = body.get("max_tokens") or body.get("max_completion_tokens")
        content: Any = self.completion(prompt, limit)
        finish = "stop"
        if fault == "no_choices":
            return {
                "id": "chatcmpl-broken",
                "object": "chat.completion",
                "model": body.get("model"),
            }
        if fault == "bad_content":
            content = 42
        elif fault == "empty":
            content = ""
        elif fault == "truncated":
            content, finish = " ".join(content.split()[:3]), "length"
        prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in messages)
        completion_tokens = len(str(content).split())
        return {
            "id": f"chatcmpl-{hashlib.sha256(prompt.encode()).hexdigest()[:12]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", ""),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": finish,
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _embeddings(self, body: dict[str, Any], fault: str | None) -> dict[str, Any]:
        raw = body.get("input", [])
        texts = [] if fault == "empty" else [raw] if isinstance(raw, str) else list(raw)
        data = []
        for i, text in enumerate(texts):
            vector = fake_embedding(str(text), int(body.get("dimensions") or self.dim)).astype(
                "<f4"
            )
            if body.get("encoding_format") == "base64":
                value: Any = base64.b64encode(vector.tobytes()).decode("ascii")
            else:
                value = [float(x) for x in vector]
            data.append({"object": "embedding", "index": i, "embedding": value})
        if fault == "no_data":
            return {"object": "list", "model": body.get("model", "")}
        if fault == "wrong_count":
            data = data[:-1]
        elif fault == "wrong_dim" and data:
            data[0]["embedding"] = data[0]["embedding"][:-1]
        elif fault == "not_numbers":
            for item in data:
                item["embedding"] = [str(x) for x in item["embedding"]]
        data.reverse()  # clients must order by "index", not by position
        tokens = sum(len(str(t).split()) for t in texts)
        return {
            "object": "list",
            "data": data,
            "model": body.get("model", ""),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


# -- building through the server ---------------------------------------------------------------
#: A small multi-topic corpus: 8 documents of 4 sentences each.
CORPUS = [
    f"Report {i} covers {topic}. The {topic} team met on day {i} and wrote notes. "
    f"Several {topic} results were better than expected in week {i}. "
    f"Next steps for {topic} include review number {i} and a budget."
    for i, topic in enumerate(
        ["rockets", "bread", "cats", "rivers", "rockets", "bread", "cats", "rivers"]
    )
]


class GroupClusterer:
    """Deterministic clusterer: consecutive groups of ``size`` rows (fast, no UMAP)."""

    def __init__(self, size: int = 3) -> None:
        self.size = size

    def cluster(self, vectors: np.ndarray) -> list[list[int]]:
        n = len(vectors)
        return [list(range(i, min(i + self.size, n))) for i in range(0, n, self.size)]


def openai_builder(
    url: str,
    *,
    api_key: str = "sk-test-key",
    max_concurrency: int = 4,
    timeout: float = 2.0,
    max_retries: int = 6,
    cache: object = None,
    clusterer: object | None = None,
    **kwargs: Any,
) -> Any:
    """A TreeBuilder whose embedder and summariser talk to ``url`` with the real client.

    Fast retries (backoff 10 ms) and a whitespace tokenizer keep the tests short.
    """
    from raptor_core.backends.openai import OpenAIEmbedder, OpenAISummarizer
    from raptor_core.build.builder import TreeBuilder
    from raptor_core.testing import WhitespaceTokenizer

    retry: dict[str, Any] = {
        "timeout": timeout,
        "max_retries": max_retries,
        "backoff": 0.01,
        "max_backoff": 0.05,
    }
    embedder = OpenAIEmbedder(
        "fake-embed",
        base_url=url,
        api_key=api_key,
        batch_size=8,
        max_concurrency=max_concurrency,
        **retry,
    )
    summarizer = OpenAISummarizer("fake-chat", base_url=url, api_key=api_key, **retry)
    params: dict[str, Any] = {
        "tokenizer": WhitespaceTokenizer(),
        "clusterer": clusterer if clusterer is not None else GroupClusterer(),
        "chunk_max_tokens": 12,
        "summary_max_tokens": 20,
        "max_concurrency": max_concurrency,
        "cache": cache,
    }
    params.update(kwargs)
    return TreeBuilder(embedder, summarizer, **params)


def tree_signature(tree: Any) -> list[tuple[str, str, tuple[str, ...]]]:
    """Node ids, texts and children: what must match between two builds."""
    return [(n.id, n.text, tuple(n.children)) for n in tree.nodes]
