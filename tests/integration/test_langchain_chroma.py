"""A RAPTOR tree in LangChain vector stores: a real Chroma server, embedded Chroma, the real model.

* The NodeStore conformance suite over ``langchain_chroma.Chroma`` on the session's real
  ``chroma run`` server (cosine, l2 and inner-product collections) and on an embedded
  ``PersistentClient``.
* "Same answers everywhere": six essays (tests/data/multi_topic.md), built once with the
  packaged all-MiniLM-L6-v2, UMAP/GMM and the extractive summariser; every strategy returns
  the same nodes with the same scores from the in-memory tree, the plain-file tree (loaded,
  and opened lazily as a ``FileNodeStore``), an ``InMemoryVectorStore``, the Chroma server,
  Qdrant (local mode) and LangChain's FAISS store.
* ``RaptorRetriever`` over Chroma: build, reopen from a new client, Chroma's own filters.
"""

from __future__ import annotations

import itertools
import re
import warnings
from dataclasses import replace
from typing import Any

import faiss
import numpy as np
import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_chroma")

from langchain_chroma import Chroma
from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_qdrant import QdrantVectorStore
from langchain_tests.integration_tests import RetrieversIntegrationTests
from qdrant_client import QdrantClient, models

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # langchain-community's sunset notice
    from langchain_community.docstore.in_memory import InMemoryDocstore
    from langchain_community.vectorstores import FAISS

from raptor_core import DEFAULT_STRATEGY
from raptor_core.build.builder import TreeBuilder
from raptor_core.retrieval.registry import make_retriever
from raptor_core.store import FileNodeStore
from raptor_core.testing import NodeStoreTests, ScriptedLLM, select_first
from raptor_core.tree import Tree
from raptor_core.types import Document as CoreDocument
from raptor_langchain import (
    ChromaDialect,
    GenericDialect,
    LangChainNodeStore,
    RaptorEmbeddings,
    RaptorRetriever,
)

pytestmark = pytest.mark.integration

_names = itertools.count()


def collection_name(prefix: str) -> str:
    """A new collection name per use: the server lives for the whole session."""
    return f"{prefix}-{next(_names)}"


# -- conformance -------------------------------------------------------------------------------
class TestChromaServerNodeStore(NodeStoreTests):
    space = "cosine"

    @pytest.fixture(autouse=True)
    def _server(self, chroma_server: Any) -> None:
        self._client = chroma_server.client()

    def make_store(self) -> LangChainNodeStore:
        vectorstore = Chroma(
            client=self._client,
            collection_name=collection_name(f"nodes-{self.space}"),
            collection_configuration={"hnsw": {"space": self.space}},  # type: ignore[typeddict-item]
        )
        return LangChainNodeStore(vectorstore)

    def test_the_chroma_dialect_is_used(self) -> None:
        assert isinstance(self.make_store().dialect, ChromaDialect)


class TestChromaServerNodeStoreL2(TestChromaServerNodeStore):
    """Chroma's default distance: scores are still exact cosines (read from the vectors)."""

    space = "l2"


class TestChromaServerNodeStoreIP(TestChromaServerNodeStore):
    space = "ip"


class TestEmbeddedChromaNodeStore(NodeStoreTests):
    @pytest.fixture(autouse=True)
    def _embedded(self, tmp_path: Any) -> None:
        import chromadb

        self._client = chromadb.PersistentClient(path=str(tmp_path / "chroma"))

    def make_store(self) -> LangChainNodeStore:
        return LangChainNodeStore(
            Chroma(client=self._client, collection_name=collection_name("embedded"))
        )


# -- a real multi-document corpus ----------------------------------------------------------------
TOPICS = {
    "how-honeybees-communicate": ("nature", 1973),
    "the-printing-press-and-the-spread-of-the-written-word": ("history", 1450),
    "how-volcanoes-form-and-erupt": ("nature", 1883),
    "sourdough-bread-baking": ("food", 2020),
    "the-apollo-11-mission": ("history", 1969),
    "how-vaccines-train-the-immune-system": ("medicine", 1796),
}


