"""OpenAI and OpenAI-compatible services (vLLM, Ollama, llama.cpp, LiteLLM, …).

Three thin classes over the official ``openai`` client:

* :class:`OpenAIChatLLM`: an :class:`~raptor_core.types.LLM` (and ``AsyncLLM``) over
  ``/chat/completions``;
* :class:`OpenAISummarizer`: the paper's summarisation prompt sent through that LLM;
* :class:`OpenAIEmbedder`: an :class:`~raptor_core.types.Embedder` (and ``AsyncEmbedder``)
  over ``/embeddings``, ``batch_size`` texts per request.

Retries are done here, not by the client (its ``max_retries`` is 0), because a build needs
more than it offers: ``Retry-After`` honoured to the letter, a 200 whose body is not a
usable answer (an HTML page, cut JSON, no ``choices``, an empty completion, embeddings of the
wrong count or size) retried like a 5xx, jittered exponential backoff, and typed errors that
say what to fix.  A build of hundreds of
clusters meets a few 429s and 5xx on any hosted service; each is retried, and only an error
that retrying cannot fix (a bad key, an unknown model) stops the build at once.

The API key comes from ``api_key=`` or the ``OPENAI_API_KEY`` environment variable.  It is
never recorded in a tree, logged, or put in an error message.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import math
import os
import random
import re
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar

import numpy as np
from numpy.typing import NDArray

from raptor_core._imports import require
from raptor_core.build.summarizers import LLMSummarizer
from raptor_core.exceptions import (
    EmbeddingError,
    EmbeddingResponseError,
    InvalidInputError,
    InvalidParameterError,
    LLMAuthenticationError,
    LLMError,
    LLMRequestError,
    LLMResponseError,
    LLMTimeoutError,
    RaptorError,
)
from raptor_core.types import DEFAULT_SUMMARY_PROMPT

__all__ = [
    "DEFAULT_CHAT_MODEL",
    "DEFAULT_EMBEDDING_MODEL",
    "OpenAIChatLLM",
    "OpenAIEmbedder",
    "OpenAISummarizer",
    "Usage",
]

logger = logging.getLogger(__name__)

DEFAULT_CHAT_MODEL = "gpt-4o-mini"
DEFAULT_EMBEDDING_MODEL = "text-embedding-3-small"
_DEFAULT_BASE_URL = "https://api.openai.com/v1"
#: The reference implementation's system message (``GPT3TurboSummarizationModel``).
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
# A server asking for a longer pause than this is down or out of quota, not busy.
_MAX_RETRY_AFTER = 300.0
_RETRYABLE_STATUS = frozenset({408, 409, 429})
_TRUNCATION_MODES = ("retry", "keep", "error")
_TRUNCATION_RETRIES = 1

T = TypeVar("T")


class Usage:
    """Thread-safe counters of what a backend spent; :meth:`snapshot` gives a plain dict.

    Counters:
        requests: HTTP requests sent, retries included.
        calls: requests that returned a usable answer.
        prompt_tokens, completion_tokens: as reported by the server's ``usage`` field
            (billed tokens, including those of answers that were retried).
        retries: requests that failed and were retried.
        truncated: completions cut at ``max_tokens`` that were kept.
        paced: requests held back by rate-limit pacing (appears after the first).
        batches, batch_requests, batch_fallbacks: Batch API jobs submitted, the requests in
            them, and those answered per call instead (``OpenAIBatchSummarizer`` only).

    The builder snapshots ``usage`` before and after each layer to report per-layer cost.
    """

    FIELDS: ClassVar[tuple[str, ...]] = (
        "requests",
        "calls",
        "prompt_tokens",
        "completion_tokens",
        "retries",
        "truncated",
    )

    def __init__(self, fields: Sequence[str] = FIELDS) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(fields, 0)

    def add(self, **counts: int) -> None:
        """Add to the named counters."""
        with self._lock:
            for name, value in counts.items():
                self._counts[name] = self._counts.get(name, 0) + int(value)

    def snapshot(self) -> dict[str, int]:
        """A consistent copy of the counters."""
        with self._lock:
            return dict(self._counts)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.snapshot().items())
        return f"Usage({inner})"

    def __getstate__(self) -> dict[str, int]:
        return self.snapshot()

    def __setstate__(self, state: Mapping[str, int]) -> None:
        self._lock = threading.Lock()
        self._counts = dict(state)


class _InvalidResponse(Exception):
    """The service answered 200, but with nothing usable (retried like a 5xx)."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(what)
        self.fix = fix


_FIX_BASE_URL = (
    "check that base_url is the API root (it usually ends with /v1), not a web page, and that "
    "no proxy in between rewrites the answers"
)
_FIX_BROKEN = "the server or a proxy sent a cut or broken body: check its logs, or retry later"


def _not_json(body: str) -> _InvalidResponse:
    """The client hands back a non-JSON body (an HTML page, plain text) as a string."""
    snippet = " ".join(body.split())[:60]
    return _InvalidResponse(f"a body that is not JSON: {snippet!r}", _FIX_BASE_URL)


