"""raptor_langchain: RAPTOR trees as a LangChain retriever.

``RaptorRetriever`` is a ``BaseRetriever``: use it wherever ``vectorstore.as_retriever()``
goes (chains, agents, ``create_retriever_tool``).  The tree lives in memory or in your own
LangChain vector store (``LangChainNodeStore``, with a dialect per store).  The wrappers
turn LangChain models into raptor_core seams and back.  Needs ``pip install 'raptor-retriever[langchain]'``.
"""

from __future__ import annotations

import logging

from raptor_core._imports import require

# Fail with the install command before any langchain_core import below does without it.
require("langchain_core", extra="langchain")

from raptor_langchain.dialects import (  # noqa: E402
    ChromaDialect,
    GenericDialect,
    InMemoryDialect,
    MilvusDialect,
    QdrantDialect,
    StoreDialect,
)
from raptor_langchain.models import (  # noqa: E402
    LangChainEmbedder,
    LangChainLLM,
    RaptorEmbeddings,
    TracedLLM,
)
from raptor_langchain.retriever import SEARCH_TYPES, RaptorRetriever, hit_to_document  # noqa: E402
from raptor_langchain.store import LangChainNodeStore  # noqa: E402

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "SEARCH_TYPES",
    "ChromaDialect",
    "GenericDialect",
    "InMemoryDialect",
    "LangChainEmbedder",
    "LangChainLLM",
    "LangChainNodeStore",
    "MilvusDialect",
    "QdrantDialect",
    "RaptorEmbeddings",
    "RaptorRetriever",
    "StoreDialect",
    "TracedLLM",
    "hit_to_document",
]
