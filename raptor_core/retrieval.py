"""Retrieval over a RAPTOR tree: the shared result type, the base class, collapsed-tree search.

Every strategy is an object with ``retrieve(query, *, k=None, max_tokens=None) -> list[Hit]``
and an async twin ``aretrieve``.  The public methods validate and then call ``_retrieve``
(template method, like LlamaIndex ``retrieve``/``_retrieve``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core._structure import block_scores, structure
from raptor_core.exceptions import EmbeddingError, InvalidInputError, InvalidParameterError
from raptor_core.tree import Node, Tree
from raptor_core.types import AsyncEmbedder, Embedder, VectorIndex

__all__ = [
    "DEFAULT_K",
    "DEFAULT_MAX_TOKENS",
    "CollapsedTreeRetriever",
    "Hit",
    "TreeRetriever",
]

logger = logging.getLogger(__name__)

DEFAULT_K = 10
_NOT_PARAMS = frozenset({"llm", "index"})
#: The paper's collapsed-tree context budget (section 4).
DEFAULT_MAX_TOKENS = 2000


@dataclass(frozen=True, slots=True, kw_only=True)
class Hit:
    """One retrieved node.

    Attributes:
        node: the tree node.
        score: cosine similarity to the query (value-based search: the NodeScore).
        source: the strategy or search that selected it (``"collapsed"``, ``"traversal"``,
            ``"value"``, ``"llm"``, ...).
        path: ids of the selected nodes leading to this one, root-most first, ending with it.
        reason: why it was selected, when the strategy can say (an LLM's reason, ...).
        evidence: ``(chunk id, chunk score)`` pairs that produced the score (value-based).
    """

    node: Node
    score: float
    source: str
    path: tuple[str, ...] = ()
    reason: str | None = None
    evidence: tuple[tuple[str, float], ...] = ()

    @property
    def layer(self) -> int:
        """The node's layer (0 = leaf chunk)."""
        return self.node.layer

    @property
    def id(self) -> str:
        """The node's id."""
        return self.node.id


def _check_positive_int(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        msg = f"{name} must be a positive integer, got {value!r}"
        raise InvalidParameterError(msg)


def normalize_query(vector: object, dim: int) -> NDArray[np.float32]:
    """Validate a query embedding and return it unit-normalised as float32 ``(d,)``."""
    q = np.asarray(vector, dtype=np.float32).reshape(-1)
    if q.shape[0] != dim:
        msg = (
            f"query embedding has dimension {q.shape[0]} but the tree has {dim}: "
            "use the embedder the tree was built with"
        )
        raise EmbeddingError(msg)
    if not np.all(np.isfinite(q)):
        msg = "the embedder returned a query vector with NaN or infinite values"
        raise EmbeddingError(msg)
    norm = float(np.linalg.norm(q))
    if norm == 0.0:
        msg = "the embedder returned an all-zero query vector; cosine similarity is undefined"
        raise EmbeddingError(msg)
    return q / norm


def fill_budget(
    ranked_rows: Sequence[int] | NDArray[np.intp],
    token_counts: NDArray[np.int64],
    *,
    k: int,
    max_tokens: int | None,
) -> list[int]:
    """Take rows in rank order until ``k`` are taken, skipping any that would overflow the budget.

    The paper's reference code stops at the first node that does not fit; skipping it and
    trying the next (shorter) one fills the budget better and never exceeds it.
    """
    taken: list[int] = []
    used = 0
    for row in ranked_rows:
        cost = int(token_counts[row])
        if max_tokens is not None and used + cost > max_tokens:
            continue
        taken.append(int(row))
        used += cost
        if len(taken) >= k or (max_tokens is not None and used >= max_tokens):
            break
    return taken


def top_rows(scores: NDArray[np.float32], m: int) -> NDArray[np.intp]:
    """Indices of the ``m`` highest scores, best first (ties broken by index, for determinism)."""
    n = scores.shape[0]
    if m >= n:
        return np.lexsort((np.arange(n), -scores)).astype(np.intp)
    part = np.argpartition(-scores, m - 1)[:m]
    order = np.lexsort((part, -scores[part]))
    return part[order].astype(np.intp)


class TreeRetriever(ABC):
    """Base class of the tree retrieval strategies.

    Args:
        tree: the tree to search.
        embedder: embeds the query; must be the model the tree was built with.
        k: default number of hits.
        max_tokens: default context budget (sum of the hits' token counts); None = unbounded.
    """

    #: Name recorded in ``Hit.source``.
    source = "tree"

    def __init__(
        self,
        tree: Tree,
        embedder: Embedder,
        *,
        k: int = DEFAULT_K,
        max_tokens: int | None = DEFAULT_MAX_TOKENS,
    ) -> None:
        self.tree = tree
        self.embedder = embedder
        self.k = k
        self.max_tokens = max_tokens

    def get_params(self) -> dict[str, Any]:
        """The keyword parameters as stored (scikit-learn style); models and indexes excluded."""
        signature = inspect.signature(type(self).__init__)
        return {
            name: getattr(self, name)
            for name, param in signature.parameters.items()
            if param.kind is param.KEYWORD_ONLY and name not in _NOT_PARAMS and hasattr(self, name)
        }

    def __repr__(self) -> str:
        params = ", ".join(f"{key}={value!r}" for key, value in self.get_params().items())
        return f"{type(self).__name__}({self.tree!r}, {params})"

    def _resolve(self, query: str, k: int | None, max_tokens: int | None) -> tuple[int, int | None]:
        if not isinstance(query, str):
            msg = f"query must be a string, got {type(query).__name__}"
            raise InvalidInputError(msg)
        if not query.strip():
            msg = "query is empty: pass the question to search for"
            raise InvalidInputError(msg)
        k = self.k if k is None else k
        max_tokens = self.max_tokens if max_tokens is None else max_tokens
        _check_positive_int("k", k)
        _check_positive_int("max_tokens", max_tokens, allow_none=True)
        self._validate()
        return int(k), None if max_tokens is None else int(max_tokens)

    def _validate(self) -> None:  # noqa: B027 - an optional hook, not an abstract method
        """Strategy-specific parameter checks; raise InvalidParameterError."""

    def embed_query(self, query: str) -> NDArray[np.float32]:
        """Embed and normalise the query with the retriever's embedder."""
        return normalize_query(self.embedder.embed_query(query), self.tree.dim)

    async def aembed_query(self, query: str) -> NDArray[np.float32]:
        """Async :meth:`embed_query`: native when the embedder is async, else in a thread."""
        if isinstance(self.embedder, AsyncEmbedder):
            vector = await self.embedder.aembed_query(query)
        else:
            vector = await asyncio.to_thread(self.embedder.embed_query, query)
        return normalize_query(vector, self.tree.dim)

    def retrieve(
        self,
        query: str,
        *,
        k: int | None = None,
        max_tokens: int | None = None,
        embedding: Sequence[float] | NDArray[np.float32] | None = None,
    ) -> list[Hit]:
        """Return up to ``k`` hits, best first, within ``max_tokens``.

        Args:
            query: the question (LLM-guided strategies read it; vector ones embed it).
            k: maximum hits (default: the retriever's ``k``).
            max_tokens: context budget (default: the retriever's ``max_tokens``).
            embedding: a precomputed query vector from the tree's embedding model (a host
                framework's cached query embedding, HyDE); the embedder is then not called.

        Raises:
            InvalidInputError: the query is empty or not a string.
            InvalidParameterError: a parameter is out of range.
            EmbeddingError: ``embedding`` has the wrong dimension, NaN values or zero norm.
        """
        k, max_tokens = self._resolve(query, k, max_tokens)
        if len(self.tree) == 0:
            return []
        vector = (
            self.embed_query(query)
            if embedding is None
            else normalize_query(embedding, self.tree.dim)
        )
        hits = self._retrieve(query, vector, k=k, max_tokens=max_tokens)
        logger.debug("%s: %d hits for %r", type(self).__name__, len(hits), query[:80])
        return hits

    async def aretrieve(
        self,
        query: str,
        *,
        k: int | None = None,
        max_tokens: int | None = None,
        embedding: Sequence[float] | NDArray[np.float32] | None = None,
    ) -> list[Hit]:
        """Async :meth:`retrieve`; safe inside a running event loop."""
        k, max_tokens = self._resolve(query, k, max_tokens)
        if len(self.tree) == 0:
            return []
        if embedding is None:
            vector = await self.aembed_query(query)
        else:
            vector = normalize_query(embedding, self.tree.dim)
        return await self._aretrieve(query, vector, k=k, max_tokens=max_tokens)

    @abstractmethod
    def _retrieve(
        self, query: str, vector: NDArray[np.float32], *, k: int, max_tokens: int | None
    ) -> list[Hit]:
        """Search with a validated query and its unit query vector."""

    async def _aretrieve(
        self, query: str, vector: NDArray[np.float32], *, k: int, max_tokens: int | None
    ) -> list[Hit]:
        # Vector strategies are CPU-bound and fast (milliseconds): running them inline avoids
        # a thread hop.  Strategies that call an LLM override this.
        return self._retrieve(query, vector, k=k, max_tokens=max_tokens)


class CollapsedTreeRetriever(TreeRetriever):
    """Collapsed-tree retrieval (RAPTOR, section 3): all layers in one pool, ranked by cosine.

    Args:
        tree: the tree to search.
        embedder: embeds the query.
        k: maximum number of hits.
        max_tokens: context budget; the paper uses 2,000.
        layers: search only these layers (the paper's Table 8 ablation: ``[0]`` = leaves only,
            ``[top]`` = top layer only).
        min_score: drop nodes whose cosine similarity is below this.
        index: a :class:`~raptor_core.types.VectorIndex` holding the tree's nodes by id
            (``NumpyIndex.from_tree(tree)``, ``FaissIndex.from_tree(tree)``); None = an exact
            numpy product over the tree's embedding matrix.

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
        tree: Tree,
        embedder: Embedder,
        *,
        k: int = DEFAULT_K,
        max_tokens: int | None = DEFAULT_MAX_TOKENS,
        layers: Collection[int] | None = None,
        min_score: float | None = None,
        index: VectorIndex | None = None,
    ) -> None:
        super().__init__(tree, embedder, k=k, max_tokens=max_tokens)
        self.layers = layers
        self.min_score = min_score
        self.index = index

    def _validate(self) -> None:
        check_layers("layers", self.layers, self.tree)
        check_similarity("min_score", self.min_score)

    def _retrieve(
        self, query: str, vector: NDArray[np.float32], *, k: int, max_tokens: int | None
    ) -> list[Hit]:
        if self.index is not None:
            rows, scores = self._ranked_from_index(self.index, vector, k=k, max_tokens=max_tokens)
            taken = fill_budget(
                range(rows.shape[0]), self.tree.token_counts[rows], k=k, max_tokens=max_tokens
            )
            return [self._hit(int(rows[i]), float(scores[i])) for i in taken]
        all_scores, pool = block_scores(self.tree, vector, self.layers)  # (n_candidates,)
        tokens = self.tree.token_counts if pool is None else self.tree.token_counts[pool]
        carried = self.tree.carried_mask if pool is None else self.tree.carried_mask[pool]
        taken = rank_and_fill(
            all_scores,
            tokens,
            k=k,
            max_tokens=max_tokens,
            min_score=self.min_score,
            exclude=carried,
        )
        return [
            self._hit(int(local) if pool is None else int(pool[local]), float(all_scores[local]))
            for local in taken
        ]

    def _hit(self, row: int, score: float) -> Hit:
        node = self.tree.nodes[row]
        return Hit(node=node, score=score, source=self.source, path=(node.id,))

    def _ranked_from_index(
        self, index: VectorIndex, vector: NDArray[np.float32], *, k: int, max_tokens: int | None
    ) -> tuple[NDArray[np.intp], NDArray[np.float32]]:
        """Rows and scores from ``index``, enough of them to fill ``k`` within the budget."""
        struct = structure(self.tree)
        restrict = None if self.layers is None else struct.id_set(self.layers)
        n = len(self.tree) if restrict is None else len(restrict)
        m = min(n, max(4 * k, 64))
        while True:
            pairs = index.search(vector, m, restrict_to=restrict)
            rows = rows_of(self.tree, [i for i, _ in pairs])
            scores = np.fromiter((s for _, s in pairs), dtype=np.float32, count=len(pairs))
            original = ~self.tree.carried_mask[rows]  # skip copies of a single child
            rows, scores = rows[original], scores[original]
            if self.min_score is not None:
                keep = scores >= self.min_score
                exhausted = not bool(keep.all())
                rows, scores = rows[keep], scores[keep]
            else:
                exhausted = False
            taken = fill_budget(
                range(rows.shape[0]), self.tree.token_counts[rows], k=k, max_tokens=max_tokens
            )
            full = (
                max_tokens is not None
                and int(self.tree.token_counts[rows[taken]].sum()) >= max_tokens
            )
            if len(taken) >= k or full or exhausted or len(pairs) < m or m >= n:
                return rows, scores
            m = min(n, m * 4)


def rows_of(tree: Tree, ids: Sequence[str]) -> NDArray[np.intp]:
    """Rows of ids returned by an index; a clear error when the index is not the tree's."""
    try:
        return tree.rows(ids)
    except KeyError as exc:
        msg = (
            f"the vector index returned id {exc.args[0]!r}, which is not in the tree: "
            "build the index from this tree"
        )
        raise InvalidParameterError(msg) from None


def rank_and_fill(
    scores: NDArray[np.float32],
    tokens: NDArray[np.int64],
    *,
    k: int,
    max_tokens: int | None,
    min_score: float | None = None,
    exclude: NDArray[np.bool_] | None = None,
) -> list[int]:
    """Positions of the best ``scores`` that fill ``k`` hits within ``max_tokens`` (best first).

    Positions where ``exclude`` is True are never taken.

    Only a prefix of the ranking is sorted (``argpartition``); it grows when nodes that do not
    fit the budget had to be skipped.
    """
    n = scores.shape[0]
    m = min(n, max(4 * k, 64))
    while True:
        ranked = top_rows(scores, m)
        exhausted = False
        if min_score is not None:
            keep = scores[ranked] >= min_score
            exhausted = not bool(keep.all())  # ranked is sorted: nothing further qualifies
            ranked = ranked[keep]
        if exclude is not None:
            ranked = ranked[~exclude[ranked]]
        taken = fill_budget(ranked, tokens, k=k, max_tokens=max_tokens)
        budget_full = max_tokens is not None and int(tokens[taken].sum()) >= max_tokens
        if len(taken) >= k or budget_full or exhausted or m >= n:
            return taken
        m = min(n, m * 4)


def check_similarity(name: str, value: object, *, allow_none: bool = True) -> None:
    """Raise InvalidParameterError unless ``value`` is a cosine similarity in [-1, 1]."""
    if value is None and allow_none:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float | np.floating | np.integer)
        or not -1.0 <= float(value) <= 1.0
    ):
        msg = f"{name} is a cosine similarity and must be a number in [-1, 1], got {value!r}"
        raise InvalidParameterError(msg)


