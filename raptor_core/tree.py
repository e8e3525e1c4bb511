"""The immutable RAPTOR tree: nodes, their embedding matrix and the invariants every tree keeps.

A :class:`Tree` is a flat tuple of :class:`Node` objects plus one embedding
matrix whose row ``i`` belongs to ``nodes[i]``.  Layer 0 holds the leaf chunks;
layer ``l > 0`` holds summaries whose children live in layer ``l - 1``.

Every tree, however it was made (built, loaded, constructed by hand), satisfies:

* node ids are unique;
* layers are numbered ``0..L-1`` with no empty layer, so ``L <= len(nodes)``;
* every child id exists and sits exactly one layer below its parent, a node lists a
  child at most once, and every node above layer 0 has at least one child;
* ``0 <= token_count <= MAX_TOKEN_COUNT``;
* the matrix is ``(len(nodes), d)`` float32 with ``d >= 1`` (``d = 0`` only for an
  empty tree), and every row is finite with unit norm (squared norm within
  ``UNIT_NORM_TOLERANCE`` of 1).

Violations raise :class:`~raptor_core.exceptions.TreeFormatError`.  The checks are
vectorised (O(n) passes over numpy arrays plus one dictionary of ids), so constructing a
million-node tree stays a matter of seconds.

Persistence (the plain-file directory format, its validation and its limits) lives in
:mod:`raptor_core.store._format`; :meth:`Tree.save` and :meth:`Tree.load` delegate to it.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core.exceptions import InvalidParameterError, TreeFormatError

__all__ = [
    "FORMAT_VERSION",
    "MAX_TOKEN_COUNT",
    "UNIT_NORM_TOLERANCE",
    "Node",
    "Tree",
    "TreeVersionWarning",
    "is_carried",
]

#: The ``format`` marker of ``tree.json``.
FORMAT_NAME = "raptor-tree"
#: The newest ``tree.json`` format this version reads and the one it writes.
FORMAT_VERSION = 1
#: Largest accepted ``Node.token_count`` (2**31 - 1): sums over millions of nodes stay exact.
MAX_TOKEN_COUNT = 2**31 - 1
#: Largest accepted ``|squared row norm - 1|``: float32 rounding stays far below it, and a
#: row that misses it would make similarity scores leave [-1, 1].
UNIT_NORM_TOLERANCE = 1e-3
# Bytes of rows checked at a time: a memory-mapped matrix is paged in (and a hostile one
# rejected) block by block.
_BLOCK_BYTES = 16 * 1024 * 1024


class TreeVersionWarning(UserWarning):
    """The tree was saved by another version of raptor_core."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    """One node of the tree.

    Attributes:
        id: unique within the tree.
        text: the chunk text (layer 0) or the summary text (layer > 0).
        layer: 0 for leaves, 1 for summaries of leaves, and so on.
        children: ids of the nodes this one summarises (empty for leaves).
        token_count: tokens in ``text`` according to the build's tokenizer.
        doc_id: the document this node comes from: a leaf's own document, or a summary's
            when everything it summarises comes from one document; ``None`` otherwise.
        span: ``(start, end)`` character offsets of a leaf in its document.
        doc_ids: the documents this node covers (a leaf covers its own).
        metadata: the document's user metadata for leaves; for summaries, the metadata that
            every leaf below them shares (so a metadata filter that a summary passes is one
            that everything it condenses passes).
        parents: ids of the summaries that include this node (several under soft
            clustering), in tree order.  They are the inverse of ``children``, carried on each
            node so a store holding nodes one by one can walk up the tree: a :class:`Tree`
            fills them in when they are left empty (and does not save them), and rejects
            them when they disagree with the children lists.
    """

    id: str
    text: str
    layer: int
    token_count: int
    children: tuple[str, ...] = ()
    doc_id: str | None = None
    span: tuple[int, int] | None = None
    doc_ids: tuple[str, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)
    parents: tuple[str, ...] = ()

    @property
    def is_leaf(self) -> bool:
        """Whether this node is a chunk of a document (layer 0)."""
        return self.layer == 0

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict (the on-disk form; ``parents`` are derived on load)."""
        return {
            "id": self.id,
            "text": self.text,
            "layer": self.layer,
            "token_count": self.token_count,
            "children": list(self.children),
            "doc_id": self.doc_id,
            "span": list(self.span) if self.span is not None else None,
            "doc_ids": list(self.doc_ids),
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Node:
        """Inverse of :meth:`to_dict`; raises :class:`TreeFormatError` on a malformed entry.

        Every field must be present with its exact JSON type, and no other field may be.
        """
        from raptor_core.store._format import node_from_json

        return node_from_json(data)


def is_carried(node: Node) -> bool:
    """Whether ``node`` is a carried copy of its only child (see :attr:`Tree.carried_mask`).

    Decided from the node alone, since a store may not hold the child at hand: the builder
    marks such copies with ``metadata["carried"]``.
    """
    return len(node.children) == 1 and node.metadata.get("carried") is True


@dataclass(frozen=True, eq=False, kw_only=True)
class Tree:
    """An immutable RAPTOR tree.

    Attributes:
        nodes: every node, in embedding-row order (layer-major when built by TreeBuilder).
        embeddings: ``(len(nodes), d)`` float32, unit-normalised rows, read-only.
        params: how the tree was built (JSON-serialisable), see ``TreeBuilder.get_params``.
        build_info: what building it took: timings, calls, tokens per layer.

    Examples:
        >>> import numpy as np
        >>> leaf = Node(id="a", text="hello", layer=0, token_count=1, doc_id="d", doc_ids=("d",))
        >>> tree = Tree(nodes=(leaf,), embeddings=np.ones((1, 2), dtype=np.float32) / np.sqrt(2))
        >>> tree.num_layers, tree.node("a").text
        (1, 'hello')
    """

    nodes: tuple[Node, ...]
    embeddings: NDArray[np.float32]
    params: Mapping[str, Any] = field(default_factory=dict)
    build_info: Mapping[str, Any] = field(default_factory=dict)
    _row: dict[str, int] = field(init=False, repr=False)
    # Parents as CSR arrays: the parents of row r are _parent_rows[_parent_ptr[r]:_parent_ptr[r + 1]].
    _parent_ptr: NDArray[np.intp] = field(init=False, repr=False)
    _parent_rows: NDArray[np.intp] = field(init=False, repr=False)
    _layers: tuple[NDArray[np.intp], ...] = field(init=False, repr=False)
    _layer_of: NDArray[np.intp] = field(init=False, repr=False)
    _tokens: NDArray[np.int64] = field(init=False, repr=False)
    _carried: NDArray[np.bool_] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        nodes = tuple(self.nodes)
        n = len(nodes)
        emb = _checked_matrix(self.embeddings, n)
        row = {node.id: i for i, node in enumerate(nodes)}
        if len(row) != n:
            counts = Counter(node.id for node in nodes)
            duplicate = next(node_id for node_id, count in counts.items() if count > 1)
            msg = f"duplicate node id {duplicate!r}"
            raise TreeFormatError(msg)
        layer_of = _int_column(nodes, "layer")
        layers = _layer_rows(nodes, layer_of)
        tokens = _int_column(nodes, "token_count")
        bad = np.flatnonzero((tokens < 0) | (tokens > MAX_TOKEN_COUNT))
        if bad.size:
            node = nodes[bad[0]]
            msg = f"node {node.id!r} has token_count {node.token_count}; expected 0..{MAX_TOKEN_COUNT}"
            raise TreeFormatError(msg)
        n_children = np.fromiter((len(node.children) for node in nodes), dtype=np.intp, count=n)
        parent_ptr, parent_rows = _parent_index(nodes, row, layer_of, n_children)
        nodes = _with_parents(nodes, parent_ptr, parent_rows)
        # Retrieval skips nodes that copy their only child up a layer (see carried_mask).
        carried = np.zeros(n, dtype=np.bool_)
        for i in np.flatnonzero(n_children == 1):
            node = nodes[i]
            if (
                node.metadata.get("carried") is True
                and node.text == nodes[row[node.children[0]]].text
            ):
                carried[i] = True
        for array in (layer_of, tokens, carried, parent_ptr, parent_rows):
            array.flags.writeable = False
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "embeddings", emb)
        object.__setattr__(self, "params", dict(self.params))
        object.__setattr__(self, "build_info", dict(self.build_info))
        object.__setattr__(self, "_row", row)
        object.__setattr__(self, "_parent_ptr", parent_ptr)
        object.__setattr__(self, "_parent_rows", parent_rows)
        object.__setattr__(self, "_layers", layers)
        object.__setattr__(self, "_layer_of", layer_of)
        object.__setattr__(self, "_tokens", tokens)
        object.__setattr__(self, "_carried", carried)

    # -- shape ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._row

    def __repr__(self) -> str:
        sizes = ", ".join(str(len(rows)) for rows in self._layers)
        return f"Tree(nodes={len(self.nodes)}, layers=[{sizes}], dim={self.dim})"

    @property
    def dim(self) -> int:
        """Embedding dimension (0 for an empty tree built without an embedder)."""
        return int(self.embeddings.shape[1])

    @property
    def num_layers(self) -> int:
        """Number of layers, leaves included (0 for an empty tree)."""
        return len(self._layers)

    @property
    def top_layer(self) -> int:
        """Index of the highest layer (-1 for an empty tree)."""
        return len(self._layers) - 1

    @property
    def leaves(self) -> tuple[Node, ...]:
        """Layer-0 nodes."""
        return self.layer(0) if self._layers else ()

    @property
    def doc_ids(self) -> tuple[str, ...]:
        """Ids of the documents in the tree, in first-seen order."""
        seen: dict[str, None] = {}
        for node in self.leaves:
            if node.doc_id is not None:
                seen.setdefault(node.doc_id, None)
        return tuple(seen)

    # -- lookup --------------------------------------------------------------------------------
    def node(self, node_id: str) -> Node:
        """Return the node with this id; ``KeyError`` if there is none."""
        return self.nodes[self._row[node_id]]

    def row(self, node_id: str) -> int:
        """Return the embedding row of a node."""
        return self._row[node_id]

    def rows(self, node_ids: Sequence[str]) -> NDArray[np.intp]:
        """Return the embedding rows of several nodes."""
        return np.fromiter((self._row[i] for i in node_ids), dtype=np.intp, count=len(node_ids))

    def layer_rows(self, layer: int) -> NDArray[np.intp]:
        """Embedding rows of the nodes of one layer (read-only)."""
        if not 0 <= layer < len(self._layers):
            msg = f"layer must be in [0, {self.top_layer}], got {layer}"
            raise InvalidParameterError(msg)
        return self._layers[layer]

    def layer(self, layer: int) -> tuple[Node, ...]:
        """The nodes of one layer."""
        return tuple(self.nodes[i] for i in self.layer_rows(layer))

    def children(self, node_id: str) -> tuple[Node, ...]:
        """The nodes that ``node_id`` summarises."""
        return tuple(self.nodes[self._row[c]] for c in self.node(node_id).children)

    def parents(self, node_id: str) -> tuple[Node, ...]:
        """The summaries that include ``node_id`` (several under soft clustering)."""
        return tuple(self.nodes[p] for p in self._parents_of(self._row[node_id]))

    def _parents_of(self, row: int) -> NDArray[np.intp]:
        return self._parent_rows[self._parent_ptr[row] : self._parent_ptr[row + 1]]

    def ancestors(self, node_id: str) -> tuple[Node, ...]:
        """Every node above ``node_id`` (parents, their parents, …), nearest layers first."""
        seen: dict[int, None] = {}
        frontier = [self._row[node_id]]
        while frontier:
            nxt: list[int] = []
            for r in frontier:
                for parent in self._parents_of(r).tolist():
                    if parent not in seen:
                        seen[parent] = None
                        nxt.append(parent)
            frontier = nxt
        return tuple(sorted((self.nodes[r] for r in seen), key=lambda n: n.layer))

    def leaf_descendants(self, node_id: str) -> tuple[Node, ...]:
        """The leaves under a node (the node itself if it is a leaf), in tree order."""
        found: set[int] = set()
        stack = [node_id]
        while stack:
            nid = stack.pop()
            node = self.node(nid)
            if node.is_leaf:
                found.add(self._row[nid])
            else:
                stack.extend(node.children)
        return tuple(self.nodes[i] for i in sorted(found))

    @property
    def layer_of_rows(self) -> NDArray[np.intp]:
        """``(n,)`` layer of each row, for vectorised filtering (read-only)."""
        return self._layer_of

    @property
    def carried_mask(self) -> NDArray[np.bool_]:
        """``(n,)`` True for nodes that carry their only child up unchanged (read-only).

        TreeBuilder does not summarise a single-member cluster: it copies the member into the
        next layer so that every branch reaches the top.  Retrieval skips these copies, which
        would otherwise take a second slot with the same text.
        """
        return self._carried

    @property
    def token_counts(self) -> NDArray[np.int64]:
        """``(n,)`` token count of each row (read-only)."""
        return self._tokens

    # -- persistence ---------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the tree to directory ``path`` atomically and return the path.

        Saves into one directory are serialised with a lock file (``.raptor.lock``); a crash
        at any point leaves the old tree or the new one.  The directory must be new, empty,
        hold a tree saved earlier, or hold only files this package writes there (the lock,
        leftovers of an interrupted save, the CLI's ``.raptor-cache``).  Other files in a
        tree's directory are left alone.  See :mod:`raptor_core.store._format`.

        Raises:
            InvalidParameterError: ``path`` is a file, or a non-empty directory that is not a
                RAPTOR tree; or the tree holds values that cannot be stored as JSON.
            TreeLockError: another process kept the directory locked for too long.
            TreeSaveError: the disk refused a write (full, read-only); the tree saved there
                before, if any, still loads.
        """
        from raptor_core.store._format import write_tree

        return write_tree(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, mmap: bool = False, verify: bool = True) -> Tree:
        """Load a tree saved by :meth:`save`.

        Args:
            path: the directory given to ``save``.
            mmap: memory-map the embedding matrix instead of reading it.
            verify: check the SHA-256 of the matrix and of the JSON content (detects
                accidental damage; every structural check runs either way).

        Raises:
            TreeFormatError: the directory is missing, truncated, edited, oversized, holds
                symbolic links or is not a RAPTOR tree.
        """
        from raptor_core.store._format import read_tree

        return read_tree(path, mmap=mmap, verify=verify)


# -- invariants ------------------------------------------------------------------------------------
def check_unit_rows(block: NDArray[np.float32], first_row: int = 0) -> None:
    """Raise :class:`TreeFormatError` unless every row of ``block`` is finite and unit-norm.

    One pass per block of rows: a NaN or an infinity makes the squared norm NaN or
    infinite, which fails the same comparison as a row of the wrong length.

    Args:
        block: ``(m, d)`` float32 rows.
        first_row: the row number of ``block[0]`` in the whole matrix (for the message).
    """
    rows = max(1, _BLOCK_BYTES // max(1, 4 * block.shape[1]))
    for start in range(0, block.shape[0], rows):
        part = block[start : start + rows]
        squared = np.einsum("ij,ij->i", part, part)
        bad = np.flatnonzero(~(np.abs(squared - 1.0) <= UNIT_NORM_TOLERANCE))
        if bad.size:
            where = first_row + start + int(bad[0])
            msg = (
                f"embedding row {where} is not a finite unit vector (squared norm "
                f"{float(squared[bad[0]])}); embeddings must be L2-normalised"
            )
            raise TreeFormatError(msg)


def _checked_matrix(embeddings: Any, n: int) -> NDArray[np.float32]:
    try:
        emb = np.asarray(embeddings)
        if emb.dtype != np.float32:
            emb = emb.astype(np.float32)
    except (TypeError, ValueError) as exc:
        msg = f"embeddings must be a float32 array, got {type(embeddings).__name__}: {exc}"
        raise TreeFormatError(msg) from exc
    if emb.ndim != 2 or emb.shape[0] != n or (n > 0 and emb.shape[1] == 0):
        msg = f"embeddings must have shape ({n}, d) with d >= 1, got {emb.shape}"
        raise TreeFormatError(msg)
    if emb.flags.writeable:
        # The tree is immutable; copy so a caller's array cannot change it later.
        emb = emb.copy()
        emb.flags.writeable = False
    check_unit_rows(emb)
    return emb


def _int_column(nodes: tuple[Node, ...], name: str) -> NDArray[np.int64]:
    try:
        return np.fromiter((getattr(n, name) for n in nodes), dtype=np.int64, count=len(nodes))
    except (OverflowError, TypeError, ValueError) as exc:
        msg = f"every node's {name} must be an integer in range: {exc}"
        raise TreeFormatError(msg) from exc


def _layer_rows(
    nodes: tuple[Node, ...], layer_of: NDArray[np.int64]
) -> tuple[NDArray[np.intp], ...]:
    """Rows of each layer; layers must be ``0..L-1`` with none empty (so ``L <= n``)."""
    n = len(nodes)
    if n == 0:
        return ()
    # Bound the layer numbers before anything is sized by them: a node claiming layer 2**40
    # must not make us allocate 2**40 of anything.
    bad = np.flatnonzero((layer_of < 0) | (layer_of >= n))
    if bad.size:
        node = nodes[bad[0]]
        msg = (
            f"node {node.id!r} has layer {node.layer}; layers are numbered from 0 without gaps, "
            f"so this tree of {n} nodes has layers 0..{n - 1} at most"
        )
        raise TreeFormatError(msg)
    counts = np.bincount(layer_of, minlength=1)
    empty = np.flatnonzero(counts == 0)
    if empty.size:
        msg = f"layer {int(empty[0])} is empty but layer {counts.size - 1} is not"
        raise TreeFormatError(msg)
    order = np.argsort(layer_of, kind="stable").astype(np.intp, copy=False)
    layers = tuple(np.split(order, np.cumsum(counts)[:-1]))
    for rows in layers:
        rows.flags.writeable = False
    return layers


def _with_parents(
    nodes: tuple[Node, ...], ptr: NDArray[np.intp], parent_rows: NDArray[np.intp]
) -> tuple[Node, ...]:
    """``nodes`` with ``parents`` filled in from the children lists (the CSR parent index).

    ``children`` is the authority (it is what the build wrote and what a file stores).
    Nodes that already carry the right parents (TreeBuilder's, a store's) are kept as they
    are; hand-built and loaded nodes get them filled in; wrong ones are an error.
    """
    out: list[Node] | None = None
    # Plain lists: indexing numpy arrays element by element costs more than the comparison.
    ids = [node.id for node in nodes]
    bounds, rows = ptr.tolist(), parent_rows.tolist()
    for i, node in enumerate(nodes):
        start, end = bounds[i], bounds[i + 1]
        if not node.parents and start == end:
            continue
        expected = tuple(map(ids.__getitem__, rows[start:end]))
        if node.parents == expected:
            continue
        if node.parents:
            msg = (
                f"node {node.id!r} lists parents {list(node.parents)} but the nodes whose "
                f"children include it are {list(expected)}"
            )
            raise TreeFormatError(msg)
        if out is None:
            out = list(nodes)
        out[i] = replace(node, parents=expected)
    return nodes if out is None else tuple(out)


def _parent_index(
    nodes: tuple[Node, ...],
    row: Mapping[str, int],
    layer_of: NDArray[np.int64],
    n_children: NDArray[np.intp],
) -> tuple[NDArray[np.intp], NDArray[np.intp]]:
    """Check every parent-child edge and return the parents as CSR arrays (ptr, rows)."""
    n = len(nodes)
    n_edges = int(n_children.sum())
    child_rows = np.fromiter(
        (row.get(c, -1) for node in nodes for c in node.children), dtype=np.intp, count=n_edges
    )
    parent_rows = np.repeat(np.arange(n, dtype=np.intp), n_children)
    unknown = np.flatnonzero(child_rows < 0)
    if unknown.size:
        parent = nodes[parent_rows[unknown[0]]]
        child = next(c for c in parent.children if c not in row)
        msg = f"node {parent.id!r} lists unknown child {child!r}"
        raise TreeFormatError(msg)
    misplaced = np.flatnonzero(layer_of[child_rows] != layer_of[parent_rows] - 1)
    if misplaced.size:
        parent, child = nodes[parent_rows[misplaced[0]]], nodes[child_rows[misplaced[0]]]
        msg = (
            f"node {parent.id!r} (layer {parent.layer}) has child {child.id!r} in layer "
            f"{child.layer}; children must be exactly one layer below their parent"
        )
        raise TreeFormatError(msg)
    childless = np.flatnonzero((layer_of > 0) & (n_children == 0))
    if childless.size:
        node = nodes[childless[0]]
        msg = f"node {node.id!r} is in layer {node.layer} but has no children"
        raise TreeFormatError(msg)
    # Sorting by child, then parent, groups each child's parents in row order (as listed).
    order = np.lexsort((parent_rows, child_rows))
    child_sorted, parents_sorted = child_rows[order], parent_rows[order]
    repeated = np.flatnonzero(
        (child_sorted[1:] == child_sorted[:-1]) & (parents_sorted[1:] == parents_sorted[:-1])
    )
    if repeated.size:
        parent, child = nodes[parents_sorted[repeated[0]]], nodes[child_sorted[repeated[0]]]
        msg = f"node {parent.id!r} lists child {child.id!r} more than once"
        raise TreeFormatError(msg)
    ptr = np.zeros(n + 1, dtype=np.intp)
    np.cumsum(np.bincount(child_sorted, minlength=n), out=ptr[1:])
    return ptr, parents_sorted.astype(np.intp, copy=False)
