"""raptor_llamaindex with real parts: MiniLM embeddings through a LlamaIndex ``BaseEmbedding``,
UMAP/GMM clustering, extractive summaries, and real llama-index-core engines and events."""

from __future__ import annotations

import asyncio
import itertools
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, VectorStoreIndex
from llama_index.core.agent.workflow import ReActAgent
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent, RetrievalStartEvent
from llama_index.core.llms import CompletionResponse, CustomLLM, LLMMetadata, MockLLM
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.tools import QueryEngineTool
from pydantic import Field, PrivateAttr

from raptor_llamaindex import RaptorEmbedding, RaptorIndex, RaptorRetriever

pytestmark = pytest.mark.integration

DATA = Path(__file__).resolve().parents[1] / "data"


class MiniLMEmbedding(BaseEmbedding):
    """What a user's own ``BaseEmbedding`` subclass looks like (HuggingFaceEmbedding-style):
    it wraps the session's sentence-transformers model and knows nothing about RAPTOR."""

    _model: Any = PrivateAttr()
    _texts: int = PrivateAttr(default=0)

    def __init__(self, model: Any, **kwargs: Any) -> None:
        super().__init__(model_name="all-MiniLM-L6-v2", embed_batch_size=64, **kwargs)
        self._model = model

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._model.embed_query(query).tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return await asyncio.to_thread(self._get_query_embedding, query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._get_text_embeddings([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        self._texts += len(texts)
        return self._model.embed_documents(texts).tolist()


class ScriptedReActLLM(CustomLLM):
    """Plays a ReAct agent's LLM: calls the ``essays`` tool once, then answers."""

    _turn: int = PrivateAttr(default=0)

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(model_name="scripted-react")

    def _next(self) -> str:
        self._turn += 1
        if self._turn == 1:
            return (
                "Thought: I need the essays.\nAction: essays\n"
                'Action Input: {"input": "How do honeybees communicate?"}'
            )
        return "Thought: I can answer without using any more tools.\nAnswer: They dance."

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return CompletionResponse(text=self._next())

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> Any:
        text = self._next()
        yield CompletionResponse(text=text, delta=text)


def essays() -> list[Document]:
    """tests/data/multi_topic.md split into one LlamaIndex Document per essay."""
    text = (DATA / "multi_topic.md").read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    docs = []
    for section in sections:
        title, _, body = section.partition("\n")
        slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
        docs.append(Document(text=body.strip(), id_=slug, metadata={"title": title.strip()}))
    assert len(docs) == 6
    return docs


@pytest.fixture(scope="module")
def embed_model(st_embedder: Any) -> MiniLMEmbedding:
    return MiniLMEmbedding(st_embedder)


@pytest.fixture(scope="module")
def index(embed_model: MiniLMEmbedding) -> RaptorIndex:
    return RaptorIndex.from_documents(
        essays(), embed_model=embed_model, random_state=0, similarity_top_k=8
    )


class RetrievalEvents(BaseEventHandler):
    events: list[BaseEvent] = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "RetrievalEvents"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, RetrievalStartEvent | RetrievalEndEvent):
            self.events.append(event)


def test_custom_base_embedding_drives_the_build(
    index: RaptorIndex, embed_model: MiniLMEmbedding, st_embedder: Any
) -> None:
    tree = index.tree
    assert embed_model._texts >= len(tree.nodes)
    assert tree.num_layers >= 2
    assert set(tree.doc_ids) == {d.doc_id for d in essays()}
    assert tree.params["embedder"]["class"] == "raptor_llamaindex.models.LlamaIndexEmbedder"
    # The wrapper hands the model's vectors to the core unchanged (up to normalisation).
    leaf_rows = tree.layer_rows(0)[:5]
    direct = st_embedder.embed_documents([tree.nodes[r].text for r in leaf_rows])
    direct /= np.linalg.norm(direct, axis=1, keepdims=True)
    np.testing.assert_allclose(tree.embeddings[leaf_rows], direct, atol=1e-5)


def test_query_engine_answers_with_nodes_from_several_layers(index: RaptorIndex) -> None:
    # Collapsed (by name: the default returns passages of leaves) mixes summaries and leaves.
    engine = index.as_query_engine(llm=MockLLM(), strategy="collapsed")
    response = engine.query("How do honeybees tell each other where flowers are?")
    assert str(response)
    layers = {n.node.metadata["raptor_layer"] for n in response.source_nodes}
    assert len(layers) >= 2, layers
    # A LlamaIndex pipeline built by hand behaves the same.
    manual = RetrieverQueryEngine.from_args(index.as_retriever(), llm=MockLLM(max_tokens=4))
    assert str(manual.query("volcano eruptions")) == "text text text text"


def test_retrieval_is_on_topic(index: RaptorIndex) -> None:
    nodes = index.as_retriever(similarity_top_k=3).retrieve("What did Gutenberg invent in Mainz?")
    assert nodes[0].node.metadata["raptor_doc_ids"] == [
        "the-printing-press-and-the-spread-of-the-written-word"
    ]


def test_instrumentation_handler_sees_retrieval_events(index: RaptorIndex) -> None:
    dispatcher = get_dispatcher()
    handler = RetrievalEvents()
    dispatcher.add_event_handler(handler)
    try:
        response = index.as_query_engine(llm=MockLLM(max_tokens=2)).query("sourdough starter")
    finally:
        dispatcher.event_handlers.remove(handler)
    assert [type(e) for e in handler.events] == [RetrievalStartEvent, RetrievalEndEvent]
    end = handler.events[1]
    assert [n.node.node_id for n in end.nodes] == [n.node.node_id for n in response.source_nodes]


def test_persist_load_gives_identical_results(
    index: RaptorIndex, embed_model: MiniLMEmbedding, tmp_path: Path
) -> None:
    index.persist(tmp_path / "raptor")
    loaded = RaptorIndex.load(tmp_path / "raptor", embed_model=embed_model)
    assert loaded.retriever_kwargs == index.retriever_kwargs == {"similarity_top_k": 8}
    for query in ["Apollo 11 landing", "How do vaccines train immunity?", "lava viscosity"]:
        want = index.as_retriever().retrieve(query)
        got = loaded.as_retriever().retrieve(query)
        assert [(n.node.node_id, n.score) for n in got] == [(n.node.node_id, n.score) for n in want]
        assert [n.node.metadata for n in got] == [n.node.metadata for n in want]


def test_similarity_top_k_larger_than_the_tree(index: RaptorIndex) -> None:
    nodes = index.as_retriever(
        similarity_top_k=10_000, max_tokens=None, strategy="collapsed"
    ).retrieve("bread")
    # Every node once; summaries that only carry a single child up are not repeated.
    original = [
        n.id
        for n, carried in zip(index.tree.nodes, index.tree.carried_mask, strict=True)
        if not carried
    ]
    assert sorted(n.node.node_id for n in nodes) == sorted(original)
    # The default (passage) strategy without a budget: every leaf once.
    leaves = index.as_retriever(similarity_top_k=10_000, max_tokens=None).retrieve("bread")
    assert sorted(n.node.node_id for n in leaves) == sorted(n.id for n in index.tree.leaves)


def test_empty_index(embed_model: MiniLMEmbedding) -> None:
    empty = RaptorIndex.from_documents([], embed_model=embed_model)
    assert empty.as_retriever().retrieve("anything") == []
    assert empty.as_query_engine(llm=MockLLM()).query("anything").source_nodes == []


async def test_async_retrieval_inside_a_running_loop(index: RaptorIndex) -> None:
    retriever = index.as_retriever(similarity_top_k=4)
    queries = ["waggle dance", "Gutenberg Bible", "Pinatubo eruption"]
    results = await asyncio.gather(*(retriever.aretrieve(q) for q in queries))
    for query, nodes in zip(queries, results, strict=True):
        assert [n.node.node_id for n in nodes] == [
            n.node.node_id for n in retriever.retrieve(query)
        ]
    response = await index.as_query_engine(llm=MockLLM(max_tokens=2)).aquery("moon landing")
    assert response.source_nodes


def test_query_engine_tool_for_an_agent(index: RaptorIndex) -> None:
    tool = QueryEngineTool.from_defaults(
        index.as_query_engine(llm=MockLLM(max_tokens=3)),
        name="essays",
        description="Answers questions about six essays (bees, printing, volcanoes, ...).",
    )
    assert tool.metadata.name == "essays"
    output = tool.call(input="Who commanded Apollo 11?")
    assert output.content == "text text text"
    assert output.raw_output.source_nodes
    assert tool.metadata.to_openai_tool()["function"]["name"] == "essays"


# LlamaIndex's agent workflow itself triggers pydantic/workflows deprecation warnings.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_query_engine_tool_inside_a_react_agent(index: RaptorIndex) -> None:
    tool = QueryEngineTool.from_defaults(
        index.as_query_engine(llm=MockLLM(max_tokens=3)),
        name="essays",
        description="Answers questions about six essays.",
    )
    agent = ReActAgent(tools=[tool], llm=ScriptedReActLLM())
    response = await agent.run("How do honeybees communicate?")
    assert response.response.content == "They dance."
    (call,) = response.tool_calls
    assert call.tool_name == "essays"
    sources = call.tool_output.raw_output.source_nodes
    assert any("bee" in s.node.get_content().lower() for s in sources)


def test_vector_store_index_comparison_on_the_same_documents(
    index: RaptorIndex, embed_model: MiniLMEmbedding
) -> None:
    """The drop-in claim: same documents, same model, same chunk size and top-k."""
    docs = essays()
    vector = VectorStoreIndex.from_documents(
        docs,
        embed_model=embed_model,
        transformations=[SentenceSplitter(chunk_size=100, chunk_overlap=0)],
    ).as_retriever(similarity_top_k=5)
    # Collapsed by name: the claim below is about summaries (the default returns passages).
    raptor = index.as_retriever(similarity_top_k=5, strategy="collapsed")
    question = "What is the essay about honeybees mainly about?"
    vector_nodes = vector.retrieve(question)
    raptor_nodes = raptor.retrieve(question)
    assert len(vector_nodes) == len(raptor_nodes) == 5
    bees = "how-honeybees-communicate"
    assert all(n.node.ref_doc_id == bees for n in vector_nodes)
    assert all(n.node.metadata["raptor_doc_ids"] == [bees] for n in raptor_nodes)
    # Only the tree can answer a "what is it about" question with a summary.
    assert any(n.node.metadata["raptor_layer"] > 0 for n in raptor_nodes)


def test_retriever_from_a_saved_tree_with_the_core_model(
    index: RaptorIndex, st_embedder: Any, tmp_path: Path
) -> None:
    index.as_retriever(strategy="traversal", similarity_top_k=4, top_k=2).persist(tmp_path)
    retriever = RaptorRetriever.from_persist_dir(tmp_path, RaptorEmbedding(st_embedder))
    assert retriever.strategy == "traversal" and retriever.strategy_params == {"top_k": 2}
    nodes = retriever.retrieve("sourdough starter")
    assert 0 < len(nodes) <= 4


def test_mmr_query_mode_with_the_real_model(index: RaptorIndex) -> None:
    from llama_index.core.vector_stores.types import VectorStoreQueryMode

    from raptor_core import make_retriever

    query = "What do the essays say about water?"
    mmr = index.as_retriever(
        vector_store_query_mode=VectorStoreQueryMode.MMR,
        vector_store_kwargs={"mmr_threshold": 0.5},
        similarity_top_k=5,
    )
    hits = mmr.retrieve(query)
    core = make_retriever(
        "mmr", index.store, index.embedder, k=5, lambda_mult=0.5, max_tokens=mmr.max_tokens
    ).retrieve(query)
    assert [h.node.node_id for h in hits] == [h.id for h in core]
    assert {h.node.metadata["raptor_source"] for h in hits} == {"mmr"}


def test_passages_of_overlapping_nodes_hold_each_overlap_once(
    embed_model: MiniLMEmbedding,
) -> None:
    """SentenceSplitter's chunk_overlap repeats the end of each node at the next one's start;
    a passage of neighbouring nodes holds that text once."""
    index = RaptorIndex.from_documents(
        essays(),
        embed_model=embed_model,
        transformations=[SentenceSplitter(chunk_size=64, chunk_overlap=24)],
        random_state=0,
    )
    hits = index.as_retriever(max_tokens=1000).retrieve("How do honeybees communicate?")
    joined = [hit for hit in hits if len(hit.node.metadata.get("raptor_leaves", [])) > 1]
    assert joined, "neighbouring nodes should form a passage"
    essay_text = "\n".join(doc.text for doc in essays())
    overlaps = 0
    for hit in joined:
        leaf_ids = [leaf_id.split("[")[0] for leaf_id in hit.node.metadata["raptor_leaves"]]
        texts = [index.tree.node(leaf_id).text for leaf_id in leaf_ids]
        for a, b in itertools.pairwise(texts):
            repeated = max(k for k in range(len(b) + 1) if a.endswith(b[:k]))
            if repeated >= 16:
                overlaps += 1
                # As often in the passage as in the essays (once, unless the essays repeat it).
                assert hit.node.text.count(b[:repeated]) <= essay_text.count(b[:repeated])
        assert len(hit.node.text) < sum(len(text) + 1 for text in texts)
    assert overlaps, "the splitter's overlap should be seen between neighbours"


def test_rejoined_nodes_build_the_leaves_their_essays_build(
    embed_model: MiniLMEmbedding,
) -> None:
    """rejoin_nodes=True over SentenceSplitter's nodes (overlapping, cut mid-paragraph) gives
    RAPTOR's own chunks of the essays: the leaves of a build over the essays themselves."""
    nodes = SentenceSplitter(chunk_size=96, chunk_overlap=24).get_nodes_from_documents(essays())
    assert len(nodes) > 2 * len(essays())
    joined = RaptorIndex(nodes, embed_model=embed_model, random_state=0, rejoin_nodes=True)
    whole = RaptorIndex.from_documents(essays(), embed_model=embed_model, random_state=0)

    def leaves(index: RaptorIndex) -> list[tuple[str | None, Any, str]]:
        # A space the splitter dropped between two sentences comes back as a line break.
        return [(n.doc_id, n.span, " ".join(n.text.split())) for n in index.tree.leaves]

    assert leaves(joined) == leaves(whole)
    assert joined.tree.num_layers > 1
    assert sorted(joined.ref_doc_ids) == sorted(doc.id_ for doc in essays())
    hits = joined.as_retriever(max_tokens=1000).retrieve("How do honeybees communicate?")
    # Passages run across the splitter's node boundaries; the overlaps are not repeated.
    assert any("dance" in hit.node.text.lower() for hit in hits)
    node_ids = {n.node_id for n in nodes}
    assert not any(hit.node.node_id in node_ids for hit in hits)


def test_a_pdf_read_page_by_page_is_one_document_whose_passages_cross_pages(
    embed_model: MiniLMEmbedding, tmp_path: Path
) -> None:
    """SimpleDirectoryReader's pages of a real PDF: one document in the tree, leaves and
    passages run across page breaks, and every hit names the page it starts on."""
    from input_files import make_pdf, read_pdf_pages_with_llamaindex

    words = " ".join(doc.text for doc in essays()).split()
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    pdf = make_pdf(tmp_path / "essays.pdf", [lines[i : i + 9] for i in range(0, len(lines), 9)])
    pages = read_pdf_pages_with_llamaindex([pdf])
    assert len(pages) > 5
    index = RaptorIndex.from_documents(pages, embed_model=embed_model, random_state=0)
    assert index.tree.doc_ids == (pages[0].doc_id,)
    assert index.tree.num_layers > 1
    joined = "\n".join(page.text for page in pages)
    breaks = list(itertools.accumulate(len(page.text) + 1 for page in pages[:-1]))
    crossing = [
        leaf
        for leaf in index.tree.leaves
        if leaf.span is not None and any(leaf.span[0] < b < leaf.span[1] for b in breaks)
    ]
    assert len(crossing) >= len(pages) // 2  # most breaks fall inside a sentence
    for leaf in index.tree.leaves:
        assert leaf.span is not None
        page = sum(b <= leaf.span[0] for b in breaks)
        assert leaf.metadata["page_label"] == str(page + 1)
        assert joined[leaf.span[0] : leaf.span[1]].strip() == leaf.text.strip()
    hits = index.as_retriever(max_tokens=400).retrieve("How do honeybees communicate?")
    assert "dance" in hits[0].node.text.lower()
    labels = {page.metadata["page_label"] for page in pages}
    assert all(hit.node.metadata["page_label"] in labels for hit in hits)
    # Each page is still a document of the index.
    assert index.ref_doc_ids == tuple(page.doc_id for page in pages)
