"""The build cache never serves a damaged entry, and reads a foreign file as data, never code.

Entries are damaged by editing the SQLite rows directly, as a crash, a bad disk or a person
could; the wrappers must recompute them (and say so in the log), never return them.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Sequence

import numpy as np
import pytest
from openai_server import CORPUS, LOCALHOST, FakeOpenAIServer, openai_builder, tree_signature

from raptor_core.build.cache import CACHE_FILE, BuildCache, CachedEmbedder, CachedSummarizer
from raptor_core.exceptions import CacheError
from raptor_core.testing import EchoSummarizer, FakeEmbedder

pytestmark = [*LOCALHOST, pytest.mark.timeout(120)]

TEXTS = ["alpha beta gamma", "delta epsilon"]


class CountingEmbedder(FakeEmbedder):
    def __init__(self) -> None:
        super().__init__(8)
        self.sent: list[str] = []

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        self.sent.extend(texts)
        return super().embed_documents(texts)


def _edit(directory, *statements: str) -> None:
    with sqlite3.connect(directory / CACHE_FILE) as db:
        for statement in statements:
            db.execute(statement)


SUMMARY_DAMAGE = {
    "truncated": "UPDATE summaries SET summary = substr(summary, 1, 5)",
    "stored as bytes": "UPDATE summaries SET summary = X'00ff'",
    "digest lost": "UPDATE summaries SET digest = ''",
    "emptied": "UPDATE summaries SET summary = '   '",
}


@pytest.mark.parametrize("damage", sorted(SUMMARY_DAMAGE))
def test_damaged_summary_is_recomputed_not_served(tmp_path, caplog, damage: str) -> None:
    inner = EchoSummarizer()
    wrapped = CachedSummarizer(inner, BuildCache(tmp_path))
    good = wrapped.summarize(TEXTS, max_tokens=5)
    _edit(tmp_path, SUMMARY_DAMAGE[damage])
    with caplog.at_level(logging.WARNING, logger="raptor_core.build.cache"):
        assert wrapped.summarize(TEXTS, max_tokens=5) == good
    assert len(inner.calls) == 2  # recomputed
    assert "unusable" in caplog.text and "recomputing" in caplog.text
    assert wrapped.summarize(TEXTS, max_tokens=5) == good
    assert len(inner.calls) == 2  # and stored again, intact


def test_a_summary_copied_under_another_key_fails_its_digest(tmp_path) -> None:
    inner = EchoSummarizer()
    wrapped = CachedSummarizer(inner, BuildCache(tmp_path))
    wrapped.summarize(["first cluster"], max_tokens=5)
    wrapped.summarize(["second cluster"], max_tokens=5)
    _edit(
        tmp_path,
        "UPDATE summaries SET (summary, digest) = (SELECT summary, digest FROM summaries "
        "WHERE summary = 'first cluster') WHERE summary = 'second cluster'",
    )
    assert wrapped.summarize(["second cluster"], max_tokens=5) == "second cluster"
    assert len(inner.calls) == 3


VECTOR_DAMAGE = {
    "truncated": "UPDATE embeddings SET vector = substr(vector, 1, 8)",
    "dimension edited": "UPDATE embeddings SET dim = dim - 1",
    "bytes zeroed": "UPDATE embeddings SET vector = zeroblob(length(vector))",
    "bytes changed": "UPDATE embeddings SET vector = randomblob(length(vector))",
    "stored as text": "UPDATE embeddings SET vector = 'abcd'",
    "dimension as text": "UPDATE embeddings SET dim = 'eight'",
}


@pytest.mark.parametrize("damage", sorted(VECTOR_DAMAGE))
def test_damaged_vector_is_recomputed_not_served(tmp_path, caplog, damage: str) -> None:
    inner = CountingEmbedder()
    wrapped = CachedEmbedder(inner, BuildCache(tmp_path))
    good = wrapped.embed_documents(["cats purr", "dogs bark"])
    _edit(tmp_path, VECTOR_DAMAGE[damage] + " WHERE rowid = (SELECT min(rowid) FROM embeddings)")
    with caplog.at_level(logging.WARNING, logger="raptor_core.build.cache"):
        again = wrapped.embed_documents(["cats purr", "dogs bark"])
    np.testing.assert_array_equal(again, good)
    assert len(inner.sent) == 3  # exactly the damaged one was embedded again
    assert "unusable" in caplog.text
    assert BuildCache(tmp_path).stats()["embeddings"] == 2


def test_public_getters_skip_damaged_entries(tmp_path) -> None:
    with BuildCache(tmp_path) as cache:
        cache.put_summary("s", "a summary")
        cache.put_embeddings({"e": np.ones(4, dtype=np.float32)})
    _edit(tmp_path, SUMMARY_DAMAGE["truncated"], VECTOR_DAMAGE["truncated"])
    with BuildCache(tmp_path) as cache:
        assert cache.get_summary("s") is None
        assert cache.get_embeddings(["e"]) == {}
        assert cache.stats() == {"summaries": 0, "embeddings": 0}  # deleted


# -- the file itself ---------------------------------------------------------------------------
@pytest.mark.parametrize("schema", ["3", "99", "1; DROP TABLE summaries", "__import__('os')"])
def test_unknown_schema_is_a_typed_error(tmp_path, schema: str) -> None:
    with BuildCache(tmp_path) as cache:
        cache.put_summary("k", "kept")
    _edit(tmp_path, f"UPDATE meta SET value = '{schema.replace(chr(39), chr(39) * 2)}'")
    with pytest.raises(CacheError, match=r"schema .* does not read .*upgrade"):
        BuildCache(tmp_path).get_summary("k")
    with sqlite3.connect(tmp_path / CACHE_FILE) as db:  # the file is left as it was
        assert db.execute("SELECT summary FROM summaries").fetchall() == [("kept",)]
    cache = BuildCache(tmp_path)
    cache.clear()  # --no-resume starts afresh
    assert cache.get_summary("k") is None
    cache.put_summary("k", "new")
    assert cache.get_summary("k") == "new"
    cache.close()


def test_another_applications_database_is_a_typed_error(tmp_path) -> None:
    _edit(tmp_path, "CREATE TABLE accounts (id INTEGER, name TEXT)")
    with pytest.raises(CacheError, match="not a raptor build cache"):
        BuildCache(tmp_path).stats()


def test_a_schema_1_cache_is_migrated_and_keeps_its_entries(tmp_path) -> None:
    vector = np.arange(1, 5, dtype=np.float32)
    _edit(
        tmp_path,
        "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
        "INSERT INTO meta VALUES ('schema', '1')",
        "CREATE TABLE summaries (key TEXT PRIMARY KEY, summary TEXT NOT NULL, created REAL NOT NULL)",
        "CREATE TABLE embeddings (key TEXT PRIMARY KEY, dim INTEGER NOT NULL, "
        "vector BLOB NOT NULL, created REAL NOT NULL)",
        "INSERT INTO summaries VALUES ('s', 'an old summary', 0)",
        "INSERT INTO summaries VALUES ('blank', '', 0)",
        f"INSERT INTO embeddings VALUES ('e', 4, X'{vector.astype('<f4').tobytes().hex()}', 0)",
        "INSERT INTO embeddings VALUES ('cut', 4, X'0000', 0)",
    )
    with BuildCache(tmp_path) as cache:
        assert cache.get_summary("s") == "an old summary"
        np.testing.assert_array_equal(cache.get_embeddings(["e"])["e"], vector)
        assert cache.stats() == {"summaries": 1, "embeddings": 1}  # the unusable rows dropped
    with sqlite3.connect(tmp_path / CACHE_FILE) as db:
        assert db.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone() == ("2",)


def test_entries_are_served_as_text_never_interpreted(tmp_path) -> None:
    payload = "__import__('os').system('touch pwned') {context} ../../etc/passwd"
    inner = EchoSummarizer()
    with BuildCache(tmp_path) as cache:
        key = BuildCache.summary_key(CachedSummarizer(inner, cache).namespace, TEXTS, 5)
        cache.put_summary(key, payload)
        assert CachedSummarizer(inner, cache).summarize(TEXTS, max_tokens=5) == payload
    assert not (tmp_path / "pwned").exists() and inner.calls == []
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(CACHE_FILE)) == []


# -- through a real build --------------------------------------------------------------------------
def test_a_rebuild_recomputes_exactly_the_damaged_entries(tmp_path) -> None:
    with FakeOpenAIServer() as srv:
        first = openai_builder(srv.url, cache=tmp_path).build(CORPUS)
    with sqlite3.connect(tmp_path / CACHE_FILE) as db:
        (summary,) = db.execute("SELECT summary FROM summaries LIMIT 1").fetchone()
        db.execute(
            "UPDATE summaries SET summary = substr(summary, 1, 4) WHERE summary = ?", (summary,)
        )
        (key,) = db.execute("SELECT key FROM embeddings ORDER BY key LIMIT 1").fetchone()
        db.execute("UPDATE embeddings SET vector = substr(vector, 1, 20) WHERE key = ?", (key,))
    with FakeOpenAIServer() as srv:
        again = openai_builder(srv.url, cache=tmp_path).build(CORPUS)
        chat, embeddings = srv.requests("chat"), srv.requests("embeddings")
    assert len(chat) == 1 and chat[0].ok  # the truncated summary, bought again
    assert len(embeddings) == 1 and len(embeddings[0].inputs) == 1  # the truncated vector
    assert tree_signature(again) == tree_signature(first)
    np.testing.assert_array_equal(again.embeddings, first.embeddings)
    assert summary in {n.text for n in again.nodes}
