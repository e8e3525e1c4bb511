"""The NodeStore seam: the in-memory store against the conformance suite, and the filters."""

from __future__ import annotations

import numpy as np
import pytest

from raptor_core import InvalidParameterError
from raptor_core.backends.faiss_index import FaissIndex
from raptor_core.retrieval.base import as_store
from raptor_core.store.filters import canonical, check_where, compile_where
from raptor_core.store.memory import InMemoryNodeStore
from raptor_core.testing import NodeStoreTests, random_tree, store_tree
from raptor_core.tree import Node
from raptor_core.types import NodeFilter


class TestInMemoryNodeStore(NodeStoreTests):
    def make_store(self) -> InMemoryNodeStore:
        return InMemoryNodeStore()


class TestInMemoryNodeStoreOverFaiss(NodeStoreTests):
    def make_store(self) -> InMemoryNodeStore:
        return InMemoryNodeStore(index=FaissIndex())


def test_a_tree_is_wrapped_once_without_copying_its_matrix() -> None:
    tree = random_tree(200)
    store = as_store(tree)
    assert as_store(tree) is store
    assert isinstance(store, InMemoryNodeStore)
    assert np.shares_memory(store.vectors([tree.nodes[0].id]), tree.embeddings) is False
    assert store._full() is tree.embeddings  # the tree's read-only matrix, not a copy


def test_to_tree_round_trips_after_updates() -> None:
    tree = store_tree()
    store = InMemoryNodeStore.from_tree(tree)
    again = store.to_tree(params=tree.params)
    assert [n.id for n in again.nodes] == [n.id for n in tree.nodes]
    np.testing.assert_array_equal(again.embeddings, tree.embeddings)


def test_deletes_compact_and_keep_order() -> None:
    tree = random_tree(120, fanout=4)
    store = InMemoryNodeStore.from_tree(tree)
    leaves = [n.id for n in tree.leaves]
    store.delete(leaves[: len(leaves) // 2])  # more than a quarter: compacts
    assert store._dead == 0
    assert [n.id for n in store][: len(leaves) // 2] == leaves[len(leaves) // 2 :]
    q = tree.embeddings[tree.row(leaves[-1])]
    assert store.search(q, 1)[0].node.id == leaves[-1]


def test_native_filter_is_a_callable() -> None:
    store = InMemoryNodeStore.from_tree(store_tree())
    q = store.vectors([next(iter(store)).id])[0]
    found = store.search(q, 50, where=NodeFilter(native=lambda n: n.token_count > 5))
    assert found and all(m.node.token_count > 5 for m in found)
    with pytest.raises(InvalidParameterError, match="callable"):
        store.search(q, 5, where=NodeFilter(native={"topic": "space"}))


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"$not": {"a": 1}},
        {"a": {"$regex": "x"}},
        {"a": {"$in": "abc"}},
        {"a": {"$gt": [1]}},
        {"a": {"$gt": True}},
        {"$and": []},
        {"$or": {"a": 1}},
        {"a": {}},
        {1: "x"},
        {"a": [1, 2]},
        {"tags": {"$contains": ["x"]}},  # one element, not a list
        {"tags": {"$any": "x"}},
        {"tags": {"$all": "xy"}},
        {"tags": {"$any": [["x"]]}},
        {"tags": {"$all": []}},  # MongoDB passes nothing, LlamaIndex everything
        {"tags": {"$text_match": "x"}},
        {"tags": {"$is_empty": True}},
    ],
)
def test_malformed_filters_are_rejected(bad: object) -> None:
    with pytest.raises(InvalidParameterError):
        check_where(bad)


def test_filter_semantics() -> None:
    node = Node(
        id="n",
        text="t",
        layer=0,
        token_count=1,
        doc_id="d",
        metadata={"flag": True, "n": 1, "s": "b"},
    )
    yes = [
        {"flag": True},
        {"n": 1},
        {"n": {"$gte": 1, "$lt": 2}},
        {"s": {"$gt": "a"}},
        {"missing": {"$ne": 3}},
        {"missing": {"$nin": [3]}},
        {"doc_id": "d"},
        {"$or": [{"n": 5}, {"s": "b"}]},
    ]
    no = [
        {"flag": 1},  # a bool is not a number
        {"n": True},
        {"missing": 3},
        {"missing": {"$gt": 0}},
        {"s": {"$gt": 0}},  # a string never compares with a number
        {"n": {"$in": [2, 3]}},
        {"doc_id": "e"},
        {"$and": [{"n": 1}, {"s": "c"}]},
    ]
    for where in yes:
        assert compile_where(where)(node), where
    for where in no:
        assert not compile_where(where)(node), where


