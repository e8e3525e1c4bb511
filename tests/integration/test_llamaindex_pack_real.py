"""Issues 14.2 and 14.3 with real parts: the deprecated pack's documented usage run against
``raptor_llamaindex.pack`` with MiniLM embeddings behind a user's ``BaseEmbedding``, UMAP/GMM
clustering and llama-index-core's offline ``MockLLM``; a real ``SentenceSplitter`` deciding
the leaves; and a real instrumentation handler watching a build."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.embedding import EmbeddingEndEvent
from llama_index.core.instrumentation.events.llm import LLMCompletionEndEvent
from llama_index.core.llms import MockLLM
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeRelationship
from pydantic import Field, PrivateAttr

from raptor_llamaindex import RaptorIndex
from raptor_llamaindex.pack import RaptorPack, RaptorRetriever

pytestmark = pytest.mark.integration

DATA = Path(__file__).resolve().parents[1] / "data"
BEES = "how-honeybees-communicate"


class MiniLMEmbedding(BaseEmbedding):
    """A user's own ``BaseEmbedding`` over the session's sentence-transformers model."""

    _model: Any = PrivateAttr()

    def __init__(self, model: Any, **kwargs: Any) -> None:
        super().__init__(model_name="all-MiniLM-L6-v2", embed_batch_size=64, **kwargs)
        self._model = model

    def _get_query_embedding(self, query: str) -> list[float]:
        return [float(x) for x in self._model.embed_query(query)]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._get_text_embeddings([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return [[float(x) for x in row] for row in self._model.embed_documents(texts)]


def essays() -> list[Document]:
    """tests/data/multi_topic.md as one LlamaIndex Document per essay."""
    text = (DATA / "multi_topic.md").read_text(encoding="utf-8")
    docs = []
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        title, _, body = section.partition("\n")
        slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
        docs.append(Document(text=body.strip(), id_=slug, metadata={"title": title.strip()}))
    assert len(docs) == 6
    return docs


class Events(BaseEventHandler):
    events: list[BaseEvent] = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "Events"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        self.events.append(event)


@pytest.fixture(scope="module")
def embed_model(st_embedder: Any) -> MiniLMEmbedding:
    return MiniLMEmbedding(st_embedder)


@pytest.fixture(scope="module")
def built(embed_model: MiniLMEmbedding) -> tuple[RaptorPack, Events]:
    root = get_dispatcher()
    handler = Events()
    root.add_event_handler(handler)
    try:
        # The pack's README, with our import line; random_state only makes the test repeatable.
        llm = MockLLM()
        pack = RaptorPack(essays(), llm=llm, embed_model=embed_model, random_state=0)
    finally:
        root.event_handlers.remove(handler)
    return pack, handler


def test_the_packs_readme_usage(built: tuple[RaptorPack, Events]) -> None:
    pack, _ = built
    nodes = pack.run("How do honeybees tell each other where flowers are?", mode="collapsed")
    assert len(nodes) == 2
    assert all(BEES in n.node.metadata["raptor_doc_ids"] for n in nodes)
    retriever = pack.get_modules()["retriever"]
    assert retriever is pack.retriever
    traversal = retriever.retrieve(
        "How do honeybees tell each other where flowers are?", mode="tree_traversal"
    )
    assert traversal and any(BEES in n.node.metadata["raptor_doc_ids"] for n in traversal)
    tree = retriever.index.tree
    assert tree.num_layers >= 2  # the tree has summaries ...
    summaries = [n for n in tree.nodes if n.layer > 0 and len(n.children) > 1]
    # ... written by the pack's llm: MockLLM echoes the summary prompt it was sent.
    assert summaries and all(s.text.startswith("Write a summary") for s in summaries)


def test_the_packs_notebook_query_engine(
    built: tuple[RaptorPack, Events], embed_model: MiniLMEmbedding, tmp_path: Path
) -> None:
    pack, _ = built
    pack.retriever.persist(tmp_path)
    retriever = RaptorRetriever.from_persist_dir(
        tmp_path, embed_model=embed_model, similarity_top_k=2, mode="tree_traversal"
    )
    engine = RetrieverQueryEngine.from_args(retriever, llm=MockLLM())
    response = engine.query("What happens when magma rises to the surface?")
    assert response.source_nodes
    assert any(
        "how-volcanoes-form-and-erupt" in n.node.metadata["raptor_doc_ids"]
        for n in response.source_nodes
    )


def test_a_build_reports_embedding_and_llm_events(built: tuple[RaptorPack, Events]) -> None:
    _, handler = built
    kinds = {type(e) for e in handler.events}
    assert EmbeddingEndEvent in kinds and LLMCompletionEndEvent in kinds
    embedded = sum(len(e.chunks) for e in handler.events if isinstance(e, EmbeddingEndEvent))
    assert embedded >= len(built[0].retriever.index.tree.nodes) // 2


def test_a_real_node_parser_decides_the_leaves(embed_model: MiniLMEmbedding) -> None:
    docs = essays()
    splitter = SentenceSplitter(chunk_size=128, chunk_overlap=0)
    index = RaptorIndex.from_documents(
        docs, embed_model=embed_model, transformations=[splitter], random_state=0
    )
    expected = splitter.get_nodes_from_documents(docs)
    assert [leaf.text for leaf in index.tree.leaves] == [n.get_content() for n in expected]
    hits = index.as_retriever(strategy="collapsed", similarity_top_k=8).retrieve(
        "How do honeybees tell each other where flowers are?"
    )
    leaves = [h.node for h in hits if h.node.metadata["raptor_layer"] == 0]
    assert leaves
    for node in leaves:
        assert node.metadata["title"]
        assert node.relationships[NodeRelationship.SOURCE].node_id == node.ref_doc_id
        assert node.ref_doc_id in {d.doc_id for d in docs}
    assert any(n.ref_doc_id == BEES for n in leaves)


DOCS = Path(__file__).resolve().parents[2] / "docs"


def python_blocks(page: str) -> list[tuple[bool, str]]:
    """``(runs, code)`` for each python block; a ``<!-- not run: ... -->`` line opts out."""
    text = (DOCS / page).read_text(encoding="utf-8")
    out = []
    for match in re.finditer(r"(<!-- not run:[^\n]*-->\n)?```python\n(.*?)```", text, re.DOTALL):
        out.append((match.group(1) is None, match.group(2)))
    return out


def test_the_migration_page_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = python_blocks("migrating-from-the-pack.md")
    before, after = (code for runs, code in blocks if "RaptorPack(" in code)
    # "Only the import differs" between the pack's usage and ours.
    changed = [
        (old, new)
        for old, new in zip(before.splitlines(), after.splitlines(), strict=True)
        if old != new
    ]
    assert changed == [
        (
            "from llama_index.packs.raptor import RaptorPack, RaptorRetriever",
            "from raptor_llamaindex.pack import RaptorPack, RaptorRetriever",
        )
    ]
    monkeypatch.chdir(tmp_path)
    ran = 0
    for runs, code in blocks:
        if runs:
            namespace: dict[str, Any] = {}
            exec(compile(code, "migrating-from-the-pack.md", "exec"), namespace)
            ran += 1
    assert ran == 3
    assert (tmp_path / "raptor_pack_index").is_dir()


def test_the_node_parser_section_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (code,) = [
        c
        for runs, c in python_blocks("llamaindex.md")
        if runs and "transformations=[SentenceSplitter" in c
    ]
    exec(compile(code, "llamaindex.md", "exec"), {})
