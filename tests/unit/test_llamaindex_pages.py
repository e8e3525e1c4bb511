"""RaptorIndex over a PDF reader's pages: one document in the tree, each leaf keeps its page.

The pages come from real PDFs read by LlamaIndex's ``SimpleDirectoryReader``, one
``Document`` per page as llama-index-readers-file's ``PDFReader`` returns them
(:func:`input_files.read_pdf_pages_with_llamaindex`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("pypdf")

from input_files import make_pdf, read_pdf_pages_with_llamaindex
from llama_index.core import Document, StorageContext, load_index_from_storage

from raptor_core.exceptions import InvalidParameterError, TreeFormatError
from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer
from raptor_llamaindex import RaptorIndex

DIM = 32
# The first page ends inside a sentence that the second page finishes.
PAGES = [
    ["Bees dance to show the hive where the flowers grow.", "The dance points at the"],
    ["sun, and a longer waggle run means the flowers are", "farther from the hive."],
    ["Honey is stored in wax cells.", "Bees fan their wings to dry it."],
]


def read(directory: Path, name: str = "bees.pdf", pages: list[list[str]] = PAGES) -> list[Document]:
    directory.mkdir(parents=True, exist_ok=True)
    return read_pdf_pages_with_llamaindex([make_pdf(directory / name, pages)])


def options(**extra: Any) -> dict[str, Any]:
    return {
        "embed_model": FakeEmbedder(DIM),
        "summarizer": EchoSummarizer(),
        "tokenizer": WhitespaceTokenizer(),
        "chunk_max_tokens": 12,
        "summary_max_tokens": 10,
        "random_state": 0,
        **extra,
    }


def crosses_the_break(text: str) -> bool:
    # The pages meet at a line break (a blank line: the loader ends each page with one).
    return re.search(r"points at the\s+sun, and a longer", text) is not None


def page_of(text: str, pages: list[Document], offset: int) -> int:
    starts = [text.index(p.text) for p in pages]
    return max(i for i, start in enumerate(starts) if start <= offset)


def test_pages_are_one_document_in_the_tree_and_each_leaf_keeps_its_page(
    tmp_path: Path,
) -> None:
    pages = read(tmp_path)
    assert [p.metadata["page_label"] for p in pages] == ["1", "2", "3"]
    index = RaptorIndex.from_documents(pages, **options())
    tree = index.tree
    assert tree.doc_ids == (pages[0].doc_id,)  # the first page's id
    assert index.ref_doc_ids == tuple(p.doc_id for p in pages)  # the pages, as given
    joined = "\n".join(p.text for p in pages)
    for leaf in tree.leaves:
        assert leaf.span is not None
        assert joined[leaf.span[0] : leaf.span[1]].strip() == leaf.text.strip()
        page = page_of(joined, pages, leaf.span[0])
        assert leaf.metadata["page_label"] == str(page + 1)
        assert leaf.metadata["file_name"] == "bees.pdf"
    # The sentence cut by the page break is in one leaf now.
    assert any(crosses_the_break(leaf.text) for leaf in tree.leaves)
    # Each page's nodes are the leaves that start on it.
    info = index.ref_doc_info
    assert list(info) == [p.doc_id for p in pages]
    for i, page in enumerate(pages):
        assert info[page.doc_id].metadata["page_label"] == str(i + 1)
        for leaf_id in info[page.doc_id].node_ids:
            assert tree.node(leaf_id).metadata["page_label"] == str(i + 1)
    assert sorted(n for p in pages for n in info[p.doc_id].node_ids) == sorted(
        leaf.id for leaf in tree.leaves
    )
    [hit, *_] = index.as_retriever(similarity_top_k=3).retrieve("Where do the dances point?")
    assert hit.node.metadata["page_label"] in {"1", "2", "3"}


def test_join_pages_false_keeps_each_page_a_document(tmp_path: Path) -> None:
    pages = read(tmp_path)
    index = RaptorIndex.from_documents(pages, join_pages=False, **options())
    assert set(index.tree.doc_ids) == {p.doc_id for p in pages}
    assert not any(crosses_the_break(leaf.text) for leaf in index.tree.leaves)


def test_two_pdfs_are_two_documents(tmp_path: Path) -> None:
    bees = read(tmp_path / "a")
    ants = read(tmp_path / "b", "ants.pdf", [["Ants farm aphids for honeydew."], ["Ants march."]])
    index = RaptorIndex.from_documents([*bees, *ants], **options())
    assert index.tree.doc_ids == (bees[0].doc_id, ants[0].doc_id)


def test_pymupdf_reader_pages_numbered_by_source_are_joined(tmp_path: Path) -> None:
    # PyMuPDFReader puts the page number in "source" ("1", "2", ...), beside total_pages and
    # file_path: each PDF is one document, and each leaf keeps its page's "source".
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    bees = make_pdf(tmp_path / "a" / "bees.pdf", PAGES)
    ants = make_pdf(tmp_path / "b" / "ants.pdf", [["Ants farm aphids."], ["Ants march."]])
    pages = read_pdf_pages_with_llamaindex([bees, ants], pymupdf=True)
    assert [p.metadata["source"] for p in pages] == ["1", "2", "3", "1", "2"]
    assert "page_label" not in pages[0].metadata
    index = RaptorIndex.from_documents(pages, **options())
    assert index.tree.doc_ids == (pages[0].doc_id, pages[3].doc_id)
    assert any(crosses_the_break(leaf.text) for leaf in index.tree.leaves)
    joined = "\n".join(p.text for p in pages[:3])
    for leaf in index.tree.leaves:
        assert leaf.span is not None
        if leaf.doc_id == pages[0].doc_id:
            assert leaf.metadata["source"] == str(page_of(joined, pages[:3], leaf.span[0]) + 1)
        assert leaf.metadata["total_pages"] == (3 if leaf.doc_id == pages[0].doc_id else 2)
    info = index.ref_doc_info
    assert list(info) == [p.doc_id for p in pages]
    assert {index.tree.node(n).metadata["source"] for n in info[pages[1].doc_id].node_ids} <= {"2"}


def test_a_changed_page_is_joined_again_in_place(tmp_path: Path) -> None:
    pages = read(tmp_path)
    index = RaptorIndex.from_documents(pages, **options())
    changed = Document(
        text="sun, and a short waggle run means the flowers are near the hive.",
        id_=pages[1].doc_id,
        metadata=pages[1].metadata,
    )
    assert index.refresh_ref_docs([pages[0], changed, pages[2]]) == [False, True, False]
    assert index.ref_doc_ids == tuple(p.doc_id for p in pages)
    [document] = index.tree.doc_ids
    text = " ".join(leaf.text for leaf in sorted(index.tree.leaves, key=lambda n: n.span or (0, 0)))
    assert "short waggle run" in text and "longer waggle run" not in text
    assert text.index("points at the") < text.index("short waggle") < text.index("Honey")
    assert document == pages[0].doc_id
    # update_ref_doc takes the same path.
    index.update_ref_doc(pages[1])
    assert any(crosses_the_break(leaf.text) for leaf in index.tree.leaves)


def test_deleting_pages_splits_or_renames_the_run(tmp_path: Path) -> None:
    pages = read(tmp_path)
    index = RaptorIndex.from_documents(pages, **options())
    index.delete_ref_doc(pages[1].doc_id)
    # Pages 1 and 3 do not follow each other: two documents.
    assert index.tree.doc_ids == (pages[0].doc_id, pages[2].doc_id)
    assert index.ref_doc_ids == (pages[0].doc_id, pages[2].doc_id)
    index.insert(pages[1])  # re-inserted, it goes back after page 1: one file again
    assert index.tree.doc_ids == (pages[0].doc_id,)
    assert index.ref_doc_ids == tuple(p.doc_id for p in pages)

    index = RaptorIndex.from_documents(pages, **options())
    index.delete_ref_doc(pages[0].doc_id)
    assert index.tree.doc_ids == (pages[1].doc_id,)  # pages 2 and 3, under page 2's id


def test_a_next_page_inserted_later_joins_the_pdf(tmp_path: Path) -> None:
    pages = read(tmp_path)
    index = RaptorIndex.from_documents(pages[:2], **options())
    assert len(index.tree.doc_ids) == 1
    index.insert(pages[2])
    assert index.tree.doc_ids == (pages[0].doc_id,)
    assert "Honey is stored" in " ".join(leaf.text for leaf in index.tree.leaves)


def test_a_next_page_joins_the_pdf_whatever_follows_it_in_the_index(tmp_path: Path) -> None:
    """Another document after the file's pages: the inserted page still joins the file."""
    pages = read(tmp_path)
    other = Document(text="Rockets burn fuel to reach orbit. " * 3, id_="rockets")
    index = RaptorIndex.from_documents([*pages[:2], other], **options())
    assert index.tree.doc_ids == (pages[0].doc_id, "rockets")
    index.insert(pages[2])
    assert sorted(index.tree.doc_ids) == sorted([pages[0].doc_id, "rockets"])
    joined = [leaf.text for leaf in index.tree.leaves if leaf.doc_id == pages[0].doc_id]
    assert "Honey is stored" in " ".join(joined)
    assert index.ref_doc_ids[-1] == "rockets"  # the page took its place in the file


