"""Document segments: parts of a document's text with metadata of their own (pages of a PDF).

A leaf takes the metadata of the segment its text starts in; summaries keep what all their
leaves share; updates see a segment's metadata change as they see a document's.
"""

from __future__ import annotations

import pytest
from test_incremental import builder, doc

from raptor_core import InvalidInputError, Segment
from raptor_core.build.rejoin import join_pages
from raptor_core.testing import check_tree_invariants
from raptor_core.types import Document


def paged(n_pages: int = 3, sentences: int = 6) -> tuple[Document, list[int]]:
    """One document of ``n_pages`` topics, a segment per page; and where each page starts."""
    names = ["cats", "rockets", "bread", "rivers"][:n_pages]
    texts = [doc(name, sentences).text for name in names]
    starts, at = [], 0
    for text in texts:
        starts.append(at)
        at += len(text) + 1
    document = Document(
        text="\n".join(texts),
        doc_id="book",
        metadata={"source": "book.pdf"},
        segments=tuple(Segment(start=s, metadata={"page": i}) for i, s in enumerate(starts)),
    )
    return document, starts


def test_each_leaf_keeps_the_page_it_starts_on() -> None:
    document, starts = paged()
    tree = builder().build([document])
    check_tree_invariants(tree, extractive=True)
    assert tree.doc_ids == ("book",)
    for leaf in tree.leaves:
        assert leaf.span is not None
        page = max(i for i, start in enumerate(starts) if start <= leaf.span[0])
        assert leaf.metadata == {"source": "book.pdf", "page": page}
    # A summary keeps the metadata all its leaves share: the page only when it is one page.
    summaries = [node for node in tree.nodes if node.layer > 0]
    assert {"page" in node.metadata for node in summaries} == {True, False}
    for node in tree.nodes:
        if node.layer > 0:
            below = {leaf.metadata["page"] for leaf in tree.leaf_descendants(node.id)}
            assert node.metadata.get("source") == "book.pdf"
            assert ("page" in node.metadata) == (len(below) == 1)


def test_text_before_the_first_segment_has_the_document_s_metadata() -> None:
    document, starts = paged(2)
    late = Document(
        text=document.text,
        doc_id="book",
        metadata={"source": "book.pdf"},
        segments=(Segment(start=starts[1], metadata={"page": 1}),),
    )
    tree = builder().build([late])
    first = min(tree.leaves, key=lambda leaf: leaf.span[0] if leaf.span else 0)
    assert first.metadata == {"source": "book.pdf"}
    assert any(leaf.metadata.get("page") == 1 for leaf in tree.leaves)


def test_a_changed_page_number_is_an_update_of_its_leaves_only() -> None:
    b = builder()
    document, _ = paged()
    tree = b.build([document])
    renumbered = Document(
        text=document.text,
        doc_id="book",
        metadata=document.metadata,
        segments=(
            *document.segments[:2],
            Segment(start=document.segments[2].start, metadata={"page": 9}),
        ),
    )
    result = b.update(tree, [renumbered])
    changed = set(result.report.nodes_changed)
    third = {leaf.id for leaf in tree.leaves if leaf.metadata.get("page") == 2}
    assert third and third <= changed
    assert not {leaf.id for leaf in tree.leaves if leaf.metadata.get("page") == 0} & changed
    assert {result.tree.node(i).metadata["page"] for i in third} == {9}
    check_tree_invariants(result.tree, extractive=True)


@pytest.mark.parametrize(
    ("segments", "why"),
    [
        ((Segment(start=5), Segment(start=5)), "increasing"),
        ((Segment(start=-1),), "increasing"),
        ((Segment(start=10_000),), "increasing"),
        ((Segment(start=True),), "increasing"),
        ((Segment(start=0, metadata={"page": object()}),), "JSON"),
        ((Segment(start=0, metadata={1: "x"}),), "str keys"),  # type: ignore[dict-item]
        (("not a segment",), "Segment objects"),
    ],
)
def test_segments_that_do_not_fit_the_text_are_refused(segments: tuple, why: str) -> None:
    bad = Document(text="Cats purr. Dogs bark.", doc_id="d", segments=segments)
    with pytest.raises(InvalidInputError, match=why):
        builder().build([bad])


def test_a_pre_split_chunk_has_no_segments() -> None:
    bad = Document(text="Cats purr.", doc_id="c", chunk_of="d", segments=(Segment(start=0),))
    with pytest.raises(InvalidInputError, match="pre-split"):
        builder().build([bad])


# -- join_pages --------------------------------------------------------------------------------
def pages(*texts: str, **metadata: object) -> list[Document]:
    return [
        Document(text=t, doc_id=f"p{i}", metadata={**metadata, "page": i, "page_label": str(i + 1)})
        for i, t in enumerate(texts)
    ]


