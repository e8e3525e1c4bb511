"""Fault injection (429, 500, timeouts, dropped connections, empty answers) and fail-fast errors."""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from typing import Any

import numpy as np
import pytest
from openai_server import (
    CORPUS,
    LOCALHOST,
    FakeOpenAIServer,
    fake_completion,
    fault_share,
    faults_in_order,
    openai_builder,
    tree_signature,
)

from raptor_core.backends.openai import OpenAIChatLLM, OpenAIEmbedder, _retry_after
from raptor_core.cli import main
from raptor_core.exceptions import (
    LLMAuthenticationError,
    LLMError,
    LLMRequestError,
    LLMResponseError,
    LLMTimeoutError,
)

pytestmark = [*LOCALHOST, pytest.mark.timeout(120)]

KEY = "sk-proj-SECRET-abcdef0123456789"
FAST: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.05}


@pytest.fixture(autouse=True)
def _no_openai_env(monkeypatch):
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def clean_tree():
    with FakeOpenAIServer() as srv:
        return openai_builder(srv.url).build(CORPUS)


def _llm(server: FakeOpenAIServer, **kwargs) -> OpenAIChatLLM:
    params: dict[str, Any] = {"base_url": server.url, "api_key": KEY, "timeout": 2.0, **FAST}
    params.update(kwargs)
    return OpenAIChatLLM("fake-chat", **params)


# -- a faulty server still gives exactly the fault-free tree -------------------------------------
@pytest.mark.parametrize("mode", ["build", "abuild"])
def test_build_survives_every_kind_of_transient_fault(clean_tree, mode: str) -> None:
    kinds = ["429", "500", "slow", "drop", "empty"]
    plan = fault_share(kinds, 0.5, endpoints=("chat", "embeddings"), attempts=2)
    with FakeOpenAIServer(faults=plan, slow_seconds=0.6, retry_after="0.05") as srv:
        builder = openai_builder(srv.url, timeout=0.3)
        tree = builder.build(CORPUS) if mode == "build" else asyncio.run(builder.abuild(CORPUS))
        faults = {r.fault for r in srv.requests() if r.fault}
        assert faults == set(kinds)  # every kind was injected at least once
        n_clusters = len(tree) - len(tree.leaves)
        assert len(srv.successes("chat")) == n_clusters  # nothing paid twice
        assert tree_signature(tree) == tree_signature(clean_tree)
        np.testing.assert_array_equal(tree.embeddings, clean_tree.embeddings)
        usage = tree.build_info["usage"]
        assert usage["summarize"]["retries"] > 0 and usage["embed"]["retries"] > 0
        assert usage["summarize"]["calls"] == n_clusters


def test_retry_after_is_honoured() -> None:
    with FakeOpenAIServer(faults=faults_in_order("429"), retry_after="0.4") as srv:
        llm = _llm(srv)
        start = time.perf_counter()
        llm.complete("hello there")
        elapsed = time.perf_counter() - start
        assert elapsed >= 0.4  # never earlier than asked, though the backoff step is 10 ms
        first, second = srv.requests("chat")
        assert first.finished is not None
        assert second.started - first.finished >= 0.39
        assert llm.usage.snapshot()["retries"] == 1


def test_retry_after_header_forms() -> None:
    assert _retry_after({"retry-after": "2"}) == 2.0
    assert _retry_after({"retry-after": "0.25"}) == 0.25
    assert _retry_after({"retry-after-ms": "150", "retry-after": "9"}) == 0.15
    when = format_datetime(datetime.now(timezone.utc) + timedelta(seconds=30), usegmt=True)
    assert 25 <= (_retry_after({"retry-after": when}) or 0) <= 31
    assert _retry_after({"retry-after": "soon"}) is None
    assert _retry_after({}) is None


def test_exponential_backoff_grows_with_jitter() -> None:
    llm = OpenAIChatLLM("m", api_key="k", backoff=1.0, max_backoff=8.0)
    for attempt, step in [(0, 1.0), (1, 2.0), (2, 4.0), (3, 8.0), (6, 8.0)]:
        delays = {llm._delay(attempt, None) for _ in range(20)}
        assert all(step / 2 <= d <= step for d in delays)
        assert len(delays) > 1  # jitter


