"""RaptorRetriever in LangChain's dialect: search_type, search_kwargs, vector stores, tracing.

Offline with fakes; the real model and a real Chroma server run in
tests/integration/test_langchain_chroma.py.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("langchain_core")

from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.runnables import RunnableLambda
from langchain_core.tracers.run_collector import RunCollectorCallbackHandler
from langchain_core.tracers.schemas import Run
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_tests.integration_tests import RetrieversIntegrationTests
from langchain_trees import TieFreeEmbedder, fast_build_options, lc_documents

from raptor_core.exceptions import InvalidParameterError
from raptor_core.retrieval.registry import make_retriever
from raptor_core.testing import FakeEmbedder, ScriptedLLM, select_first, store_tree
from raptor_core.tree import Tree
from raptor_langchain import (
    GenericDialect,
    LangChainLLM,
    LangChainNodeStore,
    RaptorEmbeddings,
    RaptorRetriever,
)

TREE = store_tree(32)


EMBEDDER = TieFreeEmbedder(dim=TREE.dim)
QUERY = "Where do bees find flowers?"


def vectorstore_with(tree: Tree = TREE) -> InMemoryVectorStore:
    vectorstore = InMemoryVectorStore(RaptorEmbeddings(EMBEDDER))
    LangChainNodeStore(vectorstore).add_tree(tree)
    return vectorstore


@pytest.fixture(params=["tree", "vectorstore"])
def source(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The same tree in memory and in a LangChain vector store."""
    if request.param == "tree":
        return {"tree": TREE, "embeddings": EMBEDDER}
    return {"vectorstore": vectorstore_with(), "embeddings": EMBEDDER}


def ids(docs: list[Any]) -> list[str]:
    return [str(d.id) for d in docs]


# -- k -----------------------------------------------------------------------------------------
def test_k_in_search_kwargs(source: dict[str, Any]) -> None:
    # It used to crash at invoke: TypeError, multiple values for keyword argument 'k'.
    retriever = RaptorRetriever(**source, search_kwargs={"k": 5})
    assert len(retriever.invoke(QUERY)) == 5
    assert len(retriever.invoke(QUERY, k=2)) == 2  # per call wins
    assert len(RaptorRetriever(**source, k=3).invoke(QUERY)) == 3


# -- search_type -------------------------------------------------------------------------------
def test_mmr_runs_the_core_mmr_strategy(source: dict[str, Any]) -> None:
    kwargs = {"k": 4, "fetch_k": 12, "lambda_mult": 0.3}
    docs = RaptorRetriever(**source, search_type="mmr", search_kwargs=kwargs).invoke(QUERY)
    assert {d.metadata["raptor_strategy"] for d in docs} == {"mmr"}
    core = make_retriever(
        "mmr", TREE, EMBEDDER, k=4, max_tokens=None, fetch_k=12, lambda_mult=0.3
    ).retrieve(QUERY)
    assert ids(docs) == [h.id for h in core]
    # MMR re-ranks the collapsed pool, so compare with the collapsed similarity ranking.
    similarity = RaptorRetriever(**source, k=4, strategy="collapsed").invoke(QUERY)
    assert ids(docs) != ids(similarity)  # diversity changes the pick (the fixture checks)
    # lambda_mult=1 is plain relevance: the similarity ranking.
    relevance = RaptorRetriever(**source, search_type="mmr", search_kwargs={"lambda_mult": 1.0})
    assert ids(relevance.invoke(QUERY, k=4)) == ids(similarity)


def test_mmr_conflicts_with_another_strategy() -> None:
    with pytest.raises(ValueError, match="mmr"):
        RaptorRetriever(tree=TREE, embeddings=EMBEDDER, search_type="mmr", strategy="traversal")
    assert RaptorRetriever(tree=TREE, embeddings=EMBEDDER, strategy="mmr").invoke(QUERY)


