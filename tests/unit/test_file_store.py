"""FileNodeStore: a saved tree searched through its node index, without loading tree.json.

* the NodeStore conformance suite (read-only: add and delete refuse);
* every strategy gives the in-memory store's ids and scores, lazily and on the fallback;
* the index is what opening reads: nodes are parsed only when returned;
* trees without an index, or with a stale one, fall back to a full load with a warning;
* a damaged or hostile index, tree.json or matrix raises TreeFormatError (at open or at the
  first use of the damaged block), never another exception or a wrong answer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from raptor_core import FileNodeStore, InvalidParameterError, TreeFormatError
from raptor_core.retrieval.registry import make_retriever
from raptor_core.store import TreeIndexWarning
from raptor_core.store._index import MAGIC
from raptor_core.store.memory import InMemoryNodeStore
from raptor_core.testing import (
    FakeEmbedder,
    NodeStoreTests,
    ScriptedLLM,
    random_tree,
    select_first,
    store_tree,
)
from raptor_core.tree import Tree
from raptor_core.types import NodeFilter


class TestFileNodeStore(NodeStoreTests):
    """The conformance suite on a saved store_tree(); writes are refused."""

    @pytest.fixture(autouse=True)
    def _tmp(self, tmp_path: Path) -> None:
        self._dir = tmp_path

    def make_store(self) -> FileNodeStore:
        empty = Tree(nodes=(), embeddings=np.zeros((0, 0), dtype=np.float32))
        return FileNodeStore.open(empty.save(self._dir / "empty"))

    def filled(self) -> tuple[Any, Tree]:
        tree = store_tree(self.dim)
        return FileNodeStore.open(tree.save(self._dir / "tree")), tree

    def holding(self, tree: Tree) -> FileNodeStore:
        return FileNodeStore.open(tree.save(self._dir / "held"))

    def test_upsert_replaces(self) -> None:
        store, tree = self.filled()
        with pytest.raises(InvalidParameterError, match="read-only"):
            store.add([tree.leaves[0]], tree.embeddings[:1])

    def test_delete(self) -> None:
        store, tree = self.filled()
        with pytest.raises(InvalidParameterError, match="read-only"):
            store.delete([tree.leaves[0].id])


def _answers(source: Any, embedder: Any, query: str) -> dict[str, list[tuple[str, float]]]:
    configs: list[tuple[str, dict[str, Any]]] = [
        ("collapsed", {"k": 8, "max_tokens": 400}),
        ("collapsed", {"k": 8, "layers": [0], "where": {"topic": {"$in": ["t1", "t3"]}}}),
        ("traversal", {"k": 8, "top_k": 2}),
        ("value", {"k": 5, "chunk_k": 8}),
        ("mmr", {"k": 5, "fetch_k": 15}),
        ("llm", {"k": 5, "top_k": 2}),
        ("passage", {"k": 4, "max_tokens": 200}),
    ]
    out = {}
    for name, params in configs:
        llm = ScriptedLLM(default=select_first(2))
        retriever = make_retriever(name, source, embedder, llm=llm, **params)
        out[f"{name} {params}"] = [(h.id, h.score) for h in retriever.retrieve(query)]
    return out


def _metadata_tree() -> Tree:
    tree = random_tree(300, fanout=4, dim=24, random_state=3)
    # Topics per document, so metadata filters have something to select.
    nodes = tuple(
        node if node.layer else _with_meta(node, {"topic": f"t{i % 4}", "year": 2000 + i % 7})
        for i, node in enumerate(tree.nodes)
    )
    return Tree(nodes=nodes, embeddings=tree.embeddings, params=tree.params)


def _with_meta(node: Any, meta: dict[str, Any]) -> Any:
    from dataclasses import replace

    return replace(node, metadata=meta, parents=())


def test_every_strategy_matches_the_in_memory_tree(tmp_path: Path) -> None:
    tree = _metadata_tree()
    store = FileNodeStore.open(tree.save(tmp_path / "t"))
    embedder = FakeEmbedder(dim=tree.dim)
    for query in ("alpha beta", "gamma", "delta epsilon zeta"):
        expected = _answers(tree, embedder, query)
        assert all(expected.values())
        assert _answers(store, embedder, query) == expected


def test_opening_parses_no_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from raptor_core.store import _format

    tree = random_tree(500, dim=16)
    path = tree.save(tmp_path / "t")
    parsed: list[int] = []
    original = _format._node

    def counting(data: Any, parents: Any) -> Any:
        parsed.append(1)
        return original(data, parents)

    monkeypatch.setattr(_format, "_node", counting)
    store = FileNodeStore.open(path)
    assert parsed == [] and len(store) == len(tree) and store.top_layer == tree.top_layer
    q = tree.embeddings[7]
    found = store.search(q, 3)
    assert len(parsed) == 3  # only the hits
    assert found[0].node == tree.nodes[7]
    store.search(q, 3)
    assert len(parsed) == 3  # cached


def test_scores_are_bit_identical_to_the_in_memory_store(tmp_path: Path) -> None:
    tree = random_tree(400, dim=16, random_state=5)
    store = FileNodeStore.open(tree.save(tmp_path / "t"))
    memory = InMemoryNodeStore.from_tree(tree)
    rng = np.random.default_rng(0)
    for _ in range(5):
        q = rng.normal(size=16).astype(np.float32)
        q /= np.linalg.norm(q)
        for where in (None, NodeFilter(layers=frozenset({1})), NodeFilter(include_carried=True)):
            got = [(m.node.id, m.score) for m in store.search(q, 20, where=where)]
            assert got == [(m.node.id, m.score) for m in memory.search(q, 20, where=where)]


# -- trees without a usable index --------------------------------------------------------------
def test_a_tree_without_an_index_is_loaded_in_full_with_a_warning(tmp_path: Path) -> None:
    tree = store_tree()
    path = tree.save(tmp_path / "t")
    (path / "tree.idx").unlink()  # as saved by an older version
    with pytest.warns(TreeIndexWarning, match="no node index"):
        store = FileNodeStore.open(path)
    assert "loaded" in repr(store)
    q = FakeEmbedder(dim=tree.dim).embed_query("bees")
    memory = InMemoryNodeStore.from_tree(tree)
    assert [(m.node.id, m.score) for m in store.search(q, 6)] == [
        (m.node.id, m.score) for m in memory.search(q, 6)
    ]


def test_a_stale_index_is_never_mixed_with_a_newer_tree(tmp_path: Path) -> None:
    old, new = random_tree(60, random_state=1), random_tree(80, random_state=2)
    path = old.save(tmp_path / "t")
    stale = (path / "tree.idx").read_bytes()
    new.save(path)
    (path / "tree.idx").write_bytes(stale)  # an older version re-saved without an index
    with pytest.warns(TreeIndexWarning, match="describes another"):
        store = FileNodeStore.open(path)
    assert len(store) == len(new)
    assert {n.id for n in store} == {n.id for n in new.nodes}


def test_save_writes_the_index_and_load_ignores_it(tmp_path: Path) -> None:
    tree = store_tree()
    path = tree.save(tmp_path / "t")
    assert (path / "tree.idx").read_bytes().startswith(MAGIC)
    (path / "tree.idx").write_bytes(b"garbage")
    assert Tree.load(path).nodes == tree.nodes  # tree.json stays complete


# -- damaged and hostile files -----------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Tree]:
    tree = _metadata_tree()
    return tree.save(tmp_path_factory.mktemp("saved") / "t"), tree


def _copy(saved: tuple[Path, Tree], tmp_path: Path) -> Path:
    path, _ = saved
    target = tmp_path / "copy"
    shutil.copytree(path, target)
    return target


def _exercise(path: Path, tree: Tree) -> None:
    """Open and search every way; answers must be the original's (or TreeFormatError)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TreeIndexWarning)
        store = FileNodeStore.open(path)
    embedder = FakeEmbedder(dim=tree.dim)
    assert _answers(store, embedder, "alpha gamma") == _answers(tree, embedder, "alpha gamma")
    assert [n.id for n in store] == [n.id for n in tree.nodes]


