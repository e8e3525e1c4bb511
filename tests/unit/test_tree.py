from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

from raptor_core.exceptions import InvalidParameterError, TreeFormatError
from raptor_core.store import FileNodeStore, TreeIndexWarning
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


def _unit_rows(n: int, dim: int = 2) -> np.ndarray:
    rows = np.zeros((n, dim), dtype=np.float32)
    rows[:, 0] = 1.0
    return rows


def _leaf(node_id: str, **kwargs: object) -> Node:
    fields: dict[str, object] = {"text": node_id, "layer": 0, "token_count": 1}
    fields.update(kwargs)
    return Node(id=node_id, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ((_leaf("a"), _leaf("b", layer=1, children=("zz",))), "unknown child"),
        ((_leaf("a"), _leaf("a")), "duplicate"),
        ((_leaf("a"), _leaf("x"), _leaf("b", layer=2, children=("a",))), "layer 1 is empty"),
        (
            (
                _leaf("a"),
                _leaf("c", layer=1, children=("a",)),
                _leaf("b", layer=1, children=("c",)),
            ),
            "exactly one layer below",
        ),
        ((_leaf("a"), _leaf("b", children=("a",))), "exactly one layer below"),
        (
            (_leaf("a"), _leaf("b", layer=1), _leaf("c", layer=2, children=("a",))),
            "exactly one layer below",
        ),
        ((_leaf("a"), _leaf("b", layer=1)), "has no children"),
        ((_leaf("a"), _leaf("b", layer=1, children=("a", "a"))), "more than once"),
        ((_leaf("a", layer=-1),), "layer -1"),
        ((_leaf("a", layer=2**40),), "layers 0..0 at most"),
        ((_leaf("a", layer=10**30),), "layer must be an integer in range"),
        ((_leaf("a", token_count=-1),), "token_count -1"),
        ((_leaf("a", token_count=2**31),), "token_count"),
        ((_leaf("a", token_count=10**30),), "token_count must be an integer in range"),
    ],
)
def test_invalid_structure_rejected(nodes: tuple[Node, ...], message: str) -> None:
    with pytest.raises(TreeFormatError, match=message):
        Tree(nodes=nodes, embeddings=_unit_rows(len(nodes)))


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (np.array([[1.0, 1.0]]), "not a finite unit vector"),
        (np.array([[0.0, 0.0]]), "not a finite unit vector"),
        (np.array([[np.nan, 0.0]]), "not a finite unit vector"),
        (np.array([[np.inf, 0.0]]), "not a finite unit vector"),
        (np.array([[1e30, 0.0]]), "not a finite unit vector"),
        (np.ones((1, 0)), "d >= 1"),
        (np.ones((2, 2)) / np.sqrt(2), "shape"),
        (np.ones(2) / np.sqrt(2), "shape"),
        (np.array([["a", "b"]]), "float32"),
    ],
)
def test_invalid_embeddings_rejected(rows: np.ndarray, message: str) -> None:
    with pytest.raises(TreeFormatError, match=message):
        Tree(nodes=(_leaf("a"),), embeddings=rows)


def test_rows_within_tolerance_are_accepted() -> None:
    rows = np.array([[1.0004, 0.0]], dtype=np.float32)  # float32 rounding, a little more
    assert Tree(nodes=(_leaf("a"),), embeddings=rows).dim == 2


def test_layer_2_pow_40_fails_fast_without_memory() -> None:
    """A node claiming layer 2**40 once made construction allocate gigabytes (issue 11)."""
    import tracemalloc

    nodes = (_leaf("a"), _leaf("b", layer=2**40))
    tracemalloc.start()
    try:
        with pytest.raises(TreeFormatError, match="layer 1099511627776"):
            Tree(nodes=nodes, embeddings=_unit_rows(2))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000


def test_parents_and_ancestors_with_soft_clusters() -> None:
    nodes = (
        _leaf("a"),
        _leaf("b"),
        _leaf("c"),
        _leaf("p", layer=1, children=("a", "b")),
        _leaf("q", layer=1, children=("b", "c")),
        _leaf("r", layer=2, children=("q", "p")),
    )
    tree = Tree(nodes=nodes, embeddings=_unit_rows(6))
    assert [n.id for n in tree.parents("b")] == ["p", "q"]
    assert [n.id for n in tree.parents("r")] == []
    assert [n.id for n in tree.ancestors("b")] == ["p", "q", "r"]
    assert [n.id for n in tree.leaf_descendants("r")] == ["a", "b", "c"]
    assert [list(tree.layer_rows(i)) for i in range(3)] == [[0, 1, 2], [3, 4], [5]]


