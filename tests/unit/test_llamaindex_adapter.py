"""RaptorRetriever, RaptorIndex and the LlamaIndex model wrappers, offline with fakes."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, Settings
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.base.llms.types import CompletionResponse, CompletionResponseGen, LLMMetadata
from llama_index.core.callbacks import CallbackManager, CBEventType, LlamaDebugHandler
from llama_index.core.chat_engine import (
    CondensePlusContextChatEngine,
    ContextChatEngine,
    SimpleChatEngine,
)
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent, RetrievalStartEvent
from llama_index.core.llms import CustomLLM, MockLLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import MetadataMode, NodeRelationship, QueryBundle, TextNode
from llama_index.core.tools import QueryEngineTool
from llama_index.core.vector_stores import MetadataFilter, MetadataFilters
from pydantic import Field, PrivateAttr

import raptor_llamaindex
from raptor_core.build.summarizers import ExtractiveSummarizer, LLMSummarizer
from raptor_core.exceptions import (
    EmbeddingError,
    InvalidInputError,
    InvalidParameterError,
    LLMError,
    LLMTimeoutError,
    MissingDependencyError,
    TreeFormatError,
)
from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer, tiny_tree
from raptor_core.tree import Tree
from raptor_llamaindex import (
    LlamaIndexEmbedder,
    LlamaIndexLLM,
    LlamaIndexSummarizer,
    RaptorEmbedding,
    RaptorIndex,
    RaptorRetriever,
)
from raptor_llamaindex import retriever as retriever_module
from raptor_llamaindex.models import resolve_embedder, resolve_llm, resolve_summarizer
from raptor_llamaindex.retriever import PARAMS_FILE, hit_to_node, make_core_retriever, read_params

EXPECTED_ALL = [
    "RAPTOR_METADATA_KEYS",
    "LlamaIndexEmbedder",
    "LlamaIndexLLM",
    "LlamaIndexNodeStore",
    "LlamaIndexSummarizer",
    "RaptorEmbedding",
    "RaptorIndex",
    "RaptorRetriever",
]

TOPICS = {
    "cats": "Cats purr softly. Cats sleep in the sun. Kittens chase string. A cat grooms its fur.",
    "rockets": "Rockets burn fuel. Rockets reach orbit. Satellites circle earth. Launch pads roar.",
    "bread": "Bakers knead dough. Yeast makes bread rise. Ovens bake loaves. Crust turns brown.",
}


class PairClusterer:
    """Consecutive pairs: a fast, deterministic stand-in for UMAP+GMM."""

    def cluster(self, vectors: Any) -> list[list[int]]:
        n = len(vectors)
        return [list(range(i, min(i + 2, n))) for i in range(0, n, 2)]


class StraddleClusterer:
    """The first node alone, then consecutive pairs: pairs straddle the documents."""

    def cluster(self, vectors: Any) -> list[list[int]]:
        n = len(vectors)
        return [[0], *(list(range(i, min(i + 2, n))) for i in range(1, n, 2))]


def fast_options(**extra: Any) -> dict[str, Any]:
    options: dict[str, Any] = {
        "summarizer": EchoSummarizer(),
        "tokenizer": WhitespaceTokenizer(),
        "clusterer": PairClusterer(),
        "chunk_max_tokens": 8,
        "summary_max_tokens": 10,
        "cluster_max_tokens": 100,
    }
    options.update(extra)
    return options


def documents() -> list[Document]:
    return [Document(text=t, id_=k, metadata={"topic": k}) for k, t in TOPICS.items()]


class HashEmbedding(BaseEmbedding):
    """A LlamaIndex ``BaseEmbedding`` over raptor_core's FakeEmbedder, counting its calls."""

    dim: int = 32
    _fake: FakeEmbedder = PrivateAttr()
    _calls: dict[str, int] = PrivateAttr(default_factory=dict)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(model_name="hash-embedding", **kwargs)
        self._fake = FakeEmbedder(self.dim)

    def _count(self, name: str) -> None:
        self._calls[name] = self._calls.get(name, 0) + 1

    def _get_query_embedding(self, query: str) -> list[float]:
        self._count("query")
        return self._fake.embed_query(query).tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        self._count("aquery")
        return self._fake.embed_query(query).tolist()

    def _get_text_embedding(self, text: str) -> list[float]:
        self._count("text")
        return self._fake.embed_documents([text])[0].tolist()

    async def _aget_text_embedding(self, text: str) -> list[float]:
        self._count("atext")
        return self._fake.embed_documents([text])[0].tolist()


class BrokenEmbedding(HashEmbedding):
    def _get_text_embedding(self, text: str) -> list[float]:
        raise RuntimeError("model offline")

    def _get_query_embedding(self, query: str) -> list[float]:
        raise RuntimeError("model offline")


class RecordingLLM(CustomLLM):
    """A LlamaIndex LLM that answers with a fixed text and records prompts and kwargs."""

    answer: str = "A short summary."
    responder: Callable[[str], str] | None = None
    error: Exception | None = None
    _calls: list[tuple[str, dict[str, Any]]] = PrivateAttr(default_factory=list)

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(model_name="recording")

    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        self._calls.append((prompt, kwargs))
        if self.error is not None:
            raise self.error
        return CompletionResponse(text=self.responder(prompt) if self.responder else self.answer)

    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        yield self.complete(prompt, formatted, **kwargs)


@pytest.fixture
def index() -> RaptorIndex:
    # Collapsed: these tests check summaries and node counts (passages merge leaves).
    return RaptorIndex.from_documents(
        documents(),
        embed_model=FakeEmbedder(32),
        similarity_top_k=6,
        strategy="collapsed",
        **fast_options(),
    )


# -- package surface -------------------------------------------------------------------------------
def test_exported_members() -> None:
    assert sorted(raptor_llamaindex.__all__) == sorted(EXPECTED_ALL)
    for name in EXPECTED_ALL:
        assert getattr(raptor_llamaindex, name) is not None


def test_missing_llama_index_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_index.core", None)
    for name in [m for m in sys.modules if m.split(".")[0] == "raptor_llamaindex"]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(
        MissingDependencyError, match=r"pip install 'raptor-retriever\[llamaindex\]'"
    ):
        importlib.import_module("raptor_llamaindex")


def test_retriever_is_a_llamaindex_retriever_that_keeps_the_template_method() -> None:
    assert issubclass(RaptorRetriever, BaseRetriever)
    # Overriding retrieve/aretrieve would silence LlamaIndex's callbacks and instrumentation.
    for klass in RaptorRetriever.__mro__[: RaptorRetriever.__mro__.index(BaseRetriever)]:
        assert "retrieve" not in vars(klass)
        assert "aretrieve" not in vars(klass)
    assert "_retrieve" in vars(RaptorRetriever)
    assert "_aretrieve" in vars(RaptorRetriever)


