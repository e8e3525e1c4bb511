"""Every script of benchmarks/ runs end to end at a toy size, so none can rot unnoticed.

Timings are never asserted (they belong to the benchmark's output); what is checked is that
each script ran and printed (or wrote) the sections and keys it should: for the stores, that
every store opened, answered the queries, and that the file stores return exactly what the
in-memory store returns for the same tree and queries; for the first query's benchmark, that
every step ran and the query found passages.  The scripts that read ../shared/data run on a
tiny folder in its format written by the test (tests/benchmark_scripts.py
``write_eval_data``), so they run everywhere.  Scripts whose work is starting fresh
processes (cluster_threads.py, cold_start.py) run in this process with those processes
forked from the warm interpreter or only parsed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from benchmark_scripts import ROOT, run_benchmark, write_eval_data

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


def import_benchmark(
    name: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> ModuleType:
    """``benchmarks/<name>.py`` imported in this process, forgotten after the test.

    A script puts benchmarks/ first on sys.path and imports its siblings (stores.py,
    _synthetic.py, build.py): both are undone after the test, so no later import finds them.
    """
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)

    def forget_benchmark_modules() -> None:
        for module in set(sys.modules) - before:
            if str(getattr(sys.modules[module], "__file__", "")).startswith(str(BENCHMARKS)):
                del sys.modules[module]

    request.addfinalizer(forget_benchmark_modules)
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ran(proc: subprocess.CompletedProcess[str]) -> str:
    """The script's stdout, once it exited 0 (else its output, to see why)."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def test_first_query_benchmark_runs_at_a_toy_size(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """Every step in this process (the script runs each in a fresh one, which costs 4 s each)."""
    pytest.importorskip("langchain_chroma")
    first_query = import_benchmark("first_query", monkeypatch, request)
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


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny folder in ../shared/data's format: 2 QASPER-like papers, 4 questions."""
    return write_eval_data(tmp_path_factory.mktemp("shared_data"), docs=2, paragraphs=5)


def test_query_benchmark_runs_at_a_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "query.json"
    stdout = ran(
        run_benchmark(
            "query.py", "--sizes", "300", "--queries", "2", "--json", str(out), timeout=120
        )
    )
    assert "node store built in" in stdout
    data = json.loads(out.read_text())
    strategies = set(data["median_ms"])
    assert "baseline: numpy matmul + argsort" in strategies
    for name in ("collapsed", "traversal (top_k=5)", "value (chunk_k=20)", "llm (instant LLM)"):
        assert name in strategies and f"\n{name} " in stdout, (name, stdout)
    assert "hybrid (instant LLM, judge)" in strategies
    (size,) = data["setup"]
    assert set(data["setup"][size]) == {"generate_s", "structure_s"}


def test_query_load_benchmark_runs_at_a_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "query_load.json"
    stdout = ran(
        run_benchmark(
            "query_load.py",
            *("--sizes", "300", "--queries", "2", "--no-embed", "--json", str(out)),
            timeout=120,
        )
    )
    for section in (
        "## scoring one query against 10k nodes",
        "einsum, no pool (matvec: now), alone",
        "FaissIndex.search, one OpenMP thread (now), busy process",
        "## collapsed query, 300 nodes",
        "exact: 16 threads, wall / 16",
        "HNSW, leaves only (restrict_to in the graph): alone",
        "recall@10, collapsed hits",
        "# at end: load average",
    ):
        assert section in stdout, (section, stdout)
    assert json.loads(out.read_text())


