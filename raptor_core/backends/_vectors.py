"""Validation and id bookkeeping shared by the bundled VectorIndex backends."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TypeVar, cast

import numpy as np
from numpy.typing import NDArray

from raptor_core._threads import matvec
from raptor_core.exceptions import InvalidInputError, InvalidParameterError

__all__ = [
    "PositionIndex",
    "RestrictCache",
    "check_add",
    "check_k",
    "check_query",
    "exact_top",
    "no_hits",
]

T = TypeVar("T")


def check_k(k: object) -> int:
    """Return ``k`` if it is a positive integer, else raise InvalidParameterError."""
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        msg = f"k must be a positive integer, got {k!r}"
        raise InvalidParameterError(msg)
    return int(k)


def check_add(
    ids: Sequence[str], vectors: object, dim: int | None, known: Mapping[str, int]
) -> tuple[list[str], NDArray[np.float32]]:
    """Validate an ``add`` call; return the ids and the unit-normalised ``(n, d)`` float32 rows."""
    id_list = [str(i) for i in ids]
    arr = np.asarray(vectors, dtype=np.float32)
    if arr.ndim == 1 and arr.size == 0:
        arr = arr.reshape(0, dim or 0)
    if arr.ndim != 2 or arr.shape[0] != len(id_list):
        msg = f"add() needs one vector per id: got {len(id_list)} ids, vectors {arr.shape}"
        raise InvalidInputError(msg)
    if dim is not None and arr.shape[0] and arr.shape[1] != dim:
        msg = f"vectors have dimension {arr.shape[1]} but the index holds dimension {dim}"
        raise InvalidInputError(msg)
    if len(set(id_list)) != len(id_list):
        msg = "add() got the same id twice in one call"
        raise InvalidInputError(msg)
    clash = [i for i in id_list if i in known]
    if clash:
        msg = f"ids already in the index: {clash[:5]}"
        raise InvalidInputError(msg)
    if not np.all(np.isfinite(arr)):
        msg = "vectors contain NaN or infinite values"
        raise InvalidInputError(msg)
    norms = np.linalg.norm(arr, axis=1, keepdims=True)
    if np.any(norms == 0.0):
        msg = "vectors contain an all-zero row; cosine similarity is undefined for it"
        raise InvalidInputError(msg)
    return id_list, np.ascontiguousarray(arr / norms, dtype=np.float32)


def unit_vector(q: NDArray[np.float32]) -> NDArray[np.float32] | None:
    """``q`` scaled to unit length, or None when it has no direction (zeros, NaN or inf).

    The square sum is taken in float64, where that of float32 values can neither overflow
    (float32 tops out near 3.4e38; its square is far below float64's limit) nor underflow
    to zero: huge or tiny but finite values still give their direction, not zeros or an
    "all zeros" error.  One product answers every check: ``q . q`` is finite only when every
    value is, and positive unless all are zero.  (It is also cheaper than np.linalg.norm's
    dispatch on the query path, which runs right after a search left the CPU caches cold.)
    """
    wide = q.astype(np.float64)
    norm = math.sqrt(float(wide.dot(wide)))
    if not math.isfinite(norm) or norm == 0.0:
        return None
    return (wide / norm).astype(np.float32)


def check_query(query: object, dim: int) -> NDArray[np.float32]:
    """Return the query as a unit float32 ``(d,)`` vector or raise InvalidInputError."""
    q = np.asarray(query, dtype=np.float32).reshape(-1)
    if q.shape[0] != dim:
        msg = f"query has dimension {q.shape[0]} but the index holds dimension {dim}"
        raise InvalidInputError(msg)
    unit = unit_vector(q)
    if unit is None:
        msg = "query vector is all zeros or not finite"
        raise InvalidInputError(msg)
    return unit


class PositionIndex:
    """Base of the bundled indexes: they search in positions and name the ids last.

    A position is the order in which an id was added (0 first).  :meth:`search_rows`
    answers in positions, which is all :class:`~raptor_core.store.memory.InMemoryNodeStore`
    needs to find its rows (it maps positions to rows once per index, not each id on each
    query); :meth:`search` is the :class:`~raptor_core.types.VectorIndex` answer, the same
    hits with their ids.  An index of another library only needs ``search``.
    """

    _ids: list[str]

    def __len__(self) -> int:
        return len(self._ids)

    def ids(self) -> list[str]:
        """The ids held, by position (a copy)."""
        return list(self._ids)

    def search_rows(
        self,
        query: NDArray[np.float32],
        k: int,
        *,
        restrict_to: Collection[str] | None = None,
    ) -> tuple[NDArray[np.intp], NDArray[np.float32]]:
        """Positions and cosines of the ``k`` best matches, best first: :meth:`search` without ids."""
        raise NotImplementedError

    def search(
        self,
        query: NDArray[np.float32],
        k: int,
        *,
        restrict_to: Collection[str] | None = None,
    ) -> list[tuple[str, float]]:
        """The ``k`` most similar ``(id, cosine)`` pairs, best first (see :meth:`search_rows`).

        Args:
            query: ``(d,)`` query vector (normalised here).
            k: number of results; fewer come back only when fewer vectors qualify.
            restrict_to: search only these ids (unknown ids are ignored).

        Raises:
            InvalidParameterError: ``k`` is not a positive integer.
            InvalidInputError: the query has another dimension, or is zero or not finite.
        """
        rows, scores = self.search_rows(query, k, restrict_to=restrict_to)
        ids = self._ids
        # tolist(): Python ints and floats in one call each, not a numpy scalar per hit.
        return [(ids[r], s) for r, s in zip(rows.tolist(), scores.tolist(), strict=True)]


_NO_ROWS = np.zeros(0, dtype=np.intp)
_NO_SCORES = np.zeros(0, dtype=np.float32)
_NO_ROWS.flags.writeable = False
_NO_SCORES.flags.writeable = False


def no_hits() -> tuple[NDArray[np.intp], NDArray[np.float32]]:
    """The empty answer of :meth:`PositionIndex.search_rows` (shared read-only arrays)."""
    return _NO_ROWS, _NO_SCORES


class RestrictCache:
    """Translates a ``restrict_to`` collection of ids into sorted positions, cached by identity.

    Retrievers pass the same frozenset object on every query, so the O(len) translation
    happens once; a different object (or a grown index) recomputes it.  Only immutable
    collections (frozenset, tuple) are cached: a set may change between calls.  An index
    may keep one more object per entry (a FAISS id selector) with :meth:`extra`.

    Concurrent searches may share the cache: each entry is one tuple, replaced whole, so a
    reader sees one search's entry or another's, never a mix of two.
    """

    def __init__(self) -> None:
        # (restrict_to, (id, size), positions, extra); restrict_to is kept so that its id()
        # cannot be reused by another object while cached.
        self._entry: tuple[Collection[str], tuple[int, int], NDArray[np.int64], object] | None = (
            None
        )

    def _cached(
        self, restrict_to: Collection[str], known: Mapping[str, int]
    ) -> tuple[Collection[str], tuple[int, int], NDArray[np.int64], object] | None:
        entry = self._entry
        if (
            entry is not None
            and entry[0] is restrict_to
            and entry[1] == (id(restrict_to), len(known))
        ):
            return entry
        return None

    def positions(
        self, restrict_to: Collection[str], known: Mapping[str, int]
    ) -> NDArray[np.int64]:
        """Sorted positions of the known ids of ``restrict_to`` (unknown ids are ignored)."""
        entry = self._cached(restrict_to, known)
        if entry is not None:
            return entry[2]
        found = [known[i] for i in restrict_to if i in known]
        positions = np.unique(np.asarray(found, dtype=np.int64))
        if isinstance(restrict_to, frozenset | tuple):
            self._entry = (restrict_to, (id(restrict_to), len(known)), positions, None)
        return positions

    def extra(
        self,
        restrict_to: Collection[str],
        known: Mapping[str, int],
        positions: NDArray[np.int64],
        make: Callable[[NDArray[np.int64]], T],
    ) -> T:
        """``make(positions)``, kept with the cached positions of ``restrict_to`` when cached."""
        entry = self._cached(restrict_to, known)
        if entry is not None and entry[3] is not None and entry[2] is positions:
            return cast(T, entry[3])
        made = make(positions)
        if entry is not None and entry[2] is positions:
            self._entry = (entry[0], entry[1], positions, made)
        return made


def exact_top(
    matrix: NDArray[np.float32],
    query: NDArray[np.float32],
    k: int,
    positions: NDArray[np.int64] | None = None,
) -> tuple[NDArray[np.intp], NDArray[np.float32]]:
    """Rows of the ``k`` best scores of ``matrix @ query`` (within ``positions``) and the scores.

    Best first, equal scores by row.  A restricted product gathers the rows when they are few
    and scores every row otherwise: multiplying all rows beats copying most of them.
    """
    from raptor_core.retrieval.base import top_rows

    if positions is None:
        scores = matvec(matrix, query)  # no BLAS thread pool (see raptor_core._threads)
        best = top_rows(scores, min(k, scores.shape[0]))
        return best, scores[best]
    if positions.size * 4 >= matrix.shape[0]:
        scores = matvec(matrix, query)[positions]
    else:
        scores = matvec(matrix[positions], query)
    best = top_rows(scores, min(k, scores.shape[0]))
    return positions[best].astype(np.intp), scores[best]
