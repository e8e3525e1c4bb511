"""RaptorRetriever.add_documents / delete over a real Chroma server: only changes are written."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_chroma")

from langchain_chroma import Chroma
from langchain_core.documents import Document

from raptor_core.testing import check_tree_invariants
from raptor_langchain import ChromaDialect, LangChainNodeStore, RaptorEmbeddings, RaptorRetriever
from raptor_langchain.store import MANIFEST_ID

pytestmark = pytest.mark.integration

_names = itertools.count()


class RecordingDialect(ChromaDialect):
    """The Chroma dialect, recording the ids of every write it sends to the server."""

    def __init__(self, vectorstore: Chroma) -> None:
        super().__init__(vectorstore)
        self.written: list[str] = []
        self.deleted: list[str] = []

    def upsert(self, documents: Sequence[Document], vectors: NDArray[np.float32]) -> None:
        self.written.extend(str(d.id) for d in documents if d.id != MANIFEST_ID)
        super().upsert(documents, vectors)

    def delete(self, ids: Sequence[str]) -> None:
        self.deleted.extend(ids)
        super().delete(ids)


def test_add_and_delete_upsert_only_the_changes(
    chroma_server: Any, st_embedder: Any, multi_topic_text: str
) -> None:
    parts = re.split(r"^## ", multi_topic_text, flags=re.MULTILINE)[1:5]
    docs = [Document(page_content="## " + p.strip(), id=f"essay-{i}") for i, p in enumerate(parts)]
    embeddings = RaptorEmbeddings(st_embedder)
    vectorstore = Chroma(
        client=chroma_server.client(),
        collection_name=f"incremental-{next(_names)}",
        embedding_function=embeddings,
    )
    dialect = RecordingDialect(vectorstore)
    retriever = RaptorRetriever.from_documents(
        docs[:3],
        vectorstore=vectorstore,
        dialect=dialect,
        k=4,
        strategy="collapsed",
        random_state=0,
    )
    before = LangChainNodeStore(vectorstore).to_tree()
    dialect.written.clear()
    dialect.deleted.clear()

    assert retriever.add_documents(docs[3:]) == ["essay-3"]

    after = LangChainNodeStore(vectorstore).to_tree()
    check_tree_invariants(after, extractive=True)
    assert after.doc_ids == ("essay-0", "essay-1", "essay-2", "essay-3")
    # What was written is what is new or changed: never the whole tree again.
    unchanged = [n.id for n in before.nodes if n.id in after and after.node(n.id) == n]
    assert unchanged and not set(unchanged) & set(dialect.written)
    assert set(dialect.written) == {n.id for n in after.nodes} - set(unchanged)
    assert set(dialect.deleted) == {n.id for n in before.nodes} - {n.id for n in after.nodes}
    question = parts[3].split(".")[0]
    assert any(
        "essay-3" in d.metadata.get("raptor_doc_ids", "") for d in retriever.invoke(question)
    )

    reopened = RaptorRetriever.from_vectorstore(
        Chroma(
            client=chroma_server.client(),
            collection_name=vectorstore._collection.name,
            embedding_function=embeddings,
        )
    )
    reopened.delete(["essay-3"])
    final = LangChainNodeStore(vectorstore).to_tree()
    assert {n.id for n in final.nodes} == {n.id for n in before.nodes}
    check_tree_invariants(final, extractive=True)
