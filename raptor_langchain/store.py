"""A RAPTOR tree inside a LangChain ``VectorStore``: :class:`LangChainNodeStore`.

Every node of every layer becomes one document of the vector store, so a team that already
runs its RAG pipeline on Chroma (or any LangChain store) keeps one storage system, and every
retrieval strategy of :mod:`raptor_core.retrieval` runs on it unchanged.

**Node ⇄ document.**  ``Document.id`` is the node id, ``page_content`` its text, and the
metadata holds the user's own metadata (scalar values, and lists where the store keeps
lists) plus ``raptor_``-prefixed structural keys:

=====================  =========================================================================
``raptor_layer``       0 for a chunk, 1+ for summaries (int)
``raptor_token_count`` tokens in the text (int)
``raptor_carried``     whether the node is a carried copy of its only child (bool)
``raptor_doc_id``      the node's document (absent for summaries over several documents)
``raptor_span_start``  a chunk's character offsets in its document (absent for summaries)
``raptor_span_end``
``raptor_children``    ids of the nodes a summary condenses (a list, or a JSON string where
                       the store keeps no lists, as in Chroma)
``raptor_parents``     ids of the summaries that include the node
``raptor_doc_ids``     the documents the node covers
``raptor_metadata``    the node's full user metadata as JSON (values a store cannot keep,
                       such as ``None`` or nested mappings, survive here)
``raptor_id``          the node id again, for stores that return documents without ids
=====================  =========================================================================

**Manifest.**  One more document, id ``raptor-manifest``, records what the tree's files
would: a format name and version, the vector dimension and the tree's ``params`` (how it
was built: descriptions only; nothing read back is ever instantiated).  It is written after
the nodes and marked complete, so an interrupted build is refused on reopening.  It has no
``raptor_layer``, so no search returns it.  It also keeps the tree's per-layer sizes
(``layer_sizes``), current after every ``add``/``delete``, so that opening a store finds
its top layer without asking the store: Chroma answers any metadata filter by scanning
the whole collection (seconds at a million nodes).  Where the store can count (Chroma, the
in-memory store), the sizes are trusted only while they add up to the store's count, else
the top layer is found by probing the store as before (a store written by an older
version, or written to by others); where it cannot (the generic dialect), they are the
only record.  Sizes that are not a list of at most 1,000 non-negative integers are
damage and raise :class:`~raptor_core.exceptions.TreeFormatError`.  The Chroma dialect
also copies the manifest into the collection's own metadata, which comes with the
collection: opening reads that copy, so it reads no record, and Chroma's loading of the
collection's segments (its whole HNSW index: 2.5 s at a million nodes) waits for the first
search.

**One tree per store** (per Chroma collection): documents without ``raptor_layer`` are
never returned, but they count in ``len``.

**Updates** are one ``delete(ids)`` and one ``add`` (an upsert) of the changed nodes; the
store is never rewritten.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore
from numpy.typing import NDArray

from raptor_core._version import __version__
from raptor_core.build.incremental import checked_floor, floor_build_info, recorded_floor
from raptor_core.exceptions import (
    InvalidInputError,
    InvalidParameterError,
    TreeFormatError,
)
from raptor_core.store._format import MAX_DIM
from raptor_core.store.codec import (
    SMALL_LAYER,
    UNFILTERED_SHARE,
    caller_layer_sizes,
    checked_dim,
    checked_layer_sizes,
    is_node_metadata,
    layer_share,
    node_from_metadata,
    node_metadata,
    top_layer_of,
    tree_layer_sizes,
    unfiltered_depth,
)
from raptor_core.store.filters import check_where, compile_where
from raptor_core.store.vectors import UNIT_LENGTH_TOLERANCE, StoreShape, unit_rows
from raptor_core.tree import Node, Tree
from raptor_core.types import Embedder, Match, NodeFilter
from raptor_langchain.dialects import Pushdown, Row, StoreDialect, dialect_for
from raptor_langchain.models import LangChainEmbedder, RaptorEmbeddings

__all__ = [
    "EMBEDDED_CACHE_SIZE",
    "MANIFEST_ID",
    "STORE_FORMAT",
    "LangChainNodeStore",
    "document_to_node",
    "node_to_document",
]

logger = logging.getLogger(__name__)

#: Id of the document that records how the tree in a store was built.
MANIFEST_ID = "raptor-manifest"
#: Format name and version written into the manifest.
STORE_FORMAT = ("raptor-tree-store", 1)
# Searches whose filter runs partly in Python ask the store for this many extra documents
# first, and four times more each time too few pass.
_SLACK = 8
#: How many texts re-embedded for scoring (stores that return no vectors) are remembered:
#: 10,000 vectors of 384 floats are 15 MB.
EMBEDDED_CACHE_SIZE = 10_000


# -- node <-> document -------------------------------------------------------------------------
def node_to_document(node: Node, *, native_lists: bool = True) -> Document:
    """The vector-store document of ``node`` (see the module docstring for the keys).

    Args:
        node: the node.
        native_lists: the store keeps list-valued metadata (the in-memory store); else id
            lists are JSON strings and user lists live in ``raptor_metadata`` only.

    Examples:
        >>> leaf = Node(id="a", text="Bees dance.", layer=0, token_count=3, doc_id="d",
        ...             span=(0, 11), doc_ids=("d",), metadata={"source": "bees.md"})
        >>> doc = node_to_document(leaf)
        >>> doc.id, doc.metadata["source"], doc.metadata["raptor_layer"]
        ('a', 'bees.md', 0)
        >>> document_to_node(doc) == leaf
        True
    """
    meta = node_metadata(node, native_lists=native_lists)
    meta["raptor_id"] = node.id
    return Document(id=node.id, page_content=node.text, metadata=meta)


def is_node_document(document: Document) -> bool:
    """Whether ``document`` encodes a tree node (not the manifest or a foreign document)."""
    return is_node_metadata(document.metadata)


def document_to_node(document: Document) -> Node:
    """The node a vector-store document encodes (inverse of :func:`node_to_document`).

    Raises:
        TreeFormatError: the document is not a node, or its ``raptor_`` keys are damaged.
    """
    meta = document.metadata or {}
    node_id = document.id or meta.get("raptor_id")
    return node_from_metadata(
        str(node_id), document.page_content, meta, written_by="RaptorRetriever"
    )


# -- the manifest ------------------------------------------------------------------------------
def _parse_manifest(raw: object) -> Any:
    """The manifest string read from a store, parsed; None where it is not JSON.

    Store data is untrusted: besides malformed JSON (ValueError, which also covers an
    integer too long to convert), a string nested thousands of levels deep exhausts the
    parser's recursion; both are the same damage to the caller.
    """
    if not isinstance(raw, str):
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


# -- the store ---------------------------------------------------------------------------------
def _core_embedder(embeddings: Embeddings | Embedder | None) -> Embedder | None:
    if embeddings is None:
        return None
    if isinstance(embeddings, RaptorEmbeddings):
        return embeddings.embedder
    if isinstance(embeddings, Embeddings):
        return LangChainEmbedder(embeddings)
    return embeddings


class LangChainNodeStore:
    """A :class:`~raptor_core.types.NodeStore` inside a LangChain ``VectorStore``.

    Every retrieval strategy runs on it unchanged (pass it where a Tree goes), and
    :class:`~raptor_langchain.RaptorRetriever` uses it for ``from_documents(...,
    vectorstore=...)`` and ``from_vectorstore``.  Scores are exact cosines: recomputed from
    the stored vectors, or (generic stores) from the texts embedded again.

    Args:
        vectorstore: the LangChain store (``InMemoryVectorStore``, ``Chroma``, or any
            other through the generic dialect).
        embeddings: the model the tree was built with; needed by stores without a dialect
            (to score what they return) and for ``vectors()`` there.  Default: the store's
            own ``embeddings``.
        dialect: how to talk to the store (default: :func:`~raptor_langchain.dialects.dialect_for`).

    Examples:
        >>> from langchain_core.vectorstores import InMemoryVectorStore
        >>> from raptor_core import CollapsedTreeRetriever
        >>> from raptor_core.testing import FakeEmbedder, tiny_tree
        >>> from raptor_langchain import RaptorEmbeddings
        >>> tree, embedder = tiny_tree(), FakeEmbedder(dim=64)
        >>> store = LangChainNodeStore(InMemoryVectorStore(RaptorEmbeddings(embedder)))
        >>> store.add_tree(tree)
        >>> len(store) == len(tree)
        True
        >>> hits = CollapsedTreeRetriever(store, embedder, k=2).retrieve("cats purr")
        >>> len(hits)
        2
    """

    def __init__(
        self,
        vectorstore: VectorStore,
        embeddings: Embeddings | Embedder | None = None,
        *,
        dialect: StoreDialect | None = None,
    ) -> None:
        self.vectorstore = vectorstore
        self.embeddings = embeddings if embeddings is not None else vectorstore.embeddings
        self.dialect = dialect if dialect is not None else dialect_for(vectorstore)
        self._manifest: dict[str, Any] | None = None
        self._manifest_read = False
        self._refreshed = False
        self._top: int | None = None
        self._dim: int | None = None
        self._count: int | None = None
        #: Changes with every write through this store and every refresh(): what a strategy
        #: read from the store once (the passage strategy's leaves) is read again after it.
        self.revision = 0
        self._layer_cache: dict[int, frozenset[str] | None] = {}
        # Texts a store without vectors returned, embedded again to score them: the same
        # leaves come back query after query, so each (id, text) is embedded once.
        self._embedded: OrderedDict[tuple[str, str], NDArray[np.float32]] = OrderedDict()
        self._embedded_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"LangChainNodeStore({type(self.vectorstore).__name__}, dialect={self.dialect.name})"

    def __getstate__(self) -> dict[str, Any]:
        # A lock cannot be pickled or deep-copied (a retriever over a store is, by LangChain's
        # serialisers and copy.deepcopy); the texts embedded again are a cache of up to
        # 15 MB that the copy refills on demand.  What the store itself holds travels with
        # it: a store that cannot be pickled (Chroma's client) raises its own error.
        state = dict(self.__dict__)
        del state["_embedded_lock"], state["_embedded"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._embedded = OrderedDict()
        self._embedded_lock = threading.Lock()

    # -- manifest --------------------------------------------------------------------------------
    @property
    def manifest(self) -> dict[str, Any] | None:
        """The manifest record (format, dimension, the tree's params), None when absent.

        Raises:
            TreeFormatError: the manifest is damaged or of a newer format.
        """
        if not self._manifest_read:
            self._manifest = self._read_manifest()
            self._manifest_read = True
        return self._manifest

    def _read_manifest(self) -> dict[str, Any] | None:
        # A copy kept where the store reads it without touching the records (Chroma: the
        # collection's metadata), on opening only: refresh() reads the document itself.
        copy = getattr(self.dialect, "manifest_copy", None)
        raw = copy() if copy is not None and not self._refreshed else None
        if raw is None:
            rows = self.dialect.fetch([MANIFEST_ID], native=None, vectors=False)
            if not rows:
                return None
            raw = (rows[0].document.metadata or {}).get("raptor_manifest")
        manifest = _parse_manifest(raw)
        if not isinstance(manifest, dict) or manifest.get("format") != STORE_FORMAT[0]:
            msg = (
                f"the {MANIFEST_ID!r} document of the vector store is damaged: {raw!r:.120}; "
                "rebuild the tree into an empty store (collection)"
            )
            raise TreeFormatError(msg)
        version = manifest.get("format_version")
        if not isinstance(version, int) or version > STORE_FORMAT[1]:
            msg = (
                f"the tree in this vector store has format version {version!r}; this "
                f"raptor-retriever reads up to {STORE_FORMAT[1]}: upgrade raptor-retriever"
            )
            raise TreeFormatError(msg)
        return manifest

    def _write_manifest(self, manifest: dict[str, Any]) -> None:
        raw = json.dumps(manifest, sort_keys=True, default=str)
        doc = Document(
            id=MANIFEST_ID,
            page_content="RAPTOR tree manifest (raptor-retriever): how the tree was built.",
            metadata={"raptor_manifest": raw},
        )
        dim = checked_dim(manifest.get("dim"))
        if dim is None:  # every caller records a checked dimension; never write a damaged one
            msg = (
                f"cannot record the {MANIFEST_ID!r} document without the vector dimension: "
                "store nodes first"
            )
            raise InvalidParameterError(msg)
        # Any unit vector: no search returns the manifest (it has no raptor_layer).
        anchor = np.zeros((1, dim), dtype=np.float32)
        anchor[0, 0] = 1.0
        self.dialect.upsert([doc], anchor)
        keep = getattr(self.dialect, "keep_manifest_copy", None)
        if keep is not None:
            keep(raw)  # after the document: a copy never claims more than the document
        self._manifest, self._manifest_read = manifest, True
        self._count = None

    def write_manifest(
        self,
        *,
        params: Mapping[str, Any] | None = None,
        dim: int | None = None,
        layer_sizes: Sequence[int] | None = None,
    ) -> None:
        """Record how the tree was built (``Tree.params``), its dimension and layer sizes.

        ``layer_sizes`` (nodes per layer, as ``add_tree`` passes them) lets an open find the
        top layer without asking the store; None keeps the recorded ones.

        Raises:
            InvalidParameterError: the dimension is unknown (nothing stored, none given).
        """
        manifest = dict(self.manifest or {})
        if dim is None:
            # A damaged recorded dimension is not one: the store's vectors tell.
            dim = checked_dim(manifest.get("dim")) or self.dialect.dim()
        if checked_dim(dim) is None:
            msg = (
                f"write_manifest needs the vector dimension, an integer in 1..{MAX_DIM} (got "
                f"{str(dim)[:40]}): store nodes first or pass dim="
            )
            raise InvalidParameterError(msg)
        manifest.update(
            format=STORE_FORMAT[0],
            format_version=STORE_FORMAT[1],
            raptor_version=__version__,
            dim=dim,
        )
        if params is not None:
            manifest["params"] = json.loads(json.dumps(dict(params), default=str))
        manifest.setdefault("params", {})
        manifest["complete"] = True
        if layer_sizes is not None:
            manifest["layer_sizes"] = caller_layer_sizes(layer_sizes)
        elif not self.dialect.can_count:
            manifest.setdefault("layer_sizes", [])
        self._write_manifest(manifest)
        self._top = None

    def shape(self) -> StoreShape:
        """What a load checks a caller's embedder against: the recorded params, dim, size.

        Duck-types the part of a :class:`Tree` that
        :func:`raptor_core.components.check_embedder` reads.
        """
        sizes = self._recorded_sizes()
        # The recorded size where there is one (it only tells an empty tree from another):
        # counting a Chroma collection loads it whole, which the first search does anyway.
        size = sum(sizes) if sizes is not None else len(self)
        return StoreShape(params=self.params, dim=self.dim or 0, size=size)

    @property
    def complete(self) -> bool:
        """Whether the store holds a whole tree (its manifest was written after its nodes)."""
        # Exactly true, as written: a damaged value (NaN, a string) is not a finished build.
        return (self.manifest or {}).get("complete") is True

    @property
    def params(self) -> dict[str, Any]:
        """How the stored tree was built (``Tree.params`` recorded in the manifest)."""
        manifest = self.manifest or {}
        params = manifest.get("params")
        return dict(params) if isinstance(params, dict) else {}

    def refresh(self) -> None:
        """Forget cached facts (manifest, dimension, size, top layer, small layers' ids).

        Call it after others wrote to the store.
        """
        self._manifest, self._manifest_read = None, False
        self._refreshed = True
        self.revision += 1
        self._top = None
        self._count = None
        self._dim = None
        self._layer_cache.clear()

    # -- shape -----------------------------------------------------------------------------------
    def _recorded_sizes(self) -> list[int] | None:
        """The manifest's per-layer sizes (None: not recorded), checked: store data is untrusted.

        Raises:
            TreeFormatError: they are not a list of at most 1,000 non-negative integers.
        """
        raw = (self.manifest or {}).get("layer_sizes")
        if raw is None:
            return None
        sizes = checked_layer_sizes(raw) if isinstance(raw, list) else None
        if sizes is None:
            msg = (
                f"the {MANIFEST_ID!r} document's layer_sizes is damaged ({str(raw)[:80]}): "
                "the store was edited outside raptor-retriever; rebuild the tree into an "
                "empty store (collection)"
            )
            raise TreeFormatError(msg)
        return sizes

    def _layer_sizes(self) -> list[int]:
        return self._recorded_sizes() or []

    def _trusted_sizes(self) -> list[int] | None:
        """The recorded sizes where they describe the store (None: find out from the store).

        A store that cannot count has no other record.  One that can has its count compared:
        an older version's store records none, and a write by others, or an update cut
        short between the nodes and the manifest, leaves a sum that differs.
        """
        sizes = self._recorded_sizes()
        if not self.dialect.can_count:
            return sizes or []
        if sizes is None or sum(sizes) != len(self):
            return None
        return sizes

    def __len__(self) -> int:
        if not self.dialect.can_count:
            return sum(self._layer_sizes())
        if self._count is None:
            # Cached until our next write (or refresh()): every retrieval asks, and Chroma
            # counts a collection by reading it (8 ms a call at 100k nodes).
            self._count = self.dialect.count()
        if self._count is None:
            return sum(self._layer_sizes())
        return max(0, self._count - (1 if self.manifest is not None else 0))

    @property
    def listable(self) -> bool:
        """Whether the store can list its documents (iteration works).

        Strategies that would read every leaf (``passage``) work on the leaves a search
        finds when it cannot (``scope="found"``).
        """
        return bool(self.dialect.can_count)

    def __iter__(self) -> Iterator[Node]:
        for doc in self.dialect.scan():
            if is_node_document(doc):
                yield document_to_node(doc)

    @property
    def dim(self) -> int | None:
        """Vector dimension (None while nothing is stored)."""
        if self._dim is None:
            recorded = checked_dim((self.manifest or {}).get("dim"))
            # Absent or damaged (NaN, a float, a bool, out of range): the store's vectors tell.
            self._dim = recorded if recorded is not None else self.dialect.dim()
        return self._dim

    @property
    def top_layer(self) -> int:
        """The highest layer stored (-1 while empty).

        Read from the manifest's layer sizes when they hold (see the module docstring), so
        opening a large Chroma collection runs no filtered scan; else asked of the store.
        """
        if self._top is None:
            sizes = self._trusted_sizes()
            top = None if sizes is None else top_layer_of(sizes)
            if top is None:
                top = self.dialect.max_layer()
            if top is None:
                top = top_layer_of(self._layer_sizes())
            self._top = top
        return self._top

    # -- writes ----------------------------------------------------------------------------------
    def add(self, nodes: Sequence[Node], vectors: NDArray[np.float32]) -> None:
        """Upsert ``nodes`` with their vectors, in one batched write.

        Raises:
            InvalidInputError: one finite, non-zero vector per node is needed, of the
                store's dimension; ids must be unique within one call.
        """
        nodes = list(nodes)
        ids = [n.id for n in nodes]
        if len(set(ids)) != len(ids):
            msg = "add() got the same node id twice in one call"
            raise InvalidInputError(msg)
        if MANIFEST_ID in ids:
            msg = f"{MANIFEST_ID!r} is reserved for the tree's manifest; rename the node"
            raise InvalidInputError(msg)
        arr = unit_rows(vectors, len(nodes), self.dim)
        if not nodes:
            return
        # (add_tree: a store that counts has no manifest yet, so no sizes to keep up.)
        tracked = self._tracking()
        before = self.get(ids) if tracked else []
        docs = [node_to_document(n, native_lists=self.dialect.native_lists) for n in nodes]
        self.dialect.upsert(docs, arr)
        self.revision += 1
        self._top = self._count = None
        self._layer_cache.clear()
        if self._dim is None:
            self._dim = int(arr.shape[1])
        if tracked:
            self._resize(added=nodes, removed=before, dim=int(arr.shape[1]))

    def delete(self, ids: Sequence[str]) -> None:
        """Remove the nodes with these ids; unknown ids are ignored."""
        ids = [i for i in dict.fromkeys(ids) if i != MANIFEST_ID]
        if not ids:
            return
        tracked = self._tracking()
        before = self.get(ids) if tracked else []
        self.dialect.delete(ids)
        self.revision += 1
        self._top = self._count = None
        self._layer_cache.clear()
        if before:
            self._resize(added=[], removed=before, dim=None)

    def _tracking(self) -> bool:
        """Whether a write must keep the manifest's layer sizes current (checked before it).

        Sizes that no longer describe a store that can count are dropped here, so that
        later writes cannot bring their sum back to the count by chance.
        """
        if not self.dialect.can_count:
            return True
        if self._trusted_sizes() is not None:
            return True
        manifest = self.manifest
        if manifest is not None and "layer_sizes" in manifest:
            dim = self.dim  # the recorded one where it is sound, else the store's
            if dim is not None:
                kept = {k: v for k, v in manifest.items() if k != "layer_sizes"}
                self._write_manifest({**kept, "dim": dim})
        return False

    def _resize(self, *, added: Sequence[Node], removed: Sequence[Node], dim: int | None) -> None:
        """Keep the manifest's per-layer sizes current."""
        sizes = self._layer_sizes()
        for node, step in [(n, -1) for n in removed] + [(n, 1) for n in added]:
            sizes += [0] * (node.layer + 1 - len(sizes))
            sizes[node.layer] = max(0, sizes[node.layer] + step)
        while sizes and sizes[-1] == 0:
            sizes.pop()
        manifest = dict(self.manifest or {})
        manifest.update(layer_sizes=sizes)
        if "format" not in manifest:
            # Nodes written before the tree's manifest (add_tree writes it last).
            manifest.update(
                format=STORE_FORMAT[0],
                format_version=STORE_FORMAT[1],
                raptor_version=__version__,
                params={},
                complete=False,
            )
        # The recorded dimension where it is sound, else the store's (or this write's).
        known = self.dim
        manifest["dim"] = known if known is not None else dim
        self._write_manifest(manifest)

    def add_tree(self, tree: Tree, *, batch_size: int = 1000) -> None:
        """Write every node of ``tree`` and a manifest recording ``tree.params``.

        Raises:
            InvalidParameterError: the store already holds a tree (reopen it with
                ``RaptorRetriever.from_vectorstore``, or use an empty store).
        """
        if self.manifest is not None or len(self) > 0:
            msg = (
                f"the {type(self.vectorstore).__name__} already holds documents: write a tree "
                "into an empty store (collection), or reopen the tree it holds with "
                "RaptorRetriever.from_vectorstore"
            )
            raise InvalidParameterError(msg)
        if len(tree) == 0:
            return
        nodes = list(tree.nodes)
        for start in range(0, len(nodes), batch_size):
            self.add(nodes[start : start + batch_size], tree.embeddings[start : start + batch_size])
        # Last, like tree.json in a tree directory: an interrupted write leaves no complete
        # manifest, and from_vectorstore refuses the store instead of serving half a tree.
        self.write_manifest(params=tree.params, dim=tree.dim, layer_sizes=tree_layer_sizes(tree))

    # -- reads -----------------------------------------------------------------------------------
    def _fetch_nodes(
        self, ids: Sequence[str], *, vectors: bool, native: Any = None
    ) -> list[tuple[Node, NDArray[np.float32] | None]]:
        rows = self.dialect.fetch(list(ids), native=native, vectors=vectors)
        return [
            (document_to_node(r.document), r.vector) for r in rows if is_node_document(r.document)
        ]

    def get(self, ids: Sequence[str]) -> list[Node]:
        """The stored nodes with these ids, in the order asked; unknown ids are left out."""
        wanted = [i for i in dict.fromkeys(ids) if i != MANIFEST_ID]
        if not wanted:
            return []
        by_id = {node.id: node for node, _ in self._fetch_nodes(wanted, vectors=False)}
        return [by_id[i] for i in ids if i in by_id]

    def vectors(self, ids: Sequence[str]) -> NDArray[np.float32]:
        """The ``(len(ids), d)`` unit vectors of these ids.

        Raises:
            KeyError: an id is not stored.
        """
        ids = list(ids)
        found = self._fetch_nodes(list(dict.fromkeys(ids)), vectors=True)
        missing = set(ids) - {node.id for node, _ in found}
        if missing:
            raise KeyError(sorted(missing)[0])
        scored = self._with_vectors(found)
        by_id = {node.id: vector for node, vector in scored}
        if not ids:
            return np.zeros((0, self.dim or 0), dtype=np.float32)
        return np.stack([by_id[i] for i in ids]).astype(np.float32)

    def _with_vectors(
        self, found: Sequence[tuple[Node, NDArray[np.float32] | None]]
    ) -> list[tuple[Node, NDArray[np.float32]]]:
        """Unit vectors for ``found``: the stored ones, else the texts embedded again.

        Texts embedded again are remembered by id and text (the last
        :data:`EMBEDDED_CACHE_SIZE`), so a text that comes back is not embedded twice.
        """
        vectors = [v for _, v in found]
        with self._embedded_lock:
            for i, (node, v) in enumerate(found):
                if v is None and (node.id, node.text) in self._embedded:
                    vectors[i] = self._embedded[node.id, node.text]
                    self._embedded.move_to_end((node.id, node.text))
        missing = [i for i, v in enumerate(vectors) if v is None]
        if missing:
            embedder = _core_embedder(self.embeddings)
            if embedder is None:
                msg = (
                    f"{type(self.vectorstore).__name__} returns no vectors, so its results are "
                    "scored by embedding them again: pass embeddings= (the tree's model)"
                )
                raise InvalidParameterError(msg)
            texts = list(dict.fromkeys(found[i][0].text for i in missing))
            again = np.asarray(embedder.embed_documents(texts), dtype=np.float32)
            by_text = dict(zip(texts, again, strict=True))
            with self._embedded_lock:
                for i in missing:
                    node = found[i][0]
                    vectors[i] = by_text[node.text]
                    self._embedded[node.id, node.text] = by_text[node.text]
                while len(self._embedded) > EMBEDDED_CACHE_SIZE:
                    self._embedded.popitem(last=False)
        out = []
        for (node, _), vector in zip(found, vectors, strict=True):
            v = np.asarray(vector, dtype=np.float32).reshape(-1)
            norm = float(np.linalg.norm(v))
            # A stored unit vector is kept bit for bit: dividing it by its float32 norm moves
            # its last bits, and to_tree() would not give back the tree that was written.
            if norm > 0 and abs(norm - 1.0) > UNIT_LENGTH_TOLERANCE:
                v = v / norm
            out.append((node, v))
        return out

    def to_tree(self) -> Tree:
        """The stored nodes as an in-memory :class:`Tree` (layer by layer), for ``Tree.save``.

        Its ``build_info`` holds the cohesion floor the manifest records (see
        :meth:`record_floor`), so that an update of the stored tree keeps the floor as an
        update of the in-memory one does.

        Raises:
            InvalidParameterError: the store cannot list its documents.
            TreeFormatError: the stored nodes do not form a tree.
        """
        nodes = sorted(self, key=lambda n: n.layer)
        if not nodes:
            return Tree(nodes=(), embeddings=np.zeros((0, self.dim or 0), dtype=np.float32))
        matrix = self.vectors([n.id for n in nodes])
        floor = checked_floor((self.manifest or {}).get("cohesion_floor"))
        return Tree(
            nodes=tuple(nodes),
            embeddings=matrix,
            params=self.params,
            build_info=floor_build_info(floor),
        )

    def record_floor(self, tree: Tree) -> None:
        """Keep the cohesion floor ``tree`` records (after an update) in the manifest.

        The first update of a tree measures each summary layer's drift floor and later
        updates keep it (raptor_core.build.incremental); a store rebuilds its tree from the
        nodes, so the floor travels in the manifest.  Nothing to keep: nothing is written.
        """
        floor = recorded_floor(tree.build_info)
        manifest = self.manifest
        if floor is None or manifest is None or manifest.get("cohesion_floor") == floor:
            return
        self._write_manifest({**manifest, "cohesion_floor": floor})

    # -- search ----------------------------------------------------------------------------------
    def search(
        self, vector: NDArray[np.float32], k: int, *, where: NodeFilter | None = None
    ) -> list[Match]:
        """The ``k`` stored nodes most similar to ``vector`` passing ``where``, best first.

        ``where.native`` is a filter in the store's own dialect (a callable
        ``(Document) -> bool`` for ``InMemoryVectorStore``, a ``where`` dict for Chroma, the
        ``filter=`` of ``similarity_search_by_vector`` elsewhere); it sees the stored
        documents, with the ``raptor_`` keys above.

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
        q = np.asarray(vector, dtype=np.float32).reshape(-1)
        dim = self.dim
        if dim is None:
            return []  # nothing stored
        if q.shape[0] != dim:
            msg = f"query vector has dimension {q.shape[0]} but the store holds {dim}"
            raise InvalidInputError(msg)
        ids = self._restricted_ids(where)
        if ids is not None and not ids:
            return []
        if (where.layers is not None and not where.layers) or (
            where.doc_ids is not None and not where.doc_ids
        ):
            return []
        # Layers holding most of the nodes are searched without a filter and checked here;
        # small ones are listed once and scored by id (fetching every leaf of a tree of
        # 2,000 leaves on each query would cost more than one unfiltered search).
        share = self._unpushed_share(where) if ids is None else None
        if ids is None and where.layers is not None and share is None:
            ids = self._small_layer_ids(where.layers)
        pushdown = self._pushdown(where, ids)
        if ids is not None and (where.native is None or self.dialect.fetch_filters):
            found = self._search_ids(q, int(k), sorted(ids), pushdown, where.native)
        else:
            found = self._search_store(q, int(k), pushdown, where.native, share)
        return found

    def _unpushed_share(self, where: NodeFilter) -> float | None:
        """The share of the nodes a layer-only filter keeps, when it should stay in Python.

        A dialect whose store scans the whole collection for any filter (``where_scans``:
        Chroma) pays that scan on every query; when the layers asked for hold at least half
        of the nodes (the leaves: 85% of a tree), an unfiltered search for a few times
        ``k / share`` results, checked here, finds the same ``k`` without it.  None: push the filter down.
        """
        if not getattr(self.dialect, "where_scans", False) or where.layers is None:
            return None
        if where.doc_ids is not None or where.where is not None or where.native is not None:
            return None
        sizes = self._trusted_sizes()
        if not sizes:
            return None
        share = layer_share(sizes, where.layers)
        return share if share >= UNFILTERED_SHARE else None

    def _small_layer_ids(self, layers: frozenset[int]) -> frozenset[str] | None:
        """The ids of ``layers`` when the dialect lists them and each layer is small."""
        lister = getattr(self.dialect, "layer_ids", None)
        if lister is None:
            return None
        ids: set[str] = set()
        sizes = self._trusted_sizes()
        for layer in layers:
            if sizes is not None and 0 <= layer < len(sizes) and sizes[layer] > SMALL_LAYER:
                return None  # known to be large: listing it would scan the collection
            if layer not in self._layer_cache:
                self._layer_cache[layer] = lister(layer, SMALL_LAYER)
            known = self._layer_cache[layer]
            if known is None:
                return None
            ids |= known
        return frozenset(ids)

    def _restricted_ids(self, where: NodeFilter) -> frozenset[str] | None:
        """The ids a search is limited to (``ids`` and children of ``parents``), if any."""
        ids = where.ids
        if where.parents is not None:
            children = frozenset(c for p in self.get(sorted(where.parents)) for c in p.children)
            ids = children if ids is None else ids & children
        return ids

    @staticmethod
    def _pushdown(where: NodeFilter, ids: frozenset[str] | None) -> Pushdown:
        passes: Callable[[Node], bool] | None = (
            compile_where(where.where) if where.where is not None else None
        )
        layers, doc_ids, carried = where.layers, where.doc_ids, where.include_carried

        def accepts(doc: Document) -> bool:
            # Cheap keys first: most documents are decided without decoding.
            meta = doc.metadata
            if not meta or "raptor_layer" not in meta:
                return False
            if layers is not None and meta["raptor_layer"] not in layers:
                return False
            if not carried and meta.get("raptor_carried") is True:
                return False
            if doc_ids is not None and meta.get("raptor_doc_id") not in doc_ids:
                return False
            if ids is not None and (doc.id or meta.get("raptor_id")) not in ids:
                return False
            return passes is None or passes(document_to_node(doc))

        return Pushdown(
            layers=layers,
            doc_ids=doc_ids,
            include_carried=carried,
            where=where.where,
            accepts=accepts,
        )

    @staticmethod
    def _rank(scored: list[tuple[Node, float]], k: int) -> list[Match]:
        # Equal scores (a summary that copies its only child's text) go lower layer first,
        # as in the in-memory store, which keeps the tree's layer-major order; otherwise
        # the sort is stable and keeps the store's order.  Scores are compared at 1e-6:
        # one vector at two rows of a float32 product can differ in its last bits.
        scored.sort(key=lambda pair: (-round(pair[1], 6), pair[0].layer))
        return [Match(node, score) for node, score in scored[:k]]

    def _score(
        self, q: NDArray[np.float32], rows: Sequence[Row], pushdown: Pushdown
    ) -> list[tuple[Node, float]]:
        kept = [
            (document_to_node(r.document), r.vector) for r in rows if pushdown.accepts(r.document)
        ]
        if not kept:
            return []
        pairs = self._with_vectors(kept)
        # One matrix-vector product, as the in-memory store computes its scores.
        scores = np.stack([v for _, v in pairs]) @ q
        return [(node, float(s)) for (node, _), s in zip(pairs, scores, strict=True)]

    def _search_ids(
        self, q: NDArray[np.float32], k: int, ids: list[str], pushdown: Pushdown, native: Any
    ) -> list[Match]:
        """Score a known set of ids exactly: fetch them with their vectors, no ANN search.

        Only the caller's native filter goes to the store; the rest of ``where`` is checked
        in Python on the fetched rows (``_score``).  The ids bound the rows fetched, and a
        store-side filter on a fetch by ids can cost a scan of the whole collection (Chroma:
        0.8 s at 10,000 nodes against 13 ms for the ids alone; benchmarks/stores.py).
        """
        rows = self.dialect.fetch(ids, native=native, vectors=self.dialect.has_vectors)
        return self._rank(self._score(q, rows, pushdown), k)

    def _search_store(
        self,
        q: NDArray[np.float32],
        k: int,
        pushdown: Pushdown,
        native: Any,
        share: float | None = None,
    ) -> list[Match]:
        """Search the store; widen the search while the checks in Python drop too many.

        ``share``: the layer filter stays out of the store's query (see
        ``_unpushed_share``), and about ``2 k / share`` results are asked for.
        """
        translated = pushdown if share is None else replace(pushdown, layers=None)
        ours, exact = self.dialect.translate(translated)
        native_filter = self.dialect.conjoin(ours, native)
        m = k if exact and share is None else k + _SLACK
        if share is not None:
            m = unfiltered_depth(k, share, _SLACK)
        while True:
            rows = self.dialect.query(q, m, native=native_filter)
            scored = self._score(q, rows, pushdown)
            if len(scored) >= k or len(rows) < m:
                return self._rank(scored, k)
            m *= 4
