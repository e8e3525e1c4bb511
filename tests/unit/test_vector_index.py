"""The bundled VectorIndex backends: conformance suite, FAISS == numpy, retrievers on an index."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from raptor_core import (
    CollapsedTreeRetriever,
    FaissIndex,
    MissingDependencyError,
    NumpyIndex,
    Tree,
    VectorIndex,
)
from raptor_core.testing import VectorIndexTests, random_tree


class TestNumpyIndex(VectorIndexTests):
    def make_index(self) -> VectorIndex:
        return NumpyIndex()


class TestFaissIndex(VectorIndexTests):
    def make_index(self) -> VectorIndex:
        return FaissIndex()


def _unit(n: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("restricted", [False, True])
def test_faiss_and_numpy_rank_identically(restricted: bool) -> None:
    vectors = _unit(2000, 64, 0)
    ids = [f"n{i}" for i in range(len(vectors))]
    numpy_index, faiss_index = NumpyIndex(), FaissIndex()
    for index in (numpy_index, faiss_index):
        index.add(ids[:1500], vectors[:1500])
        index.add(ids[1500:], vectors[1500:])
    allowed = frozenset(ids[::7]) if restricted else None
    for query in _unit(20, 64, 1):
        a = numpy_index.search(query, 25, restrict_to=allowed)
        b = faiss_index.search(query, 25, restrict_to=allowed)
        assert [i for i, _ in a] == [i for i, _ in b]
        np.testing.assert_allclose([s for _, s in a], [s for _, s in b], atol=1e-5)


def test_from_tree_indexes_node_ids() -> None:
    tree = random_tree(30, fanout=3, dim=8, random_state=0)
    for cls in (NumpyIndex, FaissIndex):
        assert len(cls.from_tree(tree)) == len(tree)
        leaves = cls.from_tree(tree, layers=[0])
        assert len(leaves) == len(tree.leaves)
        found = leaves.search(tree.embeddings[tree.row("L0.4")], 1)
        assert found[0][0] == "L0.4" and found[0][1] == pytest.approx(1.0, abs=1e-5)


@pytest.fixture(scope="module")
def tree() -> Tree:
    return random_tree(300, fanout=5, dim=32, soft=0.2, random_state=5)


class VectorEmbedder:
    def __init__(self, vector: np.ndarray) -> None:
        self.vector = vector

    def embed_documents(self, texts):
        return np.tile(self.vector, (len(texts), 1))

    def embed_query(self, text):
        return self.vector


@pytest.mark.parametrize("cls", [NumpyIndex, FaissIndex])
@pytest.mark.parametrize(
    "params",
    [
        {},
        {"layers": [0]},
        {"layers": [1, 2]},
        {"k": 3, "max_tokens": 25},
        {"min_score": 0.3, "k": 50, "max_tokens": None},
        {"k": 1000, "max_tokens": None},
    ],
)
def test_collapsed_search_is_the_same_with_an_index(tree: Tree, cls, params: dict) -> None:
    index = cls.from_tree(tree)
    for q in _unit(5, tree.dim, 3):
        plain = CollapsedTreeRetriever(tree, VectorEmbedder(q), **params).retrieve("q")
        indexed = CollapsedTreeRetriever(tree, VectorEmbedder(q), index=index, **params).retrieve(
            "q"
        )
        assert [h.id for h in indexed] == [h.id for h in plain]
        assert [h.score for h in indexed] == pytest.approx([h.score for h in plain], abs=1e-5)


def test_missing_faiss_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "faiss", None)
    with pytest.raises(MissingDependencyError, match="faiss-cpu"):
        FaissIndex()


def test_reprs() -> None:
    index = NumpyIndex()
    index.add(["a"], np.ones((1, 4), dtype=np.float32))
    assert repr(index) == "NumpyIndex(size=1, dim=4)" and index.dim == 4
    assert repr(FaissIndex()) == "FaissIndex(size=0, dim=None)"
