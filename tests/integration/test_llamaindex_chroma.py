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
import re
from typing import Any

import faiss
import numpy as np
import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("llama_index.vector_stores.chroma")

from llama_index.core import Document, StorageContext, load_index_from_storage
from llama_index.core.schema import NodeRelationship
from llama_index.core.vector_stores import MetadataFilter, MetadataFilters, SimpleVectorStore
from llama_index.vector_stores.chroma import ChromaVectorStore
from llama_index.vector_stores.faiss import FaissVectorStore
from llama_index.vector_stores.milvus import MilvusVectorStore
from llama_index.vector_stores.qdrant import QdrantVectorStore
from qdrant_client import QdrantClient

from raptor_core.build.builder import TreeBuilder
from raptor_core.retrieval.registry import make_retriever
from raptor_core.store import FileNodeStore
from raptor_core.testing import NodeStoreTests
from raptor_core.tree import Tree
from raptor_llamaindex import RaptorIndex
from raptor_llamaindex.index import to_core_documents
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


# -- a real multi-document corpus ----------------------------------------------------------------
TOPICS = {
    "how-honeybees-communicate": ("nature", 1973),
    "the-printing-press-and-the-spread-of-the-written-word": ("history", 1450),
    "how-volcanoes-form-and-erupt": ("nature", 1883),
    "sourdough-bread-baking": ("food", 2020),
    "the-apollo-11-mission": ("history", 1969),
    "how-vaccines-train-the-immune-system": ("medicine", 1796),
}
QUESTIONS = (
    "What does the waggle dance tell other bees?",
    "Who walked on the Moon and when?",
    "How does a starter make bread rise?",
    "What do these essays say about how ideas and knowledge spread?",
    "Why do some volcanoes erupt explosively?",
)


def essays(text: str) -> list[Document]:
    """One LlamaIndex document per essay of tests/data/multi_topic.md, with metadata."""
    docs = []
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        title, _, body = section.partition("\n")
        slug = re.sub(r"\W+", "-", title.lower()).strip("-")
        topic, year = TOPICS[slug]
        docs.append(
            Document(
                id_=slug,
                text=body.strip(),
                metadata={"title": title.strip(), "topic": topic, "year": year},
            )
        )
    return docs


@pytest.fixture(scope="session")
def essay_docs(multi_topic_text: str) -> list[Document]:
    return essays(multi_topic_text)


@pytest.fixture(scope="session")
def essay_tree(st_embedder: Any, essay_docs: list[Document]) -> Tree:
    """The six essays as one tree, built once with the real model (seed 0)."""
    return TreeBuilder(st_embedder, random_state=0).build(to_core_documents(essay_docs))


def strategy_configs() -> list[tuple[str, dict[str, Any]]]:
    """Every strategy that needs no LLM, with and without filters."""
    return [
        ("collapsed", {"k": 8, "max_tokens": 1500}),
        ("collapsed", {"k": 8, "layers": [0], "where": {"topic": "nature"}}),
        ("collapsed", {"k": 8, "where": {"year": {"$lt": 1900}}}),
        (
            "collapsed",
            {"k": 6, "where": {"$or": [{"topic": "food"}, {"doc_id": "the-apollo-11-mission"}]}},
        ),
        ("traversal", {"k": 8, "top_k": 3}),
        ("traversal", {"k": 10, "threshold": 0.2}),
        ("value", {"k": 6, "chunk_k": 12}),
        ("value", {"k": 6, "chunk_k": 12, "include": "evidence"}),
        ("passage", {"k": 5, "max_tokens": 600}),
        ("passage", {"k": 5, "where": {"topic": "history"}}),
        ("passage", {"k": 100, "max_tokens": 1000, "scope": "found"}),
        ("mmr", {"k": 6, "fetch_k": 20, "lambda_mult": 0.5}),
    ]


