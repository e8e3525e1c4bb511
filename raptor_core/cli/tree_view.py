"""``raptor inspect --html``: one self-contained HTML page to browse a tree.

The page is rendered here, in Python, so it reads without JavaScript: a table of the layers,
then every node of every layer, top layer first, with its cluster (children), the documents
it covers and links up and down the tree.  A small inline script adds the search box, which
does *lexical* matching in the browser (no model runs there: the words of the query are
looked up in each node's text and the best-matching nodes are highlighted), and a menu of
queries whose real retrieval results were computed by ``raptor inspect --query`` with the
tree's embedding model, so what the retriever returns can be seen on the tree.

Everything from the tree file is data: it is HTML-escaped, and the data handed to the script
is JSON with ``<``, ``>`` and ``&`` escaped, so no text can close a tag or run code.  The page
loads nothing from the network (inline CSS and JS, no fonts, no images).
"""

from __future__ import annotations

import html
import json
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["render_tree_html"]

_PREVIEW = 90  # characters of a child's text shown in its parent's cluster list


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _script_json(data: Any) -> str:
    # Inside <script> only "</" can end the element; escaping < > & covers it and "<!--".
    text = json.dumps(data, ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _preview(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _PREVIEW else flat[: _PREVIEW - 1] + "…"


_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{position:sticky;top:0;background:#fff;border-bottom:1px solid #d8dce3;padding:10px 18px;z-index:2}
h1{font-size:18px;margin:0 0 4px} h2{font-size:16px;margin:22px 0 8px}
main{padding:0 18px 40px} .muted{color:#667085}
#search{display:flex;gap:8px;flex-wrap:wrap;margin-top:6px}
#q{flex:1;min-width:220px;padding:5px 8px;font:inherit} select{font:inherit}
table{border-collapse:collapse;background:#fff} td,th{border:1px solid #d8dce3;padding:3px 8px;text-align:right}
.nodes{display:grid;grid-template-columns:repeat(auto-fill,minmax(320px,1fr));gap:10px}
.node{background:#fff;border:1px solid #d8dce3;border-radius:6px;padding:8px 10px}
.node h3{font-size:13px;margin:0 0 4px;font-weight:600} .node p.text{margin:4px 0;white-space:pre-wrap}
.node.hit{border:2px solid #d9480f;background:#fff4e6} .node.on-path{border:2px dashed #d9480f}
.node.dim{opacity:.35} .rank{background:#d9480f;color:#fff;border-radius:9px;padding:0 7px;margin-right:6px}
mark{background:#ffe066} .meta{font-size:12px;color:#667085} details{font-size:12px}
a{color:#1c5fd1;text-decoration:none} a:hover{text-decoration:underline}
"""

# The search box: each query word (three letters or more, a few common words left out) is
# matched case-insensitively at the start of a word of each node's text; nodes are ranked by the summed inverse document frequency of the words
# they contain, the best `k` highlighted.  A preset replays precomputed retrieval results.
_JS = r"""
(function(){
const data = JSON.parse(document.getElementById('tree-data').textContent);
const nodes = Array.from(document.querySelectorAll('.node'));
const pos = {}; nodes.forEach((n, i) => {pos[n.id.slice(1)] = i;});  // tree row -> element
const texts = nodes.map(n => n.querySelector('p.text'));
const originals = texts.map(t => t.textContent);
const lower = originals.map(t => t.toLowerCase());
const status = document.getElementById('status');
const box = document.getElementById('q'), preset = document.getElementById('preset');
const K = 10;
function esc(s){return s.replace(/[&<>"']/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;',"'":'&#39;'}[c]));}
const STOP = new Set(['the','and','for','are','was','were','how','what','who','why','when','where','which','does','did','with','that','this','from','into','have','has','not','you','your','its','can']);
function words(q){return Array.from(new Set(q.toLowerCase().match(/[\p{L}\p{N}]+/gu) || [])).filter(w => w.length > 2 && !STOP.has(w));}
function quote(w){return w.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');}
// A word matches at the start of a word of the text ("bee" finds "bees", not "frisbee").
function finder(w){return new RegExp('(?<![\\p{L}\\p{N}])' + quote(w), 'iu');}
function reset(){
  nodes.forEach((n, i) => {
    n.classList.remove('hit', 'on-path', 'dim');
    const r = n.querySelector('.rank'); if (r) r.remove();
    texts[i].textContent = originals[i];
  });
}
function mark(i, ws){
  if (!ws.length) return;
  const re = new RegExp('(?<![\\p{L}\\p{N}])(' + ws.map(quote).join('|') + ')', 'giu');
  // Match on the raw text and escape every piece: the text never becomes markup.
  const text = originals[i];
  let out = '', last = 0;
  for (const m of text.matchAll(re)) {
    out += esc(text.slice(last, m.index)) + '<mark>' + esc(m[0]) + '</mark>';
    last = m.index + m[0].length;
  }
  texts[i].innerHTML = out + esc(text.slice(last));
}
function show(ranked, path, label, ws, scroll){
  reset();
  if (!ranked.length){status.textContent = label + ': no node matches'; return;}
  nodes.forEach(n => n.classList.add('dim'));
  path.forEach(i => {nodes[i].classList.remove('dim'); nodes[i].classList.add('on-path');});
  ranked.forEach((i, r) => {
    const n = nodes[i]; n.classList.remove('dim', 'on-path'); n.classList.add('hit');
    const s = document.createElement('span'); s.className = 'rank'; s.textContent = '#' + (r + 1);
    n.querySelector('h3').prepend(s); mark(i, ws);
  });
  status.textContent = label + ': ' + ranked.length + ' node(s) highlighted' + (path.length ? ', dashed: the path that led to them' : '');
  if (scroll) nodes[ranked[0]].scrollIntoView({block: 'center'});
}
function lexical(q, scroll){
  const ws = words(q);
  if (!ws.length){reset(); status.textContent = ''; return;}
  const found = ws.map(w => {const re = finder(w); return lower.map(t => re.test(t));});
  const df = found.map(f => f.filter(Boolean).length);
  const scored = [];
  lower.forEach((t, i) => {
    let s = 0;
    ws.forEach((w, j) => {if (found[j][i]) s += Math.log(1 + nodes.length / df[j]);});
    if (s > 0) scored.push([s, i]);
  });
  scored.sort((a, b) => b[0] - a[0] || a[1] - b[1]);
  show(scored.slice(0, K).map(x => x[1]), [], 'words "' + ws.join(' ') + '"', ws, scroll);
}
function replay(idx, scroll){
  const p = data.queries[idx];
  show(p.hits.map(r => pos[r]), p.path.map(r => pos[r]), p.strategy + ' retrieval for "' + p.query + '"', words(p.query), scroll);
}
box.addEventListener('input', () => {preset.value = ''; lexical(box.value, true);});
preset.addEventListener('change', () => {box.value = ''; if (preset.value === '') {reset(); status.textContent = '';} else replay(+preset.value, true);});
// #q=words or #preset=N in the address opens the page with that search (used by the tests).
const hash = new URLSearchParams(location.hash.slice(1));
if (hash.has('q')) {box.value = hash.get('q'); lexical(box.value);}
else if (hash.has('preset') && data.queries[+hash.get('preset')]) {preset.value = hash.get('preset'); replay(+hash.get('preset'));}
document.body.dataset.ready = 'true';
})();
"""


def _layer_table(rows: Sequence[Mapping[str, Any]]) -> str:
    head = "<tr><th>layer</th><th>nodes</th><th>tokens</th><th>avg cluster size</th><th>compression</th></tr>"
    body = "".join(
        "<tr>"
        f"<td><a href='#layer-{r['layer']}'>{r['layer']}</a></td><td>{r['nodes']}</td>"
        f"<td>{r['tokens']}</td>"
        f"<td>{'-' if r['avg_children'] is None else r['avg_children']}</td>"
        f"<td>{'-' if r['compression'] is None else str(r['compression']) + 'x'}</td>"
        "</tr>"
        for r in rows
    )
    return f"<table id='layers'>{head}{body}</table>"


def render_tree_html(
    tree: Any,
    *,
    title: str,
    layer_rows: Sequence[Mapping[str, Any]],
    queries: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The whole page for ``tree``.

    Args:
        tree: a :class:`~raptor_core.tree.Tree`.
        title: shown as the page title (the tree's directory).
        layer_rows: per-layer statistics (see ``raptor_core.cli.inspect.layer_rows``).
        queries: precomputed retrievals, each ``{"query", "strategy", "hits": [node ids,
            best first], "path": [node ids that led to them]}``.
    """
    index = {node.id: i for i, node in enumerate(tree.nodes)}
    # Nodes are named by their row in the tree (element id "n<row>"): ids from a file may
    # hold any character, rows are plain numbers.
    presets = [
        {
            "query": q["query"],
            "strategy": q["strategy"],
            "hits": [index[h] for h in q["hits"] if h in index],
            "path": [index[p] for p in q["path"] if p in index and p not in q["hits"]],
        }
        for q in queries
    ]
    sections = []
    for layer in reversed(range(tree.num_layers)):
        layer_nodes = tree.layer(layer)
        sizes = [len(n.children) for n in layer_nodes]
        cluster = (
            f"; cluster sizes {min(sizes)}–{max(sizes)}, median {statistics.median(sizes):g}"
            if layer and sizes
            else ""
        )
        name = "leaves (document chunks)" if layer == 0 else "summaries"
        cards = "".join(_node_card(tree, node, index) for node in layer_nodes)
        sections.append(
            f"<section class='layer' id='layer-{layer}' data-layer='{layer}'>"
            f"<h2>Layer {layer}: {len(layer_nodes)} {name}{cluster}</h2>"
            f"<div class='nodes'>{cards}</div></section>"
        )
    options = "".join(
        f"<option value='{i}'>{_e(q['strategy'])}: {_e(q['query'])}</option>"
        for i, q in enumerate(queries)
    )
    menu = (
        f"<select id='preset' title='retrieval results computed by raptor inspect --query'>"
        f"<option value=''>precomputed queries ({len(queries)})</option>{options}</select>"
    )
    summary = (
        f"{len(tree)} nodes, {tree.num_layers} layers, {len(tree.doc_ids)} documents, "
        f"embedding dimension {tree.dim}"
    )
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        # No network: a policy that lets the page's own inline style and script run only.
        "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; "
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'\">"
        f"<title>RAPTOR tree: {_e(title)}</title><style>{_CSS}</style></head><body>"
        f"<header><h1>RAPTOR tree: {_e(title)}</h1><div class='muted'>{_e(summary)}</div>"
        "<div id='search'><input id='q' type='search' placeholder='search words in the "
        f"node texts (lexical, in the page)' aria-label='search'>{menu}</div>"
        "<div id='status' class='muted' role='status'></div></header><main>"
        f"<h2>Layers</h2>{_layer_table(layer_rows)}{''.join(sections)}</main>"
        f"<script type='application/json' id='tree-data'>{_script_json({'queries': presets})}"
        f"</script><script>{_JS}</script></body></html>"
    )


def _node_card(tree: Any, node: Any, index: Mapping[str, int]) -> str:
    row = index[node.id]
    parts = [
        f"<article class='node' id='n{row}' data-id='{_e(node.id)}' data-layer='{node.layer}'>",
        f"<h3>{_e(node.id)} <span class='meta'>layer {node.layer} · {node.token_count} tokens"
        + (f" · cluster of {len(node.children)}" if node.children else "")
        + "</span></h3>",
        f"<p class='text'>{_e(node.text)}</p>",
    ]
    if node.layer == 0:
        span = f" [{node.span[0]}:{node.span[1]}]" if node.span else ""
        parts.append(f"<div class='meta docs'>document: {_e(node.doc_id)}{_e(span)}</div>")
    else:
        docs = ", ".join(_e(d) for d in node.doc_ids)
        parts.append(f"<div class='meta docs'>source documents ({len(node.doc_ids)}): {docs}</div>")
        items = "".join(
            f"<li><a href='#n{index[c]}'>{_e(c)}</a>: {_e(_preview(tree.node(c).text))}</li>"
            for c in node.children
            if c in index
        )
        parts.append(
            f"<details class='children'><summary>{len(node.children)} children</summary>"
            f"<ul>{items}</ul></details>"
        )
    if node.parents:
        ups = ", ".join(f"<a href='#n{index[p]}'>{_e(p)}</a>" for p in node.parents if p in index)
        parts.append(f"<div class='meta'>summarised in: {ups}</div>")
    parts.append("</article>")
    return "".join(parts)
