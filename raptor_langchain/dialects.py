"""How :class:`~raptor_langchain.store.LangChainNodeStore` talks to one kind of LangChain ``VectorStore``.

LangChain's ``VectorStore`` API can add texts (embedding them itself), search by vector
without scores on most stores, and filter in a dialect of each store's own.  A RAPTOR tree
needs more: write precomputed vectors, read vectors back to score exactly, filter on the
tree's structure.  A *dialect* is the small piece that does this for one store:

* :class:`InMemoryDialect` for ``langchain_core``'s ``InMemoryVectorStore``: vectors go
  into its ``store`` dictionary, searches run through its own cosine search, filters are
  callables ``(Document) -> bool`` (its native filter type).
* :class:`ChromaDialect` for ``langchain_chroma.Chroma``: reads and writes go through its
  Chroma collection (``upsert`` with vectors, ``query`` with ``include=["embeddings"]``),
  filters are Chroma ``where`` dictionaries.  The core's metadata dialect *is* a subset of
  Chroma's, so a core ``where`` filter is translated and runs inside Chroma.  Lists are
  stored as JSON strings (see the class for the chromadb bug this avoids).
* :class:`QdrantDialect` for ``langchain_qdrant.QdrantVectorStore``: reads and writes go
  through its Qdrant client; point ids must be UUIDs, so each document is stored under a
  name-based UUID of its id and reads back under its own id.
* :class:`FAISSDialect` for ``langchain_community``'s ``FAISS``: documents written with its
  ``add_embeddings``, vectors read back from the FAISS index, filters run in Python.
* :class:`GenericDialect` for any other store, through the public ``VectorStore`` API
  only: ``add_texts`` (the store embeds the texts with its own model, which must be the
  tree's), ``similarity_search_by_vector`` (native filters passed as ``filter=``),
  ``get_by_ids`` and ``delete``.  Scores are recomputed by embedding the found texts again,
  structural filters run in Python on an over-fetched result, and the store cannot be
  listed or counted, so the tree's per-layer sizes live in the manifest record.  Correct,
  but slower; write a dialect for a store you use at scale (the ones here are the model).

A dialect never sees a :class:`~raptor_core.tree.Node`: the store encodes nodes as
documents, and hands the dialect a :class:`Pushdown` describing what a search may return.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore, VectorStore
from numpy.typing import NDArray

from raptor_core._imports import is_instance_of
from raptor_core.exceptions import InvalidInputError, InvalidParameterError
from raptor_core.store.codec import uuid_id
from raptor_core.store.vectors import nearest_rows

__all__ = [
    "ChromaDialect",
    "FAISSDialect",
    "GenericDialect",
    "InMemoryDialect",
    "MilvusDialect",
    "Pushdown",
    "QdrantDialect",
    "Row",
    "StoreDialect",
    "dialect_for",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Row:
    """One stored document and, when the store returns it, its stored vector."""

    document: Document
    vector: NDArray[np.float32] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Pushdown:
    """What a search may return, for a dialect to filter on inside its store.

    Attributes:
        layers: only documents of these layers (``raptor_layer``); None: any layer.
        doc_ids: only documents whose ``raptor_doc_id`` is one of these.
        include_carried: also documents with ``raptor_carried`` true.
        where: the user's filter in the core dialect (:mod:`raptor_core.store.filters`).
        accepts: the exact test of all of the above on one stored document (decoded by the
            store); dialects that filter in Python use it as is.
    """

    layers: frozenset[int] | None
    doc_ids: frozenset[str] | None
    include_carried: bool
    where: Mapping[str, Any] | None
    accepts: Callable[[Document], bool]


@runtime_checkable
class StoreDialect(Protocol):
    """The operations :class:`~raptor_langchain.store.LangChainNodeStore` needs from a store.

    Attributes:
        name: shown in errors and ``repr``.
        native_lists: the store keeps list-valued metadata (else lists are JSON strings).
        has_vectors: ``query`` and ``fetch`` return stored vectors (else the store
            re-embeds the texts to score them).
        can_count: ``count``, ``max_layer`` and ``scan`` work (else the manifest's per-layer
            sizes are the only record; where they work, the sizes are checked against
            ``count`` and ``max_layer`` is the fallback).
        fetch_filters: ``fetch`` applies a native filter (else a search with a native
            filter and an id restriction runs as a filtered search, checked in Python).

    Methods:
        upsert: write documents with their ``(n, d)`` unit vectors; a stored id is replaced.
        fetch: the stored documents with these ids that pass ``native`` (any order;
            unknown ids left out).
        query: the ``m`` stored documents nearest to a unit vector that pass ``native``,
            nearest first.
        delete: remove these ids (unknown ids ignored).
        count: how many documents the store holds (None: it cannot say).
        scan: every stored document (raise when the store cannot list them).
        max_layer: the highest ``raptor_layer`` stored (-1: none; None: cannot say).
        dim: the stored vectors' dimension (None: empty or cannot say).
        translate: the store's native filter for a :class:`Pushdown` (None: no filter),
            and whether it is exact (else the store over-fetches and checks in Python).
        conjoin: the native filter passing what both of two native filters pass.
    """

    name: str
    native_lists: bool
    has_vectors: bool
    can_count: bool
    fetch_filters: bool

    def upsert(self, documents: Sequence[Document], vectors: NDArray[np.float32]) -> None:
        """Write documents with their unit vectors (upsert)."""

    def fetch(self, ids: Sequence[str], *, native: Any, vectors: bool) -> list[Row]:
        """The stored documents with these ids that pass ``native``."""

    def query(self, vector: NDArray[np.float32], m: int, *, native: Any) -> list[Row]:
        """The ``m`` documents nearest to ``vector`` that pass ``native``, nearest first."""

    def delete(self, ids: Sequence[str]) -> None:
        """Remove these ids."""

    def count(self) -> int | None:
        """How many documents the store holds."""

    def scan(self) -> Iterator[Document]:
        """Every stored document."""

    def max_layer(self) -> int | None:
        """The highest ``raptor_layer`` stored."""

    def dim(self) -> int | None:
        """The stored vectors' dimension."""

    def translate(self, pushdown: Pushdown) -> tuple[Any, bool]:
        """The native filter for ``pushdown`` and whether it is exact."""

    def conjoin(self, ours: Any, theirs: Any) -> Any:
        """The native filter passing what both pass."""


def _layer_of(document: Document) -> int | None:
    value = document.metadata.get("raptor_layer") if document.metadata else None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        return None
    return int(value)


def _top_layer(documents: Iterable[Document]) -> int:
    """The highest ``raptor_layer`` among ``documents`` (-1: none), for dialects that list."""
    layers = (_layer_of(doc) for doc in documents)
    return max((x for x in layers if x is not None), default=-1)


