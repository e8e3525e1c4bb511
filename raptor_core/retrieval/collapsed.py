"""Collapsed-tree retrieval (RAPTOR, section 3): every layer in one pool, ranked by cosine."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core.retrieval.base import (
    DEFAULT_K,
    DEFAULT_MAX_TOKENS,
    Hit,
    TreeRetriever,
    as_store,
    check_layers,
    check_similarity,
    fill_ranked,
    similarity_score,
)
from raptor_core.store.memory import InMemoryNodeStore
from raptor_core.tree import Tree
from raptor_core.types import Embedder, Match, NodeStore, VectorIndex

__all__ = ["CollapsedTreeRetriever", "ranked_within_budget"]


class CollapsedTreeRetriever(TreeRetriever):
    """Collapsed-tree retrieval (RAPTOR, section 3): all layers in one pool, ranked by cosine.

    Args:
        tree: the tree to search (a :class:`Tree` or a :class:`~raptor_core.types.NodeStore`).
        embedder: embeds the query.
        k: maximum number of hits.
        max_tokens: context budget; the paper uses 2,000.
        layers: search only these layers (the paper's Table 8 ablation: ``[0]`` = leaves only,
            ``[top]`` = top layer only).
        min_score: drop nodes whose cosine similarity is below this.
        index: a :class:`~raptor_core.types.VectorIndex` holding the tree's nodes by id
            (``NumpyIndex.from_tree(tree)``, ``FaissIndex.from_tree(tree)``) to search through;
            only with a :class:`Tree` (a store brings its own search).
        where: a metadata filter (see :class:`TreeRetriever`).
        native_filter: a filter in the store's own dialect.

    Examples:
        >>> from raptor_core.testing import FakeEmbedder, tiny_tree
        >>> tree = tiny_tree()
        >>> hits = CollapsedTreeRetriever(tree, FakeEmbedder(dim=tree.dim), k=2).retrieve("cats")
        >>> len(hits)
        2
    """

    source = "collapsed"

    def __init__(
        self,
        tree: Tree | NodeStore,
        embedder: Embedder,
        *,
        k: int = DEFAULT_K,
        max_tokens: int | None = DEFAULT_MAX_TOKENS,
        layers: Collection[int] | None = None,
        min_score: float | None = None,
        index: VectorIndex | None = None,
        where: Mapping[str, Any] | None = None,
        native_filter: Any = None,
    ) -> None:
        super().__init__(
            tree, embedder, k=k, max_tokens=max_tokens, where=where, native_filter=native_filter
        )
        self.layers = layers
        self.min_score = min_score
        self.index = index

    @property
    def store(self) -> NodeStore:
        """The store searched; with ``index``, a store searching through that index."""
        return as_store(self.tree, index=self.index)

    def _validate(self) -> None:
        if self.layers is not None:  # checked against the store's layers: only when given
            check_layers("layers", self.layers, self.store)
        check_similarity("min_score", self.min_score)

    def _retrieve(
        self, query: str, vector: NDArray[np.float32], *, k: int, max_tokens: int | None
    ) -> list[Hit]:
        layers = None if self.layers is None else frozenset(int(x) for x in self.layers)
        matches = ranked_within_budget(
            self.store,
            vector,
            self.node_filter(layers=layers),
            k=k,
            max_tokens=max_tokens,
            min_score=self.min_score,
        )
        return [
            Hit(node=m.node, score=similarity_score(m.score), source=self.source, path=(m.node.id,))
            for m in matches
        ]


def ranked_within_budget(
    store: NodeStore,
    vector: NDArray[np.float32],
    where: Any,
    *,
    k: int,
    max_tokens: int | None,
    min_score: float | None = None,
) -> list[Match]:
    """The best matches of ``where`` that fill ``k`` hits within ``max_tokens``, best first.

    The store is asked for a prefix of the ranking (``max(4k, 64)`` matches; ``k`` without
    a budget, when the first ``k`` are the answer); the prefix grows fourfold while nodes
    too long for the remaining budget had to be skipped and the store still has more.  A
    node that does not fit is skipped and the next one tried, so the budget is filled
    without ever being exceeded (:func:`~raptor_core.retrieval.base.fill_ranked`).
    """
    if isinstance(store, InMemoryNodeStore) and type(store).search is InMemoryNodeStore.search:
        # Same answer, without building a Match for every node of the prefix (a subclass
        # with its own search goes the general way, through that search).
        return store.search_within_budget(
            vector, k, max_tokens=max_tokens, where=where, min_score=min_score
        )
    # Every match costs a vector store its document, metadata and vector (Chroma: about
    # 4 ms more for 72 than for 18 at 100k nodes), so only a budget asks for more than k.
    matches: list[Match] = []

    def fetch(m: int) -> tuple[list[float], NDArray[np.int64]]:
        nonlocal matches
        matches = store.search(vector, m, where=where)
        tokens = np.fromiter((x.node.token_count for x in matches), np.int64, len(matches))
        return [x.score for x in matches], tokens

    taken = fill_ranked(fetch, k=k, max_tokens=max_tokens, min_score=min_score)
    return [matches[i] for i in taken]
