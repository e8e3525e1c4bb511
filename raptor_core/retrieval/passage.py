"""Passage retrieval: leaf hits grown into contiguous passages of their document.

Flat chunk retrieval returns ~100-token fragments in score order.  A tree knows more: its
leaves carry their document and position (``doc_id``, ``span``), so it knows which chunks
are neighbours, and its node texts support a lexical index.  Evidence that a reader needs
(a paragraph, a story section, a stretch of a meeting) is usually longer than one chunk
and rarely aligned with chunk boundaries, so a chunk next to a strong hit is often worth
more than the next fragment elsewhere.  This strategy:

1. ranks a pool of leaves as *seeds*, best first, by their strongest signal relative to that
   signal's best leaf: ``max(cosine / best cosine, BM25 / best BM25)`` (:func:`seed_strength`);
   the pool is the ``m`` best leaves by cosine and the ``m`` best by BM25, a few times what
   the budget holds, so a store is searched once whatever its size;
2. grows each seed into a passage with up to ``window`` adjacent leaves on each side, as
   long as each added leaf is itself relevant: within the ``rank_factor * K`` best leaves
   by cosine similarity, where ``K`` is the number of leaves the budget holds (``max_tokens``
   over the mean leaf length).  BM25 proposes seeds but does not make a neighbour relevant:
   on long pages chunk after chunk repeats the question's words.  The threshold is relative to the budget:
   the context a seed brings along must be as relevant as what flat retrieval with a few
   times the budget would have returned anyway.  The side whose next leaf is stronger
   grows first, and one seed grows into at most ``max_share`` of the budget;
3. merges passages that touch into one, and fills the budget; the passage that first fails
   to fit is cut to the tokens left (as a reader's context window would cut it), so the
   budget is used to the last token and never exceeded.

A store that cannot list its nodes (a LangChain or LlamaIndex vector store reached only
through its search API) cannot give BM25 over every leaf or each leaf's neighbours.  There
the strategy works on the leaves its one search *found* (``scope="found"``): seeds by
cosine alone, and two found leaves are neighbours when their spans in the same document are
separated by at most two characters (the whitespace between consecutive chunks; no chunk
fits in it).  Growth only ever adds leaves among the ``rank_factor * K`` best by cosine,
which that search returns, so the passages grow by the same rule as with every leaf read;
what is lost is BM25's seeds and the exact mean leaf size (``K`` is taken from the found
leaves).

Seeds are not an equal-weight fusion of the two signals: BM25's few strongest matches
become seeds next to the dense ones, but below them the dense order rules, because on
factoid questions over long pages BM25 often promotes chunks that repeat the question's
words without the answer.

What was measured and dropped (``benchmarks/results/quality.md``, development half of the
documents): seeds by reciprocal-rank fusion of dense and BM25 (loses on NQ), expanding
every seed regardless of relevance (loses on NQ at 400 tokens), cluster or summary scores
smoothing leaf scores, routing through the best summary, and restricting expansion to
leaves of the same cluster (adjacent leaves share a cluster only 20-35% of the time with
the extractive summariser's clusters): none beat the rule above.  Capping a passage at
half the budget while growing both sides alternately lost NQ answers as often as it found
QASPER evidence; growing the stronger side first made the cap a clear gain.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import weakref
from collections.abc import Mapping
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
    check_similarity,
    check_token_counts,
    similarity_score,
    top_rows,
    tree_tokenizer,
)
from raptor_core.retrieval.lexical import BM25Index
from raptor_core.tree import Node, Tree, is_carried
from raptor_core.types import Embedder, NodeStore, Tokenizer

__all__ = [
    "DEFAULT_RANK_FACTOR",
    "DEFAULT_SCOPE",
    "DEFAULT_WINDOW",
    "PassageRetriever",
    "seed_strength",
    "tree_tokenizer",
]

#: A neighbour joins a passage when it ranks within this many times the leaves that fit
#: the budget (by cosine).  Measured on the development documents: 3 to 6 score
#: alike; below 2 passages rarely grow, above 8 they take budget from distinct hits.
DEFAULT_RANK_FACTOR = 4.0
#: At most this many leaves are added on each side of a seed: a passage of up to five
#: ~100-token leaves holds a long paragraph or a story section without letting one seed
#: take a small budget.  1 to 3 scored alike.
DEFAULT_WINDOW = 2
#: A seed grows into at most this share of the budget (the seed itself always counts), so
#: even a small budget holds two places of the document.  Evidence spread over several
#: paragraphs (QASPER) needs the second place at 400 tokens; at 1,000 tokens and more the
#: ``window`` binds first.  Measured with growth toward the stronger side first (without it,
#: a capped passage grew into whichever side came first and lost NQ answers).
DEFAULT_MAX_SHARE = 0.5
#: Which leaves a search works on: ``"auto"`` is ``"all"`` on a store that can list its
#: nodes, else ``"found"`` (see :class:`PassageRetriever`).
DEFAULT_SCOPE = "auto"
_SCOPES = ("auto", "all", "found")
#: Two found leaves of one document are neighbours when at most this many characters
#: separate their spans: consecutive chunks are separated by whitespace only (a space, a
#: line break, a blank line), and a chunk between them would need at least one character
#: plus a separator on each side.
_ADJACENT_GAP = 2
#: The leaf size assumed before a search when the tree's params do not record its chunk
#: size (the paper's ~100-token chunks).
_LEAF_TOKENS_GUESS = 100
#: More leaves than any store holds (about 10^12): ``K`` and the pool sizes are capped here,
#: so a budget, ``k`` or rank factor too large for a float (``max_tokens=10**400``,
#: ``rank_factor=1e308``) means "every leaf" instead of overflowing; smaller sizes are
#: computed exactly as without the cap.
_MAX_SIZE = 2**40
#: More tokens than any tree holds (token counts are int64): a larger budget is cut to
#: this, which changes no result and keeps the budget arithmetic within floats.
_MAX_BUDGET = 2**62


@dataclass(frozen=True, slots=True)
class _LeafOrder:
    """Each leaf's neighbours in its document: ``prev``/``next`` leaf ordinals, -1 at the ends."""

    prev: NDArray[np.intp]
    next: NDArray[np.intp]


