"""The store benchmarks run end to end at a toy size, so they cannot rot unnoticed.

Timings are never asserted (they belong to the benchmark's output); what is checked is that
every store opened, answered the queries, and that the file stores return exactly what the
in-memory store returns for the same tree and queries; and that every step of the first
query's benchmark ran and the query found passages.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from benchmark_scripts import ROOT, run_benchmark

BENCHMARKS = ROOT / "benchmarks"


@pytest.mark.slow
def test_store_benchmark_runs_at_a_toy_size(tmp_path: Path) -> None:
    stores = ["memory", "file-mmap", "file-json-only"]
    proc = run_benchmark(
        "stores.py",
        "--sizes",
        "300",
        "--queries",
        "5",
        "--stores",
        *stores,
        "--out",
        str(tmp_path),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "stores.json").read_text())
    (size,) = data["sizes"].values()
    assert set(size["stores"]) == set(stores)
    for name, result in size["stores"].items():
        assert "error" not in result, (name, result)
        assert result["open_s"] >= 0 and result["rss_open_mb"] > 0
    for name in ("memory", "file-mmap"):
        latency = size["stores"][name]["latency"]
        assert set(latency) >= {"collapsed", "traversal"}
        assert all(v["p95_ms"] >= v["p50_ms"] > 0 for v in latency.values())
    # Same tree, same queries, exact search: the file store must return the same ids.
    assert size["stores"]["file-mmap"]["agreement"] == {"collapsed": 1.0, "traversal": 1.0}
    assert "latency" not in size["stores"]["file-json-only"]
    markdown = (tmp_path / "stores.md").read_text()
    assert "| memory |" in markdown and "| file-mmap |" in markdown


def test_first_query_benchmark_runs_at_a_toy_size(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """Every step in this process (the script runs each in a fresh one, which costs 4 s each)."""
    pytest.importorskip("langchain_chroma")
    # The script puts benchmarks/ first on sys.path and imports its siblings (stores.py,
    # _synthetic.py): both are undone after the test, so no later import finds them.
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)

    def forget_benchmark_modules() -> None:
        for name in set(sys.modules) - before:
            if str(getattr(sys.modules[name], "__file__", "")).startswith(str(BENCHMARKS)):
                del sys.modules[name]

    request.addfinalizer(forget_benchmark_modules)
    spec = importlib.util.spec_from_file_location("first_query", BENCHMARKS / "first_query.py")
    assert spec is not None and spec.loader is not None
    first_query = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(first_query)
    results: dict[str, dict[str, float]] = {}

    def in_this_process(step: str, work: Path) -> dict[str, float]:
        results[step] = first_query.child(step, work)
        return results[step]

    first_query.run(argparse.Namespace(sizes=[400], runs=1), tmp_path, in_this_process)
    assert list(results) == ["read", "scan", "bm25", "first"]
    lines = capsys.readouterr().out.splitlines()
    for label in ("read every record", "decode into nodes", "build BM25", "first passage query"):
        assert any(label in line for line in lines), lines
    assert any("(baseline)" in line and line.endswith("1.00x") for line in lines), lines
    returned = [line for line in lines if "the first query returned" in line]
    assert returned and "returned 0 " not in returned[0], lines
    # What the steps read: every node written, the leaves for BM25, passages found.
    assert results["scan"]["nodes"] == len(first_query.make_tree(400))
    assert 0 < results["bm25"]["texts"] < results["scan"]["nodes"]