def test_persistent_rate_limit_is_reported_after_the_retries() -> None:
    with FakeOpenAIServer(faults=lambda *_: "429", retry_after="0.01") as srv:
        with pytest.raises(LLMError, match=r"429.*lower max_concurrency"):
            _llm(srv, max_retries=2).complete("x")
        assert len(srv.requests()) == 3


def test_persistent_timeouts_raise_llm_timeout_error() -> None:
    with FakeOpenAIServer(faults=lambda *_: "slow", slow_seconds=0.4) as srv:
        with pytest.raises(LLMTimeoutError, match=r"did not answer within 0.15s.*--timeout"):
            _llm(srv, timeout=0.15, max_retries=1).complete("x")
        assert len(srv.requests()) == 2


def test_empty_completions_are_retried_then_reported() -> None:
    with FakeOpenAIServer(faults=faults_in_order("empty", "empty")) as srv:
        assert _llm(srv).complete("three tries") == fake_completion("three tries")
        assert len(srv.requests()) == 3
    with FakeOpenAIServer(faults=lambda *_: "empty") as srv:
        llm = _llm(srv, max_retries=2)
        with pytest.raises(
            LLMResponseError, match=r"invalid response \(an empty completion\) on all 3 attempts"
        ):
            llm.complete("never")
        usage = llm.usage.snapshot()
        assert usage["requests"] == 3 and usage["calls"] == 0 and usage["retries"] == 2


def test_truncated_completions() -> None:
    with FakeOpenAIServer(faults=faults_in_order("truncated")) as srv:
        assert _llm(srv).complete("a prompt with words") == fake_completion("a prompt with words")
        assert [r.fault for r in srv.requests()] == ["truncated", None]  # retried once
    with FakeOpenAIServer(faults=lambda *_: "truncated") as srv:
        llm = _llm(srv)
        answer = llm.complete("a prompt with many words in it")  # "retry": kept after one retry
        assert answer and llm.usage.snapshot()["truncated"] == 1
        assert len(srv.requests()) == 2  # not max_retries + 1: the same cut text is not bought 7x
        _llm(srv, on_truncated="keep").complete("kept at once")
        assert len(srv.requests()) == 3
        with pytest.raises(LLMError, match=r"cut the completion at max_tokens.*summary_max_tokens"):
            _llm(srv, on_truncated="error").complete("strict")
        assert len(srv.requests()) == 5


def test_connection_refused_is_reported_after_retries() -> None:
    srv = FakeOpenAIServer().start()
    url = srv.url
    srv.stop()
    llm = OpenAIChatLLM("m", base_url=url, api_key=KEY, max_retries=1, **FAST)
    with pytest.raises(LLMError, match=r"could not reach.*server is running"):
        llm.complete("anyone?")


def test_embedder_retries_and_fails_typed() -> None:
    with FakeOpenAIServer(faults=faults_in_order("500", "drop", endpoint="embeddings")) as srv:
        embedder = OpenAIEmbedder("e", base_url=srv.url, api_key=KEY, **FAST)
        assert embedder.embed_documents(["a", "b"]).shape == (2, srv.dim)
        assert embedder.usage.snapshot()["retries"] == 2
    with FakeOpenAIServer(faults=lambda *_: "401") as srv:
        with pytest.raises(LLMAuthenticationError):
            OpenAIEmbedder("e", base_url=srv.url, api_key=KEY, **FAST).embed_query("x")
        assert len(srv.requests()) == 1


# -- errors that retrying cannot fix fail fast, with a message that says what to fix -------------
@pytest.mark.parametrize(
    ("fault", "error", "advice"),
    [
        ("401", LLMAuthenticationError, "OPENAI_API_KEY"),
        ("403", LLMAuthenticationError, "no access to model 'fake-chat'"),
        ("quota", LLMAuthenticationError, "billing"),
        ("400", LLMRequestError, "check the model name and parameters"),
        ("404", LLMRequestError, "check the model name"),
        ("501", LLMRequestError, "HTTP 501"),
    ],
)
def test_non_retryable_errors_fail_fast(fault: str, error: type, advice: str) -> None:
    with FakeOpenAIServer(faults=lambda *_: fault) as srv:
        llm = _llm(srv, backoff=1.0)  # six retries would take 30 s or more
        llm.check_settings()
        start = time.perf_counter()
        with pytest.raises(error, match=advice) as info:
            llm.complete("x")
        assert type(info.value) is error
        assert time.perf_counter() - start < 5.0
        assert len(srv.requests()) == 1