def _tokens(value: object) -> int:
    """A token count from a response's ``usage`` (0 when absent or not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return 0
    return value


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_DURATION_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
#: Seconds a request that cannot be placed in any known window waits before looking again
#: (the window is full of requests still in flight, whose answers will tell more).
_PACE_POLL = 0.05
# Headers whose window end differs by less than this are about the same window.
_SAME_WINDOW = 0.05


def _duration(raw: str | None) -> float | None:
    """Seconds of a rate-limit reset header: ``"1s"``, ``"6m0s"``, ``"20ms"``, ``"1.5"``."""
    if not raw:
        return None
    text = raw.strip().lower()
    try:
        value = float(text)
    except ValueError:
        parts = _DURATION.findall(text)
        if not parts or "".join(n + u for n, u in parts) != text:
            return None
        value = sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    return value if math.isfinite(value) and value >= 0 else None


def _count(raw: str | None) -> float | None:
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _estimate_tokens(texts: Sequence[str], max_tokens: int | None = None) -> int:
    """Tokens a rate limiter charges for a request (an estimate, as the limiter's own).

    About four characters a token, plus the completion it may write: OpenAI reserves
    ``max_tokens`` against the limit up front.
    """
    return sum(math.ceil(len(t) / 4) for t in texts) + (max_tokens or 0)


class _Window:
    """One limit (requests or tokens) as the server last described it."""

    def __init__(self) -> None:
        self.limit: float | None = None
        self.remaining: float | None = None  # None: no header yet, or refilled without a limit
        self.reset_at: float | None = None  # when the server said the window is full again
        self.refilled = False

    def refill(self, now: float, in_flight: float) -> None:
        if self.reset_at is not None and not self.refilled and now >= self.reset_at:
            # Requests still in flight may land in the new window: count them against it.
            self.remaining = None if self.limit is None else self.limit - in_flight
            self.refilled = True

    def observe(
        self,
        now: float,
        limit: float | None,
        remaining: float | None,
        reset: float | None,
        in_flight: float,
    ) -> None:
        if limit is not None:
            self.limit = limit
        if remaining is None:
            return
        # The server has not counted (all of) our other requests in flight yet: subtract them.
        adjusted = remaining - in_flight
        reset_at = now + (reset or 0.0)
        if self.reset_at is None or reset_at > self.reset_at + _SAME_WINDOW:
            self.remaining, self.reset_at, self.refilled = adjusted, reset_at, False
        elif reset_at >= self.reset_at - _SAME_WINDOW and not self.refilled:
            # Answers arrive out of order: within one window the lowest count is the latest.
            self.remaining = adjusted if self.remaining is None else min(self.remaining, adjusted)
            self.reset_at = max(self.reset_at, reset_at)
        # else: a late answer about a window that has already ended

    def wait(self, now: float, need: float, in_flight: int) -> float:
        """Seconds until ``need`` fits (0: now); ``in_flight``: requests not yet answered."""
        if self.remaining is None:
            return 0.0
        if self.limit is not None:
            need = min(need, self.limit)  # a request larger than the window fits an empty one
        if self.remaining >= need:
            return 0.0
        if self.reset_at is not None and not self.refilled and self.reset_at > now:
            return self.reset_at - now
        # The window has reset since the last news: wait for the answers in flight to bring
        # more, or, with none left to come (they failed without headers), go and find out.
        return _PACE_POLL if in_flight else 0.0


class _RatePacer:
    """Holds requests back while the service's rate-limit window is used up.

    It reads the ``x-ratelimit-*`` headers of every answer (requests and tokens: limit,
    remaining, time to reset) and the optional caps of the caller (a sliding minute), and
    :meth:`reserve` tells a request how long to wait before it may go.  One pacer serves every
    thread and task of a service object: reservations are taken under a lock held for
    microseconds, never across a wait, so a sync caller sleeps and an async one awaits.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        self.clock = clock
        self.sleep = sleep  # tests pass a fake clock and sleep
        self._lock = threading.Lock()
        self._requests = _Window()
        self._tokens = _Window()
        self._in_flight = 0
        self._in_flight_tokens = 0
        self._answered = False  # no answer yet: its headers, if any, are still unknown
        self._sent: deque[tuple[float, int]] = deque()  # (when, tokens) of the last minute

    def _cap_wait(self, now: float, tokens: int, rpm: int | None, tpm: int | None) -> float:
        while self._sent and self._sent[0][0] <= now - 60.0:
            self._sent.popleft()
        wait = 0.0
        if rpm is not None and len(self._sent) >= rpm:
            wait = self._sent[len(self._sent) - rpm][0] + 60.0 - now
        if tpm is not None:
            need = min(tokens, tpm)
            used = sum(t for _, t in self._sent)
            for when, spent in self._sent:  # the oldest expire first
                if used + need <= tpm:
                    break
                used -= spent
                wait = max(wait, when + 60.0 - now)
        return wait

    def reserve(self, tokens: int, *, rpm: int | None = None, tpm: int | None = None) -> float:
        """Seconds to wait before asking again, or 0.0: the request may go now.

        A request let go is counted in flight until :meth:`done`.  ``rpm``/``tpm``: the
        caller's own caps.
        """
        with self._lock:
            if not self._answered and self._in_flight:
                # The first request goes alone: a burst sent before any answer has told us
                # the limits could be over them at once (many tasks start together).
                return _PACE_POLL
            now = self.clock()
            self._requests.refill(now, self._in_flight)
            self._tokens.refill(now, self._in_flight_tokens)
            wait = max(
                self._requests.wait(now, 1, self._in_flight),
                self._tokens.wait(now, tokens, self._in_flight),
                self._cap_wait(now, tokens, rpm, tpm),
            )
            if wait > 0:
                return wait
            for window, need in ((self._requests, 1), (self._tokens, tokens)):
                if window.remaining is not None:
                    window.remaining -= need
            self._in_flight += 1
            self._in_flight_tokens += tokens
            self._sent.append((now, tokens))
            return 0.0

    def observe(self, headers: Mapping[str, str] | None, tokens: int) -> None:
        """Read an answer's rate-limit headers (the request is still counted in flight)."""
        if not headers:
            return
        get = headers.get
        with self._lock:
            now = self.clock()
            self._requests.observe(
                now,
                _count(get("x-ratelimit-limit-requests")),
                _count(get("x-ratelimit-remaining-requests")),
                _duration(get("x-ratelimit-reset-requests")),
                self._in_flight - 1,
            )
            self._tokens.observe(
                now,
                _count(get("x-ratelimit-limit-tokens")),
                _count(get("x-ratelimit-remaining-tokens")),
                _duration(get("x-ratelimit-reset-tokens")),
                self._in_flight_tokens - tokens,
            )

    def done(self, tokens: int) -> None:
        """The request reserved with ``tokens`` has its answer (or failed)."""
        with self._lock:
            self._in_flight -= 1
            self._in_flight_tokens -= tokens
            self._answered = True


class _OpenAIService:
    """Connection settings, clients and the retry loop shared by the chat and embedding classes."""

    _kind = "OpenAI service"
    _usage_fields: ClassVar[tuple[str, ...]] = Usage.FIELDS
    #: Raised when every attempt got a 200 with an invalid body.
    _invalid_error: ClassVar[type[RaptorError]] = LLMResponseError
    #: Parameters that change how a call is made, not what it returns (left out of cache keys).
    cache_ignore: ClassVar[frozenset[str]] = frozenset(
        {
            "base_url",
            "timeout",
            "max_retries",
            "backoff",
            "max_backoff",
            "max_concurrency",
            "pacing",
            "max_requests_per_minute",
            "max_tokens_per_minute",
        }
    )

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None,
        api_key: str | None,
        timeout: float,
        max_retries: int,
        backoff: float,
        max_backoff: float,
        pacing: bool = True,
        max_requests_per_minute: int | None = None,
        max_tokens_per_minute: int | None = None,
    ) -> None:
        self.model = model
        self.base_url = base_url
        self._api_key = api_key  # private: never in get_params(), repr() or a tree
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.pacing = pacing
        self.max_requests_per_minute = max_requests_per_minute
        self.max_tokens_per_minute = max_tokens_per_minute
        self.usage = Usage(self._usage_fields)
        self._lock = threading.Lock()
        self._client: Any = None
        self._aclients: dict[int, Any] = {}
        self._pacer = _RatePacer()

    # -- pickling / copying: clients and locks are rebuilt, the key travels -----------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("_lock", "_client", "_aclients", "_pacer"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._client = None
        self._aclients = {}
        self._pacer = _RatePacer()

    def __repr__(self) -> str:
        where = f", base_url={self.base_url!r}" if self.base_url else ""
        return f"{type(self).__name__}(model={self.model!r}{where})"

    # -- settings ------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """The base URL requests go to (``base_url``, else ``OPENAI_BASE_URL``, else OpenAI)."""
        return self.base_url or os.environ.get("OPENAI_BASE_URL") or _DEFAULT_BASE_URL

    def _where(self) -> str:
        return f"{self._kind} (model {self.model!r} at {self.endpoint})"

    def _validate(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            msg = f"{type(self).__name__}: model must be a non-empty string, got {self.model!r}"
            raise InvalidParameterError(msg)
        for name in ("timeout", "backoff", "max_backoff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                msg = f"{type(self).__name__}: {name} must be a positive number, got {value!r}"
                raise InvalidParameterError(msg)
        retries = self.max_retries
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            msg = f"{type(self).__name__}: max_retries must be an integer >= 0, got {retries!r}"
            raise InvalidParameterError(msg)
        if not isinstance(self.pacing, bool):
            msg = f"{type(self).__name__}: pacing must be True or False, got {self.pacing!r}"
            raise InvalidParameterError(msg)
        for name in ("max_requests_per_minute", "max_tokens_per_minute"):
            cap = getattr(self, name)
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
                msg = (
                    f"{type(self).__name__}: {name} must be a positive integer or None, got {cap!r}"
                )
                raise InvalidParameterError(msg)

    def check_settings(self) -> None:
        """Validate the parameters and that an API key is available, without any request.

        Raises:
            InvalidParameterError: a parameter is out of range.
            LLMAuthenticationError: no key is set and no self-hosted ``base_url`` either.
        """
        self._validate()
        self._key()

    def _key(self) -> str:
        key = self._api_key or os.environ.get("OPENAI_API_KEY")
        if key:
            return key
        if self.base_url or os.environ.get("OPENAI_BASE_URL"):
            # Self-hosted servers (vLLM, Ollama, llama.cpp) usually take any key.
            return "not-needed"
        msg = (
            f"no API key for {self._where()}: set the OPENAI_API_KEY environment variable or "
            "pass api_key=...; for a self-hosted server without authentication pass base_url=..."
        )
        raise LLMAuthenticationError(msg)

    def _client_kwargs(self) -> dict[str, Any]:
        return {
            "api_key": self._key(),
            "base_url": self.endpoint,
            "timeout": float(self.timeout),
            "max_retries": 0,  # retries are ours: see the module docstring
        }

    def _sync_client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._validate()
                openai = require("openai", extra="openai")
                self._client = openai.OpenAI(**self._client_kwargs())
            return self._client

    def _async_client(self) -> Any:
        # An httpx async pool belongs to one event loop: keep one client per running loop.
        loop_id = id(asyncio.get_running_loop())
        with self._lock:
            client = self._aclients.get(loop_id)
            if client is None:
                self._validate()
                openai = require("openai", extra="openai")
                client = openai.AsyncOpenAI(**self._client_kwargs())
                self._aclients = {loop_id: client}
            return client

    def close(self) -> None:
        """Close the synchronous HTTP client (a new one is made on the next call)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    async def aclose(self) -> None:
        """Close the async HTTP client of the running event loop (call before the loop ends).

        Not required: a client left open is reclaimed when the loop goes, with only a
        ``ResourceWarning`` (shown in development mode) about its idle connections.
        """
        loop_id = id(asyncio.get_running_loop())
        with self._lock:
            client = self._aclients.pop(loop_id, None)
        if client is not None:
            await client.close()

    # -- retries -------------------------------------------------------------------------------
    def _scrub(self, text: str) -> str:
        key = self._api_key or os.environ.get("OPENAI_API_KEY")
        if key and len(key) >= 4:
            text = text.replace(key, "***")
        return text

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            # Honour the server's wait, never less; a little spread avoids a thundering herd
            # of all the requests it turned away at once.
            return retry_after * (1.0 + 0.1 * random.random())
        # Exponential backoff with "equal jitter": between half and all of the step.
        step = min(self.max_backoff, self.backoff * 2.0**attempt)
        return step * (0.5 + 0.5 * random.random())

    def _decide(self, exc: BaseException, attempt: int) -> float:
        """Return how long to wait before retrying ``exc``, or raise the typed error."""
        openai = require("openai", extra="openai")
        where = self._where()
        attempts = attempt + 1
        retry_after: float | None = None
        if isinstance(exc, json.JSONDecodeError | UnicodeDecodeError):
            # The client parses a body declared as JSON; it was not (cut off, or garbage).
            exc = _InvalidResponse("a body that is not valid JSON", _FIX_BROKEN)
        elif isinstance(exc, openai.APIResponseValidationError):
            exc = _InvalidResponse("a body that does not fit the API's schema", _FIX_BASE_URL)
        if isinstance(exc, _InvalidResponse):
            reason = str(exc)
            final: RaptorError = self._invalid_error(
                f"{where} returned an invalid response ({exc}) on all {attempts} attempts: "
                f"{exc.fix}"
            )
        elif isinstance(exc, openai.APITimeoutError):
            reason = f"no answer within {self.timeout}s"
            final = LLMTimeoutError(
                f"{where} did not answer within {self.timeout}s on any of {attempts} attempts: "
                "raise timeout= (--timeout), lower max_concurrency, or check the server's load"
            )
        elif isinstance(exc, openai.APIConnectionError):
            cause = exc.__cause__ or exc
            reason = f"connection failed ({type(cause).__name__}: {self._scrub(str(cause))})"
            final = LLMError(
                f"could not reach {where} in {attempts} attempts: check that the server is "
                "running and that base_url (OPENAI_BASE_URL) is right"
            )
        elif isinstance(exc, openai.APIStatusError):
            status = int(exc.status_code)
            detail = self._scrub(_server_message(exc))
            retry_after = _retry_after(exc.response.headers)
            if status == 429 and _error_code(exc) == "insufficient_quota":
                msg = (
                    f"{where}: the account is out of quota (HTTP 429 insufficient_quota): "
                    "check the plan and billing"
                )
                raise LLMAuthenticationError(msg) from None
            if status in {401, 403}:
                raise self._auth_error(status) from None
            if (status not in _RETRYABLE_STATUS and status < 500) or status == 501:
                # 501: the server lacks the endpoint (llama.cpp without --embeddings).
                raise self._request_error(status, detail) from None
            reason = f"HTTP {status}" + (f" ({detail})" if detail else "")
            if retry_after is not None and retry_after > _MAX_RETRY_AFTER:
                msg = (
                    f"{where} asks to wait {retry_after:.0f}s before retrying (HTTP {status}): "
                    "try again later or lower max_concurrency"
                )
                raise LLMError(msg) from None
            final = LLMError(
                f"{where} failed with {reason} on all {attempts} attempts: "
                + (
                    "lower max_concurrency or raise max_retries"
                    if status == 429
                    else "try again later"
                )
            )
        else:
            raise exc
        if attempt >= self.max_retries:
            raise final from (
                exc if isinstance(exc, _InvalidResponse) or not self._leaks(exc) else None
            )
        delay = self._delay(attempt, retry_after)
        self.usage.add(retries=1)
        logger.warning(
            "%s: %s; retry %d/%d in %.2fs", where, reason, attempt + 1, self.max_retries, delay
        )
        return delay

    def _leaks(self, exc: BaseException) -> bool:
        key = self._api_key or os.environ.get("OPENAI_API_KEY")
        return key is not None and len(key) >= 4 and key in f"{exc!s}{exc!r}"

    def _auth_error(self, status: int) -> LLMAuthenticationError:
        where = self._where()
        if status == 401:
            msg = (
                f"{where} rejected the API key (HTTP 401): set OPENAI_API_KEY (or pass api_key=) "
                "to a valid key for this server"
            )
        else:
            msg = (
                f"{where} refused access (HTTP 403): the API key has no access to model "
                f"{self.model!r}; check the key's project, organisation or region"
            )
        return LLMAuthenticationError(msg)

    def _request_error(self, status: int, detail: str) -> LLMRequestError:
        where = self._where()
        said = f"; the server said: {detail}" if detail else ""
        if status == 404:
            msg = (
                f"{where} answered HTTP 404: check the model name (the server lists its models at "
                f"{self.endpoint.rstrip('/')}/models) and that base_url ends with /v1{said}"
            )
        else:
            msg = (
                f"{where} rejected the request (HTTP {status}){said}: check the model name and "
                "parameters (newer OpenAI models need max_tokens_param='max_completion_tokens' "
                "and temperature=None)"
            )
        return LLMRequestError(msg)

    # -- pacing --------------------------------------------------------------------------------
    def _paced(self, cost: int | None) -> bool:
        return cost is not None and (
            self.pacing is True
            or self.max_requests_per_minute is not None
            or self.max_tokens_per_minute is not None
        )

    def _reserve(self, cost: int) -> float:
        wait = self._pacer.reserve(
            cost, rpm=self.max_requests_per_minute, tpm=self.max_tokens_per_minute
        )
        if wait > 0:
            logger.debug("%s: rate limit: waiting %.2fs", self._where(), wait)
        return wait

    def _turn(self, cost: int) -> None:
        """Wait (sleeping) until the pacer lets a request of ``cost`` tokens go."""
        counted = False
        while (wait := self._reserve(cost)) > 0:
            if not counted:
                self.usage.add(paced=1)
                counted = True
            self._pacer.sleep(wait)

    async def _aturn(self, cost: int) -> None:
        """Async :meth:`_turn`: other tasks run while this one waits."""
        counted = False
        while (wait := self._reserve(cost)) > 0:
            if not counted:
                self.usage.add(paced=1)
                counted = True
            await asyncio.sleep(wait)

    def _observe(self, headers: Any, cost: int | None) -> None:
        """Feed an answer's rate-limit headers to the pacer (for paced requests)."""
        if cost is not None and self.pacing is True:
            self._pacer.observe(headers, cost)

    def _call(self, attempt_fn: Callable[[], T], *, cost: int | None = None) -> T:
        """``attempt_fn()`` with retries; ``cost`` (estimated tokens) paces it (None: not)."""
        paced = self._paced(cost)
        for attempt in range(self.max_retries + 1):
            if paced:
                self._turn(cost or 0)
            self.usage.add(requests=1)
            try:
                return attempt_fn()
            except Exception as exc:
                self._observe(_headers_of(exc), cost)
                delay = self._decide(exc, attempt)
            finally:
                if paced:
                    self._pacer.done(cost or 0)
            time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _acall(self, attempt_fn: Callable[[], Awaitable[T]], *, cost: int | None = None) -> T:
        paced = self._paced(cost)
        for attempt in range(self.max_retries + 1):
            if paced:
                await self._aturn(cost or 0)
            self.usage.add(requests=1)
            try:
                return await attempt_fn()
            except Exception as exc:
                self._observe(_headers_of(exc), cost)
                delay = self._decide(exc, attempt)
            finally:
                if paced:
                    self._pacer.done(cost or 0)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover


def _headers_of(exc: BaseException) -> Any:
    """The HTTP headers of a failed request's answer (None without one)."""
    return getattr(getattr(exc, "response", None), "headers", None)


def _server_message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, Mapping):
        error = body.get("error", body)
        if isinstance(error, Mapping) and error.get("message"):
            return str(error["message"])[:300]
        if isinstance(error, str):
            return error[:300]
    message = getattr(exc, "message", "") or ""
    return str(message)[:300]


def _error_code(exc: Any) -> str | None:
    code = getattr(exc, "code", None)
    if code:
        return str(code)
    body = getattr(exc, "body", None)
    if isinstance(body, Mapping):
        error = body.get("error", body)
        if isinstance(error, Mapping) and error.get("code"):
            return str(error["code"])
    return None


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds asked for by ``retry-after-ms`` or ``Retry-After`` (seconds or an HTTP date)."""
    raw_ms = headers.get("retry-after-ms")
    if raw_ms:
        try:
            value = float(raw_ms) / 1000.0
        except ValueError:
            value = math.nan
        if math.isfinite(value) and value >= 0:
            return value
    raw = headers.get("retry-after")
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError):
            return None
        return max(0.0, when.timestamp() - time.time())
    return value if math.isfinite(value) and value >= 0 else None


_FIX_EMBEDDINGS_API = "check that the server at base_url speaks the OpenAI embeddings API"


def _parse_embeddings(response: Any, n: int, expected: int | None) -> NDArray[np.float32]:
    """The ``(n, d)`` vectors of an embeddings response, in input order.

    Raises:
        _InvalidResponse: no ``data`` list, a wrong count, bad indices, non-numbers, sizes
            that differ (from each other or from ``expected``), NaN or infinite values.
    """
    data = getattr(response, "data", None)
    if not isinstance(data, list):
        raise _InvalidResponse("JSON without a 'data' list", _FIX_EMBEDDINGS_API)
    if len(data) != n:
        raise _InvalidResponse(
            f"{len(data)} embeddings for {n} texts",
            "check that the model is an embedding model and that the server accepts batches",
        )
    indices = [getattr(item, "index", None) for item in data]
    order = [i for i in indices if isinstance(i, int) and not isinstance(i, bool)]
    if all(i is None for i in indices):
        order = list(range(n))  # some servers omit "index": trust the order
    elif sorted(order) != list(range(n)):
        raise _InvalidResponse(f"embedding indices {indices[:8]}, not 0..{n - 1}", _FIX_BROKEN)
    rows: list[Any] = [None] * n
    for position, item in zip(order, data, strict=True):
        vector = np.asarray(getattr(item, "embedding", None))
        # kind f/i/u: numbers; strings ("U"), None or mixed ("O") and booleans are not.
        if vector.ndim != 1 or vector.dtype.kind not in "fiu":
            raise _InvalidResponse(
                "an embedding that is not a list of numbers", _FIX_EMBEDDINGS_API
            )
        rows[position] = vector
    sizes = sorted({int(v.shape[0]) for v in rows})
    if len(sizes) > 1 or sizes[0] == 0 or (expected is not None and sizes != [expected]):
        wanted = f", expected {expected}" if expected is not None else ""
        raise _InvalidResponse(
            f"embeddings of size {', '.join(map(str, sizes))}{wanted}",
            "check that every request reaches the same embedding model (and that it supports "
            "the dimensions asked for)",
        )
    arr = np.stack(rows).astype(np.float32)
    if not np.all(np.isfinite(arr)):
        raise _InvalidResponse("embeddings with NaN or infinite values", _FIX_BROKEN)
    return arr


class OpenAIChatLLM(_OpenAIService):
    """An :class:`~raptor_core.types.LLM` over an OpenAI-compatible ``/chat/completions``.

    Works with OpenAI and with self-hosted servers that speak its API (vLLM, Ollama,
    llama.cpp ``llama-server``, LiteLLM): point ``base_url`` at the server's ``/v1``.

    Args:
        model: model name as the server knows it.
        base_url: API root; ``OPENAI_BASE_URL`` or OpenAI's when None.
        api_key: the key; ``OPENAI_API_KEY`` when None.  Never logged or recorded.
        system_prompt: system message sent first (None: none).
        temperature: sampling temperature; 0 makes summaries repeatable.  None leaves it to
            the server (needed by reasoning models that reject the parameter).
        max_tokens_param: request field that carries ``max_tokens``; newer OpenAI models
            want ``"max_completion_tokens"``.
        on_truncated: a completion cut at ``max_tokens`` is retried once, then kept with a
            warning and counted in ``usage`` (``"retry"``); kept at once (``"keep"``); or
            retried once, then raised as :class:`LLMError` (``"error"``).
        timeout: seconds to wait for one answer.
        max_retries: retries after a 429, a 5xx, a timeout, a dropped connection or a 200
            with an invalid body (not JSON, no ``choices``, empty content); 401/403/400/404
            are never retried.
        backoff: first backoff step in seconds; doubles at each retry up to ``max_backoff``.
        max_backoff: cap of one backoff step (``Retry-After`` is honoured as sent).
        pacing: read the ``x-ratelimit-*`` headers of every answer and hold later requests
            (of every thread and task using this object) while the server's request or token
            window is used up, instead of provoking 429s.  Servers that send no such headers
            are not slowed down.
        max_requests_per_minute, max_tokens_per_minute: your own caps over any sliding
            minute (None: none); tokens are estimated as the rate limiter does (about four
            characters a token, plus ``max_tokens``).

    Examples:
        >>> llm = OpenAIChatLLM("llama3.1", base_url="http://localhost:11434/v1")
        >>> llm.complete("Say hi", max_tokens=5)  # doctest: +SKIP
        'Hi!'
    """

    _kind = "chat model"

    def __init__(
        self,
        model: str = DEFAULT_CHAT_MODEL,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        temperature: float | None = 0.0,
        max_tokens_param: str = "max_tokens",
        on_truncated: str = "retry",
        timeout: float = 60.0,
        max_retries: int = 6,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        pacing: bool = True,
        max_requests_per_minute: int | None = None,
        max_tokens_per_minute: int | None = None,
    ) -> None:
        super().__init__(
            model,
            base_url=base_url,
            api_key=api_key,
            timeout=timeout,
            max_retries=max_retries,
            backoff=backoff,
            max_backoff=max_backoff,
            pacing=pacing,
            max_requests_per_minute=max_requests_per_minute,
            max_tokens_per_minute=max_tokens_per_minute,
        )
        self.system_prompt = system_prompt
        self.temperature = temperature
        self.max_tokens_param = max_tokens_param
        self.on_truncated = on_truncated

    def get_params(self) -> dict[str, Any]:
        """Constructor parameters, without the API key (recorded in ``Tree.params``)."""
        return {
            "model": self.model,
            "base_url": self.base_url,
            "system_prompt": self.system_prompt,
            "temperature": self.temperature,
            "max_tokens_param": self.max_tokens_param,
            "on_truncated": self.on_truncated,
            "timeout": self.timeout,
            "max_retries": self.max_retries,
            "backoff": self.backoff,
            "max_backoff": self.max_backoff,
            "pacing": self.pacing,
            "max_requests_per_minute": self.max_requests_per_minute,
            "max_tokens_per_minute": self.max_tokens_per_minute,
        }

    def _validate(self) -> None:
        super()._validate()
        if self.on_truncated not in _TRUNCATION_MODES:
            msg = f"on_truncated must be one of {_TRUNCATION_MODES}, got {self.on_truncated!r}"
            raise InvalidParameterError(msg)
        if self.max_tokens_param not in {"max_tokens", "max_completion_tokens"}:
            msg = (
                "max_tokens_param must be 'max_tokens' or 'max_completion_tokens', "
                f"got {self.max_tokens_param!r}"
            )
            raise InvalidParameterError(msg)

    def _request(self, prompt: str, max_tokens: int | None) -> dict[str, Any]:
        if not isinstance(prompt, str) or not prompt.strip():
            msg = "the prompt is empty: there is nothing to send to the model"
            raise InvalidInputError(msg)
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            msg = f"max_tokens must be a positive integer or None, got {max_tokens!r}"
            raise InvalidParameterError(msg)
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": prompt})
        request: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.temperature is not None:
            request["temperature"] = self.temperature
        if max_tokens is not None:
            request[self.max_tokens_param] = max_tokens
        return request

    def _cost(self, request: Mapping[str, Any]) -> int:
        texts = [str(m.get("content") or "") for m in request["messages"]]
        return _estimate_tokens(texts, request.get(self.max_tokens_param))

    def _answer(self, response: Any, attempts: _AttemptCounter) -> str:
        if isinstance(response, str):
            raise _not_json(response)
        usage = getattr(response, "usage", None)
        self.usage.add(
            prompt_tokens=_tokens(getattr(usage, "prompt_tokens", 0)),
            completion_tokens=_tokens(getattr(usage, "completion_tokens", 0)),
        )
        # The client builds its response objects without validation: check every field used.
        choices = getattr(response, "choices", None)
        if not isinstance(choices, list) or not choices:
            raise _InvalidResponse(
                "JSON without a 'choices' list",
                "check that the server at base_url speaks the OpenAI chat completions API",
            )
        message = getattr(choices[0], "message", None)
        content = getattr(message, "content", None)
        if content is not None and not isinstance(content, str):
            raise _InvalidResponse(
                f"a completion whose content is {type(content).__name__}, not text",
                "check that the server at base_url speaks the OpenAI chat completions API",
            )
        if not content or not content.strip():
            raise _InvalidResponse(
                "an empty completion",
                "check that the model is a chat model and that the prompt fits its context",
            )
        truncated = getattr(choices[0], "finish_reason", None) == "length"
        if truncated and self.on_truncated != "keep":
            # One more try (a sampled answer may fit, a glitch may pass); more would mostly pay
            # for the same cut text again at temperature 0.
            if attempts.truncated < _TRUNCATION_RETRIES and not attempts.last():
                attempts.truncated += 1
                raise _InvalidResponse("a completion cut at max_tokens", "")
            if self.on_truncated == "error":
                msg = (
                    f"{self._where()} cut the completion at max_tokens (finish_reason='length') "
                    f"{attempts.truncated + 1} times: raise the summary length "
                    "(summary_max_tokens) or pass on_truncated='keep'"
                )
                raise LLMError(msg)
        if truncated:
            self.usage.add(truncated=1)
            logger.warning("%s: keeping a completion cut at max_tokens", self._where())
        self.usage.add(calls=1)
        return content.strip()

    def complete(self, prompt: str, *, max_tokens: int | None = None) -> str:
        """Return the model's answer to ``prompt`` (at most ``max_tokens`` tokens).

        Raises:
            LLMAuthenticationError: the key was rejected (401/403) or no key is set.
            LLMRequestError: unknown model or bad parameter (400/404/422).
            LLMResponseError: every attempt got a 200 with an invalid body (a subclass of
                ``LLMRequestError``).
            LLMTimeoutError: no answer within ``timeout`` after all retries.
            LLMError: other failures after all retries.
        """
        request = self._request(prompt, max_tokens)
        client = self._sync_client()
        attempts = _AttemptCounter(self.max_retries)

        cost = self._cost(request)

        def attempt() -> str:
            attempts.next()
            raw = client.chat.completions.with_raw_response.create(**request)
            self._observe(raw.headers, cost)
            return self._answer(raw.parse(), attempts)

        return self._call(attempt, cost=cost)

    async def acomplete(self, prompt: str, *, max_tokens: int | None = None) -> str:
        """Async :meth:`complete` on the async client (one per event loop)."""
        request = self._request(prompt, max_tokens)
        client = self._async_client()
        attempts = _AttemptCounter(self.max_retries)

        cost = self._cost(request)

        async def attempt() -> str:
            attempts.next()
            raw = await client.chat.completions.with_raw_response.create(**request)
            self._observe(raw.headers, cost)
            return self._answer(raw.parse(), attempts)

        return await self._acall(attempt, cost=cost)


class _AttemptCounter:
    """Attempts of one retried call, and how many of them came back truncated."""

    def __init__(self, max_retries: int) -> None:
        self.max_retries = max_retries
        self.attempt = -1
        self.truncated = 0

    def next(self) -> None:
        self.attempt += 1

    def last(self) -> bool:
        return self.attempt >= self.max_retries


class OpenAISummarizer(LLMSummarizer):
    """The RAPTOR summariser over an OpenAI-compatible chat model.

    Sends the paper's prompt (``DEFAULT_SUMMARY_PROMPT``) or your ``prompt`` template (with a
    ``{context}`` placeholder) for each cluster; ``summary_max_tokens`` of the builder becomes
    the request's ``max_tokens``.  The builder requests the summaries of a layer concurrently
    (``TreeBuilder(max_concurrency=...)``); retries and usage are those of the inner
    :class:`OpenAIChatLLM`, available as ``self.llm`` and ``self.usage``.

    Args:
        model: chat model name.
        prompt: template with ``{context}``; the paper's prompt by default.
        separator: joins a cluster's texts into the context.
        base_url, api_key, system_prompt, temperature, max_tokens_param, on_truncated,
            timeout, max_retries, backoff, max_backoff, pacing, max_requests_per_minute,
            max_tokens_per_minute: as :class:`OpenAIChatLLM`.

    Examples:
        >>> from raptor_core import TreeBuilder
        >>> summarizer = OpenAISummarizer("gpt-4o-mini")  # reads OPENAI_API_KEY
        >>> builder = TreeBuilder(summarizer=summarizer, max_concurrency=8)
    """

    cache_ignore = _OpenAIService.cache_ignore

    def __init__(
        self,
        model: str = DEFAULT_CHAT_MODEL,
        *,
        prompt: str = DEFAULT_SUMMARY_PROMPT,
        separator: str = "\n\n",
        base_url: str | None = None,
        api_key: str | None = None,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        temperature: float | None = 0.0,
        max_tokens_param: str = "max_tokens",
        on_truncated: str = "retry",
        timeout: float = 60.0,
        max_retries: int = 6,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        pacing: bool = True,
        max_requests_per_minute: int | None = None,
        max_tokens_per_minute: int | None = None,
    ) -> None:
        llm = OpenAIChatLLM(
            model,
            base_url=base_url,
            api_key=api_key,
            system_prompt=system_prompt,
            temperature=temperature,
            max_tokens_param=max_tokens_param,
            on_truncated=on_truncated,
            timeout=timeout,
            max_retries=max_retries,
            backoff=backoff,
            max_backoff=max_backoff,
            pacing=pacing,
            max_requests_per_minute=max_requests_per_minute,
            max_tokens_per_minute=max_tokens_per_minute,
        )
        super().__init__(llm, prompt=prompt, separator=separator)
        self.llm: OpenAIChatLLM = llm

    def __repr__(self) -> str:
        return f"OpenAISummarizer(model={self.llm.model!r})"

    @property
    def model(self) -> str:
        """The chat model's name."""
        return self.llm.model

    @property
    def usage(self) -> Usage:
        """Calls and tokens spent so far."""
        return self.llm.usage

    def get_params(self) -> dict[str, Any]:
        """Constructor parameters, without the API key (recorded in ``Tree.params``)."""
        return {"prompt": self.prompt, "separator": self.separator, **self.llm.get_params()}

    def check_settings(self) -> None:
        """Validate the prompt and the model's settings without any request."""
        self.render([""])
        self.llm.check_settings()

    def close(self) -> None:
        """Close the chat model's synchronous HTTP client."""
        self.llm.close()

    async def aclose(self) -> None:
        """Close the chat model's async HTTP client for the running loop."""
        await self.llm.aclose()


