"""Issue 14.2: the user's nodes are the leaves, their fields survive, builds are instrumented."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.embedding import EmbeddingEndEvent, EmbeddingStartEvent
from llama_index.core.instrumentation.events.llm import (
    LLMCompletionEndEvent,
    LLMCompletionStartEvent,
)
from llama_index.core.instrumentation.span_handlers import SimpleSpanHandler
from llama_index.core.llms import MockLLM
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import MetadataMode, NodeRelationship, TextNode
from pydantic import Field

from raptor_core.exceptions import InvalidParameterError
from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer, tiny_tree
from raptor_core.tree import Tree
from raptor_llamaindex import LlamaIndexEmbedder, RaptorIndex, RaptorRetriever
from raptor_llamaindex.ingestion import (
    LLAMAINDEX_NODE_KEY,
    chunk_position,
    node_to_document,
    pop_node_fields,
)

TEXTS = {
    "cats": "Cats purr softly. Cats sleep in the sun. Kittens chase string. A cat grooms its fur.",
    "rockets": "Rockets burn fuel. Rockets reach orbit. Satellites circle earth. Launch pads roar.",
    "bread": "Bakers knead dough. Yeast makes bread rise. Ovens bake loaves. Crust turns brown.",
    "bees": "Bees dance to show flowers. Hives hold honey. Queens lay eggs. Drones fly out.",
}


class PairClusterer:
    """Consecutive pairs: a fast, deterministic stand-in for UMAP+GMM."""

    def cluster(self, vectors: Any) -> list[list[int]]:
        n = len(vectors)
        return [list(range(i, min(i + 2, n))) for i in range(0, n, 2)]


def fast(**extra: Any) -> dict[str, Any]:
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


def user_nodes() -> list[TextNode]:
    """Nodes as a node parser makes them: ids, metadata, hidden keys, links, offsets."""
    nodes = []
    for i, (topic, text) in enumerate(TEXTS.items()):
        source = Document(text="the whole book", id_=f"book-{i % 2}")
        node = TextNode(
            id_=f"node-{topic}",
            text=text,
            metadata={"topic": topic, "file_path": f"/data/{topic}.txt", "page": i},
            excluded_embed_metadata_keys=["file_path"],
            excluded_llm_metadata_keys=["file_path", "page"],
            start_char_idx=10 * i,
            end_char_idx=10 * i + len(text),
        )
        node.relationships[NodeRelationship.SOURCE] = source.as_related_node_info()
        nodes.append(node)
    for before, after in itertools.pairwise(nodes):
        before.relationships[NodeRelationship.NEXT] = after.as_related_node_info()
        after.relationships[NodeRelationship.PREVIOUS] = before.as_related_node_info()
    return nodes


# -- adapter: transformations and nodes -----------------------------------------------------------
def test_transformations_output_is_the_leaves_never_rechunked() -> None:
    docs = [Document(text=" ".join(TEXTS.values()) * 3, id_="book")]
    splitter = SentenceSplitter(chunk_size=40, chunk_overlap=0)
    expected = [n.get_content() for n in splitter.get_nodes_from_documents(docs)]
    index = RaptorIndex.from_documents(
        docs, embed_model=FakeEmbedder(16), transformations=[splitter], **fast()
    )
    leaves = index.tree.leaves
    # chunk_max_tokens=8 would have cut these ~30-word nodes: they are kept whole.
    assert [leaf.text for leaf in leaves] == expected
    assert all(leaf.doc_id == "book" for leaf in leaves)
    assert index.ref_doc_ids == ("book",)


def test_node_parser_as_chunker_and_pipeline_work_like_transformations() -> None:
    docs = [Document(text=" ".join(TEXTS.values()) * 2, id_="book")]
    splitter = SentenceSplitter(chunk_size=40, chunk_overlap=0)
    by_list = RaptorIndex.from_documents(
        docs, embed_model=FakeEmbedder(16), transformations=[splitter], **fast()
    )
    by_chunker = RaptorIndex.from_documents(
        docs, embed_model=FakeEmbedder(16), chunker=splitter, **fast()
    )
    by_pipeline = RaptorIndex.from_documents(
        docs,
        embed_model=FakeEmbedder(16),
        transformations=IngestionPipeline(transformations=[splitter]),
        **fast(),
    )
    texts = [leaf.text for leaf in by_list.tree.leaves]
    assert [leaf.text for leaf in by_chunker.tree.leaves] == texts
    assert [leaf.text for leaf in by_pipeline.tree.leaves] == texts


def test_bad_transformations_fail_before_building() -> None:
    with pytest.raises(InvalidParameterError, match="transformations must be"):
        RaptorIndex.from_documents(
            [Document(text="x y z")], embed_model=FakeEmbedder(16), transformations=["split"]
        )
    splitter = SentenceSplitter()
    with pytest.raises(InvalidParameterError, match="not both"):
        RaptorIndex.from_documents(
            [Document(text="x y z")],
            embed_model=FakeEmbedder(16),
            chunker=splitter,
            transformations=[splitter],
        )


def test_node_fields_survive_into_retrieved_nodes() -> None:
    nodes = user_nodes()
    index = RaptorIndex.from_documents(nodes, embed_model=FakeEmbedder(16), **fast())
    assert {leaf.id for leaf in index.tree.leaves} == {n.node_id for n in nodes}
    assert set(index.tree.doc_ids) == {"book-0", "book-1"}
    assert index.ref_doc_ids == ("book-0", "book-1")
    hits = index.as_retriever(strategy="collapsed", similarity_top_k=50).retrieve("cats")
    got = {h.node.node_id: h.node for h in hits if h.node.metadata["raptor_layer"] == 0}
    assert set(got) == {n.node_id for n in nodes}
    for original in nodes:
        node = got[original.node_id]
        assert LLAMAINDEX_NODE_KEY not in node.metadata
        assert {k: node.metadata[k] for k in original.metadata} == original.metadata
        assert node.ref_doc_id == original.ref_doc_id
        # The user's links all come back (a store may add the tree's own PARENT links).
        assert {r: node.relationships[r] for r in original.relationships} == (
            original.relationships
        )
        assert (node.start_char_idx, node.end_char_idx) == (
            original.start_char_idx,
            original.end_char_idx,
        )
        assert set(original.excluded_llm_metadata_keys) <= set(node.excluded_llm_metadata_keys)
        assert set(original.excluded_embed_metadata_keys) <= set(node.excluded_embed_metadata_keys)
        # What a query engine puts in the prompt: the hidden keys stay hidden.
        prompt = node.get_content(metadata_mode=MetadataMode.LLM)
        assert original.metadata["topic"] in prompt
        assert "/data/" not in prompt and "page" not in prompt
        embed_text = node.get_content(metadata_mode=MetadataMode.EMBED)
        assert "/data/" not in embed_text and "page: " in embed_text
    summaries = [h.node for h in hits if h.node.metadata["raptor_layer"] > 0]
    assert summaries
    assert all(set(s.metadata["raptor_doc_ids"]) <= {"book-0", "book-1"} for s in summaries)


def test_insert_nodes_into_a_document_index_and_delete_by_source() -> None:
    index = RaptorIndex.from_documents(
        [Document(text=TEXTS["cats"], id_="cats-doc")], embed_model=FakeEmbedder(16), **fast()
    )
    nodes = user_nodes()
    index.insert_nodes(nodes)
    leaves = index.tree.leaves
    assert {n.node_id for n in nodes} <= {leaf.id for leaf in leaves}
    assert any(leaf.doc_id == "cats-doc" and leaf.span is not None for leaf in leaves)
    assert set(index.ref_doc_ids) == {"cats-doc", "book-0", "book-1"}
    index.delete_ref_doc("book-0")  # removes both of its nodes
    assert {leaf.doc_id for leaf in index.tree.leaves} == {"cats-doc", "book-1"}
    assert {"node-rockets", "node-bees"} <= {leaf.id for leaf in index.tree.leaves}


def test_persisted_index_keeps_nodes_as_leaves(tmp_path: Any) -> None:
    index = RaptorIndex.from_documents(user_nodes(), embed_model=FakeEmbedder(16), **fast())
    index.persist(tmp_path)
    loaded = RaptorIndex.load(tmp_path, embed_model=FakeEmbedder(16), **fast())
    assert loaded.ref_doc_ids == ("book-0", "book-1")
    extra = TextNode(id_="node-extra", text="Owls hunt at night. Owls hoot.")
    loaded.insert_nodes([extra])
    ids = {leaf.id for leaf in loaded.tree.leaves}
    assert {"node-cats", "node-rockets", "node-bread", "node-bees", "node-extra"} == ids
    hit = next(
        h
        for h in loaded.as_retriever(strategy="collapsed", similarity_top_k=50).retrieve("x")
        if h.node.node_id == "node-cats"
    )
    assert hit.node.ref_doc_id == "book-0" and "file_path" in hit.node.excluded_llm_metadata_keys


def test_a_from_tree_index_does_not_rejoin_pre_split_leaves() -> None:
    built = RaptorIndex.from_documents(user_nodes(), embed_model=FakeEmbedder(16), **fast())
    index = RaptorIndex.from_tree(built.tree, embed_model=FakeEmbedder(16), **fast())
    assert sorted(d.doc_id for d in index.documents) == sorted(n.node_id for n in user_nodes())
    index.insert_nodes([TextNode(id_="node-extra", text="Owls hunt at night.")])
    assert len(index.tree.leaves) == 5


def test_a_damaged_node_record_is_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metadata = {"topic": "x", LLAMAINDEX_NODE_KEY: "{not json"}
    with caplog.at_level(logging.WARNING, logger="raptor_llamaindex.ingestion"):
        assert pop_node_fields(metadata) is None
    assert metadata == {"topic": "x"} and "damaged" in caplog.text
    # A record naming an unknown relationship or node type keeps the rest.
    doc = node_to_document(user_nodes()[1])
    record = doc.metadata[LLAMAINDEX_NODE_KEY].replace('"node_type":"4"', '"node_type":"nope"')
    fields = pop_node_fields({LLAMAINDEX_NODE_KEY: record.replace('"3":', '"99":')})
    assert fields is not None and NodeRelationship.PREVIOUS in fields.relationships


@pytest.mark.parametrize("raw", ["[" * 100_000, "1" * 5000], ids=["deep", "long-integer"])
def test_a_record_the_parser_cannot_take_is_a_damaged_record(
    raw: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Nested past the parser's recursion, or an integer past Python's digit limit: the
    # retrieval returning the leaf used to die with a raw RecursionError / ValueError.
    metadata = {"topic": "x", LLAMAINDEX_NODE_KEY: raw}
    assert chunk_position(metadata) is None
    with caplog.at_level(logging.WARNING, logger="raptor_llamaindex.ingestion"):
        assert pop_node_fields(metadata) is None
    assert metadata == {"topic": "x"} and "damaged" in caplog.text
    tree = tiny_tree()
    leaves = tuple(
        dataclasses.replace(n, metadata={"topic": "x", LLAMAINDEX_NODE_KEY: raw})
        if n.is_leaf
        else n
        for n in tree.nodes
    )
    tree = Tree(nodes=leaves, embeddings=tree.embeddings, params=tree.params)
    hits = RaptorRetriever(
        tree, FakeEmbedder(tree.dim), strategy="collapsed", similarity_top_k=10
    ).retrieve("cats purr")
    leaf_hits = [h.node for h in hits if h.node.metadata["raptor_layer"] == 0]
    assert leaf_hits and all(n.metadata["topic"] == "x" for n in leaf_hits)
    assert all(LLAMAINDEX_NODE_KEY not in n.metadata for n in leaf_hits)


# -- instrumentation ------------------------------------------------------------------------------
class Collect(BaseEventHandler):
    events: list[BaseEvent] = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "Collect"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        self.events.append(event)


@pytest.fixture
def instrumented() -> Iterator[tuple[Collect, SimpleSpanHandler]]:
    root = get_dispatcher()
    events, spans = Collect(), SimpleSpanHandler()
    root.add_event_handler(events)
    root.add_span_handler(spans)
    yield events, spans
    root.event_handlers.remove(events)
    root.span_handlers.remove(spans)


def test_build_emits_embedding_and_llm_events_inside_a_build_span(
    instrumented: tuple[Collect, SimpleSpanHandler],
) -> None:
    events, spans = instrumented
    RaptorIndex.from_documents(
        user_nodes(),
        embed_model=MockEmbedding(embed_dim=8),
        llm=MockLLM(max_tokens=6),
        **{k: v for k, v in fast().items() if k != "summarizer"},
    )
    kinds = {type(e) for e in events.events}
    assert {EmbeddingStartEvent, EmbeddingEndEvent} <= kinds
    assert {LLMCompletionStartEvent, LLMCompletionEndEvent} <= kinds
    parents = {s.id_: s.parent_id for s in spans.completed_spans}
    build = [s for s in parents if s.startswith("build_tree")]
    assert len(build) == 1

    def under_build(span_id: str | None) -> bool:
        while span_id is not None:
            if span_id == build[0]:
                return True
            span_id = parents.get(span_id)
        return False

    llm_events = [e for e in events.events if isinstance(e, LLMCompletionStartEvent)]
    # Summaries run in worker threads; the context copy keeps them in the build's span.
    assert llm_events and all(under_build(e.span_id) for e in llm_events)
    embed_events = [e for e in events.events if isinstance(e, EmbeddingStartEvent)]
    assert all(under_build(e.span_id) for e in embed_events)


def test_updates_emit_embedding_events_inside_an_update_span(
    instrumented: tuple[Collect, SimpleSpanHandler],
) -> None:
    events, spans = instrumented
    index = RaptorIndex.from_documents(
        user_nodes(), embed_model=MockEmbedding(embed_dim=8), **fast()
    )
    events.events.clear()
    index.insert_nodes([TextNode(id_="node-owls", text="Owls hunt at night. Owls hoot.")])
    asyncio.run(index.adelete_ref_doc("book-0"))
    parents = {s.id_: s.parent_id for s in spans.completed_spans}
    updates = [s for s in parents if s.startswith(("update_tree", "aupdate_tree"))]
    assert len(updates) == 2

    def under_update(span_id: str | None) -> bool:
        while span_id is not None:
            if span_id in updates:
                return True
            span_id = parents.get(span_id)
        return False

    embed_events = [e for e in events.events if isinstance(e, EmbeddingStartEvent)]
    assert embed_events and all(under_update(e.span_id) for e in embed_events)


def test_a_core_embedder_over_a_llamaindex_model_emits_events(
    instrumented: tuple[Collect, SimpleSpanHandler],
) -> None:
    events, _ = instrumented
    RaptorIndex.from_documents(
        user_nodes(), embed_model=LlamaIndexEmbedder(MockEmbedding(embed_dim=8)), **fast()
    )
    starts = [e for e in events.events if isinstance(e, EmbeddingStartEvent)]
    assert starts


def test_a_passage_of_several_nodes_keeps_their_source_and_outer_links() -> None:
    text = " ".join(f"Bees dance number {i}. Bees make honey {i}." for i in range(60))
    index = RaptorIndex.from_documents(
        [Document(text=text, id_="bees")],
        embed_model=FakeEmbedder(16),
        transformations=[SentenceSplitter(chunk_size=40, chunk_overlap=0)],
        **fast(),
    )
    hits = index.as_retriever(similarity_top_k=3, max_tokens=400).retrieve(
        "Bees dance number 7. Bees make honey 7."
    )
    joined = [h.node for h in hits if len(h.node.metadata.get("raptor_leaves", [])) > 1]
    single = [h.node for h in hits if "raptor_leaves" not in h.node.metadata]
    assert joined, "the passage strategy should join neighbouring nodes here"
    for node in joined:
        # The first node's NEXT and offsets would be wrong for the joined passage: it keeps
        # the document, the first node's PREVIOUS and the last node's NEXT (when they exist).
        assert set(node.relationships) <= {
            NodeRelationship.SOURCE,
            NodeRelationship.PREVIOUS,
            NodeRelationship.NEXT,
        }
        assert node.ref_doc_id == "bees"
    for node in single:
        assert NodeRelationship.NEXT in node.relationships or (
            NodeRelationship.PREVIOUS in node.relationships
        )
    assert all(LLAMAINDEX_NODE_KEY not in h.node.metadata for h in hits)


def test_templates_survive_and_unsafe_ones_are_dropped() -> None:
    node = TextNode(
        id_="n1",
        text="Bees dance.",
        metadata={"topic": "bees"},
        text_template="[{metadata_str}] {content}",
        metadata_template="{key}={value}",
        metadata_separator="; ",
    )
    doc = node_to_document(node)
    fields = pop_node_fields(dict(doc.metadata))
    assert fields is not None
    assert fields.templates == {
        "text_template": "[{metadata_str}] {content}",
        "metadata_template": "{key}={value}",
        "metadata_separator": "; ",
    }
    evil = doc.metadata[LLAMAINDEX_NODE_KEY].replace(
        "[{metadata_str}] {content}", "{content.__class__.__mro__}"
    )
    fields = pop_node_fields({LLAMAINDEX_NODE_KEY: evil})
    assert fields is not None and "text_template" not in fields.templates
    index = RaptorIndex.from_documents([node], embed_model=FakeEmbedder(16), **fast())
    (hit,) = index.as_retriever(strategy="collapsed").retrieve("bees")
    assert hit.node.get_content(metadata_mode=MetadataMode.LLM) == "[topic=bees] Bees dance."


def test_async_build_and_insert_run_the_transformations() -> None:
    splitter = SentenceSplitter(chunk_size=40, chunk_overlap=0)
    docs = [Document(text=" ".join(TEXTS.values()) * 2, id_="book")]

    async def main() -> RaptorIndex:
        index = await RaptorIndex.afrom_documents(
            docs, embed_model=FakeEmbedder(16), transformations=[splitter], **fast()
        )
        await index.ainsert_nodes(user_nodes())
        return index

    index = asyncio.run(main())
    expected = [n.get_content() for n in splitter.get_nodes_from_documents(docs)]
    book = [leaf.text for leaf in index.tree.leaves if leaf.doc_id == "book"]
    assert book == expected
    assert set(index.ref_doc_ids) == {"book", "book-0", "book-1"}


def test_insert_runs_the_index_transformations_like_base_index() -> None:
    splitter = SentenceSplitter(chunk_size=40, chunk_overlap=0)
    index = RaptorIndex.from_documents(
        [Document(text=" ".join(TEXTS.values()), id_="a")],
        embed_model=FakeEmbedder(16),
        transformations=[splitter],
        **fast(),
    )
    new = Document(text=" ".join(TEXTS.values()) * 2, id_="b")
    index.insert(new)
    expected = [n.get_content() for n in splitter.get_nodes_from_documents([new])]
    assert [leaf.text for leaf in index.tree.leaves if leaf.doc_id == "b"] == expected
    asyncio.run(index.ainsert(Document(text=TEXTS["cats"] * 3, id_="c")))
    c_leaves = [leaf for leaf in index.tree.leaves if leaf.doc_id == "c"]
    assert c_leaves and all(leaf.span is None for leaf in c_leaves)  # the splitter's nodes


def test_summaries_never_carry_a_node_record() -> None:
    # Same source, no links, no offsets: records differ only by the node id.
    nodes = [TextNode(id_=f"n{i}", text=text) for i, text in enumerate(TEXTS.values())]
    for node in nodes:
        node.relationships[NodeRelationship.SOURCE] = Document(
            text="x", id_="src"
        ).as_related_node_info()
    index = RaptorIndex.from_documents(nodes, embed_model=FakeEmbedder(16), **fast())
    summaries = [n for n in index.tree.nodes if n.layer > 0]
    assert summaries
    assert all(LLAMAINDEX_NODE_KEY not in s.metadata for s in summaries)


def test_the_constructor_takes_nodes_as_leaves() -> None:
    nodes = user_nodes()
    index = RaptorIndex(nodes=nodes, embed_model=FakeEmbedder(16), **fast())
    assert sorted(leaf.id for leaf in index.tree.leaves) == sorted(n.node_id for n in nodes)
    assert index.ref_doc_ids == ("book-0", "book-1")
    index.delete_ref_doc("book-0")
    assert sorted(leaf.id for leaf in index.tree.leaves) == ["node-bees", "node-rockets"]


def test_refresh_and_update_with_transformations_work_per_source_document() -> None:
    splitter = SentenceSplitter(chunk_size=40, chunk_overlap=0)
    docs = [Document(text=TEXTS[t] * 2, id_=t) for t in ("cats", "rockets")]
    index = RaptorIndex.from_documents(
        docs, embed_model=FakeEmbedder(16), transformations=[splitter], **fast()
    )
    assert set(index.ref_doc_info) == {"cats", "rockets"}
    assert all(info.node_ids for info in index.ref_doc_info.values())
    # Hashes are kept per source document, so an unchanged one is not rebuilt or duplicated.
    changed = Document(text=TEXTS["bread"] * 2, id_="rockets")
    assert index.refresh_ref_docs([docs[0], changed]) == [False, True]
    assert index.ref_doc_ids == ("cats", "rockets")
    rockets = [leaf for leaf in index.tree.leaves if leaf.doc_id == "rockets"]
    text = " ".join(leaf.text for leaf in rockets)
    assert "Bakers" in text and "Rockets" not in text
    assert all(leaf.span is None for leaf in rockets)  # the splitter's nodes, not re-chunked
