"""Where a tree's nodes live: the ``NodeStore`` seam and the stores that ship with the core.

Every retrieval strategy reads nodes through a store, so the same strategy runs on the
in-memory arrays of a :class:`~raptor_core.tree.Tree`, on the plain-file directory format,
or (through the adapters) on a user's own vector database.
"""

from __future__ import annotations

from raptor_core.store.codec import is_node_metadata, node_from_metadata, node_metadata
from raptor_core.store.files import FileNodeStore, TreeIndexWarning
from raptor_core.store.filters import check_where, compile_where
from raptor_core.store.memory import InMemoryNodeStore
from raptor_core.store.vectors import StoreShape, unit_rows
from raptor_core.types import Match, NodeFilter, NodeStore

__all__ = [
    "FileNodeStore",
    "InMemoryNodeStore",
    "Match",
    "NodeFilter",
    "NodeStore",
    "StoreShape",
    "TreeIndexWarning",
    "check_where",
    "compile_where",
    "is_node_metadata",
    "node_from_metadata",
    "node_metadata",
    "unit_rows",
]
