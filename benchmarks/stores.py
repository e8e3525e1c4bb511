"""Open time, query latency and memory of the node stores at 10k, 100k and 1M nodes.

For each size a synthetic tree (``_synthetic.py``: 384-dim unit vectors, no model) is saved
once with ``Tree.save``; then every store in ``STORES`` is measured in a FRESH Python
process, so its open time is a cold start and its peak RSS (``resource.getrusage``, the
kernel's high-water mark) is its own:

* **write**: putting the tree into the store (Chroma: ``LangChainNodeStore.add_tree``, or
  ``RaptorIndex.from_tree`` for the LlamaIndex store, in a process of its own; the file
  store's ``Tree.save`` is timed in the parent);
* **open**: from nothing in memory to a store a retriever can search (imports excluded,
  timed apart); Chroma: ``RaptorRetriever.from_vectorstore``, ``load_index_from_storage``;
* **first query**: the first collapsed query after opening, where lazy stores pay for what
  they did not load at open (Chroma loads the collection's segments, its whole HNSW index
  included, on the first read of any record);
* **latency**: p50 / p95 of ``--queries`` queries for the collapsed and traversal strategies,
  query vectors precomputed (embedding excluded); the same queries for every store;
* **RSS**: peak after open and peak after the queries (Chroma server: the server's own peak
  too, from ``/proc``);
* **agreement**: the share of the in-memory store's top-k ids each store returns (HNSW is
  approximate; the file stores must agree exactly).

The baseline, measured in the same run and in the in-memory store's process, is numpy brute
force over the matrix already in RAM (``argsort(-(E @ q))[:k]``); latencies are printed as
ratios of it, because the machines are shared and noisy.  BLAS runs with ``--threads``
threads (default 1, as in ``query.py``); Chroma's own threads are not limited.

A store is one entry of ``STORES``: a name, what it imports, an optional ``write`` step and
an ``open`` step.  Results are rewritten after every measurement, so an interrupted run
keeps what it measured.

Usage:
    python benchmarks/stores.py [--sizes 10000 100000 1000000] [--stores NAME ...]
        [--queries 50] [--threads 1] [--out benchmarks/results] [--keep DIR [--reuse]]

``--keep DIR --reuse`` keeps what an earlier run left in ``DIR/<size>`` (the saved tree,
the query vectors, a store's written data) and measures the opens again without writing
(writing 1M nodes into Chroma takes over half an hour): two versions of the code can then
be compared on the same data, run after run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

K = 10
TOP_K = 5  # traversal: children kept per layer
COLLECTION = "raptor-bench"
BASELINE = "baseline: numpy brute force (matrix in RAM)"


# -- the stores ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StoreEntry:
    """One store to measure.

    ``open(work, context)`` runs in a fresh process and returns what the strategies search
    (a Tree or a NodeStore); ``prepare(work)`` runs before it there, untimed (the in-memory
    store starts from a tree already in RAM).  ``write(tree, work)`` runs once per size in
    a process of its own, before any open.  ``reads`` names the entry whose written data
    this one opens (Chroma server serves what the embedded client wrote).  ``probes(store)``
    returns extra timed calls ``(query vector) -> anything``: the store's own floor.
    """

    name: str
    open: Callable[[Path, dict[str, Any]], Any]
    needs: tuple[str, ...] = ()
    write: Callable[[Any, Path], None] | None = None
    written: Callable[[Path], bool] | None = None
    prepare: Callable[[Path], Any] | None = None
    reads: str | None = None
    server: bool = False
    search: bool = True
    probes: Callable[[Any], dict[str, Callable[[np.ndarray], Any]]] | None = None
    note: str = ""


def _prepare_tree(work: Path) -> Any:
    from raptor_core import Tree

    return Tree.load(work / "tree")


def _open_memory(work: Path, context: dict[str, Any]) -> Any:
    from raptor_core.store import InMemoryNodeStore

    return InMemoryNodeStore.from_tree(context["prepared"])


def _open_file(*, mmap: bool, verify: bool = True) -> Callable[[Path, dict[str, Any]], Any]:
    def open_file(work: Path, context: dict[str, Any]) -> Any:
        from raptor_core import Tree
        from raptor_core.store import InMemoryNodeStore

        tree = Tree.load(work / "tree", mmap=mmap, verify=verify)
        return InMemoryNodeStore.from_tree(tree)

    return open_file


def _open_lazy(*, verify: bool) -> Callable[[Path, dict[str, Any]], Any]:
    def open_lazy(work: Path, context: dict[str, Any]) -> Any:
        from raptor_core.store import FileNodeStore

        return FileNodeStore.open(work / "tree", verify=verify)

    return open_lazy


def _parse_json_only(work: Path, context: dict[str, Any]) -> Any:
    # What the file store's load costs before any node or matrix exists.
    return json.loads((work / "tree" / "tree.json").read_bytes())


def _chroma_store(client: Any) -> Any:
    from langchain_chroma import Chroma

    from raptor_langchain import LangChainNodeStore

    return LangChainNodeStore(
        Chroma(
            client=client,
            collection_name=COLLECTION,
            collection_configuration={"hnsw": {"space": "cosine"}},  # type: ignore[typeddict-item]
        )
    )


def _write_chroma(tree: Any, work: Path) -> None:
    import chromadb

    _chroma_store(chromadb.PersistentClient(path=str(work / "chroma"))).add_tree(tree)


def _ready(store: Any) -> Any:
    # Opening as a user does: RaptorRetriever.from_vectorstore reads the manifest, the
    # dimension and the tree's size and checks the embedder; the store it made is searched.
    # (The top layer is read at the first search that needs it.)
    from raptor_core.testing import FakeEmbedder
    from raptor_langchain import RaptorEmbeddings, RaptorRetriever

    embeddings = RaptorEmbeddings(FakeEmbedder(dim=384))  # never called: vectors are given
    return RaptorRetriever.from_vectorstore(store.vectorstore, embeddings=embeddings).store


def _written_chroma(work: Path) -> bool:
    return (work / "chroma" / "chroma.sqlite3").exists()


def _open_chroma_embedded(work: Path, context: dict[str, Any]) -> Any:
    import chromadb

    return _ready(_chroma_store(chromadb.PersistentClient(path=str(work / "chroma"))))


def _open_chroma_server(work: Path, context: dict[str, Any]) -> Any:
    import chromadb

    client = chromadb.HttpClient(host="127.0.0.1", port=int(context["port"]))
    return _ready(_chroma_store(client))


def _chroma_probes(store: Any) -> dict[str, Callable[[np.ndarray], Any]]:
    # The floor under LangChainNodeStore: one raw collection.query, with and without the
    # metadata filter that keeps the manifest out of results.
    collection = store.dialect.collection

    def raw(where: dict[str, Any] | None) -> Callable[[np.ndarray], Any]:
        def query(q: np.ndarray) -> Any:
            got = collection.query(query_embeddings=[q], n_results=K, where=where, include=[])
            return got["ids"][0]

        return query

    def probe_layers(q: np.ndarray) -> Any:
        # What opening cost before the manifest recorded the layer sizes: one filtered
        # get per layer (each a scan of the collection).
        return store.dialect.max_layer()

    return {
        "collection.query, no filter": raw(None),
        "collection.query, where raptor_layer >= 0": raw({"raptor_layer": {"$gte": 0}}),
        "top layer by probing (open before the manifest kept layer sizes)": probe_layers,
    }


def _li_vector_store(work: Path) -> Any:
    import chromadb
    from llama_index.vector_stores.chroma import ChromaVectorStore

    client = chromadb.PersistentClient(path=str(work / "chroma-li"))
    collection = client.get_or_create_collection(
        COLLECTION, configuration={"hnsw": {"space": "cosine"}}
    )
    return ChromaVectorStore(chroma_collection=collection)


def _write_chroma_li(tree: Any, work: Path) -> None:
    from llama_index.core import StorageContext

    from raptor_core.testing import FakeEmbedder
    from raptor_llamaindex import RaptorIndex

    context = StorageContext.from_defaults(vector_store=_li_vector_store(work))
    # The embedder is never called (the tree has its vectors); it must have their dimension.
    index = RaptorIndex.from_tree(
        tree, embed_model=FakeEmbedder(dim=tree.dim), storage_context=context
    )
    index.storage_context.persist(persist_dir=str(work / "li-index"))


def _written_chroma_li(work: Path) -> bool:
    return (work / "li-index").exists()


def _open_chroma_li(work: Path, context: dict[str, Any]) -> Any:
    from llama_index.core import StorageContext, load_index_from_storage

    from raptor_core.testing import FakeEmbedder

    storage = StorageContext.from_defaults(
        persist_dir=str(work / "li-index"), vector_store=_li_vector_store(work)
    )
    # Opening as a user does (it checks the embedder against the store's dim and size);
    # the top layer is read at the first search that needs it.
    index = load_index_from_storage(storage, embed_model=FakeEmbedder(dim=384))
    return index.store  # type: ignore[attr-defined]


def _chroma_li_probes(store: Any) -> dict[str, Callable[[np.ndarray], Any]]:
    collection = store.backend.collection

    def raw(q: np.ndarray) -> Any:
        return collection.query(query_embeddings=[q], n_results=K, include=[])["ids"][0]

    return {
        "collection.query, no filter": raw,
        "top layer by probing (open before the index struct kept layer sizes)": lambda q: (
            store.backend.max_layer()
        ),
    }


CHROMA = ("chromadb", "langchain_chroma", "raptor_langchain")
CHROMA_LI = ("chromadb", "llama_index.vector_stores.chroma", "raptor_llamaindex")
STORES: dict[str, StoreEntry] = {
    e.name: e
    for e in [
        StoreEntry(
            name="memory",
            prepare=_prepare_tree,
            open=_open_memory,
            note="InMemoryNodeStore.from_tree over a tree already in RAM",
        ),
        StoreEntry(name="file", open=_open_file(mmap=False), note="Tree.load(path)"),
        StoreEntry(name="file-mmap", open=_open_file(mmap=True), note="Tree.load(path, mmap=True)"),
        StoreEntry(
            name="file-mmap-noverify",
            open=_open_file(mmap=True, verify=False),
            note="Tree.load(path, mmap=True, verify=False): no SHA-256 of the files",
        ),
        StoreEntry(
            name="file-lazy",
            open=_open_lazy(verify=True),
            note="FileNodeStore.open(path): the node index tree.idx, the matrix mapped, nodes "
            "parsed when returned; blocks checked (SHA-256, unit norm) on first use",
        ),
        StoreEntry(
            name="file-lazy-noverify",
            open=_open_lazy(verify=False),
            note="FileNodeStore.open(path, verify=False): rows still checked unit-norm on first "
            "use, no SHA-256 of the blocks",
        ),
        StoreEntry(
            name="file-json-only",
            open=_parse_json_only,
            search=False,
            note="json.loads(tree.json) alone: the part of a file load that mmap cannot skip",
        ),
        StoreEntry(
            name="chroma-embedded",
            needs=CHROMA,
            write=_write_chroma,
            written=_written_chroma,
            open=_open_chroma_embedded,
            probes=_chroma_probes,
            note="langchain_chroma.Chroma on chromadb.PersistentClient, LangChainNodeStore",
        ),
        StoreEntry(
            name="chroma-server",
            needs=CHROMA,
            reads="chroma-embedded",
            server=True,
            open=_open_chroma_server,
            probes=_chroma_probes,
            note="the same data served by `chroma run`, chromadb.HttpClient on 127.0.0.1",
        ),
        StoreEntry(
            name="chroma-llamaindex",
            needs=CHROMA_LI,
            write=_write_chroma_li,
            written=_written_chroma_li,
            open=_open_chroma_li,
            probes=_chroma_li_probes,
            note="llama_index ChromaVectorStore on chromadb.PersistentClient: written by "
            "RaptorIndex.from_tree, opened with load_index_from_storage (LlamaIndexNodeStore)",
        ),
    ]
}


# -- the child process -----------------------------------------------------------------------------
class LookupEmbedder:
    """Returns precomputed query vectors: query embedding costs nothing in the timings."""

    def __init__(self, vectors: dict[str, np.ndarray]) -> None:
        self.vectors = vectors

    def embed_documents(self, texts: Any) -> np.ndarray:
        return np.stack([self.vectors[t] for t in texts])

    def embed_query(self, text: str) -> np.ndarray:
        return self.vectors[text]


def _peak_rss_mb(pid: int | str = "self") -> float | None:
    """Peak resident memory of a process (``VmHWM``), in MB.

    Not ``getrusage``'s ``ru_maxrss``: Linux carries it across ``exec``, so a child started
    by a large parent reports the parent's peak; ``VmHWM`` belongs to the process's own
    address space.
    """
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    if pid != "self":
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _times(
    run: Callable[[str], Any], queries: list[str], budget_s: float
) -> tuple[list[float], list[list[str]]]:
    """Time ``run`` on each query, stopping early once ``budget_s`` is spent (3 at least)."""
    times, ids = [], []
    deadline = time.perf_counter() + budget_s
    for query in queries:
        if len(times) >= 3 and time.perf_counter() > deadline:
            break
        start = time.perf_counter()
        hits = run(query)
        times.append((time.perf_counter() - start) * 1000.0)
        ids.append(hits)
    return times, ids


def _summary(times: list[float]) -> dict[str, float]:
    return {
        "p50_ms": float(np.percentile(times, 50)),
        "p95_ms": float(np.percentile(times, 95)),
        "n": len(times),
    }


def child(
    entry: StoreEntry, work: Path, context: dict[str, Any], threads: int, budget_s: float
) -> dict[str, Any]:
    """Open the store and time it; runs in a fresh process (see ``--child``)."""
    import importlib

    from threadpoolctl import threadpool_limits

    start = time.perf_counter()
    from raptor_core import CollapsedTreeRetriever, TreeTraversalRetriever

    for module in entry.needs:
        importlib.import_module(module)
    out: dict[str, Any] = {"import_s": time.perf_counter() - start}
    if entry.prepare is not None:
        context = {**context, "prepared": entry.prepare(work)}
    out["rss_before_open_mb"] = _peak_rss_mb()
    with threadpool_limits(limits=threads):
        start = time.perf_counter()
        store = entry.open(work, context)
        out["open_s"] = time.perf_counter() - start
        out["rss_open_mb"] = _peak_rss_mb()
        if not entry.search:
            return out
        vectors = np.load(work / "queries.npy")
        names = [f"q{i}" for i in range(len(vectors))]
        embedder = LookupEmbedder(dict(zip(names, vectors, strict=True)))
        runs: dict[str, Callable[[str], list[str]]] = {}
        if "prepared" in context:
            matrix = context["prepared"].embeddings
            ids = [n.id for n in context["prepared"].nodes]

            def baseline(query: str) -> list[str]:
                return [ids[i] for i in np.argsort(-(matrix @ embedder.vectors[query]))[:K]]

            runs[BASELINE] = baseline
        for strategy, retriever in {
            "collapsed": CollapsedTreeRetriever(store, embedder, k=K, max_tokens=None),
            "traversal": TreeTraversalRetriever(store, embedder, k=K, top_k=TOP_K, max_tokens=None),
        }.items():
            runs[strategy] = lambda q, r=retriever: [h.node.id for h in r.retrieve(q)]
        start = time.perf_counter()
        runs["collapsed"](names[0])
        out["first_query_ms"] = (time.perf_counter() - start) * 1000.0
        out["latency"], out["ids"] = {}, {}
        if entry.probes is not None:
            for name, probe in entry.probes(store).items():
                runs[f"probe: {name}"] = lambda q, f=probe: f(embedder.vectors[q])
        for name, run in runs.items():
            start = time.perf_counter()
            warm = run(names[0])
            warm_s = time.perf_counter() - start
            if warm_s > budget_s:
                # Too slow to repeat within the budget: the warm-up is the one sample.
                times, found = [warm_s * 1000.0], [warm]
            else:
                times, found = _times(run, names, budget_s)
            out["latency"][name] = _summary(times)
            out["ids"][name] = found
    out["rss_peak_mb"] = _peak_rss_mb()
    out["rss_anon_mb"] = _anon_rss_mb()
    return out


def _anon_rss_mb() -> float | None:
    """Resident memory that is not a mapped file (``RssAnon``), in MB, now.

    A memory-mapped matrix counts in the RSS once its pages are read, but those pages belong
    to the page cache: the kernel drops them under memory pressure and shares them between
    processes.  Anonymous memory is what the process really holds.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def _run_child(
    args: argparse.Namespace, entry: StoreEntry, work: Path, context: dict[str, Any], mode: str
) -> dict[str, Any]:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        entry.name,
        "--mode",
        mode,
        "--work",
        str(work),
        "--context",
        json.dumps(context),
        "--threads",
        str(args.threads),
        "--budget",
        str(args.budget),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-5:]
        return {"error": f"exit {done.returncode}: " + " | ".join(tail)}
    return json.loads(done.stdout.strip().splitlines()[-1])


