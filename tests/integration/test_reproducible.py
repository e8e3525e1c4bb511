"""The same input, seed and parameters give the same tree, with or without a build cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from raptor_core import Tree, TreeBuilder

pytestmark = pytest.mark.integration

DATA = Path(__file__).resolve().parents[1] / "data"


def _docs() -> list[dict[str, str]]:
    return [
        {"doc_id": "topics", "text": (DATA / "multi_topic.md").read_text(encoding="utf-8")},
        {"doc_id": "bees", "text": (DATA / "corpus" / "bees.txt").read_text(encoding="utf-8")},
        {"doc_id": "ocean", "text": (DATA / "corpus" / "ocean.md").read_text(encoding="utf-8")},
    ]


def _same(a: Tree, b: Tree) -> None:
    assert [n.id for n in a.nodes] == [n.id for n in b.nodes]
    assert [n.text for n in a.nodes] == [n.text for n in b.nodes]
    np.testing.assert_array_equal(a.embeddings, b.embeddings)


def test_a_cache_with_partial_hits_gives_the_tree_an_uncached_build_gives(
    st_embedder, tmp_path: Path
) -> None:
    docs = _docs()
    cache = tmp_path / "cache"
    # Warm the cache with part of the corpus: the full build then meets partial hits.
    TreeBuilder(st_embedder, random_state=0, cache=cache).build(docs[:1])
    cached = TreeBuilder(st_embedder, random_state=0, cache=cache).build(docs)
    again = TreeBuilder(st_embedder, random_state=0, cache=cache).build(docs)
    plain = TreeBuilder(st_embedder, random_state=0).build(docs)
    _same(cached, plain)
    _same(again, plain)
