"""Build a RAPTOR tree: chunk, embed, cluster, summarise, repeat (RAPTOR, section 3)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import logging
import math
import os
import threading
import time
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from numpy.typing import NDArray

from raptor_core.build.ids import summary_id
from raptor_core.build.progress import BuildProgress, StageClock
from raptor_core.exceptions import (
    EmbeddingError,
    InvalidInputError,
    InvalidParameterError,
    RaptorError,
    SummarizationError,
)
from raptor_core.tree import Node, Tree

if TYPE_CHECKING:
    from raptor_core.build.budget import LLMBudget, Pricing
    from raptor_core.build.cache import BuildCache
    from raptor_core.build.executors import Executor
    from raptor_core.build.incremental import TreeUpdate
    from raptor_core.build.progress import BuildProgressCallback
from raptor_core.types import (
    AsyncEmbedder,
    AsyncSummarizer,
    BatchSummarizer,
    Chunker,
    Clusterer,
    Document,
    Embedder,
    Segment,
    Summarizer,
    Tokenizer,
)

__all__ = [
    "TYPICAL_CLUSTER_SIZE",
    "BuildEstimate",
    "LayerEstimate",
    "ProgressCallback",
    "TreeBuilder",
    "describe",
    "to_documents",
]

logger = logging.getLogger(__name__)

#: The largest seed numpy's legacy API and scikit-learn accept.
_MAX_SEED = 2**32 - 1

#: ``progress(stage, done, total)``; stages: "chunk", "embed", "cluster", "summarize".
ProgressCallback = Callable[[str, int, int], None]


def describe(component: object) -> dict[str, Any]:
    """A JSON-serialisable description of a component, recorded in the tree's params."""
    cls = type(component)
    out: dict[str, Any] = {"class": f"{cls.__module__}.{cls.__qualname__}"}
    get_params = getattr(component, "get_params", None)
    params = (
        get_params()
        if callable(get_params)
        else vars(component)
        if hasattr(component, "__dict__")
        else {}
    )
    for key, value in params.items():
        if key.startswith("_") or "key" in key.lower():  # never record credentials
            continue
        if value is None or isinstance(value, str | int | float | bool):
            out[key] = value
    return out


def to_documents(documents: Iterable[str | Document | Mapping[str, Any]]) -> list[Document]:
    """Normalise strings, :class:`Document` objects and ``{"doc_id", "text", ...}`` mappings.

    A mapping without ``doc_id`` gets ``doc-N`` (N its position), as a string does; a mapping's
    or a Document's ``metadata`` of None means no metadata.

    Raises:
        InvalidParameterError: ``documents`` is not a list of documents (a single string,
            mapping or Document, or not iterable at all).
        InvalidInputError: a document is empty, binary, not text, or a duplicate id; its id
            is not a non-empty string, or its metadata is not a JSON-serialisable mapping.
    """
    out: list[Document] = []
    seen: set[str] = set()
    for i, item in enumerate(_document_items(documents)):
        if isinstance(item, Document):
            doc = item
            _check_doc_id(i, doc.doc_id)
            if not isinstance(doc.metadata, dict):
                doc = replace(doc, metadata=_metadata(i, doc.doc_id, doc.metadata))
        elif isinstance(item, str):
            doc = Document(text=item, doc_id=f"doc-{i}")
        elif isinstance(item, Mapping):
            if "text" not in item:
                msg = f"document #{i} has no 'text' field (keys: {sorted(map(str, item))})"
                raise InvalidInputError(msg)
            doc_id = item.get("doc_id", f"doc-{i}")
            _check_doc_id(i, doc_id)
            extra = {k: v for k, v in item.items() if k not in {"text", "doc_id", "metadata"}}
            meta = {**extra, **_metadata(i, doc_id, item.get("metadata"))}
            doc = Document(text=item["text"], doc_id=doc_id, metadata=meta)
        else:
            msg = f"document #{i} must be a str, Document or mapping, got {type(item).__name__}"
            raise InvalidInputError(msg)
        _check_text(doc)
        if doc.chunk_of is not None and (
            not isinstance(doc.chunk_of, str) or not doc.chunk_of or not _is_unicode(doc.chunk_of)
        ):
            msg = f"document #{i}: chunk_of must be a non-empty str (the source document id), got {doc.chunk_of!a}"
            raise InvalidInputError(msg)
        if doc.doc_id in seen:
            msg = f"duplicate doc_id {doc.doc_id!r}: give every document a unique id"
            raise InvalidInputError(msg)
        seen.add(doc.doc_id)
        _check_json(doc.metadata, f"metadata of document {doc.doc_id!r}")
        _check_segments(doc)
        out.append(doc)
    return out


def _document_items(documents: object) -> list[object]:
    """The items of ``documents``, refusing what is one document rather than a list of them.

    A string, bytes, a mapping or a Document is iterable, so without this check
    ``build("abc")`` would index three one-letter documents and ``build({"text": ...})``
    its keys.

    Raises:
        InvalidParameterError: ``documents`` is one document, or not iterable.
    """
    if isinstance(documents, str | bytes | bytearray | Mapping | Document):
        kind = (
            "mapping"
            if isinstance(documents, Mapping)
            else "Document"
            if isinstance(documents, Document)
            else "string"
        )
        msg = (
            f"documents must be a list (of str, Document or mappings), not a single {kind}: "
            "wrap it in a list"
        )
        raise InvalidParameterError(msg)
    try:
        # iter() only asks for an iterator: a generator's body does not run yet, so a
        # TypeError raised inside it is not mistaken for this one.
        items = iter(documents)  # type: ignore[call-overload]
    except TypeError:
        msg = (
            f"documents must be a list (of str, Document or mappings), got "
            f"{type(documents).__name__}"
        )
        raise InvalidParameterError(msg) from None
    return list(items)


def _check_doc_id(position: int, doc_id: object) -> None:
    """Raise InvalidInputError unless ``doc_id`` can name a document in a tree file."""
    problem = None
    if not isinstance(doc_id, str):
        # Not coerced with str(): None would become the id "None", and 5 an id "5" that
        # delete([5]) could not find.
        problem = f"must be a non-empty str, got {type(doc_id).__name__} {doc_id!a}"
    elif not doc_id:
        problem = "is empty"
    elif not _is_unicode(doc_id):
        problem = f"{doc_id!a} is not Unicode text (a lone surrogate)"
    elif "\x00" in doc_id:
        # Node ids are digests of NUL-joined parts (build/ids.py): a NUL in an id could
        # make two documents' leaves share an id.
        problem = f"{doc_id!a} contains a NUL character"
    if problem is not None:
        msg = (
            f"document #{position}: doc_id {problem}: give each document a unique non-empty "
            "string id (or, for a mapping, leave doc_id out to get doc-N)"
        )
        raise InvalidInputError(msg)


