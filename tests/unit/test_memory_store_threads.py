"""InMemoryNodeStore shared between threads: a search sees the store before a write or
after it, and once a write returns the store is whole.

The deterministic tests run a write in another thread at a chosen point inside a search
and wait until that write has either finished or is blocked on the store's lock: without
the lock the write lands in the middle of the search, as it did before (a row lost for
good, a stale filter mask cached, a match whose node had been deleted).
"""

from __future__ import annotations

import copy
import pickle
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import raptor_core.store.memory as memory_module
from raptor_core.exceptions import InvalidInputError
from raptor_core.store.memory import InMemoryNodeStore
from raptor_core.testing import random_tree
from raptor_core.tree import Node
from raptor_core.types import NodeFilter

DIM = 8


def _unit(seed: int, n: int = 1) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _leaf(name: str) -> Node:
    return Node(id=name, text=name, layer=0, token_count=3)


class _WatchedLock:
    """The store's lock, telling when the writer thread would have to wait for it."""

    def __init__(self, lock: Any, writer: Callable[[], int | None], blocked: threading.Event):
        self._lock, self._writer, self._blocked = lock, writer, blocked

    def __enter__(self) -> Any:
        if threading.get_ident() != self._writer():
            self._lock.acquire()
        elif not self._lock.acquire(blocking=False):
            self._blocked.set()
            self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


@contextmanager
def write_inside(
    store: InMemoryNodeStore,
    monkeypatch: pytest.MonkeyPatch,
    owner: Any,
    name: str,
    write: Callable[[], None],
) -> Iterator[list[BaseException]]:
    """Run ``write`` in another thread the first time this thread has called ``owner.name``.

    The call goes on once the write has returned or is waiting for the store's lock; the
    write is joined when the block ends.  Errors of the write are collected, not lost.
    """
    reader = threading.get_ident()
    settled = threading.Event()
    errors: list[BaseException] = []
    writer = threading.Thread(target=lambda: _run(write, errors, settled))
    lock = getattr(store, "_lock", None)
    if lock is not None:  # the code before the fix had none
        store._lock = _WatchedLock(lock, lambda: writer.ident, settled)  # type: ignore[assignment]
    original = getattr(owner, name)

    def hooked(*args: Any, **kwargs: Any) -> Any:
        # The write comes after the call: between it and what the search does with its result.
        result = original(*args, **kwargs)
        if threading.get_ident() == reader and writer.ident is None:
            writer.start()
            assert settled.wait(10), "the write neither finished nor waited for the lock"
        return result

    monkeypatch.setattr(owner, name, hooked)
    try:
        yield errors
    finally:
        monkeypatch.setattr(owner, name, original)
        if writer.ident is not None:
            writer.join(10)
        if lock is not None:
            store._lock = lock


def _run(write: Callable[[], None], errors: list[BaseException], done: threading.Event) -> None:
    try:
        write()
    except BaseException as exc:  # reported by the test
        errors.append(exc)
    finally:
        done.set()


def _fresh(store: InMemoryNodeStore) -> InMemoryNodeStore:
    """A store built afresh from what ``store`` holds, in its order."""
    nodes = list(store)
    fresh = InMemoryNodeStore()
    fresh.add(nodes, store.vectors([n.id for n in nodes]))
    return fresh


def _whole(store: InMemoryNodeStore) -> None:
    """``store`` answers as a fresh store over the same nodes does."""
    fresh = _fresh(store)
    everything = len(store) + 1
    for seed in range(3):
        q = _unit(100 + seed)[0]
        for where in (None, NodeFilter(layers=frozenset({0})), NodeFilter(layers=frozenset({1}))):
            got = [(m.node.id, m.score) for m in store.search(q, everything, where=where)]
            want = [(m.node.id, m.score) for m in fresh.search(q, everything, where=where)]
            assert got == want
    ids = [n.id for n in store]
    assert list(store) == list(fresh) == store.get(ids)
    assert np.array_equal(store.vectors(ids), fresh.vectors(ids))


# -- deterministic: a write at a chosen point inside a search ------------------------------------
def test_a_row_added_while_a_search_joins_the_blocks_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = InMemoryNodeStore()
    store.add([_leaf("a")], _unit(1))
    store.add([_leaf("b")], _unit(2))  # two blocks: the next search joins them
    new, q = _unit(3), _unit(4)[0]  # not inside: numpy's random numbers call concatenate
    with write_inside(
        store, monkeypatch, np, "concatenate", lambda: store.add([_leaf("c")], new)
    ) as errors:
        found = store.search(q, 5)
    assert not errors
    assert {m.node.id for m in found} <= {"a", "b", "c"}
    assert [m.node.id for m in store.search(new[0], 1)] == ["c"]
    assert np.array_equal(store.vectors(["c"]), new)
    _whole(store)


