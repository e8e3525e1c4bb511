"""The content-addressed build cache: no work lost, nothing paid twice."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest
from openai_server import CORPUS, GroupClusterer, tree_signature

from raptor_core.backends.openai import OpenAIEmbedder, OpenAISummarizer
from raptor_core.build.builder import TYPICAL_CLUSTER_SIZE, TreeBuilder
from raptor_core.build.cache import (
    CACHE_FILE,
    BuildCache,
    CachedEmbedder,
    CachedSummarizer,
    component_identity,
)
from raptor_core.build.summarizers import ExtractiveSummarizer, LLMSummarizer
from raptor_core.exceptions import CacheError, InvalidParameterError, SummarizationError
from raptor_core.testing import EchoSummarizer, FakeEmbedder, ScriptedLLM, WhitespaceTokenizer
from raptor_core.types import AsyncEmbedder, AsyncSummarizer, Embedder, Summarizer

pytestmark = pytest.mark.timeout(60)


class CountingEmbedder(FakeEmbedder):
    """FakeEmbedder that records every batch and fails on call number ``fail_on`` if set.

    ``fail_on`` is an attribute, not a constructor parameter, so a failing instance has the
    same cache identity as a healthy one (as a real service that fails, then recovers).
    """

    fail_on: int | None = None

    def __init__(self, dim: int = 16, *, batch_size: int | None = None) -> None:
        super().__init__(dim)
        if batch_size is not None:
            self.batch_size = batch_size
        self.batches: list[list[str]] = []

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        self.batches.append(list(texts))
        if self.fail_on is not None and len(self.batches) == self.fail_on:
            raise RuntimeError("embedding service down")
        return super().embed_documents(texts)


class FlakySummarizer(EchoSummarizer):
    """EchoSummarizer that fails on call number ``fail_on`` (an attribute, as above)."""

    fail_on: int | None = None

    def summarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        if self.fail_on is not None and len(self.calls) + 1 == self.fail_on:
            self.calls.append(("<failed>",))
            raise RuntimeError("service unavailable")
        return super().summarize(texts, max_tokens=max_tokens)


class SlowEcho(EchoSummarizer):
    def summarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        answer = super().summarize(texts, max_tokens=max_tokens)
        time.sleep(0.02)
        return answer


def make_builder(cache, summarizer=None, embedder=None, **kwargs) -> TreeBuilder:
    params = {
        "tokenizer": WhitespaceTokenizer(),
        "clusterer": GroupClusterer(),
        "chunk_max_tokens": 12,
        "summary_max_tokens": 12,
        "max_concurrency": 1,
        "cache": cache,
    }
    params.update(kwargs)
    return TreeBuilder(embedder or CountingEmbedder(), summarizer or EchoSummarizer(), **params)


# -- BuildCache --------------------------------------------------------------------------------
def test_round_trip_and_persistence(tmp_path) -> None:
    vector = np.linspace(-1, 1, 7, dtype=np.float32)
    with BuildCache(tmp_path / "c") as cache:
        key = BuildCache.summary_key("ns", ["a", "b"], 100)
        cache.put_summary(key, "résumé 総括")
        cache.put_embeddings({"e1": vector})
        assert cache.stats() == {"summaries": 1, "embeddings": 1}
    again = BuildCache(tmp_path / "c")
    assert again.get_summary(key) == "résumé 総括"
    got = again.get_embeddings(["e1", "missing"])
    assert list(got) == ["e1"]
    np.testing.assert_array_equal(got["e1"], vector)
    assert got["e1"].dtype == np.float32
    again.clear()
    assert again.stats() == {"summaries": 0, "embeddings": 0}
    again.close()


def test_keys_name_exactly_what_produced_the_answer() -> None:
    base = BuildCache.summary_key("model-a", ["x", "y"], 100)
    assert base == BuildCache.summary_key("model-a", ("x", "y"), 100)
    assert base != BuildCache.summary_key("model-b", ["x", "y"], 100)
    assert base != BuildCache.summary_key("model-a", ["y", "x"], 100)
    assert base != BuildCache.summary_key("model-a", ["x", "y"], 50)
    assert base != BuildCache.summary_key("model-a", ["x y"], 100)
    assert BuildCache.embedding_key("m", "t") != BuildCache.embedding_key("m2", "t")
    assert len(base) == 64


def test_stored_as_plain_sqlite_rows_never_pickled(tmp_path) -> None:
    vector = np.arange(5, dtype=np.float32)
    with BuildCache(tmp_path) as cache:
        cache.put_embeddings({"k": vector})
        cache.put_summary("s", "text")
    with sqlite3.connect(tmp_path / CACHE_FILE) as db:
        dim, blob = db.execute("SELECT dim, vector FROM embeddings").fetchone()
        (summary,) = db.execute("SELECT summary FROM summaries").fetchone()
    assert dim == 5 and blob == vector.astype("<f4").tobytes()
    assert summary == "text"


@pytest.mark.parametrize(
    "content",
    [
        b"this is not a database" * 100,  # garbage
        b"SQLite format 3\x00" + b"\x00" * 50,  # a truncated header
    ],
)
def test_unreadable_cache_is_a_typed_error_and_clear_starts_afresh(tmp_path, content) -> None:
    (tmp_path / CACHE_FILE).write_bytes(content)
    cache = BuildCache(tmp_path)
    with pytest.raises(CacheError, match=r"--no-resume") as info:
        cache.get_summary("k")
    assert str(tmp_path) in str(info.value)
    assert (tmp_path / CACHE_FILE).read_bytes() == content  # never moved or deleted unasked
    cache.clear()  # what --no-resume does
    cache.put_summary("k", "v")
    assert cache.get_summary("k") == "v"
    cache.close()


def test_cache_path_that_is_a_file_is_a_parameter_error(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidParameterError, match="not a directory"):
        BuildCache(tmp_path / "file").get_summary("k")


def test_threads_share_one_cache(tmp_path) -> None:
    cache = BuildCache(tmp_path)

    def work(t: int) -> None:
        for i in range(40):
            cache.put_summary(f"{t}-{i}", f"summary {t} {i}")
            cache.put_embeddings({f"{t}-{i}": np.full(4, t + i + 1, dtype=np.float32)})
            assert cache.get_summary(f"{t}-{i}") == f"summary {t} {i}"

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert cache.stats() == {"summaries": 240, "embeddings": 240}
    cache.close()


def test_a_killed_writer_keeps_every_committed_entry(tmp_path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        from raptor_core.build.cache import BuildCache
        cache = BuildCache({str(tmp_path)!r})
        for i in range(100000):
            cache.put_summary(f"k{{i}}", "x" * 2000)
            print(i, flush=True)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    acknowledged = -1
    for line in proc.stdout:
        acknowledged = int(line)
        if acknowledged >= 30:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    with BuildCache(tmp_path) as cache:
        assert all(cache.get_summary(f"k{i}") == "x" * 2000 for i in range(acknowledged + 1))


# -- identity ----------------------------------------------------------------------------------
def test_identity_of_an_openai_summarizer() -> None:
    a = OpenAISummarizer("gpt-x", api_key="sk-secret", base_url="http://a/v1", timeout=5)
    b = OpenAISummarizer(
        "gpt-x", api_key="sk-other", base_url="http://b/v1", timeout=9, max_retries=1
    )
    assert component_identity(a) == component_identity(b)  # same answers, whoever serves them
    identity = component_identity(a)
    assert identity["model"] == "gpt-x" and "{context}" in identity["prompt"]
    assert "sk-secret" not in str(identity) and "base_url" not in identity
    assert component_identity(OpenAISummarizer("gpt-y")) != identity
    assert component_identity(OpenAISummarizer("gpt-x", prompt="Sum up: {context}")) != identity
    embed = component_identity(OpenAIEmbedder("e", dimensions=256, max_concurrency=9))
    assert embed["dimensions"] == 256 and "max_concurrency" not in embed


def test_identity_uses_constructor_params_and_nests() -> None:
    embedder = FakeEmbedder(8)
    before = component_identity(embedder)
    embedder.embed_documents(["changes counters"])
    assert (
        component_identity(embedder)
        == before
        == {"class": "raptor_core.testing.FakeEmbedder", "dim": 8}
    )
    nested = component_identity(LLMSummarizer(ScriptedLLM(default="ok"), prompt="P {context}"))
    assert nested["prompt"] == "P {context}"
    assert nested["llm"] == {"class": "raptor_core.testing.ScriptedLLM", "default": "ok"}
    extractive = component_identity(ExtractiveSummarizer(FakeEmbedder(4)))
    assert extractive["embedder"]["dim"] == 4


# -- wrappers ----------------------------------------------------------------------------------
def test_cached_summarizer(tmp_path) -> None:
    inner = EchoSummarizer()
    cache = BuildCache(tmp_path)
    wrapped = CachedSummarizer(inner, cache)
    assert isinstance(wrapped, Summarizer) and isinstance(wrapped, AsyncSummarizer)
    assert getattr(wrapped, "summarize_batch", None) is None  # EchoSummarizer has none
    first = wrapped.summarize(["a b c", "d e"], max_tokens=3)
    assert wrapped.summarize(["a b c", "d e"], max_tokens=3) == first == "a b c"
    assert wrapped.summarize(["a b c", "d e"], max_tokens=4) == "a b c d"
    assert len(inner.calls) == 2
    assert asyncio.run(wrapped.asummarize(["a b c", "d e"], max_tokens=3)) == first
    assert wrapped.usage.snapshot() == {"cache_hits": 2, "cache_misses": 2}
    # another wrapper (a resumed build) over the same cache: no new call
    assert (
        CachedSummarizer(EchoSummarizer(), cache).summarize(["a b c", "d e"], max_tokens=3) == first
    )


def test_empty_summaries_are_not_cached(tmp_path) -> None:
    llm = ScriptedLLM(["  ", "real summary"])
    wrapped = CachedSummarizer(LLMSummarizer(llm), BuildCache(tmp_path))
    with pytest.raises(SummarizationError, match="empty"):
        wrapped.summarize(["text"], max_tokens=5)
    assert wrapped.summarize(["text"], max_tokens=5) == "real summary"
    assert len(llm.prompts) == 2


def test_cached_summarizer_batch_passthrough(tmp_path) -> None:
    class Batch:
        def __init__(self) -> None:
            self.seen: list[list[tuple[str, ...]]] = []

        def summarize(self, texts, *, max_tokens):
            return self.summarize_batch([texts], max_tokens=max_tokens)[0]

        def summarize_batch(self, clusters, *, max_tokens):
            self.seen.append([tuple(c) for c in clusters])
            return [" ".join(c)[:max_tokens] or "" for c in clusters]

    inner = Batch()
    wrapped = CachedSummarizer(inner, BuildCache(tmp_path))
    assert wrapped.summarize_batch([["a"], ["b"]], max_tokens=5) == ["a", "b"]
    assert wrapped.summarize_batch([["a"], ["c"], ["b"]], max_tokens=5) == ["a", "c", "b"]
    assert inner.seen == [[("a",), ("b",)], [("c",)]]  # only the miss went through


def test_cached_embedder_dedups_groups_and_commits_per_group(tmp_path) -> None:
    cache = BuildCache(tmp_path)
    inner = CountingEmbedder(batch_size=2)
    inner.fail_on = 3
    wrapped = CachedEmbedder(inner, cache)
    assert isinstance(wrapped, Embedder) and isinstance(wrapped, AsyncEmbedder)
    texts = ["t0", "t1", "t0", "t2", "t3", "t4", "t5"]
    with pytest.raises(RuntimeError, match="down"):
        wrapped.embed_documents(texts)
    assert inner.batches == [["t0", "t1"], ["t2", "t3"], ["t4", "t5"]]  # t0 sent once
    assert cache.stats()["embeddings"] == 4  # the groups before the failure are kept
    resumed = CountingEmbedder(batch_size=2)
    vectors = CachedEmbedder(resumed, cache).embed_documents(texts)
    assert resumed.batches == [["t4", "t5"]]
    np.testing.assert_allclose(vectors, FakeEmbedder(16).embed_documents(texts), rtol=1e-6)


def test_cached_embedder_does_not_cache_unusable_vectors(tmp_path) -> None:
    class Broken:
        def embed_documents(self, texts):
            out = np.ones((len(texts), 3), dtype=np.float32)
            out[0] = np.nan
            out[1] = 0.0
            return out

        def embed_query(self, text):
            return np.ones(3, dtype=np.float32)

    cache = BuildCache(tmp_path)
    vectors = CachedEmbedder(Broken(), cache).embed_documents(["nan", "zero", "fine"])
    assert np.isnan(vectors[0]).all() and not vectors[1].any()  # returned for the builder to reject
    assert cache.stats()["embeddings"] == 1


async def test_cached_embedder_async_and_queries(tmp_path) -> None:
    inner = CountingEmbedder()
    wrapped = CachedEmbedder(inner, BuildCache(tmp_path))
    first = await wrapped.aembed_documents(["x", "y"])
    again = await wrapped.aembed_documents(["y", "x"])
    np.testing.assert_array_equal(first[::-1], again)
    assert len(inner.batches) == 1
    np.testing.assert_array_equal(await wrapped.aembed_query("x"), inner.embed_query("x"))
    assert wrapped.usage.snapshot() == {"cache_hits": 2, "cache_misses": 2}


# -- builder integration -----------------------------------------------------------------------
def test_rebuild_makes_no_calls_and_gives_the_same_tree(tmp_path) -> None:
    first_summarizer, first_embedder = EchoSummarizer(), CountingEmbedder()
    first = make_builder(tmp_path, first_summarizer, first_embedder).build(CORPUS)
    assert first_summarizer.calls and first_embedder.batches
    summarizer, embedder = EchoSummarizer(), CountingEmbedder()
    second = make_builder(tmp_path, summarizer, embedder).build(CORPUS)
    assert summarizer.calls == [] and embedder.batches == []
    assert tree_signature(second) == tree_signature(first)
    np.testing.assert_array_equal(second.embeddings, first.embeddings)
    for layer in second.build_info["layers"][1:]:
        assert layer["usage"]["summarize"] == {"cache_hits": layer["nodes"], "cache_misses": 0}
    assert second.params["summarizer"]["class"] == "raptor_core.testing.EchoSummarizer"


def test_changed_settings_miss_only_what_they_change(tmp_path) -> None:
    tree = make_builder(tmp_path).build(CORPUS)
    summarizer, embedder = EchoSummarizer(), CountingEmbedder()
    make_builder(tmp_path, summarizer, embedder, summary_max_tokens=9).build(CORPUS)
    assert summarizer.calls  # new summary length: new summaries
    leaves = {n.text for n in tree.leaves}
    assert embedder.batches and not leaves & {t for b in embedder.batches for t in b}  # cached


def test_resume_after_an_exception_makes_only_the_missing_calls(tmp_path) -> None:
    reference = make_builder(None).build(CORPUS)
    n_summaries = len(reference) - len(reference.leaves)
    failing = FlakySummarizer()
    failing.fail_on = 5
    with pytest.raises(SummarizationError, match="service unavailable"):
        make_builder(tmp_path, failing).build(CORPUS)
    summarizer = FlakySummarizer()
    resumed = make_builder(tmp_path, summarizer).build(CORPUS)
    assert len(summarizer.calls) == n_summaries - 4  # the four answers before the failure are kept
    assert tree_signature(resumed) == tree_signature(reference)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_ctrl_c_stops_spending_and_resumes(tmp_path, concurrency: int) -> None:
    reference = make_builder(None).build(CORPUS)
    n_summaries = len(reference) - len(reference.leaves)
    summarizer = SlowEcho()  # 20 ms a call: workers cannot race far ahead of the interrupt
    started_before_interrupt = []

    def progress(stage: str, done: int, total: int) -> None:
        if stage == "summarize" and done == 3:
            started_before_interrupt.append(len(summarizer.calls))
            raise KeyboardInterrupt

    builder = make_builder(tmp_path, summarizer, max_concurrency=concurrency, progress=progress)
    with pytest.raises(KeyboardInterrupt):
        builder.build(CORPUS)
    spent = len(summarizer.calls)
    # what was in flight finishes, nothing new starts
    assert spent <= started_before_interrupt[0] + concurrency
    again = SlowEcho()
    resumed = make_builder(tmp_path, again, max_concurrency=concurrency).build(CORPUS)
    assert len(again.calls) == n_summaries - spent
    assert tree_signature(resumed) == tree_signature(reference)


async def test_abuild_uses_the_cache(tmp_path) -> None:
    first = await make_builder(tmp_path).abuild(CORPUS)
    summarizer, embedder = EchoSummarizer(), CountingEmbedder()
    second = await make_builder(tmp_path, summarizer, embedder).abuild(CORPUS)
    assert summarizer.calls == [] and embedder.batches == []
    assert tree_signature(second) == tree_signature(first)


def test_cache_argument_is_validated() -> None:
    with pytest.raises(InvalidParameterError, match="cache"):
        make_builder(123).build(CORPUS)


# -- estimate ----------------------------------------------------------------------------------
class Forbidden:
    """A model that must not be called."""

    batch_size = 64

    def embed_documents(self, texts):
        raise AssertionError("estimate called the embedder")

    def embed_query(self, text):
        raise AssertionError("estimate called the embedder")

    def summarize(self, texts, *, max_tokens):
        raise AssertionError("estimate called the summariser")


def test_estimate_calls_no_model_and_projects_layers() -> None:
    docs = CORPUS * 6
    builder = make_builder(None, Forbidden(), Forbidden())
    estimate = builder.estimate(docs)
    tree = make_builder(None).build(docs)
    assert estimate.documents == len(docs) and estimate.chunks == len(tree.leaves)
    layer0, layer1 = estimate.layers[0], estimate.layers[1]
    assert layer0.embed_tokens == sum(n.token_count for n in tree.leaves) and layer0.calls == 0
    assert layer1.calls == -(-layer0.nodes // TYPICAL_CLUSTER_SIZE)
    assert layer1.prompt_tokens >= layer0.embed_tokens  # every leaf is read once
    assert layer1.completion_tokens == layer1.calls * 12
    assert estimate.calls == sum(x.calls for x in estimate.layers) > 0
    assert estimate.to_dict()["calls"] == estimate.calls


def test_estimate_counts_the_prompt_template() -> None:
    docs = CORPUS * 6
    plain = make_builder(None, EchoSummarizer()).estimate(docs)
    with_llm = make_builder(None, OpenAISummarizer("m", api_key="k")).estimate(docs)
    assert with_llm.calls == plain.calls
    assert with_llm.prompt_tokens > plain.prompt_tokens  # template and system message per call
