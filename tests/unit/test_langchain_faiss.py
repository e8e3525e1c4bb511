"""LangChain's FAISS store (langchain_community) holding a RAPTOR tree, through FAISSDialect.

Real FAISS indexes and the store's own docstore; the embedding model is a fake here (the
real one runs in tests/integration/test_langchain_real.py).
"""

from __future__ import annotations

import warnings
from typing import Any

import faiss
import numpy as np
import pytest

pytest.importorskip("langchain_core")

with warnings.catch_warnings():
    # langchain-community announces its sunset on import; its FAISS store is still the one
    # LangChain's tutorials build.
    warnings.simplefilter("ignore", DeprecationWarning)
    from langchain_community.docstore.in_memory import InMemoryDocstore
    from langchain_community.vectorstores import FAISS

from langchain_core.documents import Document

from raptor_core.exceptions import InvalidInputError, InvalidParameterError
from raptor_core.retrieval.registry import make_retriever
from raptor_core.testing import FakeEmbedder, NodeStoreTests, store_tree
from raptor_core.types import NodeFilter
from raptor_langchain import LangChainNodeStore, RaptorEmbeddings, RaptorRetriever
from raptor_langchain.dialects import FAISSDialect, dialect_for

DIM = 32


def faiss_vectorstore(dim: int = DIM, index: Any = None) -> FAISS:
    """An empty FAISS store as LangChain's docs make one (L2 index, in-memory docstore)."""
    return FAISS(
        embedding_function=RaptorEmbeddings(FakeEmbedder(dim=dim)),
        index=index if index is not None else faiss.IndexFlatL2(dim),
        docstore=InMemoryDocstore(),
        index_to_docstore_id={},
    )


class TestFAISSNodeStore(NodeStoreTests):
    def make_store(self) -> LangChainNodeStore:
        store = LangChainNodeStore(faiss_vectorstore(self.dim))
        assert isinstance(store.dialect, FAISSDialect)
        return store


class TestFAISSInnerProductNodeStore(NodeStoreTests):
    """``distance_strategy=MAX_INNER_PRODUCT`` stores build an IndexFlatIP: same answers."""

    def make_store(self) -> LangChainNodeStore:
        return LangChainNodeStore(faiss_vectorstore(self.dim, faiss.IndexFlatIP(self.dim)))


def test_the_dialect_is_chosen_for_a_faiss_store() -> None:
    assert isinstance(dialect_for(faiss_vectorstore()), FAISSDialect)


def test_the_store_s_own_api_still_reads_the_tree() -> None:
    vectorstore = faiss_vectorstore()
    store = LangChainNodeStore(vectorstore)
    tree = store_tree(DIM)
    store.add_tree(tree)
    leaf = tree.leaves[3]
    # LangChain's own search, by the leaf's own vector, finds the leaf first.
    [(doc, _)] = vectorstore.similarity_search_with_score_by_vector(
        tree.embeddings[tree.row(leaf.id)].tolist(), k=1
    )
    assert doc.id == leaf.id and doc.page_content == leaf.text
    assert vectorstore.get_by_ids([leaf.id])[0].metadata["raptor_layer"] == 0


def test_updates_keep_positions_and_ids_in_step() -> None:
    # FAISS's delete compacts the index and renumbers every position after a deleted one;
    # reads after it must still pair each document with its own vector.
    store = LangChainNodeStore(faiss_vectorstore())
    tree = store_tree(DIM)
    store.add_tree(tree)
    gone = [tree.nodes[0].id, tree.nodes[5].id]
    store.delete(gone)
    kept = [n for n in tree.nodes if n.id not in gone]
    for node in kept:
        vector = tree.embeddings[tree.row(node.id)]
        [match] = store.search(vector, 1, where=NodeFilter(include_carried=True))
        # The node found has this vector in the tree (a carried copy may share it).
        assert match.score == pytest.approx(1.0, abs=1e-5)
        assert np.allclose(tree.embeddings[tree.row(match.node.id)], vector, atol=1e-6)
    # Upserting a stored node replaces it: one copy, the new vector.
    node = kept[2]
    other = tree.embeddings[tree.row(kept[3].id)]
    store.add([node], other[None, :])
    assert len(store) == len(tree) - len(gone)
    [match] = store.search(other, 1, where=NodeFilter(ids=frozenset({node.id})))
    assert match.score == pytest.approx(1.0, abs=1e-5)


