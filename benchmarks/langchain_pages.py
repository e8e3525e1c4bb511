"""RAPTOR over a PDF loader's pages, as retrievers for ``quality.py --retrievers``.

LangChain's PDF loaders (``PyPDFLoader`` and the others) return one document per page,
numbered in ``metadata["page"]``, and pipelines hand those pages (or their splits) to the
vector store.  The evaluation sets are plain text, so each document is cut here into pages
of about 3,000 characters (a page of a single-column paper) at a line break, numbered from
0 with the source's name, as a loader would give them; the line break each cut falls on is
the one the pages are joined with again, so the joined text is the document's own.

* ``PagesAsDocuments``: every page indexed as a document of its own
  (``rejoin_splits=False``, what earlier versions did with every page);
* ``PagesJoined``: the default, the pages joined into their document first, each leaf
  keeping the page it starts on.

Run from the repository root (``quality.py`` puts ``benchmarks/`` on the path)::

    python benchmarks/quality.py --data ../shared/data --limit-docs 0 --limit-questions 0 \\
        --retrievers passage,pages-as-documents=langchain_pages:PagesAsDocuments,pages-joined=langchain_pages:PagesJoined

Both use the run's embedding model, tokenizer and seed, and the offline extractive
summariser, as the run's own trees do.
"""

from __future__ import annotations

from typing import Any

from langchain_core.documents import Document
from langchain_splits import SplitsAsDocuments

__all__ = ["PAGE_CHARS", "PagesAsDocuments", "PagesJoined", "cut_pages"]

#: About one page of a single-column PDF.
PAGE_CHARS = 3000


def cut_pages(text: str, size: int = PAGE_CHARS) -> list[str]:
    """``text`` cut into pages of at most about ``size`` characters at line breaks.

    Each page ends before a line break, which is dropped (``"\\n".join(pages) == text``);
    a stretch without a line break in the second half of a page is left longer.
    """
    pages: list[str] = []
    at = 0
    while len(text) - at > size:
        cut = text.rfind("\n", at + size // 2, at + size)
        if cut < 0:
            cut = text.find("\n", at + size)
            if cut < 0:
                break
        pages.append(text[at:cut])
        at = cut + 1
    pages.append(text[at:])
    return pages


class PagesAsDocuments(SplitsAsDocuments):
    """The default strategy over each document's pages, each indexed as a document."""

    rejoin = False

    @staticmethod
    def documents(corpus: Any) -> list[Document]:
        """Each document's pages, numbered from 0, with the document's id as ``source``."""
        return [
            Document(page_content=page, metadata={"source": d.doc_id, "page": i})
            for d in corpus.documents
            for i, page in enumerate(cut_pages(d.text))
        ]


class PagesJoined(PagesAsDocuments):
    """The same, with the pages joined back into their document (the default)."""

    rejoin = True
