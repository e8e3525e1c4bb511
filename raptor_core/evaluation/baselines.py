"""Flat baselines that need no framework: BM25, dense, and their fusion over the tree's leaves.

All three rank the *same* ~100-token chunks that the RAPTOR tree was built on, so the only
difference from RAPTOR is the tree.  ``dense`` uses the leaf embeddings already in the tree
(the same model as every other retriever): it is the sanity baseline that the framework
retrievers over the same chunks should match.  ``fusion`` is the hybrid users build with
LlamaIndex ``QueryFusionRetriever(mode="reciprocal_rerank")`` or LangChain
``EnsembleRetriever``: reciprocal-rank fusion of the dense and BM25 rankings.

Each baseline returns a ranked list of texts longer than any budget needs; the harness cuts
it at the budget (:func:`~raptor_core.evaluation.metrics.fit_budget`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from raptor_core._imports import require
from raptor_core.retrieval.base import normalize_query, top_rows

if TYPE_CHECKING:
    from raptor_core.evaluation.runner import EvalCorpus

__all__ = [
    "RRF_K",
    "BM25Baseline",
    "DenseBaseline",
    "FusionBaseline",
    "candidate_k",
    "reciprocal_rank_fusion",
]

#: The reciprocal-rank-fusion constant of Cormack et al. (SIGIR 2009), which LlamaIndex's
#: ``QueryFusionRetriever`` and LangChain's ``EnsembleRetriever`` also use.
RRF_K = 60

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

    def ranked(self, question: str, k: int, *, matching_only: bool = False) -> list[int]:
        """Positions in :attr:`texts` of the ``k`` best chunks by BM25 score, best first.

        Args:
            question: the query.
            k: how many chunks.
            matching_only: drop chunks that share no query term (BM25 score 0), whose order
                among themselves is arbitrary.
        """
        if not self.texts:
            return []
        query = self._bm25s.tokenize([question], return_ids=False, show_progress=False)
        if not any(query):
            return []  # nothing but stop words: BM25 has no signal
        ids, scores = self._index.retrieve(
            query, k=min(k, len(self.texts)), show_progress=False, n_threads=1
        )
        return [
            int(i) for i, s in zip(ids[0], scores[0], strict=True) if s > 0 or not matching_only
        ]

    def retrieve(self, question: str, *, max_tokens: int) -> list[str]:
        """Chunks ranked by BM25 score, best first."""
        ranked = self.ranked(question, candidate_k(max_tokens, len(self.texts)))
        return [self.texts[i] for i in ranked]


class DenseBaseline:
    """Cosine similarity over the leaves' own texts: flat dense retrieval, same chunks.

    The tree's leaf vectors are reused where they are the text's own; a leaf that the tree
    embedded under its section heading (``TreeBuilder(section_context=True)``) is embedded
    again by its text alone, as a flat retriever over the same chunks would.

    Args:
        corpus: the evaluation corpus; its embedder embeds the queries (and those leaves).
    """

    def __init__(self, corpus: EvalCorpus) -> None:
        tree = corpus.tree
        rows = tree.layer_rows(0) if tree.num_layers else np.zeros(0, dtype=np.intp)
        leaves = [tree.nodes[int(r)] for r in rows]
        self.texts = [leaf.text for leaf in leaves]
        matrix = np.array(tree.embeddings[rows], dtype=np.float32)  # (n_leaves, d)
        if tree.params.get("section_context") is True:
            from raptor_core.build.sections import leaf_context

            in_context = leaf_context(corpus.documents, leaves)
            redo = [i for i, leaf in enumerate(leaves) if leaf.id in in_context]
            if redo:
                plain = np.asarray(
                    corpus.embedder.embed_documents([self.texts[i] for i in redo]),
                    dtype=np.float32,
                )
                matrix[redo] = plain / np.linalg.norm(plain, axis=1, keepdims=True)
        self._matrix = matrix
        self._dim = tree.dim
        self._embedder: Any = corpus.embedder

    def ranked(self, question: str, k: int) -> list[int]:
        """Positions in :attr:`texts` of the ``k`` chunks most similar to the question."""
        if not self.texts:
            return []
        vector = normalize_query(self._embedder.embed_query(question), self._dim)
        scores = self._matrix @ vector  # (n_leaves,)
        return [int(i) for i in top_rows(scores, min(k, len(self.texts)))]

    def retrieve(self, question: str, *, max_tokens: int) -> list[str]:
        """Chunks ranked by cosine similarity to the question, best first."""
        ranked = self.ranked(question, candidate_k(max_tokens, len(self.texts)))
        return [self.texts[i] for i in ranked]


def reciprocal_rank_fusion(rankings: Sequence[Sequence[int]], *, k: int = RRF_K) -> list[int]:
    """Fuse ranked lists of item ids: ``score(d) = sum over lists of 1 / (k + rank(d))``.

    Ranks start at 1.  An item missing from a list gets nothing from it.  Ties keep the
    order in which the items were first seen (the first list first), so the result is
    deterministic.

    Args:
        rankings: ranked item ids, best first, one list per retriever.
        k: the fusion constant; larger values flatten the rank discount.

    Returns:
        Every item of every list, best fused score first.

    Examples:
        >>> reciprocal_rank_fusion([[1, 2, 3], [3, 1]])
        [1, 3, 2]
    """
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking, 1):
            scores[item] = scores.get(item, 0.0) + 1.0 / (k + rank)
    order = {item: i for i, item in enumerate(scores)}  # first-seen order breaks ties
    return sorted(scores, key=lambda item: (-scores[item], order[item]))


class FusionBaseline:
    """Reciprocal-rank fusion of :class:`DenseBaseline` and :class:`BM25Baseline` (k = 60).

    Each retriever contributes its top :func:`candidate_k` chunks, as a user's
    ``QueryFusionRetriever`` or ``EnsembleRetriever`` would; the fused list is ranked by
    ``1 / (60 + dense rank) + 1 / (60 + BM25 rank)``.  The constant is the usual one, not
    tuned on any data set.

    Args:
        corpus: the evaluation corpus; its tree's layer-0 chunks are ranked.
    """

    def __init__(self, corpus: EvalCorpus) -> None:
        self._dense = DenseBaseline(corpus)
        self._bm25 = BM25Baseline(corpus)
        self.texts = self._dense.texts

    def retrieve(self, question: str, *, max_tokens: int) -> list[str]:
        """Chunks ranked by fused reciprocal rank, best first."""
        if not self.texts:
            return []
        m = candidate_k(max_tokens, len(self.texts))
        dense = self._dense.ranked(question, m)
        # Chunks sharing no term with the question have BM25 score 0 and an arbitrary order:
        # they carry no lexical signal, so only the matching ones vote.
        lexical = self._bm25.ranked(question, m, matching_only=True)
        return [self.texts[i] for i in reciprocal_rank_fusion([dense, lexical])[:m]]
