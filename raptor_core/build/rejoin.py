"""Splits of one source document put back together before the builder chunks them.

Pipelines often split their documents before they reach us: LangChain's RAG tutorial
passes ``RecursiveCharacterTextSplitter(chunk_size=1000, chunk_overlap=200,
add_start_index=True).split_documents(docs)`` to its vector store.  Indexed as documents,
those splits cost RAPTOR twice: each split is chunked on its own (a 1,000-character split
ends in a fragment of a leaf), and the 200 characters each split repeats from the one before
are stored, embedded and returned twice.  Passages never join two splits either, because
they are different documents.

A splitter that records where each split starts in its source (``start_index``) says
enough to undo the split: consecutive splits with the same metadata whose offsets advance
and whose overlapping text agrees are one source, and its text is the splits laid at their
offsets.  :func:`rejoin_splits` does that and nothing more; which documents carry an offset
is the adapter's business (the LangChain adapter reads ``metadata["start_index"]``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from raptor_core.types import Document, Segment

__all__ = [
    "MAX_GAP",
    "PAGE_KEYS",
    "Rejoined",
    "continues",
    "join_pages",
    "rejoin_splits",
    "split_start",
]

#: The most characters two consecutive splits may leave between them and still be joined.
#: Splitters strip the whitespace at a split's ends (a paragraph break, an indent): that is
#: the gap they leave.  A longer hole means text is missing (splits filtered out, or not
#: consecutive at all), and joining across it would make a passage of text that is not
#: contiguous in the source.
MAX_GAP = 16


#: Metadata keys that number a loader's pages: ``page`` and ``page_label`` (LangChain's PDF
#: loaders: PyPDF, PyMuPDF, pdfplumber), ``page_number`` (Unstructured), ``page_label``
#: (LlamaIndex's PDF reader).
PAGE_KEYS = ("page", "page_label", "page_number")


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejoined:
    """One document for the builder, and which of the given documents it was made of."""

    document: Document
    parts: tuple[int, ...]


def split_start(value: object) -> int | None:
    """``value`` as a split's start offset, or None when it cannot be one.

    Only a non-negative int is an offset: a bool is not, and -1 is what ``str.find`` (and
    so a splitter that looked for its split in the source) returns for "not found".
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


class _Source:
    """A source document being laid back together, split by split.

    The text is kept as a list of pieces: growing one string split by split would copy the
    whole text at every split, quadratic in the source's length.  A new split starts after
    the last one, so its overlap lies within ``recent``, the text laid from the last split's
    start onwards (at most as long as the longest split).
    """

    def __init__(self, index: int, doc: Document, start: int) -> None:
        self.first = doc
        self.parts = [index]
        # Whitespace stripped from the very start of the source is filled back when it is
        # short, so that leaf spans are offsets in the source itself.
        lead = "\n" * start if start <= MAX_GAP else ""
        # Every offset in the joined text is a source offset less this: gaps are filled with
        # as many characters as they held, and only a long lead is left out.
        self.shift = 0 if lead else start
        self.places = [start - self.shift]  # each part's offset in the joined text
        self.pieces = [lead + doc.text]
        self.last_start = start
        self.recent = doc.text
        self.end = start + len(doc.text)  # the source offset just past the text laid so far

    def take(self, index: int, doc: Document, start: int) -> bool:
        """Lay ``doc`` at ``start`` if it continues this source; False if it does not."""
        if (
            doc.metadata != self.first.metadata
            or start <= self.last_start
            or start > self.end + MAX_GAP
        ):
            return False
        at = start - self.last_start
        repeated = self.recent[at : at + len(doc.text)]
        if not doc.text.startswith(repeated):
            # The overlap disagrees: the offsets are not into this text.
            return False
        # Stripped whitespace between the two (when they do not overlap) comes back as line
        # breaks: a line break never glues two paragraphs into one sentence, a space could.
        new = "\n" * max(0, start - self.end) + doc.text[len(repeated) :]
        self.pieces.append(new)
        self.recent = (self.recent + new)[at:]
        self.parts.append(index)
        self.places.append(start - self.shift)
        self.last_start = start
        self.end += len(new)
        return True

    def results(self, documents: Sequence[Document], *, refuse_periodic: bool) -> list[Rejoined]:
        """The joined document; each split as given when there is nothing to join or trust."""
        if len(self.parts) > 1:
            text = "".join(self.pieces)
            if not (refuse_periodic and self._periodic(text, documents)):
                joined = dataclasses.replace(self.first, text=text)
                return [Rejoined(document=joined, parts=tuple(self.parts))]
        return [Rejoined(document=documents[i], parts=(i,)) for i in self.parts]

    def _periodic(self, text: str, documents: Sequence[Document]) -> bool:
        """Whether some split's text occurs again within its own length after its place.

        Offsets found by searching for each split from the previous split's *start*
        (LlamaIndex's node parsers) land too early in text that repeats itself: they still
        advance and agree with every overlap, and the join would drop the repeats.  Text in
        which a split recurs that close is periodic, so its offsets cannot be trusted.  (A
        repeat far away leaves a hole in the offsets instead, which is never joined.)
        """
        for part, place in zip(self.parts, self.places, strict=True):
            split = documents[part].text
            if text.find(split, place + 1, place + 1 + 2 * len(split)) >= 0:
                return True
        return False


