"""RAPTOR over a LangChain text splitter's splits, as retrievers for ``quality.py --retrievers``.

LangChain's RAG tutorial splits its documents with
``RecursiveCharacterTextSplitter(chunk_size=1000, chunk_overlap=200, add_start_index=True)``
and hands the splits to its vector store.  These two factories build a ``RaptorRetriever``
over those splits of each document and search it with the default strategy:

* ``SplitsAsDocuments``: every split indexed as a document of its own
  (``rejoin_splits=False``, what earlier versions did);
* ``SplitsRejoined``: the default, splits joined back into their document first.

Run from the repository root (``quality.py`` puts ``benchmarks/`` on the path)::

    python benchmarks/quality.py --data ../shared/data --limit-docs 0 --limit-questions 0 \\
        --retrievers passage,splits-as-documents=langchain_splits:SplitsAsDocuments,splits-rejoined=langchain_splits:SplitsRejoined

Both use the run's embedding model, tokenizer and seed, and the offline extractive
summariser, as the run's own trees do.
"""

from __future__ import annotations

from typing import Any

from langchain_core.documents import Document
from langchain_text_splitters import RecursiveCharacterTextSplitter

from raptor_langchain import RaptorRetriever

__all__ = ["SplitsAsDocuments", "SplitsRejoined"]


class SplitsAsDocuments:
    """The default strategy over the tutorial's splits, each indexed as a document."""

    rejoin = False

    def __init__(self, corpus: Any) -> None:
        self.retriever = RaptorRetriever.from_documents(
            self.documents(corpus),
            corpus.embedder,
            k=1000,
            rejoin_splits=self.rejoin,
            tokenizer=corpus.tokenizer,
            random_state=corpus.random_state,
        )

    @staticmethod
    def documents(corpus: Any) -> list[Document]:
        """The tutorial's splits of the corpus's documents (``source``: the document id)."""
        splitter = RecursiveCharacterTextSplitter(
            chunk_size=1000, chunk_overlap=200, add_start_index=True
        )
        sources = [
            Document(page_content=d.text, metadata={"source": d.doc_id}) for d in corpus.documents
        ]
        return splitter.split_documents(sources)

    def retrieve(self, question: str, *, max_tokens: int) -> list[str]:
        """Passage texts, best first, within ``max_tokens``."""
        return [doc.page_content for doc in self.retriever.invoke(question, max_tokens=max_tokens)]


class SplitsRejoined(SplitsAsDocuments):
    """The same, with the splits joined back into their document (the default)."""

    rejoin = True