# -- InMemoryVectorStore -----------------------------------------------------------------------
class InMemoryDialect:
    """``langchain_core.vectorstores.InMemoryVectorStore``: exact, in this process.

    Vectors are written into the store's ``store`` dictionary in the shape its own
    ``add_documents`` writes, so ``dump``/``load`` and its own searches keep working.
    Native filters are callables ``(Document) -> bool``, the store's own filter type.
    """

    name = "InMemoryVectorStore"
    native_lists = True
    has_vectors = True
    can_count = True
    fetch_filters = True

    def __init__(self, vectorstore: InMemoryVectorStore) -> None:
        self.vectorstore = vectorstore

    def upsert(self, documents: Sequence[Document], vectors: NDArray[np.float32]) -> None:
        """Write entries as ``InMemoryVectorStore.add_documents`` does, with our vectors."""
        entries = self.vectorstore.store
        for doc, vector in zip(documents, vectors, strict=True):
            entries[str(doc.id)] = {
                "id": doc.id,
                "vector": vector.tolist(),
                "text": doc.page_content,
                "metadata": doc.metadata,
            }

    def _row(self, entry: Mapping[str, Any], vectors: bool) -> Row:
        doc = Document(id=entry["id"], page_content=entry["text"], metadata=entry["metadata"])
        return Row(doc, np.asarray(entry["vector"], dtype=np.float32) if vectors else None)

    def fetch(self, ids: Sequence[str], *, native: Any, vectors: bool) -> list[Row]:
        """Entries by id, filtered by the callable ``native``."""
        entries = self.vectorstore.store
        rows = [self._row(entries[i], vectors) for i in ids if i in entries]
        return [r for r in rows if native is None or native(r.document)]

    def query(self, vector: NDArray[np.float32], m: int, *, native: Any) -> list[Row]:
        """The store's own cosine search, with the vectors it ranked.

        The search ranks a snapshot of the store's dictionary; a delete running meanwhile
        (another thread updating the tree) may remove a found entry from the live one.  So
        the vectors come from the search itself (``_similarity_search_with_score_by_vector``
        returns ``(document, score, vector)``), never from a second lookup by id; where the
        store lacks that method, found entries that have gone since are left out.
        """
        search = getattr(self.vectorstore, "_similarity_search_with_score_by_vector", None)
        if search is not None:
            triples = search(vector.tolist(), k=m, filter=native)
            return [Row(doc, np.asarray(vec, dtype=np.float32)) for doc, _, vec in triples]
        found = self.vectorstore.similarity_search_with_score_by_vector(
            vector.tolist(), k=m, filter=native
        )
        entries = self.vectorstore.store
        rows = []
        for doc, _ in found:
            entry = entries.get(str(doc.id))
            if entry is not None:
                rows.append(Row(doc, np.asarray(entry["vector"], dtype=np.float32)))
        return rows

    def delete(self, ids: Sequence[str]) -> None:
        """Remove entries (unknown ids are ignored by the store)."""
        self.vectorstore.delete(list(ids))

    def count(self) -> int:
        """Entries in the store."""
        return len(self.vectorstore.store)

    def scan(self) -> Iterator[Document]:
        """Every entry, in insertion order."""
        for entry in list(self.vectorstore.store.values()):
            yield Document(id=entry["id"], page_content=entry["text"], metadata=entry["metadata"])

    def max_layer(self) -> int:
        """The highest layer among the entries (-1: none)."""
        return _top_layer(self.scan())

    def dim(self) -> int | None:
        """The length of a stored vector."""
        for entry in self.vectorstore.store.values():
            return len(entry["vector"])
        return None

    def translate(self, pushdown: Pushdown) -> tuple[Any, bool]:
        """The exact test, as the store's callable filter."""
        return pushdown.accepts, True

    def conjoin(self, ours: Any, theirs: Any) -> Any:
        """Both callables must accept."""
        if ours is None or theirs is None:
            return theirs if ours is None else ours
        if not callable(theirs):
            msg = (
                "an InMemoryVectorStore filter is a callable (Document) -> bool; "
                f"got {type(theirs).__name__} (use where= for a metadata filter dict)"
            )
            raise InvalidParameterError(msg)

        def both(doc: Document) -> bool:
            return bool(ours(doc)) and bool(theirs(doc))

        return both


# -- Chroma ------------------------------------------------------------------------------------
_CHROMA_INCLUDE = ["documents", "metadatas"]
#: ``ChromaDialect.query`` answers this many results or more by an exact scan (see there).
EXACT_QUERY_FROM = 10_000
#: Records per ``collection.get`` page when reading the whole collection.  Each page costs
#: a fixed overhead: at 1M nodes a page of 1,000 took 0.2-0.3 s, one of 5,000 0.4 s, so a
#: full read went from 211 s to about 80 s (benchmarks/README.md).
_READ_PAGE = 5000
_MANIFEST_KEY = "raptor_manifest"


