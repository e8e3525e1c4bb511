"""Tree traversal retrieval (RAPTOR, Sarthi et al. 2024, section 3 and figure 2).

Start at a layer (the top by default), select the nodes most similar to the query, then
look only at the *children of the selected nodes* in the next step, and so on for
``num_layers`` steps.  The answer is the union of the selected sets.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from raptor_core._structure import block_scores, expand
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
    selection_path,
    top_rows,
)
from raptor_core.tree import Tree
from raptor_core.types import Embedder

__all__ = ["TreeTraversalRetriever", "check_layer_span"]

ORDERS = ("score", "layer")


def check_layer_span(tree: Tree, start_layer: object, num_layers: object) -> None:
    """Validate ``start_layer`` and ``num_layers`` like the paper's reference code, clearly.

    ``start_layer`` must be a layer of the tree (at most the top layer) and ``num_layers``
    at most ``start_layer + 1``: there are only that many layers from ``start_layer`` down
    to the leaves.  On an empty tree only the types are checked.
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
    if start_value is not None and (
        start_value < 0 or (len(tree) and start_value > tree.top_layer)
    ):
        msg = f"start_layer must be in [0, {tree.top_layer}] (the top layer), got {start_layer}"
        raise InvalidParameterError(msg)
    if steps is not None:
        _check_positive_int("num_layers", steps)
        start = tree.top_layer if start_value is None else start_value
        if len(tree) and steps > start + 1:
            msg = (
                f"num_layers must be at most start_layer + 1 = {start + 1} (the layers from "
                f"{start} down to the leaves), got {num_layers}"
            )
            raise InvalidParameterError(msg)


class TreeTraversalRetriever(TreeRetriever):
    """Tree traversal: descend from ``start_layer``, keeping only children of selected nodes.

    Selection at each step is by rank (``top_k`` most similar candidates) or, when
    ``threshold`` is given, by similarity: every candidate whose cosine *similarity* to the
    query is at least ``threshold`` is kept.  (The paper's reference code compares cosine
    *distances* with ``>``, which keeps the least similar nodes; this class does not.)

    Args:
        tree: the tree to search.
        embedder: embeds the query.
        k: maximum number of hits returned in total (after the union of all steps).
        max_tokens: context budget over the returned hits.
        top_k: nodes selected per step (rank selection).
        threshold: if given, select by cosine similarity >= threshold instead of by rank;
            ``-1`` keeps every candidate, ``1`` keeps (almost) nothing.
        start_layer: layer to start at (default: the top layer).
        num_layers: steps to descend (default: ``start_layer + 1``, down to the leaves).
        min_score: never select a node whose cosine similarity is below this.
        order: ``"score"`` returns the union best first; ``"layer"`` returns it in selection
            order (top layer first), like the paper's concatenated context.  The budget and
            ``k`` keep the first nodes in this order.

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
        tree: Tree,
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
    ) -> None:
        super().__init__(tree, embedder, k=k, max_tokens=max_tokens)
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
        check_layer_span(self.tree, self.start_layer, self.num_layers)

    def _select(self, scores: NDArray[np.float32]) -> NDArray[np.intp]:
        """Positions in ``scores`` of the selected candidates, best first."""
        if self.threshold is None:
            chosen = top_rows(scores, min(int(self.top_k), scores.shape[0]))
        else:
            passing = np.flatnonzero(scores >= self.threshold)
            chosen = passing[top_rows(scores[passing], passing.shape[0])]
        if self.min_score is not None:
            chosen = chosen[scores[chosen] >= self.min_score]
        return chosen

    def _reason(self, layer: int, score: float, rank: int, n: int, step: int) -> str:
        pool = (
            f"the {n} nodes of layer {layer}"
            if step == 0
            else f"the {n} children of the selected nodes"
        )
        if self.threshold is not None:
            return f"cosine {score:.3f} >= threshold {self.threshold} among {pool}"
        return f"rank {rank + 1} among {pool}"

    def _retrieve(
        self, query: str, vector: NDArray[np.float32], *, k: int, max_tokens: int | None
    ) -> list[Hit]:
        tree = self.tree
        start = tree.top_layer if self.start_layer is None else int(self.start_layer)
        steps = start + 1 if self.num_layers is None else int(self.num_layers)
        frontier = tree.layer_rows(start)
        carried = tree.carried_mask
        # Step 0 scores a whole layer: score it as a (view) block of the matrix.
        scores = block_scores(tree, vector, [start])[0]
        via: dict[int, int] = {}  # child row -> the best selected parent that led to it
        picked: list[tuple[int, float, str]] = []  # (row, score, reason) in selection order
        picked_rows: set[int] = set()
        for step in range(steps):
            if frontier.shape[0] == 0:
                break
            if step:
                scores = tree.embeddings[frontier] @ vector  # (n_children,): small
            chosen = self._select(scores)
            n = int(frontier.shape[0])
            for rank, local in enumerate(chosen):
                row = int(frontier[local])
                reason = self._reason(tree.nodes[row].layer, float(scores[local]), rank, n, step)
                picked_rows.add(row)
                if not carried[row]:  # a copy of its only child: expanded, not returned
                    picked.append((row, float(scores[local]), reason))
            if step == steps - 1 or chosen.shape[0] == 0:
                break
            frontier = expand(tree, frontier[chosen].tolist(), via, picked_rows)
        if self.order == "score":
            # Stable sort keeps selection order among equal scores.
            picked.sort(key=lambda item: -item[1])
        tokens = tree.token_counts[np.asarray([row for row, _, _ in picked], dtype=np.intp)]
        taken = fill_budget(range(len(picked)), tokens, k=k, max_tokens=max_tokens)
        return [
            Hit(
                node=tree.nodes[picked[i][0]],
                score=picked[i][1],
                source=self.source,
                path=selection_path(tree, via, picked[i][0]),
                reason=picked[i][2],
            )
            for i in taken
        ]
