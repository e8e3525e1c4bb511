"""Saving trees: real processes racing, killed mid-save, foreign directories, permissions.

Issue 11, part 3: writes never lose or corrupt anything.  Every test here uses real files
and real processes (multiprocessing with the spawn start method, or subprocess).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import multiprocessing
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from filelock import FileLock

from raptor_core.exceptions import (
    InvalidParameterError,
    TreeFormatError,
    TreeLockError,
    TreeSaveError,
)
from raptor_core.store import FileNodeStore, TreeIndexWarning, _format
from raptor_core.testing import random_tree, tiny_tree
from raptor_core.tree import Node, Tree

SPAWN = multiprocessing.get_context("spawn")


def _tree(seed: int, n_leaves: int = 400) -> Tree:
    return random_tree(n_leaves, dim=32, random_state=seed)


def _same(a: Tree, b: Tree) -> bool:
    return a.nodes == b.nodes and np.array_equal(np.asarray(a.embeddings), b.embeddings)


def _entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _assert_clean(directory: Path) -> None:
    """Exactly one whole tree: the lock, tree.json, its node index and the matrix it names."""
    names = _entries(directory)
    assert len(names) == 4 and names[0] == ".raptor.lock", names
    assert names[2:] == ["tree.idx", "tree.json"], names
    assert names[1] == json.loads((directory / "tree.json").read_text())["embeddings"]["file"]
    # The index belongs to this tree.json: opening lazily neither warns nor differs.
    with warnings.catch_warnings():
        warnings.simplefilter("error", TreeIndexWarning)
        lazy = FileNodeStore.open(directory)
    assert [n.id for n in lazy] == [n.id for n in Tree.load(directory).nodes]


# -- two processes saving into one directory ------------------------------------------------
def _save_rounds(seed: int, directory: str, rounds: int, barrier: Any) -> None:
    tree = _tree(seed)
    for _ in range(rounds):
        barrier.wait()
        tree.save(directory)
        barrier.wait()


def test_concurrent_saves_leave_one_whole_tree(tmp_path: Path) -> None:
    rounds = 50
    trees = (_tree(1), _tree(2))
    barrier = SPAWN.Barrier(3)
    workers = [
        SPAWN.Process(target=_save_rounds, args=(seed, str(tmp_path), rounds, barrier))
        for seed in (1, 2)
    ]
    for worker in workers:
        worker.start()
    try:
        winners = set()
        for _ in range(rounds):
            barrier.wait(timeout=120)  # both start saving now
            barrier.wait(timeout=120)  # both saves returned
            loaded = Tree.load(tmp_path)
            matches = [i for i, tree in enumerate(trees) if _same(loaded, tree)]
            assert len(matches) == 1, "the directory holds a mix of the two trees"
            winners.add(matches[0])
            _assert_clean(tmp_path)
    finally:
        _stop(workers)
    assert all(worker.exitcode == 0 for worker in workers)


def _stop(workers: list[Any]) -> None:
    for worker in workers:
        worker.join(timeout=60)
        if worker.is_alive():  # a failed round left it waiting on the barrier
            worker.kill()
            worker.join()


def _persist_rounds(seed: int, directory: str, rounds: int) -> None:
    from raptor_llamaindex.retriever import save_with_params

    tree = _tree(seed)
    for _ in range(rounds):
        save_with_params(tree, directory, retriever={"similarity_top_k": seed})


def test_concurrent_llamaindex_persists_never_fail(tmp_path: Path) -> None:
    """The adapter's parameter file is written in the tree's locked save, without a fixed
    temporary name (two processes used to race to FileNotFoundError)."""
    pytest.importorskip("llama_index.core")
    from raptor_llamaindex.retriever import PARAMS_FILE, read_params

    workers = [
        SPAWN.Process(target=_persist_rounds, args=(seed, str(tmp_path), 20)) for seed in (1, 2)
    ]
    for worker in workers:
        worker.start()
    _stop(workers)
    assert [worker.exitcode for worker in workers] == [0, 0]
    seed = read_params(tmp_path)["retriever"]["similarity_top_k"]
    assert _same(Tree.load(tmp_path), _tree(seed))  # the tree and its parameters belong together
    assert _entries(tmp_path) == sorted(
        [".raptor.lock", "tree.idx", "tree.json", PARAMS_FILE, _emb(tmp_path).name]
    )


def _save_alternately(directory: str, rounds: int) -> None:
    trees = (_tree(1), _tree(2))
    for i in range(rounds):
        trees[i % 2].save(directory)


def test_loads_during_saves_see_a_whole_tree(tmp_path: Path) -> None:
    """A load racing a save reads the old tree or the new one (it retries if the matrix it
    was about to open was just replaced), never an error."""
    trees = (_tree(1), _tree(2))
    trees[0].save(tmp_path)
    saver = SPAWN.Process(target=_save_alternately, args=(str(tmp_path), 40))
    saver.start()
    loads = 0
    try:
        while saver.is_alive() or loads == 0:
            loaded = Tree.load(tmp_path, mmap=loads % 2 == 1)
            assert any(_same(loaded, tree) for tree in trees)
            loads += 1
    finally:
        _stop([saver])
    assert saver.exitcode == 0 and loads > 0


def test_a_save_waits_for_the_lock(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tree = tiny_tree()
    tree.save(tmp_path)
    held = threading.Event()

    def hold() -> None:  # filelock locks are per thread: acquire and release in one
        with FileLock(tmp_path / ".raptor.lock"):
            held.set()
            time.sleep(0.5)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="raptor_core.store._format"):
        tiny_tree(dim=16).save(tmp_path)
    assert time.monotonic() - started >= 0.4  # it waited for the holder to let go
    holder.join()
    assert "another process is saving a tree" in caplog.text
    assert Tree.load(tmp_path).dim == 16


def test_a_save_gives_up_on_a_stuck_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny_tree().save(tmp_path)
    before = (tmp_path / "tree.json").read_bytes()
    monkeypatch.setattr(_format, "LOCK_TIMEOUT_S", 0.2)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, filelock; l = filelock.FileLock(sys.argv[1]); l.acquire(); "
            "print('held', flush=True); time.sleep(60)",
            str(tmp_path / ".raptor.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(TreeLockError, match="another process has been saving"):
            tiny_tree(dim=16).save(tmp_path)
        assert isinstance(TreeLockError("x"), TimeoutError)
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / "tree.json").read_bytes() == before
    # The kernel releases the lock of a killed holder: the next save goes through.
    tiny_tree(dim=16).save(tmp_path)
    assert Tree.load(tmp_path).dim == 16


# -- kill -9 ---------------------------------------------------------------------------------
_KILL_SCRIPT = textwrap.dedent(
    """
    import sys
    from raptor_core.testing import random_tree
    trees = [random_tree(3000, dim=64, random_state=s) for s in (1, 2)]
    print("ready", flush=True)
    i = 0
    while True:
        trees[i % 2].save(sys.argv[1])
        i += 1
    """
)


def test_kill_9_mid_save_leaves_old_or_new_and_next_save_cleans(tmp_path: Path) -> None:
    trees = [random_tree(3000, dim=64, random_state=s) for s in (1, 2)]
    trees[0].save(tmp_path)
    rng = random.Random(7)
    for _ in range(6):
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILL_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        loaded = Tree.load(tmp_path)
        assert any(_same(loaded, tree) for tree in trees)
    third = tiny_tree()
    third.save(tmp_path)
    _assert_clean(tmp_path)
    assert _same(Tree.load(tmp_path), third)


# -- what a save may touch -------------------------------------------------------------------
def test_foreign_directory_is_refused_and_untouched(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "data").mkdir()
    with pytest.raises(InvalidParameterError, match="not empty and holds no RAPTOR tree"):
        tiny_tree().save(tmp_path)
    assert _entries(tmp_path) == ["data", "notes.txt"]  # not even a lock file
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "content",
    [b'{"hello": "world"}', b"not json", b"", json.dumps({"format": "other"}).encode()],
)
def test_foreign_tree_json_is_never_overwritten(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "tree.json").write_bytes(content)
    with pytest.raises(InvalidParameterError, match=r"its tree\.json is not a RAPTOR tree"):
        tiny_tree().save(tmp_path)
    assert (tmp_path / "tree.json").read_bytes() == content
    assert _entries(tmp_path) == ["tree.json"]


def test_tree_json_symlink_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    tiny_tree().save(tmp_path / "real")
    target.write_bytes((tmp_path / "real" / "tree.json").read_bytes())
    directory = tmp_path / "tree"
    directory.mkdir()
    (directory / "tree.json").symlink_to(target)
    before = target.read_bytes()
    with pytest.raises(InvalidParameterError):
        tiny_tree(dim=16).save(directory)
    assert target.read_bytes() == before


def test_lock_symlink_is_refused(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    tiny_tree().save(tmp_path / "t")
    (tmp_path / "t" / ".raptor.lock").unlink()
    (tmp_path / "t" / ".raptor.lock").symlink_to(victim)
    with pytest.raises(InvalidParameterError, match="symbolic link"):
        tiny_tree().save(tmp_path / "t")
    assert victim.read_text() == "keep"


def test_our_own_leftovers_do_not_make_a_directory_foreign(tmp_path: Path) -> None:
    (tmp_path / ".raptor-cache").mkdir()
    (tmp_path / ".raptor-cache" / "cache.sqlite3").write_bytes(b"cache")
    (tmp_path / ".raptor.lock").write_bytes(b"")
    (tmp_path / ".raptor-tmp-0123456789abcdef.tree.json").write_bytes(b"half")
    (tmp_path / ".tree.json.abcd_123.tmp").write_bytes(b"old temp")  # earlier versions
    (tmp_path / ".embeddings-0123456789abcdef.npy.x1y2z3w4.tmp").write_bytes(b"old temp")
    tiny_tree().save(tmp_path)
    assert _entries(tmp_path) == [
        ".raptor-cache",
        ".raptor.lock",
        _emb(tmp_path).name,
        "tree.idx",
        "tree.json",
    ]
    assert (tmp_path / ".raptor-cache" / "cache.sqlite3").read_bytes() == b"cache"


def _emb(directory: Path) -> Path:
    (found,) = (p for p in directory.glob("embeddings-*.npy") if _is_ours(p))
    return found


def _is_ours(path: Path) -> bool:
    return hashlib.sha256(path.read_bytes()).hexdigest().startswith(path.name[11:27])


def test_foreign_embeddings_files_survive_a_resave(tmp_path: Path) -> None:
    tiny_tree().save(tmp_path)
    old = _emb(tmp_path)
    (tmp_path / "embeddings-mine.npy").write_bytes(b"user data")
    (tmp_path / "embeddings-0123456789abcdef.npy").write_bytes(b"named like ours")
    (tmp_path / "README.md").write_text("about this tree")
    tiny_tree(dim=16).save(tmp_path)
    assert not old.exists()  # the matrix the previous tree.json named is gone
    assert (tmp_path / "embeddings-mine.npy").read_bytes() == b"user data"
    assert (tmp_path / "embeddings-0123456789abcdef.npy").read_bytes() == b"named like ours"
    assert (tmp_path / "README.md").read_text() == "about this tree"
    assert Tree.load(tmp_path).dim == 16


def test_resaving_the_same_tree_keeps_its_matrix(tmp_path: Path) -> None:
    tree = tiny_tree()
    tree.save(tmp_path)
    matrix = _emb(tmp_path)
    inode = matrix.stat().st_ino
    tree.save(tmp_path)
    assert matrix.stat().st_ino == inode  # same content, same file: not rewritten
    _assert_clean(tmp_path)


def test_matrix_file_is_exactly_what_numpy_writes(tmp_path: Path) -> None:
    tree = tiny_tree()
    tree.save(tmp_path)
    buf = io.BytesIO()
    np.save(buf, tree.embeddings, allow_pickle=False)
    assert _emb(tmp_path).read_bytes() == buf.getvalue()


_UMASK_SCRIPT = textwrap.dedent(
    """
    import json, os, stat, sys
    from pathlib import Path
    from raptor_core.testing import tiny_tree
    os.umask(int(sys.argv[2], 8))
    directory = Path(sys.argv[1])
    tiny_tree().save(directory)
    tiny_tree(dim=16).save(directory)  # a re-save keeps the modes
    print(json.dumps({p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()}))
    """
)


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_saved_files_follow_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _UMASK_SCRIPT, str(tmp_path / "t"), oct(umask)[2:]],
        check=True,
        capture_output=True,
        text=True,
    )
    modes = json.loads(proc.stdout)
    assert len(modes) == 4 and set(modes.values()) == {mode}, modes


# -- what a save refuses to write ------------------------------------------------------------
def _nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def _leaf_tree(**fields: Any) -> Tree:
    node = Node(id="a", text=fields.pop("text", "x"), layer=0, token_count=1, **fields)
    return Tree(nodes=(node,), embeddings=np.array([[1.0, 0.0]], dtype=np.float32))


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (_leaf_tree(metadata={"x": float("nan")}), "JSON"),
        (_leaf_tree(metadata={"x": object()}), "JSON"),
        (_leaf_tree(metadata={"deep": _nested(40)}), "nested"),
        (_leaf_tree(text="\ud800"), "surrogate"),
        (_leaf_tree(span=(5, 2)), "span"),
        (_leaf_tree(doc_id=3), "doc_id"),  # type: ignore[arg-type]
    ],
)
def test_a_save_refuses_what_a_load_would_refuse(tmp_path: Path, tree: Tree, message: str) -> None:
    with pytest.raises(InvalidParameterError, match=message):
        tree.save(tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_unknown_extra_file_names_are_refused(tmp_path: Path) -> None:
    for name in ("tree.json", "../x", ".hidden", "embeddings-0123456789abcdef.npy", ""):
        with pytest.raises(InvalidParameterError, match="plain file name"):
            _format.write_tree(tiny_tree(), tmp_path, extra_files={name: b"{}"})
    assert _entries(tmp_path) == []


# -- hostile files: bounded memory, fast failure ---------------------------------------------
_MEMORY_SCRIPT = textwrap.dedent(
    """
    import hashlib, io, json, os, resource, sys, time
    import numpy as np
    from numpy.lib import format as npy_format
    from pathlib import Path
    from raptor_core.exceptions import TreeFormatError
    from raptor_core.testing import random_tree
    from raptor_core.tree import Tree

    case, directory = sys.argv[1], Path(sys.argv[2])
    tree = random_tree(2000, dim=16, random_state=0)
    tree.save(directory)
    doc = json.loads((directory / "tree.json").read_text())
    (old,) = directory.glob("embeddings-*.npy")
    n, dim = len(tree), tree.dim

    def write_matrix(matrix_bytes=None, size=None):
        old_path = directory / doc["embeddings"]["file"]
        if matrix_bytes is not None:
            sha = hashlib.sha256(matrix_bytes).hexdigest()
        else:  # a sparse file: header, then a hole up to `size`
            sha = "0" * 64
        name = f"embeddings-{sha[:16]}.npy"
        path = directory / name
        with open(path, "wb") as f:
            f.write(header if matrix_bytes is None else matrix_bytes)
            if size is not None:
                f.truncate(size)
        if old_path != path:
            old_path.unlink()
        doc["embeddings"].update(file=name, sha256=sha)

    def body_sha():
        body = {k: doc[k] for k in ("params", "build_info", "nodes")}
        text = json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    if case == "12TiB-header":
        # The issue's case: a forged header claims a (3 * 2**40 / d, d) float32 matrix.
        buf = io.BytesIO()
        npy_format.write_array_header_1_0(
            buf, {"descr": "<f4", "fortran_order": False, "shape": (3 * 2**40 // dim, dim)}
        )
        write_matrix(buf.getvalue() + tree.embeddings.tobytes())
    elif case == "layer-2**40":
        doc["nodes"][-1]["layer"] = 2**40
    elif case == "sparse-matrix":
        # Consistent JSON (d = 65,536) and a sparse matrix file of the exact size: 500 MB
        # of holes that read as zeros.
        dim = 65536
        doc["embeddings"]["shape"] = [n, dim]
        buf = io.BytesIO()
        npy_format.write_array_header_1_0(
            buf, {"descr": "<f4", "fortran_order": False, "shape": (n, dim)}
        )
        header = buf.getvalue()
        write_matrix(None, len(header) + n * dim * 4)
    doc["content_sha256"] = body_sha()
    (directory / "tree.json").write_text(json.dumps(doc))
    results = {}
    for mmap in (False, True):
        for verify in (True, False):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            started = time.perf_counter()
            try:
                Tree.load(directory, mmap=mmap, verify=verify)
                outcome = "loaded"
            except TreeFormatError as exc:
                outcome = "TreeFormatError"
            grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
            results[f"mmap={mmap} verify={verify}"] = [outcome, grown, time.perf_counter() - started]
    print(json.dumps(results))
    """
)


@pytest.mark.parametrize("case", ["12TiB-header", "layer-2**40", "sparse-matrix"])
def test_hostile_files_fail_fast_in_bounded_memory(tmp_path: Path, case: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, case, str(tmp_path / "t")],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    results = json.loads(proc.stdout)
    for mode, (outcome, grown_kib, seconds) in results.items():
        assert outcome == "TreeFormatError", mode
        assert grown_kib < 64 * 1024, f"{mode}: resident memory grew by {grown_kib} KiB"
        assert seconds < 10, f"{mode}: took {seconds:.1f} s"


def test_fifo_in_place_of_tree_json_does_not_hang(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "tree.json")
    with pytest.raises(TreeFormatError, match="not a regular file"):
        Tree.load(tmp_path)
    with pytest.raises(InvalidParameterError):
        tiny_tree().save(tmp_path)
    assert stat.S_ISFIFO(os.lstat(tmp_path / "tree.json").st_mode)


def test_lazy_opens_during_saves_see_a_whole_tree(tmp_path: Path) -> None:
    """FileNodeStore.open racing saves gets the old tree or the new one, never a mix of an
    index and a tree.json, and never mistakes the save in progress for a stale index."""
    trees = (_tree(1), _tree(2))
    trees[0].save(tmp_path)
    saver = SPAWN.Process(target=_save_alternately, args=(str(tmp_path), 40))
    saver.start()
    opens = 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", TreeIndexWarning)
            while saver.is_alive() or opens == 0:
                store = FileNodeStore.open(tmp_path)
                nodes = list(store)
                assert any(nodes == list(tree.nodes) for tree in trees)
                opens += 1
    finally:
        _stop([saver])
    assert saver.exitcode == 0 and opens > 0


@pytest.mark.parametrize("owned", ["matrix", "tree.idx", ".raptor.lock", "tree.json"])
def test_a_directory_in_place_of_a_file_the_save_writes_is_refused_first(
    tmp_path: Path, owned: str
) -> None:
    """Refused before anything is written: the save would otherwise fail halfway."""
    tiny_tree().save(tmp_path)
    name = next(p.name for p in tmp_path.glob("*.npy")) if owned == "matrix" else owned
    (tmp_path / name).unlink()
    (tmp_path / name).mkdir()
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(InvalidParameterError, match=f"{name!r} must be a file"):
        tiny_tree(dim=16).save(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == files


def test_a_refused_write_raises_tree_save_error_and_keeps_the_old_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    old = tiny_tree()
    old.save(tmp_path)
    write = _format._atomic_write

    def disk_full(directory: Path, name: str, chunks: Any) -> None:
        if name == "tree.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(directory / name))
        write(directory, name, chunks)

    monkeypatch.setattr(_format, "_atomic_write", disk_full)
    with pytest.raises(TreeSaveError, match="unchanged and still loads") as caught:
        tiny_tree(dim=16).save(tmp_path)
    assert isinstance(caught.value, OSError)
    assert caught.value.errno == errno.ENOSPC
    loaded = Tree.load(tmp_path)
    assert loaded.nodes == old.nodes
    np.testing.assert_array_equal(loaded.embeddings, old.embeddings)
    monkeypatch.undo()
    assert Tree.load(tiny_tree(dim=16).save(tmp_path)).dim == 16  # and the next save works


def test_a_failure_to_tidy_up_after_the_save_is_only_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tiny_tree().save(tmp_path)

    def refuse(directory: Path, *, keep: str) -> None:
        raise PermissionError(13, "Permission denied", str(directory))

    monkeypatch.setattr(_format, "_remove_orphan_matrices", refuse)
    with caplog.at_level(logging.WARNING, logger=_format.__name__):
        tiny_tree(dim=16).save(tmp_path)
    assert "could not tidy up" in caplog.text
    assert Tree.load(tmp_path).dim == 16