def test_unknown_model_names_the_model_and_the_models_endpoint() -> None:
    with FakeOpenAIServer(models={"llama3"}) as srv:
        with pytest.raises(LLMRequestError) as info:
            _llm(srv).complete("x")
        message = str(info.value)
        assert "'fake-chat'" in message and f"{srv.url}/models" in message
        assert "does not exist" in message  # the server's own words are passed on


def _everything_said(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)) + repr(exc) + repr(exc.args)


def test_bad_key_fails_fast_and_is_never_repeated(caplog) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, the openai client's and httpx's included
    wrong = "sk-wrong-key-that-must-stay-secret-42"
    with FakeOpenAIServer(api_key=KEY) as srv:  # it echoes the key it got, like OpenAI
        llm = _llm(srv, api_key=wrong)
        with pytest.raises(LLMAuthenticationError) as info:
            llm.complete("x")
        assert "HTTP 401" in str(info.value) and "OPENAI_API_KEY" in str(info.value)
        assert wrong not in _everything_said(info.value)
        assert wrong not in repr(llm) and wrong not in str(llm.get_params())
        assert len(srv.requests()) == 1
    assert wrong not in caplog.text
    assert wrong not in "".join(str(r.args) for r in caplog.records)


def test_bad_key_stops_a_build_fast(caplog) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "sk-wrong-key-in-a-build-77"
    with FakeOpenAIServer(api_key=KEY) as srv:
        builder = openai_builder(srv.url, api_key=wrong, max_concurrency=2)
        with pytest.raises(LLMAuthenticationError) as info:
            builder.build(CORPUS)  # 4 embedding batches, 2 at a time
        assert wrong not in _everything_said(info.value)
        # The batches in flight fail, none is retried, the queued ones are never sent.
        assert len(srv.requests()) <= 2
    assert wrong not in caplog.text


async def test_bad_key_stops_async_embedding_batches() -> None:
    with FakeOpenAIServer(api_key=KEY) as srv:
        embedder = OpenAIEmbedder(
            "e", base_url=srv.url, api_key="sk-bad-1234", batch_size=1, max_concurrency=2
        )
        with pytest.raises(LLMAuthenticationError):
            await embedder.aembed_documents([f"text {i}" for i in range(8)])
        assert len(srv.requests()) <= 2


def test_bad_key_in_a_summary_layer_is_wrapped_with_its_place(caplog) -> None:
    """Embeddings pass, the chat endpoint rejects the key: the error says where, stays typed."""
    with FakeOpenAIServer(faults=lambda endpoint, *_: "401" if endpoint == "chat" else None) as srv:
        builder = openai_builder(srv.url, max_concurrency=4)
        with pytest.raises(LLMAuthenticationError, match=r"layer 1, cluster \d+.*HTTP 401"):
            builder.build(CORPUS)
        assert len(srv.requests("chat")) <= 4  # at most what was in flight; none retried


def test_cli_reports_a_bad_key_without_it(tmp_path, monkeypatch, capsys) -> None:
    wrong = "sk-cli-wrong-key-000111"
    (tmp_path / "a.txt").write_text(CORPUS[0], encoding="utf-8")
    monkeypatch.setenv("OPENAI_API_KEY", wrong)
    with FakeOpenAIServer(api_key=KEY) as srv:
        code = main(
            [
                "build", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"),
                "--embed-provider", "openai", "--llm-base-url", srv.url, "--llm", "openai",
            ]
        )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 2
    assert "error:" in captured.err and "OPENAI_API_KEY" in captured.err
    assert wrong not in captured.err + captured.out


def test_cli_without_a_key_fails_before_any_work(tmp_path, capsys) -> None:
    (tmp_path / "a.txt").write_text(CORPUS[0], encoding="utf-8")
    code = main(
        ["build", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"), "--llm", "openai"]
    )
    assert code == 2
    assert "OPENAI_API_KEY" in capsys.readouterr().err


def test_summarization_error_type_is_kept_for_other_failures() -> None:
    with FakeOpenAIServer(faults=lambda endpoint, *_: "500" if endpoint == "chat" else None) as srv:
        builder = openai_builder(srv.url, max_retries=1)
        with pytest.raises(LLMError, match=r"layer 1, cluster \d+.*HTTP 500.*on all 2 attempts"):
            builder.build(CORPUS)
