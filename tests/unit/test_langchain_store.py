"""LangChainNodeStore: a RAPTOR tree inside a LangChain VectorStore, offline with fakes.

Chroma (embedded and server) runs in tests/integration/test_langchain_chroma.py.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("langchain_core")

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import InMemoryVectorStore, VectorStore
from langchain_qdrant import QdrantVectorStore
from qdrant_client import QdrantClient, models

from raptor_core.exceptions import InvalidInputError, InvalidParameterError, TreeFormatError
from raptor_core.retrieval.registry import make_retriever
from raptor_core.store.filters import compile_where
from raptor_core.testing import FakeEmbedder, NodeStoreTests, store_tree
from raptor_core.tree import Node
from raptor_core.types import NodeFilter, NodeStore
from raptor_langchain import GenericDialect, InMemoryDialect, LangChainNodeStore, RaptorEmbeddings
from raptor_langchain.dialects import (
    ChromaDialect,
    Pushdown,
    QdrantDialect,
    Row,
    chroma_where,
    dialect_for,
)
from raptor_langchain.store import MANIFEST_ID, document_to_node, node_to_document

DIM = 32


def in_memory_vectorstore(dim: int = DIM) -> InMemoryVectorStore:
    return InMemoryVectorStore(RaptorEmbeddings(FakeEmbedder(dim=dim)))


def filled_store(dialect: str = "memory") -> tuple[LangChainNodeStore, InMemoryVectorStore]:
    vectorstore = in_memory_vectorstore()
    chosen = GenericDialect(vectorstore) if dialect == "generic" else None
    store = LangChainNodeStore(vectorstore, dialect=chosen)
    store.add_tree(store_tree(DIM))
    return store, vectorstore


# -- the conformance suite ---------------------------------------------------------------------
class TestInMemoryVectorStoreNodeStore(NodeStoreTests):
    def make_store(self) -> LangChainNodeStore:
        return LangChainNodeStore(in_memory_vectorstore(self.dim))


def qdrant_vectorstore(dim: int = DIM, client: QdrantClient | None = None) -> QdrantVectorStore:
    """A real Qdrant (local mode) collection behind LangChain's Qdrant store."""
    client = client if client is not None else QdrantClient(":memory:")
    if not client.collection_exists("tree"):
        client.create_collection(
            "tree",
            vectors_config=models.VectorParams(size=dim, distance=models.Distance.COSINE),
        )
    return QdrantVectorStore(
        client=client, collection_name="tree", embedding=RaptorEmbeddings(FakeEmbedder(dim=dim))
    )


class TestQdrantNodeStore(NodeStoreTests):
    """Qdrant takes UUID point ids only: documents are stored under a UUID of their id."""

    def make_store(self) -> LangChainNodeStore:
        store = LangChainNodeStore(qdrant_vectorstore(self.dim))
        assert isinstance(store.dialect, QdrantDialect)
        return store


class TestGenericDialectNodeStore(NodeStoreTests):
    """Any other VectorStore: the store embeds texts itself and cannot be listed.

    Scores come from embedding the returned texts again, so equal scores may differ in the
    last bit and tied nodes may swap: rankings are compared as sets (like an ANN store).
    """

    exact = False
    listable = False

    def make_store(self) -> LangChainNodeStore:
        vectorstore = in_memory_vectorstore(self.dim)
        return LangChainNodeStore(vectorstore, dialect=GenericDialect(vectorstore))

    def test_add_len_iter_get(self) -> None:
        store, tree = self.filled()
        assert len(store) == len(tree)  # counted in the manifest
        ids = [tree.nodes[i].id for i in (5, 0, len(tree) - 1)]
        assert [n.id for n in store.get([*ids, "no-such-node"])] == ids
        with pytest.raises(InvalidParameterError, match="cannot list"):
            list(store)

    def test_upsert_replaces(self) -> None:
        # The store embeds the new text itself: the vector given to add() is not stored.
        store, tree = self.filled()
        leaf = tree.leaves[0]
        store.add([replace(leaf, text="replaced text")], tree.embeddings[:1])
        assert len(store) == len(tree)
        assert store.get([leaf.id])[0].text == "replaced text"
        vector = FakeEmbedder(dim=self.dim).embed_documents(["replaced text"])[0]
        best = store.search(vector, 1, where=NodeFilter(layers=frozenset({0})))
        assert best[0].node.id == leaf.id
        assert abs(best[0].score - 1.0) <= 1e-5

    def test_delete(self) -> None:
        store, tree = self.filled()
        gone = [tree.leaves[0].id, tree.leaves[1].id]
        store.delete([*gone, "no-such-node"])
        assert len(store) == len(tree) - 2
        assert store.get(gone) == []
        found = store.search(self.query(), len(tree), where=NodeFilter(include_carried=True))
        assert not {m.node.id for m in found} & set(gone)