class OpenAIEmbedder(_OpenAIService):
    """An :class:`~raptor_core.types.Embedder` over an OpenAI-compatible ``/embeddings``.

    ``embed_documents`` sends ``batch_size`` texts per request and up to ``max_concurrency``
    requests at once.  Vectors come back as float32 in input order (not normalised: the
    builder normalises).  A tree records this embedder's parameters (never the key), so
    ``raptor query`` re-creates it with the key from the environment.

    Args:
        model: embedding model name as the server knows it.
        base_url: API root; ``OPENAI_BASE_URL`` or OpenAI's when None.
        api_key: the key; ``OPENAI_API_KEY`` when None.  Never logged or recorded.
        batch_size: texts per request (OpenAI accepts up to 2,048).
        dimensions: shorten vectors to this size (``text-embedding-3-*`` only).
        max_concurrency: batches in flight at once.
        timeout, max_retries, backoff, max_backoff, pacing, max_requests_per_minute,
            max_tokens_per_minute: as :class:`OpenAIChatLLM`.

    Examples:
        >>> embedder = OpenAIEmbedder("nomic-embed-text", base_url="http://localhost:11434/v1")
        >>> embedder.embed_documents(["a cat", "a dog"]).shape  # doctest: +SKIP
        (2, 768)
    """

    _kind = "embedding model"
    _usage_fields = ("requests", "calls", "prompt_tokens", "retries")
    _invalid_error = EmbeddingResponseError
    _dim: int | None = None  # the vector size of the first valid answer

    def __init__(
        self,
        model: str = DEFAULT_EMBEDDING_MODEL,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        batch_size: int = 128,
        dimensions: int | None = None,
        max_concurrency: int = 4,
        timeout: float = 60.0,
        max_retries: int = 6,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        pacing: bool = True,
        max_requests_per_minute: int | None = None,
        max_tokens_per_minute: int | None = None,
    ) -> None:
        super().__init__(
            model,
            base_url=base_url,
            api_key=api_key,
            timeout=timeout,
            max_retries=max_retries,
            backoff=backoff,
            max_backoff=max_backoff,
            pacing=pacing,
            max_requests_per_minute=max_requests_per_minute,
            max_tokens_per_minute=max_tokens_per_minute,
        )
        self.batch_size = batch_size
        self.dimensions = dimensions
        self.max_concurrency = max_concurrency

    def get_params(self) -> dict[str, Any]:
        """Constructor parameters, without the API key (recorded in ``Tree.params``)."""
        return {
            "model": self.model,
            "base_url": self.base_url,
            "batch_size": self.batch_size,
            "dimensions": self.dimensions,
            "max_concurrency": self.max_concurrency,
            "timeout": self.timeout,
            "max_retries": self.max_retries,
            "backoff": self.backoff,
            "max_backoff": self.max_backoff,
            "pacing": self.pacing,
            "max_requests_per_minute": self.max_requests_per_minute,
            "max_tokens_per_minute": self.max_tokens_per_minute,
        }

    def _validate(self) -> None:
        super()._validate()
        for name in ("batch_size", "max_concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                msg = f"OpenAIEmbedder: {name} must be an integer >= 1, got {value!r}"
                raise InvalidParameterError(msg)
        dims = self.dimensions
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
            msg = f"OpenAIEmbedder: dimensions must be a positive integer or None, got {dims!r}"
            raise InvalidParameterError(msg)

    def _batches(self, texts: Sequence[str]) -> Iterator[list[str]]:
        self._validate()
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text.strip():
                msg = f"text #{i} is empty or not a string ({text!r}): embedding services reject it"
                raise InvalidInputError(msg)
        for start in range(0, len(texts), self.batch_size):
            yield list(texts[start : start + self.batch_size])

    def _request(self, batch: list[str]) -> dict[str, Any]:
        # "float", not the client's default base64: llama.cpp and older servers lack base64.
        request: dict[str, Any] = {"model": self.model, "input": batch, "encoding_format": "float"}
        if self.dimensions is not None:
            request["dimensions"] = self.dimensions
        return request

    def _vectors(self, response: Any, n: int) -> NDArray[np.float32]:
        if isinstance(response, str):
            raise _not_json(response)
        usage = getattr(response, "usage", None)
        self.usage.add(prompt_tokens=_tokens(getattr(usage, "prompt_tokens", 0)))
        # Vectors must have the requested size, or the size this instance got before: a
        # server that switches models mid-build would otherwise mix incomparable vectors.
        expected = self.dimensions if self.dimensions is not None else self._dim
        arr = _parse_embeddings(response, n, expected)
        self._dim = int(arr.shape[1])
        self.usage.add(calls=1)
        return arr

    def _embed_batch(self, batch: list[str]) -> NDArray[np.float32]:
        client = self._sync_client()
        request = self._request(batch)
        cost = _estimate_tokens(batch)

        def attempt() -> NDArray[np.float32]:
            raw = client.embeddings.with_raw_response.create(**request)
            self._observe(raw.headers, cost)
            return self._vectors(raw.parse(), len(batch))

        return self._call(attempt, cost=cost)

    async def _aembed_batch(self, batch: list[str]) -> NDArray[np.float32]:
        client = self._async_client()
        request = self._request(batch)
        cost = _estimate_tokens(batch)

        async def attempt() -> NDArray[np.float32]:
            raw = await client.embeddings.with_raw_response.create(**request)
            self._observe(raw.headers, cost)
            return self._vectors(raw.parse(), len(batch))

        return await self._acall(attempt, cost=cost)

    def _stack(self, parts: Sequence[NDArray[np.float32]]) -> NDArray[np.float32]:
        if not parts:
            return np.zeros((0, self.dimensions or 0), dtype=np.float32)
        dims = {p.shape[1] for p in parts}
        if len(dims) > 1:
            msg = (
                f"{self._where()} returned vectors of different sizes {sorted(dims)} across batches"
            )
            raise EmbeddingError(msg)
        return np.concatenate(parts)

    def embed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Embed texts; ``(len(texts), d)`` float32.

        Raises:
            EmbeddingResponseError: every attempt got a 200 with invalid embeddings (not
                JSON, no ``data``, a wrong count or size, non-numbers, NaN).
            LLMAuthenticationError, LLMRequestError, LLMTimeoutError, LLMError: as
                :meth:`OpenAIChatLLM.complete`.
        """
        batches = list(self._batches(texts))
        if len(batches) <= 1 or self.max_concurrency == 1:
            return self._stack([self._embed_batch(b) for b in batches])
        # Set by the first failure or Ctrl-C: the batches still queued are never sent (a rejected
        # key costs one request per worker).  A skipped batch always follows the failed one, so
        # collecting in order raises that failure first.
        stop = threading.Event()

        def one(batch: list[str]) -> NDArray[np.float32] | None:
            if stop.is_set():
                return None
            try:
                return self._embed_batch(batch)
            except BaseException:
                stop.set()
                raise

        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(batches))) as pool:
            futures = [pool.submit(one, b) for b in batches]
            try:
                parts = [f.result() for f in futures]
            except BaseException:
                stop.set()
                for future in futures:
                    future.cancel()
                raise
        return self._stack([p for p in parts if p is not None])

    def embed_query(self, text: str) -> NDArray[np.float32]:
        """Embed one query; ``(d,)`` float32."""
        return self.embed_documents([text])[0]

    async def aembed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Async :meth:`embed_documents`: up to ``max_concurrency`` batches at once."""
        batches = list(self._batches(texts))
        semaphore = asyncio.Semaphore(self.max_concurrency)
        failed = False

        async def one(batch: list[str]) -> NDArray[np.float32]:
            nonlocal failed
            async with semaphore:
                if failed:  # another batch failed: send nothing more
                    raise asyncio.CancelledError
                try:
                    return await self._aembed_batch(batch)
                except BaseException:
                    failed = True
                    raise

        tasks = [asyncio.ensure_future(one(b)) for b in batches]
        try:
            parts = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        return self._stack(parts)

    async def aembed_query(self, text: str) -> NDArray[np.float32]:
        """Async :meth:`embed_query`."""
        return (await self.aembed_documents([text]))[0]