def test_index_byte_flips_and_truncations(saved: tuple[Path, Tree], tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    original = (path / "tree.idx").read_bytes()
    rng = np.random.default_rng(0)
    positions = sorted(
        {*range(0, 40), *rng.integers(0, len(original), 150).tolist(), len(original) - 1}
    )
    outcomes = {"error": 0, "same": 0}
    for pos in positions:
        damaged = bytearray(original)
        damaged[pos] ^= 1 << int(rng.integers(0, 8))
        for content in (bytes(damaged), original[:pos]):
            (path / "tree.idx").write_bytes(content)
            try:
                _exercise(path, saved[1])
                outcomes["same"] += 1
            except TreeFormatError:
                outcomes["error"] += 1
    # Nearly every change is caught by the checksum; a few (the recorded tree.json size,
    # the header's padding) make the index stale or change nothing, and answers stay exact.
    assert outcomes["error"] > 250, outcomes


def test_tree_json_and_matrix_damage_is_found_when_used(
    saved: tuple[Path, Tree], tmp_path: Path
) -> None:
    path = _copy(saved, tmp_path)
    tree = saved[1]
    tree_json = (path / "tree.json").read_bytes()
    # A flipped byte in the last node's line: opening works, returning that node fails.
    last = tree.nodes[-1]
    where = tree_json.rindex(json.dumps(last.text).encode())
    damaged = bytearray(tree_json)
    damaged[where + 3] ^= 0x01
    (path / "tree.json").write_bytes(bytes(damaged))
    store = FileNodeStore.open(path)
    q = tree.embeddings[len(tree) - 1]
    with pytest.raises(TreeFormatError, match="checksum"):
        store.search(q, 1, where=NodeFilter(include_carried=True))
    # Without block checksums the line still must agree with the index, or parse.
    unverified = FileNodeStore.open(path, verify=False)
    found = unverified.search(q, 1, where=NodeFilter(include_carried=True))
    assert found[0].node.id == last.id  # a different text is a different valid tree
    (path / "tree.json").write_bytes(tree_json)
    # A NaN row of the matrix: the search touching it fails, even unverified.
    (matrix,) = path.glob("embeddings-*.npy")
    raw = bytearray(matrix.read_bytes())
    raw[-8:-4] = np.float32(np.nan).tobytes()
    matrix.write_bytes(bytes(raw))
    for verify in (True, False):
        store = FileNodeStore.open(path, verify=verify)
        with pytest.raises(TreeFormatError, match="checksum" if verify else "unit vector"):
            store.search(q, 1)


def _forge(path: Path, mutate: Callable[[dict[str, np.ndarray]], None]) -> None:
    """Rewrite tree.idx with changed columns and a recomputed checksum (a deliberate forgery)."""
    raw = (path / "tree.idx").read_bytes()
    header_len = int.from_bytes(raw[8:16], "little")
    header = json.loads(raw[16 : 16 + header_len])
    n, e = header["num_nodes"], header["num_edges"]
    names = ["rec_start", "rec_end", "child_ptr", "layer", "tokens", "doc", "meta", "child_rows"]
    dtypes = ["<i8", "<i8", "<i8", "<i4", "<i4", "<i4", "<i4", "<i4"]
    counts = [n, n, n + 1, n, n, n, n, e]
    body = bytearray(raw[16 + header_len :])
    columns, offset = {}, 0
    for name, dtype, count in zip(names, dtypes, counts, strict=True):
        size = count * np.dtype(dtype).itemsize
        columns[name] = np.frombuffer(bytes(body[offset : offset + size]), dtype=dtype).copy()
        offset += size
    mutate(columns)
    packed = b"".join(
        columns[name].astype(dtype).tobytes() for name, dtype in zip(names, dtypes, strict=True)
    )
    assert len(packed) == offset
    body[:offset] = packed
    header["body_sha256"] = hashlib.sha256(bytes(body)).hexdigest()
    text = json.dumps(header).encode()
    text += b" " * (header_len - len(text))
    assert len(text) == header_len
    (path / "tree.idx").write_bytes(raw[:16] + text + bytes(body))


def _set(name: str, position: int, value: int) -> Callable[[dict[str, np.ndarray]], None]:
    def mutate(columns: dict[str, np.ndarray]) -> None:
        columns[name][position] = value

    return mutate


def _copy_first_child(columns: dict[str, np.ndarray]) -> None:
    columns["child_rows"][1] = columns["child_rows"][0]  # the first summary's first two


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (_set("layer", 0, 2**31 - 1), "layer"),
        (_set("layer", -1, -1), "layer"),
        (_set("tokens", 3, -5), "token count"),
        (_set("doc", 0, 10**6), "document index"),
        (_set("meta", 0, -1), "metadata index"),
        (_set("child_rows", 0, 10**9), "child row"),
        (_set("child_rows", 0, -3), "child row"),
        (_set("child_ptr", 5, 10**12), "CSR"),
        (_copy_first_child, "more than once"),
        (_set("rec_start", 0, 0), "byte range"),
        (_set("rec_end", 4, 2**40), "byte range"),
    ],
)
def test_forged_columns_are_refused(
    saved: tuple[Path, Tree], tmp_path: Path, mutate: Any, problem: str
) -> None:
    path = _copy(saved, tmp_path)
    _forge(path, mutate)
    with pytest.raises(TreeFormatError, match=problem):
        FileNodeStore.open(path)


