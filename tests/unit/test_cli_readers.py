"""``raptor build`` inputs read in-process: every file type, folders, filters, skip reports.

The same inputs go through the installed ``raptor`` command in
tests/integration/test_cli_inputs.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from input_files import HTML, make_docx, make_pdf

from raptor_core.cli.readers import html_to_text, read_documents
from raptor_core.exceptions import InvalidInputError, MissingDependencyError


# -- each type -------------------------------------------------------------------------------------
def test_html_keeps_headings_and_drops_scripts() -> None:
    text, title = html_to_text(HTML)
    assert title == "Bees & hives"
    assert text.splitlines() == [
        "Home",
        "# Bees",
        "Bees dance to show where flowers are.",
        "## Hives",
        "wax",
        "honey",
    ]
    assert "secret" not in text and "color" not in text and "enable js" not in text


def test_pdf_text_and_page_count(tmp_path: Path) -> None:
    pdf = make_pdf(tmp_path / "v.pdf", [["Volcanoes erupt lava (hot)."], ["Page two."]])
    [doc] = read_documents([str(pdf)])
    assert doc.text == "Volcanoes erupt lava (hot).\n\nPage two."
    assert doc.metadata == {"source": str(pdf), "pages": 2}
    assert "%PDF" not in doc.text
    # Each page is a segment: the leaves of a build keep the page they start on.
    assert [(s.start, s.metadata) for s in doc.segments] == [
        (0, {"page": 0, "page_label": "1"}),
        (doc.text.index("Page two."), {"page": 1, "page_label": "2"}),
    ]


def test_pdf_leaves_keep_their_page(tmp_path: Path) -> None:
    from raptor_core import TreeBuilder
    from raptor_core.testing import (
        EchoSummarizer,
        FakeEmbedder,
        GroupClusterer,
        WhitespaceTokenizer,
    )

    lines = [f"Volcano {i} erupted in the year {1800 + i} with ash." for i in range(8)]
    pdf = make_pdf(tmp_path / "v.pdf", [lines[:4], [], lines[4:]])  # page 2 is blank
    [doc] = read_documents([str(pdf)])
    builder = TreeBuilder(
        FakeEmbedder(),
        EchoSummarizer(),
        tokenizer=WhitespaceTokenizer(),
        clusterer=GroupClusterer(2),
        chunk_max_tokens=10,
        random_state=0,
    )
    tree = builder.build([doc])
    pages = {leaf.text.split()[1]: leaf.metadata["page_label"] for leaf in tree.leaves}
    assert pages == {str(i): ("1" if i < 4 else "3") for i in range(8)}


def test_pdf_without_text_is_refused(tmp_path: Path) -> None:
    pdf = make_pdf(tmp_path / "scan.pdf", [[]])
    with pytest.raises(InvalidInputError, match="no extractable text"):
        read_documents([str(pdf)])
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(b"%PDF-1.4\nnot really a pdf")
    with pytest.raises(InvalidInputError, match="not a readable PDF"):
        read_documents([str(broken)])


def test_docx_headings_paragraphs_tables(tmp_path: Path) -> None:
    path = make_docx(tmp_path / "otters.docx")
    [doc] = read_documents([str(path)])
    assert doc.text.splitlines() == [
        "# Otters",
        "Otters hold hands while they sleep so they do not drift apart.",
        "habitat | kelp forests",
        "Sea otters use rocks as tools.",
    ]


@pytest.mark.parametrize(("module", "suffix"), [("pypdf", ".pdf"), ("docx", ".docx")])
def test_missing_reader_package_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, suffix: str
) -> None:
    path = tmp_path / f"file{suffix}"
    path.write_bytes(b"whatever")
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(MissingDependencyError, match=r"raptor-retriever\[readers\]"):
        read_documents([str(path)])


def test_jsonl_keeps_the_users_source_and_metadata(tmp_path: Path) -> None:
    path = tmp_path / "notes.jsonl"
    path.write_text(
        '{"doc_id": "n1", "body": "Cats purr.", "source": "crm", "stars": 4, "tags": ["x"]}\n'
        "\n"
        '{"body": "Dogs bark.", "source_file": "theirs"}\n'
    )
    first, second = read_documents([str(path)], text_field="body")
    assert (first.doc_id, first.text) == ("n1", "Cats purr.")
    # The user's "source" stays theirs; where we read it from goes under other keys.
    assert first.metadata == {
        "source": "crm",
        "stars": 4,
        "source_file": str(path),
        "source_line": 1,
    }
    assert second.doc_id == "notes:3"
    assert second.metadata == {"source_file": "theirs", "source_line": 3}


def test_jsonl_without_the_text_field_lists_the_fields(tmp_path: Path) -> None:
    path = tmp_path / "notes.jsonl"
    path.write_text('{"doc_id": "n1", "body": "Cats purr."}\n')
    with pytest.raises(
        InvalidInputError, match=r"notes.jsonl:1 has no string 'text'.*body, doc_id.*--text-field"
    ):
        read_documents([str(path)])


def test_csv_and_tsv_rows(tmp_path: Path) -> None:
    csv_path = tmp_path / "faq.csv"
    csv_path.write_text(
        'doc_id,question,answer,source\nq1,Why?,"Because, of course.",manual\nq2,How?,,web\n'
    )
    [doc] = read_documents([str(csv_path)], text_field="answer")  # the empty row is left out
    assert (doc.doc_id, doc.text) == ("q1", "Because, of course.")
    assert doc.metadata == {
        "question": "Why?",
        "source": "manual",
        "source_file": str(csv_path),
        "source_line": 2,
    }
    with pytest.raises(
        InvalidInputError, match=r"no 'text' column \(columns: doc_id, question, answer, source\)"
    ):
        read_documents([str(csv_path)])
    tsv = tmp_path / "rows.tsv"
    tsv.write_text("text\tlang\nHallo Welt\tde\n")
    [row] = read_documents([str(tsv)])
    assert (row.text, row.metadata["lang"], row.doc_id) == ("Hallo Welt", "de", "rows:2")


# -- folders ---------------------------------------------------------------------------------------
def make_folder(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "a.md").write_text("# A\nMarkdown text about apples.")
    (root / "sub" / "b.txt").write_text("Plain text about bananas.")
    (root / "sub" / "page.html").write_text(HTML)
    (root / "notes.log").write_text("a log line")
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (root / "fake.txt").write_bytes(b"\x00\x01binary under a text name")
    (root / "latin1.md").write_bytes("Größe".encode("latin-1"))
    (root / "empty.txt").write_text("   \n")
    (root / ".git" / "config").write_text("[core]")
    return root


def test_folder_skips_with_reasons(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "docs")
    skipped: list[tuple[str, str]] = []
    docs = read_documents([str(folder)], on_skip=lambda p, why: skipped.append((p.name, why)))
    assert sorted(d.doc_id for d in docs) == sorted(
        str(folder / p) for p in ("a.md", "sub/b.txt", "sub/page.html")
    )
    reasons = dict(skipped)
    assert set(reasons) == {"notes.log", "image.png", "fake.txt", "latin1.md", "empty.txt"}
    assert reasons["notes.log"] == "unsupported file type '.log'"
    assert reasons["fake.txt"] == "is a binary file, not text"
    assert reasons["latin1.md"].startswith("is not valid UTF-8 text")
    assert reasons["empty.txt"] == "holds no text"
    html = next(d for d in docs if d.doc_id.endswith("page.html"))
    assert html.metadata["title"] == "Bees & hives" and "# Bees" in html.text


def test_glob_and_exclude(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "docs")
    skipped: list[Path] = []

    def ids(**kw: object) -> list[str]:
        docs = read_documents([str(folder)], on_skip=lambda p, why: skipped.append(p), **kw)  # type: ignore[arg-type]
        return sorted(Path(d.doc_id).relative_to(folder).as_posix() for d in docs)

    assert ids(include=["*.md"]) == ["a.md"]  # latin1.md is selected, then skipped
    assert [p.name for p in skipped] == ["latin1.md"]
    assert ids(include=["sub/*"]) == ["sub/b.txt", "sub/page.html"]
    # A --glob selecting an unknown type reads it as text.
    assert ids(include=["*.log", "*.txt"], exclude=["fake.txt", "empty.txt"]) == [
        "notes.log",
        "sub/b.txt",
    ]
    assert ids(exclude=["sub/*", "*.png", "*.log"]) == ["a.md"]
    with pytest.raises(InvalidInputError, match="holds no file that could be read"):
        ids(exclude=["sub/*", "a.md"])


def test_hidden_entries_are_left_out_unless_a_glob_names_them(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    (folder / ".hidden").mkdir(parents=True)
    (folder / ".hidden" / "x.md").write_text("hidden text")
    (folder / "y.md").write_text("visible text")
    assert [d.text for d in read_documents([str(folder)])] == ["visible text"]
    got = read_documents([str(folder)], include=[".hidden/*"])
    assert [d.text for d in got] == ["hidden text"]


def test_named_files_fail_loudly(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "docs")
    with pytest.raises(InvalidInputError, match="binary"):
        read_documents([str(folder / "fake.txt")])
    # A named file of an unknown type is read as text.
    assert read_documents([str(folder / "notes.log")])[0].text == "a log line"
    with pytest.raises(InvalidInputError, match="binary"):
        read_documents([str(folder / "image.png")])


def test_pdf_control_characters_become_blanks(tmp_path: Path) -> None:
    # A font without a Unicode map extracts as control characters; they are never text.
    pdf = make_pdf(tmp_path / "odd.pdf", [["Bell\x07\x01 rings twice."]])
    [doc] = read_documents([str(pdf)])
    assert doc.text == "Bell   rings twice."


def test_long_csv_cells(tmp_path: Path) -> None:
    path = tmp_path / "long.csv"
    long_text = "word " * 60_000  # 300 kB: over the csv module's default cell limit
    path.write_text(f'text\n"{long_text}"\n')
    [doc] = read_documents([str(path)])
    assert doc.text == long_text


def test_hidden_folders_are_not_walked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "docs"
    (folder / ".venv" / "lib").mkdir(parents=True)
    (folder / ".venv" / "lib" / "x.txt").write_text("never read")
    (folder / "a.txt").write_text("read me")
    walked: list[str] = []
    real_walk = os.walk

    def spy(top: Any, *args: Any, **kwargs: Any) -> Any:
        for root, dirs, files in real_walk(top, *args, **kwargs):
            walked.append(Path(root).name)
            yield root, dirs, files

    monkeypatch.setattr(os, "walk", spy)
    assert [d.text for d in read_documents([str(folder)])] == ["read me"]
    assert walked == ["docs"]  # .venv was pruned, not entered


# -- the end-to-end audit's cases ---------------------------------------------------------------
def test_a_folder_file_the_system_refuses_is_skipped_and_the_rest_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "ok.txt").write_text("readable text")
    (folder / "secret.txt").write_text("never read")
    read_bytes = Path.read_bytes

    def refuse(path: Path) -> bytes:  # chmod 000 does not stop root: refuse by hand
        if path.name == "secret.txt":
            raise PermissionError(13, "Permission denied", str(path))
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", refuse)
    skipped: list[tuple[str, str]] = []
    docs = read_documents([str(folder)], on_skip=lambda p, why: skipped.append((p.name, why)))
    assert [d.text for d in docs] == ["readable text"]
    assert skipped == [
        ("secret.txt", "permission denied: check the permissions or use another path")
    ]
    # Named, the same file is the user's input error (exit status 2), naming the file.
    with pytest.raises(InvalidInputError, match=r"secret\.txt cannot be read: permission denied"):
        read_documents([str(folder / "secret.txt")])


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_wide_unicode_text_with_a_byte_order_mark_is_text(tmp_path: Path, encoding: str) -> None:
    path = tmp_path / "notes.txt"
    bom = {"utf-16-be": b"\xfe\xff"}.get(encoding, b"")
    path.write_bytes(bom + "Caf\u00e9 notes, line one.\nLine two.".encode(encoding))
    [doc] = read_documents([str(path)])
    assert doc.text == "Caf\u00e9 notes, line one.\nLine two."


def test_utf16_without_its_bom_is_still_binary(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes("plain words".encode("utf-16-le"))  # NUL bytes and no mark
    with pytest.raises(InvalidInputError, match="binary"):
        read_documents([str(path)])


def test_a_glob_reads_hidden_files_only_when_it_names_them(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / ".draft.txt").write_text("hidden draft")
    (folder / "final.txt").write_text("final text")
    assert [d.text for d in read_documents([str(folder)], include=["*.txt"])] == ["final text"]
    got = read_documents([str(folder)], include=["*.txt", ".*.txt"])
    assert sorted(d.text for d in got) == ["final text", "hidden draft"]


@pytest.mark.parametrize("value", ["null", '""', "[1]", "true", "1.5"])
def test_a_record_doc_id_must_be_a_string_or_an_integer(tmp_path: Path, value: str) -> None:
    path = tmp_path / "notes.jsonl"
    path.write_text('{"text": "fine"}\n{"doc_id": %s, "text": "Gamma."}\n' % value)  # noqa: UP031
    with pytest.raises(InvalidInputError, match=r"notes\.jsonl:2 has a doc_id that is not"):
        read_documents([str(path)])


def test_an_integer_record_id_is_written_as_a_string(tmp_path: Path) -> None:
    path = tmp_path / "notes.jsonl"
    path.write_text('{"doc_id": 7, "text": "Seven."}\n')
    assert [d.doc_id for d in read_documents([str(path)])] == ["7"]


def test_two_files_giving_one_id_are_named(tmp_path: Path) -> None:
    for folder in ("r1", "r2"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "notes.jsonl").write_text('{"text": "Alpha."}\n')
    with pytest.raises(InvalidInputError, match=r"r1/notes\.jsonl and .*r2/notes\.jsonl both"):
        read_documents([str(tmp_path / "r1"), str(tmp_path / "r2")])


def test_a_file_named_twice_is_said_so(tmp_path: Path) -> None:
    path = tmp_path / "bees.txt"
    path.write_text("Bees dance.")
    with pytest.raises(InvalidInputError, match=r"bees\.txt is read twice"):
        read_documents([str(path), str(path)])
