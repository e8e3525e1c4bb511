"""Corpus-scale builds: time per token and peak memory as the corpus grows (issue 16).

Builds trees over synthetic corpora made from the shared evaluation documents (../shared/data,
every ``*_docs.jsonl``), repeated until the target size with each copy's lines shuffled and given
its own document ids, so no two copies chunk alike.  Summaries come from a stub (the first
words of the cluster's text: no model), so what grows with the corpus is chunking, embedding
and, mostly, clustering.  Each size is built in a fresh process, which reports its own stage
timings and peak RSS; the baseline is the same build at the smallest size in the same run
(per-token cost ratios), plus the unbucketed clusterer (``bucket_size=None``) at the sizes
given by ``--unbucketed-max``.

Usage:
    python benchmarks/scale.py --sizes 100k,1M,10M --embedder fake   # hash embedder, no model
    python benchmarks/scale.py --sizes 100k --embedder real          # all-MiniLM-L6-v2 (slow on CPU)
    python benchmarks/scale.py --quality                             # bucketed vs whole, on 2 QA sets
    python benchmarks/scale.py --report a.json b.json                # tables of saved --json runs

``--embedder fake`` uses raptor_core.testing.FakeEmbedder (hashed bag of words, 384
dimensions): clustering cost is what this measures, and embedding 10M tokens with the real
model takes hours on 2 CPU cores.  ``--quality`` instead compares retrieval quality on reduced
qasper and fairytaleqa sets (one tree per set, real embedder) with ``bucket_size`` forced low
against the default, and against the default with another seed (the noise floor).

Without ../shared/data (or RAPTOR_EVAL_DATA) the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("RAPTOR_EVAL_DATA", ROOT.parent / "shared" / "data"))


def parse_size(text: str) -> int:
    text = text.strip().lower().replace("_", "")
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    return int(float(text.rstrip("km")) * scale)


def label(tokens: int) -> str:
    if tokens >= 1_000_000:
        return f"{tokens / 1_000_000:g}M"
    return f"{tokens / 1_000:g}k" if tokens >= 1_000 else str(tokens)


class StubSummarizer:
    """The first ``max_tokens`` words of the cluster's text: no model, constant cost per call."""

    def summarize(self, texts: list[str], *, max_tokens: int) -> str:
        words: list[str] = []
        for text in texts:
            words.extend(text.split()[: max_tokens - len(words)])
            if len(words) >= max_tokens:
                break
        return " ".join(words)


def synthetic_corpus(target_tokens: int, seed: int, count: Any) -> tuple[list[dict[str, str]], int]:
    """Shared documents repeated, lines shuffled per copy, until ``target_tokens`` (about)."""
    originals: list[tuple[str, list[str], int]] = []
    for path in sorted(DATA.glob("*_docs.jsonl")):
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f):
                record = json.loads(line)
                lines = [x for x in record["text"].splitlines() if x.strip()]
                # The line number too: a few ids repeat within a file.
                doc_id = f"{path.stem}/{n}/{record['doc_id']}"
                originals.append((doc_id, lines, count(record["text"])))
    rng = random.Random(seed)
    docs: list[dict[str, str]] = []
    total, copy = 0, 0
    while total < target_tokens:
        order = list(range(len(originals)))
        rng.shuffle(order)
        for i in order:
            doc_id, lines, tokens = originals[i]
            shuffled = lines[:]
            if copy:  # copy 0 is the original text
                rng.shuffle(shuffled)
            docs.append({"doc_id": f"{doc_id}#{copy}", "text": "\n\n".join(shuffled)})
            total += tokens
            if total >= target_tokens:
                break
        copy += 1
    return docs, total