def test_similarity_score_threshold(source: dict[str, Any]) -> None:
    everything = RaptorRetriever(**source, k=50).invoke(QUERY)
    threshold = everything[3].metadata["score"]
    retriever = RaptorRetriever(
        **source,
        search_type="similarity_score_threshold",
        search_kwargs={"score_threshold": threshold, "k": 50},
    )
    docs = retriever.invoke(QUERY)
    assert ids(docs) == [str(d.id) for d in everything if d.metadata["score"] >= threshold]
    assert 4 <= len(docs) < len(everything)
    assert ids(retriever.invoke(QUERY, k=2)) == ids(docs)[:2]
    assert retriever.invoke(QUERY, score_threshold=1.0) == []  # nothing is that close


@pytest.mark.parametrize("strategy", ["traversal", "value"])
def test_score_threshold_applies_to_every_strategy(strategy: str) -> None:
    retriever = RaptorRetriever(
        tree=TREE,
        embeddings=EMBEDDER,
        strategy=strategy,
        search_type="similarity_score_threshold",
        search_kwargs={"score_threshold": 0.2},
    )
    plain = RaptorRetriever(tree=TREE, embeddings=EMBEDDER, strategy=strategy).invoke(QUERY)
    kept = retriever.invoke(QUERY)
    assert ids(kept) == [str(d.id) for d in plain if d.metadata["score"] >= 0.2]


def test_score_threshold_is_checked() -> None:
    with pytest.raises(ValueError, match="score_threshold"):
        RaptorRetriever(tree=TREE, embeddings=EMBEDDER, search_type="similarity_score_threshold")
    for bad in (-0.1, 1.5, "0.5", True, float("nan")):
        with pytest.raises(ValueError, match="score_threshold"):
            RaptorRetriever(
                tree=TREE,
                embeddings=EMBEDDER,
                search_type="similarity_score_threshold",
                search_kwargs={"score_threshold": bad},
            )
    with pytest.raises(ValueError, match="similarity_score_threshold"):
        RaptorRetriever(tree=TREE, embeddings=EMBEDDER, search_kwargs={"score_threshold": 0.5})


def test_unknown_search_type_and_keys_are_errors_naming_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match="'similarity', 'mmr', 'similarity_score_threshold'"):
        RaptorRetriever(tree=TREE, embeddings=EMBEDDER, search_type="hnsw")
    with pytest.raises(ValueError, match=r"'top_n'.*accepted: .*filter.*\bk\b.*window"):
        RaptorRetriever(tree=TREE, embeddings=EMBEDDER, search_kwargs={"top_n": 3})
    with pytest.raises(ValueError, match="fetch_k and lambda_mult need search_type='mmr'"):
        RaptorRetriever(tree=TREE, embeddings=EMBEDDER, search_kwargs={"fetch_k": 30})
    retriever = RaptorRetriever(tree=TREE, embeddings=EMBEDDER)
    with pytest.raises(InvalidParameterError, match=r"'no_such_option'.*accepted"):
        retriever.invoke(QUERY, no_such_option=1)
    # Strategy parameters are accepted keys.
    traversal = RaptorRetriever(
        tree=TREE, embeddings=EMBEDDER, strategy="traversal", search_kwargs={"top_k": 2}
    )
    assert traversal.invoke(QUERY)


# -- filters -----------------------------------------------------------------------------------
def test_filter_on_an_in_memory_tree_is_the_core_dialect() -> None:
    retriever = RaptorRetriever(
        tree=TREE, embeddings=EMBEDDER, k=50, search_kwargs={"filter": {"topic": "nature"}}
    )
    docs = retriever.invoke(QUERY)
    assert docs and all(d.metadata["topic"] == "nature" for d in docs)
    rockets = retriever.invoke(QUERY, filter={"doc_id": "rockets"})  # per call
    assert rockets and {tuple(d.metadata["raptor_doc_ids"]) for d in rockets} == {("rockets",)}
    both = RaptorRetriever(
        tree=TREE,
        embeddings=EMBEDDER,
        k=50,
        search_kwargs={"filter": {"topic": "nature"}, "where": {"lang": "de"}},
    ).invoke(QUERY)
    assert both and all(d.metadata["lang"] == "de" for d in both)


