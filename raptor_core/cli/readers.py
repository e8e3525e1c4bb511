"""Input files for ``raptor build``: one reader per file type, folders, filters, skip reports.

Supported: plain text and Markdown (``.txt .text .rst .md .markdown``), HTML (``.html .htm``,
text with headings kept as lines), PDF (``.pdf``, with ``pypdf``), Word (``.docx``, with
``python-docx``), and records: ``.jsonl`` (one JSON object a line) and ``.csv``/``.tsv`` (one
row a document), whose text is in the ``text_field`` column and whose other fields become
metadata.

A file the user *names* must be readable: anything wrong with it is an
:class:`~raptor_core.exceptions.InvalidInputError`.  A file *found in a folder* that cannot be
read (an unsupported type, binary bytes, not UTF-8, a PDF without text, a missing optional
package) is skipped and reported through ``on_skip`` with the reason, so one stray file does
not stop a build over a folder.  Bytes are never indexed as text: a NUL byte or invalid UTF-8
makes a file unreadable, never a document.
"""

from __future__ import annotations

import codecs
import csv
import fnmatch
import io
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from raptor_core.cli._common import check_unicode, os_advice, path_text
from raptor_core.exceptions import InvalidInputError, MissingDependencyError
from raptor_core.types import Document, Segment

__all__ = [
    "READERS",
    "RECORD_SUFFIXES",
    "TEXT_SUFFIXES",
    "SkipHandler",
    "html_to_text",
    "read_documents",
    "read_text",
]

TEXT_SUFFIXES = {".txt", ".text", ".rst", ".md", ".markdown"}
HTML_SUFFIXES = {".html", ".htm", ".xhtml"}
RECORD_SUFFIXES = {".jsonl", ".ndjson", ".csv", ".tsv"}

#: Called with (file, reason) for each file of a folder that is not read.
SkipHandler = Callable[[Path, str], None]

#: Our metadata keys on documents read from records; a user's field of the same name wins.
RECORD_FILE_KEY = "source_file"
RECORD_LINE_KEY = "source_line"


# -- text --------------------------------------------------------------------------------------
def read_text(path: Path) -> str:
    """The UTF-8 text of ``path``.

    Raises:
        InvalidInputError: a binary file or one that is not UTF-8.
    """
    return _decode(path.read_bytes(), path)


#: Byte-order marks of the UTF-16 and UTF-32 text some editors (Windows Notepad, Excel's
#: "Unicode text") write: such text is full of NUL bytes, so it is decoded before the
#: binary check.  UTF-32's marks start with UTF-16's: they are tried first.
_WIDE_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


def _decode(data: bytes, path: Path) -> str:
    for bom, encoding in _WIDE_BOMS:
        if data.startswith(bom):
            try:
                return data.decode(encoding)
            except UnicodeDecodeError as exc:
                msg = (
                    f"{path_text(path)} starts as {encoding.upper()} text but is not valid "
                    f"{encoding.upper()} (byte {exc.start}): convert it to UTF-8 first"
                )
                raise InvalidInputError(msg) from exc
    # A NUL byte never occurs in UTF-8 text but in nearly every binary format.
    if b"\x00" in data[:65536]:
        msg = f"{path_text(path)} is a binary file, not text"
        raise InvalidInputError(msg)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        msg = (
            f"{path_text(path)} is not valid UTF-8 text (byte {exc.start}): "
            "convert it to UTF-8 first"
        )
        raise InvalidInputError(msg) from exc


def _file_document(
    path: Path,
    text: str,
    extra: Mapping[str, Any] | None = None,
    segments: tuple[Segment, ...] = (),
) -> list[Document]:
    source = path_text(path)
    metadata = {"source": source, **(extra or {})}
    return [Document(text=text, doc_id=source, metadata=metadata, segments=segments)]


def _read_plain(path: Path, text_field: str) -> list[Document]:
    return _file_document(path, read_text(path))


