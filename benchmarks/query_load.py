"""Query latency alone, beside a CPU-bound process, and from 16 threads at once.

Three parts, each printed as ratios against baselines measured in the same run:

1. **Scoring options at 10k nodes**: the matrix-vector product behind every dense search, by
   the ways the query path could run it: numpy ``@`` with BLAS's default thread pool (what
   the library did before), ``@`` inside a cached threadpoolctl controller's one-thread limit
   (per-call cost of capping the pool), and ``np.einsum`` (no pool at all: what
   :func:`raptor_core._threads.matvec` does now); and a FAISS flat index searched with its
   default OpenMP threads (before) and through ``FaissIndex.search`` (one OpenMP thread,
   now).  Alone and with a busy process.
2. **Collapsed query** (``CollapsedTreeRetriever.retrieve``, query vectors precomputed so the
   embedding is excluded) at 10k and 100k nodes: alone, with one busy-loop subprocess
   running, and 16 queries from 16 threads at once (wall time / 16, and each query's own
   latency) against one query alone.  BLAS keeps its default threads, as in a user's process.
3. **Query embedding** with the real all-MiniLM-L6-v2 (``--no-embed`` skips it): alone and
   with the busy process, one torch thread (now) against torch's default pool (before), and
   ONNX Runtime on one thread when the model has been exported (``raptor export-onnx``).

"Alone" means no process started by this script; the machine's load average is printed,
because other work on a shared machine is part of every figure.

Usage:
    python benchmarks/query_load.py [--sizes 10000 100000] [--queries 50] [--no-embed]
        [--onnx-dir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _synthetic import synthetic_queries, synthetic_tree

from raptor_core import CollapsedTreeRetriever, FaissIndex
from raptor_core._threads import matvec
from raptor_core.retrieval.base import as_store

K = 10
CONCURRENT = 16


class LookupEmbedder:
    """Returns precomputed query vectors: query embedding costs nothing in the timings."""

    def __init__(self, vectors: dict[str, np.ndarray]) -> None:
        self.vectors = vectors

    def embed_documents(self, texts):
        return np.stack([self.vectors[t] for t in texts])

    def embed_query(self, text):
        return self.vectors[text]


@contextlib.contextmanager
def busy_process() -> Iterator[None]:
    """One CPU-bound Python process running for the duration of the block."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # let the scheduler see it
        yield
    finally:
        proc.kill()
        proc.wait()


