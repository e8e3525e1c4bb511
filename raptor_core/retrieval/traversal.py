"""Tree traversal retrieval (RAPTOR, Sarthi et al. 2024, section 3 and figure 2).

Start at a layer (the top by default), select the nodes most similar to the query, then
look only at the *children of the selected nodes* in the next step, and so on for
``num_layers`` steps.  The answer is the union of the selected sets.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    check_choice,
    check_similarity,
    fill_budget,
    selection_path,
    similarity_score,
    top_layer,
)
from raptor_core.tree import Tree, is_carried
from raptor_core.types import Embedder, Match, NodeFilter, NodeStore

__all__ = ["TreeTraversalRetriever", "check_layer_span", "first_layer"]

ORDERS = ("score", "layer")


def check_layer_span(top: int, start_layer: object, num_layers: object) -> None:
    """Validate ``start_layer`` and ``num_layers`` like the paper's reference code, clearly.

    ``start_layer`` must be a layer of the tree (at most ``top``, the top layer) and
    ``num_layers`` at most ``start_layer + 1``: there are only that many layers from
    ``start_layer`` down to the leaves.  On an empty tree (``top`` -1) only the types are
    checked.
    """
    values: dict[str, int | None] = {}
    for name, value in (("start_layer", start_layer), ("num_layers", num_layers)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | np.integer)
        ):
            msg = f"{name} must be an integer or None, got {value!r}"
            raise InvalidParameterError(msg)
        values[name] = None if value is None else int(value)
    start_value, steps = values["start_layer"], values["num_layers"]
    if start_value is not None and (start_value < 0 or (top >= 0 and start_value > top)):
        msg = f"start_layer must be in [0, {top}] (the top layer), got {start_layer}"
        raise InvalidParameterError(msg)
    if steps is not None:
        _check_positive_int("num_layers", steps)
        start = top if start_value is None else start_value
        if top >= 0 and steps > start + 1:
            msg = (
                f"num_layers must be at most start_layer + 1 = {start + 1} (the layers from "
                f"{start} down to the leaves), got {num_layers}"
            )
            raise InvalidParameterError(msg)


def first_layer(retriever: TreeRetriever, store: NodeStore, given: int | None) -> int:
    """The layer a descent starts at: ``given``, else the top layer of what the filters keep.

    With a filter (``where``, ``native_filter``) the top layer may hold no passing node (a
    summary over several documents never passes a one-document filter): the descent then
    starts at the highest layer that does, as collapsed search would find its nodes, rather
    than at an empty layer (-1 when no node passes).
    """
    if given is not None:
        return int(given)
    # Carried copies count: the descent selects them to reach their child.
    return top_layer(store, retriever.node_filter(include_carried=True))


class TreeTraversalRetriever(TreeRetriever):
    """Tree traversal: descend from ``start_layer``, keeping only children of selected nodes.

    Selection at each step is by rank (``top_k`` most similar candidates) or, when
    ``threshold`` is given, by similarity: every candidate whose cosine *similarity* to the
    query is at least ``threshold`` is kept.  (The paper's reference code compares cosine
    *distances* with ``>``, which keeps the least similar nodes; this class does not.)

    Args:
        tree: the tree to search (a :class:`Tree` or a :class:`~raptor_core.types.NodeStore`).
        embedder: embeds the query.
        k: maximum number of hits returned in total (after the union of all steps).
        max_tokens: context budget over the returned hits.
        top_k: nodes selected per step (rank selection).
        threshold: if given, select by cosine similarity >= threshold instead of by rank;
            ``-1`` keeps every candidate, ``1`` keeps (almost) nothing.
        start_layer: layer to start at (default: the top layer; with a filter, the highest
            layer holding a node that passes it).
        num_layers: steps to descend (default: ``start_layer + 1``, down to the leaves).
        min_score: never select a node whose cosine similarity is below this.
        order: ``"score"`` returns the union best first; ``"layer"`` returns it in selection
            order (top layer first), like the paper's concatenated context.  The budget and
            ``k`` keep the first nodes in this order.
        where: a metadata filter (see :class:`TreeRetriever`); with one, the search starts
            at ``start_layer`` as given, else at the highest layer holding a passing node,
            and only passing nodes are selected (a summary over documents the filter
            excludes is not a way down).
        native_filter: a filter in the store's own dialect.

    Examples:
        >>> from raptor_core.testing import FakeEmbedder, tiny_tree
        >>> tree = tiny_tree()
        >>> retriever = TreeTraversalRetriever(tree, FakeEmbedder(dim=tree.dim), top_k=1)
        >>> hits = retriever.retrieve("cats purr")
        >>> [h.id for h in hits], hits[-1].path
        (['L1.0', 'L0.0'], ('L1.0', 'L0.0'))
    """

    source = "traversal"

    def __init__(
        self,
        tree: Tree | NodeStore,
        embedder: Embedder,
        *,
        k: int = DEFAULT_K,
        max_tokens: int | None = DEFAULT_MAX_TOKENS,
        top_k: int = 5,
        threshold: float | None = None,
        start_layer: int | None = None,
        num_layers: int | None = None,
        min_score: float | None = None,
        order: str = "score",
        where: Mapping[str, Any] | None = None,
        native_filter: Any = None,
    ) -> None:
        super().__init__(
            tree, embedder, k=k, max_tokens=max_tokens, where=where, native_filter=native_filter
        )
        self.top_k = top_k
        self.threshold = threshold
        self.start_layer = start_layer
        self.num_layers = num_layers
        self.min_score = min_score
        self.order = order

    def _validate(self) -> None:
        _check_positive_int("top_k", self.top_k)
        check_similarity("threshold", self.threshold)
        check_similarity("min_score", self.min_score)
        check_choice("order", self.order, ORDERS)
        check_layer_span(top_layer(self.store), self.start_layer, self.num_layers)

    def _select(self, vector: NDArray[np.float32], where: NodeFilter) -> list[Match]:
        """The selected candidates among those passing ``where``, best first."""
        if self.threshold is None:
            chosen = self.store.search(vector, int(self.top_k), where=where)
        else:
            # Every candidate at or above the threshold: widen the search until one falls below.
            m = 64
            while True:
                found = self.store.search(vector, m, where=where)
                chosen = [x for x in found if x.score >= self.threshold]
                if len(chosen) < len(found) or len(found) < m:
                    break
                m *= 4
        if self.min_score is not None:
            chosen = [x for x in chosen if x.score >= self.min_score]
        return chosen

    def _reason(self, match: Match, rank: int, step: int) -> str:
        pool = (
            f"the nodes of layer {match.node.layer}"
            if step == 0
            else "the children of the selected nodes"
        )
        if self.threshold is not None:
            return f"cosine {match.score:.3f} >= threshold {self.threshold} among {pool}"
        return f"rank {rank + 1} among {pool}"

    def _retrieve(
        self, query: str, vector: NDArray[np.float32], *, k: int, max_tokens: int | None
    ) -> list[Hit]:
        store = self.store
        start = first_layer(self, store, self.start_layer)
        steps = start + 1 if self.num_layers is None else min(int(self.num_layers), start + 1)
        # Carried copies are selected (their child is reached through them) but not returned.
        where = self.node_filter(layers=frozenset({start}), include_carried=True)
        via: dict[str, str] = {}  # child id -> the best selected parent that led to it
        picked: list[tuple[Match, str]] = []  # (match, reason) in selection order
        for step in range(steps):
            chosen = self._select(vector, where)
            rank_of = {x.node.id: rank for rank, x in enumerate(chosen)}
            for rank, match in enumerate(chosen):
                if not is_carried(match.node):
                    picked.append((match, self._reason(match, rank, step)))
            if step == steps - 1 or not chosen:
                break
            for match in chosen:
                for child in match.node.children:
                    via.setdefault(child, match.node.id)  # chosen is best first
            where = self.node_filter(parents=frozenset(rank_of), include_carried=True)
        if self.order == "score":
            # Stable sort keeps selection order among equal scores.
            picked.sort(key=lambda item: -item[0].score)
        tokens = np.fromiter((m.node.token_count for m, _ in picked), np.int64, len(picked))
        taken = fill_budget(range(len(picked)), tokens, k=k, max_tokens=max_tokens)
        return [
            Hit(
                node=picked[i][0].node,
                score=similarity_score(picked[i][0].score),
                source=self.source,
                path=selection_path(via, picked[i][0].node.id),
                reason=picked[i][1],
            )
            for i in taken
        ]