def test_cold_start_benchmark_commands_are_valid(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """The script's work is four kinds of fresh process (a minute): each of its ``raptor``
    command lines is parsed by the real CLI instead of run, and the report is printed."""
    from raptor_core.cli.app import make_parser

    cold_start = import_benchmark("cold_start", monkeypatch, request)
    seen: list[list[str]] = []

    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert cmd[0] == sys.executable, cmd
        if cmd[1:3] == ["-m", "raptor_core.cli"]:
            make_parser().parse_args(cmd[3:])  # SystemExit on a flag the CLI lost
        else:
            assert cmd[1] == "-c", cmd
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(cold_start, "subprocess", SimpleNamespace(run=run, DEVNULL=None))
    out = tmp_path / "cold_start.json"
    monkeypatch.setattr(sys, "argv", ["cold_start.py", "--runs", "1", "--json", str(out)])
    cold_start.main()
    commands = [c[3] for c in seen if c[1] == "-m"]
    assert commands == ["build", "export-onnx", "query", "query"]
    assert "--no-onnx" in seen[-1]
    assert all((ROOT / "tests" / "data" / "multi_topic.md").as_posix() in c for c in seen[:1])
    stdout = capsys.readouterr().out
    for row in ('python -c "import numpy" (baseline)', "raptor query (ONNX Runtime: now)"):
        assert row in stdout, stdout
    assert set(json.loads(out.read_text())) == {"median_s", "runs"}


@pytest.mark.slow
def test_cluster_threads_benchmark_runs_at_a_toy_size(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """Each setting's child runs as the script starts it, forked from the warm interpreter
    (a fresh one imports UMAP for seconds; the thread caps are then not applied, which only
    the timings would show)."""
    cluster_threads = import_benchmark("cluster_threads", monkeypatch, request)

    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert cmd[:2] == [sys.executable, cluster_threads.__file__], cmd
        proc = run_benchmark("cluster_threads.py", *cmd[2:], timeout=120)
        ran(proc)
        return proc

    monkeypatch.setattr(cluster_threads, "subprocess", SimpleNamespace(run=run))
    argv = ["cluster_threads.py", "--n", "60", "--repeats", "1", "--rounds", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    cluster_threads.main()
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("setting") and "warm/a" in line for line in lines), lines
    for label in ("(a) default", "(b) 1 thread", "(c) 2 threads"):
        (row,) = [line for line in lines if line.startswith(label)]
        assert int(row.split()[-1]) >= 1  # clusters found


@pytest.mark.slow
def test_build_benchmark_runs_at_a_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "build.json"
    stdout = ran(run_benchmark("build.py", "--tokens", "1000", "--json", str(out), timeout=180))
    for stage in ("chunk", "embed", "cluster", "summarize", "persist", "total"):
        assert any(line.startswith(stage) for line in stdout.splitlines()), (stage, stdout)
    assert "clustering / embedding =" in stdout
    data = json.loads(out.read_text())
    assert set(data) == {"tokens", "corpus", "timings", "total", "peak_rss_mb"}
    assert data["tokens"] >= 1000


@pytest.mark.slow
def test_scale_benchmark_runs_at_a_toy_size(
    tmp_path: Path,
    eval_data: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """One size, its build forked from the warm interpreter; then ``--report`` of its JSON."""
    monkeypatch.setenv("RAPTOR_EVAL_DATA", str(eval_data))
    scale = import_benchmark("scale", monkeypatch, request)
    assert eval_data == scale.DATA

    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert cmd[:2] == [sys.executable, scale.__file__], cmd
        return run_benchmark("scale.py", *cmd[2:], timeout=120)

    monkeypatch.setattr(scale, "subprocess", SimpleNamespace(run=run))
    out = tmp_path / "scale.json"
    argv = ["scale.py", "--sizes", "2k", "--unbucketed-max", "0", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert scale.main() == 0
    stdout = capsys.readouterr().out
    assert "| tokens | bucket_size | chunks | layers |" in stdout, stdout
    (row,) = json.loads(out.read_text())
    assert row["target_tokens"] == 2000 and row["chunks"] > 0 and row["embedder"] == "fake"
    assert set(row["timings"]) >= {"chunk", "embed", "cluster"}
    monkeypatch.setattr(sys, "argv", ["scale.py", "--report", str(out)])
    assert scale.main() == 0
    assert "| tokens | bucket_size |" in capsys.readouterr().out


@pytest.mark.slow
def test_vs_baselines_benchmark_runs_at_a_toy_size(tmp_path: Path, eval_data: Path) -> None:
    out = tmp_path / "vs_baselines.json"
    stdout = ran(
        run_benchmark(
            "vs_baselines.py",
            *("--docs", "1", "--queries", "2", "--data", str(eval_data), "--json", str(out)),
            timeout=180,
        )
    )
    assert f"QASPER ({eval_data / 'qasper_docs.jsonl'})" in stdout, stdout
    for name in ("raptor", "llamaindex", "llamaindex leaves", "langchain", "langchain leaves"):
        assert any(line.startswith(f"{name} ") for line in stdout.splitlines()), (name, stdout)
    data = json.loads(out.read_text())
    assert set(data) == {"environment", "source", "seed", "rows"} and data["rows"]


@pytest.mark.slow
def test_quality_and_compare_benchmarks_run_at_a_toy_size(tmp_path: Path, eval_data: Path) -> None:
    """quality.py with the flat baselines, then compare.py on its output.

    The four framework modules' retrievers (llamaindex_nodes, llamaindex_pages,
    langchain_splits, langchain_pages) run through quality.py in
    tests/integration/test_rejoin_benchmarks.py, which also checks their figures.
    """
    common = ["--data", str(eval_data), "--sets", "qasper", "--limit-docs", "0"]
    common += ["--limit-questions", "0", "--budgets", "400", "--cache", str(tmp_path / "cache")]
    base = tmp_path / "base"
    retrievers = "passage,dense,bm25"
    stdout = ran(
        run_benchmark(
            "quality.py", *common, "--out", str(base), "--retrievers", retrievers, timeout=300
        )
    )
    assert "best flat baseline, evidence:" in stdout, stdout
    data = json.loads((base / "quality.json").read_text())
    qasper = data["sets"]["qasper"]
    assert qasper["skipped"] == {}
    names = {row["retriever"] for row in qasper["summary"]}
    assert names == {r.split("=")[0] for r in retrievers.split(",")}
    assert all(row["questions"] == 4 for row in qasper["summary"])
    assert (base / "quality.md").is_file()
    # compare.py pairs two runs question by question: BASE against itself here (a second run
    # of quality.py, even over the cached trees, would cost as much again).
    compared = ran(run_benchmark("compare.py", str(base), str(base), "--draws", "50", timeout=60))
    assert "`passage`: margin over the best flat baseline" in compared, compared
    # Two documents: one held out, none left for the development half, which is then omitted.
    assert "**held-out**" in compared and "**all**" in compared, compared
    assert "| qasper |" in compared and "average change (95% interval)" in compared


@pytest.mark.slow
def test_incremental_benchmark_runs_at_a_toy_size(tmp_path: Path, eval_data: Path) -> None:
    stdout = ran(
        run_benchmark(
            "incremental.py",
            *("--n", "3", "--data", str(eval_data), "--out", str(tmp_path)),
            timeout=300,
        )
    )
    for step in ("build 2 documents:", "insert 1 document:", "delete it again:"):
        assert step in stdout, (step, stdout)
    markdown = (tmp_path / "incremental.md").read_text()
    for row in ("| fresh build of 3 documents |", "| insert 1 into 2 |", "| delete 1 from 3 |"):
        assert row in markdown, markdown
    assert "| grown by insert |" in markdown and "| fresh build |" in markdown
    data = json.loads((tmp_path / "incremental.json").read_text())
    assert {"base", "fresh", "insert", "delete", "recall"} <= set(data)
    # One call per cluster, whether the builder summarised them one by one or in batches.
    assert data["insert"]["calls"] == data["insert"]["report"]["summary_calls"]


def test_incremental_benchmark_counts_without_changing_the_build(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """The counting wrapper keeps the extractive summariser's batch call and sentence vector
    tap: without them the builder summarised cluster by cluster from several threads, and
    concurrent in-context embedding failed (a SummarizationError at the first rebuild)."""
    from raptor_core import ExtractiveSummarizer, TreeBuilder
    from raptor_core.testing import FakeEmbedder, GroupClusterer
    from raptor_core.types import BatchSummarizer

    incremental = import_benchmark("incremental", monkeypatch, request)
    embedder = FakeEmbedder(dim=32)
    counting = incremental.CountingSummarizer(ExtractiveSummarizer(embedder))
    batched = isinstance(counting, BatchSummarizer)  # apart: no narrowing of `counting`
    assert batched
    assert callable(getattr(counting, "sentence_vector_tap", None))
    docs = [
        {"doc_id": f"d{i}", "text": f"Cats nap in the sun, day {i}. Dogs bark at noon. " * 20}
        for i in range(3)
    ]
    builder = TreeBuilder(embedder, counting, clusterer=GroupClusterer(3), random_state=0)
    tree = builder.build(docs)
    summaries = sum(1 for node in tree.nodes if node.layer > 0 and len(node.children) > 1)
    assert counting.calls == summaries > 0


@pytest.mark.slow
def test_ray_build_benchmark_runs_at_a_toy_size(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    out = tmp_path / "ray_build.json"
    stdout = ran(
        run_benchmark(
            "ray_build.py",
            *("--tokens", "300", "--embedder", "fake", "--json", str(out)),
            timeout=300,
        )
    )
    assert "same tree: ids and texts equal, vectors within 1e-6" in stdout, stdout
    for stage in ("chunk", "embed", "cluster", "summarize", "total"):
        assert any(line.startswith(stage) for line in stdout.splitlines()), (stage, stdout)
    data = json.loads(out.read_text())
    assert data["same_tree"] is True and data["embedder"] == "fake"