# -- node <-> document -------------------------------------------------------------------------
ODD = Node(
    id="L0-odd",
    text="Odd metadata.",
    layer=0,
    token_count=2,
    doc_id="d",
    span=(3, 16),
    doc_ids=("d",),
    metadata={
        "none": None,
        "nested": {"a": [1, 2]},
        "tags": ["x", "y"],
        "mixed": [1, "a"],
        "empty": [],
        "ratio": 0.25,
        "flag": True,
        "raptor_layer": "user's own key",
    },
    parents=("L1-p",),
)


@pytest.mark.parametrize("native_lists", [True, False])
def test_every_node_shape_round_trips(native_lists: bool) -> None:
    for node in [*store_tree(DIM).nodes, ODD]:
        doc = node_to_document(node, native_lists=native_lists)
        assert doc.id == node.id
        assert document_to_node(doc) == node


def test_documents_hold_what_the_store_can_filter_on() -> None:
    doc = node_to_document(ODD)
    meta = doc.metadata
    assert meta["raptor_layer"] == 0  # ours; the user's raptor_layer lives in raptor_metadata
    assert json.loads(meta["raptor_metadata"])["raptor_layer"] == "user's own key"
    assert (meta["ratio"], meta["flag"], meta["tags"]) == (0.25, True, ["x", "y"])
    for kept_in_json_only in ("none", "nested", "mixed", "empty"):
        assert kept_in_json_only not in meta
    assert (meta["raptor_span_start"], meta["raptor_span_end"]) == (3, 16)
    assert meta["raptor_parents"] == ["L1-p"]
    assert meta["raptor_children"] == []  # always written, even empty
    flat = node_to_document(ODD, native_lists=False).metadata
    assert flat["raptor_children"] == "[]"
    assert flat["raptor_parents"] == '["L1-p"]'
    assert "tags" not in flat


def test_numbers_handed_back_as_floats_are_read() -> None:
    doc = node_to_document(ODD)
    doc.metadata.update(raptor_layer=0.0, raptor_token_count=2.0, raptor_span_start=3.0)
    assert document_to_node(doc) == ODD


@pytest.mark.parametrize(
    "damage",
    [
        {"raptor_layer": 0.5},
        {"raptor_token_count": "many"},
        {"raptor_metadata": "{not json"},
        {"raptor_metadata": "[1, 2]"},
        {"raptor_children": '{"a": 1}'},
        {"raptor_parents": [1, 2]},
    ],
)
def test_damaged_documents_raise_tree_format_error(damage: dict[str, Any]) -> None:
    doc = node_to_document(ODD)
    doc.metadata.update(damage)
    with pytest.raises(TreeFormatError, match="L0-odd"):
        document_to_node(doc)
    with pytest.raises(TreeFormatError, match="not a RAPTOR node"):
        document_to_node(Document(id="x", page_content="foreign", metadata={"source": "a"}))


