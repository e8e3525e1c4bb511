"""Query latency of every retrieval strategy on synthetic trees of 1k, 10k and 100k nodes.

Measures the search itself: query vectors are precomputed (an embedder that looks them up
costs microseconds) and the LLM strategies get an instant scripted LLM, so what is left
is the library's own work (vector math, walking the tree, building prompts, parsing
answers, the asyncio plumbing).  Each strategy is timed over the same queries after a
warm-up query (the first query of a tree wraps it in its in-memory node store; that one-off
cost is printed separately), and the median is reported as milliseconds and as a ratio
of the baseline measured in the same run: a plain numpy brute force over all nodes
(``argsort(-(E @ q))[:k]``).  The machines are shared and noisy, so ratios within one run
mean more than absolute numbers.

BLAS and OpenMP run with ``--threads`` threads (default 1): a matrix-vector product is
memory-bound, and on a loaded machine a two-thread BLAS call waits a whole scheduler
time slice (about 12 ms) for its second thread, which would swamp every number here.

Usage:
    python benchmarks/query.py [--sizes 1000 10000 100000] [--queries 30] [--threads 1]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _synthetic import synthetic_queries, synthetic_tree

from raptor_core import (
    CollapsedTreeRetriever,
    FaissIndex,
    HybridRetriever,
    LLMGuidedRetriever,
    Tree,
    TreeTraversalRetriever,
    ValueBasedRetriever,
)
from raptor_core.retrieval.base import as_store
from raptor_core.testing import ScriptedLLM

K = 10
CANDIDATE = re.compile(r"^\[([^\]]+)\]", re.MULTILINE)


class LookupEmbedder:
    """Returns precomputed query vectors: query embedding costs nothing in the timings."""

    def __init__(self, vectors: dict[str, np.ndarray]) -> None:
        self.vectors = vectors

    def embed_documents(self, texts):
        return np.stack([self.vectors[t] for t in texts])

    def embed_query(self, text):
        return self.vectors[text]


def instant_llm() -> ScriptedLLM:
    """Chooses the first three candidates it is shown; the judge always wants more."""

    def answer(prompt: str) -> str:
        if '"enough"' in prompt:
            return '{"enough": false, "reason": "more"}'
        ids = CANDIDATE.findall(prompt)[:3]
        return json.dumps({"selected": [{"id": i, "reason": "first"} for i in ids]})

    return ScriptedLLM(default=answer)


def strategies(tree: Tree, embedder: LookupEmbedder) -> dict[str, Callable[[str], object]]:
    embeddings = tree.embeddings

    def baseline(query: str) -> object:
        scores = embeddings @ embedder.vectors[query]
        return np.argsort(-scores)[:K]

    faiss_index = FaissIndex.from_tree(tree)
    leaf_index = FaissIndex.from_tree(tree, layers=[0])
    runs: dict[str, Callable[[str], object]] = {"baseline: numpy matmul + argsort": baseline}
    retrievers = {
        "collapsed": CollapsedTreeRetriever(tree, embedder, k=K),
        "collapsed, leaves only (layers=[0])": CollapsedTreeRetriever(
            tree, embedder, k=K, layers=[0]
        ),
        "collapsed + FaissIndex": CollapsedTreeRetriever(tree, embedder, k=K, index=faiss_index),
        "traversal (top_k=5)": TreeTraversalRetriever(tree, embedder, k=K, top_k=5),
        "traversal (threshold=0.3)": TreeTraversalRetriever(tree, embedder, k=K, threshold=0.3),
        "value (chunk_k=20)": ValueBasedRetriever(tree, embedder, k=K),
        "value + FaissIndex (leaves)": ValueBasedRetriever(tree, embedder, k=K, index=leaf_index),
        "llm (instant LLM)": LLMGuidedRetriever(tree, embedder, llm=instant_llm(), k=K),
        "hybrid (instant LLM, no judge)": HybridRetriever(
            tree, embedder, llm=instant_llm(), k=K, judge=False
        ),
        "hybrid (instant LLM, judge)": HybridRetriever(tree, embedder, llm=instant_llm(), k=K),
    }
    for name, retriever in retrievers.items():
        runs[name] = retriever.retrieve
    return runs


def measure(run: Callable[[str], object], queries: list[str]) -> float:
    run(queries[0])  # warm-up
    times = []
    for query in queries:
        start = time.perf_counter()
        run(query)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 100_000])
    parser.add_argument("--queries", type=int, default=30, help="timed queries per strategy")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--threads", type=int, default=1, help="BLAS/OpenMP threads (1)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    FaissIndex()  # load faiss (and its OpenMP runtime) so the thread limit covers it too
    with threadpool_limits(limits=args.threads):
        run_all(args)


def run_all(args: argparse.Namespace) -> None:
    print(
        f"# query latency, median of {args.queries} queries (ms); dim {args.dim}, k={K}\n"
        f"# {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs ({args.threads} BLAS/OpenMP threads), "
        f"Python {platform.python_version()}, numpy {np.__version__}"
    )
    table: dict[str, dict[int, float]] = {}
    setup: dict[int, dict[str, float]] = {}
    for n in args.sizes:
        start = time.perf_counter()
        tree = synthetic_tree(n, dim=args.dim, seed=0)
        built = time.perf_counter() - start
        vectors = synthetic_queries(tree, args.queries + 1)
        queries = [f"q{i}" for i in range(len(vectors))]
        embedder = LookupEmbedder(dict(zip(queries, vectors, strict=True)))
        start = time.perf_counter()
        # The one-off per-tree cost, outside the timings: the in-memory node store that every
        # retriever over this tree shares (as_store caches it per tree), with its layer array.
        cached = as_store(tree)
        _ = cached.top_layer
        setup[len(tree)] = {"generate_s": built, "structure_s": time.perf_counter() - start}
        print(
            f"# {tree!r}: generated in {built:.1f} s, node store built in "
            f"{setup[len(tree)]['structure_s'] * 1000:.0f} ms (once per tree)"
        )
        for name, run in strategies(tree, embedder).items():
            table.setdefault(name, {})[len(tree)] = measure(run, queries)

    sizes = sorted({s for row in table.values() for s in row})
    baseline = table["baseline: numpy matmul + argsort"]
    width = max(len(name) for name in table)
    header = f"{'strategy':<{width}}" + "".join(f"{f'{s:,} nodes':>24}" for s in sizes)
    print(header)
    print("-" * len(header))
    for name, row in table.items():
        cells = "".join(f"{f'{row[s]:8.3f} ms ({row[s] / baseline[s]:5.2f}x)':>24}" for s in sizes)
        print(f"{name:<{width}}{cells}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"median_ms": table, "setup": setup, "k": K, "dim": args.dim}, indent=2)
        )


if __name__ == "__main__":
    main()
