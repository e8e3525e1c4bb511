"""``raptor eval`` on question files with little or no gold: stopped early, or told.

Run in-process through :func:`raptor_core.cli.main`; the sentence-transformers embedder is
replaced by the fake, so no model is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import raptor_core.backends.sentence_transformers as st_backend
from raptor_core.cli import EXIT_USAGE, main
from raptor_core.testing import FakeEmbedder

TEXT = "Cats purr in the warm sun. Kittens chase string across the floor. " * 20
EVIDENCE = "Kittens chase string across the floor."


def _files(tmp_path: Path, questions: list[dict[str, Any]]) -> list[str]:
    docs, qs = tmp_path / "docs.jsonl", tmp_path / "questions.jsonl"
    docs.write_text(json.dumps({"doc_id": "d1", "text": TEXT}) + "\n", encoding="utf-8")
    qs.write_text("".join(json.dumps(q) + "\n" for q in questions), encoding="utf-8")
    return [
        "eval",
        "--docs",
        str(docs),
        "--questions",
        str(qs),
        "--out",
        str(tmp_path / "out"),
        "--retrievers",
        "bm25",
        "--budgets",
        "40",
        "--no-plot",
    ]


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The embedder loads the run makes (each one is the start of building trees)."""
    loads: list[str] = []

    def fake(*args: Any, **kwargs: Any) -> FakeEmbedder:
        loads.append("embedder")
        return FakeEmbedder(16)

    monkeypatch.setattr(st_backend, "SentenceTransformerEmbedder", fake)
    return loads


@pytest.mark.parametrize(
    ("question", "extra", "hint"),
    [
        ({}, [], ""),
        # Gold that no metric scores: a one-word answer, a number, a 3-word passage.
        ({"answers": ["yes", "13"], "evidence": ["Cats purr here."]}, [], ""),
        ({"options": ["a cat", "a dog"], "gold_option": 0}, [], "only with --reader llm"),
    ],
)
def test_questions_without_gold_stop_before_anything_is_built(
    tmp_path: Path,
    built: list[str],
    capsys: pytest.CaptureFixture[str],
    question: dict[str, Any],
    extra: list[str],
    hint: str,
) -> None:
    questions = [{"doc_id": "d1", "question": f"What do cats do? {i}", **question} for i in (1, 2)]
    assert main([*_files(tmp_path, questions), *extra]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("raptor eval: error: none of the 2 questions"), err
    assert "'evidence'" in err and "'answers'" in err and "'evidence_turn_spans'" in err
    assert "docs/evaluation.md" in err and hint in err
    assert built == [] and not (tmp_path / "out").exists()


def test_questions_partly_without_gold_run_with_a_note(
    tmp_path: Path, built: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    questions = [
        {"doc_id": "d1", "question": "What do kittens chase?", "evidence": [EVIDENCE]},
        {"doc_id": "d1", "question": "Do cats purr?"},
        {"doc_id": "d1", "question": "Is it sunny?", "answers": ["yes"]},
    ]
    assert main([*_files(tmp_path, questions), "--json"]) == 0
    out, err = capsys.readouterr()
    assert "note: 2 of 3 questions have no gold field a metric can score" in err
    shown = json.loads(out)
    assert shown["unscored"] == 2
    assert shown["summary"][0]["n_evidence_recall"] == 1
    assert built == ["embedder"]

    assert main([*_files(tmp_path, questions), "--quiet"]) == 0
    assert capsys.readouterr().err == ""
