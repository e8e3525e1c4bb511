"""Tree nodes as flat vector-store metadata, and back: one codec for every adapter.

A vector store keeps a text, a vector and a flat mapping of scalar metadata per record.  A
tree node needs more (its layer, children, parents, documents, span and the user's own
metadata), so both framework adapters write the same ``raptor_``-prefixed keys next to the
user's scalar metadata, and read nodes back through :func:`node_from_metadata`:

=====================  =========================================================================
``raptor_layer``       0 for a chunk, 1+ for summaries (int)
``raptor_token_count`` tokens in the text (int)
``raptor_carried``     whether the node is a carried copy of its only child (bool, or 0/1
                       where the store's filters take no booleans)
``raptor_doc_id``      the node's document (absent for summaries over several documents)
``raptor_span_start``  a chunk's character offsets in its document (absent for summaries)
``raptor_span_end``
``raptor_children``    ids of the nodes a summary condenses (a list where the store keeps
                       lists, else a JSON string)
``raptor_parents``     ids of the summaries that include the node
``raptor_doc_ids``     the documents the node covers
``raptor_metadata``    the node's full user metadata as JSON (values a store cannot keep,
                       such as ``None``, lists or nested mappings, survive here)
=====================  =========================================================================

Everything read back is data: a damaged record raises
:class:`~raptor_core.exceptions.TreeFormatError`, never a half-built node.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from raptor_core.exceptions import InvalidParameterError, TreeFormatError
from raptor_core.store._format import MAX_DIM
from raptor_core.tree import Node, Tree, is_carried

__all__ = [
    "MAX_LAYERS",
    "SMALL_LAYER",
    "STRUCTURAL_PREFIX",
    "UNFILTERED_SHARE",
    "caller_layer_sizes",
    "checked_dim",
    "checked_layer_sizes",
    "is_node_metadata",
    "layer_share",
    "node_from_metadata",
    "node_metadata",
    "scalar_value",
    "top_layer_of",
    "tree_layer_sizes",
    "unfiltered_depth",
    "uuid_id",
]

#: Metadata keys with this prefix are the codec's; a user's own keys with it are not copied
#: out of ``raptor_metadata`` (they would be mistaken for structure).
STRUCTURAL_PREFIX = "raptor_"


#: Namespace of :func:`uuid_id` (fixed: a node must land on the same record in every run).
_UUID_NAMESPACE = uuid.UUID("6f1c4d2e-8a3b-5c7d-9e0f-1a2b3c4d5e6f")


def uuid_id(node_id: str) -> str:
    """The record id of a node in a store that takes UUIDs only (Qdrant, Weaviate).

    A name-based UUID (version 5) of the node id: the same node always lands on the same
    record, so an upsert replaces it; the adapters keep the node's own id beside it.

    Examples:
        >>> uuid_id("L0-abc") == uuid_id("L0-abc") != uuid_id("L0-abd")
        True
    """
    return str(uuid.uuid5(_UUID_NAMESPACE, node_id))


#: The most layers a recorded ``layer_sizes`` may list: trees have a handful, and the bound
#: keeps a damaged record from making a store allocate without limit.
MAX_LAYERS = 1000


def checked_layer_sizes(value: object) -> list[int] | None:
    """``value`` as per-layer node counts (bottom up), or None when it is not such a list.

    Adapters record the counts next to the tree (a store manifest, an index struct) so the
    top layer is known without asking the store; what they read back is checked here.  A
    list of at most :data:`MAX_LAYERS` integers >= 0 (numpy integers too, booleans not).

    Examples:
        >>> checked_layer_sizes([120, 14, 2]), checked_layer_sizes([3, -1]), checked_layer_sizes("3")
        ([120, 14, 2], None, None)
    """
    if not isinstance(value, list | tuple) or len(value) > MAX_LAYERS:
        return None
    if not all(
        isinstance(n, int | np.integer) and not isinstance(n, bool) and n >= 0 for n in value
    ):
        return None
    return [int(n) for n in value]


def checked_dim(value: object) -> int | None:
    """``value`` as a vector dimension, or None when it is not an integer in ``1..MAX_DIM``.

    Adapters record the dimension next to the tree (a store manifest, an index struct);
    JSON allows NaN, floats, ``true`` and integers of any size there, and none of them may
    reach a write (``np.zeros((1, dim))``) or a comparison with a query's dimension.

    Examples:
        >>> checked_dim(384), checked_dim(True), checked_dim(float("nan")), checked_dim(10**9)
        (384, None, None, None)
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIM:
        return None
    return value