# -- the core filter dialect in Chroma's ---------------------------------------------------------
@pytest.mark.parametrize(
    ("where", "expected", "exact"),
    [
        ({"topic": "nature"}, {"topic": {"$eq": "nature"}}, True),
        ({"doc_id": {"$in": ["a", "b"]}}, {"raptor_doc_id": {"$in": ["a", "b"]}}, True),
        (
            {"year": {"$gte": 2000, "$lt": 2020}},
            {"$and": [{"year": {"$gte": 2000}}, {"year": {"$lt": 2020}}]},
            True,
        ),
        (
            {"$or": [{"lang": "de"}, {"topic": {"$ne": "space"}}]},
            {"$or": [{"lang": {"$eq": "de"}}, {"topic": {"$ne": "space"}}]},
            True,
        ),
        ({"title": {"$gt": "M"}}, None, False),  # Chroma orders numbers only
        ({"x": None}, None, False),  # Chroma stores no None
        ({"x": {"$in": [1, "a"]}}, None, False),  # one type per list in Chroma
        ({"x": {"$in": []}}, None, False),
        ({"raptor_layer": 1}, None, False),  # a user key of ours: kept in raptor_metadata
        ({"$or": [{"a": 1}, {"t": {"$gt": "x"}}]}, None, False),
        # List metadata lives in raptor_metadata only: the list operators run in Python.
        ({"tags": {"$contains": 3}}, None, False),
        ({"tags": {"$contains": "x"}, "a": 1}, {"a": {"$eq": 1}}, False),
        ({"tags": {"$any": [1, 2]}}, None, False),
        ({"tags": {"$all": [1.5]}}, None, False),
        (
            {"$and": [{"a": 1}, {"t": {"$gt": "x"}}], "b": False},
            {"$and": [{"a": {"$eq": 1}}, {"b": {"$eq": False}}]},
            False,
        ),
    ],
)
def test_core_filters_translate_to_chroma(
    where: dict[str, Any], expected: dict[str, Any] | None, exact: bool
) -> None:
    assert chroma_where(where) == (expected, exact)


# Any Chroma `where` is evaluated over the whole collection before the search (a scan that
# grows with the collection: benchmarks/results/stores.md), so plain searches send none.
def _pushdown(*, layers: frozenset[int] | None = None, carried: bool = False) -> Pushdown:
    return Pushdown(
        layers=layers, doc_ids=None, include_carried=carried, where=None, accepts=lambda _: True
    )


@pytest.mark.parametrize(
    ("pushdown", "expected"),
    [
        (_pushdown(), (None, False)),  # carried copies and the manifest: dropped in Python
        (_pushdown(carried=True), (None, False)),
        (_pushdown(layers=frozenset({1})), ({"raptor_layer": {"$in": [1]}}, False)),
        (_pushdown(layers=frozenset({1}), carried=True), ({"raptor_layer": {"$in": [1]}}, True)),
    ],
)
def test_chroma_gets_no_where_for_the_structural_defaults(
    pushdown: Pushdown, expected: tuple[Any, bool]
) -> None:
    assert ChromaDialect(in_memory_vectorstore()).translate(pushdown) == expected


class _RecordingDialect(InMemoryDialect):
    def __init__(self, vectorstore: InMemoryVectorStore) -> None:
        super().__init__(vectorstore)
        self.fetched: list[Any] = []

    def fetch(self, ids: Sequence[str], *, native: Any, vectors: bool) -> list[Row]:
        self.fetched.append(native)
        return super().fetch(ids, native=native, vectors=vectors)


def test_a_search_among_known_ids_sends_only_the_callers_filter() -> None:
    """The ids bound what is fetched; the structural filter is checked in Python."""
    vectorstore = in_memory_vectorstore()
    dialect = _RecordingDialect(vectorstore)
    store = LangChainNodeStore(vectorstore, dialect=dialect)
    tree = store_tree(DIM)
    store.add_tree(tree)
    parent = next(n for n in tree.nodes if len(n.children) > 1)
    q = np.eye(DIM, dtype=np.float32)[0]
    dialect.fetched.clear()
    found = store.search(q, 10, where=NodeFilter(parents=frozenset({parent.id})))
    assert {m.node.id for m in found} == set(parent.children)
    assert dialect.fetched and all(native is None for native in dialect.fetched)
    first = parent.children[0]
    mine = store.search(
        q, 10, where=NodeFilter(parents=frozenset({parent.id}), native=lambda d: d.id == first)
    )
    assert [m.node.id for m in mine] == [first]


class _LayerListingDialect(InMemoryDialect):
    """Lists small layers, as ChromaDialect does, and counts how often it is asked."""

    def __init__(self, vectorstore: InMemoryVectorStore) -> None:
        super().__init__(vectorstore)
        self.listed: list[int] = []

    def layer_ids(self, layer: int, limit: int) -> frozenset[str] | None:
        self.listed.append(layer)
        ids = [d.id for d in self.scan() if d.metadata.get("raptor_layer") == layer]
        return frozenset(str(i) for i in ids) if len(ids) <= limit else None


