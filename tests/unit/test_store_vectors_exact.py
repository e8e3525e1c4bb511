"""A tree written into a store comes back with its vectors bit for bit.

Dividing a float32 unit vector by its norm again moves its last bits (about 6e-8): the
tree read back differed from the tree written, and an incremental update then placed a
new chunk differently than on the in-memory tree (that update is tested with the other
store-backed updates, in test_store_floor.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from raptor_core.store.memory import InMemoryNodeStore
from raptor_core.store.vectors import unit_rows
from raptor_core.testing import FakeEmbedder, random_tree
from raptor_core.tree import Tree


def _tree() -> Tree:
    # Enough rows that re-normalising changes the last bit of some of them.
    return random_tree(300, dim=24, random_state=3)


def test_unit_rows_keeps_unit_rows_and_scales_the_others() -> None:
    tree = _tree()
    scaled = tree.embeddings.copy()
    scaled[::7] *= 3.0
    out = unit_rows(scaled, len(tree), tree.dim)
    unit = np.ones(len(tree), dtype=np.bool_)
    unit[::7] = False
    assert np.array_equal(out[unit], tree.embeddings[unit])
    assert np.allclose(np.linalg.norm(out[~unit], axis=1), 1.0, atol=1e-6)
    # A copy even when nothing is scaled: the store keeps it, the caller may change theirs.
    kept = unit_rows(tree.embeddings, len(tree), tree.dim)
    assert np.array_equal(kept, tree.embeddings)
    assert not np.shares_memory(kept, tree.embeddings)


def test_in_memory_store_round_trips_vectors_exactly() -> None:
    tree = _tree()
    store = InMemoryNodeStore()
    store.add(list(tree.nodes), tree.embeddings)
    assert np.array_equal(store.to_tree().embeddings, tree.embeddings)
    ids = [n.id for n in tree.nodes]
    assert np.array_equal(store.vectors(ids), tree.embeddings)


def test_langchain_store_round_trips_vectors_exactly() -> None:
    pytest.importorskip("langchain_core")
    from langchain_core.vectorstores import InMemoryVectorStore

    from raptor_langchain import LangChainNodeStore, RaptorEmbeddings

    tree = _tree()
    store = LangChainNodeStore(InMemoryVectorStore(RaptorEmbeddings(FakeEmbedder(dim=tree.dim))))
    store.add_tree(tree)
    back = store.to_tree()
    order = {n.id: i for i, n in enumerate(tree.nodes)}
    expected = tree.embeddings[[order[n.id] for n in back.nodes]]
    assert np.array_equal(back.embeddings, expected)
    ids = [n.id for n in tree.nodes]
    assert np.array_equal(store.vectors(ids), tree.embeddings)


def test_llamaindex_store_round_trips_vectors_exactly() -> None:
    pytest.importorskip("llama_index.core")
    from llama_index.core.vector_stores import SimpleVectorStore

    from raptor_llamaindex import LlamaIndexNodeStore

    tree = _tree()
    store = LlamaIndexNodeStore(SimpleVectorStore())
    store.add_tree(tree)
    ids = [n.id for n in tree.nodes]
    assert np.array_equal(store.vectors(ids), tree.embeddings)
