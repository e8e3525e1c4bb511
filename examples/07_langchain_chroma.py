"""Bring your own vector store: a RAPTOR tree inside Chroma, through LangChain.

Why: a team whose RAG pipeline already runs on a vector database should not need a second
storage system for RAPTOR.  ``RaptorRetriever.from_documents(..., vectorstore=...)`` writes
every layer of the tree (chunks and summaries) into any LangChain ``VectorStore``, here
``langchain_chroma.Chroma``; ``RaptorRetriever.from_vectorstore`` reopens it later, in
another process, without rebuilding.  Searches run inside Chroma, with Chroma's own filter
dialect, and the collection stays an ordinary Chroma collection.

This script:
1. builds a tree over six short essays with the packaged local embedding model (offline)
   and writes it into a Chroma collection;
2. reopens the collection from a new client, as a new process would, and asks questions
   the way ``vectorstore.as_retriever()`` users do: ``k``, Chroma ``filter``s,
   ``search_type="mmr"`` and ``"similarity_score_threshold"``;
3. queries the same collection with LangChain's own ``Chroma.similarity_search``.

Chroma: embedded in a temporary directory by default; set ``CHROMA_HOST`` (and
``CHROMA_PORT``) to use a running ``chroma run`` server instead.
Run: ``python examples/07_langchain_chroma.py`` (about a minute on two CPU cores).
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
from langchain_chroma import Chroma
from langchain_core.documents import Document

from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder
from raptor_langchain import RaptorEmbeddings, RaptorRetriever

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
    """One LangChain Document per essay, as a loader + splitter on headings would give."""
    docs = []
    text = ESSAYS.read_text(encoding="utf-8")
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        title, _, body = section.partition("\n")
        slug = re.sub(r"\W+", "-", title.lower()).strip("-")
        docs.append(
            Document(
                id=slug,
                page_content=body.strip(),
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


def show(title: str, docs: list[Document]) -> None:
    print(title)
    for doc in docs:
        layer = doc.metadata["raptor_layer"]
        kind = "chunk  " if layer == 0 else f"layer {layer}"
        text = " ".join(doc.page_content.split())
        print(f"  [{kind}] {doc.metadata['score']:.3f}  {text[:72]}…")
    print()


def main() -> None:
    # Any LangChain Embeddings works (OpenAIEmbeddings, HuggingFaceEmbeddings, ...);
    # RaptorEmbeddings exposes the packaged offline all-MiniLM-L6-v2 as one.
    embeddings = RaptorEmbeddings(SentenceTransformerEmbedder())
    collection = f"essays-raptor-{uuid.uuid4().hex[:8]}"

    with tempfile.TemporaryDirectory() as tmp:
        # 1. Build into Chroma: every layer becomes documents of the collection.
        store = Chroma(
            client=chroma_client(tmp),
            collection_name=collection,
            embedding_function=embeddings,
            collection_configuration={"hnsw": {"space": "cosine"}},
        )
        start = time.perf_counter()
        RaptorRetriever.from_documents(load_documents(), vectorstore=store, random_state=0)
        count = len(store.get(include=[])["ids"])
        print(f"built and wrote {count - 1} nodes (+1 manifest record) into Chroma collection")
        print(f"{collection!r} in {time.perf_counter() - start:.1f}s\n")

        # 2. Reopen from a new client, as another process would: nothing is rebuilt.
        reopened = Chroma(
            client=chroma_client(tmp), collection_name=collection, embedding_function=embeddings
        )
        retriever = RaptorRetriever.from_vectorstore(reopened, k=4)

        question = "What do these essays say about how ideas and knowledge spread?"
        show(f"Q: {question}", retriever.invoke(question))
        # Chroma's own filter dialect, per call, as with vectorstore.as_retriever().
        show(
            "same question, filter={'topic': 'history'}:",
            retriever.invoke(question, filter={"topic": "history"}),
        )
        # Chroma operators on RAPTOR's keys: the chunks of one essay only.
        show(
            "Q: Who flew to the Moon?  filter: the Apollo essay's chunks",
            retriever.invoke(
                "Who flew to the Moon?",
                filter={"$and": [{"raptor_doc_id": "the-apollo-11-mission"}, {"raptor_layer": 0}]},
            ),
        )
        mmr = RaptorRetriever.from_vectorstore(
            reopened, search_type="mmr", search_kwargs={"k": 4, "fetch_k": 10, "lambda_mult": 0.5}
        )
        show(
            "Q: How do bees find flowers?  search_type='mmr'",
            mmr.invoke("How do bees find flowers?"),
        )
        strict = RaptorRetriever.from_vectorstore(
            reopened,
            search_type="similarity_score_threshold",
            search_kwargs={"score_threshold": 0.45, "k": 10},
        )
        show(
            "Q: How does a sourdough starter leaven bread?  score_threshold=0.45",
            strict.invoke("How does a sourdough starter leaven bread?"),
        )

        # 3. It is still an ordinary Chroma collection.
        plain = reopened.similarity_search("waggle dance", k=2, filter={"raptor_layer": 0})
        print("Chroma.similarity_search('waggle dance', filter={'raptor_layer': 0}):")
        for doc in plain:
            print(f"  {doc.id}: {' '.join(doc.page_content.split())[:72]}…")

        if os.environ.get("CHROMA_HOST"):
            reopened.delete_collection()  # leave a shared server as we found it


if __name__ == "__main__":
    main()