def test_list_operators() -> None:
    """$contains/$any/$all match whole elements; a scalar counts as a list of one."""
    node = Node(
        id="n",
        text="t",
        layer=0,
        token_count=1,
        doc_id="d",
        metadata={"tags": ["bees", "ants", 3], "s": "bees", "flags": [True], "t": ("a", "b")},
    )
    yes = [
        {"tags": {"$contains": "bees"}},
        {"tags": {"$contains": 3}},
        {"tags": {"$any": ["wasps", "ants"]}},
        {"tags": {"$any": {"ants"}}},
        {"tags": {"$all": ["ants", "bees"]}},
        {"tags": {"$all": ("bees",), "$contains": 3}},
        {"t": {"$all": ["a", "b"]}},  # a tuple is a list too
        {"flags": {"$contains": True}},
        # A scalar is a list of one: $any is then $in, $contains is $eq.
        {"s": {"$contains": "bees"}},
        {"s": {"$any": ["bees", "ants"]}},
        {"s": {"$all": ["bees"]}},
        {"$or": [{"tags": {"$contains": "x"}}, {"tags": {"$all": ["bees", 3]}}]},
    ]
    no = [
        {"tags": {"$contains": "bee"}},  # elements, never substrings
        {"s": {"$contains": "bee"}},
        {"tags": {"$contains": "3"}},
        {"flags": {"$contains": 1}},  # a bool is not a number
        {"tags": {"$any": ["wasps"]}},
        {"tags": {"$any": []}},  # like $in []: nothing
        {"tags": {"$all": ["bees", "wasps"]}},
        {"s": {"$all": ["bees", "ants"]}},
        {"missing": {"$contains": "bees"}},  # a missing key fails, as comparisons do
        {"missing": {"$any": ["bees"]}},
        {"missing": {"$all": ["bees"]}},
    ]
    for where in yes:
        assert compile_where(where)(node), where
    for where in no:
        assert not compile_where(where)(node), where


def test_list_operators_pass_a_summary_only_when_its_leaves_share_the_list() -> None:
    from raptor_core.build.builder import TreeBuilder
    from raptor_core.build.chunking import SentenceChunker
    from raptor_core.testing import (
        EchoSummarizer,
        FakeEmbedder,
        GroupClusterer,
        WhitespaceTokenizer,
    )
    from raptor_core.types import Document

    tokenizer = WhitespaceTokenizer()
    builder = TreeBuilder(
        FakeEmbedder(dim=16),
        EchoSummarizer(),
        tokenizer=tokenizer,
        chunker=SentenceChunker(tokenizer, max_tokens=8),
        clusterer=GroupClusterer(2),
        summary_max_tokens=8,
        min_layer_size=2,
        random_state=0,
    )
    tags = {"a": ["x", "y"], "b": ["x", "y"], "c": ["x", "z"], "d": ["x", "w"]}
    texts = {
        "a": "Bees dance to tell the hive.",
        "b": "Ants dig tunnels under the ground.",
        "c": "Moles dig in the dark soil.",
        "d": "Owls hoot at night in woods.",
    }
    tree = builder.build(
        [Document(doc_id=d, metadata={"tags": tags[d]}, text=texts[d]) for d in tags]
    )
    same = next(n for n in tree.nodes if n.layer and n.doc_ids == ("a", "b"))
    mixed = next(n for n in tree.nodes if n.layer and n.doc_ids == ("c", "d"))
    # Every leaf below `mixed` holds "x", but their lists differ, so it has no tags at all.
    for where in ({"tags": {"$contains": "x"}}, {"tags": {"$any": ["x"]}}):
        assert all(compile_where(where)(leaf) for leaf in tree.leaves)
        assert compile_where(where)(same)
        assert not compile_where(where)(mixed)
    assert compile_where({"tags": {"$all": ["y", "x"]}})(same)
    assert not compile_where({"tags": {"$contains": "z"}})(same)
    # Through a store and a strategy: the nodes found are those the predicate passes.
    store = InMemoryNodeStore.from_tree(tree)
    q = tree.embeddings[0]
    found = store.search(q, 50, where=NodeFilter(where={"tags": {"$contains": "y"}}))
    assert {m.node.id for m in found} == {
        n.id for n in tree.nodes if n.doc_ids in (("a",), ("b",), ("a", "b"))
    }


