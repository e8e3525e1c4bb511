"""Tiny real input files for the ``raptor build`` tests, made with the libraries that read them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def make_pdf(path: Path, pages: list[list[str]]) -> Path:
    """A real PDF whose pages show ``pages`` (lines of Helvetica text), written with pypdf."""
    pypdf = pytest.importorskip("pypdf")
    from pypdf.generic import DecodedStreamObject, DictionaryObject, NameObject

    writer = pypdf.PdfWriter()
    for lines in pages:
        page = writer.add_blank_page(width=612, height=792)
        font = DictionaryObject(
            {
                NameObject("/Type"): NameObject("/Font"),
                NameObject("/Subtype"): NameObject("/Type1"),
                NameObject("/BaseFont"): NameObject("/Helvetica"),
            }
        )
        page[NameObject("/Resources")] = DictionaryObject(
            {NameObject("/Font"): DictionaryObject({NameObject("/F1"): font})}
        )
        ops = ["BT", "/F1 12 Tf", "72 720 Td", "14 TL"]
        for line in lines:
            escaped = line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
            ops.append(f"({escaped}) Tj T*")
        ops.append("ET")
        stream = DecodedStreamObject()
        stream.set_data("\n".join(ops).encode("latin-1"))
        page.replace_contents(stream)
    with path.open("wb") as handle:
        writer.write(handle)
    return path


def read_pdf_pages_with_llamaindex(paths: list[Path], *, pymupdf: bool = False) -> list[Any]:
    """LlamaIndex documents of PDFs' pages, as ``SimpleDirectoryReader`` reads a folder of PDFs.

    The reader returns what llama-index-readers-file's ``PDFReader`` returns: one ``Document``
    per page, its ``page_label`` and the file's metadata; with ``pymupdf``, what its
    ``PyMuPDFReader`` returns: the page number in ``source`` (from "1"), ``total_pages`` and
    ``file_path``.  (That package pins an older pypdf and pandas than this project's other
    dependencies, and PyMuPDF is not installed, so the reader is written here.)
    """
    pypdf = pytest.importorskip("pypdf")
    from llama_index.core import Document, SimpleDirectoryReader
    from llama_index.core.readers.base import BaseReader

    class PageReader(BaseReader):
        def load_data(self, file: Path, extra_info: dict[str, Any] | None = None) -> list[Any]:
            pdf = pypdf.PdfReader(file)
            pages = []
            for i, page in enumerate(pdf.pages):
                if pymupdf:
                    numbered = {"total_pages": len(pdf.pages), "file_path": str(file)}
                    metadata = {**(extra_info or {}), **numbered, "source": f"{i + 1}"}
                else:
                    metadata = {
                        "page_label": pdf.page_labels[i],
                        "file_name": file.name,
                        **(extra_info or {}),
                    }
                pages.append(Document(text=page.extract_text(), metadata=metadata))
            return pages

    reader = SimpleDirectoryReader(
        input_files=paths, file_extractor={".pdf": PageReader()}, filename_as_id=True
    )
    return reader.load_data()


def make_docx(path: Path) -> Path:
    docx = pytest.importorskip("docx")
    document = docx.Document()
    document.add_heading("Otters", level=1)
    document.add_paragraph("Otters hold hands while they sleep so they do not drift apart.")
    table = document.add_table(rows=1, cols=3)
    table.cell(0, 0).text = "habitat"
    table.cell(0, 1).merge(table.cell(0, 2)).text = "kelp forests"
    document.add_paragraph("Sea otters use rocks as tools.")
    document.save(str(path))
    return path


HTML = """<!doctype html><html><head><title>Bees &amp; hives</title>
<style>body { color: red }</style><script>var secret = "do not index";</script></head>
<body><nav>Home</nav><h1>Bees</h1><p>Bees <b>dance</b> to show where flowers are.</p>
<h2>Hives</h2><ul><li>wax</li><li>honey</li></ul><noscript>enable js</noscript></body></html>"""