def child_main(args: argparse.Namespace) -> None:
    entry = STORES[args.child]
    work = Path(args.work)
    context = json.loads(args.context)
    if args.mode == "write":
        from raptor_core import Tree

        for module in entry.needs:
            __import__(module)
        tree = Tree.load(work / "tree", mmap=True)
        start = time.perf_counter()
        assert entry.write is not None
        entry.write(tree, work)
        result = {"write_s": time.perf_counter() - start, "rss_peak_mb": _peak_rss_mb()}
    else:
        result = child(entry, work, context, args.threads, args.budget)
    print(json.dumps(result))


# -- the parent ------------------------------------------------------------------------------------
@dataclass
class Results:
    args: argparse.Namespace
    machine: dict[str, Any]
    sizes: dict[int, dict[str, Any]] = field(default_factory=dict)

    def write(self) -> None:
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        data = {
            "machine": self.machine,
            "k": K,
            "traversal_top_k": TOP_K,
            "queries": self.args.queries,
            "dim": self.args.dim,
            "threads": self.args.threads,
            "stores": {
                name: STORES[name].note
                for name in STORES
                if any(name in size["stores"] for size in self.sizes.values())
            },
            "sizes": self.sizes,
            "note": self.args.note,
        }
        (out / "stores.json").write_text(json.dumps(data, indent=1) + "\n")
        (out / "stores.md").write_text(markdown(data))


