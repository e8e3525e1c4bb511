"""How :class:`~raptor_llamaindex.store.LlamaIndexNodeStore` talks to one kind of LlamaIndex vector store.

LlamaIndex's ``BasePydanticVectorStore`` API adds nodes (with their embeddings), deletes
them, gets them by id and searches with ``VectorStoreQuery`` and ``MetadataFilters``.  A
RAPTOR tree needs a little more: read stored vectors back to score exactly, list and count
the nodes.  A *backend* is the small piece that does this for one store:

* :class:`SimpleBackend` for ``SimpleVectorStore`` (vectors in its dictionaries, texts in
  the docstore beside it);
* :class:`ChromaBackend` for ``ChromaVectorStore`` (vectors read back from its collection);
* :class:`FaissBackend` for ``FaissVectorStore`` and ``FaissMapVectorStore`` (vectors in a
  FAISS index that knows no node ids, texts and the id of each vector in the docstore);
* :class:`QdrantBackend` for ``QdrantVectorStore`` (point ids must be UUIDs; listed by
  scrolling the collection in pages);
* :class:`MilvusBackend` for ``MilvusVectorStore`` (listed with a query iterator);
* :class:`GenericBackend` for any other store, through the public API only.

A backend never sees a :class:`~raptor_core.tree.Node`: the store encodes nodes as
LlamaIndex ``TextNode`` objects and decodes what a backend returns.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from llama_index.core.schema import BaseNode, TextNode
from llama_index.core.storage.docstore.simple_docstore import SimpleDocumentStore
from llama_index.core.storage.docstore.types import BaseDocumentStore
from llama_index.core.vector_stores.simple import SimpleVectorStore
from llama_index.core.vector_stores.types import (
    BasePydanticVectorStore,
    FilterCondition,
    MetadataFilters,
    VectorStoreQuery,
)
from llama_index.core.vector_stores.utils import build_metadata_filter_fn, metadata_dict_to_node
from numpy.typing import NDArray

from raptor_core._imports import is_instance_of
from raptor_core.exceptions import InvalidParameterError
from raptor_core.store.codec import uuid_id
from raptor_core.store.vectors import nearest_rows

__all__ = [
    "BATCH",
    "EXACT_QUERY_FROM",
    "FAISS_LABEL_KEY",
    "NODE_ID_KEY",
    "ChromaBackend",
    "FaissBackend",
    "GenericBackend",
    "MilvusBackend",
    "QdrantBackend",
    "Row",
    "SimpleBackend",
    "backend_for",
    "filters_pass",
]

#: Nodes per request when reading or writing in pages.
BATCH = 1000
#: Records per page when reading a whole Chroma collection: a page costs a fixed 0.2-0.4 s
#: at 1M nodes, so pages of 5,000 read it in about a third of the time of pages of 1,000.
READ_PAGE = 5000
#: ``ChromaBackend.query`` answers this many results or more by an exact scan (see there).
EXACT_QUERY_FROM = 10_000


def filters_pass(filters: MetadataFilters, meta: Mapping[str, Any]) -> bool:
    """Evaluate LlamaIndex filters (nested ones too) on one node's stored metadata."""
    results = []
    for item in filters.filters:
        if isinstance(item, MetadataFilters):
            results.append(filters_pass(item, meta))
        else:
            check = build_metadata_filter_fn(lambda _: meta, MetadataFilters(filters=[item]))
            results.append(bool(check("")))
    condition = filters.condition or FilterCondition.AND
    if condition == FilterCondition.AND:
        return all(results)
    if condition == FilterCondition.OR:
        return any(results)
    return not any(results)


#: What integrations say when their collection or table has not been created yet (most
#: create it on the first add): LanceDB's ``TableNotFoundError``, "Collection t not found".
_NOT_CREATED = re.compile(
    r"\b(collection|table|index)\b.*\b(not found|does not exist|doesn't exist|not initiali[sz]ed)",
    re.IGNORECASE | re.DOTALL,
)