# -- node conversion -------------------------------------------------------------------------------
def test_nodes_carry_layer_document_span_and_children() -> None:
    tree = tiny_tree()
    nodes = RaptorRetriever(
        tree, FakeEmbedder(tree.dim), similarity_top_k=10, strategy="collapsed"
    ).retrieve("cats")
    assert {n.node.node_id for n in nodes} == {node.id for node in tree.nodes}
    for item in nodes:
        node = item.node
        assert isinstance(node, TextNode)
        source = tree.node(node.node_id)
        meta = node.metadata
        assert node.text == source.text
        assert meta["raptor_layer"] == source.layer
        assert meta["raptor_doc_ids"] == list(source.doc_ids)
        assert meta["raptor_source"] == "collapsed"
        if source.is_leaf:
            assert meta["raptor_doc_id"] == source.doc_id
            assert meta["raptor_span"] == list(source.span)
            assert (node.start_char_idx, node.end_char_idx) == source.span
            assert node.ref_doc_id == source.doc_id
        else:
            assert meta["raptor_children"] == list(source.children)
            children = node.relationships[NodeRelationship.CHILD]
            assert [c.node_id for c in children] == list(source.children)
        # Bookkeeping stays out of prompts and out of re-embedding.
        assert "raptor_" not in node.get_content(metadata_mode=MetadataMode.LLM)
        assert "raptor_" not in node.get_content(metadata_mode=MetadataMode.EMBED)
    scores = [n.score for n in nodes]
    assert scores == sorted(scores, reverse=True)


def test_leaf_nodes_keep_document_metadata(index: RaptorIndex) -> None:
    nodes = index.as_retriever(similarity_top_k=50, max_tokens=None).retrieve("cats purr")
    leaves = [n.node for n in nodes if n.node.metadata["raptor_layer"] == 0]
    assert leaves
    for leaf in leaves:
        assert leaf.metadata["topic"] == leaf.metadata["raptor_doc_id"]
        assert leaf.get_content(metadata_mode=MetadataMode.LLM).startswith("topic: ")


def test_summaries_keep_the_metadata_all_their_leaves_share() -> None:
    docs = documents()
    for doc in docs:
        doc.metadata["file_path"] = f"/data/{doc.doc_id}.txt"
        doc.excluded_llm_metadata_keys = ["file_path"]
    index = RaptorIndex.from_documents(docs, embed_model=FakeEmbedder(32), **fast_options())
    only_cats = MetadataFilters(filters=[MetadataFilter(key="topic", value="cats")])
    nodes = index.as_retriever(
        strategy="collapsed", similarity_top_k=50, max_tokens=None, filters=only_cats
    ).retrieve("cats purr")
    summaries = [n.node for n in nodes if n.node.metadata["raptor_layer"] > 0]
    assert summaries
    for summary in summaries:
        # The keys the filter passed it on are there to see, as on a leaf.
        assert summary.metadata["topic"] == "cats"
        assert summary.metadata["file_path"] == "/data/cats.txt"
        assert "carried" not in summary.metadata
        llm_text = summary.get_content(metadata_mode=MetadataMode.LLM)
        assert "topic: cats" in llm_text
        assert "file_path" not in llm_text and "raptor_" not in llm_text
        embed_text = summary.get_content(metadata_mode=MetadataMode.EMBED)
        assert "file_path" in embed_text and "raptor_" not in embed_text
    # A summary straddling two documents keeps only what their leaves share.
    straddled = RaptorIndex.from_documents(
        docs, embed_model=FakeEmbedder(32), **fast_options(clusterer=StraddleClusterer())
    )
    mixed = [
        n.node
        for n in straddled.as_retriever(
            strategy="collapsed", similarity_top_k=50, max_tokens=None
        ).retrieve("cats")
        if len(n.node.metadata["raptor_doc_ids"]) > 1
    ]
    assert mixed
    for summary in mixed:
        assert "topic" not in summary.metadata and "file_path" not in summary.metadata


def test_a_carried_summary_drops_the_bookkeeping_and_keeps_its_nodes_exclusions() -> None:
    from raptor_core.retrieval import Hit
    from raptor_core.tree import Node
    from raptor_llamaindex.ingestion import LLAMAINDEX_NODE_KEY

    record = {
        "version": 1,
        "id": "n1",
        "source": "d1",
        "excluded_llm_metadata_keys": ["secret"],
        "excluded_embed_metadata_keys": ["secret"],
        "relationships": {},
        "start_char_idx": 3,
        "end_char_idx": 9,
    }
    carried = Node(
        id="L1.0",
        text="Cats purr.",
        layer=1,
        token_count=2,
        children=("n1",),
        doc_id="d1",
        doc_ids=("d1",),
        metadata={
            "topic": "cats",
            "secret": "s3",
            "carried": True,
            LLAMAINDEX_NODE_KEY: json.dumps(record),
        },
    )
    node = hit_to_node(Hit(node=carried, score=0.5, source="collapsed")).node
    assert isinstance(node, TextNode)
    assert node.metadata["topic"] == "cats" and node.metadata["secret"] == "s3"
    assert "carried" not in node.metadata and LLAMAINDEX_NODE_KEY not in node.metadata
    assert "secret" in node.excluded_llm_metadata_keys
    assert "secret" in node.excluded_embed_metadata_keys
    # The node's offsets are the leaf's, not the summary's.
    assert node.start_char_idx is None and node.end_char_idx is None


def test_hit_to_node_records_path_and_reason() -> None:
    from raptor_core.retrieval import Hit

    tree = tiny_tree()
    hit = Hit(node=tree.node("L0.0"), score=0.5, source="llm", path=("L1.0", "L0.0"), reason="cats")
    node = hit_to_node(hit).node
    assert node.metadata["raptor_path"] == ["L1.0", "L0.0"]
    assert node.metadata["raptor_reason"] == "cats"


# -- retriever parameters ------------------------------------------------------------------------
def test_similarity_top_k_is_the_core_k_and_can_be_changed() -> None:
    tree = tiny_tree()
    retriever = RaptorRetriever(
        tree, FakeEmbedder(tree.dim), similarity_top_k=2, strategy="collapsed"
    )
    assert len(retriever.retrieve("cats")) == 2
    retriever.similarity_top_k = 3
    assert len(retriever.retrieve("cats")) == 3


def test_default_similarity_top_k_is_llamaindex_default() -> None:
    from llama_index.core.constants import DEFAULT_SIMILARITY_TOP_K

    tree = tiny_tree()
    retriever = RaptorRetriever(tree, FakeEmbedder(tree.dim))
    assert retriever.similarity_top_k == DEFAULT_SIMILARITY_TOP_K
    assert len(retriever.retrieve("cats")) == DEFAULT_SIMILARITY_TOP_K


