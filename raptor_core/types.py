"""The seams of raptor_core: small Protocols that any object can satisfy by duck typing.

Nothing here needs to be inherited from.  A LangChain ``Embeddings`` already has
``embed_documents``/``embed_query``; wrap it only to get numpy arrays back.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "DEFAULT_SUMMARY_PROMPT",
    "LLM",
    "AsyncEmbedder",
    "AsyncLLM",
    "AsyncSummarizer",
    "Chunk",
    "Chunker",
    "Clusterer",
    "Document",
    "Embedder",
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
    """A text to index, with a stable id and user metadata (JSON-serialisable)."""

    text: str
    doc_id: str
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
