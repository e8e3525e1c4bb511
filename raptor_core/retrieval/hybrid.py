"""Hybrid tree search: value-based and LLM-guided search at once, with an LLM judge.

The default search of PageIndex's retrieval API, on a RAPTOR tree::

    value-based search ─┐                      ┌─> extract (optional, LLM)
                        ├─> queue of unique ─> consumer ─> judge (LLM): enough? ─> stop
    LLM-guided search ──┘     nodes            (token budget, k)

Both searches run concurrently as asyncio tasks and offer nodes to one queue; a node that
was already offered is not queued again (the result still records that both searches
found it).  The value search is fast and contributes its best ``value_k`` nodes almost at
once; the LLM search adds its choices as it descends.  A consumer takes nodes in arrival
order, keeps those that fit the token budget, optionally has the LLM extract the
relevant sentences of each, and after each node asks an LLM judge whether the context is
enough to answer; a "yes" stops both searches.  The whole run is bounded by ``timeout``
seconds: what was gathered by then is returned.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core._async import run_sync
from raptor_core._llm import ask_json, call_llm, render
from raptor_core.exceptions import InvalidParameterError, LLMAuthenticationError
from raptor_core.retrieval.base import (
    DEFAULT_K,
    DEFAULT_MAX_TOKENS,
    Hit,
    TreeRetriever,
    _check_positive_int,
    as_store,
)
from raptor_core.retrieval.llm import SELECT_PROMPT, LLMGuidedRetriever, check_timeout
from raptor_core.retrieval.value import DEFAULT_CHUNK_K, ValueBasedRetriever
from raptor_core.tree import Tree
from raptor_core.types import LLM, Embedder, NodeStore, VectorIndex

__all__ = [
    "EXTRACT_PROMPT",
    "JUDGE_PROMPT",
    "HybridResult",
    "HybridRetriever",
    "JudgeDecision",
]

logger = logging.getLogger(__name__)

#: Placeholders: ``{query}``, ``{context}``.
JUDGE_PROMPT = """Decide whether the context below is enough to answer the question completely.

Question: {query}

Context:
{context}

Answer with a JSON object only, no other text:
{"enough": true or false, "reason": "<one short sentence>"}"""

#: Placeholders: ``{query}``, ``{text}``.
EXTRACT_PROMPT = """Copy, word for word, the sentences of the passage below that help answer \
the question. Copy nothing else. If no sentence helps, answer NONE.

Question: {query}

Passage:
{text}"""

STOP_REASONS = ("judge", "k", "budget", "timeout", "exhausted")


@dataclass(frozen=True, slots=True, kw_only=True)
class JudgeDecision:
    """One verdict of the judge, taken right after ``node_id`` was added.

    Attributes:
        node_id: the node just added to the context.
        enough: whether the judge found the context sufficient.
        reason: the judge's reason (or why its answer was unusable).
        hits: number of hits gathered at that moment.
        elapsed: seconds since the search started.
    """

    node_id: str
    enough: bool
    reason: str
    hits: int
    elapsed: float


@dataclass(frozen=True, slots=True, kw_only=True)
class HybridResult:
    """What a hybrid search gathered and why it stopped.

    Attributes:
        hits: accepted nodes in the order the consumer took them; ``Hit.source`` is the
            search that found the node first (``"value"`` or ``"llm"``).
        found_by: node id -> every search that found it, first finder first (nodes offered
            but not accepted included).
        extracts: node id -> the sentences the LLM extracted (when ``extract=True``).
        judgements: the judge's verdicts, in order.
        stop_reason: ``"judge"`` (enough context), ``"k"``, ``"budget"``, ``"timeout"`` or
            ``"exhausted"`` (both searches ended).
        elapsed: wall-clock seconds of the search (query embedding excluded).
        errors: failures of a search or of the judge, as messages (the run degrades instead
            of failing).
    """

    hits: tuple[Hit, ...] = ()
    found_by: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    extracts: Mapping[str, str] = field(default_factory=dict)
    judgements: tuple[JudgeDecision, ...] = ()
    stop_reason: str = "exhausted"
    elapsed: float = 0.0
    errors: tuple[str, ...] = ()

    @property
    def stopped_early(self) -> bool:
        """Whether the judge stopped the search before it ran out of nodes, hits or budget."""
        return self.stop_reason == "judge"

    @property
    def stopped_after(self) -> int | None:
        """Number of hits when the judge stopped the search (None if it did not)."""
        return len(self.hits) if self.stopped_early else None

    @property
    def context(self) -> str:
        """The gathered context: each hit's extract (if any) or text, separated by blank lines."""
        return "\n\n".join(self.extracts.get(h.id, h.node.text) for h in self.hits)


