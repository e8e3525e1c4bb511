"""Section headings: the context a leaf is embedded in (``TreeBuilder(section_context=True)``).

A ~100-token chunk of a paper's "Baselines" section, or of a web page's "Career" records, often
does not say what it is about: the heading above it does.  The builder embeds such a leaf twice,
alone and under its heading, and keeps the normalised mean of the two vectors, so the leaf is
found both by what it says and by the section it belongs to (its text is unchanged).

Headings are read from the document text in three forms, whatever the source:

* Markdown ATX headings (``# Results``, ``## 3.2 Ablations``), as converters write them;
* HTML headings (``<h2>Career</h2>``, any case, tags inside stripped);
* plain-text heading lines, as text extracted from PDFs and web pages has them: a line of one
  to ten words and at most 80 characters that starts with a capital or a digit, does not end
  like a sentence or a clause (``.!?:;,``, a closing quote or bracket), holds no ``": "`` (a
  meeting turn, a label) and is followed by a line of prose: at least twelve words (and at
  least twice its own) that does not start in lower case (hard-wrapped prose continues in
  lower case).

Stories and meeting transcripts have none of these and are embedded as before.

Tables are sections of their own kind: a chunk of table rows (``| Net income | 10,000 |``)
says nothing of what its columns are, the table's header row does.  A leaf that starts in the
body of a table is also embedded under that table's header row (after the section heading, if
any).  Tables are read in two forms: Markdown pipe tables (a header line, a ``|---|`` line,
then the rows) and HTML tables (the first ``<tr>`` whose cells are all ``<th>``).
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raptor_core.tree import Node
    from raptor_core.types import Document

__all__ = [
    "leaf_context",
    "leaf_headings",
    "leaf_table_headers",
    "section_headings",
    "table_headers",
]

# Tag patterns never match across a "<" and an element's closing tag is found by a search
# of its own (see _elements): a pattern like "<h2>(.*?)</h2>" rescans the rest of the text
# from every unclosed tag, and text like "<h2> " repeated takes minutes.
_MARKDOWN = re.compile(r"^[ \t]{0,3}#{1,6}[ \t]+(\S.*)$", re.MULTILINE)
_HTML_HEADING = re.compile(r"<h([1-6])(?:\s[^<>]*)?>", re.IGNORECASE)
_HTML_HEADING_END = re.compile(r"</h([1-6])\s*>", re.IGNORECASE)
_TAG = re.compile(r"<[^<>]*>")
_LINE = re.compile(r"[^\n\r]+")
_NOT_A_HEADING_END = frozenset(".!?:;,\"'”’)]»")
# Tables: a Markdown header line and its delimiter line; the rows that follow; HTML rows.
_PIPE_ROW = re.compile(r"^[ \t]*\|.*\|[ \t]*$")
_PIPE_DELIMITER = re.compile(
    r"^[ \t]*\|?[ \t]*:?-{3,}:?[ \t]*(?:\|[ \t]*:?-{3,}:?[ \t]*)+\|?[ \t]*$"
)
_HTML_TABLE = re.compile(r"<table\b[^<>]*>", re.IGNORECASE)
_HTML_TABLE_END = re.compile(r"</table\s*>", re.IGNORECASE)
_HTML_ROW = re.compile(r"<tr\b[^<>]*>", re.IGNORECASE)
_HTML_ROW_END = re.compile(r"</tr\s*>", re.IGNORECASE)
# Cell tags; "_" after the name: some extracted pages write attributes as <Th_colspan="2">.
_HTML_HEADER_CELL = re.compile(r"<th(?=[\s>_])", re.IGNORECASE)
_HTML_DATA_CELL = re.compile(r"<td(?=[\s>_])", re.IGNORECASE)
# A plain-text heading line: short, and followed by a line of prose.
_MAX_HEADING_WORDS = 10
_MAX_HEADING_CHARS = 80
_MIN_BODY_WORDS = 12


def _is_heading_line(line: str, following: str) -> bool:
    words = line.split()
    if not 1 <= len(words) <= _MAX_HEADING_WORDS or len(line) > _MAX_HEADING_CHARS:
        return False
    if line[-1] in _NOT_A_HEADING_END or ": " in line:
        return False
    if not (line[0].isupper() or line[0].isdigit()):
        return False
    if not following or following[0].islower():
        return False
    return len(following.split()) >= max(_MIN_BODY_WORDS, 2 * len(words))


def _elements(
    text: str,
    opening: re.Pattern[str],
    closing: re.Pattern[str],
    start: int = 0,
    end: int | None = None,
) -> list[tuple[re.Match[str], int, int]]:
    """Each opening tag of ``text[start:end]`` with the first closing tag after it.

    ``(opening match, closing start, closing end)``, paired as a lazy ``open(.*?)close``
    pattern pairs them (an element's content is never searched for another element; an
    opening tag never closed is skipped), in linear time.  When both patterns have a group
    (a heading's level), a closing tag only closes an opening tag with the same group.
    """
    end = len(text) if end is None else end
    closings: dict[str | None, tuple[list[int], list[int]]] = {}
    for close in closing.finditer(text, start, end):
        key = close.group(1) if closing.groups else None
        starts, ends = closings.setdefault(key, ([], []))
        starts.append(close.start())
        ends.append(close.end())
    found = []
    resume = start
    for match in opening.finditer(text, start, end):
        if match.start() < resume:
            continue  # inside the element found last
        starts, ends = closings.get(match.group(1) if closing.groups else None, ([], []))
        i = bisect.bisect_left(starts, match.end())
        if i < len(starts):
            found.append((match, starts[i], ends[i]))
            resume = ends[i]
    return found


def _markdown_heading(line: str) -> str:
    """An ATX heading's text without its optional closing sequence of ``#``."""
    heading = line.strip()
    bare = heading.rstrip("#")
    # "C#" keeps its "#"; so does a heading of only "#"s.
    return bare.rstrip() if bare and bare[-1] in " \t" else heading


def section_headings(text: str) -> list[tuple[int, str]]:
    """The headings of ``text``: ``(offset where the heading starts, heading text)``, in order.

    Examples:
        >>> text = "# Results" + chr(10) + "The model wins." + chr(10) + "<h2>Career</h2> Most points."
        >>> section_headings(text)
        [(0, 'Results'), (26, 'Career')]
    """
    found: list[tuple[int, str]] = []
    for match in _MARKDOWN.finditer(text):
        indent = len(match.group()) - len(match.group().lstrip())
        found.append((match.start() + indent, _markdown_heading(match.group(1))))
    for match, content_end, _ in _elements(text, _HTML_HEADING, _HTML_HEADING_END):
        heading = " ".join(_TAG.sub(" ", text[match.end() : content_end]).split())
        if heading:
            found.append((match.start(), heading))
    lines = [(m.start(), m.group()) for m in _LINE.finditer(text)]
    for (start, raw), (_, following) in itertools.pairwise(lines):
        line = raw.strip()
        if line and _is_heading_line(line, following.strip()):
            found.append((start + len(raw) - len(raw.lstrip()), line))
    found.sort()
    return found


def _pipe_tables(text: str) -> list[tuple[int, int, str]]:
    # Every line with its offsets, blank ones too: a blank line ends a table.
    lines = []
    offset = 0
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        lines.append((offset, offset + len(body), body))
        offset += len(line)
    found = []
    i = 0
    while i + 1 < len(lines):
        header = lines[i][2]
        if not (_PIPE_ROW.match(header) and _PIPE_DELIMITER.match(lines[i + 1][2])):
            i += 1
            continue
        body_start = lines[i + 1][1]
        j = i + 2
        while j < len(lines) and _PIPE_ROW.match(lines[j][2]):
            j += 1
        body_end = lines[j - 1][1]
        if j > i + 2:  # a table with rows
            cells = [c.strip() for c in header.strip().strip("|").split("|")]
            found.append((body_start, body_end, " | ".join(c for c in cells if c)))
        i = j
    return found


def _html_tables(text: str) -> list[tuple[int, int, str]]:
    found = []
    for table, content_end, table_end in _elements(text, _HTML_TABLE, _HTML_TABLE_END):
        rows = _elements(text, _HTML_ROW, _HTML_ROW_END, table.end(), content_end)
        for row, cells_end, row_end in rows:
            cells = text[row.end() : cells_end]
            if _HTML_HEADER_CELL.search(cells) and not _HTML_DATA_CELL.search(cells):
                header = " ".join(_TAG.sub(" ", cells).split())
                if header:
                    found.append((row_end, table_end, header))
                break
    return found


def table_headers(text: str) -> list[tuple[int, int, str]]:
    """The tables of ``text`` that have a header row: ``(body start, table end, header)``.

    The body starts after the header row (a Markdown table's delimiter line); the header is
    the row's cell texts (``"Item | 2023 | 2022"`` for Markdown, space-joined for HTML).

    Examples:
        >>> table_headers("| Item | 2023 |" + chr(10) + "|---|---|" + chr(10) + "| Net income | 9 |")
        [(25, 44, 'Item | 2023')]
    """
    return sorted(_pipe_tables(text) + _html_tables(text))


def leaf_table_headers(text: str, spans: Sequence[tuple[int, int]]) -> list[str | None]:
    """For each leaf span of ``text``, the header row of the table whose body it starts in.

    None where the leaf starts outside a table's body (a leaf that starts at or before the
    header row holds it already).
    """
    tables = table_headers(text)
    starts = [start for start, _, _ in tables]
    out: list[str | None] = []
    for start, _end in spans:
        t = bisect.bisect_right(starts, start) - 1
        out.append(tables[t][2] if t >= 0 and start < tables[t][1] else None)
    return out


def leaf_headings(text: str, spans: Sequence[tuple[int, int]]) -> list[str | None]:
    """For each leaf span of ``text``, the heading of the section it starts in.

    None where no heading precedes the leaf, or where the leaf starts with its heading (the
    context is in its own text already).
    """
    headings = section_headings(text)
    offsets = [offset for offset, _ in headings]
    out: list[str | None] = []
    for start, _end in spans:
        h = bisect.bisect_right(offsets, start) - 1
        # A leaf that starts with its heading (its markup included) holds it already.
        out.append(headings[h][1] if h >= 0 and offsets[h] < start else None)
    return out


def leaf_context(docs: Sequence[Document], leaves: Sequence[Node]) -> dict[str, str]:
    """Leaf id -> the text a leaf under a section heading or in a table is also embedded as.

    The section heading, then the table's header row, then the leaf's text, one per line.
    """
    texts = {doc.doc_id: doc.text for doc in docs if doc.chunk_of is None}
    by_doc: dict[str, list[Node]] = {}
    for leaf in leaves:
        if leaf.span is not None and leaf.doc_id in texts:
            by_doc.setdefault(leaf.doc_id, []).append(leaf)
    context: dict[str, str] = {}
    for doc_id, doc_leaves in by_doc.items():
        spans = [leaf.span for leaf in doc_leaves if leaf.span is not None]
        text = texts[doc_id]
        for leaf, heading, header in zip(
            doc_leaves, leaf_headings(text, spans), leaf_table_headers(text, spans), strict=True
        ):
            parts = [part for part in (heading, header) if part is not None]
            if parts:
                context[leaf.id] = "\n".join([*parts, leaf.text])
    return context
