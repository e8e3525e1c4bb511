"""Deterministic fakes for fast tests, shipped with the package (like httpx's MockTransport).

None of these need a model or the network.  ``FakeEmbedder`` gives texts that share words
similar vectors, so retrieval tests over it are meaningful, not random.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from numpy.typing import NDArray

from raptor_core.exceptions import LLMError
from raptor_core.testing_suites import NodeStoreTests, VectorIndexTests, store_tree
from raptor_core.tree import Node, Tree

__all__ = [
    "EchoSummarizer",
    "FakeEmbedder",
    "GroupClusterer",
    "NodeStoreTests",
    "ScriptedLLM",
    "VectorIndexTests",
    "WhitespaceTokenizer",
    "check_tree_invariants",
    "random_tree",
    "select_first",
    "store_tree",
    "tiny_tree",
]

_WORD = re.compile(r"\w+", re.UNICODE)


class FakeEmbedder:
    """Hashed bag-of-words embedder: deterministic, fast, and similar for texts sharing words.

    Args:
        dim: vector dimension.
    """

    def __init__(self, dim: int = 64) -> None:
        self.dim = dim
        self.calls = 0
        self.texts_embedded = 0

    def get_params(self) -> dict[str, int]:
        """The constructor parameters (a tree records these, not the call counters)."""
        return {"dim": self.dim}

    def _vector(self, text: str) -> NDArray[np.float32]:
        vec = np.zeros(self.dim, dtype=np.float32)
        for word in _WORD.findall(text.lower()):
            digest = hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest()
            bucket = int.from_bytes(digest[:4], "little") % self.dim
            sign = 1.0 if digest[4] & 1 else -1.0
            vec[bucket] += sign
        norm = float(np.linalg.norm(vec))
        if norm == 0.0:
            # Texts without words still need a valid direction: hash the raw string.
            seed = int.from_bytes(
                hashlib.blake2b(text.encode("utf-8"), digest_size=4).digest(), "little"
            )
            vec = np.random.default_rng(seed).standard_normal(self.dim).astype(np.float32)
            norm = float(np.linalg.norm(vec))
        return vec / norm

    def embed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Embed texts; ``(len(texts), dim)``."""
        self.calls += 1
        self.texts_embedded += len(texts)
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.stack([self._vector(t) for t in texts])

    def embed_query(self, text: str) -> NDArray[np.float32]:
        """Embed a query; ``(dim,)``."""
        return self._vector(text)


class WhitespaceTokenizer:
    """One token per whitespace-separated word; ``decode`` joins with single spaces."""

    def __init__(self) -> None:
        self._vocab: dict[str, int] = {}
        self._words: list[str] = []
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, list[str]]:
        # A lock cannot be pickled (a build on Ray sends the tokenizer to its workers).
        return {"words": list(self._words)}

    def __setstate__(self, state: dict[str, list[str]]) -> None:
        self._lock = threading.Lock()
        self._words = list(state["words"])
        self._vocab = {word: i for i, word in enumerate(self._words)}

    def encode(self, text: str) -> list[int]:
        """Return one id per word."""
        ids = []
        with self._lock:
            for word in text.split():
                if word not in self._vocab:
                    self._vocab[word] = len(self._words)
                    self._words.append(word)
                ids.append(self._vocab[word])
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Join the words of ``ids`` with spaces."""
        return " ".join(self._words[i] for i in ids)

    def count(self, text: str) -> int:
        """Number of words."""
        return len(text.split())


class EchoSummarizer:
    """Concatenates the cluster's texts and keeps the first ``max_tokens`` words.

    Only for tests: it is a truncation, not a summary.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, list[tuple[str, ...]]]:
        # A copy on another process (a Ray worker) records its own calls.
        return {"calls": list(self.calls)}

    def __setstate__(self, state: dict[str, list[tuple[str, ...]]]) -> None:
        self.calls = list(state["calls"])
        self._lock = threading.Lock()

    def summarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        """Return the first ``max_tokens`` words of the joined texts."""
        with self._lock:
            self.calls.append(tuple(texts))
        return " ".join(" ".join(texts).split()[:max_tokens])


