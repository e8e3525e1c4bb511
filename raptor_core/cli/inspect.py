"""``raptor inspect``: a saved tree's shape and build parameters, or a page to browse it."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from raptor_core._argtypes import int_range
from raptor_core.cli import _common
from raptor_core.cli._common import check_unicode, path_text, safe, safe_json
from raptor_core.exceptions import InvalidParameterError

__all__ = ["add_parser", "layer_rows", "run_inspect"]


def layer_rows(tree: Any) -> list[dict[str, Any]]:
    """Per layer: node count, tokens, average children and compression against the layer below."""
    rows = []
    for layer in range(tree.num_layers):
        nodes = tree.layer(layer)
        tokens = sum(n.token_count for n in nodes)
        children = [len(n.children) for n in nodes] if layer else []
        below = sum(n.token_count for n in tree.layer(layer - 1)) if layer else 0
        rows.append(
            {
                "layer": layer,
                "nodes": len(nodes),
                "tokens": tokens,
                "avg_children": round(sum(children) / len(children), 2) if children else None,
                # Compression: tokens of the layer below per token of this layer.
                "compression": round(below / tokens, 2) if layer and tokens else None,
            }
        )
    return rows


#: Strategies ``--query`` can precompute: those that need no LLM.
HTML_STRATEGIES = ("collapsed", "traversal", "value", "mmr", "passage")


#: Documents listed by the plain-text ``raptor inspect``.
_DOCUMENTS_SHOWN = 50


def document_rows(tree: Any) -> list[dict[str, Any]]:
    """Each document of the tree: its id, number of leaves and leaf tokens, by id."""
    leaves: dict[str, list[int]] = {}
    for node in tree.nodes:
        if node.layer == 0 and node.doc_id is not None:
            counts = leaves.setdefault(node.doc_id, [0, 0])
            counts[0] += 1
            counts[1] += node.token_count
    return [
        {"doc_id": doc_id, "leaves": n, "tokens": tokens}
        for doc_id, (n, tokens) in sorted(leaves.items())
    ]


def _precompute(tree: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run each ``--query`` with the tree's embedding model; node ids per query."""
    if not args.query:
        return []
    from raptor_core.cli import models
    from raptor_core.retrieval.registry import make_retriever

    embedder = models.query_embedder(tree, args)
    retriever = make_retriever(args.strategy, tree, embedder, k=args.top_k)
    out = []
    for question in args.query:
        hits = retriever.retrieve(check_unicode(question, "--query"))
        ids: list[str] = []
        path: list[str] = []
        for hit in hits:
            # A passage is a span of leaves, not a stored node: highlight its leaves.
            ids.extend(hit.leaves or (hit.node.id,))
            path.extend(p for p in hit.path[:-1] if p not in path)
        out.append({"query": question, "strategy": args.strategy, "hits": ids, "path": path})
    return out


def _write_html(tree: Any, args: argparse.Namespace) -> None:
    from raptor_core.cli.tree_view import render_tree_html

    out = Path(args.html)
    if out.is_dir():
        msg = f"--html {path_text(out)} is a directory: give a file name such as tree.html"
        raise InvalidParameterError(msg)
    page = render_tree_html(
        tree,
        title=Path(args.tree).name or args.tree,
        layer_rows=layer_rows(tree),
        queries=_precompute(tree, args),
    )
    # Write beside the target and rename, so a failed write never leaves half a page.
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".raptor-", suffix=".html")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(page)
        # mkstemp makes the file private (0600); a page is an ordinary file (umask applies).
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run_inspect(args: argparse.Namespace) -> int:
    """Run ``raptor inspect`` with parsed ``args``; returns the exit status."""
    if args.query and not args.html:
        msg = "--query precomputes results for the --html page: add --html FILE"
        raise InvalidParameterError(msg)
    tree = _common.load_tree(args.tree)
    if args.html:
        _write_html(tree, args)
        print(safe(f"wrote {path_text(Path(args.html))}: open it in a browser"))
        return 0
    info = tree.build_info
    rows = layer_rows(tree)
    documents = document_rows(tree)
    if args.json:
        report = {"layers": rows, "documents": documents, "params": tree.params, "build_info": info}
        print(safe_json(report, indent=2))
        return 0
    print(
        safe(
            f"{args.tree}: {len(tree)} nodes, {tree.num_layers} layers, dim {tree.dim}, "
            f"{len(tree.doc_ids)} documents"
        )
    )
    print(f"{'layer':>5} {'nodes':>7} {'tokens':>9} {'avg children':>13} {'compression':>12}")
    for r in rows:
        avg = "-" if r["avg_children"] is None else f"{r['avg_children']:.2f}"
        comp = "-" if r["compression"] is None else f"{r['compression']:.2f}x"
        print(f"{r['layer']:>5} {r['nodes']:>7} {r['tokens']:>9} {avg:>13} {comp:>12}")
    print("build parameters:")
    for key, value in tree.params.items():
        shown = safe_json(value) if isinstance(value, dict | list) else value
        print(safe(f"  {key}: {shown}"))
    if info.get("stop_reason"):
        print(safe(f"stopped: {info['stop_reason']}"))
    # The ids `raptor remove` and `raptor update` take; a long list is cut (--json has all).
    print("documents (id: leaves, tokens):")
    for row in documents[:_DOCUMENTS_SHOWN]:
        print(safe(f"  {row['doc_id']}: {row['leaves']}, {row['tokens']}"))
    if len(documents) > _DOCUMENTS_SHOWN:
        print(f"  ... and {len(documents) - _DOCUMENTS_SHOWN} more (raptor inspect --json)")
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``inspect`` on the ``raptor`` command's subparsers."""
    inspect = sub.add_parser(
        "inspect", help="print a tree's shape and build parameters, or write a page to browse it"
    )
    inspect.add_argument("tree", help="tree directory")
    inspect.add_argument("--json", action="store_true", help="print as JSON")
    page = inspect.add_argument_group("browsable page (see docs/cli.md)")
    page.add_argument(
        "--html",
        metavar="FILE",
        default=None,
        help="write one self-contained HTML page showing the whole tree, with a search box",
    )
    page.add_argument(
        "--query",
        action="append",
        metavar="TEXT",
        help="precompute what this query retrieves and offer it in the page (repeatable; "
        "runs the tree's embedding model)",
    )
    page.add_argument(
        "--strategy",
        choices=HTML_STRATEGIES,
        default="collapsed",
        help="strategy for --query (default collapsed)",
    )
    page.add_argument(
        "--top-k", "-k", type=int_range(1), default=10, help="hits per --query (default 10)"
    )
    page.add_argument(
        "--embedder",
        default=None,
        metavar="SPEC",
        help="for --query: the model the tree was built with (see raptor query --embedder)",
    )
    page.add_argument("--embed-base-url", default=None, help="API root for --embedder openai:...")
    inspect.set_defaults(embed_model=None, llm_base_url=None, timeout=60.0)
    inspect.set_defaults(func=run_inspect)
    return inspect
