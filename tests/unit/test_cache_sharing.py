"""A build cache shared by threads and processes: each answer is paid for once.

Claims are rows in the cache's own SQLite file; these tests drive them through the public
wrappers (``CachedSummarizer``, ``CachedEmbedder``, ``TreeBuilder(cache=...)``), with real
threads, real processes (subprocesses started on this interpreter) and the real ``openai``
client against the local server.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from openai_server import (
    CORPUS,
    LOCALHOST,
    FakeOpenAIServer,
    Record,
    openai_builder,
    tree_signature,
)

from raptor_core.build.cache import CACHE_FILE, BuildCache, CachedEmbedder, CachedSummarizer
from raptor_core.exceptions import InvalidParameterError
from raptor_core.testing import EchoSummarizer, FakeEmbedder

pytestmark = [*LOCALHOST, pytest.mark.timeout(120)]

TESTS_DIR = Path(__file__).resolve().parents[1]
TEXTS = ["alpha beta gamma", "delta epsilon"]


class SlowSummarizer(EchoSummarizer):
    """EchoSummarizer that takes ``seconds`` and can fail on demand (thread-safe counting)."""

    def __init__(self, seconds: float = 0.2, *, fail: bool = False) -> None:
        super().__init__()
        self.seconds = seconds
        self.fail = fail

    def summarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        time.sleep(self.seconds)
        if self.fail:
            self.calls.append(("<failed>",))  # list.append is atomic
            raise RuntimeError("service unavailable")
        return super().summarize(texts, max_tokens=max_tokens)  # thread-safe


class SlowEmbedder(FakeEmbedder):
    def __init__(self, batch_size: int) -> None:
        super().__init__(16)
        self.batch_size = batch_size
        self.sent: list[str] = []
        self._sent_lock = threading.Lock()

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        time.sleep(0.05)
        with self._sent_lock:
            self.sent.extend(texts)
        return super().embed_documents(texts)


def _claim_row(directory: Path, key: str, *, host: str, pid: object, expires: object) -> None:
    """Write a claim as another process would have (the cache file must exist)."""
    with sqlite3.connect(directory / CACHE_FILE) as db:
        db.execute(
            "INSERT OR REPLACE INTO claims (key, token, host, pid, expires) VALUES (?, ?, ?, ?, ?)",
            (key, "someone-else", host, pid, expires),
        )


def _claims(directory: Path) -> list[tuple[object, ...]]:
    with sqlite3.connect(directory / CACHE_FILE) as db:
        return db.execute("SELECT key, host, pid FROM claims").fetchall()


def _key(summarizer: EchoSummarizer, cache: BuildCache) -> str:
    return BuildCache.summary_key(CachedSummarizer(summarizer, cache).namespace, TEXTS, 5)


# -- threads -----------------------------------------------------------------------------------
@pytest.mark.parametrize("shared_object", [True, False])
def test_threads_asking_for_one_summary_pay_once(tmp_path, shared_object: bool) -> None:
    inner = SlowSummarizer(0.3)
    one_cache = BuildCache(tmp_path)
    answers: list[str] = []

    def ask() -> None:
        cache = one_cache if shared_object else BuildCache(tmp_path)  # as separate processes do
        answers.append(CachedSummarizer(inner, cache).summarize(TEXTS, max_tokens=5))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(inner.calls) == 1
    assert answers == ["alpha beta gamma delta epsilon"] * 8
    assert _claims(tmp_path) == []  # released with the answer


def test_waiters_count_as_cache_hits(tmp_path) -> None:
    inner = SlowSummarizer(0.3)
    wrappers = [CachedSummarizer(inner, BuildCache(tmp_path)) for _ in range(3)]
    threads = [
        threading.Thread(target=w.summarize, args=(TEXTS,), kwargs={"max_tokens": 5})
        for w in wrappers
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    counts = [w.usage.snapshot() for w in wrappers]
    assert sum(c["cache_misses"] for c in counts) == 1
    assert sum(c["cache_hits"] for c in counts) == 2


def test_a_failed_claimant_hands_the_key_to_a_waiter(tmp_path) -> None:
    failing, healthy = SlowSummarizer(0.3, fail=True), SlowSummarizer(0.0)
    errors: list[BaseException] = []

    def claimant() -> None:
        try:
            CachedSummarizer(failing, BuildCache(tmp_path)).summarize(TEXTS, max_tokens=5)
        except RuntimeError as exc:
            errors.append(exc)

    first = threading.Thread(target=claimant)
    first.start()
    time.sleep(0.1)  # the claimant holds the key and is calling
    start = time.perf_counter()
    answer = CachedSummarizer(healthy, BuildCache(tmp_path)).summarize(TEXTS, max_tokens=5)
    first.join()
    assert errors and answer == "alpha beta gamma delta epsilon"
    assert len(failing.calls) == 1 and len(healthy.calls) == 1  # the waiter asked after the failure
    assert time.perf_counter() - start < 2.0


def test_threads_embedding_the_same_texts_split_the_work_and_pay_once(tmp_path) -> None:
    texts = [f"text number {i}" for i in range(40)]
    inner = SlowEmbedder(batch_size=4)
    results: list[np.ndarray] = []

    def embed() -> None:
        results.append(CachedEmbedder(inner, BuildCache(tmp_path)).embed_documents(texts))

    threads = [threading.Thread(target=embed) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 3  # no thread failed (opening one new cache from three at once)
    assert sorted(inner.sent) == sorted(texts)  # every text sent exactly once
    expected = FakeEmbedder(16).embed_documents(texts)
    for vectors in results:
        np.testing.assert_allclose(vectors, expected, rtol=1e-6)


# -- stale claims ------------------------------------------------------------------------------
def _exited_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize(
    "who", ["dead process on this host", "earlier process with our pid", "expired lease elsewhere"]
)
def test_stale_claims_are_taken_over_at_once(tmp_path, who: str) -> None:
    import socket

    inner = SlowSummarizer(0.0)
    cache = BuildCache(tmp_path, lease=30.0)
    cache.stats()  # creates the file
    key = _key(inner, cache)
    host, pid, expires = socket.gethostname(), _exited_pid(), time.time() + 3600
    if who == "earlier process with our pid":
        pid = os.getpid()
    elif who == "expired lease elsewhere":
        host, expires = "another-machine", time.time() - 1
    _claim_row(tmp_path, key, host=host, pid=pid, expires=expires)
    start = time.perf_counter()
    assert CachedSummarizer(inner, cache).summarize(TEXTS, max_tokens=5)
    assert time.perf_counter() - start < 1.0
    assert len(inner.calls) == 1


def test_a_live_claim_elsewhere_holds_until_its_lease_expires(tmp_path) -> None:
    inner = SlowSummarizer(0.0)
    cache = BuildCache(tmp_path, lease=30.0)
    cache.stats()
    _claim_row(
        tmp_path, _key(inner, cache), host="another-machine", pid=1, expires=time.time() + 1.0
    )
    start = time.perf_counter()
    CachedSummarizer(inner, cache).summarize(TEXTS, max_tokens=5)
    assert 0.9 <= time.perf_counter() - start < 5.0
    assert len(inner.calls) == 1


def test_a_waiter_waits_at_most_its_own_lease(tmp_path) -> None:
    """A claim promising to hold for ages (a stuck or hostile claimant) does not block."""
    inner = SlowSummarizer(0.0)
    cache = BuildCache(tmp_path, lease=1.0)
    cache.stats()
    _claim_row(tmp_path, _key(inner, cache), host="another-machine", pid=1, expires=1e300)
    start = time.perf_counter()
    CachedSummarizer(inner, cache).summarize(TEXTS, max_tokens=5)
    assert 0.9 <= time.perf_counter() - start < 5.0


@pytest.mark.parametrize(
    ("pid", "expires"),
    [
        (0, 1e300),
        (-1, 1e300),
        ("12", 1e300),
        (None, 1e300),
        (1.5, 1e300),
        (2**40, 1e300),  # os.kill would overflow
        (1, math.nan),
        (1, "tomorrow"),
    ],
)
def test_unreadable_claim_rows_are_stale_and_never_probed(
    tmp_path, monkeypatch, pid: object, expires: object
) -> None:
    import socket

    probed: list[object] = []
    real_kill = os.kill

    def recording_kill(target: int, sig: int) -> None:
        probed.append(target)
        real_kill(target, sig)

    monkeypatch.setattr(os, "kill", recording_kill)
    inner = SlowSummarizer(0.0)
    cache = BuildCache(tmp_path, lease=30.0)
    cache.stats()
    with sqlite3.connect(tmp_path / CACHE_FILE) as db:  # SQLite keeps whatever type it is given
        db.execute("DROP TABLE claims")
        db.execute("CREATE TABLE claims (key TEXT PRIMARY KEY, token, host, pid, expires)")
    _claim_row(tmp_path, _key(inner, cache), host=socket.gethostname(), pid=pid, expires=expires)
    start = time.perf_counter()
    CachedSummarizer(inner, cache).summarize(TEXTS, max_tokens=5)
    assert time.perf_counter() - start < 1.0
    assert all(isinstance(p, int) and p > 0 for p in probed)  # 0 or -1 would name groups


def test_lease_is_validated_where_used(tmp_path) -> None:
    for lease in (0, -1.0, "10", True):
        cache = BuildCache(tmp_path, lease=lease)  # type: ignore[arg-type]
        with pytest.raises(InvalidParameterError, match="lease"):
            CachedSummarizer(EchoSummarizer(), cache).summarize([str(lease)], max_tokens=5)


def test_cache_pickles_as_its_settings(tmp_path) -> None:
    import pickle

    cache = BuildCache(tmp_path, lease=7.0)
    cache.put_summary("k", "v")
    clone = pickle.loads(pickle.dumps(cache))
    assert clone.lease == 7.0 and clone.get_summary("k") == "v"


# -- async -------------------------------------------------------------------------------------
async def test_an_async_waiter_keeps_the_event_loop_running(tmp_path) -> None:
    inner = SlowSummarizer(0.6)
    holder = threading.Thread(
        target=CachedSummarizer(inner, BuildCache(tmp_path)).summarize,
        args=(TEXTS,),
        kwargs={"max_tokens": 5},
    )
    holder.start()
    await asyncio.sleep(0.2)  # the thread holds the claim
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.ensure_future(tick())
    answer = await CachedSummarizer(inner, BuildCache(tmp_path)).asummarize(TEXTS, max_tokens=5)
    ticker.cancel()
    holder.join()
    assert answer == "alpha beta gamma delta epsilon" and len(inner.calls) == 1
    assert ticks >= 15  # about 0.4 s of waiting: the loop ran all along


async def test_a_cancelled_async_call_releases_its_claim(tmp_path) -> None:
    started = asyncio.Event()

    class Hanging(EchoSummarizer):
        async def asummarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
            started.set()
            await asyncio.sleep(30)
            return "never"

    task = asyncio.ensure_future(
        CachedSummarizer(Hanging(), BuildCache(tmp_path)).asummarize(TEXTS, max_tokens=5)
    )
    await started.wait()
    assert len(_claims(tmp_path)) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _claims(tmp_path) == []


# -- real processes ----------------------------------------------------------------------------
BUILD_CHILD = textwrap.dedent(
    """
    import hashlib, json, os, sys, time
    sys.path.insert(0, {tests!r})
    import openai  # imported before "ready", so the builds start together
    from openai_server import CORPUS, openai_builder, tree_signature

    url, cache, out = sys.argv[1], sys.argv[2], sys.argv[3]
    open(out + ".ready", "w").close()
    while not os.path.exists(os.path.join(os.path.dirname(out), "go")):
        time.sleep(0.01)
    tree = openai_builder(url, cache=cache, max_concurrency=2, timeout=60.0).build(CORPUS)
    result = {{
        "signature": tree_signature(tree),
        "embeddings": hashlib.sha256(tree.embeddings.tobytes()).hexdigest(),
        "usage": tree.build_info["usage"],
    }}
    with open(out, "w") as f:
        json.dump(result, f)
    """
)


@pytest.mark.slow
def test_four_processes_building_one_tree_pay_for_each_request_once(tmp_path) -> None:
    with FakeOpenAIServer() as srv:
        reference = openai_builder(srv.url).build(CORPUS)
    n_summaries = len(reference) - len(reference.leaves)
    script = tmp_path / "child.py"
    script.write_text(BUILD_CHILD.format(tests=str(TESTS_DIR)), encoding="utf-8")
    outs = [tmp_path / f"build{i}.json" for i in range(4)]
    with FakeOpenAIServer(delay=0.1, embed_delay=0.05) as srv:
        procs = [
            subprocess.Popen(
                [sys.executable, str(script), srv.url, str(tmp_path / "cache"), str(out)]
            )
            for out in outs
        ]
        deadline = time.monotonic() + 60
        while not all(Path(f"{out}.ready").exists() for out in outs):
            assert time.monotonic() < deadline, "children did not start"
            assert all(p.poll() is None for p in procs), "a child failed to start"
            time.sleep(0.02)
        (tmp_path / "go").touch()
        assert [p.wait(timeout=90) for p in procs] == [0, 0, 0, 0]
        chat, embeddings = srv.requests("chat"), srv.requests("embeddings")

    # The server saw each distinct summary request once, and nothing else on that endpoint.
    assert all(r.ok for r in chat + embeddings)
    assert Counter(r.key for r in chat).most_common(1)[0][1] == 1
    assert len(chat) == n_summaries
    # Each text was embedded in exactly one request.
    sent = Counter(text for r in embeddings for text in r.inputs)
    assert sent.most_common(1)[0][1] == 1
    # Every process built the same tree as a process alone, and between them paid once.
    results = [json.loads(out.read_text()) for out in outs]
    expected = json.loads(json.dumps(tree_signature(reference)))
    expected_vectors = hashlib.sha256(reference.embeddings.tobytes()).hexdigest()
    for result in results:
        assert result["signature"] == expected
        assert result["embeddings"] == expected_vectors
    assert sum(r["usage"]["summarize"]["calls"] for r in results) == n_summaries
    assert sum(r["usage"]["summarize"]["cache_hits"] for r in results) == 3 * n_summaries


SUMMARY_CHILD = textwrap.dedent(
    """
    import logging, sys
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("raptor_core.build.cache").setLevel(logging.DEBUG)
    from raptor_core.backends.openai import OpenAISummarizer
    from raptor_core.build.cache import BuildCache, CachedSummarizer

    url, cache = sys.argv[1], sys.argv[2]
    llm = OpenAISummarizer("fake-chat", base_url=url, api_key="sk-test", timeout=60, max_retries=0)
    summarizer = CachedSummarizer(llm, BuildCache(cache, lease=60))
    print(summarizer.summarize(["alpha beta gamma", "delta epsilon"], max_tokens=20), flush=True)
    """
)


def _lines(stream: object) -> queue.Queue[str]:
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in stream:  # type: ignore[attr-defined]
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _wait_for(lines: queue.Queue[str], needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            continue
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"{needle!r} not seen in {seen}")


@pytest.mark.slow
@pytest.mark.parametrize("reaped", [True, False])
def test_a_sigkilled_claimant_does_not_block_the_others(tmp_path, reaped: bool) -> None:
    if not reaped and not Path("/proc/self/stat").exists():
        pytest.skip("telling a zombie from a live process needs /proc")
    script = tmp_path / "child.py"
    script.write_text(SUMMARY_CHILD, encoding="utf-8")
    first_request = threading.Event()
    unblock = threading.Event()

    def hang_the_first(record: Record) -> None:
        if record.endpoint == "chat" and not first_request.is_set():
            first_request.set()
            unblock.wait(30)  # the claimant waits for an answer that never comes

    with FakeOpenAIServer(on_request=hang_the_first) as srv:
        args = [sys.executable, str(script), srv.url, str(tmp_path / "cache")]
        claimant = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        try:
            assert first_request.wait(60), "the claimant never asked"
            waiter = subprocess.Popen(
                args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            _wait_for(_lines(waiter.stderr), "waiting for another claimant", timeout=60)
            assert len(srv.requests("chat")) == 1  # the waiter waits, it does not ask
            claimant.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            if reaped:
                claimant.wait(timeout=10)
            waiter.wait(timeout=60)
            took = time.monotonic() - killed
            assert waiter.stdout is not None
            out = waiter.stdout.read()
        finally:
            unblock.set()
            claimant.kill()
            claimant.wait(timeout=10)
        assert waiter.returncode == 0
        assert out.strip().startswith("S")  # the server's summary
        assert took < 10.0  # far below the 60 s lease: the dead claimant was detected
        assert len(srv.requests("chat")) == 2  # the killed one, and the waiter's
