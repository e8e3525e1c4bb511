"""FAISS indexes: exact (``IndexFlatIP``) and approximate (HNSW); faiss is imported on first use."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core._threads import single_omp_thread
from raptor_core.backends._vectors import (
    PositionIndex,
    RestrictCache,
    check_add,
    check_k,
    check_query,
    exact_top,
    no_hits,
)
from raptor_core.exceptions import InvalidParameterError
from raptor_core.tree import Tree

__all__ = ["FaissHNSWIndex", "FaissIndex"]


class FaissIndex(PositionIndex):
    """A :class:`~raptor_core.types.VectorIndex` over a FAISS ``IndexFlatIP``.

    Exact search (no quantisation), so it returns the same ranking as
    :class:`~raptor_core.backends.numpy_index.NumpyIndex`; scores agree to float32
    rounding.  Vectors are unit-normalised when added (scores are cosine similarities);
    ``restrict_to`` is applied inside FAISS with an ``IDSelectorBitmap`` (kept between calls
    that pass the same frozenset), so restricted searches are exact too.  Equal scores are ordered by insertion.

    Raises:
        MissingDependencyError: ``faiss`` is not installed (``pip install faiss-cpu``).
    """

    def __init__(self) -> None:
        from raptor_core._imports import require

        self._faiss: Any = require("faiss", package="faiss-cpu")
        self._index: Any = None
        self._ids: list[str] = []
        self._pos: dict[str, int] = {}
        self._restrict = RestrictCache()

    @classmethod
    def from_tree(cls, tree: Tree, *, layers: Collection[int] | None = None) -> FaissIndex:
        """An index over the nodes of ``tree`` (only ``layers`` when given), keyed by node id."""
        from raptor_core.backends.numpy_index import _add_tree

        index = cls()
        _add_tree(index, tree, layers)
        return index

    def __len__(self) -> int:
        return len(self._ids)

    def __repr__(self) -> str:
        return f"FaissIndex(size={len(self)}, dim={self.dim})"

    @property
    def dim(self) -> int | None:
        """Vector dimension (None until the first add)."""
        return None if self._index is None else int(self._index.d)

    def add(self, ids: Sequence[str], vectors: NDArray[np.float32]) -> None:
        """Add vectors under unique string ids (see :meth:`NumpyIndex.add`)."""
        id_list, rows = check_add(ids, vectors, self.dim, self._pos)
        if not id_list:
            return
        if self._index is None:
            self._index = self._faiss.IndexFlatIP(int(rows.shape[1]))
        self._index.add(rows)
        for i in id_list:
            self._pos[i] = len(self._ids)
            self._ids.append(i)

    def empty(self) -> FaissIndex:
        """A new, empty index (how a store rebuilds its index after a delete)."""
        return FaissIndex()

    def _selector(self, positions: NDArray[np.int64]) -> _Selector:
        return _Selector(self._faiss, positions, len(self._ids))

    def search_rows(
        self,
        query: NDArray[np.float32],
        k: int,
        *,
        restrict_to: Collection[str] | None = None,
    ) -> tuple[NDArray[np.intp], NDArray[np.float32]]:
        """Positions and cosines of the ``k`` most similar vectors, best first.

        :meth:`search` names the same hits by id (see ``NumpyIndex.search_rows``).
        """
        k = check_k(k)
        if not self._ids:
            return no_hits()
        q = check_query(query, int(self._index.d)).reshape(1, -1)
        if restrict_to is None:
            with single_omp_thread(self._faiss):  # one query: see raptor_core._threads
                dist, labels = self._index.search(q, min(k, len(self._ids)))
        else:
            positions = self._restrict.positions(restrict_to, self._pos)
            if positions.size == 0:
                return no_hits()
            selector = self._restrict.extra(restrict_to, self._pos, positions, self._selector)
            params = self._faiss.SearchParameters(sel=selector.sel)
            with single_omp_thread(self._faiss):
                dist, labels = self._index.search(q, min(k, int(positions.size)), params=params)
        keep = labels[0] >= 0
        found, scores = labels[0][keep], dist[0][keep]
        order = np.lexsort((found, -scores))  # deterministic order for equal scores
        return found[order].astype(np.intp, copy=False), scores[order]


class _Selector:
    """A FAISS ``IDSelectorBitmap`` over ``positions`` and the bitmap it reads.

    FAISS keeps a raw pointer to the bitmap, so the array lives as long as the selector.
    Testing a bit costs less than ``IDSelectorBatch``'s hash lookup, and building it is one
    numpy call instead of a hash set of every allowed id.
    """

    def __init__(self, faiss: Any, positions: NDArray[np.int64], size: int) -> None:
        flags = np.zeros(size, dtype=np.bool_)
        flags[positions] = True
        self.bitmap = np.packbits(flags, bitorder="little")
        self.sel = faiss.IDSelectorBitmap(size, faiss.swig_ptr(self.bitmap))
        self._faiss = faiss
        self._params: dict[int, Any] = {}

    def params(self, ef: int) -> Any:
        """HNSW search parameters with this selector and beam (made once per beam width)."""
        made = self._params.get(ef)
        if made is None:
            made = self._params[ef] = _hnsw_params(self._faiss, ef, self.sel)
        return made


def _hnsw_params(faiss: Any, ef: int, sel: Any) -> Any:
    """``SearchParametersHNSW``: FAISS only reads them, so searches on any thread share them."""
    params = faiss.SearchParametersHNSW()
    params.efSearch = ef
    if sel is not None:
        params.sel = sel
    return params


#: Defaults of :class:`FaissHNSWIndex`, chosen with ``benchmarks/query_load.py`` (see
#: benchmarks/README.md, "Query latency under load").
DEFAULT_HNSW_M = 32
DEFAULT_EF_CONSTRUCTION = 80
DEFAULT_EF_SEARCH = 128
DEFAULT_EXACT_BELOW = 2048

# A rough price of a filtered graph search, in distance computations per candidate kept
# (about m at m=32), against an exact product over the allowed rows.  With it a layer filter
# over most nodes stays in the graph (leaves only, 86% of the nodes at 10k: 0.48 ms against
# 0.91 ms exact, benchmarks/README.md) and a small filter goes to the product.
_VISITS_PER_CANDIDATE = 32


def _check_setting(name: str, value: object, minimum: int, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        msg = f"{name} must be an integer >= {minimum}, got {value!r}: {hint}"
        raise InvalidParameterError(msg)
    return int(value)


class FaissHNSWIndex(PositionIndex):
    """Approximate nearest-neighbour search over a FAISS HNSW graph (``IndexHNSWFlat``).

    For stores of 100k nodes and more, where one exact product over every vector costs
    milliseconds (memory-bound: ``benchmarks/query_load.py``), a graph search visits a few
    thousand vectors instead.  It may miss a true neighbour (recall@10 against exact search
    is measured in benchmarks/README.md); what it returns is exact:

    * scores are the exact cosines of the returned ids (the graph keeps the vectors
      unquantised; equal to an exact index's to float32 rounding), so ``min_score`` and
      ``score_threshold`` mean what they mean with an exact index;
    * equal scores come back in insertion order, and a search is deterministic for a given
      graph (the graph itself, built on several threads, can differ between builds);
    * a search over fewer than ``exact_below`` vectors (the whole index, or the allowed ids
      of ``restrict_to``) is exact, by one product over those vectors: cheaper than the
      graph at that size;
    * a larger ``restrict_to`` filters inside the graph search (``IDSelectorBitmap``) with a
      beam widened by the share of ids left out; when that search would cost about as much
      as an exact product over the allowed rows, or finds fewer than ``k`` of them, the
      product answers instead.

    The graph is built in memory by :meth:`add` (FAISS's OpenMP threads, all cores); a
    search runs on the calling thread only (one OpenMP thread), so concurrent searches from
    many threads neither oversubscribe the cores nor wait on each other.  Vectors are
    unit-normalised when added (scores are cosine similarities).  The index is never read
    from or written to a file: build it from the tree (:meth:`from_tree`).  Searches may run
    from any number of threads at once; an :meth:`add` must not overlap them.

    Args:
        m: neighbours per node in the graph (FAISS's ``M``); more: better recall, more memory
            (about ``8 * m`` bytes per vector on top of the vector) and a slower build.
        ef_construction: candidates kept while inserting a vector; more: a better graph, a
            slower build.
        ef_search: candidates kept while searching (at least ``k``); the main trade-off of
            recall against latency.
        exact_below: searches over fewer vectors than this are exact (0: always the graph).

    Raises:
        MissingDependencyError: ``faiss`` is not installed (``pip install faiss-cpu``).
        InvalidParameterError: a setting is out of range.

    Examples:
        >>> import numpy as np
        >>> index = FaissHNSWIndex(exact_below=0)
        >>> index.add(["a", "b"], np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32))
        >>> index.search(np.array([0.9, 0.1], dtype=np.float32), 1)[0][0]
        'a'
    """

    def __init__(
        self,
        *,
        m: int = DEFAULT_HNSW_M,
        ef_construction: int = DEFAULT_EF_CONSTRUCTION,
        ef_search: int = DEFAULT_EF_SEARCH,
        exact_below: int = DEFAULT_EXACT_BELOW,
    ) -> None:
        from raptor_core._imports import require

        self.m = _check_setting("m", m, 2, "the graph needs at least 2 neighbours per node (32)")
        self.ef_construction = _check_setting(
            "ef_construction", ef_construction, 1, "raise it for a better graph (default 80)"
        )
        self.ef_search = _check_setting(
            "ef_search", ef_search, 1, "raise it for better recall (default 128)"
        )
        self.exact_below = _check_setting(
            "exact_below", exact_below, 0, "0 searches the graph at every size"
        )
        self._faiss: Any = require("faiss", package="faiss-cpu")
        self._index: Any = None
        self._dim = 0  # the index's dimension once built, kept off FAISS's SWIG getter
        self._vectors: NDArray[np.float32] = np.zeros((0, 0), dtype=np.float32)
        self._ids: list[str] = []
        self._pos: dict[str, int] = {}
        self._restrict = RestrictCache()
        self._params: dict[int, Any] = {}  # search parameters by beam width, unfiltered

    @classmethod
    def from_tree(
        cls,
        tree: Tree,
        *,
        layers: Collection[int] | None = None,
        m: int = DEFAULT_HNSW_M,
        ef_construction: int = DEFAULT_EF_CONSTRUCTION,
        ef_search: int = DEFAULT_EF_SEARCH,
        exact_below: int = DEFAULT_EXACT_BELOW,
    ) -> FaissHNSWIndex:
        """An index over the nodes of ``tree`` (only ``layers`` when given), keyed by node id."""
        from raptor_core.backends.numpy_index import _add_tree

        index = cls(
            m=m, ef_construction=ef_construction, ef_search=ef_search, exact_below=exact_below
        )
        _add_tree(index, tree, layers)
        return index

    def empty(self) -> FaissHNSWIndex:
        """A new, empty index with the same settings (how a store rebuilds after a delete)."""
        return FaissHNSWIndex(
            m=self.m,
            ef_construction=self.ef_construction,
            ef_search=self.ef_search,
            exact_below=self.exact_below,
        )

    def __len__(self) -> int:
        return len(self._ids)

    def __repr__(self) -> str:
        return (
            f"FaissHNSWIndex(size={len(self)}, dim={self.dim}, m={self.m}, "
            f"ef_construction={self.ef_construction}, ef_search={self.ef_search}, "
            f"exact_below={self.exact_below})"
        )

    @property
    def dim(self) -> int | None:
        """Vector dimension (None until the first add)."""
        return None if self._index is None else int(self._index.d)

    def add(self, ids: Sequence[str], vectors: NDArray[np.float32]) -> None:
        """Add vectors under unique string ids and link them into the graph.

        Raises:
            InvalidInputError: see :meth:`NumpyIndex.add`.
        """
        id_list, rows = check_add(ids, vectors, self.dim, self._pos)
        if not id_list:
            return
        faiss = self._faiss
        if self._index is None:
            dim = int(rows.shape[1])
            self._index = faiss.IndexHNSWFlat(dim, self.m, faiss.METRIC_INNER_PRODUCT)
            self._index.hnsw.efConstruction = self.ef_construction
            self._dim = dim
        self._index.add(rows)
        for i in id_list:
            self._pos[i] = len(self._ids)
            self._ids.append(i)
        # The graph's own float32 copy of the vectors, viewed without copying: exact scores
        # and exact searches read it.  Refreshed here because an add may move the buffer.
        storage = faiss.downcast_index(self._index.storage)
        n, d = len(self._ids), int(self._index.d)
        self._vectors = faiss.rev_swig_ptr(storage.get_xb(), n * d).reshape(n, d)

    def _selector(self, positions: NDArray[np.int64]) -> _Selector:
        return _Selector(self._faiss, positions, len(self._ids))

    def search_rows(
        self,
        query: NDArray[np.float32],
        k: int,
        *,
        restrict_to: Collection[str] | None = None,
    ) -> tuple[NDArray[np.intp], NDArray[np.float32]]:
        """Positions and exact cosines of about the ``k`` most similar vectors, best first.

        :meth:`search` names the same hits by id.

        Args:
            query: ``(d,)`` query vector (normalised here).
            k: number of results; fewer come back only when fewer vectors qualify.
            restrict_to: search only these ids (unknown ids are ignored).
        """
        k = check_k(k)
        if not self._ids:
            return no_hits()
        q = check_query(query, self._dim)
        n = len(self._ids)
        positions = None
        if restrict_to is not None:
            positions = self._restrict.positions(restrict_to, self._pos)
            if positions.size == 0:
                return no_hits()
        size = n if positions is None else int(positions.size)
        want = min(k, size)
        ef = max(self.ef_search, want)
        if positions is not None:
            # A filtered graph search keeps only the allowed share of what it visits.
            ef = min(n, -(-ef * n // size))
        if size < self.exact_below or (
            positions is not None and ef * _VISITS_PER_CANDIDATE >= size
        ):
            return self._exact(q, k, positions)
        if restrict_to is not None and positions is not None:
            selector = self._restrict.extra(restrict_to, self._pos, positions, self._selector)
            params = selector.params(ef)
        else:
            params = self._params.get(ef)
            if params is None:
                params = self._params[ef] = _hnsw_params(self._faiss, ef, None)
        faiss = self._faiss
        cosines = np.empty(want, dtype=np.float32)
        found = np.empty(want, dtype=np.int64)  # FAISS's idx_t
        with single_omp_thread(faiss):  # one query: see raptor_core._threads
            # search_c: the call under faiss's numpy wrapper, which would check and copy the
            # (already unit, contiguous) query and allocate these two arrays again.
            self._index.search_c(
                1, faiss.swig_ptr(q), want, faiss.swig_ptr(cosines), faiss.swig_ptr(found), params
            )
        if int(found.min()) < 0:
            # The graph ran out of allowed vectors before finding k (FAISS pads with -1):
            # be correct, not fast.
            return self._exact(q, k, positions)
        # IndexHNSWFlat keeps the vectors unquantised: FAISS's inner products are the exact
        # cosines (to float32 rounding).  Sorted again for a deterministic order of ties.
        order = np.lexsort((found, -cosines))
        return found[order].astype(np.intp, copy=False), cosines[order]

    def _exact(
        self, q: NDArray[np.float32], k: int, positions: NDArray[np.int64] | None
    ) -> tuple[NDArray[np.intp], NDArray[np.float32]]:
        return exact_top(self._vectors, q, k, positions)
