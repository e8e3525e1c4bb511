"""Evaluation data: documents and questions in the JSONL format of ``shared/data/README.md``.

Documents: one JSON object per line with ``doc_id`` and ``text`` (other fields become
metadata).  Questions: ``doc_id``, ``question``, and any of ``answers``, ``evidence``,
``evidence_sections`` (FairytaleQA: section numbers from 1), ``evidence_turn_spans``
(QMSum: inclusive ``[first, last]`` turn ranges, turns = lines numbered from 0) and
``options`` with ``gold_option`` (QuALITY: multiple choice, the gold option's index from 0).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from raptor_core.evaluation.metrics import section_texts, turn_texts
from raptor_core.exceptions import InvalidInputError
from raptor_core.types import Document

__all__ = [
    "HOLDOUT_SPLITS",
    "Question",
    "gold_units",
    "holdout_split",
    "load_documents",
    "load_questions",
    "select",
]

#: The two halves of :func:`holdout_split`.
HOLDOUT_SPLITS = ("dev", "held-out")


@dataclass(frozen=True, slots=True, kw_only=True)
class Question:
    """One evaluation question and its gold signals.

    Attributes:
        doc_id: the document the question is about.
        question_id: unique id (``<doc_id>:q<n>`` when the file has none).
        question: the question text.
        answers: gold answer strings (scored by answer-string recall).
        evidence: gold evidence passages, document text (scored by evidence recall).
        evidence_sections: gold section numbers, from 1 (scored by span recall).
        evidence_turn_spans: gold inclusive turn ranges, from 0 (span recall and precision).
        options: the answer options of a multiple-choice question (scored by a reader's
            choice accuracy, see :mod:`~raptor_core.evaluation.readers`).
        gold_option: the index of the correct option, from 0 (None: not multiple choice).
    """

    doc_id: str
    question_id: str
    question: str
    answers: tuple[str, ...] = ()
    evidence: tuple[str, ...] = ()
    evidence_sections: tuple[int, ...] = ()
    evidence_turn_spans: tuple[tuple[int, int], ...] = ()
    options: tuple[str, ...] = ()
    gold_option: int | None = None


def _records(path: str | os.PathLike[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, record)`` for every non-blank line of a JSONL file."""
    file = Path(path)
    if not file.is_file():
        msg = f"{file} does not exist or is not a file"
        raise InvalidInputError(msg)
    with file.open("rb") as handle:
        for lineno, raw in enumerate(handle, 1):
            where = f"{file}:{lineno}"
            try:
                # Decoded line by line, so that a file in another encoding is reported
                # where it goes wrong (a text-mode read fails somewhere inside the loop).
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                msg = f"{where} is not valid UTF-8 (byte {exc.start}): convert the file to UTF-8"
                raise InvalidInputError(msg) from exc
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as exc:  # bad JSON, too deep, too many digits
                msg = f"{where} is not valid JSON: {type(exc).__name__}: {exc}"
                raise InvalidInputError(msg) from exc
            if not isinstance(record, dict):
                msg = f"{where} must be a JSON object, got {type(record).__name__}"
                raise InvalidInputError(msg)
            yield where, record


def _string(where: str, record: Mapping[str, Any], key: str) -> str:
    value = record.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and key == "doc_id":
        return str(value)
    if not isinstance(value, str) or not value.strip():
        msg = f"{where}: {key!r} must be a non-empty string, got {value!r:.60}"
        raise InvalidInputError(msg)
    return value


