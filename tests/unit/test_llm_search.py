"""LLM-guided tree search with a scripted LLM: choices, malformed output, fallback, limits."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time

import numpy as np
import pytest

from raptor_core import (
    InvalidInputError,
    InvalidParameterError,
    LLMAuthenticationError,
    LLMError,
    LLMGuidedRetriever,
    LLMTimeoutError,
    Tree,
)
from raptor_core._llm import ask_json
from raptor_core.testing import (
    FakeEmbedder,
    ScriptedLLM,
    random_tree,
    tiny_tree,
)

CANDIDATE = re.compile(r"^\[([^\]]+)\]", re.MULTILINE)


def chosen(*ids: str, reason: str | None = None) -> str:
    items = [{"id": i, "reason": reason or f"about {i}"} for i in ids]
    return json.dumps({"selected": items})


def select_all(prompt: str) -> str:
    return chosen(*CANDIDATE.findall(prompt))


@pytest.fixture
def tree() -> Tree:
    return tiny_tree()


def retriever(tree: Tree, llm, **params) -> LLMGuidedRetriever:
    return LLMGuidedRetriever(tree, FakeEmbedder(tree.dim), llm=llm, **params)


def test_follows_the_llms_choices_down_the_tree(tree: Tree) -> None:
    llm = ScriptedLLM(
        [
            chosen("L1.1", reason="about rockets"),
            json.dumps({"selected": [{"id": "L0.3", "reason": "satellites"}, {"id": "L0.2"}]}),
        ]
    )
    hits = retriever(tree, llm).retrieve("How do satellites reach orbit?")
    assert [(h.id, h.reason) for h in hits] == [
        ("L1.1", "about rockets"),
        ("L0.3", "satellites"),
        ("L0.2", "chosen by the LLM"),
    ]
    assert [h.path for h in hits] == [("L1.1",), ("L1.1", "L0.3"), ("L1.1", "L0.2")]
    assert all(h.source == "llm" for h in hits)
    q = FakeEmbedder(tree.dim).embed_query("How do satellites reach orbit?")
    assert hits[1].score == pytest.approx(float(tree.embeddings[tree.row("L0.3")] @ q), abs=1e-6)
    first, second = llm.prompts
    assert "How do satellites reach orbit?" in first
    assert set(CANDIDATE.findall(first)) == {"L1.0", "L1.1"}
    # Only the children of the chosen node are shown next.
    assert set(CANDIDATE.findall(second)) == {"L0.2", "L0.3"}
    assert '"selected"' in first and "at most 3 nodes" in first


def test_choosing_nothing_stops_the_search(tree: Tree) -> None:
    llm = ScriptedLLM(['{"selected": []}'])
    assert retriever(tree, llm).retrieve("quantum chromodynamics") == []
    assert len(llm.prompts) == 1


def test_unknown_ids_are_ignored_and_plain_id_lists_accepted(tree: Tree) -> None:
    llm = ScriptedLLM([chosen("L9.9", "L1.0"), '{"selected": ["L0.1", "L1.1"]}'])
    hits = retriever(tree, llm).retrieve("kittens")
    assert [h.id for h in hits] == ["L1.0", "L0.1"]  # L1.1 is not a candidate at step 2


@pytest.mark.parametrize(
    "answer",
    [
        'Sure! Here you go:\n```json\n{"selected": [{"id": "L1.0", "reason": "cats"}]}\n```',
        'I choose {"selected": ["L1.0"]} because it is about cats.',
        '[{"id": "[L1.0]", "reason": "cats"}]',
    ],
)
def test_tolerates_fences_chatter_and_variants(tree: Tree, answer: str) -> None:
    llm = ScriptedLLM([answer], default='{"selected": []}')
    assert [h.id for h in retriever(tree, llm).retrieve("cats")] == ["L1.0"]
    assert len(llm.prompts) == 2  # no retry was needed


def test_malformed_answer_is_retried_once(tree: Tree, caplog: pytest.LogCaptureFixture) -> None:
    llm = ScriptedLLM(["I think the first one.", chosen("L1.0")], default='{"selected": []}')
    with caplog.at_level(logging.WARNING, logger="raptor_core"):
        hits = retriever(tree, llm).retrieve("cats")
    assert [h.id for h in hits] == ["L1.0"]
    assert "could not be used" in llm.prompts[1] and "no JSON" in llm.prompts[1]
    assert "fell back" not in caplog.text


@pytest.mark.parametrize(
    "script",
    [
        ["not json", '{"wrong": "shape"}'],
        [chosen("X1"), chosen("X2")],  # only unknown ids: unusable
        [LLMError("service unavailable"), "still not json"],
        [RuntimeError("connection reset"), LLMTimeoutError("slow")],
        ["[" * 100_000, '{"selected": ' + "{" * 100_000],  # nested past the recursion limit
    ],
)
def test_unusable_twice_falls_back_to_similarity(
    tree: Tree, script: list, caplog: pytest.LogCaptureFixture
) -> None:
    llm = ScriptedLLM(script, default='{"selected": []}')
    with caplog.at_level(logging.WARNING, logger="raptor_core.retrieval.llm"):
        hits = retriever(tree, llm, top_k=1).retrieve("cats purr")
    assert [h.id for h in hits] == ["L1.0"]  # the most similar top-layer node
    assert hits[0].reason.startswith("similarity fallback")
    assert "fell back to similarity ranking" in caplog.text
    assert len(llm.prompts) == 3  # two attempts at step 1, one at step 2


def test_authentication_errors_are_not_hidden(tree: Tree) -> None:
    llm = ScriptedLLM([LLMAuthenticationError("invalid API key")])
    with pytest.raises(LLMAuthenticationError):
        retriever(tree, llm).retrieve("cats")


class SlowLLM:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.calls = 0

    async def acomplete(self, prompt: str, *, max_tokens: int | None = None) -> str:
        self.calls += 1
        await asyncio.sleep(self.seconds)
        return '{"selected": []}'

    def complete(self, prompt: str, *, max_tokens: int | None = None) -> str:
        self.calls += 1
        time.sleep(self.seconds)
        return '{"selected": []}'


def test_llm_timeout_counts_as_a_failed_call(tree: Tree, caplog: pytest.LogCaptureFixture) -> None:
    llm = SlowLLM(5.0)
    started = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="raptor_core.retrieval.llm"):
        hits = retriever(tree, llm, top_k=1, num_layers=1, llm_timeout=0.05).retrieve("cats purr")
    assert time.perf_counter() - started < 2.0
    assert [h.id for h in hits] == ["L1.0"] and "LLMTimeoutError" in hits[0].reason
    assert llm.calls == 2


class SyncOnlyLLM:
    def __init__(self) -> None:
        self.prompts: list[str] = []

    def complete(self, prompt: str, *, max_tokens: int | None = None) -> str:
        self.prompts.append(prompt)
        return select_all(prompt)


async def test_sync_llm_in_async_code_and_sync_api_inside_a_loop(tree: Tree) -> None:
    llm = SyncOnlyLLM()
    r = retriever(tree, llm, top_k=1)
    async_hits = await r.aretrieve("rockets orbit")
    sync_hits = r.retrieve("rockets orbit")  # a running loop: runs on a worker thread
    assert [h.id for h in async_hits] == [h.id for h in sync_hits]
    assert len(async_hits) == 2 and async_hits[1].path[0] == async_hits[0].id


async def test_a_parser_recursing_too_deep_counts_as_a_malformed_answer() -> None:
    def parse(answer: object) -> object:
        raise RecursionError("maximum recursion depth exceeded")

    llm = ScriptedLLM(default="[1]")
    value, error = await ask_json(llm, "pick", parse, max_tokens=None, timeout=None)
    assert value is None and error == "malformed answer: maximum recursion depth exceeded"
    assert len(llm.prompts) == 2  # retried once, like any malformed answer


def test_top_k_caps_the_llms_choices(tree: Tree) -> None:
    llm = ScriptedLLM(default=select_all)
    hits = retriever(tree, llm, top_k=1, k=100, max_tokens=None).retrieve("cats")
    assert [h.layer for h in hits] == [1, 0]
    everything = retriever(tree, llm, top_k=5, k=100, max_tokens=None).retrieve("cats")
    assert {h.id for h in everything} == {n.id for n in tree.nodes}


def test_max_candidates_shows_the_most_similar_only() -> None:
    tree = random_tree(40, fanout=4, dim=16, random_state=2)
    llm = ScriptedLLM(default='{"selected": []}')
    q = "leaf 3"
    retriever(tree, llm, start_layer=0, max_candidates=5).retrieve(q)
    shown = CANDIDATE.findall(llm.prompts[0])
    scores = tree.embeddings[tree.layer_rows(0)] @ FakeEmbedder(tree.dim).embed_query(q)
    assert shown == [tree.leaves[i].id for i in np.argsort(-scores, kind="stable")[:5]]


def test_k_and_max_tokens(tree: Tree) -> None:
    llm = ScriptedLLM(default=select_all)
    assert len(retriever(tree, llm, top_k=5, k=3).retrieve("cats")) == 3
    for budget in (6, 12, 20):
        hits = retriever(tree, llm, top_k=5, max_tokens=budget).retrieve("cats")
        assert hits and sum(h.node.token_count for h in hits) <= budget


def test_no_similar_nodes_means_no_llm_call(tree: Tree) -> None:
    llm = ScriptedLLM(default=select_all)
    assert retriever(tree, llm, min_score=0.99).retrieve("cats") == []
    assert llm.prompts == []


def test_a_filter_starts_at_the_highest_layer_it_keeps(
    one_summary_per_document_tree: Tree,
) -> None:
    # The top summaries span two documents each: a one-document filter keeps none of them,
    # so the LLM is first shown the layer below, not an empty top layer.
    docs_tree = one_summary_per_document_tree
    llm = ScriptedLLM(default=select_all)
    search = LLMGuidedRetriever(docs_tree, FakeEmbedder(), llm=llm, where={"doc_id": "d0"})
    hits = search.retrieve("cats purr")
    assert sorted(h.id for h in hits) == sorted(n.id for n in docs_tree.nodes if n.doc_id == "d0")
    assert [h.layer for h in hits] == [1, 0, 0]
    assert "(summary, layer 1" in llm.prompts[0]


@pytest.mark.parametrize("preview_chars", [1, 2, 3, 4, 10])
def test_previews_never_exceed_preview_chars(tree: Tree, preview_chars: int) -> None:
    llm = ScriptedLLM(default='{"selected": []}')
    retriever(tree, llm, preview_chars=preview_chars).retrieve("cats")
    shown = re.findall(r"^\[[^\]]+\] \([^)]*\) (.*)$", llm.prompts[0], re.MULTILINE)
    assert shown and all(len(text) <= preview_chars for text in shown)
    assert any(len(text) == preview_chars for text in shown)  # every text here is longer


def test_custom_prompt(tree: Tree) -> None:
    llm = ScriptedLLM(default='{"selected": []}')
    retriever(tree, llm, prompt="Q={query}\n{candidates}\nJSON please").retrieve("cats")
    assert llm.prompts[0].startswith("Q=cats\n[L1.")


def test_empty_tree_and_empty_query(tree: Tree) -> None:
    llm = ScriptedLLM(default=select_all)
    empty = Tree(nodes=(), embeddings=np.zeros((0, 8), np.float32))
    assert LLMGuidedRetriever(empty, FakeEmbedder(8), llm=llm).retrieve("cats") == []
    with pytest.raises(InvalidInputError):
        retriever(tree, llm).retrieve("")


@pytest.mark.parametrize(
    "params",
    [
        {"llm": object()},
        {"top_k": 0},
        {"max_candidates": -1},
        {"llm_timeout": 0},
        {"prompt": "no placeholder"},
        {"num_layers": 3},
        {"min_score": 2.0},
    ],
)
def test_validation(tree: Tree, params: dict) -> None:
    params.setdefault("llm", ScriptedLLM(default=select_all))
    with pytest.raises(InvalidParameterError):
        LLMGuidedRetriever(tree, FakeEmbedder(tree.dim), **params).retrieve("cats")
