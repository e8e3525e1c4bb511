"""The file-backed :class:`~raptor_core.types.NodeStore`: search a saved tree without loading it.

:meth:`FileNodeStore.open` reads the node index ``tree.idx`` that
:meth:`~raptor_core.tree.Tree.save` writes beside ``tree.json`` (see
:mod:`raptor_core.store._index`): numpy columns for the structure (layers, token counts,
children, documents, metadata), the embedding matrix memory-mapped, and each node's JSON
line read from ``tree.json`` only when a search returns that node.  Opening a million-node
tree therefore reads tens of megabytes instead of gigabytes.

Checks run when data is first used: a block of ``tree.json`` or of the matrix is compared
with its SHA-256 (``verify=True``) and matrix rows are checked finite and unit-norm the
first time a search touches them, so the first query over the whole matrix pays for
reading it once.  A tree without an index (saved by an older version, or re-saved by one)
is read in full with :meth:`~raptor_core.tree.Tree.load`, with a
:class:`TreeIndexWarning` saying so.
"""

from __future__ import annotations

import hashlib
import mmap as mmap_module
import os
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core._threads import matvec
from raptor_core.exceptions import InvalidInputError, InvalidParameterError, TreeFormatError
from raptor_core.store._format import TREE_FILE
from raptor_core.store._index import (
    Columns,
    IndexFile,
    columns_from_tree,
    meta_flags,
    parent_index,
)
from raptor_core.store.filters import compile_where
from raptor_core.store.memory import _GATHER_SHARE, _filter_key
from raptor_core.tree import Node, Tree, check_unit_rows
from raptor_core.types import Match, NodeFilter

__all__ = ["FileNodeStore", "TreeIndexWarning"]

# Parsed nodes kept for repeated hits (a few megabytes at most).
_NODE_CACHE = 4096
_TREE_JSON = Path(TREE_FILE)


class TreeIndexWarning(UserWarning):
    """A saved tree has no usable node index, so opening it read all of ``tree.json``."""


