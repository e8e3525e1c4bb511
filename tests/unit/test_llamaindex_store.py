"""RaptorIndex and LlamaIndexNodeStore over SimpleVectorStore, offline with fakes.

* The NodeStore conformance suite over ``SimpleVectorStore`` (texts in a docstore).
* Nodes as LlamaIndex ``TextNode`` objects: relationships, metadata, hidden keys.
* ``RaptorIndex`` as a ``BaseIndex``: the storage context, ``load_index_from_storage``,
  updates written into the vector store, ``filters=``, a tampered index store.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, StorageContext, load_index_from_storage
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.indices.base import BaseIndex
from llama_index.core.llms import MockLLM
from llama_index.core.schema import BaseNode, NodeRelationship, RelatedNodeInfo, TextNode
from llama_index.core.vector_stores import (
    FilterCondition,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
    SimpleVectorStore,
)
from llama_index.core.vector_stores.types import (
    BasePydanticVectorStore,
    VectorStoreQuery,
    VectorStoreQueryResult,
)
from llama_index.core.vector_stores.utils import build_metadata_filter_fn
from llama_index.vector_stores.faiss import FaissMapVectorStore, FaissVectorStore
from llama_index.vector_stores.milvus import MilvusVectorStore
from llama_index.vector_stores.qdrant import QdrantVectorStore
from qdrant_client import QdrantClient

from raptor_core.exceptions import InvalidInputError, InvalidParameterError, TreeFormatError
from raptor_core.retrieval.registry import make_retriever
from raptor_core.testing import (
    EchoSummarizer,
    FakeEmbedder,
    GroupClusterer,
    NodeStoreTests,
    WhitespaceTokenizer,
    store_tree,
)
from raptor_core.tree import is_carried
from raptor_llamaindex import LlamaIndexNodeStore, RaptorIndex
from raptor_llamaindex.store import core_where, node_to_text_node, text_node_to_node

DOCS = {
    "cats": (
        "pets",
        "Cats purr softly. Cats sleep in the sun. Kittens chase string. A cat grooms.",
    ),
    "rockets": ("space", "Rockets burn fuel. Boosters land on barges. Orbit needs great speed."),
    "bread": ("food", "Bread rises with yeast. Sourdough needs a starter. Ovens bake loaves."),
}


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def documents() -> list[Document]:
    return [
        Document(text=text, id_=doc_id, metadata={"topic": topic})
        for doc_id, (topic, text) in DOCS.items()
    ]


def options(**extra: Any) -> dict[str, Any]:
    return {
        "embed_model": FakeEmbedder(32),
        "summarizer": EchoSummarizer(),
        "tokenizer": WhitespaceTokenizer(),
        "clusterer": GroupClusterer(2),
        "min_layer_size": 2,
        "chunk_max_tokens": 8,
        "summary_max_tokens": 10,
        "random_state": 0,
        "strategy": "collapsed",
        **extra,
    }


def assert_same_ranking(got: list[tuple[str, float]], want: list[tuple[str, float]]) -> None:
    """Same scores in the same order; ids may swap only among equal scores (bag-of-words
    fakes tie often, and which of several tied nodes comes first is each store's own)."""
    assert [round(s, 5) for _, s in got] == [round(s, 5) for _, s in want]
    last = round(want[-1][1], 5) if want else None
    for score in {round(s, 5) for _, s in want} - {last}:
        assert {i for i, s in got if round(s, 5) == score} == {
            i for i, s in want if round(s, 5) == score
        }


def answers(index: Any, query: str, **kwargs: Any) -> list[tuple[str, float]]:
    return [
        (n.node.node_id, round(float(n.score or 0), 6))
        for n in index.as_retriever(**kwargs).retrieve(query)
    ]


# -- the store ---------------------------------------------------------------------------------
class TestSimpleVectorStoreNodeStore(NodeStoreTests):
    def make_store(self) -> LlamaIndexNodeStore:
        return LlamaIndexNodeStore(SimpleVectorStore())


class TestFaissVectorStoreNodeStore(NodeStoreTests):
    """LlamaIndex's FAISS integration: labels, not ids, from a real FAISS index."""

    def make_store(self) -> LlamaIndexNodeStore:
        return LlamaIndexNodeStore(FaissVectorStore(faiss_index=faiss.IndexFlatL2(self.dim)))


@pytest.mark.filterwarnings("ignore:Payload indexes have no effect:UserWarning")
class TestQdrantVectorStoreNodeStore(NodeStoreTests):
    """A real Qdrant (its local mode, in memory): point ids must be UUIDs."""

    def make_store(self) -> LlamaIndexNodeStore:
        client = QdrantClient(":memory:")
        return LlamaIndexNodeStore(QdrantVectorStore(client=client, collection_name="tree"))


class TestMilvusVectorStoreNodeStore(NodeStoreTests):
    """A real Milvus (Milvus Lite, in a local file): listed with its query iterator."""

    def make_store(self) -> LlamaIndexNodeStore:
        path = Path(tempfile.mkdtemp()) / "milvus.db"
        vector_store = MilvusVectorStore(
            uri=str(path), dim=self.dim, overwrite=True, similarity_metric="IP"
        )
        return LlamaIndexNodeStore(vector_store)


class TestFaissMapVectorStoreNodeStore(NodeStoreTests):
    def make_store(self) -> LlamaIndexNodeStore:
        index = faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))
        return LlamaIndexNodeStore(FaissMapVectorStore(faiss_index=index))


