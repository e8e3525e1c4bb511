from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from raptor_core.exceptions import InvalidParameterError, TreeFormatError
from raptor_core.testing import FakeEmbedder, tiny_tree
from raptor_core.tree import Node, Tree, TreeVersionWarning


def _emb_file(directory: Path) -> Path:
    (found,) = directory.glob("embeddings-*.npy")
    return found


def test_round_trip_is_identical(tmp_path: Path) -> None:
    tree = tiny_tree()
    tree.save(tmp_path / "t")
    loaded = Tree.load(tmp_path / "t")
    assert loaded.nodes == tree.nodes
    assert np.array_equal(loaded.embeddings, tree.embeddings)
    assert loaded.embeddings.dtype == np.float32
    assert loaded.params == tree.params
    assert loaded.build_info == tree.build_info


def test_mmap_load_matches(tmp_path: Path) -> None:
    tree = tiny_tree()
    tree.save(tmp_path)
    loaded = Tree.load(tmp_path, mmap=True)
    assert np.array_equal(np.asarray(loaded.embeddings), tree.embeddings)


def test_tree_is_immutable() -> None:
    tree = tiny_tree()
    with pytest.raises(ValueError, match="read-only"):
        tree.embeddings[0, 0] = 1.0
    with pytest.raises(AttributeError):
        tree.nodes = ()  # type: ignore[misc]
    with pytest.raises(AttributeError):
        tree.nodes[0].text = "x"  # type: ignore[misc]


def test_caller_array_cannot_change_tree() -> None:
    emb = np.eye(2, dtype=np.float32)
    nodes = (
        Node(id="a", text="a", layer=0, token_count=1),
        Node(id="b", text="b", layer=0, token_count=1),
    )
    tree = Tree(nodes=nodes, embeddings=emb)
    emb[0, 0] = 5.0
    assert tree.embeddings[0, 0] == 1.0


def test_structure_queries() -> None:
    tree = tiny_tree()
    assert tree.num_layers == 2 and tree.top_layer == 1
    assert [n.id for n in tree.children("L1.0")] == ["L0.0", "L0.1"]
    assert [n.id for n in tree.parents("L0.2")] == ["L1.1"]
    assert [n.id for n in tree.ancestors("L0.3")] == ["L1.1"]
    assert [n.id for n in tree.leaf_descendants("L1.0")] == ["L0.0", "L0.1"]
    assert tree.doc_ids == ("d1", "d2")
    assert list(tree.layer_of_rows) == [0, 0, 0, 0, 1, 1]
    with pytest.raises(InvalidParameterError):
        tree.layer_rows(2)


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ((Node(id="a", text="", layer=1, token_count=0, children=("zz",)),), "unknown child"),
        (
            (
                Node(id="a", text="", layer=0, token_count=0),
                Node(id="a", text="", layer=0, token_count=0),
            ),
            "duplicate",
        ),
        (
            (
                Node(id="a", text="", layer=0, token_count=0),
                Node(id="b", text="", layer=2, token_count=0, children=("a",)),
            ),
            "layer 1 is empty",
        ),
        (
            (
                Node(id="a", text="", layer=1, token_count=0),
                Node(id="b", text="", layer=1, token_count=0, children=("a",)),
            ),
            "not below",
        ),
    ],
)
def test_invalid_structure_rejected(nodes: tuple[Node, ...], message: str) -> None:
    with pytest.raises(TreeFormatError, match=message):
        Tree(nodes=nodes, embeddings=np.ones((len(nodes), 2), dtype=np.float32))


def test_empty_tree_round_trip(tmp_path: Path) -> None:
    tree = Tree(nodes=(), embeddings=np.zeros((0, 8), dtype=np.float32))
    assert tree.num_layers == 0 and tree.top_layer == -1 and tree.leaves == ()
    tree.save(tmp_path)
    assert len(Tree.load(tmp_path)) == 0


