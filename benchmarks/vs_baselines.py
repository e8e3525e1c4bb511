"""Build time and query latency: RAPTOR against LlamaIndex's and LangChain's default retrievers.

Same documents, same embedding model (the packaged all-MiniLM-L6-v2, loaded and warmed
before anything is timed), same process, so the ratios are meaningful on a shared, noisy
machine even when the absolute seconds are not.

    raptor             TreeBuilder(embedder, random_state=seed).build(docs)
                       query: CollapsedTreeRetriever(tree, embedder, max_tokens=2000)
    llamaindex         VectorStoreIndex.from_documents(docs, embed_model=...)
                       (SentenceSplitter defaults)
                       query: index.as_retriever()  (similarity_top_k=2, its default)
    langchain          InMemoryVectorStore.from_documents(split docs, embedding=...)
                       (RecursiveCharacterTextSplitter defaults)  query: store.as_retriever() (k=4)
    * leaves           the same two default retrievers over the RAPTOR tree's own ~100-token
                       leaves: a flat index at RAPTOR's granularity

Ratios are RAPTOR / baseline: a build ratio of 12 means RAPTOR took 12 times as long to
index.  Against the default chunking, RAPTOR embeds many more, smaller chunks (the frameworks
embed a few large chunks, which the model truncates at 256 word pieces) and then clusters
and summarises; against the "leaves" rows, the embedding work is the same and the ratio is
the cost of the tree itself.  Query latency includes embedding the question for every
retriever.

Usage:
    python benchmarks/vs_baselines.py [--docs 4] [--queries 30] [--seed 0] [--json OUT]
                                      [--data DIR]

Input: QASPER papers and questions from ../shared/data (or ``--data``) when present, otherwise the
project's test texts with questions made from their first sentences.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def load(
    n_docs: int, n_queries: int, data: Path = DATA
) -> tuple[list[dict[str, str]], list[str], str]:
    docs_path, questions_path = data / "qasper_docs.jsonl", data / "qasper.jsonl"
    if docs_path.is_file() and questions_path.is_file():
        from raptor_core.evaluation import load_documents, load_questions, select

        all_docs = load_documents(docs_path)
        docs, questions = select(
            all_docs,
            load_questions(questions_path, all_docs),
            limit_docs=n_docs,
            limit_questions=n_queries,
        )
        return (
            [{"doc_id": d.doc_id, "text": d.text} for d in docs],
            [q.question for q in questions],
            f"QASPER ({docs_path})",
        )
    texts = [
        ROOT / "tests" / "data" / "multi_topic.md",
        *sorted((ROOT / "tests" / "data" / "corpus").glob("*.[mt][dx]*")),
    ]
    docs = [
        {"doc_id": p.name, "text": p.read_text(encoding="utf-8")} for p in texts if p.is_file()
    ][:n_docs]
    queries = []
    for d in docs:
        queries += [s.strip() + "?" for s in d["text"].split(".")[1:6] if len(s.split()) > 4]
    return docs, queries[:n_queries], "tests/data (no ../shared/data)"


def timed(fn, *args, **kwargs):
    started = time.perf_counter()
    value = fn(*args, **kwargs)
    return value, time.perf_counter() - started


def interleaved_latencies(retrievers: dict, embed, queries: list[str]) -> dict[str, list[float]]:
    """Milliseconds per query for each retriever, timed round-robin so load spikes hit all alike.

    ``embed`` (the bare query embedding) is timed in the same rotation: it is the floor of
    every retriever's latency here.
    """
    calls = {**retrievers, "(query embedding)": embed}
    for call in calls.values():
        call(queries[0])  # warm-up: lazy imports, first-call allocations
    out: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for i, q in enumerate(queries):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            _, seconds = timed(calls[name], q)
            out[name].append(seconds * 1000.0)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--queries", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    parser.add_argument(
        "--data", type=Path, default=DATA, help="QASPER in ../shared/data's format (default: it)"
    )
    args = parser.parse_args()

    from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder
    from raptor_core.build.builder import TreeBuilder
    from raptor_core.evaluation.runner import environment
    from raptor_core.retrieval import CollapsedTreeRetriever

    docs, queries, source = load(args.docs, args.queries, args.data)
    if not docs or not queries:
        print("vs_baselines: no documents or queries found")
        return 0
    embedder = SentenceTransformerEmbedder()
    embedder.embed_documents(["warm up the model before timing anything"])
    rows: dict[str, dict[str, float]] = {}

    retrievers = {}
    tree, build_s = timed(TreeBuilder(embedder, random_state=args.seed).build, docs)
    retrievers["raptor"] = CollapsedTreeRetriever(tree, embedder, k=100, max_tokens=2000).retrieve
    rows["raptor"] = {"build_s": build_s, "chunks": len(tree.leaves), "nodes": len(tree)}

    try:
        from llama_index.core import Document as LIDocument
        from llama_index.core import VectorStoreIndex
        from llama_index.core.schema import TextNode

        from raptor_llamaindex.models import RaptorEmbedding
    except ImportError as exc:
        print(f"llamaindex: skipped ({exc})")
    else:
        li_docs = [LIDocument(text=d["text"], id_=d["doc_id"]) for d in docs]
        index, build_s = timed(
            VectorStoreIndex.from_documents, li_docs, embed_model=RaptorEmbedding(embedder)
        )
        retrievers["llamaindex"] = index.as_retriever().retrieve
        chunks = len(index.docstore.docs)
        rows["llamaindex"] = {"build_s": build_s, "chunks": chunks, "nodes": chunks}
        # The same ~100-token chunks as the RAPTOR leaves: the embedding work of a flat index
        # at RAPTOR's granularity, so the rest of RAPTOR's build time is the tree itself.
        nodes = [TextNode(text=leaf.text, id_=leaf.id) for leaf in tree.leaves]
        index, build_s = timed(VectorStoreIndex, nodes, embed_model=RaptorEmbedding(embedder))
        retrievers["llamaindex leaves"] = index.as_retriever().retrieve
        rows["llamaindex leaves"] = {"build_s": build_s, "chunks": len(nodes), "nodes": len(nodes)}

    try:
        from langchain_core.documents import Document as LCDocument
        from langchain_core.vectorstores import InMemoryVectorStore

        from raptor_langchain.baselines import _default_split
        from raptor_langchain.models import RaptorEmbeddings
    except ImportError as exc:
        print(f"langchain: skipped ({exc})")
    else:

        def build_langchain() -> InMemoryVectorStore:
            split = [LCDocument(page_content=c) for d in docs for c in _default_split(d["text"])[0]]
            return InMemoryVectorStore.from_documents(split, embedding=RaptorEmbeddings(embedder))

        store, build_s = timed(build_langchain)
        retrievers["langchain"] = store.as_retriever().invoke
        chunks = len(store.store)
        rows["langchain"] = {"build_s": build_s, "chunks": chunks, "nodes": chunks}
        leaves = [LCDocument(page_content=leaf.text) for leaf in tree.leaves]
        store, build_s = timed(
            InMemoryVectorStore.from_documents, leaves, embedding=RaptorEmbeddings(embedder)
        )
        retrievers["langchain leaves"] = store.as_retriever().invoke
        rows["langchain leaves"] = {"build_s": build_s, "chunks": len(leaves), "nodes": len(leaves)}

    for name, ms in interleaved_latencies(retrievers, embedder.embed_query, queries).items():
        rows.setdefault(name, {}).update(p50_ms=statistics.median(ms), mean_ms=statistics.fmean(ms))

    env = environment()
    print(f"{len(docs)} documents from {source}, {len(queries)} queries, seed {args.seed}")
    print(f"{env['cpu']}, {env['cpus']} cores; all-MiniLM-L6-v2 on CPU")
    print(
        f"{'retriever':<20} {'chunks':>7} {'nodes':>6} {'build s':>9} {'query p50 ms':>13} "
        f"{'build ratio':>12} {'query ratio':>12}"
    )
    raptor = rows["raptor"]
    for name, r in rows.items():
        if "build_s" not in r:  # the bare query embedding: latency floor, nothing built
            print(f"{name:<20} {'':>7} {'':>6} {'':>9} {r['p50_ms']:>13.1f}")
            continue
        build_ratio = raptor["build_s"] / r["build_s"] if r["build_s"] else float("nan")
        query_ratio = raptor["p50_ms"] / r["p50_ms"] if r["p50_ms"] else float("nan")
        ratios = ("-", "-") if name == "raptor" else (f"{build_ratio:.1f}x", f"{query_ratio:.2f}x")
        print(
            f"{name:<20} {r['chunks']:>7} {r['nodes']:>6} {r['build_s']:>9.2f} "
            f"{r['p50_ms']:>13.1f} {ratios[0]:>12} {ratios[1]:>12}"
        )
    print("ratios are RAPTOR / baseline, measured in the same run (queries timed round-robin)")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"environment": env, "source": source, "seed": args.seed, "rows": rows}, indent=1
            ),
            encoding="utf-8",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
