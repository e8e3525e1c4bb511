"""FaissHNSWIndex: conformance, recall against exact search, exact scores, restrict_to, threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from raptor_core import (
    CollapsedTreeRetriever,
    FaissHNSWIndex,
    InMemoryNodeStore,
    InvalidParameterError,
    NumpyIndex,
    VectorIndex,
)
from raptor_core.testing import FakeEmbedder, VectorIndexTests, random_tree


class TestFaissHNSWIndex(VectorIndexTests):
    """The defaults: the suite's few dozen vectors are under ``exact_below``."""

    def make_index(self) -> VectorIndex:
        return FaissHNSWIndex()


class TestFaissHNSWGraph(VectorIndexTests):
    """The graph alone (``exact_below=0``): at the suite's sizes it still finds the exact top k."""

    def make_index(self) -> VectorIndex:
        return FaissHNSWIndex(exact_below=0)


def _texts(n: int, seed: int) -> list[str]:
    """Short texts over a small vocabulary: FakeEmbedder maps shared words to nearby vectors."""
    rng = np.random.default_rng(seed)
    vocabulary = [f"w{i}" for i in range(400)]
    return [" ".join(rng.choice(vocabulary, size=int(rng.integers(4, 12)))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus() -> tuple[list[str], np.ndarray, np.ndarray]:
    embedder = FakeEmbedder(dim=64)
    vectors = np.asarray(embedder.embed_documents(_texts(4000, 0)), dtype=np.float32)
    queries = np.asarray(embedder.embed_documents(_texts(40, 1)), dtype=np.float32)
    return [f"n{i}" for i in range(len(vectors))], vectors, queries


@pytest.fixture(scope="module")
def indexes(corpus) -> tuple[NumpyIndex, FaissHNSWIndex]:
    ids, vectors, _ = corpus
    exact, graph = NumpyIndex(), FaissHNSWIndex(exact_below=0)
    for index in (exact, graph):
        index.add(ids[:2500], vectors[:2500])  # two adds: the graph grows in place
        index.add(ids[2500:], vectors[2500:])
    return exact, graph


def _recall(found: list[list[str]], truth: list[list[tuple[str, float]]]) -> float:
    """Mean share of the found ids scoring at least the exact k-th best (ties count as found)."""
    shares = []
    for ids, exact in zip(found, truth, strict=True):
        score = dict(exact)
        kth = exact[len(ids) - 1][1] if len(exact) >= len(ids) else -1.0
        shares.append(sum(score.get(i, -2.0) >= kth - 1e-6 for i in ids) / len(ids))
    return float(np.mean(shares))


def test_recall_at_10_against_exact_search(corpus, indexes) -> None:
    ids, vectors, queries = corpus
    exact, graph = indexes
    truth = [exact.search(q, len(ids)) for q in queries]
    found = [[i for i, _ in graph.search(q, 10)] for q in queries]
    assert _recall(found, truth) >= 0.95
    # A narrow beam loses neighbours: the recall above comes from the graph, not from luck.
    narrow = FaissHNSWIndex(m=2, ef_construction=1, ef_search=1, exact_below=0)
    narrow.add(ids, vectors)
    assert _recall([[i for i, _ in narrow.search(q, 10)] for q in queries], truth) < 0.9


def test_scores_are_the_exact_cosines_of_the_returned_ids(corpus, indexes) -> None:
    ids, vectors, queries = corpus
    exact, graph = indexes
    row = {i: j for j, i in enumerate(ids)}
    for q in queries[:10]:
        found = graph.search(q, 25)
        assert len(found) == 25
        scores = [s for _, s in found]
        assert scores == sorted(scores, reverse=True)
        unit = q / np.linalg.norm(q)
        expected = vectors[[row[i] for i, _ in found]] @ unit
        np.testing.assert_allclose(scores, expected, atol=1e-6)
        everything = dict(exact.search(q, len(ids)))
        np.testing.assert_allclose(scores, [everything[i] for i, _ in found], atol=1e-6)


@pytest.mark.parametrize("share", [0.02, 0.3, 0.9])
def test_restrict_to_returns_only_allowed_ids(corpus, indexes, share: float) -> None:
    """Small sets are searched exactly; large ones in the graph, with a fallback."""
    ids, _, queries = corpus
    exact, graph = indexes
    rng = np.random.default_rng(3)
    allowed = frozenset(i for i in ids if rng.random() < share)
    truth, found = [], []
    for q in queries:
        hits = graph.search(q, 10, restrict_to=allowed)
        assert len(hits) == 10 and all(i in allowed for i, _ in hits)
        found.append([i for i, _ in hits])
        truth.append(exact.search(q, len(allowed), restrict_to=allowed))
    assert _recall(found, truth) >= 0.95
    if share < 0.5:  # priced as an exact product over the allowed rows
        assert found == [[i for i, _ in t[:10]] for t in truth]


def test_restrict_to_falls_back_to_exact_when_the_graph_runs_short() -> None:
    """A filter the graph cannot reach enough of still gets k exact answers."""
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((3000, 16)).astype(np.float32)
    ids = [f"v{i}" for i in range(3000)]
    graph, exact = FaissHNSWIndex(m=2, ef_search=1, exact_below=0), NumpyIndex()
    graph.add(ids, vectors)
    exact.add(ids, vectors)
    allowed = frozenset(ids[:2900])  # 97%: searched in the graph with a beam of one
    query = rng.standard_normal(16).astype(np.float32)
    hits = graph.search(query, 2900, restrict_to=allowed)
    assert hits == exact.search(query, 2900, restrict_to=allowed)


def test_unknown_and_empty_restrictions(indexes) -> None:
    _, graph = indexes
    query = np.ones(64, dtype=np.float32)
    assert graph.search(query, 5, restrict_to=frozenset()) == []
    assert graph.search(query, 5, restrict_to={"nope"}) == []
    assert [i for i, _ in graph.search(query, 5, restrict_to={"n7", "nope"})] == ["n7"]


@pytest.mark.parametrize(
    ("setting", "value", "hint"),
    [
        ("m", 1, "at least 2 neighbours"),
        ("m", 2.5, "at least 2 neighbours"),
        ("ef_construction", 0, "better graph"),
        ("ef_search", 0, "better recall"),
        ("ef_search", True, "better recall"),
        ("exact_below", -1, "0 searches the graph"),
    ],
)
def test_bad_settings_say_what_to_do(setting: str, value: object, hint: str) -> None:
    with pytest.raises(InvalidParameterError, match=f"{setting} must be an integer.*{hint}"):
        FaissHNSWIndex(**{setting: value})  # type: ignore[arg-type]


def test_concurrent_searches_match_serial_ones(corpus, indexes) -> None:
    ids, _, queries = corpus
    _, graph = indexes
    allowed = frozenset(ids[::5] + ids[1::5] + ids[2::5] + ids[3::5])  # 80%: the graph path
    few = frozenset(ids[::50])  # the exact path
    jobs = [(q, r) for q in queries for r in (None, allowed, few)]
    serial = [graph.search(q, 10, restrict_to=r) for q, r in jobs]
    results: list[list[list[tuple[str, float]]]] = [[] for _ in range(16)]
    barrier = threading.Barrier(16)

    def worker(t: int) -> None:
        barrier.wait()
        results[t] = [graph.search(q, 10, restrict_to=r) for q, r in jobs[t:] + jobs[:t]]

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for t, got in enumerate(results):
        assert got == serial[t:] + serial[:t]


def test_retrievers_and_stores_search_through_it() -> None:
    tree = random_tree(2500, fanout=6, dim=32, random_state=2)
    embedder = FakeEmbedder(dim=32)
    index = FaissHNSWIndex.from_tree(tree, ef_search=96, exact_below=0)
    assert len(index) == len(tree) and index.ef_search == 96
    queries = [f"topic {i}" for i in range(20)]
    plain = CollapsedTreeRetriever(tree, embedder, k=10)
    graph = CollapsedTreeRetriever(tree, embedder, k=10, index=index)
    found = [[h.id for h in graph.retrieve(q)] for q in queries]
    truth = [
        [(h.id, h.score) for h in plain.retrieve(q, k=len(tree), max_tokens=None)] for q in queries
    ]
    assert _recall(found, truth) >= 0.95
    for q in queries[:5]:
        for hit in graph.retrieve(q, max_tokens=None):
            vector = tree.embeddings[tree.row(hit.id)]
            cosine = float(vector @ embedder.embed_query(q)) / float(
                np.linalg.norm(embedder.embed_query(q)) * np.linalg.norm(vector)
            )
            assert hit.score == pytest.approx(max(cosine, 0.0), abs=1e-5)

    store = InMemoryNodeStore.from_tree(tree, index=FaissHNSWIndex(m=8, exact_below=0))
    gone = tree.leaves[0].id
    store.delete([gone])
    assert isinstance(store.index, FaissHNSWIndex)
    assert (store.index.m, store.index.exact_below) == (8, 0)  # rebuilt with its settings
    assert len(store.index) == len(tree) - 1
    q = np.asarray(tree.embeddings[tree.row(gone)])
    assert gone not in [m.node.id for m in store.search(q, 5)]


def test_repr() -> None:
    assert repr(FaissHNSWIndex(m=16)) == (
        "FaissHNSWIndex(size=0, dim=None, m=16, ef_construction=80, ef_search=128, "
        "exact_below=2048)"
    )