def _agreement(found: list[list[str]], reference: list[list[str]]) -> float:
    # A store that ran out of time answered a prefix of the queries.
    shares = [len(set(a) & set(b)) / max(1, len(b)) for a, b in zip(found, reference, strict=False)]
    return float(np.mean(shares)) if shares else float("nan")


def _fmt_ms(latency: dict[str, float] | None, baseline: dict[str, float] | None) -> str:
    if latency is None:
        return ""
    cell = f"{latency['p50_ms']:.2f} / {latency['p95_ms']:.2f}"
    if baseline:
        cell += f" ({latency['p50_ms'] / baseline['p50_ms']:.1f}x)"
    if baseline and latency.get("n", 0) < baseline.get("n", 0):
        cell += f" [{latency['n']} queries]"  # stopped by --budget
    return cell


def rows(size: dict[str, Any]) -> list[list[str]]:
    """One table row per store of one size (strings, for the terminal and markdown)."""
    stores = size["stores"]
    base = stores.get("memory", {}).get("latency", {}).get(BASELINE)
    out = []
    if base:
        out.append([BASELINE, "", "", "", _fmt_ms(base, base), "", "", "", ""])
    for name, r in sorted(stores.items(), key=lambda item: _ORDER.get(item[0], len(_ORDER))):
        if r.get("code") not in (None, size.get("code")):
            name = f"{name} (at {r['code']})"  # kept from an earlier run by --merge
        if "error" in r:
            out.append([name, f"error: {r['error'][:80]}", "", "", "", "", "", "", ""])
            continue
        if "skipped" in r:
            out.append([name, f"skipped: {r['skipped']}", "", "", "", "", "", "", ""])
            continue
        latency = r.get("latency", {})
        agree = r.get("agreement", {})
        rss = (
            f"{r['rss_before_open_mb']:.0f} / {r['rss_open_mb']:.0f} / "
            f"{r.get('rss_peak_mb', r['rss_open_mb']):.0f}"
        )
        if r.get("rss_anon_mb") is not None:
            rss += f" (anon {r['rss_anon_mb']:.0f})"
        if "server_rss_peak_mb" in r:
            rss += f" + server {r['server_rss_peak_mb']:.0f}"
        out.append(
            [
                name,
                f"{r['write_s']:.1f}"
                if "write_s" in r
                else "reused"
                if "write_reused" in r
                else "",
                f"{r['open_s']:.3f}",
                f"{r['first_query_ms']:.1f}" if "first_query_ms" in r else "",
                _fmt_ms(latency.get("collapsed"), base),
                _fmt_ms(latency.get("traversal"), base),
                rss,
                " / ".join(f"{agree[s]:.2f}" for s in ("collapsed", "traversal") if s in agree),
                f"{r['import_s']:.1f}",
            ]
        )
    return out