def test_similarity_top_k_larger_than_the_tree_returns_every_node() -> None:
    tree = tiny_tree()
    retriever = RaptorRetriever(
        tree, FakeEmbedder(tree.dim), similarity_top_k=1000, max_tokens=None, strategy="collapsed"
    )
    nodes = retriever.retrieve("rockets")
    assert len(nodes) == len(tree)
    assert len({n.node.node_id for n in nodes}) == len(tree)
    # The default (passage) strategy without a budget returns every leaf, one per node.
    leaves = RaptorRetriever(
        tree, FakeEmbedder(tree.dim), similarity_top_k=1000, max_tokens=None
    ).retrieve("rockets")
    assert sorted(n.node.node_id for n in leaves) == sorted(leaf.id for leaf in tree.leaves)


def test_max_tokens_budget_is_respected() -> None:
    tree = tiny_tree()
    retriever = RaptorRetriever(
        tree, FakeEmbedder(tree.dim), similarity_top_k=10, max_tokens=10, strategy="collapsed"
    )
    nodes = retriever.retrieve("cats")
    assert sum(tree.node(n.node.node_id).token_count for n in nodes) <= 10


def test_collapsed_strategy_parameters_are_passed_through() -> None:
    tree = tiny_tree()
    retriever = RaptorRetriever(
        tree, FakeEmbedder(tree.dim), similarity_top_k=10, layers=[0], strategy="collapsed"
    )
    assert {n.node.metadata["raptor_layer"] for n in retriever.retrieve("cats")} == {0}


def test_bad_parameters_fail_at_construction() -> None:
    tree = tiny_tree()
    with pytest.raises(InvalidParameterError):
        RaptorRetriever(tree, FakeEmbedder(tree.dim), strategy="no-such-strategy")
    with pytest.raises((InvalidParameterError, TypeError)):
        RaptorRetriever(tree, FakeEmbedder(tree.dim), no_such_param=1)
    with pytest.raises(InvalidParameterError):
        RaptorRetriever("not a tree", FakeEmbedder())  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError):
        RaptorRetriever(tree, object())  # type: ignore[arg-type]


def test_the_core_names_are_refused_with_the_retrievers_own(index: RaptorIndex) -> None:
    # k used to reach the core twice (a raw TypeError); LlamaIndex calls it similarity_top_k.
    tree = tiny_tree()
    with pytest.raises(InvalidParameterError, match="similarity_top_k"):
        index.as_retriever(k=3)
    with pytest.raises(InvalidParameterError, match="similarity_top_k"):
        RaptorRetriever(tree, FakeEmbedder(tree.dim), k=3)
    with pytest.raises(InvalidParameterError, match="similarity_top_k"):
        index.as_query_engine(llm=MockLLM(), k=3)
    with pytest.raises(InvalidParameterError, match="retriever's own max_tokens"):
        make_core_retriever(
            "collapsed",
            tree,
            FakeEmbedder(tree.dim),
            llm=None,
            k=2,
            max_tokens=None,
            params={"max_tokens": 10},
        )


def test_an_unknown_parameter_lists_the_names_a_caller_can_pass(index: RaptorIndex) -> None:
    with pytest.raises(InvalidParameterError, match="foo") as info:
        index.as_retriever(foo=1)
    names = set(re.findall(r"\w+", str(info.value)))
    assert {"layers", "min_score", "similarity_top_k", "max_tokens", "filters"} <= names
    assert "k" not in names


def test_empty_query_raises_value_error() -> None:
    tree = tiny_tree()
    with pytest.raises(ValueError, match="empty"):
        RaptorRetriever(tree, FakeEmbedder(tree.dim)).retrieve("   ")


def test_query_bundle_is_accepted() -> None:
    tree = tiny_tree()
    retriever = RaptorRetriever(tree, FakeEmbedder(tree.dim))
    assert retriever.retrieve(QueryBundle("cats")) == retriever.retrieve("cats")


def test_retriever_embeds_queries_with_a_llamaindex_model() -> None:
    embed_model = HashEmbedding()
    tree = tiny_tree(dim=32)
    nodes = RaptorRetriever(tree, embed_model, similarity_top_k=1).retrieve("cats purr")
    assert (
        nodes[0].node.node_id
        == RaptorRetriever(tree, FakeEmbedder(32), similarity_top_k=1)
        .retrieve("cats purr")[0]
        .node.node_id
    )
    assert embed_model._calls == {"query": 1}


# -- strategies ------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["collapsed", "traversal", "value"])
def test_vector_strategies_are_selectable(strategy: str) -> None:
    tree = tiny_tree()
    retriever = RaptorRetriever(tree, FakeEmbedder(tree.dim), strategy=strategy, similarity_top_k=3)
    nodes = retriever.retrieve("cats")
    assert 0 < len(nodes) <= 3
    assert all(n.node.metadata["raptor_source"] for n in nodes)


def test_traversal_parameters_are_passed_through() -> None:
    tree = tiny_tree()
    retriever = RaptorRetriever(
        tree, FakeEmbedder(tree.dim), strategy="traversal", similarity_top_k=10, top_k=1
    )
    nodes = retriever.retrieve("cats purr")
    # top_k=1: one summary, then one of its children.
    assert len(nodes) == 2
    summary, leaf = sorted((n.node for n in nodes), key=lambda n: -n.metadata["raptor_layer"])
    assert leaf.node_id in summary.metadata["raptor_children"]


def select_cats(prompt: str) -> str:
    """Scripted LLM-search answer: the cat summary first, then its first leaf."""
    chosen = "L0.0" if "[L0.0]" in prompt else "L1.0"
    return json.dumps({"selected": [{"id": chosen, "reason": f"picked {chosen}"}]})


def test_llm_strategy_is_guided_by_a_llamaindex_llm() -> None:
    tree = tiny_tree()
    llm = RecordingLLM(responder=select_cats)
    retriever = RaptorRetriever(
        tree, FakeEmbedder(tree.dim), strategy="llm", llm=llm, similarity_top_k=5, top_k=1
    )
    assert isinstance(retriever._llm, LlamaIndexLLM)
    nodes = retriever.retrieve("Which animals purr?")
    assert [n.node.node_id for n in nodes] == ["L1.0", "L0.0"]
    assert nodes[1].node.metadata["raptor_reason"] == "picked L0.0"
    assert nodes[1].node.metadata["raptor_path"] == ["L1.0", "L0.0"]
    assert nodes[1].node.metadata["raptor_source"] == "llm"
    assert len(llm._calls) == 2