class ChromaDialect:
    """``langchain_chroma.Chroma``, embedded or client/server, through its collection.

    Vectors are written with ``collection.upsert`` and read back with ``include=
    ["embeddings"]``, so scores are exact cosines whatever the collection's distance
    (``cosine``, ``l2`` and ``ip`` rank unit vectors alike).  Chroma searches with HNSW,
    an approximate index: with its default ``ef_search`` of 100 a result is exact for
    collections of a few thousand nodes; raise ``ef_search`` in the collection's
    configuration for larger trees that must rank exactly.  Native filters are Chroma
    ``where`` dictionaries; the core's metadata filters are translated to them (all but
    string ordering and ``None`` values, which are checked in Python instead).
    """

    name = "Chroma"
    # Any `where` makes Chroma evaluate it over the whole collection before it searches
    # (2.8 s a query at 1M nodes): the store keeps a filter on layers that hold most of the
    # nodes out of the query and checks it in Python on a larger result.
    where_scans = True
    # chromadb 1.5 returns the list-valued metadata of a deleted collection's records on the
    # records of a collection created after it (its internal ids are reused): every list
    # is written as a JSON string instead, and every key the store reads is always written.
    native_lists = False
    has_vectors = True
    can_count = True
    fetch_filters = True

    def __init__(self, vectorstore: VectorStore, *, batch_size: int | None = None) -> None:
        self.vectorstore = vectorstore
        self.batch_size = batch_size

    @property
    def collection(self) -> Any:
        """The ``chromadb`` collection behind the LangChain store."""
        return self.vectorstore._collection  # type: ignore[attr-defined]

    def _batch(self) -> int:
        if self.batch_size is not None:
            return int(self.batch_size)
        client = getattr(self.vectorstore, "_client", None)
        try:
            limit = int(client.get_max_batch_size())  # type: ignore[union-attr]
        except Exception:  # an older client or a stand-in: any safe size will do
            limit = 1000
        return max(1, min(limit, 1000))

    def upsert(self, documents: Sequence[Document], vectors: NDArray[np.float32]) -> None:
        """``collection.upsert`` in batches the server accepts, replacing stored metadata.

        Chroma's upsert *merges* new metadata into a stored record, so a key the new
        document lacks would survive (a node that lost its ``raptor_doc_id``); such keys
        are read first and set to None, which removes them.
        """
        step = self._batch()
        for start in range(0, len(documents), step):
            part = documents[start : start + step]
            ids = [str(d.id) for d in part]
            stored = self.collection.get(ids=ids, include=["metadatas"])
            old_keys = {
                i: set(meta or {})
                for i, meta in zip(stored["ids"], stored["metadatas"], strict=True)
            }
            metadatas = []
            for node_id, doc in zip(ids, part, strict=True):
                meta: dict[str, Any] = dict(doc.metadata)
                meta.update(dict.fromkeys(old_keys.get(node_id, set()) - meta.keys()))
                metadatas.append(meta)
            self.collection.upsert(
                ids=ids,
                embeddings=np.asarray(vectors[start : start + step], dtype=np.float32),
                metadatas=metadatas,
                documents=[d.page_content for d in part],
            )

    @staticmethod
    def _rows(ids: Any, docs: Any, metas: Any, embeddings: Any) -> list[Row]:
        rows = []
        for i, node_id in enumerate(ids):
            vector = None if embeddings is None else np.asarray(embeddings[i], dtype=np.float32)
            doc = Document(id=node_id, page_content=docs[i] or "", metadata=metas[i] or {})
            rows.append(Row(doc, vector))
        return rows

    def fetch(self, ids: Sequence[str], *, native: Any, vectors: bool) -> list[Row]:
        """``collection.get(ids=..., where=native)``, in batches."""
        include = [*_CHROMA_INCLUDE, "embeddings"] if vectors else list(_CHROMA_INCLUDE)
        rows: list[Row] = []
        step = self._batch()
        for start in range(0, len(ids), step):
            got = self.collection.get(
                ids=list(ids[start : start + step]), where=native, include=include
            )
            found = got.get("embeddings") if vectors else None
            rows += self._rows(got["ids"], got["documents"], got["metadatas"], found)
        return rows

    def query(self, vector: NDArray[np.float32], m: int, *, native: Any) -> list[Row]:
        """``collection.query`` with the stored vectors included (an exact scan for large ``m``).

        chromadb binds one SQL variable per result it returns, and SQLite allows 32,766: a
        deeper query fails with "too many SQL variables".  A strategy asks that deep only
        when scores are too close to stop earlier (the passage strategy on a vague query),
        and past :data:`EXACT_QUERY_FROM` results an HNSW search is no cheaper than
        reading the matching records, so those are read a page at a time and ranked here.
        """
        if m >= EXACT_QUERY_FROM:
            return self._exact_query(vector, m, native)
        got = self.collection.query(
            query_embeddings=[np.asarray(vector, dtype=np.float32)],
            n_results=int(m),
            where=native,
            include=[*_CHROMA_INCLUDE, "embeddings"],
        )
        return self._rows(
            got["ids"][0], got["documents"][0], got["metadatas"][0], got["embeddings"][0]
        )

    def _exact_query(self, vector: NDArray[np.float32], m: int, native: Any) -> list[Row]:
        """The ``m`` records passing ``native`` nearest to ``vector``, by exact cosine."""
        rows = [
            row
            for got in self._pages([*_CHROMA_INCLUDE, "embeddings"], where=native)
            for row in self._rows(got["ids"], got["documents"], got["metadatas"], got["embeddings"])
        ]
        if not rows:
            return []
        matrix = np.stack([np.asarray(r.vector, dtype=np.float32) for r in rows])
        ids = [str(r.document.id) for r in rows]
        return [rows[i] for i, _ in nearest_rows(vector, matrix, ids, m)]

    def _pages(self, include: list[str], *, where: Any = None) -> Iterator[Any]:
        """``collection.get`` results of every record passing ``where``, a page at a time."""
        step = self.batch_size if self.batch_size is not None else _READ_PAGE
        offset = 0
        while True:
            got = self.collection.get(where=where, limit=step, offset=offset, include=include)
            yield got
            if len(got["ids"]) < step:
                return
            offset += step

    def delete(self, ids: Sequence[str]) -> None:
        """``collection.delete`` (unknown ids are ignored by Chroma)."""
        step = self._batch()
        for start in range(0, len(ids), step):
            self.collection.delete(ids=list(ids[start : start + step]))

    def count(self) -> int:
        """``collection.count()``."""
        return int(self.collection.count())

    def scan(self) -> Iterator[Document]:
        """Every document, a page at a time."""
        for got in self._pages(list(_CHROMA_INCLUDE)):
            for row in self._rows(got["ids"], got["documents"], got["metadatas"], None):
                yield row.document

    def max_layer(self) -> int:
        """Probe layers upwards with one-id ``get`` calls (trees have a handful of layers)."""
        top = -1
        while self.collection.get(where={"raptor_layer": top + 1}, limit=1, include=[])["ids"]:
            top += 1
        return top

    def manifest_copy(self) -> str | None:
        """The manifest's copy in the collection's own metadata (None: there is none).

        Optional for a dialect.  Chroma loads a collection's segments, its whole HNSW index
        included (2.5 s and 2 GB at 1M nodes), on the first ``get``, ``count`` or
        ``query``; the collection's metadata comes with the collection itself, so reading
        the manifest from it leaves that load to the first search.
        """
        raw = (self.collection.metadata or {}).get(_MANIFEST_KEY)
        return raw if isinstance(raw, str) else None

    def keep_manifest_copy(self, raw: str) -> None:
        """Write ``raw`` (the manifest's JSON) into the collection's metadata too."""
        metadata = dict(self.collection.metadata or {})
        if any(key.startswith("hnsw:") for key in metadata):
            # chromadb refuses to modify metadata holding the legacy distance keys: the
            # manifest document alone serves such a collection.
            return
        metadata[_MANIFEST_KEY] = raw
        self.collection.modify(metadata=metadata)

    def layer_ids(self, layer: int, limit: int) -> frozenset[str] | None:
        """The ids of one layer if it holds at most ``limit`` nodes (else None).

        Optional for a dialect: :class:`~raptor_langchain.store.LangChainNodeStore` caches
        the answer until its next write or ``refresh()``.
        """
        got = self.collection.get(where={"raptor_layer": layer}, limit=limit + 1, include=[])
        ids = got["ids"]
        return frozenset(ids) if len(ids) <= limit else None

    def dim(self) -> int | None:
        """The length of one stored vector (any record: a collection has one dimension).

        No ``where``: Chroma would scan the whole collection to evaluate it.
        """
        got = self.collection.get(limit=1, include=["embeddings"])
        embeddings = got.get("embeddings")
        if embeddings is None or len(embeddings) == 0:
            return None
        return len(embeddings[0])

    def translate(self, pushdown: Pushdown) -> tuple[Any, bool]:
        """A Chroma ``where`` for the pushdown (None: no filter), and whether it is exact.

        It is not exact when part of ``where`` has no Chroma twin, when carried copies are
        excluded, or when there is no filter (the manifest may come back): the store then
        asks for a few more documents and checks them in Python.
        """
        clauses: list[dict[str, Any]] = []
        if pushdown.layers is not None:
            clauses.append({"raptor_layer": {"$in": sorted(pushdown.layers)}})
        if pushdown.doc_ids is not None:
            clauses.append({"raptor_doc_id": {"$in": sorted(pushdown.doc_ids)}})
        exact = True
        if pushdown.where is not None:
            translated, exact = chroma_where(pushdown.where)
            if translated is not None:
                clauses.append(translated)
        # "Not a carried copy" and "a node, not the manifest" stay out of the `where`: any
        # `where` makes Chroma evaluate it over the whole collection before it searches
        # (40 ms a query at 10,000 nodes, growing with the collection: see
        # benchmarks/results/stores.md), while carried copies and the manifest are rare in
        # a top k and are dropped in Python from a slightly larger result.
        if not clauses:
            return None, False
        return (clauses[0] if len(clauses) == 1 else {"$and": clauses}), exact and (
            pushdown.include_carried
        )

    def conjoin(self, ours: Any, theirs: Any) -> Any:
        """``{"$and": [ours, theirs]}``."""
        if ours is None or theirs is None:
            return theirs if ours is None else ours
        if not isinstance(theirs, Mapping):
            msg = f"a Chroma filter is a `where` dict, got {type(theirs).__name__}"
            raise InvalidParameterError(msg)
        return {"$and": [ours, dict(theirs)]}


