"""Incremental trees through the real parts: MiniLM, UMAP/GMM, tiktoken, extractive summaries."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import pytest

from raptor_core.build.builder import TreeBuilder
from raptor_core.build.summarizers import ExtractiveSummarizer
from raptor_core.retrieval import CollapsedTreeRetriever
from raptor_core.testing import check_tree_invariants
from raptor_core.tree import Tree

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class CountingSummarizer:
    """The extractive summariser, counting its calls."""

    def __init__(self, inner: ExtractiveSummarizer) -> None:
        self.inner = inner
        self.calls = 0

    def summarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        self.calls += 1
        return self.inner.summarize(texts, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def sections(multi_topic_text: str) -> list[dict[str, str]]:
    parts = re.split(r"^## ", multi_topic_text, flags=re.MULTILINE)[1:]
    return [{"doc_id": f"essay-{i}", "text": "## " + p.strip()} for i, p in enumerate(parts)]


@pytest.fixture(scope="module")
def grown(st_embedder, sections):
    summarizer = CountingSummarizer(ExtractiveSummarizer(st_embedder))
    builder = TreeBuilder(st_embedder, summarizer, random_state=0)
    tree = builder.build(sections[:-1])
    build_calls = summarizer.calls
    summarizer.calls = 0
    result = builder.insert(tree, sections[-1:])
    return builder, summarizer, tree, build_calls, result


def test_insert_is_local_and_keeps_the_rest(grown, sections) -> None:
    _, summarizer, tree, build_calls, result = grown
    new: Tree = result.tree
    check_tree_invariants(new, extractive=True)
    assert new.doc_ids == tuple(s["doc_id"] for s in sections)
    assert result.report.summary_calls == summarizer.calls < build_calls
    assert result.report.embedded_chunks == sum(1 for n in new.leaves if n.doc_id == "essay-5")
    for node in tree.nodes:
        if node.id in new:
            row_old, row_new = tree.row(node.id), new.row(node.id)
            assert node.text == new.node(node.id).text
            assert np.array_equal(tree.embeddings[row_old], new.embeddings[row_new])
    # Everything summarised again lies above the new document.
    above = {
        a.id for leaf in new.leaves if leaf.doc_id == "essay-5" for a in new.ancestors(leaf.id)
    }
    made = [i for i in result.report.nodes_added if new.node(i).layer > 0]
    assert made and set(made) <= above


def test_the_new_document_is_retrievable(grown, st_embedder) -> None:
    result = grown[4]
    hits = CollapsedTreeRetriever(result.tree, st_embedder, k=5).retrieve(
        "How do vaccines train the immune system with antigens?"
    )
    assert any("essay-5" in hit.node.doc_ids for hit in hits[:3])


def test_delete_removes_every_trace(grown) -> None:
    builder, _, _, _, result = grown
    tree = result.tree
    unique = {
        w
        for n in tree.leaves
        if n.doc_id == "essay-0"
        for w in re.findall(r"[a-z]{6,}", n.text.lower())
    } - {
        w
        for n in tree.leaves
        if n.doc_id != "essay-0"
        for w in re.findall(r"[a-z]{6,}", n.text.lower())
    }
    assert unique
    deleted = builder.delete(tree, ["essay-0"])
    check_tree_invariants(deleted.tree, extractive=True)
    for node in deleted.tree.nodes:
        assert "essay-0" not in node.doc_ids
        assert not unique & set(re.findall(r"[a-z]{6,}", node.text.lower())), node.id
    assert deleted.report.docs_removed == ("essay-0",)


def test_same_operations_same_tree(grown, st_embedder, sections) -> None:
    _, _, tree, _, result = grown
    again = TreeBuilder(
        st_embedder, CountingSummarizer(ExtractiveSummarizer(st_embedder)), random_state=0
    ).insert(tree, sections[-1:])
    assert [n.id for n in again.tree.nodes] == [n.id for n in result.tree.nodes]
    assert np.array_equal(again.tree.embeddings, result.tree.embeddings)
