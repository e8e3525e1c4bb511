"""benchmarks/llamaindex_nodes.py, llamaindex_pages.py, langchain_splits.py and langchain_pages.py,
in quality.py.

Joined back together, the splits must score exactly as the whole documents do (the figures
docs/llamaindex.md and docs/langchain.md cite rest on it); the splits kept apart must run
and be scored.  The data is written by the test: long enough for ``SentenceSplitter()`` to
cut each document into overlapping 1,024-token nodes, and never periodic (repeated text is
not joined by LlamaIndex's rule, by design).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from benchmark_scripts import run_benchmark

_FLOWERS = ["clover", "heather", "lavender", "thyme", "borage", "sage", "lime", "apple"]


def _text(topic: str, n: int) -> str:
    paragraphs = []
    for p in range(n):
        sentences = [
            f"On day {p * 7 + s} the {topic} keeper noted that worker {p * 31 + s} visited "
            f"{_FLOWERS[(p + s) % len(_FLOWERS)]} {s + 2} times before noon."
            for s in range(6)
        ]
        paragraphs.append(" ".join(sentences))
    return "\n\n".join(paragraphs)


def _write_set(data: Path) -> None:
    data.mkdir()
    docs = [
        {"doc_id": topic, "title": topic, "text": _text(topic, 40)} for topic in ("hive", "farm")
    ]
    questions = [
        {
            "doc_id": "hive",
            "question": "Which worker visited lime on day 142?",
            "evidence": [docs[0]["text"].split("\n\n")[20]],
        },
        {
            "doc_id": "farm",
            "question": "What did the farm keeper note on day 80?",
            "evidence": [docs[1]["text"].split("\n\n")[11]],
        },
    ]
    (data / "notes_docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (data / "notes.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))


def _summary(data: Path, out: Path, retrievers: str) -> dict[tuple[str, int], dict[str, Any]]:
    proc = run_benchmark(
        "quality.py",
        "--data",
        str(data),
        "--sets",
        "notes",
        "--limit-docs",
        "0",
        "--limit-questions",
        "0",
        "--retrievers",
        retrievers,
        "--out",
        str(out),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "quality.json").read_text())["sets"]["notes"]["summary"]
    return {(r["retriever"], r["budget"]): r for r in summary}


def _assert_joined_scores_as_whole(
    rows: dict[tuple[str, int], dict[str, Any]], *, apart: str, joined: str
) -> None:
    """``joined`` scores exactly as ``passage`` over the whole documents; ``apart`` is scored."""
    assert {name for name, _ in rows} == {"passage", apart, joined}
    for budget in (400, 1000, 2000):
        whole, rejoined = rows["passage", budget], rows[joined, budget]
        assert rejoined["evidence_recall"] == whole["evidence_recall"]
        assert rejoined["context_tokens"] == whole["context_tokens"]
        assert rows[apart, budget]["evidence_recall"] is not None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("apart", "joined", "needs"),
    [
        (
            "nodes-as-leaves=llamaindex_nodes:NodesAsLeaves",
            "nodes-rejoined=llamaindex_nodes:NodesRejoined",
            ("llama_index.core",),
        ),
        (
            # langchain_pages cuts the pages.
            "li-pages-as-documents=llamaindex_pages:PagesAsDocuments",
            "li-pages-joined=llamaindex_pages:PagesJoined",
            ("llama_index.core", "langchain_text_splitters"),
        ),
        (
            "splits-as-documents=langchain_splits:SplitsAsDocuments",
            "splits-rejoined=langchain_splits:SplitsRejoined",
            ("langchain_text_splitters",),
        ),
        (
            # langchain_pages builds on langchain_splits.
            "pages-as-documents=langchain_pages:PagesAsDocuments",
            "pages-joined=langchain_pages:PagesJoined",
            ("langchain_text_splitters",),
        ),
    ],
    ids=["llamaindex-nodes", "llamaindex-pages", "langchain-splits", "langchain-pages"],
)
def test_joined_documents_score_as_the_whole_documents(
    tmp_path: Path, apart: str, joined: str, needs: tuple[str, ...]
) -> None:
    for module in needs:
        pytest.importorskip(module)
    _write_set(tmp_path / "data")
    out = tmp_path / "out"
    rows = _summary(tmp_path / "data", out, f"passage,{apart},{joined}")
    _assert_joined_scores_as_whole(rows, apart=apart.split("=")[0], joined=joined.split("=")[0])
    # No flat baseline ran: the headline says so instead of naming a baseline "None".
    markdown = (out / "quality.md").read_text()
    assert "No flat baseline ran in this run" in markdown and "(None)" not in markdown
