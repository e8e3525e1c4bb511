"""A content-addressed build cache: an interrupted build resumes without paying twice.

Every summary and every document embedding a build obtains is stored under a key that
names exactly what produced it::

    summary key   = sha256(component identity, cluster texts, max_tokens)
    embedding key = sha256(component identity, text)

The *identity* of a component is its class and the parameters that change its output
(model name, prompt template, separator, temperature, …; see :func:`component_identity`),
never its API key and never operational settings such as ``base_url``, ``timeout`` or
``max_concurrency``.  So a rebuild over the same documents with the same models finds every
answer it already paid for, whatever stopped the previous run (an exception, Ctrl-C, a
killed process, a power cut after the last commit), and a changed prompt or model simply
misses the cache.

Storage is one SQLite file (``cache.sqlite3``) in WAL mode with ``synchronous=FULL``: each
answer is committed as soon as it arrives, a crash loses at most the answers in flight, and
a torn write is rolled back by SQLite on the next open.  Vectors are stored as raw
little-endian float32 bytes and summaries as text; nothing is ever pickled.  Several threads
(and processes) may share a cache.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core.exceptions import EmbeddingError, InvalidParameterError
from raptor_core.types import AsyncEmbedder, AsyncSummarizer, Embedder, Summarizer

__all__ = [
    "CACHE_FILE",
    "BuildCache",
    "CachedEmbedder",
    "CachedSummarizer",
    "component_identity",
]

logger = logging.getLogger(__name__)

CACHE_FILE = "cache.sqlite3"
_SCHEMA_VERSION = "1"
_SQL_CHUNK = 500  # keys per SELECT ... IN (...), well under SQLite's variable limit

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS summaries (
    key TEXT PRIMARY KEY, summary TEXT NOT NULL, created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS embeddings (
    key TEXT PRIMARY KEY, dim INTEGER NOT NULL, vector BLOB NOT NULL, created REAL NOT NULL
);
"""


def component_identity(component: object, *, _depth: int = 0) -> dict[str, Any]:
    """Class and output-relevant parameters of a component, as a JSON-serialisable dict.

    Parameters come from ``get_params()`` when the component has one, else from the
    attributes named like its constructor's arguments (the scikit-learn convention).  Nested
    components (the LLM inside a summariser, the embedder inside the extractive summariser)
    are described recursively.  Left out: private names, anything named like a key, and the
    names in the component's ``cache_ignore`` (operational settings that do not change the
    output, such as ``base_url`` or ``timeout``).
    """
    cls = type(component)
    out: dict[str, Any] = {"class": f"{cls.__module__}.{cls.__qualname__}"}
    if _depth > 4:
        return out
    ignore = frozenset(getattr(component, "cache_ignore", ()) or ())
    get_params = getattr(component, "get_params", None)
    if callable(get_params):
        params = dict(get_params())
    else:
        try:
            names = list(inspect.signature(cls).parameters)
        except (TypeError, ValueError):
            names = []
        attrs = getattr(component, "__dict__", {})
        params = {name: attrs[name] for name in names if name in attrs}
    for name, value in sorted(params.items()):
        if name.startswith("_") or "key" in name.lower() or name in ignore:
            continue
        if value is None or isinstance(value, str | int | float | bool):
            out[name] = value
        elif isinstance(value, list | tuple) and all(
            isinstance(v, str | int | float | bool) for v in value
        ):
            out[name] = list(value)
        elif inspect.isroutine(value):
            out[name] = f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
        elif hasattr(value, "__dict__") or hasattr(type(value), "__slots__"):
            out[name] = component_identity(value, _depth=_depth + 1)
    return out


def _identity_json(component: object) -> str:
    return json.dumps(component_identity(component), sort_keys=True, ensure_ascii=False)


