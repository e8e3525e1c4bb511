"""Build-time benchmark: each stage of a RAPTOR build on a ~50,000-token input.

Prints the time of chunking, embedding, clustering, summarising and persisting, and each
stage as a ratio of the embedding stage measured in the same run (the machines are shared
and noisy, so absolute seconds mean little; ratios within one run do).  The paper's
reference code spends more time in UMAP and its BIC sweep than in embedding; here
clustering must stay below embedding.

Usage:
    python benchmarks/build.py [--tokens 50000] [--threads N] [--seed 0] [--json OUT]
    python benchmarks/build.py --corpus mixed --tokens 1000000     # scaling runs

Input (``--corpus quality``, the default): QuALITY articles from ../shared/data when present
(real prose), topped up with the project's own docs and test texts, paragraphs shuffled.
``--corpus mixed``: the lines of every document in ../shared/data (papers, stories,
meetings, web pages, articles) shuffled together and cut into documents of 200 lines, so
that a corpus of any size has the same mix of kinds of text; compare sizes with it (with
the default, 100k tokens are all QuALITY prose and 1M mostly Markdown).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"


def load_corpus(target_tokens: int, count) -> tuple[list[dict[str, str]], str]:
    docs: list[dict[str, str]] = []
    total = 0
    source = SHARED / "quality_docs.jsonl"
    if source.is_file():
        with source.open(encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                docs.append({"doc_id": record["doc_id"], "text": record["text"]})
                total += count(record["text"])
                if total >= target_tokens:
                    return docs, f"{source.name} ({len(docs)} articles)"
    paragraphs = []
    for path in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "data" / "multi_topic.md"]:
        if path.is_file():
            paragraphs += [p for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    rng = random.Random(0)
    i = 0
    while total < target_tokens and paragraphs:
        rng.shuffle(paragraphs)
        text = "\n\n".join(paragraphs)
        docs.append({"doc_id": f"synthetic-{i}", "text": text})
        total += count(text)
        i += 1
    return docs, "project docs + tests/data (shuffled)"


def load_mixed(target_tokens: int, count) -> tuple[list[dict[str, str]], str]:
    lines = []
    for path in sorted(SHARED.glob("*_docs.jsonl")):
        with path.open(encoding="utf-8") as f:
            for record in map(json.loads, f):
                lines += [line for line in record["text"].splitlines() if line.strip()]
    if not lines:
        msg = f"--corpus mixed needs the documents of {SHARED}"
        raise SystemExit(msg)
    rng = random.Random(0)
    docs: list[dict[str, str]] = []
    total = 0
    while total < target_tokens:
        rng.shuffle(lines)  # each pass a new order: repeated text is not repeated chunks
        for start in range(0, len(lines), 200):
            text = "\n".join(lines[start : start + 200])
            docs.append({"doc_id": f"mixed-{len(docs)}", "text": text})
            total += count(text)
            if total >= target_tokens:
                break
    return docs, f"every document of {SHARED.name}, lines shuffled (mixed)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=50_000)
    parser.add_argument("--threads", type=int, default=None, help="TreeBuilder n_threads cap")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--corpus", choices=["quality", "mixed"], default="quality")
    args = parser.parse_args()

    from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder
    from raptor_core.build.builder import TreeBuilder
    from raptor_core.tokenizers import count_tokens, default_tokenizer

    tokenizer = default_tokenizer()
    loader = load_mixed if args.corpus == "mixed" else load_corpus
    docs, source = loader(args.tokens, lambda t: count_tokens(tokenizer, t))
    n_tokens = sum(count_tokens(tokenizer, d["text"]) for d in docs)

    embedder = SentenceTransformerEmbedder()
    t0 = time.perf_counter()
    embedder.embed_query("load the model before timing the build")
    load = time.perf_counter() - t0
    # Import UMAP/numba outside the timed build as well: a long-running service pays it once.
    t0 = time.perf_counter()
    import umap  # noqa: F401

    import_umap = time.perf_counter() - t0

    builder = TreeBuilder(
        embedder, tokenizer=tokenizer, n_threads=args.threads, random_state=args.seed
    )
    t0 = time.perf_counter()
    tree = builder.build(docs)
    build_total = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        tree.save(tmp)
        persist = time.perf_counter() - t0

    timings = dict(tree.build_info["timings"])
    timings["persist"] = persist
    total = build_total + persist
    embed = timings["embed"] or 1e-9
    print(
        f"input: {source}: {len(docs)} documents, {n_tokens} tokens, {tree.build_info['chunks']} chunks"
    )
    shape = ", ".join(f"L{x['layer']}={x['nodes']}" for x in tree.build_info["layers"])
    print(f"tree: {shape}")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {sys.version.split()[0]}"
    )
    print(f"one-off: model load {load:.2f}s, import umap {import_umap:.2f}s (not in the totals)")
    print(f"{'stage':<10} {'seconds':>9} {'x embed':>9} {'share':>7}")
    for stage in ("chunk", "embed", "cluster", "summarize", "persist"):
        print(
            f"{stage:<10} {timings[stage]:>9.2f} {timings[stage] / embed:>9.2f} {timings[stage] / total:>7.1%}"
        )
    print(f"{'total':<10} {total:>9.2f} {total / embed:>9.2f}")
    import resource

    # ru_maxrss is in KiB on Linux (bytes on macOS).
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (
        1 << 20 if sys.platform == "darwin" else 1 << 10
    )
    print(f"peak RSS {peak:.0f} MB; {total / n_tokens * 1e3:.3f} ms per token")
    verdict = "OK" if timings["cluster"] < timings["embed"] else "SLOW"
    print(
        f"clustering / embedding = {timings['cluster'] / embed:.2f} ({verdict}: must stay below 1)"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "tokens": n_tokens,
                    "corpus": source,
                    "timings": timings,
                    "total": total,
                    "peak_rss_mb": peak,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
