"""JSON we read (files, store records, cache rows) that is nested or sized to break the parser.

``json.loads`` raises ``RecursionError`` on nesting deeper than the interpreter's stack and a
plain ``ValueError`` (not ``JSONDecodeError``) on an integer past Python's digit limit.  Each
reader below must turn both into its own typed error (or its documented "ignored" path).
"""

from __future__ import annotations

import glob
import json
import sqlite3
from pathlib import Path

import pytest

from raptor_core.backends.onnx import ONNX_FORMAT, export_info
from raptor_core.build.cache import BuildCache, _digest
from raptor_core.cli.readers import read_documents
from raptor_core.evaluation.data import load_documents
from raptor_core.exceptions import InvalidInputError, TreeFormatError
from raptor_core.store.codec import node_from_metadata, node_metadata
from raptor_core.tree import Node

DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = "1" * 5000

HOSTILE = pytest.mark.parametrize("payload", [DEEP, HUGE_INT], ids=["deep", "huge-int"])


@HOSTILE
def test_build_cache_job_record_is_ignored(tmp_path: Path, payload: str) -> None:
    cache = BuildCache(tmp_path)
    key = BuildCache.job_key("ns", ["request"])
    cache.put_job(key, {"id": "batch_1"})
    [db] = glob.glob(str(tmp_path / "**" / "*.sqlite3"), recursive=True)
    with sqlite3.connect(db) as con:  # a record that passes its (unkeyed) digest
        con.execute(
            "UPDATE jobs SET value = ?, digest = ? WHERE key = ?",
            (payload, _digest("job", key, payload.encode()), key),
        )
    con.close()
    assert BuildCache(tmp_path).get_job(key) is None


@HOSTILE
def test_onnx_export_metadata(tmp_path: Path, payload: str) -> None:
    (tmp_path / "model.onnx").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "raptor-onnx.json").write_text(
        '{"format": "%s", "dim": %s}' % (ONNX_FORMAT, payload)  # noqa: UP031
    )
    # export_info answers None for a directory that is not a usable export.
    assert export_info(tmp_path) is None


@HOSTILE
def test_evaluation_jsonl(tmp_path: Path, payload: str) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text('{"doc_id": "a", "text": "x"}\n{"doc_id": %s}\n' % payload)  # noqa: UP031
    with pytest.raises(InvalidInputError, match=r"docs\.jsonl:2 is not valid JSON"):
        load_documents(path)


@HOSTILE
def test_cli_jsonl_input(tmp_path: Path, payload: str) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n{"text": %s}\n' % payload)  # noqa: UP031
    with pytest.raises(InvalidInputError, match=r"docs\.jsonl:2 is not valid JSON"):
        read_documents([str(path)])


@HOSTILE
@pytest.mark.parametrize("key", ["raptor_metadata", "raptor_children"])
def test_store_record(payload: str, key: str) -> None:
    node = Node(id="a", text="cats purr", layer=0, token_count=2, doc_id="d", span=(0, 9))
    meta = dict(node_metadata(node))
    meta[key] = payload
    with pytest.raises(TreeFormatError, match="'a' in the vector store is not a RAPTOR node"):
        node_from_metadata("a", node.text, meta)


def test_readers_still_read_good_json(tmp_path: Path) -> None:
    """The wider catch changes nothing for valid input."""
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"doc_id": "a", "text": "cats purr"}) + "\n")
    assert [d.doc_id for d in load_documents(path)] == ["a"]
    node = Node(id="a", text="cats purr", layer=0, token_count=2, doc_id="d", span=(0, 9))
    assert node_from_metadata("a", node.text, node_metadata(node)) == node


def test_evaluation_jsonl_not_in_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "questions.jsonl"
    path.write_bytes(
        b'{"doc_id": "a", "text": "x"}\n' + '{"doc_id": "caf\u00e9"}\n'.encode("latin-1")
    )
    with pytest.raises(InvalidInputError, match=r"questions\.jsonl:2 is not valid UTF-8"):
        load_documents(path)


def test_evaluation_jsonl_keeps_its_byte_order_mark_tolerance(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"doc_id": "a", "text": "x"}\r\n')
    assert [d.doc_id for d in load_documents(path)] == ["a"]