def build_once(
    tokens: int, embedder_name: str, bucket_size: int | None, seed: int
) -> dict[str, Any]:
    """One build in this process; its figures (run in a child process by :func:`main`)."""
    from raptor_core.build.builder import TreeBuilder
    from raptor_core.build.clustering import GMMClusterer
    from raptor_core.tokenizers import count_tokens, default_tokenizer

    tokenizer = default_tokenizer()
    t0 = time.perf_counter()
    docs, approx = synthetic_corpus(tokens, seed, lambda t: count_tokens(tokenizer, t))
    corpus_s = time.perf_counter() - t0
    if embedder_name == "real":
        from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder

        embedder: Any = SentenceTransformerEmbedder()
        embedder.embed_query("load the model before timing the build")
    else:
        from raptor_core.testing import FakeEmbedder

        embedder = FakeEmbedder(dim=384)
    # UMAP/numba import outside the timed build (a long-running process pays it once).
    import umap  # noqa: F401

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # CPU seconds per stage, from the progress callbacks: the CPU time since the previous
    # callback goes to the stage reporting now (each callback comes after a unit of its
    # stage's work).  The build runs on one thread (TreeBuilder n_threads=1), so on this shared,
    # overloaded machine CPU time is a steadier measure than wall time, which other jobs inflate.
    cpu = {"chunk": 0.0, "embed": 0.0, "cluster": 0.0, "summarize": 0.0}
    last = [time.process_time()]

    def progress(stage: str, done: int, total: int) -> None:
        now = time.process_time()
        cpu[stage] = cpu.get(stage, 0.0) + now - last[0]
        last[0] = now

    builder = TreeBuilder(
        embedder,
        StubSummarizer(),
        tokenizer=tokenizer,
        clusterer=GMMClusterer(bucket_size=bucket_size, random_state=seed),
        n_threads=1,
        random_state=seed,
        progress=progress,
    )
    t0, c0 = time.perf_counter(), time.process_time()
    last[0] = c0
    tree = builder.build(docs)
    total, total_cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "target_tokens": tokens,
        "tokens": approx,
        "documents": len(docs),
        "chunks": tree.build_info["chunks"],
        "layers": [x["nodes"] for x in tree.build_info["layers"]],
        "timings": tree.build_info["timings"],
        "build_s": total,
        "build_cpu_s": total_cpu,
        "cpu": cpu,
        "corpus_s": corpus_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_before_build_mb": rss_before / 1024,
        "bucket_size": bucket_size,
        "embedder": embedder_name,
        "load_avg_1_5_15": os.getloadavg(),  # the machine is shared: how busy it was
    }


