"""Progress events of a build, with time left and money spent (issue 16).

``TreeBuilder(on_progress=callback)`` calls ``callback(event)`` with a :class:`BuildProgress`
each time a stage moves (a document chunked, a batch embedded, a layer clustered, a summary
received); ``TreeBuilder(progress=...)`` keeps getting the plain ``(stage, done, total)``.
The ``raptor`` command draws its bars from these events.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BuildProgress", "BuildProgressCallback"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BuildProgress:
    """One step of a build: where it is, how long the stage has taken and has left, and cost.

    Attributes:
        stage: ``"chunk"``, ``"embed"``, ``"cluster"`` or ``"summarize"``.
        done, total: units of the stage's current pass (documents, texts, layers, clusters).
        layer: the layer being made (0: the leaves).
        elapsed_s: seconds since this pass of the stage began.
        eta_s: seconds left in this pass at the rate so far; None before the first unit is
            done (unknown), 0.0 when the pass is complete.  Cache hits make the rate look
            faster than paid calls will be.
        summary_calls: summary calls that reached the summariser in this run (not cache hits).
        prompt_tokens, completion_tokens: their tokens (reported by the summariser, else
            counted by the build's tokenizer when a budget meters the calls).
        spent_usd: what they cost, when prices are known (``LLMBudget(pricing=...)`` or a
            summariser's ``pricing``); None otherwise.
        max_cost_usd, max_summary_tokens: the budget's caps (None: not capped).
    """

    stage: str
    done: int
    total: int
    layer: int = 0
    elapsed_s: float = 0.0
    eta_s: float | None = None
    summary_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spent_usd: float | None = None
    max_cost_usd: float | None = None
    max_summary_tokens: int | None = None

    @property
    def fraction(self) -> float:
        """``done / total`` (1.0 for an empty pass)."""
        return self.done / self.total if self.total else 1.0


#: ``on_progress(event)``.
BuildProgressCallback = Callable[[BuildProgress], None]


class StageClock:
    """Start times of stage passes, for ``elapsed_s`` and ``eta_s``.

    Not locked: one build's stages run one after another.
    """

    def __init__(self) -> None:
        self._stage = ""
        self._start = time.perf_counter()
        self._last_done = 0

    def begin(self, stage: str) -> None:
        """A pass of ``stage`` starts now."""
        self._stage, self._start, self._last_done = stage, time.perf_counter(), 0

    def times(self, stage: str, done: int, total: int) -> tuple[float, float | None]:
        """``(elapsed_s, eta_s)`` of the pass that reported ``done`` of ``total``."""
        now = time.perf_counter()
        if stage != self._stage or done < self._last_done:
            # A stage that reports without begin(): time it from its first report.
            self.begin(stage)
            self._start = now
        self._last_done = done
        elapsed = now - self._start
        if total <= 0 or done >= total:
            return elapsed, 0.0
        if done <= 0 or elapsed <= 0.0:
            return elapsed, None
        return elapsed, elapsed / done * (total - done)