def rejoin_splits(
    documents: Sequence[Document], starts: Sequence[int | None], *, refuse_periodic: bool = False
) -> list[Rejoined]:
    """Join consecutive splits of one source into that source, in the order given.

    ``starts[i]`` is where ``documents[i]`` starts in the document it was split from, or
    None when it is not a split (or the offset is unknown).  A split continues the source
    of the split before it when both have the same metadata (compare them without the
    offset's own key), it starts after that split, no more than :data:`MAX_GAP` characters
    past the text laid so far, and the text it repeats from its predecessor (a splitter's
    ``chunk_overlap``) is the same text.  The joined document keeps the id and metadata of
    its first split; its text holds every overlap once and fills the whitespace the
    splitter stripped between splits with line breaks (and before the first split, when it
    starts within :data:`MAX_GAP` characters of the source's start, so that offsets in the
    joined text are offsets in the source).  A split joined with nothing is returned as it
    was given.  A split that fits none of that
    (a document with no offset, a pre-split chunk with ``chunk_of``, a split whose offsets
    restart or jump, or whose overlap disagrees) starts a new document, so nothing is ever
    joined on a guess: at worst, splits stay separate documents as they were given.

    Args:
        documents: the splits, in the order the splitter returned them.
        starts: each split's offset in its source, or None.
        refuse_periodic: return a run as its splits, as given, when one of them occurs again
            within its own length after its place in the joined text.  For offsets found
            by searching for each split from the previous split's start (LlamaIndex's node
            parsers), which land too early in text that repeats itself.  Offsets searched
            from the previous split's end less the overlap (LangChain's ``start_index``)
            are exact there and need no such check.

    Returns:
        One :class:`Rejoined` per resulting document, in the order of their first splits;
        every given index appears in exactly one ``parts``.

    Raises:
        ValueError: ``starts`` and ``documents`` differ in length.

    Examples:
        >>> from raptor_core.types import Document, Segment
        >>> splits = [Document(text="One two three.", doc_id="a"),
        ...           Document(text="three. Four.", doc_id="b")]
        >>> [r.document.text for r in rejoin_splits(splits, [0, 8])]
        ['One two three. Four.']
    """
    if len(starts) != len(documents):
        msg = f"got {len(starts)} offsets for {len(documents)} documents"
        raise ValueError(msg)
    out: list[Rejoined] = []
    source: _Source | None = None
    for index, (doc, given) in enumerate(zip(documents, starts, strict=True)):
        # A pre-split chunk (chunk_of set) is a leaf as it is, never a split to join.
        start = split_start(given) if doc.chunk_of is None else None
        if source is not None and start is not None and source.take(index, doc, start):
            continue
        if source is not None:
            out.extend(source.results(documents, refuse_periodic=refuse_periodic))
            source = None
        if start is None:
            out.append(Rejoined(document=doc, parts=(index,)))
        else:
            source = _Source(index, doc, start)
    if source is not None:
        out.extend(source.results(documents, refuse_periodic=refuse_periodic))
    return out


#: LlamaIndex's ``PyMuPDFReader`` numbers its pages in ``source`` (a string, from "1"), next
#: to ``total_pages`` and ``file_path``: there, and only there, ``source`` is a page key.
#: Elsewhere ``source`` names the file (LangChain's loaders put the path there), so it never
#: is one by default.
_NUMBERED_BY_SOURCE = ("total_pages", "file_path")


def _keys_of(doc: Document, keys: tuple[str, ...]) -> tuple[str, ...]:
    """The page keys of ``doc``: ``keys``, plus ``source`` on a ``PyMuPDFReader`` page."""
    metadata = doc.metadata
    source = metadata.get("source")
    if (
        "source" not in keys
        and isinstance(source, str)
        and source.isascii()
        and source.isdigit()
        and all(k in metadata for k in _NUMBERED_BY_SOURCE)
        and not any(k in metadata for k in keys)
    ):
        return (*keys, "source")
    return keys


