"""The LangChain adapter under concurrent use: updates racing updates, searches racing deletes.

No timing: each race is forced with events at the point where it does harm.
"""

from __future__ import annotations

import asyncio
import copy
import pickle
import threading
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("langchain_core")

from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore
from update_races import FIRST, SAFETY_S, SECOND, ContendedLock, GatedEmbedder

from raptor_core.testing import (
    EchoSummarizer,
    FakeEmbedder,
    GroupClusterer,
    WhitespaceTokenizer,
    check_tree_invariants,
    tiny_tree,
)
from raptor_core.tree import Tree
from raptor_langchain import InMemoryDialect, LangChainNodeStore, RaptorEmbeddings, RaptorRetriever
from raptor_langchain.retriever import _STORE_LOCKS

DIM = 32
TEXTS = {
    "cats": "Cats purr in the sun. Kittens chase string. A cat sleeps all day. Felines hunt mice.",
    "rockets": "Rockets burn fuel. Boosters lift satellites. Orbit needs speed. Engines roar.",
}


def gated(vectorstore: InMemoryVectorStore | None) -> tuple[RaptorRetriever, GatedEmbedder]:
    embedder = GatedEmbedder(DIM)
    retriever = RaptorRetriever.from_documents(
        [Document(page_content=t, id=name) for name, t in TEXTS.items()],
        embedder,
        vectorstore=vectorstore,
        strategy="collapsed",
        summarizer=EchoSummarizer(),
        tokenizer=WhitespaceTokenizer(),
        clusterer=GroupClusterer(2),
        chunk_max_tokens=8,
        random_state=0,
    )
    contend(retriever, ContendedLock(embedder.release.set))
    embedder.armed = True
    return retriever, embedder


def contend(retriever: RaptorRetriever, lock: ContendedLock) -> None:
    """Make ``lock`` the one the retriever's updates hold: its store's, else its own."""
    if retriever.vectorstore is not None:
        _STORE_LOCKS[retriever.vectorstore] = lock
    else:
        retriever.__pydantic_private__["_update_lock"] = lock  # type: ignore[index]


def final_tree(retriever: RaptorRetriever, vectorstore: InMemoryVectorStore | None) -> Tree:
    if vectorstore is None:
        assert retriever.tree is not None
        return retriever.tree
    return LangChainNodeStore(vectorstore).to_tree()


def in_memory_store() -> InMemoryVectorStore:
    return InMemoryVectorStore(RaptorEmbeddings(FakeEmbedder(DIM)))


# -- two updates at once ---------------------------------------------------------------------
@pytest.mark.parametrize("make_store", [lambda: None, in_memory_store], ids=["tree", "store"])
def test_two_threads_adding_documents_both_land(
    make_store: Callable[[], InMemoryVectorStore | None],
) -> None:
    vectorstore = make_store()
    retriever, embedder = gated(vectorstore)
    returned: dict[str, list[str]] = {}

    def add(doc_id: str, text: str) -> None:
        returned[doc_id] = retriever.add_documents([Document(page_content=text, id=doc_id)])

    first = threading.Thread(target=add, args=("first", FIRST))
    first.start()
    assert embedder.holding.wait(SAFETY_S)  # the first update has read the tree
    second = threading.Thread(target=add, args=("second", SECOND))
    second.start()
    first.join(SAFETY_S)
    second.join(SAFETY_S)
    assert not embedder.timed_out
    assert returned == {"first": ["first"], "second": ["second"]}
    tree = final_tree(retriever, vectorstore)
    assert {"cats", "rockets", "first", "second"} == set(tree.doc_ids)
    check_tree_invariants(tree, extractive=True)


@pytest.mark.parametrize("make_store", [lambda: None, in_memory_store], ids=["tree", "store"])
def test_two_async_adds_at_once_both_land(
    make_store: Callable[[], InMemoryVectorStore | None],
) -> None:
    vectorstore = make_store()
    retriever, embedder = gated(vectorstore)

    async def both() -> list[list[str]]:
        return list(
            await asyncio.gather(
                retriever.aadd_documents([Document(page_content=FIRST, id="first")]),
                retriever.aadd_documents([Document(page_content=SECOND, id="second")]),
            )
        )

    assert asyncio.run(both()) == [["first"], ["second"]]
    assert not embedder.timed_out
    tree = final_tree(retriever, vectorstore)
    assert {"cats", "rockets", "first", "second"} == set(tree.doc_ids)
    check_tree_invariants(tree, extractive=True)


