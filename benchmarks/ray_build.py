"""Build-time benchmark: each build stage run locally and on Ray, in the same run.

Builds the same documents twice with the same seed, once in this process and once with
``RayExecutor`` (a local Ray started here, or ``--address`` for a cluster), and prints every
stage's seconds side by side with the ratio Ray / local (the machines are shared and noisy:
ratios within one run mean more than seconds).  It also checks that both trees are the same
(node ids, texts, vectors within 1e-6).

Summaries: by default the offline extractive summariser, which has its own batch call and so
stays in the driver (the ratio shows Ray's overhead only); ``--llm-latency S`` swaps in a
deterministic stand-in for an LLM that waits S seconds per cluster, which Ray runs as tasks,
``--max-concurrency`` at a time.  See benchmarks/README.md for the cost model on N machines.

Usage:
    python benchmarks/ray_build.py [--tokens 20000] [--address auto] [--llm-latency 0.5]
                                   [--max-concurrency 4] [--seed 0] [--json OUT]
                                   [--embedder real|fake]

``--embedder fake`` swaps all-MiniLM-L6-v2 for raptor_core.testing.FakeEmbedder (hashed bag of
words, no model): Ray's overhead on every stage but a real embedding (a quick check that the
script runs).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

STAGES = ("chunk", "embed", "cluster", "summarize")


class SlowSummarizer:
    """A stand-in for an LLM: the first words of the cluster, after ``latency`` seconds."""

    def __init__(self, latency: float) -> None:
        self.latency = latency

    def summarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        time.sleep(self.latency)
        return " ".join(" ".join(texts).split()[:max_tokens])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--address", default=None, help="Ray address (default: start one here)")
    parser.add_argument("--llm-latency", type=float, default=None, help="seconds per summary")
    parser.add_argument("--max-concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--embedder", choices=["real", "fake"], default="real")
    args = parser.parse_args()

    import numpy as np
    from build import load_corpus

    from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder
    from raptor_core.build.builder import TreeBuilder
    from raptor_core.build.ray_executor import RayExecutor
    from raptor_core.testing import FakeEmbedder
    from raptor_core.tokenizers import count_tokens, default_tokenizer

    tokenizer = default_tokenizer()
    docs, source = load_corpus(args.tokens, lambda t: count_tokens(tokenizer, t))
    n_tokens = sum(count_tokens(tokenizer, d["text"]) for d in docs)
    embedder: Any = (
        FakeEmbedder(dim=384) if args.embedder == "fake" else SentenceTransformerEmbedder()
    )
    embedder.embed_query("load the model before timing")
    # Compile UMAP's numba kernels before timing too: the first build would pay for it alone.
    from raptor_core.build.clustering import GMMClusterer

    GMMClusterer(random_state=0).cluster(
        np.random.default_rng(0).standard_normal((80, 384)).astype(np.float32)
    )

    def builder(executor: RayExecutor | None) -> TreeBuilder:
        summarizer = SlowSummarizer(args.llm_latency) if args.llm_latency is not None else None
        return TreeBuilder(
            embedder,
            summarizer,
            tokenizer=tokenizer,
            max_concurrency=args.max_concurrency,
            random_state=args.seed,
            executor=executor,
        )

    t0 = time.perf_counter()
    local = builder(None).build(docs)
    local_total = time.perf_counter() - t0

    executor = RayExecutor(args.address)
    t0 = time.perf_counter()
    ray = executor._ray()  # connect (or start a local Ray): a one-off, reported apart
    connect = time.perf_counter() - t0
    ray.data.DataContext.get_current().enable_progress_bars = False
    for name in ("ray", "ray.data"):
        logging.getLogger(name).setLevel(logging.WARNING)
    cpus = ray.cluster_resources().get("CPU", 0)
    t0 = time.perf_counter()
    on_ray = builder(executor).build(docs)
    ray_total = time.perf_counter() - t0
    executor.close()

    same = [n.id for n in local.nodes] == [n.id for n in on_ray.nodes] and [
        n.text for n in local.nodes
    ] == [n.text for n in on_ray.nodes]
    close = local.embeddings.shape == on_ray.embeddings.shape and bool(
        np.allclose(local.embeddings, on_ray.embeddings, atol=1e-6, rtol=0)
    )
    lt, rt = local.build_info["timings"], on_ray.build_info["timings"]
    summaries = (
        "extractive (driver)"
        if args.llm_latency is None
        else (f"stand-in LLM, {args.llm_latency}s per call, max_concurrency={args.max_concurrency}")
    )
    print(
        f"input: {source}: {len(docs)} documents, {n_tokens} tokens, {local.build_info['chunks']} chunks"
    )
    shape = ", ".join(f"L{x['layer']}={x['nodes']}" for x in local.build_info["layers"])
    print(f"tree: {shape}")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {sys.version.split()[0]}; Ray {ray.__version__} with {cpus:g} CPUs "
        f"({args.address or 'local, started here'}); summaries: {summaries}; "
        f"embedder: {args.embedder}"
    )
    print(f"one-off: Ray connect/start {connect:.2f}s (not in the totals)")
    print(f"{'stage':<10} {'local s':>9} {'ray s':>9} {'ray/local':>10}")
    for stage in STAGES:
        ratio = rt[stage] / lt[stage] if lt[stage] else float("nan")
        print(f"{stage:<10} {lt[stage]:>9.2f} {rt[stage]:>9.2f} {ratio:>10.2f}")
    print(f"{'total':<10} {local_total:>9.2f} {ray_total:>9.2f} {ray_total / local_total:>10.2f}")
    print(
        f"same tree: ids and texts {'equal' if same else 'DIFFER'}, vectors {'within 1e-6' if close else 'DIFFER'}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "tokens": n_tokens,
                    "chunks": local.build_info["chunks"],
                    "ray_cpus": cpus,
                    "summaries": summaries,
                    "embedder": args.embedder,
                    "local": {**lt, "total": local_total},
                    "ray": {**rt, "total": ray_total, "connect": connect},
                    "same_tree": same and close,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