def run_child(tokens: int, embedder: str, bucket_size: int | None, seed: int) -> dict[str, Any]:
    command = [
        sys.executable,
        __file__,
        "--child",
        str(tokens),
        "--embedder",
        embedder,
        "--bucket-size",
        "none" if bucket_size is None else str(bucket_size),
        "--seed",
        str(seed),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=os.environ)
    if done.returncode != 0:
        raise SystemExit(f"build of {label(tokens)} tokens failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def print_table(rows: list[dict[str, Any]], base: dict[str, Any]) -> list[str]:
    """Markdown table of CPU microseconds per token; ratios against ``base``."""

    def per_token(row: dict[str, Any], stage: str) -> float:
        return 1e6 * row["cpu"][stage] / row["tokens"]

    def total(row: dict[str, Any]) -> float:
        return 1e6 * row["build_cpu_s"] / row["tokens"]

    lines = [
        "| tokens | bucket_size | chunks | layers | chunk | embed | cluster | summarise "
        "| total CPU µs/token | total x base | cluster x base | wall s | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cluster_ratio = per_token(row, "cluster") / max(per_token(base, "cluster"), 1e-12)
        lines.append(
            f"| {label(row['target_tokens'])} ({row['tokens']:,}) | {row['bucket_size']} "
            f"| {row['chunks']:,} | {'/'.join(map(str, row['layers']))} "
            f"| {per_token(row, 'chunk'):.1f} | {per_token(row, 'embed'):.1f} "
            f"| {per_token(row, 'cluster'):.1f} | {per_token(row, 'summarize'):.1f} "
            f"| {total(row):.1f} | {total(row) / total(base):.2f} | {cluster_ratio:.2f} "
            f"| {row['build_s']:.0f} | {row['peak_rss_mb']:,.0f} |"
        )
    for line in lines:
        print(line)
    return lines


def report(rows: list[dict[str, Any]], bucket: int | None) -> None:
    bucketed = [r for r in rows if r["bucket_size"] == bucket]
    whole = [r for r in rows if r["bucket_size"] is None and bucket is not None]
    if not bucketed:
        return
    print("\nCPU µs per token by stage (one thread); ratios against the smallest size:")
    print_table(bucketed, bucketed[0])
    if whole:
        print("\nunbucketed (bucket_size=None), ratios against the smallest bucketed build:")
        print_table(whole, bucketed[0])


def quality(args: argparse.Namespace) -> int:
    from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder
    from raptor_core.build.clustering import GMMClusterer
    from raptor_core.evaluation import evaluate, load_documents, load_questions, select
    from raptor_core.retrieval.registry import DEFAULT_STRATEGY

    #: set -> (primary metric, documents, questions) of the reduced run.
    sets = {
        "qasper": ("evidence_recall", args.quality_docs, 30),
        "fairytaleqa": ("span_recall", args.quality_docs, 40),
    }
    embedder = SentenceTransformerEmbedder()
    variants = [
        ("default (seed 0)", args.seed, None),
        (f"bucket_size={args.low_bucket} (seed 0)", args.seed, args.low_bucket),
        ("default (seed 1)", args.seed + 1, None),
    ]
    retrievers = [DEFAULT_STRATEGY, "collapsed"]
    out: dict[str, Any] = {}
    lines = [
        "| set | retriever | budget | " + " | ".join(v[0] for v in variants) + " |",
        "|---|---|---|" + "---|" * len(variants),
    ]
    for name, (metric, n_docs, n_questions) in sets.items():
        docs = load_documents(DATA / f"{name}_docs.jsonl")
        questions = load_questions(DATA / f"{name}.jsonl", docs)
        if n_docs <= 0:  # --quality-docs 0: every document and question of the set
            docs, questions = select(docs, questions, limit_docs=None, limit_questions=None)
        else:
            docs, questions = select(
                docs, questions, limit_docs=n_docs, limit_questions=n_questions
            )
        scores: dict[str, dict[tuple[str, int], float]] = {}
        for title, seed, bucket in variants:
            kwargs: dict[str, Any] = {}
            if bucket is not None:
                kwargs["clusterer"] = GMMClusterer(bucket_size=bucket, random_state=seed)
            t0 = time.perf_counter()
            result = evaluate(
                docs,
                questions,
                retrievers=retrievers,
                budgets=[400, 2000],
                tree_per="all",
                embedder=embedder,
                random_state=seed,
                builder_params=kwargs,
            )
            scores[title] = {
                (row["retriever"], int(row["budget"])): float(row[metric]) for row in result.summary
            }
            print(
                f"{name} / {title}: {result.config['leaves']} leaves, "
                f"{result.config['nodes']} nodes, {time.perf_counter() - t0:.0f}s",
                flush=True,
            )
        out[name] = {t: {f"{r}@{b}": v for (r, b), v in s.items()} for t, s in scores.items()}
        for key in scores[variants[0][0]]:
            cells = " | ".join(f"{100 * scores[v[0]][key]:.1f}" for v in variants)
            lines.append(f"| {name} ({metric}) | {key[0]} | {key[1]} | {cells} |")
    for line in lines:
        print(line)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="100k,300k,1M", help="corpus sizes in tokens")
    parser.add_argument("--embedder", choices=["fake", "real"], default="fake")
    parser.add_argument("--bucket-size", default="2000", help="GMMClusterer bucket_size or none")
    parser.add_argument(
        "--unbucketed-max", default="300k", help="also build unbucketed up to this size (0: never)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--quality", action="store_true", help="the quality check instead")
    parser.add_argument("--low-bucket", type=int, default=64, help="bucket_size of --quality")
    parser.add_argument(
        "--quality-docs",
        type=int,
        default=5,
        help="documents per set (--quality; 0: all, with every question)",
    )
    parser.add_argument(
        "--report", type=Path, nargs="+", default=None, help="print the tables of saved --json runs"
    )
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    bucket = None if args.bucket_size.lower() == "none" else int(args.bucket_size)

    if args.child is not None:
        print(json.dumps(build_once(args.child, args.embedder, bucket, args.seed)))
        return 0
    if args.report:
        saved = [row for path in args.report for row in json.loads(path.read_text())]
        report(sorted(saved, key=lambda r: r["tokens"]), bucket)
        return 0
    if not any(DATA.glob("*_docs.jsonl")):
        print(f"scale benchmark: no *_docs.jsonl under {DATA}; nothing to do")
        return 0
    if args.quality:
        return quality(args)

    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    unbucketed_max = parse_size(args.unbucketed_max)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {sys.version.split()[0]}; embedder: {args.embedder}; seed {args.seed}",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    for tokens in sizes:
        runs = [bucket]
        if bucket is not None and tokens <= unbucketed_max:
            runs.append(None)
        for size in runs:
            row = run_child(tokens, args.embedder, size, args.seed)
            rows.append(row)
            c = row["cpu"]
            print(
                f"{label(tokens)} tokens, bucket_size={size}: {row['chunks']} chunks, "
                f"layers {row['layers']}, build {row['build_s']:.1f}s wall, "
                f"{row['build_cpu_s']:.1f}s CPU (chunk {c['chunk']:.1f}, embed {c['embed']:.1f}, "
                f"cluster {c['cluster']:.1f}, summarise {c['summarize']:.1f}), "
                f"peak RSS {row['peak_rss_mb']:.0f} MB, load {row['load_avg_1_5_15'][0]:.1f}",
                flush=True,
            )
            if args.json:  # after every build: a long run stopped early keeps what it measured
                args.json.write_text(json.dumps(rows, indent=2))
    report(rows, bucket)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
