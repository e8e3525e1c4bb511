"""Builds on a real local Ray cluster give the tree a local build gives (the ``[ray]`` extra).

In-process tests run on a local Ray that this module starts with ``ray.init(num_cpus=2)``.
The command-line test joins a cluster by address: the module starts its own head, ``ray
start --head --block`` on 127.0.0.1 with 2 CPUs, free ports and its own token, in a
temporary directory, and stops exactly that process group at the end (never ``ray stop``,
which would stop every Ray on the machine).  Skipped when Ray is not installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import warm_python

pytest.importorskip("ray", reason="Ray is not installed: pip install 'raptor-retriever[ray]'")
pytest.importorskip("ray.data", reason="Ray Data is not installed: pip install 'ray[data]'")

from raptor_core.build.builder import TreeBuilder
from raptor_core.build.chunking import SentenceChunker
from raptor_core.build.executors import BuildStageError
from raptor_core.build.ray_executor import RayExecutor
from raptor_core.build.summarizers import ExtractiveSummarizer
from raptor_core.exceptions import InvalidParameterError, SummarizationError
from raptor_core.testing import (
    EchoSummarizer,
    FakeEmbedder,
    WhitespaceTokenizer,
    check_tree_invariants,
)
from raptor_core.tree import Tree

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "data" / "corpus"
#: This cluster's own token (Ray 2.5x authenticates drivers), so that no token file that
#: another cluster on the machine wrote is needed or changed.
TOKEN = secrets.token_hex(32)


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    # Workers import raptor_core from this checkout, as an installed package would be found.
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": TOKEN,
    }


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A 2-CPU Ray head on 127.0.0.1, started (and stopped) by this module only."""
    ray_bin = Path(sys.executable).with_name("ray")
    if not ray_bin.exists():
        pytest.skip(f"no `ray` command next to {sys.executable}")
    port = _free_port()
    # Short path: Ray's Unix sockets live under it and their paths have a length limit.
    temp = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    command = [str(ray_bin), "start", "--head", "--block", "--node-ip-address", "127.0.0.1"]
    command += ["--port", str(port), "--num-cpus", "2", "--include-dashboard=false"]
    command += ["--temp-dir", temp, "--disable-usage-stats"]
    # Fixed defaults would collide with another cluster on the machine: take free ones.
    for flag in ("--ray-client-server-port", "--dashboard-agent-listen-port"):
        command += [flag, str(_free_port())]
    log = open(Path(temp) / "head.log", "w")  # noqa: SIM115 - closed in teardown
    head = subprocess.Popen(
        command, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if head.poll() is not None:
                pytest.fail(f"ray start exited: {(Path(temp) / 'head.log').read_text()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > deadline:
                pytest.fail("the Ray head did not open its port within 120 s")
            time.sleep(0.5)
        time.sleep(2)  # the GCS port opens before the raylet registers
        yield address
    finally:
        # `ray start --block` stops the processes it started when it gets SIGTERM; whatever
        # is left of its process group (ours alone: start_new_session) is killed after.  Its
        # graceful stop waits about 30 s for workers a driver left behind; nothing of the
        # cluster outlives its processes but its temporary directory, removed below.
        head.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        head.wait(10)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def executor() -> Iterator[RayExecutor]:
    """A RayExecutor on a 2-CPU local Ray started here (and shut down after the module)."""
    import ray

    if ray.is_initialized():
        pytest.skip("Ray is already initialised in this process by another test")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": _env()["PYTHONPATH"], "HF_HUB_OFFLINE": "1"}},
    )
    try:
        yield RayExecutor(num_cpus_per_task=1)
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def docs() -> list[dict[str, str]]:
    return [
        {"doc_id": path.name, "text": path.read_text(encoding="utf-8")}
        for path in sorted(CORPUS.glob("*.md"))
    ]


def assert_same_tree(a: Tree, b: Tree) -> None:
    assert [n.id for n in a.nodes] == [n.id for n in b.nodes]
    assert [n.text for n in a.nodes] == [n.text for n in b.nodes]
    assert [n.children for n in a.nodes] == [n.children for n in b.nodes]
    np.testing.assert_allclose(a.embeddings, b.embeddings, atol=1e-6, rtol=0)


def fake_builder(summarizer: Any, executor: RayExecutor | None) -> TreeBuilder:
    return TreeBuilder(
        FakeEmbedder(),
        summarizer,
        tokenizer=WhitespaceTokenizer(),
        chunk_max_tokens=30,
        summary_max_tokens=40,
        cluster_max_tokens=200,
        random_state=0,
        executor=executor,
    )


def test_fake_components_give_the_same_tree_and_run_on_the_cluster(
    executor: RayExecutor, docs: list[dict[str, str]]
) -> None:
    local_summarizer, ray_summarizer = EchoSummarizer(), EchoSummarizer()
    local = fake_builder(local_summarizer, None).build(docs)
    on_ray = fake_builder(ray_summarizer, executor).build(docs)
    assert local.num_layers > 1
    assert_same_tree(local, on_ray)
    # The summaries were made on Ray workers, on copies: the driver's summariser saw nothing.
    assert local_summarizer.calls
    assert ray_summarizer.calls == []


def test_the_real_model_embeds_the_same_on_the_cluster(
    executor: RayExecutor, multi_topic_text: str, st_embedder: Any
) -> None:
    # The packaged all-MiniLM-L6-v2 travels as its allowlisted spec; each actor loads it.
    # Vectors agree to float rounding.  Whole trees are compared between new processes in
    # the command-line test below: a CPU model's last bits depend on the process's history
    # (~1e-7, seen between this pytest process and a fresh one), and UMAP can amplify that.
    docs = [{"doc_id": "topics", "text": multi_topic_text}]

    def build(ex: RayExecutor | None) -> Tree:
        summarizer = ExtractiveSummarizer(st_embedder)
        return TreeBuilder(st_embedder, summarizer, random_state=0, executor=ex).build(docs)

    local = build(None)
    on_ray = build(executor)
    check_tree_invariants(on_ray, extractive=True)
    assert on_ray.num_layers > 1
    leaves = len(local.layer(0))
    assert [n.id for n in on_ray.layer(0)] == [n.id for n in local.layer(0)]
    np.testing.assert_allclose(
        on_ray.embeddings[:leaves], local.embeddings[:leaves], atol=1e-6, rtol=0
    )


def test_remote_failures_are_typed_and_name_the_stage(executor: RayExecutor) -> None:
    with pytest.raises(
        SummarizationError, match=r"summarize stage, item 2 of 3 failed: ValueError"
    ):
        executor.map_tasks(int, ["1", "x", "3"], stage="summarize", max_concurrency=1)
    with pytest.raises(BuildStageError, match=r"chunk stage, batch 1 of 2 failed: ValueError"):
        executor.map_batches(int, ["x", "2"], stage="chunk")
    # A typed error raised on a worker keeps its type.
    refuse = SentenceChunker(WhitespaceTokenizer(), max_tokens=0).split
    with pytest.raises(InvalidParameterError, match=r"^chunk stage, item 1 of 1: max_tokens"):
        executor.map_tasks(refuse, ["a b"], stage="chunk")


def test_results_come_back_in_input_order(executor: RayExecutor) -> None:
    items = [str(i) * (20 - i) for i in range(12)]
    assert executor.map_tasks(len, items, stage="cluster", max_concurrency=3) == [
        len(x) for x in items
    ]
    assert executor.map_batches(sorted, [[3, 1], [2], [9, 8, 7]], stage="embed") == [
        [1, 3],
        [2],
        [7, 8, 9],
    ]


def test_cli_build_with_ray_matches_a_local_build(ray_address: str, tmp_path: Path) -> None:
    # A process of its own joins the cluster by address, with the cluster's token in its env
    # (forked from the warm interpreter, which has not imported Ray: tests/warm_python.py).
    def build(out: Path, *extra: str) -> dict[str, Any]:
        args = ["build", str(CORPUS), "--out", str(out), "--chunk-tokens", "60", "--quiet"]
        proc = warm_python.raptor(*args, *extra, env=_env(), timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads((out / "tree.json").read_text(encoding="utf-8"))

    on_ray = build(tmp_path / "ray", "--ray", ray_address)
    local = build(tmp_path / "local")
    assert [n["id"] for n in on_ray["nodes"]] == [n["id"] for n in local["nodes"]]
    assert [n["text"] for n in on_ray["nodes"]] == [n["text"] for n in local["nodes"]]
    a = Tree.load(tmp_path / "ray").embeddings
    b = Tree.load(tmp_path / "local").embeddings
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