async def test_llm_strategy_async_inside_a_running_loop() -> None:
    tree = tiny_tree()
    llm = RecordingLLM(responder=select_cats)
    retriever = RaptorRetriever(
        tree, FakeEmbedder(tree.dim), strategy="llm", llm=llm, similarity_top_k=5, top_k=1
    )
    nodes = await retriever.aretrieve("Which animals purr?")
    assert [n.node.node_id for n in nodes] == ["L1.0", "L0.0"]
    # The sync API also works while this loop runs (the core never calls asyncio.run).
    assert [n.node.node_id for n in retriever.retrieve("Which animals purr?")] == ["L1.0", "L0.0"]


def test_hybrid_strategy_uses_a_llamaindex_llm() -> None:
    tree = tiny_tree()
    llm = RecordingLLM(responder=select_cats)
    retriever = RaptorRetriever(
        tree, FakeEmbedder(tree.dim), strategy="hybrid", llm=llm, similarity_top_k=3
    )
    assert retriever.retrieve("Which animals purr?")
    assert llm._calls


def test_llm_strategy_needs_an_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Settings, "_llm", None)
    tree = tiny_tree()
    with pytest.raises(InvalidParameterError, match="needs an LLM"):
        RaptorRetriever(tree, FakeEmbedder(tree.dim), strategy="llm")
    monkeypatch.setattr(Settings, "_llm", RecordingLLM(responder=select_cats))
    assert RaptorRetriever(tree, FakeEmbedder(tree.dim), strategy="llm").retrieve("purr")


# -- callbacks, instrumentation, async -------------------------------------------------------------
class RetrievalEvents(BaseEventHandler):
    events: list[BaseEvent] = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "RetrievalEvents"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, RetrievalStartEvent | RetrievalEndEvent):
            self.events.append(event)


@pytest.fixture
def retrieval_events() -> Any:
    dispatcher = get_dispatcher()
    handler = RetrievalEvents()
    dispatcher.add_event_handler(handler)
    yield handler
    dispatcher.event_handlers.remove(handler)


def test_instrumentation_events_fire(retrieval_events: RetrievalEvents) -> None:
    tree = tiny_tree()
    nodes = RaptorRetriever(tree, FakeEmbedder(tree.dim)).retrieve("cats")
    kinds = [type(e) for e in retrieval_events.events]
    assert kinds == [RetrievalStartEvent, RetrievalEndEvent]
    assert retrieval_events.events[1].nodes == nodes


async def test_instrumentation_events_fire_async(retrieval_events: RetrievalEvents) -> None:
    tree = tiny_tree()
    await RaptorRetriever(tree, FakeEmbedder(tree.dim)).aretrieve("cats")
    assert [type(e) for e in retrieval_events.events] == [RetrievalStartEvent, RetrievalEndEvent]


def test_callback_manager_sees_the_retrieve_event() -> None:
    debug = LlamaDebugHandler()
    tree = tiny_tree()
    retriever = RaptorRetriever(
        tree, FakeEmbedder(tree.dim), callback_manager=CallbackManager([debug])
    )
    retriever.retrieve("cats")
    assert len(debug.get_event_pairs(CBEventType.RETRIEVE)) == 1


async def test_async_retrieval_inside_a_running_loop() -> None:
    asyncio.get_running_loop()  # the test itself runs in a loop, as in Jupyter or FastAPI
    embed_model = HashEmbedding()
    tree = tiny_tree(dim=32)
    retriever = RaptorRetriever(tree, embed_model, similarity_top_k=3, strategy="collapsed")
    nodes = await retriever.aretrieve("rockets")
    assert embed_model._calls == {"aquery": 1}  # the model's own async path
    assert [(n.node.node_id, n.score) for n in nodes] == [
        (n.node.node_id, n.score) for n in retriever.retrieve("rockets")
    ]
    # The sync API is usable from inside the loop too (no asyncio.run anywhere).
    many = await asyncio.gather(*(retriever.aretrieve(q) for q in ["cats", "bread", "orbit"]))
    assert all(len(result) == 3 for result in many)


async def test_index_builds_inside_a_running_loop() -> None:
    sync_index = RaptorIndex.from_documents(
        documents(), embed_model=FakeEmbedder(32), **fast_options()
    )
    async_index = await RaptorIndex.afrom_documents(
        documents(), embed_model=FakeEmbedder(32), **fast_options()
    )
    assert [n.text for n in sync_index.tree.nodes] == [n.text for n in async_index.tree.nodes]
    nodes = await async_index.as_retriever().aretrieve("bread")
    assert nodes


# -- index -----------------------------------------------------------------------------------------
def test_index_builds_a_tree_from_llamaindex_documents(index: RaptorIndex) -> None:
    tree = index.tree
    assert tree.num_layers >= 2
    assert set(tree.doc_ids) == set(TOPICS)
    assert index.ref_doc_ids == tuple(TOPICS)
    assert index.retriever_kwargs == {"similarity_top_k": 6, "strategy": "collapsed"}
    nodes = index.as_retriever().retrieve("rockets reach orbit")
    assert len(nodes) == 6
    assert len({n.node.metadata["raptor_layer"] for n in nodes}) >= 2


def test_index_builds_from_nodes() -> None:
    nodes = [TextNode(text=t, id_=f"node-{k}", metadata={"topic": k}) for k, t in TOPICS.items()]
    nodes[0].relationships[NodeRelationship.SOURCE] = nodes[0].as_related_node_info()
    nodes[1].relationships[NodeRelationship.SOURCE] = Document(
        text="x", id_="parent"
    ).as_related_node_info()
    index = RaptorIndex.from_documents(nodes, embed_model=FakeEmbedder(32), **fast_options())
    # Each node is one leaf named after it, filed under its source document (issue 14.2).
    assert set(index.tree.doc_ids) == {"node-cats", "parent", "node-bread"}
    leaves = {leaf.id: leaf for leaf in index.tree.leaves}
    assert set(leaves) == {"node-cats", "node-rockets", "node-bread"}
    assert leaves["node-rockets"].doc_id == "parent"
    assert leaves["node-cats"].doc_id == "node-cats"
    assert leaves["node-rockets"].metadata["topic"] == "rockets"


def test_retriever_from_defaults() -> None:
    retriever = RaptorRetriever.from_defaults(
        documents=documents(),
        embed_model=FakeEmbedder(32),
        builder_kwargs=fast_options(),
        similarity_top_k=4,
        strategy="collapsed",
    )
    assert len(retriever.retrieve("cats")) == 4
    tree = tiny_tree()
    assert RaptorRetriever.from_defaults(tree=tree, embed_model=FakeEmbedder(tree.dim)).tree is tree
    with pytest.raises(InvalidParameterError, match="exactly one"):
        RaptorRetriever.from_defaults(tree=tree, documents=documents())