class QueryOnlyVectorStore(BasePydanticVectorStore):
    """A store that can only be searched: nodes in a dict, exact cosine search, no listing.

    It keeps no texts (a docstore holds them) and has no
    ``get_nodes``; it filters with LlamaIndex's flat ``MetadataFilters`` only.
    """

    stores_text: bool = False
    _nodes: dict[str, BaseNode] = PrivateAttr(default_factory=dict)

    @property
    def client(self) -> None:
        return None

    def add(self, nodes: Sequence[BaseNode], **_: Any) -> list[str]:
        for node in nodes:
            self._nodes[node.node_id] = node
        return [n.node_id for n in nodes]

    def delete(self, ref_doc_id: str, **_: Any) -> None:
        self._nodes = {i: n for i, n in self._nodes.items() if n.ref_doc_id != ref_doc_id}

    def delete_nodes(
        self, node_ids: list[str] | None = None, filters: Any = None, **_: Any
    ) -> None:
        for node_id in node_ids or []:
            self._nodes.pop(node_id, None)

    def _ranked(self, query: VectorStoreQuery) -> list[tuple[float, str]]:
        """``(cosine, id)`` of the best nodes passing the query's filters and ids, best first."""
        passes = build_metadata_filter_fn(lambda i: self._nodes[i].metadata, query.filters)
        allowed = None if query.node_ids is None else set(query.node_ids)
        q = np.asarray(query.query_embedding, dtype=np.float64)
        scored = [
            (float(np.dot(n.get_embedding(), q)), i)
            for i, n in self._nodes.items()
            if (allowed is None or i in allowed) and passes(i)
        ]
        order = sorted(range(len(scored)), key=lambda j: -scored[j][0])[: query.similarity_top_k]
        return [scored[j] for j in order]

    def query(self, query: VectorStoreQuery, **_: Any) -> VectorStoreQueryResult:
        ranked = self._ranked(query)
        return VectorStoreQueryResult(
            similarities=[score for score, _ in ranked], ids=[i for _, i in ranked]
        )


class TestQueryOnlyVectorStoreNodeStore(NodeStoreTests):
    """A vector store that can only be searched, its texts in a docstore."""

    listable = False

    def make_store(self) -> LlamaIndexNodeStore:
        from llama_index.core.storage.docstore import SimpleDocumentStore

        vector_store = QueryOnlyVectorStore()
        store = LlamaIndexNodeStore(vector_store, docstore=SimpleDocumentStore(), layer_sizes=[])
        assert store.listable is False
        return store


class DictVectorStore(QueryOnlyVectorStore):
    """A store LlamaIndexNodeStore has no backend for: nodes in a dict, exact cosine search.

    Like many integrations it keeps texts, returns nodes from ``get_nodes`` and filters with
    LlamaIndex's flat ``MetadataFilters`` only.
    """

    stores_text: bool = True

    def get_nodes(
        self, node_ids: list[str] | None = None, filters: Any = None, **_: Any
    ) -> list[BaseNode]:
        if node_ids is None:
            return list(self._nodes.values())
        return [self._nodes[i] for i in node_ids if i in self._nodes]

    def query(self, query: VectorStoreQuery, **_: Any) -> VectorStoreQueryResult:
        ranked = self._ranked(query)
        return VectorStoreQueryResult(
            nodes=[self._nodes[i] for _, i in ranked],
            similarities=[score for score, _ in ranked],
            ids=[i for _, i in ranked],
        )


class TestGenericVectorStoreNodeStore(NodeStoreTests):
    """Any other vector store, through the public BasePydanticVectorStore API only."""

    def make_store(self) -> LlamaIndexNodeStore:
        store = LlamaIndexNodeStore(DictVectorStore())
        assert type(store.backend).__name__ == "GenericBackend"
        return store

    def test_a_reopened_store_searches(self) -> None:
        """A new LlamaIndexNodeStore over a filled store learns the dimension from it."""
        store, tree = self.filled()
        reopened = LlamaIndexNodeStore(store.vector_store)
        assert reopened.dim == tree.dim
        assert [m.node.id for m in reopened.search(self.query(), 4)] == [
            m.node.id for m in store.search(self.query(), 4)
        ]


def test_nodes_are_linked_text_nodes() -> None:
    tree = store_tree(32)
    summary = next(n for n in tree.nodes if n.layer == 1 and len(n.children) > 1)
    leaf = tree.node(summary.children[0])
    stored = node_to_text_node(summary)
    assert isinstance(stored, TextNode)
    assert [r.node_id for r in stored.relationships[NodeRelationship.CHILD]] == list(
        summary.children
    )  # type: ignore[union-attr]
    assert json.loads(stored.metadata["raptor_doc_ids"]) == list(summary.doc_ids)
    assert stored.metadata["raptor_layer"] == 1
    chunk = node_to_text_node(leaf)
    assert chunk.ref_doc_id == leaf.doc_id  # SOURCE: the chunk's document
    assert chunk.relationships[NodeRelationship.PARENT].node_id == leaf.parents[0]  # type: ignore[union-attr]
    assert (chunk.start_char_idx, chunk.end_char_idx) == leaf.span
    # Our bookkeeping never reaches prompts or embeddings.
    assert "raptor_layer" not in chunk.get_content(metadata_mode="llm")  # type: ignore[arg-type]
    assert "raptor_layer" not in chunk.get_content(metadata_mode="embed")  # type: ignore[arg-type]
    assert all(text_node_to_node(node_to_text_node(n)) == n for n in tree.nodes)
    assert any(is_carried(n) for n in tree.nodes)


def test_foreign_nodes_are_refused() -> None:
    with pytest.raises(TreeFormatError, match="not a RAPTOR node"):
        text_node_to_node(TextNode(text="hello", id_="x"))
    damaged = node_to_text_node(store_tree(32).leaves[0])
    damaged.metadata["raptor_children"] = "{not json"
    with pytest.raises(TreeFormatError):
        text_node_to_node(damaged)