class _Leaves:
    """Leaves as passages need them: nodes, tokens, neighbours, a BM25 index.

    :meth:`from_store` reads every leaf of a store once (kept per store, weakly, while the
    store holds the same number of nodes); :meth:`found` takes the leaves one search found.
    """

    def __init__(self, nodes: list[Node], order: _LeafOrder, size: object) -> None:
        self.size = size  # the store's stamp when read (the cache's staleness check)
        self.nodes = nodes
        self.ordinal = {node.id: i for i, node in enumerate(nodes)}
        self.tokens = np.fromiter((node.token_count for node in nodes), np.int64, len(nodes))
        self.order = order
        self._bm25: BM25Index | None = None

    @classmethod
    def from_store(cls, store: NodeStore) -> _Leaves:
        """Every leaf of ``store``; neighbours: same ``doc_id``, consecutive by span start."""
        size = _stamp(store)
        nodes = [n for n in store if n.layer == 0 and not is_carried(n)]
        n = len(nodes)
        # Ties of span start keep the store's order.
        by_doc: dict[str | None, list[tuple[int, int]]] = {}
        for i, node in enumerate(nodes):
            start = node.span[0] if node.span is not None else 0
            by_doc.setdefault(node.doc_id, []).append((start, i))
        prev = np.full(n, -1, dtype=np.intp)
        nxt = np.full(n, -1, dtype=np.intp)
        for members in by_doc.values():
            ordered = [i for _, i in sorted(members)]
            prev[ordered[1:]] = ordered[:-1]
            nxt[ordered[:-1]] = ordered[1:]
        return cls(nodes, _LeafOrder(prev=prev, next=nxt), size)

    @classmethod
    def found(cls, nodes: list[Node]) -> _Leaves:
        """The leaves one search found, best first; neighbours by their spans (see module)."""
        n = len(nodes)
        by_doc: dict[str, list[tuple[int, int, int]]] = {}
        for i, node in enumerate(nodes):
            if node.doc_id is not None and node.span is not None:
                by_doc.setdefault(node.doc_id, []).append((*node.span, i))
        prev = np.full(n, -1, dtype=np.intp)
        nxt = np.full(n, -1, dtype=np.intp)
        for members in by_doc.values():
            members.sort()
            for (_, end, a), (start, _, b) in itertools.pairwise(members):
                if 0 <= start - end <= _ADJACENT_GAP:
                    prev[b], nxt[a] = a, b
        return cls(nodes, _LeafOrder(prev=prev, next=nxt), n)

    @property
    def bm25(self) -> BM25Index:
        """BM25 over the leaf texts, built on first use."""
        if self._bm25 is None:
            self._bm25 = BM25Index([node.text for node in self.nodes])
        return self._bm25


_LEAVES: weakref.WeakKeyDictionary[Any, _Leaves] = weakref.WeakKeyDictionary()


def _stamp(store: NodeStore) -> tuple[int, object]:
    """What must stay the same for leaves read from ``store`` to still be its leaves.

    The count alone is not enough: an update that adds as many nodes as it replaces keeps
    it.  A store's ``revision`` (see :class:`~raptor_core.types.NodeStore`) changes with
    every write through it; the count also catches some writes made around it.
    """
    return len(store), getattr(store, "revision", None)


def _leaves_cached(store: NodeStore) -> bool:
    """Whether :func:`_leaves` would answer from its cache (the store is unchanged since)."""
    try:
        cached = _LEAVES.get(store)
    except TypeError:  # not weakly referenceable: never cached
        return False
    return cached is not None and cached.size == _stamp(store)


def _leaves(store: NodeStore) -> _Leaves:
    try:
        cached = _LEAVES.get(store)
    except TypeError:  # a store that cannot be weakly referenced: no cache
        return _Leaves.from_store(store)
    if cached is None or cached.size != _stamp(store):
        cached = _Leaves.from_store(store)
        _LEAVES[store] = cached
    return cached


