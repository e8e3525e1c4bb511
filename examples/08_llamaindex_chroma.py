"""Bring your own vector store: a RAPTOR index inside Chroma, through LlamaIndex.

Why: a team whose LlamaIndex pipeline already runs on a vector database should not need a
second storage system for RAPTOR.  ``RaptorIndex`` is a LlamaIndex index: given a
``StorageContext`` over any vector store (here ``ChromaVectorStore``) it writes every layer
of the tree, chunks and summaries, into that store as linked ``TextNode`` objects;
``storage_context.persist()`` and ``load_index_from_storage`` reopen it later, in another
process, without rebuilding.  Every retrieval strategy searches Chroma itself.

This script:
1. builds an index over six short essays with the packaged local embedding model (offline)
   into a Chroma collection, and persists the storage context;
2. reopens it from a new client with ``load_index_from_storage``, as a new process would,
   and asks questions with several strategies and LlamaIndex ``MetadataFilters``;
3. reads the same collection with LlamaIndex's own ``ChromaVectorStore`` API.

Chroma: embedded in a temporary directory by default; set ``CHROMA_HOST`` (and
``CHROMA_PORT``) to use a running ``chroma run`` server instead.
Run: ``python examples/08_llamaindex_chroma.py`` (about a minute on two CPU cores).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
import uuid
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import chromadb
from llama_index.core import Document, StorageContext, load_index_from_storage
from llama_index.core.schema import NodeRelationship, NodeWithScore
from llama_index.core.vector_stores import MetadataFilter, MetadataFilters
from llama_index.vector_stores.chroma import ChromaVectorStore

from raptor_llamaindex import RaptorEmbedding, RaptorIndex

ESSAYS = Path(__file__).resolve().parents[1] / "tests" / "data" / "multi_topic.md"
TOPICS = {  # metadata to filter on
    "how-honeybees-communicate": "nature",
    "the-printing-press-and-the-spread-of-the-written-word": "history",
    "how-volcanoes-form-and-erupt": "nature",
    "sourdough-bread-baking": "food",
    "the-apollo-11-mission": "history",
    "how-vaccines-train-the-immune-system": "medicine",
}


def load_documents() -> list[Document]:
    """One LlamaIndex Document per essay, as a reader splitting on headings would give."""
    docs = []
    text = ESSAYS.read_text(encoding="utf-8")
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        title, _, body = section.partition("\n")
        slug = re.sub(r"\W+", "-", title.lower()).strip("-")
        docs.append(
            Document(
                id_=slug,
                text=body.strip(),
                metadata={"title": title.strip(), "topic": TOPICS[slug]},
            )
        )
    return docs


def chroma_client(path: str) -> chromadb.ClientAPI:
    """A client of the server named by CHROMA_HOST, else an embedded one at ``path``."""
    host = os.environ.get("CHROMA_HOST")
    if host:
        return chromadb.HttpClient(host=host, port=int(os.environ.get("CHROMA_PORT", "8000")))
    return chromadb.PersistentClient(path=path)


def show(title: str, nodes: list[NodeWithScore]) -> None:
    print(title)
    for hit in nodes:
        layer = hit.node.metadata["raptor_layer"]
        kind = "chunk  " if layer == 0 else f"layer {layer}"
        text = " ".join(hit.node.get_content().split())
        print(f"  [{kind}] {hit.score or 0:.3f}  {text[:72]}…")
    print()


def main() -> None:
    # Any LlamaIndex embedding model works (OpenAIEmbedding, HuggingFaceEmbedding, ...);
    # RaptorEmbedding exposes the packaged offline all-MiniLM-L6-v2 as one.
    embed_model = RaptorEmbedding()
    collection = f"essays-raptor-li-{uuid.uuid4().hex[:8]}"

    with tempfile.TemporaryDirectory() as tmp:
        # 1. Build into Chroma: every layer becomes nodes of the collection.
        chroma = chroma_client(tmp).get_or_create_collection(
            collection, configuration={"hnsw": {"space": "cosine"}}
        )
        storage_context = StorageContext.from_defaults(
            vector_store=ChromaVectorStore(chroma_collection=chroma)
        )
        start = time.perf_counter()
        index = RaptorIndex.from_documents(
            load_documents(),
            storage_context=storage_context,
            embed_model=embed_model,
            random_state=0,
            similarity_top_k=4,
        )
        print(f"built and wrote {chroma.count()} nodes into Chroma collection")
        print(f"{collection!r} in {time.perf_counter() - start:.1f}s")
        index.storage_context.persist(persist_dir=f"{tmp}/raptor")
        print(f"persisted the storage context to {sorted(os.listdir(f'{tmp}/raptor'))}\n")

        # 2. Reopen from a new client, as another process would: nothing is rebuilt.
        vector_store = ChromaVectorStore(
            chroma_collection=chroma_client(tmp).get_collection(collection)
        )
        index = load_index_from_storage(
            StorageContext.from_defaults(persist_dir=f"{tmp}/raptor", vector_store=vector_store),
            embed_model=embed_model,
        )
        print(f"reopened: {index!r}\n")

        question = "What do these essays say about how ideas and knowledge spread?"
        show(f"Q: {question}  (passages, the default)", index.as_retriever().retrieve(question))
        show(
            "same question, strategy='collapsed' (all layers ranked together):",
            index.as_retriever(strategy="collapsed").retrieve(question),
        )
        history = MetadataFilters(filters=[MetadataFilter(key="topic", value="history")])
        show(
            "same question, filters: topic == 'history'",
            index.as_retriever(strategy="collapsed", filters=history).retrieve(question),
        )
        apollo = MetadataFilters(
            filters=[MetadataFilter(key="doc_id", value="the-apollo-11-mission")]
        )
        show(
            "Q: Who flew to the Moon?  filters: the Apollo essay only, top-down traversal",
            index.as_retriever(strategy="traversal", filters=apollo).retrieve(
                "Who flew to the Moon?"
            ),
        )

        # 3. It is still an ordinary Chroma collection of LlamaIndex nodes.
        summary = next(n for n in index.tree.nodes if n.layer == 1)
        (stored,) = vector_store.get_nodes(node_ids=[summary.id])
        children = stored.relationships[NodeRelationship.CHILD]
        print(
            f"ChromaVectorStore.get_nodes: summary {stored.node_id} has {len(children)} CHILD links"
        )  # type: ignore[arg-type]

        if os.environ.get("CHROMA_HOST"):
            chroma_client(tmp).delete_collection(collection)  # leave a shared server as found


if __name__ == "__main__":
    main()
