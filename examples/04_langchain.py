"""RAPTOR as a drop-in LangChain retriever, offline.

Why: a LangChain app usually retrieves with ``vectorstore.as_retriever()``, which can only
return chunks.  ``RaptorRetriever`` is a ``BaseRetriever`` too, so it slots into the same
chains and agent tools, and it can also return the summaries of its tree: a question about
the collection as a whole gets an answer that no single chunk holds.

This script:
1. turns six short essays into LangChain ``Document``s and builds a ``RaptorRetriever``
   with the packaged local embedding model (no network, no API key);
2. runs an LCEL RAG chain with it (a fake chat model stands in for ChatOpenAI & co.);
3. wraps it with ``create_retriever_tool`` and lets a scripted "agent" model call it;
4. compares its top 4 against ``InMemoryVectorStore(...).as_retriever()`` (k=4) over the
   same documents, cut into the same chunks.

Run: ``python examples/04_langchain.py`` (about a minute on two CPU cores).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from langchain_core.documents import Document
from langchain_core.language_models.fake_chat_models import (
    FakeListChatModel,
    GenericFakeChatModel,
)
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.tools import create_retriever_tool
from langchain_core.vectorstores import InMemoryVectorStore

from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder
from raptor_langchain import RaptorEmbeddings, RaptorRetriever

ESSAYS = Path(__file__).resolve().parents[1] / "tests" / "data" / "multi_topic.md"


def load_documents() -> list[Document]:
    """One LangChain Document per essay, as a loader + splitter on headings would give."""
    text = ESSAYS.read_text(encoding="utf-8")
    docs = []
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        title, _, body = section.partition("\n")
        slug = re.sub(r"\W+", "-", title.lower()).strip("-")
        docs.append(
            Document(
                id=slug,
                page_content=body.strip(),
                metadata={"source": ESSAYS.name, "title": title.strip()},
            )
        )
    return docs


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(doc.page_content for doc in docs)


def short(text: str, width: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def main() -> None:
    docs = load_documents()
    # Any LangChain Embeddings works here (HuggingFaceEmbeddings, OpenAIEmbeddings, ...);
    # RaptorEmbeddings exposes the packaged offline all-MiniLM-L6-v2 as one.
    embeddings = RaptorEmbeddings(SentenceTransformerEmbedder())

    # 1. Build.  Pass llm=ChatOpenAI(...) (or any chat model) for abstractive summaries;
    #    without one, summaries are extractive and the build stays offline.
    start = time.perf_counter()
    retriever = RaptorRetriever.from_documents(docs, embeddings=embeddings, k=4, random_state=0)
    tree = retriever.tree
    sizes = [len(tree.layer(i)) for i in range(tree.num_layers)]
    print(f"built a tree over {len(docs)} documents in {time.perf_counter() - start:.1f}s")
    print(f"  nodes per layer (leaves first): {sizes}\n")

    with tempfile.TemporaryDirectory() as tmp:
        retriever.save(Path(tmp) / "essays-tree")
        # The tree records the packaged model, one of the few a load re-creates by itself
        # (a local sentence-transformers model by name), so loading needs no arguments.
        # Any other model (OpenAI, a LangChain Embeddings) is passed again: embeddings=...
        retriever = RaptorRetriever.from_tree(Path(tmp) / "essays-tree", k=4)

    # 2. An LCEL chain: exactly where vectorstore.as_retriever() would go.
    prompt = ChatPromptTemplate.from_template(
        "Answer from the context only.\n\nContext:\n{context}\n\nQuestion: {question}"
    )
    llm = FakeListChatModel(responses=["Bees point the way with the waggle dance."])
    chain = (
        {"context": retriever | format_docs, "question": RunnablePassthrough()}
        | prompt
        | llm
        | StrOutputParser()
    )
    question = "How do honeybees tell each other where food is?"
    print(f"chain.invoke({question!r}) -> {chain.invoke(question)!r}")
    chunks = list(chain.stream(question))
    print(f"  streamed in {len(chunks)} chunks: {chunks[:5]}…\n")

    # 3. As an agent tool.  The scripted model asks for the tool the way a real
    #    tool-calling model (e.g. ChatOpenAI().bind_tools([tool])) would.
    tool = create_retriever_tool(
        retriever,
        "search_essays",
        "Search six short essays on bees, printing, volcanoes, sourdough, Apollo 11 and vaccines.",
    )
    call = {"name": tool.name, "args": {"query": "Apollo 11 crew"}, "id": "call-1"}
    agent_model = GenericFakeChatModel(
        messages=iter(
            [
                AIMessage(content="", tool_calls=[call]),
                AIMessage(content="Armstrong, Aldrin, Collins."),
            ]
        )
    )
    messages: list = [HumanMessage("Who flew on Apollo 11?")]
    ai = agent_model.invoke(messages)
    messages.append(ai)
    for tool_call in ai.tool_calls:
        result = tool.invoke({**tool_call, "type": "tool_call"})  # a ToolMessage
        print(f"agent called {tool_call['name']}({tool_call['args']}) -> {short(result.content)}")
        messages.append(result)
    print(f"agent answered: {agent_model.invoke(messages).content}\n")

    # 4. Against a flat vector store over the same documents, cut into the same chunks
    #    (the tree's leaves), with the same model: the paper's RAPTOR vs flat comparison.
    chunks = [
        Document(id=n.id, page_content=n.text, metadata={**n.metadata, "doc_id": n.doc_id})
        for n in retriever.tree.leaves
    ]
    store = InMemoryVectorStore(embedding=embeddings)
    store.add_documents(chunks)
    flat = store.as_retriever(search_kwargs={"k": 4})

    questions = [
        "What was the waggle dance decoded by, and what does it encode?",  # one detail
        "What subjects does this collection of essays cover?",  # the whole collection
    ]
    for q in questions:
        print(f"Q: {q}")
        raptor_docs = retriever.invoke(q)
        flat_docs = flat.invoke(q)
        raptor_cover = {d for doc in raptor_docs for d in doc.metadata["raptor_doc_ids"]}
        flat_cover = {doc.metadata["doc_id"] for doc in flat_docs}
        # A summary draws on every essay under it (raptor_doc_ids), a chunk on one.
        print(f"  RAPTOR (k=4) draws on {len(raptor_cover)} of {len(docs)} essays:")
        for doc in raptor_docs:
            layer = doc.metadata["raptor_layer"]
            kind = "leaf   " if layer == 0 else f"layer {layer}"
            print(f"    [{kind}] {doc.metadata['score']:.3f} {short(doc.page_content, 70)}")
        print(f"  InMemoryVectorStore (k=4) draws on {len(flat_cover)} of {len(docs)} essays:")
        for doc in flat_docs:
            print(f"    [leaf   ]       {short(doc.page_content, 70)}")
        print()


if __name__ == "__main__":
    main()
