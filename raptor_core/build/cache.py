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
little-endian float32 bytes and summaries as text, each with a SHA-256 digest of its key and
value that is checked on every read: an entry that fails it (truncated, edited, a vector of
the wrong length) is logged, deleted and recomputed, never served.  Nothing is ever pickled,
and nothing read from the file chooses code, a class, a URL or a path.

Several threads and processes may share a cache, and never pay twice for one key: before a
call, the caller *claims* the keys it is missing (a row in the ``claims`` table, taken in a
``BEGIN IMMEDIATE`` transaction, so exactly one claimant wins); the others poll until the
answer is committed.  A claim is taken over when its process is gone (same host: the PID no
longer runs), when its lease has expired, or when a waiter has waited a whole lease itself,
so a crashed or stuck claimant delays the others by at most ``lease`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import inspect
import json
import logging
import math
import os
import secrets
import socket
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
from numpy.typing import NDArray

from raptor_core.exceptions import (
    CacheError,
    EmbeddingError,
    InvalidParameterError,
    SummarizationError,
)
from raptor_core.types import AsyncEmbedder, AsyncSummarizer, Embedder, Summarizer

__all__ = [
    "CACHE_FILE",
    "DEFAULT_LEASE",
    "BuildCache",
    "CachedEmbedder",
    "CachedSummarizer",
    "component_identity",
]

logger = logging.getLogger(__name__)

CACHE_FILE = "cache.sqlite3"
#: Seconds a claim holds off other processes wanting the same answer: longer than the
#: slowest call the OpenAI backends make with their defaults (60 s x 7 attempts plus backoff).
DEFAULT_LEASE = 600.0
# "1": no digests, no claims (migrated on open); "2": digests and the claims table.
_SCHEMA_VERSION = "2"
_SQL_CHUNK = 500  # keys per SELECT ... IN (...), well under SQLite's variable limit
_BUSY_TIMEOUT = 30.0  # seconds SQLite waits for another writer (every transaction is short)
_POLL_FIRST, _POLL_MAX = 0.02, 0.25  # a waiter's polling interval grows from/to these

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS summaries (key TEXT PRIMARY KEY, summary TEXT NOT NULL, "
    "created REAL NOT NULL, digest TEXT NOT NULL DEFAULT '')",
    "CREATE TABLE IF NOT EXISTS embeddings (key TEXT PRIMARY KEY, dim INTEGER NOT NULL, "
    "vector BLOB NOT NULL, created REAL NOT NULL, digest TEXT NOT NULL DEFAULT '')",
    "CREATE TABLE IF NOT EXISTS claims (key TEXT PRIMARY KEY, token TEXT NOT NULL, "
    "host TEXT NOT NULL, pid INTEGER NOT NULL, expires REAL NOT NULL)",
    # Long-running remote jobs (an OpenAI batch) started for a set of requests: a rerun finds
    # the job here and waits for it instead of paying for a second one.  A new table in the
    # same schema version: older versions never read it, and it needs no migration.
    "CREATE TABLE IF NOT EXISTS jobs (key TEXT PRIMARY KEY, value TEXT NOT NULL, "
    "created REAL NOT NULL, digest TEXT NOT NULL)",
)

Kind = Literal["summary", "embedding"]
T = TypeVar("T")


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


# -- integrity ---------------------------------------------------------------------------------
def _digest(kind: str, key: str, value: bytes) -> str:
    # The key is hashed with the value, so a row copied under another key fails too.
    h = hashlib.sha256(kind.encode("ascii") + b"\0" + key.encode("utf-8") + b"\0")
    h.update(value)
    return h.hexdigest()


def _summary_bytes(summary: str) -> bytes:
    return summary.encode("utf-8", "surrogatepass")


def _valid_summary(summary: object) -> bool:
    return isinstance(summary, str) and bool(summary.strip())


def _usable_vector(vector: object) -> bool:
    arr = np.asarray(vector)
    return bool(arr.ndim == 1 and arr.size and np.all(np.isfinite(arr)) and np.any(arr != 0.0))


def _check_summary(key: str, summary: object, digest: object) -> str:
    """Why a stored summary cannot be served ("" when it can)."""
    if not isinstance(summary, str):
        return f"summary stored as {type(summary).__name__}, not text"
    if not summary.strip():
        return "empty summary"
    if digest != _digest("summary", key, _summary_bytes(summary)):
        return "digest mismatch (truncated or edited)"
    return ""


def _check_vector(
    key: str, dim: object, blob: object, digest: object
) -> tuple[NDArray[np.float32] | None, str]:
    """The stored vector, or None and why it cannot be served."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        return None, f"dimension {dim!r}"
    if not isinstance(blob, bytes):
        return None, f"vector stored as {type(blob).__name__}, not bytes"
    if len(blob) != 4 * dim:
        return None, f"{len(blob)} bytes for {dim} float32 values"
    if digest != _digest("embedding", key, blob):
        return None, "digest mismatch (edited)"
    vector = np.frombuffer(blob, dtype="<f4").astype(np.float32)
    if not _usable_vector(vector):
        return None, "NaN, infinite or all-zero vector"
    return vector, ""


# -- claims ------------------------------------------------------------------------------------
# Tokens of the claims this process holds.  A claim row with this process's PID but a token
# not in here was left by an earlier process that had the same PID: it is taken over.
_HELD: set[str] = set()
_HELD_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def _host() -> str:
    return socket.gethostname()


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (True when that cannot be told)."""
    if os.name != "posix":
        # Windows has no harmless probe (os.kill there terminates); the lease decides.
        return True
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, only existence is checked
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, under another user
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:  # not Linux, or it just ended
        return True
    # A killed process its parent has not reaped yet is a zombie: it will never answer.
    # The state letter follows the command name, which is in parentheses and may hold ")".
    return stat.rpartition(b")")[2].split()[:1] != [b"Z"]


def _stale(row: Sequence[object], now: float) -> str:
    """Why a claim row no longer holds ("" while it does)."""
    token, host, pid, expires = row
    if (
        not isinstance(token, str)
        or not isinstance(host, str)
        or isinstance(pid, bool)
        or not isinstance(pid, int)
        or not 0 < pid < 2**31  # 0 and negative PIDs name process groups: never probe them
        or isinstance(expires, bool)
        or not isinstance(expires, int | float)
        or not math.isfinite(expires)
    ):
        return "unreadable claim"
    if expires <= now:
        return f"its lease (process {pid} on {host!r}) has expired"
    if host != _host():
        return ""  # another machine or container: only the lease tells
    if pid == os.getpid():
        with _HELD_LOCK:
            held = token in _HELD
        return "" if held else f"it was left by an earlier process {pid}"
    return "" if _pid_alive(pid) else f"process {pid} is gone"


@dataclass(slots=True)
class _Claim:
    """What one claim transaction found and took."""

    found: dict[str, Any]
    token: str | None = None
    keys: list[str] = field(default_factory=list)  # claimed for the caller to compute
    busy: list[str] = field(default_factory=list)  # held by a live claimant elsewhere


class _DamagedCache(CacheError):
    """The file is not a cache this version can read (:meth:`BuildCache.clear` resets it)."""


def _error_kind(exc: sqlite3.Error) -> str:
    text = str(exc).lower()
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    primary = code & 0xFF if isinstance(code, int) else None
    if primary in {5, 6} or "locked" in text or "busy" in text:  # SQLITE_BUSY, SQLITE_LOCKED
        return "busy"
    if (
        primary in {11, 26}  # SQLITE_CORRUPT, SQLITE_NOTADB
        or "not a database" in text
        or "malformed" in text
        or "no such table" in text
        or "no such column" in text
    ):
        return "damaged"
    return "other"


def _enable_wal(conn: sqlite3.Connection) -> None:
    """Switch ``conn`` to write-ahead logging, waiting out other connections that hold a lock.

    SQLite answers a journal-mode change with "database is locked" at once, without its busy
    handler, while another connection is creating or preparing the same file (several threads
    or processes opening one new cache); so wait and retry here, up to the busy timeout.
    """
    deadline = time.monotonic() + _BUSY_TIMEOUT
    delay = 0.005
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            busy = "locked" in str(exc) or "busy" in str(exc)
            if not busy or time.monotonic() >= deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


class BuildCache:
    """Summaries and embeddings of a build, persisted in ``directory/cache.sqlite3``.

    Safe to share between threads and processes (see the module docstring): a key one of them
    is already asking the model for is waited for, not bought again.

    Args:
        directory: where the cache lives; ``raptor build`` uses ``OUT/.raptor-cache``.
        lease: seconds another process's claim on a key is honoured: a waiter takes the key
            over when its claimant's lease has expired, or after waiting that long itself.
            A claimant on this host whose process is gone is taken over at once.

    The database is opened on first use.  An entry failing its digest is treated as a miss:
    logged, deleted and recomputed.  A file that is not a cache this version can read (not
    SQLite, damaged, another application's database, a newer schema) raises
    :class:`~raptor_core.exceptions.CacheError`; :meth:`clear` (``raptor build --no-resume``)
    replaces such a file with an empty cache.  It is never moved or deleted behind the user's
    back: another process may be using it.

    Examples:
        >>> import tempfile
        >>> with BuildCache(tempfile.mkdtemp()) as cache:
        ...     key = BuildCache.summary_key("model-a", ["some text"], 100)
        ...     cache.put_summary(key, "a summary")
        ...     cache.get_summary(key)
        'a summary'
    """

    def __init__(self, directory: str | os.PathLike[str], *, lease: float = DEFAULT_LEASE) -> None:
        self.directory = directory
        self.lease = lease
        self._conn: sqlite3.Connection | None = None
        self._conn_pid = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"BuildCache({str(self.directory)!r})"

    def __enter__(self) -> BuildCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # A cache travels to another process (multiprocessing) as its settings; it reopens there.
    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory, "lease": self.lease}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.__init__(state["directory"], lease=state["lease"])  # type: ignore[misc]

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
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            msg = f"cannot create the build cache directory {directory}: {exc}"
            raise CacheError(msg) from exc
        # isolation_level=None: autocommit; every write below is its own explicit transaction.
        conn = sqlite3.connect(
            self.path, timeout=_BUSY_TIMEOUT, check_same_thread=False, isolation_level=None
        )
        try:
            _enable_wal(conn)
            # FULL: a commit is on disk when it returns, so a killed build keeps every answer
            # it had received.  One fsync per answer is nothing next to a model call.
            conn.execute("PRAGMA synchronous=FULL")
            with _transaction(conn):
                self._prepare(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _prepare(self, conn: sqlite3.Connection) -> None:
        """Create, check or migrate the schema (inside a write transaction: one process does it)."""
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        if tables and "meta" not in tables:
            msg = "it is an SQLite database, but not a raptor build cache"
            raise self._damaged(msg)
        row = (
            conn.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()
            if tables
            else None
        )
        version = None if row is None else row[0]
        if tables and version == "1":
            self._migrate_v1(conn)
        elif tables and version != _SCHEMA_VERSION:
            shown = repr(version)[:40]
            msg = (
                f"the build cache {self.path} has schema {shown}, which this version of "
                f"raptor-retriever does not read (it reads {_SCHEMA_VERSION}): upgrade "
                f"raptor-retriever, or delete {self.directory} (or build with --no-resume) to "
                "start the cache afresh"
            )
            raise _DamagedCache(msg)
        for statement in _SCHEMA:
            conn.execute(statement)
        if version != _SCHEMA_VERSION:  # new or migrated
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)", (_SCHEMA_VERSION,))

    def _migrate_v1(self, conn: sqlite3.Connection) -> None:
        """Schema 1 had no digests: add them to the rows that pass the checks of the time."""
        logger.info("migrating build cache %s to schema %s", self.path, _SCHEMA_VERSION)
        for table in ("summaries", "embeddings"):
            conn.execute(f"ALTER TABLE {table} ADD COLUMN digest TEXT NOT NULL DEFAULT ''")
        bad, fixed = [], []
        for key, summary in conn.execute("SELECT key, summary FROM summaries").fetchall():
            if isinstance(key, str) and _valid_summary(summary):
                fixed.append((_digest("summary", key, _summary_bytes(summary)), key))
            else:
                bad.append((key,))
        conn.executemany("UPDATE summaries SET digest = ? WHERE key = ?", fixed)
        conn.executemany("DELETE FROM summaries WHERE key = ?", bad)
        bad, fixed = [], []
        for key, dim, blob in conn.execute("SELECT key, dim, vector FROM embeddings").fetchall():
            ok = isinstance(key, str) and isinstance(dim, int) and isinstance(blob, bytes)
            if ok and dim > 0 and len(blob) == 4 * dim:
                fixed.append((_digest("embedding", key, blob), key))
            else:
                bad.append((key,))
        conn.executemany("UPDATE embeddings SET digest = ? WHERE key = ?", fixed)
        conn.executemany("DELETE FROM embeddings WHERE key = ?", bad)

    def _damaged(self, detail: str) -> _DamagedCache:
        msg = (
            f"the build cache {self.path} is damaged or not a raptor build cache ({detail}): "
            f"delete {self.directory}, or build with --no-resume (BuildCache.clear()), to start "
            "the cache afresh"
        )
        return _DamagedCache(msg)

    def _error(self, exc: sqlite3.Error) -> CacheError:
        kind = _error_kind(exc)
        if kind == "damaged":
            return self._damaged(str(exc))
        if kind == "busy":
            msg = (
                f"the build cache {self.path} stayed locked by another process for more than "
                f"{_BUSY_TIMEOUT:.0f}s ({exc}): check for a stuck process, or give this build "
                "its own cache directory"
            )
        else:
            msg = (
                f"cannot use the build cache {self.path} ({exc}): check the directory's "
                "permissions and free space"
            )
        return CacheError(msg)

    @contextlib.contextmanager
    def _session(self) -> Iterator[sqlite3.Connection]:
        """The connection, under this object's lock, with SQLite errors made typed."""
        with self._lock:
            if self._conn is not None and self._conn_pid != os.getpid():
                # Forked: an SQLite connection must not be used across fork; open our own.
                self._conn = None
            try:
                if self._conn is None:
                    self._conn = self._open()
                    self._conn_pid = os.getpid()
                yield self._conn
            except sqlite3.Error as exc:
                raise self._error(exc) from exc

    def close(self) -> None:
        """Close the database (it is reopened on next use)."""
        with self._lock:
            if self._conn is not None:
                if self._conn_pid == os.getpid():
                    self._conn.close()
                self._conn = None

    def clear(self) -> None:
        """Delete every entry; a file that is not a readable cache is replaced by an empty one.

        Claims of builds running elsewhere, and records of pending batch jobs, are kept, so
        they still do not pay twice.
        """
        try:
            with self._session() as db, _transaction(db):
                db.execute("DELETE FROM summaries")
                db.execute("DELETE FROM embeddings")
        except _DamagedCache as exc:
            logger.warning("replacing the unusable build cache %s: %s", self.path, exc)
            self.close()
            try:
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{self.path}{suffix}").unlink(missing_ok=True)
            except OSError as err:
                msg = f"cannot replace the unusable build cache {self.path}: {err}"
                raise CacheError(msg) from err
            with self._session():
                pass  # create the new file now, so errors surface here

    def stats(self) -> dict[str, int]:
        """Number of stored summaries and embeddings."""
        with self._session() as db:
            summaries = db.execute("SELECT COUNT(*) FROM summaries").fetchone()[0]
            embeddings = db.execute("SELECT COUNT(*) FROM embeddings").fetchone()[0]
        return {"summaries": int(summaries), "embeddings": int(embeddings)}

    # -- reading -------------------------------------------------------------------------------
    def _select(
        self, db: sqlite3.Connection, kind: Kind, keys: Sequence[str], *, purge: bool
    ) -> tuple[dict[str, Any], list[str]]:
        """Verified entries among ``keys``, and the keys whose entry failed its checks.

        With ``purge`` (inside a write transaction) the failing rows are deleted.
        """
        found: dict[str, Any] = {}
        damaged: list[str] = []
        if kind == "summary":
            query = "SELECT key, summary, digest FROM summaries WHERE key IN ({})"
        else:
            query = "SELECT key, dim, vector, digest FROM embeddings WHERE key IN ({})"
        for start in range(0, len(keys), _SQL_CHUNK):
            chunk = list(keys[start : start + _SQL_CHUNK])
            for key, *row in db.execute(query.format(",".join("?" * len(chunk))), chunk):
                value: Any
                if kind == "summary":
                    value, reason = row[0], _check_summary(key, row[0], row[1])
                else:
                    value, reason = _check_vector(key, row[0], row[1], row[2])
                if not reason:
                    found[key] = value
                    continue
                damaged.append(key)
                if purge:
                    logger.warning(
                        "build cache %s: %s entry %s… is unusable (%s): deleted, recomputing",
                        self.path,
                        kind,
                        str(key)[:12],
                        reason,
                    )
        if purge and damaged:
            table = "summaries" if kind == "summary" else "embeddings"
            db.executemany(f"DELETE FROM {table} WHERE key = ?", [(k,) for k in damaged])
        return found, damaged

    def _lookup(self, kind: Kind, keys: Sequence[str]) -> dict[str, Any]:
        """Verified entries among ``keys`` (damaged ones are deleted)."""
        wanted = list(dict.fromkeys(keys))
        with self._session() as db:
            found, damaged = self._select(db, kind, wanted, purge=False)
            if damaged:  # rare: re-read and delete under the write lock
                with _transaction(db):
                    again, _ = self._select(db, kind, damaged, purge=True)
                found.update(again)
        return found

    def get_summary(self, key: str) -> str | None:
        """The stored summary, or None (also for an entry that fails its digest)."""
        return self._lookup("summary", [key]).get(key)

    def get_embeddings(self, keys: Iterable[str]) -> dict[str, NDArray[np.float32]]:
        """The stored vectors among ``keys`` (missing or damaged keys are absent)."""
        return self._lookup("embedding", list(keys))

    # -- writing -------------------------------------------------------------------------------
    def _rows(self, kind: Kind, items: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        now = time.time()
        rows: list[tuple[Any, ...]] = []
        for key, value in items.items():
            if kind == "summary":
                text = str(value)
                rows.append((key, text, now, _digest("summary", key, _summary_bytes(text))))
            else:
                arr = np.ascontiguousarray(value, dtype="<f4").reshape(-1)
                blob = arr.tobytes()
                rows.append((key, int(arr.shape[0]), blob, now, _digest("embedding", key, blob)))
        return rows

    def _store(self, kind: Kind, items: Mapping[str, Any], claim: _Claim | None = None) -> None:
        """Commit entries and, in the same transaction, release ``claim``."""
        rows = self._rows(kind, items)
        try:
            with self._session() as db, _transaction(db):
                if kind == "summary":
                    sql = "INSERT OR REPLACE INTO summaries (key, summary, created, digest) VALUES (?, ?, ?, ?)"
                else:
                    sql = "INSERT OR REPLACE INTO embeddings (key, dim, vector, created, digest) VALUES (?, ?, ?, ?, ?)"
                db.executemany(sql, rows)
                if claim is not None and claim.token is not None:
                    db.execute("DELETE FROM claims WHERE token = ?", (claim.token,))
        finally:
            if claim is not None and claim.token is not None:
                with _HELD_LOCK:
                    _HELD.discard(claim.token)

    def put_summary(self, key: str, summary: str) -> None:
        """Store one summary durably (committed when this returns)."""
        self._store("summary", {key: summary})

    def put_summaries(self, items: Mapping[str, str]) -> None:
        """Store several summaries in one transaction."""
        self._store("summary", items)

    def put_embeddings(self, items: Mapping[str, NDArray[np.float32]]) -> None:
        """Store vectors in one transaction (committed when this returns)."""
        self._store("embedding", items)

    # -- remote jobs ---------------------------------------------------------------------------
    @staticmethod
    def job_key(namespace: str, requests: Sequence[object]) -> str:
        """Key of a remote job made of exactly ``requests`` (JSON-serialisable, in order)."""
        return _sha256("job", namespace, list(requests))

    def get_job(self, key: str) -> dict[str, Any] | None:
        """The record of a job started under ``key`` (None: none, or one that fails its digest).

        A record is plain JSON data (ids the service gave out); nothing in it is executed.
        """
        with self._session() as db:
            row = db.execute("SELECT value, digest FROM jobs WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        value, digest = row
        record: object = None
        if isinstance(value, str) and digest == _digest("job", key, value.encode("utf-8")):
            # A record that passes its (unkeyed) digest may still be hostile: nesting deeper
            # than the parser's stack, or an integer past Python's digit limit.
            with contextlib.suppress(ValueError, RecursionError):
                record = json.loads(value)
        if not isinstance(record, dict):
            logger.warning(
                "build cache %s: job record %s… is unusable: ignored", self.path, key[:12]
            )
            self.delete_job(key)
            return None
        return record

    def put_job(self, key: str, record: Mapping[str, Any]) -> None:
        """Record (or replace) the job started under ``key``; committed when this returns."""
        value = json.dumps(dict(record), sort_keys=True, ensure_ascii=False)
        digest = _digest("job", key, value.encode("utf-8"))
        with self._session() as db, _transaction(db):
            db.execute(
                "INSERT OR REPLACE INTO jobs (key, value, created, digest) VALUES (?, ?, ?, ?)",
                (key, value, time.time(), digest),
            )

    def delete_job(self, key: str) -> None:
        """Forget the job recorded under ``key`` (finished, or failed for good)."""
        with self._session() as db, _transaction(db):
            db.execute("DELETE FROM jobs WHERE key = ?", (key,))

    # -- claims --------------------------------------------------------------------------------
    def _claim(
        self, kind: Kind, keys: Sequence[str], *, limit: int | None, force: Iterable[str] = ()
    ) -> _Claim:
        """Read the entries of ``keys`` and claim up to ``limit`` missing ones, atomically.

        A missing key is claimed when nobody holds it, its holder is gone (see :func:`_stale`)
        or it is in ``force`` (waited for a whole lease); otherwise it is reported busy.
        """
        lease = self._lease()
        forced = set(force)
        token = secrets.token_hex(16)
        with _HELD_LOCK:  # before the commit: our other threads must see the claim as live
            _HELD.add(token)
        claimed = False
        try:
            with self._session() as db, _transaction(db):
                found, _ = self._select(db, kind, keys, purge=True)
                missing = [k for k in dict.fromkeys(keys) if k not in found]
                claim = _Claim(found=found)
                holders: dict[str, Sequence[object]] = {}
                for start in range(0, len(missing), _SQL_CHUNK):
                    chunk = missing[start : start + _SQL_CHUNK]
                    marks = ",".join("?" * len(chunk))
                    query = (
                        f"SELECT key, token, host, pid, expires FROM claims WHERE key IN ({marks})"
                    )
                    holders.update({row[0]: row[1:] for row in db.execute(query, chunk)})
                now = time.time()
                for key in missing:
                    holder = holders.get(key)
                    reason = "" if holder is None else _stale(holder, now)
                    if holder is not None and not reason and key in forced:
                        reason = f"waited {lease:g}s (the lease) for it"
                    if holder is not None and not reason:
                        claim.busy.append(key)
                    elif limit is None or len(claim.keys) < limit:
                        if holder is not None:
                            logger.info("build cache: taking over a claim: %s", reason)
                        claim.keys.append(key)
                if claim.keys:
                    owner = (token, _host(), os.getpid(), now + lease)
                    db.executemany(
                        "INSERT OR REPLACE INTO claims (key, token, host, pid, expires) "
                        "VALUES (?, ?, ?, ?, ?)",
                        [(key, *owner) for key in claim.keys],
                    )
                    claim.token = token
            claimed = bool(claim.keys)  # committed
        finally:
            if not claimed:
                with _HELD_LOCK:
                    _HELD.discard(token)
        return claim

    def _lease(self) -> float:
        lease = self.lease
        if isinstance(lease, bool) or not isinstance(lease, int | float) or not lease > 0:
            msg = f"BuildCache lease must be a positive number of seconds, got {lease!r}"
            raise InvalidParameterError(msg)
        return float(lease)

    def _release(self, claim: _Claim) -> None:
        """Give back a claim without an answer (the call failed): a waiter takes the keys."""
        if claim.token is None:
            return
        try:
            with self._session() as db, _transaction(db):
                db.execute("DELETE FROM claims WHERE token = ?", (claim.token,))
        finally:
            with _HELD_LOCK:
                _HELD.discard(claim.token)


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    """A write transaction, taken at once (``BEGIN IMMEDIATE``): one writer at a time."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


# -- fetching through the cache, shared with other threads and processes ------------------------
class _Fetch:
    """The values of some keys: from the cache, from a claimant elsewhere, or computed here.

    :meth:`step` claims what nobody is computing and returns those keys for the caller to
    compute and pass to :meth:`done`; an empty list means "everything left is being computed
    elsewhere: wait :meth:`pause` seconds and step again"; None means finished (all values in
    :attr:`values`).  On any failure the caller calls :meth:`release`.
    """

    def __init__(
        self,
        cache: BuildCache,
        kind: Kind,
        keys: Iterable[str],
        *,
        limit: int | None,
        usable: Callable[[Any], bool],
    ) -> None:
        self.cache = cache
        self.kind: Kind = kind
        self.pending = list(dict.fromkeys(keys))
        self.limit = limit
        self.usable = usable
        self.values: dict[str, Any] = {}
        self.computed = 0  # keys answered by this fetch's own calls
        self._held: _Claim | None = None
        self._abandoned = False  # release() ran: a claim taken from now on is given back
        self._lock = threading.Lock()
        self._first = True
        self._delay = _POLL_FIRST
        self._waiting_since: dict[str, float] = {}

    def _take(self, found: Mapping[str, Any]) -> None:
        self.values.update(found)
        self.pending = [k for k in self.pending if k not in found]

    def step(self) -> list[str] | None:
        """Claim keys to compute now ([]: wait), or None when every value is known."""
        if self._first:
            # Reads only: a fully cached build never takes the write lock.
            self._first = False
            self._take(self.cache._lookup(self.kind, self.pending))
        if not self.pending:
            return None
        now = time.monotonic()
        lease = self.cache._lease()
        overdue = [k for k, since in self._waiting_since.items() if now - since >= lease]
        claim = self.cache._claim(self.kind, self.pending, limit=self.limit, force=overdue)
        self._take(claim.found)
        if claim.keys:
            with self._lock:
                abandoned = self._abandoned
                if not abandoned:
                    self._held = claim
            if abandoned:
                # A cancelled async caller released this fetch while its worker thread was
                # still claiming (asyncio.run cancels the thread's task at shutdown): give the
                # claim back, or a rerun in this process would wait a whole lease for it.
                self.cache._release(claim)
                return []
            self._delay = _POLL_FIRST
            return list(claim.keys)
        if not self.pending:
            return None
        fresh = [key for key in claim.busy if key not in self._waiting_since]
        if fresh:
            self._waiting_since.update(dict.fromkeys(fresh, now))
            logger.debug(
                "build cache: waiting for another claimant of %d %s(s) (%s…)",
                len(fresh),
                self.kind,
                fresh[0][:12],
            )
        return []

    def pause(self) -> float:
        """Seconds to wait before the next :meth:`step` (growing while nothing changes)."""
        delay, self._delay = self._delay, min(_POLL_MAX, self._delay * 1.5)
        return delay

    def done(self, values: Mapping[str, Any]) -> None:
        """Keep the computed values; commit the usable ones and release the claim."""
        with self._lock:
            claim, self._held = self._held, None
        self.values.update(values)
        self.computed += len(values)
        self.pending = [k for k in self.pending if k not in values]
        store = {k: v for k, v in values.items() if self.usable(v)}
        if store or claim is not None:
            self.cache._store(self.kind, store, claim)

    def release(self) -> None:
        """Give back the claim in hand, if any (never raises: it runs while failing)."""
        with self._lock:
            self._abandoned = True
            claim, self._held = self._held, None
        if claim is not None:
            try:
                self.cache._release(claim)
            except Exception:  # the lease frees it anyway; do not hide the original error
                logger.warning("build cache: could not release a claim", exc_info=True)


def _fetch_sync(fetch: _Fetch, compute: Callable[[list[str]], Mapping[str, Any]]) -> None:
    try:
        while (keys := fetch.step()) is not None:
            if keys:
                fetch.done(compute(keys))
            else:
                time.sleep(fetch.pause())
    except BaseException:
        fetch.release()
        raise


async def _off_loop(fetch: _Fetch, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread, releasing its claim if we are cancelled meanwhile.

    A cancelled ``to_thread`` call still finishes in its thread: the claim it may take is
    released when it does, not left to the lease.
    """
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda _: fetch.release())
        raise


async def _fetch_async(
    fetch: _Fetch, compute: Callable[[list[str]], Awaitable[Mapping[str, Any]]]
) -> None:
    try:
        while (keys := await _off_loop(fetch, fetch.step)) is not None:
            if keys:
                await _off_loop(fetch, fetch.done, await compute(keys))
            else:
                await asyncio.sleep(fetch.pause())  # the event loop runs on while we wait
    except BaseException:
        fetch.release()
        raise


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

    def count_fetch(self, fetch: _Fetch, asked: int) -> None:
        """Count a fetch: what its own calls answered is a miss, everything else a hit."""
        self.count(hits=asked - fetch.computed, misses=fetch.computed)

    def snapshot(self) -> dict[str, int]:
        """The inner component's usage (if it reports any) plus ``cache_hits``/``cache_misses``."""
        inner = getattr(getattr(self._inner, "usage", None), "snapshot", None)
        out = {k: int(v) for k, v in dict(inner()).items()} if callable(inner) else {}
        with self._lock:
            out["cache_hits"] = self.hits
            out["cache_misses"] = self.misses
        return out


class CachedSummarizer:
    """A :class:`~raptor_core.types.Summarizer` that answers from a :class:`BuildCache` first.

    Only misses reach the wrapped summariser, and each answer is committed to the cache
    before it is returned, so a build killed at any point keeps every summary it received.
    A summary that another thread or process sharing the cache is already asking for is
    waited for, not requested again (a summary received that way counts as a cache hit).
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

    def _fetch(self, keys: Iterable[str], *, limit: int | None) -> _Fetch:
        return _Fetch(self.cache, "summary", keys, limit=limit, usable=_valid_summary)

    def summarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        """The cached summary, or the wrapped summariser's (then cached)."""
        key = BuildCache.summary_key(self.namespace, texts, max_tokens)
        fetch = self._fetch([key], limit=1)

        def compute(keys: list[str]) -> dict[str, Any]:
            return {key: self.summarizer.summarize(texts, max_tokens=max_tokens)}

        _fetch_sync(fetch, compute)
        self.usage.count_fetch(fetch, 1)
        return fetch.values[key]

    async def asummarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        """Async :meth:`summarize` (native when the wrapped summariser is async).

        Cache reads and writes run in a worker thread and waiting uses ``asyncio.sleep``, so
        the event loop is never blocked.
        """
        key = BuildCache.summary_key(self.namespace, texts, max_tokens)
        fetch = self._fetch([key], limit=1)

        async def compute(keys: list[str]) -> dict[str, Any]:
            if isinstance(self.summarizer, AsyncSummarizer):
                summary = await self.summarizer.asummarize(texts, max_tokens=max_tokens)
            else:
                summary = await asyncio.to_thread(
                    self.summarizer.summarize, texts, max_tokens=max_tokens
                )
            return {key: summary}

        await _fetch_async(fetch, compute)
        self.usage.count_fetch(fetch, 1)
        return fetch.values[key]

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
        keys = [BuildCache.summary_key(self.namespace, texts, max_tokens) for texts in clusters]
        by_key = dict(zip(keys, clusters, strict=True))
        fetch = self._fetch(keys, limit=None)

        def compute(claimed: list[str]) -> dict[str, Any]:
            batch = self.summarizer.summarize_batch  # type: ignore[attr-defined]
            # A summariser that runs remote jobs records them here (requires_cache = True).
            extra = (
                {"cache": self.cache} if getattr(self.summarizer, "requires_cache", False) else {}
            )
            answers = list(batch([by_key[k] for k in claimed], max_tokens=max_tokens, **extra))
            if len(answers) != len(claimed):
                msg = (
                    f"summarize_batch returned {len(answers)} summaries for {len(claimed)} clusters"
                )
                raise SummarizationError(msg)
            return dict(zip(claimed, answers, strict=True))

        _fetch_sync(fetch, compute)
        self.usage.count_fetch(fetch, len(clusters))
        return [fetch.values[k] for k in keys]


def _rows_of(vectors: object, n: int) -> NDArray[np.float32]:
    arr = np.asarray(vectors, dtype=np.float32)
    if arr.ndim != 2 or arr.shape[0] != n:
        msg = f"embedder returned shape {arr.shape} for {n} texts, not ({n}, d)"
        raise EmbeddingError(msg)
    return arr


class CachedEmbedder:
    """An :class:`~raptor_core.types.Embedder` that answers document embeddings from a cache.

    Texts already embedded (in this build, an earlier one, or twice in one call) are not sent
    again, nor are texts another thread or process sharing the cache is embedding (they are
    waited for).  Misses go to the wrapped embedder in groups of ``batch_size x
    max_concurrency`` texts (its own attributes, when it has them), each group claimed just
    before it is sent and committed as soon as it returns, so a killed build loses at most the
    group in flight.  Vectors that are not finite or are all zero are returned but not cached
    (the builder rejects them).  Query embeddings are not cached.

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

    def _group_size(self) -> int | None:
        batch = getattr(self.embedder, "batch_size", None)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            return None  # everything missing in one call
        concurrency = getattr(self.embedder, "max_concurrency", 1)
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            concurrency = 1
        return batch * concurrency

    def _fetch(self, texts: list[str]) -> tuple[list[str], dict[str, str], _Fetch]:
        keys = [BuildCache.embedding_key(self.namespace, t) for t in texts]
        by_key = dict(zip(keys, texts, strict=True))
        fetch = _Fetch(
            self.cache, "embedding", keys, limit=self._group_size(), usable=_usable_vector
        )
        return keys, by_key, fetch

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
        keys, by_key, fetch = self._fetch(texts)

        def compute(claimed: list[str]) -> dict[str, Any]:
            group = [by_key[k] for k in claimed]
            rows = _rows_of(self.embedder.embed_documents(group), len(group))
            return dict(zip(claimed, rows, strict=True))

        _fetch_sync(fetch, compute)
        self.usage.count_fetch(fetch, len(texts))
        return self._assemble(keys, fetch.values)

    async def aembed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Async :meth:`embed_documents` (native when the wrapped embedder is async)."""
        texts = list(texts)
        keys, by_key, fetch = self._fetch(texts)

        async def compute(claimed: list[str]) -> dict[str, Any]:
            group = [by_key[k] for k in claimed]
            if isinstance(self.embedder, AsyncEmbedder):
                vectors = await self.embedder.aembed_documents(group)
            else:
                vectors = await asyncio.to_thread(self.embedder.embed_documents, group)
            return dict(zip(claimed, _rows_of(vectors, len(group)), strict=True))

        await _fetch_async(fetch, compute)
        self.usage.count_fetch(fetch, len(texts))
        return self._assemble(keys, fetch.values)

    def embed_query(self, text: str) -> NDArray[np.float32]:
        """Embed a query with the wrapped embedder (queries are not cached)."""
        return self.embedder.embed_query(text)

    async def aembed_query(self, text: str) -> NDArray[np.float32]:
        """Async :meth:`embed_query`."""
        if isinstance(self.embedder, AsyncEmbedder):
            return await self.embedder.aembed_query(text)
        return await asyncio.to_thread(self.embedder.embed_query, text)