def test_rows_of_a_layer_follow_node_order_when_layers_interleave() -> None:
    nodes = (
        _leaf("a"),
        _leaf("p", layer=1, children=("a",)),
        _leaf("b"),
        _leaf("q", layer=1, children=("b",)),
    )
    tree = Tree(nodes=nodes, embeddings=_unit_rows(4))
    assert list(tree.layer_rows(0)) == [0, 2] and list(tree.layer_rows(1)) == [1, 3]
    assert [n.id for n in tree.parents("b")] == ["q"]


@pytest.mark.parametrize("dim", [8, 0])  # LlamaIndex allows an empty index: (0, 0)
@pytest.mark.parametrize("mmap", [False, True])
def test_empty_tree_round_trip(tmp_path: Path, dim: int, mmap: bool) -> None:
    tree = Tree(nodes=(), embeddings=np.zeros((0, dim), dtype=np.float32))
    assert tree.num_layers == 0 and tree.top_layer == -1 and tree.leaves == ()
    tree.save(tmp_path)
    loaded = Tree.load(tmp_path, mmap=mmap)
    assert len(loaded) == 0 and loaded.embeddings.shape == (0, dim)


def test_load_of_a_bad_path_is_a_tree_format_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    for path in (tmp_path / "file", str(tmp_path) + "/a\0b"):
        with pytest.raises(TreeFormatError):
            Tree.load(path)


def test_no_pickle_in_saved_files(tmp_path: Path) -> None:
    tiny_tree().save(tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0] == ".raptor.lock" and names[2:] == ["tree.idx", "tree.json"]
    assert names[1].startswith("embeddings-") and len(names) == 4
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
    with pytest.raises(TreeFormatError, match="truncated"):
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
    tree = Tree(nodes=(node,), embeddings=_unit_rows(1))
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
    assert not list(tmp_path.glob(".raptor-tmp-*"))


@pytest.mark.parametrize("die_at", ["tree.json", "fsync"])
def test_crash_mid_save_keeps_previous_tree_and_next_save_cleans(
    tmp_path: Path, die_at: str
) -> None:
    """A process dies mid-save (no cleanup runs): the old tree survives, the next save tidies.

    ``tree.json``: dies once the new matrix is in place, before ``tree.json`` is replaced
    (an orphaned matrix is left).  ``fsync``: dies with a temporary file written but not
    renamed (a ``.raptor-tmp-*`` file is left).
    """
    old = tiny_tree()
    old.save(tmp_path)
    script = textwrap.dedent(
        f"""
        import os
        from raptor_core.store import _format
        from raptor_core.testing import tiny_tree
        real_write, real_fsync = _format._atomic_write, _format.os.fsync
        def write(directory, name, chunks):
            if name == "tree.json":
                os._exit(9)  # die like SIGKILL: no cleanup, no finally blocks
            real_write(directory, name, chunks)
        def fsync(fd):
            real_fsync(fd)
            os._exit(9)
        if {die_at!r} == "tree.json":
            _format._atomic_write = write
        else:
            _format.os.fsync = fsync
        tiny_tree(dim=16).save({str(tmp_path)!r})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], check=False, env=os.environ.copy())
    assert proc.returncode == 9
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    # lock, tree.json, tree.idx (old, or new and stale), old matrix + an orphan or a temp file
    assert len(leftovers) == 5
    loaded = Tree.load(tmp_path)
    assert loaded.dim == old.dim
    assert np.array_equal(loaded.embeddings, old.embeddings)
    with warnings.catch_warnings():
        # A crash after the new index was written leaves it beside the old tree.json: the
        # lazy store sees it describes another tree.json and reads tree.json in full.
        warnings.simplefilter("ignore", TreeIndexWarning)
        assert FileNodeStore.open(tmp_path).dim == old.dim
    newer = tiny_tree(dim=32)
    newer.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".raptor.lock", "tree.idx", "tree.json", _emb_file(tmp_path).name]
    )
    assert Tree.load(tmp_path).dim == 32


def test_interrupt_during_write_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from raptor_core.store import _format

    tiny_tree().save(tmp_path)
    real = _format.os.fsync

    def boom(fd: int) -> None:
        real(fd)
        raise KeyboardInterrupt  # after the temp file is written, before its rename

    monkeypatch.setattr(_format.os, "fsync", boom)
    with pytest.raises(KeyboardInterrupt):
        tiny_tree(dim=16).save(tmp_path)
    monkeypatch.undo()
    assert not list(tmp_path.glob(".raptor-tmp-*"))
    assert Tree.load(tmp_path).dim == 64


def test_fake_embedder_similarity_is_meaningful() -> None:
    emb = FakeEmbedder(64)
    a, b, c = emb.embed_documents(["cats purr", "cats sleep", "rocket orbit"])
    assert a @ b > a @ c
