"""Flat baselines that need no framework: BM25 and dense retrieval over the tree's leaves.

Both rank the *same* ~100-token chunks that the RAPTOR tree was built on, so the only
difference from RAPTOR is the tree.  ``dense`` uses the leaf embeddings already in the tree
(the same model as every other retriever): it is the sanity baseline that the framework
retrievers over the same chunks should match.

Each baseline returns a ranked list of texts longer than any budget needs; the harness cuts
it at the budget (:func:`~raptor_core.evaluation.metrics.fit_budget`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from raptor_core._imports import require
from raptor_core.retrieval import normalize_query, top_rows

if TYPE_CHECKING:
    from raptor_core.evaluation.runner import EvalCorpus

__all__ = ["BM25Baseline", "DenseBaseline", "candidate_k"]

logger = logging.getLogger(__name__)


def candidate_k(max_tokens: int, available: int) -> int:
    """How many ranked chunks to ask a flat retriever for, so it can fill ``max_tokens``.

    One chunk per 25 budget tokens (at least 10): four times what ~100-token chunks need, so
    short chunks and duplicates cannot leave the budget unfilled.
    """
    return max(1, min(available, max(10, max_tokens // 25)))


class BM25Baseline:
    """BM25 (`bm25s <https://github.com/xhluca/bm25s>`_, its defaults) over the tree's leaves.

    Args:
        corpus: the evaluation corpus; its tree's layer-0 chunks are indexed.
    """

    def __init__(self, corpus: EvalCorpus) -> None:
        self._bm25s = require("bm25s", extra="eval")
        self.texts = [leaf.text for leaf in corpus.tree.leaves]
        self._index = self._bm25s.BM25()
        if self.texts:
            tokens = self._bm25s.tokenize(self.texts, show_progress=False)
            self._index.index(tokens, show_progress=False)

    def retrieve(self, question: str, *, max_tokens: int) -> list[str]:
        """Chunks ranked by BM25 score, best first."""
        if not self.texts:
            return []
        query = self._bm25s.tokenize([question], return_ids=False, show_progress=False)
        if not any(query):
            return []  # nothing but stop words: BM25 has no signal
        k = candidate_k(max_tokens, len(self.texts))
        ids, _scores = self._index.retrieve(query, k=k, show_progress=False, n_threads=1)
        return [self.texts[int(i)] for i in ids[0]]


class DenseBaseline:
    """Cosine similarity over the tree's leaf embeddings: flat dense retrieval, same chunks.

    Args:
        corpus: the evaluation corpus; its embedder embeds the queries.
    """

    def __init__(self, corpus: EvalCorpus) -> None:
        tree = corpus.tree
        rows = tree.layer_rows(0) if tree.num_layers else np.zeros(0, dtype=np.intp)
        self.texts = [tree.nodes[int(r)].text for r in rows]
        self._matrix = np.asarray(tree.embeddings[rows], dtype=np.float32)  # (n_leaves, d)
        self._dim = tree.dim
        self._embedder: Any = corpus.embedder

    def retrieve(self, question: str, *, max_tokens: int) -> list[str]:
        """Chunks ranked by cosine similarity to the question, best first."""
        if not self.texts:
            return []
        vector = normalize_query(self._embedder.embed_query(question), self._dim)
        scores = self._matrix @ vector  # (n_leaves,)
        ranked = top_rows(scores, candidate_k(max_tokens, len(self.texts)))
        return [self.texts[int(i)] for i in ranked]
