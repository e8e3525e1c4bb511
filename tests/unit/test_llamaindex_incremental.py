"""RaptorIndex updates through the core incremental API: local work, in-place store writes.

Every test compares the vector store before and after an update: the nodes written are
exactly those that are new or differ (text, metadata, parents, vector), the nodes deleted
exactly those gone, and every other stored record is left as it was.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import NodeRelationship, TextNode

from raptor_core.exceptions import InvalidInputError, InvalidParameterError
from raptor_core.testing import (
    EchoSummarizer,
    FakeEmbedder,
    GroupClusterer,
    WhitespaceTokenizer,
    check_tree_invariants,
)
from raptor_core.tree import Tree
from raptor_llamaindex import RaptorIndex

TOPICS = {
    "cats": "cat kitten purr whisker feline meow paw tail",
    "rockets": "rocket orbit launch fuel thrust booster satellite engine",
    "bread": "bread flour yeast dough oven crust knead loaf",
    "rivers": "river delta stream bank flood current estuary basin",
    "music": "violin cello melody rhythm chord tempo orchestra score",
    "chess": "chess knight bishop rook pawn gambit castle checkmate",
}


def text(name: str, n: int = 6, marker: str = "") -> str:
    words = TOPICS[name].split()
    return " ".join(
        f"The {words[i % 8]} and the {words[(i + 3) % 8]} meet {words[(i + 5) % 8]} {marker} {i}."
        for i in range(n)
    )


def doc(name: str, marker: str = "", **kw: Any) -> Document:
    return Document(text=text(name, marker=marker), id_=name, metadata={"topic": name}, **kw)


def options(summarizer: EchoSummarizer | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "embed_model": FakeEmbedder(32),
        "summarizer": summarizer or EchoSummarizer(),
        "tokenizer": WhitespaceTokenizer(),
        "clusterer": GroupClusterer(3),
        "chunk_max_tokens": 12,
        "summary_max_tokens": 12,
        "random_state": 0,
        **extra,
    }


BASE = ("cats", "rockets", "bread", "rivers", "music")


class StoreSpy:
    """Records the node ids RaptorIndex writes to and deletes from its vector store."""

    def __init__(self, index: RaptorIndex, monkeypatch: pytest.MonkeyPatch) -> None:
        self.written: list[str] = []
        self.deleted: list[str] = []
        store = index.store
        add, delete = store.add, store.delete

        def spy_add(nodes: Any, vectors: Any) -> None:
            self.written.extend(n.id for n in nodes)
            add(nodes, vectors)

        def spy_delete(ids: Any) -> None:
            self.deleted.extend(ids)
            delete(ids)

        monkeypatch.setattr(store, "add", spy_add)
        monkeypatch.setattr(store, "delete", spy_delete)


def snapshot(index: RaptorIndex) -> dict[str, tuple[Any, list[float]]]:
    """Every stored record as the vector store and its docstore hold it."""
    vector_store = index.storage_context.vector_store
    docstore = index.storage_context.docstore
    return {
        node_id: (docstore.get_node(node_id).to_json(), list(vector))
        for node_id, vector in vector_store.data.embedding_dict.items()
    }


def differ(before: Tree, after: Tree) -> tuple[set[str], set[str]]:
    """(ids to write, ids to delete) for ``before`` -> ``after``, from the trees alone."""
    write = {
        n.id
        for n in after.nodes
        if n.id not in before
        or before.node(n.id) != n
        or not np.array_equal(
            before.embeddings[before.row(n.id)], after.embeddings[after.row(n.id)]
        )
    }
    return write, {n.id for n in before.nodes} - {n.id for n in after.nodes}


def check_in_place(
    index: RaptorIndex,
    before: Tree,
    stored: dict[str, tuple[Any, list[float]]],
    spy: StoreSpy,
) -> set[str]:
    """The store holds the new tree, only the difference was written; returns what was."""
    after = index.tree
    write, delete = differ(before, after)
    assert set(spy.written) == write and len(spy.written) == len(write)
    assert set(spy.deleted) == delete
    now = snapshot(index)
    assert set(now) == {n.id for n in after.nodes}
    untouched = set(now) - write
    assert untouched, "an update that rewrote every node proves nothing"
    assert all(now[i] == stored[i] for i in untouched)
    return write


@pytest.fixture
def summarizer() -> EchoSummarizer:
    return EchoSummarizer()


@pytest.fixture
def index(summarizer: EchoSummarizer) -> RaptorIndex:
    built = RaptorIndex.from_documents([doc(n) for n in BASE], **options(summarizer))
    assert built.tree.num_layers >= 3
    summarizer.calls.clear()
    return built


# -- sync ------------------------------------------------------------------------------------------
def test_insert_is_local_and_writes_only_the_difference(
    index: RaptorIndex, summarizer: EchoSummarizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh = EchoSummarizer()
    RaptorIndex.from_documents([doc(n) for n in (*BASE, "chess")], **options(fresh))
    before, stored = index.tree, snapshot(index)
    spy = StoreSpy(index, monkeypatch)

    index.insert(doc("chess"))

    after = index.tree
    check_tree_invariants(after, extractive=True)
    assert after.doc_ids == (*BASE, "chess")
    report = after.build_info["incremental"]["last"]
    assert report["op"] == "insert" and report["docs_added"] == ["chess"]
    # Only the clusters the new chunks joined (and their ancestors) were summarised.
    assert 0 < len(summarizer.calls) == report["summary_calls"] < len(fresh.calls)
    written = check_in_place(index, before, stored, spy)
    assert written >= {n.id for n in after.leaves if n.doc_id == "chess"}
    # Old leaves keep their content (a leaf whose cluster changed gets a new parent only).
    kept = [leaf for leaf in after.leaves if leaf.doc_id != "chess"]
    assert all(replace(before.node(n.id), parents=()) == replace(n, parents=()) for n in kept)


def test_delete_removes_the_document_everywhere_and_writes_only_the_difference(
    index: RaptorIndex, summarizer: EchoSummarizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    before, stored = index.tree, snapshot(index)
    spy = StoreSpy(index, monkeypatch)

    index.delete_ref_doc("bread")

    after = index.tree
    check_tree_invariants(after, extractive=True)
    assert "bread" not in after.doc_ids and index.ref_doc_ids == tuple(
        n for n in BASE if n != "bread"
    )
    # No summary keeps a word only the deleted document had.
    assert not any(w in node.text for node in after.nodes for w in ("flour", "yeast", "dough"))
    assert len(summarizer.calls) == after.build_info["incremental"]["last"]["summary_calls"]
    check_in_place(index, before, stored, spy)
    assert set(spy.deleted) >= {n.id for n in before.leaves if n.doc_id == "bread"}
    with pytest.raises(InvalidInputError, match="bread"):
        index.delete_ref_doc("bread")


def test_update_ref_doc_replaces_a_changed_document_and_skips_an_unchanged_one(
    index: RaptorIndex, summarizer: EchoSummarizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    before, stored = index.tree, snapshot(index)
    spy = StoreSpy(index, monkeypatch)
    index.update_ref_doc(doc("rivers"))  # same text and metadata: nothing to do
    assert index.tree.nodes == before.nodes and not spy.written and not spy.deleted
    assert summarizer.calls == []

    index.update_ref_doc(doc("rivers", marker="monsoon"))

    after = index.tree
    check_tree_invariants(after, extractive=True)
    assert after.build_info["incremental"]["last"]["docs_replaced"] == ["rivers"]
    assert all("monsoon" in n.text for n in after.leaves if n.doc_id == "rivers")
    assert set(after.doc_ids) == set(before.doc_ids)
    check_in_place(index, before, stored, spy)


def test_a_metadata_only_update_rewrites_metadata_in_place_without_summarising(
    index: RaptorIndex, summarizer: EchoSummarizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    before, stored = index.tree, snapshot(index)
    spy = StoreSpy(index, monkeypatch)
    relabelled = Document(text=text("rivers"), id_="rivers", metadata={"topic": "water"})

    index.update_ref_doc(relabelled)

    after = index.tree
    check_tree_invariants(after, extractive=True)
    last = after.build_info["incremental"]["last"]
    assert summarizer.calls == [] and last["summary_calls"] == 0
    assert last["embedded_chunks"] == last["embedded_summaries"] == 0
    assert last["docs_replaced"] == ["rivers"]
    # Same nodes, same order, same vectors: only metadata differs.
    assert [(n.id, n.text, n.children) for n in after.nodes] == [
        (n.id, n.text, n.children) for n in before.nodes
    ]
    assert np.array_equal(after.embeddings, before.embeddings)
    written = check_in_place(index, before, stored, spy)
    rivers = {n.id for n in after.leaves if n.doc_id == "rivers"}
    assert rivers <= written and not spy.deleted
    docstore = index.storage_context.docstore
    for node_id in rivers:
        assert docstore.get_node(node_id).metadata["topic"] == "water"
    # refresh_ref_docs reports a metadata change as a change.
    again = Document(text=text("rivers"), id_="rivers", metadata={"topic": "streams"})
    assert index.refresh_ref_docs([again, doc("cats")]) == [True, False]
    assert summarizer.calls == []


def test_refresh_ref_docs_returns_which_documents_changed(
    index: RaptorIndex, summarizer: EchoSummarizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A hash that no longer matches, over the same content: sent to the core, which finds
    # nothing to change, so the document is reported unchanged (and costs nothing).
    index.storage_context.docstore.set_document_hash("music", "stale")
    before, stored = index.tree, snapshot(index)
    spy = StoreSpy(index, monkeypatch)
    documents = [doc("cats"), doc("bread", marker="rye"), doc("chess"), doc("music")]

    assert index.refresh_ref_docs(documents) == [False, True, True, False]

    after = index.tree
    check_tree_invariants(after, extractive=True)
    assert after.build_info["incremental"]["updates"] == 1  # one update for the whole batch
    assert set(index.ref_doc_ids) == {*BASE, "chess"}
    assert "rye" in " ".join(n.text for n in after.leaves if n.doc_id == "bread")
    assert not any(n.doc_id == "music" for n in after.leaves if n.id not in before)
    check_in_place(index, before, stored, spy)
    # The hashes are recorded: the same documents again change nothing and cost nothing.
    summarizer.calls.clear()
    assert index.refresh_ref_docs(documents) == [False] * 4
    assert summarizer.calls == [] and index.tree is after


def test_insert_nodes_adds_nodes_to_a_known_source_document(
    summarizer: EchoSummarizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    book = Document(text="the whole book", id_="book")
    nodes = []
    for name in BASE:
        node = TextNode(id_=f"node-{name}", text=text(name, n=2))
        node.relationships[NodeRelationship.SOURCE] = book.as_related_node_info()
        nodes.append(node)
    index = RaptorIndex.from_documents(nodes[:4], **options(summarizer))
    assert index.ref_doc_ids == ("book",)
    index.insert_nodes(nodes[4:])  # LlamaIndex lets nodes join their ref_doc_id
    assert sorted(leaf.id for leaf in index.tree.leaves) == sorted(n.node_id for n in nodes)
    assert index.ref_doc_info["book"].node_ids and index.ref_doc_ids == ("book",)
    # A whole document with an id already indexed is refused before anything is paid.
    embedder = index.embedder
    assert isinstance(embedder, FakeEmbedder)
    calls = embedder.calls
    with pytest.raises(InvalidInputError, match="duplicate"):
        index.insert(Document(text="More.", id_="node-cats"))
    assert embedder.calls == calls


def test_transformations_replace_a_source_and_leave_the_others_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    splitter = SentenceSplitter(chunk_size=24, chunk_overlap=0)
    index = RaptorIndex.from_documents(
        [doc(n) for n in BASE], transformations=[splitter], **options()
    )
    before, stored = index.tree, snapshot(index)
    spy = StoreSpy(index, monkeypatch)
    index.update_ref_doc(doc("cats", marker="tabby"))
    after = index.tree
    assert all(leaf.span is None for leaf in after.leaves)  # the splitter's nodes
    assert "tabby" in " ".join(n.text for n in after.leaves if n.doc_id == "cats")
    assert {n.id for n in after.leaves if n.doc_id != "cats"} == {
        n.id for n in before.leaves if n.doc_id != "cats"
    }
    check_in_place(index, before, stored, spy)


def test_deleting_every_document_leaves_an_empty_index() -> None:
    index = RaptorIndex.from_documents([doc("cats"), doc("bread")], **options())
    index.delete_ref_doc("cats")
    index.delete_ref_doc("bread")
    assert len(index.tree) == 0 and index.ref_doc_ids == ()
    assert index.storage_context.vector_store.data.embedding_dict == {}
    index.insert(doc("rivers"))
    assert index.tree.doc_ids == ("rivers",)


def test_a_tree_of_leaves_only_is_built_again_to_grow_summaries() -> None:
    # One short document: no summary layer yet.  The core never adds layers, so the first
    # insert builds the tree whole (there was no summary to keep).
    short = Document(text="Cats purr.", id_="cats")
    index = RaptorIndex.from_documents([short], **options())
    assert index.tree.num_layers == 1
    index.insert_nodes([doc(n) for n in BASE if n != "cats"])
    assert index.tree.num_layers >= 2
    check_tree_invariants(index.tree, extractive=True)


def test_bad_updates_are_refused_before_anything_is_paid(index: RaptorIndex) -> None:
    embedder = index.embedder
    assert isinstance(embedder, FakeEmbedder)
    calls = embedder.calls
    before = index.tree
    with pytest.raises(InvalidInputError, match="no document"):
        index.update_ref_doc(doc("chess"))
    with pytest.raises(InvalidInputError):
        index.insert(Document(text="   ", id_="blank"))
    with pytest.raises(InvalidParameterError):
        index.refresh_ref_docs("cats")  # type: ignore[arg-type]
    assert embedder.calls == calls and index.tree is before


# -- async -----------------------------------------------------------------------------------------
def test_async_updates_give_the_trees_the_sync_ones_give(monkeypatch: pytest.MonkeyPatch) -> None:
    def run(index: RaptorIndex, asynchronous: bool) -> list[Any]:
        steps = [
            ("insert", doc("chess")),
            ("update", doc("rivers", marker="monsoon")),
            ("delete", "bread"),
            ("refresh", [doc("cats", marker="tabby"), doc("music")]),
        ]
        results = []
        for op, arg in steps:
            if asynchronous:
                call = {
                    "insert": index.ainsert,
                    "update": index.aupdate_ref_doc,
                    "delete": index.adelete_ref_doc,
                    "refresh": index.arefresh_ref_docs,
                }[op]
                results.append(asyncio.run(call(arg)))
            else:
                call = {
                    "insert": index.insert,
                    "update": index.update_ref_doc,
                    "delete": index.delete_ref_doc,
                    "refresh": index.refresh_ref_docs,
                }[op]
                results.append(call(arg))
        return results

    sync_index = RaptorIndex.from_documents([doc(n) for n in BASE], **options())
    async_index = RaptorIndex.from_documents([doc(n) for n in BASE], **options())
    stored = snapshot(async_index)
    spy = StoreSpy(async_index, monkeypatch)
    assert run(async_index, True) == run(sync_index, False)
    assert [n.to_dict() for n in async_index.tree.nodes] == [
        n.to_dict() for n in sync_index.tree.nodes
    ]
    assert async_index.tree.build_info["incremental"]["updates"] == 4
    now = snapshot(async_index)
    assert set(now) == {n.id for n in async_index.tree.nodes}
    untouched = set(now) - set(spy.written)
    assert untouched and all(now[i] == stored[i] for i in untouched)
    assert set(spy.deleted) == set(stored) - set(now) | (set(spy.written) - set(now))


def test_inserting_an_indexed_document_again_is_refused_before_anything_is_paid() -> None:
    splitter = SentenceSplitter(chunk_size=24, chunk_overlap=0)
    index = RaptorIndex.from_documents(
        [doc(n) for n in BASE], transformations=[splitter], **options()
    )
    embedder = index.embedder
    assert isinstance(embedder, FakeEmbedder)
    calls, before = embedder.calls, index.tree
    # Without the check, the splitter's new nodes would join the indexed "cats" document.
    with pytest.raises(InvalidInputError, match="update_ref_doc"):
        index.insert(doc("cats", marker="again"))
    with pytest.raises(InvalidInputError, match="update_ref_doc"):
        asyncio.run(index.ainsert(doc("cats", marker="again")))
    # A whole document under the id of indexed nodes would replace them: refused too.
    with pytest.raises(InvalidInputError, match="update_ref_doc"):
        index.insert_nodes([doc("cats", marker="again")])
    assert embedder.calls == calls and index.tree is before
