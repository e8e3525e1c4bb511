"""RaptorRetriever and the LangChain model wrappers, offline with fakes."""

from __future__ import annotations

import importlib
import sys
from typing import Any
from uuid import UUID

import numpy as np
import pytest

pytest.importorskip("langchain_core")

from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding, Embeddings
from langchain_core.language_models.fake import FakeListLLM
from langchain_core.language_models.fake_chat_models import (
    FakeListChatModel,
    GenericFakeChatModel,
    ParrotFakeChatModel,
)
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_core.tools import BaseTool, create_retriever_tool
from langchain_tests.integration_tests import RetrieversIntegrationTests

import raptor_langchain
from raptor_core.exceptions import (
    EmbeddingError,
    InvalidParameterError,
    LLMError,
    MissingDependencyError,
)
from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer, tiny_tree
from raptor_langchain import (
    LangChainEmbedder,
    LangChainLLM,
    RaptorEmbeddings,
    RaptorRetriever,
    hit_to_document,
)

TREE = tiny_tree()


class PairClusterer:
    """Groups consecutive rows in pairs: a fast, deterministic stand-in for UMAP+GMM."""

    def cluster(self, vectors: Any) -> list[list[int]]:
        n = len(vectors)
        return [list(range(i, min(i + 2, n))) for i in range(0, n, 2)]


def fast_build_options() -> dict[str, Any]:
    return {
        "tokenizer": WhitespaceTokenizer(),
        "clusterer": PairClusterer(),
        "chunk_max_tokens": 8,
        "cluster_max_tokens": 64,
        "max_layers": 2,
    }


LC_DOCS = [
    Document(
        page_content="Cats purr and sleep most of the day.", id="cats", metadata={"source": "a.md"}
    ),
    Document(
        page_content="Kittens chase string and play with cats.",
        id="kittens",
        metadata={"source": "b.md"},
    ),
    Document(
        page_content="Rockets burn fuel to reach orbit.", id="rockets", metadata={"source": "c.md"}
    ),
    Document(
        page_content="Satellites orbit the earth after launch.",
        id="sats",
        metadata={"source": "d.md"},
    ),
]


@pytest.fixture
def retriever() -> RaptorRetriever:
    # Collapsed: these tests check summaries and node counts (passages merge leaves).
    return RaptorRetriever(tree=TREE, embeddings=FakeEmbedder(dim=TREE.dim), strategy="collapsed")


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(doc.page_content for doc in docs)


PROMPT = ChatPromptTemplate.from_template("Context: {context}\n\nQuestion: {question}")


# -- public surface ----------------------------------------------------------------------------
def test_exported_names_are_pinned() -> None:
    assert sorted(raptor_langchain.__all__) == [
        "ChromaDialect",
        "GenericDialect",
        "InMemoryDialect",
        "LangChainEmbedder",
        "LangChainLLM",
        "LangChainNodeStore",
        "MilvusDialect",
        "QdrantDialect",
        "RaptorEmbeddings",
        "RaptorRetriever",
        "SEARCH_TYPES",
        "StoreDialect",
        "TracedLLM",
        "hit_to_document",
    ]


def test_import_without_langchain_core_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [
        m for m in sys.modules if m == "raptor_langchain" or m.startswith("raptor_langchain.")
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "langchain_core", None)
    with pytest.raises(
        MissingDependencyError, match=r"pip install 'raptor-retriever\[langchain\]'"
    ):
        importlib.import_module("raptor_langchain")


# -- k and per-call parameters -----------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 6])
def test_k_at_construction(k: int) -> None:
    docs = RaptorRetriever(
        tree=TREE, embeddings=FakeEmbedder(dim=TREE.dim), k=k, strategy="collapsed"
    ).invoke("cats")
    assert len(docs) == k
    assert all(isinstance(d, Document) for d in docs)


def test_default_k_is_four(retriever: RaptorRetriever) -> None:
    assert len(retriever.invoke("cats")) == 4


