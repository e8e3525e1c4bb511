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
3. **Approximate search** (``FaissHNSWIndex``, defaults) against the exact search of part 2,
   at the same sizes: the collapsed query through the HNSW index alone, beside the busy
   process and from 16 threads; leaves only (a ``restrict_to`` filter inside the graph);
   recall@10 of the collapsed hits and of the index against exact search; build time.  With
   ``--real N``, also recall and latency over N real sentence vectors (all-MiniLM-L6-v2 over
   the shared evaluation documents, embedded once and cached: ``--real-cache``).  With
   ``--sweep``, the settings the defaults were chosen from: HNSW ``m``, ``ef_construction``
   and ``ef_search``, IVF ``nlist`` and ``nprobe``, each with its build time, latency (raw
   FAISS, against the exact flat index) and recall@10.
4. **Query embedding** with the real all-MiniLM-L6-v2 (``--no-embed`` skips it): alone and
   with the busy process, one torch thread (now) against torch's default pool (before), and
   ONNX Runtime on one thread when the model has been exported (``raptor export-onnx``).

"Alone" means no process started by this script; the machine's load average is printed,
because other work on a shared machine is part of every figure.

Usage:
    python benchmarks/query_load.py [--sizes 10000 100000] [--queries 50] [--no-embed]
        [--no-ann] [--real N] [--real-cache FILE] [--sweep] [--only-ann] [--onnx-dir DIR]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
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

from raptor_core import CollapsedTreeRetriever, FaissHNSWIndex, FaissIndex, NumpyIndex
from raptor_core._threads import matvec, single_omp_thread
from raptor_core.retrieval.base import as_store

K = 10
CONCURRENT = 16
BLOCK = 10  # queries of one index in a row (see median_ms)


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


def median_ms(runs: dict[str, Callable[[int], object]], n: int, block: int = 1) -> dict[str, float]:
    """Median milliseconds of each run, interleaved so they share the noise.

    ``block`` queries of one run follow each other before the next run's: one exact query
    streams the whole matrix through the caches, which would otherwise slow down the query
    of another index that runs right after it (a cost no single-index process pays).
    """
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run(0)  # warm-up
    for first in range(0, n, block):
        for name, run in runs.items():
            for i in range(first, min(n, first + block)):
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


def collapsed(tree_size: int, n: int, *, ann: bool) -> dict[str, float]:
    """Collapsed query latency, exact (the in-memory store) and through FaissHNSWIndex.

    Both retrievers are timed in the same loops, query by query, so they share the noise.
    """
    tree = synthetic_tree(tree_size, seed=0)
    vectors = synthetic_queries(tree, max(n, CONCURRENT) + 1)
    names = [f"q{i}" for i in range(len(vectors))]
    embedder = LookupEmbedder(dict(zip(names, vectors, strict=True)))
    as_store(tree)  # the one-off node store, outside the timings
    retrievers = {"exact": CollapsedTreeRetriever(tree, embedder, k=K)}
    out: dict[str, float] = {}
    if ann:
        start = time.perf_counter()
        index = FaissHNSWIndex.from_tree(tree)
        out["HNSW build s"] = time.perf_counter() - start
        retrievers["HNSW"] = CollapsedTreeRetriever(tree, embedder, k=K, index=index)
        as_store(tree, index=index)
        exact_leaves = CollapsedTreeRetriever(tree, embedder, k=K, layers=[0])
        hnsw_leaves = CollapsedTreeRetriever(tree, embedder, k=K, layers=[0], index=index)
        out.update(recalls(tree, vectors, index, retrievers, exact_leaves, hnsw_leaves))

    def runner(retriever: CollapsedTreeRetriever) -> Callable[[int], object]:
        return lambda i: retriever.retrieve(names[i % len(names)])

    runs = {name: runner(r) for name, r in retrievers.items()}
    if ann:
        runs["exact, leaves only"] = runner(exact_leaves)
        runs["HNSW, leaves only (restrict_to in the graph)"] = runner(hnsw_leaves)
    out.update({f"{name}: alone": ms for name, ms in median_ms(runs, n, BLOCK).items()})
    for name in retrievers:
        per_query, latency = concurrent_ms(runs[name], CONCURRENT)
        out[f"{name}: {CONCURRENT} threads, wall / {CONCURRENT}"] = per_query
        out[f"{name}: {CONCURRENT} threads, median latency"] = latency
    with busy_process():
        busy = median_ms({name: runs[name] for name in retrievers}, n, BLOCK)
    out.update({f"{name}: busy process": ms for name, ms in busy.items()})
    return out


def recall_at(found: list[str], exact: list[tuple[str, float]], k: int = K) -> float:
    """Share of ``found[:k]`` scoring at least the exact k-th score (a tie counts as found)."""
    scores = dict(exact)
    kth = exact[min(k, len(exact)) - 1][1]
    top = found[:k]
    return sum(scores.get(i, -2.0) >= kth - 1e-6 for i in top) / max(1, min(k, len(exact)))


