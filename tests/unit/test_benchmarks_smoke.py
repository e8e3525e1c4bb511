"""The store benchmark runs end to end at a toy size, so it cannot rot unnoticed.

Timings are never asserted (they belong to the benchmark's output); what is checked is that
every store opened, answered the queries, and that the file stores return exactly what the
in-memory store returns for the same tree and queries.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_scripts import run_benchmark


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


@pytest.mark.slow
def test_first_query_benchmark_runs_at_a_toy_size(tmp_path: Path) -> None:
    pytest.importorskip("langchain_chroma")
    proc = run_benchmark(
        "first_query.py", "--sizes", "400", "--runs", "1", "--keep", str(tmp_path), timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for label in ("read every record", "decode into nodes", "build BM25", "first passage query"):
        assert any(label in line for line in lines), proc.stdout
    assert any("(baseline)" in line and line.endswith("1.00x") for line in lines), proc.stdout
    returned = [line for line in lines if "the first query returned" in line]
    assert returned and "returned 0 " not in returned[0], proc.stdout
