"""Conformance suites for the seams, re-exported by :mod:`raptor_core.testing`.

Subclass a suite in a test module, under a name pytest collects, and fill in the factory::

    from raptor_core.testing import VectorIndexTests

    class TestMyIndex(VectorIndexTests):
        def make_index(self):
            return MyIndex()

pytest is imported inside the tests, so importing this module never needs it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core.types import VectorIndex

__all__ = ["VectorIndexTests"]


def _unit_rows(n: int, dim: int, seed: int) -> NDArray[np.float32]:
    rows = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


class VectorIndexTests:
    """What every :class:`~raptor_core.types.VectorIndex` must do: exact, best-first cosine search.

    Errors for bad input must be ``ValueError`` subclasses (``InvalidInputError`` and
    ``InvalidParameterError`` are).
    """

    dim = 16

    def make_index(self) -> VectorIndex:
        """Return a new, empty index (override)."""
        raise NotImplementedError

    def _filled(self, n: int = 40, seed: int = 0) -> tuple[Any, list[str], NDArray[np.float32]]:
        index = self.make_index()
        ids = [f"v{i}" for i in range(n)]
        vectors = _unit_rows(n, self.dim, seed)
        index.add(ids, vectors)
        return index, ids, vectors

    def test_satisfies_protocol(self) -> None:
        """The index is a VectorIndex by duck typing."""
        assert isinstance(self.make_index(), VectorIndex)

    def test_exact_top_k_best_first(self) -> None:
        """Search is exact: the brute-force top k, best first, with cosine scores."""
        index, ids, vectors = self._filled()
        query = _unit_rows(1, self.dim, 99)[0]
        expected = np.argsort(-(vectors @ query), kind="stable")[:7]
        found = index.search(query, 7)
        assert [i for i, _ in found] == [ids[j] for j in expected]
        scores = [s for _, s in found]
        assert scores == sorted(scores, reverse=True)
        np.testing.assert_allclose(scores, (vectors @ query)[expected], atol=1e-5)

    def test_scores_are_cosine_similarities(self) -> None:
        """Vectors and queries are normalised: scores are cosines."""
        index = self.make_index()
        index.add(
            ["a", "b"],
            np.array(
                [[3.0] + [0.0] * (self.dim - 1), [1.0, 1.0] + [0.0] * (self.dim - 2)],
                dtype=np.float32,
            ),
        )
        query = np.zeros(self.dim, dtype=np.float32)
        query[0] = 5.0
        found = dict(index.search(query, 2))
        assert abs(found["a"] - 1.0) < 1e-5
        assert abs(found["b"] - 2**-0.5) < 1e-5

    def test_k_larger_than_index_returns_everything(self) -> None:
        """A k above the size returns every vector."""
        index, ids, _ = self._filled(n=5)
        found = index.search(_unit_rows(1, self.dim, 3)[0], 50)
        assert sorted(i for i, _ in found) == sorted(ids)

    def test_empty_index_returns_nothing(self) -> None:
        """An empty index answers with an empty list."""
        assert self.make_index().search(_unit_rows(1, self.dim, 3)[0], 3) == []

    def test_restrict_to_is_exact_within_the_subset(self) -> None:
        """restrict_to gives the exact top k of the subset."""
        index, ids, vectors = self._filled()
        allowed = frozenset(ids[::3])
        query = _unit_rows(1, self.dim, 7)[0]
        found = index.search(query, 4, restrict_to=allowed)
        subset = [j for j, i in enumerate(ids) if i in allowed]
        best = sorted(subset, key=lambda j: -float(vectors[j] @ query))[:4]
        assert [i for i, _ in found] == [ids[j] for j in best]

    def test_restrict_to_ignores_unknown_ids(self) -> None:
        """Unknown ids in restrict_to are ignored; an empty one finds nothing."""
        index, _, _ = self._filled(n=5)
        query = _unit_rows(1, self.dim, 3)[0]
        assert [i for i, _ in index.search(query, 5, restrict_to={"v1", "nope"})] == ["v1"]
        assert index.search(query, 5, restrict_to=frozenset()) == []

    def test_restrict_to_sees_vectors_added_later(self) -> None:
        """A reused restrict_to object sees vectors added since."""
        index, _, _ = self._filled(n=5)
        allowed = frozenset({"v1", "late"})
        query = _unit_rows(1, self.dim, 3)[0]
        assert [i for i, _ in index.search(query, 5, restrict_to=allowed)] == ["v1"]
        index.add(["late"], query.reshape(1, -1))
        assert [i for i, _ in index.search(query, 5, restrict_to=allowed)] == ["late", "v1"]

    def test_add_accumulates(self) -> None:
        """Several add calls build one index."""
        index = self.make_index()
        vectors = _unit_rows(6, self.dim, 1)
        index.add(["a", "b", "c"], vectors[:3])
        index.add(["d", "e", "f"], vectors[3:])
        assert index.search(vectors[4], 1)[0][0] == "e"
        assert index.search(vectors[0], 1)[0][0] == "a"

    def test_equal_scores_keep_insertion_order(self) -> None:
        """Equal scores come back in insertion order."""
        index = self.make_index()
        vector = _unit_rows(1, self.dim, 5)
        index.add(["first", "second", "third"], np.repeat(vector, 3, axis=0))
        assert [i for i, _ in index.search(vector[0], 3)] == ["first", "second", "third"]

    def test_rejects_duplicate_ids(self) -> None:
        """An id can be added only once."""
        import pytest

        index, _, vectors = self._filled(n=3)
        with pytest.raises(ValueError, match="already"):
            index.add(["v0"], vectors[:1])
        with pytest.raises(ValueError):
            self.make_index().add(["x", "x"], vectors[:2])

    def test_rejects_mismatched_input(self) -> None:
        """Bad shapes, dimensions and zero vectors raise ValueError."""
        import pytest

        index, _, vectors = self._filled(n=3)
        with pytest.raises(ValueError):
            index.add(["a", "b"], vectors[:1])
        with pytest.raises(ValueError):
            index.add(["a"], np.ones((1, self.dim + 1), dtype=np.float32))
        with pytest.raises(ValueError):
            index.search(np.ones(self.dim + 1, dtype=np.float32), 2)
        with pytest.raises(ValueError):
            index.add(["z"], np.zeros((1, self.dim), dtype=np.float32))

    def test_rejects_invalid_k(self) -> None:
        """The k argument must be a positive integer."""
        import pytest

        index, _, vectors = self._filled(n=3)
        for k in (0, -1, True, 1.5):
            with pytest.raises(ValueError):
                index.search(vectors[0], k)