def test_unknown_parameter_fails_before_building() -> None:
    embedder = FakeEmbedder(32)
    with pytest.raises(InvalidParameterError, match="chunk_max_tokenz"):
        RaptorIndex.from_documents(documents(), embed_model=embedder, chunk_max_tokenz=5)
    assert embedder.calls == 0


def test_empty_index() -> None:
    index = RaptorIndex.from_documents([], embed_model=FakeEmbedder(32))
    assert len(index.tree) == 0
    assert index.as_retriever(similarity_top_k=5).retrieve("anything") == []
    response = index.as_query_engine(llm=MockLLM()).query("anything")
    assert response.source_nodes == []


async def test_empty_index_async() -> None:
    index = RaptorIndex.from_documents([], embed_model=FakeEmbedder(32))
    assert await index.as_retriever().aretrieve("anything") == []


def test_empty_documents_are_rejected() -> None:
    with pytest.raises(InvalidInputError):
        RaptorIndex.from_documents([Document(text="  ")], embed_model=FakeEmbedder(32))


def test_insert_is_incremental_and_live_retrievers_follow(index: RaptorIndex) -> None:
    retriever = index.as_retriever(similarity_top_k=3)
    before = index.tree
    index.insert(Document(text="Volcanoes erupt lava. Magma rises from the mantle.", id_="volcano"))
    assert index.tree is not before
    assert "volcano" in index.tree.doc_ids
    assert index.ref_doc_ids == (*TOPICS, "volcano")
    # The old tree is updated in place, not rebuilt: every old leaf is kept as it was.
    for leaf in before.leaves:
        assert index.tree.node(leaf.id).text == leaf.text
        assert np.array_equal(
            index.tree.embeddings[index.tree.row(leaf.id)], before.embeddings[before.row(leaf.id)]
        )
    assert index.tree.build_info["incremental"]["last"]["op"] == "insert"
    nodes = retriever.retrieve("volcanoes erupt lava magma")
    assert "volcano" in nodes[0].node.metadata["raptor_doc_ids"]


def test_insert_duplicate_id_is_rejected_and_leaves_the_tree(index: RaptorIndex) -> None:
    before = index.tree
    with pytest.raises(InvalidInputError, match="duplicate"):
        index.insert(Document(text="More cats.", id_="cats"))
    assert index.tree is before


def test_insert_into_empty_index_and_delete() -> None:
    index = RaptorIndex.from_documents([], embed_model=FakeEmbedder(32), **fast_options())
    index.insert_nodes(documents())
    assert set(index.tree.doc_ids) == set(TOPICS)
    index.delete_ref_doc("cats")
    assert set(index.tree.doc_ids) == {"rockets", "bread"}
    with pytest.raises(InvalidInputError, match="cats"):
        index.delete_ref_doc("cats")


async def test_ainsert(index: RaptorIndex) -> None:
    await index.ainsert(Document(text="Volcanoes erupt lava. Magma rises.", id_="volcano"))
    assert "volcano" in index.tree.doc_ids


def test_insert_into_an_index_wrapping_a_bare_tree() -> None:
    tree = RaptorIndex.from_documents(
        documents(), embed_model=FakeEmbedder(32), **fast_options()
    ).tree
    index = RaptorIndex.from_tree(tree, embed_model=FakeEmbedder(32), **fast_options())
    assert set(index.ref_doc_ids) == set(TOPICS)
    index.insert(Document(text="Volcanoes erupt lava.", id_="volcano"))
    assert set(index.tree.doc_ids) == {*TOPICS, "volcano"}


def test_a_bare_trees_document_keeps_only_what_all_its_leaves_share() -> None:
    # `raptor build` gives a PDF's leaves the page they start on; the document rejoined
    # from them is not on page 0.
    from raptor_core import Document as CoreDocument
    from raptor_core import Segment, TreeBuilder

    pages = ["Cats purr when content. Cats sleep all day.", "Cats hunt mice at night. Mice hide."]
    pdf = CoreDocument(
        text="\n".join(pages),
        doc_id="cats.pdf",
        metadata={"source": "cats.pdf"},
        segments=(
            Segment(start=0, metadata={"page": 0, "page_label": "i"}),
            Segment(start=len(pages[0]) + 1, metadata={"page": 1, "page_label": "ii"}),
        ),
    )
    tree = TreeBuilder(FakeEmbedder(32), **fast_options()).build([pdf])
    assert {leaf.metadata.get("page") for leaf in tree.leaves} == {0, 1}
    index = RaptorIndex.from_tree(tree, embed_model=FakeEmbedder(32), **fast_options())
    [document] = index.documents
    assert document.metadata == {"source": "cats.pdf"}
    assert index.ref_doc_info["cats.pdf"].metadata == {"source": "cats.pdf"}


# -- engines ---------------------------------------------------------------------------------------
def test_query_engine_with_mock_llm(index: RaptorIndex) -> None:
    engine = index.as_query_engine(llm=MockLLM(), similarity_top_k=5, response_mode="compact")
    assert isinstance(engine, RetrieverQueryEngine)
    response = engine.query("What do cats do?")
    assert len(response.source_nodes) == 5
    assert str(response)  # MockLLM echoes the prompt, which contains the retrieved context
    assert response.source_nodes[0].node.text in str(response)


def test_retriever_query_engine_from_args(index: RaptorIndex) -> None:
    engine = RetrieverQueryEngine.from_args(index.as_retriever(), llm=MockLLM(max_tokens=4))
    response = engine.query("bread")
    assert str(response) == "text text text text"
    assert len(response.source_nodes) == 6


def test_query_engine_tool(index: RaptorIndex) -> None:
    tool = QueryEngineTool.from_defaults(
        index.as_query_engine(llm=MockLLM(max_tokens=3)),
        name="raptor_docs",
        description="Answers questions about cats, rockets and bread.",
    )
    output = tool.call(input="How do rockets reach orbit?")
    assert output.content == "text text text"
    assert output.raw_output.source_nodes


@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        ("best", CondensePlusContextChatEngine),
        ("condense_plus_context", CondensePlusContextChatEngine),
        ("context", ContextChatEngine),
        ("simple", SimpleChatEngine),
    ],
)
def test_chat_engines(index: RaptorIndex, mode: str, kind: type) -> None:
    engine = index.as_chat_engine(chat_mode=mode, llm=MockLLM(max_tokens=2), similarity_top_k=3)
    assert isinstance(engine, kind)
    assert engine.chat("Tell me about bread").response == "text text"


def test_condense_question_chat_engine(index: RaptorIndex) -> None:
    engine = index.as_chat_engine(chat_mode="condense_question", llm=MockLLM(max_tokens=2))
    assert str(engine.chat("Tell me about bread")) == "text text"


