"""The LLM budget (``TreeBuilder(budget=LLMBudget(...))``) and the ``BuildProgress`` events.

A fake priced summariser reports OpenAI-style usage and, by default, the worst case of each
call (a full ``max_tokens`` completion), so "spend never passes the cap" is checked exactly.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from raptor_core.build.budget import LLMBudget, Meter, Pricing, prompt_tokens
from raptor_core.build.builder import TreeBuilder
from raptor_core.build.progress import BuildProgress, StageClock
from raptor_core.exceptions import BudgetExceededError, InvalidParameterError, RaptorError
from raptor_core.testing import EchoSummarizer, FakeEmbedder, GroupClusterer, WhitespaceTokenizer

DOCS = [
    f"Report {i} covers topic {i % 4}. The team met on day {i} and wrote notes. "
    f"Results were better than expected in week {i}."
    for i in range(16)
]
PRICES = Pricing(prompt_usd_per_million=1000.0, completion_usd_per_million=3000.0)


class _Counts:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts = {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0}

    def add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self.counts[k] += v

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class PricedSummarizer:
    """Echo summaries with usage counters; tracks calls, prompts and peak concurrency."""

    def __init__(self, *, delay: float = 0.0, full: bool = True) -> None:
        self.delay = delay
        self.full = full  # report max_tokens completion tokens (the worst case)
        self.usage = _Counts()
        self.prompts: list[tuple[str, ...]] = []
        self._lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0

    def get_params(self) -> dict[str, Any]:
        return {"full": self.full}

    def _enter(self, texts: Sequence[str]) -> None:
        with self._lock:
            self.prompts.append(tuple(texts))
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)

    def _answer(self, texts: Sequence[str], max_tokens: int) -> str:
        words = " ".join(texts).split()[:max_tokens]
        self.usage.add(
            calls=1,
            prompt_tokens=sum(len(t.split()) for t in texts),
            completion_tokens=max_tokens if self.full else len(words),
        )
        with self._lock:
            self.in_flight -= 1
        return " ".join(words)

    def summarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        self._enter(texts)
        time.sleep(self.delay)
        return self._answer(texts, max_tokens)


class AsyncPricedSummarizer(PricedSummarizer):
    async def asummarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        self._enter(texts)
        await asyncio.sleep(self.delay)
        return self._answer(texts, max_tokens)


def builder(summarizer: Any, **kw: Any) -> TreeBuilder:
    params: dict[str, Any] = {
        "tokenizer": WhitespaceTokenizer(),
        "clusterer": GroupClusterer(3),
        "chunk_max_tokens": 8,
        "summary_max_tokens": 10,
        "random_state": 0,
    }
    params.update(kw)
    return TreeBuilder(FakeEmbedder(16), summarizer, **params)


def signature(tree: Any) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(n.id, n.text, tuple(n.children)) for n in tree.nodes]


def spent(summarizer: PricedSummarizer) -> tuple[int, float]:
    c = summarizer.usage.snapshot()
    return c["prompt_tokens"] + c["completion_tokens"], PRICES.cost(
        c["prompt_tokens"], c["completion_tokens"]
    )


# -- parameters ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("budget", "fragment"),
    [
        (LLMBudget(max_cost_usd=1.0), "needs the model's prices"),
        (LLMBudget(max_cost_usd=-1.0, pricing=PRICES), "max_cost_usd must be"),
        (LLMBudget(max_cost_usd=float("nan"), pricing=PRICES), "max_cost_usd must be"),
        (LLMBudget(max_summary_tokens=0), "max_summary_tokens must be"),
        (LLMBudget(max_summary_tokens=True), "max_summary_tokens must be"),  # type: ignore[arg-type]
        (
            LLMBudget(pricing=Pricing(prompt_usd_per_million=-1, completion_usd_per_million=1)),
            "prompt_usd_per_million",
        ),
        ({"max_cost_usd": 1.0}, "must be an LLMBudget"),
    ],
)
def test_a_bad_budget_is_refused_before_any_call(budget: Any, fragment: str) -> None:
    summarizer = PricedSummarizer()
    b = builder(summarizer, budget=budget)  # stored as given
    assert b.budget is budget
    with pytest.raises(InvalidParameterError, match=fragment):
        b.build(DOCS)
    with pytest.raises(InvalidParameterError, match=fragment):
        b.estimate(DOCS)
    assert summarizer.prompts == []


def test_pricing_may_come_from_the_summariser() -> None:
    summarizer = PricedSummarizer()
    summarizer.pricing = PRICES  # type: ignore[attr-defined]
    with pytest.raises(BudgetExceededError) as info:
        builder(summarizer, budget=LLMBudget(max_cost_usd=0.3)).build(DOCS)
    assert info.value.spent_usd is not None
    assert 0 < info.value.spent_usd <= 0.3
    assert spent(summarizer)[1] <= 0.3


# -- the cap -------------------------------------------------------------------------------------
@pytest.mark.parametrize("cap", [60, 150, 333, 700])
def test_token_cap_stops_before_the_call_that_would_pass_it(cap: int) -> None:
    summarizer = PricedSummarizer()
    with pytest.raises(BudgetExceededError) as info:
        builder(summarizer, budget=LLMBudget(max_summary_tokens=cap)).build(DOCS)
    err = info.value
    tokens, _ = spent(summarizer)
    assert tokens <= cap
    assert err.spent_tokens == tokens
    assert err.calls == len(summarizer.prompts)
    assert err.max_summary_tokens == cap
    # The refused call really would have passed the cap.
    assert tokens + err.needed_tokens > cap
    message = str(err)
    assert f"{tokens} tokens" in message
    assert f"max_summary_tokens={cap}" in message
    assert "no cache" in message  # and says how to make a rerun cheap
    assert "layer " in message  # the place is added as for any summariser error


def test_cost_cap_in_usd() -> None:
    summarizer = PricedSummarizer()
    with pytest.raises(BudgetExceededError) as info:
        builder(summarizer, budget=LLMBudget(max_cost_usd=0.5, pricing=PRICES)).build(DOCS)
    _, usd = spent(summarizer)
    assert 0 < usd <= 0.5
    assert info.value.spent_usd == pytest.approx(usd)
    assert info.value.needed_usd is not None
    assert usd + info.value.needed_usd > 0.5
    assert f"${usd:.4f}" in str(info.value)
    assert "max_cost_usd=$0.5" in str(info.value)
    assert isinstance(info.value, RaptorError)


def test_a_budget_that_fits_changes_nothing() -> None:
    plain = builder(PricedSummarizer()).build(DOCS)
    summarizer = PricedSummarizer()
    capped = builder(
        summarizer, budget=LLMBudget(max_cost_usd=100.0, max_summary_tokens=10**6, pricing=PRICES)
    ).build(DOCS)
    assert signature(capped) == signature(plain)
    np.testing.assert_array_equal(capped.embeddings, plain.embeddings)
    info = capped.build_info["budget"]
    tokens, usd = spent(summarizer)
    assert info["spent"]["prompt_tokens"] + info["spent"]["completion_tokens"] == tokens
    assert info["spent"]["usd"] == pytest.approx(usd, abs=1e-6)
    assert info["max_cost_usd"] == 100.0
    assert "budget" not in plain.build_info


def test_a_summariser_without_usage_is_metered_with_the_tokenizer() -> None:
    echo = EchoSummarizer()
    with pytest.raises(BudgetExceededError) as info:
        builder(echo, budget=LLMBudget(max_summary_tokens=120)).build(DOCS)
    tok = WhitespaceTokenizer()
    used = sum(
        prompt_tokens(echo, tok, texts) + len(" ".join(texts).split()[:10]) for texts in echo.calls
    )
    assert 0 < used <= 120
    assert info.value.spent_tokens == used


def test_local_summarisers_are_not_metered() -> None:
    from raptor_core.build.summarizers import ExtractiveSummarizer

    embedder = FakeEmbedder(16)
    tree = TreeBuilder(
        embedder,
        ExtractiveSummarizer(embedder, tokenizer=WhitespaceTokenizer()),
        tokenizer=WhitespaceTokenizer(),
        clusterer=GroupClusterer(3),
        chunk_max_tokens=8,
        budget=LLMBudget(max_summary_tokens=1),
    ).build(DOCS)
    assert tree.num_layers > 1
    assert tree.build_info["budget"]["spent"]["calls"] == 0


# -- resume from the cache -----------------------------------------------------------------------
def test_resume_after_the_cap_gives_the_uncapped_tree_and_repeats_no_call(tmp_path: Path) -> None:
    reference = builder(PricedSummarizer()).build(DOCS)
    first = PricedSummarizer()
    with pytest.raises(BudgetExceededError, match="in the build cache"):
        builder(first, budget=LLMBudget(max_summary_tokens=300), cache=tmp_path).build(DOCS)
    assert first.prompts
    second = PricedSummarizer()
    tree = builder(second, budget=LLMBudget(max_summary_tokens=10**6), cache=tmp_path).build(DOCS)
    assert signature(tree) == signature(reference)
    np.testing.assert_array_equal(tree.embeddings, reference.embeddings)
    assert not set(first.prompts) & set(second.prompts)  # nothing paid twice
    assert len(first.prompts) + len(second.prompts) == sum(
        1 for n in reference.nodes if n.layer > 0 and len(n.children) > 1
    )
    # Cache hits never count: a third build is free, whatever the cap.
    third = PricedSummarizer()
    again = builder(third, budget=LLMBudget(max_summary_tokens=1), cache=tmp_path).build(DOCS)
    assert signature(again) == signature(reference)
    assert third.prompts == []
    assert again.build_info["budget"]["spent"]["calls"] == 0


def test_the_same_cap_rerun_moves_on_from_where_it_stopped(tmp_path: Path) -> None:
    made: list[tuple[str, ...]] = []
    for _ in range(20):
        summarizer = PricedSummarizer()
        try:
            builder(summarizer, budget=LLMBudget(max_summary_tokens=200), cache=tmp_path).build(
                DOCS
            )
        except BudgetExceededError:
            assert summarizer.prompts  # each rerun buys something new
            made.extend(summarizer.prompts)
            continue
        made.extend(summarizer.prompts)
        break
    else:
        pytest.fail("the build never finished")
    assert len(made) == len(set(made))


# -- concurrency ---------------------------------------------------------------------------------
@pytest.mark.parametrize("cap", [100, 250, 480])
def test_concurrent_workers_never_overspend(cap: int) -> None:
    summarizer = PricedSummarizer(delay=0.01)
    with pytest.raises(BudgetExceededError):
        builder(summarizer, budget=LLMBudget(max_summary_tokens=cap), max_concurrency=8).build(DOCS)
    assert spent(summarizer)[0] <= cap
    assert summarizer.in_flight == 0  # every call in flight was waited for


def test_calls_run_concurrently_under_a_budget() -> None:
    summarizer = PricedSummarizer(delay=0.02)
    builder(summarizer, budget=LLMBudget(max_summary_tokens=10**6), max_concurrency=4).build(DOCS)
    assert summarizer.peak > 1


@pytest.mark.parametrize("cls", [PricedSummarizer, AsyncPricedSummarizer])
@pytest.mark.parametrize("cached", [False, True])
def test_async_build_stops_at_the_cap_and_keeps_what_was_paid(
    cls: type[PricedSummarizer], cached: bool, tmp_path: Path
) -> None:
    summarizer = cls(delay=0.01)
    cache = tmp_path if cached else None
    capped = builder(
        summarizer, budget=LLMBudget(max_summary_tokens=333), max_concurrency=8, cache=cache
    )
    with pytest.raises(BudgetExceededError):
        asyncio.run(capped.abuild(DOCS))
    assert spent(summarizer)[0] <= 333
    assert summarizer.in_flight == 0
    if cached:
        rest = cls()
        tree = asyncio.run(builder(rest, cache=tmp_path).abuild(DOCS))
        assert not set(summarizer.prompts) & set(rest.prompts)
        assert signature(tree) == signature(builder(cls()).build(DOCS))


def test_meter_reservations_are_atomic() -> None:
    """Many threads racing for one budget: the reserved total never passes the cap."""
    meter = Meter(
        LLMBudget(max_summary_tokens=1000),
        None,
        EchoSummarizer(),
        WhitespaceTokenizer(),
        has_cache=False,
    )
    granted: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(16)

    def worker() -> None:
        barrier.wait()
        for _ in range(20):
            try:
                meter.reserve([["one two three"]], 7, wait=False)
            except Exception:
                return
            with lock:
                granted.append(10)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(granted) == 1000  # 100 calls of 10 tokens fit exactly, and no more
    assert meter.in_flight() == 100


# -- batch summarisers ---------------------------------------------------------------------------
class BatchSummarizer(PricedSummarizer):
    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def summarize_batch(self, clusters: Sequence[Sequence[str]], *, max_tokens: int) -> list[str]:
        self.batches.append(len(clusters))
        return [self.summarize(c, max_tokens=max_tokens) for c in clusters]


def test_a_batch_is_all_or_nothing() -> None:
    summarizer = BatchSummarizer()
    tree = builder(summarizer, budget=LLMBudget(max_summary_tokens=10**6)).build(DOCS)
    layer_one = summarizer.batches[0]
    assert layer_one > 1
    assert tree.build_info["budget"]["spent"]["calls"] == len(summarizer.prompts)
    small = BatchSummarizer()
    with pytest.raises(BudgetExceededError):
        builder(small, budget=LLMBudget(max_summary_tokens=100)).build(DOCS)
    assert small.batches == []  # the first layer's batch does not fit: nothing was sent


# -- incremental updates -------------------------------------------------------------------------
def test_insert_under_a_budget_resumes_from_the_cache(tmp_path: Path) -> None:
    base = builder(PricedSummarizer()).build(DOCS[:10])
    new = [
        f"Extra {i} on topic {i % 4}. Nobody expected week {i}. Notes were written."
        for i in range(8)
    ]
    reference = builder(PricedSummarizer()).insert(base, new)
    first = PricedSummarizer()
    with pytest.raises(BudgetExceededError):
        builder(first, budget=LLMBudget(max_summary_tokens=60), cache=tmp_path).insert(base, new)
    assert spent(first)[0] <= 60
    second = PricedSummarizer()
    update = builder(second, budget=LLMBudget(max_summary_tokens=10**6), cache=tmp_path).insert(
        base, new
    )
    assert signature(update.tree) == signature(reference.tree)
    assert not set(first.prompts) & set(second.prompts)


# -- estimate ------------------------------------------------------------------------------------
def test_estimate_prices_the_projection_and_compares_it_with_the_cap() -> None:
    plain = builder(PricedSummarizer()).estimate(DOCS)
    assert plain.cost_usd is None
    assert plain.within_budget is None
    priced = builder(PricedSummarizer(), budget=LLMBudget(pricing=PRICES)).estimate(DOCS)
    assert priced.cost_usd == pytest.approx(
        PRICES.cost(priced.prompt_tokens, priced.completion_tokens)
    )
    assert priced.within_budget is True
    assert priced.to_dict()["cost_usd"] == pytest.approx(priced.cost_usd, abs=1e-6)
    tight = LLMBudget(max_cost_usd=priced.cost_usd / 2, pricing=PRICES)
    assert builder(PricedSummarizer(), budget=tight).estimate(DOCS).within_budget is False
    tokens = LLMBudget(max_summary_tokens=10)
    assert builder(PricedSummarizer(), budget=tokens).estimate(DOCS).within_budget is False


# -- progress events -----------------------------------------------------------------------------
def test_progress_events_carry_eta_and_cost_and_the_old_callback_still_works() -> None:
    events: list[BuildProgress] = []
    plain: list[tuple[str, int, int]] = []
    summarizer = PricedSummarizer()
    builder(
        summarizer,
        budget=LLMBudget(pricing=PRICES),
        progress=lambda *a: plain.append(a),
        on_progress=events.append,
    ).build(DOCS)
    assert [(e.stage, e.done, e.total) for e in events] == plain
    assert {e.stage for e in events} == {"chunk", "embed", "cluster", "summarize"}
    for e in events:
        assert e.elapsed_s >= 0
        assert e.eta_s is None or e.eta_s >= 0
        if e.done >= e.total:
            assert e.eta_s == 0.0
        assert e.spent_usd is not None
    summaries = [e for e in events if e.stage == "summarize"]
    usd = [e.spent_usd for e in summaries]
    assert usd == sorted(usd)  # spend only grows
    assert summaries[-1].summary_calls == len(summarizer.prompts)
    assert summaries[-1].spent_usd == pytest.approx(spent(summarizer)[1])
    assert {e.layer for e in summaries} >= {1, 2}


def test_progress_without_prices_has_no_usd() -> None:
    events: list[BuildProgress] = []
    builder(PricedSummarizer(), on_progress=events.append).build(DOCS)
    last = [e for e in events if e.stage == "summarize"][-1]
    assert last.spent_usd is None
    assert last.summary_calls > 0  # tokens still come from the summariser's usage
    assert last.prompt_tokens > 0


def test_stage_clock_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    import raptor_core.build.progress as progress

    now = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    clock = StageClock()
    clock.begin("embed")
    assert clock.times("embed", 0, 10) == (0.0, None)  # nothing done yet: unknown
    now[0] = 102.0
    assert clock.times("embed", 2, 10) == (2.0, 8.0)  # 1 s per unit, 8 left
    now[0] = 110.0
    assert clock.times("embed", 10, 10) == (10.0, 0.0)
    clock.begin("summarize")
    now[0] = 113.0
    assert clock.times("summarize", 1, 4) == (3.0, 9.0)


def test_an_async_build_stopped_by_the_cap_leaves_no_claim_in_the_cache(tmp_path: Path) -> None:
    """asyncio.run cancels the worker-thread tasks still claiming: their claims are given back.

    A claim left behind would make the rerun in this process wait a whole lease (600 s).
    """
    import sqlite3

    for i in range(20):
        directory = tmp_path / str(i)
        capped = builder(
            AsyncPricedSummarizer(delay=0.005),
            budget=LLMBudget(max_summary_tokens=150 + 7 * i),
            max_concurrency=8,
            cache=directory,
        )
        with pytest.raises(BudgetExceededError):
            asyncio.run(capped.abuild(DOCS))
        with sqlite3.connect(directory / "cache.sqlite3") as db:
            assert db.execute("SELECT COUNT(*) FROM claims").fetchone() == (0,)