@dataclass
class _Run:
    """Mutable state of one run, shared by the tasks (all on one event loop: no locks)."""

    started: float
    queue: asyncio.Queue[Hit | None]
    hits: list[Hit] = field(default_factory=list)
    used: int = 0
    found_by: dict[str, list[str]] = field(default_factory=dict)
    extracts: dict[str, str] = field(default_factory=dict)
    judgements: list[JudgeDecision] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop_reason: str = "exhausted"

    def offer(self, hit: Hit) -> None:
        finders = self.found_by.setdefault(hit.id, [])
        if hit.source in finders:
            return
        finders.append(hit.source)
        if len(finders) == 1:  # first sighting: queue it; later finders are only recorded
            self.queue.put_nowait(hit)

    def result(self) -> HybridResult:
        return HybridResult(
            hits=tuple(self.hits),
            found_by={key: tuple(value) for key, value in self.found_by.items()},
            extracts=dict(self.extracts),
            judgements=tuple(self.judgements),
            stop_reason=self.stop_reason,
            elapsed=time.perf_counter() - self.started,
            errors=tuple(self.errors),
        )


class HybridRetriever(TreeRetriever):
    """Hybrid tree search: concurrent value-based and LLM-guided search, an LLM judge, a timeout.

    :meth:`retrieve` returns the hits; :meth:`search` returns a :class:`HybridResult` that
    also says which search found each node, what the judge decided and why the run
    stopped.  ``Hit.score`` is the finder's score, in [0, 1]: the mean cosine of the node's
    retrieved chunks for ``"value"`` hits, the cosine similarity for ``"llm"`` hits.

    Args:
        tree: the tree to search.
        embedder: embeds the query.
        llm: the model for the LLM search, the judge and the extraction.
        k: maximum number of hits.
        max_tokens: context budget; nodes that do not fit are skipped.
        value_k: nodes the value search contributes (default: half of ``k``, rounded up),
            which leaves room for the LLM's choices.
        chunk_k: chunks retrieved by the value search (see ValueBasedRetriever).
        include: nodes the value search may return: ``"all"``, ``"summaries"``, ``"leaves"``.
        top_k: nodes the LLM may choose per step (see LLMGuidedRetriever).
        start_layer: layer the LLM search starts at (default: the top layer; with a filter,
            the highest layer holding a node that passes it).
        num_layers: steps the LLM search descends (default: down to the leaves).
        max_candidates: candidates shown to the LLM per step.
        min_score: both searches ignore nodes below this cosine similarity.
        judge: ask the LLM judge after each accepted node whether the context is enough.
        extract: have the LLM extract the relevant sentences of each accepted node
            (``HybridResult.extracts``); one extra LLM call per node.
        timeout: wall-clock seconds for the whole search (None: unbounded).
        llm_timeout: seconds per LLM call (None: wait).
        index: vector index for the value search's chunk retrieval (see ValueBasedRetriever).

    Examples:
        >>> from raptor_core.testing import FakeEmbedder, ScriptedLLM, tiny_tree
        >>> tree = tiny_tree()
        >>> llm = ScriptedLLM(default='{"selected": [], "enough": true, "reason": "done"}')
        >>> result = HybridRetriever(tree, FakeEmbedder(dim=tree.dim), llm=llm).search("cats purr")
        >>> result.stop_reason, result.stopped_after, result.hits[0].source
        ('judge', 1, 'value')
    """

    source = "hybrid"

    def __init__(
        self,
        tree: Tree | NodeStore,
        embedder: Embedder,
        *,
        llm: LLM,
        k: int = DEFAULT_K,
        max_tokens: int | None = DEFAULT_MAX_TOKENS,
        value_k: int | None = None,
        chunk_k: int = DEFAULT_CHUNK_K,
        include: str = "all",
        top_k: int = 3,
        start_layer: int | None = None,
        num_layers: int | None = None,
        max_candidates: int = 20,
        min_score: float | None = None,
        judge: bool = True,
        extract: bool = False,
        timeout: float | None = 60.0,
        llm_timeout: float | None = None,
        index: VectorIndex | None = None,
        where: Mapping[str, Any] | None = None,
        native_filter: Any = None,
    ) -> None:
        super().__init__(
            tree, embedder, k=k, max_tokens=max_tokens, where=where, native_filter=native_filter
        )
        self.llm = llm
        self.value_k = value_k
        self.chunk_k = chunk_k
        self.include = include
        self.top_k = top_k
        self.start_layer = start_layer
        self.num_layers = num_layers
        self.max_candidates = max_candidates
        self.min_score = min_score
        self.judge = judge
        self.extract = extract
        self.timeout = timeout
        self.llm_timeout = llm_timeout
        self.index = index

    @property
    def store(self) -> NodeStore:
        """The store searched; with ``index``, a store searching through that index."""
        return as_store(self.tree, index=self.index)

    # -- the two searches ----------------------------------------------------------------------
    def _searches(self) -> tuple[ValueBasedRetriever, LLMGuidedRetriever]:
        value = ValueBasedRetriever(
            self.tree,
            self.embedder,
            k=self.k,
            max_tokens=None,
            chunk_k=self.chunk_k,
            include=self.include,
            min_score=self.min_score,
            index=self.index,
            where=self.where,
            native_filter=self.native_filter,
        )
        guided = LLMGuidedRetriever(
            self.tree,
            self.embedder,
            llm=self.llm,
            k=self.k,
            max_tokens=None,
            top_k=self.top_k,
            start_layer=self.start_layer,
            num_layers=self.num_layers,
            max_candidates=self.max_candidates,
            min_score=self.min_score,
            llm_timeout=self.llm_timeout,
            prompt=SELECT_PROMPT,
            where=self.where,
            native_filter=self.native_filter,
        )
        return value, guided

    def _validate(self) -> None:
        value, guided = self._searches()
        value._validate()
        guided._validate()
        _check_positive_int("value_k", self.value_k, allow_none=True)
        for name in ("judge", "extract"):
            if not isinstance(getattr(self, name), bool):
                msg = f"{name} must be True or False, got {getattr(self, name)!r}"
                raise InvalidParameterError(msg)
        check_timeout("timeout", self.timeout)

    # -- public API ----------------------------------------------------------------------------
    def search(
        self, query: str, *, k: int | None = None, max_tokens: int | None = None
    ) -> HybridResult:
        """Run the hybrid search and return the full :class:`HybridResult`.

        Raises:
            InvalidInputError: the query is empty or not a string.
            InvalidParameterError: a parameter is out of range.
            LLMAuthenticationError: the LLM rejected the credentials.
        """
        k, max_tokens = self._resolve(query, k, max_tokens)
        if len(self.store) == 0:
            return HybridResult()
        vector = self.embed_query(query)
        return run_sync(lambda: self._run(query, vector, k=k, max_tokens=max_tokens))

    async def asearch(
        self, query: str, *, k: int | None = None, max_tokens: int | None = None
    ) -> HybridResult:
        """Async :meth:`search`; safe inside a running event loop."""
        k, max_tokens = self._resolve(query, k, max_tokens)
        if len(self.store) == 0:
            return HybridResult()
        vector = await self.aembed_query(query)
        return await self._run(query, vector, k=k, max_tokens=max_tokens)

    def _retrieve(
        self, query: str, vector: NDArray[np.float32], *, k: int, max_tokens: int | None
    ) -> list[Hit]:
        return list(run_sync(lambda: self._run(query, vector, k=k, max_tokens=max_tokens)).hits)

    async def _aretrieve(
        self, query: str, vector: NDArray[np.float32], *, k: int, max_tokens: int | None
    ) -> list[Hit]:
        return list((await self._run(query, vector, k=k, max_tokens=max_tokens)).hits)

    # -- the run -------------------------------------------------------------------------------
    async def _run(
        self, query: str, vector: NDArray[np.float32], *, k: int, max_tokens: int | None
    ) -> HybridResult:
        run = _Run(started=time.perf_counter(), queue=asyncio.Queue())
        value, guided = self._searches()
        # Integer halving: k / 2 overflows a float for a huge k (10**400 means "no limit").
        value_k = (k + 1) // 2 if self.value_k is None else int(self.value_k)

        async def value_search() -> None:
            # Inline, not in a thread: it is one store search and a walk up the parents
            # (milliseconds in memory), and running it first keeps arrival order repeatable.
            ranking = value.score_nodes(vector)
            for position in range(min(value_k, len(ranking))):
                run.offer(value.hit(ranking, position))

        async def llm_search() -> None:
            await guided.walk(query, vector, k=k, max_tokens=None, emit=run.offer)

        # The LLM search starts first so its first call is in flight while the value
        # search's nodes are consumed and judged.
        producers = [
            asyncio.create_task(llm_search(), name="raptor-hybrid-llm"),
            asyncio.create_task(value_search(), name="raptor-hybrid-value"),
        ]
        pending = len(producers)

        def finished(task: asyncio.Task[None]) -> None:
            nonlocal pending
            pending -= 1
            if not task.cancelled() and task.exception() is not None:
                exc = task.exception()
                run.errors.append(
                    f"{task.get_name().rsplit('-', 1)[-1]} search failed: "
                    f"{type(exc).__name__}: {exc}"
                )
                logger.warning("hybrid search: %s", run.errors[-1])
            if pending == 0:
                run.queue.put_nowait(None)  # both searches are over: wake the consumer

        for task in producers:
            task.add_done_callback(finished)
        consumer = asyncio.create_task(self._consume(query, run, k=k, max_tokens=max_tokens))
        try:
            done, _ = await asyncio.wait({consumer}, timeout=self.timeout)
            if consumer not in done:
                run.stop_reason = "timeout"
                logger.info(
                    "hybrid search: timed out after %s s with %d hits", self.timeout, len(run.hits)
                )
        finally:
            for task in (consumer, *producers):
                task.cancel()
            outcomes = await asyncio.gather(consumer, *producers, return_exceptions=True)
        for outcome in outcomes:
            # Bad credentials or parameters are configuration errors: never hide them
            # behind a degraded result.
            if isinstance(outcome, LLMAuthenticationError | InvalidParameterError):
                raise outcome
        if isinstance(outcomes[0], BaseException) and not isinstance(
            outcomes[0], asyncio.CancelledError
        ):
            raise outcomes[0]
        return run.result()

    async def _consume(self, query: str, run: _Run, *, k: int, max_tokens: int | None) -> None:
        while True:
            hit = await run.queue.get()
            if hit is None:
                run.stop_reason = "exhausted"
                return
            cost = hit.node.token_count
            if max_tokens is not None and run.used + cost > max_tokens:
                continue  # does not fit; a later, shorter node may
            if self.extract:
                run.extracts[hit.id] = await self._extract(query, hit)
            run.hits.append(hit)
            run.used += cost
            if len(run.hits) >= k:
                run.stop_reason = "k"
                return
            if max_tokens is not None and run.used >= max_tokens:
                run.stop_reason = "budget"
                return
            if self.judge:
                decision = await self._judge(query, run, hit)
                run.judgements.append(decision)
                if decision.enough:
                    run.stop_reason = "judge"
                    return

    async def _judge(self, query: str, run: _Run, hit: Hit) -> JudgeDecision:
        context = "\n\n".join(f"[{h.id}] {run.extracts.get(h.id, h.node.text)}" for h in run.hits)

        def parse(answer: Any) -> tuple[bool, str]:
            if not isinstance(answer, dict) or "enough" not in answer:
                msg = 'expected {"enough": true/false, "reason": "..."}'
                raise ValueError(msg)
            enough = answer["enough"]
            if isinstance(enough, str) and enough.strip().lower() in {"true", "yes", "false", "no"}:
                enough = enough.strip().lower() in {"true", "yes"}
            if not isinstance(enough, bool):
                msg = f"'enough' must be true or false, got {enough!r}"
                raise ValueError(msg)
            return enough, str(answer.get("reason") or "")

        verdict, error = await ask_json(
            self.llm,
            render(JUDGE_PROMPT, query=query, context=context),
            parse,
            max_tokens=256,
            timeout=self.llm_timeout,
        )
        if verdict is None:
            logger.warning("hybrid search: the judge's answer was unusable (%s); continuing", error)
            run.errors.append(f"judge: {error}")
            verdict = (False, f"judge answer unusable: {error}")
        return JudgeDecision(
            node_id=hit.id,
            enough=verdict[0],
            reason=verdict[1],
            hits=len(run.hits),
            elapsed=time.perf_counter() - run.started,
        )

    async def _extract(self, query: str, hit: Hit) -> str:
        try:
            answer = await call_llm(
                self.llm,
                render(EXTRACT_PROMPT, query=query, text=hit.node.text),
                max_tokens=max(64, hit.node.token_count),
                timeout=self.llm_timeout,
            )
        except LLMAuthenticationError:
            raise
        except Exception as exc:
            logger.warning(
                "hybrid search: extraction failed for %s (%s); keeping its full text", hit.id, exc
            )
            return hit.node.text
        if not isinstance(answer, str):
            return hit.node.text
        answer = answer.strip()
        return "" if answer.upper().rstrip(".") == "NONE" else answer
