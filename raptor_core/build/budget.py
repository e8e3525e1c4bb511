"""A hard cap on what a build spends on LLM summaries (issue 16).

:class:`LLMBudget` caps the cost (``max_cost_usd``, with :class:`Pricing`) and/or the tokens
(``max_summary_tokens``: prompt plus completion) of the summary calls of one
:meth:`~raptor_core.build.builder.TreeBuilder.build`, ``insert``, ``update`` or ``delete``.

How the cap holds with calls in flight: before each call that reaches the summariser (a cache
hit never does) its *worst case* is reserved: its prompt tokens, counted with the builder's
tokenizer, plus ``summary_max_tokens`` of completion.  The call is made only if what was
already spent, plus every reservation in flight, plus this worst case, stays within the cap;
the check and the reservation happen under one lock, so concurrent workers cannot both take
the last of the budget.  When the call returns its reservation is replaced by what it really
cost: the usage the summariser reports (``usage.snapshot()``, as the OpenAI backend's
``prompt_tokens``/``completion_tokens``), or, when it reports none, the builder's own count of
the prompt and the answer.  An LLM summariser's worst case also counts
``CHAT_FRAMING_TOKENS`` for the chat format's own tokens.  Prompts are counted with the
build's tokenizer: a model whose tokenizer needs more tokens than it for the same text could
pass the cap by that difference on its last call.  Retries of answers the service billed
(a truncated completion asked again) are counted when they are reported, after the call.

The first call that does not fit is not made: the build waits for the calls in flight (so
their answers reach the cache) and raises :class:`~raptor_core.exceptions.BudgetExceededError`.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from raptor_core.exceptions import BudgetExceededError, InvalidParameterError
from raptor_core.types import AsyncSummarizer, Summarizer, Tokenizer

__all__ = ["CHAT_FRAMING_TOKENS", "LLMBudget", "Pricing", "Spend"]

#: Tokens added to an LLM summariser's worst case for the chat format (role markers, priming).
CHAT_FRAMING_TOKENS = 12
# How often an async call refused by the budget checks whether the calls in flight are done.
_DRAIN_POLL_S = 0.02


@dataclass(frozen=True, slots=True, kw_only=True)
class Pricing:
    """What a chat model charges, in US dollars per million tokens.

    Prices come from you (your provider's price list), or from a summariser that exposes a
    ``pricing`` attribute holding one of these; never from a file.

    Examples:
        >>> Pricing(prompt_usd_per_million=0.15, completion_usd_per_million=0.60).cost(
        ...     1_000_000, 500_000
        ... )
        0.45
    """

    prompt_usd_per_million: float
    completion_usd_per_million: float

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        """The price of ``prompt_tokens`` in and ``completion_tokens`` out, in USD."""
        return (
            prompt_tokens * self.prompt_usd_per_million
            + completion_tokens * self.completion_usd_per_million
        ) / 1_000_000

    def _validate(self) -> None:
        for name in ("prompt_usd_per_million", "completion_usd_per_million"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                msg = f"Pricing.{name} must be a finite number >= 0 (USD per million tokens), got {value!r}"
                raise InvalidParameterError(msg)


@dataclass(frozen=True, slots=True, kw_only=True)
class LLMBudget:
    """Caps on the summary calls of one build or update (``TreeBuilder(budget=...)``).

    Args:
        max_cost_usd: the most the summary calls may cost, in USD (needs ``pricing``, or a
            summariser with a ``pricing`` attribute).  None: no cost cap.
        max_summary_tokens: the most prompt plus completion tokens the summary calls may use.
            None: no token cap.
        pricing: the model's prices; without caps, a budget only meters (the progress
            events and ``build_info["budget"]`` then show the cost).

    Parameters are stored as given and checked when the build starts.  The cap applies to
    each run on its own: a rerun with the same cache gets its answers already paid for as
    cache hits, which cost nothing, and spends its cap on what is left.

    Examples:
        >>> LLMBudget(max_summary_tokens=50_000)
        LLMBudget(max_cost_usd=None, max_summary_tokens=50000, pricing=None)
    """

    max_cost_usd: float | None = None
    max_summary_tokens: int | None = None
    pricing: Pricing | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Spend:
    """What the summary calls of a run have used so far (cache hits excluded)."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usd: float | None = None

    @property
    def tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form."""
        out: dict[str, Any] = {
            "calls": self.calls,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }
        if self.usd is not None:
            out["usd"] = round(self.usd, 6)
        return out


def resolve_pricing(budget: object, summarizer: object) -> Pricing | None:
    """Check ``budget`` (an :class:`LLMBudget` or None); the prices to count with.

    Raises:
        InvalidParameterError: not an LLMBudget, a cap out of range, or a cost cap without
            prices.
    """
    own = getattr(summarizer, "pricing", None)
    if budget is None:
        return own if isinstance(own, Pricing) else None
    if not isinstance(budget, LLMBudget):
        msg = f"budget must be an LLMBudget or None, got {type(budget).__name__}"
        raise InvalidParameterError(msg)
    cost = budget.max_cost_usd
    if cost is not None and (
        isinstance(cost, bool)
        or not isinstance(cost, int | float)
        or not math.isfinite(cost)
        or cost <= 0
    ):
        msg = f"max_cost_usd must be a finite number > 0 (USD) or None, got {cost!r}"
        raise InvalidParameterError(msg)
    tokens = budget.max_summary_tokens
    if tokens is not None and (
        isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1
    ):
        msg = f"max_summary_tokens must be an integer >= 1 or None, got {tokens!r}"
        raise InvalidParameterError(msg)
    pricing = budget.pricing
    if pricing is None and isinstance(own, Pricing):
        pricing = own
    if pricing is not None:
        if not isinstance(pricing, Pricing):
            msg = f"pricing must be a Pricing or None, got {type(pricing).__name__}"
            raise InvalidParameterError(msg)
        pricing._validate()
    if cost is not None and pricing is None:
        msg = (
            "max_cost_usd needs the model's prices: pass LLMBudget(pricing=Pricing("
            "prompt_usd_per_million=..., completion_usd_per_million=...)) (raptor: "
            "--price-prompt and --price-completion), or cap tokens with max_summary_tokens"
        )
        raise InvalidParameterError(msg)
    return pricing


def prompt_tokens(summarizer: object, tokenizer: Tokenizer, texts: Sequence[str]) -> int:
    """Tokens of the prompt ``summarizer`` sends for ``texts``, by the build's tokenizer.

    The rendered template plus :data:`CHAT_FRAMING_TOKENS` when the summariser has ``render``
    (LLM summarisers), else the texts themselves; plus the system message of an ``llm`` that
    has one.
    """
    from raptor_core.tokenizers import count_tokens

    render = getattr(summarizer, "render", None)
    prompt = render(list(texts)) if callable(render) else "\n\n".join(texts)
    total = count_tokens(tokenizer, str(prompt))
    if callable(render):
        total += CHAT_FRAMING_TOKENS
    system = getattr(getattr(summarizer, "llm", None), "system_prompt", None)
    if isinstance(system, str):
        total += count_tokens(tokenizer, system)
    return total


def _reported(summarizer: object) -> tuple[int, int, int]:
    """``(calls, prompt_tokens, completion_tokens)`` the summariser reports (zeros if none)."""
    snapshot = getattr(getattr(summarizer, "usage", None), "snapshot", None)
    if not callable(snapshot):
        return 0, 0, 0
    counts: Mapping[str, Any] = dict(snapshot())
    return tuple(  # type: ignore[return-value]
        int(counts.get(name, 0) or 0) for name in ("calls", "prompt_tokens", "completion_tokens")
    )


@dataclass(slots=True)
class _Ticket:
    prompt: int
    completion: int
    calls: int = 1


class Meter:
    """Counts a run's summary calls and enforces its :class:`LLMBudget` (thread-safe).

    One per run; the builder wraps the summariser in a :class:`MeteredSummarizer` over it when
    a budget is set, and reads :meth:`spend` for its progress events either way.
    """

    def __init__(
        self,
        budget: LLMBudget | None,
        pricing: Pricing | None,
        summarizer: object,
        tokenizer: Tokenizer,
        *,
        has_cache: bool,
    ) -> None:
        self.budget = budget
        self.pricing = pricing
        self.summarizer = summarizer
        self.tokenizer = tokenizer
        self.has_cache = has_cache
        self._cond = threading.Condition()
        self._baseline = _reported(summarizer)
        self._calls = 0
        self._prompt = 0
        self._completion = 0
        self._reserved_prompt = 0
        self._reserved_completion = 0
        self._in_flight = 0
        self._stopped = False

    # -- figures --------------------------------------------------------------------------------
    def _spent_tokens(self) -> tuple[int, int, int]:
        now = _reported(self.summarizer)
        calls, prompt, completion = (a - b for a, b in zip(now, self._baseline, strict=True))
        if prompt or completion:
            # What the service billed (retries and chat framing included) is the real spend.
            return max(calls, self._calls), prompt, completion
        # A summariser (or a server) that reports no usage: our own count.
        return self._calls, self._prompt, self._completion

    def spend(self) -> Spend:
        """What the run's summary calls have used so far."""
        with self._cond:
            calls, prompt, completion = self._spent_tokens()
        usd = self.pricing.cost(prompt, completion) if self.pricing is not None else None
        return Spend(calls=calls, prompt_tokens=prompt, completion_tokens=completion, usd=usd)

    # -- the check ------------------------------------------------------------------------------
    def reserve(
        self, clusters: Sequence[Sequence[str]], max_tokens: int, *, wait: bool = True
    ) -> _Ticket:
        """Reserve the worst case of summarising ``clusters`` (one call each, or one batch).

        Raises BudgetExceededError when it does not fit, once the calls in flight are done;
        ``wait=False`` (async callers) raises an internal ``_Refused`` at once instead, and
        the caller drains without blocking the event loop.
        """
        ticket = _Ticket(
            sum(prompt_tokens(self.summarizer, self.tokenizer, texts) for texts in clusters),
            max_tokens * len(clusters),
            len(clusters),
        )
        with self._cond:
            if not (self._stopped or self._over(ticket)):
                self._reserved_prompt += ticket.prompt
                self._reserved_completion += ticket.completion
                self._in_flight += 1
                return ticket
            # Stop every later call too: a build that cannot finish should stop promptly,
            # not spend the rest of the cap on clusters it cannot use yet.
            self._stopped = True
            if wait:
                while self._in_flight:
                    self._cond.wait()
        if not wait:
            raise _Refused(ticket)
        raise self.error(ticket)

    def _over(self, ticket: _Ticket) -> bool:
        budget = self.budget
        if budget is None:
            return False
        _, prompt, completion = self._spent_tokens()
        prompt += self._reserved_prompt + ticket.prompt
        completion += self._reserved_completion + ticket.completion
        if (
            budget.max_summary_tokens is not None
            and prompt + completion > budget.max_summary_tokens
        ):
            return True
        # Priced from integer totals in one step: no float drift from adding and removing
        # reservations.
        return (
            budget.max_cost_usd is not None
            and self.pricing is not None
            and self.pricing.cost(prompt, completion) > budget.max_cost_usd
        )

    def settle(self, ticket: _Ticket, answer: object) -> None:
        """Replace a call's reservation by what it used."""
        from raptor_core.tokenizers import count_tokens

        used = count_tokens(self.tokenizer, answer) if isinstance(answer, str) else 0
        with self._cond:
            self._release(ticket)
            self._calls += ticket.calls
            self._prompt += ticket.prompt
            self._completion += used

    def cancel(self, ticket: _Ticket) -> None:
        """Drop the reservation of a call that failed (what it was billed, if reported, counts)."""
        with self._cond:
            self._release(ticket)

    def _release(self, ticket: _Ticket) -> None:
        self._reserved_prompt -= ticket.prompt
        self._reserved_completion -= ticket.completion
        self._in_flight -= 1
        self._cond.notify_all()

    def in_flight(self) -> int:
        """Calls reserved and not yet settled."""
        with self._cond:
            return self._in_flight

    def error(self, ticket: _Ticket) -> BudgetExceededError:
        """The error for a call that was not made (with what was spent, once the rest is in)."""
        budget = self.budget or LLMBudget()
        spent = self.spend()
        pricing = self.pricing
        needed_usd = pricing.cost(ticket.prompt, ticket.completion) if pricing else None
        caps = []
        if budget.max_cost_usd is not None:
            caps.append(f"max_cost_usd=${budget.max_cost_usd:g}")
        if budget.max_summary_tokens is not None:
            caps.append(f"max_summary_tokens={budget.max_summary_tokens}")
        cost = f"${spent.usd:.4f}, " if spent.usd is not None else ""
        need = f"${needed_usd:.4f}, " if needed_usd is not None else ""
        resume = (
            "The answers received are in the build cache: raise the cap (LLMBudget, or "
            "--max-cost-usd / --max-summary-tokens) and rerun with the same cache; answers "
            "already paid for are cache hits and cost nothing."
            if self.has_cache
            else "This build has no cache, so a rerun pays for them again: pass "
            "cache=DIRECTORY (raptor always keeps one) and raise the cap (LLMBudget, or "
            "--max-cost-usd / --max-summary-tokens)."
        )
        msg = (
            f"LLM budget reached: spent {cost}{spent.tokens} tokens ({spent.calls} summary "
            f"calls) of the cap {' and '.join(caps)}; the next call needs up to {need}"
            f"{ticket.prompt + ticket.completion} tokens, so it was not made and the build "
            f"stopped. {resume}"
        )
        return BudgetExceededError(
            msg,
            spent_usd=spent.usd,
            spent_tokens=spent.tokens,
            calls=spent.calls,
            max_cost_usd=budget.max_cost_usd,
            max_summary_tokens=budget.max_summary_tokens,
            needed_usd=needed_usd,
            needed_tokens=ticket.prompt + ticket.completion,
        )