class ScriptedLLM:
    """An :class:`~raptor_core.types.LLM` that replays scripted answers and records prompts.

    Args:
        responses: answers returned in order; a callable gets the prompt and returns the
            answer; an ``Exception`` instance is raised instead of answered.
        default: answer once the script is exhausted (``None`` = raise :class:`LLMError`).
    """

    def __init__(
        self,
        responses: Iterable[str | Exception | Callable[[str], str]] = (),
        *,
        default: str | Callable[[str], str] | None = None,
    ) -> None:
        self._script: deque[str | Exception | Callable[[str], str]] = deque(responses)
        self.default = default
        self.prompts: list[str] = []
        self._lock = threading.Lock()

    def _next(self, prompt: str) -> str:
        with self._lock:
            self.prompts.append(prompt)
            item = self._script.popleft() if self._script else self.default
        if item is None:
            msg = "ScriptedLLM ran out of scripted responses"
            raise LLMError(msg)
        if isinstance(item, Exception):
            raise item
        return item(prompt) if callable(item) else item

    def complete(self, prompt: str, *, max_tokens: int | None = None) -> str:
        """Return the next scripted answer."""
        return self._next(prompt)

    async def acomplete(self, prompt: str, *, max_tokens: int | None = None) -> str:
        """Async :meth:`complete`."""
        return self._next(prompt)


class GroupClusterer:
    """A deterministic :class:`~raptor_core.types.Clusterer`: consecutive runs of ``size`` rows.

    The last group takes what is left (a single row is then carried up unchanged), so trees
    built with it have every shape the builder makes, in milliseconds and without UMAP.
    """

    def __init__(self, size: int = 3) -> None:
        self.size = size

    def cluster(self, vectors: NDArray[np.float32]) -> list[list[int]]:
        """Groups of ``size`` consecutive row indices."""
        n = int(np.asarray(vectors).shape[0])
        return [list(range(i, min(i + self.size, n))) for i in range(0, n, self.size)]


def select_first(n: int = 2) -> Callable[[str], str]:
    """An answer function for :class:`ScriptedLLM`: select the first ``n`` candidates shown.

    Answers the selection prompt of LLM-guided search with the first ``n`` ``[id]`` lines
    and the judge of hybrid search with "not enough", so searches run to the end,
    deterministically.
    """
    pattern = re.compile(r"^\[([^\]]+)\]", re.MULTILINE)

    def answer(prompt: str) -> str:
        if '"enough"' in prompt:
            return '{"enough": false, "reason": "keep looking"}'
        ids = pattern.findall(prompt)[:n]
        return json.dumps({"selected": [{"id": i, "reason": "listed first"} for i in ids]})

    return answer


def tiny_tree(dim: int = 64) -> Tree:
    """A hand-built two-layer tree over two documents, embedded with :class:`FakeEmbedder`."""
    texts = [
        ("d1", "Cats purr and sleep most of the day."),
        ("d1", "Kittens chase string and play with cats."),
        ("d2", "Rockets burn fuel to reach orbit."),
        ("d2", "Satellites orbit the earth after rocket launch."),
    ]
    leaves = [
        Node(
            id=f"L0.{i}",
            text=t,
            layer=0,
            token_count=len(t.split()),
            doc_id=d,
            span=(0, len(t)),
            doc_ids=(d,),
        )
        for i, (d, t) in enumerate(texts)
    ]
    summaries = [
        Node(
            id="L1.0",
            text="Cats and kittens purr, sleep and play.",
            layer=1,
            token_count=7,
            children=("L0.0", "L0.1"),
            doc_ids=("d1",),
        ),
        Node(
            id="L1.1",
            text="Rockets launch satellites into orbit.",
            layer=1,
            token_count=5,
            children=("L0.2", "L0.3"),
            doc_ids=("d2",),
        ),
    ]
    nodes = (*leaves, *summaries)
    emb = FakeEmbedder(dim).embed_documents([n.text for n in nodes])
    record = {"class": "raptor_core.testing.FakeEmbedder", "dim": dim}
    return Tree(nodes=nodes, embeddings=emb, params={"embedder": record})