def not_created(exc: Exception) -> bool:
    """Whether ``exc`` says the store's collection does not exist yet (an empty store).

    Examples:
        >>> not_created(ValueError("Collection raptor not found"))
        True
        >>> not_created(ConnectionError("host not found"))
        False
    """
    return type(exc).__name__ in {"TableNotFoundError", "CollectionNotFoundError"} or bool(
        _NOT_CREATED.search(str(exc))
    )


@dataclass(frozen=True, slots=True)
class Row:
    node: BaseNode
    vector: NDArray[np.float32] | None


class GenericBackend:
    """The generic backend: the public ``BasePydanticVectorStore`` API only."""

    #: the store takes nested MetadataFilters (not every integration does: only flat
    #: conditions are pushed down to an unknown store, the rest is checked in Python)
    nested = False
    #: the store's ``!=`` and ``nin`` pass a node without the key (as the core's do)
    negations = True
    #: the store returns vectors (else scores are the store's own similarities)
    has_vectors = False
    #: any metadata filter makes the store scan the collection before its vector search
    #: (Chroma: 0.4 s a query at 100k nodes, against 2 ms without): the structural default
    #: "no carried copies" is then checked in Python on a slightly larger result instead
    scanning_filters = False
    #: ``count`` does not list the store (recorded layer sizes are checked against it)
    cheap_count = False
    #: ``count`` is a dictionary's length: asked every time, never cached, so nodes added
    #: through LlamaIndex's own API count at once
    live_count = False

    def __init__(self, vector_store: BasePydanticVectorStore, docstore: BaseDocumentStore | None):
        self.vector_store = vector_store
        self.docstore = docstore

    def add(self, nodes: Sequence[TextNode]) -> None:
        self.vector_store.add(list(nodes))
        if self.docstore is not None:
            plain = [n.model_copy(update={"embedding": None}) for n in nodes]
            self.docstore.add_documents(plain, allow_update=True)

    def delete(self, ids: Sequence[str]) -> None:
        if not ids:
            return
        try:
            self.vector_store.delete_nodes(node_ids=list(ids))
        except Exception as exc:
            if not not_created(exc):
                raise  # (no collection yet: nothing to delete)
        if self.docstore is not None:
            for node_id in ids:
                self.docstore.delete_document(node_id, raise_error=False)

    def fetch(self, ids: Sequence[str]) -> list[Row]:
        if not ids:
            return []
        if self.docstore is not None and not self.vector_store.stores_text:
            found = self.docstore.get_nodes(list(ids), raise_error=False)
            return [Row(n, None) for n in found if n is not None]
        nodes = self.vector_store.get_nodes(node_ids=list(ids))
        return [Row(n, _vector(n.embedding)) for n in nodes]

    def query(
        self, q: NDArray[np.float32], m: int, filters: MetadataFilters | None, ids: Any = None
    ) -> list[tuple[str, float]]:
        try:
            result = self.vector_store.query(
                VectorStoreQuery(
                    query_embedding=[float(x) for x in q],
                    similarity_top_k=m,
                    filters=filters,
                    node_ids=None if ids is None else list(ids),
                )
            )
        except Exception as exc:
            if not not_created(exc):
                raise
            return []  # no collection yet: nothing stored
        found = result.ids or [n.node_id for n in result.nodes or []]
        sims = result.similarities or [math.nan] * len(found)
        return list(zip(found, sims, strict=False))

    @property
    def listable(self) -> bool:
        """Whether :meth:`scan` can work: the integration implements ``get_nodes``."""
        return type(self.vector_store).get_nodes is not BasePydanticVectorStore.get_nodes

    def scan(self) -> Iterator[BaseNode]:
        try:
            nodes = self.vector_store.get_nodes(node_ids=None)
        except NotImplementedError as exc:
            msg = (
                f"{type(self.vector_store).__name__} cannot list its nodes (get_nodes): "
                "reading the whole tree (to_tree, or updating an index reopened over it) "
                "needs a store that can; every search strategy works without it"
            )
            raise InvalidParameterError(msg) from exc
        except Exception as exc:
            # Most integrations create their collection on the first add: until then,
            # listing it fails, and the store is simply empty.
            if not not_created(exc):
                raise
            return
        yield from nodes

    def count(self) -> int:
        return sum(1 for _ in self.scan())

    def max_layer(self) -> int:
        return max((_layer(n.metadata) for n in self.scan()), default=-1)

    def dim(self) -> int | None:
        for node in self.scan():
            vector = _vector(node.embedding)
            if vector is not None:
                return int(vector.shape[0])
        return None


