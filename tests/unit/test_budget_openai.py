"""The LLM budget through the real ``openai`` client, against the local OpenAI-compatible server.

The server reports ``usage`` (word counts), so the build meters what the server says it
charged; the requests it logs prove that the capped build stopped before passing the cap and
that the rerun with a higher cap paid for nothing twice.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from openai_server import CORPUS, LOCALHOST, FakeOpenAIServer, openai_builder, tree_signature

from raptor_core.build.budget import LLMBudget, Pricing
from raptor_core.build.progress import BuildProgress
from raptor_core.exceptions import BudgetExceededError

pytestmark = [*LOCALHOST, pytest.mark.timeout(120)]

PRICES = Pricing(prompt_usd_per_million=2000.0, completion_usd_per_million=8000.0)


@pytest.fixture(autouse=True)
def _no_openai_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)


def server_cost(server: FakeOpenAIServer) -> float:
    """What the server billed for its chat answers (its own usage figures, priced)."""
    from openai_server import fake_completion

    usd = 0.0
    for record in server.successes("chat"):
        messages = record.body["messages"]
        prompt = sum(len(str(m["content"]).split()) for m in messages)
        answer = fake_completion(record.prompt, record.body.get("max_tokens"))
        usd += PRICES.cost(prompt, len(answer.split()))
    return usd


@pytest.mark.parametrize("run_async", [False, True])
def test_the_cap_stops_the_build_and_a_higher_cap_resumes_with_no_repeated_call(
    tmp_path: Path, run_async: bool
) -> None:
    def build(b: Any) -> Any:
        return asyncio.run(b.abuild(CORPUS)) if run_async else b.build(CORPUS)

    with FakeOpenAIServer(delay=0.01) as server:
        reference = build(openai_builder(server.url))
        needed = server_cost(server)  # what an uncapped build costs
        server.reset()
        cap = needed / 2
        events: list[BuildProgress] = []
        capped = openai_builder(
            server.url,
            cache=tmp_path,
            budget=LLMBudget(max_cost_usd=cap, pricing=PRICES),
            on_progress=events.append,
        )
        with pytest.raises(BudgetExceededError) as info:
            build(capped)
        first = [r.prompt for r in server.requests("chat")]
        assert first  # it spent something ...
        assert server_cost(server) <= cap  # ... and never passed the cap
        assert info.value.spent_usd == pytest.approx(server_cost(server))
        assert "in the build cache" in str(info.value)
        paid = [e for e in events if e.stage == "summarize"]
        assert paid
        assert paid[-1].max_cost_usd == cap
        assert paid[-1].spent_usd is not None
        assert paid[-1].spent_usd <= cap

        server.reset()
        resumed = build(
            openai_builder(
                server.url,
                cache=tmp_path,
                budget=LLMBudget(max_cost_usd=needed * 2, pricing=PRICES),
            )
        )
        second = [r.prompt for r in server.requests("chat")]
        assert not set(first) & set(second)  # answers already paid for came from the cache
        assert len(first) + len(second) == len(
            [n for n in reference.nodes if n.layer > 0 and len(n.children) > 1]
        )
    assert tree_signature(resumed) == tree_signature(reference)
    np.testing.assert_allclose(resumed.embeddings, reference.embeddings, atol=1e-6)
    spent = resumed.build_info["budget"]["spent"]
    assert spent["calls"] == len(second)


def test_token_cap_through_the_client(tmp_path: Path) -> None:
    with FakeOpenAIServer() as server:
        builder = openai_builder(
            server.url, cache=tmp_path, budget=LLMBudget(max_summary_tokens=200)
        )
        with pytest.raises(BudgetExceededError) as info:
            builder.build(CORPUS)
        used = 0
        for record in server.successes("chat"):
            used += sum(len(str(m["content"]).split()) for m in record.body["messages"])
        assert used <= info.value.spent_tokens <= 200


def test_a_batch_job_is_reserved_whole_and_resumes_under_a_higher_cap(tmp_path: Path) -> None:
    from raptor_core.backends.openai_batch import OpenAIBatchSummarizer

    def batch_builder(url: str, budget: LLMBudget) -> Any:
        builder = openai_builder(url, cache=tmp_path, budget=budget)
        builder.summarizer = OpenAIBatchSummarizer(
            "fake-chat", base_url=url, api_key="sk-test-key", poll_interval=0.01, timeout=5.0
        )
        return builder

    with FakeOpenAIServer() as server:
        reference = openai_builder(server.url).build(CORPUS)
        server.reset()
        with pytest.raises(BudgetExceededError):
            batch_builder(server.url, LLMBudget(max_summary_tokens=300)).build(CORPUS)
        assert server.batches == {}  # the first layer's job did not fit: nothing was submitted
        assert server.requests("chat") == []
        tree = batch_builder(server.url, LLMBudget(max_summary_tokens=10**6)).build(CORPUS)
        assert server.batches  # the cache reached the batch summariser through the meter
        assert server.requests("chat") == []
    assert tree_signature(tree) == tree_signature(reference)
    summaries = [n for n in reference.nodes if n.layer > 0 and len(n.children) > 1]
    assert tree.build_info["budget"]["spent"]["calls"] == len(summaries)
