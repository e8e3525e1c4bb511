"""FaissHNSWIndex over real all-MiniLM-L6-v2 vectors: recall against exact search, retrievers."""

from __future__ import annotations

import numpy as np
import pytest

from raptor_core import CollapsedTreeRetriever, FaissHNSWIndex, NumpyIndex, Tree

pytestmark = pytest.mark.integration

QUESTIONS = [
    "Who were the crew of Apollo 11?",
    "What dance do honeybees use to show where flowers are?",
    "Who built the printing press in Mainz?",
    "What makes some volcanic eruptions explosive?",
    "What does hydration mean for a sourdough loaf?",
    "How do mRNA vaccines work?",
    "When did the first moon landing happen?",
    "How is bread leavened without yeast?",
]


@pytest.fixture(scope="module")
def windows(st_embedder, multi_topic_text: str) -> tuple[list[str], np.ndarray]:
    """Overlapping 12-word windows of the six-topic text (about 900), embedded for real."""
    words = multi_topic_text.split()
    texts = [" ".join(words[i : i + 12]) for i in range(0, len(words) - 12, 3)]
    return texts, np.asarray(st_embedder.embed_documents(texts), dtype=np.float32)


def test_recall_against_exact_search_on_real_vectors(windows, st_embedder) -> None:
    texts, vectors = windows
    ids = [f"w{i}" for i in range(len(texts))]
    exact, graph = NumpyIndex(), FaissHNSWIndex(exact_below=0)
    exact.add(ids, vectors)
    graph.add(ids, vectors)
    shares = []
    for question in QUESTIONS:
        q = st_embedder.embed_query(question)
        truth = exact.search(q, 10)
        found = graph.search(q, 10)
        kth = truth[-1][1]
        score = dict(exact.search(q, len(ids)))
        shares.append(sum(score[i] >= kth - 1e-6 for i, _ in found) / 10)
        # exact cosines of the returned ids
        np.testing.assert_allclose([s for _, s in found], [score[i] for i, _ in found], atol=1e-6)
    assert np.mean(shares) >= 0.95


def test_collapsed_retrieval_through_hnsw_matches_exact(real_tree: Tree, st_embedder) -> None:
    index = FaissHNSWIndex.from_tree(real_tree, exact_below=0)
    for question in QUESTIONS:
        exact = CollapsedTreeRetriever(real_tree, st_embedder, k=5).retrieve(question)
        graph = CollapsedTreeRetriever(real_tree, st_embedder, k=5, index=index).retrieve(question)
        assert [h.id for h in graph] == [h.id for h in exact]
        np.testing.assert_allclose([h.score for h in graph], [h.score for h in exact], atol=1e-6)
        leaves = CollapsedTreeRetriever(
            real_tree, st_embedder, k=5, layers=[0], index=index
        ).retrieve(question)
        assert leaves and {h.layer for h in leaves} == {0}