def _vector(value: Any) -> NDArray[np.float32] | None:
    if value is None:
        return None
    arr = np.asarray(value, dtype=np.float32).reshape(-1)
    return arr if arr.size else None


def _layer(meta: Mapping[str, Any] | None) -> int:
    value = (meta or {}).get("raptor_layer")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return -1
    return int(value)


class _MatrixBackend(GenericBackend):
    """A backend that searches exactly over one matrix of the stored vectors, kept between writes.

    Subclasses say what the matrix holds (:meth:`_matrix`: node ids in row order and unit
    rows) and where each node's metadata is (:meth:`_metadata`); filters are evaluated by
    LlamaIndex's own filter function once per filter and kept as boolean masks.
    """

    nested = False  # LlamaIndex's filter function refuses nested MetadataFilters
    has_vectors = True
    cheap_count = True

    def __init__(self, vector_store: BasePydanticVectorStore, docstore: BaseDocumentStore) -> None:
        super().__init__(vector_store, docstore)
        self._writes = 0
        self._cache: tuple[Any, list[str], NDArray[np.float32]] | None = None
        self._masks: dict[str, NDArray[np.bool_]] = {}

    def _matrix(self) -> tuple[list[str], NDArray[np.float32]]:
        raise NotImplementedError

    def _metadata(self) -> Mapping[str, Mapping[str, Any]]:
        raise NotImplementedError

    def _cached(
        self, key: Any, build: Callable[[], tuple[list[str], NDArray[np.float32]]]
    ) -> tuple[list[str], NDArray[np.float32]]:
        """The matrix for ``key``, built (and normalised) again when the key changed."""
        if self._cache is None or self._cache[0] != key:
            order, matrix = build()
            norms = np.linalg.norm(matrix, axis=1, keepdims=True)
            norms[norms == 0] = 1.0
            self._cache = (key, order, matrix / norms)
            self._masks.clear()
        return self._cache[1], self._cache[2]

    def query(
        self, q: NDArray[np.float32], m: int, filters: MetadataFilters | None, ids: Any = None
    ) -> list[tuple[str, float]]:
        from raptor_core.retrieval.base import top_rows

        order, matrix = self._matrix()
        rows: NDArray[np.intp] | None = None
        if filters is not None:
            key = filters.model_dump_json()
            mask = self._masks.get(key)
            if mask is None:
                metas = self._metadata()
                passes = build_metadata_filter_fn(lambda i: metas.get(i, {}), filters)
                mask = np.fromiter((passes(i) for i in order), dtype=np.bool_, count=len(order))
                self._masks[key] = mask
            rows = np.flatnonzero(mask)
        if ids is not None:
            wanted = set(ids)
            allowed = np.fromiter((i in wanted for i in order), dtype=np.bool_, count=len(order))
            rows = np.flatnonzero(allowed) if rows is None else rows[allowed[rows]]
        if not order or (rows is not None and rows.size == 0):
            return []
        if rows is None:
            scores = matrix @ q
        elif rows.size * 4 < len(order):
            scores = matrix[rows] @ q  # gathering a few rows beats multiplying them all
        else:
            scores = (matrix @ q)[rows]
        best = top_rows(scores, min(m, scores.shape[0]))
        positions = best if rows is None else rows[best]
        return [(order[p], float(scores[b])) for p, b in zip(positions, best, strict=True)]


