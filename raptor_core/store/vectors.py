"""Checks every store applies to the vectors it is given, and the shape it reports.

The in-memory store and the adapters' stores (LangChain, LlamaIndex) accept vectors from
callers and from other stores; each must refuse the same bad input with the same message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core._threads import matvec
from raptor_core.exceptions import InvalidInputError

__all__ = ["UNIT_LENGTH_TOLERANCE", "StoreShape", "nearest_rows", "unit_rows"]

#: A row whose L2 norm is this close to 1 is already a unit vector and is kept bit for bit:
#: dividing it by its float32 norm again moves its last bits (about 6e-8), so a tree
#: written into a store and read back would differ from the tree, and an incremental
#: update would place a new chunk differently than on the in-memory tree.  A float32 row
#: normalised once has a norm within a few 1e-8 of 1.
UNIT_LENGTH_TOLERANCE = 1e-6


def unit_rows(vectors: object, n: int, dim: int | None) -> NDArray[np.float32]:
    """``vectors`` as ``(n, d)`` float32 rows of unit length, after checking them.

    Rows already of unit length (within :data:`UNIT_LENGTH_TOLERANCE`) are kept bit for bit.

    Args:
        vectors: one vector per node (anything ``numpy.asarray`` takes).
        n: the number of nodes the vectors belong to.
        dim: the store's dimension; None when it holds nothing yet.

    Raises:
        InvalidInputError: not one vector per node, another dimension than the store's,
            NaN or infinite values, or an all-zero row (cosine is undefined for it).
    """
    arr = np.asarray(vectors, dtype=np.float32)
    if arr.size == 0 and n == 0:
        return np.zeros((0, dim or 0), dtype=np.float32)
    if arr.ndim != 2 or arr.shape[0] != n:
        msg = f"add() needs one vector per node: got {n} nodes, vectors of shape {arr.shape}"
        raise InvalidInputError(msg)
    if dim is not None and arr.shape[1] != dim:
        msg = f"vectors have dimension {arr.shape[1]} but the store holds dimension {dim}"
        raise InvalidInputError(msg)
    if not np.all(np.isfinite(arr)):
        msg = "vectors contain NaN or infinite values"
        raise InvalidInputError(msg)
    norms = np.linalg.norm(arr.astype(np.float64), axis=1)
    if np.any(norms == 0.0):
        msg = "vectors contain an all-zero row; cosine similarity is undefined for it"
        raise InvalidInputError(msg)
    # Always a copy: a store keeps the rows, and the caller may change its array later.
    out = np.array(arr, dtype=np.float32, order="C")
    off = np.abs(norms - 1.0) > UNIT_LENGTH_TOLERANCE
    if off.any():
        out[off] = arr[off] / norms[off, None]
    return out


def nearest_rows(
    query: NDArray[np.float32], vectors: NDArray[np.float32], ids: Sequence[str], m: int
) -> list[tuple[int, float]]:
    """The ``m`` rows of ``vectors`` nearest to ``query`` by exact cosine: (row, cosine), best first.

    For a store that ranks records it has read itself instead of asking its index (an
    adapter's exact scan).  Ties go in id order, so the same records give the same answer
    in any order; an all-zero row scores 0.

    Examples:
        >>> import numpy as np
        >>> rows = np.array([[0.0, 2.0], [1.0, 0.0], [3.0, 0.0]], dtype=np.float32)
        >>> nearest_rows(np.array([1.0, 0.0], dtype=np.float32), rows, ["c", "b", "a"], 2)
        [(2, 1.0), (1, 1.0)]
    """
    if len(ids) == 0:
        return []
    norms = np.linalg.norm(vectors, axis=1)
    scores = matvec(vectors, np.asarray(query, dtype=np.float32).reshape(-1))
    scores = scores / np.where(norms > 0, norms, 1.0)
    order = sorted(range(len(ids)), key=lambda i: (-float(scores[i]), str(ids[i])))
    return [(i, float(scores[i])) for i in order[:m]]


@dataclass(frozen=True, slots=True)
class StoreShape:
    """What checking a caller's embedder reads of a stored tree (``check_embedder``)."""

    params: Mapping[str, Any]
    dim: int
    size: int

    def __len__(self) -> int:
        return self.size
