"""RAPTOR over a PDF reader's pages in LlamaIndex, as retrievers for ``quality.py --retrievers``.

``SimpleDirectoryReader`` reads a PDF one ``Document`` per page, labelled ``page_label``
"1", "2", ... (llama-index-readers-file's ``PDFReader``).  The evaluation sets are plain
text, so each document is cut into pages of about 3,000 characters at a line break
(:func:`langchain_pages.cut_pages`, the same pages as the LangChain benchmark), with the
file metadata and ids such a reader gives (``filename_as_id=True``):

* ``PagesAsDocuments``: ``RaptorIndex(pages, join_pages=False)``, each page a document;
* ``PagesJoined``: ``RaptorIndex(pages)``, the default: the pages of a file joined into one
  document of the tree, each leaf keeping the page it starts on.

Run from the repository root (``quality.py`` puts ``benchmarks/`` on the path)::

    python benchmarks/quality.py --data ../shared/data --limit-docs 0 --limit-questions 0 \\
        --retrievers passage,li-pages-as-documents=llamaindex_pages:PagesAsDocuments,li-pages-joined=llamaindex_pages:PagesJoined

Both use the run's embedding model, tokenizer and seed, and the offline extractive
summariser, as the run's own trees do.
"""

from __future__ import annotations

from typing import Any

from langchain_pages import cut_pages
from llama_index.core import Document
from llamaindex_nodes import NodesAsLeaves

__all__ = ["PagesAsDocuments", "PagesJoined"]


class PagesAsDocuments(NodesAsLeaves):
    """The default strategy over a ``RaptorIndex`` of each document's pages, kept apart."""

    join = False

    @staticmethod
    def items(corpus: Any) -> list[Any]:
        """Each document's pages, as a PDF reader gives them."""
        return [
            Document(
                text=page,
                id_=f"{d.doc_id}_part_{i}",
                metadata={"file_name": d.doc_id, "page_label": str(i + 1)},
            )
            for d in corpus.documents
            for i, page in enumerate(cut_pages(d.text))
        ]

    def options(self) -> dict[str, Any]:
        """``join_pages`` as the class says."""
        return {"join_pages": self.join}


class PagesJoined(PagesAsDocuments):
    """The same, with the pages of a document joined into one (the default)."""

    join = True