class SimpleBackend(_MatrixBackend):
    """``SimpleVectorStore``: vectors and metadata in its dictionaries, texts in the docstore.

    Searches compute what ``SimpleVectorStore.query`` computes (exact cosine over its
    embedding dictionary, filters through LlamaIndex's own filter function), but over one
    numpy matrix and boolean masks kept between writes: its ``query`` turns every stored
    list into an array on every call, ten times slower at a few thousand nodes.  The cache
    is keyed on the dictionary's identity and size and on our own writes, so nodes added
    through LlamaIndex's API are seen too.
    """

    live_count = True
    vector_store: SimpleVectorStore

    def add(self, nodes: Sequence[TextNode]) -> None:
        super().add(nodes)
        self._writes += 1

    def delete(self, ids: Sequence[str]) -> None:
        super().delete(ids)
        self._writes += 1

    def _matrix(self) -> tuple[list[str], NDArray[np.float32]]:
        data = self.vector_store.data.embedding_dict

        def build() -> tuple[list[str], NDArray[np.float32]]:
            ids = list(data)
            return ids, np.asarray([data[i] for i in ids], dtype=np.float32).reshape(len(ids), -1)

        return self._cached((id(data), len(data), self._writes), build)

    def _metadata(self) -> Mapping[str, Mapping[str, Any]]:
        return self.vector_store.data.metadata_dict or {}

    def fetch(self, ids: Sequence[str]) -> list[Row]:
        assert self.docstore is not None
        vectors = self.vector_store.data.embedding_dict
        present = [i for i in ids if i in vectors]
        found = self.docstore.get_nodes(present, raise_error=False) if present else []
        return [Row(n, _vector(vectors[n.node_id])) for n in found if n is not None]

    @property
    def listable(self) -> bool:
        """The simple store lists its ids itself."""
        return True

    def scan(self) -> Iterator[BaseNode]:
        assert self.docstore is not None
        ids = list(self.vector_store.data.embedding_dict)
        for start in range(0, len(ids), BATCH):
            for node in self.docstore.get_nodes(ids[start : start + BATCH], raise_error=False):
                if node is not None:
                    yield node

    def count(self) -> int:
        return len(self.vector_store.data.embedding_dict)

    def max_layer(self) -> int:
        metas = self.vector_store.data.metadata_dict or {}
        return max((_layer(m) for m in metas.values()), default=-1)

    def dim(self) -> int | None:
        first = next(iter(self.vector_store.data.embedding_dict.values()), None)
        return None if first is None else len(first)


