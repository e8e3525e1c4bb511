"""The default strategy's first query over a Chroma collection, against reading the collection.

The first ``passage`` query over a store that can be listed reads every leaf once: to know
each leaf's neighbours and to build the BM25 index (see docs/retrieval.md, "Stores that can
only be searched").  This script measures that first query, each step in a fresh process
(a cold start, as after a restart of the service that holds the retriever):

* **read** (the baseline): ``collection.get`` of every record's document and metadata, a
  page of 5,000 at a time, as the store reads them: what Chroma itself costs;
* **scan**: the same records decoded into tree nodes (``list(LangChainNodeStore(...))``);
* **bm25**: building the BM25 index over the leaf texts (read untimed before);
* **first query**: ``PassageRetriever(store, ...).retrieve(q)`` with a 2,000-token budget,
  the query vector precomputed (embedding excluded); then a **second query**.

Every process first reads one record, so Chroma's one-off load of the collection's segments
is in none of the timings.  The tree is synthetic (``_synthetic.py``) with leaf texts of 75
words drawn from a Zipf distribution over 50,000 made-up words, so BM25 sees a realistic
vocabulary; leaves come 40 to a document, in order.  Steps run interleaved, ``--runs``
times; medians are printed as ratios of the read of the same run.

Usage:
    python benchmarks/first_query.py [--sizes 10000 100000] [--runs 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

COLLECTION = "first-query"
STEPS = ("read", "scan", "bm25", "first")
WORDS_PER_LEAF = 75
LEAVES_PER_DOC = 40


def _vocabulary(size: int, rng: np.random.Generator) -> list[str]:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lengths = rng.integers(3, 11, size=size)
    return ["".join(rng.choice(letters, size=int(n))) for n in lengths]


def make_tree(n_nodes: int) -> Any:
    """A synthetic tree with texts of real size and vocabulary, leaves in documents."""
    from _synthetic import synthetic_tree

    from raptor_core.tree import Tree

    tree = synthetic_tree(n_nodes)
    rng = np.random.default_rng(7)
    vocabulary = _vocabulary(50_000, rng)
    nodes = []
    for node in tree.nodes:
        ranks = np.minimum(rng.zipf(1.2, size=WORDS_PER_LEAF), len(vocabulary)) - 1
        text = " ".join(vocabulary[r] for r in ranks) + "."
        if node.layer == 0:
            i = int(node.id.split(".")[1])
            doc = f"doc{i // LEAVES_PER_DOC}"
            start = (i % LEAVES_PER_DOC) * 1000
            node = dataclasses.replace(
                node, text=text, doc_id=doc, doc_ids=(doc,), span=(start, start + len(text))
            )
        else:
            node = dataclasses.replace(node, text=text)
        nodes.append(node)
    return Tree(nodes=tuple(nodes), embeddings=tree.embeddings, params=tree.params)


def _store(path: Path) -> Any:
    import chromadb
    from langchain_chroma import Chroma

    from raptor_langchain import LangChainNodeStore

    return LangChainNodeStore(
        Chroma(
            client=chromadb.PersistentClient(path=str(path)),
            collection_name=COLLECTION,
            collection_configuration={"hnsw": {"space": "cosine"}},  # type: ignore[typeddict-item]
        )
    )


def child(step: str, work: Path) -> dict[str, float]:
    """One step, timed in this (fresh) process."""
    store = _store(work / "chroma")
    collection = store.dialect.collection
    collection.get(limit=1, include=[])  # Chroma loads the collection's segments here
    start = time.perf_counter()
    if step == "read":
        offset, page = 0, 5000
        include = ["documents", "metadatas"]
        while len(collection.get(limit=page, offset=offset, include=include)["ids"]) == page:
            offset += page
        return {"seconds": time.perf_counter() - start}
    if step == "scan":
        nodes = list(store)
        return {"seconds": time.perf_counter() - start, "nodes": len(nodes)}
    if step == "bm25":
        from raptor_core.retrieval.lexical import BM25Index

        texts = [node.text for node in store if node.layer == 0]
        start = time.perf_counter()
        BM25Index(texts)
        return {"seconds": time.perf_counter() - start, "texts": len(texts)}
    from stores import LookupEmbedder

    from raptor_core import PassageRetriever

    vectors = np.load(work / "queries.npy")
    retriever = PassageRetriever(store, LookupEmbedder({"q": vectors[0]}), max_tokens=2000)
    hits = retriever.retrieve("q")
    first = time.perf_counter() - start
    # Another retriever on the same store: the leaves read by the first are kept per store.
    second = PassageRetriever(store, LookupEmbedder({"q": vectors[1]}), max_tokens=2000)
    start = time.perf_counter()
    second.retrieve("q")
    return {"seconds": first, "second": time.perf_counter() - start, "hits": len(hits)}


def prepare(n: int, work: Path) -> None:
    if (work / "queries.npy").exists():
        return
    from _synthetic import synthetic_queries

    tree = make_tree(n)
    start = time.perf_counter()
    _store(work / "chroma").add_tree(tree)
    print(f"  wrote {len(tree):,} nodes into Chroma in {time.perf_counter() - start:.0f} s")
    np.save(work / "queries.npy", synthetic_queries(tree, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep", default=None, help="keep the collections here and reuse them")
    parser.add_argument("--child", choices=STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, Path(args.work))))
        return
    if args.keep:
        run(args, Path(args.keep))
    else:
        with tempfile.TemporaryDirectory(prefix="first-query-") as scratch:
            run(args, Path(scratch))


def in_fresh_process(step: str, work: Path) -> dict[str, float]:
    """:func:`child` in a new interpreter (a cold start)."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", step, "--work", str(work)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(
    args: argparse.Namespace,
    root: Path,
    step_runner: Callable[[str, Path], dict[str, float]] = in_fresh_process,
) -> None:
    """Every size: write the collection (unless kept from before), then time the steps.

    ``step_runner``: how a step runs (tests pass :func:`child`, this process).
    """
    for n in args.sizes:
        work = root / str(n)
        work.mkdir(parents=True, exist_ok=True)
        print(f"{n:,} nodes")
        prepare(n, work)
        times: dict[str, list[float]] = {step: [] for step in (*STEPS, "second")}
        hits = 0
        for _ in range(args.runs):
            for step in STEPS:
                result = step_runner(step, work)
                times[step].append(result["seconds"])
                if "second" in result:
                    times["second"].append(result["second"])
                    hits = result["hits"]
        base = statistics.median(times["read"])
        for step, label in (
            ("read", "read every record (baseline)"),
            ("scan", "read and decode into nodes"),
            ("bm25", "build BM25 over the leaves"),
            ("first", "first passage query"),
            ("second", "second passage query"),
        ):
            median = statistics.median(times[step])
            print(f"  {label:<32} {median:8.2f} s  {median / base:6.2f}x")
        print(f"  (the first query returned {hits} passages)")


if __name__ == "__main__":
    main()