def test_unsupported_chat_mode(index: RaptorIndex) -> None:
    with pytest.raises(InvalidParameterError, match="QueryEngineTool"):
        index.as_chat_engine(chat_mode="react", llm=MockLLM())


def test_answer_llm_defaults_to_settings_llm(
    index: RaptorIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Settings, "_llm", MockLLM(max_tokens=1))
    assert str(index.as_query_engine().query("bread")) == "text"


# -- persistence -----------------------------------------------------------------------------------
def test_persist_load_round_trip(index: RaptorIndex, tmp_path: Any) -> None:
    index = RaptorIndex.from_documents(
        documents(),
        embed_model=FakeEmbedder(32),
        similarity_top_k=5,
        max_tokens=40,
        strategy="collapsed",
        layers=[0, 1],
        **fast_options(),
    )
    index.persist(tmp_path / "idx")
    saved = json.loads((tmp_path / "idx" / PARAMS_FILE).read_text())
    assert saved["retriever"] == {
        "similarity_top_k": 5,
        "max_tokens": 40,
        "strategy": "collapsed",
        "strategy_params": {"layers": [0, 1]},
    }
    loaded = RaptorIndex.load(tmp_path / "idx", embed_model=FakeEmbedder(32))
    assert loaded.retriever_kwargs == saved["retriever"]
    assert loaded.documents == index.documents
    for query in ["cats purr", "rockets orbit", "bread crust"]:
        want = [
            (n.node.node_id, n.score, n.node.metadata) for n in index.as_retriever().retrieve(query)
        ]
        got = [
            (n.node.node_id, n.score, n.node.metadata)
            for n in loaded.as_retriever().retrieve(query)
        ]
        assert got == want
    # Inserting after load updates with the saved build parameters (components passed again).
    loaded_with_components = RaptorIndex.load(
        tmp_path / "idx", embed_model=FakeEmbedder(32), **fast_options()
    )
    loaded_with_components.insert(Document(text="Volcanoes erupt lava.", id_="volcano"))
    assert "volcano" in loaded_with_components.tree.doc_ids


def test_load_recreates_a_recorded_raptor_core_embedder(index: RaptorIndex, tmp_path: Any) -> None:
    index.persist(tmp_path)
    loaded = RaptorIndex.load(tmp_path)  # FakeEmbedder(32) is recorded in the tree's params
    assert isinstance(loaded.embedder, FakeEmbedder)
    assert [n.node.node_id for n in loaded.as_retriever().retrieve("cats")] == [
        n.node.node_id for n in index.as_retriever().retrieve("cats")
    ]


def test_load_needs_the_model_when_it_cannot_be_recreated(tmp_path: Any) -> None:
    index = RaptorIndex.from_documents(documents(), embed_model=HashEmbedding(), **fast_options())
    index.persist(tmp_path)
    with pytest.raises(InvalidParameterError, match="embed_model="):
        RaptorIndex.load(tmp_path)
    loaded = RaptorIndex.load(tmp_path, embed_model=HashEmbedding())
    assert loaded.as_retriever().retrieve("cats")


def test_empty_index_round_trip(tmp_path: Any) -> None:
    RaptorIndex.from_documents([], embed_model=FakeEmbedder(32)).persist(tmp_path)
    loaded = RaptorIndex.load(tmp_path)
    assert len(loaded.tree) == 0
    assert loaded.as_retriever().retrieve("x") == []


def test_retriever_persist_round_trip(tmp_path: Any) -> None:
    tree = tiny_tree()
    retriever = RaptorRetriever(
        tree, FakeEmbedder(tree.dim), similarity_top_k=3, layers=[0], strategy="collapsed"
    )
    retriever.persist(tmp_path)
    loaded = RaptorRetriever.from_persist_dir(tmp_path, FakeEmbedder(tree.dim))
    assert loaded.get_params() == retriever.get_params()
    assert loaded.retrieve("cats") == retriever.retrieve("cats")
    # Overrides win; switching strategy drops the old strategy's parameters.
    assert (
        RaptorRetriever.from_persist_dir(
            tmp_path, FakeEmbedder(tree.dim), similarity_top_k=1
        ).similarity_top_k
        == 1
    )


def test_load_of_a_bare_tree_directory(tmp_path: Any) -> None:
    tree = tiny_tree()
    tree.save(tmp_path)
    index = RaptorIndex.load(tmp_path, embed_model=FakeEmbedder(tree.dim))
    assert index.retriever_kwargs == {}
    assert set(index.ref_doc_ids) == {"d1", "d2"}
    assert index.as_retriever().retrieve("cats")


def test_damaged_parameter_file(tmp_path: Any) -> None:
    tiny_tree().save(tmp_path)
    (tmp_path / PARAMS_FILE).write_text("{not json")
    with pytest.raises(TreeFormatError):
        RaptorIndex.load(tmp_path, embed_model=FakeEmbedder())
    (tmp_path / PARAMS_FILE).write_text(json.dumps({"format": "other"}))
    with pytest.raises(TreeFormatError):
        RaptorRetriever.from_persist_dir(tmp_path, FakeEmbedder())


def _params_file(**sections: Any) -> str:
    return json.dumps({"format": "raptor-llamaindex", "format_version": 1, **sections})


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"format": "raptor-llamaindex", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "deep"),
        ('{"format": "raptor-llamaindex", "format_version": ' + "1" * 5000 + "}", "digits"),
        (
            _params_file(documents=[{"doc_id": "d", "text": "t", "metadata": {"s": 1}}]).replace(
                '"s": 1', '"s": NaN'
            ),
            "NaN",
        ),
        (_params_file(documents=[{"doc_id": "d", "text": "\ud800"}]), "surrogate"),
        (_params_file(retriever={"strategy": "collapsed", "strategy_params": {"x": 1}}), "x"),
    ],
    ids=["deep", "long-integer", "nan", "surrogate", "schema"],
)
def test_a_parameter_file_the_parser_cannot_take_is_a_format_error(
    tmp_path: Any, content: str, match: str
) -> None:
    tiny_tree().save(tmp_path)
    (tmp_path / PARAMS_FILE).write_text(content)
    with pytest.raises(TreeFormatError, match=match):
        read_params(tmp_path)
    with pytest.raises(TreeFormatError, match=match):
        RaptorRetriever.from_persist_dir(tmp_path, FakeEmbedder())


