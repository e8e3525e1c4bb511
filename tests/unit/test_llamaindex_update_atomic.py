"""A RaptorIndex update is all or nothing, even when it takes several core steps.

With ``join_pages=True`` one call can be two core steps: deleting a PDF's first page deletes
the joined file from the tree, then inserts the pages that remain under the next page's id.
A model failing in any step must leave the tree, the vector store and the saved index struct
as they were (so ``ref_doc_ids`` and retrieval are unchanged and the same call can be
retried), and the retry must give the index that an update without the failure gives.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, StorageContext
from numpy.typing import NDArray

from raptor_core.exceptions import EmbeddingError, SummarizationError
from raptor_core.testing import EchoSummarizer, FakeEmbedder, GroupClusterer, WhitespaceTokenizer
from raptor_llamaindex import RaptorIndex
from raptor_llamaindex.index import RaptorIndexStruct

TEXTS = [
    "Cats purr and sleep. Kittens chase string. Cats like fish and milk.",
    "Dogs bark at night. Puppies chew shoes. Dogs love long walks.",
    "Rockets burn fuel. Orbit needs speed. Satellites circle the earth.",
    "Rivers carve valleys. Deltas meet the sea. Floods feed the plains.",
]
QUERIES = ["rockets orbit satellites", "cats kittens fish", "bread yeast ovens"]


class FailingEmbedder(FakeEmbedder):
    """A FakeEmbedder whose ``fail_at``-th ``embed_documents`` call (counted from 1) fails."""

    def __init__(self) -> None:
        super().__init__(32)
        self.made = 0  # every call, the failed one too (`calls` is FakeEmbedder's own)
        self.fail_at: int | None = None

    def embed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]:
        self.made += 1
        if self.made == self.fail_at:
            raise RuntimeError("embedding service down")
        return super().embed_documents(texts)


class FailingSummarizer(EchoSummarizer):
    """An EchoSummarizer whose ``fail_at``-th call (counted from 1) fails."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.fail_at: int | None = None

    def summarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        self.count += 1
        if self.count == self.fail_at:
            raise RuntimeError("LLM service down")
        return super().summarize(texts, max_tokens=max_tokens)


def page(i: int, number: int | None = None, text: str | None = None) -> Document:
    return Document(
        text=TEXTS[i] if text is None else text,
        id_=f"p{i}",
        metadata={"source": "a.pdf", "page": i if number is None else number},
    )


OTHERS = [
    Document(text="Bread needs yeast. Dough rises slowly. Ovens bake the loaf.", id_="bread"),
    Document(text="Tea leaves steep. Green tea is light. Black tea is strong.", id_="tea"),
]

Op = Callable[[RaptorIndex], Any]

# (initial pages, the update).  The first three are two core steps in the tree (a delete,
# then an insert or update); an insert is one (a new page can only extend the last file).
SCENARIOS: dict[str, tuple[list[Document], Op]] = {
    # p0+p1+p2 -> p1+p2: delete the joined "p0", insert "p1".
    "delete_ref_doc": ([page(0), page(1), page(2)], lambda ix: ix.delete_ref_doc("p0")),
    # p0, p1 (numbered 7) apart; p1 renumbered joins p0: delete "p1", update "p0".
    "update_ref_doc": ([page(0), page(1, 7)], lambda ix: ix.update_ref_doc(page(1))),
    # As update_ref_doc, plus a new page that joins too.
    "refresh_ref_docs": (
        [page(0), page(1, 7)],
        lambda ix: ix.refresh_ref_docs([page(0), page(1), page(2)]),
    ),
    # One step each: the next page joins the file; a changed page updates its file.
    "insert": ([page(0), page(1)], lambda ix: ix.insert(page(2))),
    "update_ref_doc_one_step": (
        [page(0), page(1), page(2)],
        lambda ix: ix.update_ref_doc(page(1, text="Dogs howl at the moon. Wolves run far.")),
    ),
}
STEPS = {
    "delete_ref_doc": ["delete", "insert"],
    "update_ref_doc": ["delete", "update"],
    "refresh_ref_docs": ["delete", "update"],
    "insert": ["update"],
    "update_ref_doc_one_step": ["update"],
}


def build(
    pages: list[Document],
    embedder: FakeEmbedder | None = None,
    summarizer: EchoSummarizer | None = None,
    storage_context: StorageContext | None = None,
) -> RaptorIndex:
    return RaptorIndex.from_documents(
        [*OTHERS, *pages],  # the pages last: an inserted page joins them
        embed_model=embedder or FakeEmbedder(32),
        summarizer=summarizer or EchoSummarizer(),
        storage_context=storage_context,
        join_pages=True,
        tokenizer=WhitespaceTokenizer(),
        clusterer=GroupClusterer(2),
        chunk_max_tokens=8,
        summary_max_tokens=12,
        min_layer_size=2,
        random_state=0,
    )