def _metadata(position: int, doc_id: str, metadata: object) -> dict[str, Any]:
    """A document's metadata as a dict; None is no metadata (the Document default, ``{}``)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        msg = (
            f"document #{position} ({doc_id!r}): metadata must be a mapping of field names to "
            f"JSON values, got {type(metadata).__name__}: pass a dict, or None for no metadata"
        )
        raise InvalidInputError(msg)
    return dict(metadata)


def _check_segments(doc: Document) -> None:
    """Raise InvalidInputError unless ``doc.segments`` are segments of its text, in order."""
    segments = doc.segments
    if not segments:
        return
    if not isinstance(segments, tuple | list) or not all(isinstance(s, Segment) for s in segments):
        msg = f"segments of document {doc.doc_id!r} must be a tuple of Segment objects"
        raise InvalidInputError(msg)
    if doc.chunk_of is not None:
        msg = f"document {doc.doc_id!r} is one pre-split chunk (chunk_of): it has no segments"
        raise InvalidInputError(msg)
    previous = -1
    for segment in segments:
        start = segment.start
        if (
            isinstance(start, bool)
            or not isinstance(start, int)
            or not previous < start < len(doc.text)
        ):
            msg = (
                f"segments of document {doc.doc_id!r} must start at increasing offsets "
                f"inside its text (0 to {len(doc.text) - 1}), got {start!r} after {previous}"
            )
            raise InvalidInputError(msg)
        previous = start
        meta = segment.metadata
        if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
            msg = f"segment metadata of document {doc.doc_id!r} must be a dict with str keys"
            raise InvalidInputError(msg)
        _check_json(meta, f"segment metadata of document {doc.doc_id!r}")


def _check_json(metadata: object, what: str) -> None:
    """Raise InvalidInputError naming ``what`` unless ``metadata`` can go into a tree file."""
    try:
        # Encoded as the tree file will be: a lone surrogate cannot be written as UTF-8.
        json.dumps(metadata, allow_nan=False, ensure_ascii=False).encode()
    except (TypeError, ValueError) as exc:
        msg = (
            f"{what} must be JSON-serialisable ({exc}): values may be str, int, finite float, "
            "bool, None, and lists and dicts of these; convert others before indexing, e.g. "
            "a datetime or date to an ISO string with value.isoformat()"
        )
        raise InvalidInputError(msg) from exc


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_text(doc: Document) -> None:
    if not isinstance(doc.text, str):
        msg = f"document {doc.doc_id!r}: text must be str, got {type(doc.text).__name__} (decode bytes first)"
        raise InvalidInputError(msg)
    if not doc.text.strip():
        msg = f"document {doc.doc_id!r} is empty or whitespace only: remove it or give it text"
        raise InvalidInputError(msg)
    try:
        doc.text.encode("utf-8")
    except UnicodeEncodeError as exc:
        # Undecoded bytes (surrogateescape) or a JSON "\ud800" escape: not text, and a
        # tree holding it could not be saved as UTF-8.
        msg = (
            f"document {doc.doc_id!r} holds {doc.text[exc.start : exc.end]!a} at "
            f"character {exc.start}, which is not Unicode text: decode the file correctly"
        )
        raise InvalidInputError(msg) from None
    sample = doc.text[:100_000]
    # Control characters other than whitespace do not occur in text; a NUL or many of them
    # means a binary file was decoded as text.
    controls = sum(
        1 for ch in sample if unicodedata.category(ch) == "Cc" and ch not in "\t\n\r\f\v"
    )
    if "\x00" in sample or controls > max(8, len(sample) // 100):
        msg = f"document {doc.doc_id!r} looks binary ({controls} control characters): pass text, not file bytes"
        raise InvalidInputError(msg)


class TreeBuilder:
    """Builds a :class:`~raptor_core.tree.Tree` from documents.

    Parameters are stored as given and validated when :meth:`build` runs (scikit-learn style).

    Args:
        embedder: embeds chunks and summaries (default: the packaged all-MiniLM-L6-v2).
        summarizer: summarises clusters (default: :class:`ExtractiveSummarizer`, offline).
        tokenizer: counts tokens (default: tiktoken ``cl100k_base``, or a documented fallback).
        chunker: splits documents (default: :class:`SentenceChunker` with ``chunk_max_tokens``).
        clusterer: soft-clusters vectors (default: :class:`GMMClusterer` seeded with
            ``random_state``).
        chunk_max_tokens: leaf chunk size; the paper uses 100.
        section_context: embed each leaf that sits under a section heading (Markdown, HTML
            or a plain-text heading line: :mod:`raptor_core.build.sections`) twice, alone
            and with the heading before its text, and keep the normalised mean of the two
            vectors; its text is unchanged.  A chunk of a paper's "Baselines" section is then
            found by the section it belongs to as well as by what it says.  A leaf in the
            body of a Markdown or HTML table is embedded with the table's header row the
            same way (after the heading, if any).  Documents without headings or tables
            (stories, transcripts) and pre-split chunks are embedded as before.  It costs
            one more embedding per such leaf; what it gains is measured in
            ``docs/retrieval.md`` ("Section context").  An update embeds new leaves as the
            tree's own were, whatever this builder's setting.
        summary_max_tokens: summary length asked of the summariser; the paper uses 100.
        cluster_max_tokens: a cluster whose text exceeds this is re-clustered so the
            summariser's input stays bounded; the paper uses 3,500.
        max_layers: maximum number of summary layers above the leaves.
        min_layer_size: a layer with fewer nodes is not clustered further.
        max_concurrency: summaries requested at once (threads for sync summarisers,
            tasks for async ones).
        n_threads: cap on torch/BLAS/numba threads during the build (None: leave as is).
        random_state: seed for the default clusterer, an int from 0 to 2**32 - 1.
        progress: ``progress(stage, done, total)`` callback.
        on_progress: ``on_progress(event)`` callback with a
            :class:`~raptor_core.build.progress.BuildProgress`: the same steps with the time
            elapsed and left (ETA) and the tokens and USD spent so far (the CLI draws its bars
            with it).
        budget: an :class:`~raptor_core.build.budget.LLMBudget` capping the cost or tokens of
            the summary calls of each build, insert, update or delete: the call that would
            take spend past the cap is not made and
            :class:`~raptor_core.exceptions.BudgetExceededError` is raised (rerun with the
            same ``cache`` and a higher cap to resume: paid answers are cache hits).  Local
            summarisers (``cacheable = False``) cost nothing and are not metered.  None: no cap.
        cache: a :class:`~raptor_core.build.cache.BuildCache`, or a directory for one.  Summaries and
            embeddings are read from it first and written to it as they arrive, so a build
            rerun after a crash or Ctrl-C makes only the calls it had not made.  Builds in
            several processes may share one cache: each answer is paid for once (the others
            wait for it).  Components that declare ``cacheable = False`` (the local
            sentence-transformers model, the extractive summariser) are recomputed instead:
            that is free, and it keeps the tree identical with or without a cache.  None: no
            cache.
        executor: where chunking, embedding and (for summarisers without their own
            ``summarize_batch``) summarising run: a
            :class:`~raptor_core.build.executors.LocalExecutor`, a
            :class:`~raptor_core.build.ray_executor.RayExecutor` for a Ray cluster, or any
            :class:`~raptor_core.build.executors.Executor`.  None (the default): in this
            process, as ``LocalExecutor()`` does.  Every executor gives the same tree.

    Examples:
        >>> from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer
        >>> builder = TreeBuilder(FakeEmbedder(), EchoSummarizer(), tokenizer=WhitespaceTokenizer())
        >>> tree = builder.build(["Cats purr. Dogs bark.", "Rockets fly to orbit."])
        >>> tree.doc_ids
        ('doc-0', 'doc-1')
    """

    def __init__(
        self,
        embedder: Embedder | None = None,
        summarizer: Summarizer | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        chunker: Chunker | None = None,
        clusterer: Clusterer | None = None,
        chunk_max_tokens: int = 100,
        section_context: bool = True,
        summary_max_tokens: int = 100,
        cluster_max_tokens: int = 3500,
        max_layers: int = 5,
        min_layer_size: int = 3,
        max_concurrency: int = 4,
        n_threads: int | None = None,
        random_state: int | None = None,
        progress: ProgressCallback | None = None,
        cache: BuildCache | str | os.PathLike[str] | None = None,
        on_progress: BuildProgressCallback | None = None,
        budget: LLMBudget | None = None,
        executor: Executor | None = None,
    ) -> None:
        self.embedder = embedder
        self.summarizer = summarizer
        self.tokenizer = tokenizer
        self.chunker = chunker
        self.clusterer = clusterer
        self.chunk_max_tokens = chunk_max_tokens
        self.section_context = section_context
        self.summary_max_tokens = summary_max_tokens
        self.cluster_max_tokens = cluster_max_tokens
        self.max_layers = max_layers
        self.min_layer_size = min_layer_size
        self.max_concurrency = max_concurrency
        self.n_threads = n_threads
        self.random_state = random_state
        self.progress = progress
        self.cache = cache
        self.on_progress = on_progress
        self.budget = budget
        self.executor = executor

    _int_params: Mapping[str, int] = {
        "chunk_max_tokens": 8,
        "summary_max_tokens": 1,
        "cluster_max_tokens": 16,
        "max_layers": 0,
        "min_layer_size": 2,
        "max_concurrency": 1,
    }

    def get_params(self) -> dict[str, Any]:
        """The builder's parameters, JSON-serialisable (recorded in ``Tree.params``)."""
        params: dict[str, Any] = {name: getattr(self, name) for name in self._int_params}
        params["section_context"] = self.section_context
        params["n_threads"] = self.n_threads
        params["random_state"] = self.random_state
        return params

    # -- resolution ----------------------------------------------------------------------------
    def _validate(self) -> None:
        for name, minimum in self._int_params.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                msg = f"{name} must be an integer >= {minimum}, got {value!r}"
                raise InvalidParameterError(msg)
        if self.cluster_max_tokens < self.chunk_max_tokens:
            msg = (
                f"cluster_max_tokens ({self.cluster_max_tokens}) must be at least chunk_max_tokens "
                f"({self.chunk_max_tokens}), or no cluster of two chunks could be summarised"
            )
            raise InvalidParameterError(msg)
        if not isinstance(self.section_context, bool):
            msg = f"section_context must be True or False, got {self.section_context!r}"
            raise InvalidParameterError(msg)
        if self.n_threads is not None and (
            not isinstance(self.n_threads, int) or self.n_threads < 1
        ):
            msg = f"n_threads must be a positive integer or None, got {self.n_threads!r}"
            raise InvalidParameterError(msg)
        rs = self.random_state
        # A plain int: it is recorded in the tree's JSON params (a numpy integer is not
        # JSON), and numpy and scikit-learn seeds must lie in [0, 2**32 - 1].
        if rs is not None and (
            isinstance(rs, bool) or not isinstance(rs, int) or not 0 <= rs <= _MAX_SEED
        ):
            msg = f"random_state must be an int in [0, 2**32 - 1] or None, got {rs!r}"
            raise InvalidParameterError(msg)
        for name in ("progress", "on_progress"):
            callback = getattr(self, name)
            if callback is not None and not callable(callback):
                msg = f"{name} must be a callable or None, got {type(callback).__name__}"
                raise InvalidParameterError(msg)
        # Components are duck-typed (Protocols): check the method each is called through, so
        # a wrong object fails here, before any embedding or summary is paid for.
        for name, method, example in (
            ("tokenizer", "encode", "TiktokenTokenizer() or RegexTokenizer()"),
            ("chunker", "split", "SentenceChunker(tokenizer)"),
            ("clusterer", "cluster", "GMMClusterer()"),
        ):
            component = getattr(self, name)
            if component is not None and not callable(getattr(component, method, None)):
                article = "an" if method[0] in "aeiou" else "a"
                msg = (
                    f"{name} must have {article} {method}() method (a {name.capitalize()} such "
                    f"as {example}), got {type(component).__name__}"
                )
                raise InvalidParameterError(msg)
        if self.executor is not None and not all(
            callable(getattr(self.executor, name, None)) for name in ("map_batches", "map_tasks")
        ):
            msg = (
                f"executor must have map_batches and map_tasks (an Executor such as "
                f"LocalExecutor() or RayExecutor()), got {type(self.executor).__name__}"
            )
            raise InvalidParameterError(msg)

    def _components(self) -> tuple[Embedder, Summarizer, Tokenizer, Chunker, Clusterer]:
        from raptor_core.tokenizers import default_tokenizer

        embedder = self.embedder
        if embedder is None:
            from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder

            embedder = SentenceTransformerEmbedder()
        tokenizer = self.tokenizer if self.tokenizer is not None else default_tokenizer()
        summarizer = self.summarizer
        if summarizer is None:
            from raptor_core.build.summarizers import ExtractiveSummarizer

            summarizer = ExtractiveSummarizer(embedder, tokenizer=tokenizer)
        chunker = self.chunker
        if chunker is None:
            from raptor_core.build.chunking import SentenceChunker

            chunker = SentenceChunker(tokenizer, max_tokens=self.chunk_max_tokens)
        clusterer = self.clusterer
        if clusterer is None:
            from raptor_core.build.clustering import GMMClusterer

            clusterer = GMMClusterer(random_state=self.random_state)
        return embedder, summarizer, tokenizer, chunker, clusterer

    # -- public API ----------------------------------------------------------------------------
    def build(self, documents: Iterable[str | Document | Mapping[str, Any]]) -> Tree:
        """Build a tree over ``documents`` (strings, :class:`Document` or mappings).

        Raises:
            InvalidInputError: no documents, or an empty, binary or duplicate document, or
                one with a bad ``doc_id`` or ``metadata``.
            InvalidParameterError: a builder parameter is out of range or a component lacks
                its method, or ``documents`` is one document rather than a list of them.
            EmbeddingError, SummarizationError: a model failed (with layer and cluster),
                or returned an empty summary or one that is not Unicode text.
        """
        from raptor_core._threads import limit_threads

        run = _BuildRun(self, documents)
        with limit_threads(self.n_threads):
            run.make_leaves()
            run.commit_layer(run.leaf_vectors(run.embed_sync(run.leaf_texts_to_embed())))
            while run.next_clusters():
                summaries = run.summarize_sync()
                run.add_layer(summaries)
                run.commit_layer(run.assemble_vectors(run.embed_sync(run.texts_to_embed())))
        return run.finish()

    async def abuild(self, documents: Iterable[str | Document | Mapping[str, Any]]) -> Tree:
        """Async :meth:`build`: summaries and embeddings use the async seams when present.

        CPU-bound stages (chunking, clustering) run in a worker thread so the event loop stays
        responsive.
        """
        run = _BuildRun(self, documents)
        await asyncio.to_thread(run.make_leaves)
        run.commit_layer(run.leaf_vectors(await run.aembed(run.leaf_texts_to_embed())))
        while await asyncio.to_thread(run.next_clusters):
            summaries = await run.summarize_async()
            run.add_layer(summaries)
            run.commit_layer(run.assemble_vectors(await run.aembed(run.texts_to_embed())))
        return run.finish()

    # -- incremental updates (raptor_core.build.incremental) -----------------------------------
    def insert(
        self, tree: Tree, documents: Iterable[str | Document | Mapping[str, Any]]
    ) -> TreeUpdate:
        """Add documents to ``tree`` without rebuilding it; returns the new tree and a report.

        Only the new chunks are embedded, and only the clusters they join (and those
        clusters' ancestors) are re-summarised; every other node keeps its id, text and
        embedding.  Plain strings get the first free ``doc-N`` ids.  The builder must use the
        tree's embedder (and, to keep the tree consistent, its tokenizer, chunker and
        summariser).  See :mod:`raptor_core.build.incremental` for the design.

        Raises:
            InvalidParameterError: a document id is already in the tree (use :meth:`update`),
                or the embedder is not the tree's.
            InvalidInputError: an empty, binary or duplicate document (before anything is
                paid for).
        """
        from raptor_core.build.incremental import _UpdateRun, prepare_insert, run_sync

        docs = prepare_insert(tree, documents)
        return run_sync(_UpdateRun(self, tree, add=docs, remove=()), "insert")

    def delete(self, tree: Tree, doc_ids: Iterable[str]) -> TreeUpdate:
        """Remove documents from ``tree`` without rebuilding it.

        Their leaves go, and every cluster that lost members is re-summarised from what it
        has left (one left empty disappears), so no summary keeps text that only they had.

        Raises:
            InvalidParameterError: an id is not in the tree.
            InvalidInputError: the ids are every document of the tree.
        """
        from raptor_core.build.incremental import _UpdateRun, prepare_delete, run_sync

        gone = prepare_delete(tree, doc_ids)
        return run_sync(_UpdateRun(self, tree, add=(), remove=gone), "delete")

    def update(
        self, tree: Tree, documents: Iterable[str | Document | Mapping[str, Any]]
    ) -> TreeUpdate:
        """Replace documents by id (an upsert: new ids are inserted).

        A document whose chunks (ids derive from its id, spans and text) and metadata are
        those already in the tree is left alone and costs nothing: see
        ``report.docs_unchanged``.  One whose chunks are the same with other metadata is
        relabelled in place (nothing is embedded or summarised; its nodes are in
        ``report.nodes_changed``).  A changed one is deleted and re-inserted in one pass.
        """
        from raptor_core.build.incremental import _UpdateRun, prepare_update, run_sync

        docs = prepare_update(tree, documents)
        return run_sync(_UpdateRun(self, tree, add=docs, remove=()), "update")

    async def ainsert(
        self, tree: Tree, documents: Iterable[str | Document | Mapping[str, Any]]
    ) -> TreeUpdate:
        """Async :meth:`insert`."""
        from raptor_core.build.incremental import _UpdateRun, prepare_insert, run_async

        docs = prepare_insert(tree, documents)
        return await run_async(_UpdateRun(self, tree, add=docs, remove=()), "insert")

    async def adelete(self, tree: Tree, doc_ids: Iterable[str]) -> TreeUpdate:
        """Async :meth:`delete`."""
        from raptor_core.build.incremental import _UpdateRun, prepare_delete, run_async

        gone = prepare_delete(tree, doc_ids)
        return await run_async(_UpdateRun(self, tree, add=(), remove=gone), "delete")

    async def aupdate(
        self, tree: Tree, documents: Iterable[str | Document | Mapping[str, Any]]
    ) -> TreeUpdate:
        """Async :meth:`update`."""
        from raptor_core.build.incremental import _UpdateRun, prepare_update, run_async

        docs = prepare_update(tree, documents)
        return await run_async(_UpdateRun(self, tree, add=docs, remove=()), "update")

    def estimate(self, documents: Iterable[str | Document | Mapping[str, Any]]) -> BuildEstimate:
        """Estimate the model calls and tokens of :meth:`build`, without calling any model.

        The documents are chunked for real (tokenizer and chunker only); the layers above are
        projected: a layer of ``n`` nodes of ``t`` tokens forms about
        ``n / min(TYPICAL_CLUSTER_SIZE, cluster_max_tokens / t)`` clusters (RAPTOR reports
        6.7 children per summary on average), each one summary call whose prompt is the
        template plus the cluster's texts and whose completion is at most
        ``summary_max_tokens`` (an upper bound).  Layers stop as in :meth:`build`:
        ``max_layers``, ``min_layer_size``, or a single cluster.  Real counts depend on the
        clustering; soft-clustered nodes shared by two clusters are not counted twice.  The
        build cache is not consulted: the estimate is for a build from scratch.

        With prices (``budget=LLMBudget(pricing=...)`` or a summariser's ``pricing``) the
        estimate has a ``cost_usd``; with a budget, ``within_budget`` says whether the
        projection fits its caps.  A build does not refuse to start on a projection (the
        clustering decides the real cost, and a resumed build pays only for cache misses):
        the cap itself stops it before the first call that would pass it.
        """
        from raptor_core.build.budget import resolve_pricing
        from raptor_core.tokenizers import count_tokens, default_tokenizer

        self._validate()
        pricing = resolve_pricing(self.budget, self.summarizer)
        docs = to_documents(documents)
        if not docs:
            msg = "no documents to estimate a build for"
            raise InvalidInputError(msg)
        tokenizer = self.tokenizer if self.tokenizer is not None else default_tokenizer()
        chunker = self.chunker
        if chunker is None:
            from raptor_core.build.chunking import SentenceChunker

            chunker = SentenceChunker(tokenizer, max_tokens=self.chunk_max_tokens)
        from raptor_core.build.leaves import document_leaves
        from raptor_core.build.sections import leaf_context

        leaves = [leaf for doc in docs for leaf in document_leaves(doc, chunker, tokenizer)]
        tokens = [leaf.token_count for leaf in leaves]
        # Leaves under a section heading are embedded a second time, with the heading.
        in_context = [
            count_tokens(tokenizer, text)
            for text in (
                leaf_context(docs, leaves) if self.section_context is True else {}
            ).values()
        ]
        overhead = 0  # prompt tokens sent with every cluster (template, system message)
        render = getattr(self.summarizer, "render", None)
        if callable(render):
            overhead += count_tokens(tokenizer, render([""]))
        system = getattr(getattr(self.summarizer, "llm", None), "system_prompt", None)
        if isinstance(system, str):
            overhead += count_tokens(tokenizer, system)
        batch = getattr(self.embedder, "batch_size", None)
        batch = min(batch, 256) if isinstance(batch, int) and batch > 0 else 256

        n, per_node = len(tokens), (sum(tokens) / len(tokens) if tokens else 0.0)
        layers = [
            LayerEstimate(
                layer=0,
                nodes=n,
                embed_calls=math.ceil((n + len(in_context)) / batch),
                embed_tokens=sum(tokens) + sum(in_context),
            )
        ]
        for layer in range(1, self.max_layers + 1):
            if n < self.min_layer_size:
                break
            size = max(2.0, min(TYPICAL_CLUSTER_SIZE, self.cluster_max_tokens / max(per_node, 1.0)))
            clusters = math.ceil(n / size)
            if clusters <= 1 or clusters >= n:
                break
            layers.append(
                LayerEstimate(
                    layer=layer,
                    nodes=clusters,
                    calls=clusters,
                    prompt_tokens=round(clusters * overhead + n * per_node),
                    completion_tokens=clusters * self.summary_max_tokens,
                    embed_calls=math.ceil(clusters / batch),
                    embed_tokens=clusters * self.summary_max_tokens,
                )
            )
            n, per_node = clusters, float(self.summary_max_tokens)
        return BuildEstimate(
            documents=len(docs),
            chunks=len(tokens),
            layers=tuple(layers),
            pricing=pricing,
            budget=self.budget,
        )


