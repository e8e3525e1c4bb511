"""LlamaIndexNodeStore over SimpleVectorStore: the NodeStore conformance suite and the encoding."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core.vector_stores import SimpleVectorStore

from raptor_core.testing import NodeStoreTests
from raptor_llamaindex.store import LlamaIndexNodeStore


class TestSimpleVectorStoreNodeStore(NodeStoreTests):
    def make_store(self) -> LlamaIndexNodeStore:
        return LlamaIndexNodeStore(SimpleVectorStore())