# -- HTML --------------------------------------------------------------------------------------
_HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
# Elements that end a line of text; inline ones (a, b, span, ...) do not.
_BLOCKS = _HEADINGS | {
    "address", "article", "aside", "blockquote", "br", "dd", "details", "div", "dl", "dt",
    "figcaption", "figure", "footer", "header", "hr", "li", "main", "nav", "ol", "p", "pre",
    "section", "summary", "table", "td", "th", "tr", "ul",
}  # fmt: skip
# Never text: code, styling, and what a browser does not show.
_HIDDEN = {"script", "style", "noscript", "template", "svg", "head", "iframe", "object"}


class _TextExtractor(HTMLParser):
    """Collects visible text: one line per block, headings as ``# Heading`` lines."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.lines: list[str] = []
        self.current: list[str] = []
        self.hidden = 0  # depth inside _HIDDEN elements
        self.heading: int | None = None
        self.title: list[str] = []
        self.in_title = False

    def _flush(self) -> None:
        line = " ".join("".join(self.current).split())
        if line:
            prefix = "#" * self.heading + " " if self.heading else ""
            self.lines.append(prefix + line)
        self.current = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title":
            self.in_title = True
        if tag in _HIDDEN:
            self.hidden += 1
        elif tag in _BLOCKS:
            self._flush()
            if tag in _HEADINGS:
                self.heading = int(tag[1])

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _BLOCKS:  # <br/>, <hr/>
            self._flush()

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self.in_title = False
        if tag in _HIDDEN:
            self.hidden = max(0, self.hidden - 1)
        elif tag in _BLOCKS:
            self._flush()
            if tag in _HEADINGS:
                self.heading = None

    def handle_data(self, data: str) -> None:
        if self.in_title:
            self.title.append(data)
        elif not self.hidden:
            self.current.append(data)

    def text(self) -> str:
        self._flush()
        return "\n".join(self.lines)


def html_to_text(html: str) -> tuple[str, str | None]:
    r"""The visible text of an HTML page and its ``<title>`` (None if it has none).

    Scripts, styles and other hidden elements are dropped; each block element (paragraph,
    list item, table cell, ...) becomes a line and each heading a line starting with one
    ``#`` per level, so the chunker sees the page's structure.

    Examples:
        >>> html_to_text("<h2>Cats</h2><p>They <b>purr</b>.</p><script>x()</script>")
        ('## Cats\nThey purr.', None)
    """
    parser = _TextExtractor()
    parser.feed(html)
    parser.close()
    title = " ".join("".join(parser.title).split())
    return parser.text(), title or None


def _read_html(path: Path, text_field: str) -> list[Document]:
    text, title = html_to_text(read_text(path))
    return _file_document(path, text, {"title": title} if title else None)


# -- PDF and DOCX (optional packages) ------------------------------------------------------------
def _require(module: str, package: str) -> Any:
    from raptor_core._imports import require

    try:
        return require(module, extra="readers")
    except MissingDependencyError as exc:
        msg = (
            f"reading {package} files needs the {module!r} package: run "
            "`pip install 'raptor-retriever[readers]'`"
        )
        raise MissingDependencyError(msg) from exc


_EXTRACTED_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _read_pdf(path: Path, text_field: str) -> list[Document]:
    pypdf = _require("pypdf", ".pdf")
    from pypdf.errors import PdfReadError

    try:
        reader = pypdf.PdfReader(str(path))
        if reader.is_encrypted:
            msg = f"{path_text(path)} is an encrypted PDF: decrypt it first"
            raise InvalidInputError(msg)
        pages = [page.extract_text() or "" for page in reader.pages]
        labels = _page_labels(reader, len(pages))
    except (PdfReadError, ValueError, KeyError, TypeError) as exc:
        # pypdf raises assorted errors on damaged files; all mean "not a readable PDF".
        msg = f"{path_text(path)} is not a readable PDF: {exc}"
        raise InvalidInputError(msg) from exc
    # A blank line between pages keeps a paragraph from running across a page break.  Fonts
    # without a Unicode map extract as control characters: blanks, not text.
    kept = [(i, page.strip()) for i, page in enumerate(pages) if page.strip()]
    text = _EXTRACTED_CONTROL.sub(" ", "\n\n".join(page for _, page in kept))
    if not text.strip():
        msg = f"{path_text(path)} has no extractable text (a scanned PDF? run OCR on it first)"
        raise InvalidInputError(msg)
    check_unicode(text, path_text(path))
    # Each leaf keeps the page it starts on, numbered as LangChain's PDF loaders number
    # them: ``page`` from 0, ``page_label`` as printed (the PDF's own labels: "iv", "12").
    segments, at = [], 0
    for i, page in kept:
        segments.append(Segment(start=at, metadata={"page": i, "page_label": labels[i]}))
        at += len(page) + 2
    return _file_document(path, text, {"pages": len(pages)}, tuple(segments))


def _page_labels(reader: Any, count: int) -> list[str]:
    """The PDF's page labels, or "1", "2", ... when it has none it can give."""
    try:
        labels = [str(label) for label in reader.page_labels]
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        labels = []
    if len(labels) != count:
        labels = [str(i + 1) for i in range(count)]
    return labels