def test_the_setting_is_saved_with_the_index(tmp_path: Path) -> None:
    pages = read(tmp_path / "pdf")
    index = RaptorIndex.from_documents(pages[:2], **options())
    index.storage_context.persist(str(tmp_path / "storage"))
    reopened = load_index_from_storage(
        StorageContext.from_defaults(persist_dir=str(tmp_path / "storage")), **options()
    )
    assert isinstance(reopened, RaptorIndex)
    reopened.insert(pages[2])
    assert reopened.tree.doc_ids == (pages[0].doc_id,)

    index.persist(tmp_path / "export")
    loaded = RaptorIndex.load(tmp_path / "export", **options())
    loaded.insert(pages[2])
    assert loaded.tree.doc_ids == (pages[0].doc_id,)
    # Changed on opening, the setting applies to the documents written from then on.
    apart = RaptorIndex.load(tmp_path / "export", join_pages=False, **options())
    apart.insert(pages[2])
    assert pages[2].doc_id in apart.tree.doc_ids


def test_an_index_saved_before_the_option_never_joins(tmp_path: Path) -> None:
    pages = read(tmp_path / "pdf")
    index = RaptorIndex.from_documents(pages[:2], join_pages=False, **options())
    index._index_struct.join_pages = None  # as an older version wrote it
    index.storage_context.persist(str(tmp_path / "storage"))
    reopened = load_index_from_storage(
        StorageContext.from_defaults(persist_dir=str(tmp_path / "storage")), **options()
    )
    reopened.insert(pages[2])
    assert len(reopened.tree.doc_ids) == 3


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidParameterError, match="join_pages must be True or False"):
        RaptorIndex.from_documents([Document(text="Bees dance.")], join_pages="yes", **options())
    pages = read(tmp_path / "pdf")
    index = RaptorIndex.from_documents(pages, **options())
    index.persist(tmp_path / "export")
    params = tmp_path / "export" / "raptor_llamaindex.json"
    params.write_text(params.read_text().replace('"join_pages": true', '"join_pages": "yes"'))
    with pytest.raises(TreeFormatError, match="join_pages"):
        RaptorIndex.load(tmp_path / "export", **options())