def test_forged_record_ranges_disagree_with_the_columns(
    saved: tuple[Path, Tree], tmp_path: Path
) -> None:
    path = _copy(saved, tmp_path)
    tree = saved[1]

    def swap(columns: dict[str, np.ndarray]) -> None:
        for name in ("rec_start", "rec_end"):
            columns[name][[0, 1]] = columns[name][[1, 0]]

    _forge(path, swap)
    # Refused at open: the ranges are no longer tree.json's lines in order (before any
    # node is read, a swap would be caught only when one of the two nodes was served).
    with pytest.raises(TreeFormatError, match="node lines, one after another"):
        FileNodeStore.open(path, verify=False)
    assert len(tree) > 1


@pytest.mark.parametrize(
    ("name", "position", "delta"),
    [("rec_start", 0, 1), ("rec_end", 0, -1), ("rec_start", 1, 1), ("rec_end", -1, -1)],
    ids=["first-start", "first-end", "second-start", "last-end"],
)
def test_record_ranges_must_tile_the_node_lines(
    saved: tuple[Path, Tree], tmp_path: Path, name: str, position: int, delta: int
) -> None:
    """A range inside the nodes but not exactly a node's line is refused at open.

    Such a range may point at a JSON object nested in a node's own metadata, and the store
    would then serve a text that Tree.load never shows.
    """
    path = _copy(saved, tmp_path)

    def shift(columns: dict[str, np.ndarray]) -> None:
        columns[name][position] += delta

    _forge(path, shift)
    with pytest.raises(TreeFormatError, match="node lines, one after another"):
        FileNodeStore.open(path, verify=False)


