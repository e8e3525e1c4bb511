"""``raptor query``: retrieve context for a question from a saved tree."""

from __future__ import annotations

import argparse
from typing import Any

from raptor_core._argtypes import finite_float, int_range, positive_float
from raptor_core.cli import _common, models
from raptor_core.cli._common import check_unicode, safe, safe_json
from raptor_core.exceptions import InvalidParameterError
from raptor_core.retrieval.registry import DEFAULT_STRATEGY, STRATEGIES

__all__ = ["add_parser", "explain", "hit_json", "make_retriever", "run_query"]


def hit_json(hit: Any) -> dict[str, Any]:
    """A :class:`~raptor_core.retrieval.base.Hit` as the JSON object ``--json`` prints."""
    node = hit.node
    out: dict[str, Any] = {
        "id": node.id,
        "layer": node.layer,
        "score": round(float(hit.score), 6),
        "text": node.text,
        "doc_id": node.doc_id,
        "source": hit.source,
        # The document's fields (a record's columns, an HTML title, a PDF page): what a
        # citation needs.  Summaries carry those all their leaves share.
        "metadata": dict(node.metadata),
    }
    if node.layer == 0:
        out["span"] = list(node.span) if node.span else None
    else:
        out["doc_ids"] = list(node.doc_ids)
        out["children"] = list(node.children)
    if hit.leaves:
        out["leaves"] = list(hit.leaves)
    if len(hit.path) > 1:
        out["path"] = list(hit.path)
    if hit.reason:
        out["reason"] = hit.reason
    if hit.evidence:
        out["evidence"] = [{"id": i, "score": round(s, 6)} for i, s in hit.evidence]
    return out


#: ``query`` flag (argparse dest) -> retriever parameter; a flag left unset is not passed.
_STRATEGY_FLAGS = {
    "layers": "layers",
    "start_layer": "start_layer",
    "num_layers": "num_layers",
    "threshold": "threshold",
    "top_k_per_layer": "top_k",
    "chunk_k": "chunk_k",
    "window": "window",
    "rank_factor": "rank_factor",
    "max_share": "max_share",
    "min_score": "min_score",
    "llm_timeout": "llm_timeout",
    "search_timeout": "timeout",
}


def make_retriever(args: argparse.Namespace, tree: Any, embedder: Any) -> Any:
    """The retriever the ``query`` flags describe (strategy, its parameters, its LLM)."""
    from raptor_core.retrieval.registry import accepted_params
    from raptor_core.retrieval.registry import make_retriever as make

    strategy = getattr(args, "strategy", DEFAULT_STRATEGY)
    accepted = accepted_params(strategy)
    params: dict[str, Any] = {"k": args.top_k, "max_tokens": args.max_tokens}
    for dest, name in _STRATEGY_FLAGS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if name not in accepted:
            msg = f"--{dest.replace('_', '-')} does not apply to --strategy {strategy}"
            raise InvalidParameterError(msg)
        params[name] = value
    if args.layers:
        try:
            params["layers"] = [int(x) for x in args.layers.split(",")]
        except ValueError:
            msg = f"--layers takes comma-separated layer numbers, e.g. 0,1; got {args.layers!r}"
            raise InvalidParameterError(msg) from None
    llm = None
    if strategy in {"llm", "hybrid"}:
        llm = models.search_llm(args)
        if llm is None:
            msg = f"--strategy {strategy} needs an LLM: pass --llm ... (for example --llm openai)"
            raise InvalidParameterError(msg)
    return make(strategy, tree, embedder, llm=llm, **params)


def explain(tree: Any, hits: Any, query_vector: Any) -> list[dict[str, Any]]:
    """The nodes a search went through, per layer, top layer first.

    Every node a hit was reached through (``Hit.path``), every hit, and every chunk that
    scored a value-based hit (``Hit.evidence``) is listed once under its layer with its
    cosine similarity to the query (computed from the tree's vectors, so nodes on the path
    that are not returned get a score too) and its role: ``hit #rank``, ``path`` or
    ``evidence``.
    """
    import numpy as np

    q = np.asarray(query_vector, dtype=np.float32).reshape(-1)
    q = q / (float(np.linalg.norm(q)) or 1.0)
    seen: dict[str, dict[str, Any]] = {}

    def add(node_id: str, role: str, *, via: str | None = None, reason: str | None = None) -> None:
        if node_id not in tree:
            return
        entry = seen.get(node_id)
        if entry is None:
            node = tree.node(node_id)
            cosine = float(tree.embeddings[tree.row(node_id)] @ q)
            entry = {"id": node_id, "layer": node.layer, "score": round(cosine, 4), "roles": []}
            seen[node_id] = entry
        if role not in entry["roles"]:
            entry["roles"].append(role)
        if via and "via" not in entry:
            entry["via"] = via
        if reason and "reason" not in entry:
            entry["reason"] = reason

    for rank, hit in enumerate(hits, 1):
        steps = list(hit.path) or [hit.node.id]
        for parent, child in zip([None, *steps], steps, strict=False):
            add(child, "path", via=parent)
        for i, leaf in enumerate(hit.leaves):  # a passage: its leaves are what was returned
            add(leaf, f"hit #{rank}", reason=None if i else hit.reason)
        add(hit.node.id, f"hit #{rank}", reason=hit.reason)
        for chunk_id, _ in hit.evidence:
            if chunk_id not in hit.leaves:
                add(chunk_id, f"evidence of #{rank}")
    for entry in seen.values():
        if len(entry["roles"]) > 1 and "path" in entry["roles"]:
            entry["roles"].remove("path")  # a hit that is also on a path: say it is a hit
    layers: dict[int, list[dict[str, Any]]] = {}
    for entry in seen.values():
        layers.setdefault(entry["layer"], []).append(entry)
    return [
        {"layer": layer, "nodes": sorted(layers[layer], key=lambda e: -e["score"])}
        for layer in sorted(layers, reverse=True)
    ]


