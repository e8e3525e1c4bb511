"""Array views of a tree's structure, computed once per tree and shared by the retrievers.

A :class:`~raptor_core.tree.Tree` stores children as tuples of ids, which is the right
shape for persistence but too slow to walk in Python on a 100k-node tree at query time.
:func:`structure` returns CSR (compressed sparse row) arrays instead:

* ``children``: for each row, the rows of its children;
* ``membership``: for each leaf, the rows of every node that contains it (the leaf itself,
  its parents, their parents, ...): the "a chunk belongs to each of its ancestors" relation
  of value-based search.

They are cached per tree object (weakly, so a dropped tree frees them).
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Iterable
from functools import cached_property

import numpy as np
from numpy.typing import NDArray

from raptor_core.tree import Tree

__all__ = ["TreeStructure", "block_scores", "expand", "structure"]

_CACHE: weakref.WeakKeyDictionary[Tree, TreeStructure] = weakref.WeakKeyDictionary()


class TreeStructure:
    """Lazily computed index arrays of one tree (see the module docstring)."""

    def __init__(self, tree: Tree) -> None:
        self._tree = weakref.ref(tree)
        self._blocks: dict[tuple[int, ...], tuple[NDArray[np.intp], slice | None]] = {}
        self._id_sets: dict[tuple[int, ...] | None, frozenset[str]] = {}

    @property
    def tree(self) -> Tree:
        tree = self._tree()
        if tree is None:  # pragma: no cover - the caller holds the tree
            msg = "the tree of this structure was garbage-collected"
            raise RuntimeError(msg)
        return tree

    @cached_property
    def children(self) -> tuple[NDArray[np.intp], NDArray[np.intp]]:
        """``(indptr (n+1,), rows)``: children of row ``r`` are ``rows[indptr[r]:indptr[r+1]]``."""
        tree = self.tree
        counts = np.zeros(len(tree), dtype=np.intp)
        flat: list[str] = []
        for i, node in enumerate(tree.nodes):
            if node.children:
                counts[i] = len(node.children)
                flat.extend(node.children)
        indptr = np.zeros(len(tree) + 1, dtype=np.intp)
        np.cumsum(counts, out=indptr[1:])
        rows = tree.rows(flat)
        indptr.flags.writeable = False
        rows.flags.writeable = False
        return indptr, rows

    @cached_property
    def leaf_rows(self) -> NDArray[np.intp]:
        """Rows of the layer-0 nodes."""
        return self.tree.layer_rows(0) if len(self.tree) else np.zeros(0, dtype=np.intp)

    @cached_property
    def leaf_ordinal(self) -> NDArray[np.intp]:
        """``(n,)``: position of a row in :attr:`leaf_rows`, -1 for summaries."""
        out = np.full(len(self.tree), -1, dtype=np.intp)
        out[self.leaf_rows] = np.arange(self.leaf_rows.shape[0])
        return out

    @cached_property
    def membership(self) -> tuple[NDArray[np.intp], NDArray[np.intp]]:
        """``(indptr (n_leaves+1,), rows)``: the nodes containing leaf ``leaf_rows[j]``.

        Computed as the transitive closure of the child -> parent relation with sparse
        matrix products (one per layer), so it costs milliseconds even on 100k nodes.
        """
        import scipy.sparse as sp

        tree = self.tree
        n = len(tree)
        indptr, child_rows = self.children
        parent_rows = np.repeat(np.arange(n, dtype=np.intp), np.diff(indptr))
        ones = np.ones(child_rows.shape[0], dtype=np.float32)
        up = sp.csr_matrix((ones, (child_rows, parent_rows)), shape=(n, n))  # child -> parent
        reach = sp.identity(n, dtype=np.float32, format="csr")  # a node contains itself
        closure = reach
        for _ in range(max(tree.num_layers - 1, 0)):
            reach = reach @ up
            if reach.nnz == 0:
                break
            closure = closure + reach
        leaves = closure[self.leaf_rows].tocsr()
        leaves.sort_indices()
        member_indptr = leaves.indptr.astype(np.intp)
        member_rows = leaves.indices.astype(np.intp)
        member_indptr.flags.writeable = False
        member_rows.flags.writeable = False
        return member_indptr, member_rows

    def block(self, layers: Collection[int] | None) -> tuple[NDArray[np.intp] | None, slice | None]:
        """Rows of ``layers`` (None = all) and, when they are contiguous, the equivalent slice.

        A contiguous block of the embedding matrix is a view, so a layer-restricted search
        costs no copy; TreeBuilder stores layers contiguously (layer-major order).
        """
        if layers is None:
            return None, slice(0, len(self.tree))
        key = tuple(sorted(set(layers)))
        cached = self._blocks.get(key)
        if cached is None:
            tree = self.tree
            rows = np.sort(np.concatenate([tree.layer_rows(x) for x in key]))
            contiguous = rows.size > 0 and int(rows[-1]) - int(rows[0]) + 1 == rows.size
            cached = (rows, slice(int(rows[0]), int(rows[-1]) + 1) if contiguous else None)
            self._blocks[key] = cached
        return cached

    def id_set(self, layers: Collection[int] | None) -> frozenset[str]:
        """Ids of the nodes of ``layers`` (None = all), one cached object per layer set.

        Indexes cache the rows of a ``restrict_to`` collection by identity, so passing the
        same object on every query keeps restricted index searches fast.
        """
        key = tuple(sorted(set(layers))) if layers is not None else None
        cached = self._id_sets.get(key)
        if cached is None:
            nodes = self.tree.nodes
            if layers is None:
                cached = frozenset(n.id for n in nodes)
            else:
                rows, _ = self.block(layers)
                cached = frozenset(nodes[int(r)].id for r in rows)  # type: ignore[union-attr]
            self._id_sets[key] = cached
        return cached


def structure(tree: Tree) -> TreeStructure:
    """The cached :class:`TreeStructure` of ``tree``."""
    cached = _CACHE.get(tree)
    if cached is None:
        cached = TreeStructure(tree)
        _CACHE[tree] = cached
    return cached


def block_scores(
    tree: Tree, vector: NDArray[np.float32], layers: Collection[int] | None
) -> tuple[NDArray[np.float32], NDArray[np.intp] | None]:
    """Cosine scores of the nodes of ``layers`` and their rows (None when all rows).

    Contiguous layer blocks are multiplied as views; scattered ones are scored in full and
    then gathered, which is cheaper than copying the rows out of the matrix.
    """
    rows, block = structure(tree).block(layers)
    if block is not None:
        return tree.embeddings[block] @ vector, rows
    return (tree.embeddings @ vector)[rows], rows


def expand(
    tree: Tree, parents: Iterable[int], via: dict[int, int], exclude: Collection[int]
) -> NDArray[np.intp]:
    """Sorted unique child rows of ``parents`` (given best first), minus ``exclude``.

    Records in ``via`` which parent led to each child: the best one, since under soft
    clustering a child can have several selected parents.
    """
    indptr, child_rows = structure(tree).children
    claims: dict[int, int] = {}
    for parent in parents:
        for child in child_rows[indptr[parent] : indptr[parent + 1]].tolist():
            if child not in exclude and child not in claims:
                claims[child] = int(parent)
    via.update(claims)
    return np.fromiter(sorted(claims), dtype=np.intp, count=len(claims))