def test_a_parameter_file_is_read_as_the_tree_files_are(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree_dir = tmp_path / "tree"
    tiny_tree().save(tree_dir)
    params = tree_dir / PARAMS_FILE
    # A symbolic link to a file elsewhere is refused, never followed.
    outside = tmp_path / "elsewhere.json"
    outside.write_text(_params_file(retriever={"similarity_top_k": 999}))
    params.symlink_to(outside)
    with pytest.raises(TreeFormatError, match="symbolic link"):
        read_params(tree_dir)
    with pytest.raises(TreeFormatError, match="symbolic link"):
        RaptorIndex.load(tree_dir, embed_model=FakeEmbedder())
    params.unlink()
    os.mkfifo(params)  # would block a plain open
    with pytest.raises(TreeFormatError, match="not a regular file"):
        read_params(tree_dir)
    params.unlink()
    params.write_text(_params_file(retriever={"similarity_top_k": 3}))
    assert read_params(tree_dir)["retriever"]["similarity_top_k"] == 3
    monkeypatch.setattr(retriever_module, "MAX_JSON_BYTES", 16)
    with pytest.raises(TreeFormatError, match="bytes"):
        read_params(tree_dir)


def test_load_without_a_tree(tmp_path: Any) -> None:
    with pytest.raises(TreeFormatError):
        RaptorIndex.load(tmp_path / "nothing")


# -- model wrappers --------------------------------------------------------------------------------
def test_embedder_wrapper_shapes_and_dtype() -> None:
    embedder = LlamaIndexEmbedder(HashEmbedding())
    matrix = embedder.embed_documents(["a cat", "a dog", "a rocket"])
    assert matrix.shape == (3, 32) and matrix.dtype == np.float32
    vector = embedder.embed_query("a cat")
    assert vector.shape == (32,) and vector.dtype == np.float32
    np.testing.assert_allclose(matrix[0], FakeEmbedder(32).embed_documents(["a cat"])[0], rtol=1e-6)
    assert embedder.get_params() == {"embed_class": "HashEmbedding", "model_name": "hash-embedding"}
    assert embedder.embed_documents([]).shape[0] == 0


async def test_embedder_wrapper_async_uses_the_models_async_api() -> None:
    model = HashEmbedding()
    embedder = LlamaIndexEmbedder(model)
    matrix = await embedder.aembed_documents(["a cat", "a dog"])
    vector = await embedder.aembed_query("a cat")
    assert matrix.shape == (2, 32) and vector.shape == (32,)
    assert model._calls == {"atext": 2, "aquery": 1}


def test_embedder_wrapper_errors_are_embedding_errors() -> None:
    embedder = LlamaIndexEmbedder(BrokenEmbedding())
    with pytest.raises(EmbeddingError, match="model offline"):
        embedder.embed_documents(["x"])
    with pytest.raises(EmbeddingError, match="model offline"):
        embedder.embed_query("x")


def test_custom_base_embedding_drives_the_build() -> None:
    model = HashEmbedding()
    index = RaptorIndex.from_documents(documents(), embed_model=model, **fast_options())
    assert model._calls["text"] >= len(index.tree.leaves)
    assert index.tree.params["embedder"]["class"] == "raptor_llamaindex.models.LlamaIndexEmbedder"
    assert index.tree.params["embedder"]["model_name"] == "hash-embedding"
    expected = RaptorIndex.from_documents(
        documents(), embed_model=FakeEmbedder(32), **fast_options()
    )
    np.testing.assert_allclose(
        index.tree.embeddings, expected.tree.embeddings, rtol=1e-5, atol=1e-6
    )


async def test_custom_base_embedding_drives_the_async_build() -> None:
    model = HashEmbedding()
    index = await RaptorIndex.afrom_documents(documents(), embed_model=model, **fast_options())
    assert model._calls.get("atext", 0) >= len(index.tree.leaves)
    assert "text" not in model._calls


def test_llm_wrapper() -> None:
    llm = LlamaIndexLLM(MockLLM(max_tokens=3))
    assert llm.complete("hello") == "text text text"
    assert asyncio.run(llm.acomplete("hello")) == "text text text"
    assert llm.get_params()["llm_class"] == "MockLLM"


def test_llm_wrapper_forwards_max_tokens_only_when_asked() -> None:
    model = RecordingLLM()
    LlamaIndexLLM(model).complete("p", max_tokens=5)
    LlamaIndexLLM(model, max_tokens_kwarg="max_tokens").complete("p", max_tokens=5)
    assert [kwargs for _, kwargs in model._calls] == [{}, {"max_tokens": 5}]


def test_llm_wrapper_errors() -> None:
    with pytest.raises(LLMError, match="quota"):
        LlamaIndexLLM(RecordingLLM(error=RuntimeError("quota"))).complete("p")
    with pytest.raises(LLMTimeoutError):
        LlamaIndexLLM(RecordingLLM(error=TimeoutError("slow"))).complete("p")


def test_llm_summarizer_drives_the_build() -> None:
    model = RecordingLLM(answer="Summary of a cluster.")
    options = fast_options()
    del options["summarizer"]
    index = RaptorIndex.from_documents(
        documents(), embed_model=FakeEmbedder(32), llm=model, **options
    )
    summaries = [n for n in index.tree.nodes if n.layer > 0]
    assert summaries and {n.text for n in summaries} == {"Summary of a cluster."}
    assert len(model._calls) == len(summaries)
    assert model._calls[0][0].startswith("Write a summary of the following")


def test_summarizer_wrapper() -> None:
    summarizer = LlamaIndexSummarizer(RecordingLLM(answer=" Bees dance. "), prompt="Sum: {context}")
    assert summarizer.summarize(["a", "b"], max_tokens=5) == "Bees dance."
    assert summarizer.get_params()["prompt"] == "Sum: {context}"


# -- defaults and Settings -----------------------------------------------------------------------
def test_unset_settings_are_never_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Settings, "_llm", None)
    monkeypatch.setattr(Settings, "_embed_model", None)
    assert resolve_llm(None) is None
    assert resolve_summarizer(None) is None  # TreeBuilder's extractive default
    RaptorIndex.from_documents(documents(), embed_model=FakeEmbedder(32), **fast_options())
    assert Settings._llm is None and Settings._embed_model is None


def test_settings_models_are_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    model = HashEmbedding()
    llm = RecordingLLM()
    monkeypatch.setattr(Settings, "_embed_model", model)
    monkeypatch.setattr(Settings, "_llm", llm)
    embedder = resolve_embedder(None)
    assert isinstance(embedder, LlamaIndexEmbedder) and embedder.embed_model is model
    summarizer = resolve_summarizer(None)
    assert isinstance(summarizer, LLMSummarizer)
    assert summarizer.llm.llm is llm  # type: ignore[attr-defined]
    options = fast_options()
    del options["summarizer"]
    index = RaptorIndex.from_documents(documents(), **options)
    assert index.tree.params["embedder"]["model_name"] == "hash-embedding"
    assert llm._calls


def test_settings_placeholders_count_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Settings, "_llm", MockLLM())
    monkeypatch.setattr(Settings, "_embed_model", MockEmbedding(embed_dim=4))
    assert resolve_llm(None) is None
    assert resolve_summarizer(None) is None
    from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder

    assert isinstance(resolve_embedder(None), SentenceTransformerEmbedder)


