"""HTTP 200 with an invalid body: retried like a 5xx, then a typed error; a build resumes.

The real ``openai`` client talks to the local server, which answers some requests with an
HTML page, cut JSON, JSON without ``choices`` or ``data``, non-text content, or embeddings
of the wrong count, size or type.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from typing import Any

import numpy as np
import pytest
from openai_server import (
    CORPUS,
    INVALID_BODY_FAULTS,
    LOCALHOST,
    FakeOpenAIServer,
    fake_completion,
    fake_embedding,
    faults_in_order,
    openai_builder,
    tree_signature,
)

from raptor_core.backends.openai import OpenAIChatLLM, OpenAIEmbedder
from raptor_core.exceptions import (
    EmbeddingError,
    EmbeddingResponseError,
    LLMRequestError,
    LLMResponseError,
)
from raptor_core.types import DEFAULT_SUMMARY_PROMPT

pytestmark = [*LOCALHOST, pytest.mark.timeout(120)]

KEY = "sk-test-invalid-0123456789"
FAST: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.05, "timeout": 5.0}
CHAT_FAULTS = INVALID_BODY_FAULTS["chat"]
EMBED_FAULTS = INVALID_BODY_FAULTS["embeddings"]


@pytest.fixture(autouse=True)
def _no_openai_env(monkeypatch):
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)


def _llm(server: FakeOpenAIServer, **kwargs: Any) -> OpenAIChatLLM:
    return OpenAIChatLLM("fake-chat", base_url=server.url, api_key=KEY, **{**FAST, **kwargs})


def _embedder(server: FakeOpenAIServer, **kwargs: Any) -> OpenAIEmbedder:
    params = {"base_url": server.url, "api_key": KEY, "max_concurrency": 1, **FAST, **kwargs}
    return OpenAIEmbedder("fake-embed", **params)


# -- chat ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", CHAT_FAULTS)
def test_chat_recovers_from_transient_invalid_bodies(fault: str) -> None:
    with FakeOpenAIServer(faults=faults_in_order(fault, fault)) as srv:
        llm = _llm(srv)
        assert llm.complete("a prompt about rivers") == fake_completion("a prompt about rivers")
        assert [r.fault for r in srv.requests()] == [fault, fault, None]
        usage = llm.usage.snapshot()
        assert usage["requests"] == 3 and usage["retries"] == 2 and usage["calls"] == 1


@pytest.mark.parametrize("fault", CHAT_FAULTS)
def test_chat_persistent_invalid_bodies_fail_typed_after_bounded_retries(fault: str) -> None:
    with FakeOpenAIServer(faults=lambda *_: fault) as srv:
        llm = _llm(srv, max_retries=2, backoff=0.1, max_backoff=1.0)
        with pytest.raises(LLMResponseError, match="invalid response") as info:
            llm.complete("never answered properly")
        assert isinstance(info.value, LLMRequestError)
        assert "on all 3 attempts" in str(info.value)
        records = srv.requests()
        assert len(records) == 3  # bounded: max_retries + 1
        # backoff between attempts: attempt i waits at least half of backoff * 2**i
        gaps = [b.started - (a.finished or a.started) for a, b in itertools.pairwise(records)]
        assert gaps[0] >= 0.05 and gaps[1] >= 0.1


def test_an_html_page_points_at_base_url() -> None:
    expected = r"not JSON: '<!DOCTYPE html>.*ends with /v1"
    with (
        FakeOpenAIServer(faults=lambda *_: "html") as srv,
        pytest.raises(LLMResponseError, match=expected),
    ):
        _llm(srv, max_retries=0).complete("x")


async def test_async_chat_retries_invalid_bodies_then_fails_typed() -> None:
    with FakeOpenAIServer(faults=faults_in_order("bad_json", "no_choices")) as srv:
        llm = _llm(srv)
        assert await llm.acomplete("async prompt") == fake_completion("async prompt")
        assert len(srv.requests()) == 3
        await llm.aclose()
    with FakeOpenAIServer(faults=lambda *_: "bad_content") as srv:
        llm = _llm(srv, max_retries=1)
        with pytest.raises(LLMResponseError, match="content is int, not text"):
            await llm.acomplete("x")
        assert len(srv.requests()) == 2
        await llm.aclose()


# -- embeddings ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", EMBED_FAULTS)
def test_embeddings_recover_from_transient_invalid_bodies(fault: str) -> None:
    texts = ["cats purr", "dogs bark", "rockets fly"]
    plan = faults_in_order(fault, fault, endpoint="embeddings")
    with FakeOpenAIServer(faults=plan) as srv:
        embedder = _embedder(srv)
        vectors = embedder.embed_documents(texts)
        expected = np.stack([fake_embedding(t, srv.dim) for t in texts])
        np.testing.assert_allclose(vectors, expected, rtol=1e-6)
        assert len(srv.requests("embeddings")) == 3
        assert embedder.usage.snapshot()["retries"] == 2


@pytest.mark.parametrize("fault", EMBED_FAULTS)
def test_embeddings_persistent_invalid_bodies_fail_typed(fault: str) -> None:
    with FakeOpenAIServer(faults=lambda *_: fault) as srv:
        embedder = _embedder(srv, max_retries=2)
        with pytest.raises(EmbeddingResponseError, match=r"invalid response.*on all 3 attempts"):
            embedder.embed_documents(["one text", "another text"])
        assert isinstance(EmbeddingResponseError("x"), EmbeddingError)
        assert len(srv.requests()) == 3


def test_a_vector_size_change_between_requests_is_an_invalid_response() -> None:
    """A server that switches models mid-build: the new size is rejected, not mixed in."""
    with FakeOpenAIServer() as srv:
        embedder = _embedder(srv, max_retries=1)
        assert embedder.embed_documents(["first"]).shape == (1, srv.dim)
        srv.dim = srv.dim // 2
        with pytest.raises(
            EmbeddingResponseError, match=rf"size {srv.dim}, expected {srv.dim * 2}"
        ):
            embedder.embed_documents(["second"])


async def test_async_embeddings_retry_invalid_bodies() -> None:
    plan = faults_in_order("wrong_count", "not_numbers", endpoint="embeddings")
    with FakeOpenAIServer(faults=plan) as srv:
        embedder = _embedder(srv)
        vectors = await embedder.aembed_documents(["a b", "c d"])
        assert vectors.shape == (2, srv.dim)
        assert len(srv.requests()) == 3
        await embedder.aclose()


# -- in a build: the error names the cluster, and a rerun pays only for what is missing ----------
def _prompt_of(tree, node_id: str) -> str:
    context = "\n\n".join(tree.node(c).text for c in tree.node(node_id).children)
    return DEFAULT_SUMMARY_PROMPT.replace("{context}", context)


@pytest.mark.parametrize("fault", ["html", "no_choices"])
def test_build_names_the_cluster_and_a_rerun_makes_only_the_missing_requests(
    tmp_path, fault: str
) -> None:
    with FakeOpenAIServer() as srv:
        reference = openai_builder(srv.url).build(CORPUS)
    n_summaries = len(reference) - len(reference.leaves)

    def broken_for_rivers(endpoint: str, key: str, attempt: int) -> str | None:
        return fault if endpoint == "chat" and "rivers" in key else None

    cache = tmp_path / "cache"
    with FakeOpenAIServer(faults=broken_for_rivers) as srv:
        builder = openai_builder(srv.url, cache=cache, max_retries=2, max_concurrency=2)
        with pytest.raises(LLMResponseError) as info:
            builder.build(CORPUS)
        first_run = srv.requests("chat")
    message = str(info.value)
    match = re.match(r"layer 1, cluster (\d+) \(\d+ nodes\): chat model", message)
    assert match, message
    assert "invalid response" in message and "on all 3 attempts" in message
    # Layer nodes come in cluster order: the failing cluster is that node of layer 1.
    failed = reference.layer(1)[int(match.group(1))].id
    assert "rivers" in _prompt_of(reference, failed)
    faulted: dict[str, int] = {}
    for record in first_run:
        if record.fault:
            faulted[record.key] = faulted.get(record.key, 0) + 1
    assert faulted and all(n == 3 for n in faulted.values())  # bounded per cluster
    answered = {r.key for r in first_run if r.ok}
    assert answered  # clusters without "rivers" were answered (and cached) before the stop

    with FakeOpenAIServer() as fixed:  # the server is fixed: rerun
        tree = openai_builder(fixed.url, cache=cache, max_concurrency=2).build(CORPUS)
        rerun = fixed.requests("chat")
    assert not {r.key for r in rerun} & answered  # nothing answered before is bought again
    assert len(rerun) == n_summaries - len(answered)
    assert tree_signature(tree) == tree_signature(reference)


def test_build_with_invalid_embeddings_names_the_layer(tmp_path) -> None:
    def ragged_for_bread(endpoint: str, key: str, attempt: int) -> str | None:
        return "wrong_dim" if endpoint == "embeddings" and "bread" in key else None

    with FakeOpenAIServer(faults=ragged_for_bread) as srv:
        builder = openai_builder(srv.url, cache=tmp_path, max_retries=1, max_concurrency=1)
        with pytest.raises(EmbeddingResponseError, match=r"^layer 0, embedding texts 0\.\.\d+: "):
            builder.build(CORPUS)


def test_slow_retries_of_invalid_bodies_follow_the_backoff_cap() -> None:
    """The backoff of invalid bodies is the same as for a 5xx: capped by max_backoff."""
    with FakeOpenAIServer(faults=faults_in_order(*["bad_json"] * 4)) as srv:
        llm = _llm(srv, backoff=0.05, max_backoff=0.1)
        start = time.perf_counter()
        llm.complete("capped")
        elapsed = time.perf_counter() - start
        # waits: >= 0.025, 0.05, 0.05, 0.05 (capped at 0.1, halved by jitter at worst)
        assert elapsed >= 0.175
        assert len(srv.requests()) == 5


def test_async_summaries_in_abuild_name_the_cluster() -> None:
    def broken(endpoint: str, key: str, attempt: int) -> str | None:
        return "bad_json" if endpoint == "chat" and "cats" in key else None

    with FakeOpenAIServer(faults=broken) as srv:
        builder = openai_builder(srv.url, max_retries=1)
        with pytest.raises(LLMResponseError, match=r"^layer 1, cluster \d+ .*not valid JSON"):
            asyncio.run(builder.abuild(CORPUS))