class _BuildRun:
    """State of one build; the builder itself keeps only parameters."""

    def __init__(
        self, builder: TreeBuilder, documents: Iterable[str | Document | Mapping[str, Any]]
    ) -> None:
        builder._validate()
        self.docs = to_documents(documents)
        if not self.docs:
            msg = "no documents to build a tree from"
            raise InvalidInputError(msg)
        self._setup(builder)

    def _setup(self, builder: TreeBuilder) -> None:
        """Resolve the components and reset the run's state (shared with incremental updates)."""
        self.b = builder
        self.embedder, self.summarizer, self.tokenizer, self.chunker, self.clusterer = (
            builder._components()
        )
        self.raw_embedder, self.raw_summarizer = self.embedder, self.summarizer
        from raptor_core.build.budget import Meter, MeteredSummarizer, resolve_pricing

        pricing = resolve_pricing(builder.budget, self.raw_summarizer)  # before any work
        self.executor = getattr(builder, "executor", None)
        if self.executor is not None:
            # Innermost: the meter, the cache and the sentence-vector tap stay in this process.
            self._use_executor(self.executor)
        self.cache, self.owns_cache = _open_cache(builder.cache)
        if self.cache is None and getattr(self.summarizer, "requires_cache", False):
            # Checked before anything is paid for: without a cache a batch job submitted by a
            # run that then dies could not be found again (it would be paid for twice).
            msg = (
                f"{type(self.summarizer).__name__} needs a build cache to record its pending "
                "batch jobs: pass TreeBuilder(cache=DIRECTORY), and the same directory again to resume"
            )
            raise InvalidParameterError(msg)
        self.meter = Meter(
            builder.budget,
            pricing,
            self.raw_summarizer,
            self.tokenizer,
            has_cache=self.cache is not None,
        )
        paid = getattr(self.summarizer, "cacheable", True)
        if builder.budget is not None and paid:
            # Under the cache: a cache hit never reaches the meter, so it never counts.
            self.summarizer = MeteredSummarizer(self.summarizer, self.meter)
        if self.cache is not None:
            from raptor_core.build.cache import CachedEmbedder, CachedSummarizer, _identity_json

            # Only what costs money goes through the cache.  A local model is recomputed:
            # that is free, and its output depends (by ~1e-7) on what else shares its batch,
            # which a cache hit changes — enough to move UMAP's layout and give another tree.
            # Keyed by the raw components: a cache filled with an executor serves a build
            # without one, and the other way round.
            if getattr(self.embedder, "cacheable", True):
                self.embedder = CachedEmbedder(
                    self.embedder, self.cache, namespace=_identity_json(self.raw_embedder)
                )
            if paid:
                # Keyed by the summariser itself, so metered and unmetered runs share answers.
                self.summarizer = CachedSummarizer(
                    self.summarizer, self.cache, namespace=_identity_json(self.raw_summarizer)
                )
        tap = getattr(self.raw_summarizer, "sentence_vector_tap", None)
        if callable(tap) and self.embedder is self.raw_embedder:
            # The extractive summariser takes its sentence vectors from the forward passes
            # that embed each layer, instead of embedding every sentence again.
            self.embedder = tap(self.embedder)
        self.clock = StageClock()
        self.usage_seen: dict[str, dict[str, int]] = {}
        self.usage_delta()  # baseline: a reused component may have spent before this build
        self.nodes: list[Node] = []
        self.vectors: list[NDArray[np.float32]] = []
        self.layer_nodes: list[Node] = []  # the layer being clustered
        self.layer_vectors: NDArray[np.float32] = np.zeros((0, 0), dtype=np.float32)
        self.clusters: list[list[int]] = []
        self.timings: dict[str, float] = {
            "chunk": 0.0,
            "embed": 0.0,
            "cluster": 0.0,
            "summarize": 0.0,
        }
        self.layers_info: list[dict[str, Any]] = []
        # What each new leaf under a section heading is embedded with besides its own text
        # (leaf id -> "heading\ntext"); see TreeBuilder's section_context.
        self.section_context = bool(builder.section_context)
        self.leaf_context: dict[str, str] = {}
        self.stop_reason = ""
        self.layer = 0

    def _use_executor(self, executor: Executor) -> None:
        """Route embedding, and summaries one cluster at a time, through ``executor``.

        A summariser with its own ``summarize_batch`` (the extractive one embeds every
        sentence of a layer in one call; a batch API is one request) keeps running here.
        """
        from raptor_core.build.executors import ExecutorEmbedder, ExecutorSummarizer

        tap = getattr(self.raw_summarizer, "sentence_vector_tap", None)
        tapped = tap(self.embedder) if callable(tap) else self.embedder
        # The extractive summariser's sentence vectors come from the same forward passes,
        # on the workers, as without an executor (see ExecutorEmbedder).
        self.embedder = ExecutorEmbedder(
            self.embedder,
            executor,
            tap_into=self.raw_summarizer if tapped is not self.embedder else None,
        )
        if not callable(getattr(self.summarizer, "summarize_batch", None)):
            self.summarizer = ExecutorSummarizer(
                self.summarizer, executor, max_concurrency=self.b.max_concurrency
            )

    def _progress(self, stage: str, done: int, total: int) -> None:
        if self.b.progress is not None:
            self.b.progress(stage, done, total)
        if self.b.on_progress is not None:
            self.b.on_progress(self._event(stage, done, total))

    def _event(self, stage: str, done: int, total: int) -> BuildProgress:
        elapsed, eta = self.clock.times(stage, done, total)
        spend = self.meter.spend()
        budget = self.b.budget
        return BuildProgress(
            stage=stage,
            done=done,
            total=total,
            layer=self.layer if stage in {"chunk", "embed"} else self.layer + 1,
            elapsed_s=elapsed,
            eta_s=eta,
            summary_calls=spend.calls,
            prompt_tokens=spend.prompt_tokens,
            completion_tokens=spend.completion_tokens,
            spent_usd=spend.usd,
            max_cost_usd=budget.max_cost_usd if budget is not None else None,
            max_summary_tokens=budget.max_summary_tokens if budget is not None else None,
        )

    # -- stage: chunk --------------------------------------------------------------------------
    def make_leaves(self) -> None:
        from raptor_core.build.leaves import document_leaves, warn_long_chunks

        start = time.perf_counter()
        self.clock.begin("chunk")
        if self.executor is not None:
            from raptor_core.build.executors import CHUNK_BATCH, LeafBatch

            step = CHUNK_BATCH
            batches = [self.docs[i : i + step] for i in range(0, len(self.docs), step)]
            fn = LeafBatch(self.chunker, self.tokenizer)
            for leaves in self.executor.map_batches(fn, batches, stage="chunk"):
                for doc_leaves in leaves:
                    self.layer_nodes.extend(doc_leaves)
            self._progress("chunk", len(self.docs), len(self.docs))
        for d, doc in enumerate(self.docs if self.executor is None else ()):
            self.layer_nodes.extend(document_leaves(doc, self.chunker, self.tokenizer))
            self._progress("chunk", d + 1, len(self.docs))
        warn_long_chunks(self.layer_nodes, self.b.cluster_max_tokens)
        if self.section_context:
            from raptor_core.build.sections import leaf_context

            self.leaf_context = leaf_context(self.docs, self.layer_nodes)
        self.timings["chunk"] += time.perf_counter() - start

    def leaf_texts_to_embed(self) -> list[str]:
        """The new leaves' texts, then the in-context texts of those under a heading."""
        nodes = self.layer_nodes
        return [n.text for n in nodes] + [
            self.leaf_context[n.id] for n in nodes if n.id in self.leaf_context
        ]

    def leaf_vectors(self, vectors: NDArray[np.float32]) -> NDArray[np.float32]:
        """The leaves' vectors from :meth:`leaf_texts_to_embed`'s (unit) vectors.

        A leaf under a heading gets the normalised mean of its two vectors: alone and in
        context.  Either alone would lose something: the heading prefix makes the leaves of a
        section alike, and the plain vector misses what the section is about.
        """
        n = len(self.layer_nodes)
        rows = [i for i, node in enumerate(self.layer_nodes) if node.id in self.leaf_context]
        if not rows:
            return vectors[:n]
        out = np.array(vectors[:n], dtype=np.float32, copy=True)
        mixed = out[rows].astype(np.float64) + vectors[n:].astype(np.float64)
        out[rows] = mixed / np.linalg.norm(mixed, axis=1, keepdims=True)
        return out

    # -- stage: embed --------------------------------------------------------------------------
    def _check_vectors(self, vectors: object, texts: Sequence[str]) -> NDArray[np.float32]:
        try:
            arr = np.asarray(vectors, dtype=np.float32)
        except (TypeError, ValueError) as exc:  # ragged lists, strings, objects
            msg = f"layer {self.layer}: embedder returned something other than a (n, d) array of numbers: {exc}"
            raise EmbeddingError(msg) from exc
        if arr.ndim != 2 or arr.shape[0] != len(texts):
            msg = f"layer {self.layer}: embedder returned shape {arr.shape} for {len(texts)} texts; expected ({len(texts)}, d)"
            raise EmbeddingError(msg)
        if self.vectors and arr.shape[1] != self.vectors[0].shape[1]:
            msg = f"layer {self.layer}: embedding dimension changed from {self.vectors[0].shape[1]} to {arr.shape[1]}"
            raise EmbeddingError(msg)
        bad = ~np.all(np.isfinite(arr), axis=1)
        # float64: the norm of float32 values near 1e38 would overflow to inf (and zero the row).
        norms = np.linalg.norm(np.where(bad[:, None], 0.0, arr.astype(np.float64)), axis=1)
        bad |= norms == 0.0
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            msg = (
                f"layer {self.layer}: embedder returned NaN, infinite or all-zero vectors for "
                f"{int(bad.sum())} of {len(texts)} texts (first: {texts[first][:60]!r}); "
                "cosine similarity is undefined for them: fix or replace the embedder"
            )
            raise EmbeddingError(msg)
        return (arr / norms[:, None]).astype(np.float32)

    def embed_sync(self, texts: Sequence[str]) -> NDArray[np.float32]:
        start = time.perf_counter()
        self.clock.begin("embed")
        # With an executor the layer goes in one call: the executor cuts the same batches.
        batch = 256 if self.executor is None else max(len(texts), 1)
        parts: list[NDArray[np.float32]] = []
        for i in range(0, len(texts), batch):
            chunk = list(texts[i : i + batch])
            try:
                raw = self.embedder.embed_documents(chunk)
            except RaptorError as exc:
                _say_where(exc, f"layer {self.layer}, embedding texts {i}..{i + len(chunk)}")
                raise
            except Exception as exc:
                msg = f"layer {self.layer}: embedding texts {i}..{i + batch} failed: {exc}"
                raise EmbeddingError(msg) from exc
            part = self._check_vectors(raw, chunk)  # shape checked per call: batches must agree
            if parts and part.shape[1] != parts[0].shape[1]:
                msg = f"layer {self.layer}: embedding dimension changed from {parts[0].shape[1]} to {part.shape[1]}"
                raise EmbeddingError(msg)
            parts.append(part)
            self._progress("embed", min(i + batch, len(texts)), len(texts))
        out = np.concatenate(parts) if parts else np.zeros((0, 0), dtype=np.float32)
        self.timings["embed"] += time.perf_counter() - start
        return out

    async def aembed(self, texts: Sequence[str]) -> NDArray[np.float32]:
        if not isinstance(self.embedder, AsyncEmbedder):
            return await asyncio.to_thread(self.embed_sync, texts)
        start = time.perf_counter()
        try:
            vectors = await self.embedder.aembed_documents(list(texts))
        except RaptorError as exc:
            _say_where(exc, f"layer {self.layer}, embedding {len(texts)} texts")
            raise
        except Exception as exc:
            msg = f"layer {self.layer}: embedding {len(texts)} texts failed: {exc}"
            raise EmbeddingError(msg) from exc
        out = self._check_vectors(vectors, texts)
        self.timings["embed"] += time.perf_counter() - start
        return out

    def commit_layer(self, vectors: NDArray[np.float32]) -> None:
        """Record the current layer's nodes with their (checked, unit) vectors."""
        self.layer_vectors = vectors
        self.nodes.extend(self.layer_nodes)
        self.vectors.append(self.layer_vectors)
        info: dict[str, Any] = {
            "layer": self.layer,
            "nodes": len(self.layer_nodes),
            "tokens": int(sum(n.token_count for n in self.layer_nodes)),
        }
        if self.layer > 0:
            info["mean_children"] = round(
                float(np.mean([len(n.children) for n in self.layer_nodes])), 3
            )
        usage = self.usage_delta()
        if usage:
            info["usage"] = usage
        self.layers_info.append(info)

    def usage_delta(self) -> dict[str, dict[str, int]]:
        """What the summariser and embedder spent since the last call, for those that count.

        A component counts by having ``usage.snapshot() -> Mapping[str, int]`` (the OpenAI
        backends, and the cache wrappers, which add ``cache_hits``/``cache_misses``).
        """
        out: dict[str, dict[str, int]] = {}
        for role, component in (("summarize", self.summarizer), ("embed", self.embedder)):
            snapshot = getattr(getattr(component, "usage", None), "snapshot", None)
            if not callable(snapshot):
                continue
            now = {str(k): int(v) for k, v in dict(snapshot()).items()}
            before = self.usage_seen.get(role, {})
            self.usage_seen[role] = now
            delta = {k: v - before.get(k, 0) for k, v in now.items()}
            if any(delta.values()):
                out[role] = delta
        return out

    # -- stage: cluster ------------------------------------------------------------------------
    def next_clusters(self) -> bool:
        """Cluster the current layer; False when the tree is finished (and why is recorded)."""
        from raptor_core.build.clustering import MapFn, cluster_within_limit

        n = len(self.layer_nodes)
        if self.layer >= self.b.max_layers:
            self.stop_reason = f"max_layers={self.b.max_layers} reached"
            return False
        if n < self.b.min_layer_size:
            self.stop_reason = f"layer {self.layer} has {n} node(s), fewer than min_layer_size={self.b.min_layer_size}"
            return False
        start = time.perf_counter()
        self.clock.begin("cluster")
        tokens = [node.token_count for node in self.layer_nodes]
        map_fn = None
        if self.executor is not None:
            # Independent buckets of a large layer are clustered wherever the executor runs
            # tasks (in parallel on a Ray cluster); each job carries its own seed, so the
            # clusters are the same in any order.
            map_fn = cast(MapFn, functools.partial(self.executor.map_tasks, stage="cluster"))
        clusters = cluster_within_limit(
            self.clusterer, self.layer_vectors, tokens, self.b.cluster_max_tokens, map_fn=map_fn
        )
        self.timings["cluster"] += time.perf_counter() - start
        self._progress("cluster", self.layer + 1, self.layer + 1)
        # Two mixture components can claim exactly the same members; one summary serves both
        # (and the second would get the same id, since ids derive from children).
        clusters = [list(c) for c in dict.fromkeys(tuple(sorted(set(c))) for c in clusters if c)]
        if len(clusters) <= 1:
            # A layer that re-summarises one cluster adds a node but no structure (issue #2).
            self.stop_reason = f"layer {self.layer} forms a single cluster"
            return False
        merging = sum(1 for c in clusters if len(c) > 1)
        if merging < 2:
            # Single-member clusters are carried up unchanged, so with fewer than two real
            # groups the new layer would be (almost) a copy of this one.
            self.stop_reason = (
                f"clustering layer {self.layer} no longer groups nodes "
                f"({len(clusters)} clusters, {merging} with more than one member)"
            )
            return False
        self.clusters = clusters
        return True

    # -- stage: summarise ----------------------------------------------------------------------
    def _cluster_texts(self) -> list[list[str]]:
        return [[self.layer_nodes[i].text for i in cluster] for cluster in self.clusters]

    def _to_summarize(self) -> list[int]:
        """Clusters that need a summary: a single-member cluster is carried up unchanged.

        Summarising one node only paraphrases it (or, extractively, copies it): that costs an
        LLM call and puts a near-duplicate next to the original in every search.
        """
        return [i for i, cluster in enumerate(self.clusters) if len(cluster) > 1]

    def _with_carried(self, summaries: Sequence[object]) -> list[object]:
        out: list[object] = [self.layer_nodes[c[0]].text for c in self.clusters]
        for i, summary in zip(self._to_summarize(), summaries, strict=True):
            out[i] = summary
        return out

    def texts_to_embed(self) -> list[str]:
        """Texts of the new layer that need an embedding (after :meth:`add_layer`)."""
        return [self.layer_nodes[i].text for i in self._to_summarize()]

    def assemble_vectors(self, fresh: NDArray[np.float32]) -> NDArray[np.float32]:
        """Vectors of the new layer: fresh ones for summaries, the member's for carried nodes."""
        below = self.layer_vectors  # still the previous layer until commit_layer
        out = below[[c[0] for c in self.clusters]].copy()
        todo = self._to_summarize()
        if todo:
            out[todo] = fresh
        return out

    def _wrap(self, index: int, exc: BaseException) -> RaptorError:
        where = f"layer {self.layer + 1}, cluster {index} ({len(self.clusters[index])} nodes)"
        if isinstance(exc, RaptorError):
            _say_where(exc, where)
            return exc
        return SummarizationError(f"{where}: summariser failed: {exc!r}")

    def _checked_summary(self, index: int, summary: object) -> str:
        if not isinstance(summary, str) or not summary.strip():
            msg = (
                f"layer {self.layer + 1}, cluster {index}: the summariser returned an empty "
                f"summary ({summary!r}); every cluster needs text to embed"
            )
            raise SummarizationError(msg)
        try:
            summary.encode("utf-8")
        except UnicodeEncodeError as exc:
            # Caught here, not when the finished tree is saved: by then every summary of
            # the build has been paid for.
            msg = (
                f"layer {self.layer + 1}, cluster {index}: the summariser returned a summary "
                f"holding {summary[exc.start : exc.end]!a} at character {exc.start}, which is "
                "not Unicode text (a lone surrogate) and could not be saved: check how the "
                "summariser decodes its model's output"
            )
            raise SummarizationError(msg) from None
        return summary.strip()

    def summarize_sync(self) -> list[str]:
        start = time.perf_counter()
        self.clock.begin("summarize")
        todo = self._to_summarize()
        all_texts = self._cluster_texts()
        texts = [all_texts[i] for i in todo]
        limit = self.b.summary_max_tokens
        results: list[object]
        # Checked on the summariser itself: the cache wrapper only passes its seams through.
        if isinstance(self.raw_summarizer, BatchSummarizer):
            results = self._summarize_batch(texts, limit, todo)
        else:
            results = [None] * len(texts)
            # Set by the first failure or Ctrl-C: queued clusters then spend nothing (a bad key
            # costs one request per worker, not one per cluster).
            stop = threading.Event()

            def one(i: int) -> None:
                if stop.is_set():
                    return
                try:
                    results[i] = self.summarizer.summarize(texts[i], max_tokens=limit)
                except BaseException:
                    stop.set()
                    raise

            with ThreadPoolExecutor(max_workers=min(self.b.max_concurrency, len(texts))) as pool:
                # Each task runs in a copy of the caller's context, as asyncio.to_thread does:
                # tracing spans (LlamaIndex instrumentation, OpenTelemetry) kept in
                # contextvars then see the summariser's LLM calls inside the build's span.
                futures = [
                    pool.submit(contextvars.copy_context().run, one, i) for i in range(len(texts))
                ]
                try:
                    for done, (i, fut) in enumerate(
                        zip(range(len(texts)), futures, strict=True), 1
                    ):
                        error = fut.exception()
                        if error is not None:
                            raise self._wrap(todo[i], error) from error
                        self._progress("summarize", done, len(texts))
                except BaseException:
                    stop.set()
                    for other in futures:
                        other.cancel()
                    raise
        self.timings["summarize"] += time.perf_counter() - start
        checked = [self._checked_summary(i, s) for i, s in zip(todo, results, strict=True)]
        return [str(s) for s in self._with_carried(checked)]

    def _summarize_batch(self, texts: list[list[str]], limit: int, todo: list[int]) -> list[object]:
        """All of a layer's clusters in one ``summarize_batch`` call (see BatchSummarizer)."""
        batch = self.summarizer.summarize_batch  # type: ignore[attr-defined]
        try:
            results = list(batch(texts, max_tokens=limit))
        except Exception as exc:
            raise self._wrap(todo[0], exc) from exc
        if len(results) != len(texts):
            msg = (
                f"layer {self.layer + 1}: summarize_batch returned {len(results)} summaries "
                f"for {len(texts)} clusters"
            )
            raise SummarizationError(msg)
        self._progress("summarize", len(texts), len(texts))
        return results

    async def summarize_async(self) -> list[str]:
        start = time.perf_counter()
        self.clock.begin("summarize")
        todo = self._to_summarize()
        all_texts = self._cluster_texts()
        texts = [all_texts[i] for i in todo]
        limit = self.b.summary_max_tokens
        if isinstance(self.raw_summarizer, BatchSummarizer) and texts:
            # A batch job may wait for hours: in a worker thread, the event loop runs on.
            batched = await asyncio.to_thread(self._summarize_batch, texts, limit, todo)
            self.timings["summarize"] += time.perf_counter() - start
            checked = [self._checked_summary(i, s) for i, s in zip(todo, batched, strict=True)]
            return [str(s) for s in self._with_carried(checked)]
        semaphore = asyncio.Semaphore(self.b.max_concurrency)
        done = 0

        async def one(i: int) -> str:
            nonlocal done
            async with semaphore:
                try:
                    if isinstance(self.summarizer, AsyncSummarizer):
                        summary = await self.summarizer.asummarize(texts[i], max_tokens=limit)
                    else:
                        summary = await asyncio.to_thread(
                            self.summarizer.summarize, texts[i], max_tokens=limit
                        )
                except Exception as exc:
                    raise self._wrap(todo[i], exc) from exc
            done += 1
            self._progress("summarize", done, len(texts))
            return self._checked_summary(todo[i], summary)

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(texts))]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        self.timings["summarize"] += time.perf_counter() - start
        return [str(s) for s in self._with_carried(list(results))]

    # -- stage: next layer ---------------------------------------------------------------------
    def add_layer(self, summaries: list[str]) -> None:
        """Make the summary nodes of the next layer (their vectors come with commit_layer)."""
        from raptor_core.tokenizers import count_tokens

        children_layer = self.layer_nodes
        self.layer += 1
        new_nodes = []
        for cluster, summary in zip(self.clusters, summaries, strict=True):
            members = [children_layer[j] for j in cluster]
            carried = len(members) == 1
            new_nodes.append(
                summary_node(
                    layer=self.layer,
                    text=summary,
                    members=members,
                    token_count=members[0].token_count
                    if carried
                    else count_tokens(self.tokenizer, summary),
                )
            )
        self.layer_nodes = new_nodes

    def finish(self) -> Tree:
        embeddings = (
            np.concatenate(self.vectors) if self.vectors else np.zeros((0, 0), dtype=np.float32)
        )
        params = self.b.get_params()
        params.update(
            embedder=describe(self.raw_embedder),
            summarizer=describe(self.raw_summarizer),
            tokenizer=describe(self.tokenizer),
            chunker=describe(self.chunker),
            clusterer=describe(self.clusterer),
        )
        build_info = {
            "documents": len(self.docs),
            "chunks": len(self.vectors[0]) if self.vectors else 0,
            "layers": self.layers_info,
            "timings": {k: round(v, 4) for k, v in self.timings.items()},
            "stop_reason": self.stop_reason,
        }
        totals: dict[str, dict[str, int]] = {}
        for info in self.layers_info:
            for role, counts in info.get("usage", {}).items():
                total = totals.setdefault(role, {})
                for name, value in counts.items():
                    total[name] = total.get(name, 0) + value
        if totals:
            build_info["usage"] = totals
        if self.b.budget is not None:
            build_info["budget"] = self.budget_info()
        if self.cache is not None and self.owns_cache:
            self.cache.close()
        logger.info("built tree: %s", build_info)
        return Tree(
            nodes=tuple(self.nodes), embeddings=embeddings, params=params, build_info=build_info
        )

    def budget_info(self) -> dict[str, Any]:
        """The budget's caps and what the run spent (``build_info["budget"]``)."""
        budget = self.b.budget
        info: dict[str, Any] = {"spent": self.meter.spend().to_dict()}
        if budget is not None:
            info["max_cost_usd"] = budget.max_cost_usd
            info["max_summary_tokens"] = budget.max_summary_tokens
        return info