_ORDER = {name: i for i, name in enumerate(STORES)}

HEADER = [
    "store",
    "write s",
    "open s",
    "1st query ms",
    "collapsed p50 / p95 ms",
    "traversal p50 / p95 ms",
    "RSS MB before / open / peak",
    "agreement",
    "imports s",
]


def markdown(data: dict[str, Any]) -> str:
    m = data["machine"]
    lines = [
        "# Node stores at scale: open time, query latency, memory",
        "",
        f"Generated by `benchmarks/stores.py` on {m['date']}: {m['platform']}, {m['cpus']} CPUs, "
        f"{m['memory_gb']:.0f} GB RAM, Python {m['python']}, numpy {m['numpy']}"
        + (f", chromadb {m['chromadb']}" if m.get("chromadb") else "")
        + f"; load average at start {m['load']}.",
        f"Synthetic trees, dim {data['dim']}, k={data['k']}, {data['queries']} queries per "
        f"strategy (query embedding excluded), traversal top_k={data['traversal_top_k']}, "
        f"{data['threads']} BLAS thread(s).  Every store is opened in a fresh process.  "
        "Latency ratios are of the numpy baseline's p50 in the same run.  RSS: the "
        "process's peak before opening (interpreter and imports; for `memory`, the tree already "
        "in RAM), after opening, and after the queries, then (anon N) the anonymous part "
        "at the end: pages of a memory-mapped file count in the RSS once read, but the kernel "
        "can drop them.  Agreement: share of the in-memory store's top-k "
        "ids returned (collapsed / traversal).  [n queries]: the strategy used up its time "
        "budget (`--budget`) after n queries.",
        "",
        "Sizes that ran: " + ", ".join(f"{int(s):,}" for s in data["sizes"]) + ".",
    ]
    if data.get("note"):
        lines += ["", str(data["note"])]
    for size in data["sizes"].values():
        lines += [
            "",
            f"## {size['nodes']:,} nodes",
            "",
            (
                f"Generated in {size['generate_s']:.1f} s; `Tree.save` {size['save_s']:.1f} s; "
                if size["generate_s"] == size["generate_s"]  # NaN: --reuse
                else "Tree and written stores (write s: reused) left by an earlier run (--reuse); "
            )
            + f"tree.json {size['json_mb']:.0f} MB, matrix {size['matrix_mb']:.0f} MB; "
            f"load average {size.get('load_at_start', '?')} when this size started; "
            f"code at commit {size.get('code', '?')}.",
            "",
            "| " + " | ".join(HEADER) + " |",
            "|" + "---|" * len(HEADER),
        ]
        lines += ["| " + " | ".join(row) + " |" for row in rows(size)]
        probes = [
            (store, name[len("probe: ") :], latency)
            for store, r in size["stores"].items()
            for name, latency in r.get("latency", {}).items()
            if name.startswith("probe: ")
        ]
        if probes:
            lines += ["", "| store | probe | p50 / p95 ms |", "|---|---|---|"]
            lines += [f"| {s} | `{n}` | {_fmt_ms(lat, None)} |" for s, n, lat in probes]
    lines += ["", "Stores:", ""]
    lines += [f"- `{name}`: {note}" for name, note in data["stores"].items()]
    return "\n".join(lines) + "\n"