class ChromaBackend(GenericBackend):
    """``ChromaVectorStore``: vectors read back from its collection (``vector_store.client``)."""

    nested = True
    has_vectors = True
    scanning_filters = True
    cheap_count = True

    @property
    def collection(self) -> Any:
        return self.vector_store.client

    def add(self, nodes: Sequence[TextNode]) -> None:
        # In pages: the integration sends everything in batches of its own size, which
        # chromadb refuses above its max batch size (5461 embedded: a 100k-node tree failed).
        for start in range(0, len(nodes), BATCH):
            super().add(nodes[start : start + BATCH])

    def delete(self, ids: Sequence[str]) -> None:
        for start in range(0, len(ids), BATCH):
            self.collection.delete(ids=list(ids[start : start + BATCH]))

    @staticmethod
    def _rows(got: Mapping[str, Any], vectors: bool) -> list[Row]:
        embeddings = got.get("embeddings") if vectors else None
        rows = []
        for i, meta in enumerate(got["metadatas"]):
            try:
                node = metadata_dict_to_node(meta or {}, text=got["documents"][i])
            except ValueError:
                # A record LlamaIndex did not write: not a tree node, so never returned.
                node = TextNode(id_=got["ids"][i], text=got["documents"][i] or "")
            vector = None if embeddings is None else _vector(embeddings[i])
            rows.append(Row(node, vector))
        return rows

    def query(
        self, q: NDArray[np.float32], m: int, filters: MetadataFilters | None, ids: Any = None
    ) -> list[tuple[str, float]]:
        """The store's own search, or an exact scan for ``m >= EXACT_QUERY_FROM``.

        chromadb binds one SQL variable per result it returns, and SQLite allows 32,766: a
        deeper query fails with "too many SQL variables".  A strategy asks that deep only
        when scores are too close to stop earlier (the passage strategy on a vague query),
        and that deep an HNSW search is no cheaper than reading the records, so they are
        read a page at a time, filtered and ranked here by exact cosine.
        """
        if m < EXACT_QUERY_FROM:
            return super().query(q, m, filters, ids)
        include = ["metadatas", "embeddings"]
        pages: Iterator[Mapping[str, Any]]
        if ids is not None:
            wanted = list(ids)
            pages = (
                self.collection.get(ids=wanted[start : start + BATCH], include=include)
                for start in range(0, len(wanted), BATCH)
            )
        else:
            pages = self._pages(include)
        found: list[str] = []
        vectors: list[NDArray[np.float32]] = []
        for got in pages:
            for i, node_id in enumerate(got["ids"]):
                meta = got["metadatas"][i] or {}
                vector = _vector(got["embeddings"][i])
                if vector is None or (filters is not None and not filters_pass(filters, meta)):
                    continue
                found.append(str(node_id))
                vectors.append(vector)
        if not found:
            return []
        return [(found[i], score) for i, score in nearest_rows(q, np.stack(vectors), found, m)]

    def _pages(self, include: list[str]) -> Iterator[Mapping[str, Any]]:
        # Reads in pages of READ_PAGE: each `get` costs a fixed 0.2-0.4 s at 1M nodes.
        offset = 0
        while True:
            got = self.collection.get(limit=READ_PAGE, offset=offset, include=include)
            yield got
            if len(got["ids"]) < READ_PAGE:
                return
            offset += READ_PAGE

    def layer_ids(self, layer: int) -> frozenset[str]:
        """The ids of one layer (one filtered read: the caller caches it)."""
        return frozenset(self.collection.get(where={"raptor_layer": layer}, include=[])["ids"])

    def fetch(self, ids: Sequence[str]) -> list[Row]:
        rows: list[Row] = []
        for start in range(0, len(ids), BATCH):
            got = self.collection.get(
                ids=list(ids[start : start + BATCH]),
                include=["metadatas", "documents", "embeddings"],
            )
            rows += self._rows(got, vectors=True)
        return rows

    @property
    def listable(self) -> bool:
        """Chroma lists its collection in pages."""
        return True

    def scan(self) -> Iterator[BaseNode]:
        for got in self._pages(["metadatas", "documents"]):
            for row in self._rows(got, vectors=False):
                yield row.node

    def count(self) -> int:
        return int(self.collection.count())

    def max_layer(self) -> int:
        # Probe upwards with one-id gets: trees have a handful of layers.
        top = -1
        while self.collection.get(where={"raptor_layer": top + 1}, limit=1, include=[])["ids"]:
            top += 1
        return top

    def dim(self) -> int | None:
        # The dimension chromadb records with the collection: any get, count or query would
        # load the collection's segments first, its whole HNSW index included (2.5 s and
        # 2 GB at 1M nodes), which the first search does anyway.
        model = getattr(self.collection, "get_model", None)
        known = getattr(model(), "dimension", None) if callable(model) else None
        if isinstance(known, int) and not isinstance(known, bool) and known > 0:
            return known
        got = self.collection.get(limit=1, include=["embeddings"])
        embeddings = got.get("embeddings")
        if embeddings is None or len(embeddings) == 0:
            return None
        return len(embeddings[0])


#: The docstore metadata key holding the FAISS label (the vector's id inside the FAISS
#: index) of each node a :class:`FaissBackend` wrote.
FAISS_LABEL_KEY = "raptor_faiss_label"