def test_canonical_keys_of_list_operators() -> None:
    assert canonical({"tags": {"$any": ["b", "a"]}}) == '{"tags":{"$any":["b","a"]}}'
    assert canonical({"tags": {"$all": {"b", "a"}}}) == '{"tags":{"$all":["a","b"]}}'
    assert canonical({"t": {"$contains": "x"}}) != canonical({"t": {"$eq": "x"}})
    # Sets of mixed kinds used to raise TypeError ("<" between str and int).
    assert canonical({"n": {"$in": {1, "a", None}}}) == canonical({"n": {"$in": {None, "a", 1}}})
    with pytest.raises(InvalidParameterError, match="non-empty list"):
        canonical({"tags": {"$all": []}})
    with pytest.raises(InvalidParameterError, match=r"\$contains"):
        canonical({"tags": {"$contains": object()}})
    store = InMemoryNodeStore.from_tree(store_tree())
    q = store.vectors([next(iter(store)).id])[0]
    mixed = NodeFilter(where={"lang": {"$in": {"de", None, 1}}})
    assert {m.node.metadata["lang"] for m in store.search(q, 50, where=mixed)} == {"de"}


def test_retrievers_filter_by_metadata_on_a_tree() -> None:
    from raptor_core import CollapsedTreeRetriever
    from raptor_core.testing import FakeEmbedder

    tree = store_tree()
    retriever = CollapsedTreeRetriever(
        tree, FakeEmbedder(dim=tree.dim), k=50, max_tokens=None, where={"doc_id": "rockets"}
    )
    hits = retriever.retrieve("orbit")
    assert hits and all(h.node.doc_ids == ("rockets",) for h in hits)
    with pytest.raises(InvalidParameterError):
        CollapsedTreeRetriever(tree, FakeEmbedder(dim=tree.dim), where={"$bad": 1}).retrieve("x")


class _SearchOnly:
    """A store seen only through NodeStore.search: ranked_within_budget's general path."""

    def __init__(self, store: InMemoryNodeStore) -> None:
        self.inner = store

    def search(self, vector, k, *, where=None):
        return self.inner.search(vector, k, where=where)


@pytest.mark.parametrize("index", [None, FaissIndex])
@pytest.mark.parametrize(
    ("k", "max_tokens", "min_score", "layers"),
    [
        (10, 2000, None, None),
        (10, None, None, None),
        (40, 300, None, None),  # the budget ends the filling before k
        (200, 5000, None, None),
        (10, 2000, 0.2, None),
        (5, 120, None, frozenset({0})),
        (8, 2000, -0.1, frozenset({1, 2})),
    ],
)
def test_budget_fast_path_matches_the_general_one(index, k, max_tokens, min_score, layers) -> None:
    from raptor_core.retrieval.collapsed import ranked_within_budget

    tree = random_tree(400, fanout=5, dim=16, tokens=60, random_state=3)
    store = InMemoryNodeStore.from_tree(tree, index=None if index is None else index())
    where = NodeFilter(layers=layers)
    for q in np.random.default_rng(1).standard_normal((6, 16)).astype(np.float32):
        q /= np.linalg.norm(q)
        fast = ranked_within_budget(
            store, q, where, k=k, max_tokens=max_tokens, min_score=min_score
        )
        general = ranked_within_budget(
            _SearchOnly(store), q, where, k=k, max_tokens=max_tokens, min_score=min_score
        )
        assert [(m.node.id, m.score) for m in fast] == [(m.node.id, m.score) for m in general]
        assert fast  # the case is not vacuous
