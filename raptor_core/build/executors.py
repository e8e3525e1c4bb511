"""Where a build's parallel work runs: in this process, or on a cluster (:mod:`.ray_executor`).

A build has two kinds of parallel work, and an :class:`Executor` offers one method for each:

* ``map_batches(fn, batches, *, stage)``: the same function over many batches, with a model
  loaded once per worker (chunking documents, embedding texts);
* ``map_tasks(fn, items, *, stage, max_concurrency)``: independent calls, a bounded number
  at a time (summarising clusters, clustering independent buckets of a layer).

Both return the results in input order, so the tree does not depend on which worker finished
first: the same documents and ``random_state`` give the same tree with every executor.  A
failure raises a typed :class:`~raptor_core.exceptions.RaptorError` that names the stage and
the batch or item (:func:`stage_error`).

The builder forms the batches itself (256 texts per embedding call, as without an executor),
because a local model's vectors depend by ~1e-7 on what else shares its batch, and that is
enough to move UMAP's layout: equal batches are what make the trees identical.

Components travel to other processes as :class:`Shipped` values: an embedder on the closed
allowlist of :mod:`raptor_core.components` travels as its description and is re-created on
the worker (once per worker process), never as a pickled model; any other component is
pickled by the executor's own serialiser (cloudpickle for Ray).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, NoReturn, Protocol, TypeVar, cast, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from raptor_core.exceptions import (
    EmbeddingError,
    InvalidParameterError,
    RaptorError,
    SummarizationError,
)
from raptor_core.types import Chunker, Document, Embedder, SpanEmbedder, Summarizer, Tokenizer

__all__ = [
    "BuildStageError",
    "Executor",
    "LocalExecutor",
    "Shipped",
    "component_spec",
    "stage_error",
]

T = TypeVar("T")
R = TypeVar("R")
C = TypeVar("C")

#: Texts per embedding call, as the builder embeds without an executor.
EMBED_BATCH = 256
#: Documents per chunking batch: enough to amortise a task, few enough to spread a corpus.
CHUNK_BATCH = 32


class BuildStageError(RaptorError):
    """A stage run through an executor failed in code that is neither embedding nor summarising.

    Chunking and clustering failures are raised as this; embedding and summarising ones as
    :class:`~raptor_core.exceptions.EmbeddingError` and
    :class:`~raptor_core.exceptions.SummarizationError`.  ``stage`` names the stage.
    """

    def __init__(self, message: str, *, stage: str = "") -> None:
        super().__init__(message)
        self.stage = stage

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only ``stage`` would be lost by the default pickling of exceptions.
        return (_stage_error, (str(self), self.stage))


def _stage_error(message: str, stage: str) -> BuildStageError:
    return BuildStageError(message, stage=stage)


@runtime_checkable
class Executor(Protocol):
    """Runs a build's parallel work; results always come back in input order."""

    def map_batches(self, fn: Callable[[T], R], batches: Sequence[T], *, stage: str) -> list[R]:
        """``[fn(b) for b in batches]``, possibly on other workers (fn is picklable)."""
        ...

    def map_tasks(
        self,
        fn: Callable[[T], R],
        items: Sequence[T],
        *,
        stage: str,
        max_concurrency: int | None = None,
    ) -> list[R]:
        """``[fn(x) for x in items]`` with at most ``max_concurrency`` calls at once.

        None: as many at once as the executor sees fit.
        """
        ...


_STAGE_ERRORS: Mapping[str, type[RaptorError]] = {
    "embed": EmbeddingError,
    "summarize": SummarizationError,
}


def stage_error(stage: str, what: str, exc: BaseException) -> RaptorError:
    """The typed error to raise for ``exc``, raised by ``what`` (``"batch 3 of 9"``) of ``stage``.

    A :class:`RaptorError` keeps its type (an authentication error stays one) and gets the
    place prefixed to its message; anything else becomes the stage's error type
    (:class:`EmbeddingError`, :class:`SummarizationError`, else :class:`BuildStageError`).
    """
    where = f"{stage} stage, {what}"
    if isinstance(exc, RaptorError):
        exc.args = (f"{where}: {exc}", *exc.args[1:]) if exc.args else (where,)
        return exc
    cls = _STAGE_ERRORS.get(stage)
    msg = f"{where} failed: {type(exc).__name__}: {exc}"
    if cls is None:
        return BuildStageError(msg, stage=stage)
    return cls(msg)


