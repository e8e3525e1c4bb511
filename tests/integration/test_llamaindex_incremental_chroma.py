"""RaptorIndex updates over a real Chroma server and the real model: only changes are written.

Six essays (tests/data/multi_topic.md), the packaged all-MiniLM-L6-v2 and UMAP+GMM: after
``insert``, ``update_ref_doc`` and ``delete_ref_doc``, the ids written to and deleted from
the collection are exactly the nodes that are new, changed or gone, and every other record in
Chroma (text, metadata, vector) is byte for byte what it was.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("llama_index.vector_stores.chroma")

from llama_index.core import Document, StorageContext, load_index_from_storage
from llama_index.vector_stores.chroma import ChromaVectorStore

from raptor_core.testing import check_tree_invariants
from raptor_core.tree import Tree
from raptor_llamaindex import RaptorIndex

pytestmark = pytest.mark.integration

_names = itertools.count()


def essays(text: str) -> list[Document]:
    docs = []
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        title, _, body = section.partition("\n")
        slug = re.sub(r"\W+", "-", title.lower()).strip("-")
        docs.append(Document(id_=slug, text=body.strip(), metadata={"title": title.strip()}))
    return docs


def records(vector_store: ChromaVectorStore) -> dict[str, tuple[Any, Any, list[float]]]:
    """Every record of the collection as Chroma returns it."""
    got = vector_store.client.get(include=["documents", "metadatas", "embeddings"])
    return {
        i: (doc, meta, [float(x) for x in emb])
        for i, doc, meta, emb in zip(
            got["ids"], got["documents"], got["metadatas"], got["embeddings"], strict=True
        )
    }


def expected_writes(before: Tree, after: Tree) -> tuple[set[str], set[str]]:
    """(new or differing ids, gone ids), from the two trees alone."""
    write = {
        n.id
        for n in after.nodes
        if n.id not in before
        or before.node(n.id) != n
        or not np.array_equal(
            before.embeddings[before.row(n.id)], after.embeddings[after.row(n.id)]
        )
    }
    return write, {n.id for n in before.nodes} - {n.id for n in after.nodes}


class Spy:
    def __init__(self, index: RaptorIndex, monkeypatch: pytest.MonkeyPatch) -> None:
        self.written: list[str] = []
        self.deleted: list[str] = []
        store = index.store
        add, delete = store.add, store.delete

        def spy_add(nodes: Any, vectors: Any) -> None:
            self.written.extend(n.id for n in nodes)
            add(nodes, vectors)

        def spy_delete(ids: Any) -> None:
            self.deleted.extend(ids)
            delete(ids)

        monkeypatch.setattr(store, "add", spy_add)
        monkeypatch.setattr(store, "delete", spy_delete)


def test_updates_write_exactly_the_changed_nodes_to_chroma(
    chroma_server: Any,
    st_embedder: Any,
    multi_topic_text: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Any,
) -> None:
    docs = essays(multi_topic_text)
    assert len(docs) >= 6
    name = f"li-incremental-{next(_names)}"
    collection = chroma_server.client().get_or_create_collection(
        name, configuration={"hnsw": {"space": "cosine"}}
    )
    vector_store = ChromaVectorStore(chroma_collection=collection)
    index = RaptorIndex.from_documents(
        docs[:5],
        storage_context=StorageContext.from_defaults(vector_store=vector_store),
        embed_model=st_embedder,
        random_state=0,
        strategy="collapsed",
        similarity_top_k=5,
    )
    assert index.tree.num_layers >= 2
    index.storage_context.persist(persist_dir=tmp_path / "index")
    # Updates on an index reopened from Chroma, as an application would make them.
    index = load_index_from_storage(
        StorageContext.from_defaults(persist_dir=tmp_path / "index", vector_store=vector_store),
        embed_model=st_embedder,
    )
    assert isinstance(index, RaptorIndex)
    edited = docs[1].text.replace(".", ". Astronauts trained for years in simulators.", 1)
    steps = [
        ("insert", lambda: index.insert(docs[5])),
        ("update", lambda: index.update_ref_doc(Document(id_=docs[1].id_, text=edited))),
        ("delete", lambda: index.delete_ref_doc(docs[2].id_)),
    ]
    for op, step in steps:
        before, stored = index.tree, records(vector_store)
        spy = Spy(index, monkeypatch)
        step()
        monkeypatch.undo()
        after = index.tree
        check_tree_invariants(after, extractive=True)
        assert after.build_info["incremental"]["last"]["op"] == op
        write, gone = expected_writes(before, after)
        assert set(spy.written) == write and len(spy.written) == len(write), op
        assert set(spy.deleted) == gone, op
        now = records(vector_store)
        assert set(now) == {n.id for n in after.nodes}, op
        untouched = set(now) - write
        assert len(untouched) > len(write), op  # most of the collection was never rewritten
        assert all(now[i] == stored[i] for i in untouched), op
    assert set(index.ref_doc_ids) == {d.id_ for d in docs} - {docs[2].id_}
    assert "simulators" in " ".join(n.text for n in index.tree.leaves if n.doc_id == docs[1].id_)
    # The collection alone gives back the updated tree, links included.
    reread = {n.id: n.to_dict() for n in index.store.to_tree().nodes}
    assert reread == {n.id: n.to_dict() for n in index.tree.nodes}
