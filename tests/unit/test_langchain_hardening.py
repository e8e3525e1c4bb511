"""The LangChain adapter against misuse and damaged data: pickling, a misplaced argument,
bad search keywords at construction, a store's damaged manifest."""

from __future__ import annotations

import asyncio
import copy
import json
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import faiss
import pytest

pytest.importorskip("langchain_core")

with warnings.catch_warnings():
    # langchain-community announces its sunset on import.
    warnings.simplefilter("ignore", DeprecationWarning)
    from langchain_community.docstore.in_memory import InMemoryDocstore
    from langchain_community.vectorstores import FAISS

from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore, VectorStore

from raptor_core.exceptions import InvalidParameterError, TreeFormatError
from raptor_core.testing import EchoSummarizer, FakeEmbedder, tiny_tree
from raptor_core.tree import Node
from raptor_langchain import GenericDialect, LangChainNodeStore, RaptorEmbeddings, RaptorRetriever
from raptor_langchain.store import MANIFEST_ID

DIM = 32
TEXTS = [
    "Cats purr softly. Kittens chase string. A cat grooms its fur. " * 3,
    "Rockets burn fuel. Boosters land on barges. Satellites reach orbit. " * 3,
]
DOCS = [Document(page_content=text, id=f"doc{i}") for i, text in enumerate(TEXTS)]
BUILD: dict[str, Any] = {"summarizer": EchoSummarizer(), "random_state": 0, "chunk_max_tokens": 20}


def in_memory() -> VectorStore:
    return InMemoryVectorStore(RaptorEmbeddings(FakeEmbedder(dim=DIM)))


def faiss_store() -> VectorStore:
    return FAISS(
        embedding_function=RaptorEmbeddings(FakeEmbedder(dim=DIM)),
        index=faiss.IndexFlatL2(DIM),
        docstore=InMemoryDocstore(),
        index_to_docstore_id={},
    )


def round_trip(retriever: RaptorRetriever) -> RaptorRetriever:
    copied = pickle.loads(pickle.dumps(retriever))  # our own bytes
    assert isinstance(copied, RaptorRetriever)
    return copied


def answers(retriever: RaptorRetriever) -> list[tuple[str | None, str]]:
    return [(d.id, d.page_content) for d in retriever.invoke("cats and kittens", k=3)]


# -- pickling a retriever over a vector store ------------------------------------------------
@pytest.mark.parametrize("make_store", [in_memory, faiss_store])
@pytest.mark.parametrize("copier", [round_trip, copy.deepcopy])
def test_a_retriever_over_a_vector_store_pickles_and_deep_copies(
    make_store: Callable[[], VectorStore], copier: Callable[[Any], Any]
) -> None:
    store = make_store()
    built = RaptorRetriever.from_documents(DOCS, FakeEmbedder(dim=DIM), vectorstore=store, **BUILD)
    reopened = RaptorRetriever.from_vectorstore(store, strategy="collapsed")
    for retriever in (built, reopened):
        copied = copier(retriever)
        assert answers(copied) == answers(retriever)


def test_a_copied_store_embeds_again_with_a_fresh_lock_and_cache() -> None:
    # The generic dialect scores what the store returns by embedding it again: the cache
    # and its lock are recreated, not shared with the original.
    vectorstore = in_memory()
    store = LangChainNodeStore(vectorstore, dialect=GenericDialect(vectorstore))
    store.add_tree(tiny_tree(DIM))
    retriever = RaptorRetriever(
        vectorstore=vectorstore, dialect=store.dialect, strategy="collapsed"
    )
    expected = answers(retriever)
    copied = round_trip(retriever)
    copied_store = copied.store
    assert isinstance(copied_store, LangChainNodeStore)
    assert len(copied_store._embedded) == 0
    assert answers(copied) == expected
    assert len(copied_store._embedded) > 0
    assert copied_store._embedded_lock is not getattr(retriever.store, "_embedded_lock", None)


# -- from_texts with metadatas where llm goes ------------------------------------------------
def test_from_texts_refuses_metadatas_in_place_of_llm_before_embedding() -> None:
    embedder = FakeEmbedder(dim=DIM)
    metadatas = [{"source": "cats"}, {"source": "rockets"}]
    with pytest.raises(InvalidParameterError, match=r"got list.*metadatas=") as caught:
        RaptorRetriever.from_texts(TEXTS, embedder, metadatas, **BUILD)  # type: ignore[arg-type]
    assert "LangChain chat model" in str(caught.value)
    with pytest.raises(InvalidParameterError, match="metadatas="):
        asyncio.run(RaptorRetriever.afrom_texts(TEXTS, embedder, metadatas, **BUILD))  # type: ignore[arg-type]
    assert embedder.texts_embedded == 0


@pytest.mark.parametrize("llm", ["gpt-4o-mini", 3, object()])
def test_an_llm_that_is_no_model_is_refused_everywhere(llm: Any) -> None:
    embedder = FakeEmbedder(dim=DIM)
    with pytest.raises(InvalidParameterError, match="llm must be"):
        RaptorRetriever.from_documents(DOCS, embedder, llm, **BUILD)
    assert embedder.texts_embedded == 0
    with pytest.raises(InvalidParameterError, match="llm must be"):
        RaptorRetriever(tree=tiny_tree(DIM), embeddings=FakeEmbedder(dim=DIM), llm=llm)