class _Refused(Exception):
    """Internal: an async call was refused; the caller drains, then raises the real error."""

    def __init__(self, ticket: _Ticket) -> None:
        super().__init__("refused")
        self.ticket = ticket


class MeteredSummarizer:
    """A summariser whose every call passes :meth:`Meter.reserve` first.

    It sits *under* the build cache (``CachedSummarizer(MeteredSummarizer(s))``), so a cache
    hit never reaches it.  The cache keys keep the wrapped summariser's identity.
    """

    def __init__(self, summarizer: Summarizer, meter: Meter) -> None:
        self.summarizer = summarizer
        self.meter = meter

    def __repr__(self) -> str:
        return f"MeteredSummarizer({self.summarizer!r})"

    @property
    def usage(self) -> object:
        """The wrapped summariser's ``usage`` (None when it keeps none)."""
        return getattr(self.summarizer, "usage", None)

    @property
    def requires_cache(self) -> bool:
        """The wrapped summariser's (a batch summariser records its jobs in the cache)."""
        return bool(getattr(self.summarizer, "requires_cache", False))

    def summarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        """Summarise if the budget allows the call's worst case."""
        ticket = self.meter.reserve([texts], max_tokens)
        try:
            answer = self.summarizer.summarize(texts, max_tokens=max_tokens)
        except BaseException:
            self.meter.cancel(ticket)
            raise
        self.meter.settle(ticket, answer)
        return answer

    async def asummarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        """Async :meth:`summarize` (a sync summariser runs in a worker thread)."""
        if not isinstance(self.summarizer, AsyncSummarizer):
            return await asyncio.to_thread(self.summarize, texts, max_tokens=max_tokens)
        try:
            ticket = self.meter.reserve([texts], max_tokens, wait=False)
        except _Refused as refused:
            # The other tasks' calls are still running; waiting here keeps this error from
            # cancelling them (asyncio.gather would), so their paid answers reach the cache.
            while self.meter.in_flight():
                await asyncio.sleep(_DRAIN_POLL_S)
            raise self.meter.error(refused.ticket) from None
        try:
            answer = await self.summarizer.asummarize(texts, max_tokens=max_tokens)
        except BaseException:
            self.meter.cancel(ticket)
            raise
        self.meter.settle(ticket, answer)
        return answer

    @property
    def summarize_batch(self) -> Any:
        """The wrapped ``summarize_batch`` (only if it has one); a batch is all or nothing.

        Raises:
            AttributeError: the wrapped summariser has no ``summarize_batch``.
        """
        if not callable(getattr(self.summarizer, "summarize_batch", None)):
            msg = f"{type(self.summarizer).__name__} has no summarize_batch"
            raise AttributeError(msg)
        return self._summarize_batch

    def _summarize_batch(
        self, clusters: Sequence[Sequence[str]], *, max_tokens: int, **kwargs: Any
    ) -> list[str]:
        # One job for many clusters cannot stop half way: reserve them all, or none.  (A job
        # an earlier run submitted is reserved again although it is paid for: safe, not exact.)
        ticket = self.meter.reserve(clusters, max_tokens)
        try:
            batch = self.summarizer.summarize_batch  # type: ignore[attr-defined]
            answers = list(batch(clusters, max_tokens=max_tokens, **kwargs))
        except BaseException:
            self.meter.cancel(ticket)
            raise
        self.meter.settle(ticket, " ".join(a for a in answers if isinstance(a, str)))
        return answers
