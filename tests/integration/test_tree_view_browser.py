"""The ``raptor inspect --html`` page in a real headless Chromium: its DOM after the script ran.

``make test`` installs Chromium first when it can (scripts/ensure-chromium.sh); without it
this test skips and says so.  The tree is built with the fakes, and the installed ``raptor``
command writes the page in a subprocess (the fake embedder is re-created from the tree's
record, so ``--query`` runs a real retrieval without loading a model).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from warm_python import raptor

from raptor_core.build.builder import TreeBuilder
from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer
from raptor_core.tree import Tree

pytestmark = pytest.mark.integration

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no Chromium on PATH: run scripts/ensure-chromium.sh (apt-get install chromium)",
)


def chromium(url: str, profile: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",  # root in CI containers cannot use the sandbox
            "--disable-gpu",
            f"--user-data-dir={profile}",
            "--no-first-run",
            *flags,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "HOME": str(profile)},
    )


class Nodes(HTMLParser):
    """The .node articles of a dumped DOM: element id -> (classes, rank badge text)."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: dict[str, list[str]] = {}
        self.ranks: dict[str, str] = {}
        self.current: str | None = None
        self.in_rank = False
        self.ready = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "body" and a.get("data-ready") == "true":
            self.ready = True
        classes = (a.get("class") or "").split()
        if tag == "article" and "node" in classes:
            self.current = a["id"] or ""
            self.nodes[self.current] = classes
        if tag == "span" and "rank" in classes:
            self.in_rank = True

    def handle_data(self, data: str) -> None:
        if self.in_rank and self.current:
            self.ranks[self.current] = data
            self.in_rank = False


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Tree]:
    root = tmp_path_factory.mktemp("view")
    builder = TreeBuilder(
        FakeEmbedder(16), EchoSummarizer(), tokenizer=WhitespaceTokenizer(), random_state=0
    )
    tree = builder.build(
        [
            {"doc_id": "cats", "text": "Cats purr and sleep in the sun. " * 30},
            {"doc_id": "rockets", "text": "Rockets burn fuel to reach orbit. " * 30},
            {"doc_id": "bread", "text": "Bakers knead dough and bake bread. " * 30},
            # Markup in a document is text: the page must show it, never run it.
            {"doc_id": "markup", "text": "Markup <img src=x onerror=alert(1)> is text. " * 30},
        ]
    )
    tree.save(root / "tree")
    out = root / "tree.html"
    proc = raptor("inspect", str(root / "tree"), "--html", str(out), "--query", "rockets orbit")
    assert proc.returncode == 0, proc.stderr
    return out, Tree.load(root / "tree")


@needs_chromium
def test_page_in_headless_chromium(page: tuple[Path, Tree], tmp_path: Path) -> None:
    out, tree = page
    url = out.as_uri()

    proc = chromium(url, tmp_path / "p1", "--dump-dom")
    dom = Nodes()
    dom.feed(proc.stdout)
    assert dom.ready, proc.stderr[-2000:]  # the script ran to its end
    assert len(dom.nodes) == len(tree)
    assert not any("hit" in c or "dim" in c for c in dom.nodes.values())

    # Lexical search from the address: nodes holding "bread" are highlighted, ranked.
    proc = chromium(url + "#q=bread", tmp_path / "p2", "--dump-dom")
    dom = Nodes()
    dom.feed(proc.stdout)
    hits = {i for i, c in dom.nodes.items() if "hit" in c}
    with_bread = {f"n{row}" for row, n in enumerate(tree.nodes) if "bread" in n.text.lower()}
    assert hits and hits <= with_bread and len(hits) == min(10, len(with_bread))
    assert {dom.ranks[i] for i in hits} == {f"#{r}" for r in range(1, len(hits) + 1)}
    assert all("dim" in c for i, c in dom.nodes.items() if i not in hits)
    assert "<mark>bread</mark>" in proc.stdout.lower()
    assert re.search(r'id="status"[^>]*>words "bread": \d+ node\(s\) highlighted', proc.stdout)

    # The precomputed query replays the retrieval that `--query` ran.
    proc = chromium(url + "#preset=0", tmp_path / "p3", "--dump-dom")
    dom = Nodes()
    dom.feed(proc.stdout)
    hits = [i for i, c in dom.nodes.items() if "hit" in c]
    assert hits and 'collapsed retrieval for "rockets orbit"' in proc.stdout
    top = min(hits, key=lambda i: int(dom.ranks[i].lstrip("#")))
    assert "rocket" in tree.nodes[int(top[1:])].text.lower()

    # Searching highlights inside text holding markup without turning it into elements.
    proc = chromium(url + "#q=img", tmp_path / "p5", "--dump-dom")
    assert "<mark>img</mark>" in proc.stdout and "&lt;<mark>img</mark> src=x" in proc.stdout
    assert "<img" not in proc.stdout

    shot = tmp_path / "shot.png"
    proc = chromium(
        url + "#q=rockets", tmp_path / "p4", f"--screenshot={shot}", "--window-size=1200,800"
    )
    assert shot.is_file(), proc.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000
