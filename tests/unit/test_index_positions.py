"""The in-memory store through raptor's own indexes (positions) and through any VectorIndex (ids).

The bundled indexes answer a store in positions (``search_rows``), which the store maps to
its rows with one cached array; any other :class:`~raptor_core.types.VectorIndex` answers in
ids, looked up one by one.  Both must give the same hits, in the same order, with the same
scores, filtered or not, before and after the store or the index changes.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import pytest
from numpy.typing import NDArray

from raptor_core import (
    CollapsedTreeRetriever,
    EmbeddingError,
    FaissHNSWIndex,
    FaissIndex,
    InMemoryNodeStore,
    InvalidInputError,
    InvalidParameterError,
    NumpyIndex,
    Tree,
)
from raptor_core.backends._vectors import PositionIndex, check_query
from raptor_core.retrieval.base import normalize_query
from raptor_core.testing import FakeEmbedder, random_tree
from raptor_core.tree import Node
from raptor_core.types import NodeFilter


class ThirdPartyIndex:
    """A VectorIndex of another library: ``add`` and ``search`` by id, nothing else.

    It answers with one of raptor's indexes inside, so that both paths search the very same
    vectors (an HNSW graph differs between builds) and any difference is the store's.
    """

    def __init__(self, inner: PositionIndex | None = None) -> None:
        self.inner: PositionIndex = inner if inner is not None else NumpyIndex()
        self.searches = 0

    def __len__(self) -> int:
        return len(self.inner)

    def add(self, ids: Sequence[str], vectors: NDArray[np.float32]) -> None:
        self.inner.add(ids, vectors)

    def search(
        self,
        query: NDArray[np.float32],
        k: int,
        *,
        restrict_to: Collection[str] | None = None,
    ) -> list[tuple[str, float]]:
        self.searches += 1
        return self.inner.search(query, k, restrict_to=restrict_to)


@pytest.fixture(scope="module")
def tree() -> Tree:
    # About 3,000 nodes: over FaissHNSWIndex's exact_below, so its default searches the graph.
    return random_tree(2500, fanout=6, dim=32, soft=0.2, random_state=7)


def _queries(tree: Tree, n: int, seed: int) -> NDArray[np.float32]:
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, len(tree), size=n)
    noisy = tree.embeddings[rows] + 0.3 * rng.standard_normal((n, tree.dim)).astype(np.float32)
    return np.asarray(noisy, dtype=np.float32)


def _filters(tree: Tree) -> list[NodeFilter | None]:
    top = tree.top_layer
    return [
        None,
        NodeFilter(layers=frozenset({0})),
        NodeFilter(layers=frozenset({1, top})),
        NodeFilter(ids=frozenset(n.id for n in tree.nodes[::37])),
        NodeFilter(parents=frozenset(n.id for n in tree.nodes if n.layer == 1)),
        NodeFilter(layers=frozenset({0}), include_carried=True),
    ]


def _answers(store: InMemoryNodeStore, queries: NDArray[np.float32], tree: Tree) -> list[object]:
    out: list[object] = []
    for where in _filters(tree):
        for q in queries:
            out.append([(m.node.id, m.score) for m in store.search(q, 10, where=where)])
            out.append([(m.node.id, m.score) for m in store.search(q, 200, where=where)])
            within = store.search_within_budget(q, 10, max_tokens=300, where=where)
            out.append([(m.node.id, m.score) for m in within])
    return out


INDEXES = {
    "numpy": NumpyIndex.from_tree,
    "faiss-flat": FaissIndex.from_tree,
    "hnsw-graph": lambda tree: FaissHNSWIndex.from_tree(tree, exact_below=0),
    "hnsw-default": FaissHNSWIndex.from_tree,
}


@pytest.mark.parametrize("name", list(INDEXES))
def test_both_paths_give_identical_hits(tree: Tree, name: str) -> None:
    index = INDEXES[name](tree)
    outside = ThirdPartyIndex(index)
    own = InMemoryNodeStore.from_tree(tree, index=index)
    generic = InMemoryNodeStore.from_tree(tree, index=outside)
    queries = _queries(tree, 6, 1)
    assert _answers(own, queries, tree) == _answers(generic, queries, tree)
    assert outside.searches > 0  # the generic path did run, through search() and ids

    # And whole retrievals, unfiltered and by layers, with and without a budget.
    for params in ({}, {"layers": [0]}, {"layers": [1, 2]}, {"max_tokens": None, "k": 40}):
        for q in queries[:3]:
            a = CollapsedTreeRetriever(tree, FakeEmbedder(tree.dim), index=index, **params)
            b = CollapsedTreeRetriever(tree, FakeEmbedder(tree.dim), index=outside, **params)
            assert a.retrieve("q", embedding=q) == b.retrieve("q", embedding=q)


def test_the_bundled_indexes_answer_the_store_in_positions(tree: Tree) -> None:
    index = NumpyIndex.from_tree(tree)

    def no_ids(*args: object, **kwargs: object) -> list[tuple[str, float]]:
        raise AssertionError("the store asked a bundled index for ids")

    index.search = no_ids  # type: ignore[method-assign]
    store = InMemoryNodeStore.from_tree(tree, index=index)
    q = _queries(tree, 1, 2)[0]
    exact = InMemoryNodeStore.from_tree(tree)
    for where in _filters(tree):
        found = store.search(q, 10, where=where)
        assert [m.node.id for m in found] == [m.node.id for m in exact.search(q, 10, where=where)]


def test_a_subclass_with_its_own_search_goes_through_it(tree: Tree) -> None:
    class Logged(NumpyIndex):
        def __init__(self) -> None:
            super().__init__()
            self.asked: list[int] = []

        def search(
            self,
            query: NDArray[np.float32],
            k: int,
            *,
            restrict_to: Collection[str] | None = None,
        ) -> list[tuple[str, float]]:
            self.asked.append(k)
            return super().search(query, k, restrict_to=restrict_to)

    index = Logged()
    store = InMemoryNodeStore.from_tree(tree, index=index)
    store.search(_queries(tree, 1, 3)[0], 7)
    assert index.asked == [7]


def test_search_rows_are_the_positions_of_the_ids_search_returns(tree: Tree) -> None:
    allowed = frozenset(n.id for n in tree.nodes[::5])
    for make in INDEXES.values():
        index = make(tree)
        ids = index.ids()
        assert ids == [n.id for n in tree.nodes] and len(index) == len(tree)
        for q in _queries(tree, 3, 4):
            for restrict in (None, allowed):
                rows, scores = index.search_rows(q, 25, restrict_to=restrict)
                assert rows.dtype == np.intp and scores.dtype == np.float32
                pairs = index.search(q, 25, restrict_to=restrict)
                assert pairs == [
                    (ids[r], s) for r, s in zip(rows.tolist(), scores.tolist(), strict=True)
                ]
        assert index.search_rows(_queries(tree, 1, 5)[0], 5, restrict_to=frozenset())[0].size == 0


def test_an_index_over_part_of_the_tree_maps_its_own_positions(tree: Tree) -> None:
    """Positions of an index built from some layers are not the store's rows."""
    for make in (NumpyIndex.from_tree, FaissIndex.from_tree):
        upper = make(tree, layers=[1, 2])
        own = InMemoryNodeStore.from_tree(tree, index=upper)
        generic = InMemoryNodeStore.from_tree(tree, index=ThirdPartyIndex(upper))
        for q in _queries(tree, 4, 6):
            a = [(m.node.id, m.score) for m in own.search(q, 10)]
            assert a == [(m.node.id, m.score) for m in generic.search(q, 10)]
            assert {tree.node(i).layer for i, _ in a} <= {1, 2}


