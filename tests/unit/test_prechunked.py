"""Pre-split chunks (``Document.chunk_of``): one leaf each, named by their id, never cut."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from raptor_core.build.builder import TreeBuilder
from raptor_core.exceptions import InvalidInputError
from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer
from raptor_core.types import Document as CoreDocument

CATS = "Cats purr softly. Cats sleep in the sun. Kittens chase string. A cat grooms its fur."


class PairClusterer:
    """Consecutive pairs: a fast, deterministic stand-in for UMAP+GMM."""

    def cluster(self, vectors: Any) -> list[list[int]]:
        n = len(vectors)
        return [list(range(i, min(i + 2, n))) for i in range(0, n, 2)]


def fast(**extra: Any) -> dict[str, Any]:
    options: dict[str, Any] = {
        "summarizer": EchoSummarizer(),
        "tokenizer": WhitespaceTokenizer(),
        "clusterer": PairClusterer(),
        "chunk_max_tokens": 8,
        "summary_max_tokens": 10,
        "cluster_max_tokens": 100,
    }
    options.update(extra)
    return options


def test_core_pre_split_chunks_are_single_leaves_named_by_their_id() -> None:
    long_text = " ".join(f"word{i}." for i in range(40))  # 40 tokens, chunk_max_tokens is 8
    docs = [
        CoreDocument(text=long_text, doc_id="chunk-a", chunk_of="book"),
        CoreDocument(text="Short one. Two words.", doc_id="chunk-b", chunk_of="book"),
        CoreDocument(text=CATS, doc_id="whole"),  # split by the builder as before
    ]
    tree = TreeBuilder(FakeEmbedder(16), **fast()).build(docs)
    leaves = {leaf.id: leaf for leaf in tree.leaves}
    assert leaves["chunk-a"].text == long_text
    assert leaves["chunk-a"].token_count == 40
    assert (leaves["chunk-a"].doc_id, leaves["chunk-a"].span) == ("book", None)
    whole = [leaf for leaf in tree.leaves if leaf.doc_id == "whole"]
    assert len(whole) > 1 and all(leaf.span is not None for leaf in whole)
    assert set(tree.doc_ids) == {"book", "whole"}


def test_core_estimate_counts_pre_split_chunks_whole() -> None:
    docs = [CoreDocument(text="a b c d e f g h i j k l", doc_id="c1", chunk_of="d")]
    estimate = TreeBuilder(FakeEmbedder(16), **fast()).estimate(docs)
    assert estimate.chunks == 1
    assert estimate.layers[0].embed_tokens == 12


def test_core_warns_when_a_chunk_exceeds_the_summariser_input(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # PairClusterer pairs neighbours: (long, short) pairs must be split, short pairs summarised.
    texts = ["x " * 150, "a b", "c d", "e f", "g h", "i j", "x " * 120, "k l", "x " * 101]
    docs = [CoreDocument(text=t, doc_id=f"c{i}", chunk_of="d") for i, t in enumerate(texts)]
    sent: list[list[str]] = []

    class Recording(EchoSummarizer):
        def summarize(self, texts: Any, *, max_tokens: int) -> str:
            sent.append(list(texts))
            return super().summarize(texts, max_tokens=max_tokens)

    options = fast(summarizer=Recording())
    with caplog.at_level(logging.WARNING, logger="raptor_core.build.leaves"):
        tree = TreeBuilder(FakeEmbedder(16), **options).build(docs)
    assert "3 pre-split chunk(s) are longer than cluster_max_tokens=100" in caplog.text
    # Never summarised: each long chunk is a cluster of its own and carried up unchanged.
    assert sent and not any(t.startswith("x x") for cluster in sent for t in cluster)
    assert len(tree.leaves) == len(texts)


@pytest.mark.parametrize("bad", ["", 3])
def test_core_rejects_a_bad_chunk_of(bad: Any) -> None:
    with pytest.raises(InvalidInputError, match="chunk_of"):
        TreeBuilder(FakeEmbedder(16), **fast()).build(
            [CoreDocument(text="some text", doc_id="c", chunk_of=bad)]
        )


def test_pre_split_leaves_survive_save_and_load(tmp_path: Any) -> None:
    from raptor_core.tree import Tree

    docs = [
        CoreDocument(
            text=f"Chunk {i} says something. More words here.", doc_id=f"n{i}", chunk_of="src"
        )
        for i in range(6)
    ]
    tree = TreeBuilder(FakeEmbedder(16), **fast(), random_state=0).build(docs)
    tree.save(tmp_path / "t")
    loaded = Tree.load(tmp_path / "t")
    assert [(n.id, n.doc_id, n.span) for n in loaded.leaves] == [
        (f"n{i}", "src", None) for i in range(6)
    ]
    assert loaded.num_layers == tree.num_layers >= 2