def test_llamaindex_filters_translate_to_the_core_dialect() -> None:
    filters = MetadataFilters(
        filters=[
            MetadataFilter(key="ref_doc_id", value="bees"),
            MetadataFilters(
                filters=[
                    MetadataFilter(key="year", operator=FilterOperator.GTE, value=2000),
                    MetadataFilter(key="lang", operator=FilterOperator.IN, value=["de", "fr"]),
                ],
                condition=FilterCondition.OR,
            ),
        ]
    )
    assert core_where(filters) == {
        "$and": [
            {"doc_id": {"$eq": "bees"}},
            {"$or": [{"year": {"$gte": 2000}}, {"lang": {"$in": ["de", "fr"]}}]},
        ]
    }
    with pytest.raises(InvalidParameterError, match="text_match"):
        core_where(
            MetadataFilters(filters=[MetadataFilter(key="t", operator="text_match", value="x")])
        )
    with pytest.raises(InvalidParameterError, match="not"):
        core_where(MetadataFilters(filters=[MetadataFilter(key="t", value="x")], condition="not"))


def test_native_llamaindex_filters_on_the_store() -> None:
    tree = store_tree(32)
    store = LlamaIndexNodeStore(SimpleVectorStore())
    store.add_tree(tree)
    from raptor_core.types import NodeFilter

    q = tree.embeddings[0]
    native = MetadataFilters(
        filters=[
            MetadataFilter(key="topic", value="nature"),
            MetadataFilter(key="raptor_layer", value=0),
        ]
    )
    found = store.search(q, 50, where=NodeFilter(native=native))
    assert found and all(m.node.layer == 0 and m.node.metadata["topic"] == "nature" for m in found)
    expected = store.search(
        q, 50, where=NodeFilter(layers=frozenset({0}), where={"topic": "nature"})
    )
    assert [m.node.id for m in found] == [m.node.id for m in expected]
    with pytest.raises(InvalidParameterError, match="MetadataFilters"):
        store.search(q, 3, where=NodeFilter(native=lambda n: True))


# -- the index ---------------------------------------------------------------------------------
def test_index_is_a_llamaindex_index_over_its_vector_store() -> None:
    index = RaptorIndex.from_documents(documents(), **options())
    assert isinstance(index, BaseIndex)
    vector_store = index.storage_context.vector_store
    assert isinstance(vector_store, SimpleVectorStore)
    tree = index.tree
    assert tree.num_layers >= 2
    # Every layer is in the vector store, the texts in the docstore beside it.
    assert set(vector_store.data.embedding_dict) == {n.id for n in tree.nodes}
    summary = next(n for n in tree.nodes if n.layer == 1)
    stored = index.storage_context.docstore.get_node(summary.id)
    assert [r.node_id for r in stored.relationships[NodeRelationship.CHILD]] == list(
        summary.children
    )  # type: ignore[union-attr]
    assert index.ref_doc_info["cats"].node_ids == [n.id for n in tree.leaves if n.doc_id == "cats"]
    # Strategies search the store, and find what the in-memory tree finds.
    retriever = index.as_retriever(similarity_top_k=5)
    assert retriever.store is index.store
    on_tree = make_retriever("collapsed", tree, index.embedder, k=5).retrieve("rockets and orbit")
    assert [n.node.node_id for n in retriever.retrieve("rockets and orbit")] == [
        h.id for h in on_tree
    ]


def test_build_into_a_given_storage_context_and_reload(tmp_path: Path) -> None:
    vector_store = SimpleVectorStore()
    context = StorageContext.from_defaults(vector_store=vector_store)
    index = RaptorIndex.from_documents(documents(), storage_context=context, **options())
    assert index.storage_context.vector_store is vector_store
    assert len(vector_store.data.embedding_dict) == len(index.tree)
    before = answers(index, "cats sleep in the sun", similarity_top_k=4)
    index.storage_context.persist(persist_dir=tmp_path)

    loaded = load_index_from_storage(
        StorageContext.from_defaults(persist_dir=tmp_path), embed_model=FakeEmbedder(32)
    )
    assert isinstance(loaded, RaptorIndex)
    assert loaded.ref_doc_ids == tuple(DOCS)
    assert loaded.retriever_kwargs == {"strategy": "collapsed"}
    assert answers(loaded, "cats sleep in the sun", similarity_top_k=4) == before
    assert [n.to_dict() for n in loaded.tree.nodes] == [n.to_dict() for n in index.tree.nodes]
    # The build parameters came back too: an update gives the tree the same update of the
    # original index gives.
    loaded = load_index_from_storage(
        StorageContext.from_defaults(persist_dir=tmp_path),
        embed_model=FakeEmbedder(32),
        summarizer=EchoSummarizer(),
        tokenizer=WhitespaceTokenizer(),
        clusterer=GroupClusterer(2),
    )
    extra = Document(text="Volcanoes erupt lava. Magma rises from the mantle.", id_="volcano")
    loaded.insert(extra)
    index.insert(extra)
    assert [n.to_dict() for n in loaded.tree.nodes] == [n.to_dict() for n in index.tree.nodes]


def reopen_index(persist_dir: Path, vector_store: Any) -> RaptorIndex:
    """``load_index_from_storage`` over ``vector_store``, with the components updates need."""
    loaded = load_index_from_storage(
        StorageContext.from_defaults(vector_store=vector_store, persist_dir=persist_dir),
        embed_model=FakeEmbedder(32),
        summarizer=EchoSummarizer(),
        tokenizer=WhitespaceTokenizer(),
        clusterer=GroupClusterer(2),
    )
    assert isinstance(loaded, RaptorIndex)
    return loaded


def assert_reopened_like(loaded: RaptorIndex, reference: RaptorIndex, query: str) -> None:
    """A reopened index holds the reference's nodes, answers like it, and updates like it.

    Stores that list in their own order (Qdrant: by point id) give the same nodes in
    another order.
    """
    assert sorted(loaded.tree.nodes, key=lambda n: n.id) == sorted(
        reference.tree.nodes, key=lambda n: n.id
    )
    for strategy in ("collapsed", "passage", "traversal"):
        kwargs = {"similarity_top_k": 6, "strategy": strategy, "max_tokens": 40}
        assert answers(loaded, query, **kwargs) == answers(reference, query, **kwargs)
    extra = Document(text="Volcanoes erupt lava. Magma rises from the mantle.", id_="volcano")
    for target in (loaded, reference):
        target.insert(extra)
        target.delete_ref_doc("cats")
    assert {n.id for n in loaded.store} == {n.id for n in reference.tree.nodes}
    assert_same_ranking(
        answers(loaded, "volcanoes erupt lava", similarity_top_k=5),
        answers(reference, "volcanoes erupt lava", similarity_top_k=5),
    )