async def test_k_per_call_overrides_the_field(retriever: RaptorRetriever) -> None:
    assert len(retriever.invoke("cats", k=1)) == 1
    assert len(await retriever.ainvoke("cats", k=3)) == 3
    assert len(retriever.invoke("cats")) == 4  # the field is untouched


def test_k_larger_than_the_tree_returns_every_node(retriever: RaptorRetriever) -> None:
    assert len(retriever.invoke("cats", k=50)) == len(TREE)


def test_reassigned_fields_take_effect(retriever: RaptorRetriever) -> None:
    assert len(retriever.invoke("cats")) == 4
    retriever.k = 2
    assert len(retriever.invoke("cats")) == 2
    retriever.search_kwargs = {"layers": [1]}
    assert {d.metadata["raptor_layer"] for d in retriever.invoke("cats")} == {1}


def test_search_kwargs_and_per_call_overrides(retriever: RaptorRetriever) -> None:
    leaves = RaptorRetriever(
        tree=TREE,
        embeddings=FakeEmbedder(dim=TREE.dim),
        strategy="collapsed",
        search_kwargs={"layers": [0]},
    )
    assert {d.metadata["raptor_layer"] for d in leaves.invoke("cats", k=4)} == {0}
    summaries = leaves.invoke("cats", layers=[1])
    assert {d.metadata["raptor_layer"] for d in summaries} == {1}
    assert len(summaries) == 2


def test_max_tokens_bounds_the_context(retriever: RaptorRetriever) -> None:
    docs = retriever.invoke("cats", k=6, max_tokens=10)
    assert sum(TREE.node(str(d.id)).token_count for d in docs) <= 10
    assert docs


def test_invalid_parameters_raise() -> None:
    with pytest.raises(ValueError, match="strategy"):
        RaptorRetriever(tree=TREE, embeddings=FakeEmbedder(dim=TREE.dim), strategy="nope")
    with pytest.raises(ValueError):
        RaptorRetriever(tree=TREE, embeddings=FakeEmbedder(dim=TREE.dim), k=0)
    retriever = RaptorRetriever(tree=TREE, embeddings=FakeEmbedder(dim=TREE.dim))
    with pytest.raises(InvalidParameterError):
        retriever.invoke("cats", k=0)
    with pytest.raises(InvalidParameterError, match="no_such_option"):
        retriever.invoke("cats", no_such_option=1)


def test_embedder_of_wrong_dimension_fails_clearly() -> None:
    # A declared dimension is checked before the first query ...
    retriever = RaptorRetriever(tree=TREE, embeddings=FakeEmbedder(dim=TREE.dim + 1))
    with pytest.raises(InvalidParameterError, match="dimensions"):
        retriever.invoke("cats")
    # ... and an undeclared one at the first query.
    wrong = DeterministicFakeEmbedding(size=TREE.dim + 1)
    with pytest.raises(EmbeddingError, match="dimension"):
        RaptorRetriever(tree=TREE, embeddings=wrong).invoke("cats")


# -- strategies --------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["collapsed", "traversal", "value"])
async def test_vector_strategies_honour_k(strategy: str) -> None:
    retriever = RaptorRetriever(tree=TREE, embeddings=FakeEmbedder(dim=TREE.dim), strategy=strategy)
    for k in (1, 3, len(TREE)):
        docs = retriever.invoke("What do cats do all day?", k=k)
        assert len(docs) == k
        assert {d.metadata["raptor_strategy"] for d in docs} == {strategy}
        assert len(await retriever.ainvoke("What do cats do all day?", k=k)) == k


def test_traversal_and_value_metadata() -> None:
    embedder = FakeEmbedder(dim=TREE.dim)
    traversal = RaptorRetriever(tree=TREE, embeddings=embedder, strategy="traversal")
    leaf = next(d for d in traversal.invoke("cats purr", k=4) if d.metadata["raptor_layer"] == 0)
    assert leaf.metadata["raptor_path"][-1] == leaf.id
    assert len(leaf.metadata["raptor_path"]) == 2  # chosen summary, then the leaf
    value = RaptorRetriever(tree=TREE, embeddings=embedder, strategy="value")
    summary = next(d for d in value.invoke("cats purr", k=4) if d.metadata["raptor_layer"] == 1)
    evidence = summary.metadata["raptor_evidence"]
    assert evidence
    assert {chunk for chunk, _ in evidence} <= set(summary.metadata["raptor_children"])