def _leaf_tokens_guess(tree: object) -> float:
    """The chunk size a tree's params record (a leaf's size before any is seen), else 100."""
    params = getattr(tree, "params", None)
    size = params.get("chunk_max_tokens") if isinstance(params, Mapping) else None
    if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
        return float(size)
    return float(_LEAF_TOKENS_GUESS)


def seed_strength(
    cosine: NDArray[np.float32], lexical: NDArray[np.float32] | None
) -> NDArray[np.float64]:
    """How strongly each leaf seeds a passage, in [0, 1]: its best signal relative to that signal's best leaf.

    ``max(cosine / best cosine, BM25 / best BM25)`` (negative cosines count as 0).  Each
    signal's top leaf scores 1, so BM25's strongest matches become seeds next to the dense
    ones; but cosines of related chunks are close together while BM25 scores fall off
    quickly, so below its first few matches BM25 rarely outranks the dense order.  That is
    the point: on factoid questions over long pages, BM25 ranks chunks that repeat the
    question's words above the answer, and an equal-weight fusion loses those answers.

    Examples:
        >>> import numpy as np
        >>> seed_strength(np.array([0.5, 0.4, -0.1], dtype=np.float32), np.array([0.0, 2.0, 1.0]))
        array([1. , 1. , 0.5])
    """
    dense = np.maximum(cosine.astype(np.float64), 0.0)
    top = float(dense.max()) if dense.size else 0.0
    strength = dense / top if top > 0 else dense
    if lexical is not None and lexical.size and float(lexical.max()) > 0:
        strength = np.maximum(strength, lexical.astype(np.float64) / float(lexical.max()))
    return strength


def _best(scores: NDArray[np.float32], m: int, *, positive_only: bool = False) -> NDArray[np.bool_]:
    """A mask of the ``m`` best entries of ``scores`` (only those > 0 when ``positive_only``)."""
    mask = np.zeros(scores.shape[0], dtype=bool)
    if m <= 0 or scores.shape[0] == 0:
        return mask
    best = top_rows(scores, min(m, scores.shape[0]))
    if positive_only:
        best = best[scores[best] > 0]
    mask[best] = True
    return mask


#: Passages are joined leaf texts; leaves end at sentence boundaries, so a line break
#: between them reads naturally for paragraphs, transcript turns and table rows alike.
SEPARATOR = "\n"
#: The shortest repeat of one pre-split leaf's end at the next one's start that counts as a
#: splitter's overlap (``chunk_overlap``) rather than text that happens to repeat.
_MIN_OVERLAP_CHARS = 16
#: Places where the next leaf's start recurs in the previous leaf that are tried before
#: giving up: text made of one repeated phrase would otherwise cost time quadratic in its
#: length (such a repeat is then kept twice, as before overlaps were detected).
_MAX_OVERLAP_TRIES = 64


def _overlap(first: Node, second: Node) -> int:
    """Characters at the start of ``second``'s text that repeat the end of ``first``'s.

    Only pre-split leaves (no ``span``) can overlap: a splitter with ``chunk_overlap``
    starts each chunk with the end of the one before.  The builder's own chunks never
    overlap, so leaves with spans give 0.  Repeats shorter than :data:`_MIN_OVERLAP_CHARS`
    count as text, not overlap.
    """
    if first.span is not None or second.span is not None:
        return 0
    a, b = first.text, second.text
    head = b[:_MIN_OVERLAP_CHARS]
    if len(head) < _MIN_OVERLAP_CHARS:
        return 0
    # The longest overlap starts earliest in ``a``: try each place its first characters occur.
    at = a.find(head, max(0, len(a) - len(b)))
    for _ in range(_MAX_OVERLAP_TRIES):
        if at < 0:
            break
        if b.startswith(a[at:]):
            return len(a) - at
        at = a.find(head, at + 1)
    return 0


def _join_leaves(leaves: list[Node]) -> str:
    """Consecutive leaves' texts as one passage, each overlap (:func:`_overlap`) once."""
    parts = [leaves[0].text]
    for before, leaf in itertools.pairwise(leaves):
        text = leaf.text[_overlap(before, leaf) :].lstrip()
        if text:
            parts.append(text)
    return SEPARATOR.join(parts)


@dataclass(frozen=True, slots=True)
class _Ranking:
    """The seed candidates of one query (see ``PassageRetriever._rank``)."""

    cosine: NDArray[np.float32]  # (n_leaves,) cosine of fetched leaves, NaN elsewhere
    relevant: NDArray[np.bool_]  # (n_leaves,) leaves a passage may grow into
    strength: NDArray[np.float64]  # (n_leaves,) seed strength of fetched leaves
    seeds: NDArray[np.intp]  # the seed pool, strongest first
    position: NDArray[np.intp]  # (n_leaves,) place of each leaf among the seeds


