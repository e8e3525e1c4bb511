"""LangChain's default retriever as an evaluation baseline for ``raptor eval``.

``InMemoryVectorStore(embedding=...).as_retriever(search_kwargs={"k": k})`` is the vector
store of LangChain's retrieval tutorials (cosine similarity over an in-memory list).  Two
variants are registered (entry-point group ``raptor.eval_baselines``):

* ``langchain-inmemory``: over the RAPTOR tree's own leaf chunks (~100 tokens), so the only
  difference from RAPTOR is the tree;
* ``langchain-inmemory-default-chunking``: over ``RecursiveCharacterTextSplitter()`` with
  its defaults (4,000 characters, 200 overlap).  That splitter lives in
  ``langchain-text-splitters``, which ``langchain-core`` does not depend on; when it is not
  installed, :func:`recursive_character_split` (a re-implementation of the same algorithm
  with the same defaults) is used instead, and the result records which one ran.

Both embed with the evaluation's embedding model, wrapped in
:class:`~raptor_langchain.models.RaptorEmbeddings`; ``k`` is set high enough to fill the
budget, and the harness cuts the ranked list at the budget.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore

from raptor_core.evaluation.baselines import candidate_k
from raptor_langchain.models import RaptorEmbeddings

if TYPE_CHECKING:
    from raptor_core.evaluation.runner import EvalCorpus

__all__ = [
    "InMemoryBaseline",
    "InMemoryDefaultChunkingBaseline",
    "recursive_character_split",
]

#: ``RecursiveCharacterTextSplitter``'s defaults (``TextSplitter.__init__``).
DEFAULT_CHUNK_SIZE = 4000
DEFAULT_CHUNK_OVERLAP = 200
DEFAULT_SEPARATORS = ("\n\n", "\n", " ", "")


def _split_keeping_separator(text: str, separator: str) -> list[str]:
    """Split on ``separator``, which starts every piece after the first (``keep_separator``)."""
    if not separator:
        return list(text)
    parts = re.split(f"({re.escape(separator)})", text)
    pieces = [parts[0]] + [parts[i] + parts[i + 1] for i in range(1, len(parts) - 1, 2)]
    return [p for p in pieces if p]


def _merge(splits: Sequence[str], chunk_size: int, chunk_overlap: int) -> list[str]:
    """Greedily join pieces up to ``chunk_size``, carrying up to ``chunk_overlap`` over."""
    chunks: list[str] = []
    current: list[str] = []
    total = 0
    for piece in splits:
        size = len(piece)
        if total + size > chunk_size and current:
            joined = "".join(current).strip()
            if joined:
                chunks.append(joined)
            # Drop pieces from the front until what is left may be repeated as overlap.
            while total > chunk_overlap or (total + size > chunk_size and total > 0):
                total -= len(current[0])
                current = current[1:]
        current.append(piece)
        total += size
    joined = "".join(current).strip()
    if joined:
        chunks.append(joined)
    return chunks


def recursive_character_split(
    text: str,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    chunk_overlap: int = DEFAULT_CHUNK_OVERLAP,
    separators: Sequence[str] = DEFAULT_SEPARATORS,
) -> list[str]:
    """Split like ``RecursiveCharacterTextSplitter(...).split_text`` with its defaults.

    Paragraphs first, then lines, then words, then characters: the first separator found in
    the text splits it, pieces that are still too long are split with the next separators,
    and neighbouring pieces are merged back up to ``chunk_size`` characters with
    ``chunk_overlap`` characters of overlap.  Separators are kept at the start of a piece
    and whitespace is stripped from each chunk, as the splitter's defaults do.

    Examples:
        >>> recursive_character_split("aa bb cc dd", chunk_size=8, chunk_overlap=3)
        ['aa bb cc', 'cc dd']
    """
    separator = separators[-1]
    rest: tuple[str, ...] = ()
    for i, candidate in enumerate(separators):
        if candidate == "":
            separator = ""
            break
        if candidate in text:
            separator, rest = candidate, tuple(separators[i + 1 :])
            break
    chunks: list[str] = []
    good: list[str] = []
    for piece in _split_keeping_separator(text, separator):
        if len(piece) < chunk_size:
            good.append(piece)
            continue
        if good:
            chunks += _merge(good, chunk_size, chunk_overlap)
            good = []
        if rest:
            chunks += recursive_character_split(
                piece, chunk_size=chunk_size, chunk_overlap=chunk_overlap, separators=rest
            )
        else:
            chunks.append(piece)
    if good:
        chunks += _merge(good, chunk_size, chunk_overlap)
    return chunks


def _default_split(text: str) -> tuple[list[str], str]:
    try:
        from langchain_text_splitters import RecursiveCharacterTextSplitter
    except ImportError:
        return recursive_character_split(
            text
        ), "raptor_langchain.baselines.recursive_character_split"
    splitter: Any = RecursiveCharacterTextSplitter()
    return list(
        splitter.split_text(text)
    ), "langchain_text_splitters.RecursiveCharacterTextSplitter"


class InMemoryBaseline:
    """``InMemoryVectorStore(...).as_retriever()`` over the RAPTOR tree's leaf chunks.

    Setup:
        ``pip install 'raptor-retriever[langchain]'``

    Key init args:
        corpus: an :class:`~raptor_core.evaluation.runner.EvalCorpus` (documents, tree,
            embedder); built by ``raptor_core.evaluation.evaluate``.

    Usage:
        .. code-block:: python

            from raptor_core.evaluation import evaluate

            evaluate(docs, questions, retrievers=["collapsed", "langchain-inmemory"])
    """

    #: ``"tree"``: the tree's leaves; ``"default"``: ``RecursiveCharacterTextSplitter()``.
    chunking = "tree"

    def __init__(self, corpus: EvalCorpus) -> None:
        self.splitter = "raptor tree leaves"
        self.documents = self._documents(corpus)
        self.store = InMemoryVectorStore(embedding=RaptorEmbeddings(corpus.embedder))
        if self.documents:
            self.store.add_documents(self.documents)

    def _documents(self, corpus: EvalCorpus) -> list[Document]:
        if self.chunking == "tree":
            return [Document(page_content=leaf.text, id=leaf.id) for leaf in corpus.tree.leaves]
        out: list[Document] = []
        for doc in corpus.documents:
            chunks, self.splitter = _default_split(doc.text)
            out += [Document(page_content=c, metadata={"doc_id": doc.doc_id}) for c in chunks]
        return out

    def retrieve(self, question: str, *, max_tokens: int) -> list[str]:
        """Document texts ranked by the default retriever, best first."""
        if not self.documents:
            return []
        k = candidate_k(max_tokens, len(self.documents))
        retriever = self.store.as_retriever(search_kwargs={"k": k})
        return [doc.page_content for doc in retriever.invoke(question)]


class InMemoryDefaultChunkingBaseline(InMemoryBaseline):
    """``InMemoryVectorStore(...).as_retriever()`` over the default splitter's chunks."""

    chunking = "default"
