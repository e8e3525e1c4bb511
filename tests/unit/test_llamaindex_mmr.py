"""LlamaIndex's MMR habit: ``vector_store_query_mode="mmr"`` runs the core MMR strategy."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document
from llama_index.core.vector_stores.types import VectorStoreQueryMode

from raptor_core import make_retriever
from raptor_core.exceptions import InvalidParameterError
from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer
from raptor_llamaindex import RaptorIndex, RaptorRetriever

QUERY = "bees and honey in the hive"
TEXTS = {
    "bees": "Bees dance to show where flowers are. Bees make honey in the hive. " * 6,
    "hives": "A hive holds honey and wax. Keepers smoke the hive to calm bees. " * 6,
    "rockets": "Rockets burn fuel to reach orbit. Boosters land on barges. " * 6,
}


@pytest.fixture(scope="module")
def index() -> RaptorIndex:
    documents = [Document(text=text, id_=key) for key, text in TEXTS.items()]
    return RaptorIndex.from_documents(
        documents,
        embed_model=FakeEmbedder(32),
        summarizer=EchoSummarizer(),
        tokenizer=WhitespaceTokenizer(),
        chunk_max_tokens=12,
        random_state=0,
    )


def ids(nodes: list) -> list[str]:
    return [n.node.node_id for n in nodes]


@pytest.mark.parametrize("mode", ["mmr", VectorStoreQueryMode.MMR])
def test_mmr_mode_runs_the_core_mmr_strategy(index: RaptorIndex, mode: object) -> None:
    retriever = index.as_retriever(
        vector_store_query_mode=mode,
        vector_store_kwargs={"mmr_threshold": 0.3},
        similarity_top_k=4,
    )
    assert retriever.strategy == "mmr"
    core = make_retriever(
        "mmr", index.store, index.embedder, k=4, lambda_mult=0.3, max_tokens=retriever.max_tokens
    )
    assert ids(retriever.retrieve(QUERY)) == [h.id for h in core.retrieve(QUERY)]
    # mmr_threshold=1 is plain relevance: the collapsed ranking.
    relevance = index.as_retriever(
        vector_store_query_mode="mmr",
        vector_store_kwargs={"mmr_threshold": 1.0},
        similarity_top_k=4,
        max_tokens=None,
    )
    collapsed = index.as_retriever(strategy="collapsed", similarity_top_k=4, max_tokens=None)
    assert ids(relevance.retrieve(QUERY)) == ids(collapsed.retrieve(QUERY))
    diverse = index.as_retriever(
        vector_store_query_mode="mmr",
        vector_store_kwargs={"mmr_threshold": 0.0},
        similarity_top_k=4,
        max_tokens=None,
    )
    assert ids(diverse.retrieve(QUERY)) != ids(collapsed.retrieve(QUERY))


def test_default_mode_keeps_the_strategy(index: RaptorIndex) -> None:
    retriever = index.as_retriever(vector_store_query_mode=VectorStoreQueryMode.DEFAULT)
    assert retriever.strategy == "passage"


def test_bad_modes_and_kwargs_are_clear_errors(index: RaptorIndex) -> None:
    with pytest.raises(InvalidParameterError, match=r"'default', 'mmr'.*BM25"):
        index.as_retriever(vector_store_query_mode="hybrid")
    with pytest.raises(InvalidParameterError, match="accepted: mmr_threshold"):
        index.as_retriever(vector_store_query_mode="mmr", vector_store_kwargs={"alpha": 1})
    with pytest.raises(InvalidParameterError, match="need vector_store_query_mode='mmr'"):
        index.as_retriever(vector_store_kwargs={"mmr_threshold": 0.5})
    with pytest.raises(InvalidParameterError, match="cannot be combined with strategy='traversal'"):
        RaptorRetriever(
            index.store, index.embedder, strategy="traversal", vector_store_query_mode="mmr"
        )
    out_of_range = index.as_retriever(
        vector_store_query_mode="mmr", vector_store_kwargs={"mmr_threshold": 2}
    )
    with pytest.raises(InvalidParameterError, match="lambda_mult"):
        out_of_range.retrieve(QUERY)
