"""Input files for ``raptor build``: text and markdown files, folders of them, ``.jsonl``."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from raptor_core.cli._common import check_unicode, path_text
from raptor_core.exceptions import InvalidInputError
from raptor_core.types import Document

__all__ = ["TEXT_SUFFIXES", "read_documents", "read_text"]

TEXT_SUFFIXES = {".txt", ".md", ".markdown", ".rst", ".text"}


def _iter_files(paths: Sequence[str]) -> Iterator[Path]:
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES | {".jsonl"}
            )
            if not found:
                msg = f"{path} contains no .txt, .md, .rst or .jsonl files"
                raise InvalidInputError(msg)
            yield from found
        elif path.is_file():
            yield path
        else:
            msg = f"{path} does not exist"
            raise InvalidInputError(msg)


def read_text(path: Path) -> str:
    """The UTF-8 text of ``path``.

    Raises:
        InvalidInputError: a binary file or one that is not UTF-8.
    """
    data = path.read_bytes()
    if b"\x00" in data[:65536]:
        msg = f"{path} is a binary file, not text"
        raise InvalidInputError(msg)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        msg = f"{path} is not valid UTF-8 text (byte {exc.start}): convert it to UTF-8 first"
        raise InvalidInputError(msg) from exc


def read_documents(paths: Sequence[str]) -> list[Document]:
    """Read text/markdown files, folders of them, and ``.jsonl`` files with ``doc_id``/``text``.

    Raises:
        InvalidInputError: a missing, binary or non-UTF-8 file, a malformed ``.jsonl`` line,
            or text that is not valid Unicode (an escaped lone surrogate in JSON).
    """
    docs: list[Document] = []
    for path in _iter_files(paths):
        source = path_text(path)
        if path.suffix.lower() == ".jsonl":
            for lineno, line in enumerate(read_text(path).splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    msg = f"{source}:{lineno} is not valid JSON: {exc}"
                    raise InvalidInputError(msg) from exc
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    msg = f"{source}:{lineno} needs a JSON object with a string 'text' field"
                    raise InvalidInputError(msg)
                # JSON may escape a lone surrogate (a \ud800 escape): not text, and unwritable later.
                check_unicode(json.dumps(record, ensure_ascii=False), f"{source}:{lineno}")
                doc_id = str(record.get("doc_id", f"{path.stem}:{lineno}"))
                meta = {
                    k: v for k, v in record.items() if k not in {"text", "doc_id"} and _is_scalar(v)
                }
                meta["source"] = source
                docs.append(Document(text=record["text"], doc_id=doc_id, metadata=meta))
        else:
            docs.append(Document(text=read_text(path), doc_id=source, metadata={"source": source}))
    return docs


def _is_scalar(value: object) -> bool:
    return value is None or isinstance(value, str | int | float | bool)
