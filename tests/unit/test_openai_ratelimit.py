"""Pacing from the ``x-ratelimit-*`` headers (and the caller's own caps).

Unit tests drive the pacer with a fake clock; the tests against the local server (real
``openai`` client, its rate-limit mode answering 429 over a window) check that a paced client
provokes no 429 where an unpaced one does, from threads and from asyncio tasks.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from openai_server import LOCALHOST, FakeOpenAIServer, RateLimit

from raptor_core.backends.openai import (
    OpenAIChatLLM,
    OpenAIEmbedder,
    _duration,
    _estimate_tokens,
    _RatePacer,
)
from raptor_core.exceptions import InvalidParameterError, LLMError

pytestmark = [*LOCALHOST, pytest.mark.timeout(120)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def headers(remaining: int, reset: str, *, limit: int = 3, tokens: int = 10**6) -> dict[str, str]:
    return {
        "x-ratelimit-limit-requests": str(limit),
        "x-ratelimit-remaining-requests": str(remaining),
        "x-ratelimit-reset-requests": reset,
        "x-ratelimit-limit-tokens": str(tokens),
        "x-ratelimit-remaining-tokens": str(tokens),
        "x-ratelimit-reset-tokens": reset,
    }


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [
        ("1s", 1.0),
        ("6m0s", 360.0),
        ("20ms", 0.02),
        ("1h2m3.5s", 3723.5),
        ("0.25", 0.25),
        ("", None),
        ("soon", None),
        ("5x", None),
        ("-1", None),
    ],
)
def test_reset_durations_parse_like_openai_writes_them(raw: str, seconds: float | None) -> None:
    assert _duration(raw) == (pytest.approx(seconds) if seconds is not None else None)


def test_token_estimate_counts_the_completion_too() -> None:
    assert _estimate_tokens(["abcd", "abcde"]) == 1 + 2
    assert _estimate_tokens(["abcd"], 100) == 101


# -- the pacer with a fake clock -----------------------------------------------------------------
def test_an_exhausted_window_holds_requests_until_it_resets() -> None:
    clock = FakeClock()
    pacer = _RatePacer(clock=clock)
    assert pacer.reserve(10) == 0.0  # nothing known yet: go
    pacer.observe(headers(0, "2s"), 10)
    pacer.done(10)
    assert pacer.reserve(10) == pytest.approx(2.0)
    clock.now += 1.5
    assert pacer.reserve(10) == pytest.approx(0.5)
    clock.now += 0.5
    # The window is full again (limit 3): three go, the fourth waits for news.
    assert [pacer.reserve(10) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert pacer.reserve(10) > 0


def test_requests_in_flight_count_against_what_the_server_reports() -> None:
    clock = FakeClock()
    pacer = _RatePacer(clock=clock)
    assert pacer.reserve(1) == 0.0
    assert pacer.reserve(1) > 0  # before the first answer, one request at a time
    pacer.done(1)
    assert [pacer.reserve(1) for _ in range(3)] == [0.0, 0.0, 0.0]
    # The first answer says 2 remain, but two of ours are still in flight: none is free.
    pacer.observe(headers(2, "1s", limit=5), 1)
    pacer.done(1)
    assert pacer.reserve(1) == pytest.approx(1.0)


def test_a_late_answer_about_an_ended_window_is_ignored() -> None:
    clock = FakeClock()
    pacer = _RatePacer(clock=clock)
    pacer.reserve(1)
    pacer.observe(headers(0, "1s"), 1)
    pacer.done(1)
    clock.now += 1.0  # the window ends and refills
    assert pacer.reserve(1) == 0.0
    pacer.reserve(1)
    # An answer sent before the reset arrives now: its window is over, it changes nothing.
    pacer.observe(headers(0, "1ms"), 1)
    pacer.done(1)
    assert pacer.reserve(1) == 0.0


def test_requests_that_failed_without_headers_do_not_block_the_next_window() -> None:
    clock = FakeClock()
    pacer = _RatePacer(clock=clock)
    pacer.reserve(1)
    pacer.observe(headers(0, "1s", limit=2), 1)
    pacer.done(1)
    clock.now += 1.0
    assert [pacer.reserve(1) for _ in range(3)] == [0.0, 0.0, pytest.approx(0.05)]
    pacer.done(1)  # both fail without an answer (a dropped connection): no headers
    pacer.done(1)
    assert pacer.reserve(1) == 0.0  # nothing in flight can bring news: go and find out


def test_tokens_are_paced_like_requests() -> None:
    clock = FakeClock()
    pacer = _RatePacer(clock=clock)
    pacer.reserve(400)
    pacer.observe(
        {
            "x-ratelimit-limit-tokens": "1000",
            "x-ratelimit-remaining-tokens": "600",
            "x-ratelimit-reset-tokens": "6m0s",
        },
        400,
    )
    pacer.done(400)
    assert pacer.reserve(500) == 0.0
    assert pacer.reserve(500) == pytest.approx(360.0)


def test_caller_caps_are_a_sliding_minute() -> None:
    clock = FakeClock()
    pacer = _RatePacer(clock=clock)
    assert pacer.reserve(1, rpm=2) == 0.0
    pacer.done(1)
    clock.now += 10
    assert pacer.reserve(1, rpm=2) == 0.0
    assert pacer.reserve(1, rpm=2) == pytest.approx(50.0)  # the first leaves the minute
    clock.now += 50
    assert pacer.reserve(1, rpm=2) == 0.0
    assert pacer.reserve(300, tpm=500) == 0.0
    # 1 + 1 + 300 + 300 > 500: it waits until the first 300 leave the minute
    assert pacer.reserve(300, tpm=500) == pytest.approx(60.0)


def test_paced_client_sleeps_instead_of_sending(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real client: the server reports the window used up; the next request waits."""
    clock = FakeClock()
    limit = RateLimit(requests=2, window=30.0, enforce=False)  # headers only
    with FakeOpenAIServer(rate_limit=limit) as server:
        llm = OpenAIChatLLM("fake-chat", base_url=server.url, api_key="k", max_retries=0)
        llm._pacer = _RatePacer(clock=clock, sleep=clock.sleep)
        for i in range(5):
            llm.complete(f"question {i}", max_tokens=5)
    # Requests 3, 4 and 5 found the window used up and slept until the reset the server
    # announced (its own window, in real time, never ends during the test: each later
    # answer reports it used up again).
    assert len(clock.sleeps) == 3
    assert all(29.0 <= s <= 30.5 for s in clock.sleeps)
    assert llm.usage.snapshot()["paced"] == 3
    assert len(server.requests("chat")) == 5