def test_documented_from_texts_calls_still_work() -> None:
    retriever = RaptorRetriever.from_texts(
        TEXTS, FakeEmbedder(dim=DIM), None, [{"n": 1}, {"n": 2}], ids=["a", "b"], **BUILD
    )
    assert {d.metadata["n"] for d in retriever.invoke("cats", k=2)} <= {1, 2}


# -- search keywords at construction ---------------------------------------------------------
BAD_SEARCH = [
    {"search_kwargs": {"foo": 1}},
    {"search_kwargs": {"score_threshold": 0.5}},
    {"search_kwargs": {"fetch_k": 10}},
    {"search_type": "similarity_score_threshold", "search_kwargs": {"score_threshold": 2}},
    {"search_type": "best"},
    {"strategy": "nearest"},
]


@pytest.mark.parametrize("fields", BAD_SEARCH)
def test_bad_search_fields_raise_invalid_parameter_error_at_construction(
    fields: dict[str, Any], tmp_path: Any
) -> None:
    tree = tiny_tree(DIM)
    with pytest.raises(InvalidParameterError):
        RaptorRetriever(tree=tree, embeddings=FakeEmbedder(dim=DIM), **fields)
    tree.save(tmp_path / "tree")
    with pytest.raises(InvalidParameterError):
        RaptorRetriever.from_tree(tmp_path / "tree", FakeEmbedder(dim=DIM), **fields)
    vectorstore = in_memory()
    LangChainNodeStore(vectorstore).add_tree(tree)
    with pytest.raises(InvalidParameterError):
        RaptorRetriever.from_vectorstore(vectorstore, **fields)
    # The builders refuse before paying for the build.
    embedder = FakeEmbedder(dim=DIM)
    with pytest.raises(InvalidParameterError):
        RaptorRetriever.from_texts(TEXTS, embedder, **fields, **BUILD)
    with pytest.raises(InvalidParameterError):
        RaptorRetriever.from_documents(DOCS, embedder, vectorstore=in_memory(), **fields, **BUILD)
    assert embedder.texts_embedded == 0


def test_a_retriever_needs_exactly_one_source() -> None:
    with pytest.raises(InvalidParameterError, match="exactly one"):
        RaptorRetriever(embeddings=FakeEmbedder(dim=DIM))


def test_pydantic_type_errors_still_raise_a_value_error() -> None:
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        RaptorRetriever(tree=tiny_tree(DIM), embeddings=FakeEmbedder(dim=DIM), k=0)


# -- a damaged manifest ----------------------------------------------------------------------
def store_with_manifest(manifest: str | None = None) -> InMemoryVectorStore:
    vectorstore = InMemoryVectorStore(RaptorEmbeddings(FakeEmbedder(dim=DIM)))
    LangChainNodeStore(vectorstore).add_tree(tiny_tree(DIM))
    if manifest is not None:
        vectorstore.store[MANIFEST_ID]["metadata"]["raptor_manifest"] = manifest
    return vectorstore


@pytest.mark.parametrize("raw", ["[" * 100_000, "{" * 50_000, "1" * 5_000, "{not json"])
def test_an_unparsable_manifest_raises_tree_format_error(raw: str) -> None:
    vectorstore = store_with_manifest(raw)
    with pytest.raises(TreeFormatError, match="damaged"):
        _ = LangChainNodeStore(vectorstore).manifest
    with pytest.raises(TreeFormatError, match="damaged"):
        RaptorRetriever.from_vectorstore(vectorstore)


def manifest_with(**changes: Any) -> str:
    # NaN goes in as JSON writes it (json.dumps allows it by default).
    manifest = json.loads(store_with_manifest().store[MANIFEST_ID]["metadata"]["raptor_manifest"])
    manifest.update(changes)
    return json.dumps(manifest)


@pytest.mark.parametrize("dim", [float("nan"), float("inf"), 32.0, True, -3, 0, 10**12, "32"])
def test_a_damaged_recorded_dim_falls_back_to_the_store(dim: Any) -> None:
    vectorstore = store_with_manifest(manifest_with(dim=dim))
    store = LangChainNodeStore(vectorstore)
    assert store.dim == DIM
    assert answers(RaptorRetriever.from_vectorstore(vectorstore, strategy="collapsed"))
    # A write records the store's dimension, never the damaged one.
    leaf = Node(id="extra", text="Owls hunt at night.", layer=0, token_count=4, doc_id="owls")
    store.add([leaf], FakeEmbedder(dim=DIM).embed_documents([leaf.text]))
    raw = vectorstore.store[MANIFEST_ID]["metadata"]["raptor_manifest"]
    assert json.loads(raw)["dim"] == DIM


@pytest.mark.parametrize("complete", [float("nan"), "false", 1])
def test_only_a_manifest_marked_complete_true_is_complete(complete: Any) -> None:
    vectorstore = store_with_manifest(manifest_with(complete=complete))
    assert not LangChainNodeStore(vectorstore).complete
    with pytest.raises(InvalidParameterError, match="incomplete"):
        RaptorRetriever.from_vectorstore(vectorstore)