class _Selection:
    """Greedy leaf selection under a token budget and a cap on the number of passages.

    Costs are upper bounds: a leaf's token count plus one token per join with an already
    selected neighbour (the separator).  The exact count of each joined passage is taken
    afterwards, when a tokenizer is available.
    """

    def __init__(
        self,
        tokens: NDArray[np.int64],
        order: _LeafOrder,
        max_tokens: int | None,
        k: int,
        *,
        allow_cut: bool,
    ) -> None:
        self.tokens = tokens
        self.order = order
        self.max_tokens = max_tokens
        self.k = k
        self.allow_cut = allow_cut
        self.taken = np.zeros(tokens.shape[0], dtype=bool)
        self.used = 0
        self.passages = 0
        self.cut: int | None = None  # the leaf that first failed to fit (cut later)
        self.done = False

    def _joins(self, leaf: int) -> int:
        return sum(
            1
            for other in (self.order.prev[leaf], self.order.next[leaf])
            if other >= 0 and self.taken[other]
        )

    def add(self, group: list[int]) -> None:
        """Take the leaves of ``group`` (a seed, then its neighbours) while they fit."""
        for leaf in group:
            if self.taken[leaf]:
                continue
            joins = self._joins(leaf)
            if self.passages + 1 - joins > self.k:
                return  # it would open one passage too many
            cost = int(self.tokens[leaf]) + joins
            if self.max_tokens is not None and self.used + cost > self.max_tokens:
                if self.allow_cut:
                    self.cut = leaf
                    self.done = True
                    return
                continue  # whole leaves only: a later, shorter one may still fit
            self.taken[leaf] = True
            self.used += cost
            self.passages += 1 - joins
            if self.max_tokens is not None and self.used >= self.max_tokens:
                self.done = True
                return
        # The k-th passage still grows with its seed's neighbours; then no seed may follow.
        if self.passages >= self.k:
            self.done = True

    def runs(self) -> list[list[int]]:
        """The selected leaves as maximal runs of neighbours, each in document order."""
        runs = []
        for leaf in np.flatnonzero(self.taken).tolist():
            if self.order.prev[leaf] >= 0 and self.taken[self.order.prev[leaf]]:
                continue  # not the first leaf of its run
            run = [leaf]
            while self.order.next[run[-1]] >= 0 and self.taken[self.order.next[run[-1]]]:
                run.append(int(self.order.next[run[-1]]))
            runs.append(run)
        return runs


def _count(tokenizer: Tokenizer, text: str) -> int:
    from raptor_core.tokenizers import count_tokens

    return count_tokens(tokenizer, text)