def _read_docx(path: Path, text_field: str) -> list[Document]:
    docx = _require("docx", ".docx")
    try:
        document = docx.Document(str(path))
    except Exception as exc:  # python-docx raises zipfile/KeyError/its own: all mean unreadable
        msg = f"{path_text(path)} is not a readable .docx file: {exc}"
        raise InvalidInputError(msg) from exc
    # Paragraphs and tables in document order (python-docx >= 1.0), else tables last.
    blocks = getattr(document, "iter_inner_content", None)
    lines: list[str] = []
    for block in blocks() if callable(blocks) else [*document.paragraphs, *document.tables]:
        if hasattr(block, "rows"):  # a table: one line per row
            for row in block.rows:
                cells: list[str] = []
                for cell in row.cells:
                    text = cell.text.strip()
                    # A merged cell is returned once per grid column it spans: keep it once.
                    if text and (not cells or cells[-1] != text):
                        cells.append(text)
                if cells:
                    lines.append(" | ".join(cells))
            continue
        text = block.text.strip()
        if not text:
            continue
        style = block.style.name if block.style is not None else ""
        match = re.fullmatch(r"Heading (\d)", style or "")
        lines.append("#" * int(match.group(1)) + " " + text if match else text)
    return _file_document(path, "\n".join(lines))


# -- records: JSONL and CSV ------------------------------------------------------------------------
def _record_document(
    record: dict[str, Any], path: Path, number: int, where: str, text_field: str
) -> Document:
    text = record.get(text_field)
    if not isinstance(text, str):
        fields = ", ".join(sorted(map(str, record))) or "none"
        msg = (
            f"{where} has no string {text_field!r} field (fields: {fields}): "
            "pass --text-field NAME to say which field holds the text"
        )
        raise InvalidInputError(msg)
    # JSON may escape a lone surrogate (a \ud800 escape): not text, and unwritable later.
    check_unicode(json.dumps(record, ensure_ascii=False), where)
    doc_id = record.get("doc_id", f"{path.stem}:{number}")
    if isinstance(doc_id, int) and not isinstance(doc_id, bool):
        doc_id = str(doc_id)  # numeric ids are common in exports; the tree's ids are strings
    if not isinstance(doc_id, str) or not doc_id:
        msg = (
            f"{where} has a doc_id that is not a non-empty string or integer "
            f"({json.dumps(doc_id)[:40]}): give the record a unique id, or leave doc_id out "
            f"to get {path.stem}:{number}"
        )
        raise InvalidInputError(msg)
    meta = {k: v for k, v in record.items() if k not in {text_field, "doc_id"} and _is_scalar(v)}
    # The user's own fields win: ours only fill keys the record does not have.
    meta.setdefault(RECORD_FILE_KEY, path_text(path))
    meta.setdefault(RECORD_LINE_KEY, number)
    return Document(text=text, doc_id=doc_id, metadata=meta)