@pytest.mark.filterwarnings("ignore:Payload indexes have no effect:UserWarning")
def test_same_answers_everywhere(
    essay_tree: Tree, chroma_server: Any, st_embedder: Any, tmp_path: Any
) -> None:
    """Each strategy: the same node ids, in the same order, with the same scores on every store."""
    import chromadb

    simple = LlamaIndexNodeStore(SimpleVectorStore())
    embedded = LlamaIndexNodeStore(
        chroma_store(chromadb.PersistentClient(path=str(tmp_path / "db")), "essays")
    )
    server = LlamaIndexNodeStore(
        chroma_store(chroma_server.client(), collection_name("essays"), "cosine")
    )
    # LlamaIndex's FAISS integration (a real FAISS index, labels mapped through the docstore).
    faiss_store = LlamaIndexNodeStore(
        FaissVectorStore(faiss_index=faiss.IndexFlatL2(essay_tree.dim))
    )
    # Qdrant (local mode): UUID point ids, its collection scrolled in pages.
    qdrant_store = LlamaIndexNodeStore(
        QdrantVectorStore(client=QdrantClient(":memory:"), collection_name="essays")
    )
    # Milvus Lite (a local file): read with its query iterator.
    milvus_store = LlamaIndexNodeStore(
        MilvusVectorStore(
            uri=str(tmp_path / "milvus.db"), dim=essay_tree.dim, overwrite=True,
            similarity_metric="IP",
        )
    )  # fmt: skip
    for store in (simple, embedded, server, faiss_store, qdrant_store, milvus_store):
        store.add_tree(essay_tree)
    sources: dict[str, Any] = {
        "tree": essay_tree,
        "file, opened lazily": FileNodeStore.open(essay_tree.save(tmp_path / "tree")),
        "SimpleVectorStore": simple,
        "Chroma embedded": embedded,
        "Chroma server": server,
        "FaissVectorStore": faiss_store,
        "QdrantVectorStore": qdrant_store,
        "MilvusVectorStore": milvus_store,
    }
    assert sum(len(essay_tree.layer(i)) for i in range(essay_tree.num_layers)) > 30
    for question in QUESTIONS:
        vector = st_embedder.embed_query(question)  # once: the model is the slow part
        for strategy, params in strategy_configs():
            answers = {}
            for name, source in sources.items():
                retriever = make_retriever(strategy, source, st_embedder, **params)
                hits = retriever.retrieve(question, embedding=vector)
                answers[name] = [(h.id, h.score) for h in hits]
            expected = answers.pop("tree")
            assert expected, (strategy, params, question)
            for name, got in answers.items():
                where = (name, strategy, params, question)
                assert [i for i, _ in got] == [i for i, _ in expected], where
                np.testing.assert_allclose(
                    [s for _, s in got], [s for _, s in expected], atol=1e-5, err_msg=str(where)
                )