def test_filter_on_a_vector_store_is_the_stores_own_dialect() -> None:
    # InMemoryVectorStore filters with a callable over its documents.
    retriever = RaptorRetriever(
        vectorstore=vectorstore_with(),
        embeddings=EMBEDDER,
        k=50,
        search_kwargs={"filter": lambda doc: doc.metadata.get("lang") == "de"},
    )
    docs = retriever.invoke(QUERY)
    assert docs and all(d.metadata["lang"] == "de" for d in docs)
    # The core dialect still works on a store, as where=.
    where = RaptorRetriever(
        vectorstore=vectorstore_with(),
        embeddings=EMBEDDER,
        k=50,
        search_kwargs={"where": {"lang": "de"}},
    )
    assert ids(where.invoke(QUERY)) == ids(docs)
    with pytest.raises(InvalidParameterError, match="callable"):
        retriever.invoke(QUERY, filter={"lang": "de"})


# -- vector stores -------------------------------------------------------------------------------
def test_source_is_a_tree_or_a_vector_store() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        RaptorRetriever(embeddings=EMBEDDER)
    with pytest.raises(ValueError, match="exactly one"):
        RaptorRetriever(tree=TREE, vectorstore=vectorstore_with(), embeddings=EMBEDDER)


@pytest.mark.parametrize("strategy", ["collapsed", "traversal", "value", "mmr", "llm"])
async def test_every_strategy_answers_alike_from_a_vector_store(strategy: str) -> None:
    def retriever(**source: Any) -> RaptorRetriever:
        llm = ScriptedLLM(default=select_first(2))
        return RaptorRetriever(**source, embeddings=EMBEDDER, strategy=strategy, llm=llm, k=6)

    in_memory = retriever(tree=TREE)
    stored = retriever(vectorstore=vectorstore_with())
    for query in ("where do bees find flowers", "rocket fuel and orbit"):
        expected = [(d.id, d.metadata["score"]) for d in in_memory.invoke(query)]
        got = [(d.id, d.metadata["score"]) for d in stored.invoke(query)]
        assert {i for i, _ in got} == {i for i, _ in expected}, (strategy, query)
        assert dict(got) == pytest.approx(dict(expected), abs=1e-5)
        assert len(await stored.ainvoke(query)) == len(got)


async def test_from_documents_into_a_vector_store_and_reopen(tmp_path: Any) -> None:
    vectorstore = InMemoryVectorStore(RaptorEmbeddings(EMBEDDER))
    built = RaptorRetriever.from_documents(
        lc_documents(), vectorstore=vectorstore, k=3, **fast_build_options()
    )
    assert built.tree is None  # every layer lives in the vector store
    assert built.embeddings is vectorstore.embeddings  # the store's own model by default
    layers = {
        e["metadata"]["raptor_layer"]
        for e in vectorstore.store.values()
        if "raptor_layer" in e["metadata"]
    }
    assert layers == {0, 1, 2}
    answer = ids(built.invoke("rocket orbit"))
    # Reopen without rebuilding: the same answers, sync and async.
    reopened = RaptorRetriever.from_vectorstore(vectorstore, k=3)
    assert ids(reopened.invoke("rocket orbit")) == answer
    assert ids(await reopened.ainvoke("rocket orbit")) == answer
    assert reopened.store.params["summarizer"]["class"].endswith("EchoSummarizer")  # type: ignore[union-attr]
    # Export to the plain-file format and search it in memory: the same answers.
    loaded = RaptorRetriever.from_tree(reopened.save(tmp_path / "tree"), EMBEDDER, k=3)
    assert ids(loaded.invoke("rocket orbit")) == answer
    # The async build writes the same tree.
    other = InMemoryVectorStore(RaptorEmbeddings(EMBEDDER))
    abuilt = await RaptorRetriever.afrom_documents(
        lc_documents(), vectorstore=other, k=3, **fast_build_options()
    )
    assert set(other.store) == set(vectorstore.store)
    assert ids(await abuilt.ainvoke("rocket orbit")) == answer


