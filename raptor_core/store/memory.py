"""The in-memory :class:`~raptor_core.types.NodeStore`: nodes in a list, vectors in one matrix.

Search is exact: one matrix-vector product over the rows that may match, then a partial
sort.  Filters become boolean row masks; the masks of layer sets and metadata filters are
cached until the store changes, so a repeated query pays only the product.  A
:class:`~raptor_core.tree.Tree` is wrapped without copying its (possibly memory-mapped)
embedding matrix; the first ``add`` after that copies it once.

Deleting a node leaves a tombstone row (masked out of every search) until more than a
quarter of the rows are dead; then the rows are compacted.  Insertion order is kept, so
iteration and tie-breaking are deterministic.

Threads may share a store: every write holds the store's lock, and every read takes what
it needs (matrix, node list, row masks) under the same lock.  A search then scores that
snapshot outside the lock, so searches run side by side and a search concurrent with a
write sees the store before the write or after it, never in between.  So a write replaces
the matrix, the token counts and the node list rather than change them (an append only
extends the node list past the rows a snapshot knows).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import islice
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core._threads import matvec
from raptor_core.backends._vectors import PositionIndex
from raptor_core.exceptions import InvalidInputError, InvalidParameterError
from raptor_core.store.filters import canonical, compile_where
from raptor_core.store.vectors import unit_rows
from raptor_core.tree import Node, Tree, is_carried
from raptor_core.types import Match, NodeFilter, VectorIndex

__all__ = ["InMemoryNodeStore"]

# Rows scored one by one instead of through the whole matrix when a filter names fewer than
# this share of them: gathering a few rows is cheaper than multiplying all of them.
_GATHER_SHARE = 0.25
_NO_FILTER = NodeFilter()
_NO_ROWS = np.zeros(0, dtype=np.intp)
_NO_ROWS.flags.writeable = False
_NO_TOKENS = np.zeros(0, dtype=np.int64)
_NO_TOKENS.flags.writeable = False

# What one ranking found: rows and scores, best first, and the node list and token counts
# those rows index (the store's at the time, which a later write does not change).
_Found = tuple[NDArray[np.intp], list[float], Sequence["Node | None"], NDArray[np.int64]]
_NOTHING: _Found = (_NO_ROWS, [], [], _NO_TOKENS)


class InMemoryNodeStore:
    """A :class:`~raptor_core.types.NodeStore` held in this process.

    Args:
        index: an optional :class:`~raptor_core.types.VectorIndex` (for example
            :class:`~raptor_core.backends.faiss_index.FaissIndex`) to run searches through;
            None: an exact numpy product, which is as fast as FAISS's exact index for one
            query at a time up to a few hundred thousand nodes.

    Examples:
        >>> from raptor_core.testing import FakeEmbedder, tiny_tree
        >>> tree = tiny_tree()
        >>> store = InMemoryNodeStore.from_tree(tree)
        >>> q = FakeEmbedder(dim=tree.dim).embed_query("cats")
        >>> [m.node.layer for m in store.search(q, 2, where=NodeFilter(layers=frozenset({0})))]
        [0, 0]
    """

    def __init__(self, *, index: VectorIndex | None = None) -> None:
        self.index = index
        # Reentrant: add() deletes the ids it replaces, and a native filter called under
        # the lock may read the store.
        self._lock = threading.RLock()
        #: How the stored tree was built (``Tree.params``, descriptions only), when known.
        self.params: Mapping[str, Any] = {}
        self._nodes: list[Node | None] = []
        self._row: dict[str, int] = {}
        self._blocks: list[NDArray[np.float32]] = []
        self._matrix: NDArray[np.float32] | None = None
        self._layer = np.zeros(0, dtype=np.int32)
        self._tokens = np.zeros(0, dtype=np.int64)
        self._carried = np.zeros(0, dtype=np.bool_)
        self._alive = np.zeros(0, dtype=np.bool_)
        self._dead = 0
        #: Changes with every write: what a strategy read from the store once (the passage
        #: strategy's leaves) is read again after it.
        self.revision = 0
        self._masks: dict[Any, NDArray[np.bool_] | None] = {}
        self._id_sets: dict[Any, frozenset[str]] = {}
        # (index, its size, its positions' rows, whether some position has no row): see
        # _index_rows.  One tuple, replaced whole, so concurrent searches may share it.
        self._positions: tuple[PositionIndex, int, NDArray[np.intp], bool] | None = None

    @classmethod
    def from_tree(cls, tree: Tree, *, index: VectorIndex | None = None) -> InMemoryNodeStore:
        """A store over every node of ``tree``; the embedding matrix is shared, not copied.

        Args:
            tree: the tree.
            index: a vector index to search through: empty (the tree's vectors are added to
                it) or already holding the tree's nodes, or some of them, by id
                (``FaissIndex.from_tree(tree, layers=[0])``); nodes it does not hold are never
                found, and an id it returns that the tree does not hold is an error.
        """
        store = cls()
        store.params = dict(tree.params)
        if len(tree):
            store._append(list(tree.nodes), tree.embeddings)
        if index is not None:
            size = getattr(index, "__len__", None)
            if len(tree) and callable(size) and size() == 0:
                index.add([n.id for n in tree.nodes], tree.embeddings)
            store.index = index
        return store

    def __repr__(self) -> str:
        return f"InMemoryNodeStore(nodes={len(self)}, dim={self.dim})"

    def __getstate__(self) -> dict[str, Any]:
        # A lock cannot be pickled or deep-copied (a retriever over a store is, by
        # LangChain's serialisers and copy.deepcopy); the copy gets its own.
        with self._lock:
            state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    # -- shape ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        with self._lock:
            return len(self._row)

    def __iter__(self) -> Iterator[Node]:
        # The node slots as they are now: a later append extends the list past `count`, a
        # delete or a compaction replaces it.
        with self._lock:
            nodes, count = self._nodes, len(self._nodes)
        return (node for node in islice(nodes, count) if node is not None)

    def __contains__(self, node_id: object) -> bool:
        with self._lock:
            return node_id in self._row

    @property
    def dim(self) -> int | None:
        """Vector dimension (None while empty)."""
        with self._lock:
            if self._matrix is not None:
                return int(self._matrix.shape[1])
            return int(self._blocks[0].shape[1]) if self._blocks else None

    @property
    def top_layer(self) -> int:
        """The highest layer stored (-1 while empty)."""
        with self._lock:
            alive = self._layer[self._alive]
        return int(alive.max()) if alive.size else -1

    # -- writes --------------------------------------------------------------------------------
    def add(self, nodes: Sequence[Node], vectors: NDArray[np.float32]) -> None:
        """Insert ``nodes`` with their vectors; an id already stored is replaced (upsert).

        Raises:
            InvalidInputError: one vector per node is needed, of the store's dimension,
                finite and non-zero; ids must be unique within one call.
        """
        nodes = list(nodes)
        ids = [n.id for n in nodes]
        if len(set(ids)) != len(ids):
            msg = "add() got the same node id twice in one call"
            raise InvalidInputError(msg)
        # One lock for the delete and the append: no search sees the replaced nodes gone
        # and their new versions not yet there.
        with self._lock:
            arr = unit_rows(vectors, len(nodes), self.dim)
            replaced = [i for i in ids if i in self._row]
            if replaced:
                self.delete(replaced)
            self._append(nodes, arr)

    def _append(self, nodes: list[Node], vectors: NDArray[np.float32]) -> None:
        """Append checked unit ``vectors`` (or a tree's own matrix, shared)."""
        with self._lock:
            arr = np.asarray(vectors, dtype=np.float32)
            if not nodes:
                return
            start = len(self._nodes)
            self._nodes.extend(nodes)
            for offset, node in enumerate(nodes):
                self._row[node.id] = start + offset
            self._blocks.append(arr)
            self._matrix = None
            self._layer = np.concatenate(
                [self._layer, np.fromiter((n.layer for n in nodes), np.int32, len(nodes))]
            )
            self._tokens = np.concatenate(
                [self._tokens, np.fromiter((n.token_count for n in nodes), np.int64, len(nodes))]
            )
            self._carried = np.concatenate(
                [self._carried, np.fromiter((is_carried(n) for n in nodes), np.bool_, len(nodes))]
            )
            self._alive = np.concatenate([self._alive, np.ones(len(nodes), dtype=np.bool_)])
            if self.index is not None:
                self.index.add([n.id for n in nodes], arr)
            self._changed()

    def delete(self, ids: Sequence[str]) -> None:
        """Remove the nodes with these ids; unknown ids are ignored."""
        with self._lock:
            rows = [self._row.pop(i) for i in ids if i in self._row]
            if not rows:
                return
            # A new list, not the old one changed: a search scoring a snapshot outside the
            # lock still reads its own list, where these rows hold their nodes.
            nodes = list(self._nodes)
            for row in rows:
                nodes[row] = None
            self._nodes = nodes
            self._alive[rows] = False
            self._dead += len(rows)
            if self.index is not None:
                # VectorIndex has no delete: rebuild it from the live rows, with the index's
                # own settings when it can make an empty copy of itself (the bundled ones can).
                empty = getattr(self.index, "empty", None)
                self.index = empty() if callable(empty) else type(self.index)()
                live = np.flatnonzero(self._alive)
                if live.size:
                    self.index.add([self._nodes[r].id for r in live], self._full()[live])  # type: ignore[union-attr]
            if self._dead * 4 > len(self._nodes):
                self._compact()
            self._changed()

    def _compact(self) -> None:
        live = np.flatnonzero(self._alive)
        matrix = self._full()[live]
        nodes = [self._nodes[int(r)] for r in live]
        self._nodes = list(nodes)
        self._row = {n.id: i for i, n in enumerate(nodes) if n is not None}
        self._blocks, self._matrix = [matrix], matrix
        self._layer, self._tokens = self._layer[live], self._tokens[live]
        self._carried = self._carried[live]
        self._alive = np.ones(live.size, dtype=np.bool_)
        self._dead = 0

    def _changed(self) -> None:
        self.revision += 1
        self._masks.clear()
        self._id_sets.clear()
        self._positions = None

    # -- reads ---------------------------------------------------------------------------------
    def _full(self) -> NDArray[np.float32]:
        # With the lock held: it replaces _matrix and _blocks, which a write also does.
        if self._matrix is None:
            if not self._blocks:
                return np.zeros((0, 0), dtype=np.float32)
            self._matrix = (
                self._blocks[0] if len(self._blocks) == 1 else np.concatenate(self._blocks)
            )
            self._blocks = [self._matrix]
        return self._matrix

    def _node_at(self, row: int) -> Node:
        node = self._nodes[row]
        assert node is not None, "rows of live nodes only"
        return node

    def get(self, ids: Sequence[str]) -> list[Node]:
        """The stored nodes with these ids, in the order asked; unknown ids are left out."""
        with self._lock:
            known = self._row
            return [self._node_at(known[i]) for i in ids if i in known]

    def vectors(self, ids: Sequence[str]) -> NDArray[np.float32]:
        """The ``(len(ids), d)`` unit vectors of these ids.

        Raises:
            KeyError: an id is not stored.
        """
        with self._lock:
            rows = np.fromiter((self._row[i] for i in ids), dtype=np.intp, count=len(ids))
            return np.asarray(self._full()[rows], dtype=np.float32)

    def to_tree(
        self,
        *,
        params: Mapping[str, Any] | None = None,
        build_info: Mapping[str, Any] | None = None,
    ) -> Tree:
        """The stored nodes as an immutable :class:`Tree`, layer by layer, insertion order within.

        Raises:
            TreeFormatError: the stored nodes do not form a tree (a child is missing, ...).
        """
        with self._lock:
            live = np.flatnonzero(self._alive)
            order = live[np.argsort(self._layer[live], kind="stable")]
            nodes = tuple(self._node_at(int(r)) for r in order)
            matrix = self._full()
            emb = matrix[order] if order.size else np.zeros((0, matrix.shape[1]), np.float32)
            stored_params = self.params
        # Checking the tree (every row a unit vector, every child present) needs no lock.
        return Tree(
            nodes=nodes,
            embeddings=emb,
            params=stored_params if params is None else params,
            build_info=build_info or {},
        )

    # -- search --------------------------------------------------------------------------------
    def search(
        self, vector: NDArray[np.float32], k: int, *, where: NodeFilter | None = None
    ) -> list[Match]:
        """The ``k`` stored nodes most similar to ``vector`` that pass ``where``, best first.

        Ties are broken by insertion order.  ``where.native`` may be a callable
        ``(Node) -> bool``.

        Raises:
            InvalidParameterError: ``k`` is not a positive integer, ``where`` is malformed.
            InvalidInputError: the vector's dimension is not the store's.
        """
        rows, scores, nodes, _ = self._ranker(vector, where)(k)
        return [Match(nodes[r], s) for r, s in zip(rows.tolist(), scores, strict=True)]

    def search_within_budget(
        self,
        vector: NDArray[np.float32],
        k: int,
        *,
        max_tokens: int | None,
        where: NodeFilter | None = None,
        min_score: float | None = None,
    ) -> list[Match]:
        """What :func:`~raptor_core.retrieval.collapsed.ranked_within_budget` returns.

        The same matches, found the same way, but the nodes skipped for the budget are
        never turned into :class:`Match` objects: their token counts are read from an array.

        Raises:
            InvalidParameterError, InvalidInputError: as :meth:`search`.
        """
        from raptor_core.retrieval.base import fill_ranked

        ranked = self._ranker(vector, where)
        found = _NOTHING

        def fetch(m: int) -> tuple[list[float], NDArray[np.int64]]:
            nonlocal found
            found = ranked(m)
            return found[1], found[3][found[0]]

        taken = fill_ranked(fetch, k=k, max_tokens=max_tokens, min_score=min_score)
        rows, scores, nodes, _ = found
        return [Match(nodes[int(rows[i])], scores[i]) for i in taken]  # type: ignore[arg-type]

    def _ranker(
        self, vector: NDArray[np.float32], where: NodeFilter | None
    ) -> Callable[[int], _Found]:
        """``ranked(k)``: the ``k`` best matches, best first (the work of :meth:`search`).

        The first call reads what an exact search needs (matrix, candidate rows, node list)
        under the lock; every call scores that snapshot outside it, so the prefixes that
        :meth:`search_within_budget` fetches rank the same nodes, whatever is written
        meanwhile.  A search through ``self.index`` runs under the lock: a write changes the
        index in place.
        """
        snapshot: tuple[Any, ...] | None = None

        def ranked(k: int) -> _Found:
            nonlocal snapshot
            if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
                msg = f"k must be a positive integer, got {k!r}"
                raise InvalidParameterError(msg)
            if snapshot is None:
                with self._lock:
                    if not self._row:
                        return _NOTHING
                    q = np.asarray(vector, dtype=np.float32).reshape(-1)
                    if q.shape[0] != self.dim:
                        msg = (
                            f"query vector has dimension {q.shape[0]} but the store holds "
                            f"{self.dim}"
                        )
                        raise InvalidInputError(msg)
                    chosen = where if where is not None else _NO_FILTER
                    rows = self._candidate_rows(chosen)
                    if rows is not None and rows.size == 0:
                        return _NOTHING
                    if self.index is not None:
                        found, scores = self._search_index(q, int(k), chosen, rows)
                        return found, scores, self._nodes, self._tokens
                    snapshot = (q, self._full(), rows, self._nodes, self._tokens)
            q, matrix, rows, nodes, tokens = snapshot
            found, scores = _exact(q, matrix, rows, int(k))
            return found, scores, nodes, tokens

        return ranked

    def _search_index(
        self, q: NDArray[np.float32], k: int, where: NodeFilter, rows: NDArray[np.intp] | None
    ) -> tuple[NDArray[np.intp], list[float]]:
        assert self.index is not None
        restrict = None
        if rows is not None:
            # Only mask-only filters are cached: ids and parents change from query to query.
            key = _filter_key(where) if where.ids is None and where.parents is None else None
            restrict = self._id_sets.get(key) if key is not None else None
            if restrict is None:
                restrict = frozenset(self._nodes[int(r)].id for r in rows)  # type: ignore[union-attr]
                if key is not None:
                    self._id_sets[key] = restrict
        index = self.index
        expected = min(k, len(self._row) if rows is None else int(rows.size))
        if isinstance(index, PositionIndex) and type(index).search is PositionIndex.search:
            # One of raptor's own indexes, whose search is search_rows plus ids: its
            # positions become rows through one cached array instead of a dict per hit.
            positions, scores = index.search_rows(q, k, restrict_to=restrict)
            if rows is not None and positions.size < expected:
                raise _shortfall_error(int(positions.size), expected)
            table, strangers = self._index_rows(index)
            found = table[positions]
            if strangers and found.size and int(found.min()) < 0:
                raise _stranger_error(index.ids()[int(positions[int(np.argmin(found))])])
            return found, scores.tolist()
        pairs = index.search(q, k, restrict_to=restrict)
        if rows is not None and len(pairs) < expected:
            raise _shortfall_error(len(pairs), expected)
        known = self._row
        found_rows = [known.get(i, -1) for i, _ in pairs]
        if -1 in found_rows:
            raise _stranger_error(pairs[found_rows.index(-1)][0])
        return np.asarray(found_rows, dtype=np.intp), [s for _, s in pairs]

    def _index_rows(self, index: PositionIndex) -> tuple[NDArray[np.intp], bool]:
        """The store row of each position of ``index`` (-1: an id not stored), and whether a -1 is there.

        Built once per index and size, dropped when the store's rows change.
        """
        entry = self._positions
        if entry is not None and entry[0] is index and entry[1] == len(index):
            return entry[2], entry[3]
        ids = index.ids()
        known = self._row
        table = np.fromiter((known.get(i, -1) for i in ids), dtype=np.intp, count=len(ids))
        strangers = bool(table.size) and int(table.min()) < 0
        table.flags.writeable = False
        self._positions = (index, len(ids), table, strangers)
        return table, strangers

    def _candidate_rows(self, where: NodeFilter) -> NDArray[np.intp] | None:
        """Rows that may match (None: every row), live rows only, sorted."""
        explicit: NDArray[np.intp] | None = None
        if where.ids is not None:
            explicit = _rows(self._row, where.ids)
        if where.parents is not None:
            children = {c for p in where.parents if p in self._row for c in self._child_ids(p)}
            kids = _rows(self._row, children)
            explicit = kids if explicit is None else np.intersect1d(explicit, kids)
        mask = self._mask(where)
        if explicit is not None:
            return explicit[mask[explicit]] if mask is not None else explicit
        if mask is None:
            return None
        return np.flatnonzero(mask).astype(np.intp)

    def _child_ids(self, parent: str) -> tuple[str, ...]:
        node = self._nodes[self._row[parent]]
        return node.children if node is not None else ()

    def _mask(self, where: NodeFilter) -> NDArray[np.bool_] | None:
        """The boolean row mask of the cacheable parts of ``where`` (None: all rows pass)."""
        key = _filter_key(where)
        if key is not None and key in self._masks:
            return self._masks[key]  # None too: a filter every row passes
        parts: list[NDArray[np.bool_]] = []
        if self._dead:
            parts.append(self._alive)
        if not where.include_carried and self._carried.any():
            parts.append(~self._carried)
        if where.layers is not None:
            parts.append(np.isin(self._layer, np.fromiter(where.layers, np.int32)))
        if where.doc_ids is not None:
            parts.append(self._node_mask(lambda n: n.doc_id in where.doc_ids))
        if where.where is not None:
            parts.append(self._node_mask(compile_where(where.where)))
        if where.native is not None:
            if not callable(where.native):
                msg = (
                    "InMemoryNodeStore takes a callable (Node) -> bool as a native filter; "
                    f"got {type(where.native).__name__} (use where= for metadata filters)"
                )
                raise InvalidParameterError(msg)
            parts.append(self._node_mask(where.native))
        mask = None
        if parts:
            mask = parts[0].copy() if len(parts) == 1 else np.logical_and.reduce(parts)
            if mask.all():
                mask = None
        if mask is not None:
            mask.flags.writeable = False
        if key is not None:
            self._masks[key] = mask
        return mask

    def _node_mask(self, predicate: Any) -> NDArray[np.bool_]:
        return np.fromiter(
            (node is not None and bool(predicate(node)) for node in self._nodes),
            dtype=np.bool_,
            count=len(self._nodes),
        )


def _exact(
    q: NDArray[np.float32], matrix: NDArray[np.float32], rows: NDArray[np.intp] | None, k: int
) -> tuple[NDArray[np.intp], list[float]]:
    """Rows of ``matrix`` (of ``rows``; None: all) and scores of the ``k`` best, best first."""
    from raptor_core.retrieval.base import top_rows

    # matvec, not `@`: no BLAS thread pool on the query path (see raptor_core._threads).
    if rows is None:
        scores = matvec(matrix, q)
    elif rows.size < _GATHER_SHARE * matrix.shape[0]:
        scores = matvec(matrix[rows], q)
    else:
        scores = matvec(matrix, q)[rows]
    best = top_rows(scores, min(k, scores.shape[0]))
    positions = best if rows is None else rows[best]
    # tolist(): Python floats in one call, not one numpy scalar per match.
    return positions, scores[best].tolist()


def _filter_key(where: NodeFilter) -> Any:
    """A hashable key for the mask of ``where``; None when it cannot be cached (callables)."""
    if where.native is not None:
        return None
    return (
        where.layers,
        where.doc_ids,
        where.include_carried,
        None if where.where is None else canonical(where.where),
    )


def _shortfall_error(returned: int, expected: int) -> InvalidParameterError:
    msg = (
        f"the vector index returned {returned} of {expected} nodes for a filtered "
        "search: it must hold the tree's nodes (build it with "
        "NumpyIndex.from_tree(tree) or FaissIndex.from_tree(tree))"
    )
    return InvalidParameterError(msg)


def _stranger_error(node_id: str) -> InvalidParameterError:
    msg = (
        f"the vector index returned id {node_id!r}, which is not in the tree: "
        "build the index from this tree"
    )
    return InvalidParameterError(msg)


def _rows(index: Mapping[str, int], ids: Any) -> NDArray[np.intp]:
    found = [index[i] for i in ids if i in index]
    return np.unique(np.asarray(found, dtype=np.intp))
