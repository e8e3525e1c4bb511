"""``raptor build`` over real PDF, HTML, Markdown, CSV, JSONL and DOCX files, as a user runs it.

Everything goes through the ``raptor`` command with the packaged embedding model: its console
entry point, in a process forked from the session's warm interpreter (tests/warm_python.py),
or a fresh interpreter where the test is about one.  The tree it saves is then read back to
check what was indexed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from input_files import HTML, make_docx, make_pdf
from warm_python import raptor

from raptor_core.tree import Tree

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_build_reads_every_type_and_reports_skips(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    (docs / "drafts").mkdir(parents=True)
    make_pdf(docs / "volcano.pdf", [["Volcanoes erupt molten lava and ash."], ["Magma cools."]])
    make_docx(docs / "otters.docx")
    (docs / "bees.html").write_text(HTML)
    (docs / "apples.md").write_text("# Apples\nApples grow on trees in orchards.")
    (docs / "faq.csv").write_text(
        "doc_id,body,source\nq1,Tides follow the pull of the moon.,almanac\n"
    )
    (docs / "notes.jsonl").write_text(
        json.dumps({"doc_id": "n1", "body": "Glaciers carve valleys.", "source": "crm"}) + "\n"
    )
    (docs / "photo.jpg").write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00")
    (docs / "blob.txt").write_bytes(b"\x00\x00binary")
    (docs / "drafts" / "old.md").write_text("Draft text that must not be indexed.")

    proc = raptor(
        "build", "docs", "--out", "tree", "--exclude", "drafts/*", "--max-layers", "1",
        "--text-field", "body", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # Each skipped file on one line with why, then a count; nothing else (no warnings).
    assert proc.stderr.splitlines() == [
        "raptor build: skipped docs/blob.txt: is a binary file, not text",
        "raptor build: skipped docs/photo.jpg: unsupported file type '.jpg'",
        "raptor build: skipped 2 file(s), read 6 document(s)",
    ]
    tree = Tree.load(tmp_path / "tree")
    assert set(tree.doc_ids) == {
        "docs/apples.md", "docs/bees.html", "docs/otters.docx", "docs/volcano.pdf", "q1", "n1",
    }  # fmt: skip
    leaves = {leaf.doc_id: leaf for leaf in tree.leaves}
    assert "Volcanoes erupt molten lava" in leaves["docs/volcano.pdf"].text
    assert not any("%PDF" in leaf.text or "PK\x03\x04" in leaf.text for leaf in tree.leaves)
    assert (
        "# Bees" in leaves["docs/bees.html"].text and "secret" not in leaves["docs/bees.html"].text
    )
    assert "# Otters" in leaves["docs/otters.docx"].text
    assert leaves["n1"].metadata["source"] == "crm"  # the user's field, not our path
    assert leaves["n1"].metadata["source_file"] == "docs/notes.jsonl"
    assert leaves["q1"].metadata["source"] == "almanac"

    proc = raptor("query", "tree", "Which animals hold hands?", "-k", "1", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)[0]["doc_id"] == "docs/otters.docx"


def test_build_onto_a_tree_needs_overwrite_and_bad_fields_are_named(tmp_path: Path) -> None:
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "tree.json").write_text("{}")
    (tmp_path / "a.csv").write_text("title,body\nx,Some text.\n")
    proc = raptor("build", "a.csv", "--out", "tree", cwd=tmp_path)
    assert proc.returncode == 2 and "--overwrite" in proc.stderr
    proc = raptor("build", "a.csv", "--out", "out", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "raptor build: error: a.csv has no 'text' column (columns: title, body): "
        "pass --text-field NAME to say which column holds the text"
    )
    proc = raptor(
        "build", "a.csv", "--out", "out", "--dry-run", "--text-field", "body", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("dry run: 1 documents")


# What a bare `pip install raptor-retriever` lacks: the extras' packages.
BARE = """
import sys
for name in ("llama_index", "langchain_core", "langchain", "openai", "chromadb", "matplotlib",
             "bm25s", "pypdf", "docx"):
    sys.modules[name] = None  # importing it now fails, as when it is not installed
from raptor_core.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_quickstart_on_a_bare_install_prints_nothing_on_stderr(tmp_path: Path) -> None:
    """The quickstart's build and query: no tokenizer or model-loading noise, no warning."""
    doc = Path(__file__).resolve().parents[1] / "data" / "multi_topic.md"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("TOKENIZERS_PARALLELISM", None)  # the CLI sets what it needs itself
    args = [sys.executable, "-c", BARE]
    build = [*args, "build", str(doc), "--out", str(tmp_path / "tree"), "--max-layers", "1"]
    proc = subprocess.run(build, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.startswith(f"built {tmp_path / 'tree'}: 1 documents")
    query = [*args, "query", str(tmp_path / "tree"), "What is the topic?", "--max-tokens", "200"]
    proc = subprocess.run(query, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


# main() called by a script that imported transformers first (the variable that silences its
# bars is read at import, so main() setting it comes too late).
AFTER_TRANSFORMERS = """
import sys
from transformers.utils import logging
assert logging.is_progress_bar_enabled()
from raptor_core.cli import main
status = main(sys.argv[1:])
print(status, logging.is_progress_bar_enabled())
"""


def test_main_draws_no_model_loading_bar_after_transformers_was_imported(tmp_path: Path) -> None:
    doc = Path(__file__).resolve().parents[1] / "data" / "multi_topic.md"
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    build = ["build", str(doc), "--out", str(tmp_path / "tree"), "--max-layers", "0", "--quiet"]
    proc = subprocess.run(
        [sys.executable, "-c", AFTER_TRANSFORMERS, *build],
        capture_output=True, text=True, env={**env, "HF_HUB_OFFLINE": "1"}, timeout=300,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no "Loading weights" bar
    assert proc.stdout == "0 True\n"  # built, and the caller's setting is back


def test_no_section_context_embeds_leaves_by_their_text_alone(tmp_path: Path) -> None:
    body = " ".join(
        f"Sentence {i} says something about the colony and its queen." for i in range(30)
    )
    (tmp_path / "bees.md").write_text(f"# Bees\n\n## Swarming\n{body}\n")
    for name, flags in (("with", []), ("without", ["--no-section-context"])):
        proc = raptor("build", "bees.md", "--out", name, "--max-layers", "0", *flags, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    with_, without = Tree.load(tmp_path / "with"), Tree.load(tmp_path / "without")
    assert (with_.params["section_context"], without.params["section_context"]) == (True, False)
    assert [leaf.id for leaf in with_.leaves] == [leaf.id for leaf in without.leaves]
    # Leaves after the first (which holds the headings) are under "Swarming": their vectors differ.
    rows = with_.layer_rows(0)[1:]
    assert len(rows) >= 2
    assert not np.allclose(with_.embeddings[rows], without.embeddings[rows], atol=1e-4)
    assert np.allclose(with_.embeddings[0], without.embeddings[0], atol=1e-5)