def state(index: RaptorIndex) -> dict[str, Any]:
    """Everything an update may change: the documents, the tree, the store, the saved struct."""
    tree = index.tree
    stored = index.store.to_tree()  # read back from the vector store
    order = sorted(range(len(stored)), key=lambda r: stored.nodes[r].id)
    saved = index.storage_context.index_store.get_index_struct(index.index_id)
    assert isinstance(saved, RaptorIndexStruct)
    return {
        "ref_doc_ids": index.ref_doc_ids,
        "documents": index.documents,
        "tree_doc_ids": tree.doc_ids,
        "tree_nodes": tree.nodes,
        "tree_embeddings": tree.embeddings.tolist(),
        "store_size": len(index.store),
        "store_nodes": [stored.nodes[r] for r in order],
        "store_embeddings": np.round(stored.embeddings[order], 5).tolist(),
        "saved_documents": saved.documents,
        "saved_layer_sizes": saved.layer_sizes,
        "retrieved": [
            [(n.node.node_id, n.node.get_content()) for n in index.as_retriever().retrieve(q)]
            for q in QUERIES
        ],
    }


def calls_of(name: str, model: str) -> int:
    """How many model calls the scenario's update makes when nothing fails."""
    pages, op = SCENARIOS[name]
    embedder, summarizer = FailingEmbedder(), FailingSummarizer()
    index = build(pages, embedder, summarizer)
    embedder.made = summarizer.count = 0
    op(index)
    return embedder.made if model == "embedder" else summarizer.count


def expected_after(name: str) -> dict[str, Any]:
    pages, op = SCENARIOS[name]
    index = build(pages)
    op(index)
    return state(index)


def failures() -> list[tuple[str, str, int]]:
    # Every model call of every update fails once: a later step's failure is what used to
    # leave the index half-applied.
    return [
        (name, model, n)
        for name, model in itertools.product(SCENARIOS, ("embedder", "summarizer"))
        for n in range(1, calls_of(name, model) + 1)
    ]


FAILURES = failures()


@pytest.mark.parametrize("name", SCENARIOS)
def test_each_update_takes_its_core_steps_and_calls_both_models(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps: list[list[str]] = []
    original = RaptorIndex._steps

    def spy(tree: Any, write: Any, delete: Any) -> list[tuple[str, Sequence[Any]]]:
        out = original(tree, write, delete)
        steps.append([step for step, _ in out])
        return out

    pages, op = SCENARIOS[name]
    index = build(pages)
    monkeypatch.setattr(RaptorIndex, "_steps", staticmethod(spy))
    op(index)
    assert steps == [STEPS[name]]
    assert calls_of(name, "embedder") >= 1
    assert calls_of(name, "summarizer") >= 1


@pytest.mark.parametrize(("name", "model", "fail_at"), FAILURES)
def test_a_failed_update_leaves_the_index_as_it_was_and_can_be_retried(
    name: str, model: str, fail_at: int
) -> None:
    pages, op = SCENARIOS[name]
    embedder, summarizer = FailingEmbedder(), FailingSummarizer()
    index = build(pages, embedder, summarizer)
    before = state(index)
    embedder.made = summarizer.count = 0
    if model == "embedder":
        embedder.fail_at = fail_at
    else:
        summarizer.fail_at = fail_at
    with pytest.raises(EmbeddingError if model == "embedder" else SummarizationError):
        op(index)
    assert state(index) == before
    embedder.fail_at = summarizer.fail_at = None
    op(index)  # the same call again: nothing says the document is gone or up to date
    assert state(index) == expected_after(name)


@pytest.mark.parametrize("fail_at", range(1, calls_of("delete_ref_doc", "embedder") + 1))
def test_a_failed_async_update_leaves_the_index_as_it_was(fail_at: int) -> None:
    pages, _ = SCENARIOS["delete_ref_doc"]
    embedder = FailingEmbedder()
    index = build(pages, embedder)
    before = state(index)
    embedder.made, embedder.fail_at = 0, fail_at
    with pytest.raises(EmbeddingError):
        asyncio.run(index.adelete_ref_doc("p0"))
    assert state(index) == before
    embedder.fail_at = None
    asyncio.run(index.adelete_ref_doc("p0"))
    assert state(index) == expected_after("delete_ref_doc")


def test_a_failed_update_leaves_a_chroma_collection_as_it_was() -> None:
    pytest.importorskip("llama_index.vector_stores.chroma")
    import chromadb
    from llama_index.vector_stores.chroma import ChromaVectorStore

    client = chromadb.EphemeralClient()

    def storage(collection: str) -> StorageContext:
        store = ChromaVectorStore(chroma_collection=client.create_collection(collection))
        return StorageContext.from_defaults(vector_store=store)

    pages, op = SCENARIOS["delete_ref_doc"]
    embedder = FailingEmbedder()
    index = build(pages, embedder, storage_context=storage("atomic_failed"))
    before = state(index)
    embedder.made, embedder.fail_at = 0, calls_of("delete_ref_doc", "embedder")
    with pytest.raises(EmbeddingError):
        op(index)
    assert state(index) == before
    embedder.fail_at = None
    op(index)
    reference = build(pages, storage_context=storage("atomic_reference"))
    op(reference)
    assert state(index) == state(reference)