def print_size(size: dict[str, Any]) -> None:
    table = [HEADER, *rows(size)]
    widths = [max(len(r[i]) for r in table) for i in range(len(HEADER))]
    print(f"\n## {size['nodes']:,} nodes")
    for i, row in enumerate(table):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("-" * (sum(widths) + 2 * len(widths)))
    for store, r in size["stores"].items():
        for name, latency in r.get("latency", {}).items():
            if name.startswith("probe: "):
                print(f"{store} {name}: {_fmt_ms(latency, None)} ms")


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "memory_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
    }
    try:
        from importlib.metadata import version

        info["chromadb"] = version("chromadb")
    except Exception:  # not installed: the Chroma stores are skipped
        info["chromadb"] = None
    return info


def _commit() -> str | None:
    """The commit measured: ``RAPTOR_BENCH_COMMIT`` (a copy outside git), else ``git``'s."""
    if os.environ.get("RAPTOR_BENCH_COMMIT"):
        return os.environ["RAPTOR_BENCH_COMMIT"]
    done = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or None


def _missing(entry: StoreEntry) -> str | None:
    import importlib.util

    for module in entry.needs:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install 'raptor-retriever[chroma]')"
    return None


def measure_size(args: argparse.Namespace, n: int, work: Path, results: Results) -> None:
    from _synthetic import synthetic_queries, synthetic_tree

    from raptor_core import Tree

    if args.reuse and (work / "tree").exists() and (work / "queries.npy").exists():
        generated = saved = float("nan")  # done by the run that left them
        nodes = len(Tree.load(work / "tree", mmap=True, verify=False))
    else:
        start = time.perf_counter()
        tree = synthetic_tree(n, dim=args.dim, seed=0)
        generated = time.perf_counter() - start
        np.save(work / "queries.npy", synthetic_queries(tree, args.queries))
        start = time.perf_counter()
        tree.save(work / "tree")
        saved = time.perf_counter() - start
        nodes = len(tree)
        del tree
    files = {p.name: p.stat().st_size / 1e6 for p in (work / "tree").iterdir() if p.is_file()}
    size: dict[str, Any] = {
        "nodes": nodes,
        "load_at_start": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "code": _commit(),
        "generate_s": generated,
        "save_s": saved,
        "json_mb": files.get("tree.json", 0.0),
        "matrix_mb": sum(v for k, v in files.items() if k.endswith(".npy")),
        "stores": {},
    }
    kept = results.sizes.get(n, {}).get("stores", {}) if args.merge else {}
    # --merge: stores not measured again keep their earlier figures (and say which commit).
    size["stores"] = {
        name: {**r, "code": r.get("code", results.sizes[n].get("code"))}
        for name, r in kept.items()
        if name not in args.stores
    }
    results.sizes[n] = size
    print(f"# {nodes:,} nodes: generated in {generated:.1f} s, saved in {saved:.1f} s", flush=True)
    written: dict[str, dict[str, Any]] = {}
    reference: dict[str, list[list[str]]] = {}
    for name in args.stores:
        entry = STORES[name]
        missing = _missing(entry)
        if missing is not None:
            size["stores"][name] = {"skipped": missing}
            continue
        result: dict[str, Any] = {}
        if args.reuse and entry.written is not None and entry.written(work):
            written[name] = {"reused": True}
            result = {"write_reused": True}
        elif entry.write is not None:
            result = _run_child(args, entry, work, {}, "write")
            written[name] = result
            if "error" in result:
                size["stores"][name] = result
                results.write()
                continue
            result = {"write_s": result["write_s"], "write_rss_peak_mb": result["rss_peak_mb"]}
        if entry.reads is not None and "error" in written.get(entry.reads, {"error": ""}):
            size["stores"][name] = {"skipped": f"needs what {entry.reads} writes"}
            continue
        if entry.server:
            result.update(_measure_server(args, entry, work))
        else:
            result.update(_run_child(args, entry, work, {}, "open"))
        result["code"] = size["code"]
        size["stores"][name] = result
        found = result.pop("ids", {})
        if name == "memory":
            reference = found
        result["agreement"] = {
            s: _agreement(found[s], reference[s])
            for s in ("collapsed", "traversal")
            if s in reference and s in found
        }
        results.write()
        print(f"  {name}: done", flush=True)
    print_size(size)