def test_an_async_delete_waits_for_a_sync_add() -> None:
    retriever, embedder = gated(None)
    adding = threading.Thread(
        target=retriever.add_documents, args=([Document(page_content=FIRST, id="first")],)
    )
    adding.start()
    assert embedder.holding.wait(SAFETY_S)
    # The delete finds the lock taken (releasing the add), then runs on the add's tree.
    asyncio.run(retriever.adelete(["cats"]))
    adding.join(SAFETY_S)
    tree = final_tree(retriever, None)
    assert set(tree.doc_ids) == {"rockets", "first"}
    check_tree_invariants(tree, extractive=True)


def test_two_retrievers_over_one_store_update_one_at_a_time() -> None:
    # A web app that opens a retriever per request over one shared vector store: the two
    # updates read the same stored tree unless they share the store's lock, and the one
    # that writes last drops the other's document.
    vectorstore = in_memory_store()
    first_retriever, embedder = gated(vectorstore)
    second_retriever = RaptorRetriever.from_vectorstore(vectorstore, embedder, strategy="collapsed")
    assert second_retriever._lock() is first_retriever._lock()
    other = RaptorRetriever(vectorstore=in_memory_store(), embeddings=embedder)
    assert other._lock() is not first_retriever._lock()
    adding = threading.Thread(
        target=first_retriever.add_documents, args=([Document(page_content=FIRST, id="first")],)
    )
    adding.start()
    assert embedder.holding.wait(SAFETY_S)  # the first update has read the stored tree
    second_retriever.add_documents([Document(page_content=SECOND, id="second")])
    adding.join(SAFETY_S)
    assert not embedder.timed_out
    tree = final_tree(first_retriever, vectorstore)
    assert {"cats", "rockets", "first", "second"} == set(tree.doc_ids)
    check_tree_invariants(tree, extractive=True)


def test_a_copied_retriever_has_its_own_unlocked_update_lock() -> None:
    retriever = RaptorRetriever(tree=tiny_tree(DIM), embeddings=FakeEmbedder(DIM))
    lock = retriever._update_lock
    with lock:  # copied while an update runs
        copies = [copy.deepcopy(retriever), pickle.loads(pickle.dumps(retriever))]
    for copied in copies:
        assert copied._update_lock is not lock
        assert copied._update_lock.acquire(blocking=False)
        copied._update_lock.release()


# -- a search racing a delete ----------------------------------------------------------------
class DeletedAfterSearch(InMemoryVectorStore):
    """Loses its nearest entry right after a search ranked the snapshot (a racing delete)."""

    def _similarity_search_with_score_by_vector(
        self, embedding: list[float], k: int = 4, filter: Any = None
    ) -> list[tuple[Document, float, list[float]]]:
        found = super()._similarity_search_with_score_by_vector(embedding, k, filter)
        if found:
            self.store.pop(str(found[0][0].id), None)
        return found


class DeletedAfterPublicSearch(InMemoryVectorStore):
    """The same, for a store without the search returning vectors (the fallback)."""

    _similarity_search_with_score_by_vector = None  # type: ignore[assignment]

    def similarity_search_with_score_by_vector(
        self, embedding: list[float], k: int = 4, filter: Any = None, **kwargs: Any
    ) -> list[tuple[Document, float]]:
        found = InMemoryVectorStore._similarity_search_with_score_by_vector(
            self, embedding, k, filter
        )
        if found:
            self.store.pop(str(found[0][0].id), None)
        return [(doc, score) for doc, score, _ in found]


@pytest.mark.parametrize(
    ("store_class", "kept"), [(DeletedAfterSearch, 3), (DeletedAfterPublicSearch, 2)]
)
def test_a_search_racing_a_delete_returns_what_is_left(
    store_class: type[InMemoryVectorStore], kept: int
) -> None:
    embedder = FakeEmbedder(DIM)
    vectorstore = store_class(RaptorEmbeddings(embedder))
    LangChainNodeStore(vectorstore).add_tree(tiny_tree(DIM))
    stored = {key: list(entry["vector"]) for key, entry in vectorstore.store.items()}
    query = embedder.embed_query("cats and kittens")

    rows = InMemoryDialect(vectorstore).query(query, 3, native=None)
    # With the search's own vectors the snapshot's hits all come back, each with the vector
    # it was ranked by; without them the entry that went is left out.
    assert len(rows) == kept
    for row in rows:
        assert row.vector is not None
        assert row.vector.tolist() == pytest.approx(stored[str(row.document.id)])

    retriever = RaptorRetriever(vectorstore=vectorstore, embeddings=embedder, strategy="collapsed")
    assert retriever.invoke("rockets and orbit", k=2)  # no KeyError from the lost entry