def test_an_index_in_a_faiss_vector_store_reloads_and_updates(tmp_path: Path) -> None:
    # FaissVectorStore answers with FAISS labels and keeps no ids, texts or metadata; the
    # docstore records each node's label, so a reloaded index searches, lists and updates.
    vector_store = FaissVectorStore(faiss_index=faiss.IndexFlatL2(32))
    context = StorageContext.from_defaults(vector_store=vector_store)
    index = RaptorIndex.from_documents(documents(), storage_context=context, **options())
    assert vector_store.client.ntotal == len(index.tree)
    query = "cats sleep in the sun"
    on_tree = [
        (h.id, round(h.score, 6))
        for h in make_retriever("collapsed", index.tree, index.embedder, k=4).retrieve(query)
    ]
    assert answers(index, query, similarity_top_k=4) == on_tree
    index.storage_context.persist(persist_dir=tmp_path)

    def reopen() -> RaptorIndex:
        return reopen_index(tmp_path, FaissVectorStore.from_persist_dir(str(tmp_path)))

    loaded = reopen()
    assert answers(loaded, query, similarity_top_k=4) == on_tree
    assert [n.to_dict() for n in loaded.tree.nodes] == [n.to_dict() for n in index.tree.nodes]
    for strategy in ("passage", "traversal", "value"):
        got = answers(loaded, query, similarity_top_k=6, strategy=strategy, max_tokens=40)
        assert got == answers(index, query, similarity_top_k=6, strategy=strategy, max_tokens=40)
    # Updates: FAISS cannot delete, so replaced vectors stay in the index unlabelled and are
    # never returned; the tree is the one the in-memory index gets.
    extra = Document(text="Volcanoes erupt lava. Magma rises from the mantle.", id_="volcano")
    loaded.insert(extra)
    loaded.delete_ref_doc("cats")
    reference = RaptorIndex.from_documents(documents(), **options())
    reference.insert(extra)
    reference.delete_ref_doc("cats")
    assert [n.to_dict() for n in loaded.tree.nodes] == [n.to_dict() for n in reference.tree.nodes]
    assert loaded.storage_context.vector_store.client.ntotal > len(loaded.tree)
    for query in ("volcanoes erupt lava", "cats sleep in the sun", "bread"):
        assert answers(loaded, query, similarity_top_k=5) == answers(
            reference, query, similarity_top_k=5
        )
    loaded.storage_context.persist(persist_dir=tmp_path)
    again = reopen()
    assert {n.id for n in again.store} == {n.id for n in reference.tree.nodes}
    assert answers(again, "volcanoes erupt lava", similarity_top_k=5) == answers(
        reference, "volcanoes erupt lava", similarity_top_k=5
    )


@pytest.mark.filterwarnings("ignore:Payload indexes have no effect:UserWarning")
def test_an_index_in_qdrant_reopens_and_updates(tmp_path: Path) -> None:
    # Qdrant takes UUID point ids only, creates its collection on the first write and lists
    # at most 9,999 points through the integration: none of that shows through RaptorIndex.
    def vector_store(name: str = "essays") -> QdrantVectorStore:
        client = QdrantClient(path=str(tmp_path / "qdrant"))  # on disk, local mode
        return QdrantVectorStore(client=client, collection_name=name)

    store = vector_store()
    index = RaptorIndex.from_documents(
        documents(), storage_context=StorageContext.from_defaults(vector_store=store), **options()
    )
    query = "cats sleep in the sun"
    reference = RaptorIndex.from_documents(documents(), **options())
    assert answers(index, query, similarity_top_k=4) == answers(
        reference, query, similarity_top_k=4
    )
    index.storage_context.persist(persist_dir=tmp_path / "index")
    store.client.close()  # local mode holds a lock on its folder

    # A misspelled collection reads as a new, empty one: refused, not answered with nothing.
    wrong = vector_store("essay")
    misplaced = load_index_from_storage(
        StorageContext.from_defaults(vector_store=wrong, persist_dir=tmp_path / "index"),
        embed_model=FakeEmbedder(32),
    )
    with pytest.raises(InvalidParameterError, match="holds none of the"):
        misplaced.as_retriever().retrieve(query)
    wrong.client.close()
    loaded = reopen_index(tmp_path / "index", vector_store())
    assert_reopened_like(loaded, reference, query)
    loaded.storage_context.vector_store.client.close()
    loaded.storage_context.vector_store.client.close()


