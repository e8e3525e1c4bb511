"""The store benchmark runs end to end at a toy size, so it cannot rot unnoticed.

Timings are never asserted (they belong to the benchmark's output); what is checked is that
every store opened, answered the queries, and that the file stores return exactly what the
in-memory store returns for the same tree and queries.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "stores.py"


@pytest.mark.slow
def test_store_benchmark_runs_at_a_toy_size(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    stores = ["memory", "file-mmap", "file-json-only"]
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--sizes",
            "300",
            "--queries",
            "5",
            "--stores",
            *stores,
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
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