def selecting_chat_model() -> FakeListChatModel:
    # Top layer first, then the children of the chosen summary (see raptor_core.retrieval.llm).
    return FakeListChatModel(
        responses=[
            '{"selected": [{"id": "L1.0", "reason": "about cats"}]}',
            '{"selected": [{"id": "L0.0", "reason": "says cats purr"}]}',
        ]
    )


async def test_llm_strategy_with_a_langchain_chat_model() -> None:
    retriever = RaptorRetriever(
        tree=TREE, embeddings=FakeEmbedder(dim=TREE.dim), strategy="llm", llm=selecting_chat_model()
    )
    for docs in (retriever.invoke("Do cats purr?"), await retriever.ainvoke("Do cats purr?")):
        assert [d.id for d in docs] == ["L1.0", "L0.0"]
        assert [d.metadata["raptor_reason"] for d in docs] == ["about cats", "says cats purr"]
        assert docs[1].metadata["raptor_path"] == ["L1.0", "L0.0"]


def test_llm_strategies_need_an_llm() -> None:
    for strategy in ("llm", "hybrid"):
        retriever = RaptorRetriever(
            tree=TREE, embeddings=FakeEmbedder(dim=TREE.dim), strategy=strategy
        )
        with pytest.raises(InvalidParameterError, match="llm="):
            retriever.invoke("cats")


async def test_hybrid_strategy_runs_sync_and_async() -> None:
    retriever = RaptorRetriever(
        tree=TREE,
        embeddings=FakeEmbedder(dim=TREE.dim),
        strategy="hybrid",
        llm=selecting_chat_model(),
        k=2,
    )
    assert len(retriever.invoke("Do cats purr?")) == 2
    assert len(await retriever.ainvoke("Do cats purr?")) == 2


# -- documents and metadata --------------------------------------------------------------------
def test_leaf_and_summary_metadata(retriever: RaptorRetriever) -> None:
    docs = {d.id: d for d in retriever.invoke("cats", k=len(TREE))}
    leaf, summary = docs["L0.0"], docs["L1.0"]
    assert leaf.page_content == TREE.node("L0.0").text
    assert leaf.metadata["raptor_layer"] == 0
    assert leaf.metadata["raptor_doc_id"] == "d1"
    assert leaf.metadata["raptor_span"] == [0, len(leaf.page_content)]
    assert leaf.metadata["raptor_doc_ids"] == ["d1"]
    assert leaf.metadata["raptor_children"] == []
    assert summary.metadata["raptor_layer"] == 1
    assert summary.metadata["raptor_doc_id"] is None
    assert summary.metadata["raptor_children"] == ["L0.0", "L0.1"]
    assert summary.metadata["raptor_doc_ids"] == ["d1"]
    for doc in docs.values():
        assert isinstance(doc.metadata["score"], float)
        assert doc.metadata["raptor_strategy"] == "collapsed"
        assert doc.metadata["raptor_path"] == [doc.id]


def test_documents_are_ranked_by_score(retriever: RaptorRetriever) -> None:
    scores = [d.metadata["score"] for d in retriever.invoke("rockets orbit", k=6)]
    assert scores == sorted(scores, reverse=True)


def test_user_metadata_survives_and_is_not_overwritten() -> None:
    from raptor_core.retrieval import Hit
    from raptor_core.tree import Node

    node = Node(
        id="L0.0",
        text="t",
        layer=0,
        token_count=1,
        doc_id="d",
        span=(0, 1),
        doc_ids=("d",),
        metadata={"source": "file.md", "page": 3},
    )
    hit = Hit(node=node, score=0.5, source="value", reason="relevant", evidence=(("L0.0", 0.5),))
    doc = hit_to_document(hit)
    assert doc.metadata["source"] == "file.md"
    assert doc.metadata["page"] == 3
    assert doc.metadata["raptor_reason"] == "relevant"
    assert doc.metadata["raptor_evidence"] == [["L0.0", 0.5]]


