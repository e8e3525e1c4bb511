"""What every retrieval strategy shares: the result type, the base class, budget and ranking helpers.

Every strategy is an object with ``retrieve(query, *, k=None, max_tokens=None) -> list[Hit]``
and an async twin ``aretrieve``.  The public methods validate and then call ``_retrieve``
(template method, like LlamaIndex ``retrieve``/``_retrieve``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import reprlib
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core.backends._vectors import unit_vector
from raptor_core.exceptions import (
    EmbeddingError,
    InvalidInputError,
    InvalidParameterError,
    TreeFormatError,
)
from raptor_core.store.filters import check_where
from raptor_core.tokenizers import count_tokens
from raptor_core.tree import Node, Tree
from raptor_core.types import (
    AsyncEmbedder,
    Embedder,
    NodeFilter,
    NodeStore,
    Tokenizer,
    VectorIndex,
)

__all__ = [
    "DEFAULT_K",
    "DEFAULT_MAX_TOKENS",
    "Hit",
    "TreeRetriever",
    "as_store",
    "check_choice",
    "check_layers",
    "check_similarity",
    "fill_budget",
    "fill_ranked",
    "normalize_query",
    "selection_path",
    "similarity_score",
    "top_layer",
    "top_rows",
]

logger = logging.getLogger(__name__)

DEFAULT_K = 10
_NOT_PARAMS = frozenset({"llm", "index"})
#: The paper's collapsed-tree context budget (section 4).
DEFAULT_MAX_TOKENS = 2000


@dataclass(frozen=True, slots=True, kw_only=True)
class Hit:
    """One retrieved node, or one passage of consecutive leaves.

    Attributes:
        node: the tree node; for a passage (see ``leaves``), a node made for the hit and not
            stored in the tree, whose text is the passage.
        score: how well the hit matches the query, in [0, 1], on one scale for every
            strategy: a cosine similarity clipped at 0 (of the node; for value-based search
            the mean over the node's retrieved chunks; for a passage its best leaf).
        source: the strategy or search that selected it (``"collapsed"``, ``"traversal"``,
            ``"value"``, ``"llm"``, ``"passage"``, ...).
        path: ids of the selected nodes leading to this one, root-most first, ending with it.
        reason: why it was selected, when the strategy can say (an LLM's reason, ...).
        evidence: ``(chunk id, chunk score)`` pairs that produced the score (value-based
            search; for a passage, each of its leaves with its cosine similarity).
        leaves: for a passage, the ids of the consecutive leaves of one document whose text
            ``node.text`` joins, in document order; empty when ``node`` is a stored node.
    """

    node: Node
    score: float
    source: str
    path: tuple[str, ...] = ()
    reason: str | None = None
    evidence: tuple[tuple[str, float], ...] = ()
    leaves: tuple[str, ...] = ()

    @property
    def layer(self) -> int:
        """The node's layer (0 = leaf chunk)."""
        return self.node.layer

    @property
    def id(self) -> str:
        """The node's id."""
        return self.node.id


def similarity_score(cosine: float) -> float:
    """A cosine similarity as a hit score in [0, 1]: negative similarity means unrelated (0).

    Every strategy reports its ``Hit.score`` on this scale (the cosine of the hit's text, or
    of the evidence behind it), so one ``score_threshold`` means the same for all of them.
    """
    return min(1.0, max(0.0, float(cosine)))


def _check_positive_int(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        msg = f"{name} must be a positive integer, got {value!r}"
        raise InvalidParameterError(msg)


def normalize_query(vector: object, dim: int | None, *, given: bool = False) -> NDArray[np.float32]:
    """Validate a query embedding and return it unit-normalised as float32 ``(d,)``.

    ``dim`` None (a store that does not know its dimension) skips the dimension check.
    ``given``: the vector was passed in (``embedding=``) rather than returned by the
    embedder, which the error messages say.

    Raises:
        EmbeddingError: ``vector`` is not a vector of numbers, has the wrong dimension,
            NaN or infinite values, or zero norm.
    """
    q = _as_vector(vector, given=given)
    if dim is not None and q.shape[0] != dim:
        msg = (
            f"query embedding has dimension {q.shape[0]} but the tree has {dim}: "
            "use the embedder the tree was built with"
        )
        raise EmbeddingError(msg)
    unit = unit_vector(q)
    if unit is not None:
        return unit
    if not np.all(np.isfinite(q)):
        msg = "the embedder returned a query vector with NaN or infinite values"
        raise EmbeddingError(msg)
    msg = "the embedder returned an all-zero query vector; cosine similarity is undefined"
    raise EmbeddingError(msg)


def _as_vector(vector: object, *, given: bool) -> NDArray[np.float32]:
    """``vector`` as a flat float32 array, or EmbeddingError naming what it was instead."""
    # A string of digits converts to a number: never a vector, whatever it holds.
    if not isinstance(vector, str | bytes):
        try:
            return np.asarray(vector, dtype=np.float32).reshape(-1)
        except (TypeError, ValueError, OverflowError):
            pass  # ragged, non-numeric or beyond any float: reported below
    got = f"{type(vector).__name__} {reprlib.repr(vector)}"
    if given:
        msg = (
            "embedding must be a flat sequence of numbers (the query's vector from the "
            f"tree's embedding model), got {got}"
        )
    else:
        msg = (
            f"the embedder returned something other than a vector of numbers ({got}) "
            "for the query: its embed_query must return a 1-D array of floats"
        )
    raise EmbeddingError(msg)


#: A hit whose text holds more UTF-8 bytes per recorded token than this is counted again
#: with the tree's tokenizer before it is returned.  Text runs at about 1.5 to 5 bytes a
#: token (CJK lowest, English about 4.5), so honest hits are almost never counted again; a
#: count forged low, which would let a context overrun its budget, is caught.
_BYTES_PER_TOKEN_CHECKED = 6
_TOKENIZERS: weakref.WeakKeyDictionary[Any, list[Tokenizer | None]] = weakref.WeakKeyDictionary()


#: Encodings a tree file may name for the budget tokenizer (tiktoken's own; data, not code).
_ENCODINGS = frozenset({"cl100k_base", "o200k_base", "p50k_base", "r50k_base"})


def _tokenizer_from_record(record: object) -> Tokenizer | None:
    """The tokenizer a tree's params describe, from a closed allowlist; else None.

    A tree file is data: only raptor_core's own local tokenizers are re-created, with a
    validated encoding name.  Anything else means passages are whole leaves only.
    """
    if not isinstance(record, Mapping):
        return None
    kind = record.get("class")
    if kind == "raptor_core.tokenizers.TiktokenTokenizer":
        encoding = record.get("encoding_name", "cl100k_base")
        if encoding not in _ENCODINGS:
            return None
        from raptor_core.tokenizers import TiktokenTokenizer

        return TiktokenTokenizer(str(encoding))
    if kind == "raptor_core.tokenizers.RegexTokenizer":
        from raptor_core.tokenizers import RegexTokenizer

        return RegexTokenizer()
    if kind == "raptor_core.testing.WhitespaceTokenizer":
        from raptor_core.testing import WhitespaceTokenizer

        return WhitespaceTokenizer()
    return None


def tree_tokenizer(tree: object) -> Tokenizer | None:
    """The tokenizer a tree was built with, when its params name an allowlisted one.

    A store that knows how its tree was built exposes the same ``params`` (the in-memory
    store keeps the tree's; the adapters' stores read them back as descriptions).
    """
    params = getattr(tree, "params", None)
    if not isinstance(params, Mapping):
        return None
    try:
        cached = _TOKENIZERS.get(tree)
    except TypeError:  # not weakly referenceable: no cache
        cached = None
    if cached is None:
        try:
            tokenizer = _tokenizer_from_record(params.get("tokenizer"))
        except (ImportError, OSError, ValueError):
            tokenizer = None  # e.g. tiktoken missing: passages are whole leaves only
        cached = [tokenizer]
        with contextlib.suppress(TypeError):  # not weakly referenceable: no cache
            _TOKENIZERS[tree] = cached
    return cached[0]


def check_token_counts(nodes: Iterable[Node], tokenizer: Tokenizer | None) -> None:
    """Raise TreeFormatError if a node's text has more tokens than it records.

    Budgets are filled with the recorded counts; a tree or store written by someone else
    could record fewer than its texts hold, and every context would overrun its budget.
    Only texts longer than ``_BYTES_PER_TOKEN_CHECKED`` bytes per recorded token are
    counted (honest ones never are, in practice), with the tokenizer the tree's params name;
    without one (a tokenizer outside the allowlist) nothing can be checked.
    """
    if tokenizer is None:
        return
    for node in nodes:
        recorded = int(node.token_count)
        size = len(node.text.encode("utf-8", "surrogatepass"))
        if size <= _BYTES_PER_TOKEN_CHECKED * recorded:
            continue
        actual = count_tokens(tokenizer, node.text)
        if actual > recorded:
            msg = (
                f"node {node.id!r} records {recorded} tokens but its text has {actual}: the "
                "tree (or the store holding it) was edited, or built with another tokenizer "
                "than its params name, and a context would overrun its token budget; "
                "rebuild it from its documents"
            )
            raise TreeFormatError(msg)


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
    return _fill(ranked_rows, token_counts, k=k, max_tokens=max_tokens)[0]


def _fill(
    ranked_rows: Sequence[int] | NDArray[np.intp],
    token_counts: NDArray[np.int64],
    *,
    k: int,
    max_tokens: int | None,
) -> tuple[list[int], int]:
    """:func:`fill_budget` and the tokens the rows taken use."""
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
    return taken, used


def fill_ranked(
    fetch: Callable[[int], tuple[Sequence[float], NDArray[np.int64]]],
    *,
    k: int,
    max_tokens: int | None,
    min_score: float | None = None,
) -> list[int]:
    """Fill ``k`` hits within ``max_tokens`` from a ranking fetched a prefix at a time.

    ``fetch(m)`` returns the scores and token counts of the best ``m`` candidates (fewer when
    there are no more), best first.  The first prefix is ``max(4k, 64)`` long (``k`` without a
    budget, when the first ``k`` are the answer) and grows fourfold while nodes too long for
    the remaining budget had to be skipped and more may follow.  Returns the positions taken
    in the last prefix fetched, in rank order.
    """
    m = k if max_tokens is None else max(4 * k, 64)
    while True:
        scores, tokens = fetch(m)
        exhausted = len(scores) < m
        ranked: Sequence[int] | range = range(len(scores))
        if min_score is not None:
            ranked = [i for i, score in enumerate(scores) if score >= min_score]
            exhausted = exhausted or len(ranked) < len(scores)  # ranked: nothing further passes
        taken, used = _fill(ranked, tokens, k=k, max_tokens=max_tokens)
        full = max_tokens is not None and used >= max_tokens
        if len(taken) >= k or full or exhausted:
            return taken
        m *= 4


def top_rows(scores: NDArray[np.float32], m: int) -> NDArray[np.intp]:
    """Indices of the ``m`` highest scores, best first, equal scores by index.

    Always a prefix of the full ranking, whatever ``m``: rows tied with the ``m``-th score are
    taken lowest index first.
    """
    n = scores.shape[0]
    if m >= n:
        return np.lexsort((np.arange(n), -scores)).astype(np.intp)
    # One partition for the m-th score, one pass for the rows at or above it (in index
    # order), then a stable sort of those few: cheaper than argpartition and lexsort.
    kth = np.partition(scores, n - m)[n - m]
    rows = np.flatnonzero(scores >= kth)
    if rows.size > m:
        top = scores[rows]
        tied = np.flatnonzero(top == kth)[: m - int(np.count_nonzero(top > kth))]
        rows = np.sort(np.concatenate([rows[top > kth], rows[tied]]))
    return rows[np.argsort(-scores[rows], kind="stable")].astype(np.intp, copy=False)


class TreeRetriever(ABC):
    """Base class of the tree retrieval strategies.

    Every strategy reads the tree through a :class:`~raptor_core.types.NodeStore`: pass a
    :class:`~raptor_core.tree.Tree` (wrapped in an :class:`InMemoryNodeStore`, shared by all
    retrievers over that tree) or any store (the file store, a LlamaIndex or LangChain
    vector store through the adapters).

    Args:
        tree: what to search: a :class:`Tree` or a :class:`~raptor_core.types.NodeStore`.
        embedder: embeds the query; must be the model the tree was built with.
        k: default number of hits.
        max_tokens: default context budget (sum of the hits' token counts); None = unbounded.
        where: a metadata filter in the core's dialect (:mod:`raptor_core.store.filters`):
            only nodes that pass it are returned.  A summary passes when the metadata shared
            by everything it condenses does (e.g. ``{"doc_id": "report-2024"}`` keeps that
            document's leaves and the summaries of that document alone).
        native_filter: a filter in the store's own dialect, ANDed with ``where``.
    """

    #: Name recorded in ``Hit.source``.
    source = "tree"

    def __init__(
        self,
        tree: Tree | NodeStore,
        embedder: Embedder,
        *,
        k: int = DEFAULT_K,
        max_tokens: int | None = DEFAULT_MAX_TOKENS,
        where: Mapping[str, Any] | None = None,
        native_filter: Any = None,
    ) -> None:
        self.tree = tree
        self.embedder = embedder
        self.k = k
        self.max_tokens = max_tokens
        self.where = where
        self.native_filter = native_filter

    @property
    def store(self) -> NodeStore:
        """The :class:`~raptor_core.types.NodeStore` searched (a Tree is wrapped once)."""
        return as_store(self.tree)

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
        try:
            query.encode("utf-8")
        except UnicodeEncodeError as exc:
            # A lone surrogate (undecoded bytes, a JSON "\ud800" escape) fails in whatever
            # encodes the query next (the embedder, an LLM client, a tokenizer).
            msg = (
                f"query holds {query[exc.start : exc.end]!a}, which is not valid Unicode text "
                "(a lone surrogate, from bytes that are not UTF-8): decode the question as "
                "UTF-8 before searching"
            )
            raise InvalidInputError(msg) from None
        k = self.k if k is None else k
        max_tokens = self.max_tokens if max_tokens is None else max_tokens
        _check_positive_int("k", k)
        _check_positive_int("max_tokens", max_tokens, allow_none=True)
        if self.where is not None:
            check_where(self.where)
        self._validate()
        return int(k), None if max_tokens is None else int(max_tokens)

    def _validate(self) -> None:  # noqa: B027 - an optional hook, not an abstract method
        """Strategy-specific parameter checks; raise InvalidParameterError."""

    def node_filter(self, **structure: Any) -> NodeFilter:
        """A :class:`NodeFilter` with the retriever's user filters and ``structure``."""
        return NodeFilter(where=self.where, native=self.native_filter, **structure)

    def _dim(self) -> int | None:
        dim = getattr(self.store, "dim", None)
        return int(dim) if isinstance(dim, int | np.integer) else None

    def embed_query(self, query: str) -> NDArray[np.float32]:
        """Embed and normalise the query with the retriever's embedder."""
        return normalize_query(self.embedder.embed_query(query), self._dim())

    async def aembed_query(self, query: str) -> NDArray[np.float32]:
        """Async :meth:`embed_query`: native when the embedder is async, else in a thread."""
        if isinstance(self.embedder, AsyncEmbedder):
            vector = await self.embedder.aembed_query(query)
        else:
            vector = await asyncio.to_thread(self.embedder.embed_query, query)
        return normalize_query(vector, self._dim())

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
            InvalidInputError: the query is empty, not a string, or not valid Unicode text.
            InvalidParameterError: a parameter is out of range.
            EmbeddingError: ``embedding`` (or the embedder's vector) is not a flat sequence
                of numbers, has the wrong dimension, NaN values or zero norm.
        """
        k, max_tokens = self._resolve(query, k, max_tokens)
        if len(self.store) == 0:
            return []
        vector = (
            self.embed_query(query)
            if embedding is None
            else normalize_query(embedding, self._dim(), given=True)
        )
        hits = self._retrieve(query, vector, k=k, max_tokens=max_tokens)
        check_token_counts((hit.node for hit in hits), tree_tokenizer(self.tree))
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
        if len(self.store) == 0:
            return []
        if embedding is None:
            vector = await self.aembed_query(query)
        else:
            vector = normalize_query(embedding, self._dim(), given=True)
        hits = await self._aretrieve(query, vector, k=k, max_tokens=max_tokens)
        check_token_counts((hit.node for hit in hits), tree_tokenizer(self.tree))
        return hits

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


# One store per (tree, index) pair, dropped with the tree.
_STORES: weakref.WeakKeyDictionary[Tree, dict[int, NodeStore]] = weakref.WeakKeyDictionary()


def as_store(tree: Tree | NodeStore, *, index: VectorIndex | None = None) -> NodeStore:
    """``tree`` as a :class:`NodeStore`: a Tree is wrapped once (shared by its retrievers).

    Args:
        tree: a Tree or a NodeStore (returned as is).
        index: a :class:`VectorIndex` already holding the tree's nodes, to search through
            (the pre-store ``index=`` parameter of the strategies); only with a Tree.

    Raises:
        InvalidParameterError: ``tree`` is neither a Tree nor a NodeStore, or ``index`` is
            given with a store.
    """
    if isinstance(tree, Tree):
        # get() before setdefault(): a lookup reuses the tree's plain weak reference, where
        # setdefault() makes a new one (with a callback) and a new dict on every call.
        stores = _STORES.get(tree)
        if stores is None:
            stores = _STORES.setdefault(tree, {})
        store = stores.get(id(index))
        if store is None:
            from raptor_core.store.memory import InMemoryNodeStore

            # The store keeps ``index`` alive, so its id() cannot be reused while cached.
            store = stores[id(index)] = InMemoryNodeStore.from_tree(tree, index=index)
        return store
    if index is not None:
        msg = "index= applies to a Tree; a NodeStore searches with its own index"
        raise InvalidParameterError(msg)
    if isinstance(tree, NodeStore):
        return tree
    msg = f"expected a Tree or a NodeStore to search, got {type(tree).__name__}"
    raise InvalidParameterError(msg)


def top_layer(store: NodeStore, where: NodeFilter | None = None) -> int:
    """The highest layer of ``store`` holding a node that passes ``where`` (-1: none).

    Uses the store's ``top_layer`` attribute when there is no filter, else probes layers
    from the top with one-result searches.
    """
    known = getattr(store, "top_layer", None)
    if not isinstance(known, int | np.integer):
        known = max((node.layer for node in store), default=-1)
    if where is None or (where.where is None and where.native is None and where.doc_ids is None):
        return int(known)
    dim = getattr(store, "dim", None)
    if not isinstance(dim, int | np.integer) or dim <= 0:
        return int(known)
    probe = np.zeros(int(dim), dtype=np.float32)
    probe[0] = 1.0
    for layer in range(int(known), -1, -1):
        kept = replace(where, layers=frozenset({layer}))
        if store.search(probe, 1, where=kept):
            return layer
    return -1


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


def check_layers(name: str, layers: Collection[int] | None, tree: Tree | NodeStore) -> None:
    """Raise InvalidParameterError unless ``layers`` is None or a non-empty set of tree layers."""
    if layers is None:
        return
    if isinstance(layers, str | bytes) or not isinstance(layers, Collection):
        msg = f"{name} must be a collection of layer numbers, got {layers!r}"
        raise InvalidParameterError(msg)
    top = tree.top_layer if isinstance(tree, Tree) else top_layer(tree)
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


def selection_path(via: Mapping[str, str], node_id: str) -> tuple[str, ...]:
    """Ids from the root-most selected ancestor down to ``node_id``, following ``via`` upwards.

    ``via`` maps a node to the selected parent that led to it.
    """
    chain = [node_id]
    while chain[-1] in via and len(chain) <= len(via):
        chain.append(via[chain[-1]])
    return tuple(reversed(chain))
