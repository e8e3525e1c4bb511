"""Reopening a RaptorIndex over Chroma asks the collection no filtered question.

Chroma answers any metadata ``where`` by scanning the whole collection (seconds at a
million nodes: benchmarks/results/stores.md), so the index struct records the tree's
layer sizes and the store takes its top layer from them.  A real embedded Chroma
collection's ``get``/``query`` calls are recorded.  Damaged sizes in the struct raise
TreeFormatError; sizes that no longer add up to the collection's count (the index store
saved apart from later writes) make the store probe the collection, as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from chroma_server import Recorder

pytest.importorskip("llama_index.vector_stores.chroma")

import chromadb
from llama_index.core import Document, StorageContext, load_index_from_storage
from llama_index.vector_stores.chroma import ChromaVectorStore

from raptor_core.exceptions import TreeFormatError
from raptor_core.store.codec import tree_layer_sizes
from raptor_core.testing import FakeEmbedder
from raptor_llamaindex import RaptorIndex
from raptor_llamaindex.index import RaptorIndexStruct
from raptor_llamaindex.store import LlamaIndexNodeStore

pytestmark = pytest.mark.integration

TOPICS = ["bees dance", "volcanoes erupt", "rivers carve", "stars burn", "tides turn", "ants march"]


def _docs(topics: list[str]) -> list[Document]:
    return [
        Document(text=f"The {t} in their own way, day after day, for reasons. " * 12, id_=t)
        for t in topics
    ]


def _vector_store(path: Path) -> ChromaVectorStore:
    # A new client each time: a reopened index shares no cache with the writer.
    client = chromadb.PersistentClient(path=str(path / "chroma"))
    return ChromaVectorStore(chroma_collection=client.get_or_create_collection("tree"))


@pytest.fixture
def persisted(tmp_path: Path) -> Path:
    index = RaptorIndex.from_documents(
        _docs(TOPICS),
        storage_context=StorageContext.from_defaults(vector_store=_vector_store(tmp_path)),
        embed_model=FakeEmbedder(),
        random_state=0,
        chunk_max_tokens=40,
    )
    assert index.tree.top_layer >= 1
    index.storage_context.persist(persist_dir=tmp_path / "index")
    return tmp_path


def _load(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[RaptorIndex, Recorder]:
    vector_store = _vector_store(path)
    recorder = Recorder(vector_store.client, monkeypatch)
    loaded = load_index_from_storage(
        StorageContext.from_defaults(persist_dir=path / "index", vector_store=vector_store),
        embed_model=FakeEmbedder(),
    )
    assert isinstance(loaded, RaptorIndex)
    return loaded, recorder


def test_reopening_and_a_collapsed_query_run_no_filtered_scan(
    persisted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded, recorder = _load(persisted, monkeypatch)
    # Opening read no record: dim and size come from the collection and the struct, so
    # Chroma has not loaded the collection's segments yet (the first search does).
    assert recorder.calls == []
    store = loaded.store
    assert store.layer_sizes is not None and sum(store.layer_sizes) == len(store)
    assert store.top_layer == len(store.layer_sizes) - 1 >= 1
    assert loaded.as_retriever(strategy="collapsed").retrieve("Why do bees dance?")
    assert recorder.calls
    assert recorder.filtered == []


def test_the_recorded_sizes_follow_updates(
    persisted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded, _ = _load(persisted, monkeypatch)
    loaded.insert(_docs(["whales sing"])[0])
    loaded.delete_ref_doc("ants march")
    sizes = tree_layer_sizes(loaded.tree)
    assert loaded.store.layer_sizes == sizes
    assert loaded.index_struct.layer_sizes == sizes
    loaded.storage_context.persist(persist_dir=persisted / "index")
    again, recorder = _load(persisted, monkeypatch)
    assert again.store.top_layer == len(sizes) - 1
    assert recorder.filtered == []


@pytest.mark.parametrize("sizes", ["3,1", [2, -1], [True], [0] * 1001])
def test_damaged_sizes_in_the_index_struct_are_refused(tmp_path: Path, sizes: Any) -> None:
    struct = RaptorIndexStruct(layer_sizes=sizes)
    with pytest.raises(TreeFormatError, match="layer_sizes"):
        RaptorIndex(
            index_struct=struct,
            storage_context=StorageContext.from_defaults(vector_store=_vector_store(tmp_path)),
            embed_model=FakeEmbedder(),
        )


def test_stale_sizes_make_the_store_probe(persisted: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded, _ = _load(persisted, monkeypatch)
    top = loaded.store.top_layer
    vector_store = _vector_store(persisted)
    recorder = Recorder(vector_store.client, monkeypatch)
    stale = LlamaIndexNodeStore(vector_store, layer_sizes=[0] * 9 + [1])
    assert stale.top_layer == top
    assert recorder.filtered  # probed layer by layer


def test_leaf_searches_send_no_filter_when_leaves_are_most_of_the_tree(
    persisted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The default strategy (passage) searches layer 0. Sent to Chroma, that filter is a scan
    # of the whole collection on every query (2.8 s at 1M nodes); the leaves hold most of
    # the nodes, so the store asks without it for a few times more results and keeps the
    # leaves itself.
    from raptor_core import CollapsedTreeRetriever, PassageRetriever

    loaded, recorder = _load(persisted, monkeypatch)
    sizes = loaded.store.layer_sizes
    assert sizes is not None and sizes[0] >= sum(sizes) / 2
    queries = ["Why do bees dance?", "What do rivers carve?", "stars"]
    on_chroma = [
        [
            [(h.id, h.node.text) for h in make(loaded.store).retrieve(q)]
            for make in (
                lambda t: PassageRetriever(t, FakeEmbedder(), max_tokens=80),
                lambda t: CollapsedTreeRetriever(t, FakeEmbedder(), k=3, layers=[0]),
            )
        ]
        for q in queries
    ]
    assert all(on_chroma)
    assert recorder.filtered == []
    tree = loaded.tree
    on_tree = [
        [
            [(h.id, h.node.text) for h in make(tree).retrieve(q)]
            for make in (
                lambda t: PassageRetriever(t, FakeEmbedder(), max_tokens=80),
                lambda t: CollapsedTreeRetriever(t, FakeEmbedder(), k=3, layers=[0]),
            )
        ]
        for q in queries
    ]
    assert on_chroma == on_tree


def test_a_small_layer_is_listed_once_then_searched_by_ids(
    persisted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A traversal starts at the top layer: a few nodes.  A filter on it would cost a scan
    # of the collection on every query; its ids are listed once (one filtered read, cached
    # until the next write) and scored exactly after that.
    loaded, recorder = _load(persisted, monkeypatch)
    traversal = loaded.as_retriever(strategy="traversal")
    first = [n.node.node_id for n in traversal.retrieve("Why do bees dance?")]
    listed = list(recorder.filtered)
    assert listed and all(call[0] == "get" for call in listed)
    again = [n.node.node_id for n in traversal.retrieve("Why do bees dance?")]
    traversal.retrieve("What do rivers carve?")
    assert again == first and recorder.filtered == listed
    tree = loaded.tree
    from raptor_core import TreeTraversalRetriever

    on_tree = TreeTraversalRetriever(tree, FakeEmbedder()).retrieve("Why do bees dance?")
    on_store = TreeTraversalRetriever(loaded.store, FakeEmbedder()).retrieve("Why do bees dance?")
    assert [h.id for h in on_store] == [h.id for h in on_tree]
    # A write forgets the listing: the next search lists the layer again.
    loaded.insert(_docs(["whales sing"])[0])
    loaded.as_retriever(strategy="traversal").retrieve("Why do whales sing?")
    assert len(recorder.filtered) > len(listed)
