"""RaptorRetriever in other LangChain code: findings of a user audit (wrappers, messages, docs).

Offline with fakes: deduplicating wrappers (``MultiQueryRetriever``), the messages a
LangChain user can act on, and searching a store RAPTOR wrote with LangChain's own API.
"""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("langchain_core")

from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_trees import TieFreeEmbedder, fast_build_options, lc_documents

from raptor_core.exceptions import InvalidInputError, InvalidParameterError
from raptor_core.retrieval import Hit
from raptor_core.testing import tiny_tree
from raptor_langchain import RaptorEmbeddings, RaptorRetriever, hit_to_document
from raptor_langchain.retriever import SEARCH_METADATA_KEYS
from raptor_langchain.store import MANIFEST_ID

EMBEDDER = TieFreeEmbedder(dim=64)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "langchain.md"
#: Three wordings of one question, as a query-rewriting LLM makes them.
VARIANTS = ["Where do bees find flowers?", "bees flowers dance", "How do bees show flowers?"]


def unique(documents: list[Document]) -> list[Document]:
    """LangChain's deduplication in MultiQueryRetriever (``_unique_documents``)."""
    return [doc for i, doc in enumerate(documents) if doc not in documents[:i]]


def built(**fields: Any) -> RaptorRetriever:
    return RaptorRetriever.from_documents(
        lc_documents(), EMBEDDER, k=2, strategy="collapsed", **fields, **fast_build_options()
    )


# -- wrappers that deduplicate --------------------------------------------------------------------
def test_the_same_node_from_two_queries_differs_only_in_search_metadata() -> None:
    retriever = built()
    runs = [retriever.invoke(q) for q in VARIANTS]
    together = [doc for run in runs for doc in run]
    ids = {doc.id for doc in together}
    # Today's default is kept: scores are documented, and every hit carries one.
    assert all("score" in doc.metadata for doc in together)
    assert len(unique(together)) > len(ids)  # one node, several documents: no dedup

    quiet = built(search_metadata=False)
    together = [doc for q in VARIANTS for doc in quiet.invoke(q)]
    assert {doc.id for doc in together} == ids  # the same nodes are found
    assert len(unique(together)) == len(ids)
    assert not SEARCH_METADATA_KEYS & {key for doc in together for key in doc.metadata}
    assert all("raptor_layer" in doc.metadata for doc in together)  # the node's own keys stay


def test_search_metadata_is_a_field_of_every_constructor() -> None:
    tree = tiny_tree()
    retriever = RaptorRetriever(tree=tree, embeddings=EMBEDDER, search_metadata=False)
    [doc] = retriever.invoke("cats", k=1)
    assert "score" not in doc.metadata and "raptor_path" not in doc.metadata
    # Per retriever, like k: a copy with it switched back on.
    loud = retriever.model_copy(update={"search_metadata": True})
    assert "score" in loud.invoke("cats", k=1)[0].metadata
    # The score threshold still applies: it reads the hit's score, not the metadata.
    strict = RaptorRetriever(
        tree=tree,
        embeddings=EMBEDDER,
        search_metadata=False,
        search_type="similarity_score_threshold",
        search_kwargs={"score_threshold": 1.0},
    )
    assert strict.invoke("cats") == []


def test_hit_to_document_leaves_out_every_search_key() -> None:
    node = tiny_tree().nodes[0]
    hit = Hit(
        node=node,
        score=0.5,
        source="llm",
        path=(node.id,),
        reason="it names cats",
        evidence=((node.id, 0.5),),
    )
    full = hit_to_document(hit).metadata
    assert set(full) >= SEARCH_METADATA_KEYS
    bare = hit_to_document(hit, search_metadata=False).metadata
    assert set(full) - set(bare) == SEARCH_METADATA_KEYS
    # A document's own key of the same name is the node's, not the search's: it stays.
    own = dataclasses.replace(node, metadata={**node.metadata, "score": "five stars"})
    kept = hit_to_document(dataclasses.replace(hit, node=own), search_metadata=False).metadata
    assert kept["score"] == "five stars"
    assert hit_to_document(dataclasses.replace(hit, node=own)).metadata["score"] == 0.5


def test_multi_query_retriever_returns_each_node_once() -> None:
    multi_query = pytest.importorskip("langchain_classic.retrievers.multi_query")
    from langchain_core.language_models.fake_chat_models import FakeListChatModel

    def run(retriever: RaptorRetriever) -> list[Document]:
        llm = FakeListChatModel(responses=["\n".join(VARIANTS)])
        wrapper = multi_query.MultiQueryRetriever.from_llm(retriever=retriever, llm=llm)
        return wrapper.invoke("How do bees find flowers?")

    loud = run(built())
    assert len(loud) > len({doc.id for doc in loud})  # the audit's finding, by default
    quiet = run(built(search_metadata=False))
    assert len(quiet) == len({doc.id for doc in quiet}) == len({doc.id for doc in loud})


