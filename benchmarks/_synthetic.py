"""Synthetic RAPTOR trees of a chosen size, for speed benchmarks (no model, no text).

``synthetic_tree(n_nodes)`` has a plausible shape: about 85% leaves, and each layer above
groups about 7 nodes of the layer below under one summary (with 10% of the nodes in two
clusters, as under RAPTOR's soft clustering), up to a top layer of at most 7 nodes.

Vectors are generated top-down, like topics and sub-topics: the top layer is random, and
each child is its parent's vector plus noise (cosine about 0.8 to its parent), so a query
near a leaf is also near the leaf's ancestors, as with real summaries.  Rows are
layer-major, as TreeBuilder writes them.  Dimension 384 matches all-MiniLM-L6-v2.

    from _synthetic import synthetic_tree, synthetic_queries
    tree = synthetic_tree(10_000)
"""

from __future__ import annotations

import numpy as np

from raptor_core.tree import Node, Tree

__all__ = ["synthetic_queries", "synthetic_tree"]

FANOUT = 7


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def synthetic_tree(n_nodes: int, dim: int = 384, seed: int = 0, *, soft: float = 0.1) -> Tree:
    """A random tree with about ``n_nodes`` nodes (within a few percent), about 85% leaves."""
    rng = np.random.default_rng(seed)
    # Layer sizes, bottom up: a geometric series, n_leaves * F / (F - 1) nodes in all.
    sizes = [max(2, round(n_nodes * (FANOUT - 1) / FANOUT))]
    while sizes[-1] > FANOUT:
        sizes.append(-(-sizes[-1] // FANOUT))
    top = len(sizes) - 1
    vectors: list[np.ndarray] = [np.empty(0)] * len(sizes)
    parents_of: list[list[list[int]]] = [[] for _ in sizes]  # layer -> node -> parent indices
    vectors[top] = _unit(rng.standard_normal((sizes[top], dim)))
    for layer in range(top - 1, -1, -1):
        n, n_up = sizes[layer], sizes[layer + 1]
        primary = np.sort(np.arange(n) % n_up)  # every parent gets about FANOUT children
        noise = 0.75 * rng.standard_normal((n, dim)) / np.sqrt(dim)
        vectors[layer] = _unit(vectors[layer + 1][primary] + noise)
        parents = [[int(p)] for p in primary]
        for i in np.flatnonzero(rng.random(n) < soft):
            extra = int(rng.integers(n_up))
            if extra != parents[i][0]:
                parents[i].append(extra)
        parents_of[layer] = parents
    children: list[list[list[int]]] = [[[] for _ in range(size)] for size in sizes]
    for layer in range(top):
        for i, parents in enumerate(parents_of[layer]):
            for p in parents:
                children[layer + 1][p].append(i)
    tokens = rng.integers(40, 101, size=sum(sizes))
    nodes: list[Node] = []
    for layer, size in enumerate(sizes):
        for i in range(size):
            kids = tuple(f"L{layer - 1}.{c}" for c in children[layer][i]) if layer else ()
            nodes.append(
                Node(
                    id=f"L{layer}.{i}",
                    text=f"synthetic node {layer}.{i}",
                    layer=layer,
                    token_count=int(tokens[len(nodes)]),
                    children=kids,
                    doc_id=None if layer else "synthetic",
                    doc_ids=("synthetic",),
                )
            )
    return Tree(
        nodes=tuple(nodes),
        embeddings=np.concatenate(vectors),
        params={"generator": "benchmarks/_synthetic.py", "seed": seed},
    )


def synthetic_queries(tree: Tree, n: int, seed: int = 1, noise: float = 0.5) -> np.ndarray:
    """``(n, dim)`` unit query vectors, each near a random leaf (so some nodes are relevant)."""
    rng = np.random.default_rng(seed)
    base = tree.embeddings[rng.choice(tree.layer_rows(0), size=n)]
    return _unit(base + noise * rng.standard_normal(base.shape) / np.sqrt(tree.dim))