def _read_jsonl(path: Path, text_field: str) -> list[Document]:
    source = path_text(path)
    docs = []
    for lineno, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:  # bad JSON, too deep, too many digits
            msg = f"{source}:{lineno} is not valid JSON: {type(exc).__name__}: {exc}"
            raise InvalidInputError(msg) from exc
        if not isinstance(record, dict):
            msg = f"{source}:{lineno} needs a JSON object with a string {text_field!r} field"
            raise InvalidInputError(msg)
        docs.append(_record_document(record, path, lineno, f"{source}:{lineno}", text_field))
    return docs


def _read_csv(path: Path, text_field: str) -> list[Document]:
    source = path_text(path)
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    # The csv module refuses cells over 128 KiB by default; a document may well be longer.
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    reader = csv.DictReader(io.StringIO(read_text(path), newline=""), delimiter=delimiter)
    try:
        return _csv_rows(reader, path, source, text_field)
    except csv.Error as exc:  # an unterminated quote, ...
        msg = f"{source}:{reader.line_num} is not valid CSV: {exc}"
        raise InvalidInputError(msg) from exc


def _csv_rows(
    reader: csv.DictReader[str], path: Path, source: str, text_field: str
) -> list[Document]:
    if reader.fieldnames is None or text_field not in reader.fieldnames:
        columns = ", ".join(reader.fieldnames or []) or "none"
        msg = (
            f"{source} has no {text_field!r} column (columns: {columns}): "
            "pass --text-field NAME to say which column holds the text"
        )
        raise InvalidInputError(msg)
    docs = []
    # Row numbers count the header as line 1, as a spreadsheet shows them.
    for number, row in enumerate(reader, 2):
        record = {k: v for k, v in row.items() if k is not None}  # None: extra cells
        if not (record.get(text_field) or "").strip():
            continue
        docs.append(_record_document(record, path, number, f"{source}:{number}", text_field))
    return docs


def _is_scalar(value: object) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


#: Suffix -> reader(path, text_field) -> documents.
READERS: dict[str, Callable[[Path, str], list[Document]]] = {
    **dict.fromkeys(TEXT_SUFFIXES, _read_plain),
    **dict.fromkeys(HTML_SUFFIXES, _read_html),
    ".pdf": _read_pdf,
    ".docx": _read_docx,
    ".jsonl": _read_jsonl,
    ".ndjson": _read_jsonl,
    ".csv": _read_csv,
    ".tsv": _read_csv,
}


# -- folders -----------------------------------------------------------------------------------
def _matches(relative: str, patterns: Sequence[str]) -> bool:
    # A pattern without "/" matches the file name at any depth (like .gitignore); one with
    # "/" matches the path relative to the folder.
    name = relative.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(relative if "/" in p else name, p) for p in patterns)


def _walk(folder: Path, *, hidden: bool) -> list[Path]:
    """Every file under ``folder``, sorted; hidden folders are not entered unless ``hidden``."""
    found: list[Path] = []
    for root, dirs, files in os.walk(folder):
        # Pruning here (not filtering afterwards) keeps a .git or .venv from being walked.
        dirs[:] = [d for d in dirs if hidden or not d.startswith(".")]
        found.extend(Path(root, name) for name in files)
    return sorted(found)


def _folder_files(
    folder: Path, include: Sequence[str], exclude: Sequence[str], on_skip: SkipHandler
) -> Iterator[Path]:
    # A --glob that names a hidden entry (".github/*") is the only way in.
    hidden_patterns = [p for p in include if any(part.startswith(".") for part in p.split("/"))]
    for path in _walk(folder, hidden=bool(hidden_patterns)):
        relative = path.relative_to(folder).as_posix()
        if not path.is_file() or _matches(relative, exclude):
            continue
        is_hidden = any(part.startswith(".") for part in path.relative_to(folder).parts)
        if include:
            # Files the patterns leave out were left out on purpose: not reported.  A hidden
            # file is read only when a pattern that names a hidden entry selects it:
            # "*.txt" does not name ".notes.txt", ".*.txt" does.
            if _matches(relative, hidden_patterns if is_hidden else include):
                yield path
            continue
        if is_hidden:
            continue  # .git, .venv, editor files: never the user's documents
        if path.suffix.lower() in READERS:
            yield path
        else:
            on_skip(path, f"unsupported file type {path.suffix or '(no suffix)'!r}")