def essays(text: str) -> list[Document]:
    """One LangChain document per essay of tests/data/multi_topic.md, with metadata."""
    docs = []
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        title, _, body = section.partition("\n")
        slug = re.sub(r"\W+", "-", title.lower()).strip("-")
        topic, year = TOPICS[slug]
        docs.append(
            Document(
                id=slug,
                page_content=body.strip(),
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
    core = [
        CoreDocument(doc_id=str(d.id), text=d.page_content, metadata=d.metadata) for d in essay_docs
    ]
    return TreeBuilder(st_embedder, random_state=0).build(core)


@pytest.fixture(scope="session")
def chroma_essays(chroma_server: Any, essay_tree: Tree, st_embedder: Any) -> Chroma:
    """The essay tree written into a collection of the Chroma server."""
    vectorstore = Chroma(
        client=chroma_server.client(),
        collection_name="essays",
        embedding_function=RaptorEmbeddings(st_embedder),
        collection_configuration={"hnsw": {"space": "cosine"}},  # type: ignore[typeddict-item]
    )
    LangChainNodeStore(vectorstore).add_tree(essay_tree)
    return vectorstore


QUESTIONS = (
    "What does the waggle dance tell other bees?",
    "Who walked on the Moon and when?",
    "How does a starter make bread rise?",
    "What do these essays say about how ideas and knowledge spread?",
    "Why do some volcanoes erupt explosively?",
)


def strategy_configs() -> list[tuple[str, dict[str, Any]]]:
    return [
        ("collapsed", {"k": 8, "max_tokens": 1500}),
        ("collapsed", {"k": 8, "layers": [0], "where": {"topic": "nature"}}),
        ("collapsed", {"k": 8, "where": {"year": {"$lt": 1900}}}),
        ("traversal", {"k": 8, "top_k": 3}),
        ("traversal", {"k": 10, "threshold": 0.2}),
        ("value", {"k": 6, "chunk_k": 12}),
        ("value", {"k": 6, "chunk_k": 12, "include": "evidence"}),
        ("mmr", {"k": 6, "fetch_k": 20, "lambda_mult": 0.5}),
        ("llm", {"k": 5, "top_k": 2}),
        ("passage", {"k": 100, "max_tokens": 400, "scope": "found"}),
        ("passage", {"k": 100, "max_tokens": 1500, "scope": "found"}),
    ]


def test_same_answers_everywhere(
    essay_tree: Tree, chroma_essays: Chroma, st_embedder: Any, tmp_path: Any
) -> None:
    """Each strategy: the same node ids, in the same order, with the same scores on every store."""
    in_memory_vs = InMemoryVectorStore(RaptorEmbeddings(st_embedder))
    LangChainNodeStore(in_memory_vs).add_tree(essay_tree)
    # Qdrant (local mode): UUID point ids, written and read through its client.
    qdrant = QdrantClient(":memory:")
    qdrant.create_collection(
        "essays",
        vectors_config=models.VectorParams(size=essay_tree.dim, distance=models.Distance.COSINE),
    )
    qdrant_vs = QdrantVectorStore(
        client=qdrant, collection_name="essays", embedding=RaptorEmbeddings(st_embedder)
    )
    LangChainNodeStore(qdrant_vs).add_tree(essay_tree)
    # LangChain's FAISS store (langchain_community), as its docs make an empty one.
    faiss_vs = FAISS(
        embedding_function=RaptorEmbeddings(st_embedder),
        index=faiss.IndexFlatL2(essay_tree.dim),
        docstore=InMemoryDocstore(),
        index_to_docstore_id={},
    )
    LangChainNodeStore(faiss_vs).add_tree(essay_tree)
    sources: dict[str, Any] = {
        "tree": essay_tree,
        "file": Tree.load(essay_tree.save(tmp_path / "essays")),
        "file, opened lazily": FileNodeStore.open(tmp_path / "essays"),
        "InMemoryVectorStore": LangChainNodeStore(in_memory_vs),
        "Chroma server": LangChainNodeStore(chroma_essays),
        "Qdrant": LangChainNodeStore(qdrant_vs),
        "FAISS": LangChainNodeStore(faiss_vs),
    }
    assert sum(len(essay_tree.layer(i)) for i in range(essay_tree.num_layers)) > 30
    for question in QUESTIONS:
        vector = st_embedder.embed_query(question)  # once: the model is the slow part
        for strategy, params in strategy_configs():
            answers = {}
            for name, source in sources.items():
                llm = ScriptedLLM(default=select_first(2))
                retriever = make_retriever(strategy, source, st_embedder, llm=llm, **params)
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


def test_the_default_strategy_through_the_generic_vectorstore_api(
    essay_tree: Tree, chroma_essays: Chroma, st_embedder: Any
) -> None:
    """A store with no dialect (here Chroma reached only through the VectorStore API).

    It cannot list its documents, so the default strategy makes passages of the leaves its
    search finds: the answers of ``scope="found"`` on the in-memory tree, real model and
    real Chroma server.
    """
    store = LangChainNodeStore(chroma_essays, dialect=GenericDialect(chroma_essays))
    assert store.listable is False
    grown = 0
    for question in QUESTIONS:
        vector = st_embedder.embed_query(question)
        expected, got = (
            make_retriever(DEFAULT_STRATEGY, source, st_embedder, k=100, **params).retrieve(
                question, embedding=vector, max_tokens=1000
            )
            for source, params in ((essay_tree, {"scope": "found"}), (store, {}))
        )
        assert expected and [(h.id, h.leaves) for h in got] == [(h.id, h.leaves) for h in expected]
        np.testing.assert_allclose([h.score for h in got], [h.score for h in expected], atol=1e-4)
        grown += sum(1 for h in got if h.leaves)
    assert grown  # passages of several leaves, not single chunks
    retriever = RaptorRetriever(vectorstore=chroma_essays, dialect=GenericDialect(chroma_essays))
    docs = retriever.invoke("What does the waggle dance tell other bees?")
    assert docs and docs[0].metadata["raptor_strategy"] == "passage"
    assert "waggle" in " ".join(d.page_content for d in docs).lower()


def test_deep_searches_are_answered_by_an_exact_scan(
    essay_tree: Tree, chroma_essays: Chroma, st_embedder: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # chromadb returns at most 32,765 results (one SQL variable each): past EXACT_QUERY_FROM
    # the dialect reads the matching records a page at a time and ranks them itself.
    from raptor_langchain import dialects

    store = LangChainNodeStore(chroma_essays, dialect=ChromaDialect(chroma_essays, batch_size=7))
    question = QUESTIONS[3]
    vector = st_embedder.embed_query(question)
    leaves = essay_tree.layer(0)
    native = {"raptor_layer": {"$in": [0]}}
    by_hnsw = store.dialect.query(vector, len(leaves), native=native)
    monkeypatch.setattr(dialects, "EXACT_QUERY_FROM", 1)
    exact = store.dialect.query(vector, len(leaves), native=native)
    # Every leaf, in exact cosine order (pages of 7 records: several pages).
    cosines = {n.id: float(essay_tree.embeddings[essay_tree.row(n.id)] @ vector) for n in leaves}
    assert [r.document.id for r in exact] == sorted(cosines, key=lambda i: -cosines[i])
    assert {r.document.id for r in exact} == {r.document.id for r in by_hnsw}
    assert [r.document.id for r in store.dialect.query(vector, 5, native=native)] == [
        r.document.id for r in exact[:5]
    ]
    # The strategies that search deepest give the in-memory answers on the exact path.
    for strategy, params in [
        ("passage", {"k": 10**6, "max_tokens": 400}),
        ("passage", {"k": 10**6, "max_tokens": 2000}),
        ("collapsed", {"k": 8, "max_tokens": 1500}),
    ]:
        expected, got = (
            make_retriever(strategy, source, st_embedder, **params).retrieve(
                question, embedding=vector
            )
            for source in (essay_tree, store)
        )
        assert expected and [h.id for h in got] == [h.id for h in expected], (strategy, params)
        np.testing.assert_allclose([h.score for h in got], [h.score for h in expected], atol=1e-5)


# -- RaptorRetriever over Chroma -----------------------------------------------------------------
def test_the_rag_tutorial_s_splits_build_the_tree_their_essays_build(
    chroma_server: Any, essay_docs: list[Document], essay_tree: Tree, st_embedder: Any
) -> None:
    """LangChain's RAG pipeline, RAPTOR swapped in for the vector store's retriever.

    The tutorial splits with ``RecursiveCharacterTextSplitter(chunk_size=1000,
    chunk_overlap=200, add_start_index=True)``; those splits, built into a Chroma
    collection, give the tree the whole essays give (same texts, spans and metadata at
    every layer), and the default strategy's passages run across the splits' boundaries.
    """
    splitter = pytest.importorskip("langchain_text_splitters").RecursiveCharacterTextSplitter(
        chunk_size=1000, chunk_overlap=200, add_start_index=True
    )
    splits = splitter.split_documents(essay_docs)
    assert len(splits) > len(essay_docs)
    vectorstore = Chroma(
        client=chroma_server.client(),
        collection_name=collection_name("splits"),
        embedding_function=RaptorEmbeddings(st_embedder),
    )
    retriever = RaptorRetriever.from_documents(
        splits, vectorstore=vectorstore, k=10, max_tokens=1000, random_state=0
    )
    assert isinstance(retriever.store, LangChainNodeStore)
    built = retriever.store.to_tree()

    def shape(tree: Tree) -> list[tuple[int, str, Any, str]]:
        return sorted(
            (n.layer, n.text, n.span, repr(sorted(n.metadata.items()))) for n in tree.nodes
        )

    assert shape(built) == shape(essay_tree)
    # Where each split of an essay starts: a passage over more than one split crosses one.
    boundaries = {
        (d.metadata["title"], d.metadata["start_index"])
        for d in splits
        if d.metadata["start_index"] > 0
    }
    crossing = 0
    for question in QUESTIONS:
        for hit in retriever.invoke(question):
            start, end = hit.metadata["raptor_span"] or (0, 0)
            title = hit.metadata["title"]
            crossing += any(t == title and start < b < end for t, b in boundaries)
    assert crossing > 0


def test_build_into_chroma_and_reopen_from_another_client(
    chroma_server: Any, essay_docs: list[Document], st_embedder: Any
) -> None:
    name = collection_name("retriever")
    embeddings = RaptorEmbeddings(st_embedder)
    vectorstore = Chroma(
        client=chroma_server.client(), collection_name=name, embedding_function=embeddings
    )
    # Two essays keep the build short; the six-essay tree is built once for the session.
    built = RaptorRetriever.from_documents(
        essay_docs[:2], vectorstore=vectorstore, k=4, random_state=0
    )
    assert built.tree is None
    question = "How did printing change the way bees are studied?"
    answer = built.invoke(question)
    # A new process would do this: a new client, the same collection, no rebuild.
    again = Chroma(
        client=chroma_server.client(), collection_name=name, embedding_function=embeddings
    )
    reopened = RaptorRetriever.from_vectorstore(again, k=4)
    assert [d.id for d in reopened.invoke(question)] == [d.id for d in answer]
    assert reopened.store.params["embedder"]["class"].endswith("SentenceTransformerEmbedder")  # type: ignore[union-attr]
    # It stays an ordinary Chroma collection: LangChain's own search works on it.
    plain = again.similarity_search("waggle dance", k=2, filter={"raptor_layer": 0})
    assert plain and all(d.metadata["raptor_layer"] == 0 for d in plain)


def test_chroma_filters_pass_through(chroma_essays: Chroma, st_embedder: Any) -> None:
    retriever = RaptorRetriever(
        vectorstore=chroma_essays,
        embeddings=st_embedder,
        k=20,
        search_kwargs={"filter": {"topic": {"$in": ["history", "food"]}}},
    )
    docs = retriever.invoke("What changed the world?")
    assert docs and {d.metadata["topic"] for d in docs} <= {"history", "food"}
    # Chroma's own operators on RAPTOR's keys: chunks and summaries of one essay.
    apollo = retriever.invoke(
        "Who flew?",
        filter={
            "$and": [{"raptor_doc_id": "the-apollo-11-mission"}, {"raptor_layer": {"$gte": 0}}]
        },
    )
    assert apollo and {d.metadata["raptor_doc_id"] for d in apollo} == {"the-apollo-11-mission"}
    # The core dialect (where=) also runs inside Chroma, ANDed with the native filter.
    old = retriever.invoke("history", where={"year": {"$lt": 1500}})
    assert old and {d.metadata["year"] for d in old} == {1450}


def test_mmr_and_score_threshold_over_chroma(chroma_essays: Chroma, st_embedder: Any) -> None:
    question = "What does the waggle dance tell other bees?"
    similar = RaptorRetriever(vectorstore=chroma_essays, embeddings=st_embedder, k=4)
    mmr = RaptorRetriever(
        vectorstore=chroma_essays,
        embeddings=st_embedder,
        search_type="mmr",
        search_kwargs={"k": 4, "fetch_k": 30, "lambda_mult": 0.25},
    )
    plain, diverse = similar.invoke(question), mmr.invoke(question)
    assert [d.id for d in plain] != [d.id for d in diverse]
    assert len({d.metadata["raptor_doc_id"] for d in diverse}) >= len(
        {d.metadata["raptor_doc_id"] for d in plain}
    )
    threshold = RaptorRetriever(
        vectorstore=chroma_essays,
        embeddings=st_embedder,
        search_type="similarity_score_threshold",
        search_kwargs={"score_threshold": 0.5, "k": 50},
    )
    kept = threshold.invoke(question)
    assert kept and all(d.metadata["score"] >= 0.5 for d in kept)
    assert len(kept) < 50


# -- LangChain's standard suite over Chroma, for every strategy without an LLM ---------------------
class TestStandardSuiteOverChroma(RetrieversIntegrationTests):
    strategy = "collapsed"
    search_type = "similarity"

    @pytest.fixture(autouse=True)
    def _chroma(self, chroma_essays: Chroma, st_embedder: Any) -> None:
        self._params = {"vectorstore": chroma_essays, "embeddings": RaptorEmbeddings(st_embedder)}

    @property
    def retriever_constructor(self) -> type[RaptorRetriever]:
        return RaptorRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {**self._params, "strategy": self.strategy, "search_type": self.search_type}

    @property
    def retriever_query_example(self) -> str:
        return "How do honeybees tell each other where flowers are?"


class TestStandardSuiteOverChromaTraversal(TestStandardSuiteOverChroma):
    strategy = "traversal"


class TestStandardSuiteOverChromaValue(TestStandardSuiteOverChroma):
    strategy = "value"


class TestStandardSuiteOverChromaMMR(TestStandardSuiteOverChroma):
    search_type = "mmr"


def test_upserts_replace_metadata_and_deleted_collections_leave_nothing_behind(
    chroma_server: Any,
) -> None:
    """Two chromadb behaviours the Chroma dialect works around.

    Chroma's upsert merges metadata into a stored record (a key the new node lacks would
    survive), and chromadb 1.5 returns the list-valued metadata of a deleted collection's
    records on the records of a collection created after it.
    """
    from raptor_core.testing import store_tree

    client = chroma_server.client()
    tree = store_tree(32)
    first = collection_name("deleted")
    LangChainNodeStore(Chroma(client=client, collection_name=first)).add_tree(tree)
    client.delete_collection(first)
    store = LangChainNodeStore(Chroma(client=client, collection_name=collection_name("after")))
    store.add_tree(tree)
    assert {n.id: n for n in store} == {n.id: n for n in tree.nodes}
    leaf = tree.leaves[0]
    assert leaf.doc_id is not None and leaf.metadata
    orphan = replace(leaf, doc_id=None, span=None, metadata={})
    store.add([orphan], tree.embeddings[tree.row(leaf.id)][None, :])
    assert store.get([leaf.id]) == [orphan]
    stored = store.dialect.fetch([leaf.id], native=None, vectors=False)[0].document.metadata
    assert not {"raptor_doc_id", "raptor_span_start", "topic"} & set(stored)
