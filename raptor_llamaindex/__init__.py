"""raptor_llamaindex: RAPTOR trees as a LlamaIndex retriever and index.

``RaptorIndex.from_documents(docs).as_retriever()`` is a drop-in replacement for
``VectorStoreIndex.from_documents(docs).as_retriever()``, and like it keeps its nodes in the
``StorageContext``'s vector store (``LlamaIndexNodeStore``); the model wrappers let any
LlamaIndex embedding model or LLM drive raptor_core.  Requires the ``llamaindex`` extra.
"""

from __future__ import annotations

import logging

from raptor_core._imports import require

# Fail on import with the install command, not later with a bare ModuleNotFoundError.
require("llama_index.core", extra="llamaindex")

from raptor_llamaindex.index import RaptorIndex  # noqa: E402
from raptor_llamaindex.models import (  # noqa: E402
    LlamaIndexEmbedder,
    LlamaIndexLLM,
    LlamaIndexSummarizer,
    RaptorEmbedding,
)
from raptor_llamaindex.retriever import RAPTOR_METADATA_KEYS, RaptorRetriever  # noqa: E402
from raptor_llamaindex.store import LlamaIndexNodeStore  # noqa: E402

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "RAPTOR_METADATA_KEYS",
    "LlamaIndexEmbedder",
    "LlamaIndexLLM",
    "LlamaIndexNodeStore",
    "LlamaIndexSummarizer",
    "RaptorEmbedding",
    "RaptorIndex",
    "RaptorRetriever",
]