def test_a_narrow_filter_still_finds_k() -> None:
    # The store's own search fetches 20 and filters those; the dialect asks for more.
    store = LangChainNodeStore(faiss_vectorstore())
    tree = store_tree(DIM)
    store.add_tree(tree)
    top = max(n.layer for n in tree.nodes)
    wanted = {n.id for n in tree.nodes if n.layer == top}
    # From every leaf, some top-layer nodes rank near the bottom of the whole tree.
    for leaf in tree.leaves:
        query = np.asarray(tree.embeddings[tree.row(leaf.id)], dtype=np.float32)
        found = store.search(query, len(wanted), where=NodeFilter(layers=frozenset({top})))
        assert {m.node.id for m in found} == wanted


def test_a_native_filter_in_faiss_s_dialect_applies() -> None:
    vectorstore = faiss_vectorstore()
    store = LangChainNodeStore(vectorstore)
    tree = store_tree(DIM)
    store.add_tree(tree)
    doc = tree.leaves[0].doc_id
    query = np.asarray(tree.embeddings[-1], dtype=np.float32)
    for native in ({"raptor_doc_id": doc}, lambda meta: meta.get("raptor_doc_id") == doc):
        found = store.search(query, 5, where=NodeFilter(native=native))
        assert found and {m.node.doc_id for m in found} == {doc}
    with pytest.raises(InvalidParameterError, match="FAISS filter"):
        store.search(query, 5, where=NodeFilter(native=42))


def test_an_index_that_cannot_give_vectors_back_is_named() -> None:
    quantizer = faiss.IndexFlatL2(DIM)
    index = faiss.IndexIVFFlat(quantizer, DIM, 2)
    index.train(np.random.default_rng(0).standard_normal((64, DIM)).astype(np.float32))
    store = LangChainNodeStore(faiss_vectorstore(index=index))
    tree = store_tree(DIM)
    store.add_tree(tree)
    with pytest.raises(InvalidParameterError, match="make_direct_map"):
        store.search(np.asarray(tree.embeddings[0]), 3)
    index.make_direct_map()
    assert store.search(np.asarray(tree.embeddings[0]), 3)


def test_the_retriever_builds_into_faiss_and_reopens_from_it() -> None:
    embeddings = RaptorEmbeddings(FakeEmbedder(dim=DIM))
    vectorstore = faiss_vectorstore()
    docs = [
        Document(page_content=f"Bees dance to show where flowers grow. Hive {i} is busy.")
        for i in range(3)
    ] + [Document(page_content="The moon pulls the tides twice a day. " * 6, id="tides")]
    built = RaptorRetriever.from_documents(docs, embeddings=embeddings, vectorstore=vectorstore)
    again = RaptorRetriever.from_vectorstore(vectorstore)
    question = "When do tides rise?"
    assert [d.id for d in again.invoke(question)] == [d.id for d in built.invoke(question)]
    # The default strategy reads every leaf (FAISS can list), so BM25 seeds run too.
    passage = make_retriever("passage", LangChainNodeStore(vectorstore), embeddings.embedder)
    assert passage.retrieve(question)[0].node.doc_id == "tides"


def test_an_index_of_another_dimension_is_a_clear_error_and_writes_nothing() -> None:
    vectorstore = faiss_vectorstore(dim=16)
    with pytest.raises(InvalidInputError, match="dimension 16"):
        LangChainNodeStore(vectorstore).add_tree(store_tree(DIM))
    assert vectorstore.index.ntotal == 0 and vectorstore.index_to_docstore_id == {}