def _cut(tokenizer: Tokenizer, text: str, room: int, *, keep_end: bool) -> str:
    """The longest start (or end, ``keep_end``) of ``text`` within ``room`` tokens."""
    if room <= 0:
        return ""
    ids = tokenizer.encode(text)
    piece = tokenizer.decode(ids[-room:] if keep_end else ids[:room]).strip()
    # Decoding part of a BPE sequence can re-tokenise to more tokens: shrink until it fits.
    while piece and _count(tokenizer, piece) > room:
        drop = max(1, len(piece) // 10)
        piece = (piece[drop:] if keep_end else piece[:-drop]).strip()
    return piece


@dataclass(slots=True)
class _Passage:
    leaves: list[int]  # leaf ordinals, document order
    text: str
    cost: int
    cut: str | None = None  # "end": the last leaf cut short; "start": the first one
    kept: int = 0  # characters of the cut leaf's text that were kept


class PassageRetriever(TreeRetriever):
    """Seeds by similarity, grown into contiguous passages where neighbours are relevant.

    See the module docstring for the algorithm.  Each hit is one passage: a single leaf
    (``hit.node`` is the tree's node, ``hit.leaves`` is empty) or several consecutive
    leaves of one document, joined with line breaks (``hit.node`` is a node made for the
    hit, with id ``"<first>..<last>"``, the joined text, the document's ``doc_id`` and
    ``metadata``, layer 0 and the covering ``span``; ``hit.leaves`` lists the leaf ids).
    The last passage may be cut to the tokens left in the budget, as a reader's context
    window would cut it: its id then ends with ``"[:n]"`` (the first ``n`` characters of
    its text were kept) or ``"[-n:]"`` (the last ``n``, when the cut leaf precedes the
    rest of the passage), and ``hit.leaves`` includes the cut leaf.

    ``Hit.score`` is the highest cosine similarity of the passage's leaves to the query,
    clipped to [0, 1], the same scale as the collapsed strategy's scores; hits come best
    first.  ``Hit.evidence`` lists every leaf of the passage with its cosine.

    Args:
        tree: the tree to search (passages are made of its leaves).
        embedder: embeds the query.
        k: maximum number of passages.
        max_tokens: context budget (sum of the passages' tokens).  None: no passages are
            formed (how far one may grow is relative to the budget), and the ``k``
            strongest leaves are returned one per hit.
        window: at most this many leaves added on each side of a seed.
        rank_factor: a neighbour is added when it is among the ``rank_factor * K`` best
            leaves by cosine, ``K`` being the number of leaves the budget holds
            (``max_tokens`` over the mean leaf length).
        max_share: one seed grows into at most this share of ``max_tokens`` (in (0, 1];
            the seed itself always counts), so a small budget still holds more than one
            place of the document.  Passages of two seeds that touch still merge.
        lexical: seed passages from BM25 (built from the leaf texts) as well as by cosine.
        min_score: leaves whose cosine similarity is below this never seed a passage.
        scope: which leaves a search works on.  ``"all"``: every leaf of the store, read
            once and kept (BM25 over all of them, neighbours in document order); the store
            must be able to list its nodes.  ``"found"``: only the leaves one search finds
            (the ``rank_factor * K`` best by cosine, or more), neighbours where their spans
            touch, no BM25 (``lexical`` is not used), ``K`` from the found leaves' mean
            size; for a vector store that can only be searched.  ``"auto"`` (default):
            ``"all"`` unless the store says it cannot list its nodes (``listable = False``,
            as the LangChain and LlamaIndex stores do for stores without a listing API).
        budget_tokenizer: counts the tokens of joined and cut passages; None: the tokenizer
            the tree was built with, when its params name a raptor_core tokenizer.  Without one,
            passages are whole leaves, never cut, and each join counts as one token.

    Examples:
        >>> from raptor_core.testing import FakeEmbedder, tiny_tree
        >>> tree = tiny_tree()
        >>> retriever = PassageRetriever(tree, FakeEmbedder(dim=tree.dim), max_tokens=30)
        >>> hit = retriever.retrieve("cats purr")[0]
        >>> hit.id, hit.leaves
        ('L0.0..L0.1', ('L0.0', 'L0.1'))
    """

    source = "passage"

    def __init__(
        self,
        tree: Tree | NodeStore,
        embedder: Embedder,
        *,
        k: int = DEFAULT_K,
        max_tokens: int | None = DEFAULT_MAX_TOKENS,
        window: int = DEFAULT_WINDOW,
        rank_factor: float = DEFAULT_RANK_FACTOR,
        max_share: float = DEFAULT_MAX_SHARE,
        lexical: bool = True,
        min_score: float | None = None,
        budget_tokenizer: Tokenizer | None = None,
        where: Mapping[str, Any] | None = None,
        native_filter: Any = None,
        scope: str = DEFAULT_SCOPE,
    ) -> None:
        super().__init__(
            tree, embedder, k=k, max_tokens=max_tokens, where=where, native_filter=native_filter
        )
        self.window = window
        self.rank_factor = rank_factor
        self.max_share = max_share
        self.lexical = lexical
        self.min_score = min_score
        self.budget_tokenizer = budget_tokenizer
        self.scope = scope

    def _validate(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            msg = f"window must be a non-negative integer, got {self.window!r}"
            raise InvalidParameterError(msg)
        factor = self.rank_factor
        if (
            isinstance(factor, bool)
            or not isinstance(factor, int | float)
            or not math.isfinite(factor)
            or factor < 0
        ):
            msg = f"rank_factor must be a non-negative number, got {factor!r}"
            raise InvalidParameterError(msg)
        share = self.max_share
        if (
            isinstance(share, bool)
            or not isinstance(share, int | float)
            or not math.isfinite(share)
            or not 0 < share <= 1
        ):
            msg = f"max_share must be a number in (0, 1], got {share!r}"
            raise InvalidParameterError(msg)
        if not isinstance(self.lexical, bool):
            msg = f"lexical must be True or False, got {self.lexical!r}"
            raise InvalidParameterError(msg)
        check_similarity("min_score", self.min_score)
        if self.scope not in _SCOPES:
            msg = f"scope must be one of {', '.join(map(repr, _SCOPES))}, got {self.scope!r}"
            raise InvalidParameterError(msg)

    def _scope(self) -> str:
        """``"all"`` or ``"found"``: what ``scope`` means for this store."""
        if self.scope != "auto":
            return str(self.scope)
        return "all" if getattr(self.store, "listable", True) is not False else "found"

    def _sizes(self, mean_tokens: float, k: int, max_tokens: int | None) -> tuple[int, int]:
        """``(depth, m)``: how many best leaves a passage may grow into, and the pool size.

        ``K``, the leaves the budget holds, is ``max_tokens`` over the mean leaf size: the
        neighbour threshold ``depth`` is a multiple of it, so it loosens with the budget
        instead of being a fixed similarity.  The pool holds at least ``depth`` leaves.
        """
        cap = _MAX_SIZE
        if max_tokens is None:
            fits = float(min(k, cap))
        else:
            fits = min(max_tokens, cap) / max(1.0, mean_tokens)
        depth = math.ceil(min(float(self.rank_factor) * max(1.0, fits), cap))
        return depth, max(depth, 2 * math.ceil(fits), 16)

    def _retrieve(
        self, query: str, vector: NDArray[np.float32], *, k: int, max_tokens: int | None
    ) -> list[Hit]:
        if max_tokens is not None:
            max_tokens = min(max_tokens, _MAX_BUDGET)
        if self._scope() == "found":
            return self._retrieve_found(vector, k=k, max_tokens=max_tokens)
        leaves = _leaves(self.store)
        n = len(leaves.nodes)
        if n == 0:
            return []
        depth, m = self._sizes(float(leaves.tokens.mean()), k, max_tokens)
        lexical = leaves.bm25.scores(query) if self.lexical else None  # (n_leaves,)
        # Seeds come from a pool of the ``m`` best leaves by cosine and the ``m`` best by
        # BM25, a few times what the budget holds: one search of the store, whatever its
        # size, and the same pool (so the same answer) from every store.  Ranking every leaf
        # instead only mattered when the pool ran out before the budget was full, and cost a
        # full scan of a vector store on every such query (a budget left a few tokens short
        # of any leaf, when leaves are never cut, ran out every pool).
        ranked = self._rank(leaves, vector, lexical, depth, min(m, n))
        return self._fill(leaves, ranked, k, max_tokens, depth)

    async def _aretrieve(
        self, query: str, vector: NDArray[np.float32], *, k: int, max_tokens: int | None
    ) -> list[Hit]:
        # The first search of a store reads every leaf and builds BM25: milliseconds for a
        # small tree, seconds to minutes for a large vector store (Chroma at 100k nodes: about
        # 25 s).  That runs in a worker thread, so the event loop keeps serving meanwhile;
        # later searches find it cached and run inline, as the other vector strategies do.
        if self._scope() == "all" and not _leaves_cached(self.store):
            await asyncio.to_thread(self._read_leaves)
        return self._retrieve(query, vector, k=k, max_tokens=max_tokens)

    def _read_leaves(self) -> None:
        leaves = _leaves(self.store)
        if self.lexical and leaves.nodes:
            leaves.bm25  # noqa: B018 - built now, in this thread, and kept with the leaves

    def _retrieve_found(
        self, vector: NDArray[np.float32], *, k: int, max_tokens: int | None
    ) -> list[Hit]:
        """``scope="found"``: passages among the leaves one search of the store finds."""
        # The filter leaves carried copies out, as every search of the leaves does.
        where = self.node_filter(layers=frozenset({0}))
        _, m = self._sizes(_leaf_tokens_guess(self.tree), k, max_tokens)
        found = self.store.search(vector, m, where=where)
        if not found:
            return []
        # K from the leaves found (the store cannot say what its mean leaf is); a pool
        # asked for on a guess of the leaf size is searched again when that guess was high.
        depth, wanted = self._sizes(
            float(np.mean([x.node.token_count for x in found])), k, max_tokens
        )
        if wanted > m and len(found) == m:
            found = self.store.search(vector, wanted, where=where)
        found = found[:wanted]
        leaves = _Leaves.found([x.node for x in found])
        n = len(found)
        cosine = np.fromiter((x.score for x in found), np.float32, n)  # (n_found,), best first
        relevant = np.zeros(n, dtype=bool)
        relevant[:depth] = True
        strength = seed_strength(cosine, None)
        seeds = np.lexsort((np.arange(n), -cosine, -strength)).astype(np.intp)
        position = np.empty(n, dtype=np.intp)
        position[seeds] = np.arange(n)
        ranked = _Ranking(
            cosine=cosine, relevant=relevant, strength=strength, seeds=seeds, position=position
        )
        return self._fill(leaves, ranked, k, max_tokens, depth)

    def _fill(
        self,
        leaves: _Leaves,
        ranked: _Ranking,
        k: int,
        max_tokens: int | None,
        depth: int,
    ) -> list[Hit]:
        """Grow the ranked seeds into passages within the budget, as hits."""
        n = len(leaves.nodes)
        tokens = leaves.tokens  # (n_leaves,)
        if max_tokens is None:
            # How far a passage may grow is relative to the budget; without one, there is
            # nothing to trade context against, so the k strongest leaves come back alone.
            order = _LeafOrder(prev=np.full(n, -1, np.intp), next=np.full(n, -1, np.intp))
        else:
            order = leaves.order
        tokenizer = self.budget_tokenizer
        if tokenizer is None:
            tokenizer = tree_tokenizer(self.tree)
        cap = None if max_tokens is None else float(self.max_share) * max_tokens
        selection = _Selection(tokens, order, max_tokens, k, allow_cut=tokenizer is not None)
        self._select(selection, ranked, order, tokens, cap)
        # The selection was sized with the recorded counts: a count forged low is an error
        # here, not passages silently dropped for overflowing once joined and counted.
        chosen = [leaves.nodes[i] for i in np.flatnonzero(selection.taken).tolist()]
        if selection.cut is not None:
            chosen.append(leaves.nodes[selection.cut])
        check_token_counts(chosen, tree_tokenizer(self.tree))
        passages = self._passages(selection, ranked.position, leaves.nodes, tokenizer, max_tokens)
        return [self._hit(p, ranked.cosine, leaves.nodes, depth) for p in passages]

    def _rank(
        self,
        leaves: _Leaves,
        vector: NDArray[np.float32],
        lexical: NDArray[np.float32] | None,
        depth: int,
        m: int,
    ) -> _Ranking:
        """The seed pool: the ``m`` best leaves by cosine and the ``m`` best by BM25.

        ``relevant`` marks the ``depth`` best by cosine, the leaves a passage may grow into.
        """
        n = len(leaves.nodes)
        store = self.store
        cosine = np.full(n, np.nan, dtype=np.float32)  # (n_leaves,): NaN = not fetched
        where = self.node_filter(layers=frozenset({0}))
        dense = store.search(vector, m, where=where)
        for match in dense:
            at = leaves.ordinal.get(match.node.id)
            if at is not None:
                cosine[at] = match.score
        everything = len(dense) < m or m >= n  # every leaf that passes the filters is known
        dense_order = [leaves.ordinal[x.node.id] for x in dense if x.node.id in leaves.ordinal]
        relevant = np.zeros(n, dtype=bool)
        relevant[dense_order[:depth]] = True
        pool = np.zeros(n, dtype=bool)
        pool[dense_order[:m]] = True
        if lexical is not None:
            # BM25 proposes seeds only: a neighbour that merely repeats the question's words
            # is not context (long pages repeat them in chunk after chunk), so growth asks
            # for closeness in meaning, as it does with scope="found".
            lexical_order = self._lexical_candidates(leaves, vector, lexical, cosine, m, everything)
            pool[lexical_order[:m]] = True
        known = ~np.isnan(cosine)
        # Every fetched leaf passes the filters: its BM25 counts towards its strength.
        lexical_scores = np.where(known, lexical, 0.0) if lexical is not None else None
        cos = np.where(known, cosine, 0.0).astype(np.float32)
        strength = seed_strength(cos, lexical_scores)
        candidates = np.flatnonzero(pool & known)
        dense_rank = np.where(known, cosine, -np.inf)
        seeds = candidates[np.lexsort((candidates, -dense_rank[candidates], -strength[candidates]))]
        position = np.full(n, n, dtype=np.intp)
        position[seeds] = np.arange(seeds.shape[0])
        return _Ranking(
            cosine=cosine,
            relevant=relevant & known,
            strength=strength,
            seeds=seeds,
            position=position,
        )

    def _lexical_candidates(
        self,
        leaves: _Leaves,
        vector: NDArray[np.float32],
        lexical: NDArray[np.float32],
        cosine: NDArray[np.float32],
        depth: int,
        everything: bool,
    ) -> NDArray[np.intp]:
        """The ``depth`` best leaves by BM25 (> 0) that pass the filters, best first.

        Their cosines are fetched from the store (one search restricted to their ids), which
        also tells which of them pass the user's filters.
        """
        ranked = top_rows(lexical, lexical.shape[0])
        ranked = ranked[lexical[ranked] > 0]
        chosen: list[int] = []
        offset = 0
        while len(chosen) < depth and offset < ranked.shape[0]:
            batch = ranked[offset : offset + 2 * (depth - len(chosen))]
            offset += batch.shape[0]
            unknown = [int(i) for i in batch if np.isnan(cosine[i])]
            if unknown and not everything:
                ids = frozenset(leaves.nodes[i].id for i in unknown)
                where = self.node_filter(layers=frozenset({0}), ids=ids)
                for match in self.store.search(vector, len(ids), where=where):
                    at = leaves.ordinal.get(match.node.id)
                    if at is not None:
                        cosine[at] = match.score
            # Fetched (or known to pass when every passing leaf is known): a candidate.
            chosen.extend(int(i) for i in batch if not np.isnan(cosine[i]))
        return np.asarray(chosen[:depth], dtype=np.intp)

    def _select(
        self,
        selection: _Selection,
        ranked: _Ranking,
        order: _LeafOrder,
        tokens: NDArray[np.int64],
        cap: float | None,
    ) -> None:
        """Grow the pool's seeds into the selection, strongest first, until it is done."""
        for seed in ranked.seeds.tolist():
            if selection.done:
                return
            if selection.taken[seed]:
                continue
            if self.min_score is not None and ranked.cosine[seed] < self.min_score:
                continue
            selection.add(self._grow(seed, ranked, order, selection.taken, tokens, cap))

    def _grow(
        self,
        seed: int,
        ranked: _Ranking,
        order: _LeafOrder,
        taken: NDArray[np.bool_],
        tokens: NDArray[np.int64],
        cap: float | None,
    ) -> list[int]:
        """The seed, then its relevant neighbours outwards, the stronger side first.

        A side stops at its first leaf that is not relevant, already taken, past ``window``
        leaves from the seed, or that would take the passage past ``cap`` tokens: passages
        stay contiguous.  While both sides can grow, the side whose next leaf is the
        stronger seed grows first, so when the cap leaves room for one more leaf, it is the
        better one.
        """
        group = [seed]
        size = int(tokens[seed])
        ends = [seed, seed]
        grown = [0, 0]
        steps = (order.prev, order.next)
        while True:
            frontier = []  # (strength, side, leaf) of each side that can still grow
            for side in (0, 1):
                at = int(steps[side][ends[side]])
                if (
                    grown[side] < int(self.window)
                    and at >= 0
                    and not taken[at]
                    and ranked.relevant[at]
                    and (cap is None or size + int(tokens[at]) <= cap)
                ):
                    frontier.append((float(ranked.strength[at]), -side, at))
            if not frontier:
                return group
            _, side, at = max(frontier)  # ties: the preceding leaf first
            side = -side
            group.append(at)
            size += int(tokens[at])
            ends[side] = at
            grown[side] += 1

    def _passages(
        self,
        selection: _Selection,
        position: NDArray[np.intp],
        nodes: list[Node],
        tokenizer: Tokenizer | None,
        max_tokens: int | None,
    ) -> list[_Passage]:
        """The selected runs as passages, best first, plus the cut leaf when it helps."""
        passages = []
        for run in selection.runs():
            text = _join_leaves([nodes[leaf] for leaf in run])
            if len(run) == 1:
                cost = nodes[run[0]].token_count
            elif tokenizer is not None:
                cost = _count(tokenizer, text)
            else:
                cost = sum(nodes[leaf].token_count for leaf in run) + len(run) - 1
            passages.append(_Passage(run, text, cost))
        # A passage ranks where its strongest seed ranks.
        passages.sort(key=lambda p: int(position[p.leaves].min()))
        if max_tokens is not None:
            # Exact counts of joined texts can exceed the bounds only through BPE oddities;
            # if they ever do, drop passages from the end rather than overflow.
            while passages and sum(p.cost for p in passages) > max_tokens:
                passages.pop()
        leaf = selection.cut
        if leaf is None or tokenizer is None or max_tokens is None:
            return passages
        room = max_tokens - sum(p.cost for p in passages)
        order = selection.order
        for p in passages:
            at_end = bool(order.next[p.leaves[-1]] == leaf)
            if not at_end and order.prev[p.leaves[0]] != leaf:
                continue
            # Next to a passage the cut leaf extends it (its start when it precedes it):
            # the passage is re-counted whole, separator included.  What it repeats of the
            # passage (a splitter's overlap) is in the passage already.
            text = nodes[leaf].text
            if at_end:
                text = text[_overlap(nodes[p.leaves[-1]], nodes[leaf]) :].lstrip()
            else:
                text = text[: len(text) - _overlap(nodes[leaf], nodes[p.leaves[0]])].rstrip()
            repeated = len(nodes[leaf].text) - len(text)  # the overlap and its whitespace
            piece = _cut(tokenizer, text, room - 1, keep_end=not at_end)
            while piece:
                joined = SEPARATOR.join([p.text, piece] if at_end else [piece, p.text])
                cost = _count(tokenizer, joined)
                if cost <= p.cost + room:
                    p.leaves = [*p.leaves, leaf] if at_end else [leaf, *p.leaves]
                    # The passage holds the repeated characters too (kept: see _hit).
                    p.text, p.cost, p.kept = joined, cost, len(piece) + repeated
                    # The selection's join costs are upper bounds: the leaf may fit whole.
                    if piece != text.strip():
                        p.cut = "end" if at_end else "start"
                    break
                piece = _cut(tokenizer, piece, _count(tokenizer, piece) - 1, keep_end=not at_end)
            return passages
        text = nodes[leaf].text
        piece = _cut(tokenizer, text, room, keep_end=False)
        if piece == text.strip():  # it fits whole after all (join costs are upper bounds)
            passages.append(_Passage([leaf], text, _count(tokenizer, text)))
        elif piece:
            passages.append(_Passage([leaf], piece, _count(tokenizer, piece), "end", len(piece)))
        return passages

    def _hit(
        self,
        passage: _Passage,
        cosine: NDArray[np.float32],
        nodes: list[Node],
        depth: int,
    ) -> Hit:
        run = passage.leaves
        leaves = [nodes[leaf] for leaf in run]
        best = max(run, key=lambda leaf: (float(cosine[leaf]), -leaf))
        evidence = tuple(
            (node.id, float(cosine[leaf])) for node, leaf in zip(leaves, run, strict=True)
        )
        reason = f"seed {nodes[best].id} (cosine {float(cosine[best]):.3f})"
        grown = len(run) - 1
        if grown:
            reason += f", {grown} adjacent leaf{'' if grown == 1 else 's'} among the top {depth} by similarity"
        if passage.cut is not None:
            reason += "; cut to the tokens left in the budget"
        score = similarity_score(float(cosine[best]))
        if len(run) == 1 and passage.cut is None:
            return Hit(
                node=leaves[0],
                score=score,
                source=self.source,
                path=(leaves[0].id,),
                reason=reason,
                evidence=evidence,
            )
        # A cut leaf keeps a prefix ("end") or a suffix ("start") of its text, which is the
        # document text of its span: name and place the passage accordingly.
        ids = [node.id for node in leaves]
        first, last = leaves[0], leaves[-1]
        start = first.span[0] if first.span is not None else None
        end = last.span[1] if last.span is not None else None
        if passage.cut == "end":
            ids[-1] += f"[:{passage.kept}]"
            end = None if last.span is None else last.span[0] + passage.kept
        elif passage.cut == "start":
            ids[0] += f"[-{passage.kept}:]"
            start = None if first.span is None else first.span[1] - passage.kept
        node_id = ids[0] if len(ids) == 1 else f"{ids[0]}..{ids[-1]}"
        node = Node(
            id=node_id,
            text=passage.text,
            layer=0,
            token_count=passage.cost,
            doc_id=first.doc_id,
            span=None if start is None or end is None else (start, end),
            doc_ids=first.doc_ids,
            metadata=first.metadata,
        )
        return Hit(
            node=node,
            score=score,
            source=self.source,
            path=(node_id,),
            reason=reason,
            evidence=evidence,
            leaves=tuple(node.id for node in leaves),
        )