def test_searches_in_a_small_layer_score_its_cached_ids() -> None:
    vectorstore = in_memory_vectorstore()
    dialect = _LayerListingDialect(vectorstore)
    store = LangChainNodeStore(vectorstore, dialect=dialect)
    tree = store_tree(DIM)
    store.add_tree(tree)
    reference, _ = filled_store()
    top = frozenset({tree.top_layer})
    q = np.eye(DIM, dtype=np.float32)[1]
    for _ in range(2):
        found = store.search(q, 3, where=NodeFilter(layers=top, include_carried=True))
        expected = reference.search(q, 3, where=NodeFilter(layers=top, include_carried=True))
        assert [(m.node.id, round(m.score, 6)) for m in found] == [
            (m.node.id, round(m.score, 6)) for m in expected
        ]
    assert dialect.listed == [tree.top_layer]  # listed once, then cached
    newcomer = replace(tree.nodes[-1], id="new-top", children=tree.nodes[-1].children)
    store.add([newcomer], np.eye(DIM, dtype=np.float32)[1:2])  # a write forgets the cache
    found = store.search(q, 1, where=NodeFilter(layers=top, include_carried=True))
    assert [m.node.id for m in found] == ["new-top"]
    assert dialect.listed == [tree.top_layer, tree.top_layer]


# -- manifest, shape, reopening ----------------------------------------------------------------
def test_the_manifest_records_the_build_and_is_never_found() -> None:
    store, vectorstore = filled_store()
    tree = store_tree(DIM)
    assert vectorstore.get_by_ids([MANIFEST_ID])
    assert store.params == json.loads(json.dumps(tree.params))
    assert store.manifest is not None and store.manifest["dim"] == DIM
    assert (len(store), store.top_layer, store.dim) == (len(tree), tree.top_layer, DIM)
    everything = store.search(
        np.eye(DIM, dtype=np.float32)[0], 1000, where=NodeFilter(include_carried=True)
    )
    assert MANIFEST_ID not in {m.node.id for m in everything}
    assert len(everything) == len(tree)
    assert MANIFEST_ID not in {n.id for n in store}


def test_a_reopened_store_reads_its_shape_from_the_vector_store() -> None:
    _, vectorstore = filled_store()
    reopened = LangChainNodeStore(vectorstore)
    tree = store_tree(DIM)
    assert (len(reopened), reopened.top_layer, reopened.dim) == (len(tree), tree.top_layer, DIM)
    exported = reopened.to_tree()
    assert {n.id: n for n in exported.nodes} == {n.id: n for n in tree.nodes}
    for node in tree.nodes:
        np.testing.assert_allclose(
            exported.embeddings[exported.row(node.id)],
            tree.embeddings[tree.row(node.id)],
            atol=1e-6,
        )


def test_a_store_holds_one_tree() -> None:
    store, _ = filled_store()
    with pytest.raises(InvalidParameterError, match="already holds"):
        store.add_tree(store_tree(DIM))


@pytest.mark.parametrize(
    ("manifest", "match"),
    [
        ("not json", "damaged"),
        (json.dumps({"format": "something-else"}), "damaged"),
        (json.dumps({"format": "raptor-tree-store", "format_version": 99}), "upgrade"),
    ],
)
def test_a_damaged_or_newer_manifest_is_refused(manifest: str, match: str) -> None:
    _, vectorstore = filled_store()
    vectorstore.store[MANIFEST_ID]["metadata"] = {"raptor_manifest": manifest}
    with pytest.raises(TreeFormatError, match=match):
        len(LangChainNodeStore(vectorstore))


def test_the_top_layer_follows_deletes() -> None:
    for dialect in ("memory", "generic"):
        store, _ = filled_store(dialect)
        tree = store_tree(DIM)
        store.delete([n.id for n in tree.layer(tree.top_layer)])
        assert store.top_layer == tree.top_layer - 1, dialect
        assert len(store) == len(tree) - len(tree.layer(tree.top_layer)), dialect