# -- messages a LangChain user can act on ---------------------------------------------------------
def test_adding_an_id_already_in_the_tree_says_delete_first() -> None:
    retriever = built()
    with pytest.raises(InvalidParameterError, match="already in the tree") as caught:
        retriever.add_documents([Document(page_content="Bees sleep at night.", id="bees")])
    message = str(caught.value)
    assert "delete(['bees'])" in message and "add_documents" in message
    assert "update" not in message  # RaptorRetriever has no update()


def test_a_store_raptor_never_wrote_is_not_called_an_incomplete_tree() -> None:
    store = InMemoryVectorStore(RaptorEmbeddings(EMBEDDER))
    store.add_documents(
        [Document(page_content="a LangChain document", id=f"u{i}") for i in range(3)]
    )
    with pytest.raises(InvalidParameterError) as caught:
        RaptorRetriever.from_vectorstore(store)
    message = str(caught.value)
    assert "holds 3 document(s), none of which RAPTOR wrote" in message
    assert "incomplete" not in message and "interrupted" not in message
    assert "from_documents(..., vectorstore=...)" in message


def test_a_partial_tree_without_a_manifest_is_still_incomplete() -> None:
    store = InMemoryVectorStore(RaptorEmbeddings(EMBEDDER))
    RaptorRetriever.from_documents(lc_documents(), vectorstore=store, **fast_build_options())
    store.delete([MANIFEST_ID])  # what a build cut short before its manifest leaves
    with pytest.raises(InvalidParameterError, match="holds an incomplete RAPTOR tree"):
        RaptorRetriever.from_vectorstore(store)


def test_datetime_metadata_is_refused_with_what_to_do() -> None:
    doc = Document(
        page_content="Bees dance.", id="bees", metadata={"modified": datetime.datetime(2024, 1, 2)}
    )
    with pytest.raises(InvalidInputError, match=r"value\.isoformat\(\)"):
        RaptorRetriever.from_documents([doc], EMBEDDER, **fast_build_options())
    # Not converted silently: the ISO string the message asks for is what is kept.
    doc.metadata["modified"] = doc.metadata["modified"].isoformat()
    retriever = RaptorRetriever.from_documents([doc], EMBEDDER, **fast_build_options())
    assert retriever.invoke("bees")[0].metadata["modified"] == "2024-01-02T00:00:00"


# -- LangChain's own search of a store RAPTOR wrote -----------------------------------------------
def test_a_raptor_key_filter_keeps_the_manifest_out_of_an_in_memory_search() -> None:
    store = InMemoryVectorStore(RaptorEmbeddings(EMBEDDER))
    RaptorRetriever.from_documents(lc_documents(), vectorstore=store, **fast_build_options())
    everything = store.similarity_search("how the tree was built", k=100)
    assert MANIFEST_ID in {doc.id for doc in everything}  # LangChain's search finds it
    nodes = store.similarity_search(
        "how the tree was built", k=100, filter=lambda doc: "raptor_layer" in doc.metadata
    )
    assert {doc.id for doc in nodes} == {doc.id for doc in everything} - {MANIFEST_ID}


def test_a_raptor_key_filter_keeps_the_manifest_out_of_a_chroma_search(tmp_path: Path) -> None:
    pytest.importorskip("langchain_chroma")
    import chromadb
    from langchain_chroma import Chroma

    client = chromadb.PersistentClient(path=str(tmp_path / "chroma"))
    store = Chroma(
        client=client, collection_name="manifest", embedding_function=RaptorEmbeddings(EMBEDDER)
    )
    RaptorRetriever.from_documents(lc_documents(), vectorstore=store, **fast_build_options())
    everything = store.similarity_search("how the tree was built", k=100)
    assert MANIFEST_ID in {doc.id for doc in everything}
    retriever = store.as_retriever(
        search_kwargs={"k": 100, "filter": {"raptor_layer": {"$gte": 0}}}
    )
    nodes = retriever.invoke("how the tree was built")
    assert {doc.id for doc in nodes} == {doc.id for doc in everything} - {MANIFEST_ID}


def test_the_docs_say_which_searches_skip_the_manifest() -> None:
    text = " ".join(DOCS.read_text(encoding="utf-8").split())
    assert "No search returns it" not in text
    assert "No search of `RaptorRetriever` returns it" in text
    assert '{"raptor_layer": {"$gte": 0}}' in text
    assert "`search_metadata`" in text and "MultiQueryRetriever" in text