def test_no_pickle_in_saved_files(tmp_path: Path) -> None:
    tiny_tree().save(tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[1] == "tree.json" and names[0].startswith("embeddings-")
    # np.load with allow_pickle=False must be able to read the matrix.
    np.load(_emb_file(tmp_path), allow_pickle=False)


# -- corruption -------------------------------------------------------------------------------
def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(TreeFormatError, match="no RAPTOR tree"):
        Tree.load(tmp_path / "nope")


def test_truncated_json(tmp_path: Path) -> None:
    tiny_tree().save(tmp_path)
    data = (tmp_path / "tree.json").read_bytes()
    (tmp_path / "tree.json").write_bytes(data[: len(data) // 2])
    with pytest.raises(TreeFormatError, match="not valid JSON"):
        Tree.load(tmp_path)


def test_truncated_embeddings(tmp_path: Path) -> None:
    tiny_tree().save(tmp_path)
    emb = _emb_file(tmp_path)
    emb.write_bytes(emb.read_bytes()[:-10])
    with pytest.raises(TreeFormatError, match="checksum"):
        Tree.load(tmp_path)
    # Even without checksum verification, a truncated matrix is a TreeFormatError.
    with pytest.raises(TreeFormatError):
        Tree.load(tmp_path, verify=False)


def test_edited_node_text_detected(tmp_path: Path) -> None:
    tiny_tree().save(tmp_path)
    doc = json.loads((tmp_path / "tree.json").read_text())
    doc["nodes"][0]["text"] = "tampered"
    (tmp_path / "tree.json").write_text(json.dumps(doc))
    with pytest.raises(TreeFormatError, match="edited"):
        Tree.load(tmp_path)


def test_edited_field_type_detected_without_checksum(tmp_path: Path) -> None:
    tiny_tree().save(tmp_path)
    doc = json.loads((tmp_path / "tree.json").read_text())
    doc["nodes"][0]["layer"] = "zero"
    (tmp_path / "tree.json").write_text(json.dumps(doc))
    with pytest.raises(TreeFormatError, match="layer"):
        Tree.load(tmp_path, verify=False)


def test_foreign_json(tmp_path: Path) -> None:
    (tmp_path / "tree.json").write_text(json.dumps({"hello": "world"}))
    with pytest.raises(TreeFormatError, match="not a RAPTOR tree"):
        Tree.load(tmp_path)


def test_future_format_version(tmp_path: Path) -> None:
    tiny_tree().save(tmp_path)
    doc = json.loads((tmp_path / "tree.json").read_text())
    doc["format_version"] = 99
    (tmp_path / "tree.json").write_text(json.dumps(doc))
    with pytest.raises(TreeFormatError, match="format_version"):
        Tree.load(tmp_path)


def test_other_package_version_warns(tmp_path: Path) -> None:
    tiny_tree().save(tmp_path)
    doc = json.loads((tmp_path / "tree.json").read_text())
    doc["raptor_core_version"] = "0.0.1"
    (tmp_path / "tree.json").write_text(json.dumps(doc))
    with pytest.warns(TreeVersionWarning):
        Tree.load(tmp_path)


def test_pickled_npy_is_refused(tmp_path: Path) -> None:
    tiny_tree().save(tmp_path)
    emb = _emb_file(tmp_path)
    np.save(emb, np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(TreeFormatError):
        Tree.load(tmp_path, verify=False)


def test_unserialisable_metadata_is_a_clear_error(tmp_path: Path) -> None:
    node = Node(id="a", text="x", layer=0, token_count=1, metadata={"when": object()})
    tree = Tree(nodes=(node,), embeddings=np.ones((1, 2), dtype=np.float32))
    with pytest.raises(InvalidParameterError, match="JSON"):
        tree.save(tmp_path)
    assert not (tmp_path / "tree.json").exists()


def test_save_onto_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(InvalidParameterError, match="not a directory"):
        tiny_tree().save(target)


def test_resave_replaces_and_cleans_old_matrix(tmp_path: Path) -> None:
    tiny_tree().save(tmp_path)
    other = tiny_tree(dim=32)
    other.save(tmp_path)
    assert len(list(tmp_path.glob("embeddings-*.npy"))) == 1
    assert Tree.load(tmp_path).dim == 32
    assert not list(tmp_path.glob(".*tmp"))


def test_crash_mid_save_keeps_previous_tree(tmp_path: Path) -> None:
    """Kill a process while it saves (after the new matrix is written): the old tree survives."""
    old = tiny_tree()
    old.save(tmp_path)
    script = textwrap.dedent(
        f"""
        import os, raptor_core.tree as t
        from raptor_core.testing import tiny_tree
        real = t._atomic_write
        def crashing(target, write):
            if target.name == "tree.json":
                os._exit(9)  # die like SIGKILL: no cleanup, no finally blocks
            real(target, write)
        t._atomic_write = crashing
        tiny_tree(dim=16).save({str(tmp_path)!r})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], check=False, env=os.environ.copy())
    assert proc.returncode == 9
    loaded = Tree.load(tmp_path)
    assert loaded.dim == old.dim
    assert np.array_equal(loaded.embeddings, old.embeddings)


def test_interrupt_during_write_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import raptor_core.tree as tree_module

    tiny_tree().save(tmp_path)

    def boom(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(tree_module.json, "dumps", boom)
    with pytest.raises(KeyboardInterrupt):
        tiny_tree(dim=16).save(tmp_path)
    monkeypatch.undo()
    assert not list(tmp_path.glob(".*tmp"))
    assert Tree.load(tmp_path).dim == 64


def test_fake_embedder_similarity_is_meaningful() -> None:
    emb = FakeEmbedder(64)
    a, b, c = emb.embed_documents(["cats purr", "cats sleep", "rocket orbit"])
    assert a @ b > a @ c