def test_a_vector_store_is_built_into_only_when_empty_and_reopened_only_with_a_tree() -> None:
    vectorstore = InMemoryVectorStore(RaptorEmbeddings(EMBEDDER))
    with pytest.raises(InvalidParameterError, match="no RAPTOR tree"):
        RaptorRetriever.from_vectorstore(vectorstore)
    vectorstore.add_texts(["someone else's document"])
    with pytest.raises(InvalidParameterError, match="already holds documents"):
        RaptorRetriever.from_documents(
            lc_documents(), vectorstore=vectorstore, **fast_build_options()
        )


@pytest.mark.parametrize("dialect", ["memory", "generic"])
def test_an_interrupted_build_is_refused_on_reopening(dialect: str) -> None:
    vectorstore = InMemoryVectorStore(RaptorEmbeddings(EMBEDDER))
    store = LangChainNodeStore(
        vectorstore, dialect=GenericDialect(vectorstore) if dialect == "generic" else None
    )
    original = store.add
    calls = []

    def failing_add(nodes: Any, vectors: Any) -> None:
        calls.append(len(nodes))
        if len(calls) == 2:
            raise ConnectionError("the server went away")
        original(nodes, vectors)

    store.add = failing_add  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        store.add_tree(TREE, batch_size=5)
    assert 0 < len(LangChainNodeStore(vectorstore, dialect=store.dialect)) < len(TREE)
    with pytest.raises(InvalidParameterError, match="incomplete RAPTOR tree"):
        RaptorRetriever.from_vectorstore(vectorstore, dialect=store.dialect)


def test_a_generic_store_serves_the_retriever() -> None:
    vectorstore = InMemoryVectorStore(RaptorEmbeddings(EMBEDDER))
    dialect = GenericDialect(vectorstore)
    built = RaptorRetriever.from_documents(
        lc_documents(), vectorstore=vectorstore, dialect=dialect, k=3, **fast_build_options()
    )
    assert isinstance(built.store.dialect, GenericDialect)  # type: ignore[union-attr]
    assert built.store.listable is False  # type: ignore[union-attr]
    # It cannot be listed: the default strategy makes passages of the leaves its search
    # finds, as it does on the tree with scope="found".
    assert built._strategy() == "passage"
    in_memory = RaptorRetriever.from_documents(
        lc_documents(), EMBEDDER, k=3, search_kwargs={"scope": "found"}, **fast_build_options()
    )
    for query in ("rocket orbit", "how do bees make honey"):
        assert ids(built.invoke(query)) == ids(in_memory.invoke(query))
    assert all(doc.metadata["raptor_strategy"] == "passage" for doc in built.invoke("bees"))
    collapsed = built.model_copy(update={"strategy": "collapsed"})
    assert ids(collapsed.invoke("rocket orbit"))  # every other strategy still works there
    reopened = RaptorRetriever.from_vectorstore(vectorstore, dialect=GenericDialect(vectorstore))
    assert len(reopened.store) == len(in_memory.tree)  # type: ignore[arg-type]


# -- tracing -------------------------------------------------------------------------------------
def selecting_chat_model() -> FakeListChatModel:
    # Each call answers with the first candidate listed in the prompt is impossible for a
    # fixed list; select ids that exist in every step instead (the top layer, then layer 1).
    top = TREE.layer(TREE.top_layer)[0]
    child = TREE.node(top.children[0])
    return FakeListChatModel(
        responses=[
            f'{{"selected": [{{"id": "{top.id}", "reason": "r"}}]}}',
            f'{{"selected": [{{"id": "{child.id}", "reason": "r"}}]}}',
            '{"selected": []}',
        ]
    )


def retriever_run(handler: RunCollectorCallbackHandler) -> Run:
    (run,) = handler.traced_runs
    assert run.run_type == "retriever"
    return run