def test_pacing_off_and_no_headers_never_wait() -> None:
    clock = FakeClock()
    with FakeOpenAIServer(rate_limit=RateLimit(requests=1, window=30.0, enforce=False)) as server:
        llm = OpenAIChatLLM("fake-chat", base_url=server.url, api_key="k", pacing=False)
        llm._pacer = _RatePacer(clock=clock, sleep=clock.sleep)
        for i in range(3):
            llm.complete(f"q {i}", max_tokens=5)
    with FakeOpenAIServer() as server:  # a server that sends no rate-limit headers
        llm = OpenAIChatLLM("fake-chat", base_url=server.url, api_key="k")
        llm._pacer = _RatePacer(clock=clock, sleep=clock.sleep)
        for i in range(3):
            llm.complete(f"q {i}", max_tokens=5)
    assert clock.sleeps == []


@pytest.mark.parametrize(
    "kwargs",
    [{"pacing": "yes"}, {"max_requests_per_minute": 0}, {"max_tokens_per_minute": 1.5}],
)
def test_bad_pacing_settings_are_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidParameterError):
        OpenAIChatLLM("m", api_key="k", **kwargs).check_settings()


def test_pacing_settings_are_recorded_but_not_part_of_cache_keys() -> None:
    from raptor_core.build.cache import component_identity

    llm = OpenAIChatLLM("m", api_key="k", max_requests_per_minute=60)
    assert llm.get_params()["max_requests_per_minute"] == 60
    assert "max_requests_per_minute" not in component_identity(llm)
    assert component_identity(llm) == component_identity(OpenAIChatLLM("m", api_key="k"))


