"""RaptorIndex updates racing each other: none may be lost.

No timing: each race is forced with events at the point where it does harm (see
``tests/update_races.py``).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document
from update_races import FIRST, SAFETY_S, SECOND, ContendedLock, GatedEmbedder

from raptor_core.testing import EchoSummarizer, GroupClusterer, WhitespaceTokenizer
from raptor_llamaindex import RaptorIndex

TEXTS = {
    "cats": "Cats purr in the sun. Kittens chase string. A cat sleeps all day. Felines hunt mice.",
    "rockets": "Rockets burn fuel. Boosters lift satellites. Orbit needs speed. Engines roar.",
}


def gated_index() -> tuple[RaptorIndex, GatedEmbedder]:
    embedder = GatedEmbedder(32)
    index = RaptorIndex.from_documents(
        [Document(text=text, id_=name) for name, text in TEXTS.items()],
        embed_model=embedder,
        summarizer=EchoSummarizer(),
        tokenizer=WhitespaceTokenizer(),
        clusterer=GroupClusterer(2),
        chunk_max_tokens=8,
        random_state=0,
    )
    # Set directly: before the fix the index has no such lock and ignores it.
    index._update_lock = ContendedLock(embedder.release.set)
    embedder.armed = True
    return index, embedder


def assert_both_landed(index: RaptorIndex) -> None:
    expected = {"cats", "rockets", "first", "second"}
    assert set(index.ref_doc_ids) == expected
    assert set(index.tree.doc_ids) == expected
    # The vector store holds exactly the tree: no node of a lost update left behind.
    assert sorted(n.id for n in index.store) == sorted(n.id for n in index.tree.nodes)


def test_two_async_inserts_gathered_both_land() -> None:
    index, embedder = gated_index()

    async def both() -> list[Any]:
        return list(
            await asyncio.gather(
                index.ainsert(Document(text=FIRST, id_="first")),
                index.ainsert(Document(text=SECOND, id_="second")),
            )
        )

    asyncio.run(both())
    assert not embedder.timed_out
    assert_both_landed(index)


def test_two_threads_inserting_both_land() -> None:
    index, embedder = gated_index()
    first = threading.Thread(target=index.insert, args=(Document(text=FIRST, id_="first"),))
    first.start()
    assert embedder.holding.wait(SAFETY_S)  # the first update has read the tree
    second = threading.Thread(target=index.insert, args=(Document(text=SECOND, id_="second"),))
    second.start()
    first.join(SAFETY_S)
    second.join(SAFETY_S)
    assert not embedder.timed_out
    assert_both_landed(index)


def test_an_async_delete_waits_for_a_sync_insert() -> None:
    index, embedder = gated_index()
    inserting = threading.Thread(target=index.insert, args=(Document(text=FIRST, id_="first"),))
    inserting.start()
    assert embedder.holding.wait(SAFETY_S)
    # The delete finds the lock taken (releasing the insert), then runs on the insert's tree.
    asyncio.run(index.adelete_ref_doc("cats"))
    inserting.join(SAFETY_S)
    assert set(index.ref_doc_ids) == set(index.tree.doc_ids) == {"rockets", "first"}