def summary_node(*, layer: int, text: str, members: Sequence[Node], token_count: int) -> Node:
    """The layer-``layer`` node summarising ``members`` with ``text``.

    Its provenance comes from its members: the documents they cover, the document when there
    is only one, and the metadata that all of them share (a filter a summary passes is then
    one that everything below it passes).  A single member is *carried* up unchanged, marked
    so that retrieval can skip the copy.
    """
    covered: dict[str, None] = {}
    for member in members:
        for doc_id in member.doc_ids:
            covered.setdefault(doc_id, None)
    return Node(
        id=summary_id(layer, [m.id for m in members]),
        text=text,
        layer=layer,
        token_count=token_count,
        children=tuple(m.id for m in members),
        doc_id=next(iter(covered)) if len(covered) == 1 else None,
        doc_ids=tuple(covered),
        metadata=summary_metadata(members),
    )


def summary_metadata(members: Sequence[Node]) -> dict[str, Any]:
    """The metadata of the node summarising ``members`` (see :func:`summary_node`).

    Apart from ``summary_node``, an update whose documents changed only their metadata calls
    it: a summary then keeps its id, text and vector, and only this is recomputed.
    """
    shared = {
        key: value
        for key, value in members[0].metadata.items()
        if key != "carried" and all(m.metadata.get(key, _MISSING) == value for m in members[1:])
    }
    if len(members) == 1:
        shared["carried"] = True
    return shared