def _kind(value: object) -> str | None:
    """The Chroma metadata type of a filter operand (None: not one Chroma compares)."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    return None


def _chroma_condition(field: str, op: str, value: Any) -> dict[str, Any] | None:
    """One ``{field: {op: value}}`` Chroma clause, or None when Chroma would differ."""
    if op in ("$eq", "$ne"):
        ok = _kind(value) is not None
    elif op in ("$in", "$nin"):
        # Chroma wants a non-empty list of one type; None has no twin.
        kinds = {_kind(v) for v in value}
        ok = bool(value) and len(kinds) == 1 and None not in kinds
        value = list(value)
    elif op in ("$gt", "$gte", "$lt", "$lte"):
        # Chroma orders numbers only; the core also orders strings.
        ok = _kind(value) in ("int", "float")
    else:
        # $contains/$any/$all: this dialect writes no lists into Chroma (they live in
        # raptor_metadata only), so they are checked in Python.
        ok = False
    return {field: {op: value}} if ok else None


def chroma_where(where: Mapping[str, Any]) -> tuple[dict[str, Any] | None, bool]:
    """Translate a (checked) core filter into a Chroma ``where``.

    Returns:
        ``(where, exact)``: a Chroma filter passing at least every node the core filter
        passes (None: no constraint), and whether it passes exactly those.  Parts with no
        Chroma twin (ordering strings, comparing with None, the list operators ``$contains``
        ``$any`` ``$all``, ``raptor_``-prefixed user keys, which are stored in
        ``raptor_metadata`` only) are left out, and the caller checks them in Python.

    Examples:
        >>> chroma_where({"doc_id": "a", "year": {"$gte": 2000}})
        ({'$and': [{'raptor_doc_id': {'$eq': 'a'}}, {'year': {'$gte': 2000}}]}, True)
        >>> chroma_where({"title": {"$gt": "M"}})
        (None, False)
    """
    parts: list[dict[str, Any]] = []
    exact = True
    for key, condition in where.items():
        if key in ("$and", "$or"):
            subs = [chroma_where(sub) for sub in condition]
            kept = [clause for clause, _ in subs if clause is not None]
            sub_exact = all(e for _, e in subs)
            if key == "$and":
                parts += kept
                exact = exact and sub_exact
            elif len(kept) == len(subs):
                parts.append(kept[0] if len(kept) == 1 else {"$or": kept})
                exact = exact and sub_exact
            else:
                exact = False  # one unconstrained branch: the whole $or passes anything
            continue
        if key.startswith("raptor_"):
            exact = False
            continue
        field = "raptor_doc_id" if key == "doc_id" else key
        ops = condition if isinstance(condition, Mapping) else {"$eq": condition}
        for op, value in ops.items():
            clause = _chroma_condition(field, op, value)
            if clause is None:
                exact = False
            else:
                parts.append(clause)
    if not parts:
        return None, exact
    return (parts[0] if len(parts) == 1 else {"$and": parts}), exact


# -- Qdrant ------------------------------------------------------------------------------------
#: The payload key holding a document's own id (beside LangChain's content and metadata).
_QDRANT_ID_KEY = "raptor_id"


class QdrantDialect:
    """``langchain_qdrant.QdrantVectorStore`` (a Qdrant server, or ``QdrantClient(":memory:")``).

    Qdrant takes point ids that are UUIDs or integers only; the tree's ids are neither
    (``"L0-1a2b..."``), and ``add_texts`` with them fails.  Each document is written with
    the Qdrant client under :func:`~raptor_core.store.codec.uuid_id` of its id, in
    LangChain's payload layout (``page_content``, ``metadata``, so the store's own searches
    still read it) plus its own id, and reads back under that id.  Stored vectors come back
    with every read (exact scores); the collection is listed by scrolling it in pages.
    Native filters are ``qdrant_client.models.Filter`` objects; structure (layers,
    documents) is pushed down as one, the core's metadata filters are checked in Python.
    """

    name = "Qdrant"
    native_lists = True
    has_vectors = True
    can_count = True
    fetch_filters = False

    def __init__(self, vectorstore: VectorStore) -> None:
        self.vectorstore = vectorstore

    @property
    def _client(self) -> Any:
        return self.vectorstore.client  # type: ignore[attr-defined]

    @property
    def _collection(self) -> str:
        return str(self.vectorstore.collection_name)  # type: ignore[attr-defined]

    def _keys(self) -> tuple[str, str, str]:
        store: Any = self.vectorstore
        return store.content_payload_key, store.metadata_payload_key, store.vector_name

    def _row(self, point: Any, vectors: bool) -> Row:
        content_key, metadata_key, vector_name = self._keys()
        payload = point.payload or {}
        doc = Document(
            id=str(payload.get(_QDRANT_ID_KEY) or point.id),
            page_content=payload.get(content_key) or "",
            metadata=dict(payload.get(metadata_key) or {}),
        )
        vector = point.vector if vectors else None
        if isinstance(vector, dict):
            vector = vector.get(vector_name)
        return Row(doc, None if vector is None else np.asarray(vector, dtype=np.float32))

    def upsert(self, documents: Sequence[Document], vectors: NDArray[np.float32]) -> None:
        """``client.upsert`` of whole points (payload replaced), in batches."""
        from qdrant_client import models

        content_key, metadata_key, vector_name = self._keys()
        for start in range(0, len(documents), _QDRANT_BATCH):
            part = documents[start : start + _QDRANT_BATCH]
            points = [
                models.PointStruct(
                    id=uuid_id(str(doc.id)),
                    vector={vector_name: vector.tolist()} if vector_name else vector.tolist(),
                    payload={
                        content_key: doc.page_content,
                        metadata_key: dict(doc.metadata),
                        _QDRANT_ID_KEY: str(doc.id),
                    },
                )
                for doc, vector in zip(part, vectors[start : start + _QDRANT_BATCH], strict=True)
            ]
            self._client.upsert(collection_name=self._collection, points=points)

    def fetch(self, ids: Sequence[str], *, native: Any, vectors: bool) -> list[Row]:
        """``client.retrieve`` by point id (no native filter: the store searches instead)."""
        if native is not None:
            msg = "QdrantDialect.fetch cannot apply a native filter"
            raise InvalidParameterError(msg)
        rows: list[Row] = []
        for start in range(0, len(ids), _QDRANT_BATCH):
            points = self._client.retrieve(
                collection_name=self._collection,
                ids=[uuid_id(str(i)) for i in ids[start : start + _QDRANT_BATCH]],
                with_payload=True,
                with_vectors=vectors,
            )
            rows += [self._row(p, vectors) for p in points]
        return rows

    def query(self, vector: NDArray[np.float32], m: int, *, native: Any) -> list[Row]:
        """``client.query_points`` with the stored vectors included."""
        _, _, vector_name = self._keys()
        found = self._client.query_points(
            collection_name=self._collection,
            query=np.asarray(vector, dtype=np.float32).tolist(),
            using=vector_name or None,
            limit=int(m),
            query_filter=native,
            with_payload=True,
            with_vectors=True,
        )
        return [self._row(p, True) for p in found.points]

    def delete(self, ids: Sequence[str]) -> None:
        """``client.delete`` by point id (unknown ids are ignored by Qdrant)."""
        from qdrant_client import models

        for start in range(0, len(ids), _QDRANT_BATCH):
            chunk: list[int | str | uuid.UUID] = [
                uuid_id(str(i)) for i in ids[start : start + _QDRANT_BATCH]
            ]
            self._client.delete(
                collection_name=self._collection,
                points_selector=models.PointIdsList(points=chunk),
            )

    def count(self) -> int:
        """``client.count`` (exact)."""
        return int(self._client.count(collection_name=self._collection, exact=True).count)

    def _pages(self, *, vectors: bool) -> Iterator[Row]:
        offset = None
        while True:
            points, offset = self._client.scroll(
                collection_name=self._collection,
                limit=_QDRANT_BATCH,
                offset=offset,
                with_payload=True,
                with_vectors=vectors,
            )
            for point in points:
                yield self._row(point, vectors)
            if offset is None:
                return

    def scan(self) -> Iterator[Document]:
        """Every document, scrolling the collection a page at a time."""
        for row in self._pages(vectors=False):
            yield row.document

    def max_layer(self) -> int:
        """The highest layer among the documents (-1: none)."""
        return _top_layer(self.scan())

    def dim(self) -> int | None:
        """The length of one stored vector."""
        row = next(iter(self._pages(vectors=True)), None)
        return None if row is None or row.vector is None else int(row.vector.shape[0])

    def translate(self, pushdown: Pushdown) -> tuple[Any, bool]:
        """A Qdrant ``Filter`` on layers and documents; the user's ``where`` stays in Python.

        Not exact when there is a ``where``, when carried copies are excluded (rare in a top
        k, dropped in Python), or when there is no filter (the manifest may come back).
        """
        from qdrant_client import models

        _, metadata_key, _ = self._keys()
        clauses: list[Any] = []
        if pushdown.layers is not None:
            clauses.append(
                models.FieldCondition(
                    key=f"{metadata_key}.raptor_layer",
                    match=models.MatchAny(any=sorted(pushdown.layers)),
                )
            )
        if pushdown.doc_ids is not None:
            clauses.append(
                models.FieldCondition(
                    key=f"{metadata_key}.raptor_doc_id",
                    match=models.MatchAny(any=sorted(pushdown.doc_ids)),
                )
            )
        if not clauses:
            return None, False
        exact = pushdown.where is None and pushdown.include_carried
        return models.Filter(must=clauses), exact

    def conjoin(self, ours: Any, theirs: Any) -> Any:
        """A ``Filter`` that must pass both."""
        from qdrant_client import models

        if ours is None or theirs is None:
            return theirs if ours is None else ours
        if not isinstance(theirs, models.Filter):
            msg = f"a Qdrant filter is a qdrant_client.models.Filter, got {type(theirs).__name__}"
            raise InvalidParameterError(msg)
        return models.Filter(must=[ours, theirs])


#: Points per Qdrant request (upsert, retrieve, delete, a scrolled page).
_QDRANT_BATCH = 1000


# -- FAISS (langchain_community) ----------------------------------------------------------------
class FAISSDialect:
    """``langchain_community.vectorstores.FAISS``: a FAISS index and a docstore, in this process.

    The store keeps its documents in a docstore (``InMemoryDocstore``) and its vectors in a
    FAISS index that knows positions, not ids (``index_to_docstore_id`` maps one to the
    other).  Documents are written with the store's own ``add_embeddings`` (our vectors,
    the store's layout, so ``save_local`` and its own searches keep working), after
    ``delete`` of the ids already stored: the docstore refuses to add an id twice.  Vectors
    are read back with ``index.reconstruct``, so scores are exact cosines; the index must be
    one that can give its vectors back (``IndexFlatL2``, which ``FAISS.from_documents``
    makes, ``IndexFlatIP``, ``IndexHNSWFlat``; an IVF index after ``make_direct_map()``).

    Filters run in Python on the documents the index returns, as the store's own searches
    filter (a ``filter=`` dict in the store's dialect, or a callable on the metadata); a
    search asks the index for more until enough pass.  The store's own searches, with their
    default ``fetch_k=20``, may return fewer than asked when a filter is narrow; these do not.
    """

    name = "FAISS"
    native_lists = True
    has_vectors = True
    can_count = True
    fetch_filters = True

    def __init__(self, vectorstore: VectorStore) -> None:
        # langchain_community is optional: its attributes (index, docstore, ...) are untyped.
        self.vectorstore: Any = vectorstore
        self._positions: dict[str, int] = {}
        self._positions_of: tuple[int, int] = (0, -1)

    def _position(self) -> dict[str, int]:
        """Document id -> index position, rebuilt when the store's mapping changed.

        ``add_embeddings`` extends ``index_to_docstore_id`` in place and ``delete`` replaces
        it (positions shift as the index compacts), so its identity and size say when
        the reverse map is stale; every lookup is also checked against the mapping itself.
        """
        mapping = self.vectorstore.index_to_docstore_id
        stamp = (id(mapping), len(mapping))
        if stamp != self._positions_of:
            self._positions = {str(doc_id): int(at) for at, doc_id in mapping.items()}
            self._positions_of = stamp
        return self._positions

    def _positions_for(self, ids: Sequence[str]) -> list[tuple[str, int]]:
        """``(id, position)`` of the stored ids among ``ids``, in the order given."""
        mapping = self.vectorstore.index_to_docstore_id
        positions = self._position()
        if any(i in positions and mapping.get(positions[i]) != i for i in ids):
            self._positions_of = (0, -1)  # changed behind our back: rebuild
            positions = self._position()
        return [(i, positions[i]) for i in ids if i in positions]

    def _document(self, doc_id: str) -> Document | None:
        doc = self.vectorstore.docstore.search(doc_id)
        if not isinstance(doc, Document):
            return None  # the docstore answers a missing id with a message string
        return doc if doc.id == doc_id else doc.model_copy(update={"id": doc_id})

    def _vectors(self, positions: Sequence[int]) -> NDArray[np.float32]:
        index = self.vectorstore.index
        if not positions:
            return np.zeros((0, int(index.d)), dtype=np.float32)
        try:
            out = index.reconstruct_batch(np.asarray(positions, dtype=np.int64))
        except RuntimeError as exc:
            msg = (
                f"this FAISS index ({type(index).__name__}) cannot give its vectors back "
                f"({exc}); a RAPTOR tree needs them to score exactly: use IndexFlatL2 "
                "(what FAISS.from_documents makes), IndexFlatIP or IndexHNSWFlat, or call "
                "index.make_direct_map() on an IVF index"
            )
            raise InvalidParameterError(msg) from exc
        return np.asarray(out, dtype=np.float32).reshape(len(positions), -1)

    def upsert(self, documents: Sequence[Document], vectors: NDArray[np.float32]) -> None:
        """``delete`` the stored ids, then the store's own ``add_embeddings`` with our vectors."""
        width = int(self.vectorstore.index.d)
        if vectors.ndim != 2 or vectors.shape[1] != width:
            # FAISS itself fails with a bare AssertionError.
            msg = (
                f"this FAISS store's index holds vectors of dimension {width}, the tree's "
                f"have {vectors.shape[-1]}: give the store an index of the tree's dimension "
                "(and the tree's embedding model)"
            )
            raise InvalidInputError(msg)
        ids = [str(doc.id) for doc in documents]
        stored = [i for i, _ in self._positions_for(ids)]
        if stored:
            self.vectorstore.delete(stored)
        self.vectorstore.add_embeddings(
            list(zip([d.page_content for d in documents], vectors.tolist(), strict=True)),
            metadatas=[dict(d.metadata) for d in documents],
            ids=ids,
        )

    def fetch(self, ids: Sequence[str], *, native: Any, vectors: bool) -> list[Row]:
        """The stored documents with these ids that pass the callable ``native``."""
        found = self._positions_for([str(i) for i in ids])
        rows: list[tuple[Document, int]] = []
        for doc_id, at in found:
            doc = self._document(doc_id)
            if doc is not None and (native is None or native(doc)):
                rows.append((doc, at))
        if not vectors:
            return [Row(doc) for doc, _ in rows]
        matrix = self._vectors([at for _, at in rows])
        return [Row(doc, vector) for (doc, _), vector in zip(rows, matrix, strict=True)]

    def query(self, vector: NDArray[np.float32], m: int, *, native: Any) -> list[Row]:
        """The index's nearest, filtered here; asked again for more until ``m`` pass."""
        index = self.vectorstore.index
        total = int(index.ntotal)
        if total == 0:
            return []
        q = np.asarray(vector, dtype=np.float32).reshape(1, -1)
        mapping = self.vectorstore.index_to_docstore_id
        asked = min(total, m if native is None else max(2 * m, m + 16))
        while True:
            _, found = index.search(q, asked)
            rows: list[tuple[Document, int]] = []
            for at in found[0]:
                doc_id = mapping.get(int(at)) if at >= 0 else None
                doc = None if doc_id is None else self._document(str(doc_id))
                if doc is not None and (native is None or native(doc)):
                    rows.append((doc, int(at)))
                    if len(rows) == m:
                        break
            if len(rows) >= m or asked >= total:
                break
            asked = min(total, 4 * asked)
        matrix = self._vectors([at for _, at in rows])
        return [Row(doc, vec) for (doc, _), vec in zip(rows, matrix, strict=True)]

    def delete(self, ids: Sequence[str]) -> None:
        """The store's ``delete`` of the ids it holds (it raises on unknown ids)."""
        stored = [i for i, _ in self._positions_for([str(i) for i in ids])]
        if stored:
            self.vectorstore.delete(stored)

    def count(self) -> int:
        """Documents in the store (``index_to_docstore_id``)."""
        return len(self.vectorstore.index_to_docstore_id)

    def scan(self) -> Iterator[Document]:
        """Every document, in index order."""
        mapping = self.vectorstore.index_to_docstore_id
        for at in sorted(mapping):
            doc = self._document(str(mapping[at]))
            if doc is not None:
                yield doc

    def max_layer(self) -> int:
        """The highest layer among the documents (-1: none)."""
        return _top_layer(self.scan())

    def dim(self) -> int | None:
        """The index's dimension, once it holds a vector."""
        index = self.vectorstore.index
        return int(index.d) if int(index.ntotal) > 0 else None

    def translate(self, pushdown: Pushdown) -> tuple[Any, bool]:
        """The exact test, as a callable on the stored document (applied here, not by FAISS)."""
        return pushdown.accepts, True

    def conjoin(self, ours: Any, theirs: Any) -> Any:
        """Ours and the user's FAISS filter (a dict in its dialect, or a callable on metadata)."""
        if theirs is None:
            return ours
        if not (callable(theirs) or isinstance(theirs, Mapping)):
            msg = (
                "a FAISS filter is a dict of metadata conditions or a callable taking a "
                f"document's metadata; got {type(theirs).__name__}"
            )
            raise InvalidParameterError(msg)
        try:
            on_metadata = self.vectorstore._create_filter_func(theirs)
        except ValueError as exc:
            raise InvalidParameterError(f"FAISS rejected the filter {theirs!r}: {exc}") from exc

        def both(doc: Document) -> bool:
            return (ours is None or bool(ours(doc))) and bool(on_metadata(doc.metadata))

        return both


# -- any other store ---------------------------------------------------------------------------
class GenericDialect:
    """Any LangChain ``VectorStore``, through its public API only (see the module docstring).

    Needs ``add_texts``, ``similarity_search_by_vector``, ``get_by_ids`` and ``delete``;
    a store lacking one fails with an error naming it.  Native filters are passed to
    ``similarity_search_by_vector(..., filter=native)`` in the store's own dialect.
    """

    native_lists = False
    has_vectors = False
    can_count = False
    fetch_filters = False

    def __init__(self, vectorstore: VectorStore) -> None:
        self.vectorstore = vectorstore
        self.name = type(vectorstore).__name__

    def _unsupported(self, method: str, exc: Exception) -> InvalidParameterError:
        return InvalidParameterError(
            f"{self.name} does not implement VectorStore.{method}, which a RAPTOR tree in a "
            f"generic vector store needs ({exc!r}); use a store that does, or write a "
            "dialect for it (see raptor_langchain.dialects)"
        )

    def upsert(self, documents: Sequence[Document], vectors: NDArray[np.float32]) -> None:
        """``delete`` the stored ids, then ``add_texts`` (the store embeds the texts)."""
        ids = [str(d.id) for d in documents]
        stored = [row.document.id for row in self.fetch(ids, native=None, vectors=False)]
        if stored:
            self.delete([str(i) for i in stored])
        try:
            self.vectorstore.add_texts(
                [d.page_content for d in documents],
                metadatas=[d.metadata for d in documents],
                ids=ids,
            )
        except NotImplementedError as exc:
            raise self._unsupported("add_texts", exc) from exc

    def fetch(self, ids: Sequence[str], *, native: Any, vectors: bool) -> list[Row]:
        """``get_by_ids`` (native filters cannot be applied: the caller searches instead)."""
        if native is not None:
            msg = "GenericDialect.fetch cannot apply a native filter"
            raise InvalidParameterError(msg)
        try:
            docs = self.vectorstore.get_by_ids(list(ids))
        except NotImplementedError as exc:
            raise self._unsupported("get_by_ids", exc) from exc
        return [Row(doc) for doc in docs]

    def query(self, vector: NDArray[np.float32], m: int, *, native: Any) -> list[Row]:
        """``similarity_search_by_vector``; the native filter goes in as ``filter=``."""
        kwargs = {} if native is None else {"filter": native}
        try:
            docs = self.vectorstore.similarity_search_by_vector(vector.tolist(), k=m, **kwargs)
        except NotImplementedError as exc:
            raise self._unsupported("similarity_search_by_vector", exc) from exc
        return [Row(doc) for doc in docs]

    def delete(self, ids: Sequence[str]) -> None:
        """``delete`` the ids that are stored (some stores raise on unknown ids)."""
        stored = [str(row.document.id) for row in self.fetch(ids, native=None, vectors=False)]
        if not stored:
            return
        try:
            self.vectorstore.delete(ids=stored)
        except NotImplementedError as exc:
            raise self._unsupported("delete", exc) from exc

    def count(self) -> None:
        """Unknown: the ``VectorStore`` API cannot count."""
        return None

    def scan(self) -> Iterator[Document]:
        """The ``VectorStore`` API cannot list documents."""
        msg = (
            f"{self.name} cannot list its documents through the VectorStore API, so this "
            "operation (iterating the tree, exporting it, the 'passage' strategy, which reads "
            "every leaf once) needs a store with a dialect (InMemoryVectorStore, Chroma) or one "
            "you write; on this store, search with strategy='collapsed' (or another strategy)"
        )
        raise InvalidParameterError(msg)

    def max_layer(self) -> None:
        """Unknown: kept in the manifest instead."""
        return None

    def dim(self) -> None:
        """Unknown: kept in the manifest instead."""
        return None

    def translate(self, pushdown: Pushdown) -> tuple[Any, bool]:
        """No pushdown: structure is checked in Python."""
        return None, False

    def conjoin(self, ours: Any, theirs: Any) -> Any:
        """Only the user's native filter reaches the store."""
        return theirs


# -- Milvus (langchain_milvus) -------------------------------------------------------------------
#: Rows per Milvus request (upsert, a fetched id chunk, a listed page); Milvus caps a query's
#: ``offset + limit`` and a search's ``limit`` at 16,384.
_MILVUS_BATCH = 1000
_MILVUS_TOPK = 16_384
_MILVUS_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _milvus_literal(value: str) -> str:
    r"""A Milvus boolean-expression string literal for ``value``.

    pymilvus's own ``get``/``delete(ids=...)`` and ``query_iterator`` quote ids with Python's
    ``repr`` (Milvus rejects ``\c``), and Milvus Lite has no filter templates, so ids are
    quoted here: Milvus reads the escapes below and takes any other character as is (it
    rejects ``\u`` and ``\x`` escapes).
    """
    return '"' + "".join(_MILVUS_ESCAPES.get(ch, ch) for ch in value) + '"'


def _milvus_in(field: str, values: Iterable[str | int]) -> str:
    items = ", ".join(_milvus_literal(v) if isinstance(v, str) else str(int(v)) for v in values)
    return f"{field} in [{items}]"


class MilvusDialect:
    """``langchain_milvus.Milvus`` (Milvus Lite, a local file, or a server), through its client.

    Each document is one row in LangChain's layout: its id in the primary key (a VARCHAR:
    create the store with ``auto_id=False``), its text in the text field, its vector in the
    vector field, its metadata as dynamic fields (``enable_dynamic_field=True``, so any key
    can be written and filtered).  Reads and writes go through the store's ``MilvusClient``
    (``vectorstore.client``): rows are upserted with our vectors and read back with them
    (exact scores, whatever the index's metric: ``L2``, ``IP`` and ``COSINE`` rank unit
    vectors alike).  A store opened on a file without the collection creates it here in
    that layout, with the store's ``index_params`` (default ``AUTOINDEX``, ``L2``).
    Structure (layers, documents) is pushed down as a Milvus boolean expression; the core's
    metadata filters are checked in Python.  Milvus keeps a text in a VARCHAR of at most
    65,535 bytes: longer node texts are refused with advice.
    """

    name = "Milvus"
    native_lists = True
    has_vectors = True
    can_count = True
    fetch_filters = True

    def __init__(self, vectorstore: VectorStore) -> None:
        # langchain_milvus is optional: its attributes (client, field names) are untyped.
        self.vectorstore: Any = vectorstore
        self._checked = False

    @property
    def _client(self) -> Any:
        return self.vectorstore.client

    @property
    def _collection(self) -> str:
        return str(self.vectorstore.collection_name)

    def _fields(self) -> tuple[str, str, str]:
        """The primary key, text and vector field names, checked to be usable."""
        store = self.vectorstore
        vector = store._vector_field
        fix = (
            "create the store as Milvus(embeddings, connection_args={'uri': ...}, "
            "collection_name=..., auto_id=False, enable_dynamic_field=True) on a new collection"
        )
        problem = None
        if store.auto_id:
            problem = "auto_id=True (Milvus would choose the ids; the tree needs its own)"
        elif not store.enable_dynamic_field:
            problem = "enable_dynamic_field=False (the tree's metadata keys are not all known)"
        elif not isinstance(vector, str) or getattr(store, "builtin_func", None):
            problem = "several vector fields or built-in functions (the tree has one vector)"
        if problem is None and not self._checked and self._exists():
            problem = self._schema_problem(store._primary_field, vector)
        if problem is not None:
            msg = f"this Milvus store cannot hold a RAPTOR tree: {problem}; {fix}"
            raise InvalidParameterError(msg)
        self._checked = self._checked or self._exists()
        return str(store._primary_field), str(store._text_field), str(vector)

    def _exists(self) -> bool:
        return bool(self._client.has_collection(self._collection))

    def _schema_problem(self, primary: str, vector: str) -> str | None:
        info = self._client.describe_collection(self._collection)
        types = {f["name"]: f for f in info.get("fields", [])}
        if not info.get("enable_dynamic_field"):
            return f"the collection {self._collection!r} has no dynamic field"
        key = types.get(primary)
        if (
            key is None
            or not key.get("is_primary")
            or str(key["type"]) != str(_milvus_type("VARCHAR"))
        ):
            return f"the collection's primary key {primary!r} is not a VARCHAR"
        vec = types.get(vector)
        if vec is None or str(vec["type"]) != str(_milvus_type("FLOAT_VECTOR")):
            return f"the collection has no FLOAT_VECTOR field {vector!r}"
        return None

    def _create(self, dim: int) -> None:
        """The collection in LangChain's layout, indexed with the store's ``index_params``."""
        from pymilvus import DataType

        primary, text, vector = self._fields()
        client = self._client
        schema = client.create_schema(auto_id=False, enable_dynamic_field=True)
        schema.add_field(text, DataType.VARCHAR, max_length=65_535)
        schema.add_field(primary, DataType.VARCHAR, is_primary=True, max_length=65_535)
        schema.add_field(vector, DataType.FLOAT_VECTOR, dim=int(dim))
        params = self.vectorstore.index_params
        if not isinstance(params, Mapping):
            params = {"metric_type": "L2", "index_type": "AUTOINDEX", "params": {}}
        index = client.prepare_index_params()
        index.add_index(field_name=vector, **dict(params))
        client.create_collection(
            self._collection,
            schema=schema,
            index_params=index,
            consistency_level=self.vectorstore.consistency_level,
        )
        self._checked = False

    def _row(self, entity: Mapping[str, Any], vectors: bool) -> Row:
        primary, text, vector = self._fields()
        meta = {k: v for k, v in entity.items() if k not in (primary, text, vector)}
        doc = Document(id=str(entity[primary]), page_content=entity.get(text) or "", metadata=meta)
        found = entity.get(vector) if vectors else None
        return Row(doc, None if found is None else np.asarray(found, dtype=np.float32))

    def upsert(self, documents: Sequence[Document], vectors: NDArray[np.float32]) -> None:
        """``client.upsert`` of whole rows (dynamic fields replaced), in batches.

        A metadata key named like one of the collection's fields would overwrite it: such
        keys are left out (the node keeps them in ``raptor_metadata``).
        """
        if len(documents) == 0:
            return
        if not self._exists():
            self._create(int(vectors.shape[1]))
        primary, text, vector = self._fields()
        for doc in documents:
            if len(doc.page_content.encode("utf-8")) > 65_535:
                msg = (
                    f"node {doc.id!r} has a text of more than 65,535 bytes, the most a Milvus "
                    "VARCHAR holds; split the documents into smaller chunks"
                )
                raise InvalidInputError(msg)
        for start in range(0, len(documents), _MILVUS_BATCH):
            part = documents[start : start + _MILVUS_BATCH]
            rows = []
            for doc, vec in zip(part, vectors[start : start + _MILVUS_BATCH], strict=True):
                row = {k: v for k, v in doc.metadata.items() if k not in (primary, text, vector)}
                row.update({primary: str(doc.id), text: doc.page_content, vector: vec.tolist()})
                rows.append(row)
            self._client.upsert(self._collection, rows)

    def fetch(self, ids: Sequence[str], *, native: Any, vectors: bool) -> list[Row]:
        """``client.query`` on the primary key (and ``native``), in batches."""
        if not ids or not self._exists():
            return []
        primary, _, _ = self._fields()
        rows: list[Row] = []
        for start in range(0, len(ids), _MILVUS_BATCH):
            expr = _milvus_in(primary, [str(i) for i in ids[start : start + _MILVUS_BATCH]])
            if native is not None:
                expr = f"({expr}) and ({native})"
            found = self._client.query(self._collection, filter=expr, output_fields=["*"])
            rows += [self._row(e, vectors) for e in found]
        return rows

    def query(self, vector: NDArray[np.float32], m: int, *, native: Any) -> list[Row]:
        """``client.search`` with the stored vectors included (an exact scan past Milvus's top k)."""
        if not self._exists():
            return []
        _, _, field = self._fields()
        if m > _MILVUS_TOPK:
            rows = [self._row(e, True) for e in self._pages(native, ["*"])]
            if not rows:
                return []
            matrix = np.stack([np.asarray(r.vector, dtype=np.float32) for r in rows])
            ids = [str(r.document.id) for r in rows]
            return [rows[i] for i, _ in nearest_rows(vector, matrix, ids, m)]
        found = self._client.search(
            self._collection,
            data=[np.asarray(vector, dtype=np.float32).tolist()],
            anns_field=field,
            limit=int(m),
            filter=native or "",
            output_fields=["*"],
        )
        return [self._row(hit["entity"], True) for hit in found[0]]

    def delete(self, ids: Sequence[str]) -> None:
        """``client.delete`` by an expression on the primary key (unknown ids are ignored)."""
        if not ids or not self._exists():
            return
        primary, _, _ = self._fields()
        for start in range(0, len(ids), _MILVUS_BATCH):
            expr = _milvus_in(primary, [str(i) for i in ids[start : start + _MILVUS_BATCH]])
            self._client.delete(self._collection, filter=expr)

    def count(self) -> int:
        """``count(*)`` (exact, deleted rows left out)."""
        if not self._exists():
            return 0
        found = self._client.query(self._collection, filter="", output_fields=["count(*)"])
        return int(found[0]["count(*)"])

    def _pages(self, native: Any, output: list[str]) -> Iterator[Mapping[str, Any]]:
        """Every row passing ``native``, a page at a time in primary-key order.

        pymilvus's ``query_iterator`` quotes its cursor with ``repr`` (see
        :func:`_milvus_literal`), so the cursor is kept here, with the same request flags.
        """
        if not self._exists():
            return
        primary, _, _ = self._fields()
        last: str | None = None
        while True:
            parts = [] if last is None else [f"{primary} > {_milvus_literal(last)}"]
            if native is not None:
                parts.append(f"({native})")
            page = self._client.query(
                self._collection,
                filter=" and ".join(parts),
                limit=_MILVUS_BATCH,
                output_fields=[primary, *output],
                iterator="True",
                reduce_stop_for_best="True",
            )
            yield from page
            if len(page) < _MILVUS_BATCH:
                return
            # Milvus compares strings byte by byte (UTF-8)
            last = max((str(e[primary]) for e in page), key=lambda k: k.encode("utf-8"))

    def scan(self) -> Iterator[Document]:
        """Every document, a page at a time."""
        for entity in self._pages(None, ["*"]):
            yield self._row(entity, False).document

    def max_layer(self) -> int:
        """The highest layer among the documents (-1: none)."""
        top = -1
        for entity in self._pages("raptor_layer >= 0", ["raptor_layer"]):
            layer = entity.get("raptor_layer")
            if isinstance(layer, int) and not isinstance(layer, bool):
                top = max(top, layer)
        return top

    def dim(self) -> int | None:
        """The dimension of the collection's vector field (None: no collection yet)."""
        if not self._exists():
            return None
        _, _, vector = self._fields()
        for field in self._client.describe_collection(self._collection).get("fields", []):
            if field.get("name") == vector:
                return int(field.get("params", {})["dim"])
        return None

    def translate(self, pushdown: Pushdown) -> tuple[Any, bool]:
        """A Milvus expression on layers and documents; the user's ``where`` stays in Python.

        Not exact when there is a ``where``, when carried copies are excluded (rare in a top
        k, dropped in Python), or when there is no filter (the manifest may come back).
        """
        clauses: list[str] = []
        if pushdown.layers is not None:
            clauses.append(_milvus_in("raptor_layer", sorted(pushdown.layers)))
        if pushdown.doc_ids is not None:
            clauses.append(_milvus_in("raptor_doc_id", sorted(pushdown.doc_ids)))
        if not clauses:
            return None, False
        exact = pushdown.where is None and pushdown.include_carried
        return " and ".join(clauses), exact

    def conjoin(self, ours: Any, theirs: Any) -> Any:
        """An expression that must pass both."""
        if ours is None or theirs is None:
            return theirs if ours is None else ours
        if not isinstance(theirs, str):
            msg = f"a Milvus filter is a boolean expression string, got {type(theirs).__name__}"
            raise InvalidParameterError(msg)
        return f"({ours}) and ({theirs})"


def _milvus_type(name: str) -> Any:
    from pymilvus import DataType

    return getattr(DataType, name)


def dialect_for(vectorstore: VectorStore) -> StoreDialect:
    """The dialect for ``vectorstore``: a specific one when known, else the generic one.

    Raises:
        InvalidParameterError: ``vectorstore`` is not a LangChain ``VectorStore``.
    """
    if not isinstance(vectorstore, VectorStore):
        msg = f"expected a LangChain VectorStore, got {type(vectorstore).__name__}"
        raise InvalidParameterError(msg)
    if isinstance(vectorstore, InMemoryVectorStore):
        return InMemoryDialect(vectorstore)
    if is_instance_of(vectorstore, "langchain_chroma", "Chroma"):
        return ChromaDialect(vectorstore)
    if is_instance_of(vectorstore, "langchain_qdrant", "QdrantVectorStore"):
        return QdrantDialect(vectorstore)
    if is_instance_of(vectorstore, "langchain_community.vectorstores", "FAISS"):
        return FAISSDialect(vectorstore)
    if is_instance_of(vectorstore, "langchain_milvus", "Milvus"):
        return MilvusDialect(vectorstore)
    logger.info("no dialect for %s: using the generic VectorStore API", type(vectorstore))
    return GenericDialect(vectorstore)
