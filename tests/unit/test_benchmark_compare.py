"""benchmarks/compare.py pairs two quality.py runs question by question.

The runs are written by the test in quality.py's output format: the margins and changes it
prints are checked against values worked out by hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmark_scripts import run_benchmark

from raptor_core.evaluation.data import holdout_split


def _doc_in(half: str) -> str:
    return next(d for d in (f"doc-{i}" for i in range(100)) if holdout_split(d) == half)


def _write_run(
    folder: Path, scores: dict[str, dict[str, list[float]]], docs: list[str], *, summary: bool
) -> None:
    """A quality.py --out folder for the set "mine" at budget 400 (answer recall)."""
    rows: list[dict[str, Any]] = []
    for retriever, values in scores.items():
        for i, value in enumerate(values):
            rows.append(
                {
                    "doc_id": docs[i],
                    "question_id": f"q{i}",
                    "retriever": retriever,
                    "budget": 400,
                    "answer_recall": value,
                }
            )
    (folder / "quality" / "mine").mkdir(parents=True)
    (folder / "quality" / "mine" / "results.json").write_text(json.dumps({"rows": rows}))
    if summary:
        meta = {"default": "passage", "budgets": [400], "sets": {"mine": {}}}
        meta["primary"] = {"mine": "answer_recall"}
        (folder / "quality.json").write_text(json.dumps(meta))


def test_compare_prints_margins_before_and_after_per_half(tmp_path: Path) -> None:
    dev, held = _doc_in("dev"), _doc_in("held-out")
    docs = [dev, dev, held, held]
    base, new = tmp_path / "base", tmp_path / "new"
    _write_run(
        base,
        {
            "passage": [1.0, 0.0, 0.0, 1.0],
            "dense": [1.0, 1.0, 0.0, 0.0],  # dev 1.0, held-out 0.0, all 0.5
            "bm25": [0.0, 0.0, 1.0, 1.0],  # dev 0.0, held-out 1.0, all 0.5
        },
        docs,
        summary=True,
    )
    # Only the retriever that changed runs again; the baselines come from BASE.
    _write_run(new, {"passage": [1.0, 1.0, 0.0, 0.0]}, docs, summary=False)
    proc = run_benchmark("compare.py", str(base), str(new), "--draws", "200", timeout=120)
    assert proc.returncode == 0, proc.stderr
    tables = proc.stdout.split("**")
    dev_table = tables[tables.index("dev") + 1]
    held_table = tables[tables.index("held-out") + 1]
    all_table = tables[tables.index("all") + 1]
    # dev: passage 0.5 -> 1.0 against dense's 1.0; held-out: 0.5 -> 0.0 against bm25's 1.0.
    assert "| mine | -50.0 -> +0.0 |" in dev_table
    assert "| mine | -50.0 -> -100.0 |" in held_table
    assert "| mine | +0.0 -> +0.0 |" in all_table
    assert tables[tables.index("dev") + 2] == "+50.0"
    assert tables[tables.index("held-out") + 2] == "-50.0"


def test_compare_refuses_runs_over_different_questions(tmp_path: Path) -> None:
    dev = _doc_in("dev")
    base, new = tmp_path / "base", tmp_path / "new"
    _write_run(base, {"passage": [1.0, 0.0], "dense": [1.0, 1.0]}, [dev, dev], summary=True)
    _write_run(new, {"passage": [1.0]}, [dev], summary=False)
    proc = run_benchmark("compare.py", str(base), str(new), timeout=120)
    assert proc.returncode == 2
    assert "scored different questions" in proc.stderr
    missing = run_benchmark("compare.py", str(tmp_path / "nowhere"), str(new), timeout=120)
    assert missing.returncode == 2 and "is BASE a quality.py --out folder?" in missing.stderr
