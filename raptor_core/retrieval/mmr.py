"""Maximal marginal relevance over the tree (Carbonell and Goldstein, SIGIR 1998).

The collapsed pool (every layer) is searched for ``fetch_k`` candidates; then hits are
picked one at a time, each maximising

    lambda_mult * cos(query, node) - (1 - lambda_mult) * max cos(node, already picked)

so that a summary and the leaves it condenses (or two near-identical chunks) do not fill
the budget with the same content.  ``lambda_mult = 1`` is plain similarity ranking,
``0`` pure diversity.  This is the ``search_type="mmr"`` of LangChain's
``VectorStore.as_retriever`` and the ``vector_store_query_mode="mmr"`` of LlamaIndex, over
the tree's own vectors.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core._threads import matvec
from raptor_core.exceptions import InvalidParameterError
from raptor_core.retrieval.base import (
    DEFAULT_K,
    DEFAULT_MAX_TOKENS,
    Hit,
    TreeRetriever,
    _check_positive_int,
    check_layers,
    check_similarity,
    similarity_score,
)
from raptor_core.tree import Tree
from raptor_core.types import Embedder, Match, NodeStore

__all__ = ["MMRRetriever", "mmr_order"]


def mmr_order(
    query: NDArray[np.float32], vectors: NDArray[np.float32], *, lambda_mult: float, k: int
) -> list[int]:
    """Indices of ``vectors`` (unit rows) in MMR order, at most ``k`` of them.

    Ties go to the lower index (the better-ranked candidate), so the order is deterministic.

    Examples:
        >>> import numpy as np
        >>> v = np.array([[1.0, 0.0], [0.99, 0.141], [0.0, 1.0]], dtype=np.float32)
        >>> mmr_order(np.array([1.0, 0.0], dtype=np.float32), v, lambda_mult=0.5, k=2)
        [0, 2]
    """
    n = vectors.shape[0]
    if n == 0:
        return []
    relevance = matvec(vectors, query)  # (n,)
    redundancy = np.full(n, -np.inf, dtype=np.float64)  # max similarity to a picked vector
    chosen: list[int] = []
    available = np.ones(n, dtype=np.bool_)
    for _ in range(min(k, n)):
        penalty = np.where(np.isfinite(redundancy), redundancy, 0.0)
        value = lambda_mult * relevance - (1.0 - lambda_mult) * penalty
        value = np.where(available, value, -np.inf)
        best = int(np.argmax(value))  # argmax returns the first maximum: deterministic
        chosen.append(best)
        available[best] = False
        redundancy = np.maximum(redundancy, matvec(vectors, vectors[best]))
    return chosen


class MMRRetriever(TreeRetriever):
    """Maximal-marginal-relevance search over the collapsed tree.

    ``Hit.score`` is the node's cosine similarity to the query; hits come in MMR order.

    Args:
        tree: the tree to search (a :class:`Tree` or a :class:`~raptor_core.types.NodeStore`).
        embedder: embeds the query (and the candidates, when the store cannot return their
            vectors).
        k: maximum number of hits.
        max_tokens: context budget over the returned nodes.
        fetch_k: candidates fetched by similarity before the MMR selection.
        lambda_mult: weight of relevance against diversity, in ``[0, 1]``.
        layers: search only these layers.
        min_score: never return a node whose cosine similarity is below this.
        where: a metadata filter (see :class:`TreeRetriever`).
        native_filter: a filter in the store's own dialect.

    Examples:
        >>> from raptor_core.testing import FakeEmbedder, tiny_tree
        >>> tree = tiny_tree()
        >>> hits = MMRRetriever(tree, FakeEmbedder(dim=tree.dim), k=2).retrieve("cats purr")
        >>> len(hits)
        2
    """

    source = "mmr"

    def __init__(
        self,
        tree: Tree | NodeStore,
        embedder: Embedder,
        *,
        k: int = DEFAULT_K,
        max_tokens: int | None = DEFAULT_MAX_TOKENS,
        fetch_k: int = 20,
        lambda_mult: float = 0.5,
        layers: Collection[int] | None = None,
        min_score: float | None = None,
        where: Mapping[str, Any] | None = None,
        native_filter: Any = None,
    ) -> None:
        super().__init__(
            tree, embedder, k=k, max_tokens=max_tokens, where=where, native_filter=native_filter
        )
        self.fetch_k = fetch_k
        self.lambda_mult = lambda_mult
        self.layers = layers
        self.min_score = min_score

    def _validate(self) -> None:
        _check_positive_int("fetch_k", self.fetch_k)
        value = self.lambda_mult
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float | np.floating)
            or not 0.0 <= float(value) <= 1.0
        ):
            msg = f"lambda_mult must be a number in [0, 1], got {value!r}"
            raise InvalidParameterError(msg)
        check_layers("layers", self.layers, self.store)
        check_similarity("min_score", self.min_score)

    def _vectors(self, matches: Sequence[Match]) -> NDArray[np.float32]:
        """Unit vectors of the candidates: from the store when it can, else re-embedded."""
        ids = [m.node.id for m in matches]
        lookup = getattr(self.store, "vectors", None)
        if callable(lookup):
            vectors = np.asarray(lookup(ids), dtype=np.float32)
        else:
            vectors = np.asarray(
                self.embedder.embed_documents([m.node.text for m in matches]), dtype=np.float32
            )
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        return (vectors / np.where(norms == 0.0, 1.0, norms)).astype(np.float32)

    def _retrieve(
        self, query: str, vector: NDArray[np.float32], *, k: int, max_tokens: int | None
    ) -> list[Hit]:
        layers = None if self.layers is None else frozenset(int(x) for x in self.layers)
        fetch = max(int(self.fetch_k), k)
        matches = self.store.search(vector, fetch, where=self.node_filter(layers=layers))
        if self.min_score is not None:
            matches = [m for m in matches if m.score >= self.min_score]
        if not matches:
            return []
        order = mmr_order(
            vector, self._vectors(matches), lambda_mult=float(self.lambda_mult), k=len(matches)
        )
        hits: list[Hit] = []
        used = 0
        for i in order:
            node = matches[i].node
            if max_tokens is not None and used + node.token_count > max_tokens:
                continue
            used += node.token_count
            hits.append(
                Hit(
                    node=node,
                    score=similarity_score(matches[i].score),
                    source=self.source,
                    path=(node.id,),
                )
            )
            if len(hits) >= k or (max_tokens is not None and used >= max_tokens):
                break
        return hits
