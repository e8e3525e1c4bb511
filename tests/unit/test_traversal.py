"""Tree traversal (RAPTOR section 3): descent through children of selected nodes only."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from raptor_core import (
    InvalidInputError,
    InvalidParameterError,
    Tree,
    TreeTraversalRetriever,
)
from raptor_core.retrieval import Hit
from raptor_core.testing import (
    FakeEmbedder,
    random_tree,
    tiny_tree,
)


class VectorEmbedder:
    """Embeds every query as one fixed vector (the tests choose the geometry)."""

    def __init__(self, vector: np.ndarray) -> None:
        self.vector = np.asarray(vector, dtype=np.float32)

    def embed_documents(self, texts):
        return np.tile(self.vector, (len(texts), 1))

    def embed_query(self, text):
        return self.vector


@pytest.fixture(scope="module")
def tree() -> Tree:
    return random_tree(120, fanout=4, dim=16, soft=0.25, random_state=3)


def _query(tree: Tree, seed: int) -> np.ndarray:
    # Near a random leaf, so similarity is meaningful at every layer.
    rng = np.random.default_rng(seed)
    leaf = tree.embeddings[int(rng.integers(len(tree.leaves)))]
    q = leaf + 0.3 * rng.standard_normal(tree.dim).astype(np.float32)
    return q / np.linalg.norm(q)


def _retrieve(tree: Tree, q: np.ndarray, **params) -> list[Hit]:
    params.setdefault("k", 1000)
    params.setdefault("max_tokens", None)
    return TreeTraversalRetriever(tree, VectorEmbedder(q), **params).retrieve("question")


def _by_layer(hits: list[Hit]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for hit in hits:
        out.setdefault(hit.layer, set()).add(hit.id)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_descends_only_into_children_of_selected_nodes(tree: Tree, seed: int) -> None:
    hits = _retrieve(tree, _query(tree, seed), top_k=2)
    layers = _by_layer(hits)
    assert set(layers) == set(range(tree.num_layers))
    for layer in range(tree.top_layer):
        allowed = {c for parent in layers[layer + 1] for c in tree.node(parent).children}
        assert layers[layer] <= allowed, f"layer {layer} has nodes outside the selected subtrees"


@pytest.mark.parametrize("seed", range(5))
def test_selects_the_top_k_children_at_each_step(tree: Tree, seed: int) -> None:
    q = _query(tree, seed)
    layers = _by_layer(_retrieve(tree, q, top_k=3))
    scores = tree.embeddings @ q
    candidates = {n.id for n in tree.layer(tree.top_layer)}
    for layer in range(tree.top_layer, -1, -1):
        ranked = sorted(candidates, key=lambda i: -scores[tree.row(i)])
        assert layers[layer] == set(ranked[:3])
        candidates = {c for parent in layers[layer] for c in tree.node(parent).children}


def test_each_hit_has_its_selection_path(tree: Tree) -> None:
    for hit in _retrieve(tree, _query(tree, 0), top_k=2):
        path = hit.path
        assert path[-1] == hit.id
        assert tree.node(path[0]).layer == tree.top_layer
        for parent, child in pairwise(path):
            assert child in tree.node(parent).children
        assert hit.reason and hit.source == "traversal"


def test_soft_clustered_child_is_returned_once() -> None:
    tree = random_tree(80, fanout=3, dim=8, soft=0.9, random_state=1)
    hits = _retrieve(tree, _query(tree, 1), top_k=3)
    ids = [h.id for h in hits]
    assert len(ids) == len(set(ids))


def test_threshold_keeps_nodes_at_least_that_similar(tree: Tree) -> None:
    q = _query(tree, 3)
    scores = tree.embeddings @ q
    threshold = 0.1
    hits = _retrieve(tree, q, threshold=threshold)
    assert hits, "expected some similar nodes"
    assert all(h.score >= threshold for h in hits)
    # Completeness: every child of a selected node that passes the threshold is selected,
    # which the reference code's `distance > threshold` (least similar kept) would violate.
    selected = {h.id for h in hits}
    for hit in hits:
        for child in tree.node(hit.id).children:
            assert (child in selected) == (scores[tree.row(child)] >= threshold)
    top = tree.layer(tree.top_layer)
    assert {n.id for n in top if scores[tree.row(n.id)] >= threshold} == selected & {
        n.id for n in top
    }


def test_threshold_minus_one_keeps_every_child(tree: Tree) -> None:
    hits = _retrieve(tree, _query(tree, 4), threshold=-1.0)
    assert {h.id for h in hits} == {n.id for n in tree.nodes}


def test_threshold_one_keeps_almost_nothing(tree: Tree) -> None:
    assert _retrieve(tree, _query(tree, 4), threshold=1.0) == []
    # Only a node identical to the query can pass.
    top = tree.layer(tree.top_layer)[0]
    hits = _retrieve(tree, tree.embeddings[tree.row(top.id)], threshold=0.9999, num_layers=1)
    assert [h.id for h in hits] == [top.id]


def test_start_layer_and_num_layers(tree: Tree) -> None:
    q = _query(tree, 0)
    hits = _retrieve(tree, q, top_k=2, start_layer=1, num_layers=1)
    assert {h.layer for h in hits} == {1} and len(hits) == 2
    hits = _retrieve(tree, q, top_k=2, start_layer=1)
    assert {h.layer for h in hits} == {0, 1}
    hits = _retrieve(tree, q, top_k=2, num_layers=2)
    assert {h.layer for h in hits} == {tree.top_layer, tree.top_layer - 1}
    leaves = _retrieve(tree, q, top_k=4, start_layer=0)
    best = np.argsort(-(tree.embeddings[tree.layer_rows(0)] @ q))[:4]
    assert [h.id for h in leaves] == [tree.leaves[i].id for i in best]


def test_a_filter_starts_at_the_highest_layer_it_keeps(
    one_summary_per_document_tree: Tree,
) -> None:
    # Six documents of two leaves, one summary each, and top summaries over two documents:
    # a one-document filter keeps nothing of the top layer, so the descent starts below it.
    docs_tree = one_summary_per_document_tree

    def found(**params: object) -> list[str]:
        retriever = TreeTraversalRetriever(docs_tree, FakeEmbedder(), **params)  # type: ignore[arg-type]
        return [h.id for h in retriever.retrieve("cats purr")]

    d0 = found(where={"doc_id": "d0"})
    assert sorted(d0) == sorted(n.id for n in docs_tree.nodes if n.doc_id == "d0")
    assert found(where={"doc_id": "d0"}, num_layers=3) == d0  # no layer below the leaves
    assert found(where={"doc_id": "d0"}, start_layer=2) == []  # as given: nothing passes
    assert found(where={"doc_id": "nowhere"}) == []
    assert {docs_tree.node(i).layer for i in found()} == {0, 1, 2}  # unfiltered: from the top


def test_order_by_score_or_by_layer(tree: Tree) -> None:
    q = _query(tree, 3)
    by_score = _retrieve(tree, q, top_k=2)
    assert [h.score for h in by_score] == sorted((h.score for h in by_score), reverse=True)
    by_layer = _retrieve(tree, q, top_k=2, order="layer")
    assert [h.layer for h in by_layer] == sorted((h.layer for h in by_layer), reverse=True)
    assert {h.id for h in by_layer} == {h.id for h in by_score}


def test_k_and_max_tokens_bound_the_union(tree: Tree) -> None:
    q = _query(tree, 1)
    assert len(_retrieve(tree, q, top_k=3, k=4)) == 4
    for budget in (15, 40, 100):
        hits = _retrieve(tree, q, top_k=3, max_tokens=budget)
        assert sum(h.node.token_count for h in hits) <= budget
        assert hits


def test_k_larger_than_tree_and_min_score() -> None:
    tree = tiny_tree()
    retriever = TreeTraversalRetriever(tree, FakeEmbedder(tree.dim), top_k=50, k=500)
    assert len(retriever.retrieve("cats purr")) == len(tree)
    strict = TreeTraversalRetriever(tree, FakeEmbedder(tree.dim), min_score=0.99)
    assert strict.retrieve("cats purr") == []


def test_empty_tree_and_empty_query() -> None:
    empty = Tree(nodes=(), embeddings=np.zeros((0, 8), np.float32))
    assert TreeTraversalRetriever(empty, FakeEmbedder(8)).retrieve("anything") == []
    tree = tiny_tree()
    with pytest.raises(InvalidInputError):
        TreeTraversalRetriever(tree, FakeEmbedder(tree.dim)).retrieve("   ")


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"start_layer": 4}, "start_layer must be in \\[0, 3\\]"),
        ({"start_layer": -1}, "start_layer"),
        ({"start_layer": 1.5}, "start_layer must be an integer"),
        ({"num_layers": 5}, "num_layers must be at most start_layer \\+ 1 = 4"),
        ({"start_layer": 1, "num_layers": 3}, "at most start_layer \\+ 1 = 2"),
        ({"num_layers": 0}, "num_layers must be a positive integer"),
        ({"top_k": 0}, "top_k must be a positive integer"),
        ({"top_k": True}, "top_k"),
        ({"threshold": 1.5}, "threshold is a cosine similarity"),
        ({"threshold": -2}, "threshold"),
        ({"threshold": "high"}, "threshold"),
        ({"min_score": 3}, "min_score"),
        ({"order": "random"}, "order must be one of"),
    ],
)
def test_validation(tree: Tree, params: dict, message: str) -> None:
    retriever = TreeTraversalRetriever(tree, VectorEmbedder(_query(tree, 0)), **params)
    with pytest.raises(InvalidParameterError, match=message):
        retriever.retrieve("question")


async def test_aretrieve_inside_a_running_loop(tree: Tree) -> None:
    retriever = TreeTraversalRetriever(tree, VectorEmbedder(_query(tree, 0)), top_k=2)
    assert [h.id for h in await retriever.aretrieve("question")] == [
        h.id for h in retriever.retrieve("question")
    ]
