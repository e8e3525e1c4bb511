"""RaptorRetriever.add_documents / delete: incremental trees in memory and in a vector store."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("langchain_core")

from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore

from raptor_core.exceptions import InvalidInputError, InvalidParameterError
from raptor_core.testing import (
    EchoSummarizer,
    FakeEmbedder,
    GroupClusterer,
    WhitespaceTokenizer,
    check_tree_invariants,
)
from raptor_langchain import LangChainNodeStore, RaptorEmbeddings, RaptorRetriever

DIM = 32
TEXTS = {
    "cats": "Cats purr in the sun. Kittens chase string. A cat sleeps all day. Felines hunt mice.",
    "rockets": "Rockets burn fuel. Boosters lift satellites. Orbit needs speed. Engines roar.",
    "rivers": "Rivers flood the delta. Streams join the river. Banks erode slowly. Water flows.",
}
BREAD = "Bread needs flour. Yeast makes dough rise. Ovens bake the loaf. Crust turns brown."


def options() -> dict[str, Any]:
    return {
        "summarizer": EchoSummarizer(),
        "tokenizer": WhitespaceTokenizer(),
        "clusterer": GroupClusterer(2),
        "chunk_max_tokens": 8,
        "random_state": 0,
    }


def docs() -> list[Document]:
    return [
        Document(page_content=t, id=name, metadata={"topic": name}) for name, t in TEXTS.items()
    ]


def make(vectorstore: InMemoryVectorStore | None = None) -> RaptorRetriever:
    return RaptorRetriever.from_documents(
        docs(), FakeEmbedder(DIM), vectorstore=vectorstore, strategy="collapsed", k=3, **options()
    )


def test_add_and_delete_in_memory() -> None:
    retriever = make()
    before = retriever.tree
    assert before is not None
    ids = retriever.add_documents([Document(page_content=BREAD, metadata={"topic": "bread"})])
    assert ids == ["doc-0"]
    tree = retriever.tree
    assert tree is not None and tree is not before
    check_tree_invariants(tree, extractive=True)
    assert tree.doc_ids == (*before.doc_ids, "doc-0")
    assert any(d.metadata.get("topic") == "bread" for d in retriever.invoke("yeast dough flour"))

    assert retriever.delete(ids) is True
    assert retriever.tree is not None and "doc-0" not in retriever.tree.doc_ids
    assert {n.id for n in retriever.tree.nodes} == {n.id for n in before.nodes}


def test_vector_store_gets_only_the_changes() -> None:
    vectorstore = InMemoryVectorStore(RaptorEmbeddings(FakeEmbedder(DIM)))
    retriever = make(vectorstore)
    mirror = make()  # the same operations on an in-memory tree
    entries = dict(vectorstore.store)

    before = mirror.tree
    assert before is not None
    new = [Document(page_content=BREAD, id="bread", metadata={"topic": "bread"})]
    assert retriever.add_documents(new) == ["bread"]
    mirror.add_documents(new)
    after = mirror.tree
    assert after is not None
    stored = {k for k in vectorstore.store if k != "raptor-manifest"}
    assert stored == {n.id for n in after.nodes}
    check_tree_invariants(LangChainNodeStore(vectorstore).to_tree(), extractive=True)
    # Nodes that did not change (parents included) were not written again: their entries
    # are the very same objects.
    untouched = [n.id for n in before.nodes if n.id in after and after.node(n.id) == n]
    assert untouched
    assert all(vectorstore.store[i] is entries[i] for i in untouched)
    hits = retriever.invoke("yeast dough flour")
    assert any(d.metadata.get("topic") == "bread" for d in hits)

    retriever.delete(["bread"])
    mirror.delete(["bread"])
    stored = {k for k in vectorstore.store if k != "raptor-manifest"}
    assert stored == {n.id for n in mirror.tree.nodes}
    check_tree_invariants(LangChainNodeStore(vectorstore).to_tree(), extractive=True)


def test_a_metadata_only_update_rewrites_the_changed_metadata_in_the_store() -> None:
    # RaptorRetriever has no public replace (add_documents refuses a known id), so the core
    # update is committed through the path add_documents and delete use.
    vectorstore = InMemoryVectorStore(RaptorEmbeddings(FakeEmbedder(DIM)))
    retriever = make(vectorstore)
    entries = dict(vectorstore.store)
    tree = retriever._current_tree()
    relabelled = [
        Document(page_content=t, id=name, metadata={"topic": name.upper()})
        for name, t in TEXTS.items()
        if name == "rivers"
    ]
    core = retriever._core_documents(relabelled, rejoin=True, ids=["rivers"])

    result = retriever._update_builder(tree).update(tree, core)
    retriever._commit(tree, result)

    report = result.report
    assert report.summary_calls == report.embedded_chunks == report.embedded_summaries == 0
    assert report.docs_replaced == ("rivers",) and report.nodes_changed
    assert not (report.nodes_added or report.nodes_removed or report.nodes_relinked)
    stored = LangChainNodeStore(vectorstore).to_tree()
    check_tree_invariants(stored, extractive=True)
    assert [(n.id, n.text, n.children) for n in stored.nodes] == [
        (n.id, n.text, n.children) for n in tree.nodes
    ]
    leaves = [n for n in stored.leaves if n.doc_id == "rivers"]
    assert leaves and all(n.metadata.get("topic") == "RIVERS" for n in leaves)
    assert all(n.metadata.get("topic") != "RIVERS" for n in stored.leaves if n.doc_id != "rivers")
    # Only the relabelled nodes were written again.
    rewritten = {k for k in entries if vectorstore.store[k] is not entries[k]}
    assert rewritten - {"raptor-manifest"} == set(report.nodes_changed)


def test_a_reopened_store_can_be_updated() -> None:
    vectorstore = InMemoryVectorStore(RaptorEmbeddings(FakeEmbedder(DIM)))
    make(vectorstore)
    reopened = RaptorRetriever.from_vectorstore(vectorstore, embeddings=FakeEmbedder(DIM))
    reopened.add_documents([Document(page_content=BREAD, id="bread")])
    tree = LangChainNodeStore(vectorstore).to_tree()
    assert "bread" in tree.doc_ids
    check_tree_invariants(tree)


def test_async_add_and_delete() -> None:
    retriever = make()
    ids = asyncio.run(retriever.aadd_documents([Document(page_content=BREAD)], ids=["bread"]))
    assert ids == ["bread"] and retriever.tree is not None and "bread" in retriever.tree.doc_ids
    asyncio.run(retriever.adelete(["bread"]))
    assert "bread" not in retriever.tree.doc_ids


def test_mistakes_are_refused() -> None:
    retriever = make()
    with pytest.raises(InvalidParameterError, match="already in the tree"):
        retriever.add_documents([Document(page_content=BREAD, id="cats")])
    with pytest.raises(InvalidInputError, match="empty"):
        retriever.add_documents([Document(page_content="  ", id="blank")])
    with pytest.raises(InvalidParameterError, match="unknown document id"):
        retriever.delete(["nope"])
    with pytest.raises(InvalidParameterError, match="needs the document ids"):
        retriever.delete()
    with pytest.raises(InvalidParameterError, match="ids has 2 entries"):
        retriever.add_documents([Document(page_content=BREAD)], ids=["a", "b"])
