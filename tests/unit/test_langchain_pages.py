"""RaptorRetriever over a PDF loader's pages: joined into one document, each leaf keeps its page.

The pages come from real PDFs read by LangChain's ``PyPDFLoader`` (langchain_community,
pypdf), as a LangChain pipeline loads them.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("pypdf")

from input_files import make_pdf
from langchain_core.documents import Document
from langchain_text_splitters import RecursiveCharacterTextSplitter
from test_langchain_splits import DIM, options

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # langchain-community's sunset notice
    from langchain_community.document_loaders import PyPDFLoader

from raptor_core.testing import FakeEmbedder
from raptor_langchain import RaptorRetriever
from raptor_langchain.retriever import rejoin_documents

PAGES = [
    ["Bees dance to show the hive where the flowers grow.", "The dance points at the sun."],
    ["A waggle run that lasts longer means the flowers are", "farther from the hive."],
    ["Honey is stored in wax cells.", "Bees fan their wings to dry it."],
]


def load(tmp_path: Path, name: str = "bees.pdf", pages: list[list[str]] = PAGES) -> list[Document]:
    return PyPDFLoader(str(make_pdf(tmp_path / name, pages))).load()


def core(docs: list[Document]) -> Any:
    return RaptorRetriever._core_documents(docs, rejoin=True)


def test_a_pdf_s_pages_become_one_document_whose_leaves_keep_their_page(tmp_path: Path) -> None:
    pages = load(tmp_path)
    assert [p.metadata["page"] for p in pages] == [0, 1, 2]
    [joined] = core(pages)
    assert joined.text == "\n".join(p.page_content for p in pages)
    assert (
        "page" not in joined.metadata and joined.metadata["source"] == pages[0].metadata["source"]
    )
    retriever = RaptorRetriever.from_documents(pages, FakeEmbedder(DIM), **options())
    tree = retriever.tree
    assert tree is not None and len(tree.doc_ids) == 1
    starts = [joined.text.index(p.page_content) for p in pages]
    for leaf in tree.leaves:
        assert leaf.span is not None
        page = max(i for i, start in enumerate(starts) if start <= leaf.span[0])
        assert leaf.metadata["page"] == page  # the page the leaf starts on
        assert leaf.metadata["page_label"] == str(page + 1)
    assert {leaf.metadata["page"] for leaf in tree.leaves} == {0, 1, 2}
    # The sentence cut by the page break is one passage now, and its hit names its page.
    [hit, *_] = retriever.invoke("How far are the flowers from the hive?")
    assert "flowers are\nfarther from the hive" in hit.page_content
    assert hit.metadata["page"] in (0, 1)


def test_splits_of_pages_join_into_pages_then_into_the_pdf(tmp_path: Path) -> None:
    pages = load(tmp_path)
    splitter = RecursiveCharacterTextSplitter(chunk_size=40, chunk_overlap=10, add_start_index=True)
    splits = splitter.split_documents(pages)
    assert len(splits) > len(pages)
    [joined] = core(splits)
    assert joined.text == "\n".join(p.page_content for p in pages)
    assert "start_index" not in joined.metadata
    assert [dict(s.metadata) for s in joined.segments] == [
        {"page": i, "page_label": str(i + 1)} for i in range(3)
    ]
    [(_, parts)] = rejoin_documents(
        [RaptorRetriever._core_documents([s], rejoin=False)[0] for s in splits]
    )
    assert parts == list(range(len(splits)))


def test_two_pdfs_stay_two_documents_and_a_lone_page_stays_as_given(tmp_path: Path) -> None:
    first = load(tmp_path, "a.pdf")
    second = load(tmp_path, "b.pdf")
    lone = load(tmp_path, "c.pdf", PAGES[:1])
    docs = core([*first, *second, *lone])
    assert [d.metadata["source"] for d in docs] == [
        first[0].metadata["source"],
        second[0].metadata["source"],
        lone[0].metadata["source"],
    ]
    assert docs[2].metadata["page"] == 0 and not docs[2].segments


def test_a_missing_page_or_a_page_cut_short_is_not_joined_across(tmp_path: Path) -> None:
    pages = load(tmp_path)
    assert len(core([pages[0], pages[2]])) == 2
    # A page's only split that starts inside its page: the start of the page is missing.
    cut = Document(
        page_content=pages[1].page_content[30:],
        metadata={**pages[1].metadata, "start_index": 30},
    )
    docs = core([pages[0], cut, pages[2]])
    assert len(docs) == 3 and docs[1].metadata["start_index"] == 30


def test_rejoin_splits_false_keeps_every_page_apart(tmp_path: Path) -> None:
    pages = load(tmp_path)
    retriever = RaptorRetriever.from_documents(
        pages, FakeEmbedder(DIM), rejoin_splits=False, **options()
    )
    assert retriever.tree is not None and len(retriever.tree.doc_ids) == 3


def test_a_blank_page_does_not_break_the_pdf_apart(tmp_path: Path) -> None:
    pages = load(tmp_path, pages=[PAGES[0], [], PAGES[2]])
    assert pages[1].page_content == ""  # what PyPDFLoader gives for a blank page
    retriever = RaptorRetriever.from_documents(pages, FakeEmbedder(DIM), **options())
    assert retriever.tree is not None and len(retriever.tree.doc_ids) == 1
    assert {leaf.metadata["page"] for leaf in retriever.tree.leaves} == {0, 2}