def test_an_update_is_one_delete_and_one_upsert() -> None:
    store, vectorstore = filled_store()
    tree = store_tree(DIM)
    calls: list[tuple[str, int]] = []
    original = vectorstore.delete

    def counting_delete(ids: Sequence[str] | None = None, **kwargs: Any) -> None:
        calls.append(("delete", len(ids or ())))
        original(ids, **kwargs)

    vectorstore.delete = counting_delete  # type: ignore[method-assign]
    before = dict(vectorstore.store)
    leaf = tree.leaves[0]
    store.delete([tree.leaves[1].id])
    store.add([replace(leaf, text="changed")], tree.embeddings[:1])
    assert calls == [("delete", 1)]
    # No other node is rewritten; the manifest is, for its per-layer sizes.
    untouched = set(before) - {leaf.id, tree.leaves[1].id, MANIFEST_ID}
    assert all(vectorstore.store[i] is before[i] for i in untouched)
    assert json.loads(vectorstore.store[MANIFEST_ID]["metadata"]["raptor_manifest"])[
        "layer_sizes"
    ] == [len(tree.layer(layer)) - (layer == 0) for layer in range(tree.top_layer + 1)]


def test_bad_writes_are_refused() -> None:
    store, _ = filled_store()
    leaf = store_tree(DIM).leaves[0]
    with pytest.raises(InvalidInputError, match="dimension"):
        store.add([leaf], np.ones((1, DIM + 1), dtype=np.float32))
    with pytest.raises(InvalidInputError, match="zero"):
        store.add([leaf], np.zeros((1, DIM), dtype=np.float32))
    with pytest.raises(InvalidInputError, match="twice"):
        store.add([leaf, leaf], np.ones((2, DIM), dtype=np.float32))
    with pytest.raises(InvalidInputError, match="reserved"):
        store.add([replace(leaf, id=MANIFEST_ID)], np.ones((1, DIM), dtype=np.float32))
    with pytest.raises(InvalidInputError, match="dimension"):
        store.search(np.ones(DIM + 2, dtype=np.float32), 3)


# -- native filters ------------------------------------------------------------------------------
def test_in_memory_native_filters_are_callables_on_documents() -> None:
    store, _ = filled_store()
    q = FakeEmbedder(dim=DIM).embed_query("bees and rockets")
    found = store.search(
        q, 100, where=NodeFilter(native=lambda doc: doc.metadata.get("lang") == "de")
    )
    assert found and all(m.node.metadata["lang"] == "de" for m in found)
    with pytest.raises(InvalidParameterError, match="callable"):
        store.search(q, 3, where=NodeFilter(native={"lang": "de"}))


def test_generic_native_filters_go_to_the_store_as_filter() -> None:
    store, _ = filled_store("generic")
    tree = store_tree(DIM)
    q = FakeEmbedder(dim=DIM).embed_query("bees")
    german = NodeFilter(native=lambda doc: doc.metadata.get("lang") == "de")
    found = store.search(q, 100, where=german)
    expected = {n.id for n in tree.nodes if n.metadata.get("lang") == "de" and not _carried(n)}
    assert {m.node.id for m in found} == expected
    # With an id restriction too (a traversal step): searched, then checked in Python.
    some = frozenset(n.id for n in tree.nodes[::2])
    found = store.search(q, 100, where=replace(german, ids=some))
    assert {m.node.id for m in found} == expected & some


def _carried(node: Node) -> bool:
    return node.metadata.get("carried") is True and len(node.children) == 1


def test_strategies_take_the_store_and_a_core_filter() -> None:
    store, _ = filled_store()
    tree = store_tree(DIM)
    embedder = FakeEmbedder(dim=DIM)
    where = {"$or": [{"lang": "de"}, {"year": {"$lt": 2020}}]}
    for strategy in ("collapsed", "traversal", "value", "mmr"):
        on_store = make_retriever(strategy, store, embedder, k=50, max_tokens=None, where=where)
        on_tree = make_retriever(strategy, tree, embedder, k=50, max_tokens=None, where=where)
        hits = on_store.retrieve("bees and volcanoes")
        # No top-layer summary (each spans documents) passes: traversal starts below them.
        assert hits, strategy
        # The bag-of-words fake ties many nodes at 0: compare what is found, and its scores.
        expected = {h.id: h.score for h in on_tree.retrieve("bees and volcanoes")}
        assert {h.id: pytest.approx(h.score, abs=1e-6) for h in hits} == expected, strategy
        assert all(compile_where(where)(h.node) for h in hits), strategy