_MISSING = object()


def _say_where(exc: RaptorError, where: str) -> None:
    """Prefix the place to a typed error's message, keeping its type (an auth error stays one)."""
    exc.args = (f"{where}: {exc}", *exc.args[1:]) if exc.args else (where,)


def _open_cache(cache: object) -> tuple[BuildCache | None, bool]:
    """The build cache to use, and whether this build opened it (and so closes it)."""
    if cache is None:
        return None, False
    from raptor_core.build.cache import BuildCache

    if isinstance(cache, BuildCache):
        return cache, False
    if isinstance(cache, str | os.PathLike):
        return BuildCache(cache), True
    msg = f"cache must be a BuildCache, a directory or None, got {type(cache).__name__}"
    raise InvalidParameterError(msg)


#: Children per summary assumed by :meth:`TreeBuilder.estimate` (RAPTOR's reported average).
TYPICAL_CLUSTER_SIZE = 6.7


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerEstimate:
    """Projected size and cost of one layer (layer 0: the chunks, which cost no LLM call)."""

    layer: int
    nodes: int
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    embed_calls: int = 0
    embed_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class BuildEstimate:
    """What :meth:`TreeBuilder.estimate` projects a build to cost, layer by layer."""

    documents: int
    chunks: int
    layers: tuple[LayerEstimate, ...]
    pricing: Pricing | None = None
    budget: LLMBudget | None = None

    @property
    def calls(self) -> int:
        """Summary (LLM) calls."""
        return sum(x.calls for x in self.layers)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the summary calls."""
        return sum(x.prompt_tokens for x in self.layers)

    @property
    def completion_tokens(self) -> int:
        """Completion tokens of the summary calls (an upper bound)."""
        return sum(x.completion_tokens for x in self.layers)

    @property
    def embed_tokens(self) -> int:
        """Tokens sent to the embedder (chunks and summaries)."""
        return sum(x.embed_tokens for x in self.layers)

    @property
    def cost_usd(self) -> float | None:
        """Projected cost of the summary calls in USD (None without prices)."""
        if self.pricing is None:
            return None
        return self.pricing.cost(self.prompt_tokens, self.completion_tokens)

    @property
    def within_budget(self) -> bool | None:
        """Whether the projection fits the budget's caps (None without a budget)."""
        budget = self.budget
        if budget is None:
            return None
        tokens = self.prompt_tokens + self.completion_tokens
        if budget.max_summary_tokens is not None and tokens > budget.max_summary_tokens:
            return False
        cost = self.cost_usd
        return not (
            budget.max_cost_usd is not None and cost is not None and cost > budget.max_cost_usd
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form, totals included."""
        return {
            "documents": self.documents,
            "chunks": self.chunks,
            "calls": self.calls,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "embed_tokens": self.embed_tokens,
            "cost_usd": None if self.cost_usd is None else round(self.cost_usd, 6),
            "within_budget": self.within_budget,
            "layers": [
                {
                    "layer": x.layer,
                    "nodes": x.nodes,
                    "calls": x.calls,
                    "prompt_tokens": x.prompt_tokens,
                    "completion_tokens": x.completion_tokens,
                    "embed_calls": x.embed_calls,
                    "embed_tokens": x.embed_tokens,
                }
                for x in self.layers
            ],
        }