def _raise(error: RaptorError, cause: BaseException) -> NoReturn:
    """Raise ``error``: the original itself when it kept its type, else chained to it."""
    if error is cause:
        raise error
    raise error from cause


class LocalExecutor:
    """Runs everything in this process: the behaviour of a builder without an executor.

    Batches run one after another (a local model already uses every core for one batch);
    tasks run in up to ``max_concurrency`` threads, as the builder runs summaries, and one
    after another when ``max_concurrency`` is None or 1 (CPU-bound clustering gains nothing
    from threads that numba and BLAS already use).  After the first failure no further
    call starts.

    Examples:
        >>> LocalExecutor().map_tasks(len, ["a", "bb"], stage="demo", max_concurrency=2)
        [1, 2]
    """

    def __repr__(self) -> str:
        return "LocalExecutor()"

    def map_batches(self, fn: Callable[[T], R], batches: Sequence[T], *, stage: str) -> list[R]:
        """Call ``fn`` on each batch in turn."""
        out: list[R] = []
        for i, batch in enumerate(batches):
            try:
                out.append(fn(batch))
            except Exception as exc:
                _raise(stage_error(stage, f"batch {i + 1} of {len(batches)}", exc), exc)
        return out

    def map_tasks(
        self,
        fn: Callable[[T], R],
        items: Sequence[T],
        *,
        stage: str,
        max_concurrency: int | None = None,
    ) -> list[R]:
        """Call ``fn`` on each item, in up to ``max_concurrency`` threads."""
        _check_concurrency(max_concurrency)
        if max_concurrency is None or max_concurrency == 1 or len(items) <= 1:
            out: list[R] = []
            for i, item in enumerate(items):
                try:
                    out.append(fn(item))
                except Exception as exc:
                    _raise(stage_error(stage, f"item {i + 1} of {len(items)}", exc), exc)
            return out
        stop = threading.Event()

        def one(item: T) -> R:
            if stop.is_set():
                msg = "not started: an earlier item failed"
                raise _Skipped(msg)
            try:
                return fn(item)
            except BaseException:
                stop.set()  # queued items then cost nothing (a bad key costs one call per thread)
                raise

        results: list[R] = []
        with ThreadPoolExecutor(max_workers=min(max_concurrency, len(items))) as pool:
            futures = [pool.submit(one, item) for item in items]
            try:
                for i, fut in enumerate(futures):
                    error = fut.exception()
                    if error is not None and not isinstance(error, _Skipped):
                        _raise(stage_error(stage, f"item {i + 1} of {len(items)}", error), error)
                    if error is None:
                        results.append(fut.result())
            except BaseException:
                stop.set()
                for other in futures:
                    other.cancel()
                raise
        if len(results) != len(items):  # pragma: no cover - a skip always follows a failure
            msg = f"{stage} stage: {len(items) - len(results)} item(s) were not run"
            raise BuildStageError(msg, stage=stage)
        return results


class _Skipped(Exception):
    """An item not started because an earlier one failed (the earlier failure is raised)."""


