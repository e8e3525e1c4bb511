"""rejoin_splits: a text splitter's splits put back into the documents they were cut from."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raptor_core.build.rejoin import MAX_GAP, rejoin_splits, split_start
from raptor_core.types import Document

SOURCE = "Cinderella lost a slipper.\n\nThe prince searched the kingdom. He found her at last."


def cut(text: str, windows: list[tuple[int, int]], **metadata: object) -> list[Document]:
    return [
        Document(text=text[a:b], doc_id=f"s{i}", metadata=dict(metadata))
        for i, (a, b) in enumerate(windows)
    ]


def test_overlapping_splits_give_back_their_source_with_the_first_split_s_id() -> None:
    windows = [(0, 40), (28, 70), (60, len(SOURCE))]
    [joined] = rejoin_splits(cut(SOURCE, windows, source="c"), [a for a, _ in windows])
    assert joined.document.text == SOURCE
    assert joined.document.doc_id == "s0"
    assert joined.document.metadata == {"source": "c"}
    assert joined.parts == (0, 1, 2)


def test_stripped_whitespace_between_splits_is_filled_so_offsets_stay_offsets() -> None:
    # A splitter cuts at the paragraph break and strips it: the second split starts two
    # characters after the first ends.
    first = SOURCE.index("\n\n")
    windows = [(0, first), (first + 2, len(SOURCE))]
    [joined] = rejoin_splits(cut(SOURCE, windows), [a for a, _ in windows])
    assert joined.document.text == SOURCE
    # Whitespace stripped before the first split is filled too: offsets are the source's.
    padded = "\n\n" + SOURCE
    windows = [(2, 2 + first), (first + 4, len(padded))]
    [joined] = rejoin_splits(cut(padded, windows), [a for a, _ in windows])
    assert joined.document.text == padded
    assert joined.document.text.index("prince") == padded.index("prince")


def test_a_split_inside_the_text_laid_so_far_adds_nothing() -> None:
    windows = [(0, 60), (10, 30), (50, len(SOURCE))]
    [joined] = rejoin_splits(cut(SOURCE, windows), [a for a, _ in windows])
    assert joined.document.text == SOURCE
    assert joined.parts == (0, 1, 2)


@pytest.mark.parametrize(
    ("second_start", "why"),
    [
        (0, "the offsets restart: a new source"),
        (20, "the overlap disagrees with the text laid so far"),
        (40 + MAX_GAP + 1, "a hole longer than stripped whitespace: text is missing"),
    ],
)
def test_splits_are_never_joined_on_a_guess(second_start: int, why: str) -> None:
    docs = [
        Document(text=SOURCE[:40], doc_id="a"),
        Document(text=SOURCE[40:], doc_id="b"),
    ]
    out = rejoin_splits(docs, [0, second_start])
    assert [r.document for r in out] == docs, why
    assert [r.parts for r in out] == [(0,), (1,)]


def test_a_source_given_twice_comes_back_twice() -> None:
    # Two sources of one text (or starting with the same text): the second one's offsets
    # restart, so it is not laid over the first, where its text would agree.
    docs = cut(SOURCE, [(0, 40), (30, len(SOURCE)), (0, 40), (30, len(SOURCE))])
    out = rejoin_splits(docs, [0, 30, 0, 30])
    assert [r.document.text for r in out] == [SOURCE, SOURCE]
    assert [r.parts for r in out] == [(0, 1), (2, 3)]


def test_different_metadata_pre_split_chunks_and_unknown_offsets_stay_apart() -> None:
    a, b = SOURCE[:40], SOURCE[40:]
    cases = [
        (
            [Document(text=a, doc_id="a", metadata={"page": 1}), Document(text=b, doc_id="b")],
            [0, 40],
        ),
        ([Document(text=a, doc_id="a"), Document(text=b, doc_id="b", chunk_of="x")], [0, 40]),
        ([Document(text=a, doc_id="a"), Document(text=b, doc_id="b")], [0, None]),
        ([Document(text=a, doc_id="a"), Document(text=b, doc_id="b")], [None, 40]),
    ]
    for docs, starts in cases:
        out = rejoin_splits(docs, starts)
        assert [r.document for r in out] == docs
    # A lone split (its source fits in one) is returned exactly as given, filler and all.
    lone = [Document(text="Short.", doc_id="a")]
    assert rejoin_splits(lone, [3])[0].document is lone[0]


def test_two_sources_in_a_row_each_come_back() -> None:
    other = "A frog lived in a well. It met a princess. She kissed it."
    docs = cut(SOURCE, [(0, 40), (30, len(SOURCE))]) + cut(other, [(0, 30), (24, len(other))])
    out = rejoin_splits(docs, [0, 30, 0, 24])
    assert [r.document.text for r in out] == [SOURCE, other]
    assert [r.document.doc_id for r in out] == ["s0", "s0"]  # ids as given; cut() reuses them
    assert [r.parts for r in out] == [(0, 1), (2, 3)]


@pytest.mark.parametrize("value", [None, -1, True, 1.5, "3", 10**30])
def test_only_a_non_negative_int_is_an_offset(value: object) -> None:
    expected = value if value == 10**30 else None
    assert split_start(value) == expected
    # A huge offset is harmless: nothing is allocated for it.
    docs = [Document(text="One.", doc_id="a"), Document(text="Two.", doc_id="b")]
    assert len(rejoin_splits(docs, [value, value])) == 2  # type: ignore[list-item]


def test_offsets_must_match_the_documents() -> None:
    with pytest.raises(ValueError, match="2 offsets for 1 documents"):
        rejoin_splits([Document(text="x", doc_id="a")], [0, 1])


words = st.lists(st.sampled_from(["sun", "moon", "star", "sea", "sky"]), min_size=3, max_size=60)
seps = st.sampled_from([" ", "\n", "\n\n", ", "])


@settings(max_examples=200, deadline=None)
@given(words, st.data())
def test_any_overlapping_or_touching_windows_give_back_the_text_they_cover(
    tokens: list[str], data: st.DataObject
) -> None:
    text = tokens[0] + "".join(data.draw(seps) + t for t in tokens[1:])
    # Windows with advancing starts, each reaching at least the next one's start.
    starts = sorted(set(data.draw(st.lists(st.integers(0, len(text) - 1), min_size=1))))
    ends = [
        data.draw(st.integers(max(nxt, start + 1), len(text)))
        for start, nxt in zip(starts, [*starts[1:], len(text)], strict=True)
    ]
    # A window may reach past the next (a splitter's overlap) but must cover the text.
    windows = list(zip(starts, ends, strict=True))
    docs = cut(text, windows)
    out = rejoin_splits(docs, starts)
    assert len(out) == 1
    assert out[0].parts == tuple(range(len(windows)))
    if len(windows) == 1:
        assert out[0].document is docs[0]
        return
    # Offsets in the joined text are offsets in the source (a short lead is filled).
    lead = starts[0] if starts[0] <= MAX_GAP else 0
    assert out[0].document.text == "\n" * lead + text[starts[0] : max(ends)]


@pytest.mark.timeout(60)
def test_a_long_source_is_joined_in_one_pass() -> None:
    # 16 MB in 20,000 overlapping splits: growing one string split by split would copy the
    # text at every split (hours of copying); laid as pieces it takes well under a second.
    text = ("word " * 200 + "\n\n") * 16_000
    starts = list(range(0, len(text), 800))
    docs = [Document(text=text[s : s + 1000], doc_id=str(i)) for i, s in enumerate(starts)]
    [joined] = rejoin_splits(docs, starts)
    assert joined.document.text == text
    assert len(joined.parts) == len(docs) > 20_000


def periodic_splits() -> tuple[str, list[Document], list[int]]:
    """Splits of a text that repeats one phrase, at offsets found from the previous start.

    That is how LlamaIndex's node parsers place nodes: each split's text first occurs one
    phrase after the previous split's start, so every offset lands too early.
    """
    text = "Bees dance. " * 12
    windows = [(0, 36), (24, 60), (48, 84), (72, len(text))]
    splits = cut(text, windows)
    starts, previous = [], -1
    for split in splits:
        previous = text.find(split.text, previous + 1)
        starts.append(previous)
    return text, splits, starts


def test_periodic_text_is_joined_wrongly_unless_refused() -> None:
    text, splits, starts = periodic_splits()
    assert starts == [0, 12, 24, 36]  # too early: the splits really start 24 apart
    [joined] = rejoin_splits(splits, starts)
    assert len(joined.document.text) < len(text)  # the repeats the offsets skip are lost
    refused = rejoin_splits(splits, starts, refuse_periodic=True)
    assert [r.parts for r in refused] == [(0,), (1,), (2,), (3,)]
    assert [r.document for r in refused] == splits


def test_refusing_periodic_runs_keeps_every_other_join() -> None:
    windows = [(0, 40), (28, 70), (60, len(SOURCE))]
    splits = cut(SOURCE, windows)
    starts = [a for a, _ in windows]
    assert rejoin_splits(splits, starts, refuse_periodic=True) == rejoin_splits(splits, starts)
    # A split's place in the joined text counts the whitespace filled in before the first
    # split: taken as a place further back, each split would be "found again" at its own.
    padded = "\n\n" + SOURCE
    windows = [(2, 42), (30, 72), (62, len(padded))]
    [joined] = rejoin_splits(cut(padded, windows), [a for a, _ in windows], refuse_periodic=True)
    assert joined.document.text == padded
