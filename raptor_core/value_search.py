"""Value-based tree search (the "node value" search of PageIndex's retrieval API).

1. Vector-search the leaf chunks for the ``chunk_k`` chunks most similar to the query.
2. A chunk belongs to itself and to every ancestor of it.  Each node that at least one
   retrieved chunk belongs to gets

       NodeScore = (sum of the scores of its retrieved chunks) / sqrt(N + 1)

   where ``N`` is the number of its *retrieved* chunks.
3. Return the best nodes within ``k`` and the token budget, each with the chunks (the
   evidence) that produced its score.

Why ``N`` counts retrieved chunks, not all chunks under the node: dividing by the size of
the whole subtree would punish every high-level summary for being large, so only leaves
and tiny summaries would ever win.  With ``N`` = retrieved chunks, the score grows with
each extra relevant chunk but with diminishing returns (``N s / sqrt(N + 1)`` for equal
scores ``s``), and a node with one strong chunk beats a node whose several weak chunks add
up to the same total (``s / sqrt(2)`` against ``s / sqrt(4)`` for three chunks of ``s/3``).
The ``+ 1`` keeps a single-chunk node from scoring exactly its chunk's similarity, so a
leaf and a summary resting on that same single chunk tie.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from raptor_core._structure import block_scores, structure
from raptor_core.exceptions import InvalidParameterError
from raptor_core.retrieval import (
    DEFAULT_K,
    DEFAULT_MAX_TOKENS,
    Hit,
    TreeRetriever,
    _check_positive_int,
    check_choice,
    check_similarity,
    fill_budget,
    rows_of,
    top_rows,
)
from raptor_core.tree import Tree
from raptor_core.types import Embedder, VectorIndex

__all__ = ["INCLUDE", "NodeScores", "ValueBasedRetriever", "node_score"]

#: What value-based search returns: ranked nodes of any layer, only summaries, only leaves,
#: or ``"evidence"``: the retrieved chunks of the best nodes, best node first.
INCLUDE = ("all", "summaries", "leaves", "evidence")
DEFAULT_CHUNK_K = 20


def node_score(chunk_scores: Sequence[float]) -> float:
    """NodeScore of a node from the scores of its retrieved chunks: ``sum / sqrt(N + 1)``.

    Examples:
        >>> round(node_score([0.9]), 3), round(node_score([0.3, 0.3, 0.3]), 3)
        (0.636, 0.45)
    """
    return float(sum(chunk_scores)) / math.sqrt(len(chunk_scores) + 1)


@dataclass(frozen=True, slots=True)
class NodeScores:
    """Every node that a retrieved chunk belongs to, ranked by NodeScore (best first).

    Attributes:
        rows: ``(m,)`` tree rows, best first.
        scores: ``(m,)`` their NodeScores.
        counts: ``(m,)`` their ``N`` (retrieved chunks).
        chunk_rows: ``(c,)`` rows of the retrieved chunks, most similar first.
        chunk_scores: ``(c,)`` their cosine similarities.
        pair_node: ``(p,)`` for each (node, chunk) membership pair, the node's position in ``rows``.
        pair_chunk: ``(p,)`` and the chunk's position in ``chunk_rows``.
    """

    rows: NDArray[np.intp]
    scores: NDArray[np.float64]
    counts: NDArray[np.intp]
    chunk_rows: NDArray[np.intp]
    chunk_scores: NDArray[np.float32]
    pair_node: NDArray[np.intp]
    pair_chunk: NDArray[np.intp]

    def evidence(self, tree: Tree, position: int) -> tuple[tuple[str, float], ...]:
        """``(chunk id, cosine)`` of the retrieved chunks behind ``rows[position]``, best first."""
        chunks = np.sort(self.pair_chunk[self.pair_node == position])  # sorted = most similar first
        return tuple(
            (tree.nodes[int(self.chunk_rows[c])].id, float(self.chunk_scores[c])) for c in chunks
        )


class ValueBasedRetriever(TreeRetriever):
    """Value-based tree search: rank nodes by the retrieved chunks they contain (NodeScore).

    ``Hit.score`` is the NodeScore (not a cosine similarity), ``Hit.evidence`` lists the
    ``(chunk id, cosine)`` pairs behind it, and ``Hit.reason`` spells out the sum.

    Args:
        tree: the tree to search.
        embedder: embeds the query.
        k: maximum number of hits.
        max_tokens: context budget over the returned nodes.
        chunk_k: leaf chunks retrieved by vector search in step 1.
        include: return ``"all"`` nodes, only ``"summaries"`` (layers >= 1), only
            ``"leaves"``, or ``"evidence"``: nodes of every layer are ranked by NodeScore, and
            each is then *read* by returning its retrieved chunks (best node first, each chunk
            once), the way PageIndex picks sections and then reads their relevant passages.
            Use it when the context must hold source text rather than summaries.
        min_score: ignore retrieved chunks whose cosine similarity is below this.
        index: a :class:`~raptor_core.types.VectorIndex` holding (at least) the tree's leaves
            by id; None = an exact numpy product over the leaf embeddings.

    Examples:
        >>> from raptor_core.testing import FakeEmbedder, tiny_tree
        >>> tree = tiny_tree()
        >>> retriever = ValueBasedRetriever(tree, FakeEmbedder(dim=tree.dim), chunk_k=2)
        >>> hit = retriever.retrieve("cats purr")[0]
        >>> hit.id, [chunk for chunk, _ in hit.evidence]
        ('L1.0', ['L0.0', 'L0.1'])
    """

    source = "value"

    def __init__(
        self,
        tree: Tree,
        embedder: Embedder,
        *,
        k: int = DEFAULT_K,
        max_tokens: int | None = DEFAULT_MAX_TOKENS,
        chunk_k: int = DEFAULT_CHUNK_K,
        include: str = "all",
        min_score: float | None = None,
        index: VectorIndex | None = None,
    ) -> None:
        super().__init__(tree, embedder, k=k, max_tokens=max_tokens)
        self.chunk_k = chunk_k
        self.include = include
        self.min_score = min_score
        self.index = index

    def _validate(self) -> None:
        _check_positive_int("chunk_k", self.chunk_k)
        check_choice("include", self.include, INCLUDE)
        check_similarity("min_score", self.min_score)

    def _chunks(self, vector: NDArray[np.float32]) -> tuple[NDArray[np.intp], NDArray[np.float32]]:
        """Rows and cosine scores of the ``chunk_k`` most similar leaves, best first."""
        struct = structure(self.tree)
        if self.index is None:
            leaf_scores = block_scores(self.tree, vector, [0])[0]  # (n_leaves,)
            best = top_rows(leaf_scores, min(int(self.chunk_k), leaf_scores.shape[0]))
            rows, scores = struct.leaf_rows[best], leaf_scores[best]
        else:
            pairs = self.index.search(vector, int(self.chunk_k), restrict_to=struct.id_set([0]))
            if len(pairs) < min(int(self.chunk_k), struct.leaf_rows.shape[0]):
                msg = (
                    f"the vector index returned {len(pairs)} of {self.chunk_k} leaves: it must "
                    "hold the tree's leaves (build it with NumpyIndex.from_tree(tree))"
                )
                raise InvalidParameterError(msg)
            rows = rows_of(self.tree, [i for i, _ in pairs])
            scores = np.fromiter((s for _, s in pairs), dtype=np.float32, count=len(pairs))
            if np.any(struct.leaf_ordinal[rows] < 0):
                msg = "the vector index returned a summary node for a leaf-restricted search"
                raise InvalidParameterError(msg)
        if self.min_score is not None:
            keep = scores >= self.min_score
            rows, scores = rows[keep], scores[keep]
        return rows, scores

    def score_nodes(self, vector: NDArray[np.float32]) -> NodeScores:
        """Steps 1 and 2: retrieve chunks and rank every node they belong to by NodeScore.

        Args:
            vector: the unit query vector (``embed_query(query)``).
        """
        self._validate()
        tree = self.tree
        struct = structure(tree)
        chunk_rows, chunk_scores = self._chunks(vector)
        indptr, members = struct.membership
        ordinals = struct.leaf_ordinal[chunk_rows]
        starts, lengths = indptr[ordinals], indptr[ordinals + 1] - indptr[ordinals]
        # Gather the membership slices of all retrieved chunks at once (CSR row gather).
        shift = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
        node_rows = members[shift + np.arange(int(lengths.sum()))]
        pair_chunk = np.repeat(np.arange(chunk_rows.shape[0], dtype=np.intp), lengths)
        # A carried node copies its only child: same chunks, same score, same text.
        keep = ~tree.carried_mask[node_rows]
        if self.include in ("summaries", "leaves"):
            is_leaf = tree.layer_of_rows[node_rows] == 0
            keep &= is_leaf if self.include == "leaves" else ~is_leaf
        node_rows, pair_chunk = node_rows[keep], pair_chunk[keep]
        uniq, inverse = np.unique(node_rows, return_inverse=True)
        inverse = inverse.reshape(-1)
        sums = np.bincount(
            inverse, weights=chunk_scores[pair_chunk].astype(np.float64), minlength=uniq.shape[0]
        )
        counts = np.bincount(inverse, minlength=uniq.shape[0]).astype(np.intp)
        values = sums / np.sqrt(counts + 1.0)
        order = np.lexsort((uniq, -values))  # best first; ties by row for determinism
        position = np.empty_like(order)
        position[order] = np.arange(order.shape[0])
        return NodeScores(
            rows=uniq[order].astype(np.intp),
            scores=values[order],
            counts=counts[order],
            chunk_rows=chunk_rows,
            chunk_scores=chunk_scores,
            pair_node=position[inverse].astype(np.intp),
            pair_chunk=pair_chunk,
        )

    def hit(self, ranking: NodeScores, position: int) -> Hit:
        """The :class:`Hit` for ``ranking.rows[position]``, with its evidence and reason."""
        n = int(ranking.counts[position])
        evidence = ranking.evidence(self.tree, position)
        total = sum(s for _, s in evidence)
        return Hit(
            node=self.tree.nodes[int(ranking.rows[position])],
            score=float(ranking.scores[position]),
            source=self.source,
            path=(self.tree.nodes[int(ranking.rows[position])].id,),
            reason=f"{n} of the top {len(ranking.chunk_rows)} chunks: {total:.3f} / sqrt({n} + 1)",
            evidence=evidence,
        )

    def _retrieve(
        self, query: str, vector: NDArray[np.float32], *, k: int, max_tokens: int | None
    ) -> list[Hit]:
        ranking = self.score_nodes(vector)
        if self.include == "evidence":
            return self._evidence_hits(ranking, k=k, max_tokens=max_tokens)
        taken = fill_budget(
            range(ranking.rows.shape[0]),
            self.tree.token_counts[ranking.rows],
            k=k,
            max_tokens=max_tokens,
        )
        return [self.hit(ranking, i) for i in taken]

    def _evidence_hits(self, ranking: NodeScores, *, k: int, max_tokens: int | None) -> list[Hit]:
        """The retrieved chunks of the best nodes, in node order, each chunk once."""
        tree = self.tree
        hits: list[Hit] = []
        seen: set[int] = set()
        used = 0
        for position in range(ranking.rows.shape[0]):
            node = tree.nodes[int(ranking.rows[position])]
            score = float(ranking.scores[position])
            for chunk_id, cosine in ranking.evidence(tree, position):
                row = tree.row(chunk_id)
                cost = int(tree.token_counts[row])
                if row in seen or (max_tokens is not None and used + cost > max_tokens):
                    continue
                seen.add(row)
                used += cost
                chunk = tree.nodes[row]
                hits.append(
                    Hit(
                        node=chunk,
                        score=score,
                        source=self.source,
                        path=(node.id, chunk.id) if node.id != chunk.id else (chunk.id,),
                        reason=f"evidence of {node.id} (NodeScore {score:.3f})",
                        evidence=((chunk.id, cosine),),
                    )
                )
                if len(hits) >= k:
                    return hits
        return hits
