"""``raptor inspect --html`` (the page's content and safety) and ``raptor query --explain``.

The page is checked in a real browser in tests/integration/test_tree_view_browser.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from raptor_core.cli import main
from raptor_core.cli.inspect import layer_rows
from raptor_core.cli.query import explain
from raptor_core.cli.tree_view import render_tree_html
from raptor_core.retrieval.traversal import TreeTraversalRetriever
from raptor_core.retrieval.value import ValueBasedRetriever
from raptor_core.testing import FakeEmbedder, tiny_tree
from raptor_core.tree import Node, Tree

HOSTILE = "</script><script>alert(1)</script><img src=x onerror=alert(2)> & ' \""


def hostile_tree() -> Tree:
    base = tiny_tree(dim=16)
    nodes = tuple(
        Node(
            id=n.id if n.id != "L0.2" else "L0.2'<b>",
            text=n.text if n.id != "L0.2" else HOSTILE,
            layer=n.layer,
            token_count=n.token_count,
            children=tuple(c if c != "L0.2" else "L0.2'<b>" for c in n.children),
            doc_id=n.doc_id,
            span=n.span,
            doc_ids=n.doc_ids,
        )
        for n in base.nodes
    )
    return Tree(nodes=nodes, embeddings=base.embeddings, params=base.params)


def page_data(page: str) -> dict[str, Any]:
    match = re.search(r"<script type='application/json' id='tree-data'>(.*?)</script>", page)
    assert match is not None
    return dict(json.loads(match.group(1)))


def test_page_shows_layers_clusters_children_and_documents() -> None:
    tree = tiny_tree(dim=16)
    query = {"query": "cats", "strategy": "traversal", "hits": ["L0.0"], "path": ["L1.0", "L0.0"]}
    page = render_tree_html(tree, title="t", layer_rows=layer_rows(tree), queries=[query])
    assert page.count("<article class='node'") == len(tree)
    # Top layer first, each with its cluster sizes.
    assert page.index("id='layer-1'") < page.index("id='layer-0'")
    assert "Layer 1: 2 summaries; cluster sizes 2–2, median 2" in page
    card = page[page.index("data-id='L1.0'") :].split("</article>")[0]
    assert "cluster of 2" in card and "source documents (1): d1" in card
    assert "<a href='#n0'>L0.0</a>: Cats purr and sleep most of the day." in card
    leaf = page[page.index("data-id='L0.0'") :].split("</article>")[0]
    assert "document: d1 [0:36]" in leaf and "summarised in: <a href='#n4'>L1.0</a>" in leaf
    # Precomputed queries name nodes by their row; the path leaves out the hits themselves.
    assert page_data(page) == {
        "queries": [{"query": "cats", "strategy": "traversal", "hits": [0], "path": [4]}]
    }
    assert "<option value='0'>traversal: cats</option>" in page


def test_page_is_self_contained_and_escapes_tree_text() -> None:
    tree = hostile_tree()
    queries = [{"query": HOSTILE, "strategy": "collapsed", "hits": ["L0.2'<b>"], "path": []}]
    page = render_tree_html(tree, title="<t>", layer_rows=layer_rows(tree), queries=queries)
    # One </script> per script element: no text from the tree closes one.
    assert page.count("</script>") == 2
    assert "<img" not in page and "<b>" not in page and "<t>" not in page
    assert "&lt;/script&gt;&lt;script&gt;alert(1)" in page
    assert page_data(page)["queries"][0]["query"] == HOSTILE  # JSON-escaped, still intact
    # Nothing is fetched: no URL, no external resource (checked on a page of plain text).
    tree = tiny_tree(dim=16)
    clean = render_tree_html(tree, title="t", layer_rows=layer_rows(tree))
    assert not re.search(r"(?i)(https?:|src=|<link|@import|url\()", clean)
    assert "default-src 'none'" in clean


def test_explain_lists_each_layer_with_scores() -> None:
    tree = tiny_tree(dim=16)
    embedder = FakeEmbedder(16)
    question = "rockets orbit"
    hits = TreeTraversalRetriever(tree, embedder, top_k=1).retrieve(question)
    vector = embedder.embed_query(question)
    layers = explain(tree, hits, vector)
    assert [x["layer"] for x in layers] == [1, 0]
    [top], [leaf] = layers[0]["nodes"], layers[1]["nodes"]
    assert top["roles"] == ["hit #1"] and leaf["roles"] == ["hit #2"]
    assert leaf["via"] == top["id"] and "rank 1" in leaf["reason"]
    unit = vector / np.linalg.norm(vector)
    expected = float(tree.embeddings[tree.row(leaf["id"])] @ unit)
    assert leaf["score"] == pytest.approx(expected, abs=1e-4)

    hits = ValueBasedRetriever(tree, embedder, k=1, include="summaries").retrieve(question)
    layers = explain(tree, hits, vector)
    roles = {n["id"]: n["roles"] for layer in layers for n in layer["nodes"]}
    assert roles[hits[0].id] == ["hit #1"]
    assert {i for i, r in roles.items() if r == ["evidence of #1"]} == {
        chunk for chunk, _ in hits[0].evidence
    }


def test_query_explain_and_inspect_html_in_process(tmp_path: Path, capsys: Any) -> None:
    tiny_tree(dim=16).save(tmp_path / "tree")
    tree = str(tmp_path / "tree")
    args = ["query", tree, "rockets orbit", "--strategy", "traversal", "--top-k-per-layer", "1"]
    assert main([*args, "--explain"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("search path (traversal), top layer first")
    assert re.search(
        r"layer 1:\n    L1\.1  0\.\d{3}  hit #1 \(rank 1.*\n  layer 0:\n    L0\.2  0\.\d{3}  hit #2 <- L1\.1 ",
        out,
    )
    assert main([*args, "--explain", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert set(document) == {"hits", "explain"}
    assert [x["layer"] for x in document["explain"]] == [1, 0]

    page = tmp_path / "out" / "tree.html"
    assert main(["inspect", tree, "--html", str(page), "--query", "cats", "-k", "2"]) == 0
    assert capsys.readouterr().out == f"wrote {page}: open it in a browser\n"
    [preset] = page_data(page.read_text())["queries"]
    assert preset["strategy"] == "collapsed" and len(preset["hits"]) == 2
    assert page.stat().st_mode & 0o044  # an ordinary file, not mkstemp's private 0600
    assert main(["inspect", tree, "--query", "cats"]) == 2
    assert "--query precomputes results for the --html page" in capsys.readouterr().err
