"""``raptor add``, ``raptor update`` and ``raptor remove`` through the installed command.

The trees are built with the fakes (FakeEmbedder is re-created from the tree's record), so
no model is loaded and each command runs in a real process in about a second.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from warm_python import raptor

from raptor_core.build.builder import TreeBuilder
from raptor_core.testing import EchoSummarizer, FakeEmbedder, GroupClusterer, check_tree_invariants
from raptor_core.tree import Tree

TOPICS = {
    "cats.txt": "Cats purr in the sun. Kittens chase string. A cat sleeps all day. Felines hunt mice.",
    "rockets.txt": "Rockets burn fuel. Boosters lift satellites. Orbit needs speed. Engines roar at launch.",
    "bread.txt": "Bread needs flour. Yeast makes dough rise. Ovens bake the loaf. Crust turns brown.",
}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return raptor(*args, timeout=120)


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path]:
    """A saved tree over cats and rockets, and a folder with all three files."""
    files = tmp_path / "docs"
    files.mkdir()
    for name, text in TOPICS.items():
        (files / name).write_text(text, encoding="utf-8")
    docs = [
        {"doc_id": str(files / n), "text": TOPICS[n], "metadata": {"source": str(files / n)}}
        for n in ("cats.txt", "rockets.txt")
    ]
    builder = TreeBuilder(
        FakeEmbedder(16), EchoSummarizer(), clusterer=GroupClusterer(2), chunk_max_tokens=8
    )
    tree_dir = tmp_path / "tree"
    builder.build(docs).save(tree_dir)
    return tree_dir, files


def test_add_update_remove_round_trip(setup: tuple[Path, Path]) -> None:
    tree_dir, files = setup
    before = Tree.load(tree_dir)
    assert before.num_layers >= 2

    added = run("add", str(tree_dir), str(files / "bread.txt"), "--no-progress")
    assert added.returncode == 0, added.stderr
    assert "1 added" in added.stdout and "summaries" in added.stdout
    grown = Tree.load(tree_dir)
    check_tree_invariants(grown, extractive=True)
    assert grown.doc_ids == (*before.doc_ids, str(files / "bread.txt"))
    for node in before.leaves:
        assert np.array_equal(
            before.embeddings[before.row(node.id)], grown.embeddings[grown.row(node.id)]
        )

    saved = (tree_dir / "tree.json").read_bytes()
    same = run("update", str(tree_dir), str(files / "bread.txt"), "--no-progress")
    assert same.returncode == 0, same.stderr
    assert "1 unchanged" in same.stdout and "nothing changed" in same.stdout
    assert (tree_dir / "tree.json").read_bytes() == saved

    (files / "bread.txt").write_text("Sourdough needs a starter. It ferments slowly.", "utf-8")
    changed = run("update", str(tree_dir), str(files / "bread.txt"), "--no-progress")
    assert changed.returncode == 0, changed.stderr
    assert "1 replaced" in changed.stdout
    replaced = Tree.load(tree_dir)
    assert any("Sourdough" in n.text for n in replaced.leaves)
    assert not any("Yeast" in n.text for n in replaced.nodes)

    removed = run("remove", str(tree_dir), str(files / "bread.txt"), "--no-progress")
    assert removed.returncode == 0, removed.stderr
    assert "1 removed" in removed.stdout
    shrunk = Tree.load(tree_dir)
    check_tree_invariants(shrunk, extractive=True)
    assert shrunk.doc_ids == before.doc_ids
    assert not any("Sourdough" in n.text for n in shrunk.nodes)


@pytest.mark.parametrize(
    ("command", "target", "message"),
    [
        ("add", "cats.txt", "raptor update"),
        ("remove", "no-such-doc", "unknown document id"),
        ("add", "binary.bin", "binary"),
    ],
)
def test_mistakes_are_one_line_and_leave_the_tree(
    setup: tuple[Path, Path], command: str, target: str, message: str
) -> None:
    tree_dir, files = setup
    (files / "binary.bin").write_bytes(b"\x00\x01\x02binary\xff" * 20)
    saved = (tree_dir / "tree.json").read_bytes()
    arg = target if command == "remove" else str(files / target)
    proc = run(command, str(tree_dir), arg, "--no-progress")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"raptor {command}: error:"), proc.stderr
    assert message in lines[0]
    assert "Traceback" not in proc.stderr
    assert (tree_dir / "tree.json").read_bytes() == saved


def test_a_directory_without_a_tree_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("Some text here.", "utf-8")
    proc = run("add", str(tmp_path / "nothing"), str(tmp_path / "a.txt"))
    assert proc.returncode == 2
    assert "holds no tree" in proc.stderr and "raptor build" in proc.stderr


def test_the_same_file_by_another_path_is_refused(setup: tuple[Path, Path]) -> None:
    """The tree knows docs/cats.txt by its absolute path; docs/../docs/cats.txt is that file."""
    tree_dir, files = setup
    saved = (tree_dir / "tree.json").read_bytes()
    other = files / ".." / files.name / "cats.txt"
    proc = run("update", str(tree_dir), str(other), "--no-progress")
    assert proc.returncode == 2, proc.stderr
    assert f"is the tree's document {str(files / 'cats.txt')!r} under another path" in proc.stderr
    assert (tree_dir / "tree.json").read_bytes() == saved


def test_update_of_a_folder_names_documents_whose_file_is_gone(setup: tuple[Path, Path]) -> None:
    tree_dir, files = setup
    (files / "rockets.txt").unlink()
    proc = run("update", str(tree_dir), str(files), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "1 added" in proc.stdout  # bread.txt; cats.txt unchanged
    note = f"1 document(s) of the tree under {files}/ have no file any more"
    assert note in proc.stderr
    assert f"raptor remove {tree_dir} {files / 'rockets.txt'}" in proc.stderr
    assert str(files / "rockets.txt") in Tree.load(tree_dir).doc_ids  # noted, not removed


@pytest.fixture
def relative(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A tree built in ``proj`` from the relative paths docs/cats.txt and docs/rockets.txt."""
    project = tmp_path / "proj"
    (project / "docs").mkdir(parents=True)
    for name in ("cats.txt", "rockets.txt"):
        (project / "docs" / name).write_text(TOPICS[name], encoding="utf-8")
    docs = [
        {"doc_id": f"docs/{n}", "text": TOPICS[n], "metadata": {"source": f"docs/{n}"}}
        for n in ("cats.txt", "rockets.txt")
    ]
    monkeypatch.chdir(project)
    builder = TreeBuilder(
        FakeEmbedder(16), EchoSummarizer(), clusterer=GroupClusterer(2), chunk_max_tokens=8
    )
    builder.build(docs).save(project / "tree")
    return project, project / "tree"