def llm_children(run: Run) -> list[Run]:
    return [child for child in run.child_runs if child.run_type == "llm"]


async def test_llm_calls_are_child_runs_of_the_retriever_run() -> None:
    for call in ("invoke", "ainvoke"):
        retriever = RaptorRetriever(
            tree=TREE, embeddings=EMBEDDER, strategy="llm", llm=selecting_chat_model()
        )
        handler = RunCollectorCallbackHandler()
        if call == "invoke":
            docs = retriever.invoke(QUERY, config={"callbacks": [handler]})
        else:
            docs = await retriever.ainvoke(QUERY, config={"callbacks": [handler]})
        run = retriever_run(handler)
        calls = llm_children(run)
        assert len(calls) == 3, call  # what was asked, one run per LLM call
        assert all(c.parent_run_id == run.id for c in calls)
        first = calls[0]
        assert first.name == "FakeListChatModel"
        assert QUERY in str(first.inputs)  # the prompt, as the tracer shows it
        assert "selected" in str(first.outputs)  # and the answer
        assert docs


async def test_core_llms_are_traced_too() -> None:
    for call in ("invoke", "ainvoke"):
        llm = ScriptedLLM(default=select_first(1))
        retriever = RaptorRetriever(tree=TREE, embeddings=EMBEDDER, strategy="llm", llm=llm, k=3)
        handler = RunCollectorCallbackHandler()
        if call == "invoke":
            retriever.invoke(QUERY, config={"callbacks": [handler]})
        else:
            await retriever.ainvoke(QUERY, config={"callbacks": [handler]})
        calls = llm_children(retriever_run(handler))
        assert [c.name for c in calls] == ["ScriptedLLM"] * len(llm.prompts), call
        assert [c.inputs["prompts"][0] for c in calls] == llm.prompts
        assert all(c.outputs and "selected" in str(c.outputs) for c in calls)


def test_hybrid_search_traces_its_judge_and_selections() -> None:
    llm = ScriptedLLM(default=select_first(1))
    retriever = RaptorRetriever(
        vectorstore=vectorstore_with(),
        embeddings=EMBEDDER,
        strategy="hybrid",
        llm=LangChainLLM(RunnableLambda(lambda prompt: llm.complete(prompt))),
        k=3,
    )
    handler = RunCollectorCallbackHandler()
    assert retriever.invoke(QUERY, config={"callbacks": [handler]})
    run = retriever_run(handler)
    children = [c for c in run.child_runs if c.run_type == "chain"]
    asked = [str(c.inputs["input"]) for c in children]
    # Every prompt is a child run (a call cancelled once k is reached may add one more).
    assert llm.prompts and all(prompt in asked for prompt in llm.prompts)
    assert any('"enough"' in prompt for prompt in asked)  # the judge was asked


def test_failed_llm_calls_are_traced_as_errors() -> None:
    llm = ScriptedLLM([RuntimeError("quota exceeded")], default=select_first(1))
    retriever = RaptorRetriever(tree=TREE, embeddings=EMBEDDER, strategy="llm", llm=llm)
    handler = RunCollectorCallbackHandler()
    retriever.invoke(QUERY, config={"callbacks": [handler]})
    calls = llm_children(retriever_run(handler))
    assert "quota exceeded" in str(calls[0].error)
    assert calls[1].error is None


def test_vector_strategies_make_no_llm_runs() -> None:
    handler = RunCollectorCallbackHandler()
    retriever = RaptorRetriever(tree=TREE, embeddings=EMBEDDER, llm=selecting_chat_model())
    retriever.invoke(QUERY, config={"callbacks": [handler]})
    assert retriever_run(handler).child_runs == []


# -- LangChain's standard suite over a vector store, for every strategy without an LLM -----------
class TestStandardSuiteOverAVectorStore(RetrieversIntegrationTests):
    strategy = "collapsed"

    @property
    def retriever_constructor(self) -> type[RaptorRetriever]:
        return RaptorRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {
            "vectorstore": vectorstore_with(),
            "embeddings": EMBEDDER,
            "strategy": self.strategy,
        }

    @property
    def retriever_query_example(self) -> str:
        return QUERY


