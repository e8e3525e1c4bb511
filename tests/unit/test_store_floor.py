"""A tree kept in a store keeps its cohesion floor across updates, as an in-memory tree does.

The first update of a tree measures each summary layer's drift floor and later updates keep
it (raptor_core.build.incremental).  A store rebuilds its tree from the nodes: without the
floor beside them, every update measured it again on the already-updated tree, and updates
through a store gave other trees than the same updates in memory.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("langchain_core")

from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore

from raptor_core.build.incremental import checked_floor, recorded_floor
from raptor_core.testing import EchoSummarizer, FakeEmbedder, GroupClusterer, WhitespaceTokenizer
from raptor_langchain import RaptorEmbeddings, RaptorRetriever

TEXTS = {
    "cats": "Cats purr and sleep. Kittens chase string. Cats like fish and milk.",
    "dogs": "Dogs bark at night. Puppies chew shoes. Dogs love long walks.",
    "rockets": "Rockets burn fuel. Orbit needs speed. Satellites circle the earth.",
    "bread": "Bread needs yeast. Dough rises slowly. Ovens bake the loaf.",
    "tea": "Tea leaves steep. Green tea is light. Black tea is strong.",
}
ADDED = [
    "Kittens chase string. Cats purr and sleep.",
    "Cats purr and sleep. Cats like fish and milk.",
    "Cats like fish. Dogs bark at night.",
]


def _options() -> dict[str, object]:
    return {
        "summarizer": EchoSummarizer(),
        "tokenizer": WhitespaceTokenizer(),
        "clusterer": GroupClusterer(2),
        "chunk_max_tokens": 8,
        "summary_max_tokens": 12,
        "min_layer_size": 2,
        "random_state": 0,
    }


def test_add_documents_places_a_chunk_as_on_the_in_memory_tree() -> None:
    """A chunk that repeats a cluster's loosest member: placement ties at the last bit.

    The stored vectors must be the tree's bit for bit (see test_store_vectors_exact.py), or
    the store places it in another cluster than the in-memory tree does.
    """
    docs = [Document(page_content=t, id=i) for i, t in TEXTS.items()]
    emb = FakeEmbedder()
    memory = RaptorRetriever.from_documents(docs, emb, **_options())  # type: ignore[arg-type]
    stored = RaptorRetriever.from_documents(
        docs,
        emb,
        vectorstore=InMemoryVectorStore(RaptorEmbeddings(emb)),
        **_options(),  # type: ignore[arg-type]
    )
    assert stored.store is not None and memory.tree is not None
    assert np.array_equal(stored.store.to_tree().embeddings, memory.tree.embeddings)
    new = [Document(page_content="Cats purr and sleep. Cats like fish and milk.", id="cats2")]
    memory.add_documents(new)
    stored.add_documents(new)
    assert memory.tree is not None
    assert {n.id for n in stored.store.to_tree().nodes} == {n.id for n in memory.tree.nodes}


def test_updates_through_a_store_give_the_in_memory_tree() -> None:
    docs = [Document(page_content=t, id=i) for i, t in TEXTS.items()]
    embedder = FakeEmbedder()
    memory = RaptorRetriever.from_documents(docs, embedder, **_options())
    stored = RaptorRetriever.from_documents(
        docs, embedder, vectorstore=InMemoryVectorStore(RaptorEmbeddings(embedder)), **_options()
    )
    for k, text in enumerate(ADDED):
        added = [Document(page_content=text, id=f"c{k}")]
        memory.add_documents(added)
        stored.add_documents(added)
        tree = stored.store.to_tree()
        assert {n.id for n in tree.nodes} == {n.id for n in memory.tree.nodes}, k
        assert recorded_floor(tree.build_info) == recorded_floor(memory.tree.build_info)
    assert recorded_floor(memory.tree.build_info) is not None


@pytest.mark.parametrize(
    "value",
    [None, "0.5", [0.1, float("nan")], [float("inf")], [True], [0.1] * 300, {"a": 1}],
)
def test_a_recorded_floor_that_is_not_one_is_ignored(value: object) -> None:
    assert checked_floor(value) is None


def test_a_recorded_floor() -> None:
    assert checked_floor([-1, 0.5]) == [-1.0, 0.5]
    assert checked_floor([2.0]) == [2.0]  # every changed cluster drifts: a valid setting
    assert recorded_floor({"incremental": {"cohesion_floor": [0.25]}}) == [0.25]
    assert recorded_floor({"incremental": "x"}) is None


def test_a_reopened_llamaindex_index_keeps_the_floor(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("llama_index.core")
    from llama_index.core import Document as LIDocument
    from llama_index.core import StorageContext, load_index_from_storage

    from raptor_llamaindex import RaptorIndex

    def options() -> dict[str, object]:
        return {"embed_model": FakeEmbedder(), **_options()}

    docs = [LIDocument(text=t, id_=i) for i, t in TEXTS.items()]
    kept = RaptorIndex.from_documents(docs, **options())  # updated in memory throughout
    reopened = RaptorIndex.from_documents(docs, **options())  # persisted and reopened each time
    for k, text in enumerate(ADDED):
        added = LIDocument(text=text, id_=f"c{k}")
        kept.insert(added)
        reopened.insert(added)
        reopened.storage_context.persist(persist_dir=str(tmp_path / f"p{k}"))
        storage = StorageContext.from_defaults(persist_dir=str(tmp_path / f"p{k}"))
        reopened = load_index_from_storage(storage, **options())
        assert recorded_floor(reopened.tree.build_info) == recorded_floor(kept.tree.build_info)
        assert {n.id for n in reopened.tree.nodes} == {n.id for n in kept.tree.nodes}, k
    assert recorded_floor(kept.tree.build_info) is not None