class LazyCollectionVectorStore(DictVectorStore):
    """Like most integrations (Qdrant, LanceDB, ...), it creates its collection on the first
    add: until then, every read fails with the integration's own "not found" error."""

    _created: bool = PrivateAttr(default=False)

    def _check(self) -> None:
        if not self._created:
            msg = "Collection raptor not found"
            raise ValueError(msg)

    def add(self, nodes: Sequence[BaseNode], **kwargs: Any) -> list[str]:
        self._created = True
        return super().add(nodes, **kwargs)

    def get_nodes(
        self, node_ids: list[str] | None = None, filters: Any = None, **kwargs: Any
    ) -> list[BaseNode]:
        self._check()
        return super().get_nodes(node_ids, filters, **kwargs)

    def delete_nodes(
        self, node_ids: list[str] | None = None, filters: Any = None, **kwargs: Any
    ) -> None:
        self._check()
        super().delete_nodes(node_ids, filters, **kwargs)

    def query(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        self._check()
        return super().query(query, **kwargs)


def test_a_collection_created_on_the_first_write_is_an_empty_store() -> None:
    vector_store = LazyCollectionVectorStore()
    store = LlamaIndexNodeStore(vector_store)
    assert len(store) == 0 and store.dim is None and list(store) == []
    assert store.search(np.ones(32, dtype=np.float32), 3) == []
    store.delete(["L0-nothing"])  # nothing to delete yet: no error
    context = StorageContext.from_defaults(vector_store=vector_store)
    index = RaptorIndex.from_documents(documents(), storage_context=context, **options())
    reference = RaptorIndex.from_documents(documents(), **options())
    assert answers(index, "cats sleep in the sun") == answers(reference, "cats sleep in the sun")
    # Any other failure is the store's, and surfaces.
    broken = LazyCollectionVectorStore()
    broken._check = lambda: (_ for _ in ()).throw(ConnectionError("host not found"))  # type: ignore[method-assign]
    with pytest.raises(ConnectionError, match="host not found"):
        len(LlamaIndexNodeStore(broken))


def test_an_index_in_milvus_reopens_and_updates(tmp_path: Path) -> None:
    # Milvus Lite in a file: the integration lists nothing without a filter, and a query
    # returns at most 16,384 entities; the backend reads the collection with an iterator.
    uri = str(tmp_path / "milvus.db")
    store = MilvusVectorStore(uri=uri, dim=32, overwrite=True, similarity_metric="IP")
    index = RaptorIndex.from_documents(
        documents(), storage_context=StorageContext.from_defaults(vector_store=store), **options()
    )
    reference = RaptorIndex.from_documents(documents(), **options())
    query = "cats sleep in the sun"
    assert answers(index, query, similarity_top_k=4) == answers(
        reference, query, similarity_top_k=4
    )
    index.storage_context.persist(persist_dir=tmp_path / "index")
    store.client.close()
    loaded = reopen_index(
        tmp_path / "index", MilvusVectorStore(uri=uri, dim=32, similarity_metric="IP")
    )
    assert_reopened_like(loaded, reference, query)


def test_a_faiss_index_that_cannot_return_its_vectors_is_refused_clearly() -> None:
    # IndexIDMap (unlike IndexIDMap2) cannot reconstruct a vector from its id.
    index = faiss.IndexIDMap(faiss.IndexFlatIP(32))
    store = LlamaIndexNodeStore(FaissMapVectorStore(faiss_index=index))
    tree = store_tree(32)
    store.add_tree(tree)
    with pytest.raises(InvalidParameterError, match="cannot return its stored vectors"):
        store.search(tree.embeddings[0], 3)


def test_the_recorded_embedder_is_recreated_on_load(tmp_path: Path) -> None:
    index = RaptorIndex.from_documents(documents(), **options())
    index.storage_context.persist(persist_dir=tmp_path)
    loaded = load_index_from_storage(StorageContext.from_defaults(persist_dir=tmp_path))
    assert answers(loaded, "bread") == answers(index, "bread")
    with pytest.raises(InvalidParameterError, match="dimensions"):
        load_index_from_storage(
            StorageContext.from_defaults(persist_dir=tmp_path), embed_model=FakeEmbedder(16)
        )


def test_updates_are_written_into_the_vector_store() -> None:
    index = RaptorIndex.from_documents(documents(), **options())
    vector_store = index.storage_context.vector_store
    retriever = index.as_retriever(similarity_top_k=3)
    index.insert(Document(text="Volcanoes erupt lava. Magma rises from the mantle.", id_="volcano"))
    assert set(vector_store.data.embedding_dict) == {n.id for n in index.tree.nodes}
    assert (
        "volcano" in retriever.retrieve("volcanoes erupt lava")[0].node.metadata["raptor_doc_ids"]
    )
    index.delete_ref_doc("cats")
    ids = set(vector_store.data.embedding_dict)
    assert ids == {n.id for n in index.tree.nodes}
    assert not any(n.doc_id == "cats" for n in index.store)
    assert len(index.storage_context.docstore.docs) == len(ids)
    index.update_ref_doc(Document(text="Bread needs flour, water and salt.", id_="bread"))
    assert "flour" in " ".join(n.text for n in index.store if n.doc_id == "bread")
    with pytest.raises(InvalidInputError, match="cats"):
        index.delete_ref_doc("cats")
    with pytest.raises(InvalidParameterError, match="delete_ref_doc"):
        index.delete_nodes([index.tree.leaves[0].id])


def test_a_vector_store_holding_nodes_is_not_built_into() -> None:
    context = StorageContext.from_defaults(vector_store=SimpleVectorStore())
    RaptorIndex.from_documents(documents(), storage_context=context, **options())
    embedder = FakeEmbedder(32)
    with pytest.raises(InvalidParameterError, match="load_index_from_storage"):
        RaptorIndex.from_documents(
            documents(), storage_context=context, **options(embed_model=embedder)
        )
    assert embedder.calls == 0


def test_filters_are_honoured_like_the_core_where() -> None:
    index = RaptorIndex.from_documents(documents(), **options())
    by_doc = MetadataFilters(filters=[MetadataFilter(key="doc_id", value="rockets")])
    nodes = index.as_retriever(similarity_top_k=10, filters=by_doc).retrieve("cats and bread")
    assert nodes and all(n.node.ref_doc_id == "rockets" for n in nodes)
    by_topic = MetadataFilters(
        filters=[MetadataFilter(key="topic", operator=FilterOperator.IN, value=["pets", "food"])]
    )
    for strategy in ("collapsed", "traversal", "value", "passage", "mmr"):
        query = "cats sleep and bread rises"
        got = index.as_retriever(strategy=strategy, similarity_top_k=5, filters=by_topic).retrieve(
            query
        )
        want = make_retriever(
            strategy, index.tree, index.embedder, k=5, where={"topic": {"$in": ["pets", "food"]}}
        ).retrieve(query)
        assert_same_ranking(
            [(n.node.node_id, float(n.score or 0)) for n in got], [(h.id, h.score) for h in want]
        )
        assert all(set(n.node.metadata["raptor_doc_ids"]) <= {"cats", "bread"} for n in got)
    engine = index.as_query_engine(llm=MockLLM(), filters=by_doc)
    assert all(n.node.ref_doc_id == "rockets" for n in engine.query("cats").source_nodes)


def test_list_filters_contains_any_all_match_vector_store_index() -> None:
    from llama_index.core import VectorStoreIndex

    from raptor_llamaindex import RaptorEmbedding

    tags = {"cats": ["pets", "furry"], "rockets": ["space"], "bread": ["food", "baking"]}
    docs = [
        Document(text=text, id_=doc_id, metadata={"topic": topic, "tags": tags[doc_id]})
        for doc_id, (topic, text) in DOCS.items()
    ]
    # Clusters of three leaves: the first summary covers cats and rockets.
    raptor = RaptorIndex.from_documents(docs, **options(clusterer=GroupClusterer(3)))
    mixed = {n.id for n in raptor.tree.nodes if len(n.doc_ids) > 1}
    assert mixed
    plain = VectorStoreIndex.from_documents(docs, embed_model=RaptorEmbedding(FakeEmbedder(32)))
    cases = [
        (FilterOperator.CONTAINS, "pets", {"tags": {"$contains": "pets"}}),
        (FilterOperator.ANY, ["space", "food"], {"tags": {"$any": ["space", "food"]}}),
        (FilterOperator.ALL, ["baking", "food"], {"tags": {"$all": ["baking", "food"]}}),
        (FilterOperator.ALL, ["pets", "space"], {"tags": {"$all": ["pets", "space"]}}),
    ]
    query = "cats purr and rockets burn bread"
    for op, value, where in cases:
        filters = MetadataFilters(filters=[MetadataFilter(key="tags", value=value, operator=op)])
        assert core_where(filters) == where
        got = raptor.as_retriever(similarity_top_k=50, filters=filters).retrieve(query)
        want = make_retriever("collapsed", raptor.tree, raptor.embedder, k=50, where=where)
        assert_same_ranking(
            [(n.node.node_id, float(n.score or 0)) for n in got],
            [(h.id, h.score) for h in want.retrieve(query)],
        )
        # The documents found are VectorStoreIndex's (its chunks differ, its filter is the
        # same); a summary over documents whose tags differ has none, so it never passes.
        vsi = plain.as_retriever(similarity_top_k=50, filters=filters).retrieve(query)
        assert {n.node.ref_doc_id for n in got} == {n.node.ref_doc_id for n in vsi}
        assert all(n.node.metadata["tags"] == tags[str(n.node.ref_doc_id)] for n in got)
        assert not {n.node.node_id for n in got} & mixed
    for operator in (FilterOperator.TEXT_MATCH, FilterOperator.IS_EMPTY):
        refused = MetadataFilters(filters=[MetadataFilter(key="t", operator=operator, value="x")])
        with pytest.raises(InvalidParameterError, match=f"'{operator.value}'.*contains, any"):
            core_where(refused)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("builder", {"cache": "/etc"}, None),
        ("builder", {"chunk_max_tokens": "lots"}, "chunk_max_tokens"),
        ("builder", {"section_context": "yes"}, "section_context"),
        ("retriever", {"strategy": "os.system"}, "unknown strategy"),
        ("retriever", {"index": "faiss"}, "unknown retriever parameter"),
        ("params", ["not", "an", "object"], "params"),
        ("format_version", 99, "format_version"),
        ("documents", [{"doc_id": 1, "text": "x"}], "document #0"),
        # LlamaIndex's JSON loader takes these; the rebuild and the next save would not.
        ("documents", [{"doc_id": "d", "text": "x", "metadata": {"s": float("nan")}}], "nan"),
        ("documents", [{"doc_id": "d", "text": "x", "metadata": {"s": float("inf")}}], "inf"),
        ("documents", [{"doc_id": "d", "text": "\ud800"}], "surrogate"),
        ("documents", [{"doc_id": "d", "text": "x", "metadata": {"\udc00": 1}}], "UTF-8"),
        ("documents", [{"doc_id": "d", "text": "x", "metadata": {"a": _nested(40)}}], "nested"),
    ],
)
def test_a_tampered_index_store_is_refused(
    tmp_path: Path, field: str, value: Any, match: str | None
) -> None:
    RaptorIndex.from_documents(documents(), **options()).storage_context.persist(
        persist_dir=tmp_path
    )
    path = tmp_path / "index_store.json"
    saved = json.loads(path.read_text())
    (entry,) = saved["index_store/data"].values()
    data = json.loads(entry["__data__"])
    data[field] = value
    entry["__data__"] = json.dumps(data)
    path.write_text(json.dumps(saved))
    context = StorageContext.from_defaults(persist_dir=tmp_path)
    if match is None:  # dropped with a warning, never used
        loaded = load_index_from_storage(context, embed_model=FakeEmbedder(32))
        assert "cache" not in loaded._builder_kwargs
        return
    with pytest.raises(TreeFormatError, match=match):
        load_index_from_storage(context, embed_model=FakeEmbedder(32))


