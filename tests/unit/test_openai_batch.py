"""OpenAIBatchSummarizer through the real ``openai`` client and the local server's batch API.

The server (tests/openai_server.py) keeps a batch ``in_progress`` for ``batch_polls``
retrievals, then answers every JSONL line with its own chat handler, so a batch build must
give exactly the tree of a per-call build, for one job per layer and no chat request.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from openai_server import (
    CORPUS,
    LOCALHOST,
    FakeOpenAIServer,
    fake_completion,
    openai_builder,
    tree_signature,
)

from raptor_core.backends.openai import OpenAISummarizer
from raptor_core.backends.openai_batch import OpenAIBatchSummarizer
from raptor_core.build.cache import BuildCache
from raptor_core.build.summarizers import ExtractiveSummarizer
from raptor_core.exceptions import InvalidParameterError, LLMBatchError
from raptor_core.types import BatchSummarizer

pytestmark = [*LOCALHOST, pytest.mark.timeout(120)]

TESTS_DIR = Path(__file__).resolve().parents[1]
FAST: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.05, "timeout": 5.0}


def batch_summarizer(url: str, **kwargs: Any) -> OpenAIBatchSummarizer:
    params: dict[str, Any] = {"poll_interval": 0.01, **FAST, **kwargs}
    return OpenAIBatchSummarizer("fake-chat", base_url=url, api_key="sk-test-key", **params)


def batch_builder(url: str, cache: object, **kwargs: Any) -> Any:
    builder = openai_builder(url, cache=cache)
    builder.summarizer = batch_summarizer(url, **kwargs)
    return builder


def summary_layers(tree: Any) -> int:
    return sum(1 for layer in tree.build_info["layers"] if layer["layer"] > 0)


@pytest.fixture(scope="module")
def reference() -> Any:
    """The tree of a per-call build (the batch build must be identical)."""
    with FakeOpenAIServer() as server:
        return openai_builder(server.url).build(CORPUS)


# -- the seam ------------------------------------------------------------------------------------
def test_batch_summarizer_is_the_seam_and_per_call_is_not() -> None:
    assert isinstance(OpenAIBatchSummarizer("m", api_key="k"), BatchSummarizer)
    assert not isinstance(OpenAISummarizer("m", api_key="k"), BatchSummarizer)
    assert isinstance(ExtractiveSummarizer(), BatchSummarizer)


def test_batch_mode_needs_a_cache_and_says_so_before_any_request() -> None:
    with FakeOpenAIServer() as server:
        builder = batch_builder(server.url, cache=None)
        with pytest.raises(InvalidParameterError, match="needs a build cache"):
            builder.build(CORPUS)
        assert server.requests() == []
        with pytest.raises(InvalidParameterError, match="build cache"):
            batch_summarizer(server.url).summarize_batch([["a b"]], max_tokens=5)


@pytest.mark.parametrize(
    ("name", "value"),
    [("poll_interval", 0), ("batch_timeout", -1.0), ("completion_window", "")],
)
def test_bad_batch_settings_are_rejected(tmp_path: Path, name: str, value: object) -> None:
    summarizer = OpenAIBatchSummarizer("m", api_key="k", **{name: value})
    with pytest.raises(InvalidParameterError, match=name):
        summarizer.check_settings()
    with BuildCache(tmp_path) as cache, pytest.raises(InvalidParameterError, match=name):
        summarizer.summarize_batch([["a"]], max_tokens=5, cache=cache)


# -- a build -------------------------------------------------------------------------------------
def test_batch_build_is_one_job_per_layer_and_matches_per_call(
    tmp_path: Path, reference: Any
) -> None:
    with FakeOpenAIServer(batch_polls=2) as server:
        tree = batch_builder(server.url, cache=tmp_path / "cache").build(CORPUS)
        assert tree_signature(tree) == tree_signature(reference)
        assert server.requests("chat") == []  # every summary came from a batch
        assert len(server.batches) == summary_layers(tree) >= 2
        for batch in server.batches.values():
            assert batch["endpoint"] == "/v1/chat/completions"
            assert batch["completion_window"] == "24h"
        usage = tree.build_info["usage"]["summarize"]
        assert usage["batches"] == len(server.batches)
        assert usage["batch_requests"] == len(reference) - len(reference.leaves)
        assert usage.get("batch_fallbacks", 0) == 0
        # Finished jobs are forgotten: the records only bridge a restart.
        with BuildCache(tmp_path / "cache") as cache, cache._session() as db:
            assert db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 0

        # The same build again: every summary is a cache hit, nothing is submitted.
        again = batch_builder(server.url, cache=tmp_path / "cache").build(CORPUS)
        assert tree_signature(again) == tree_signature(reference)
        assert len(server.batches) == summary_layers(tree)


def test_async_build_uses_the_batch_too(tmp_path: Path, reference: Any) -> None:
    with FakeOpenAIServer(batch_polls=1) as server:
        builder = batch_builder(server.url, cache=tmp_path / "cache")
        tree = asyncio.run(builder.abuild(CORPUS))
        assert tree_signature(tree) == tree_signature(reference)
        assert server.requests("chat") == []
        assert len(server.batches) == summary_layers(tree)


def test_bad_answers_go_through_the_per_call_path(tmp_path: Path, reference: Any) -> None:
    faults = {"cluster-0": "error", "cluster-1": "truncated", "cluster-2": "missing"}

    def plan(endpoint: str, key: str, attempt: int) -> str | None:
        return faults.get(key) if endpoint == "batch" else None

    with FakeOpenAIServer(faults=plan) as server:
        tree = batch_builder(server.url, cache=tmp_path / "cache").build(CORPUS)
        assert tree_signature(tree) == tree_signature(reference)
        layers = summary_layers(tree)
        # Three bad lines in every layer's job (fewer when a job has fewer requests).
        sizes = [
            len(server.files[b["input_file_id"]].splitlines()) for b in server.batches.values()
        ]
        expected = sum(min(3, n) for n in sizes)
        assert len(server.requests("chat")) == expected
        usage = tree.build_info["usage"]["summarize"]
        assert usage["batch_fallbacks"] == expected
        assert layers == len(server.batches)


# -- resuming ------------------------------------------------------------------------------------
CLUSTERS = [["Cats purr softly at night."], ["Rockets fly to orbit."], ["Bread rises."]]


def test_wait_that_runs_out_keeps_the_job_and_a_rerun_picks_it_up(tmp_path: Path) -> None:
    with FakeOpenAIServer(batch_polls=10**6) as server, BuildCache(tmp_path) as cache:
        impatient = batch_summarizer(server.url, batch_timeout=0.05)
        with pytest.raises(LLMBatchError, match="still in_progress") as info:
            impatient.summarize_batch(CLUSTERS, max_tokens=20, cache=cache)
        assert info.value.status == "in_progress"
        assert list(server.batches) == [info.value.batch_id]

        server.release_batches()
        server.batch_polls = 0
        patient = batch_summarizer(server.url)
        summaries = patient.summarize_batch(CLUSTERS, max_tokens=20, cache=cache)
        assert list(server.batches) == [info.value.batch_id]  # no second job
        assert len(server.files) == 2  # the one upload and its output
        assert summaries == [fake_completion(patient.render(c), 20) for c in CLUSTERS]
        assert patient.usage.snapshot().get("batches", 0) == 0  # it submitted nothing

        # Other requests (another max_tokens) are another job.
        patient.summarize_batch(CLUSTERS, max_tokens=21, cache=cache)
        assert len(server.batches) == 2


@pytest.mark.parametrize("outcome", ["failed", "expired"])
def test_dead_batch_raises_and_is_forgotten(tmp_path: Path, outcome: str) -> None:
    with FakeOpenAIServer(batch_outcome=outcome) as server, BuildCache(tmp_path) as cache:
        summarizer = batch_summarizer(server.url)
        with pytest.raises(LLMBatchError, match=outcome) as info:
            summarizer.summarize_batch(CLUSTERS, max_tokens=20, cache=cache)
        assert info.value.status == outcome
        assert "build again" in str(info.value) or "building again" in str(info.value)
        server.batch_outcome = "completed"
        summaries = summarizer.summarize_batch(CLUSTERS, max_tokens=20, cache=cache)
        assert len(summaries) == 3
        assert len(server.batches) == 2  # the dead one was not waited for again


@pytest.mark.parametrize("outcome", ["expired", "cancelled"])
def test_answers_of_an_ended_batch_are_kept_and_not_bought_again(
    tmp_path: Path, outcome: str
) -> None:
    openai = pytest.importorskip("openai")
    clusters = [*CLUSTERS, ["Rivers flow."], ["Trains run late."]]
    polls = 10**6 if outcome == "cancelled" else 0
    with (
        FakeOpenAIServer(batch_outcome=outcome, batch_partial=2, batch_polls=polls) as server,
        BuildCache(tmp_path) as cache,
    ):
        summarizer = batch_summarizer(server.url)
        if outcome == "cancelled":
            with pytest.raises(LLMBatchError, match="still in_progress"):
                batch_summarizer(server.url, batch_timeout=0.05).summarize_batch(
                    clusters, max_tokens=20, cache=cache
                )
            client = openai.OpenAI(base_url=server.url, api_key="sk-test-key")
            client.batches.cancel(next(iter(server.batches)))
        with pytest.raises(LLMBatchError, match="2 answers are kept") as info:
            summarizer.summarize_batch(clusters, max_tokens=20, cache=cache)
        assert info.value.status == outcome
        (first,) = server.batches

        server.batch_outcome, server.batch_polls = "completed", 0
        summaries = summarizer.summarize_batch(clusters, max_tokens=20, cache=cache)
        assert summaries == [fake_completion(summarizer.render(c), 20) for c in clusters]
        second = server.batches[next(b for b in server.batches if b != first)]
        # Only the three requests the ended job had not answered were submitted again.
        assert len(server.files[second["input_file_id"]].splitlines()) == 3
        assert server.requests("chat") == []
        with cache._session() as db:  # the kept answers are dropped once used
            assert db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 0


def test_cancelled_batch_raises_then_a_rerun_submits_anew(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    with FakeOpenAIServer(batch_polls=10**6) as server, BuildCache(tmp_path) as cache:
        with pytest.raises(LLMBatchError):
            batch_summarizer(server.url, batch_timeout=0.05).summarize_batch(
                CLUSTERS, max_tokens=20, cache=cache
            )
        (batch_id,) = server.batches
        client = openai.OpenAI(base_url=server.url, api_key="sk-test-key")
        assert client.batches.cancel(batch_id).status == "cancelled"
        summarizer = batch_summarizer(server.url)
        with pytest.raises(LLMBatchError, match="cancelled") as info:
            summarizer.summarize_batch(CLUSTERS, max_tokens=20, cache=cache)
        assert info.value.batch_id == batch_id
        server.batch_polls = 0
        assert len(summarizer.summarize_batch(CLUSTERS, max_tokens=20, cache=cache)) == 3
        assert len(server.batches) == 2


def test_results_lost_by_the_service_are_a_typed_error_then_a_new_job(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    with FakeOpenAIServer(batch_polls=10**6) as server, BuildCache(tmp_path) as cache:
        with pytest.raises(LLMBatchError):
            batch_summarizer(server.url, batch_timeout=0.05).summarize_batch(
                CLUSTERS, max_tokens=20, cache=cache
            )
        (batch_id,) = server.batches
        server.release_batches()
        client = openai.OpenAI(base_url=server.url, api_key="sk-test-key")
        done = client.batches.retrieve(batch_id)
        assert done.status == "completed"
        del server.files[done.output_file_id]  # the service deleted it meanwhile
        summarizer = batch_summarizer(server.url)
        with pytest.raises(LLMBatchError, match="cannot be read"):
            summarizer.summarize_batch(CLUSTERS, max_tokens=20, cache=cache)
        server.batch_polls = 0
        assert len(summarizer.summarize_batch(CLUSTERS, max_tokens=20, cache=cache)) == 3
        assert len(server.batches) == 2


def test_a_recorded_job_the_service_does_not_know_is_replaced(tmp_path: Path) -> None:
    with FakeOpenAIServer() as server, BuildCache(tmp_path) as cache:
        summarizer = batch_summarizer(server.url)
        bodies = [summarizer.llm._request(summarizer.render(c), 20) for c in CLUSTERS]
        key = cache.job_key(f"openai-batch {summarizer.llm.endpoint}", bodies)
        cache.put_job(key, {"batch_id": "batch_from_another_account"})
        summaries = summarizer.summarize_batch(CLUSTERS, max_tokens=20, cache=cache)
        assert summaries == [fake_completion(summarizer.render(c), 20) for c in CLUSTERS]
        assert len(server.batches) == 1
        assert cache.get_job(key) is None

        # An id that is not one (a path, a query) never reaches a URL: a new job instead.
        server.reset()
        cache.put_job(key, {"batch_id": "../files/file-1/content"})
        summarizer.summarize_batch(CLUSTERS, max_tokens=20, cache=cache)
        assert len(server.batches) == 2
        assert not any(r.key.endswith("/files/file-1/content") for r in server.requests())


def test_job_records_are_checked_like_cache_entries(tmp_path: Path) -> None:
    with BuildCache(tmp_path) as cache:
        key = cache.job_key("ns", [{"a": 1}])
        assert key != cache.job_key("ns", [{"a": 2}])
        assert cache.get_job(key) is None
        cache.put_job(key, {"batch_id": "batch_1"})
        assert cache.get_job(key) == {"batch_id": "batch_1"}
        cache.clear()  # a pending job survives --no-resume: it is still paid for
        assert cache.get_job(key) == {"batch_id": "batch_1"}
        with cache._session() as db:
            db.execute("UPDATE jobs SET value = ?", ('{"batch_id": "batch_999"}',))
        assert cache.get_job(key) is None  # edited: ignored and dropped
        with cache._session() as db:
            assert db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 0


CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from openai_server import CORPUS, openai_builder
    from raptor_core.backends.openai_batch import OpenAIBatchSummarizer

    url, cache = sys.argv[1], sys.argv[2]
    builder = openai_builder(url, cache=cache)
    builder.summarizer = OpenAIBatchSummarizer(
        "fake-chat", base_url=url, api_key="sk-test-key", poll_interval=0.02
    )
    builder.build(CORPUS)
    """
)