def _strings(where: str, record: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = record.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        msg = f"{where}: {key!r} must be a list of strings, got {value!r:.60}"
        raise InvalidInputError(msg)
    return tuple(value)


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def load_documents(path: str | os.PathLike[str]) -> list[Document]:
    """Read documents (``doc_id``, ``text``; other scalar fields become metadata).

    A line that repeats an earlier document exactly is skipped.

    Raises:
        InvalidInputError: the file is missing, a line is not a JSON object, a field is
            missing or empty, or two different texts share a ``doc_id``.
    """
    docs: list[Document] = []
    seen: dict[str, str] = {}
    for where, record in _records(path):
        doc_id = _string(where, record, "doc_id")
        text = _string(where, record, "text")
        if doc_id in seen:
            if seen[doc_id] == text:
                continue  # the same document listed twice (QASPER's file has three)
            msg = f"{where}: doc_id {doc_id!r} was already used for a different text"
            raise InvalidInputError(msg)
        seen[doc_id] = text
        meta = {
            k: v
            for k, v in record.items()
            if k not in {"doc_id", "text"}
            and (v is None or isinstance(v, str | int | float | bool))
        }
        docs.append(Document(text=text, doc_id=doc_id, metadata=meta))
    if not docs:
        msg = f"{path} holds no documents"
        raise InvalidInputError(msg)
    return docs


def _question(where: str, record: Mapping[str, Any], index: int) -> Question:
    doc_id = _string(where, record, "doc_id")
    sections = record.get("evidence_sections") or []
    if not isinstance(sections, list) or not all(_int(s) and s >= 1 for s in sections):
        msg = (
            f"{where}: 'evidence_sections' must be a list of section numbers >= 1, "
            f"got {sections!r:.60}"
        )
        raise InvalidInputError(msg)
    spans = record.get("evidence_turn_spans") or []
    ok = isinstance(spans, list) and all(
        isinstance(s, list) and len(s) == 2 and _int(s[0]) and _int(s[1]) and 0 <= s[0] <= s[1]
        for s in spans
    )
    if not ok:
        msg = (
            f"{where}: 'evidence_turn_spans' must be a list of [first, last] turn numbers "
            f"(0 <= first <= last), got {spans!r:.60}"
        )
        raise InvalidInputError(msg)
    options = _strings(where, record, "options")
    gold = record.get("gold_option")
    if gold is not None and not (_int(gold) and 0 <= gold < len(options)):
        msg = (
            f"{where}: 'gold_option' must be the index of one of the {len(options)} 'options' "
            f"(from 0) or null, got {gold!r:.60}"
        )
        raise InvalidInputError(msg)
    if gold is not None and (len(options) < 2 or any(not o.strip() for o in options)):
        msg = f"{where}: a multiple-choice question needs at least two non-empty 'options'"
        raise InvalidInputError(msg)
    qid = record.get("question_id")
    return Question(
        doc_id=doc_id,
        question_id=str(qid) if qid is not None else f"{doc_id}:q{index}",
        question=_string(where, record, "question"),
        answers=_strings(where, record, "answers"),
        evidence=_strings(where, record, "evidence"),
        evidence_sections=tuple(sections),
        evidence_turn_spans=tuple((int(a), int(b)) for a, b in spans),
        options=options if gold is not None else (),
        gold_option=gold,
    )


def load_questions(
    path: str | os.PathLike[str], documents: Sequence[Document] | None = None
) -> list[Question]:
    """Read questions; with ``documents``, check that every question's gold fits its document.

    Lines that share a ``question_id`` (and document and question text) are annotations of
    one question: their answers and gold evidence are merged.

    Raises:
        InvalidInputError: the file is missing or malformed, a question names an unknown
            document, a section or turn number is out of range, or an id repeats.
    """
    questions: dict[str, Question] = {}
    per_doc: dict[str, int] = {}
    for where, record in _records(path):
        doc_id = str(record.get("doc_id"))
        per_doc[doc_id] = per_doc.get(doc_id, 0) + 1
        question = _question(where, record, per_doc[doc_id])
        first = questions.get(question.question_id)
        if first is None:
            questions[question.question_id] = question
            continue
        if (first.doc_id, first.question) != (question.doc_id, question.question):
            msg = f"{where}: question_id {question.question_id!r} is already another question's"
            raise InvalidInputError(msg)
        if (first.options, first.gold_option) != (question.options, question.gold_option):
            msg = (
                f"{where}: question_id {question.question_id!r} repeats with different "
                "'options' or 'gold_option': give each multiple-choice question one line"
            )
            raise InvalidInputError(msg)
        # Another annotation of the same question (QASPER lists some two or three times):
        # any annotator's answer counts, and all the gold evidence is kept.
        questions[question.question_id] = replace(
            first,
            answers=_union(first.answers, question.answers),
            evidence=_union(first.evidence, question.evidence),
            evidence_sections=_union(first.evidence_sections, question.evidence_sections),
            evidence_turn_spans=_union(first.evidence_turn_spans, question.evidence_turn_spans),
        )
    if not questions:
        msg = f"{path} holds no questions"
        raise InvalidInputError(msg)
    out = list(questions.values())
    if documents is not None:
        check_questions(out, documents)
    return out


def _union(first: tuple[Any, ...], second: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(dict.fromkeys((*first, *second)))


def check_questions(questions: Iterable[Question], documents: Sequence[Document]) -> None:
    """Raise InvalidInputError unless every question's document and gold spans exist."""
    by_id = {d.doc_id: d for d in documents}
    sizes: dict[str, tuple[int, int]] = {}
    for q in questions:
        doc = by_id.get(q.doc_id)
        if doc is None:
            known = ", ".join(sorted(by_id)[:5]) + (", ..." if len(by_id) > 5 else "")
            msg = (
                f"question {q.question_id!r} is about unknown doc_id {q.doc_id!r} (known: {known})"
            )
            raise InvalidInputError(msg)
        if not (q.evidence_sections or q.evidence_turn_spans):
            continue
        if q.doc_id not in sizes:
            sizes[q.doc_id] = (len(section_texts(doc.text)), len(turn_texts(doc.text)))
        n_sections, n_turns = sizes[q.doc_id]
        if any(s > n_sections for s in q.evidence_sections):
            msg = (
                f"question {q.question_id!r}: evidence_sections {list(q.evidence_sections)} but "
                f"document {q.doc_id!r} has {n_sections} blank-line-separated sections"
            )
            raise InvalidInputError(msg)
        if any(b >= n_turns for _, b in q.evidence_turn_spans):
            msg = (
                f"question {q.question_id!r}: evidence_turn_spans {list(q.evidence_turn_spans)} "
                f"but document {q.doc_id!r} has {n_turns} lines (turns 0..{n_turns - 1})"
            )
            raise InvalidInputError(msg)


def gold_units(question: Question, document_text: str) -> list[str]:
    """The texts of the question's gold sections and turns (empty when it has none)."""
    units: list[str] = []
    if question.evidence_sections:
        sections = section_texts(document_text)
        units += [sections[i - 1] for i in question.evidence_sections]
    if question.evidence_turn_spans:
        turns = turn_texts(document_text)
        for first, last in question.evidence_turn_spans:
            units += turns[first : last + 1]
    return units


def select(
    documents: Sequence[Document],
    questions: Sequence[Question],
    *,
    limit_docs: int | None = None,
    limit_questions: int | None = None,
) -> tuple[list[Document], list[Question]]:
    """Keep the documents that have questions, then apply the limits.

    ``limit_docs`` keeps the first documents (file order) that have questions;
    ``limit_questions`` keeps that many questions in all, taken round-robin over the kept
    documents so that a small run still covers every document.
    """
    asked = {q.doc_id for q in questions}
    docs = [d for d in documents if d.doc_id in asked]
    if limit_docs is not None:
        docs = docs[:limit_docs]
    kept = {d.doc_id for d in docs}
    by_doc: dict[str, list[Question]] = {}
    for q in questions:
        if q.doc_id in kept:
            by_doc.setdefault(q.doc_id, []).append(q)
    if limit_questions is None:
        chosen = [q for d in docs for q in by_doc.get(d.doc_id, [])]
    else:
        chosen = []
        depth = 0
        while len(chosen) < limit_questions and any(len(v) > depth for v in by_doc.values()):
            for d in docs:
                qs = by_doc.get(d.doc_id, [])
                if depth < len(qs) and len(chosen) < limit_questions:
                    chosen.append(qs[depth])
            depth += 1
        order = {q.question_id: i for i, q in enumerate(questions)}
        chosen.sort(key=lambda q: order[q.question_id])
    used = {q.doc_id for q in chosen}
    return [d for d in docs if d.doc_id in used], chosen


def holdout_split(doc_id: str) -> str:
    """``"dev"`` or ``"held-out"``: a fixed half of the documents, chosen by a hash of the id.

    Tune retrieval on the ``"dev"`` documents only and report the ``"held-out"`` ones
    separately: the split depends on nothing but the id, so it is the same in every run,
    for every subset of a data set, and for documents added later.

    Examples:
        >>> holdout_split("qasper_dev_1603.01514") in HOLDOUT_SPLITS
        True
    """
    return HOLDOUT_SPLITS[hashlib.sha256(doc_id.encode("utf-8")).digest()[0] % 2]