class FileNodeStore:
    """A read-only :class:`~raptor_core.types.NodeStore` over a tree saved with :meth:`Tree.save`.

    Create it with :meth:`open`.  Searches give the same nodes, scores and order as the
    in-memory store over the loaded tree; ``add`` and ``delete`` raise
    :class:`~raptor_core.exceptions.InvalidParameterError` (load the tree to change it).

    Examples:
        >>> import tempfile
        >>> from raptor_core.store import InMemoryNodeStore
        >>> from raptor_core.testing import FakeEmbedder, tiny_tree
        >>> tree = tiny_tree()
        >>> path = tree.save(tempfile.mkdtemp())
        >>> store = FileNodeStore.open(path)
        >>> q = FakeEmbedder(dim=tree.dim).embed_query("cats")
        >>> [m.node.id for m in store.search(q, 2)] == [
        ...     m.node.id for m in InMemoryNodeStore.from_tree(tree).search(q, 2)
        ... ]
        True
    """

    def __init__(
        self,
        *,
        columns: Columns,
        matrix: NDArray[np.float32],
        params: Mapping[str, Any],
        build_info: Mapping[str, Any],
        index: IndexFile | None = None,
        tree_json: Any = None,
        tree: Tree | None = None,
        verify: bool = True,
    ) -> None:
        # Internal: use open().  Either (index, tree_json) read nodes lazily, or tree holds them.
        self.params: Mapping[str, Any] = dict(params)
        self.build_info: Mapping[str, Any] = dict(build_info)
        self.verify = verify
        self._cols = columns
        self._matrix = matrix
        self._index = index
        self._tree_json = tree_json
        self._tree = tree
        self._n = len(columns.ids)
        if index is None:
            self._parent_ptr, self._parent_rows = parent_index(columns)
        else:  # computed while the index was checked
            self._parent_ptr, self._parent_rows = index.parent_ptr, index.parent_rows
        counts = np.diff(columns.child_ptr)
        self._carried = (counts == 1) & meta_flags(columns.metas)[columns.meta]
        self._row: dict[str, int] | None = None
        self._masks: dict[Any, NDArray[np.bool_] | None] = {}
        self._nodes: dict[int, Node] = {}
        self._lock = threading.Lock()
        if index is None:
            self._json_ok = bytearray()
            self._rows_ok = np.ones(1, dtype=np.bool_)
            self._block_rows = max(1, self._n)
        else:
            # A bytearray, not numpy: one node's blocks are checked per call, and slicing
            # a bytearray costs a tenth of a numpy reduction.
            self._json_ok = bytearray(index.json_sha.shape[0])
            self._rows_ok = np.zeros(index.matrix_sha.shape[0], dtype=np.bool_)
            self._block_rows = index.matrix_block_rows

    @classmethod
    def open(cls, path: str | Path, *, verify: bool = True) -> FileNodeStore:
        """Open the tree saved in directory ``path`` for search, reading only its index.

        Args:
            path: the directory given to :meth:`Tree.save`.
            verify: compare each block of ``tree.json`` and of the matrix with its SHA-256
                when it is first used (rows are checked finite and unit-norm either way).

        Raises:
            TreeFormatError: the directory, ``tree.json``, the matrix or the index is
                missing, malformed or damaged.
        """
        from raptor_core.store._format import open_tree_lazily

        return open_tree_lazily(Path(path), verify=verify)

    @classmethod
    def from_tree(cls, tree: Tree) -> FileNodeStore:
        """A store over a tree already in memory (what :meth:`open` falls back to)."""
        return cls(
            columns=columns_from_tree(tree),
            matrix=tree.embeddings,
            params=tree.params,
            build_info=tree.build_info,
            tree=tree,
        )

    def __repr__(self) -> str:
        lazy = "lazy" if self._tree is None else "loaded"
        return f"FileNodeStore(nodes={self._n}, dim={self.dim}, {lazy})"

    # -- shape ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Node]:
        """Every node in row order (parses all of ``tree.json`` on a lazy store)."""
        return (self._node_at(r) for r in range(self._n))

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._rows_by_id()

    @property
    def dim(self) -> int | None:
        """Vector dimension (None for an empty tree)."""
        return int(self._matrix.shape[1]) if self._n else None

    @property
    def top_layer(self) -> int:
        """The highest layer (-1 for an empty tree)."""
        return int(self._cols.layer.max()) if self._n else -1

    # -- writes --------------------------------------------------------------------------------
    def add(self, nodes: Sequence[Node], vectors: NDArray[np.float32]) -> None:
        """Not supported: the store reads a saved tree."""
        self._read_only()

    def delete(self, ids: Sequence[str]) -> None:
        """Not supported: the store reads a saved tree."""
        self._read_only()

    def _read_only(self) -> None:
        msg = (
            "FileNodeStore is read-only; to change the tree, load it (Tree.load), update it "
            "(raptor_core.build.incremental or InMemoryNodeStore) and save it again"
        )
        raise InvalidParameterError(msg)

    # -- reads ---------------------------------------------------------------------------------
    def get(self, ids: Sequence[str]) -> list[Node]:
        """The nodes with these ids, in the order asked; unknown ids are left out."""
        rows = self._rows_by_id()
        return [self._node_at(rows[i]) for i in ids if i in rows]

    def vectors(self, ids: Sequence[str]) -> NDArray[np.float32]:
        """The ``(len(ids), d)`` unit vectors of these ids.

        Raises:
            KeyError: an id is not stored.
        """
        by_id = self._rows_by_id()
        rows = np.fromiter((by_id[i] for i in ids), dtype=np.intp, count=len(ids))
        self._check_rows(rows)
        return np.array(self._matrix[rows], dtype=np.float32)

    def _rows_by_id(self) -> dict[str, int]:
        # Built on first use: collapsed search never needs it.
        if self._row is None:
            self._row = {node_id: i for i, node_id in enumerate(self._cols.ids)}
        return self._row

    def _node_at(self, row: int) -> Node:
        if self._tree is not None:
            return self._tree.nodes[row]
        node = self._nodes.get(row)
        if node is None:
            node = self._parse(row)
            if len(self._nodes) >= _NODE_CACHE:
                with self._lock:
                    self._nodes.clear()
            self._nodes[row] = node
        return node

    def _parse(self, row: int) -> Node:
        from raptor_core.store._format import _explain_node, _node, _parse_json, _valid_node

        index = self._index
        assert index is not None, "lazy stores only"
        start, end = int(index.rec_start[row]), int(index.rec_end[row])
        block = index.json_block_bytes
        first, last = start // block, (end - 1) // block
        if self.verify and not all(self._json_ok[first : last + 1]):
            # Block by block, each checked before the next is read: a long line in a sparse
            # or damaged file fails at its first bad block instead of filling memory.
            parts = []
            for b in range(first, last + 1):
                part = self._read(b * block, (b + 1) * block)
                parts.append(part)
                if hashlib.sha256(part).digest() != index.json_sha[b].tobytes():
                    msg = (
                        f"tree.json block {b} does not match the index's checksum: the "
                        "file was damaged or edited; re-save the tree"
                    )
                    raise TreeFormatError(msg)
                self._json_ok[b] = 1
            line = b"".join(parts)[start - first * block : end - first * block]
        else:
            line = self._read(start, end)
        data = _parse_json(line, _TREE_JSON)
        if not _valid_node(data):
            _explain_node(data, row)
        cols = self._cols
        lo, hi = int(cols.child_ptr[row]), int(cols.child_ptr[row + 1])
        doc = int(cols.doc[row])
        ids = cols.ids
        agrees = (
            data["id"] == ids[row]
            and data["layer"] == int(cols.layer[row])
            and data["token_count"] == int(cols.tokens[row])
            and data["children"] == [ids[c] for c in cols.child_rows[lo:hi].tolist()]
            and data["doc_id"] == (None if doc < 0 else cols.docs[doc])
            and data["metadata"] == cols.metas[int(cols.meta[row])]
        )
        if not agrees:
            msg = f"node {row} of tree.json disagrees with the node index; re-save the tree"
            raise TreeFormatError(msg)
        p_lo, p_hi = int(self._parent_ptr[row]), int(self._parent_ptr[row + 1])
        return _node(data, tuple(ids[p] for p in self._parent_rows[p_lo:p_hi].tolist()))

    def _read(self, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of the open ``tree.json`` (fewer at its end)."""
        fileno = self._tree_json.fileno()
        if hasattr(os, "pread"):
            return os.pread(fileno, end - start, start)
        with self._lock:  # pragma: no cover - platforms without pread
            self._tree_json.seek(start)
            return bytes(self._tree_json.read(end - start))

    def _check_rows(self, rows: NDArray[np.intp] | None) -> None:
        """Check the matrix blocks holding ``rows`` (None: all) on their first use."""
        if self._rows_ok.all():
            return
        blocks = (
            np.flatnonzero(~self._rows_ok) if rows is None else np.unique(rows // self._block_rows)
        )
        index = self._index
        assert index is not None
        for b in blocks.tolist():
            if self._rows_ok[b]:
                continue
            first = b * self._block_rows
            part = self._matrix[first : first + self._block_rows]
            if self.verify:
                digest = hashlib.sha256(np.ascontiguousarray(part).view(np.uint8).data).digest()
                if digest != index.matrix_sha[b].tobytes():
                    msg = (
                        f"rows {first}.. of {index.matrix_file} do not match the index's "
                        "checksum: the file was damaged or replaced; re-save the tree"
                    )
                    raise TreeFormatError(msg)
            check_unit_rows(part, first)
            self._rows_ok[b] = True

    # -- search --------------------------------------------------------------------------------
    def search(
        self, vector: NDArray[np.float32], k: int, *, where: NodeFilter | None = None
    ) -> list[Match]:
        """The ``k`` nodes most similar to ``vector`` that pass ``where``, best first.

        Same semantics as :meth:`InMemoryNodeStore.search` (ties by row order; ``native``
        may be a callable ``(Node) -> bool``, which parses every node once).

        Raises:
            InvalidParameterError: ``k`` is not a positive integer, ``where`` is malformed.
            InvalidInputError: the vector's dimension is not the store's.
            TreeFormatError: a block of the files used is damaged.
        """
        from raptor_core.retrieval.base import top_rows

        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
            msg = f"k must be a positive integer, got {k!r}"
            raise InvalidParameterError(msg)
        if not self._n:
            return []
        q = np.asarray(vector, dtype=np.float32).reshape(-1)
        if q.shape[0] != self.dim:
            msg = f"query vector has dimension {q.shape[0]} but the store holds {self.dim}"
            raise InvalidInputError(msg)
        rows = self._candidate_rows(where if where is not None else NodeFilter())
        if rows is not None and rows.size == 0:
            return []
        matrix = self._matrix
        # The same choice of product as InMemoryNodeStore, so scores are bit-identical.
        if rows is not None and rows.size < _GATHER_SHARE * self._n:
            self._check_rows(rows)
            scores = matvec(matrix[rows], q)
        else:
            self._check_rows(None)
            scores = matvec(matrix, q)
            if rows is not None:
                scores = scores[rows]
        best = top_rows(scores, min(int(k), scores.shape[0]))
        positions = best if rows is None else rows[best]
        return [
            Match(self._node_at(int(r)), float(s))
            for r, s in zip(positions, scores[best], strict=True)
        ]

    def _candidate_rows(self, where: NodeFilter) -> NDArray[np.intp] | None:
        """Rows that may match (None: every row), sorted."""
        explicit: NDArray[np.intp] | None = None
        by_id = self._rows_by_id() if where.ids is not None or where.parents is not None else {}
        if where.ids is not None:
            explicit = np.unique(np.asarray([by_id[i] for i in where.ids if i in by_id], np.intp))
        if where.parents is not None:
            ptr, child = self._cols.child_ptr, self._cols.child_rows
            found = [child[ptr[by_id[p]] : ptr[by_id[p] + 1]] for p in where.parents if p in by_id]
            kids = (
                np.unique(np.concatenate(found)).astype(np.intp) if found else np.zeros(0, np.intp)
            )
            explicit = kids if explicit is None else np.intersect1d(explicit, kids)
        mask = self._mask(where)
        if explicit is not None:
            return explicit[mask[explicit]] if mask is not None else explicit
        if mask is None:
            return None
        return np.flatnonzero(mask).astype(np.intp)

    def _mask(self, where: NodeFilter) -> NDArray[np.bool_] | None:
        key = _filter_key(where)
        if key is not None and key in self._masks:
            return self._masks[key]
        cols = self._cols
        parts: list[NDArray[np.bool_]] = []
        if not where.include_carried and self._carried.any():
            parts.append(~self._carried)
        if where.layers is not None:
            parts.append(np.isin(cols.layer, np.fromiter(where.layers, np.int32)))
        if where.doc_ids is not None:
            wanted = np.fromiter(
                (d in where.doc_ids for d in cols.docs), dtype=np.bool_, count=len(cols.docs)
            )
            parts.append((cols.doc >= 0) & np.append(wanted, False)[cols.doc])
        if where.where is not None:
            parts.append(self._where_mask(where.where))
        if where.native is not None:
            if not callable(where.native):
                msg = (
                    "FileNodeStore takes a callable (Node) -> bool as a native filter; "
                    f"got {type(where.native).__name__} (use where= for metadata filters)"
                )
                raise InvalidParameterError(msg)
            predicate = where.native
            parts.append(np.fromiter((bool(predicate(n)) for n in self), np.bool_, self._n))
        mask = None
        if parts:
            mask = parts[0].copy() if len(parts) == 1 else np.logical_and.reduce(parts)
            if mask.all():
                mask = None
        if key is not None:
            if mask is not None:
                mask.flags.writeable = False
            self._masks[key] = mask
        return mask

    def _where_mask(self, condition: Mapping[str, Any]) -> NDArray[np.bool_]:
        """A metadata filter, evaluated once per distinct (document, metadata) pair."""
        cols = self._cols
        predicate = compile_where(condition)
        pairs = cols.doc.astype(np.int64) * max(1, len(cols.metas)) + cols.meta
        unique, inverse = np.unique(pairs, return_inverse=True)
        passes = np.empty(unique.size, dtype=np.bool_)
        for j, pair in enumerate(unique.tolist()):
            doc, meta = divmod(pair, max(1, len(cols.metas)))
            # A stand-in carrying what the dialect reads: the metadata and the doc_id.
            probe = Node(
                id="",
                text="",
                layer=0,
                token_count=0,
                doc_id=None if doc < 0 else cols.docs[doc],
                metadata=cols.metas[meta],
            )
            passes[j] = bool(predicate(probe))
        return passes[inverse.reshape(-1)]


def open_lazily(
    columns: Columns,
    index: IndexFile,
    tree_json: Any,
    matrix_file: Any,
    matrix_offset: int,
    *,
    params: Mapping[str, Any],
    build_info: Mapping[str, Any],
    verify: bool,
) -> FileNodeStore:
    """A lazy store over open files (see ``_format.open_tree_lazily``)."""
    n, dim = len(columns.ids), index.dim
    if n * dim == 0:
        matrix = np.zeros((n, dim), dtype=np.float32)
    else:
        mapped = mmap_module.mmap(matrix_file.fileno(), 0, access=mmap_module.ACCESS_READ)
        matrix = np.frombuffer(mapped, dtype="<f4", count=n * dim, offset=matrix_offset)
        matrix = matrix.reshape(n, dim)
    return FileNodeStore(
        columns=columns,
        matrix=matrix,
        params=params,
        build_info=build_info,
        index=index,
        tree_json=tree_json,
        verify=verify,
    )


def fall_back(path: Path, reason: str, *, verify: bool) -> FileNodeStore:
    """Read the whole tree (no usable index) and warn about the cost."""
    warnings.warn(
        f"{path}: {reason}, so all of tree.json was read; re-save the tree with this version "
        "(Tree.load(path).save(path)) to open it without reading every node",
        TreeIndexWarning,
        stacklevel=5,  # fall_back, _open_once, open_tree_lazily, FileNodeStore.open, the caller
    )
    return FileNodeStore.from_tree(Tree.load(path, mmap=True, verify=verify))
