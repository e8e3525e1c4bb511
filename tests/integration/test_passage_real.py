"""The default passage strategy on a real tree (MiniLM embeddings, cl100k tokens)."""

from __future__ import annotations

import pytest

from raptor_core import DEFAULT_STRATEGY, PassageRetriever, Tree, make_retriever
from raptor_core.evaluation.metrics import evidence_recall
from raptor_core.tokenizers import count_tokens, default_tokenizer

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


@pytest.mark.parametrize(("question", "word"), QUESTIONS, ids=IDS)
@pytest.mark.parametrize("budget", [400, 2000])
def test_passages_answer_within_the_budget(
    real_tree: Tree, st_embedder, question: str, word: str, budget: int
) -> None:
    retriever = make_retriever(DEFAULT_STRATEGY, real_tree, st_embedder, k=100)
    assert isinstance(retriever, PassageRetriever)
    hits = retriever.retrieve(question, max_tokens=budget)
    texts = [h.node.text for h in hits]
    assert any(word.lower() in t.lower() for t in texts)
    # Counted with the tree's own tokenizer (cl100k), the context never exceeds the budget
    # and is filled to within one leaf of it.
    tokenizer = default_tokenizer()
    used = sum(count_tokens(tokenizer, t) for t in texts)
    assert budget - 120 <= used <= budget
    assert all(0.0 <= h.score <= 1.0 for h in hits)


def test_a_passage_holds_a_whole_paragraph_that_one_leaf_splits(
    real_tree: Tree, st_embedder, multi_topic_text: str
) -> None:
    # Paragraphs of the source text longer than one ~100-token leaf: flat leaf retrieval
    # cuts them, a passage grown from the best leaf keeps them whole more often.
    paragraphs = [p for p in multi_topic_text.split("\n\n") if len(p.split()) > 110]
    assert paragraphs
    retriever = PassageRetriever(real_tree, st_embedder, k=100)
    leaves = make_retriever("collapsed", real_tree, st_embedder, k=100, layers=[0])
    found_passage = found_leaves = 0.0
    for paragraph in paragraphs:
        question = paragraph.split(". ")[0]
        found_passage += (
            evidence_recall(
                [paragraph], [h.node.text for h in retriever.retrieve(question, max_tokens=400)]
            )
            or 0.0
        )
        found_leaves += (
            evidence_recall(
                [paragraph], [h.node.text for h in leaves.retrieve(question, max_tokens=400)]
            )
            or 0.0
        )
    assert found_passage >= found_leaves
    assert found_passage > 0
