"""Conformance suites for the seams, re-exported by :mod:`raptor_core.testing`.

Subclass a suite in a test module, under a name pytest collects, and fill in the factory::

    from raptor_core.testing import NodeStoreTests, VectorIndexTests

    class TestMyIndex(VectorIndexTests):
        def make_index(self):
            return MyIndex()

    class TestMyStore(NodeStoreTests):
        def make_store(self):
            return MyStore()          # empty

pytest is imported inside the tests, so importing this module never needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core.tree import Node, Tree
from raptor_core.types import NodeFilter, NodeStore, VectorIndex

__all__ = ["NodeStoreTests", "VectorIndexTests", "store_tree"]


def _unit_rows(n: int, dim: int, seed: int) -> NDArray[np.float32]:
    rows = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


class VectorIndexTests:
    """What every :class:`~raptor_core.types.VectorIndex` must do: exact, best-first cosine search.

    Errors for bad input must be ``ValueError`` subclasses (``InvalidInputError`` and
    ``InvalidParameterError`` are).
    """

    dim = 16

    def make_index(self) -> VectorIndex:
        """Return a new, empty index (override)."""
        raise NotImplementedError

    def _filled(self, n: int = 40, seed: int = 0) -> tuple[Any, list[str], NDArray[np.float32]]:
        index = self.make_index()
        ids = [f"v{i}" for i in range(n)]
        vectors = _unit_rows(n, self.dim, seed)
        index.add(ids, vectors)
        return index, ids, vectors

    def test_satisfies_protocol(self) -> None:
        """The index is a VectorIndex by duck typing."""
        assert isinstance(self.make_index(), VectorIndex)

    def test_exact_top_k_best_first(self) -> None:
        """Search is exact: the brute-force top k, best first, with cosine scores."""
        index, ids, vectors = self._filled()
        query = _unit_rows(1, self.dim, 99)[0]
        expected = np.argsort(-(vectors @ query), kind="stable")[:7]
        found = index.search(query, 7)
        assert [i for i, _ in found] == [ids[j] for j in expected]
        scores = [s for _, s in found]
        assert scores == sorted(scores, reverse=True)
        np.testing.assert_allclose(scores, (vectors @ query)[expected], atol=1e-5)

    def test_scores_are_cosine_similarities(self) -> None:
        """Vectors and queries are normalised: scores are cosines."""
        index = self.make_index()
        index.add(
            ["a", "b"],
            np.array(
                [[3.0] + [0.0] * (self.dim - 1), [1.0, 1.0] + [0.0] * (self.dim - 2)],
                dtype=np.float32,
            ),
        )
        query = np.zeros(self.dim, dtype=np.float32)
        query[0] = 5.0
        found = dict(index.search(query, 2))
        assert abs(found["a"] - 1.0) < 1e-5
        assert abs(found["b"] - 2**-0.5) < 1e-5

    def test_k_larger_than_index_returns_everything(self) -> None:
        """A k above the size returns every vector."""
        index, ids, _ = self._filled(n=5)
        found = index.search(_unit_rows(1, self.dim, 3)[0], 50)
        assert sorted(i for i, _ in found) == sorted(ids)

    def test_empty_index_returns_nothing(self) -> None:
        """An empty index answers with an empty list."""
        assert self.make_index().search(_unit_rows(1, self.dim, 3)[0], 3) == []

    def test_restrict_to_is_exact_within_the_subset(self) -> None:
        """restrict_to gives the exact top k of the subset."""
        index, ids, vectors = self._filled()
        allowed = frozenset(ids[::3])
        query = _unit_rows(1, self.dim, 7)[0]
        found = index.search(query, 4, restrict_to=allowed)
        subset = [j for j, i in enumerate(ids) if i in allowed]
        best = sorted(subset, key=lambda j: -float(vectors[j] @ query))[:4]
        assert [i for i, _ in found] == [ids[j] for j in best]

    def test_restrict_to_ignores_unknown_ids(self) -> None:
        """Unknown ids in restrict_to are ignored; an empty one finds nothing."""
        index, _, _ = self._filled(n=5)
        query = _unit_rows(1, self.dim, 3)[0]
        assert [i for i, _ in index.search(query, 5, restrict_to={"v1", "nope"})] == ["v1"]
        assert index.search(query, 5, restrict_to=frozenset()) == []

    def test_restrict_to_sees_vectors_added_later(self) -> None:
        """A reused restrict_to object sees vectors added since."""
        index, _, _ = self._filled(n=5)
        allowed = frozenset({"v1", "late"})
        query = _unit_rows(1, self.dim, 3)[0]
        assert [i for i, _ in index.search(query, 5, restrict_to=allowed)] == ["v1"]
        index.add(["late"], query.reshape(1, -1))
        assert [i for i, _ in index.search(query, 5, restrict_to=allowed)] == ["late", "v1"]

    def test_add_accumulates(self) -> None:
        """Several add calls build one index."""
        index = self.make_index()
        vectors = _unit_rows(6, self.dim, 1)
        index.add(["a", "b", "c"], vectors[:3])
        index.add(["d", "e", "f"], vectors[3:])
        assert index.search(vectors[4], 1)[0][0] == "e"
        assert index.search(vectors[0], 1)[0][0] == "a"

    def test_equal_scores_keep_insertion_order(self) -> None:
        """Equal scores come back in insertion order."""
        index = self.make_index()
        vector = _unit_rows(1, self.dim, 5)
        index.add(["first", "second", "third"], np.repeat(vector, 3, axis=0))
        assert [i for i, _ in index.search(vector[0], 3)] == ["first", "second", "third"]

    def test_rejects_duplicate_ids(self) -> None:
        """An id can be added only once."""
        import pytest

        index, _, vectors = self._filled(n=3)
        with pytest.raises(ValueError, match="already"):
            index.add(["v0"], vectors[:1])
        with pytest.raises(ValueError):
            self.make_index().add(["x", "x"], vectors[:2])

    def test_rejects_mismatched_input(self) -> None:
        """Bad shapes, dimensions and zero vectors raise ValueError."""
        import pytest

        index, _, vectors = self._filled(n=3)
        with pytest.raises(ValueError):
            index.add(["a", "b"], vectors[:1])
        with pytest.raises(ValueError):
            index.add(["a"], np.ones((1, self.dim + 1), dtype=np.float32))
        with pytest.raises(ValueError):
            index.search(np.ones(self.dim + 1, dtype=np.float32), 2)
        with pytest.raises(ValueError):
            index.add(["z"], np.zeros((1, self.dim), dtype=np.float32))

    def test_rejects_invalid_k(self) -> None:
        """The k argument must be a positive integer."""
        import pytest

        index, _, vectors = self._filled(n=3)
        for k in (0, -1, True, 1.5):
            with pytest.raises(ValueError):
                index.search(vectors[0], k)


#: What :func:`store_tree` is built from: three documents with metadata to filter on.
_STORE_DOCS = (
    (
        "bees",
        {"topic": "nature", "year": 2019, "lang": "en"},
        "Honey bees dance to tell the hive where flowers are. The waggle dance encodes the "
        "direction of the sun. Foragers bring nectar and pollen home. Drones do not forage. "
        "The queen lays up to two thousand eggs a day. Wax comes from glands of young bees. "
        "Bees fan their wings to cool the hive in summer.",
    ),
    (
        "rockets",
        {"topic": "space", "year": 2021, "lang": "en"},
        "Rockets burn fuel and oxidiser to push exhaust out of a nozzle. Orbit needs about "
        "eight kilometres per second. Staging drops empty tanks to save mass. Reusable boosters "
        "land on barges at sea. Satellites are released once the upper stage reaches orbit.",
    ),
    (
        "volcanoes",
        {"topic": "nature", "year": 2021, "lang": "de"},
        "Magma rises through cracks in the crust. Pressure builds until the volcano erupts. "
        "Ash clouds can ground aircraft for days. Lava flows cool into basalt. Some volcanoes "
        "sleep for centuries before they wake again. Geologists watch gas and small quakes "
        "for warning signs.",
    ),
)


@cache
def store_tree(dim: int = 32) -> Tree:
    """A small built tree with every shape a store must keep.

    Three documents with metadata, summaries over one and over several documents, and a
    carried node.  Built with the fakes of :mod:`raptor_core.testing` (no model), so it is deterministic and
    takes milliseconds.
    """
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
        FakeEmbedder(dim=dim),
        EchoSummarizer(),
        tokenizer=tokenizer,
        chunker=SentenceChunker(tokenizer, max_tokens=12),
        clusterer=GroupClusterer(3),
        summary_max_tokens=12,
        min_layer_size=2,
        random_state=0,
    )
    docs = [Document(doc_id=d, metadata=m, text=t) for d, m, t in _STORE_DOCS]
    return builder.build(docs)


class _TieBreakingEmbedder:
    """Adds a fixed small random direction to queries.

    Bag-of-words fakes score many nodes exactly 0, and which of several exactly tied nodes
    a store returns is its own business.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def embed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]:
        return np.asarray(self.inner.embed_documents(texts), dtype=np.float32)

    def embed_query(self, text: str) -> NDArray[np.float32]:
        q = np.asarray(self.inner.embed_query(text), dtype=np.float32)
        q = q + 0.05 * _unit_rows(1, q.shape[0], 1234)[0]
        return (q / np.linalg.norm(q)).astype(np.float32)


