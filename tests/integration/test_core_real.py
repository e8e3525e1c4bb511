"""Issue 2 behaviour through the real parts: MiniLM embeddings, UMAP/GMM, tiktoken, extractive summaries."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import warm_python

from raptor_core.build.builder import TreeBuilder
from raptor_core.retrieval import CollapsedTreeRetriever
from raptor_core.tokenizers import count_tokens
from raptor_core.tree import Tree

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "data" / "corpus"


def test_real_tree_has_summary_layers(real_tree: Tree) -> None:
    assert real_tree.num_layers >= 2
    assert len(real_tree.layer(1)) < len(real_tree.leaves)
    for leaf in real_tree.leaves:
        assert leaf.token_count <= 100
        assert leaf.doc_id == "topics" and leaf.metadata == {"source": "multi_topic.md"}
    for node in real_tree.layer(1):
        assert node.children and node.doc_ids == ("topics",)
        assert 0 < node.token_count <= 100


def test_every_summary_input_fits_the_limit(real_tree: Tree) -> None:
    limit = real_tree.params["cluster_max_tokens"]
    for layer in range(1, real_tree.num_layers):
        for node in real_tree.layer(layer):
            if len(node.children) > 1:
                assert sum(c.token_count for c in real_tree.children(node.id)) <= limit


def test_recursive_reclustering_keeps_summary_inputs_small(
    st_embedder, multi_topic_text: str
) -> None:
    limit = 400
    tree = TreeBuilder(st_embedder, cluster_max_tokens=limit, random_state=0, max_layers=2).build(
        [multi_topic_text]
    )
    assert tree.num_layers >= 2
    for node in tree.layer(1):
        assert sum(c.token_count for c in tree.children(node.id)) <= limit


def test_extractive_summaries_are_real_sentences(real_tree: Tree) -> None:
    from raptor_core.build.chunking import split_sentences

    for node in real_tree.layer(1):
        children = [c.text for c in real_tree.children(node.id)]
        child_sentences = {
            " ".join(t[s:e].split()) for t in children for s, e in split_sentences(t)
        }
        summary_sentences = [
            " ".join(node.text[s:e].split()) for s, e in split_sentences(node.text)
        ]
        # Every sentence of an extractive summary is a whole sentence of its children...
        assert summary_sentences and all(s in child_sentences for s in summary_sentences)
        # ...and the summary is not simply the children's opening.
        opening = " ".join(" ".join(children).split())[: len(node.text)]
        if len(children) > 1:
            assert node.text != opening


def test_same_seed_same_tree(st_embedder, multi_topic_text: str, real_tree: Tree) -> None:
    again = TreeBuilder(st_embedder, random_state=0).build(
        [{"doc_id": "topics", "text": multi_topic_text, "metadata": {"source": "multi_topic.md"}}]
    )
    assert [n.text for n in again.nodes] == [n.text for n in real_tree.nodes]
    assert [n.children for n in again.nodes] == [n.children for n in real_tree.nodes]
    assert np.allclose(again.embeddings, real_tree.embeddings, atol=1e-5)


def test_save_load_round_trip_real(real_tree: Tree, tmp_path: Path, st_embedder) -> None:
    real_tree.save(tmp_path)
    loaded = Tree.load(tmp_path)
    assert loaded.nodes == real_tree.nodes
    assert np.array_equal(loaded.embeddings, real_tree.embeddings)
    q = "Who walked on the Moon in 1969?"
    a = CollapsedTreeRetriever(real_tree, st_embedder).retrieve(q)
    b = CollapsedTreeRetriever(loaded, st_embedder).retrieve(q)
    assert [(h.id, h.score) for h in a] == [(h.id, h.score) for h in b]


@pytest.mark.parametrize("budget", [100, 400, 2000])
def test_collapsed_respects_budget_and_mixes_layers(
    real_tree: Tree, st_embedder, budget: int
) -> None:
    retriever = CollapsedTreeRetriever(real_tree, st_embedder, k=50, max_tokens=budget)
    hits = retriever.retrieve(
        "What are the main topics: bees, printing, volcanoes, bread, the Moon, vaccines?"
    )
    assert sum(h.node.token_count for h in hits) <= budget
    scores = [h.score for h in hits]
    assert scores == sorted(scores, reverse=True)
    if budget == 2000:
        assert len({h.layer for h in hits}) >= 2


def test_collapsed_finds_the_right_topic(real_tree: Tree, st_embedder) -> None:
    retriever = CollapsedTreeRetriever(real_tree, st_embedder, k=3, max_tokens=400)
    hits = retriever.retrieve("Which volcano erupted in 1883?")
    assert any("Krakatoa" in h.node.text for h in hits)


def test_tiny_inputs_build_with_real_clustering(st_embedder) -> None:
    for texts in (
        ["One sentence only."],
        ["First doc.", "Second doc."],
        [f"Doc {i} about item {i}." for i in range(5)],
    ):
        tree = TreeBuilder(st_embedder, random_state=0).build(texts)
        assert len(tree.leaves) == len(texts)


# -- CLI through a subprocess, with the real model ----------------------------------------------
def _raptor(*args: str) -> subprocess.CompletedProcess[str]:
    return warm_python.raptor(*args, timeout=600)


@pytest.fixture(scope="module")
def cli_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "tree"
    proc = _raptor(
        "build",
        str(CORPUS),
        str(ROOT / "tests" / "data" / "multi_topic.md"),
        "--out",
        str(out),
        "--seed",
        "0",
    )
    assert proc.returncode == 0, proc.stderr
    assert "documents" in proc.stdout and "chunks" in proc.stdout and "total" in proc.stdout
    return out


def test_cli_build_reads_all_file_kinds(cli_tree: Path) -> None:
    tree = Tree.load(cli_tree)
    doc_ids = set(tree.doc_ids)
    assert any(d.endswith("bees.txt") for d in doc_ids)
    assert any(d.endswith("ocean.md") for d in doc_ids)
    notes = [
        json.loads(line)
        for line in (CORPUS / "notes.jsonl").read_text().splitlines()
        if line.strip()
    ]
    assert {n["doc_id"] for n in notes} <= doc_ids
    leaf = next(n for n in tree.leaves if n.doc_id == notes[0]["doc_id"])
    assert leaf.metadata["author"] == notes[0]["author"]


def test_cli_query_json(cli_tree: Path) -> None:
    proc = _raptor(
        "query",
        str(cli_tree),
        "What causes ocean tides?",
        "--top-k",
        "4",
        "--max-tokens",
        "300",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    hits = json.loads(proc.stdout)
    assert 0 < len(hits) <= 4
    assert {"id", "layer", "score", "text", "doc_id"} <= set(hits[0])
    assert sum(count_tokens_of(h["text"]) for h in hits) <= 300 + 5 * len(hits)
    assert any("moon" in h["text"].lower() for h in hits)
    for h in hits:
        if h["layer"] > 0:
            assert h["doc_ids"]


def count_tokens_of(text: str) -> int:
    from raptor_core.tokenizers import default_tokenizer

    return count_tokens(default_tokenizer(), text)


def test_cli_query_text_and_inspect(cli_tree: Path) -> None:
    proc = _raptor("query", str(cli_tree), "Who was on the Apollo 11 crew?", "-k", "2")
    assert proc.returncode == 0, proc.stderr
    assert "layer" in proc.stdout
    proc = _raptor("inspect", str(cli_tree))
    assert proc.returncode == 0, proc.stderr
    assert (
        "compression" in proc.stdout
        and "build parameters" in proc.stdout
        and "random_state: 0" in proc.stdout
    )


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    proc = _raptor("query", str(tmp_path / "missing"), "q")
    assert proc.returncode == 2
    assert "no RAPTOR tree" in proc.stderr and "Traceback" not in proc.stderr
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\x00\x01\x02binary")
    proc = _raptor("build", str(binary), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "binary" in proc.stderr and "Traceback" not in proc.stderr