def _check_concurrency(value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        msg = f"max_concurrency must be a positive integer or None, got {value!r}"
        raise InvalidParameterError(msg)


# -- shipping components to workers ------------------------------------------------------------
def component_spec(component: object) -> dict[str, Any] | None:
    """The plain description ``component`` can be re-created from on a worker, or None.

    Only the embedders of the closed allowlist in :mod:`raptor_core.components` have one
    (a sentence-transformers model by hub name, or the packaged default; the fake embedder),
    and only when the allowlist accepts the description: a model given as a local path has
    none (it is pickled instead, as its parameters; the worker needs the same path).  The
    device is left out, so each worker uses its own best device (a GPU where it has one).
    """
    from raptor_core.build.builder import describe
    from raptor_core.components import ALLOWED_EMBEDDERS, recreate_embedder

    try:
        spec = describe(component)
    except Exception:
        return None
    if spec.get("class") not in ALLOWED_EMBEDDERS:
        return None
    try:
        recreate_embedder(spec)  # the worker will do the same: refuse now what it would refuse
    except RaptorError:
        return None
    return spec


_REBUILT: dict[str, Any] = {}
_REBUILT_LOCK = threading.Lock()


def _rebuild(spec: dict[str, Any]) -> Shipped[Any]:
    """Re-create a shipped component from its spec, once per worker process."""
    from raptor_core.components import recreate_embedder

    key = json.dumps(spec, sort_keys=True)
    with _REBUILT_LOCK:
        component = _REBUILT.get(key)
        if component is None:
            component = recreate_embedder(spec)
            _REBUILT[key] = component
    return Shipped(component)


class Shipped(Generic[C]):
    """A component that pickles as its allowlisted description when it has one.

    In this process it is just a holder (``.component``); pickled for a worker, an embedder
    with a :func:`component_spec` travels as that spec and is re-created there, once per
    worker process, so no model weights are serialised.  Any other component pickles as
    itself.
    """

    __slots__ = ("component",)

    def __init__(self, component: C) -> None:
        self.component = component

    def __repr__(self) -> str:
        return f"Shipped({self.component!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        spec = component_spec(self.component)
        if spec is not None:
            return (_rebuild, (spec,))
        return (Shipped, (self.component,))


# -- the build's work as picklable callables ----------------------------------------------------
class LeafBatch:
    """Chunk a batch of documents: one list of leaves per document (the chunk stage)."""

    def __init__(self, chunker: Chunker, tokenizer: Tokenizer) -> None:
        self.chunker = Shipped(chunker)
        self.tokenizer = Shipped(tokenizer)

    def __call__(self, docs: Sequence[Document]) -> list[list[Any]]:
        from raptor_core.build.leaves import document_leaves

        return [
            document_leaves(doc, self.chunker.component, self.tokenizer.component) for doc in docs
        ]


class EmbedBatch:
    """Embed one batch of texts (the embed stage); the embedder is built once per worker."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = Shipped(embedder)

    def __call__(self, texts: Sequence[str]) -> NDArray[np.float32]:
        raw = self.embedder.component.embed_documents(list(texts))
        try:
            return np.asarray(raw, dtype=np.float32)
        except (TypeError, ValueError):
            # Let the builder's own checks report what came back.
            return raw


class SpanBatch:
    """Embed one batch of texts and pool sentence spans (the embed stage, with the tap)."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = Shipped(embedder)

    def __call__(
        self, batch: tuple[Sequence[str], Sequence[Sequence[tuple[int, int]]]]
    ) -> tuple[NDArray[np.float32], list[NDArray[np.float32]]]:
        texts, spans = batch
        embedder = cast(SpanEmbedder, self.embedder.component)
        vectors, rows = embedder.embed_spans(list(texts), spans)
        return np.asarray(vectors, dtype=np.float32), list(rows)


class SummarizeOne:
    """Summarise one cluster's texts (the summarize stage)."""

    def __init__(self, summarizer: Summarizer, max_tokens: int) -> None:
        self.summarizer = Shipped(summarizer)
        self.max_tokens = max_tokens

    def __call__(self, texts: Sequence[str]) -> str:
        return self.summarizer.component.summarize(list(texts), max_tokens=self.max_tokens)


class ExecutorEmbedder:
    """An embedder whose ``embed_documents`` runs batches through an executor.

    The builder wraps its embedder in this (and the build cache, if any, around it, so cache
    lookups and writes stay in this process).  Batches are :data:`EMBED_BATCH` texts unless
    the executor has a ``batch_size`` of its own.
    """

    def __init__(self, embedder: Embedder, executor: Executor, *, tap_into: object = None) -> None:
        self.embedder = embedder
        self.executor = executor
        self.tap_into = tap_into
        self.cacheable = getattr(embedder, "cacheable", True)
        usage = getattr(embedder, "usage", None)
        if usage is not None:
            self.usage = usage

    def __repr__(self) -> str:
        return f"ExecutorEmbedder({self.embedder!r}, {self.executor!r})"

    def get_params(self) -> dict[str, Any]:
        """The wrapped embedder's parameters (the executor does not change the vectors)."""
        get = getattr(self.embedder, "get_params", None)
        return dict(get()) if callable(get) else {}

    def embed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Embed ``texts`` in batches through the executor; ``(len(texts), d)``."""
        size = getattr(self.executor, "batch_size", None)
        size = size if isinstance(size, int) and not isinstance(size, bool) else EMBED_BATCH
        batches = [list(texts[i : i + size]) for i in range(0, len(texts), max(size, 1))]
        if not batches:
            return np.asarray(self.embedder.embed_documents([]), dtype=np.float32)
        if self.tap_into is not None:
            return self._embed_and_tap(batches)
        parts = self.executor.map_batches(EmbedBatch(self.embedder), batches, stage="embed")
        return np.concatenate([np.asarray(p, dtype=np.float32) for p in parts])

    def _embed_and_tap(self, batches: list[list[str]]) -> NDArray[np.float32]:
        """Embed on the workers and hand the sentence vectors to the extractive summariser.

        What :meth:`ExtractiveSummarizer.sentence_vector_tap` does locally: the workers run
        ``embed_spans`` on the same batches, and the summariser here remembers each text's
        in-context sentence vectors under its own embedder, so its summaries are the same.
        """
        from raptor_core.build.summarizers import sentence_spans

        work = []
        sentences: list[list[str]] = []
        for texts in batches:
            found, spans = sentence_spans(texts)
            sentences.extend(found)
            work.append((texts, spans))
        parts = self.executor.map_batches(SpanBatch(self.embedder), work, stage="embed")
        rows = [row for _, part_rows in parts for row in part_rows]
        texts = [t for batch in batches for t in batch]
        self.tap_into._remember_in_context(self.embedder, texts, sentences, rows)  # type: ignore[attr-defined]
        return np.concatenate([np.asarray(v, dtype=np.float32) for v, _ in parts])

    def embed_query(self, text: str) -> NDArray[np.float32]:
        """Queries are embedded here: one short text is not worth a trip to a worker."""
        return self.embedder.embed_query(text)


class ExecutorSummarizer:
    """A summariser whose calls run as executor tasks.

    The builder calls ``summarize`` once per cluster from up to ``max_concurrency`` threads
    (through the budget meter and the build cache when there are some, so only cache misses
    become tasks and every answer is metered and cached here); each call is one task.
    ``summarize_batch`` sends many clusters at once, at most ``max_concurrency`` in flight.
    """

    def __init__(self, summarizer: Summarizer, executor: Executor, max_concurrency: int) -> None:
        self.summarizer = summarizer
        self.executor = executor
        self.max_concurrency = max_concurrency
        self.cacheable = getattr(summarizer, "cacheable", True)
        usage = getattr(summarizer, "usage", None)
        if usage is not None:
            self.usage = usage

    def __repr__(self) -> str:
        return f"ExecutorSummarizer({self.summarizer!r}, {self.executor!r})"

    def get_params(self) -> dict[str, Any]:
        """The wrapped summariser's parameters."""
        get = getattr(self.summarizer, "get_params", None)
        return dict(get()) if callable(get) else {}

    def summarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        """Summarise one cluster as one task."""
        return self.summarize_batch([texts], max_tokens=max_tokens)[0]

    def summarize_batch(self, clusters: Sequence[Sequence[str]], *, max_tokens: int) -> list[str]:
        """Summarise clusters as tasks, at most ``max_concurrency`` at once, in input order."""
        return self.executor.map_tasks(
            SummarizeOne(self.summarizer, max_tokens),
            [list(c) for c in clusters],
            stage="summarize",
            max_concurrency=self.max_concurrency,
        )
