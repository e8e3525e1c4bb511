"""RaptorRetriever against LangChain's standard retriever suite, with the real local model.

Over an in-memory tree and LangChain's FAISS store here; over a Chroma server in
tests/integration/test_langchain_chroma.py.

The tree is the session's ``real_tree`` (tests/data/multi_topic.md, built once with the
packaged all-MiniLM-L6-v2, UMAP/GMM and the extractive summariser).  Queries go through a
plain LangChain ``Embeddings`` over the same model, as a langchain-huggingface user's would.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_tests")

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.language_models.fake_chat_models import FakeListChatModel, ParrotFakeChatModel
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.tools import create_retriever_tool
from langchain_tests.integration_tests import RetrieversIntegrationTests

from raptor_langchain import LangChainNodeStore, RaptorRetriever

pytestmark = pytest.mark.integration


class MiniLMEmbeddings(Embeddings):
    """A LangChain ``Embeddings`` over the real model, standing in for HuggingFaceEmbeddings."""

    def __init__(self, embedder: Any) -> None:
        self.embedder = embedder

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.embedder.embed_documents(texts).tolist()  # type: ignore[no-any-return]

    def embed_query(self, text: str) -> list[float]:
        return self.embedder.embed_query(text).tolist()  # type: ignore[no-any-return]


class TestRaptorRetrieverStandard(RetrieversIntegrationTests):
    @pytest.fixture(autouse=True)
    def _real_model(self, real_tree: Any, st_embedder: Any) -> None:
        # Standard-suite properties cannot take fixtures: keep the session's tree at hand.
        self._params = {"tree": real_tree, "embeddings": MiniLMEmbeddings(st_embedder)}

    @property
    def retriever_constructor(self) -> type[RaptorRetriever]:
        return RaptorRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return self._params

    @property
    def retriever_query_example(self) -> str:
        return "How do honeybees tell each other where flowers are?"


class TestRaptorRetrieverStandardTraversal(TestRaptorRetrieverStandard):
    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {**self._params, "strategy": "traversal"}


class TestRaptorRetrieverStandardValue(TestRaptorRetrieverStandard):
    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {**self._params, "strategy": "value"}


class TestRaptorRetrieverStandardMMR(TestRaptorRetrieverStandard):
    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {**self._params, "search_type": "mmr"}


class TestRaptorRetrieverStandardFAISS(TestRaptorRetrieverStandard):
    """The tree in LangChain's FAISS store (langchain_community), read through FAISSDialect."""

    @pytest.fixture(autouse=True)
    def _real_model(self, real_tree: Any, st_embedder: Any) -> None:
        import faiss

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the package's sunset notice
            from langchain_community.docstore.in_memory import InMemoryDocstore
            from langchain_community.vectorstores import FAISS

        embeddings = MiniLMEmbeddings(st_embedder)
        vectorstore = FAISS(
            embedding_function=embeddings,
            index=faiss.IndexFlatL2(real_tree.dim),
            docstore=InMemoryDocstore(),
            index_to_docstore_id={},
        )
        LangChainNodeStore(vectorstore).add_tree(real_tree)
        self._params = {"vectorstore": vectorstore, "embeddings": embeddings}


@pytest.fixture
def retriever(real_tree: Any, st_embedder: Any) -> RaptorRetriever:
    return RaptorRetriever(tree=real_tree, embeddings=MiniLMEmbeddings(st_embedder))


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(doc.page_content for doc in docs)


def chain_over(retriever: RaptorRetriever, model: Any) -> Any:
    prompt = ChatPromptTemplate.from_template(
        "Answer from the context only.\n\nContext: {context}\n\nQuestion: {question}"
    )
    return (
        {"context": retriever | format_docs, "question": RunnablePassthrough()}
        | prompt
        | model
        | StrOutputParser()
    )


def test_retrieves_the_right_topic(retriever: RaptorRetriever) -> None:
    docs = retriever.invoke("What does the waggle dance tell other bees?", k=3)
    assert len(docs) == 3
    assert "waggle" in format_docs(docs).lower()
    assert all(d.metadata["score"] > 0 for d in docs)


async def test_lcel_chain_all_modes(retriever: RaptorRetriever) -> None:
    parrot = chain_over(retriever, ParrotFakeChatModel())
    assert "waggle" in parrot.invoke("What is the waggle dance?").lower()
    assert "apollo" in (await parrot.ainvoke("Who flew the Apollo 11 mission?")).lower()
    batched = parrot.batch(["How do volcanoes erupt?", "How is sourdough leavened?"])
    assert "magma" in batched[0].lower()
    assert "starter" in batched[1].lower() or "sourdough" in batched[1].lower()
    streamed = chain_over(retriever, FakeListChatModel(responses=["Bees dance."]))
    assert list(streamed.stream("bees")) == list("Bees dance.")
    assert [c async for c in streamed.astream("bees")] == list("Bees dance.")


def test_retriever_tool_with_the_real_model(retriever: RaptorRetriever) -> None:
    tool = create_retriever_tool(retriever, "essays", "Search six short essays.")
    assert "vaccine" in tool.invoke({"query": "How do vaccines train immunity?"}).lower()
