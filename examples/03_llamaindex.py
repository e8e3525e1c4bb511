"""RAPTOR in a LlamaIndex pipeline, offline: build, query, query engine, agent tool, comparison.

Why: most LlamaIndex pipelines start with ``VectorStoreIndex.from_documents(docs)``.  That
index only ever returns raw chunks, so a question whose answer is spread over a document
("what is this essay about?") gets a few fragments.  ``RaptorIndex`` is the one-line
replacement: it also indexes recursive summaries of clusters of chunks, and its retriever
returns ordinary ``NodeWithScore`` objects, so query engines, chat engines, postprocessors
and agent tools keep working unchanged.

Everything here runs offline on a laptop CPU in well under two minutes: the packaged
all-MiniLM-L6-v2 embeds (through ``RaptorEmbedding``, a LlamaIndex ``BaseEmbedding``), the
summaries are extractive, and LlamaIndex's ``MockLLM`` stands in for the answer model.
Swap in ``OpenAI(...)`` / ``OpenAIEmbedding(...)`` or any other LlamaIndex model for real use.

Run it with ``python examples/03_llamaindex.py``.
"""

from __future__ import annotations

import asyncio
import re
import textwrap
import time
from pathlib import Path
from typing import Any

from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.agent.workflow import ReActAgent
from llama_index.core.llms import CompletionResponse, CustomLLM, LLMMetadata, MockLLM
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import NodeWithScore
from llama_index.core.tools import QueryEngineTool
from pydantic import PrivateAttr

from raptor_llamaindex import RaptorEmbedding, RaptorIndex

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "multi_topic.md"
TOP_K = 5
QUESTIONS = [
    "What is the essay about honeybees mainly about?",
    "Which eruptions killed people, and how many?",
]


def load_essays() -> list[Document]:
    """Six unrelated essays, one LlamaIndex Document each (id = a slug of the title)."""
    text = DATA.read_text(encoding="utf-8")
    docs = []
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        title, _, body = section.partition("\n")
        slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
        docs.append(Document(text=body.strip(), id_=slug, metadata={"title": title.strip()}))
    return docs


def show(label: str, nodes: list[NodeWithScore]) -> None:
    print(f"  {label}")
    for n in nodes:
        meta = n.node.metadata
        if meta.get("raptor_layer", 0) > 0:
            where = f"layer-{meta['raptor_layer']} summary of {', '.join(meta['raptor_doc_ids'])}"
        else:
            where = f"chunk of {n.node.ref_doc_id}"
        preview = textwrap.shorten(n.node.get_content(), 70)
        print(f"    {n.score:.3f}  [{where}]  {preview}")


class ScriptedReActLLM(CustomLLM):
    """A stand-in for a real agent LLM: calls the tool once, then answers."""

    _turn: int = PrivateAttr(default=0)

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(model_name="scripted-react")

    def _next(self) -> str:
        self._turn += 1
        if self._turn == 1:
            return (
                "Thought: I need the essays to answer.\nAction: essays\n"
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


async def run_agent(tool: QueryEngineTool) -> None:
    agent = ReActAgent(tools=[tool], llm=ScriptedReActLLM())
    response = await agent.run("How do honeybees communicate?")
    for call in response.tool_calls:
        sources = call.tool_output.raw_output.source_nodes
        layers = sorted({s.node.metadata["raptor_layer"] for s in sources})
        print(f"  agent called {call.tool_name}({call.tool_kwargs}): {len(sources)} sources")
        print(f"  from layers {layers}")
    print(f"  agent answer: {response.response.content}")


def main() -> None:
    started = time.perf_counter()
    docs = load_essays()
    # One embedding model for both indexes, so the comparison is about the index alone.
    # RaptorEmbedding() is the packaged all-MiniLM-L6-v2 as a LlamaIndex BaseEmbedding.
    Settings.embed_model = RaptorEmbedding()

    # 1. Build.  The only line that differs from a VectorStoreIndex pipeline.  Without an LLM
    #    configured (Settings.llm unset, or MockLLM), cluster summaries are extractive.
    index = RaptorIndex.from_documents(docs, random_state=0, similarity_top_k=TOP_K)
    tree = index.tree
    sizes = [len(tree.layer(i)) for i in range(tree.num_layers)]
    elapsed = time.perf_counter() - started
    print(f"RAPTOR tree: {len(tree)} nodes, layer sizes {sizes} (built in {elapsed:.0f}s)")

    # The baseline, chunked at RAPTOR's leaf size (100 tokens) so only the tree differs.
    vector_index = VectorStoreIndex.from_documents(
        docs, transformations=[SentenceSplitter(chunk_size=100, chunk_overlap=0)]
    )

    # 2. Query: the same top-k from both retrievers.
    raptor = index.as_retriever()
    vector = vector_index.as_retriever(similarity_top_k=TOP_K)
    for question in QUESTIONS:
        print(f"\nQ: {question}")
        show("VectorStoreIndex", vector.retrieve(question))
        show("RaptorIndex", raptor.retrieve(question))

    # 3. A query engine (MockLLM echoes its prompt; a real LLM would answer from it).
    engine = index.as_query_engine(llm=MockLLM(max_tokens=8), response_mode="compact")
    response = engine.query("How do vaccines train the immune system?")
    layers = sorted({n.node.metadata["raptor_layer"] for n in response.source_nodes})
    print(f"\nquery engine: {len(response.source_nodes)} source nodes from layers {layers}")

    # 4. The index as an agent tool.
    tool = QueryEngineTool.from_defaults(
        engine,
        name="essays",
        description="Answers questions about six essays: bees, printing, volcanoes, "
        "sourdough, Apollo 11 and vaccines.",
    )
    asyncio.run(run_agent(tool))
    print(f"\ndone in {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