def recalls(
    tree: object,
    queries: np.ndarray,
    index: FaissHNSWIndex,
    retrievers: dict[str, CollapsedTreeRetriever],
    exact_leaves: CollapsedTreeRetriever,
    hnsw_leaves: CollapsedTreeRetriever,
) -> dict[str, float]:
    """Recall@10 against exact search: the index alone, and the collapsed hits."""
    exact_index = NumpyIndex.from_tree(tree)  # type: ignore[arg-type]
    index_recall, hit_recall, leaf_recall = [], [], []
    for q in queries:
        truth = exact_index.search(q, 4 * K)
        index_recall.append(recall_at([i for i, _ in index.search(q, K)], truth))
        plain = retrievers["exact"].retrieve("q", embedding=q, max_tokens=None, k=4 * K)
        approx = retrievers["HNSW"].retrieve("q", embedding=q)  # with the budget: 64 asked
        hit_recall.append(recall_at([h.id for h in approx], [(h.id, h.score) for h in plain]))
        plain = exact_leaves.retrieve("q", embedding=q, max_tokens=None, k=4 * K)
        approx = hnsw_leaves.retrieve("q", embedding=q)
        leaf_recall.append(recall_at([h.id for h in approx], [(h.id, h.score) for h in plain]))
    return {
        "recall@10, index": float(np.mean(index_recall)),
        "recall@10, collapsed hits": float(np.mean(hit_recall)),
        "recall@10, leaves only": float(np.mean(leaf_recall)),
    }


def sweep(vectors: np.ndarray, queries: np.ndarray, n: int) -> dict[str, float]:
    """Build time, latency and recall@10 of HNSW and IVF settings, against exact FAISS search.

    Raw FAISS searches for 64 results (what the collapsed retriever asks for with a budget),
    one OpenMP thread, queries one at a time; builds on FAISS's default threads.
    """
    import faiss

    d = vectors.shape[1]
    exact = faiss.IndexFlatIP(d)
    exact.add(vectors)
    truth = queries @ vectors.T
    kth = -np.partition(-truth, K - 1, axis=1)[:, K - 1]

    def measure(index: object, params: object) -> tuple[float, float]:
        with single_omp_thread(faiss):
            _, labels = index.search(queries, 64, params=params)  # type: ignore[attr-defined]
            ms = median_ms(
                {"q": lambda i: index.search(queries[i % len(queries)][None], 64, params=params)},  # type: ignore[attr-defined]
                n,
            )["q"]
        found = [np.mean(truth[i, labels[i, :K]] >= kth[i] - 1e-6) for i in range(len(queries))]
        return ms, float(np.mean(found))

    with single_omp_thread(faiss):
        out = {
            "exact (IndexFlatIP), ms": median_ms(
                {"q": lambda i: exact.search(queries[i % len(queries)][None], 64)}, n
            )["q"]
        }
    for m in (16, 32):
        for ef_construction in (40, 80):
            start = time.perf_counter()
            index = faiss.IndexHNSWFlat(d, m, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = ef_construction
            index.add(vectors)
            name = f"HNSW m={m} ef_construction={ef_construction}"
            out[f"{name}, build s"] = time.perf_counter() - start
            for ef in (64, 128, 256):
                params = faiss.SearchParametersHNSW()
                params.efSearch = ef
                ms, recall = measure(index, params)
                out[f"{name} ef_search={ef}, ms"], out[f"{name} ef_search={ef}, recall"] = (
                    ms,
                    recall,
                )
    for nlist in (int(np.sqrt(len(vectors))), int(4 * np.sqrt(len(vectors)))):
        start = time.perf_counter()
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, nlist, faiss.METRIC_INNER_PRODUCT)
        index.train(vectors)
        index.add(vectors)
        name = f"IVF nlist={nlist}"
        out[f"{name}, build s"] = time.perf_counter() - start
        for nprobe in (8, 16, 32, 64):
            params = faiss.SearchParametersIVF()
            params.nprobe = nprobe
            ms, recall = measure(index, params)
            out[f"{name} nprobe={nprobe}, ms"], out[f"{name} nprobe={nprobe}, recall"] = ms, recall
    return out


def print_sweep(title: str, row: dict[str, float]) -> None:
    base = row["exact (IndexFlatIP), ms"]
    print(
        f"\n## {title}: settings swept (raw FAISS, 64 results; ratio: to exact; {load_average()})"
    )
    for name, value in row.items():
        if name.endswith("build s"):
            print(f"{name:<54}{value:9.2f} s")
        elif name.endswith("ms"):
            recall = row.get(name[:-2] + "recall")
            extra = "" if recall is None else f"  recall@10 {recall:.4f}"
            print(f"{name[:-4]:<54}{value:9.3f} ms  {value / base:6.2f}x{extra}")


