"""LangChain's Milvus store (Milvus Lite, a local file) through :class:`MilvusDialect`.

Milvus Lite starts a server process per file, so every store of this module shares one
file, each in a collection of its own.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("langchain_milvus")
pytest.importorskip("milvus_lite")

from langchain_core.documents import Document
from langchain_milvus import Milvus

from raptor_core.exceptions import InvalidParameterError
from raptor_core.testing import FakeEmbedder, NodeStoreTests
from raptor_langchain import LangChainNodeStore, MilvusDialect, RaptorEmbeddings
from raptor_langchain.dialects import _milvus_literal, dialect_for

_names = itertools.count()


@pytest.fixture(scope="module")
def milvus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("milvus") / "raptor.db"


def milvus_store(path: Path, dim: int, **kwargs: object) -> Milvus:
    options: dict[str, object] = {"auto_id": False, "enable_dynamic_field": True}
    options.update(kwargs)
    return Milvus(
        RaptorEmbeddings(FakeEmbedder(dim=dim)),
        connection_args={"uri": str(path)},
        collection_name=f"c{next(_names)}",
        **options,  # type: ignore[arg-type]
    )


class TestMilvusNodeStore(NodeStoreTests):
    """Rows in LangChain's layout, ids as VARCHAR primary keys, metadata as dynamic fields."""

    @pytest.fixture(autouse=True)
    def _file(self, milvus_file: Path) -> None:
        self.path = milvus_file

    def make_store(self) -> LangChainNodeStore:
        store = LangChainNodeStore(milvus_store(self.path, self.dim))
        assert isinstance(store.dialect, MilvusDialect)
        return store


def test_dialect_for_picks_milvus(milvus_file: Path) -> None:
    assert isinstance(dialect_for(milvus_store(milvus_file, 4)), MilvusDialect)


def test_auto_id_store_is_refused_with_the_fix(milvus_file: Path) -> None:
    dialect = MilvusDialect(milvus_store(milvus_file, 4, auto_id=True))
    with pytest.raises(InvalidParameterError, match="auto_id=False"):
        dialect.upsert([Document(id="a", page_content="a")], np.eye(4, dtype=np.float32)[:1])


def test_without_dynamic_fields_is_refused(milvus_file: Path) -> None:
    dialect = MilvusDialect(milvus_store(milvus_file, 4, enable_dynamic_field=False))
    with pytest.raises(InvalidParameterError, match="enable_dynamic_field=True"):
        dialect.upsert([Document(id="a", page_content="a")], np.eye(4, dtype=np.float32)[:1])


def test_odd_ids_round_trip(milvus_file: Path) -> None:
    dialect = MilvusDialect(milvus_store(milvus_file, 4))
    odd = "a\"b\\c\nd\u00e9\U0001f600'x\t\x01"
    assert _milvus_literal('a"\\') == '"a\\"\\\\"'
    vectors = np.eye(4, dtype=np.float32)[:2]
    docs = [
        Document(id=odd, page_content="odd", metadata={"raptor_layer": 0, "raptor_doc_id": odd}),
        Document(id="plain", page_content="plain", metadata={"raptor_layer": 1, "text": "x"}),
    ]
    dialect.upsert(docs, vectors)
    assert [r.document.id for r in dialect.fetch([odd, "none"], native=None, vectors=True)] == [odd]
    plain = dialect.fetch(["plain"], native=None, vectors=False)[0].document
    assert plain.page_content == "plain"  # a metadata key named like a field does not overwrite it
    assert sorted(d.id for d in dialect.scan()) == sorted([odd, "plain"])
    assert dialect.count() == 2 and dialect.max_layer() == 1 and dialect.dim() == 4
    dialect.delete([odd, "none"])
    assert dialect.count() == 1
