"""Incremental trees (issue 13): one document added to / removed from a tree, versus a rebuild.

A tree is built over N-1 documents (the QASPER papers of ../shared/data, filled up with QuALITY
articles when N-1 exceeds the 17 papers).  Then one QASPER paper is inserted with
``TreeBuilder.insert`` and, separately, a fresh tree is built over all N documents.  Reported,
as ratios to the rebuild:

* summary calls (a counting wrapper around the summariser: the offline extractive one, so
  calls are counted, not paid) and wall time of the insert;
* the same for deleting that paper again (against the build of the N-1 documents);
* evidence-paragraph recall of the QASPER questions over the documents in the tree, with the
  collapsed-tree strategy at 400 and 2,000 tokens (the paper's budgets; the
  ``raptor_core.evaluation`` metrics), for the grown tree and the fresh build;
* whether every node of the old tree that the insert did not touch kept its id, text and
  embedding bit for bit.

Usage:
    python benchmarks/incremental.py               # N = 50 (49 documents, then one more)
    python benchmarks/incremental.py --n 12        # a quicker run
    python benchmarks/incremental.py --data /path/to/shared/data

Writes benchmarks/results/incremental.md (and .json).  Exits cleanly when the data is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(
    os.environ.get("RAPTOR_EVAL_DATA", Path(__file__).resolve().parents[2] / "shared" / "data")
)
RESULTS = ROOT / "benchmarks" / "results"
BUDGETS = (400, 2000)


class CountingSummarizer:
    """Counts the clusters summarised by the summariser it wraps.

    The builder gives a summariser with ``summarize_batch`` a whole layer in one call, and one
    with ``sentence_vector_tap`` its sentence vectors from the embedding passes: both are
    passed through, so the build is the one the extractive summariser gets unwrapped (without
    them it would summarise cluster by cluster from several threads, embedding every sentence
    again).  A batch counts one call per cluster, as the one-by-one path would.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def summarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        self.calls += 1
        return str(self.inner.summarize(texts, max_tokens=max_tokens))

    def summarize_batch(self, clusters: Sequence[Sequence[str]], *, max_tokens: int) -> list[str]:
        self.calls += len(clusters)
        return [str(s) for s in self.inner.summarize_batch(clusters, max_tokens=max_tokens)]

    def sentence_vector_tap(self, embedder: Any) -> Any:
        return self.inner.sentence_vector_tap(embedder)