def check_layers(name: str, layers: Collection[int] | None, tree: Tree) -> None:
    """Raise InvalidParameterError unless ``layers`` is None or a non-empty set of tree layers."""
    if layers is None:
        return
    if isinstance(layers, str | bytes) or not isinstance(layers, Collection):
        msg = f"{name} must be a collection of layer numbers, got {layers!r}"
        raise InvalidParameterError(msg)
    top = tree.top_layer
    bad = [
        x
        for x in layers
        if isinstance(x, bool) or not isinstance(x, int | np.integer) or not 0 <= x <= max(top, 0)
    ]
    if bad or not layers:
        msg = f"{name} must be a non-empty set of layers in [0, {top}], got {layers!r}"
        raise InvalidParameterError(msg)


def check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    """Raise InvalidParameterError unless ``value`` is one of ``choices``."""
    if value not in choices:
        msg = f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
        raise InvalidParameterError(msg)


def selection_path(tree: Tree, via: dict[int, int], row: int) -> tuple[str, ...]:
    """Ids from the root-most selected ancestor down to ``row``, following ``via`` upwards."""
    chain = [row]
    while chain[-1] in via and len(chain) <= tree.num_layers:
        chain.append(via[chain[-1]])
    return tuple(tree.nodes[r].id for r in reversed(chain))