def caller_layer_sizes(sizes: Sequence[int]) -> list[int]:
    """``layer_sizes`` passed by a caller, checked as :func:`checked_layer_sizes` checks them.

    Raises:
        InvalidParameterError: they are not at most :data:`MAX_LAYERS` counts >= 0.
    """
    checked = checked_layer_sizes(list(sizes))
    if checked is None:
        msg = f"layer_sizes must be at most {MAX_LAYERS} counts >= 0, got {sizes!r:.80}"
        raise InvalidParameterError(msg)
    return checked


# Stores whose every metadata filter scans the whole collection (Chroma: 2.8 s a query at
# 1M nodes) are searched by layer with the recorded sizes as a guide, by both adapters:

#: A layer filter keeping at least this share of the nodes (the leaves: 85% of a tree) is
#: left out of the store's query and checked on an unfiltered, deeper result.
UNFILTERED_SHARE = 0.5
#: A layer of at most this many nodes (a traversal's first step, the top layer) has its ids
#: listed once, cached until the next write, and is scored by id.
SMALL_LAYER = 2000


def layer_share(sizes: Sequence[int], layers: Collection[int]) -> float:
    """The share of the recorded nodes that ``layers`` hold (0 when nothing is recorded).

    Examples:
        >>> layer_share([85, 12, 3], {0}), layer_share([], {0})
        (0.85, 0.0)
    """
    total = sum(sizes)
    if total == 0:
        return 0.0
    return sum(sizes[layer] for layer in layers if 0 <= layer < len(sizes)) / total


def unfiltered_depth(k: int, share: float, slack: int) -> int:
    """How many results to ask of an unfiltered search for ``k`` in layers of that share.

    Twice the share's worth: summaries rank above their share (a summary is near every query
    its children are near), and each widening costs the store another query.
    """
    return math.ceil(2 * k / share) + slack


def tree_layer_sizes(tree: Tree) -> list[int]:
    """Nodes per layer of ``tree``, bottom up (what adapters record as ``layer_sizes``)."""
    return [len(tree.layer(layer)) for layer in range(tree.top_layer + 1)]


def top_layer_of(sizes: Sequence[int]) -> int:
    """The highest layer with nodes in recorded ``layer_sizes`` (-1: none).

    Examples:
        >>> top_layer_of([120, 14, 2, 0]), top_layer_of([])
        (2, -1)
    """
    return max((layer for layer, n in enumerate(sizes) if n > 0), default=-1)


def scalar_value(value: object) -> bool:
    """Whether every vector store keeps ``value`` as metadata: a string, int, bool or finite float.

    Examples:
        >>> scalar_value("a"), scalar_value(3), scalar_value(float("nan")), scalar_value(None)
        (True, True, False, False)
    """
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, str | int | bool)


def _scalar_list(value: object) -> bool:
    """A non-empty list of scalars of one type: what list-keeping stores accept."""
    if not isinstance(value, list | tuple) or not value or not all(scalar_value(v) for v in value):
        return False
    return len({type(v) for v in value}) == 1


def _encode_ids(ids: Sequence[str], native_lists: bool) -> Any:
    # Always written, even empty: a key the store reads is never left to what the store may
    # hold from elsewhere.
    return list(ids) if native_lists else json.dumps(list(ids))


