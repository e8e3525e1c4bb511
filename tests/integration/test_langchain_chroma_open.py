"""Opening a RAPTOR tree in Chroma asks the collection no filtered question.

Chroma answers any metadata ``where`` by scanning the whole collection (seconds at a
million nodes: benchmarks/results/stores.md), so the top layer comes from the layer sizes
the manifest keeps.  These tests record every ``get``/``query`` a real embedded Chroma
collection receives, and check that the sizes stay right through adds and deletes of the
top layer, and what a damaged or stale record does (damage: TreeFormatError; stale:
the store is probed, as before the sizes were recorded).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from chroma_server import Recorder

pytest.importorskip("langchain_chroma")

import chromadb
from langchain_chroma import Chroma

from raptor_core.exceptions import TreeFormatError
from raptor_core.testing import FakeEmbedder, store_tree
from raptor_core.tree import Node, Tree
from raptor_langchain import LangChainNodeStore, RaptorEmbeddings, RaptorRetriever
from raptor_langchain.store import MANIFEST_ID

pytestmark = pytest.mark.integration

DIM = 32


@pytest.fixture
def chroma_path(tmp_path: Path) -> Iterator[Path]:
    tree = store_tree(DIM)
    LangChainNodeStore(_vectorstore(tmp_path)).add_tree(tree)
    yield tmp_path


def _vectorstore(path: Path) -> Chroma:
    # A new client each time: a reopened store shares no cache with the writer.
    return Chroma(
        client=chromadb.PersistentClient(path=str(path)),
        collection_name="tree",
        embedding_function=RaptorEmbeddings(FakeEmbedder(dim=DIM)),
    )


def _reopened(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[LangChainNodeStore, Recorder]:
    vectorstore = _vectorstore(path)
    recorder = Recorder(vectorstore._collection, monkeypatch)
    return LangChainNodeStore(vectorstore), recorder


def _sizes(tree: Tree) -> list[int]:
    return [len(tree.layer(layer)) for layer in range(tree.top_layer + 1)]


def test_opening_and_a_collapsed_query_run_no_filtered_scan(
    chroma_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = store_tree(DIM)
    vectorstore = _vectorstore(chroma_path)
    recorder = Recorder(vectorstore._collection, monkeypatch)
    retriever = RaptorRetriever.from_vectorstore(
        vectorstore, embeddings=RaptorEmbeddings(FakeEmbedder(dim=DIM)), k=3, strategy="collapsed"
    )
    store = retriever.store
    assert isinstance(store, LangChainNodeStore)
    assert store.dim == DIM
    # Opening read the manifest's copy in the collection's metadata: no record was read,
    # so Chroma has not loaded the collection's segments yet (the first search does).
    assert recorder.calls == []
    assert (store.top_layer, len(store)) == (tree.top_layer, len(tree))
    assert store.manifest is not None and store.manifest["layer_sizes"] == _sizes(tree)
    assert retriever.invoke(tree.leaves[0].text)
    assert recorder.calls  # the wrapper sees the store's calls
    assert recorder.filtered == []


def test_the_recorded_sizes_follow_a_new_top_layer_and_its_deletion(
    chroma_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = store_tree(DIM)
    top = tree.top_layer
    roots = [n.id for n in tree.layer(top)]
    crown = Node(
        id="crown", text="Everything.", layer=top + 1, token_count=2, children=tuple(roots)
    )
    writer = LangChainNodeStore(_vectorstore(chroma_path))
    writer.add([crown], np.eye(DIM, dtype=np.float32)[:1])

    store, recorder = _reopened(chroma_path, monkeypatch)
    assert store.top_layer == top + 1
    assert recorder.filtered == []
    assert store.manifest is not None
    assert store.manifest["layer_sizes"] == [*_sizes(tree), 1]

    writer.delete(["crown"])
    store, recorder = _reopened(chroma_path, monkeypatch)
    assert (store.top_layer, len(store)) == (top, len(tree))
    assert recorder.filtered == []

    # Deleting the whole top layer: the layer below becomes the top.
    writer.delete(roots)
    store, recorder = _reopened(chroma_path, monkeypatch)
    assert store.top_layer == top - 1
    assert store.manifest is not None and store.manifest["layer_sizes"] == _sizes(tree)[:top]
    assert recorder.filtered == []


def _edit_sizes(path: Path, sizes: Any) -> None:
    store = LangChainNodeStore(_vectorstore(path))
    manifest = dict(store.manifest or {})
    manifest["layer_sizes"] = sizes
    store._write_manifest(manifest)


@pytest.mark.parametrize(
    "sizes",
    [
        "7,3,1",
        [5, -1],
        [3, True],
        [1.5],
        [0] * 1001,
    ],
    ids=["string", "negative", "bool", "float", "too-many-layers"],
)
def test_damaged_sizes_are_refused(
    chroma_path: Path, monkeypatch: pytest.MonkeyPatch, sizes: Any
) -> None:
    _edit_sizes(chroma_path, sizes)
    store, _ = _reopened(chroma_path, monkeypatch)
    with pytest.raises(TreeFormatError, match="layer_sizes is damaged"):
        _ = store.top_layer


def test_stale_sizes_fall_back_to_probing_the_store(
    chroma_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = store_tree(DIM)
    # A top layer far above the real one, adding up to less than the stored nodes: as if
    # others had written to the collection.
    _edit_sizes(chroma_path, [0] * 999 + [1])
    store, recorder = _reopened(chroma_path, monkeypatch)
    assert store.top_layer == tree.top_layer
    assert recorder.filtered  # probed, layer by layer
    # The next write drops the stale sizes rather than keeping them up to date.
    store.delete([tree.leaves[0].id])
    raw = LangChainNodeStore(_vectorstore(chroma_path)).dialect.fetch(
        [MANIFEST_ID], native=None, vectors=False
    )[0]
    assert "layer_sizes" not in json.loads(raw.document.metadata["raptor_manifest"])


def test_a_collection_with_legacy_distance_metadata_keeps_the_manifest_document_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # chromadb refuses to modify metadata holding "hnsw:" keys: no copy, the document serves.
    tree = store_tree(DIM)
    client = chromadb.PersistentClient(path=str(tmp_path))
    legacy = Chroma(client=client, collection_name="old", collection_metadata={"hnsw:space": "ip"})
    LangChainNodeStore(legacy).add_tree(tree)
    assert "raptor_manifest" not in (legacy._collection.metadata or {})
    reopened = LangChainNodeStore(Chroma(client=client, collection_name="old"))
    recorder = Recorder(reopened.dialect.collection, monkeypatch)
    assert (reopened.complete, reopened.top_layer) == (True, tree.top_layer)
    assert recorder.calls and recorder.filtered == []


def test_a_store_written_before_sizes_were_recorded_still_opens(
    chroma_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = store_tree(DIM)
    store = LangChainNodeStore(_vectorstore(chroma_path))
    manifest = {k: v for k, v in (store.manifest or {}).items() if k != "layer_sizes"}
    store._write_manifest(manifest)
    reopened, recorder = _reopened(chroma_path, monkeypatch)
    assert (reopened.top_layer, len(reopened)) == (tree.top_layer, len(tree))
    assert recorder.filtered  # the old way: probing


def test_leaf_searches_send_no_filter_when_leaves_are_most_of_the_tree(
    chroma_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The default strategy (passage) and a leaves-only collapsed search ask for layer 0.
    # Sent to Chroma as a `where`, that filter is a scan of the whole collection on every
    # query (2.8 s at 1M nodes); the leaves hold most of the nodes, so the store asks
    # without it for a few times more results and keeps the leaves itself.
    from raptor_core import CollapsedTreeRetriever, PassageRetriever

    tree = store_tree(DIM)
    assert len(tree.leaves) >= len(tree) / 2
    embedder = FakeEmbedder(dim=DIM)
    store, recorder = _reopened(chroma_path, monkeypatch)
    for leaf in tree.leaves[:4]:
        query = leaf.text
        for make in (
            lambda t: PassageRetriever(t, embedder, max_tokens=60),
            lambda t: CollapsedTreeRetriever(t, embedder, k=3, layers=[0]),
        ):
            on_chroma = make(store).retrieve(query)
            on_tree = make(tree).retrieve(query)
            assert on_chroma
            assert [(h.id, h.node.text) for h in on_chroma] == [
                (h.id, h.node.text) for h in on_tree
            ]
    assert recorder.filtered == []
    # A small layer that is a minority of the nodes has its ids listed once (one filtered
    # read) and is scored by id.
    top = CollapsedTreeRetriever(store, embedder, k=1, layers=[tree.top_layer])
    assert [h.id for h in top.retrieve(tree.leaves[0].text)] == [
        h.id
        for h in CollapsedTreeRetriever(tree, embedder, k=1, layers=[tree.top_layer]).retrieve(
            tree.leaves[0].text
        )
    ]
    assert recorder.filtered == [("get", {"raptor_layer": tree.top_layer})]