class FaissBackend(_MatrixBackend):
    """``FaissVectorStore`` / ``FaissMapVectorStore``: a FAISS index beside the docstore.

    The FAISS index holds vectors under integer labels and nothing else: the plain store
    answers a search with labels, not node ids, and neither integration filters, lists or
    (the plain one) deletes.  So the docstore, which holds the texts, also records each
    node's label (``FAISS_LABEL_KEY`` in its metadata there), and this backend:

    * lists and counts the tree from the docstore (a reopened index finds its labels there);
    * searches exactly, over the stored vectors read back from FAISS (``reconstruct``) into
      one matrix kept between writes, with filters checked by LlamaIndex's filter function,
      as :class:`SimpleBackend` does;
    * deletes from the docstore only: the vector stays in the FAISS index, unlabelled and
      never returned again.  The plain integration cannot delete at all, and the map one
      reuses labels after a delete (it numbers by the index's size), which would point two
      nodes at one label.  An index updated often grows by the vectors it replaced; build
      it again to compact it.

    The index must be able to return its vectors (``IndexFlatIP``, ``IndexFlatL2``,
    ``IndexHNSWFlat``, an ``IndexIDMap2`` around one of them); others fail with a clear
    error on the first search.
    """

    def __init__(self, vector_store: BasePydanticVectorStore, docstore: BaseDocumentStore) -> None:
        super().__init__(vector_store, docstore)
        # Node id -> the metadata its docstore copy holds, FAISS label included.
        self._stored: dict[str, Mapping[str, Any]] | None = None
        # Row of each node id in the cached matrix, for the matrix's order (by identity).
        self._row_of: tuple[list[str], dict[str, int]] | None = None

    @property
    def index(self) -> Any:
        return self.vector_store.client

    def _known(self) -> dict[str, Mapping[str, Any]]:
        """Every node this backend's docstore records with a FAISS label (read once)."""
        if self._stored is None:
            assert self.docstore is not None
            self._stored = {}
            for node_id, node in self.docstore.docs.items():
                label = (node.metadata or {}).get(FAISS_LABEL_KEY)
                if isinstance(label, int) and not isinstance(label, bool) and label >= 0:
                    self._stored[str(node_id)] = node.metadata
        return self._stored

    def add(self, nodes: Sequence[TextNode]) -> None:
        known = self._known()
        first = int(self.index.ntotal)
        self.vector_store.add(list(nodes))
        if int(self.index.ntotal) != first + len(nodes):
            msg = (
                f"the FAISS index holds {int(self.index.ntotal)} vectors after adding "
                f"{len(nodes)} to {first}: another writer used it meanwhile"
            )
            raise InvalidParameterError(msg)
        # Both integrations label the i-th vector of a call with the index's size plus i.
        plain = [
            n.model_copy(
                update={"metadata": {**n.metadata, FAISS_LABEL_KEY: first + i}, "embedding": None}
            )
            for i, n in enumerate(nodes)
        ]
        assert self.docstore is not None
        self.docstore.add_documents(plain, allow_update=True)
        known.update((node.node_id, node.metadata) for node in plain)
        self._writes += 1

    def delete(self, ids: Sequence[str]) -> None:
        known = self._known()
        assert self.docstore is not None
        for node_id in ids:
            if known.pop(node_id, None) is not None:
                self.docstore.delete_document(node_id, raise_error=False)
        self._writes += 1

    def _matrix(self) -> tuple[list[str], NDArray[np.float32]]:
        known = self._known()

        def build() -> tuple[list[str], NDArray[np.float32]]:
            order = list(known)
            labels = np.fromiter(
                (known[i][FAISS_LABEL_KEY] for i in order), dtype=np.int64, count=len(order)
            )
            return order, self._vectors(labels)

        return self._cached((int(self.index.ntotal), len(known), self._writes), build)

    def _metadata(self) -> Mapping[str, Mapping[str, Any]]:
        return self._known()

    def _vectors(self, labels: NDArray[np.int64]) -> NDArray[np.float32]:
        index = self.index
        if labels.size == 0:
            return np.zeros((0, int(index.d)), dtype=np.float32)
        try:
            if hasattr(index, "id_map"):  # IndexIDMap(2): labels are ids, not positions
                return np.asarray(index.reconstruct_batch(labels), dtype=np.float32)
            return np.asarray(index.reconstruct_n(0, int(index.ntotal)), dtype=np.float32)[labels]
        except RuntimeError as exc:
            msg = (
                f"this FAISS index ({type(index).__name__}) cannot return its stored vectors, "
                "which a RAPTOR tree reads to score exactly: use IndexFlatIP, IndexFlatL2, "
                f"IndexHNSWFlat or IndexIDMap2 around one of them ({exc})"
            )
            raise InvalidParameterError(msg) from exc

    def fetch(self, ids: Sequence[str]) -> list[Row]:
        assert self.docstore is not None
        known = self._known()
        present = [i for i in ids if i in known]
        if not present:
            return []
        order, matrix = self._matrix()
        if self._row_of is None or self._row_of[0] is not order:
            self._row_of = (order, {node_id: r for r, node_id in enumerate(order)})
        row_of = self._row_of[1]
        found = self.docstore.get_nodes(present, raise_error=False)
        return [Row(n, matrix[row_of[n.node_id]]) for n in found if n is not None]

    @property
    def listable(self) -> bool:
        """The docstore lists the nodes."""
        return True

    def scan(self) -> Iterator[BaseNode]:
        assert self.docstore is not None
        ids = list(self._known())
        for start in range(0, len(ids), BATCH):
            for node in self.docstore.get_nodes(ids[start : start + BATCH], raise_error=False):
                if node is not None:
                    yield node

    def count(self) -> int:
        return len(self._known())

    def max_layer(self) -> int:
        return max((_layer(m) for m in self._known().values()), default=-1)

    def dim(self) -> int | None:
        return int(self.index.d) if self._known() else None