def _sha256(*parts: object) -> str:
    payload = json.dumps(parts, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


class BuildCache:
    """Summaries and embeddings of a build, persisted in ``directory/cache.sqlite3``.

    Args:
        directory: where the cache lives; ``raptor build`` uses ``OUT/.raptor-cache``.

    The database is opened on first use.  A file that SQLite cannot read (not a database,
    or damaged beyond what its journal repairs) is renamed ``*.corrupt-<time>`` with a
    warning and a new cache is started: the cache only saves money, it never stops a build.

    Examples:
        >>> import tempfile
        >>> with BuildCache(tempfile.mkdtemp()) as cache:
        ...     key = BuildCache.summary_key("model-a", ["some text"], 100)
        ...     cache.put_summary(key, "a summary")
        ...     cache.get_summary(key)
        'a summary'
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = directory
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"BuildCache({str(self.directory)!r})"

    def __enter__(self) -> BuildCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def path(self) -> Path:
        """The SQLite file."""
        return Path(self.directory) / CACHE_FILE

    # -- keys ----------------------------------------------------------------------------------
    @staticmethod
    def summary_key(namespace: str, texts: Sequence[str], max_tokens: int) -> str:
        """Key of the summary of ``texts`` by the component identified by ``namespace``."""
        return _sha256("summary", namespace, list(texts), int(max_tokens))

    @staticmethod
    def embedding_key(namespace: str, text: str) -> str:
        """Key of the document embedding of ``text`` by the component ``namespace``."""
        return _sha256("embedding", namespace, text)

    # -- connection ----------------------------------------------------------------------------
    def _open(self) -> sqlite3.Connection:
        directory = Path(self.directory)
        if directory.exists() and not directory.is_dir():
            msg = f"cache directory {directory} exists and is not a directory"
            raise InvalidParameterError(msg)
        directory.mkdir(parents=True, exist_ok=True)
        try:
            return self._connect()
        except sqlite3.DatabaseError as exc:
            aside = self.path.with_name(f"{CACHE_FILE}.corrupt-{int(time.time())}")
            logger.warning(
                "build cache %s is unreadable (%s): moved to %s, starting afresh",
                self.path,
                exc,
                aside,
            )
            self.path.replace(aside)
            for suffix in ("-wal", "-shm"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
            return self._connect()

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: autocommit; every write below is its own explicit transaction.
        conn = sqlite3.connect(
            self.path, timeout=30.0, check_same_thread=False, isolation_level=None
        )
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            # FULL: a commit is on disk when it returns, so a killed build keeps every answer
            # it had received.  One fsync per answer is nothing next to a model call.
            conn.execute("PRAGMA synchronous=FULL")
            conn.executescript(_SCHEMA)
            row = conn.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()
            if row is None:
                conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (_SCHEMA_VERSION,))
            elif row[0] != _SCHEMA_VERSION:
                msg = f"cache schema {row[0]!r}, expected {_SCHEMA_VERSION!r}"
                raise sqlite3.DatabaseError(msg)
        except BaseException:
            conn.close()
            raise
        return conn

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            self._conn = self._open()
        return self._conn

    def close(self) -> None:
        """Close the database (it is reopened on next use)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def clear(self) -> None:
        """Delete every entry."""
        with self._lock:
            db = self._db()
            db.execute("BEGIN IMMEDIATE")
            db.execute("DELETE FROM summaries")
            db.execute("DELETE FROM embeddings")
            db.execute("COMMIT")

    def stats(self) -> dict[str, int]:
        """Number of stored summaries and embeddings."""
        with self._lock:
            db = self._db()
            summaries = db.execute("SELECT COUNT(*) FROM summaries").fetchone()[0]
            embeddings = db.execute("SELECT COUNT(*) FROM embeddings").fetchone()[0]
        return {"summaries": int(summaries), "embeddings": int(embeddings)}

    def _write(self, sql: str, rows: Iterable[tuple[Any, ...]]) -> None:
        with self._lock:
            db = self._db()
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany(sql, rows)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    # -- summaries -----------------------------------------------------------------------------
    def get_summary(self, key: str) -> str | None:
        """The stored summary, or None."""
        with self._lock:
            row = (
                self._db().execute("SELECT summary FROM summaries WHERE key = ?", (key,)).fetchone()
            )
        return None if row is None else str(row[0])

    def put_summary(self, key: str, summary: str) -> None:
        """Store one summary durably (committed when this returns)."""
        self.put_summaries({key: summary})

    def put_summaries(self, items: Mapping[str, str]) -> None:
        """Store several summaries in one transaction."""
        now = time.time()
        self._write(
            "INSERT OR REPLACE INTO summaries VALUES (?, ?, ?)",
            ((key, str(summary), now) for key, summary in items.items()),
        )

    # -- embeddings ----------------------------------------------------------------------------
    def get_embeddings(self, keys: Iterable[str]) -> dict[str, NDArray[np.float32]]:
        """The stored vectors among ``keys`` (missing keys are absent from the result)."""
        wanted = list(dict.fromkeys(keys))
        found: dict[str, NDArray[np.float32]] = {}
        with self._lock:
            db = self._db()
            for start in range(0, len(wanted), _SQL_CHUNK):
                chunk = wanted[start : start + _SQL_CHUNK]
                marks = ",".join("?" * len(chunk))
                query = f"SELECT key, dim, vector FROM embeddings WHERE key IN ({marks})"
                for key, dim, blob in db.execute(query, chunk):
                    vector = np.frombuffer(blob, dtype="<f4")
                    if vector.shape[0] == dim:  # a damaged row is a miss, not a wrong answer
                        found[str(key)] = vector.astype(np.float32)
        return found

    def put_embeddings(self, items: Mapping[str, NDArray[np.float32]]) -> None:
        """Store vectors in one transaction (committed when this returns)."""
        now = time.time()
        rows = []
        for key, vector in items.items():
            arr = np.ascontiguousarray(vector, dtype="<f4").reshape(-1)
            rows.append((key, int(arr.shape[0]), arr.tobytes(), now))
        self._write("INSERT OR REPLACE INTO embeddings VALUES (?, ?, ?, ?)", rows)


class _CacheCounters:
    """Hit/miss counters of a cached wrapper, merged into the inner component's usage."""

    def __init__(self, inner: object) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def count(self, *, hits: int = 0, misses: int = 0) -> None:
        with self._lock:
            self.hits += hits
            self.misses += misses

    def snapshot(self) -> dict[str, int]:
        """The inner component's usage (if it reports any) plus ``cache_hits``/``cache_misses``."""
        inner = getattr(getattr(self._inner, "usage", None), "snapshot", None)
        out = {k: int(v) for k, v in dict(inner()).items()} if callable(inner) else {}
        with self._lock:
            out["cache_hits"] = self.hits
            out["cache_misses"] = self.misses
        return out


def _valid_summary(summary: object) -> bool:
    return isinstance(summary, str) and bool(summary.strip())


class CachedSummarizer:
    """A :class:`~raptor_core.types.Summarizer` that answers from a :class:`BuildCache` first.

    Only misses reach the wrapped summariser, and each answer is committed to the cache
    before it is returned, so a build killed at any point keeps every summary it received.
    Empty answers are not cached (the builder rejects them; a rerun asks again).

    Args:
        summarizer: the summariser to wrap (sync, async, and ``summarize_batch`` when it has
            one, are all passed through).
        cache: where answers are stored.
        namespace: the identity part of the keys; by default the JSON of
            :func:`component_identity` of ``summarizer``.

    Attributes:
        usage: ``usage.snapshot()`` gives the wrapped summariser's usage (if it keeps one)
            plus ``cache_hits`` and ``cache_misses``.
    """

    def __init__(
        self, summarizer: Summarizer, cache: BuildCache, *, namespace: str | None = None
    ) -> None:
        self.summarizer = summarizer
        self.cache = cache
        self.namespace = namespace if namespace is not None else _identity_json(summarizer)
        self.usage = _CacheCounters(summarizer)

    def __repr__(self) -> str:
        return f"CachedSummarizer({self.summarizer!r}, {self.cache!r})"

    def _lookup(self, texts: Sequence[str], max_tokens: int) -> tuple[str, str | None]:
        key = BuildCache.summary_key(self.namespace, texts, max_tokens)
        hit = self.cache.get_summary(key)
        self.usage.count(hits=hit is not None, misses=hit is None)
        return key, hit

    def _store(self, key: str, summary: object) -> None:
        if _valid_summary(summary):
            self.cache.put_summary(key, str(summary))

    def summarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        """The cached summary, or the wrapped summariser's (then cached)."""
        key, hit = self._lookup(texts, max_tokens)
        if hit is not None:
            return hit
        summary = self.summarizer.summarize(texts, max_tokens=max_tokens)
        self._store(key, summary)
        return summary

    async def asummarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        """Async :meth:`summarize` (native when the wrapped summariser is async)."""
        key, hit = self._lookup(texts, max_tokens)
        if hit is not None:
            return hit
        if isinstance(self.summarizer, AsyncSummarizer):
            summary = await self.summarizer.asummarize(texts, max_tokens=max_tokens)
        else:
            summary = await asyncio.to_thread(
                self.summarizer.summarize, texts, max_tokens=max_tokens
            )
        self._store(key, summary)
        return summary

    @property
    def summarize_batch(self) -> Any:
        """``summarize_batch`` of the wrapped summariser, through the cache (only if it has one).

        Raises:
            AttributeError: the wrapped summariser has no ``summarize_batch``.
        """
        if not callable(getattr(self.summarizer, "summarize_batch", None)):
            msg = f"{type(self.summarizer).__name__} has no summarize_batch"
            raise AttributeError(msg)
        return self._summarize_batch

    def _summarize_batch(self, clusters: Sequence[Sequence[str]], *, max_tokens: int) -> list[str]:
        looked = [self._lookup(texts, max_tokens) for texts in clusters]
        out: list[Any] = [hit for _, hit in looked]
        missing = [i for i, (_, hit) in enumerate(looked) if hit is None]
        if missing:
            batch = self.summarizer.summarize_batch  # type: ignore[attr-defined]
            answers = list(batch([clusters[i] for i in missing], max_tokens=max_tokens))
            fresh = {}
            for i, answer in zip(missing, answers, strict=False):
                out[i] = answer
                if _valid_summary(answer):
                    fresh[looked[i][0]] = str(answer)
            if fresh:
                self.cache.put_summaries(fresh)
        return out


class CachedEmbedder:
    """An :class:`~raptor_core.types.Embedder` that answers document embeddings from a cache.

    Texts already embedded (in this build, an earlier one, or twice in one call) are not sent
    again.  Misses go to the wrapped embedder in groups of ``batch_size x max_concurrency``
    texts (its own attributes, when it has them) and each group is committed as soon as it
    returns, so a killed build loses at most the group in flight.  Vectors that are not
    finite or are all zero are returned but not cached (the builder rejects them).  Query
    embeddings are not cached.

    Args:
        embedder: the embedder to wrap.
        cache: where vectors are stored.
        namespace: the identity part of the keys; by default the JSON of
            :func:`component_identity` of ``embedder``.
    """

    def __init__(
        self, embedder: Embedder, cache: BuildCache, *, namespace: str | None = None
    ) -> None:
        self.embedder = embedder
        self.cache = cache
        self.namespace = namespace if namespace is not None else _identity_json(embedder)
        self.usage = _CacheCounters(embedder)

    def __repr__(self) -> str:
        return f"CachedEmbedder({self.embedder!r}, {self.cache!r})"

    def _group_size(self, n: int) -> int:
        batch = getattr(self.embedder, "batch_size", None)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            return max(n, 1)
        concurrency = getattr(self.embedder, "max_concurrency", 1)
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            concurrency = 1
        return batch * concurrency

    def _keep(
        self,
        group: list[str],
        texts: list[str],
        vectors: object,
        found: dict[str, NDArray[np.float32]],
    ) -> None:
        arr = np.asarray(vectors, dtype=np.float32)
        if arr.ndim != 2 or arr.shape[0] != len(texts):
            msg = (
                f"embedder returned shape {arr.shape} for {len(texts)} texts, not ({len(texts)}, d)"
            )
            raise EmbeddingError(msg)
        good = np.all(np.isfinite(arr), axis=1) & np.any(arr != 0.0, axis=1)
        fresh = {key: arr[i] for i, key in enumerate(group) if good[i]}
        if fresh:
            self.cache.put_embeddings(fresh)
        found.update({key: arr[i] for i, key in enumerate(group)})

    @staticmethod
    def _assemble(keys: list[str], found: dict[str, NDArray[np.float32]]) -> NDArray[np.float32]:
        if not keys:
            return np.zeros((0, 0), dtype=np.float32)
        dims = {found[k].shape[0] for k in keys}
        if len(dims) > 1:
            msg = f"cached and new vectors differ in size {sorted(dims)}: clear the build cache"
            raise EmbeddingError(msg)
        return np.stack([found[k] for k in keys])

    def embed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Embed texts, from the cache where possible; ``(len(texts), d)``."""
        texts = list(texts)
        keys = [BuildCache.embedding_key(self.namespace, t) for t in texts]
        found, groups = self._misses(keys, texts)
        for group, group_texts in groups:
            self._keep(group, group_texts, self.embedder.embed_documents(group_texts), found)
        return self._assemble(keys, found)

    async def aembed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Async :meth:`embed_documents` (native when the wrapped embedder is async)."""
        texts = list(texts)
        keys = [BuildCache.embedding_key(self.namespace, t) for t in texts]
        found, groups = await asyncio.to_thread(self._misses, keys, texts)
        for group, group_texts in groups:
            if isinstance(self.embedder, AsyncEmbedder):
                vectors = await self.embedder.aembed_documents(group_texts)
            else:
                vectors = await asyncio.to_thread(self.embedder.embed_documents, group_texts)
            await asyncio.to_thread(self._keep, group, group_texts, vectors, found)
        return self._assemble(keys, found)

    def _misses(
        self, keys: list[str], texts: list[str]
    ) -> tuple[dict[str, NDArray[np.float32]], list[tuple[list[str], list[str]]]]:
        found = self.cache.get_embeddings(keys)
        missing: dict[str, str] = {}
        for key, text in zip(keys, texts, strict=True):
            if key not in found:
                missing.setdefault(key, text)
        self.usage.count(hits=len(texts) - len(missing), misses=len(missing))
        todo = list(missing.items())
        size = self._group_size(len(todo))
        groups = []
        for start in range(0, len(todo), size):
            part = todo[start : start + size]
            groups.append(([k for k, _ in part], [t for _, t in part]))
        return found, groups

    def embed_query(self, text: str) -> NDArray[np.float32]:
        """Embed a query with the wrapped embedder (queries are not cached)."""
        return self.embedder.embed_query(text)

    async def aembed_query(self, text: str) -> NDArray[np.float32]:
        """Async :meth:`embed_query`."""
        if isinstance(self.embedder, AsyncEmbedder):
            return await self.embedder.aembed_query(text)
        return await asyncio.to_thread(self.embedder.embed_query, text)