def test_a_range_onto_an_object_nested_in_a_line_is_refused(tmp_path: Path) -> None:
    """The forgery the tiling rule stops: a node served from inside another's metadata."""
    base = _metadata_tree()
    first = base.nodes[0]
    hidden = {**first.to_dict(), "text": "served, never shown", "metadata": {}}
    tree = Tree(
        nodes=(dataclasses.replace(first, metadata={"x": hidden}), *base.nodes[1:]),
        embeddings=base.embeddings,
        params=base.params,
    )
    path = tree.save(tmp_path / "t")
    raw = (path / "tree.json").read_bytes()
    needle = json.dumps(hidden, ensure_ascii=False).encode()
    start = raw.index(needle)

    def point_inside(columns: dict[str, np.ndarray]) -> None:
        columns["rec_start"][0] = start
        columns["rec_end"][0] = start + len(needle)

    _forge(path, point_inside)
    with pytest.raises(TreeFormatError, match="node lines, one after another"):
        FileNodeStore.open(path, verify=False)


def test_index_that_is_a_symlink_or_fifo_is_refused(
    saved: tuple[Path, Tree], tmp_path: Path
) -> None:
    path = _copy(saved, tmp_path)
    (path / "tree.idx").rename(tmp_path / "elsewhere.idx")
    (path / "tree.idx").symlink_to(tmp_path / "elsewhere.idx")
    with pytest.raises(TreeFormatError, match=r"^[^ ]*tree\.idx is a symbolic link") as caught:
        FileNodeStore.open(path)
    assert "cannot open" not in str(caught.value)  # said once, not wrapped again
    (path / "tree.idx").unlink()
    if hasattr(os, "mkfifo"):
        os.mkfifo(path / "tree.idx")
        with pytest.raises(TreeFormatError, match="not a regular file"):
            FileNodeStore.open(path)