def test_deep_searches_are_answered_by_an_exact_scan(
    essay_tree: Tree, st_embedder: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # chromadb returns at most 32,765 results (one SQL variable each): past EXACT_QUERY_FROM
    # the backend reads the records a page at a time, filters and ranks them itself.  With
    # the threshold at 1 every search takes that path, filters and id restrictions included.
    import chromadb

    from raptor_llamaindex import _backends

    store = LlamaIndexNodeStore(
        chroma_store(chromadb.PersistentClient(path=str(tmp_path / "db")), "essays", "cosine")
    )
    store.add_tree(essay_tree)
    calls: list[int] = []
    real_pages = _backends.ChromaBackend._pages

    def pages(self: Any, include: list[str]) -> Any:
        calls.append(1)
        return real_pages(self, include)

    monkeypatch.setattr(_backends.ChromaBackend, "_pages", pages)
    monkeypatch.setattr(_backends, "BATCH", 7)  # several pages
    monkeypatch.setattr(_backends, "EXACT_QUERY_FROM", 1)
    for question in QUESTIONS[:2]:
        vector = st_embedder.embed_query(question)
        for strategy, params in strategy_configs():
            expected, got = (
                make_retriever(strategy, source, st_embedder, **params).retrieve(
                    question, embedding=vector
                )
                for source in (essay_tree, store)
            )
            where = (strategy, params, question)
            assert expected and [h.id for h in got] == [h.id for h in expected], where
            np.testing.assert_allclose(
                [h.score for h in got], [h.score for h in expected], atol=1e-5, err_msg=str(where)
            )
    assert calls  # the exact path ran


# -- RaptorIndex over Chroma ---------------------------------------------------------------------
def test_index_in_chroma_server_persist_and_reload(
    chroma_server: Any, essay_docs: list[Document], st_embedder: Any, tmp_path: Any
) -> None:
    """Build into a Chroma collection, persist the storage context, reopen from a new client."""
    name = collection_name("index")
    vector_store = chroma_store(chroma_server.client(), name, "cosine")
    index = RaptorIndex.from_documents(
        essay_docs,
        storage_context=StorageContext.from_defaults(vector_store=vector_store),
        embed_model=st_embedder,
        random_state=0,
        similarity_top_k=5,
        strategy="collapsed",
    )
    tree = index.tree
    assert vector_store.client.count() == len(tree)
    # Chroma holds every layer as LlamaIndex nodes, linked to their documents and children.
    summary = next(n for n in tree.nodes if n.layer == 1 and len(n.children) > 1)
    (stored,) = vector_store.get_nodes(node_ids=[summary.id])
    children = stored.relationships[NodeRelationship.CHILD]
    assert [c.node_id for c in children] == list(summary.children)  # type: ignore[union-attr]
    leaf = tree.leaves[0]
    (stored_leaf,) = vector_store.get_nodes(node_ids=[leaf.id])
    assert stored_leaf.ref_doc_id == leaf.doc_id
    question = "Who walked on the Moon and when?"
    before = [(n.node.node_id, n.score) for n in index.as_retriever().retrieve(question)]
    index.storage_context.persist(persist_dir=tmp_path / "index")

    reopened = chroma_store(chroma_server.client(), name)
    loaded = load_index_from_storage(
        StorageContext.from_defaults(persist_dir=tmp_path / "index", vector_store=reopened),
        embed_model=st_embedder,
    )
    assert isinstance(loaded, RaptorIndex)
    after = [(n.node.node_id, n.score) for n in loaded.as_retriever().retrieve(question)]
    assert [i for i, _ in after] == [i for i, _ in before]
    np.testing.assert_allclose([s for _, s in after], [s for _, s in before], atol=1e-5)
    # Users' filters, in LlamaIndex's dialect, run inside Chroma and in Python alike.
    nature = MetadataFilters(filters=[MetadataFilter(key="topic", value="nature")])
    for strategy in ("collapsed", "traversal", "value", "passage", "mmr"):
        nodes = loaded.as_retriever(strategy=strategy, filters=nature).retrieve(question)
        assert nodes, strategy
        docs = {d for n in nodes for d in n.node.metadata["raptor_doc_ids"]}
        assert docs <= {"how-honeybees-communicate", "how-volcanoes-form-and-erupt"}, strategy
    # An update rewrites only what changed in the collection.
    loaded.delete_ref_doc("sourdough-bread-baking")
    assert reopened.client.count() == len(loaded.tree)
    assert not reopened.client.get(where={"raptor_doc_id": "sourdough-bread-baking"})["ids"]


def test_index_in_embedded_chroma(
    essay_docs: list[Document], st_embedder: Any, tmp_path: Any
) -> None:
    """The same flow on an embedded PersistentClient, reopened by a second client."""
    import chromadb

    path = str(tmp_path / "db")
    vector_store = chroma_store(chromadb.PersistentClient(path=path), "raptor")
    index = RaptorIndex.from_documents(
        essay_docs[:3],
        storage_context=StorageContext.from_defaults(vector_store=vector_store),
        embed_model=st_embedder,
        random_state=0,
    )
    question = "What does the waggle dance tell other bees?"
    before = [n.node.node_id for n in index.as_retriever().retrieve(question)]
    index.storage_context.persist(persist_dir=tmp_path / "index")
    loaded = load_index_from_storage(
        StorageContext.from_defaults(
            persist_dir=tmp_path / "index",
            vector_store=chroma_store(chromadb.PersistentClient(path=path), "raptor"),
        ),
        embed_model=st_embedder,
    )
    assert [n.node.node_id for n in loaded.as_retriever().retrieve(question)] == before


def test_foreign_records_in_the_collection_are_never_returned(tmp_path: Any) -> None:
    """A record written by someone else (no LlamaIndex node content) is left alone."""
    import chromadb

    from raptor_core.testing import store_tree

    client = chromadb.PersistentClient(path=str(tmp_path / "db"))
    vector_store = chroma_store(client, "mixed")
    store = LlamaIndexNodeStore(vector_store)
    tree = store_tree(32)
    store.add_tree(tree)
    vector_store.client.add(
        ids=["foreign"], embeddings=[tree.embeddings[0].tolist()], documents=["not ours"],
        metadatas=[{"source": "elsewhere"}],
    )  # fmt: skip
    assert {n.id for n in store} == {n.id for n in tree.nodes}
    found = store.search(tree.embeddings[0], 3)
    assert found and "foreign" not in {m.node.id for m in found}
    assert store.get(["foreign", tree.nodes[0].id])[0].id == tree.nodes[0].id
