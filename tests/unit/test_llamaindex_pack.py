"""Issue 14.3: the deprecated pack's API on top of RaptorIndex, offline with fakes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document
from llama_index.core.llms import MockLLM
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import QueryBundle
from llama_index.core.vector_stores import SimpleVectorStore

from raptor_core.exceptions import InvalidParameterError
from raptor_core.testing import FakeEmbedder, WhitespaceTokenizer
from raptor_llamaindex import RaptorIndex
from raptor_llamaindex.pack import (
    QueryModes,
    RaptorPack,
    RaptorRetriever,
    SummaryModule,
)

TOPICS = {
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


def documents() -> list[Document]:
    return [Document(text=t, id_=k) for k, t in TOPICS.items()]


def fast() -> dict[str, Any]:
    # RaptorIndex / TreeBuilder parameters, passed through the pack's **kwargs.
    return {
        "tokenizer": WhitespaceTokenizer(),
        "clusterer": PairClusterer(),
        "chunk_max_tokens": 8,
        "summary_max_tokens": 10,
        "cluster_max_tokens": 100,
    }


def make_pack(**extra: Any) -> RaptorPack:
    return RaptorPack(
        documents(), llm=MockLLM(max_tokens=4), embed_model=FakeEmbedder(16), **fast(), **extra
    )


def test_pack_documented_usage() -> None:
    pack = make_pack()
    nodes = pack.run("query", mode="collapsed")
    assert len(nodes) == 2  # the pack's similarity_top_k default
    traversal = pack.run("query", mode="tree_traversal")
    assert traversal and len(traversal) <= 2
    assert pack.get_modules() == {"retriever": pack.retriever}
    retriever = pack.retriever
    assert isinstance(retriever, RaptorRetriever)
    assert retriever.retrieve("query", mode=QueryModes.collapsed) == nodes
    # Summaries came from the LLM the pack was given (MockLLM answers "text text ...").
    summaries = [n for n in retriever.index.tree.nodes if n.layer > 0 and len(n.children) > 1]
    assert summaries and all(s.text.startswith("text") for s in summaries)


def test_mode_default_and_bad_modes() -> None:
    pack = make_pack(mode="tree_traversal", similarity_top_k=3)
    assert pack.retriever.mode == "tree_traversal"
    assert pack.retriever._retriever(None).strategy == "traversal"
    assert pack.retriever._retriever(None).strategy_params == {"top_k": 3}
    assert pack.retriever._retriever("collapsed").max_tokens is None
    with pytest.raises(InvalidParameterError, match="'collapsed' or 'tree_traversal'"):
        make_pack(mode="passage")
    with pytest.raises(InvalidParameterError, match="'collapsed' or 'tree_traversal'"):
        pack.run("query", mode="bogus")


def test_tree_depth_is_max_layers() -> None:
    shallow = RaptorRetriever(documents(), tree_depth=1, embed_model=FakeEmbedder(16), **fast())
    deep = RaptorRetriever(documents(), tree_depth=3, embed_model=FakeEmbedder(16), **fast())
    assert shallow.index.tree.num_layers == 2
    assert deep.index.tree.num_layers > 2


def test_summary_module_prompt_and_workers() -> None:
    module = SummaryModule(llm=MockLLM(), summary_prompt="Summarize tersely.", num_workers=2)
    retriever = RaptorRetriever(
        documents(), summary_module=module, embed_model=FakeEmbedder(16), **fast()
    )
    summaries = [n for n in retriever.index.tree.nodes if n.layer == 1 and len(n.children) > 1]
    # MockLLM echoes its prompt: the instruction first, then the cluster's texts.
    assert summaries and all(s.text.startswith("Summarize tersely.\n\n") for s in summaries)
    assert retriever.index._builder_kwargs["max_concurrency"] == 2


def test_transformations_decide_the_leaves() -> None:
    splitter = SentenceSplitter(chunk_size=40, chunk_overlap=0)
    docs = [Document(text=" ".join(TOPICS.values()) * 2, id_="book")]
    retriever = RaptorRetriever(
        docs, transformations=[splitter], embed_model=FakeEmbedder(16), **fast()
    )
    expected = [n.get_content() for n in splitter.get_nodes_from_documents(docs)]
    assert [leaf.text for leaf in retriever.index.tree.leaves] == expected
    asyncio.run(retriever.insert([Document(text="Owls hunt at night. " * 12, id_="owls")]))
    assert "owls" in retriever.index.ref_doc_ids
    owls = [leaf for leaf in retriever.index.tree.leaves if leaf.doc_id == "owls"]
    assert owls and all(leaf.span is None for leaf in owls)  # split by the splitter


def test_query_bundle_query_engine_and_running_loop() -> None:
    retriever = make_pack().retriever
    assert len(retriever.retrieve(QueryBundle("cats"))) == 2
    response = RetrieverQueryEngine.from_args(retriever, llm=MockLLM()).query("cats")
    assert len(response.source_nodes) == 2

    async def inside_a_loop() -> int:
        # The pack called asyncio.run here, which fails inside Jupyter and servers.
        return len(await retriever.aretrieve("cats", mode="tree_traversal"))

    assert asyncio.run(inside_a_loop()) > 0
    collapsed = asyncio.run(retriever.collapsed_retrieval("cats"))
    assert collapsed == retriever.retrieve("cats", mode="collapsed")
    traversal = asyncio.run(retriever.tree_traversal_retrieval("cats"))
    assert traversal == retriever.retrieve("cats", mode="tree_traversal")


def test_persist_and_from_persist_dir(tmp_path: Path) -> None:
    retriever = make_pack().retriever
    before = retriever.retrieve("rockets")
    retriever.persist(tmp_path)
    loaded = RaptorRetriever.from_persist_dir(tmp_path, embed_model=FakeEmbedder(16))
    assert [n.node.node_id for n in loaded.retrieve("rockets")] == [n.node.node_id for n in before]


def test_existing_index_is_searched() -> None:
    index = RaptorIndex.from_documents(documents(), embed_model=FakeEmbedder(16), **fast())
    retriever = RaptorRetriever([], existing_index=index, similarity_top_k=3)
    assert retriever.index is index and len(retriever.retrieve("bees")) == 3
    with pytest.raises(InvalidParameterError, match="existing_index"):
        RaptorRetriever([], existing_index=object())  # type: ignore[arg-type]


def test_vector_store_documented_usage(tmp_path: Path) -> None:
    store = SimpleVectorStore()
    pack = make_pack(vector_store=store)
    assert len(pack.run("cats")) == 2
    assert store.data.embedding_dict  # the tree went into the user's store
    pack.retriever.persist(tmp_path)
    # The pack re-connected with the store alone; the tree's structure needs the directory.
    with pytest.raises(InvalidParameterError, match="persist directory"):
        RaptorRetriever([], embed_model=FakeEmbedder(16), vector_store=store)
    retriever = RaptorRetriever.from_persist_dir(
        tmp_path, embed_model=FakeEmbedder(16), vector_store=store
    )
    assert len(retriever.retrieve("cats", mode="tree_traversal")) > 0
