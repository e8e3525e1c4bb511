"""Hybrid tree search: concurrent searches, one de-duplicating queue, the judge, the timeout."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time

import numpy as np
import pytest

from raptor_core import (
    HybridResult,
    HybridRetriever,
    InvalidInputError,
    InvalidParameterError,
    LLMAuthenticationError,
    Tree,
    ValueBasedRetriever,
)
from raptor_core.testing import (
    FakeEmbedder,
    ScriptedLLM,
    tiny_tree,
)

CANDIDATE = re.compile(r"^\[([^\]]+)\]", re.MULTILINE)
NOTHING = '{"selected": []}'


def is_judge(prompt: str) -> bool:
    return '"enough"' in prompt


def is_extract(prompt: str) -> bool:
    return prompt.startswith("Copy, word for word")


def scripted(*, select=NOTHING, judge='{"enough": false, "reason": "more"}', extract="NONE"):
    """A ScriptedLLM answering by prompt kind; each answer may be a callable(prompt)."""

    def answer(prompt: str) -> str:
        kind = judge if is_judge(prompt) else extract if is_extract(prompt) else select
        return kind(prompt) if callable(kind) else kind

    return ScriptedLLM(default=answer)


def select_all(prompt: str) -> str:
    return json.dumps({"selected": [{"id": i, "reason": "all"} for i in CANDIDATE.findall(prompt)]})


@pytest.fixture
def tree() -> Tree:
    return tiny_tree()


def hybrid(tree: Tree, llm, **params) -> HybridRetriever:
    return HybridRetriever(tree, FakeEmbedder(tree.dim), llm=llm, **params)


class GatedLLM:
    """The LLM search's call cannot finish until the judge has been consulted.

    The judge is only consulted about nodes taken from the queue, and while the LLM search
    is blocked only the value search can have put them there: the run completes only if
    the two searches (and the consumer) really run concurrently.
    """

    def __init__(self) -> None:
        self.events: list[str] = []
        self._gate: asyncio.Event | None = None

    @property
    def gate(self) -> asyncio.Event:
        if self._gate is None:
            self._gate = asyncio.Event()
        return self._gate

    async def acomplete(self, prompt: str, *, max_tokens: int | None = None) -> str:
        if is_judge(prompt):
            self.events.append("judge")
            self.gate.set()
            return '{"enough": false, "reason": "keep going"}'
        self.events.append("llm search asks")
        await asyncio.wait_for(self.gate.wait(), timeout=5)
        self.events.append("llm search answered")
        return select_all(prompt)

    def complete(self, prompt: str, *, max_tokens: int | None = None) -> str:  # pragma: no cover
        raise AssertionError("the async path must be used")


async def test_value_and_llm_searches_run_concurrently(tree: Tree) -> None:
    llm = GatedLLM()
    result = await hybrid(tree, llm, k=6, value_k=1, top_k=1, timeout=10).asearch("cats purr")
    assert result.errors == ()
    first_judge = llm.events.index("judge")
    assert llm.events[0] == "llm search asks"
    assert first_judge < llm.events.index("llm search answered")
    assert {h.source for h in result.hits} == {"value", "llm"}


def test_the_queue_deduplicates_and_records_every_finder(tree: Tree) -> None:
    llm = scripted(select=select_all)
    result = hybrid(tree, llm, judge=False, value_k=10, top_k=5, k=20, max_tokens=None).search(
        "cats"
    )
    ids = [h.id for h in result.hits]
    assert len(ids) == len(set(ids)) == len(tree)
    assert all(set(result.found_by[i]) == {"value", "llm"} for i in ids)
    assert all(h.source == result.found_by[h.id][0] for h in result.hits)
    assert result.stop_reason == "exhausted" and not result.stopped_early


def test_the_judge_stops_the_search_early(tree: Tree) -> None:
    verdicts = iter(
        ['{"enough": false, "reason": "only cats"}', '{"enough": true, "reason": "ok"}']
    )
    llm = scripted(judge=lambda prompt: next(verdicts))
    result = hybrid(tree, llm, value_k=5).search("cats purr")
    assert result.stop_reason == "judge" and result.stopped_early
    assert result.stopped_after == 2 and len(result.hits) == 2
    assert [(d.node_id, d.enough, d.hits) for d in result.judgements] == [
        (result.hits[0].id, False, 1),
        (result.hits[1].id, True, 2),
    ]
    assert result.judgements[-1].reason == "ok"
    assert result.judgements[0].elapsed <= result.judgements[1].elapsed <= result.elapsed
    judge_prompts = [p for p in llm.prompts if is_judge(p)]
    assert (
        result.hits[0].node.text in judge_prompts[1]
        and result.hits[1].node.text in judge_prompts[1]
    )


def test_an_unusable_judge_does_not_stop_the_search(tree: Tree, caplog) -> None:
    llm = scripted(judge="maybe?")
    with caplog.at_level(logging.WARNING, logger="raptor_core.retrieval.hybrid"):
        result = hybrid(tree, llm, value_k=3).search("cats")
    assert len(result.hits) == 3 and result.stop_reason == "exhausted"
    assert all(not d.enough for d in result.judgements)
    assert any(e.startswith("judge:") for e in result.errors)
    assert "judge's answer was unusable" in caplog.text


class SleepyLLM:
    def __init__(self, seconds: float, *, use_async: bool) -> None:
        self.seconds = seconds
        if use_async:
            self.acomplete = self._acomplete

    async def _acomplete(self, prompt: str, *, max_tokens: int | None = None) -> str:
        await asyncio.sleep(self.seconds)
        return NOTHING

    def complete(self, prompt: str, *, max_tokens: int | None = None) -> str:
        time.sleep(self.seconds)
        return NOTHING


@pytest.mark.parametrize("use_async", [True, False])
def test_the_timeout_bounds_the_run(tree: Tree, use_async: bool) -> None:
    llm = SleepyLLM(1.5 if not use_async else 30, use_async=use_async)
    started = time.perf_counter()
    result = hybrid(tree, llm, timeout=0.3).search("cats purr")
    assert time.perf_counter() - started < 1.2
    assert result.stop_reason == "timeout" and 0.3 <= result.elapsed < 1.2
    # The first value-search node was taken before the judge's call hung.
    assert [h.source for h in result.hits] == ["value"]


def test_k_and_the_token_budget(tree: Tree) -> None:
    llm = scripted(select=select_all)
    result = hybrid(tree, llm, judge=False, k=3).search("cats")
    assert len(result.hits) == 3 and result.stop_reason == "k"
    for budget in (8, 15, 22):
        result = hybrid(tree, llm, judge=False, max_tokens=budget, value_k=6).search("cats")
        assert result.hits and sum(h.node.token_count for h in result.hits) <= budget


def test_value_k_limits_the_value_searchs_share(tree: Tree) -> None:
    llm = scripted()
    result = hybrid(tree, llm, judge=False, value_k=2).search("cats purr")
    expected = ValueBasedRetriever(tree, FakeEmbedder(tree.dim), k=2, max_tokens=None)
    assert [h.id for h in result.hits] == [h.id for h in expected.retrieve("cats purr")]
    assert [h.evidence for h in result.hits] == [h.evidence for h in expected.retrieve("cats purr")]


def test_extracts_relevant_sentences(tree: Tree) -> None:
    answers = iter(["Cats purr.", "NONE"])
    llm = scripted(extract=lambda prompt: next(answers))
    result = hybrid(tree, llm, judge=False, extract=True, value_k=2).search("cats purr")
    first, second = (h.id for h in result.hits)
    assert result.extracts == {first: "Cats purr.", second: ""}
    assert result.context == "Cats purr.\n\n"
    extract_prompts = [p for p in llm.prompts if is_extract(p)]
    assert result.hits[0].node.text in extract_prompts[0]


def test_authentication_errors_propagate(tree: Tree) -> None:
    llm = ScriptedLLM(default=lambda p: (_ for _ in ()).throw(LLMAuthenticationError("bad key")))
    with pytest.raises(LLMAuthenticationError):
        hybrid(tree, llm).search("cats")


def test_a_failing_llm_degrades_to_similarity(tree: Tree) -> None:
    llm = ScriptedLLM(default=lambda p: (_ for _ in ()).throw(RuntimeError("down")))
    result = hybrid(tree, llm, k=4).search("cats purr")
    assert len(result.hits) == 4
    assert any(
        h.source == "llm" and h.reason.startswith("similarity fallback") for h in result.hits
    )


def test_deeply_nested_garbage_degrades_like_any_malformed_answer(tree: Tree) -> None:
    llm = ScriptedLLM(default="[" * 100_000)  # past the recursion limit of the JSON decoder
    result = hybrid(tree, llm, k=4).search("cats purr")
    assert len(result.hits) == 4
    assert any(h.reason and h.reason.startswith("similarity fallback") for h in result.hits)
    assert any(e.startswith("judge: malformed answer: no JSON") for e in result.errors)


async def test_async_entry_points_inside_a_running_loop(tree: Tree) -> None:
    llm = scripted(select=select_all)
    r = hybrid(tree, llm, judge=False, k=4)
    hits = await r.aretrieve("cats")
    result = await r.asearch("cats")
    assert [h.id for h in hits] == [h.id for h in result.hits]
    assert [h.id for h in r.retrieve("cats")] == [h.id for h in hits]  # sync API in a loop


def test_retrieve_returns_the_hits(tree: Tree) -> None:
    r = hybrid(tree, scripted(select=select_all), judge=False, k=4)
    assert [h.id for h in r.retrieve("cats")] == [h.id for h in r.search("cats").hits]


def test_edge_cases(tree: Tree) -> None:
    llm = scripted(select=select_all)
    empty = Tree(nodes=(), embeddings=np.zeros((0, 8), np.float32))
    assert HybridRetriever(empty, FakeEmbedder(8), llm=llm).search("cats") == HybridResult()
    assert HybridRetriever(empty, FakeEmbedder(8), llm=llm).retrieve("cats") == []
    with pytest.raises(InvalidInputError):
        hybrid(tree, llm).search(" ")
    nothing = hybrid(tree, llm, min_score=0.99).search("cats")
    assert nothing.hits == () and nothing.stop_reason == "exhausted" and llm.prompts == []
    many = hybrid(tree, llm, judge=False, k=100, value_k=100, max_tokens=None).search("cats")
    assert len(many.hits) == len(tree)


def test_a_filter_starts_the_llm_search_at_the_highest_layer_it_keeps(
    one_summary_per_document_tree: Tree,
) -> None:
    # No top summary (each spans two documents) passes a one-document filter.
    docs_tree = one_summary_per_document_tree
    llm = scripted(select=select_all)
    search = HybridRetriever(
        docs_tree, FakeEmbedder(), llm=llm, judge=False, value_k=1, where={"doc_id": "d0"}
    )
    result = search.search("cats purr")
    d0 = {n.id for n in docs_tree.nodes if n.doc_id == "d0"}
    assert {h.id for h in result.hits} == d0  # the value search alone would find one
    assert "llm" in {h.source for h in result.hits}


def test_a_k_too_large_for_a_float_means_every_node(tree: Tree) -> None:
    # The value search's default share, half of k, used to overflow a float for a huge k.
    llm = scripted(select=select_all)
    huge = hybrid(tree, llm, judge=False, k=10**400, max_tokens=None).search("cats")
    assert len(huge.hits) == len(tree) and huge.stop_reason == "exhausted"
    odd = hybrid(tree, scripted(), judge=False, k=3, max_tokens=None).search("cats purr")
    assert [h.source for h in odd.hits] == ["value"] * 2  # value_k = 2, rounded up


@pytest.mark.parametrize(
    "params",
    [
        {"timeout": 0},
        {"timeout": -1.0},
        {"judge": "yes"},
        {"value_k": 0},
        {"include": "roots"},
        {"top_k": 0},
        {"llm": object()},
    ],
)
def test_validation(tree: Tree, params: dict) -> None:
    params.setdefault("llm", scripted())
    with pytest.raises(InvalidParameterError):
        HybridRetriever(tree, FakeEmbedder(tree.dim), **params).search("cats")