def node_metadata(
    node: Node,
    *,
    native_lists: bool = False,
    carried_as_int: bool = False,
    reserved: Collection[str] = (),
) -> dict[str, Any]:
    """The flat metadata that stores ``node``: the user's scalar keys and the ``raptor_`` ones.

    Args:
        node: the node.
        native_lists: the store keeps list-valued metadata; id lists are then lists, and the
            user's lists of one scalar type are copied too.  Else id lists are JSON strings
            and user lists live in ``raptor_metadata`` only.
        carried_as_int: write ``raptor_carried`` as 0/1 (LlamaIndex's ``MetadataFilter``
            takes no booleans).
        reserved: user keys the framework keeps for itself; they stay in ``raptor_metadata``.

    Examples:
        >>> leaf = Node(id="a", text="Bees dance.", layer=0, token_count=3, doc_id="d",
        ...             span=(0, 11), doc_ids=("d",), metadata={"source": "bees.md"})
        >>> meta = node_metadata(leaf)
        >>> meta["source"], meta["raptor_layer"], meta["raptor_doc_ids"]
        ('bees.md', 0, '["d"]')
        >>> node_from_metadata("a", "Bees dance.", meta) == leaf
        True
    """
    meta: dict[str, Any] = {}
    for key, value in node.metadata.items():
        if key.startswith(STRUCTURAL_PREFIX) or key in reserved:
            continue
        if scalar_value(value) or (native_lists and _scalar_list(value)):
            meta[key] = list(value) if isinstance(value, list | tuple) else value
    meta["raptor_layer"] = node.layer
    meta["raptor_token_count"] = node.token_count
    carried = is_carried(node)
    meta["raptor_carried"] = int(carried) if carried_as_int else carried
    if node.doc_id is not None:
        meta["raptor_doc_id"] = node.doc_id
    if node.span is not None:
        meta["raptor_span_start"], meta["raptor_span_end"] = node.span
    meta["raptor_children"] = _encode_ids(node.children, native_lists)
    meta["raptor_parents"] = _encode_ids(node.parents, native_lists)
    meta["raptor_doc_ids"] = _encode_ids(node.doc_ids, native_lists)
    meta["raptor_metadata"] = json.dumps(dict(node.metadata), sort_keys=True)
    return meta


def is_node_metadata(meta: Mapping[str, Any] | None) -> bool:
    """Whether a record's metadata encodes a tree node (not a manifest or a foreign record)."""
    return bool(meta) and "raptor_layer" in meta and "raptor_metadata" in meta  # type: ignore[operator]


def _int(meta: Mapping[str, Any], key: str) -> int:
    value = meta[key]
    # Some stores hand numbers back as floats; a non-integral one is damage.
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (isinstance(value, float) and not value.is_integer())  # also NaN and infinities
    ):
        msg = f"{key} should be an integer, got {value!r}"
        raise TypeError(msg)
    return int(value)


def _ids(meta: Mapping[str, Any], key: str) -> tuple[str, ...]:
    raw = meta.get(key)
    if raw == "[]":  # every leaf's children: skip the parser (a store is read whole at times)
        return ()
    value = json.loads(raw) if isinstance(raw, str) else raw
    if value is None:
        return ()
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        msg = f"{key} should be a list of ids, got {raw!r:.80}"
        raise TypeError(msg)
    return tuple(value)


def _absent(value: object) -> bool:
    # Some integrations (LlamaIndex's Chroma store) write a missing value as "".
    return value is None or value == ""


def node_from_metadata(
    node_id: str, text: str, meta: Mapping[str, Any] | None, *, written_by: str = "raptor"
) -> Node:
    """The node a record encodes (inverse of :func:`node_metadata`).

    Args:
        node_id: the record's id.
        text: the record's text.
        meta: the record's metadata.
        written_by: who writes such records, for the error message (``"RaptorIndex"``).

    Raises:
        TreeFormatError: the record is not a node, or its ``raptor_`` keys are damaged.
    """
    meta = meta or {}
    try:
        if not is_node_metadata(meta):
            msg = "it has no raptor_layer/raptor_metadata keys"
            raise KeyError(msg)
        metadata = json.loads(meta["raptor_metadata"])
        if not isinstance(metadata, dict):
            msg = f"raptor_metadata should hold a JSON object, got {type(metadata).__name__}"
            raise TypeError(msg)
        doc_id = meta.get("raptor_doc_id")
        start, end = meta.get("raptor_span_start"), meta.get("raptor_span_end")
        return Node(
            id=str(node_id),
            text=text,
            layer=_int(meta, "raptor_layer"),
            token_count=_int(meta, "raptor_token_count"),
            children=_ids(meta, "raptor_children"),
            doc_id=None if _absent(doc_id) else str(doc_id),
            span=None
            if _absent(start) or _absent(end)
            else (_int(meta, "raptor_span_start"), _int(meta, "raptor_span_end")),
            doc_ids=_ids(meta, "raptor_doc_ids"),
            metadata=metadata,
            parents=_ids(meta, "raptor_parents"),
        )
    except (KeyError, TypeError, ValueError, RecursionError) as exc:
        msg = (
            f"record {node_id!r} in the vector store is not a RAPTOR node ({exc}): "
            f"the store must hold only what {written_by} wrote into it"
        )
        raise TreeFormatError(msg) from exc