def test_the_stores_changes_reach_the_position_map(tree: Tree) -> None:
    """Adds, deletes (the index is rebuilt) and compaction: both paths still agree."""
    half = len(tree.leaves) // 2
    nodes = list(tree.nodes)
    own = InMemoryNodeStore(index=NumpyIndex())
    generic = InMemoryNodeStore(index=ThirdPartyIndex())
    first = [n for n in nodes if n.layer == 0][:half]
    taken = {n.id for n in first}
    rest = [n for n in nodes if n.id not in taken]
    queries = _queries(tree, 4, 8)

    def vectors(part: list[Node]) -> NDArray[np.float32]:
        return np.asarray(tree.embeddings[[tree.row(n.id) for n in part]], dtype=np.float32)

    def agree() -> None:
        for q in queries:
            for where in (None, NodeFilter(layers=frozenset({0}))):
                a = [(m.node.id, m.score) for m in own.search(q, 15, where=where)]
                b = [(m.node.id, m.score) for m in generic.search(q, 15, where=where)]
                assert a == b and a

    for store in (own, generic):
        store.add(first, vectors(first))
    agree()  # the map is built here ...
    for store in (own, generic):
        store.add(rest, vectors(rest))
    agree()  # ... and rebuilt once the index has grown
    found = own.search(queries[0], 3)[0].node.id
    for store in (own, generic):
        store.delete([found] + [n.id for n in first[: len(first) // 2]])  # compacts the rows
    agree()
    assert found not in [m.node.id for m in own.search(queries[0], 3)]


@pytest.mark.parametrize("third_party", [False, True])
def test_an_id_the_tree_lacks_is_an_error_on_both_paths(tree: Tree, third_party: bool) -> None:
    index = NumpyIndex.from_tree(tree)
    store = InMemoryNodeStore.from_tree(
        tree, index=ThirdPartyIndex(index) if third_party else index
    )
    first = tree.nodes[0].id
    assert store.search(tree.embeddings[0], 1)[0].node.id == first  # the map is built here
    stranger = np.asarray(_queries(tree, 1, 9)[0])
    index.add(["stranger"], stranger[None, :])  # behind the store's back
    assert store.search(tree.embeddings[0], 1)[0].node.id == first  # not returned: no error
    with pytest.raises(InvalidParameterError, match="'stranger', which is not in the tree"):
        store.search(stranger, 3)


def _reference_normalised(vector: NDArray[np.float32]) -> NDArray[np.float32]:
    """The unit vector computed in float64, then stored as float32."""
    q = np.asarray(vector, dtype=np.float64).reshape(-1)
    return (q / np.linalg.norm(q)).astype(np.float32)


def test_query_normalisation_keeps_the_direction_of_any_finite_vector() -> None:
    rng = np.random.default_rng(11)
    vectors = [
        rng.standard_normal(384).astype(np.float32) * scale for scale in (1e-30, 1e-19, 1, 1e18)
    ]
    vectors += [v / np.linalg.norm(v) for v in rng.standard_normal((50, 384)).astype(np.float32)]
    # q . q overflows float32 here; the direction is still every axis alike.
    vectors.append(np.full(384, 1e30, dtype=np.float32))
    for v in vectors:
        expected = _reference_normalised(v)
        assert np.array_equal(normalize_query(v, 384), expected)
        assert np.array_equal(check_query(v, 384), expected)
        assert abs(float(np.linalg.norm(expected.astype(np.float64))) - 1.0) < 1e-6
    huge = normalize_query(np.full(384, 1e30, dtype=np.float32), 384)
    assert np.allclose(huge, 1 / np.sqrt(384))  # not zeros
    for bad in (np.zeros(384), np.full(384, np.nan), np.r_[np.ones(383), np.inf]):
        with pytest.raises(EmbeddingError):
            normalize_query(bad, 384)
        with pytest.raises(InvalidInputError):
            check_query(bad, 384)