def _print_explain(strategy: str, layers: list[dict[str, Any]]) -> None:
    print(f"search path ({strategy}), top layer first; score = cosine with the question:")
    for layer in layers:
        print(f"  layer {layer['layer']}:")
        for e in layer["nodes"]:
            via = f" <- {e['via']}" if e.get("via") else ""
            why = f" ({e['reason']})" if e.get("reason") else ""
            print(safe(f"    {e['id']}  {e['score']:.3f}  {', '.join(e['roles'])}{via}{why}"))


def run_query(args: argparse.Namespace) -> int:
    """Run ``raptor query`` with parsed ``args``; returns the exit status."""
    question = check_unicode(args.question, "the question")
    tree = _common.load_tree(args.tree)
    embedder = models.query_embedder(tree, args)
    retriever = make_retriever(args, tree, embedder)
    hits = retriever.retrieve(question)
    strategy = getattr(args, "strategy", DEFAULT_STRATEGY)
    path = explain(tree, hits, embedder.embed_query(question)) if args.explain else None
    if args.json:
        found = [hit_json(h) for h in hits]
        document: Any = found if path is None else {"hits": found, "explain": path}
        print(safe_json(document, indent=2))
        return 0
    if path is not None:
        _print_explain(strategy, path)
    if not hits:
        print("no results")
        return 0
    used = sum(h.node.token_count for h in hits)
    print(f"{len(hits)} nodes, {used} tokens")
    for hit in hits:
        where = (
            hit.node.doc_id if hit.node.layer == 0 else f"summary of {len(hit.node.doc_ids)} doc(s)"
        )
        # Node ids, document ids and texts come from the tree file: escape control characters.
        print(safe(f"\n[{hit.node.id} | layer {hit.node.layer} | score {hit.score:.3f} | {where}]"))
        print(safe(hit.node.text))
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``query`` on the ``raptor`` command's subparsers."""
    positive = int_range(1)
    query = sub.add_parser("query", help="retrieve context for a question")
    query.add_argument("tree", help="tree directory")
    query.add_argument("question")
    query.add_argument("--top-k", "-k", type=positive, default=10, help="max nodes (default 10)")
    query.add_argument(
        "--max-tokens", type=positive, default=2000, help="context budget (default 2000)"
    )
    query.add_argument(
        "--layers", default=None, help="comma-separated layers to search (collapsed)"
    )
    strategy = query.add_argument_group("retrieval strategy (see docs/retrieval.md)")
    add = strategy.add_argument
    add(
        "--strategy",
        choices=STRATEGIES,
        default=DEFAULT_STRATEGY,
        help=f"search strategy ({DEFAULT_STRATEGY})",
    )
    add("--start-layer", type=int_range(0), default=None, help="traversal/llm: first layer (top)")
    add("--num-layers", type=positive, default=None, help="traversal/llm: layers to descend")
    add("--threshold", type=finite_float, default=None, help="traversal: keep cosine >= this")
    add(
        "--top-k-per-layer",
        type=positive,
        default=None,
        help="traversal/llm/hybrid: nodes per step",
    )
    add("--chunk-k", type=positive, default=None, help="value/hybrid: chunks retrieved (20)")
    add("--min-score", type=finite_float, default=None, help="ignore nodes below this cosine")
    add("--window", type=int_range(0), default=None, help="passage: leaves added each side (2)")
    add("--rank-factor", type=finite_float, default=None, help="passage: neighbour rank depth (4)")
    add(
        "--max-share",
        type=finite_float,
        default=None,
        help="passage: share of the budget one seed may grow into (0.5)",
    )
    add("--llm-timeout", type=positive_float, default=None, help="llm/hybrid: seconds per LLM call")
    add("--search-timeout", type=positive_float, default=None, help="hybrid: seconds in all (60)")
    add("--llm", choices=["openai"], default=None, help="llm/hybrid: the chat model's API")
    add("--llm-model", default="gpt-4o-mini", help="llm/hybrid: chat model for --llm openai")
    add("--llm-base-url", default=None, help="OpenAI-compatible API root ($OPENAI_BASE_URL)")
    add("--timeout", type=positive_float, default=60.0, help="seconds per request (60)")
    embedding = query.add_argument_group("query embedding model (see docs/loading-trees.md)")
    embedding.add_argument(
        "--embedder",
        default=None,
        metavar="SPEC",
        help="the model the tree was built with: NAME_OR_PATH (sentence-transformers), "
        "openai:MODEL or onnx:DIR (a `raptor export-onnx` directory); default: the tree's model when it is a local sentence-transformers "
        "model by name",
    )
    embedding.add_argument(
        "--embed-model", default=None, help="sentence-transformers model (same as --embedder)"
    )
    embedding.add_argument(
        "--embed-base-url", default=None, help="API root for --embedder openai:... (--llm-base-url)"
    )
    embedding.add_argument(
        "--no-onnx",
        action="store_true",
        help="embed with sentence-transformers even when `raptor export-onnx` has exported "
        "the tree's model (the ONNX export gives the same vectors and starts faster)",
    )
    query.add_argument("--json", action="store_true", help="print hits as JSON")
    query.add_argument(
        "--explain",
        action="store_true",
        help="first print the nodes the search went through at each layer, with scores "
        '(with --json: {"hits": [...], "explain": [...]})',
    )
    query.set_defaults(func=run_query)
    return query
