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


PAIRS = {
    "llamaindex-nodes": (
        "nodes-as-leaves=llamaindex_nodes:NodesAsLeaves",
        "nodes-rejoined=llamaindex_nodes:NodesRejoined",
    ),
    # langchain_pages cuts the pages.
    "llamaindex-pages": (
        "li-pages-as-documents=llamaindex_pages:PagesAsDocuments",
        "li-pages-joined=llamaindex_pages:PagesJoined",
    ),
    "langchain-splits": (
        "splits-as-documents=langchain_splits:SplitsAsDocuments",
        "splits-rejoined=langchain_splits:SplitsRejoined",
    ),
    # langchain_pages builds on langchain_splits.
    "langchain-pages": (
        "pages-as-documents=langchain_pages:PagesAsDocuments",
        "pages-joined=langchain_pages:PagesJoined",
    ),
}


@pytest.fixture(scope="module")
def one_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[Any, Any], str]:
    """One quality.py run of passage and every module's two retrievers: (rows, quality.md).

    One run, not one per module: each run loads the model and builds the whole-document
    trees again.
    """
    for module in ("llama_index.core", "langchain_text_splitters"):
        pytest.importorskip(module)
    root = tmp_path_factory.mktemp("rejoin")
    _write_set(root / "data")
    retrievers = ",".join(["passage", *(name for pair in PAIRS.values() for name in pair)])
    rows = _summary(root / "data", root / "out", retrievers)
    return rows, (root / "out" / "quality.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("pair", list(PAIRS))
def test_joined_documents_score_as_the_whole_documents(
    one_run: tuple[dict[Any, Any], str], pair: str
) -> None:
    rows, markdown = one_run
    apart, joined = (name.split("=")[0] for name in PAIRS[pair])
    mine = {key: row for key, row in rows.items() if key[0] in {"passage", apart, joined}}
    _assert_joined_scores_as_whole(mine, apart=apart, joined=joined)
    # No flat baseline ran: the headline says so instead of naming a baseline "None".
    assert "No flat baseline ran in this run" in markdown and "(None)" not in markdown