def test_a_builder_flag_survives_persist_and_load(tmp_path: Path) -> None:
    index = RaptorIndex.from_documents(documents(), **options(section_context=False))
    assert index.tree.params["section_context"] is False
    index.storage_context.persist(persist_dir=tmp_path)
    loaded = load_index_from_storage(
        StorageContext.from_defaults(persist_dir=tmp_path), embed_model=FakeEmbedder(32)
    )
    assert loaded._builder_kwargs["section_context"] is False


def test_unknown_load_arguments_are_refused(tmp_path: Path) -> None:
    RaptorIndex.from_documents(documents(), **options()).storage_context.persist(
        persist_dir=tmp_path
    )
    with pytest.raises(InvalidParameterError, match="similarity_top_kk"):
        load_index_from_storage(
            StorageContext.from_defaults(persist_dir=tmp_path), similarity_top_kk=3
        )


def test_legacy_persist_and_load_still_work(tmp_path: Path) -> None:
    index = RaptorIndex.from_documents(documents(), **options())
    index.persist(tmp_path)
    loaded = RaptorIndex.load(tmp_path, embed_model=FakeEmbedder(32))
    assert isinstance(loaded.storage_context.vector_store, SimpleVectorStore)
    assert answers(loaded, "cats") == answers(index, "cats")