# -- stores that lack what a search needs ----------------------------------------------------------
class _TextOnlyStore(VectorStore):
    """A VectorStore implementing the minimum LangChain requires: add_texts and search."""

    def __init__(self, embedding: Embeddings) -> None:
        self.inner = InMemoryVectorStore(embedding)

    @property
    def embeddings(self) -> Embeddings:
        return self.inner.embeddings

    def add_texts(self, texts: Any, metadatas: Any = None, **kwargs: Any) -> list[str]:
        return self.inner.add_texts(texts, metadatas=metadatas, **kwargs)

    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return self.inner.similarity_search(query, k, **kwargs)

    @classmethod
    def from_texts(
        cls, texts: Any, embedding: Embeddings, metadatas: Any = None, **kwargs: Any
    ) -> Any:
        raise NotImplementedError


def test_a_store_without_a_needed_method_names_it() -> None:
    vectorstore = _TextOnlyStore(RaptorEmbeddings(FakeEmbedder(dim=DIM)))
    store = LangChainNodeStore(vectorstore)
    assert isinstance(store.dialect, GenericDialect)
    with pytest.raises(InvalidParameterError, match="get_by_ids"):
        store.add_tree(store_tree(DIM))


def test_dialects_are_chosen_by_class() -> None:
    vectorstore = in_memory_vectorstore()
    assert isinstance(dialect_for(vectorstore), InMemoryDialect)
    assert isinstance(dialect_for(_TextOnlyStore(vectorstore.embeddings)), GenericDialect)
    with pytest.raises(InvalidParameterError, match="VectorStore"):
        dialect_for(object())  # type: ignore[arg-type]
    assert isinstance(LangChainNodeStore(vectorstore), NodeStore)


def test_generic_stores_score_by_embedding_again_and_need_the_model() -> None:
    store, vectorstore = filled_store("generic")
    blind = LangChainNodeStore(vectorstore, dialect=GenericDialect(vectorstore))
    blind.embeddings = None
    with pytest.raises(InvalidParameterError, match="embeddings="):
        blind.search(FakeEmbedder(dim=DIM).embed_query("bees"), 3)
    leaf = store_tree(DIM).leaves[0]
    np.testing.assert_allclose(
        store.vectors([leaf.id])[0], store_tree(DIM).embeddings[0], atol=1e-6
    )
    with pytest.raises(KeyError):
        store.vectors(["no-such-node"])


def test_texts_embedded_again_to_score_them_are_embedded_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A store without vectors: its results are scored by embedding their texts again.  The
    # same leaves come back query after query; each (id, text) is embedded once, and a
    # replaced text is embedded anew.
    from raptor_langchain import store as store_module

    store, _ = filled_store("generic")
    embedded: list[str] = []
    inner = FakeEmbedder(dim=DIM)

    class Counting(FakeEmbedder):
        def embed_documents(self, texts):  # type: ignore[no-untyped-def]
            embedded.extend(texts)
            return inner.embed_documents(texts)

    store.embeddings = RaptorEmbeddings(Counting(dim=DIM))
    query = inner.embed_query("bees and honey")
    leaves = NodeFilter(layers=frozenset({0}))
    first = store.search(query, 5, where=leaves)
    assert embedded and len(embedded) == len(set(embedded))
    count = len(embedded)
    assert [(m.node.id, m.score) for m in store.search(query, 5, where=leaves)] == [
        (m.node.id, m.score) for m in first
    ]
    assert len(embedded) == count  # nothing embedded the second time
    leaf = first[0].node
    store.add([replace(leaf, text="a new text for the best leaf")], inner.embed_documents(["x"]))
    again = store.search(inner.embed_query("a new text for the best leaf"), 5, where=leaves)
    assert again[0].node.id == leaf.id
    assert "a new text for the best leaf" in embedded[count:]
    # Bounded: the oldest entries go first.
    monkeypatch.setattr(store_module, "EMBEDDED_CACHE_SIZE", 3)
    store.search(inner.embed_query("rocket fuel"), 5, where=leaves)
    assert len(store._embedded) == 3
