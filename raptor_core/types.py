"""The seams of raptor_core: small Protocols that any object can satisfy by duck typing.

Nothing here needs to be inherited from.  A LangChain ``Embeddings`` already has
``embed_documents``/``embed_query``; wrap it only to get numpy arrays back.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    from raptor_core.tree import Node

__all__ = [
    "DEFAULT_SUMMARY_PROMPT",
    "LLM",
    "AsyncEmbedder",
    "AsyncLLM",
    "AsyncSummarizer",
    "BatchSummarizer",
    "Chunk",
    "Chunker",
    "Clusterer",
    "Document",
    "Embedder",
    "Match",
    "NodeFilter",
    "NodeStore",
    "Segment",
    "SpanEmbedder",
    "Summarizer",
    "Tokenizer",
    "VectorIndex",
]

#: The paper's summarisation prompt (RAPTOR, Sarthi et al. 2024, appendix).
DEFAULT_SUMMARY_PROMPT = (
    "Write a summary of the following, including as many key details as possible: {context}:"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Document:
    """A text to index, with a stable id and user metadata (JSON-serialisable).

    ``chunk_of`` marks a text that is already one chunk, split by another tool (a
    LlamaIndex node parser, a LangChain text splitter): the builder then makes it exactly
    one leaf, never splits it, and names the leaf ``doc_id`` (so the chunk keeps the id
    its tool gave it); ``chunk_of`` is the id of the document it was cut from, recorded as
    the leaf's ``doc_id``.  Such a leaf may be longer than ``chunk_max_tokens``: see
    :func:`raptor_core.build.leaves.document_leaves` for what the limits then mean.

    ``segments`` give parts of the text metadata of their own (the pages of a PDF put back
    together: each page keeps its page number): a leaf's metadata is ``metadata`` updated
    with that of the segment its text starts in.  Leaves before the first segment have
    ``metadata`` alone.
    """

    text: str
    doc_id: str
    metadata: dict[str, Any] = field(default_factory=dict)
    chunk_of: str | None = None
    segments: tuple[Segment, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """Metadata for a document's text from offset ``start`` on, up to the next segment.

    Leaves that start in it get ``{**document.metadata, **segment.metadata}``.
    """

    start: int
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
    """A piece of a document: ``text == document.text[start:end]`` (modulo stripped whitespace)."""

    text: str
    start: int
    end: int
    token_count: int


@runtime_checkable
class Tokenizer(Protocol):
    """Counts tokens; ``encode`` then ``decode`` round-trips text."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into vectors. Documents and queries may be embedded differently."""

    def embed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Return an array of shape ``(len(texts), d)``."""
        ...

    def embed_query(self, text: str) -> NDArray[np.float32]:
        """Return an array of shape ``(d,)``."""
        ...


@runtime_checkable
class SpanEmbedder(Protocol):
    """Optional: an embedder that also returns vectors of character spans inside each text.

    A span's vector pools the model's *contextual* token vectors over that span, from the same
    forward pass as the text's own vector, so span vectors cost nothing extra.  The default
    extractive summariser uses them as sentence vectors (see
    :class:`~raptor_core.build.summarizers.ExtractiveSummarizer`).
    """

    def embed_spans(
        self, texts: Sequence[str], spans: Sequence[Sequence[tuple[int, int]]]
    ) -> tuple[NDArray[np.float32], list[NDArray[np.float32]]]:
        """Return ``embed_documents(texts)`` and, per text, a ``(len(spans[i]), d)`` array."""
        ...


@runtime_checkable
class AsyncEmbedder(Protocol):
    """Optional async twin of :class:`Embedder`; without it, a thread pool is used."""

    async def aembed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]: ...

    async def aembed_query(self, text: str) -> NDArray[np.float32]: ...


@runtime_checkable
class Summarizer(Protocol):
    """Writes one summary of a cluster of texts, in at most ``max_tokens`` tokens."""

    def summarize(self, texts: Sequence[str], *, max_tokens: int) -> str: ...


@runtime_checkable
class AsyncSummarizer(Protocol):
    """Optional async twin of :class:`Summarizer`."""

    async def asummarize(self, texts: Sequence[str], *, max_tokens: int) -> str: ...


@runtime_checkable
class BatchSummarizer(Protocol):
    """Optional seam: summarise many clusters in one go (one entry per cluster, in order).

    When the summariser has it, the builder hands it every cluster of a layer at once
    (after the build cache has answered what it could), instead of one call per cluster: an
    extractive summariser embeds all sentences in one call, a batch API submits one job.
    """

    def summarize_batch(
        self, clusters: Sequence[Sequence[str]], *, max_tokens: int
    ) -> list[str]: ...


@runtime_checkable
class LLM(Protocol):
    """A text-in, text-out model: the seam shared by LLM summarisers and LLM-guided search."""

    def complete(self, prompt: str, *, max_tokens: int | None = None) -> str: ...


@runtime_checkable
class AsyncLLM(Protocol):
    """Optional async twin of :class:`LLM`."""

    async def acomplete(self, prompt: str, *, max_tokens: int | None = None) -> str: ...


@runtime_checkable
class Chunker(Protocol):
    """Splits one text into chunks that respect a token limit."""

    def split(self, text: str) -> list[Chunk]: ...


@runtime_checkable
class Clusterer(Protocol):
    """Groups vectors; soft clusters may overlap.  Returns lists of row indices."""

    def cluster(self, vectors: NDArray[np.float32]) -> list[list[int]]: ...


@runtime_checkable
class VectorIndex(Protocol):
    """Nearest-neighbour search by inner product over unit vectors (= cosine similarity)."""

    def add(self, ids: Sequence[str], vectors: NDArray[np.float32]) -> None: ...

    def search(
        self,
        query: NDArray[np.float32],
        k: int,
        *,
        restrict_to: Collection[str] | None = None,
    ) -> list[tuple[str, float]]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeFilter:
    """Which nodes a :meth:`NodeStore.search` may return; every given field must hold.

    Structural fields describe the tree; ``where`` and ``native`` carry the user's own
    metadata filter.  ``None`` means "no restriction".

    Attributes:
        layers: only nodes of these layers.
        ids: only these nodes.
        parents: only children of at least one of these nodes (how traversal descends).
        doc_ids: only nodes whose ``doc_id`` is one of these (summaries over several
            documents have none, so they never pass).
        include_carried: also return carried copies (a single-member cluster copied one
            layer up); strategies leave them out because the original is already there.
        where: a metadata filter in the core's dialect (see :mod:`raptor_core.store.filters`):
            ``{"key": value}``, ``{"key": {"$in": [...]}}``, ``$ne``, ``$gt``, ``$gte``,
            ``$lt``, ``$lte``, ``$nin``, ``$contains``, ``$any``, ``$all`` (list values),
            ``$and``, ``$or``.  Keys are node metadata, plus ``doc_id``.
        native: a filter in the store's own dialect (a LlamaIndex ``MetadataFilters``, a
            Chroma ``where`` dict, a callable for the in-memory store), ANDed with the rest.
    """

    layers: frozenset[int] | None = None
    ids: frozenset[str] | None = None
    parents: frozenset[str] | None = None
    doc_ids: frozenset[str] | None = None
    include_carried: bool = False
    where: Mapping[str, Any] | None = None
    native: Any = None


@dataclass(frozen=True, slots=True)
class Match:
    """A node found by :meth:`NodeStore.search` and its cosine similarity to the query."""

    node: Node
    score: float


@runtime_checkable
class NodeStore(Protocol):
    """Where a tree's nodes live: add, search, get, delete, iterate.

    Every retrieval strategy reads the tree through this seam, so one strategy runs on the
    in-memory arrays of a :class:`~raptor_core.tree.Tree`, on the plain-file directory
    format, or on a user's vector database through the LlamaIndex and LangChain adapters.
    Vectors are unit-normalised; scores are cosine similarities in ``[-1, 1]``.

    Methods:
        add: insert nodes with their ``(n, d)`` vectors; a node whose id is already stored
            replaces it (upsert).
        get: the stored nodes with these ids, in the order asked; unknown ids are left out.
        delete: remove these ids (unknown ids are ignored).
        search: the ``k`` nodes most similar to a unit query vector among those passing
            ``where``, best first; ties are broken deterministically.
        __iter__: every stored node (in insertion order where the store keeps one).
        __len__: the number of stored nodes.

    Optional, duck-typed: ``vectors(ids) -> (len(ids), d) array`` (for MMR and exporting a
    tree), ``dim`` and ``top_layer`` attributes (saves a probe), and ``revision``, a value
    that changes with every write through the store (what a strategy reads from a store
    once, such as the passage strategy's leaves, is kept while both it and the count stay
    the same; without it, only the count is compared).
    """

    def add(self, nodes: Sequence[Node], vectors: NDArray[np.float32]) -> None: ...

    def get(self, ids: Sequence[str]) -> list[Node]: ...

    def delete(self, ids: Sequence[str]) -> None: ...

    def search(
        self, vector: NDArray[np.float32], k: int, *, where: NodeFilter | None = None
    ) -> list[Match]: ...

    def __iter__(self) -> Iterator[Node]: ...

    def __len__(self) -> int: ...