def test_refresh_ref_docs_updates_only_what_changed() -> None:
    index = RaptorIndex.from_documents(documents(), **options())
    changed = Document(text="Bread needs flour, water and salt. Ovens bake loaves.", id_="bread")
    new = Document(text="Volcanoes erupt lava. Magma rises from the mantle.", id_="volcano")
    assert index.refresh_ref_docs([*documents()[:2], changed, new]) == [False, False, True, True]
    assert index.ref_doc_ids == ("cats", "rockets", "bread", "volcano")
    assert "flour" in " ".join(n.text for n in index.store if n.doc_id == "bread")
    assert set(index.storage_context.vector_store.data.embedding_dict) == {
        n.id for n in index.tree.nodes
    }


class CountingEmbedding(BaseEmbedding):
    """A LlamaIndex embedding model over FakeEmbedder that counts sync and async query calls."""

    _fake: FakeEmbedder = PrivateAttr(default_factory=lambda: FakeEmbedder(32))
    _calls: dict[str, int] = PrivateAttr(default_factory=dict)

    def _count(self, name: str) -> None:
        self._calls[name] = self._calls.get(name, 0) + 1

    def _get_query_embedding(self, query: str) -> list[float]:
        self._count("query")
        return self._fake.embed_query(query).tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        self._count("aquery")
        return self._fake.embed_query(query).tolist()

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._fake.embed_documents([text])[0].tolist()


async def test_async_retrieval_over_the_store_uses_the_models_async_api() -> None:
    model = CountingEmbedding()
    index = RaptorIndex.from_documents(documents(), **options(embed_model=model))
    model._calls.clear()
    retriever = index.as_retriever(similarity_top_k=3)
    nodes = await retriever.aretrieve("cats sleep")
    assert model._calls == {"aquery": 1}  # off the loop for the store, async for the model
    assert [(n.node.node_id, n.score) for n in nodes] == [
        (n.node.node_id, n.score) for n in retriever.retrieve("cats sleep")
    ]


def test_an_update_rewrites_only_the_nodes_that_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    index = RaptorIndex.from_documents(documents(), **options())
    before = {n.id for n in index.tree.nodes}
    written: list[str] = []
    add = index.store.backend.add
    monkeypatch.setattr(
        index.store.backend,
        "add",
        lambda nodes: (written.extend(n.node_id for n in nodes), add(nodes)),
    )
    index.insert(Document(text="Volcanoes erupt lava. Magma rises from the mantle.", id_="volcano"))
    after = {n.id for n in index.tree.nodes}
    assert written and set(written) <= after
    assert set(written) >= after - before  # every new node is written ...
    assert len(written) < len(after)  # ... and the unchanged chunks are not
    assert set(index.storage_context.vector_store.data.embedding_dict) == after


def test_simple_vector_store_searches_see_writes_made_through_llamaindex() -> None:
    tree = store_tree(32)
    store = LlamaIndexNodeStore(SimpleVectorStore())
    store.add_tree(tree)
    leaf = tree.leaves[0]
    q = -tree.embeddings[tree.row(leaf.id)]
    assert store.search(q, 1)[0].node.id != leaf.id  # warm the cached matrix
    # Another writer (LlamaIndex's own API) adds a node with the opposite vector.
    from dataclasses import replace

    twin = replace(leaf, id="twin", parents=())
    text_node = node_to_text_node(twin, q)
    store.vector_store.add([text_node])
    store.docstore.add_documents([text_node])  # type: ignore[union-attr]
    assert store.search(q, 1)[0].node.id == "twin"


# Any Chroma `where` is evaluated over the whole collection before the vector search
# (benchmarks/results/stores.md), so the default "no carried copies" is checked in Python.
@pytest.mark.parametrize("carried", [False, True])
def test_chroma_gets_no_where_for_the_structural_defaults(tmp_path: Path, carried: bool) -> None:
    pytest.importorskip("llama_index.vector_stores.chroma")
    import chromadb
    from llama_index.vector_stores.chroma import ChromaVectorStore

    from raptor_core.store import InMemoryNodeStore, NodeFilter
    from raptor_core.testing import store_tree

    client = chromadb.PersistentClient(path=str(tmp_path / "db"))
    collection = client.get_or_create_collection("nodes")
    chroma = LlamaIndexNodeStore(ChromaVectorStore(chroma_collection=collection))
    where = NodeFilter(include_carried=carried)
    assert chroma._filters(where) == (None, carried)  # inexact: over-fetch, check in Python
    simple = LlamaIndexNodeStore(SimpleVectorStore())
    filters, exact = simple._filters(where)
    assert exact and (filters is None) == carried
    # And the answers leave carried copies out all the same.
    tree = store_tree()
    chroma.add_tree(tree)
    sent: list[Any] = []
    query = collection.query

    def recording(*args: Any, **kwargs: Any) -> Any:
        sent.append(kwargs.get("where"))
        return query(*args, **kwargs)

    collection.query = recording  # type: ignore[method-assign]
    q = tree.embeddings[0]
    found = chroma.search(q, len(tree), where=where)
    assert sent and all(w is None for w in sent)
    memory = InMemoryNodeStore.from_tree(tree).search(q, len(tree), where=where)
    assert [m.node.id for m in found] == [m.node.id for m in memory]