def test_consecutive_pages_of_one_source_become_one_document() -> None:
    given = pages("Cats purr.", "Dogs bark.", "Owls hoot.", source="a.pdf", total_pages=3)
    [joined] = join_pages(given)
    assert joined.parts == (0, 1, 2)
    assert joined.document.doc_id == "p0"
    assert joined.document.text == "Cats purr.\nDogs bark.\nOwls hoot."
    assert joined.document.metadata == {"source": "a.pdf", "total_pages": 3}
    assert [(s.start, s.metadata) for s in joined.document.segments] == [
        (0, {"page": 0, "page_label": "1"}),
        (11, {"page": 1, "page_label": "2"}),
        (22, {"page": 2, "page_label": "3"}),
    ]
    text = joined.document.text
    assert [text[s.start : s.start + 4] for s in joined.document.segments] == [
        "Cats",
        "Dogs",
        "Owls",
    ]


def test_string_page_numbers_join_too() -> None:
    # LlamaIndex's PDF reader numbers pages with a string label only.
    given = [
        Document(text="One.", doc_id="a", metadata={"file_name": "x.pdf", "page_label": "1"}),
        Document(text="Two.", doc_id="b", metadata={"file_name": "x.pdf", "page_label": "2"}),
    ]
    assert [r.parts for r in join_pages(given)] == [(0, 1)]


@pytest.mark.parametrize(
    ("second", "why"),
    [
        ({"source": "a.pdf", "page": 2}, "a page missing in between"),
        ({"source": "a.pdf", "page": 0}, "numbers restart: another file"),
        ({"source": "b.pdf", "page": 1}, "another source"),
        ({"source": "a.pdf"}, "not a page"),
        ({"source": "a.pdf", "page": "ii"}, "a label that is not a number"),
        ({"source": "a.pdf", "page": True}, "a bool is not a number"),
    ],
)
def test_pages_are_never_joined_on_a_guess(second: dict, why: str) -> None:
    given = [
        Document(text="Cats purr.", doc_id="a", metadata={"source": "a.pdf", "page": 0}),
        Document(text="Dogs bark.", doc_id="b", metadata=second),
    ]
    assert [r.document for r in join_pages(given)] == given, why


def test_pages_without_other_metadata_are_not_known_to_be_one_source() -> None:
    given = [
        Document(text="A.", doc_id="a", metadata={"page": 0}),
        Document(text="B.", doc_id="b", metadata={"page": 1}),
    ]
    assert [r.parts for r in join_pages(given)] == [(0,), (1,)]


def test_joined_pages_build_the_tree_of_their_whole_text() -> None:
    document, _ = paged()
    given = [
        Document(text=text, doc_id=f"p{i}", metadata={"source": "book.pdf", "page": i})
        for i, text in enumerate(document.text.split("\n"))
    ]
    [joined] = join_pages(given)
    a = builder().build([joined.document])
    b = builder().build(
        [Document(text=document.text, doc_id="p0", metadata={"source": "book.pdf"})]
    )
    assert [n.id for n in a.nodes] == [n.id for n in b.nodes]
    assert [n.text for n in a.nodes] == [n.text for n in b.nodes]


def test_a_blank_page_is_part_of_the_run_and_adds_no_text() -> None:
    given = pages("Cats purr.", "", "Owls hoot.", source="a.pdf")
    [joined] = join_pages(given)
    assert joined.parts == (0, 1, 2)
    assert joined.document.text == "Cats purr.\nOwls hoot."
    assert [s.metadata["page"] for s in joined.document.segments] == [0, 2]
    # Blank pages alone are returned as given (an empty document is then refused as ever).
    assert [r.parts for r in join_pages(pages("", " ", source="a.pdf"))] == [(0,), (1,)]


def pages_with(*metadata: dict[str, object]) -> list[Document]:
    """One page per metadata, as given (``pages`` above adds ``page`` and ``page_label``)."""
    return [Document(text=f"Page {i}.", doc_id=f"p{i}", metadata=m) for i, m in enumerate(metadata)]


def test_pymupdf_reader_pages_are_numbered_by_their_source() -> None:
    pdf = {"total_pages": 2, "file_path": "/docs/a.pdf"}
    [joined] = join_pages(pages_with({**pdf, "source": "1"}, {**pdf, "source": "2"}))
    assert joined.parts == (0, 1)
    assert joined.document.metadata == pdf
    assert [s.metadata for s in joined.document.segments] == [{"source": "1"}, {"source": "2"}]


@pytest.mark.parametrize(
    ("first", "second", "why"),
    [
        # A page key of its own: source is the file's name (LangChain's loaders), which
        # differs here, so these are pages of two files.
        ({"source": "1", "page": 0}, {"source": "2", "page": 1}, "a page key of its own"),
        ({"source": "1", "total_pages": 2}, {"source": "2", "total_pages": 2}, "no file_path"),
        ({"source": "1"}, {"source": "2"}, "nothing but a source"),
        (
            {"source": "a.pdf", "total_pages": 2, "file_path": "a.pdf"},
            {"source": "b.pdf", "total_pages": 2, "file_path": "a.pdf"},
            "a source that is no number",
        ),
    ],
)
def test_source_numbers_pages_only_beside_pymupdf_s_keys(
    first: dict[str, object], second: dict[str, object], why: str
) -> None:
    assert [r.parts for r in join_pages(pages_with(first, second))] == [(0,), (1,)], why
