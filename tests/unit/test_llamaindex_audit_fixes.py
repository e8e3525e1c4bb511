"""Audit H: re-inserting through a deduplicating pipeline, token counting, passage hits."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, StorageContext, load_index_from_storage
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.ingestion import DocstoreStrategy, IngestionPipeline
from llama_index.core.llms import MockLLM
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.postprocessor import PrevNextNodePostprocessor
from llama_index.core.schema import BaseNode, NodeRelationship
from llama_index.core.storage.docstore import SimpleDocumentStore

from raptor_core.testing import EchoSummarizer, FakeEmbedder, GroupClusterer, WhitespaceTokenizer
from raptor_llamaindex import RaptorIndex

TEXTS = {
    "cats": "Cats purr softly. Kittens chase string. A cat grooms its fur. Cats nap in the sun.",
    "rockets": "Rockets burn fuel. Boosters land on barges. Satellites reach orbit. Engines roar.",
    "bread": "Bakers knead dough. Yeast makes bread rise. Ovens bake loaves. Crusts turn brown.",
}


def fast(**extra: Any) -> dict[str, Any]:
    options: dict[str, Any] = {
        "summarizer": EchoSummarizer(),
        "tokenizer": WhitespaceTokenizer(),
        "clusterer": GroupClusterer(2),
        "chunk_max_tokens": 8,
        "summary_max_tokens": 10,
        "cluster_max_tokens": 100,
    }
    options.update(extra)
    return options


# -- a document the transformations drop is not indexed, and can come back -----------------------
def doc(topic: str) -> Document:
    return Document(text=TEXTS[topic] * 2, id_=topic)


def pipeline_index() -> tuple[RaptorIndex, IngestionPipeline]:
    splitter = SentenceSplitter(chunk_size=40, chunk_overlap=0)
    pipeline = IngestionPipeline(
        transformations=[splitter],
        docstore=SimpleDocumentStore(),
        docstore_strategy=DocstoreStrategy.DUPLICATES_ONLY,
    )
    index = RaptorIndex.from_documents(
        [doc("cats"), doc("rockets"), doc("bread")],
        embed_model=FakeEmbedder(16),
        transformations=pipeline,
        **fast(),
    )
    return index, pipeline


def test_a_reinsert_the_pipeline_drops_is_not_recorded_and_refresh_brings_it_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    index, pipeline = pipeline_index()
    index.delete_ref_doc("rockets", delete_from_docstore=True)
    assert index.docstore.get_document_hash("rockets") is None
    with caplog.at_level(logging.WARNING, logger="raptor_llamaindex.index"):
        index.insert(doc("rockets"))  # the pipeline's docstore skips the duplicate
    assert "rockets" not in index.ref_doc_ids
    assert "produced no nodes" in caplog.text and "'rockets'" in caplog.text
    # Nothing was indexed, so no hash says it was.
    assert index.docstore.get_document_hash("rockets") is None
    # Still dropped by the pipeline: refresh tries (it is not indexed) and changes nothing.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="raptor_llamaindex.index"):
        assert index.refresh_ref_docs([doc("rockets")]) == [False]
    assert "produced no nodes" in caplog.text
    # Once the pipeline lets it through again, refresh indexes it.
    pipeline.docstore.delete_document("rockets")
    assert index.refresh_ref_docs([doc("rockets"), doc("cats")]) == [True, False]
    assert "rockets" in index.ref_doc_ids
    assert index.docstore.get_document_hash("rockets") == doc("rockets").hash
    assert any(leaf.doc_id == "rockets" for leaf in index.tree.leaves)


def test_refresh_reindexes_a_document_whose_hash_is_recorded_but_which_is_not_indexed() -> None:
    index = RaptorIndex.from_documents(
        [doc("cats"), doc("bread")], embed_model=FakeEmbedder(16), **fast()
    )
    # A hash recorded for a document the index does not hold (e.g. by an older version, or
    # another index sharing the docstore) does not make refresh skip it.
    index.docstore.set_document_hash("rockets", doc("rockets").hash)
    assert index.refresh_ref_docs([doc("rockets"), doc("cats")]) == [True, False]
    assert "rockets" in index.ref_doc_ids


def test_async_insert_of_a_dropped_document_records_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    index, _ = pipeline_index()
    asyncio.run(index.adelete_ref_doc("rockets", delete_from_docstore=True))
    with caplog.at_level(logging.WARNING, logger="raptor_llamaindex.index"):
        asyncio.run(index.ainsert(doc("rockets")))
    assert "produced no nodes" in caplog.text
    assert "rockets" not in index.ref_doc_ids
    assert index.docstore.get_document_hash("rockets") is None
    assert asyncio.run(index.arefresh_ref_docs([doc("rockets")])) == [False]


def test_delete_from_docstore_removes_the_document_from_the_index_docstore() -> None:
    index = RaptorIndex.from_documents(
        [doc("cats"), doc("rockets"), doc("bread")],
        embed_model=FakeEmbedder(16),
        transformations=[SentenceSplitter(chunk_size=40, chunk_overlap=0)],
        **fast(),
    )
    leaves = index.ref_doc_info["rockets"].node_ids
    # Entries a user (or LlamaIndex) put in the index's docstore under the document.
    index.docstore.set_document_hash("rockets", "h")
    index.delete_ref_doc("rockets", delete_from_docstore=True)
    assert index.docstore.get_ref_doc_info("rockets") is None
    assert index.docstore.get_document_hash("rockets") is None
    assert not any(index.docstore.document_exists(i) for i in leaves)
    assert "rockets" not in index.ref_doc_ids
    assert index.docstore.get_document_hash("cats") == doc("cats").hash


# -- LlamaIndex callbacks (TokenCountingHandler) see RAPTOR's model calls -------------------------
#: Every text a UserEmbedding embedded, in order.
EMBEDDED: list[str] = []


class UserEmbedding(BaseEmbedding):
    """A user's own LlamaIndex embedding model (deterministic); records what it embeds."""

    def _get_text_embedding(self, text: str) -> list[float]:
        EMBEDDED.append(text)
        return [float(v) for v in FakeEmbedder(16).embed_query(text)]

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._get_text_embedding(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_text_embedding(query)


def test_token_counting_handler_counts_build_update_and_query_calls() -> None:
    counter = TokenCountingHandler()
    embed_model, llm = UserEmbedding(), MockLLM(max_tokens=6)
    EMBEDDED.clear()
    manager = CallbackManager([counter])
    index = RaptorIndex.from_documents(
        [doc("cats"), doc("rockets")],
        embed_model=embed_model,
        llm=llm,
        callback_manager=manager,
        **{**fast(), "summarizer": None},
    )
    summaries = [n for n in index.tree.nodes if n.layer > 0]
    assert summaries, "the build should summarise here"
    assert counter.total_embedding_token_count > 0
    assert counter.total_llm_token_count > 0
    # One count per text the model embedded, at most one per summary (equal clusters are
    # summarised once): nothing counted twice.
    assert len(counter.embedding_token_counts) == len(EMBEDDED)
    assert 0 < len(counter.llm_token_counts) <= len(summaries)
    # LlamaIndex's convention (resolve_embed_model / resolve_llm): set on the models.
    assert embed_model.callback_manager is manager
    assert llm.callback_manager is manager

    counter.reset_counts()
    index.insert(doc("bread"))
    assert counter.total_embedding_token_count > 0

    counter.reset_counts()
    assert index.as_retriever().retrieve("Why do cats purr?")
    assert counter.total_embedding_token_count > 0
    assert len(counter.embedding_token_counts) == 1


def test_a_loaded_index_reports_to_the_callback_manager_it_is_given(tmp_path: Any) -> None:
    index = RaptorIndex.from_documents(
        [doc("cats"), doc("rockets")], embed_model=UserEmbedding(), **fast()
    )
    index.storage_context.persist(str(tmp_path))
    counter = TokenCountingHandler()
    loaded = load_index_from_storage(
        StorageContext.from_defaults(persist_dir=str(tmp_path)),
        embed_model=UserEmbedding(),
        callback_manager=CallbackManager([counter]),
    )
    loaded.as_retriever().retrieve("rockets")
    assert counter.total_embedding_token_count > 0


def test_an_llm_strategy_counts_its_query_time_llm_calls() -> None:
    index = RaptorIndex.from_documents(
        [doc("cats"), doc("rockets")], embed_model=UserEmbedding(), **fast()
    )
    counter = TokenCountingHandler()
    retriever = index.as_retriever(
        strategy="llm", llm=MockLLM(max_tokens=4), callback_manager=CallbackManager([counter])
    )
    retriever.retrieve("Why do cats purr?")  # MockLLM's answers are unusable: it falls back
    assert counter.total_llm_token_count > 0


# -- a passage links to the nodes around it --------------------------------------------------------
def bee_nodes() -> list[BaseNode]:
    text = " ".join(f"Bees dance number {i}. Bees make honey {i}." for i in range(60))
    splitter = SentenceSplitter(chunk_size=40, chunk_overlap=0)
    return list(splitter.get_nodes_from_documents([Document(text=text, id_="bees")]))


def test_a_passage_keeps_the_previous_of_its_first_leaf_and_the_next_of_its_last() -> None:
    nodes = bee_nodes()
    by_id = {n.node_id: n for n in nodes}
    index = RaptorIndex(nodes, embed_model=FakeEmbedder(16), **fast())
    query = "Bees dance number 30. Bees make honey 30."
    hits = index.as_retriever(similarity_top_k=2, max_tokens=200).retrieve(query)
    passages = [h for h in hits if len(h.node.metadata.get("raptor_leaves", [])) > 1]
    assert passages, "the passage strategy should join neighbouring nodes here"
    for hit in passages:
        leaves = hit.node.metadata["raptor_leaves"]
        first, last = by_id[leaves[0]], by_id[leaves[-1]]
        rels = hit.node.relationships
        assert rels[NodeRelationship.SOURCE].node_id == "bees"
        # The nodes around the run, where there are some (the document's last node has
        # no NEXT).
        before = rels.get(NodeRelationship.PREVIOUS)
        after = rels.get(NodeRelationship.NEXT)
        assert (before and before.node_id) == (first.prev_node and first.prev_node.node_id)
        assert (after and after.node_id) == (last.next_node and last.next_node.node_id)
        # Its id is made for the hit; its leaves are stored nodes.
        assert not index.docstore.document_exists(hit.node.node_id)
        assert all(index.docstore.document_exists(i) for i in leaves)
    assert any(NodeRelationship.NEXT in h.node.relationships for h in passages)
    assert any(NodeRelationship.PREVIOUS in h.node.relationships for h in passages)
    # PrevNextNodePostprocessor extends a passage as it would a node.
    postprocessor = PrevNextNodePostprocessor(docstore=index.docstore, num_nodes=1, mode="both")
    inner = next(h for h in passages if NodeRelationship.NEXT in h.node.relationships)
    extended = {n.node.node_id for n in postprocessor.postprocess_nodes([inner])}
    leaves = inner.node.metadata["raptor_leaves"]
    assert by_id[leaves[0]].prev_node.node_id in extended  # type: ignore[union-attr]
    assert by_id[leaves[-1]].next_node.node_id in extended  # type: ignore[union-attr]
    # Async retrieval links the same way.
    again = asyncio.run(index.as_retriever(similarity_top_k=2, max_tokens=200).aretrieve(query))
    assert [h.node.relationships for h in again] == [h.node.relationships for h in hits]


def test_passages_of_raptors_own_chunks_read_no_last_leaf() -> None:
    # Only LlamaIndex nodes have PREVIOUS / NEXT to keep: passages of RAPTOR's own chunks
    # must not cost a store read per query for nothing.
    index = RaptorIndex.from_documents(
        [Document(text=" ".join(f"Bees dance number {i}." for i in range(40)), id_="bees")],
        embed_model=FakeEmbedder(16),
        **fast(),
    )
    retriever = index.as_retriever(similarity_top_k=2, max_tokens=200)
    hits = retriever._core.retrieve("Bees dance number 30.", k=2, max_tokens=200)
    assert any(len(h.leaves) > 1 for h in hits)
    assert retriever._last_leaves(hits) == {}


def test_without_a_budget_the_passage_strategy_returns_stored_nodes() -> None:
    nodes = bee_nodes()
    index = RaptorIndex(nodes, embed_model=FakeEmbedder(16), **fast())
    hits = index.as_retriever(similarity_top_k=3, max_tokens=None).retrieve("Bees dance number 7.")
    assert len(hits) == 3
    assert all("raptor_leaves" not in h.node.metadata for h in hits)
    assert all(index.docstore.document_exists(h.node.node_id) for h in hits)