# -- callbacks ---------------------------------------------------------------------------------
class RecordingHandler(BaseCallbackHandler):
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def on_retriever_start(self, serialized: Any, query: str, **kwargs: Any) -> None:
        self.events.append(("start", query))

    def on_retriever_end(self, documents: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self.events.append(("end", len(documents)))

    def on_retriever_error(self, error: BaseException, **kwargs: Any) -> None:
        self.events.append(("error", type(error).__name__))


class AsyncRecordingHandler(AsyncCallbackHandler):
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    async def on_retriever_start(self, serialized: Any, query: str, **kwargs: Any) -> None:
        self.events.append(("start", query))

    async def on_retriever_end(self, documents: Any, **kwargs: Any) -> None:
        self.events.append(("end", len(documents)))


def test_callbacks_see_retriever_start_and_end(retriever: RaptorRetriever) -> None:
    handler = RecordingHandler()
    retriever.invoke("cats", config={"callbacks": [handler]}, k=2)
    assert handler.events == [("start", "cats"), ("end", 2)]


def test_callbacks_see_errors(retriever: RaptorRetriever) -> None:
    handler = RecordingHandler()
    with pytest.raises(InvalidParameterError):
        retriever.invoke("cats", config={"callbacks": [handler]}, k=-1)
    assert handler.events == [("start", "cats"), ("error", "InvalidParameterError")]


async def test_async_callbacks_see_retriever_start_and_end(retriever: RaptorRetriever) -> None:
    handler = AsyncRecordingHandler()
    await retriever.ainvoke("rockets", config={"callbacks": [handler]})
    assert handler.events == [("start", "rockets"), ("end", 4)]


def test_callbacks_see_the_retriever_inside_a_chain(retriever: RaptorRetriever) -> None:
    handler = RecordingHandler()
    chain = retriever | RunnableLambda(format_docs)
    chain.invoke("cats", config={"callbacks": [handler]})
    assert handler.events == [("start", "cats"), ("end", 4)]


# -- tools and chains --------------------------------------------------------------------------
def test_create_retriever_tool(retriever: RaptorRetriever) -> None:
    tool = create_retriever_tool(
        retriever, "search_notes", "Search the notes about pets and space."
    )
    assert isinstance(tool, BaseTool)
    assert tool.name == "search_notes"
    out = tool.invoke({"query": "kittens chase string"})
    assert "Kittens chase string" in out
    call = {"name": "search_notes", "args": {"query": "rockets"}, "id": "c1", "type": "tool_call"}
    message = tool.invoke(call)
    assert "Rockets" in message.content


async def test_retriever_tool_async_with_artifact(retriever: RaptorRetriever) -> None:
    tool = create_retriever_tool(
        retriever, "search_notes", "Search the notes.", response_format="content_and_artifact"
    )
    call = {"name": "search_notes", "args": {"query": "rockets"}, "id": "c1", "type": "tool_call"}
    message = await tool.ainvoke(call)
    assert all(isinstance(d, Document) for d in message.artifact)
    assert len(message.artifact) == 4


def test_tool_bound_to_a_fake_agent_model(retriever: RaptorRetriever) -> None:
    # A chat model that asks for the tool, as an agent's model would.
    tool = create_retriever_tool(retriever, "search_notes", "Search the notes.")
    call = {"name": "search_notes", "args": {"query": "orbit"}, "id": "call-1", "type": "tool_call"}
    model = GenericFakeChatModel(messages=iter([AIMessage(content="", tool_calls=[call])]))
    ai = model.invoke("What reaches orbit?")
    results = [tool.invoke(tc | {"type": "tool_call"}) for tc in ai.tool_calls]
    assert "orbit" in results[0].content


def lcel_chain(retriever: RaptorRetriever, model: Any) -> Any:
    return (
        {"context": retriever | format_docs, "question": RunnablePassthrough()}
        | PROMPT
        | model
        | StrOutputParser()
    )


def test_lcel_chain_invoke_and_batch(retriever: RaptorRetriever) -> None:
    # The parrot echoes the prompt back, so the answer shows what the retriever supplied.
    chain = lcel_chain(retriever, ParrotFakeChatModel())
    answer = chain.invoke("kittens chase string")
    assert "Kittens chase string" in answer
    assert "Question: kittens chase string" in answer
    answers = chain.batch(["kittens chase string", "rockets burn fuel"])
    assert "Kittens chase string" in answers[0]
    assert "Rockets burn fuel" in answers[1]


async def test_lcel_chain_ainvoke_and_abatch(retriever: RaptorRetriever) -> None:
    chain = lcel_chain(retriever, ParrotFakeChatModel())
    assert "Rockets burn fuel" in await chain.ainvoke("rockets burn fuel")
    answers = await chain.abatch(["cats purr", "satellites orbit"])
    assert "Cats purr" in answers[0]
    assert "Satellites orbit" in answers[1]


def test_lcel_chain_stream(retriever: RaptorRetriever) -> None:
    chain = lcel_chain(retriever, FakeListChatModel(responses=["Cats sleep a lot."]))
    chunks = list(chain.stream("cats"))
    assert len(chunks) > 1  # token by token, not one final blob
    assert "".join(chunks) == "Cats sleep a lot."


async def test_lcel_chain_astream(retriever: RaptorRetriever) -> None:
    chain = lcel_chain(retriever, FakeListChatModel(responses=["Rockets reach orbit."]))
    chunks = [chunk async for chunk in chain.astream("rockets")]
    assert len(chunks) > 1
    assert "".join(chunks) == "Rockets reach orbit."


# -- constructors and persistence --------------------------------------------------------------
def test_from_documents_with_langchain_models() -> None:
    llm = FakeListChatModel(responses=["A summary about pets and space."])
    retriever = RaptorRetriever.from_documents(
        LC_DOCS,
        embeddings=DeterministicFakeEmbedding(size=32),
        llm=llm,
        k=3,
        **fast_build_options(),
    )
    tree = retriever.tree
    assert tree.doc_ids == ("cats", "kittens", "rockets", "sats")
    summaries = [n for n in tree.nodes if n.layer > 0]
    assert summaries
    assert all(n.text == "A summary about pets and space." for n in summaries)
    assert tree.params["summarizer"]["class"].endswith("LLMSummarizer")
    docs = retriever.invoke("Rockets burn fuel to reach orbit.")
    assert len(docs) == 3
    leaf = next(
        d for d in retriever.invoke("rockets", k=len(tree)) if d.metadata["raptor_layer"] == 0
    )
    assert leaf.metadata["source"].endswith(".md")  # the LangChain document's metadata


def test_from_documents_honours_a_summary_budget() -> None:
    from raptor_core import BudgetExceededError, LLMBudget

    llm = FakeListChatModel(responses=["A summary about pets and space."])
    with pytest.raises(BudgetExceededError, match="max_summary_tokens"):
        RaptorRetriever.from_documents(
            LC_DOCS,
            embeddings=DeterministicFakeEmbedding(size=32),
            llm=llm,
            budget=LLMBudget(max_summary_tokens=5),  # less than any one summary call needs
            **fast_build_options(),
        )


async def test_afrom_documents_uses_the_async_apis() -> None:
    llm = FakeListChatModel(responses=["An async summary."])
    retriever = await RaptorRetriever.afrom_documents(
        LC_DOCS, embeddings=RaptorEmbeddings(FakeEmbedder(dim=16)), llm=llm, **fast_build_options()
    )
    assert any(n.text == "An async summary." for n in retriever.tree.nodes)
    assert len(await retriever.ainvoke("cats")) == 4


def test_from_documents_without_llm_uses_the_given_summarizer() -> None:
    summarizer = EchoSummarizer()
    retriever = RaptorRetriever.from_documents(
        LC_DOCS,
        embeddings=RaptorEmbeddings(FakeEmbedder(dim=16)),
        summarizer=summarizer,
        **fast_build_options(),
    )
    assert summarizer.calls
    assert retriever.tree.num_layers >= 2


def test_from_documents_rejects_non_documents() -> None:
    with pytest.raises(InvalidParameterError, match="Document"):
        RaptorRetriever.from_documents(["plain string"], embeddings=FakeEmbedder())  # type: ignore[list-item]


def test_from_texts_with_metadatas_and_ids() -> None:
    texts = [d.page_content for d in LC_DOCS]
    retriever = RaptorRetriever.from_texts(
        texts,
        RaptorEmbeddings(FakeEmbedder(dim=16)),
        metadatas=[{"n": i} for i in range(4)],
        ids=["a", "b", "c", "d"],
        summarizer=EchoSummarizer(),
        k=2,
        **fast_build_options(),
    )
    assert retriever.tree.doc_ids == ("a", "b", "c", "d")
    assert retriever.k == 2
    assert {n.metadata["n"] for n in retriever.tree.leaves} == {0, 1, 2, 3}
    with pytest.raises(InvalidParameterError, match="metadatas"):
        RaptorRetriever.from_texts(texts, FakeEmbedder(), metadatas=[{}])


def test_save_and_from_tree_round_trip(tmp_path: Any) -> None:
    retriever = RaptorRetriever.from_documents(
        LC_DOCS,
        embeddings=RaptorEmbeddings(FakeEmbedder(dim=16)),
        summarizer=EchoSummarizer(),
        **fast_build_options(),
    )
    retriever.save(tmp_path / "tree")
    # A raptor_core embedder is recorded in the tree: no need to pass it again.
    loaded = RaptorRetriever.from_tree(tmp_path / "tree", k=2)
    assert loaded.embeddings is None
    assert [d.id for d in loaded.invoke("rockets orbit")] == [
        d.id for d in retriever.invoke("rockets orbit", k=2)
    ]


def test_from_tree_with_a_langchain_model_needs_it_again(tmp_path: Any) -> None:
    embeddings = DeterministicFakeEmbedding(size=16)
    retriever = RaptorRetriever.from_documents(
        LC_DOCS, embeddings=embeddings, summarizer=EchoSummarizer(), **fast_build_options()
    )
    path = retriever.save(tmp_path / "tree")
    with pytest.raises(InvalidParameterError, match="embeddings="):
        RaptorRetriever.from_tree(path)
    loaded = RaptorRetriever.from_tree(path, embeddings)
    assert loaded.invoke("cats", k=1)[0].id == retriever.invoke("cats", k=1)[0].id


# -- model wrappers ----------------------------------------------------------------------------
class BrokenEmbeddings(Embeddings):
    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        raise RuntimeError("service down")

    def embed_query(self, text: str) -> list[float]:
        return [[1.0]]  # type: ignore[list-item]


async def test_langchain_embedder_returns_numpy() -> None:
    embedder = LangChainEmbedder(DeterministicFakeEmbedding(size=8))
    docs = embedder.embed_documents(["a", "b", "c"])
    assert docs.shape == (3, 8)
    assert docs.dtype == np.float32
    assert embedder.embed_query("a").shape == (8,)
    assert (await embedder.aembed_documents(["a"])).shape == (1, 8)
    assert np.allclose(await embedder.aembed_query("a"), embedder.embed_query("a"))
    assert embedder.get_params()["embeddings"].endswith("DeterministicFakeEmbedding")


def test_langchain_embedder_wraps_failures() -> None:
    embedder = LangChainEmbedder(BrokenEmbeddings())
    with pytest.raises(EmbeddingError, match="service down"):
        embedder.embed_documents(["a"])
    with pytest.raises(EmbeddingError, match="shape"):
        embedder.embed_query("a")


async def test_langchain_llm_over_chat_models_and_llms() -> None:
    chat = LangChainLLM(FakeListChatModel(responses=["from a chat model"]))
    assert chat.complete("p") == "from a chat model"
    assert await chat.acomplete("p", max_tokens=10) == "from a chat model"
    blocks = GenericFakeChatModel(
        messages=iter([AIMessage(content=[{"type": "text", "text": "block text"}])])
    )
    assert LangChainLLM(blocks).complete("p") == "block text"
    plain = LangChainLLM(FakeListLLM(responses=["from an LLM"]))
    assert plain.complete("p", max_tokens=5) == "from an LLM"
    assert await plain.acomplete("p") == "from an LLM"


def test_langchain_llm_forwards_max_tokens_only_when_asked() -> None:
    seen: list[dict[str, Any]] = []

    def model(prompt: str, **kwargs: Any) -> str:
        seen.append(kwargs)
        return "ok"

    LangChainLLM(RunnableLambda(model)).complete("p", max_tokens=7)
    LangChainLLM(RunnableLambda(model), max_tokens_kwarg="max_tokens").complete("p", max_tokens=7)
    assert seen == [{}, {"max_tokens": 7}]


async def test_langchain_llm_wraps_failures() -> None:
    def boom(prompt: str) -> str:
        raise RuntimeError("rate limited")

    with pytest.raises(LLMError, match="rate limited"):
        LangChainLLM(RunnableLambda(boom)).complete("p")
    with pytest.raises(LLMError, match="rate limited"):
        await LangChainLLM(RunnableLambda(boom)).acomplete("p")
    with pytest.raises(LLMError, match="not text"):
        LangChainLLM(RunnableLambda(lambda p: 42)).complete("p")


async def test_raptor_embeddings_over_a_core_embedder() -> None:
    core = FakeEmbedder(dim=8)
    embeddings = RaptorEmbeddings(core)
    assert isinstance(embeddings, Embeddings)
    vectors = embeddings.embed_documents(["a", "b"])
    assert len(vectors) == 2
    assert all(isinstance(x, float) for x in vectors[0])
    assert np.allclose(embeddings.embed_query("a"), core.embed_query("a"))
    assert np.allclose(await embeddings.aembed_query("a"), core.embed_query("a"))
    assert len(await embeddings.aembed_documents(["a", "b", "c"])) == 3


def test_raptor_embeddings_serve_an_in_memory_vector_store() -> None:
    from langchain_core.vectorstores import InMemoryVectorStore

    store = InMemoryVectorStore.from_documents(LC_DOCS, RaptorEmbeddings(FakeEmbedder(dim=32)))
    docs = store.as_retriever(search_kwargs={"k": 1}).invoke("Rockets burn fuel to reach orbit.")
    assert docs[0].id == "rockets"


def test_default_strategy_is_the_core_default() -> None:
    from raptor_core import DEFAULT_STRATEGY

    retriever = RaptorRetriever(tree=TREE, embeddings=FakeEmbedder(dim=TREE.dim))
    assert retriever.strategy == DEFAULT_STRATEGY == "passage"
    # No budget (the adapter's default): the k strongest leaves, one per document.
    docs = retriever.invoke("cats purr", k=3)
    assert len(docs) == 3 and all(d.metadata["raptor_layer"] == 0 for d in docs)
    # With a budget, neighbouring leaves come back as one passage.
    docs = retriever.invoke("cats purr", max_tokens=30)
    assert docs[0].id == "L0.0..L0.1" and docs[0].metadata["raptor_leaves"] == ["L0.0", "L0.1"]
    assert all(0.0 <= d.metadata["score"] <= 1.0 for d in docs)


# -- LangChain's own standard suite, over the fake tree (the real model runs in integration) ---
class TestStandardSuiteWithFakes(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[RaptorRetriever]:
        return RaptorRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"tree": TREE, "embeddings": RaptorEmbeddings(FakeEmbedder(dim=TREE.dim))}

    @property
    def retriever_query_example(self) -> str:
        return "What do cats do all day?"


class TestStandardSuiteTraversal(TestStandardSuiteWithFakes):
    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {**super().retriever_constructor_params, "strategy": "traversal"}


class TestStandardSuiteValue(TestStandardSuiteWithFakes):
    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {**super().retriever_constructor_params, "strategy": "value"}