#: The metadata key holding a node's own id where the store needs ids of another form
#: (Qdrant: UUIDs), so that the node reads back under the id the tree gave it.
NODE_ID_KEY = "raptor_id"


class QdrantBackend(GenericBackend):
    """``QdrantVectorStore``: a Qdrant collection (server, or ``QdrantClient(":memory:")``/``path=``).

    Qdrant takes point ids that are UUIDs or integers only, and the tree's ids are neither
    (``"L0-1a2b..."``): each node is stored under :func:`~raptor_core.store.codec.uuid_id`
    of its id, with its own id in ``NODE_ID_KEY``, and reads back under its own id.  The
    integration lists at most 9,999 points (``get_nodes`` without ids) and creates its
    collection on the first add, so the collection is scrolled here in pages, and a
    collection that does not exist yet is an empty store.  Stored vectors come back with
    every read (exact scores); filters are pushed down as flat ``and`` conditions.
    """

    has_vectors = True
    cheap_count = True
    negations = False  # MatchExcept: a point without the key never passes
    # The integration is optional: its attributes (collection_name, ...) are not typed here.
    vector_store: Any

    def __init__(self, vector_store: BasePydanticVectorStore, docstore: BaseDocumentStore | None):
        super().__init__(vector_store, docstore)
        self._created = False

    def _exists(self) -> bool:
        # Asked until the collection is seen, then remembered: not a round trip per search.
        if not self._created:
            store = self.vector_store
            self._created = bool(store.client.collection_exists(store.collection_name))
        return self._created

    @staticmethod
    def _restored(node: BaseNode) -> BaseNode:
        own = (node.metadata or {}).get(NODE_ID_KEY)
        return node if not isinstance(own, str) else node.model_copy(update={"id_": own})

    def add(self, nodes: Sequence[TextNode]) -> None:
        stored = [
            n.model_copy(
                update={
                    "id_": uuid_id(n.node_id),
                    "metadata": {**n.metadata, NODE_ID_KEY: n.node_id},
                }
            )
            for n in nodes
        ]
        for start in range(0, len(stored), BATCH):
            self.vector_store.add(stored[start : start + BATCH])

    def delete(self, ids: Sequence[str]) -> None:
        if ids and self._exists():
            for start in range(0, len(ids), BATCH):
                chunk = ids[start : start + BATCH]
                self.vector_store.delete_nodes(node_ids=[uuid_id(i) for i in chunk])

    def fetch(self, ids: Sequence[str]) -> list[Row]:
        if not ids or not self._exists():
            return []
        rows: list[Row] = []
        for start in range(0, len(ids), BATCH):
            chunk = [uuid_id(i) for i in ids[start : start + BATCH]]
            for node in self.vector_store.get_nodes(node_ids=chunk):
                rows.append(Row(self._restored(node), _vector(node.embedding)))
        return rows

    def query(
        self, q: NDArray[np.float32], m: int, filters: MetadataFilters | None, ids: Any = None
    ) -> list[tuple[str, float]]:
        if not self._exists():
            return []
        result = self.vector_store.query(
            VectorStoreQuery(
                query_embedding=[float(x) for x in q],
                similarity_top_k=m,
                filters=filters,
                node_ids=None if ids is None else [uuid_id(i) for i in ids],
            )
        )
        nodes = [self._restored(n) for n in result.nodes or []]
        sims = result.similarities or [math.nan] * len(nodes)
        return [(n.node_id, float(s)) for n, s in zip(nodes, sims, strict=False)]

    @property
    def listable(self) -> bool:
        """The collection is scrolled in pages."""
        return True

    def scan(self) -> Iterator[BaseNode]:
        if not self._exists():
            return
        client, name = self.vector_store.client, self.vector_store.collection_name
        offset = None
        while True:
            points, offset = client.scroll(
                collection_name=name, limit=BATCH, offset=offset, with_payload=True
            )
            for node in self.vector_store.parse_to_query_result(points).nodes or []:
                yield self._restored(node)
            if offset is None:
                return

    def count(self) -> int:
        if not self._exists():
            return 0
        name = self.vector_store.collection_name
        return int(self.vector_store.client.count(collection_name=name, exact=True).count)

    def dim(self) -> int | None:
        first = next(iter(self.scan()), None)
        if first is None:
            return None
        for row in self.fetch([first.node_id]):
            if row.vector is not None:
                return int(row.vector.shape[0])
        return None


