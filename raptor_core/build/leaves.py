"""Leaves of a tree: a document's chunks, or a chunk that another tool already cut.

Most documents are split by the builder's chunker (the paper's 100-token chunks of whole
sentences).  A :class:`~raptor_core.types.Document` with ``chunk_of`` set is a chunk
already (a LlamaIndex node, a LangChain split): it becomes one leaf as it is.  Both kinds
may sit in one tree, so an index built from whole documents can take pre-split nodes
later, and the other way round.

Token limits for pre-split chunks
---------------------------------
The builder never cuts a pre-split chunk, so ``chunk_max_tokens`` does not apply to it.
What the other limits mean for a chunk longer than the builder's own:

* ``cluster_max_tokens`` (the summariser's input): clusters are re-split until their texts
  fit; a single chunk above the limit becomes a cluster of its own and is carried up
  unchanged, so it is never sent to the summariser (and never truncated by it).  A layer
  of such chunks gets few summaries: split your documents smaller than
  ``cluster_max_tokens`` (the LlamaIndex default ``SentenceSplitter(chunk_size=1024)``
  fits the default 3,500).
* the embedding model's input: a model embeds only its first ``max_seq_length`` tokens
  (256 word pieces for the packaged all-MiniLM-L6-v2); the rest of a long chunk does not
  shape its vector, as with any vector index.
* a retrieval budget (``max_tokens``): a chunk counts with its full length.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from typing import Any

from raptor_core.build.ids import leaf_id
from raptor_core.exceptions import InvalidInputError
from raptor_core.tokenizers import count_tokens
from raptor_core.tree import Node
from raptor_core.types import Chunker, Document, Tokenizer

__all__ = ["document_leaves", "warn_long_chunks"]

logger = logging.getLogger(__name__)


def document_leaves(doc: Document, chunker: Chunker, tokenizer: Tokenizer) -> list[Node]:
    """The layer-0 nodes of ``doc``, in document order.

    A whole document is split by ``chunker``; each chunk's id is derived from the document
    id, its span and its text (:func:`~raptor_core.build.ids.leaf_id`).  A pre-split chunk
    (``doc.chunk_of`` set) is one leaf with id ``doc.doc_id``, ``doc_id`` ``doc.chunk_of``
    and no span (its offsets in the source are the splitting tool's business, and often
    unknown); its text is kept exactly as given.

    Raises:
        InvalidInputError: the chunker produced no chunk for a document.
    """
    if doc.chunk_of is not None:
        return [
            Node(
                id=doc.doc_id,
                text=doc.text,
                layer=0,
                token_count=count_tokens(tokenizer, doc.text),
                doc_id=doc.chunk_of,
                span=None,
                doc_ids=(doc.chunk_of,),
                metadata=dict(doc.metadata),
            )
        ]
    chunks = chunker.split(doc.text)
    if not chunks:
        msg = f"document {doc.doc_id!r} produced no chunks (no text left after splitting)"
        raise InvalidInputError(msg)
    starts = [segment.start for segment in doc.segments]
    return [
        Node(
            id=leaf_id(doc.doc_id, chunk.start, chunk.end, chunk.text),
            text=chunk.text,
            layer=0,
            token_count=chunk.token_count
            if chunk.token_count
            else count_tokens(tokenizer, chunk.text),
            doc_id=doc.doc_id,
            span=(chunk.start, chunk.end),
            doc_ids=(doc.doc_id,),
            metadata=_metadata_at(doc, starts, chunk.start),
        )
        for chunk in chunks
    ]


def _metadata_at(doc: Document, starts: list[int], offset: int) -> dict[str, Any]:
    """The metadata of a leaf starting at ``offset``: the document's, and its segment's."""
    at = bisect.bisect_right(starts, offset) - 1
    if at < 0:
        return dict(doc.metadata)
    return {**doc.metadata, **doc.segments[at].metadata}


def warn_long_chunks(leaves: Sequence[Node], cluster_max_tokens: int) -> None:
    """Log once when pre-split chunks exceed the summariser's input limit (see module docs)."""
    # Only pre-split leaves can exceed it: the builder's own chunks are far below.
    long = [leaf for leaf in leaves if leaf.span is None and leaf.token_count > cluster_max_tokens]
    if long:
        logger.warning(
            "%d pre-split chunk(s) are longer than cluster_max_tokens=%d (longest: %r, %d "
            "tokens); each is carried up unsummarised.  Split the documents smaller or raise "
            "cluster_max_tokens.",
            len(long),
            cluster_max_tokens,
            long[0].id,
            max(leaf.token_count for leaf in long),
        )