@pytest.mark.parametrize(
    ("where", "given"), [("proj/docs", "cats.txt"), (".", "proj/docs/cats.txt")]
)
def test_a_file_given_from_another_directory_is_refused_with_the_build_directory(
    relative: tuple[Path, Path], where: str, given: str
) -> None:
    """From outside ``proj`` the tree's ids name no file; the same file by another path is refused."""
    project, tree_dir = relative
    (project / "docs" / "cats.txt").write_text("Cats purr loudly. Kittens nap all day.", "utf-8")
    saved = (tree_dir / "tree.json").read_bytes()
    proc = raptor("update", str(tree_dir), given, "--no-progress", cwd=project.parent / where)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{given} looks like the tree's document 'docs/cats.txt'" in lines[0]
    assert f"run the command from {project} with the same paths (docs/cats.txt)" in lines[0]
    assert (tree_dir / "tree.json").read_bytes() == saved


def test_from_the_build_directory_a_file_of_the_same_name_is_another_document(
    relative: tuple[Path, Path],
) -> None:
    project, tree_dir = relative
    (project / "other").mkdir()
    (project / "other" / "cats.txt").write_text(TOPICS["bread.txt"], "utf-8")
    proc = raptor("add", str(tree_dir), "other/cats.txt", "--no-progress", cwd=project)
    assert proc.returncode == 0, proc.stderr
    assert Tree.load(tree_dir).doc_ids == ("docs/cats.txt", "docs/rockets.txt", "other/cats.txt")


def test_a_file_of_a_tree_s_name_elsewhere_is_refused_without_a_guessed_directory(
    relative: tuple[Path, Path],
) -> None:
    project, tree_dir = relative
    elsewhere = project.parent / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "cats.txt").write_text(TOPICS["cats.txt"], "utf-8")
    proc = raptor("update", str(tree_dir), "cats.txt", "--no-progress", cwd=elsewhere)
    assert proc.returncode == 2, proc.stderr
    assert "run the command from the directory the tree was built from" in proc.stderr
    assert Tree.load(tree_dir).doc_ids == ("docs/cats.txt", "docs/rockets.txt")
