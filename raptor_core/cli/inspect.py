"""``raptor inspect``: a saved tree's shape and build parameters."""

from __future__ import annotations

import argparse
from typing import Any

from raptor_core.cli import _common
from raptor_core.cli._common import safe, safe_json

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


def run_inspect(args: argparse.Namespace) -> int:
    """Run ``raptor inspect`` with parsed ``args``; returns the exit status."""
    tree = _common.load_tree(args.tree)
    info = tree.build_info
    rows = layer_rows(tree)
    if args.json:
        print(safe_json({"layers": rows, "params": tree.params, "build_info": info}, indent=2))
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
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``inspect`` on the ``raptor`` command's subparsers."""
    inspect = sub.add_parser("inspect", help="print a tree's shape and build parameters")
    inspect.add_argument("tree", help="tree directory")
    inspect.add_argument("--json", action="store_true", help="print as JSON")
    inspect.set_defaults(func=run_inspect)
    return inspect