def _measure_server(args: argparse.Namespace, entry: StoreEntry, work: Path) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    import chroma_server

    start = time.perf_counter()
    server = chroma_server.start(work / "chroma", timeout=300.0)
    started = time.perf_counter() - start
    try:
        result = _run_child(args, entry, work, {"port": server.port}, "open")
        result["server_start_s"] = started
        peak = _peak_rss_mb(server.process.pid)
        if peak is not None:
            result["server_rss_peak_mb"] = peak
    finally:
        chroma_server.stop(server)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--stores", nargs="+", default=list(STORES), choices=list(STORES))
    parser.add_argument("--queries", type=int, default=50, help="timed queries per strategy")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--threads", type=int, default=1, help="BLAS/OpenMP threads (1)")
    parser.add_argument(
        "--budget", type=float, default=60.0, help="seconds per strategy before it stops early"
    )
    parser.add_argument("--out", default=str(HERE / "results"), help="for stores.json/.md")
    parser.add_argument("--keep", default=None, help="work in this directory and keep it")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="with --keep: measure again what an earlier run left there, without writing",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the sizes already in --out/stores.json until they are measured again",
    )
    parser.add_argument(
        "--report", action="store_true", help="only rewrite stores.md from --out/stores.json"
    )
    parser.add_argument("--note", default=None, help="a remark for stores.md (how it was run)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="open", help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--context", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child_main(args)
        return
    results = Results(args=args, machine=_machine())
    previous = Path(args.out) / "stores.json"
    if (args.merge or args.report) and previous.exists():
        data = json.loads(previous.read_text())
        results.sizes = {int(n): size for n, size in data["sizes"].items()}
        if args.report:
            results.machine = data["machine"]
            args.note = args.note or data.get("note")
            results.write()
            return
    m = results.machine
    print(
        f"# node stores: dim {args.dim}, k={K}, {args.queries} queries; {m['platform']}, "
        f"{m['cpus']} CPUs, load {m['load']}, Python {m['python']}, chromadb {m['chromadb']}"
    )
    if args.reuse and not args.keep:
        parser.error("--reuse needs --keep DIR")
    for n in args.sizes:
        base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="raptor-stores-"))
        work = base / str(n)
        if work.exists() and not args.reuse:
            shutil.rmtree(work)
        work.mkdir(parents=True, exist_ok=True)
        try:
            measure_size(args, n, work, results)
        finally:
            if not args.keep:
                shutil.rmtree(base, ignore_errors=True)
    results.write()


if __name__ == "__main__":
    main()