def test_explicit_models_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Settings, "_embed_model", HashEmbedding())
    core = FakeEmbedder(8)
    assert resolve_embedder(core) is core
    extractive = ExtractiveSummarizer(core)
    assert resolve_summarizer(RecordingLLM(), extractive) is extractive
    assert isinstance(resolve_summarizer(MockLLM()), LlamaIndexSummarizer)


def test_recorded_core_embedder_wins_over_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Settings, "_embed_model", HashEmbedding())
    tree = Tree(
        nodes=tiny_tree().nodes,
        embeddings=tiny_tree().embeddings,
        params={"embedder": {"class": "raptor_core.testing.FakeEmbedder", "dim": 64}},
    )
    retriever = RaptorRetriever(tree)
    assert isinstance(retriever.embedder, FakeEmbedder)
    assert retriever.embedder.dim == 64


def test_raptor_embedding_exposes_a_core_embedder_to_llamaindex() -> None:
    from llama_index.core import VectorStoreIndex

    core = FakeEmbedder(32)
    embed_model = RaptorEmbedding(core)
    assert embed_model.embedder is core
    assert embed_model.model_name == "FakeEmbedder"
    np.testing.assert_allclose(
        embed_model.get_query_embedding("cats"), core.embed_query("cats"), rtol=1e-6
    )
    batch = embed_model.get_text_embedding_batch(["cats", "dogs"])
    np.testing.assert_allclose(batch, core.embed_documents(["cats", "dogs"]), rtol=1e-6)
    assert asyncio.run(embed_model.aget_query_embedding("cats")) == embed_model.get_query_embedding(
        "cats"
    )
    # RaptorIndex unwraps it, so the tree records the core embedder and load() re-creates it.
    assert resolve_embedder(embed_model) is core
    # And LlamaIndex's own indexes accept it.
    vector = VectorStoreIndex.from_documents(documents(), embed_model=embed_model)
    assert (
        vector.as_retriever(similarity_top_k=1).retrieve("rockets orbit")[0].node.ref_doc_id
        == "rockets"
    )


def test_document_metadata_exclusions_survive(tmp_path: Any) -> None:
    docs = documents()
    for doc in docs:
        doc.metadata["file_path"] = f"/data/{doc.doc_id}.txt"
        doc.excluded_llm_metadata_keys = ["file_path"]
    index = RaptorIndex.from_documents(docs, embed_model=FakeEmbedder(32), **fast_options())
    assert index.retriever_kwargs["excluded_llm_metadata_keys"] == ["file_path"]
    leaf = next(
        n.node
        for n in index.as_retriever(similarity_top_k=20).retrieve("cats purr")
        if n.node.metadata["raptor_layer"] == 0
    )
    assert leaf.metadata["file_path"].startswith("/data/")
    assert "file_path" not in leaf.get_content(metadata_mode=MetadataMode.LLM)
    assert "file_path" in leaf.get_content(metadata_mode=MetadataMode.EMBED)
    assert "topic" in leaf.get_content(metadata_mode=MetadataMode.LLM)
    index.persist(tmp_path)
    loaded = RaptorIndex.load(tmp_path, embed_model=FakeEmbedder(32), **fast_options())
    assert loaded.as_retriever().excluded_llm_metadata_keys == ["file_path"]
    extra = Document(text="Volcanoes erupt lava.", id_="volcano", metadata={"owner": "x"})
    extra.excluded_embed_metadata_keys = ["owner"]
    loaded.insert(extra)
    assert loaded.retriever_kwargs["excluded_embed_metadata_keys"] == ["owner"]


def test_persist_refuses_unsaveable_parameters_before_writing(tmp_path: Any) -> None:
    from raptor_core.backends.numpy_index import NumpyIndex

    tree = tiny_tree()
    vector_index = NumpyIndex()
    vector_index.add([n.id for n in tree.nodes], np.asarray(tree.embeddings))
    retriever = RaptorRetriever(
        tree, FakeEmbedder(tree.dim), index=vector_index, strategy="collapsed"
    )
    assert retriever.retrieve("cats")
    with pytest.raises(InvalidParameterError, match="JSON"):
        retriever.persist(tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_query_bundle_embedding_is_used_instead_of_the_query_string() -> None:
    from llama_index.core.schema import QueryBundle

    from raptor_core.testing import FakeEmbedder, tiny_tree
    from raptor_llamaindex import RaptorRetriever

    tree = tiny_tree()
    embedder = FakeEmbedder(tree.dim)
    retriever = RaptorRetriever(tree, embedder, similarity_top_k=1, max_tokens=None)
    rocket_vector = embedder.embed_query("rockets orbit satellites launch").tolist()
    # The text asks about cats, the precomputed embedding about rockets: the embedding wins.
    (hit,) = retriever.retrieve(QueryBundle(query_str="cats purr", embedding=rocket_vector))
    assert "ocket" in hit.node.get_content() or "atellite" in hit.node.get_content()
    (hit,) = retriever.retrieve(QueryBundle(query_str="cats purr"))
    assert "at" in hit.node.get_content().lower()
    hyde = QueryBundle(query_str="cats purr", custom_embedding_strs=["rockets reach orbit"])
    (hit,) = retriever.retrieve(hyde)
    assert "ocket" in hit.node.get_content() or "orbit" in hit.node.get_content()


def test_default_strategy_is_the_core_default_and_returns_passages() -> None:
    from raptor_core import DEFAULT_STRATEGY

    tree = tiny_tree()
    retriever = RaptorRetriever(tree, FakeEmbedder(tree.dim), similarity_top_k=2)
    assert retriever.strategy == DEFAULT_STRATEGY == "passage"
    nodes = retriever.retrieve("cats purr")
    assert nodes and all(n.node.metadata["raptor_layer"] == 0 for n in nodes)
    joined = [n for n in nodes if "raptor_leaves" in n.node.metadata]
    assert joined and joined[0].node.metadata["raptor_leaves"] == ["L0.0", "L0.1"]
    assert "raptor_leaves" in joined[0].node.excluded_llm_metadata_keys
    assert all(0.0 <= (n.score or 0.0) <= 1.0 for n in nodes)


def test_from_documents_honours_a_summary_budget() -> None:
    from raptor_core import BudgetExceededError, LLMBudget

    llm = RecordingLLM()
    with pytest.raises(BudgetExceededError, match="max_summary_tokens"):
        RaptorIndex.from_documents(
            documents(),
            embed_model=FakeEmbedder(32),
            llm=llm,
            budget=LLMBudget(max_summary_tokens=5),  # less than any one summary call needs
            **fast_options(),
        )
    assert llm._calls == []  # refused before the first call, not after it
