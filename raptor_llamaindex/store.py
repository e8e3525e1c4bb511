"""A RAPTOR tree inside a LlamaIndex vector store: :class:`LlamaIndexNodeStore`.

Every node of every layer becomes one LlamaIndex ``TextNode`` in the vector store (and,
for stores that keep no text, such as ``SimpleVectorStore``, in the docstore beside it), so a
pipeline that already runs on Chroma, Qdrant or pgvector through LlamaIndex keeps one
storage system, and every retrieval strategy of :mod:`raptor_core.retrieval` runs on it.

**Node ⇄ TextNode.**  ``id_`` is the node id, ``text`` its text, ``start_char_idx`` /
``end_char_idx`` a chunk's span.  Relationships link the tree the LlamaIndex way:
``SOURCE`` is the node's document (so a chunk's ``ref_doc_id`` is its document id),
``CHILD`` the nodes a summary condenses, ``PARENT`` the first summary that includes the node
(all of them in ``raptor_parents``: a chunk may sit in several clusters).  The metadata holds
the user's scalar metadata plus ``raptor_``-prefixed keys, all hidden from prompts and
embeddings (``excluded_*_metadata_keys``):

=====================  =========================================================================
``raptor_layer``       0 for a chunk, 1+ for summaries (int)
``raptor_token_count`` tokens in the text (int)
``raptor_carried``     1 when the node is a carried copy of its only child, else 0
``raptor_doc_id``      the node's document (absent for summaries over several documents)
``raptor_span_start``  a chunk's character offsets in its document (absent for summaries)
``raptor_span_end``
``raptor_children``    ids of the nodes a summary condenses (a JSON string)
``raptor_parents``     ids of the summaries that include the node (a JSON string)
``raptor_doc_ids``     the documents the node covers (a JSON string)
``raptor_metadata``    the node's full user metadata as JSON (lists, ``None`` and nested values
                       survive here; the top level keeps scalars only)
=====================  =========================================================================

Nothing is stored as a list: chromadb 1.5 leaks list-valued metadata between collections,
and flat-metadata stores refuse lists.  Writes delete the ids first and then add, because
some integrations (Chroma's) ``add`` without replacing and Chroma's own upsert merges
metadata.

**Backends.**  Scores are exact cosines computed from the stored vectors, read back through
a small backend per store (:mod:`raptor_llamaindex._backends`): ``SimpleVectorStore`` (its
embedding dictionary, searched as its own ``query`` does, over a cached matrix),
``ChromaVectorStore`` (its collection, ``include=["embeddings"]``) and any other
``BasePydanticVectorStore`` through the public API only (``add``, ``delete_nodes``,
``get_nodes``, ``query``), where scores are the store's own similarities when it returns no
vectors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from llama_index.core.schema import (
    BaseNode,
    MetadataMode,
    NodeRelationship,
    RelatedNodeInfo,
    TextNode,
)
from llama_index.core.storage.docstore.types import BaseDocumentStore
from llama_index.core.vector_stores.types import (
    BasePydanticVectorStore,
    FilterCondition,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
)
from numpy.typing import NDArray

from raptor_core.exceptions import InvalidInputError, InvalidParameterError
from raptor_core.store.codec import (
    SMALL_LAYER,
    STRUCTURAL_PREFIX,
    UNFILTERED_SHARE,
    caller_layer_sizes,
    is_node_metadata,
    layer_share,
    node_from_metadata,
    node_metadata,
    scalar_value,
    top_layer_of,
    tree_layer_sizes,
    unfiltered_depth,
)
from raptor_core.store.filters import check_where, compile_where
from raptor_core.store.vectors import StoreShape, unit_rows
from raptor_core.tree import Node, Tree, is_carried
from raptor_core.types import Match, NodeFilter
from raptor_llamaindex._backends import BATCH, backend_for, filters_pass
from raptor_llamaindex.ingestion import chunk_position

__all__ = [
    "STORE_METADATA_KEYS",
    "LlamaIndexNodeStore",
    "core_where",
    "node_to_text_node",
    "text_node_to_node",
]

#: Metadata keys LlamaIndex writes itself next to a node's metadata (node_to_metadata_dict).
_RESERVED = frozenset({"doc_id", "document_id", "ref_doc_id", "_node_content", "_node_type"})
#: The structural keys every stored node carries (see the module docstring).
STORE_METADATA_KEYS = (
    "raptor_layer",
    "raptor_token_count",
    "raptor_carried",
    "raptor_doc_id",
    "raptor_span_start",
    "raptor_span_end",
    "raptor_children",
    "raptor_parents",
    "raptor_doc_ids",
    "raptor_metadata",
)
# Searches whose filter runs partly in Python ask for this many extra nodes first, and
# four times more each time too few pass.
_SLACK = 8


# -- node <-> TextNode -------------------------------------------------------------------------
def node_to_text_node(node: Node, vector: NDArray[np.float32] | None = None) -> TextNode:
    """The LlamaIndex ``TextNode`` of ``node`` (see the module docstring for what it carries).

    Examples:
        >>> leaf = Node(id="a", text="Bees dance.", layer=0, token_count=3, doc_id="d",
        ...             span=(0, 11), doc_ids=("d",), metadata={"source": "bees.md"})
        >>> text_node = node_to_text_node(leaf)
        >>> text_node.ref_doc_id, text_node.metadata["source"], text_node.metadata["raptor_layer"]
        ('d', 'bees.md', 0)
        >>> text_node_to_node(text_node) == leaf
        True
    """
    # An int carried flag: LlamaIndex's MetadataFilter takes no booleans.
    meta = node_metadata(node, carried_as_int=True, reserved=_RESERVED)
    relationships: dict[NodeRelationship, Any] = {}
    if node.doc_id is not None:
        relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id=node.doc_id)
    if node.parents:
        relationships[NodeRelationship.PARENT] = RelatedNodeInfo(node_id=node.parents[0])
    if node.children:
        relationships[NodeRelationship.CHILD] = [RelatedNodeInfo(node_id=c) for c in node.children]
    hidden = [k for k in STORE_METADATA_KEYS if k in meta]
    return TextNode(
        id_=node.id,
        text=node.text,
        metadata=meta,
        relationships=relationships,
        excluded_embed_metadata_keys=hidden,
        excluded_llm_metadata_keys=hidden,
        start_char_idx=node.span[0] if node.span is not None else None,
        end_char_idx=node.span[1] if node.span is not None else None,
        embedding=None if vector is None else [float(x) for x in vector],
    )


def is_raptor_node(node: BaseNode) -> bool:
    """Whether a LlamaIndex node encodes a tree node (not a foreign one)."""
    return is_node_metadata(node.metadata)


def text_node_to_node(text_node: BaseNode) -> Node:
    """The tree node a stored LlamaIndex node encodes (inverse of :func:`node_to_text_node`).

    Raises:
        TreeFormatError: the node is not a RAPTOR node, or its ``raptor_`` keys are damaged.
    """
    return node_from_metadata(
        text_node.node_id,
        text_node.get_content(metadata_mode=MetadataMode.NONE),
        text_node.metadata,
        written_by="RaptorIndex",
    )


# -- filters -----------------------------------------------------------------------------------
_CORE_OPS = {
    FilterOperator.EQ: "$eq",
    FilterOperator.NE: "$ne",
    FilterOperator.GT: "$gt",
    FilterOperator.GTE: "$gte",
    FilterOperator.LT: "$lt",
    FilterOperator.LTE: "$lte",
    FilterOperator.IN: "$in",
    FilterOperator.NIN: "$nin",
    FilterOperator.CONTAINS: "$contains",
    FilterOperator.ANY: "$any",
    FilterOperator.ALL: "$all",
}
#: Operators pushed down into a vector store.  The list operators stay in Python: stores
#: differ on a value that is not a list (SimpleVectorStore's ``contains`` matches a
#: substring of a string and raises on a number), and lists the store cannot keep (Chroma)
#: live in ``raptor_metadata`` only.
_LI_OPS = {v: k for k, v in _CORE_OPS.items() if v not in ("$contains", "$any", "$all")}
#: LlamaIndex's names for a node's document id, all meaning the core's ``doc_id``.
_DOC_KEYS = frozenset({"doc_id", "document_id", "ref_doc_id"})


def core_where(filters: MetadataFilters) -> dict[str, Any]:
    """Translate LlamaIndex ``MetadataFilters`` into the core filter dialect.

    ``doc_id``, ``document_id`` and ``ref_doc_id`` all mean the node's document.  Nested
    ``MetadataFilters`` and the ``and``/``or`` conditions translate, and so do ``contains``,
    ``any`` and ``all`` (to ``$contains``, ``$any``, ``$all``: whole elements of a list
    value, a value that is not a list counting as a list of one).  ``not`` and the
    operators without a core twin raise: ``text_match`` (substring, token or pattern match
    depending on the store) and ``is_empty`` (a summary lacks a key its leaves disagree on,
    which is not emptiness, so it would pass where its leaves do not).

    Raises:
        InvalidParameterError: an operator or condition the core dialect lacks.

    Examples:
        >>> from llama_index.core.vector_stores import MetadataFilter, MetadataFilters
        >>> core_where(MetadataFilters(filters=[
        ...     MetadataFilter(key="ref_doc_id", value="bees"),
        ...     MetadataFilter(key="year", value=2000, operator=">="),
        ... ]))
        {'$and': [{'doc_id': {'$eq': 'bees'}}, {'year': {'$gte': 2000}}]}
    """
    parts: list[dict[str, Any]] = []
    for item in filters.filters:
        if isinstance(item, MetadataFilters):
            parts.append(core_where(item))
            continue
        op = _CORE_OPS.get(FilterOperator(item.operator))
        if op is None:
            msg = (
                f"filter operator {FilterOperator(item.operator).value!r} on {item.key!r} has "
                f"no RAPTOR equivalent: use one of {', '.join(o.value for o in _CORE_OPS)}"
            )
            raise InvalidParameterError(msg)
        key = "doc_id" if item.key in _DOC_KEYS else item.key
        value = list(item.value) if isinstance(item.value, list | tuple) else item.value
        parts.append({key: {op: value}})
    condition = filters.condition or FilterCondition.AND
    if condition not in (FilterCondition.AND, FilterCondition.OR):
        msg = f"filter condition {condition!r} is not supported: use 'and' or 'or'"
        raise InvalidParameterError(msg)
    if not parts:
        msg = "MetadataFilters without filters: pass None for no filter"
        raise InvalidParameterError(msg)
    if len(parts) == 1:
        return parts[0]
    return {"$and" if condition == FilterCondition.AND else "$or": parts}


def _li_condition(field: str, op: str, value: Any) -> MetadataFilter | None:
    """One LlamaIndex filter for a core condition, or None when stores would disagree."""
    if op not in _LI_OPS:
        return None  # checked in Python (see _LI_OPS)
    if op in ("$in", "$nin"):
        kinds = {type(v) for v in value}
        ok = (
            bool(value)
            and len(kinds) == 1
            and all(scalar_value(v) and not isinstance(v, bool) for v in value)
        )
        value = list(value)
    elif op in ("$eq", "$ne"):
        ok = scalar_value(value) and not isinstance(value, bool)  # MetadataFilter takes no bools
    else:
        # Vector stores order numbers; the core also orders strings.
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        return None
    return MetadataFilter(key=field, operator=_LI_OPS[op], value=value)


def _li_filters(
    where: Mapping[str, Any], nested: bool, negations: bool = True
) -> tuple[list[MetadataFilter | MetadataFilters], bool]:
    """A core filter as a list of LlamaIndex filters to AND, and whether it is exact.

    The list passes at least what ``where`` passes; parts without a twin are left out (the
    caller checks them in Python).  ``nested``: the store takes nested ``MetadataFilters``
    (needed for ``$or``).  ``negations``: the store's ``!=``/``nin`` pass a node without
    the key, as the core's ``$ne``/``$nin`` do (Qdrant's require the key: a summary over
    documents that disagree on it would be dropped).
    """
    parts: list[MetadataFilter | MetadataFilters] = []
    exact = True
    for key, condition in where.items():
        if key == "$and":
            for sub in condition:
                sub_parts, sub_exact = _li_filters(sub, nested, negations)
                parts += sub_parts
                exact = exact and sub_exact
            continue
        if key == "$or":
            subs = [_li_filters(sub, nested, negations) for sub in condition]
            if nested and all(p for p, _ in subs):
                branches = [
                    p[0]
                    if len(p) == 1
                    else MetadataFilters(filters=p, condition=FilterCondition.AND)
                    for p, _ in subs
                ]
                parts.append(MetadataFilters(filters=branches, condition=FilterCondition.OR))
                exact = exact and all(e for _, e in subs)
            else:
                exact = False  # an unconstrained branch: the $or passes anything
            continue
        if key.startswith(STRUCTURAL_PREFIX) or key in _RESERVED - {"doc_id"}:
            exact = False  # stored in raptor_metadata only
            continue
        field = "raptor_doc_id" if key == "doc_id" else key
        ops = condition if isinstance(condition, Mapping) else {"$eq": condition}
        for op, value in ops.items():
            clause = (
                None if op in ("$ne", "$nin") and not negations else _li_condition(field, op, value)
            )
            if clause is None:
                exact = False
            else:
                parts.append(clause)
    return parts, exact


# -- the store ---------------------------------------------------------------------------------
class LlamaIndexNodeStore:
    """A :class:`~raptor_core.types.NodeStore` inside a LlamaIndex vector store.

    Every retrieval strategy runs on it unchanged (pass it where a Tree goes);
    :class:`~raptor_llamaindex.RaptorIndex` writes into one made from its
    ``StorageContext``.

    Args:
        vector_store: any LlamaIndex ``BasePydanticVectorStore`` (``SimpleVectorStore``,
            ``ChromaVectorStore``, ...), holding one tree.
        docstore: where node texts go when the vector store keeps none
            (``SimpleVectorStore``); default: a new ``SimpleDocumentStore``.
        params: how the stored tree was built (``Tree.params``), for checking embedders.
        layer_sizes: the stored tree's nodes per layer, as :class:`~raptor_llamaindex.RaptorIndex`
            records them, so that the top layer is known without asking the store (Chroma
            scans the whole collection for any metadata filter).  Used while they add up to
            the store's count and the store counts cheaply (``SimpleVectorStore``, Chroma),
            else the store is asked; a write drops them (the caller records new ones).
        dim: the stored vectors' dimension as recorded (RaptorIndex records it), used when
            the vector store cannot tell it (no ``get_nodes``), so that a caller's embedder
            is checked before the first query.

    Examples:
        >>> from llama_index.core.vector_stores import SimpleVectorStore
        >>> from raptor_core import CollapsedTreeRetriever
        >>> from raptor_core.testing import FakeEmbedder, tiny_tree
        >>> tree = tiny_tree()
        >>> store = LlamaIndexNodeStore(SimpleVectorStore())
        >>> store.add_tree(tree)
        >>> len(store) == len(tree)
        True
        >>> hits = CollapsedTreeRetriever(store, FakeEmbedder(dim=tree.dim), k=2).retrieve("cats")
        >>> len(hits)
        2
    """

    def __init__(
        self,
        vector_store: BasePydanticVectorStore,
        *,
        docstore: BaseDocumentStore | None = None,
        params: Mapping[str, Any] | None = None,
        layer_sizes: Sequence[int] | None = None,
        dim: int | None = None,
    ) -> None:
        self.vector_store = vector_store
        self.backend = backend_for(vector_store, docstore)
        self.docstore = self.backend.docstore
        self.params: dict[str, Any] = dict(params or {})
        #: What :meth:`to_tree` records as the tree's ``build_info``: the cohesion floor the
        #: index struct keeps (set by :class:`~raptor_llamaindex.RaptorIndex`), so that an
        #: update of a reopened index keeps the floor as the in-memory tree did.
        self.build_info: dict[str, Any] = {}
        self._dim: int | None = None
        self.recorded_dim = dim
        #: Changes with every write through this store and every refresh(): what a strategy
        #: read from the store once (the passage strategy's leaves) is read again after it.
        self.revision = 0
        self._top: int | None = None
        self._count: int | None = None
        self.layer_sizes = layer_sizes

    @property
    def layer_sizes(self) -> list[int] | None:
        """The tree's nodes per layer as last recorded (None: unknown, the store is asked)."""
        return None if self._sizes is None else list(self._sizes)

    @layer_sizes.setter
    def layer_sizes(self, sizes: Sequence[int] | None) -> None:
        if sizes is not None:
            sizes = caller_layer_sizes(sizes)
        self._sizes: list[int] | None = sizes
        self._top = None
        self._layer_ids: dict[int, frozenset[str]] = {}

    def __repr__(self) -> str:
        return f"LlamaIndexNodeStore({type(self.vector_store).__name__})"

    # -- shape -----------------------------------------------------------------------------------
    def __len__(self) -> int:
        if not self.backend.listable:
            return sum(self._known_sizes())
        if self.backend.live_count:
            return self._not_emptied(self.backend.count())
        if self._count is None:
            # Cached until our next write (or refresh()): every retrieval asks, and Chroma
            # counts a collection by reading it (8 ms a call at 100k nodes).
            self._count = self._not_emptied(self.backend.count())
        return self._count

    def _not_emptied(self, count: int) -> int:
        """``count``, unless the store holds nothing where nodes were recorded (an error).

        Integrations create a collection on its first write and read a missing one as
        empty, so a reopened index pointed at a misspelled collection would answer every
        query with nothing.  (Recorded sizes are dropped by every write through this
        store, so a tree emptied through it is not mistaken for one.)
        """
        recorded = sum(self._sizes or [])
        if count == 0 and recorded:
            msg = (
                f"the {type(self.vector_store).__name__} holds none of the {recorded} nodes "
                "recorded for this tree: open the collection the tree was written into "
                "(check its name and location)"
            )
            raise InvalidParameterError(msg)
        return count

    def refresh(self) -> None:
        """Forget cached facts (dimension, size, top layer); call it after others wrote."""
        self.revision += 1
        self._dim = self._top = self._count = None
        self._sizes = None
        self._layer_ids = {}

    def _known_sizes(self) -> list[int]:
        """The recorded sizes of a store that cannot count itself (else a clear error)."""
        if self._sizes is None:
            msg = (
                f"{type(self.vector_store).__name__} can neither list nor count its nodes, "
                "and no layer sizes were recorded: open it through RaptorIndex (which records "
                "them), or pass layer_sizes= ([] for a new, empty store) and write to it only "
                "through this store"
            )
            raise InvalidParameterError(msg)
        return list(self._sizes)

    def _replaced(self, ids: Sequence[str]) -> list[Node] | None:
        """The stored nodes a write to ``ids`` replaces, when this store keeps its sizes.

        Only a store that cannot count itself, with recorded sizes, keeps them current
        across writes (None otherwise: the writer records new sizes, as RaptorIndex does).
        """
        if self.backend.listable or self._sizes is None:
            return None
        return self.get(ids)

    def _resize(self, added: Sequence[Node], removed: Sequence[Node] | None) -> None:
        """Keep the recorded sizes current across one write (``removed``: :meth:`_replaced`)."""
        if removed is None:
            self.layer_sizes = None
            return
        sizes = self._known_sizes()
        for node, step in [*((n, -1) for n in removed), *((n, 1) for n in added)]:
            sizes.extend([0] * (node.layer + 1 - len(sizes)))
            sizes[node.layer] = max(0, sizes[node.layer] + step)
        while sizes and sizes[-1] == 0:
            sizes.pop()
        self._sizes = sizes

    @property
    def listable(self) -> bool:
        """Whether the vector store can list its nodes (iteration works).

        Strategies that would read every leaf (``passage``) work on the leaves a search
        finds when it cannot (``scope="found"``).
        """
        return bool(self.backend.listable)

    def __iter__(self) -> Iterator[Node]:
        """Every node; the nodes a node parser cut from one document, in document order.

        Stores list their points in their own order (Qdrant by point id, that is at
        random), and the ``passage`` strategy takes a pre-split leaf's neighbours from this
        order: such leaves are given after the others, in the order recorded when they
        were indexed (:func:`~raptor_llamaindex.ingestion.chunk_position`).
        """
        chunks: dict[str | None, list[tuple[int, Node]]] = {}
        for node in self.backend.scan():
            if not is_raptor_node(node):
                continue
            leaf = text_node_to_node(node)
            pre_split = leaf.layer == 0 and leaf.span is None
            position = chunk_position(leaf.metadata) if pre_split else None
            if position is None:
                yield leaf
            else:
                chunks.setdefault(leaf.doc_id, []).append((position, leaf))
        for members in chunks.values():
            # A stable sort: equal positions keep the store's order.
            for _, leaf in sorted(members, key=lambda member: member[0]):
                yield leaf

    @property
    def dim(self) -> int | None:
        """Vector dimension (None while nothing is stored, or not known).

        Asked of a store that can list its nodes; else the dimension of this store's own
        writes, or the one recorded (``dim=``) while the tree holds nodes.
        """
        if self._dim is None and self.backend.listable:
            self._dim = self.backend.dim()
        if self._dim is None and not self.backend.listable and self._sizes:
            recorded = self.recorded_dim
            if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded > 0:
                return recorded
        return self._dim

    @property
    def top_layer(self) -> int:
        """The highest layer stored (-1 while empty)."""
        if not self.backend.listable:
            return top_layer_of(self._known_sizes())
        if self._top is None:
            sizes = self._sizes
            if sizes is not None and self.backend.cheap_count and sum(sizes) == len(self):
                self._top = top_layer_of(sizes)
            else:
                # No sizes, a store that counts only by listing, or sizes that no longer
                # add up (the index store saved apart from the vector store's writes).
                self._top = self.backend.max_layer()
        return self._top

    def shape(self) -> StoreShape:
        """What checking a caller's embedder reads: the recorded params, dim and size."""
        # The recorded size where there is one (it only tells an empty tree from another):
        # counting a Chroma collection loads it whole, which the first search does anyway.
        size = sum(self._sizes) if self._sizes is not None else len(self)
        return StoreShape(params=self.params, dim=self.dim or 0, size=size)

    # -- writes ----------------------------------------------------------------------------------
    def add(self, nodes: Sequence[Node], vectors: NDArray[np.float32]) -> None:
        """Upsert ``nodes`` with their vectors (stored ids are deleted, then all are added).

        Raises:
            InvalidInputError: one finite, non-zero vector per node is needed, of the
                store's dimension; ids must be unique within one call.
        """
        nodes = list(nodes)
        ids = [n.id for n in nodes]
        if len(set(ids)) != len(ids):
            msg = "add() got the same node id twice in one call"
            raise InvalidInputError(msg)
        arr = unit_rows(vectors, len(nodes), self.dim if len(nodes) else None)
        if not nodes:
            return
        before = self._replaced(ids)
        self.revision += 1
        self.backend.delete(ids)
        self.backend.add([node_to_text_node(n, v) for n, v in zip(nodes, arr, strict=True)])
        self._resize(added=nodes, removed=before)
        self._count = None
        if self._dim is None:
            self._dim = int(arr.shape[1])

    def delete(self, ids: Sequence[str]) -> None:
        """Remove the nodes with these ids; unknown ids are ignored."""
        ids = list(dict.fromkeys(ids))
        before = self._replaced(ids)
        self.revision += 1
        self.backend.delete(ids)
        self._resize(added=[], removed=before)
        self._count = None

    def add_tree(self, tree: Tree, *, batch_size: int = BATCH) -> None:
        """Write every node of ``tree`` and remember its ``params``."""
        nodes = list(tree.nodes)
        for start in range(0, len(nodes), batch_size):
            self.add(nodes[start : start + batch_size], tree.embeddings[start : start + batch_size])
        self.params = dict(tree.params)
        self.layer_sizes = tree_layer_sizes(tree)

    # -- reads -----------------------------------------------------------------------------------
    def _rows(self, ids: Sequence[str]) -> list[tuple[Node, BaseNode, NDArray[np.float32] | None]]:
        rows = self.backend.fetch(list(dict.fromkeys(ids)))
        return [
            (text_node_to_node(r.node), r.node, r.vector) for r in rows if is_raptor_node(r.node)
        ]

    def get(self, ids: Sequence[str]) -> list[Node]:
        """The stored nodes with these ids, in the order asked; unknown ids are left out."""
        by_id = {node.id: node for node, _, _ in self._rows(ids)}
        return [by_id[i] for i in ids if i in by_id]

    def vectors(self, ids: Sequence[str]) -> NDArray[np.float32]:
        """The ``(len(ids), d)`` unit vectors of these ids.

        Raises:
            KeyError: an id is not stored.
            InvalidParameterError: the store returns no vectors.
        """
        ids = list(ids)
        by_id = {node.id: vector for node, _, vector in self._rows(ids)}
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise KeyError(missing[0])
        if not ids:
            return np.zeros((0, self.dim or 0), dtype=np.float32)
        if any(v is None for v in by_id.values()):
            msg = f"{type(self.vector_store).__name__} returns no stored vectors"
            raise InvalidParameterError(msg)
        return unit_rows(np.stack([by_id[i] for i in ids]), len(ids), None)  # type: ignore[misc]

    def to_tree(self) -> Tree:
        """The stored nodes as an in-memory :class:`Tree` (layer by layer), for ``Tree.save``.

        Raises:
            TreeFormatError: the stored nodes do not form a tree.
        """
        # A store that cannot list itself is read only when it holds something (and then
        # fails clearly): an empty one, as a new index starts, is an empty tree.
        empty = not self.listable and len(self) == 0
        nodes = [] if empty else sorted(self, key=lambda n: n.layer)
        if not nodes:
            return Tree(
                nodes=(), embeddings=np.zeros((0, self.dim or 0), dtype=np.float32),
                params=self.params,
            )  # fmt: skip
        matrix = self.vectors([n.id for n in nodes])
        return Tree(
            nodes=tuple(nodes), embeddings=matrix, params=self.params, build_info=self.build_info
        )

    # -- search ----------------------------------------------------------------------------------
    def search(
        self, vector: NDArray[np.float32], k: int, *, where: NodeFilter | None = None
    ) -> list[Match]:
        """The ``k`` stored nodes most similar to ``vector`` passing ``where``, best first.

        ``where.native`` is a LlamaIndex ``MetadataFilters`` over the stored metadata (the
        ``raptor_`` keys above, your scalar keys, LlamaIndex's ``doc_id``/``ref_doc_id``).

        Raises:
            InvalidParameterError: ``k`` is not a positive integer, a filter is malformed.
            InvalidInputError: the vector's dimension is not the store's.
        """
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
            msg = f"k must be a positive integer, got {k!r}"
            raise InvalidParameterError(msg)
        where = where if where is not None else NodeFilter()
        if where.where is not None:
            check_where(where.where)
        if where.native is not None and not isinstance(where.native, MetadataFilters):
            msg = (
                "LlamaIndexNodeStore takes a LlamaIndex MetadataFilters as a native filter, "
                f"got {type(where.native).__name__}"
            )
            raise InvalidParameterError(msg)
        q = np.asarray(vector, dtype=np.float32).reshape(-1)
        dim = self.dim
        if dim is None and len(self) == 0:
            return []
        if dim is not None and q.shape[0] != dim:
            msg = f"query vector has dimension {q.shape[0]} but the store holds {dim}"
            raise InvalidInputError(msg)
        if (where.layers is not None and not where.layers) or (
            where.doc_ids is not None and not where.doc_ids
        ):
            return []
        ids = where.ids
        if where.parents is not None:
            children = frozenset(c for p in self.get(sorted(where.parents)) for c in p.children)
            ids = children if ids is None else ids & children
        if ids is not None and not ids:
            return []
        # Small layers are listed once and scored by id, unless they hold most of the nodes:
        # those are searched without a filter (``_search_store``), cheaper than fetching them.
        share = self._unpushed_share(where) if ids is None else None
        if ids is None and where.layers is not None and share is None:
            ids = self._small_layer_ids(where.layers)
        accepts = self._accepts(where, ids)
        if ids is not None and self.backend.has_vectors:
            # A known set of ids (a traversal step): score them exactly, no ANN search.
            return self._rank(self._score(q, self._rows(sorted(ids)), accepts, {}), int(k))
        return self._search_store(q, int(k), where, ids, accepts, share)

    def _small_layer_ids(self, layers: frozenset[int]) -> frozenset[str] | None:
        """The ids of ``layers`` when each is known to be small, listed once and cached.

        On a backend whose filters scan the collection, a search of a small layer (a
        traversal's first step: the top layer) would pay that scan on every query; listing
        the layer's ids pays it once, and the search then scores those ids exactly.
        """
        lister = getattr(self.backend, "layer_ids", None)
        sizes = self._sizes
        if lister is None or not self.backend.scanning_filters or not sizes:
            return None
        if not self.backend.cheap_count or sum(sizes) != len(self):
            return None
        if any(not 0 <= layer < len(sizes) or sizes[layer] > SMALL_LAYER for layer in layers):
            return None
        ids: set[str] = set()
        for layer in layers:
            if layer not in self._layer_ids:
                self._layer_ids[layer] = lister(layer)
            ids |= self._layer_ids[layer]
        return frozenset(ids)

    @staticmethod
    def _accepts(where: NodeFilter, ids: frozenset[str] | None) -> Callable[[Node, BaseNode], bool]:
        passes = compile_where(where.where) if where.where is not None else None
        native = where.native

        def accepts(node: Node, stored: BaseNode) -> bool:
            if where.layers is not None and node.layer not in where.layers:
                return False
            if not where.include_carried and is_carried(node):
                return False
            if where.doc_ids is not None and node.doc_id not in where.doc_ids:
                return False
            if ids is not None and node.id not in ids:
                return False
            if passes is not None and not passes(node):
                return False
            return native is None or filters_pass(native, _stored_metadata(stored))

        return accepts

    def _unpushed_share(self, where: NodeFilter) -> float | None:
        """The share of the nodes a layer-only filter keeps, when it should stay in Python.

        On a backend whose filters scan the whole collection (Chroma: 2.8 s a query at 1M
        nodes), a filter on layers that hold at least half of the nodes (the leaves: 85% of
        a tree) costs more than an unfiltered search for a few times ``k / share`` results
        checked here.  None: send the filter.
        """
        if not self.backend.scanning_filters or where.layers is None:
            return None
        if where.doc_ids is not None or where.where is not None or where.native is not None:
            return None
        sizes = self._sizes
        if not sizes or not self.backend.cheap_count or sum(sizes) != len(self):
            return None
        share = layer_share(sizes, where.layers)
        return share if share >= UNFILTERED_SHARE else None

    def _filters(
        self, where: NodeFilter, *, layers_in_python: bool = False
    ) -> tuple[MetadataFilters | None, bool]:
        parts: list[MetadataFilter | MetadataFilters] = []
        if where.layers is not None and not layers_in_python:
            parts.append(
                MetadataFilter(
                    key="raptor_layer", operator=FilterOperator.IN, value=sorted(where.layers)
                )
            )
        # Carried copies are rare: where a filter would scan the collection, leave them to
        # the check in Python (accepts) on an over-fetched result.
        carried_in_python = not where.include_carried and self.backend.scanning_filters
        if not where.include_carried and not carried_in_python:
            parts.append(MetadataFilter(key="raptor_carried", value=0))
        if where.doc_ids is not None:
            parts.append(
                MetadataFilter(
                    key="raptor_doc_id", operator=FilterOperator.IN, value=sorted(where.doc_ids)
                )
            )
        exact = True
        if where.where is not None:
            translated, exact = _li_filters(
                where.where, self.backend.nested, self.backend.negations
            )
            parts += translated
        if where.native is not None:
            flat_and = where.native.condition in (None, FilterCondition.AND) and not any(
                isinstance(f, MetadataFilters) for f in where.native.filters
            )
            if flat_and:
                parts += list(where.native.filters)
            elif self.backend.nested:
                parts.append(where.native)
            else:
                exact = False  # checked in Python on an over-fetched result
        exact = exact and not carried_in_python and not layers_in_python
        if not parts:
            return None, exact
        return MetadataFilters(filters=parts, condition=FilterCondition.AND), exact

    @staticmethod
    def _rank(scored: list[tuple[Node, float]], k: int) -> list[Match]:
        # Equal scores (a summary that copies its only child's text) go lower layer first,
        # as in the in-memory store, which keeps the tree's layer-major order.
        scored.sort(key=lambda pair: (-pair[1], pair[0].layer))
        return [Match(node, score) for node, score in scored[:k]]

    @staticmethod
    def _score(
        q: NDArray[np.float32],
        rows: Sequence[tuple[Node, BaseNode, NDArray[np.float32] | None]],
        accepts: Callable[[Node, BaseNode], bool],
        similarities: Mapping[str, float],
    ) -> list[tuple[Node, float]]:
        out = []
        for node, stored, vector in rows:
            if not accepts(node, stored):
                continue
            if vector is not None:
                score = float(vector @ q / (np.linalg.norm(vector) or 1.0))
            else:
                score = float(similarities.get(node.id, math.nan))
            out.append((node, score))
        return out

    def _search_store(
        self,
        q: NDArray[np.float32],
        k: int,
        where: NodeFilter,
        ids: frozenset[str] | None,
        accepts: Callable[[Node, BaseNode], bool],
        share: float | None = None,
    ) -> list[Match]:
        """Search the store; widen the search while the checks in Python drop too many.

        ``share``: the layer filter stays out of the store's query (``_unpushed_share``).
        """
        filters, exact = self._filters(where, layers_in_python=share is not None)
        m = k if exact and ids is None else k + _SLACK
        if share is not None:
            m = unfiltered_depth(k, share, _SLACK)
        if ids is not None:
            m = max(m, len(ids))
        while True:
            found = self.backend.query(q, m, filters, ids)
            rows = self._rows([i for i, _ in found])
            scored = self._score(q, rows, accepts, dict(found))
            if len(scored) >= k or len(found) < m:
                return self._rank(scored, k)
            m *= 4


def _stored_metadata(stored: BaseNode) -> dict[str, Any]:
    """The metadata a vector store filters on: the node's, plus LlamaIndex's document keys."""
    ref = stored.ref_doc_id or "None"
    return {**stored.metadata, "doc_id": ref, "document_id": ref, "ref_doc_id": ref}
