"""Maximal marginal relevance over the tree."""

from __future__ import annotations

import numpy as np
import pytest

from raptor_core import InvalidParameterError, MMRRetriever
from raptor_core.retrieval.mmr import mmr_order
from raptor_core.store.memory import InMemoryNodeStore
from raptor_core.testing import FakeEmbedder, random_tree, store_tree


def test_lambda_one_is_similarity_order() -> None:
    rng = np.random.default_rng(0)
    v = rng.standard_normal((30, 8)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    q = v[0]
    assert mmr_order(q, v, lambda_mult=1.0, k=10) == list(np.argsort(-(v @ q), kind="stable")[:10])


def test_near_duplicates_are_pushed_down() -> None:
    base = np.array([1.0, 0.0, 0.0], dtype=np.float32)
    dup = np.array([0.999, 0.0447, 0.0], dtype=np.float32)
    other = np.array([0.6, 0.0, 0.8], dtype=np.float32)
    v = np.stack([base, dup / np.linalg.norm(dup), other])
    order = mmr_order(base, v, lambda_mult=0.3, k=3)
    assert order[:2] == [0, 2]


def test_hits_fit_budget_and_are_distinct() -> None:
    tree = random_tree(300, dim=16)
    q = tree.embeddings[5]

    class Lookup:
        def embed_query(self, text: str) -> np.ndarray:
            return q

        def embed_documents(self, texts):  # pragma: no cover - the store has vectors
            raise AssertionError

    hits = MMRRetriever(tree, Lookup(), k=8, max_tokens=100, fetch_k=40).retrieve("x")
    assert hits and len({h.id for h in hits}) == len(hits)
    assert sum(h.node.token_count for h in hits) <= 100
    assert hits[0].id == tree.nodes[5].id  # the most relevant node always comes first


def test_re_embeds_when_the_store_has_no_vectors() -> None:
    tree = store_tree()
    embedder = FakeEmbedder(dim=tree.dim)

    class NoVectors:
        def __init__(self, inner: InMemoryNodeStore) -> None:
            self.inner = inner

        def __getattr__(self, name: str):
            if name == "vectors":
                raise AttributeError(name)
            return getattr(self.inner, name)

        def __iter__(self):
            return iter(self.inner)

        def __len__(self) -> int:
            return len(self.inner)

    store = NoVectors(InMemoryNodeStore.from_tree(tree))
    with_vectors = MMRRetriever(tree, embedder, k=5).retrieve("bees and flowers")
    without = MMRRetriever(store, embedder, k=5).retrieve("bees and flowers")
    assert [h.id for h in without] == [h.id for h in with_vectors]


@pytest.mark.parametrize("bad", [{"lambda_mult": 1.5}, {"lambda_mult": "x"}, {"fetch_k": 0}])
def test_bad_parameters(bad: dict) -> None:
    tree = store_tree()
    with pytest.raises(InvalidParameterError):
        MMRRetriever(tree, FakeEmbedder(dim=tree.dim), **bad).retrieve("q")