def read_documents(
    paths: Sequence[str],
    *,
    text_field: str = "text",
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    on_skip: SkipHandler | None = None,
) -> list[Document]:
    """Read files and folders into documents (see the module docstring for the types).

    Args:
        paths: files and folders; folders are searched recursively, hidden entries left out.
        text_field: the field (``.jsonl``) or column (``.csv``/``.tsv``) holding the text;
            the record's other scalar fields become the document's metadata, its ``doc_id``
            field the document id.
        include: in folders, read only files matching one of these glob patterns (a file
            of an unknown type that a pattern selects is read as UTF-8 text).
        exclude: in folders, leave out files matching one of these glob patterns.
        on_skip: called with ``(path, reason)`` for each file of a folder that is not read.

    Raises:
        InvalidInputError: a missing path, a named file that cannot be read (binary, not
            UTF-8, a malformed record, a PDF without text), or no documents at all.
        MissingDependencyError: a named ``.pdf``/``.docx`` file without its package.
    """
    skip = on_skip or (lambda path, reason: None)
    docs: list[Document] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = 0
            for file in _folder_files(path, include, exclude, skip):
                try:
                    docs.extend(_read_file(file, text_field))
                    found += 1
                except (InvalidInputError, MissingDependencyError) as exc:
                    # The messages start with the file's name, which the report shows already.
                    reason = str(exc).removeprefix(path_text(file)).lstrip(" :")
                    skip(file, reason)
                except OSError as exc:  # permission denied, an I/O error: the rest goes on
                    skip(file, os_advice(exc))
            if not found:
                msg = f"{path_text(path)} holds no file that could be read"
                raise InvalidInputError(msg)
        elif path.is_file():
            try:
                docs.extend(_read_file(path, text_field))
            except OSError as exc:
                # A file the user named: their input is wrong (exit status 2), not the work.
                msg = f"{path_text(path)} cannot be read: {os_advice(exc)}"
                raise InvalidInputError(msg) from exc
        else:
            msg = f"{path_text(path)} does not exist"
            raise InvalidInputError(msg)
    _check_unique_ids(docs)
    return docs


def _check_unique_ids(docs: Sequence[Document]) -> None:
    """Two inputs giving one document id, named by where they came from.

    The builder refuses duplicates too, but knows nothing of files: records of two files with
    the same name in different folders (``a/notes.jsonl`` and ``b/notes.jsonl``) get the
    same default ids.
    """
    seen: dict[str, Document] = {}
    for doc in docs:
        first = seen.setdefault(doc.doc_id, doc)
        if first is doc:
            continue
        where = [
            str(d.metadata.get(RECORD_FILE_KEY) or d.metadata.get("source") or "?")
            for d in (first, doc)
        ]
        if where[0] == where[1]:
            msg = (
                f"{where[0]} is read twice (named twice, or inside two folders given): name "
                "each file once"
            )
        else:
            msg = (
                f"{where[0]} and {where[1]} both give the document id {doc.doc_id!r}: give "
                "the records a doc_id field, or build the two files separately"
            )
        raise InvalidInputError(msg)


def _read_file(path: Path, text_field: str) -> list[Document]:
    # An unknown suffix on a file the user chose (by name or --glob) is read as plain text.
    reader = READERS.get(path.suffix.lower(), _read_plain)
    docs = reader(path, text_field)
    if not any(doc.text.strip() for doc in docs):
        msg = f"{path_text(path)} holds no text"
        raise InvalidInputError(msg)
    return docs