def test_forged_header_sizes_fail_fast(saved: tuple[Path, Tree], tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    raw = (path / "tree.idx").read_bytes()
    (path / "tree.idx").write_bytes(raw[:8] + (2**40).to_bytes(8, "little") + raw[16:])
    with pytest.raises(TreeFormatError, match="header length"):
        FileNodeStore.open(path)
    header_len = int.from_bytes(raw[8:16], "little")
    header = json.loads(raw[16 : 16 + header_len])
    cases = [
        ("num_nodes", 10**12, "count does not fit"),
        ("num_edges", 2**61, "count does not fit"),
        ("dim", 2**40, "does not describe the matrix"),
        ("dim", 3, "does not describe the matrix"),
    ]
    for key, value, problem in cases:
        text = json.dumps({**header, key: value}).encode()
        text += b" " * (-(16 + len(text)) % 8)
        forged = raw[:8] + len(text).to_bytes(8, "little") + text + raw[16 + header_len :]
        (path / "tree.idx").write_bytes(forged)
        with pytest.raises(TreeFormatError, match=problem):
            FileNodeStore.open(path)


def test_the_fallback_warning_points_at_the_caller(tmp_path: Path) -> None:
    path = store_tree().save(tmp_path / "t")
    (path / "tree.idx").unlink()
    with pytest.warns(TreeIndexWarning) as caught:
        FileNodeStore.open(path)
    assert caught[0].filename == __file__


def test_metadata_with_int_keys_and_tuples_round_trips(tmp_path: Path) -> None:
    tree = random_tree(30, dim=8)
    odd = {1: "one", "span": (1, 2), "nested": {"a": [1, (2, 3)]}}
    nodes = tuple(_with_meta(n, odd) if n.layer == 0 else n for n in tree.nodes)
    path = Tree(nodes=nodes, embeddings=tree.embeddings).save(tmp_path / "t")
    store = FileNodeStore.open(path)
    loaded = Tree.load(path)
    assert list(store) == list(loaded.nodes)
    found = store.search(tree.embeddings[0], 5, where=NodeFilter(where={"1": "one"}))
    assert len(found) == 5 and all(m.node.layer == 0 for m in found)


def test_threads_searching_at_once_agree(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    tree = random_tree(600, dim=16, random_state=9)
    store = FileNodeStore.open(tree.save(tmp_path / "t"))
    memory = InMemoryNodeStore.from_tree(tree)
    queries = tree.embeddings[::7]

    def search(q: np.ndarray) -> list[tuple[str, float]]:
        return [(m.node.id, m.score) for m in store.search(q, 12)]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(search, queries))
    assert got == [[(m.node.id, m.score) for m in memory.search(q, 12)] for q in queries]


@pytest.mark.parametrize("target", ["tree.json", "matrix"])
def test_byte_flips_in_tree_json_and_matrix(
    saved: tuple[Path, Tree], tmp_path: Path, target: str
) -> None:
    """Every flipped byte is refused (at open or at first use), or changes no answer."""
    path = _copy(saved, tmp_path)
    file = path / "tree.json" if target == "tree.json" else next(path.glob("embeddings-*.npy"))
    original = file.read_bytes()
    rng = np.random.default_rng(1)
    outcomes = {"error": 0, "same": 0}
    for pos in sorted({*rng.integers(0, len(original), 60).tolist(), 0, len(original) - 1}):
        damaged = bytearray(original)
        damaged[pos] ^= 1 << int(rng.integers(0, 8))
        file.write_bytes(bytes(damaged))
        try:
            _exercise(path, saved[1])
            outcomes["same"] += 1
        except TreeFormatError:
            outcomes["error"] += 1
    file.write_bytes(original)
    # Every block is used by _exercise (it lists every node and searches the whole matrix),
    # so every flip is caught by a checksum.
    assert outcomes == {"error": outcomes["error"], "same": 0}, outcomes
