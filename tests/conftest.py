"""Shared fixtures: the real embedding model is loaded once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Offline machine: the packaged model loads from disk, and the tokenizer pools must not
# fight pytest's own threads.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DATA_DIR = Path(__file__).parent / "data"
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def st_embedder():
    """The real sentence-transformers embedder (packaged all-MiniLM-L6-v2), shared by all tests.

    The model is cached per process by SentenceTransformerEmbedder, so every test that builds
    its own default embedder reuses this load as well.
    """
    from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder

    embedder = SentenceTransformerEmbedder()
    embedder.embed_query("warm up")
    return embedder


@pytest.fixture(scope="session")
def multi_topic_text() -> str:
    """A real multi-topic text (tests/data/multi_topic.md), about 3,000 tokens."""
    return (DATA_DIR / "multi_topic.md").read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def real_tree(st_embedder, multi_topic_text):
    """A tree built with the real model, UMAP/GMM and the extractive summariser (seed 0)."""
    from raptor_core.build.builder import TreeBuilder

    return TreeBuilder(st_embedder, random_state=0).build(
        [{"doc_id": "topics", "text": multi_topic_text, "metadata": {"source": "multi_topic.md"}}]
    )


@pytest.fixture(scope="session")
def chroma_server(tmp_path_factory):
    """A real Chroma server (``chroma run``) on 127.0.0.1 for the whole session.

    Use ``chroma_server.client()`` for a ``chromadb.HttpClient``; give each test its own
    collection name.  Skipped when chromadb is not installed.
    """
    pytest.importorskip("chromadb")
    import chroma_server as chroma

    server = chroma.start(tmp_path_factory.mktemp("chroma") / "db")
    yield server
    chroma.stop(server)


@pytest.fixture(scope="session")
def one_summary_per_document_tree():
    """Six documents of two leaves: one summary per document, top summaries over two each.

    A one-document filter (``where={"doc_id": "d0"}``) keeps nothing of the top layer: the
    tree for the filtered descents of traversal, LLM-guided and hybrid search.
    """
    from raptor_core.build.builder import TreeBuilder
    from raptor_core.testing import (
        EchoSummarizer,
        FakeEmbedder,
        GroupClusterer,
        WhitespaceTokenizer,
    )

    docs = [
        {"doc_id": f"d{i}", "text": f"Cats purr {i}. Kittens play {i}. Dogs bark {i}."}
        for i in range(6)
    ]
    builder = TreeBuilder(
        FakeEmbedder(),
        EchoSummarizer(),
        tokenizer=WhitespaceTokenizer(),
        clusterer=GroupClusterer(2),
        chunk_max_tokens=8,
    )
    tree = builder.build(docs)
    assert tree.top_layer == 2
    assert all(n.doc_id is None for n in tree.nodes if n.layer == 2)
    return tree