class MilvusBackend(GenericBackend):
    """``MilvusVectorStore``: a Milvus collection (a server, or Milvus Lite in a local file).

    The integration lists nothing without a filter (``get_nodes`` needs ids or filters),
    and a Milvus query returns at most 16,384 entities, so the collection is read here with
    pymilvus's query iterator, a page at a time, and counted with ``count(*)``.  Stored
    vectors come back with every read (exact scores); filters are pushed down as flat
    ``and`` conditions.
    """

    has_vectors = True
    cheap_count = True
    negations = False  # a node without the key never passes Milvus's != or not in
    # The integration is optional: its attributes (client, collection_name, ...) are untyped.
    vector_store: Any

    def _node(self, item: Mapping[str, Any]) -> BaseNode:
        store = self.vector_store
        node = metadata_dict_to_node(dict(item), text=item.get(store.text_key))
        node.embedding = item.get(store.embedding_field)
        return node

    def fetch(self, ids: Sequence[str]) -> list[Row]:
        rows: list[Row] = []
        for start in range(0, len(ids), BATCH):
            for node in self.vector_store.get_nodes(node_ids=list(ids[start : start + BATCH])):
                rows.append(Row(node, _vector(node.embedding)))
        return rows

    @property
    def listable(self) -> bool:
        """The collection is read with a query iterator."""
        return True

    def scan(self) -> Iterator[BaseNode]:
        store = self.vector_store
        pages = store.client.query_iterator(
            collection_name=store.collection_name,
            batch_size=BATCH,
            filter="",
            output_fields=["*"],
        )
        try:
            while page := pages.next():
                for item in page:
                    if "_node_content" in item:  # written through LlamaIndex
                        yield self._node(item)
        finally:
            pages.close()

    def count(self) -> int:
        store = self.vector_store
        got = store.client.query(
            collection_name=store.collection_name, filter="", output_fields=["count(*)"]
        )
        return int(got[0]["count(*)"])


def backend_for(
    vector_store: BasePydanticVectorStore, docstore: BaseDocumentStore | None
) -> GenericBackend:
    if isinstance(vector_store, SimpleVectorStore):
        return SimpleBackend(vector_store, docstore or SimpleDocumentStore())
    if vector_store.class_name() == "ChromaVectorStore":
        return ChromaBackend(vector_store, None)
    if is_instance_of(vector_store, "llama_index.vector_stores.faiss", "FaissVectorStore"):
        return FaissBackend(vector_store, docstore or SimpleDocumentStore())  # map store too
    if is_instance_of(vector_store, "llama_index.vector_stores.qdrant", "QdrantVectorStore"):
        return QdrantBackend(vector_store, None)
    if is_instance_of(vector_store, "llama_index.vector_stores.milvus", "MilvusVectorStore"):
        return MilvusBackend(vector_store, None)
    if not vector_store.stores_text and docstore is None:
        docstore = SimpleDocumentStore()
    return GenericBackend(vector_store, docstore if not vector_store.stores_text else None)