def test_killed_while_polling_a_rerun_attaches_to_the_same_batch(
    tmp_path: Path, reference: Any
) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(TESTS_DIR)), encoding="utf-8")
    cache_dir = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    with FakeOpenAIServer(batch_polls=10**6) as server:
        child = subprocess.Popen([sys.executable, str(script), server.url, str(cache_dir)], env=env)
        try:
            deadline = time.monotonic() + 60
            # Killed while it polls: the job exists and has been looked at a few times.
            while not (server.batches and server.batch_retrievals >= 3):
                assert child.poll() is None, "the child ended before it was killed"
                assert time.monotonic() < deadline, "the child never submitted a batch"
                time.sleep(0.02)
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.wait(30)
        assert child.returncode == -signal.SIGKILL
        (first_id,) = server.batches

        server.release_batches()
        server.batch_polls = 0
        tree = batch_builder(server.url, cache=cache_dir).build(CORPUS)
        assert tree_signature(tree) == tree_signature(reference)
        # Layer 1 came from the job the killed process submitted; only the layers it never
        # reached were submitted by the rerun.
        assert next(iter(server.batches)) == first_id
        assert len(server.batches) == summary_layers(tree)
        assert server.requests("chat") == []
        usage = tree.build_info["usage"]["summarize"]
        assert usage["batches"] == summary_layers(tree) - 1


def test_cli_build_with_batch(
    tmp_path: Path, reference: Any, monkeypatch: Any, capsys: Any
) -> None:
    from raptor_core.cli import main
    from raptor_core.tree import Tree

    for i, text in enumerate(CORPUS):
        (tmp_path / f"doc{i}.txt").write_text(text, encoding="utf-8")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-key")
    with FakeOpenAIServer(batch_polls=1) as server:
        args = [
            "build", str(tmp_path), "--out", str(tmp_path / "tree"),
            "--llm", "openai", "--llm-model", "fake-chat", "--llm-base-url", server.url,
            "--embed-provider", "openai", "--openai-embed-model", "fake-embed",
            "--chunk-tokens", "24", "--summary-tokens", "30",
            "--batch", "--batch-poll-interval", "0.01", "--quiet",
        ]  # fmt: skip
        assert main(args) == 0
        tree = Tree.load(tmp_path / "tree")
        assert server.requests("chat") == []
        assert len(server.batches) == summary_layers(tree) >= 1
        assert tree.params["summarizer"]["class"].endswith(".OpenAIBatchSummarizer")
    assert main(["build", str(tmp_path), "--out", str(tmp_path / "t2"), "--batch"]) == 2
    assert "add --llm openai" in capsys.readouterr().err