class TestStandardSuiteOverAVectorStoreTraversal(TestStandardSuiteOverAVectorStore):
    strategy = "traversal"


class TestStandardSuiteOverAVectorStoreValue(TestStandardSuiteOverAVectorStore):
    strategy = "value"


class TestStandardSuiteOverAVectorStoreMMR(TestStandardSuiteOverAVectorStore):
    strategy = "mmr"


class TestStandardSuiteMMRInMemory(TestStandardSuiteOverAVectorStore):
    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"tree": TREE, "embeddings": EMBEDDER, "search_type": "mmr"}


def test_the_model_is_checked_against_the_store_never_created_from_it() -> None:
    vectorstore = vectorstore_with()
    with pytest.raises(InvalidParameterError, match="dimensions"):
        RaptorRetriever.from_vectorstore(vectorstore, FakeEmbedder(dim=TREE.dim + 1))
    # The manifest records the tree's model, but a store without a model of its own and no
    # embeddings= gets an error: nothing read back from the store is instantiated.
    vectorstore.embedding = None  # type: ignore[assignment]
    assert "FakeEmbedder" in LangChainNodeStore(vectorstore).params["embedder"]["class"]
    with pytest.raises(InvalidParameterError, match="no embedding model: pass embeddings="):
        RaptorRetriever.from_vectorstore(vectorstore)


def test_from_documents_into_qdrant_reopen_and_update(tmp_path: Any) -> None:
    # A real Qdrant in its local mode, on disk: point ids must be UUIDs, which tree ids are
    # not; the dialect stores each document under a UUID of its id.
    from langchain_core.documents import Document
    from langchain_qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient, models

    def vectorstore() -> QdrantVectorStore:
        client = QdrantClient(path=str(tmp_path / "qdrant"))
        if not client.collection_exists("essays"):
            client.create_collection(
                "essays",
                vectors_config=models.VectorParams(
                    size=EMBEDDER.dim, distance=models.Distance.COSINE
                ),
            )
        return QdrantVectorStore(
            client=client, collection_name="essays", embedding=RaptorEmbeddings(EMBEDDER)
        )

    store = vectorstore()
    built = RaptorRetriever.from_documents(
        lc_documents(), vectorstore=store, k=3, **fast_build_options()
    )
    memory = RaptorRetriever.from_documents(
        lc_documents(),
        vectorstore=InMemoryVectorStore(RaptorEmbeddings(EMBEDDER)),
        k=3,
        **fast_build_options(),
    )
    for query in ("rocket orbit", "bread starter", "lava and ash"):
        assert ids(built.invoke(query)) == ids(memory.invoke(query))
    store.client.close()  # local mode holds a lock on its folder
    reopened = RaptorRetriever.from_vectorstore(vectorstore(), k=3, embeddings=EMBEDDER)
    assert ids(reopened.invoke("rocket orbit")) == ids(memory.invoke("rocket orbit"))
    assert reopened.store is not None and sorted(n.id for n in reopened.store) == sorted(
        n.id
        for n in LangChainNodeStore(memory.vectorstore).to_tree().nodes  # type: ignore[arg-type]
    )
    # Updates of a reopened tree land in Qdrant as they land in the in-memory store.
    mirror = RaptorRetriever.from_vectorstore(memory.vectorstore, k=3, embeddings=EMBEDDER)  # type: ignore[arg-type]
    extra = [Document(page_content="Glaciers carve valleys. Ice flows downhill slowly.", id="ice")]
    for retriever in (reopened, mirror):
        retriever.add_documents(extra)
        retriever.delete(["rockets"])
    assert reopened.store is not None and mirror.store is not None
    assert sorted(n.id for n in reopened.store) == sorted(n.id for n in mirror.store)
    assert ids(reopened.invoke("glaciers and ice")) == ids(mirror.invoke("glaciers and ice"))