def _page_number(doc: Document, keys: Sequence[str]) -> tuple[str, int] | None:
    """``(key, number)`` of the first page key holding a page number, else None."""
    for key in keys:
        value = doc.metadata.get(key)
        if isinstance(value, str) and value.isascii() and value.isdigit():
            return key, int(value)
        number = split_start(value)
        if number is not None:
            return key, number
    return None


def _page_of(
    doc: Document, keys: tuple[str, ...]
) -> tuple[tuple[str, int] | None, dict[str, object]]:
    """``doc``'s page number (None: not a page) and its metadata without the page keys."""
    doc_keys = _keys_of(doc, keys)
    number = None if doc.chunk_of is not None or doc.segments else _page_number(doc, doc_keys)
    return number, {k: v for k, v in doc.metadata.items() if k not in doc_keys}


def continues(previous: Document, page: Document, *, page_keys: Sequence[str] = PAGE_KEYS) -> bool:
    """Whether ``page`` is the page after ``previous`` of the same source (see join_pages).

    Its metadata without the page keys is ``previous``'s, and not empty (something must name
    the source), and it is numbered one more by the same key.
    """
    keys = tuple(page_keys)
    before, before_rest = _page_of(previous, keys)
    number, rest = _page_of(page, keys)
    return (
        before is not None
        and number == (before[0], before[1] + 1)
        and bool(rest)
        and rest == before_rest
    )


def join_pages(
    documents: Sequence[Document], *, page_keys: Sequence[str] = PAGE_KEYS, separator: str = "\n"
) -> list[Rejoined]:
    r"""Join consecutive pages of one source into that source, each page a segment of it.

    Document loaders return a PDF one page at a time (LangChain's ``PyPDFLoader``: one
    document per page, numbered by ``metadata["page"]``).  Indexed apart, no leaf or
    passage crosses a page break, and each page ends in a fragment of a leaf.  A document
    continues the run of pages before it when its metadata without ``page_keys`` is the
    run's (and not empty: something, such as ``source``, must name the source), and it is
    numbered one more than the previous page by the same key.  The joined document has the
    first page's id, its metadata without the page keys, and one
    :class:`~raptor_core.types.Segment` per page holding that page's page keys, so each
    leaf keeps the page it starts on; a blank page (its text only whitespace) is part of the
    run and adds nothing to the text.  A page joined with nothing, and anything that is
    not a page (no page number, a pre-split chunk, a document with segments already), is
    returned as given.  A page of LlamaIndex's ``PyMuPDFReader`` (``source`` a page number
    such as ``"3"``, beside ``total_pages`` and ``file_path``, and no other page key) is
    numbered by its ``source``.

    Returns:
        One :class:`Rejoined` per resulting document, in order; every given index appears
        in exactly one ``parts``.

    Examples:
        >>> from raptor_core.types import Document
        >>> pages = [Document(text="It rained.", doc_id="p0", metadata={"source": "a.pdf", "page": 0}),
        ...          Document(text="Then it snowed.", doc_id="p1", metadata={"source": "a.pdf", "page": 1})]
        >>> [joined] = join_pages(pages)
        >>> joined.document.text, joined.document.metadata, [s.metadata for s in joined.document.segments]
        ('It rained.\nThen it snowed.', {'source': 'a.pdf'}, [{'page': 0}, {'page': 1}])
    """
    keys = tuple(page_keys)
    runs: list[list[int]] = []
    keys_of = [_keys_of(doc, keys) for doc in documents]
    for index, doc in enumerate(documents):
        if runs and continues(documents[index - 1], doc, page_keys=keys):
            runs[-1].append(index)
        else:
            runs.append([index])
    out: list[Rejoined] = []
    for run in runs:
        # A blank page (a loader gives "" for it) belongs to the run but adds no text.
        written = [i for i in run if documents[i].text.strip()]
        if len(run) == 1 or not written:
            out.extend(Rejoined(document=documents[i], parts=(i,)) for i in run)
            continue
        segments, offset = [], 0
        for index in written:
            page = documents[index]
            page_keys_of = {k: page.metadata[k] for k in keys_of[index] if k in page.metadata}
            segments.append(Segment(start=offset, metadata=page_keys_of))
            offset += len(page.text) + len(separator)
        first = documents[run[0]]
        joined = dataclasses.replace(
            first,
            text=separator.join(documents[i].text for i in written),
            metadata={k: v for k, v in first.metadata.items() if k not in keys_of[run[0]]},
            segments=tuple(segments),
        )
        out.append(Rejoined(document=joined, parts=tuple(run)))
    return out