def median_ms(runs: dict[str, Callable[[int], object]], n: int) -> dict[str, float]:
    """Median milliseconds of each run, interleaved query by query so they share the noise."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run(0)  # warm-up
    for i in range(n):
        for name, run in runs.items():
            start = time.perf_counter()
            run(i)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1000.0 for name, t in times.items()}


def concurrent_ms(
    run: Callable[[int], object], n_threads: int, rounds: int = 7
) -> tuple[float, float]:
    """(wall time / n_threads, median latency of one query) for n_threads queries at once.

    Median over ``rounds`` rounds: one round is short enough for a single preemption by
    another process to dominate it.
    """
    walls: list[float] = []
    latencies: list[float] = []
    lock = threading.Lock()
    for _ in range(rounds):
        barrier = threading.Barrier(n_threads + 1)

        def worker(i: int, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            start = time.perf_counter()
            run(i)
            took = time.perf_counter() - start
            with lock:
                latencies.append(took)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        barrier.wait()
        start = time.perf_counter()
        for t in threads:
            t.join()
        walls.append(time.perf_counter() - start)
    return (
        statistics.median(walls) / n_threads * 1000.0,
        statistics.median(latencies) * 1000.0,
    )


def load_average() -> str:
    with contextlib.suppress(OSError, AttributeError):
        one, five, fifteen = os.getloadavg()
        return f"load average {one:.1f} {five:.1f} {fifteen:.1f}"
    return "load average unknown"


def scoring_options(queries: np.ndarray, matrix: np.ndarray, n: int) -> dict[str, float]:
    from threadpoolctl import ThreadpoolController

    controller = ThreadpoolController()  # built once: constructing one costs ~0.5 ms

    def blas_default(i: int) -> object:
        return matrix @ queries[i % len(queries)]

    def blas_limited(i: int) -> object:
        with controller.limit(limits=1, user_api="blas"):
            return matrix @ queries[i % len(queries)]

    def einsum(i: int) -> object:
        return matvec(matrix, queries[i % len(queries)])

    index = FaissIndex()
    index.add([str(i) for i in range(matrix.shape[0])], matrix)
    flat = index._index  # the raw faiss index: its search as it ran before the cap

    def faiss_default(i: int) -> object:
        return flat.search(queries[i % len(queries)].reshape(1, -1), K)

    def faiss_capped(i: int) -> object:
        return index.search(queries[i % len(queries)], K)

    runs = {
        "@ (BLAS default threads: before)": blas_default,
        "@ in cached threadpoolctl limit(1)": blas_limited,
        "einsum, no pool (matvec: now)": einsum,
        "FAISS flat, default OpenMP threads (before)": faiss_default,
        "FaissIndex.search, one OpenMP thread (now)": faiss_capped,
    }
    out = {f"{name}, alone": ms for name, ms in median_ms(runs, n).items()}
    with busy_process():
        out.update({f"{name}, busy process": ms for name, ms in median_ms(runs, n).items()})
    return out


def collapsed(tree_size: int, n: int) -> dict[str, float]:
    tree = synthetic_tree(tree_size, seed=0)
    vectors = synthetic_queries(tree, max(n, CONCURRENT) + 1)
    names = [f"q{i}" for i in range(len(vectors))]
    embedder = LookupEmbedder(dict(zip(names, vectors, strict=True)))
    as_store(tree)  # the one-off node store, outside the timings
    retriever = CollapsedTreeRetriever(tree, embedder, k=K)

    def run(i: int) -> object:
        return retriever.retrieve(names[i % len(names)])

    out = median_ms({"alone": run}, n)
    per_query, latency = concurrent_ms(run, CONCURRENT)
    out[f"{CONCURRENT} threads: wall / {CONCURRENT}"] = per_query
    out[f"{CONCURRENT} threads: median latency"] = latency
    with busy_process():
        out["busy process"] = median_ms({"busy": run}, n)["busy"]
    return out


def embedding(n: int, onnx_dir: Path | None) -> dict[str, float]:
    import torch

    from raptor_core.backends.onnx import OnnxEmbedder
    from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder

    embedder = SentenceTransformerEmbedder(device="cpu")
    texts = [f"what did the author say about topic {i} in the second chapter?" for i in range(n)]

    def now(i: int) -> object:
        return embedder.embed_query(texts[i % n])

    def before(i: int) -> object:  # torch's default pool, as embed_query ran before
        return embedder._encode([texts[i % n]], embedder.query_prompt)[0]

    runs = {"default pool (before)": before, "one thread (now)": now}
    if onnx_dir is not None:
        onnx = OnnxEmbedder(onnx_dir)
        runs["ONNX Runtime, one thread"] = lambda i: onnx.embed_query(texts[i % n])
    out = {"torch threads": float(torch.get_num_threads())}
    out.update({f"{name}, alone": ms for name, ms in median_ms(runs, n).items()})
    with busy_process():
        out.update({f"{name}, busy process": ms for name, ms in median_ms(runs, n).items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--queries", type=int, default=50, help="timed queries per figure")
    parser.add_argument("--no-embed", action="store_true", help="skip the real query embedding")
    parser.add_argument(
        "--onnx-dir",
        default=None,
        help="also time an ONNX export (default: `raptor export-onnx`'s, when there is one)",
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    from threadpoolctl import threadpool_info

    blas = [f"{i['internal_api']} {i['num_threads']} threads" for i in threadpool_info()]
    print(
        f"# query latency under load, median of {args.queries} (ms); k={K}\n"
        f"# {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"numpy {np.__version__}; pools: {', '.join(blas) or 'none'}\n# at start: {load_average()}"
    )
    results: dict[str, dict[str, float]] = {}

    tree = synthetic_tree(10_000, seed=0)
    queries = synthetic_queries(tree, 64)
    options = scoring_options(queries, np.asarray(tree.embeddings), args.queries)
    results["scoring, 10k nodes"] = options
    base = options["@ (BLAS default threads: before), alone"]
    print("\n## scoring one query against 10k nodes (ratio: to `@` with default threads, alone)")
    for name, ms in options.items():
        print(f"{name:<54}{ms:9.3f} ms  {ms / base:6.2f}x")

    for size in args.sizes:
        row = collapsed(size, args.queries)
        results[f"collapsed, {size} nodes"] = row
        alone = row["alone"]
        print(f"\n## collapsed query, {size:,} nodes, embedding excluded (ratio: to alone)")
        for name, ms in row.items():
            print(f"{name:<54}{ms:9.3f} ms  {ms / alone:6.2f}x")

    if not args.no_embed:
        from raptor_core.backends.onnx import default_onnx_dir, export_info

        onnx_dir = Path(args.onnx_dir) if args.onnx_dir else default_onnx_dir()
        row = embedding(args.queries, onnx_dir if export_info(onnx_dir) else None)
        results["query embedding"] = row
        base = row["default pool (before), alone"]
        print(
            f"\n## embedding one query, all-MiniLM-L6-v2 on the CPU "
            f"({row['torch threads']:.0f} torch threads by default; ratio: to before, alone)"
        )
        for name, ms in row.items():
            if name != "torch threads":
                print(f"{name:<54}{ms:9.3f} ms  {ms / base:6.2f}x")
    print(f"\n# at end: {load_average()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
