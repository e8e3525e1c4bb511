"""benchmarks/quality.py runs on sets of any name, scored by the gold signal they carry.

The same comparison is meant to run on documents and questions the team does not have, in
the format of ../shared/data; the data here is written by the test (the shared data is
never needed).  Scores are not asserted, only which metric each set got and that every
named retriever was scored.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_scripts import run_benchmark

_TOPICS = {
    "bees": [
        "Honey bees live in colonies ruled by a single queen.",
        "Worker bees gather nectar from flowers across the meadow.",
        "The waggle dance tells other workers where the flowers are.",
        "Drones exist only to mate with a queen from another hive.",
        "In winter the colony clusters together to keep the queen warm.",
        "Beekeepers harvest the surplus honey at the end of summer.",
    ],
    "rockets": [
        "A rocket carries both its fuel and the oxidiser it burns.",
        "Liquid engines can be throttled and restarted in flight.",
        "The first stage falls away once its tanks are empty.",
        "Orbital velocity near the Earth is close to eight kilometres per second.",
        "Reusable boosters land upright on a barge in the ocean.",
        "Engineers test every engine on a stand before the launch.",
    ],
}


def _write_sets(data: Path) -> None:
    docs = [
        {"doc_id": name, "title": name, "text": "\n\n".join([" ".join(lines)] * 6)}
        for name, lines in _TOPICS.items()
    ]
    for stem in ("facts", "papers", "choices"):
        with (data / f"{stem}_docs.jsonl").open("w", encoding="utf-8") as out:
            out.writelines(json.dumps(d) + "\n" for d in docs)
    facts = [
        {
            "doc_id": "bees",
            "question": "Who rules a colony of bees?",
            "answers": ["a single queen"],
        },
        {"doc_id": "rockets", "question": "Where do boosters land?", "answers": ["on a barge"]},
    ]
    papers = [
        {
            "doc_id": "bees",
            "question": "How do workers share where flowers are?",
            "evidence": [_TOPICS["bees"][2]],
        },
        {
            "doc_id": "rockets",
            "question": "How fast is orbit?",
            "evidence": [_TOPICS["rockets"][3]],
        },
    ]
    choices = [
        {
            "doc_id": "bees",
            "question": "What do drones do?",
            "answers": ["mate with a queen"],
            "options": ["mate with a queen", "gather nectar"],
            "gold_option": 0,
        }
    ]
    for stem, questions in (("facts", facts), ("papers", papers), ("choices", choices)):
        with (data / f"{stem}.jsonl").open("w", encoding="utf-8") as out:
            out.writelines(json.dumps(q) + "\n" for q in questions)


@pytest.mark.slow
def test_sets_of_other_names_are_scored_by_their_gold_signal(tmp_path: Path) -> None:
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    _write_sets(data)
    # A set name becomes a folder name (the tree cache): ".." would point outside it.
    for suffix in ("_docs.jsonl", ".jsonl"):
        (data / f"..{suffix}").write_bytes((data / f"facts{suffix}").read_bytes())
    proc = run_benchmark(
        "quality.py",
        "--data",
        str(data),
        "--sets",
        "all",
        "--limit-docs",
        "0",
        "--limit-questions",
        "0",
        "--retrievers",
        "passage,dense,bm25",
        "--out",
        str(out),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Multiple choice without evidence needs a reader model: skipped, and said so.
    assert "choices: no evidence, spans or (non multiple-choice) answers" in proc.stdout
    report = json.loads((out / "quality.json").read_text())
    assert sorted(report["sets"]) == ["facts", "papers"]
    primary = {
        name: {
            m
            for m in ("answer_recall", "evidence_recall")
            if report["sets"][name]["summary"][0][m] is not None
        }
        for name in report["sets"]
    }
    assert primary == {"facts": {"answer_recall"}, "papers": {"evidence_recall"}}
    for name, margins in report["margins"].items():
        cell = margins["all"]["2000"]
        assert cell["default"] is not None and cell["best_flat_name"] in {"dense", "bm25"}, name
    assert "## facts" in (out / "quality.md").read_text()
    # An unknown name that is not in --data is refused with the reason.
    refused = run_benchmark(
        "quality.py", "--data", str(data), "--sets", "nothing-here", timeout=120
    )
    assert refused.returncode == 2 and "nothing-here" in refused.stderr
    assert "<name>_docs.jsonl and <name>.jsonl pair" in refused.stderr
    outside = run_benchmark("quality.py", "--data", str(data), "--sets", "..", timeout=120)
    assert outside.returncode == 2 and "unknown sets ['..']" in outside.stderr