class NodeStoreTests:
    """What every :class:`~raptor_core.types.NodeStore` must do, checked on :func:`store_tree`.

    Override :meth:`make_store` (a new, empty store for vectors of dimension ``dim``).  An
    approximate (ANN) store sets ``exact = False``: rankings are then compared as sets of
    the top hits rather than in order.  A store that cannot list its nodes sets
    ``listable = False``: reading every leaf once (``passage`` with ``scope="all"``) must then
    fail with a clear error, and ``passage`` by default works on the leaves its search finds
    (``scope="found"``), as it does on the tree with that scope.  Errors for bad input must be ``ValueError``
    subclasses (``InvalidInputError``, ``InvalidParameterError``).
    """

    dim = 32
    exact = True
    listable = True
    score_atol = 1e-5

    def make_store(self) -> NodeStore:
        """Return a new, empty store (override)."""
        raise NotImplementedError

    # -- helpers -------------------------------------------------------------------------------
    def filled(self) -> tuple[Any, Tree]:
        """A store holding :func:`store_tree`, and the tree."""
        tree = store_tree(self.dim)
        return self.holding(tree), tree

    def holding(self, tree: Tree) -> Any:
        """A new store holding ``tree`` (override for a store that cannot be written)."""
        store = self.make_store()
        store.add(list(tree.nodes), tree.embeddings)
        return store

    def query(self, seed: int = 7) -> NDArray[np.float32]:
        """A unit query vector."""
        return _unit_rows(1, self.dim, seed)[0]

    def expected(
        self, tree: Tree, vector: NDArray[np.float32], k: int, where: NodeFilter | None = None
    ) -> list[tuple[str, float]]:
        """The brute-force answer of ``search`` on ``tree``."""
        from raptor_core.store.filters import compile_where
        from raptor_core.tree import is_carried

        where = where or NodeFilter()
        passes = compile_where(where.where) if where.where is not None else None
        rows = []
        for row, node in enumerate(tree.nodes):
            if where.layers is not None and node.layer not in where.layers:
                continue
            if where.ids is not None and node.id not in where.ids:
                continue
            if where.parents is not None and not set(node.parents) & where.parents:
                continue
            if where.doc_ids is not None and node.doc_id not in where.doc_ids:
                continue
            if not where.include_carried and is_carried(node):
                continue
            if passes is not None and not passes(node):
                continue
            rows.append(row)
        scores = tree.embeddings[rows] @ vector
        order = np.lexsort((np.arange(len(rows)), -scores))[:k]
        return [(tree.nodes[rows[i]].id, float(scores[i])) for i in order]

    def assert_same(
        self, found: Sequence[Any], expected: Sequence[tuple[str, float]], *, ranked: bool = True
    ) -> None:
        """``found`` matches agree with ``expected`` ids (in order when exact) and scores."""
        ids = [m.node.id for m in found]
        want = [i for i, _ in expected]
        if self.exact and ranked:
            assert ids == want, (ids, want)
        else:
            assert set(ids) == set(want), (ids, want)
        by_id = dict(expected)
        for match in found:
            assert abs(match.score - by_id[match.node.id]) <= self.score_atol

    # -- the protocol --------------------------------------------------------------------------
    def test_satisfies_protocol(self) -> None:
        """The store is a NodeStore by duck typing."""
        assert isinstance(self.make_store(), NodeStore)

    def test_add_len_iter_get(self) -> None:
        """Everything added comes back, equal, by id and by iteration."""
        import pytest

        store, tree = self.filled()
        assert len(store) == len(tree)
        if self.listable:
            assert {n.id for n in store} == {n.id for n in tree.nodes}
        else:
            with pytest.raises(ValueError, match="list"):
                list(store)
        ids = [tree.nodes[i].id for i in (5, 0, len(tree) - 1)]
        got = store.get([*ids, "no-such-node"])
        assert [n.id for n in got] == ids  # order kept, unknown left out
        for node in got:
            assert node == tree.node(node.id)

    def test_nodes_round_trip_with_their_structure(self) -> None:
        """Children, parents, layer, spans, doc ids, token counts and metadata survive."""
        store, tree = self.filled()
        for node in store.get([n.id for n in tree.nodes]):
            original = tree.node(node.id)
            assert node.children == original.children
            assert node.parents == original.parents
            assert (node.layer, node.token_count, node.span) == (
                original.layer,
                original.token_count,
                original.span,
            )
            assert (node.doc_id, node.doc_ids) == (original.doc_id, original.doc_ids)
            assert dict(node.metadata) == dict(original.metadata)
            assert node.text == original.text

    def test_upsert_replaces(self) -> None:
        """Adding an id that is stored replaces the node and its vector."""
        from dataclasses import replace

        store, tree = self.filled()
        leaf = tree.leaves[0]
        changed = replace(leaf, text="replaced text")
        vector = -tree.embeddings[tree.row(leaf.id)]
        store.add([changed], vector[None, :])
        assert len(store) == len(tree)
        assert store.get([leaf.id])[0].text == "replaced text"
        best = store.search(vector, 1, where=NodeFilter(layers=frozenset({0})))
        assert best[0].node.id == leaf.id
        assert abs(best[0].score - 1.0) <= self.score_atol

    def test_delete(self) -> None:
        """Deleted ids are gone from len, iter, get and search; unknown ids are ignored."""
        store, tree = self.filled()
        gone = [tree.leaves[0].id, tree.leaves[1].id]
        store.delete([*gone, "no-such-node"])
        assert len(store) == len(tree) - 2
        assert store.get(gone) == []
        if self.listable:
            assert not {n.id for n in store} & set(gone)
        found = store.search(self.query(), len(tree), where=NodeFilter(include_carried=True))
        assert not {m.node.id for m in found} & set(gone)

    def test_search_is_exact_and_best_first(self) -> None:
        """Search returns the brute-force top k with cosine scores, best first."""
        store, tree = self.filled()
        for seed in range(5):
            q = self.query(seed)
            found = store.search(q, 6)
            self.assert_same(found, self.expected(tree, q, 6))
            scores = [m.score for m in found]
            assert scores == sorted(scores, reverse=True)

    def test_k_larger_than_the_store(self) -> None:
        """Asking for more than there is returns everything that passes."""
        store, tree = self.filled()
        q = self.query()
        where = NodeFilter(include_carried=True)
        found = store.search(q, 10 * len(tree), where=where)
        assert len(found) == len(tree)

    def test_empty_store_finds_nothing(self) -> None:
        """An empty store answers with an empty list."""
        store = self.make_store()
        assert len(store) == 0
        assert store.search(self.query(), 3) == []

    def test_structural_filters(self) -> None:
        """layers, ids, parents, doc_ids and carried copies filter as documented."""
        store, tree = self.filled()
        q = self.query(3)
        top = tree.top_layer
        summary = next(n for n in tree.layer(1) if len(n.children) > 1)
        cases = [
            NodeFilter(layers=frozenset({0})),
            NodeFilter(layers=frozenset({1, top})),
            NodeFilter(ids=frozenset(n.id for n in tree.nodes[::3])),
            NodeFilter(parents=frozenset({summary.id})),
            NodeFilter(doc_ids=frozenset({"bees"})),
            NodeFilter(include_carried=True),
            NodeFilter(layers=frozenset({0}), doc_ids=frozenset({"rockets", "volcanoes"})),
        ]
        for where in cases:
            self.assert_same(store.search(q, 50, where=where), self.expected(tree, q, 50, where))

    def test_carried_copies_are_left_out_by_default(self) -> None:
        """A carried copy is only returned when asked for."""
        from raptor_core.tree import is_carried

        store, tree = self.filled()
        carried = [n for n in tree.nodes if is_carried(n)]
        assert carried, "store_tree() has a carried node"
        found = {m.node.id for m in store.search(self.query(), 10 * len(tree))}
        assert not found & {n.id for n in carried}

    def test_metadata_filters(self) -> None:
        """The core filter dialect: equality, comparisons, membership, $and/$or, doc_id."""
        store, tree = self.filled()
        q = self.query(5)
        cases: list[dict[str, Any]] = [
            {"topic": "nature"},
            {"year": {"$gte": 2020}},
            {"year": {"$lt": 2020}},
            {"lang": {"$in": ["de", "fr"]}},
            {"lang": {"$ne": "en"}},
            {"topic": "nature", "year": 2021},
            {"$or": [{"lang": "de"}, {"topic": "space"}]},
            {"$and": [{"topic": "nature"}, {"year": {"$gt": 2019}}]},
            {"doc_id": "rockets"},
            {"doc_id": {"$in": ["bees", "volcanoes"]}},
        ]
        for condition in cases:
            where = NodeFilter(where=condition)
            expected = self.expected(tree, q, 50, where)
            assert expected, condition
            self.assert_same(store.search(q, 50, where=where), expected)

    def test_list_operator_filters(self) -> None:
        """``$contains``/``$any``/``$all`` on list metadata, summaries included, as in Python."""
        from dataclasses import replace

        from raptor_core.build.builder import summary_metadata
        from raptor_core.tree import is_carried

        base = store_tree(self.dim)
        tags = {"bees": ["insects", "nature"], "rockets": ["space"], "volcanoes": ["nature"]}
        nodes: dict[str, Node] = {}
        for node in base.nodes:  # children come before their parents
            if node.is_leaf:
                meta = {**node.metadata, "tags": tags[str(node.doc_id)]}
            else:
                meta = summary_metadata([nodes[c] for c in node.children])
            nodes[node.id] = replace(node, metadata=meta)
        tree = Tree(nodes=tuple(nodes.values()), embeddings=base.embeddings, params=base.params)
        store = self.holding(tree)
        q = self.query(5)
        cases: list[dict[str, Any]] = [
            {"tags": {"$contains": "nature"}},
            {"tags": {"$any": ["space", "insects"]}},
            {"tags": {"$all": ["nature", "insects"]}},
            {"$or": [{"tags": {"$contains": "space"}}, {"lang": "de"}]},
            {"tags": {"$contains": "nature"}, "year": {"$gte": 2020}},
        ]
        for condition in cases:
            where = NodeFilter(where=condition)
            expected = self.expected(tree, q, 50, where)
            assert expected, condition
            self.assert_same(store.search(q, 50, where=where), expected)
        # A summary over documents whose lists differ has no tags: it fails even a filter
        # that every leaf below it passes.
        mixed = {n.id for n in tree.nodes if len(n.doc_ids) > 1}
        assert mixed and all("tags" not in tree.node(i).metadata for i in mixed)
        either = NodeFilter(where={"tags": {"$any": ["space", "nature", "insects"]}})
        found = {m.node.id for m in store.search(q, 100, where=either)}
        assert found == {n.id for n in tree.nodes if not is_carried(n)} - mixed
        # Operands no store may push down as they are (a number: Chroma's ordering path).
        for condition in ({"tags": {"$contains": 3}}, {"tags": {"$any": [3]}}):
            assert store.search(q, 50, where=NodeFilter(where=condition)) == []

    def test_summaries_pass_filters_only_for_what_they_all_share(self) -> None:
        """A summary over several documents never passes a per-document filter."""
        store, tree = self.filled()
        mixed = [n for n in tree.nodes if n.layer and len(n.doc_ids) > 1]
        assert mixed, "store_tree() has a summary over several documents"
        found = store.search(self.query(), 100, where=NodeFilter(where={"doc_id": "bees"}))
        assert all(m.node.doc_ids == ("bees",) for m in found)

    def test_strategies_match_the_in_memory_store(self) -> None:
        """Every strategy returns the same nodes, scores and order as on the tree itself."""
        import pytest

        from raptor_core.retrieval.passage import tree_tokenizer
        from raptor_core.retrieval.registry import make_retriever
        from raptor_core.testing import FakeEmbedder, ScriptedLLM, select_first

        store, tree = self.filled()
        embedder = _TieBreakingEmbedder(FakeEmbedder(dim=self.dim))
        configs: list[tuple[str, dict[str, Any]]] = [
            ("collapsed", {"k": 6, "max_tokens": 60}),
            ("collapsed", {"k": 6, "layers": [0], "where": {"topic": "nature"}}),
            ("traversal", {"k": 6, "top_k": 2}),
            ("traversal", {"k": 8, "threshold": 0.0}),
            ("value", {"k": 5, "chunk_k": 6}),
            ("value", {"k": 5, "chunk_k": 6, "include": "evidence"}),
            ("llm", {"k": 5, "top_k": 2}),
            ("passage", {"k": 5, "max_tokens": 40}),
            ("passage", {"k": 5, "max_tokens": 80, "where": {"topic": "nature"}}),
            ("passage", {"k": 5, "max_tokens": None}),
            ("passage", {"k": 5, "max_tokens": 40, "scope": "found"}),
            ("passage", {"k": 5, "max_tokens": 80, "where": {"topic": "nature"}, "scope": "found"}),
        ]
        # A store need not know how its tree was built; give passages the tree's tokenizer
        # so both cut the last passage alike.
        tokenizer = tree_tokenizer(tree)
        assert tokenizer is not None, "store_tree() records an allowlisted tokenizer"
        configs = [
            (name, {**params, "budget_tokenizer": tokenizer} if name == "passage" else params)
            for name, params in configs
        ]
        for query in ("where do bees find flowers", "rocket fuel and orbit", "lava and ash"):
            for strategy, params in configs:
                on_each = [params, params]  # (on the tree, on the store)
                if strategy == "passage" and not self.listable and "scope" not in params:
                    every = make_retriever(strategy, store, embedder, **params, scope="all")
                    with pytest.raises(ValueError, match="list"):
                        every.retrieve(query)
                    # By default the store's passages are made of the leaves a search finds.
                    on_each = [{**params, "scope": "found"}, params]
                results = []
                for source, kwargs in zip((tree, store), on_each, strict=True):
                    llm = ScriptedLLM(default=select_first(2))
                    retriever = make_retriever(strategy, source, embedder, llm=llm, **kwargs)
                    results.append(retriever.retrieve(query))
                on_tree, on_store = results
                if self.exact:
                    assert [h.id for h in on_store] == [h.id for h in on_tree], (strategy, query)
                else:
                    assert {h.id for h in on_store} == {h.id for h in on_tree}, (strategy, query)
                for a, b in zip(on_tree, on_store, strict=False):
                    if a.id == b.id:
                        assert abs(a.score - b.score) <= self.score_atol * 4

    def test_bad_input_is_a_value_error(self) -> None:
        """A wrong vector shape or k is a ValueError subclass, not a crash."""
        import pytest

        store, tree = self.filled()
        with pytest.raises(ValueError):
            store.search(self.query(), 0)
        with pytest.raises(ValueError):
            store.add([tree.leaves[0]], np.zeros((2, self.dim), dtype=np.float32))