def random_tree(
    n_leaves: int = 60,
    *,
    fanout: int = 5,
    dim: int = 16,
    soft: float = 0.1,
    tokens: int = 20,
    random_state: int = 0,
) -> Tree:
    """A random multi-layer tree for retrieval tests and benchmarks (no model needed).

    Leaves are random unit vectors; each layer above groups about ``fanout`` nodes under
    one summary whose vector is the normalised mean of its children plus noise, so that
    similarity descends sensibly.  A ``soft`` fraction of nodes gets a second parent (soft
    clustering).  Layers shrink until at most ``fanout`` nodes remain; rows are
    layer-major, as TreeBuilder writes them.
    """
    rng = np.random.default_rng(random_state)
    vectors = rng.standard_normal((n_leaves, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    sizes = rng.integers(max(1, tokens // 2), tokens * 3 // 2 + 1, size=n_leaves)
    nodes = [
        Node(
            id=f"L0.{i}",
            text=f"leaf {i}",
            layer=0,
            token_count=int(sizes[i]),
            doc_id="doc",
            span=(0, 1),
            doc_ids=("doc",),
        )
        for i in range(n_leaves)
    ]
    blocks = [vectors]
    below = [n.id for n in nodes]
    layer = 0
    while len(below) > max(fanout, 1) or layer == 0:
        layer += 1
        n_parents = max(1, -(-len(below) // fanout))
        groups: list[list[int]] = [[] for _ in range(n_parents)]
        for position, child in enumerate(rng.permutation(len(below))):
            groups[position % n_parents].append(int(child))
        if n_parents > 1:
            for child in np.flatnonzero(rng.random(len(below)) < soft):
                groups[int(rng.integers(n_parents))].append(int(child))
        child_vectors = blocks[-1]
        parent_vectors = np.empty((n_parents, dim), dtype=np.float32)
        ids = []
        for p, group in enumerate(groups):
            members = sorted(set(group))
            mean = child_vectors[members].mean(axis=0) + 0.1 * rng.standard_normal(dim)
            parent_vectors[p] = mean / np.linalg.norm(mean)
            node_id = f"L{layer}.{p}"
            ids.append(node_id)
            nodes.append(
                Node(
                    id=node_id,
                    text=f"summary {layer}.{p}",
                    layer=layer,
                    token_count=int(rng.integers(max(1, tokens // 2), tokens + 1)),
                    children=tuple(below[c] for c in members),
                    doc_ids=("doc",),
                )
            )
        blocks.append(parent_vectors)
        below = ids
    return Tree(
        nodes=tuple(nodes),
        embeddings=np.concatenate(blocks),
        params={"generator": "random_tree", "random_state": random_state},
    )


def check_tree_invariants(tree: Tree, *, built: bool = True, extractive: bool = False) -> None:
    """Assert the invariants a built or incrementally updated tree keeps (for tests).

    Beyond what :class:`Tree` checks on construction (children exist one layer down, parents
    are the inverse of children):

    * every node below the top layer has a parent, and ``parents`` match the children lists;
    * a summary covers exactly its children's documents (``doc_ids`` is their union, in
      order of first appearance, and ``doc_id`` is set exactly when there is one document);
    * a carried node copies its only child's text, token count and embedding;
    * with ``built``: ids are the stable ids of :mod:`raptor_core.build.ids`;
    * with ``extractive`` (EchoSummarizer, ExtractiveSummarizer): every word of a summary
      occurs in the texts of its children, so no summary holds text from anywhere else.

    Raises:
        AssertionError: naming the node and the invariant it breaks.
    """
    from raptor_core.build.ids import leaf_id, summary_id

    parents: dict[str, list[str]] = {}
    for node in tree.nodes:
        for child in node.children:
            parents.setdefault(child, []).append(node.id)
    for node in tree.nodes:
        assert node.parents == tuple(parents.get(node.id, ())), f"{node.id}: parents"
        if node.layer < tree.top_layer:
            assert node.parents, f"{node.id} (layer {node.layer}) has no parent"
        if node.is_leaf:
            assert node.doc_ids == (node.doc_id,), f"{node.id}: leaf doc_ids"
            if built:
                assert node.span is not None, f"{node.id}: leaf without span"
                expected = leaf_id(str(node.doc_id), *node.span, node.text)
                assert node.id == expected, f"{node.id}: not the stable leaf id"
            continue
        kids = tree.children(node.id)
        assert all(k.layer == node.layer - 1 for k in kids), f"{node.id}: child layers"
        covered = tuple(dict.fromkeys(d for k in kids for d in k.doc_ids))
        assert node.doc_ids == covered, f"{node.id}: doc_ids {node.doc_ids} != {covered}"
        assert node.doc_id == (covered[0] if len(covered) == 1 else None), f"{node.id}: doc_id"
        if built:
            assert node.id == summary_id(node.layer, node.children), f"{node.id}: not stable"
        if len(kids) == 1:
            assert node.metadata.get("carried") is True, f"{node.id}: one child, not carried"
            assert node.text == kids[0].text, f"{node.id}: carried text differs"
            assert node.token_count == kids[0].token_count, f"{node.id}: carried tokens"
            same = tree.embeddings[tree.row(node.id)] == tree.embeddings[tree.row(kids[0].id)]
            assert bool(np.all(same)), f"{node.id}: carried embedding differs"
        elif extractive:
            source = {w for k in kids for w in _WORD.findall(k.text.lower())}
            extra = [w for w in _WORD.findall(node.text.lower()) if w not in source]
            assert not extra, f"{node.id}: summary words {extra[:5]} not in its children"