def recall(tree: Any, embedder: Any, questions: Sequence[Any]) -> dict[int, float]:
    """Mean evidence recall of ``questions`` over ``tree`` per budget (collapsed tree)."""
    from raptor_core.evaluation import evidence_recall
    from raptor_core.retrieval import CollapsedTreeRetriever

    out: dict[int, float] = {}
    for budget in BUDGETS:
        retriever = CollapsedTreeRetriever(tree, embedder, k=10_000, max_tokens=budget)
        scores = []
        for q in questions:
            hits = retriever.retrieve(q.question)
            score = evidence_recall(q.evidence, [h.node.text for h in hits])
            if score is not None:
                scores.append(score)
        out[budget] = sum(scores) / len(scores) if scores else float("nan")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=50, help="documents after the insert")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    data = Path(args.data)
    if not (data / "qasper_docs.jsonl").is_file():
        print(f"incremental benchmark: no QASPER data in {data}; nothing to do")
        return 0
    if args.n < 3:
        parser.error("--n must be at least 3")

    from raptor_core import ExtractiveSummarizer, SentenceTransformerEmbedder, TreeBuilder
    from raptor_core.evaluation import load_documents, load_questions

    papers = load_documents(data / "qasper_docs.jsonl")
    questions = load_questions(data / "qasper.jsonl", papers)
    filler = (
        load_documents(data / "quality_docs.jsonl")
        if (data / "quality_docs.jsonl").is_file()
        else []
    )
    pool = [*papers[:-1], *filler]
    if len(pool) < args.n - 1:
        print(f"only {len(pool) + 1} documents available; using N = {len(pool) + 1}")
    base_docs = pool[: args.n - 1]
    new_doc = papers[-1]  # a paper, so the insert is scored by its questions too
    n = len(base_docs) + 1
    in_tree = {d.doc_id for d in base_docs} | {new_doc.doc_id}
    qs = [q for q in questions if q.doc_id in in_tree]
    embedder = SentenceTransformerEmbedder()
    embedder.embed_query("warm up")

    def builder() -> tuple[Any, CountingSummarizer]:
        summarizer = CountingSummarizer(ExtractiveSummarizer(embedder))
        return TreeBuilder(embedder, summarizer, random_state=args.seed), summarizer

    def timed(label: str, fn: Any) -> tuple[Any, float]:
        print(f"{label} ...", flush=True)
        start = time.perf_counter()
        value = fn()
        seconds = time.perf_counter() - start
        print(f"{label}: {seconds:.1f} s", flush=True)
        return value, seconds

    b, s = builder()
    base, t_base = timed(f"build {n - 1} documents", lambda: b.build(base_docs))
    calls_base = s.calls
    s.calls = 0
    grown, t_insert = timed("insert 1 document", lambda: b.insert(base, [new_doc]))
    calls_insert = s.calls
    s.calls = 0
    shrunk, t_delete = timed("delete it again", lambda: b.delete(grown.tree, [new_doc.doc_id]))
    calls_delete = s.calls
    b2, s2 = builder()
    fresh, t_fresh = timed(f"fresh build of {n} documents", lambda: b2.build([*base_docs, new_doc]))
    calls_fresh = s2.calls

    kept = [node for node in base.nodes if node.id in grown.tree]
    bitwise = all(
        node.text == grown.tree.node(node.id).text
        and bytes(base.embeddings[base.row(node.id)].tobytes())
        == bytes(grown.tree.embeddings[grown.tree.row(node.id)].tobytes())
        for node in kept
    )
    r_grown, _ = timed("recall (grown tree)", lambda: recall(grown.tree, embedder, qs))
    r_fresh, _ = timed("recall (fresh build)", lambda: recall(fresh, embedder, qs))
    base_qs = [q for q in qs if q.doc_id != new_doc.doc_id]
    r_shrunk = recall(shrunk.tree, embedder, base_qs)
    r_base = recall(base, embedder, base_qs)

    result = {
        "n": n,
        "new_document": new_doc.doc_id,
        "questions": len(qs),
        "base": {
            "nodes": len(base),
            "layers": base.num_layers,
            "seconds": t_base,
            "calls": calls_base,
        },
        "fresh": {
            "nodes": len(fresh),
            "layers": fresh.num_layers,
            "seconds": t_fresh,
            "calls": calls_fresh,
        },
        "insert": {"seconds": t_insert, "calls": calls_insert, "report": grown.report.to_dict()},
        "delete": {"seconds": t_delete, "calls": calls_delete, "report": shrunk.report.to_dict()},
        "untouched_nodes_kept_bitwise": bitwise,
        "untouched_nodes": len(kept),
        "recall": {
            "grown": r_grown,
            "fresh": r_fresh,
            "after_delete": r_shrunk,
            "base_build": r_base,
        },
    }
    lines = [
        "# Incremental trees: one document versus a rebuild",
        "",
        f"Generated by `benchmarks/incremental.py --n {args.n} --seed {args.seed}` on "
        f"{datetime.now(timezone.utc):%Y-%m-%d} ({platform.machine()}, {os.cpu_count()} cores, "
        "shared with other jobs: read the times as ratios measured side by side).",
        "",
        (
            f"`--n {args.n}` asked for more documents than the data has: {n} are used "
            f"({len(papers)} distinct QASPER papers, {len(filler)} QuALITY articles).\n\n"
            if n < args.n
            else ""
        )
        + f"Tree of {n - 1} documents (QASPER papers, then QuALITY articles), "
        f"all-MiniLM-L6-v2, UMAP/GMM, extractive summariser wrapped to count calls; "
        f"then QASPER paper `{new_doc.doc_id}` is inserted, and deleted again.",
        "",
        "| operation | summary calls | wall time (s) | calls vs rebuild | time vs rebuild |",
        "|---|---|---|---|---|",
        f"| fresh build of {n} documents | {calls_fresh} | {t_fresh:.1f} | 1 | 1 |",
        f"| insert 1 into {n - 1} | {calls_insert} | {t_insert:.2f} | "
        f"{calls_insert / max(calls_fresh, 1):.3f} | {t_insert / t_fresh:.3f} |",
        f"| build of {n - 1} documents | {calls_base} | {t_base:.1f} | 1 | 1 |",
        f"| delete 1 from {n} | {calls_delete} | {t_delete:.2f} | "
        f"{calls_delete / max(calls_base, 1):.3f} | {t_delete / t_base:.3f} |",
        "",
        f"Insert: {grown.report.embedded_chunks} chunks and "
        f"{grown.report.embedded_summaries} summaries embedded, "
        f"{len(grown.report.nodes_added)} nodes added, {len(grown.report.nodes_removed)} "
        f"removed, {grown.report.clusters_split} clusters split, "
        f"{grown.report.reclustered_subtrees} re-clustered for drift; "
        f"{len(kept)} untouched nodes kept id, text and embedding bit for bit: "
        f"{'yes' if bitwise else 'NO'}.",
        "",
        f"Evidence recall, {len(qs)} QASPER questions over the {n} documents "
        "(collapsed tree, `raptor_core.evaluation.evidence_recall`):",
        "",
        "| tree | " + " | ".join(f"{b} tokens" for b in BUDGETS) + " |",
        "|---|" + "---|" * len(BUDGETS),
        "| grown by insert | " + " | ".join(f"{r_grown[b]:.3f}" for b in BUDGETS) + " |",
        "| fresh build | " + " | ".join(f"{r_fresh[b]:.3f}" for b in BUDGETS) + " |",
        "| difference (points) | "
        + " | ".join(f"{100 * (r_grown[b] - r_fresh[b]):+.1f}" for b in BUDGETS)
        + " |",
        "",
        f"After deleting it again ({len(base_qs)} questions of the other documents): "
        + ", ".join(
            f"{b} tokens {r_shrunk[b]:.3f} (build of {n - 1}: {r_base[b]:.3f})" for b in BUDGETS
        )
        + ".",
        "",
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "incremental.md").write_text("\n".join(lines), encoding="utf-8")
    (out / "incremental.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
