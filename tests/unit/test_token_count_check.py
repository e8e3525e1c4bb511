"""A token count forged low (a tree or store from a stranger) must not overrun the budget.

Budgets are filled with the counts nodes record.  A hit whose text is long for its count is
counted again with the tokenizer the tree's params name, and a count below the text's is a
TreeFormatError, for every strategy, sync and async, from a tree, a store or a saved file.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from raptor_core import FileNodeStore, InMemoryNodeStore, TreeBuilder, TreeFormatError
from raptor_core.retrieval.registry import make_retriever
from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer
from raptor_core.tree import Tree

CATS = "Cats purr softly. Kittens chase string. A cat grooms its fur. Cats nap in the sun. " * 3
BEES = "Bees dance to share news. A hive keeps warm in winter. Queens lay eggs in spring. " * 3
STRATEGIES = ["collapsed", "traversal", "value", "mmr", "passage"]


@pytest.fixture(scope="module")
def honest() -> Tree:
    builder = TreeBuilder(
        FakeEmbedder(32),
        EchoSummarizer(),
        tokenizer=WhitespaceTokenizer(),
        chunk_max_tokens=12,
        summary_max_tokens=10,
        random_state=0,
    )
    return builder.build([{"doc_id": "cats", "text": CATS}, {"doc_id": "bees", "text": BEES}])


def _forged(tree: Tree) -> Tree:
    """Every node claims one token for a text of thousands of words."""
    nodes = tuple(
        dataclasses.replace(node, text=f"{node.text} " + "purr " * 2000, token_count=1)
        for node in tree.nodes
    )
    return Tree(nodes=nodes, embeddings=tree.embeddings, params=tree.params)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_count_forged_low_is_a_format_error(honest: Tree, strategy: str) -> None:
    forged = _forged(honest)
    retriever = make_retriever(strategy, forged, FakeEmbedder(32), k=5, max_tokens=50)
    with pytest.raises(TreeFormatError, match="records 1 tokens but its text has"):
        retriever.retrieve("cats purr")
    with pytest.raises(TreeFormatError, match="records 1 tokens but its text has"):
        asyncio.run(retriever.aretrieve("cats purr"))


def test_from_a_store_and_a_saved_tree_too(honest: Tree, tmp_path: Path) -> None:
    forged = _forged(honest)
    path = forged.save(tmp_path / "t")
    for source in (InMemoryNodeStore.from_tree(forged), FileNodeStore.open(path), Tree.load(path)):
        retriever = make_retriever("collapsed", source, FakeEmbedder(32), k=5, max_tokens=50)
        with pytest.raises(TreeFormatError, match="rebuild it"):
            retriever.retrieve("cats purr")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_honest_counts_pass_even_when_counted_again(honest: Tree, strategy: str) -> None:
    """Long words (many bytes a token) are counted again and pass: their counts are exact."""
    long_words = tuple(
        dataclasses.replace(
            node,
            text=" ".join(f"{word}{'x' * 20}" for word in node.text.split()),
        )
        for node in honest.nodes
    )
    tree = Tree(nodes=long_words, embeddings=honest.embeddings, params=honest.params)
    retriever = make_retriever(strategy, tree, FakeEmbedder(32), k=5, max_tokens=50)
    hits = retriever.retrieve("cats purr")
    assert hits
    assert sum(h.node.token_count for h in hits) <= 50


def test_a_tree_without_a_known_tokenizer_is_not_checked(honest: Tree) -> None:
    """Params that name no allowlisted tokenizer: nothing to count with (documented)."""
    forged = _forged(honest)
    bare = Tree(nodes=forged.nodes, embeddings=forged.embeddings, params={})
    retriever = make_retriever("collapsed", bare, FakeEmbedder(32), k=5, max_tokens=50)
    assert retriever.retrieve("cats purr")
