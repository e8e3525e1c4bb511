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
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core.exceptions import InvalidParameterError
from raptor_core.retrieval.base import (
    DEFAULT_K,
    DEFAULT_MAX_TOKENS,
    Hit,
    TreeRetriever,
    _check_positive_int,
    as_store,
    check_choice,
    check_similarity,
    fill_budget,
    similarity_score,
)
from raptor_core.tree import Node, Tree, is_carried
from raptor_core.types import Embedder, Match, NodeStore, VectorIndex

__all__ = ["INCLUDE", "NodeScores", "ValueBasedRetriever", "mean_chunk_score", "node_score"]

#: What value-based search returns: ranked nodes of any layer, only summaries, only leaves,
#: or ``"evidence"``: the retrieved chunks of the best nodes, best node first.
INCLUDE = ("all", "summaries", "leaves", "evidence")
DEFAULT_CHUNK_K = 20


def mean_chunk_score(node_score: float, n: int) -> float:
    """The hit score of a node with NodeScore ``node_score`` over ``n`` retrieved chunks.

    ``NodeScore * sqrt(n + 1) / n`` is the mean cosine of the node's retrieved chunks, in
    [0, 1] after clipping: the same scale as every other strategy's scores.  The ranking
    still follows NodeScore, which also rewards the number of chunks.

    Examples:
        >>> round(mean_chunk_score(node_score([0.9, 0.3]), 2), 3)
        0.6
    """
    return similarity_score(node_score * math.sqrt(n + 1) / n) if n > 0 else 0.0


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
        nodes: the ranked nodes, best first.
        scores: their NodeScores.
        counts: their ``N`` (retrieved chunks they contain).
        chunks: the retrieved chunks with their cosine similarities, most similar first.
        members: for each ranked node, the positions in ``chunks`` of its retrieved chunks.
    """

    nodes: tuple[Node, ...]
    scores: tuple[float, ...]
    counts: tuple[int, ...]
    chunks: tuple[Match, ...]
    members: tuple[tuple[int, ...], ...]

    def __len__(self) -> int:
        return len(self.nodes)

    def evidence(self, position: int) -> tuple[tuple[str, float], ...]:
        """``(chunk id, cosine)`` of the retrieved chunks behind ``nodes[position]``, best first."""
        return tuple((self.chunks[c].node.id, self.chunks[c].score) for c in self.members[position])


class ValueBasedRetriever(TreeRetriever):
    """Value-based tree search: rank nodes by the retrieved chunks they contain (NodeScore).

    Nodes are ranked by NodeScore; ``Hit.score`` is the mean cosine of the node's retrieved
    chunks, clipped to [0, 1] (:func:`mean_chunk_score`; with ``include="evidence"``, the
    chunk's own cosine), so it reads like the other strategies' scores.  ``Hit.evidence`` lists the
    ``(chunk id, cosine)`` pairs behind it, and ``Hit.reason`` spells out the sum.

    Through a :class:`~raptor_core.types.NodeStore` this is one leaf search, then a walk up
    the ``parents`` of the retrieved chunks, one batched ``get`` per layer.

    Args:
        tree: the tree to search (a :class:`Tree` or a :class:`~raptor_core.types.NodeStore`).
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
        index: a :class:`~raptor_core.types.VectorIndex` holding the tree's nodes by id, to
            search through (only with a :class:`Tree`).
        where: a metadata filter (see :class:`TreeRetriever`): chunks are retrieved among
            passing leaves, and only passing nodes are returned.
        native_filter: a filter in the store's own dialect.

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
        tree: Tree | NodeStore,
        embedder: Embedder,
        *,
        k: int = DEFAULT_K,
        max_tokens: int | None = DEFAULT_MAX_TOKENS,
        chunk_k: int = DEFAULT_CHUNK_K,
        include: str = "all",
        min_score: float | None = None,
        index: VectorIndex | None = None,
        where: Mapping[str, Any] | None = None,
        native_filter: Any = None,
    ) -> None:
        super().__init__(
            tree, embedder, k=k, max_tokens=max_tokens, where=where, native_filter=native_filter
        )
        self.chunk_k = chunk_k
        self.include = include
        self.min_score = min_score
        self.index = index

    @property
    def store(self) -> NodeStore:
        """The store searched; with ``index``, a store searching through that index."""
        return as_store(self.tree, index=self.index)

    def _validate(self) -> None:
        _check_positive_int("chunk_k", self.chunk_k)
        check_choice("include", self.include, INCLUDE)
        check_similarity("min_score", self.min_score)

    def _chunks(self, vector: NDArray[np.float32]) -> list[Match]:
        """The ``chunk_k`` leaves most similar to the query, best first."""
        chunks = self.store.search(
            vector, int(self.chunk_k), where=self.node_filter(layers=frozenset({0}))
        )
        if any(m.node.layer != 0 for m in chunks):
            msg = "the store returned a summary node for a leaf-restricted search"
            raise InvalidParameterError(msg)
        if self.min_score is not None:
            chunks = [m for m in chunks if m.score >= self.min_score]
        return chunks

    def _ancestry(self, chunks: Sequence[Match]) -> dict[str, tuple[Node, set[int]]]:
        """Every node a retrieved chunk belongs to, with the positions of those chunks."""
        found: dict[str, tuple[Node, set[int]]] = {}
        frontier: dict[str, set[int]] = {}
        for position, match in enumerate(chunks):
            found.setdefault(match.node.id, (match.node, set()))[1].add(position)
            for parent in match.node.parents:
                frontier.setdefault(parent, set()).add(position)
        store = self.store
        while frontier:
            above: dict[str, set[int]] = {}
            for node in store.get(list(frontier)):
                members = frontier[node.id]
                entry = found.setdefault(node.id, (node, set()))
                entry[1].update(members)
                for parent in node.parents:
                    above.setdefault(parent, set()).update(members)
            frontier = above
        return found

    def _passing(self, vector: NDArray[np.float32], ids: Collection[str]) -> set[str]:
        """Which of ``ids`` pass the retriever's user filter (all, when there is none)."""
        if self.where is None and self.native_filter is None:
            return set(ids)
        kept = self.store.search(
            vector, len(ids), where=self.node_filter(ids=frozenset(ids), include_carried=True)
        )
        return {m.node.id for m in kept}

    def score_nodes(self, vector: NDArray[np.float32]) -> NodeScores:
        """Steps 1 and 2: retrieve chunks and rank every node they belong to by NodeScore.

        Args:
            vector: the unit query vector (``embed_query(query)``).
        """
        self._validate()
        chunks = self._chunks(vector)
        found = self._ancestry(chunks)
        passing = self._passing(vector, found) if found else set()
        rows: list[tuple[float, int, str, Node, tuple[int, ...]]] = []
        for node_id, (node, members) in found.items():
            # A carried node copies its only child: same chunks, same score, same text.
            if is_carried(node) or node_id not in passing:
                continue
            if self.include == "leaves" and node.layer != 0:
                continue
            if self.include == "summaries" and node.layer == 0:
                continue
            ordered = tuple(sorted(members))  # chunk positions: most similar first
            value = node_score([chunks[c].score for c in ordered])
            rows.append((-value, node.layer, node_id, node, ordered))
        rows.sort(key=lambda r: r[:3])  # best first; ties by layer, then id (deterministic)
        return NodeScores(
            nodes=tuple(r[3] for r in rows),
            scores=tuple(-r[0] for r in rows),
            counts=tuple(len(r[4]) for r in rows),
            chunks=tuple(chunks),
            members=tuple(r[4] for r in rows),
        )

    def hit(self, ranking: NodeScores, position: int) -> Hit:
        """The :class:`Hit` for ``ranking.nodes[position]``, with its evidence and reason."""
        n = ranking.counts[position]
        evidence = ranking.evidence(position)
        total = sum(s for _, s in evidence)
        node = ranking.nodes[position]
        return Hit(
            node=node,
            score=mean_chunk_score(ranking.scores[position], n),
            source=self.source,
            path=(node.id,),
            reason=f"{n} of the top {len(ranking.chunks)} chunks: {total:.3f} / sqrt({n} + 1)",
            evidence=evidence,
        )

    def _retrieve(
        self, query: str, vector: NDArray[np.float32], *, k: int, max_tokens: int | None
    ) -> list[Hit]:
        ranking = self.score_nodes(vector)
        if self.include == "evidence":
            return self._evidence_hits(ranking, k=k, max_tokens=max_tokens)
        tokens = np.fromiter((n.token_count for n in ranking.nodes), np.int64, len(ranking))
        taken = fill_budget(range(len(ranking)), tokens, k=k, max_tokens=max_tokens)
        return [self.hit(ranking, i) for i in taken]

    def _evidence_hits(self, ranking: NodeScores, *, k: int, max_tokens: int | None) -> list[Hit]:
        """The retrieved chunks of the best nodes, in node order, each chunk once."""
        hits: list[Hit] = []
        seen: set[int] = set()
        used = 0
        for position, node in enumerate(ranking.nodes):
            score = ranking.scores[position]
            for c in ranking.members[position]:
                chunk, cosine = ranking.chunks[c].node, ranking.chunks[c].score
                cost = chunk.token_count
                if c in seen or (max_tokens is not None and used + cost > max_tokens):
                    continue
                seen.add(c)
                used += cost
                hits.append(
                    Hit(
                        node=chunk,
                        score=similarity_score(cosine),
                        source=self.source,
                        path=(node.id, chunk.id) if node.id != chunk.id else (chunk.id,),
                        reason=f"evidence of {node.id} (NodeScore {score:.3f})",
                        evidence=((chunk.id, cosine),),
                    )
                )
                if len(hits) >= k:
                    return hits
        return hits
