"""A RAPTOR tree in LlamaIndex vector stores: Chroma embedded and server, the real model.

* The NodeStore conformance suite over ``ChromaVectorStore`` on the session's real
  ``chroma run`` server (cosine and l2 collections) and on an embedded ``PersistentClient``.
* "Same answers everywhere": six essays (tests/data/multi_topic.md) built once with the
  packaged all-MiniLM-L6-v2; every strategy that needs no LLM returns the same nodes with
  the same scores from the in-memory tree, ``SimpleVectorStore``, embedded Chroma and the
  Chroma server.
* ``RaptorIndex`` over Chroma: build through a ``StorageContext``, persist, reload with
  ``load_index_from_storage`` from a new client, filters.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("llama_index.vector_stores.chroma")

from llama_index.vector_stores.chroma import ChromaVectorStore

from raptor_core.testing import NodeStoreTests
from raptor_llamaindex.store import LlamaIndexNodeStore

pytestmark = pytest.mark.integration

_names = itertools.count()


def collection_name(prefix: str) -> str:
    """A new collection name per use: the server lives for the whole session."""
    return f"li-{prefix}-{next(_names)}"


def chroma_store(client: Any, name: str, space: str | None = None) -> ChromaVectorStore:
    config = {"hnsw": {"space": space}} if space else None
    collection = client.get_or_create_collection(name, configuration=config)
    return ChromaVectorStore(chroma_collection=collection)


# -- conformance -------------------------------------------------------------------------------
class TestChromaServerNodeStore(NodeStoreTests):
    space = "cosine"

    @pytest.fixture(autouse=True)
    def _server(self, chroma_server: Any) -> None:
        self._client = chroma_server.client()

    def make_store(self) -> LlamaIndexNodeStore:
        return LlamaIndexNodeStore(
            chroma_store(self._client, collection_name(self.space), self.space)
        )


class TestChromaServerNodeStoreL2(TestChromaServerNodeStore):
    """Chroma's default distance: scores are still exact cosines (read from the vectors)."""

    space = "l2"


class TestEmbeddedChromaNodeStore(NodeStoreTests):
    @pytest.fixture(autouse=True)
    def _embedded(self, tmp_path: Any) -> None:
        import chromadb

        self._client = chromadb.PersistentClient(path=str(tmp_path / "chroma"))

    def make_store(self) -> LlamaIndexNodeStore:
        return LlamaIndexNodeStore(chroma_store(self._client, collection_name("embedded")))