def test_a_store_says_whether_it_can_list_its_nodes() -> None:
    # Strategies that would read every leaf work on the leaves a search finds when the
    # integration has no get_nodes (the default passage strategy then uses scope="found").
    assert LlamaIndexNodeStore(SimpleVectorStore()).listable is True
    assert LlamaIndexNodeStore(DictVectorStore()).listable is True

    class QueryOnly(BasePydanticVectorStore):
        stores_text: bool = False

        @property
        def client(self) -> None:
            return None

        def add(self, nodes: Sequence[BaseNode], **_: Any) -> list[str]:
            return [n.node_id for n in nodes]

        def delete(self, ref_doc_id: str, **_: Any) -> None:
            return None

        def query(self, query: VectorStoreQuery, **_: Any) -> VectorStoreQueryResult:
            return VectorStoreQueryResult(nodes=[], similarities=[], ids=[])

    from llama_index.core.storage.docstore import SimpleDocumentStore

    store = LlamaIndexNodeStore(QueryOnly(), docstore=SimpleDocumentStore())
    assert store.listable is False
    with pytest.raises(InvalidParameterError, match="no layer sizes were recorded"):
        len(store)
    with pytest.raises(InvalidParameterError, match="cannot list its nodes"):
        next(iter(store))


def test_an_index_over_a_store_that_can_only_be_searched(tmp_path: Path) -> None:
    # No get_nodes, texts in the docstore: RaptorIndex records the layer
    # sizes, and the default passage strategy works on the leaves its search finds.
    from llama_index.core.storage.docstore import SimpleDocumentStore

    vector_store = QueryOnlyVectorStore()
    context = StorageContext.from_defaults(
        vector_store=vector_store, docstore=SimpleDocumentStore()
    )
    index = RaptorIndex.from_documents(documents(), storage_context=context, **options())
    assert index.store.listable is False and len(index.store) == len(index.tree)
    retriever = index.as_retriever(similarity_top_k=100, strategy="passage", max_tokens=60)
    on_tree = make_retriever(
        "passage", index.tree, index.embedder, k=100, max_tokens=60, scope="found"
    )
    for query in ("cats sleep in the sun", "rockets and orbit"):
        got = [n.node.node_id for n in retriever.retrieve(query)]
        assert got and got == [h.id for h in on_tree.retrieve(query)]
    # Reopened from storage, the recorded sizes come back with the index.
    index.storage_context.persist(persist_dir=tmp_path)
    reopened = RaptorIndex(
        index_struct=index.index_struct,
        storage_context=index.storage_context,
        embed_model=FakeEmbedder(32),
    )
    assert len(reopened.store) == len(index.tree)
    # So does the dimension, which the store cannot tell: a wrong embed model is refused on
    # opening, not at the first query.
    assert index.index_struct.dim == index.tree.dim == reopened.store.dim
    stored = type(index.index_struct).from_dict(index.index_struct.to_dict())
    assert stored.dim == index.tree.dim
    with pytest.raises(InvalidParameterError, match="dimensions"):
        RaptorIndex(
            index_struct=stored,
            storage_context=index.storage_context,
            embed_model=FakeEmbedder(16),
        )
    stored.dim = "32"
    with pytest.raises(TreeFormatError, match="'dim' is not a vector dimension"):
        RaptorIndex(index_struct=stored, storage_context=index.storage_context)
    again = reopened.as_retriever(similarity_top_k=100, strategy="passage", max_tokens=60)
    assert [n.node.node_id for n in again.retrieve("rockets and orbit")] == [
        h.id for h in on_tree.retrieve("rockets and orbit")
    ]


# -- pre-split nodes in stores that list in their own order -------------------------------------
def _numbered_nodes(first: int, last: int) -> list[TextNode]:
    """Nodes a splitter cut from one document "long", in document order."""
    source = RelatedNodeInfo(node_id="long")
    return [
        TextNode(
            text=f"Sentence {i} says thing{i} and thing{i + 1}.",
            # Ids that do not sort in document order (Milvus lists by primary key).
            id_=f"{37 * i % 101:03d}-n{i:02d}",
            relationships={NodeRelationship.SOURCE: source},
        )
        for i in range(first, last)
    ]


def _number(node_id: str) -> int:
    return int(node_id.split("[")[0].rsplit("-n", 1)[1])


def _passage_runs(index: RaptorIndex, query: str) -> list[list[int]]:
    retriever = index.as_retriever(strategy="passage", max_tokens=60, similarity_top_k=4)
    runs = []
    for hit in retriever.retrieve(query):
        leaves = hit.node.metadata.get("raptor_leaves") or [hit.node.node_id]
        runs.append([_number(leaf) for leaf in leaves])
    return runs


@pytest.mark.filterwarnings("ignore:Payload indexes have no effect:UserWarning")
@pytest.mark.parametrize("kind", ["qdrant", "milvus"])
def test_pre_split_nodes_are_neighbours_in_document_order_whatever_the_store(
    kind: str, tmp_path: Path
) -> None:
    # Qdrant lists points by their (UUID) id, Milvus by its primary key: not in the order the
    # nodes were cut.  Passages must still join only consecutive nodes.
    if kind == "qdrant":
        store: Any = QdrantVectorStore(client=QdrantClient(":memory:"), collection_name="t")
    else:
        store = MilvusVectorStore(
            uri=str(tmp_path / "m.db"), dim=32, overwrite=True, similarity_metric="IP"
        )
    index = RaptorIndex(
        nodes=_numbered_nodes(0, 30),
        storage_context=StorageContext.from_defaults(vector_store=store),
        **options(max_layers=0),
    )
    listed = [_number(leaf.id) for leaf in index.store if leaf.layer == 0]
    assert listed == list(range(30))
    query = "thing12 thing13 thing14"
    runs = _passage_runs(index, query)
    assert any(len(run) > 1 for run in runs)
    for run in runs:
        assert run == list(range(run[0], run[0] + len(run)))
    # Nodes added to the same document later follow the ones it holds.
    index.insert_nodes(_numbered_nodes(30, 36))
    assert [_number(leaf.id) for leaf in index.store if leaf.layer == 0] == list(range(36))
    for run in _passage_runs(index, "thing31 thing32"):
        assert run == list(range(run[0], run[0] + len(run)))
