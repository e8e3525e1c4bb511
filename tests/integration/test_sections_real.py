"""Section context with the real model: leaves under a heading are found by their section."""

from __future__ import annotations

import numpy as np

from raptor_core import TreeBuilder
from raptor_core.build.sections import leaf_headings, leaf_table_headers
from raptor_core.types import Document

# Section bodies that never name their section: only the heading says what they are about.
TEXT = """# Notes on our system

## Training cost
It took four days on eight machines to converge, and the electricity bill came to about
nine hundred dollars in all. We stopped early twice because the loss stalled.

## Dataset
We collected ten thousand posts from public forums between March and June, removed
duplicates and kept the ones with at least twenty words. Two people labelled each one.

## Limitations
The posts are all in English and most come from two forums. People who write there
are younger than the population at large, so the labels may not carry over.
"""


def test_leaf_vectors_mix_plain_and_in_context_embeddings(st_embedder) -> None:
    doc = Document(text=TEXT, doc_id="notes")
    tree = TreeBuilder(st_embedder, chunk_max_tokens=30, max_layers=0, random_state=0).build([doc])
    plain = TreeBuilder(
        st_embedder, chunk_max_tokens=30, max_layers=0, random_state=0, section_context=False
    ).build([doc])
    leaves = tree.leaves
    spans = [leaf.span for leaf in leaves if leaf.span is not None]
    headings = leaf_headings(TEXT, spans)
    assert "Training cost" in headings and "Dataset" in headings

    for leaf, heading in zip(leaves, headings, strict=True):
        row = tree.row(leaf.id)
        alone = st_embedder.embed_documents([leaf.text])[0]
        if heading is None:
            np.testing.assert_allclose(tree.embeddings[row], alone, atol=1e-5)
            continue
        in_context = st_embedder.embed_documents([f"{heading}\n{leaf.text}"])[0]
        mixed = alone.astype(np.float64) + in_context
        np.testing.assert_allclose(tree.embeddings[row], mixed / np.linalg.norm(mixed), atol=1e-5)

    # A question about a section moves toward that section's leaves, not the others'.
    query = st_embedder.embed_query("How much did training cost?")
    training = [leaf for leaf, h in zip(leaves, headings, strict=True) if h == "Training cost"]
    others = [
        leaf for leaf, h in zip(leaves, headings, strict=True) if h not in (None, "Training cost")
    ]
    gain = {
        leaf.id: float(tree.embeddings[tree.row(leaf.id)] @ query)
        - float(plain.embeddings[plain.row(leaf.id)] @ query)
        for leaf in [*training, *others]
    }
    assert min(gain[leaf.id] for leaf in training) > max(gain[leaf.id] for leaf in others)
    # Of the leaves that do not hold a heading themselves, a training-cost one comes first.
    body = [leaf for leaf in leaves if "#" not in leaf.text]
    best = max(body, key=lambda leaf: float(tree.embeddings[tree.row(leaf.id)] @ query))
    assert best in training


# Three tables with the same row labels: only each table's header row says whose they are.
_ITEMS = ["Revenue", "Cost of revenue", "Research and development", "Marketing", "Operating income"]
TABLES = "\n\n".join(
    f"Results for the fiscal year.\n\n| {segment} | 2024 | 2023 |\n|---|---:|---:|\n"
    + "\n".join(
        f"| {item} | {100 * (i + 1) + j} | {90 * (i + 1) + j} |" for j, item in enumerate(_ITEMS)
    )
    for i, segment in enumerate(["Cloud services segment", "Gaming segment", "Devices segment"])
)


def test_table_rows_are_found_by_their_tables_header(st_embedder) -> None:
    doc = Document(text=TABLES, doc_id="filing")
    tree = TreeBuilder(st_embedder, chunk_max_tokens=20, max_layers=0, random_state=0).build([doc])
    leaves = tree.leaves
    spans = [leaf.span for leaf in leaves if leaf.span is not None]
    headers = leaf_table_headers(TABLES, spans)
    for leaf, header in zip(leaves, headers, strict=True):
        if header is None:
            continue
        alone = st_embedder.embed_documents([leaf.text])[0]
        in_context = st_embedder.embed_documents([f"{header}\n{leaf.text}"])[0]
        mixed = alone.astype(np.float64) + in_context
        np.testing.assert_allclose(
            tree.embeddings[tree.row(leaf.id)], mixed / np.linalg.norm(mixed), atol=1e-5
        )
    # The operating-income rows sit below each table's header, in leaves of their own.
    rows = [
        (leaf, header)
        for leaf, header in zip(leaves, headers, strict=True)
        if "Operating income" in leaf.text
    ]
    assert len(rows) == 3 and all(header is not None for _, header in rows)
    query = st_embedder.embed_query("What was the operating income of the Gaming segment?")
    best = max(rows, key=lambda pair: float(tree.embeddings[tree.row(pair[0].id)] @ query))
    assert best[1] == "Gaming segment | 2024 | 2023"
    # The header moved the Gaming row toward the question more than it moved the others.
    plain = TreeBuilder(
        st_embedder, chunk_max_tokens=20, max_layers=0, random_state=0, section_context=False
    ).build([doc])
    gain = {
        header: float(tree.embeddings[tree.row(leaf.id)] @ query)
        - float(plain.embeddings[plain.row(leaf.id)] @ query)
        for leaf, header in rows
    }
    gaming = gain.pop("Gaming segment | 2024 | 2023")
    assert gaming > max(gain.values())
