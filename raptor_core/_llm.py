"""Calling an :class:`~raptor_core.types.LLM` for structured (JSON) answers, tolerantly.

Models wrap JSON in code fences, add a sentence before it, or answer something else
entirely.  :func:`ask_json` extracts the first JSON value, validates it with a caller's
parser, retries once with a note about what was wrong, and reports failure (as a reason
string) instead of raising, so the search can fall back to similarity ranking.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any, TypeVar

from raptor_core.exceptions import LLMAuthenticationError, LLMError, LLMTimeoutError
from raptor_core.types import LLM, AsyncLLM

__all__ = ["ask_json", "call_llm", "parse_json_answer", "render"]

T = TypeVar("T")

_FENCE = re.compile(r"```(?:json|JSON)?\s*(.*?)```", re.DOTALL)
_RETRY_NOTE = (
    "\n\nYour previous answer could not be used ({error}). "
    "Reply with the JSON object only, exactly in the format above."
)


def render(template: str, **values: str) -> str:
    """Fill ``{name}`` placeholders with ``str.replace`` (prompts contain literal JSON braces)."""
    out = template
    for name, value in values.items():
        out = out.replace("{" + name + "}", value)
    return out


def parse_json_answer(text: object) -> Any:
    """The first JSON object or array in an LLM answer (code fences and chatter tolerated).

    Raises:
        ValueError: the answer is not text or holds no JSON value.
    """
    if not isinstance(text, str):
        msg = f"the LLM returned {type(text).__name__}, not text"
        raise ValueError(msg)
    body = text.strip()
    fenced = _FENCE.search(body)
    if fenced:
        body = fenced.group(1).strip()
    decoder = json.JSONDecoder()
    attempts = 0
    for match in re.finditer(r"[\[{]", body):
        try:
            value, _ = decoder.raw_decode(body, match.start())
        except (json.JSONDecodeError, RecursionError):
            # RecursionError: brackets nested past the interpreter's limit ("[" * 100_000),
            # garbage like any other.
            attempts += 1
            if attempts >= 20:  # long garbage: do not scan it quadratically
                break
            continue
        return value
    msg = f"no JSON in the answer {text[:80]!r}"
    raise ValueError(msg)


async def call_llm(llm: LLM, prompt: str, *, max_tokens: int | None, timeout: float | None) -> str:
    """One LLM call: native ``acomplete`` when present, else ``complete`` in a worker thread.

    Raises:
        LLMTimeoutError: no answer within ``timeout`` seconds.  (A synchronous call keeps
            running in its thread; only the wait is abandoned.)
    """
    if isinstance(llm, AsyncLLM):
        pending = llm.acomplete(prompt, max_tokens=max_tokens)
    else:
        pending = asyncio.to_thread(llm.complete, prompt, max_tokens=max_tokens)
    if timeout is None:
        return await pending
    try:
        return await asyncio.wait_for(pending, timeout)
    except asyncio.TimeoutError as exc:
        msg = f"the LLM did not answer within {timeout} s"
        raise LLMTimeoutError(msg) from exc


async def ask_json(
    llm: LLM,
    prompt: str,
    parse: Callable[[Any], T],
    *,
    max_tokens: int | None,
    timeout: float | None,
    attempts: int = 2,
) -> tuple[T | None, str]:
    """Ask for JSON and parse it; retry once on a malformed answer or a failed call.

    Args:
        llm: the model.
        prompt: asks for JSON.
        parse: turns the decoded JSON into the caller's value; raises ValueError when the
            JSON has the wrong shape.
        max_tokens: answer length passed to the model.
        timeout: seconds per call (None: wait).
        attempts: calls in total (2 = one retry).

    Returns:
        ``(value, "")`` on success, ``(None, reason)`` when every attempt failed.

    Raises:
        LLMAuthenticationError: credentials were rejected: retrying or falling back would
            only hide a configuration error.
    """
    error = "no attempt made"
    for attempt in range(attempts):
        asked = prompt if attempt == 0 else prompt + render(_RETRY_NOTE, error=error)
        try:
            answer = await call_llm(llm, asked, max_tokens=max_tokens, timeout=timeout)
        except LLMAuthenticationError:
            raise
        except (LLMError, LLMTimeoutError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            continue
        except Exception as exc:
            error = f"the LLM call failed with {type(exc).__name__}: {exc}"
            continue
        try:
            return parse(parse_json_answer(answer)), ""
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            # RecursionError: a parser walking (or printing) JSON nested past the limit.
            error = f"malformed answer: {exc}"
    return None, error
