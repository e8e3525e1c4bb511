"""Exact inner-product search with FAISS (``IndexFlatIP``); faiss is imported on first use."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core._threads import single_omp_thread
from raptor_core.backends._vectors import RestrictCache, check_add, check_k, check_query
from raptor_core.tree import Tree

__all__ = ["FaissIndex"]


class FaissIndex:
    """A :class:`~raptor_core.types.VectorIndex` over a FAISS ``IndexFlatIP``.

    Exact search (no quantisation), so it returns the same ranking as
    :class:`~raptor_core.backends.numpy_index.NumpyIndex`; scores agree to float32
    rounding.  Vectors are unit-normalised when added (scores are cosine similarities);
    ``restrict_to`` is applied inside FAISS with an ``IDSelectorBatch``, so restricted
    searches are exact too.  Equal scores are ordered by insertion.

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

    def search(
        self,
        query: NDArray[np.float32],
        k: int,
        *,
        restrict_to: Collection[str] | None = None,
    ) -> list[tuple[str, float]]:
        """The ``k`` most similar ``(id, cosine)`` pairs, best first (see ``NumpyIndex.search``)."""
        k = check_k(k)
        if not self._ids:
            return []
        q = check_query(query, int(self._index.d)).reshape(1, -1)
        if restrict_to is None:
            with single_omp_thread(self._faiss):  # one query: see raptor_core._threads
                dist, labels = self._index.search(q, min(k, len(self._ids)))
        else:
            positions = self._restrict.positions(restrict_to, self._pos)
            if positions.size == 0:
                return []
            params = self._faiss.SearchParameters(sel=self._faiss.IDSelectorBatch(positions))
            with single_omp_thread(self._faiss):
                dist, labels = self._index.search(q, min(k, int(positions.size)), params=params)
        pairs = [(float(d), int(i)) for d, i in zip(dist[0], labels[0], strict=True) if i >= 0]
        pairs.sort(key=lambda p: (-p[0], p[1]))  # deterministic order for equal scores
        return [(self._ids[i], d) for d, i in pairs]