async def test_async_updates_join_pages_too(tmp_path: Path) -> None:
    pages = read(tmp_path)
    index = await RaptorIndex.afrom_documents(pages[:2], **options())
    assert index.tree.doc_ids == (pages[0].doc_id,)
    await index.ainsert(pages[2])
    assert index.tree.doc_ids == (pages[0].doc_id,)
    changed = Document(
        text="Honey is kept in wax.", id_=pages[2].doc_id, metadata=pages[2].metadata
    )
    assert await index.arefresh_ref_docs([pages[0], pages[1], changed]) == [False, False, True]
    assert index.tree.doc_ids == (pages[0].doc_id,)
    assert "Honey is kept in wax." in " ".join(leaf.text for leaf in index.tree.leaves)


def test_a_node_parsers_nodes_of_pages_rejoin_into_pages_then_into_the_pdf(
    tmp_path: Path,
) -> None:
    from llama_index.core.node_parser import SentenceSplitter

    pages = read(tmp_path)
    for page in pages:  # the splitter counts the metadata shown to models in its chunk size
        page.excluded_embed_metadata_keys = page.excluded_llm_metadata_keys = list(page.metadata)
    nodes = SentenceSplitter(chunk_size=16, chunk_overlap=2).get_nodes_from_documents(pages)
    assert len(nodes) > len(pages)
    index = RaptorIndex(nodes, rejoin_nodes=True, **options())
    assert index.tree.doc_ids == (pages[0].doc_id,)
    assert any(crosses_the_break(leaf.text) for leaf in index.tree.leaves)
    assert {leaf.metadata["page_label"] for leaf in index.tree.leaves} == {"1", "2", "3"}