# -- against an enforcing server -----------------------------------------------------------------
# One second, not less: in a loaded suite a thread that got its turn can be held by the
# scheduler for a few hundred milliseconds before it sends.  If that outlasts the window, the
# late request opens the server's next window early and the test fails for the machine, not
# the pacer (seen once in five suites at 0.4 s).  The unpaced control still overruns it.
WINDOW = RateLimit(requests=3, window=1.0)


def _burst(llm: OpenAIChatLLM, n: int, workers: int) -> None:
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(lambda i: llm.complete(f"burst question {i}", max_tokens=5), range(n)))


@pytest.mark.parametrize("with_retries", [False, True])
def test_paced_threads_provoke_no_429(with_retries: bool) -> None:
    pytest.importorskip("openai")
    with FakeOpenAIServer(rate_limit=WINDOW) as server:
        llm = OpenAIChatLLM(
            "fake-chat",
            base_url=server.url,
            api_key="k",
            max_retries=3 if with_retries else 0,  # with none, a single 429 fails the test
            backoff=0.01,
        )
        _burst(llm, 10, workers=3)
        assert server.rate_limited == 0
        assert len(server.successes("chat")) == 10
        assert llm.usage.snapshot()["paced"] >= 1


def test_unpaced_threads_do_provoke_429() -> None:
    """The control: the same burst without pacing runs into the server's limit."""
    with FakeOpenAIServer(rate_limit=WINDOW) as server:
        llm = OpenAIChatLLM(
            "fake-chat", base_url=server.url, api_key="k", pacing=False, max_retries=0
        )
        with pytest.raises(LLMError, match="429"):
            _burst(llm, 10, workers=3)
        assert server.rate_limited >= 1


def test_paced_tasks_provoke_no_429() -> None:
    async def burst(llm: OpenAIChatLLM) -> list[str]:
        try:
            return await asyncio.gather(
                *(llm.acomplete(f"async question {i}", max_tokens=5) for i in range(9))
            )
        finally:
            await llm.aclose()

    with FakeOpenAIServer(rate_limit=WINDOW) as server:
        llm = OpenAIChatLLM("fake-chat", base_url=server.url, api_key="k", max_retries=0)
        answers = asyncio.run(burst(llm))
        assert len(answers) == 9
        assert server.rate_limited == 0


def test_a_build_through_a_rate_limited_server_provokes_no_429(tmp_path: Any) -> None:
    """Embedder and summariser (each paced on its own window) inside a real build."""
    from openai_server import CORPUS, openai_builder, tree_signature

    with FakeOpenAIServer() as server:
        reference = openai_builder(server.url).build(CORPUS)
    with FakeOpenAIServer(rate_limit=RateLimit(requests=4, window=0.3)) as server:
        tree = openai_builder(server.url, max_concurrency=4, max_retries=0).build(CORPUS)
        assert server.rate_limited == 0
    assert tree_signature(tree) == tree_signature(reference)
    assert tree.build_info["usage"]["summarize"]["paced"] >= 1


def test_token_window_paces_embeddings() -> None:
    texts = [f"text number {i} " * 10 for i in range(8)]  # about 40 tokens each
    limit = RateLimit(tokens=100, window=0.4)  # two texts per window
    with FakeOpenAIServer(rate_limit=limit) as server:
        embedder = OpenAIEmbedder(
            "fake-embed",
            base_url=server.url,
            api_key="k",
            batch_size=2,
            max_concurrency=2,
            max_retries=0,
        )
        vectors = embedder.embed_documents(texts)
        assert vectors.shape == (8, 32)
        assert server.rate_limited == 0
        assert embedder.usage.snapshot()["paced"] >= 1
