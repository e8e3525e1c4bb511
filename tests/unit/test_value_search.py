"""Value-based tree search: NodeScore = sum(chunk scores) / sqrt(N + 1)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from raptor_core import (
    CollapsedTreeRetriever,
    FaissIndex,
    InvalidInputError,
    InvalidParameterError,
    Node,
    NumpyIndex,
    Tree,
    ValueBasedRetriever,
)
from raptor_core.retrieval.value import mean_chunk_score, node_score
from raptor_core.testing import FakeEmbedder, random_tree, tiny_tree


class VectorEmbedder:
    def __init__(self, vector: np.ndarray) -> None:
        self.vector = np.asarray(vector, dtype=np.float32)

    def embed_documents(self, texts):
        return np.tile(self.vector, (len(texts), 1))

    def embed_query(self, text):
        return self.vector


def scored_tree(groups: dict[str, list[float]], dim: int = 16) -> tuple[Tree, np.ndarray]:
    """Summaries over leaves whose cosine with the query (e_0) is exactly the given score."""
    query = np.zeros(dim, dtype=np.float32)
    query[0] = 1.0
    nodes, vectors = [], []
    summaries = []
    axis = 1
    for name, scores in groups.items():
        children = []
        for score in scores:
            leaf_id = f"{name}-leaf{len(children)}"
            v = np.zeros(dim, dtype=np.float32)
            v[0], v[axis] = score, math.sqrt(1 - score**2)  # unit, cosine = score
            axis += 1
            nodes.append(Node(id=leaf_id, text=leaf_id, layer=0, token_count=10, doc_id="d"))
            vectors.append(v)
            children.append(leaf_id)
        summaries.append((name, tuple(children)))
    for name, children in summaries:
        v = np.zeros(dim, dtype=np.float32)
        v[-1] = 1.0  # summaries' own similarity plays no part in NodeScore
        nodes.append(Node(id=name, text=name, layer=1, token_count=10, children=children))
        vectors.append(v)
    return Tree(nodes=tuple(nodes), embeddings=np.stack(vectors)), query


def test_one_strong_chunk_beats_three_weak_ones_of_the_same_total() -> None:
    assert node_score([0.9]) > node_score([0.3, 0.3, 0.3])
    tree, q = scored_tree({"strong": [0.9], "weak": [0.3, 0.3, 0.3]})
    hits = ValueBasedRetriever(tree, VectorEmbedder(q), include="summaries").retrieve("q")
    assert [h.id for h in hits] == ["strong", "weak"]
    # Ranked by NodeScore; the hit score is the mean cosine of the node's retrieved chunks.
    assert hits[0].score == pytest.approx(0.9, abs=1e-6)
    assert hits[1].score == pytest.approx(0.3, abs=1e-6)
    assert "0.900 / sqrt(1 + 1)" in hits[0].reason


def test_more_relevant_chunks_raise_the_score_with_diminishing_returns() -> None:
    values = [node_score([0.5] * n) for n in range(1, 8)]
    gains = np.diff(values)
    assert np.all(gains > 0)
    assert np.all(np.diff(gains) < 0)
    tree, q = scored_tree({"one": [0.5], "two": [0.5, 0.5], "three": [0.5, 0.5, 0.5]})
    hits = ValueBasedRetriever(tree, VectorEmbedder(q), include="summaries").retrieve("q")
    assert [h.id for h in hits] == ["three", "two", "one"]


def test_a_better_chunk_raises_the_score() -> None:
    assert node_score([0.8, 0.4]) > node_score([0.7, 0.4])
    assert node_score([]) == 0.0


def test_n_counts_retrieved_chunks_only() -> None:
    # "big" has 6 leaves but only its 2 best are among the top chunk_k: N = 2, not 6.
    tree, q = scored_tree({"big": [0.95, 0.9, 0.1, 0.1, 0.1, 0.1], "small": [0.85]})
    hits = ValueBasedRetriever(tree, VectorEmbedder(q), include="summaries", chunk_k=3).retrieve(
        "q"
    )
    big = next(h for h in hits if h.id == "big")
    assert big.score == pytest.approx((0.95 + 0.9) / 2, abs=1e-6)
    assert big.score == pytest.approx(mean_chunk_score((0.95 + 0.9) / math.sqrt(3), 2), abs=1e-6)
    assert [c for c, _ in big.evidence] == ["big-leaf0", "big-leaf1"]
    assert "2 of the top 3 chunks" in big.reason


@pytest.fixture(scope="module")
def tree() -> Tree:
    return random_tree(150, fanout=5, dim=16, soft=0.3, random_state=7)


def _query(tree: Tree, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q = tree.embeddings[int(rng.integers(len(tree.leaves)))] + 0.3 * rng.standard_normal(tree.dim)
    return (q / np.linalg.norm(q)).astype(np.float32)


def _brute_force(tree: Tree, q: np.ndarray, chunk_k: int) -> dict[str, float]:
    leaf_scores = {n.id: float(tree.embeddings[tree.row(n.id)] @ q) for n in tree.leaves}
    top = dict(sorted(leaf_scores.items(), key=lambda kv: -kv[1])[:chunk_k])
    out = {}
    for node in tree.nodes:
        under = {leaf.id for leaf in tree.leaf_descendants(node.id)}
        chunks = [s for i, s in top.items() if i in under]
        if chunks:
            out[node.id] = node_score(chunks)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_matches_a_brute_force_computation(tree: Tree, seed: int) -> None:
    q = _query(tree, seed)
    expected = _brute_force(tree, q, chunk_k=12)
    retriever = ValueBasedRetriever(tree, VectorEmbedder(q), chunk_k=12, k=1000, max_tokens=None)
    hits = retriever.retrieve("q")
    node_scores = {h.id: node_score([s for _, s in h.evidence]) for h in hits}
    assert {i: pytest.approx(v, abs=1e-5) for i, v in node_scores.items()} == expected
    ranked = [node_scores[h.id] for h in hits]
    assert ranked == sorted(ranked, reverse=True)  # the ranking follows NodeScore
    for hit in hits:
        under = {leaf.id for leaf in tree.leaf_descendants(hit.id)}
        assert {c for c, _ in hit.evidence} <= under
        chunk_scores = [s for _, s in hit.evidence]
        assert chunk_scores == sorted(chunk_scores, reverse=True)
        mean = sum(chunk_scores) / len(chunk_scores)
        assert hit.score == pytest.approx(min(1.0, max(0.0, mean)), abs=1e-5)
        assert 0.0 <= hit.score <= 1.0
        assert hit.source == "value"


def test_include_summaries_or_leaves(tree: Tree) -> None:
    q = _query(tree, 1)
    summaries = ValueBasedRetriever(tree, VectorEmbedder(q), include="summaries").retrieve("q")
    assert summaries and all(h.layer > 0 for h in summaries)
    leaves = ValueBasedRetriever(tree, VectorEmbedder(q), include="leaves", k=5).retrieve("q")
    assert all(h.layer == 0 for h in leaves)
    best = np.argsort(-(tree.embeddings[tree.layer_rows(0)] @ q))[:5]
    assert [h.id for h in leaves] == [tree.leaves[i].id for i in best]
    assert all(h.score == pytest.approx(max(0.0, h.evidence[0][1])) for h in leaves)


def test_k_max_tokens_and_min_score(tree: Tree) -> None:
    q = _query(tree, 2)
    assert len(ValueBasedRetriever(tree, VectorEmbedder(q), k=3).retrieve("q")) == 3
    for budget in (10, 35, 120):
        hits = ValueBasedRetriever(tree, VectorEmbedder(q), max_tokens=budget).retrieve("q")
        assert hits and sum(h.node.token_count for h in hits) <= budget
    assert ValueBasedRetriever(tree, VectorEmbedder(q), min_score=0.999).retrieve("q") == []
    some = ValueBasedRetriever(tree, VectorEmbedder(q), min_score=0.3, k=100).retrieve("q")
    assert all(s >= 0.3 for h in some for _, s in h.evidence)


@pytest.mark.parametrize("index_cls", [NumpyIndex, FaissIndex])
def test_an_index_gives_the_same_hits(tree: Tree, index_cls) -> None:
    q = _query(tree, 3)
    plain = ValueBasedRetriever(tree, VectorEmbedder(q), chunk_k=15).retrieve("q")
    for index in (index_cls.from_tree(tree), index_cls.from_tree(tree, layers=[0])):
        indexed = ValueBasedRetriever(tree, VectorEmbedder(q), chunk_k=15, index=index).retrieve(
            "q"
        )
        assert [h.id for h in indexed] == [h.id for h in plain]
        assert [h.score for h in indexed] == pytest.approx([h.score for h in plain], abs=1e-5)


def test_an_index_of_another_tree_is_a_clear_error(tree: Tree) -> None:
    other = NumpyIndex()
    other.add(["stranger"], np.ones((1, tree.dim), dtype=np.float32))
    q = _query(tree, 0)
    with pytest.raises(InvalidParameterError, match="must hold the tree's nodes"):
        ValueBasedRetriever(tree, VectorEmbedder(q), index=other).retrieve("q")
    with pytest.raises(InvalidParameterError, match="not in the tree"):
        CollapsedTreeRetriever(tree, VectorEmbedder(q), index=other).retrieve("q")


def test_edge_cases() -> None:
    tree = tiny_tree()
    everything = ValueBasedRetriever(tree, FakeEmbedder(tree.dim), k=100, chunk_k=100)
    assert {h.id for h in everything.retrieve("cats purr")} == {n.id for n in tree.nodes}
    empty = Tree(nodes=(), embeddings=np.zeros((0, 8), np.float32))
    assert ValueBasedRetriever(empty, FakeEmbedder(8)).retrieve("anything") == []
    with pytest.raises(InvalidInputError):
        everything.retrieve("")


@pytest.mark.parametrize(
    "params",
    [{"chunk_k": 0}, {"chunk_k": "5"}, {"include": "roots"}, {"min_score": -1.5}, {"k": 0}],
)
def test_validation(params: dict) -> None:
    tree = tiny_tree()
    with pytest.raises(InvalidParameterError):
        ValueBasedRetriever(tree, FakeEmbedder(tree.dim), **params).retrieve("cats")


async def test_aretrieve_inside_a_running_loop(tree: Tree) -> None:
    retriever = ValueBasedRetriever(tree, VectorEmbedder(_query(tree, 0)))
    assert [h.id for h in await retriever.aretrieve("q")] == [h.id for h in retriever.retrieve("q")]


def test_include_evidence_reads_the_best_nodes_chunks() -> None:
    from raptor_core import ValueBasedRetriever
    from raptor_core.testing import FakeEmbedder, random_tree

    tree = random_tree(60)
    embedder = FakeEmbedder(tree.dim)
    query = tree.leaves[5].text
    nodes = ValueBasedRetriever(tree, embedder, k=50, max_tokens=None, chunk_k=10).retrieve(query)
    hits = ValueBasedRetriever(
        tree, embedder, k=50, max_tokens=None, chunk_k=10, include="evidence"
    ).retrieve(query)
    assert hits and all(h.layer == 0 for h in hits)
    assert len({h.id for h in hits}) == len(hits)  # each chunk once
    retrieved = {c for n in nodes for c, _ in n.evidence}
    assert {h.id for h in hits} == retrieved  # exactly the retrieved chunks
    # Best node first: the chunks of the top node come first; each scores its own cosine.
    top_evidence = [c for c, _ in nodes[0].evidence]
    assert [h.id for h in hits[: len(top_evidence)]] == top_evidence
    assert all(h.score == pytest.approx(max(0.0, h.evidence[0][1])) for h in hits)
    assert hits[0].reason.startswith(f"evidence of {nodes[0].id}")
    budget = sum(h.node.token_count for h in hits[:3])
    capped = ValueBasedRetriever(
        tree, embedder, k=50, max_tokens=budget, chunk_k=10, include="evidence"
    ).retrieve(query)
    assert sum(h.node.token_count for h in capped) <= budget
    assert (
        len(
            ValueBasedRetriever(tree, embedder, k=2, chunk_k=10, include="evidence").retrieve(query)
        )
        == 2
    )
