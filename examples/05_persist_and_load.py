"""Save a tree, load it back (memory-mapped), open it lazily, and see what a damaged file does.

Why: building is the expensive part, so trees are saved once and queried many times. The
format is plain files (tree.json + one .npy matrix + the node index tree.idx), written
atomically and checksummed; a large tree can be searched without loading it
(FileNodeStore.open reads the index and parses only the nodes it returns);
nothing is pickled, so loading a tree from an untrusted source cannot run code, and a
truncated or edited tree is refused with TreeFormatError instead of giving wrong answers.

Run: python examples/05_persist_and_load.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from raptor_core import (
    CollapsedTreeRetriever,
    FileNodeStore,
    Tree,
    TreeBuilder,
    TreeFormatError,
)
from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer

TEXTS = [
    "Bees dance to share the direction of flowers. The angle of the dance gives the direction.",
    "Volcanoes erupt when magma rises. Sticky magma traps gas and explodes.",
    "Sourdough rises thanks to wild yeast. A starter is fed flour and water.",
    "Apollo 11 landed on the Moon in July 1969. Armstrong and Aldrin walked on the surface.",
]


def main() -> None:
    # Fakes keep this example instant; the format is the same with the real model.
    embedder = FakeEmbedder(64)
    builder = TreeBuilder(
        embedder, EchoSummarizer(), tokenizer=WhitespaceTokenizer(), chunk_max_tokens=10
    )
    tree = builder.build(TEXTS)
    with tempfile.TemporaryDirectory() as tmp:
        directory = tree.save(Path(tmp) / "tree")
        print("saved:", sorted(p.name for p in directory.iterdir()))

        loaded = Tree.load(directory, mmap=True)
        hits = CollapsedTreeRetriever(loaded, embedder, k=2).retrieve("Who walked on the Moon?")
        print("top hit after reload:", hits[0].node.text)

        # Same answer without reading every node: what you want for a million-node tree.
        store = FileNodeStore.open(directory)
        lazy = CollapsedTreeRetriever(store, embedder, k=2).retrieve("Who walked on the Moon?")
        print("top hit, opened lazily:", lazy[0].node.text)

        matrix = next(directory.glob("embeddings-*.npy"))
        matrix.write_bytes(matrix.read_bytes()[:-16])  # simulate a truncated copy
        try:
            Tree.load(directory)
        except TreeFormatError as exc:
            print("damaged tree refused:", exc)


if __name__ == "__main__":
    main()