def test_a_filter_mask_computed_during_a_write_is_not_cached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = InMemoryNodeStore.from_tree(random_tree(20, dim=DIM, random_state=0))
    leaves = NodeFilter(layers=frozenset({0}))
    new, q = _unit(5), _unit(6)[0]
    with write_inside(
        store, monkeypatch, np, "isin", lambda: store.add([_leaf("new")], new)
    ) as errors:
        store.search(q, 3, where=leaves)
    assert not errors
    assert store.search(new[0], 1, where=leaves)[0].node.id == "new"
    _whole(store)


def test_a_search_during_a_delete_sees_the_store_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tree = random_tree(20, dim=DIM, random_state=1)
    store = InMemoryNodeStore.from_tree(tree)
    q = tree.embeddings[0]
    before = [(m.node.id, m.score) for m in InMemoryNodeStore.from_tree(tree).search(q, 10)]
    doomed = [n.id for n in tree.nodes[1:]]  # compacts: every row moves

    with write_inside(
        store, monkeypatch, memory_module, "matvec", lambda: store.delete(doomed)
    ) as errors:
        found = store.search(q, 10)
    assert not errors
    assert [(m.node.id, m.score) for m in found] == before
    assert [n.id for n in store] == [tree.nodes[0].id]
    _whole(store)


def test_a_budgeted_search_ranks_one_state_of_the_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tree = random_tree(40, dim=DIM, random_state=2)
    store = InMemoryNodeStore.from_tree(tree)
    q = tree.embeddings[3]
    before = InMemoryNodeStore.from_tree(tree).search_within_budget(q, 4, max_tokens=60)
    doomed = [n.id for n in tree.nodes[::2]]
    with write_inside(
        store, monkeypatch, memory_module, "matvec", lambda: store.delete(doomed)
    ) as errors:
        found = store.search_within_budget(q, 4, max_tokens=60)
    assert not errors
    assert [(m.node.id, m.score) for m in found] == [(m.node.id, m.score) for m in before]
    _whole(store)


def test_a_rejected_add_changes_nothing() -> None:
    # add() replaces an id by deleting it first: bad vectors are refused before that.
    store = InMemoryNodeStore()
    store.add([_leaf("a"), _leaf("b")], _unit(7, 2))
    with pytest.raises(InvalidInputError):
        store.add([_leaf("a")], np.zeros((1, DIM), dtype=np.float32))
    assert [n.id for n in store] == ["a", "b"]


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda s: pickle.loads(pickle.dumps(s))])
def test_a_copied_store_has_its_own_lock(copier: Callable[[Any], Any]) -> None:
    store = InMemoryNodeStore.from_tree(random_tree(10, dim=DIM, random_state=3))
    copied = copier(store)
    assert copied._lock is not store._lock
    copied.add([_leaf("more")], _unit(8))
    assert "more" in copied and "more" not in store
    _whole(copied)


# -- stress: many writes while searches run --------------------------------------------------------
def test_searches_beside_writes_never_fail_and_the_store_ends_whole() -> None:
    store = InMemoryNodeStore.from_tree(random_tree(40, dim=DIM, random_state=4))
    stop = threading.Event()
    errors: list[BaseException] = []

    def search() -> None:
        q = _unit(9)[0]
        leaves = NodeFilter(layers=frozenset({0}))
        try:
            while not stop.is_set():
                for found in (
                    store.search(q, 5),
                    store.search(q, 5, where=leaves),
                    store.search_within_budget(q, 5, max_tokens=30, where=leaves),
                ):
                    assert all(m.node is not None for m in found)
                store.get(["L0.1", "new.3"])
                list(store)
        except BaseException as exc:  # reported below
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: more interleavings per write
    readers = [threading.Thread(target=search) for _ in range(2)]
    try:
        for reader in readers:
            reader.start()
        for i in range(150):
            store.add([_leaf(f"new.{i}")], _unit(1000 + i))
            if i % 3 == 2:
                store.delete([f"new.{i - 1}", f"new.{i - 2}"])
    finally:
        stop.set()
        for reader in readers:
            reader.join(30)
        sys.setswitchinterval(interval)
    assert not errors, errors[0]
    added = {n.id for n in store if n.id.startswith("new.")}
    assert added == {f"new.{i}" for i in range(150) if i % 3 == 2}
    _whole(store)