def shared_sentences(n: int) -> list[str]:
    """Up to ``n`` distinct sentences of six words or more from the shared evaluation documents."""
    data = Path(__file__).resolve().parents[2] / "shared" / "data"
    texts = set()
    for name in ["quality", "qmsum", "nq_leval", "qasper", "fairytaleqa"]:
        with (data / f"{name}_docs.jsonl").open(encoding="utf-8") as lines:
            for line in lines:
                for sentence in re.split(r"(?<=[.!?])\s+|\n+", json.loads(line)["text"]):
                    sentence = sentence.strip()
                    if len(sentence.split()) >= 6:
                        texts.add(sentence[:400])
    ordered = sorted(texts)
    pick = np.random.default_rng(0).permutation(len(ordered))[:n]
    return [ordered[i] for i in pick]


def real_vectors(n: int, cache: Path) -> np.ndarray:
    """Real all-MiniLM-L6-v2 sentence vectors (embedded once, then read from ``cache``)."""
    if not cache.exists():
        from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder

        vectors = SentenceTransformerEmbedder(device="cpu").embed_documents(shared_sentences(n))
        np.save(cache, np.asarray(vectors, dtype=np.float32))
    vectors = np.load(cache)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def real_recall(vectors: np.ndarray, n: int, held_out: int = 300) -> dict[str, float]:
    """HNSW against exact search over real sentence vectors; held-out sentences as queries."""
    data, queries = vectors[:-held_out], vectors[-held_out:]
    ids = [str(i) for i in range(len(data))]
    exact = NumpyIndex()
    exact.add(ids, data)
    start = time.perf_counter()
    index = FaissHNSWIndex()
    index.add(ids, data)
    out = {"vectors": float(len(data)), "HNSW build s": time.perf_counter() - start}
    out["recall@10"] = float(
        np.mean(
            [recall_at([i for i, _ in index.search(q, K)], exact.search(q, 4 * K)) for q in queries]
        )
    )
    # The collapsed retriever asks a store for max(4k, 64) = 64 with a budget.
    runs = {
        "exact search, 64 results": lambda i: exact.search(queries[i % held_out], 64),
        "HNSW search, 64 results": lambda i: index.search(queries[i % held_out], 64),
    }
    out.update(median_ms(runs, n))
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
    parser.add_argument("--no-ann", action="store_true", help="skip FaissHNSWIndex")
    parser.add_argument(
        "--real",
        type=int,
        default=0,
        help="also measure HNSW on this many real sentence vectors (embedded once: slow)",
    )
    parser.add_argument("--real-cache", default=None, help="where the --real vectors are kept")
    parser.add_argument(
        "--sweep", action="store_true", help="also sweep HNSW and IVF settings (slow)"
    )
    parser.add_argument(
        "--only-ann", action="store_true", help="skip the scoring options and collapsed queries"
    )
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

    if not args.only_ann:
        tree = synthetic_tree(10_000, seed=0)
        queries = synthetic_queries(tree, 64)
        options = scoring_options(queries, np.asarray(tree.embeddings), args.queries)
        results["scoring, 10k nodes"] = options
        base = options["@ (BLAS default threads: before), alone"]
        print(
            "\n## scoring one query against 10k nodes (ratio: to `@` with default threads, alone)"
        )
        for name, ms in options.items():
            print(f"{name:<54}{ms:9.3f} ms  {ms / base:6.2f}x")

        for size in args.sizes:
            row = collapsed(size, args.queries, ann=not args.no_ann)
            results[f"collapsed, {size} nodes"] = row
            alone = row["exact: alone"]
            print(
                f"\n## collapsed query, {size:,} nodes, embedding excluded "
                f"(ratio: to exact search alone; {load_average()})"
            )
            for name, value in row.items():
                if name.startswith("recall"):
                    print(f"{name:<54}{value:9.4f}")
                elif name.endswith(" s"):
                    print(f"{name:<54}{value:9.2f} s   = {value * 1000 / alone:,.0f} exact queries")
                else:
                    print(f"{name:<54}{value:9.3f} ms  {value / alone:6.2f}x")

    if args.sweep:
        for size in args.sizes:
            tree = synthetic_tree(size, seed=0)
            row = sweep(np.asarray(tree.embeddings), synthetic_queries(tree, 200), args.queries)
            results[f"sweep, {size} nodes"] = row
            print_sweep(f"synthetic tree, {size:,} nodes", row)
    if args.real:
        cache = Path(args.real_cache or f"/tmp/raptor_query_load_sentences_{args.real}.npy")
        vectors = real_vectors(args.real, cache)
        if args.sweep:
            row = sweep(vectors[:-300], vectors[-300:], args.queries)
            results["sweep, real sentence vectors"] = row
            print_sweep(f"{len(vectors) - 300:,} real sentence vectors", row)
        row = real_recall(vectors, args.queries)
        results["real sentence vectors"] = row
        base = row["exact search, 64 results"]
        print(
            f"\n## {row['vectors']:,.0f} real sentence vectors (all-MiniLM-L6-v2, shared "
            f"documents), HNSW defaults (ratio: to exact search)"
        )
        print(f"{'HNSW build s':<54}{row['HNSW build s']:9.2f} s")
        print(f"{'recall@10':<54}{row['recall@10']:9.4f}")
        for name in ("exact search, 64 results", "HNSW search, 64 results"):
            print(f"{name:<54}{row[name]:9.3f} ms  {row[name] / base:6.2f}x")

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
