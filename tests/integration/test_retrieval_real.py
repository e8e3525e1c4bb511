"""Every retrieval strategy on a real tree (MiniLM embeddings) over a six-topic text."""

from __future__ import annotations

import json
import re
from itertools import pairwise

import pytest

from raptor_core import (
    CollapsedTreeRetriever,
    FaissIndex,
    HybridRetriever,
    LLMGuidedRetriever,
    NumpyIndex,
    Tree,
    TreeTraversalRetriever,
    ValueBasedRetriever,
)
from raptor_core.testing import ScriptedLLM

pytestmark = pytest.mark.integration

#: (question, a word that the passage answering it contains)
QUESTIONS = [
    ("Who were the crew of Apollo 11?", "Armstrong"),
    ("What dance do honeybees use to show where flowers are?", "waggle"),
    ("Who built the printing press in Mainz?", "Gutenberg"),
    ("What makes some volcanic eruptions explosive?", "silica"),
    ("What does hydration mean for a sourdough loaf?", "hydration"),
    ("How do mRNA vaccines work?", "mRNA"),
]
IDS = [q for q, _ in QUESTIONS]


def mentions(texts, word: str) -> bool:
    return any(word.lower() in t.lower() for t in texts)


@pytest.mark.parametrize(("question", "word"), QUESTIONS, ids=IDS)
def test_collapsed_finds_the_right_section(real_tree: Tree, st_embedder, question, word) -> None:
    hits = CollapsedTreeRetriever(real_tree, st_embedder, k=5).retrieve(question)
    assert mentions([h.node.text for h in hits], word)


def test_collapsed_draws_on_several_layers(real_tree: Tree, st_embedder) -> None:
    layers = set()
    for question, _ in QUESTIONS:
        hits = CollapsedTreeRetriever(real_tree, st_embedder, k=10).retrieve(question)
        layers |= {h.layer for h in hits}
        assert sum(h.node.token_count for h in hits) <= 2000
    assert len(layers) >= 2


def test_layer_restricted_search(real_tree: Tree, st_embedder) -> None:
    question, word = QUESTIONS[0]
    leaves = CollapsedTreeRetriever(real_tree, st_embedder, k=3, layers=[0]).retrieve(question)
    assert {h.layer for h in leaves} == {0} and mentions([h.node.text for h in leaves], word)
    top = real_tree.top_layer
    tops = CollapsedTreeRetriever(real_tree, st_embedder, k=50, layers=[top]).retrieve(question)
    assert {h.layer for h in tops} == {top}


@pytest.mark.parametrize(("question", "word"), QUESTIONS, ids=IDS)
def test_traversal_descends_into_the_right_section(
    real_tree: Tree, st_embedder, question, word
) -> None:
    hits = TreeTraversalRetriever(real_tree, st_embedder, top_k=3).retrieve(question)
    leaves = [h for h in hits if h.layer == 0]
    assert leaves and mentions([h.node.text for h in leaves], word)
    for hit in hits:
        for parent, child in pairwise(hit.path):
            assert child in real_tree.node(parent).children


@pytest.mark.parametrize(("question", "word"), QUESTIONS, ids=IDS)
def test_value_search_ranks_nodes_holding_the_answer(
    real_tree: Tree, st_embedder, question, word
) -> None:
    hits = ValueBasedRetriever(real_tree, st_embedder, k=3, chunk_k=10).retrieve(question)
    best = hits[0]
    evidence = [real_tree.node(chunk).text for chunk, _ in best.evidence]
    assert mentions(evidence, word)
    under = [leaf.text for leaf in real_tree.leaf_descendants(best.id)]
    assert mentions(under, word)


def test_faiss_and_numpy_indexes_agree_on_the_real_tree(real_tree: Tree, st_embedder) -> None:
    numpy_index, faiss_index = NumpyIndex.from_tree(real_tree), FaissIndex.from_tree(real_tree)
    for question, _ in QUESTIONS:
        a = CollapsedTreeRetriever(real_tree, st_embedder, index=numpy_index).retrieve(question)
        b = CollapsedTreeRetriever(real_tree, st_embedder, index=faiss_index).retrieve(question)
        c = CollapsedTreeRetriever(real_tree, st_embedder).retrieve(question)
        assert [h.id for h in a] == [h.id for h in b] == [h.id for h in c]


APOLLO_WORDS = ("apollo", "crew", "astronaut", "armstrong")


def keyword_llm(words: tuple[str, ...], answer: str) -> ScriptedLLM:
    """A stand-in LLM: picks the candidates that mention any of ``words``; the judge is
    satisfied once the context mentions ``answer``."""

    def reply(prompt: str) -> str:
        if '"enough"' in prompt:
            context = prompt.split("Context:", 1)[1]
            return json.dumps({"enough": answer.lower() in context.lower(), "reason": "kw"})
        picked = [
            {"id": m.group(1), "reason": "on topic"}
            for m in re.finditer(r"^\[([^\]]+)\] \([^)]*\) (.*)$", prompt, re.MULTILINE)
            if any(w in m.group(2).lower() for w in words)
        ]
        return json.dumps({"selected": picked})

    return ScriptedLLM(default=reply)


def test_llm_guided_search_follows_the_llm(real_tree: Tree, st_embedder) -> None:
    question, word = QUESTIONS[0]
    llm = keyword_llm(APOLLO_WORDS, word)
    hits = LLMGuidedRetriever(real_tree, st_embedder, llm=llm, top_k=5).retrieve(question)
    assert hits and all(any(w in h.node.text.lower() for w in APOLLO_WORDS) for h in hits)
    leaves = [h for h in hits if h.layer == 0]
    assert leaves and mentions([h.node.text for h in leaves], word)
    assert hits[-1].path[0] in {n.id for n in real_tree.layer(real_tree.top_layer)}


async def test_hybrid_stops_when_the_judge_sees_the_answer(real_tree: Tree, st_embedder) -> None:
    question, word = QUESTIONS[0]
    llm = keyword_llm(APOLLO_WORDS, word)
    retriever = HybridRetriever(real_tree, st_embedder, llm=llm, k=20, timeout=30)
    result = await retriever.asearch(question)
    assert result.stopped_early and result.judgements[-1].enough
    assert word.lower() in result.hits[-1].node.text.lower()
    assert set(result.found_by) >= {h.id for h in result.hits}
