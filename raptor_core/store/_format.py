"""The plain-file directory format of a RAPTOR tree: writing it, reading it, validating it.

Layout
------
A saved tree is a directory::

    tree.json                 format marker and version, the node count, the matrix's file
                              name, shape and SHA-256, a SHA-256 of the content, then
                              params, build_info and the nodes
    embeddings-<hex16>.npy    the (n, d) matrix: little-endian float32, C order, .npy 1.0
                              (2.0 is read too); <hex16> = first 16 hex digits of its SHA-256
    tree.idx                  the node index a lazy open reads (raptor_core.store._index);
                              never read by a load, which needs tree.json alone
    .raptor.lock              the save lock (empty; left in place, as lock files must be)
    .raptor-cache/            optional: the build cache of ``raptor build --out``
    raptor_llamaindex.json    optional: retrieval parameters written by the LlamaIndex adapter

``tree.json`` (format version 1) is one JSON object with exactly the keys ``format``
(``"raptor-tree"``), ``format_version``, ``raptor_core_version``, ``num_nodes``,
``embeddings`` (exactly ``file``, ``shape``, ``dtype`` = ``"float32"``, ``sha256``),
``content_sha256``, ``params``, ``build_info`` and ``nodes``; every node has exactly the
keys of :meth:`raptor_core.tree.Node.to_dict`.  The writer indents the header and puts
each node on a line of its own; any other layout of the same JSON reads the same.
Nothing is ever pickled.

Reading: files are data
-----------------------
A load reads ``tree.json`` and the one matrix file it names, nothing else; it never imports,
instantiates or unpickles anything.  Every problem raises
:class:`~raptor_core.exceptions.TreeFormatError`, and no other exception type:

* **Files.**  Both files are opened with ``O_NOFOLLOW | O_NONBLOCK`` and must be regular
  files: symbolic links, FIFOs, devices and directories are refused.  The matrix name must
  be exactly ``embeddings-<16 hex digits>.npy``, those digits the start of its recorded
  SHA-256, so a file can never name a path outside its directory.
* **Sizes, before reading.**  ``tree.json`` may hold at most ``MAX_JSON_BYTES`` (2 GiB).
  The matrix must be exactly its header (at most ``MAX_NPY_HEADER_BYTES``, 64 KiB) plus
  ``n * d * 4`` bytes, where ``n`` is the number of nodes actually listed and
  ``1 <= d <= MAX_DIM`` (65,536; ``d = 0`` only for an empty tree).  The ``.npy`` header
  is parsed by numpy's header reader from the open file, and its dtype (``<f4``), order
  (C) and shape (``(n, d)``) are checked before any array exists, for memory-mapped and
  in-memory loads alike.  Rows are then read (or mapped) block by block and each block is
  checked finite and unit-norm before the next is read, so a sparse or zero-filled file
  fails at its first bad block instead of filling memory.  Memory therefore stays
  proportional to the bytes really present in the files.
* **JSON.**  Strict UTF-8; ``NaN``/``Infinity`` literals, numbers that overflow to
  infinity, integers longer than Python's digit limit, strings with unpaired surrogates
  and nesting deeper than ``MAX_VALUE_DEPTH`` (32) inside ``params``, ``build_info`` or
  a node's ``metadata`` are refused.  Missing or unknown keys at the top level, in
  ``embeddings`` and in every node are refused, and every field must have its exact JSON
  type (``true`` is not an integer): ids, texts and children are strings, ``doc_id`` a
  string or null, ``span`` null or two integers ``0 <= start <= end <= 2**53``,
  ``metadata``/``params``/``build_info`` objects, ``num_nodes`` the length of ``nodes``.
* **The tree.**  The invariants every :class:`~raptor_core.tree.Tree` keeps (see
  :mod:`raptor_core.tree`): unique ids, layers ``0..L-1`` with none empty (so a layer
  number can never exceed the node count), children that exist and sit exactly one layer
  down, ``0 <= token_count <= 2**31 - 1``, finite unit-norm rows.

The checksums (``content_sha256`` and the matrix's ``sha256``) detect accidents: a
truncated copy, bit rot, a hand edit.  They are unkeyed, so they do not detect attacks:
anyone who can write the directory can recompute them.  What contains a hostile file is
the validation above: it may describe a different (valid) tree, but it cannot make a load
run code, read outside its directory, allocate memory out of proportion to the files'
real size, return NaN scores, or fail with anything but ``TreeFormatError``.

Writing: nothing lost, nothing mixed
------------------------------------
* Everything is serialised in memory first; a value that cannot be stored (an object in
  ``metadata``, NaN, nesting deeper than the reader accepts, a ``tree.json`` over
  ``MAX_JSON_BYTES``) raises ``InvalidParameterError`` before any file is touched.
* Saves into one directory are serialised by ``.raptor.lock`` (``filelock``; the
  operating system releases it when its holder dies).  A save waits up to
  ``LOCK_TIMEOUT_S`` (10 minutes) for another one, then raises ``TreeLockError``.
* A save refuses (``InvalidParameterError``, nothing touched) a non-empty directory
  unless it holds one of our trees (a regular ``tree.json`` with our format marker) or
  only files this package writes there (the lock, temporary files, matrices, the CLI's
  ``.raptor-cache/``, the adapter's parameter file).
* Each file is written to a fresh temporary name (``.raptor-tmp-<random>.<name>``,
  created with ``O_EXCL | O_NOFOLLOW`` and mode ``0o666`` so the umask and default ACLs
  apply as for any new file), flushed, fsynced and renamed into place with
  ``os.replace``; ``tree.json``, which names the matrix, is replaced last and the
  directory fsynced.  A crash at any point leaves the old tree or the new one.
* Under the lock, a save first deletes temporary files left by a killed save (ours and
  those of earlier versions), and after the new ``tree.json`` is in place, the matrix the
  previous ``tree.json`` named and matrices orphaned by a killed save (recognised by a
  name that matches their own SHA-256).  It never deletes any other file.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import math
import mmap as mmap_module
import os
import re
import secrets
import stat
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
from numpy.lib import format as npy_format
from numpy.typing import NDArray

from raptor_core._version import __version__
from raptor_core.exceptions import (
    InvalidParameterError,
    TreeFormatError,
    TreeLockError,
    TreeSaveError,
)
from raptor_core.tree import (
    FORMAT_NAME,
    FORMAT_VERSION,
    Node,
    Tree,
    TreeVersionWarning,
    check_unit_rows,
)

if TYPE_CHECKING:
    from raptor_core.store.files import FileNodeStore

__all__ = [
    "CACHE_DIR",
    "INDEX_FILE",
    "LOCK_FILE",
    "LOCK_TIMEOUT_S",
    "MAX_DIM",
    "MAX_JSON_BYTES",
    "MAX_NPY_HEADER_BYTES",
    "MAX_VALUE_DEPTH",
    "TREE_FILE",
    "node_from_json",
    "read_tree",
    "write_tree",
]

logger = logging.getLogger(__name__)

TREE_FILE = "tree.json"
#: The node index written beside ``tree.json`` (see :mod:`raptor_core.store._index`).
INDEX_FILE = "tree.idx"
#: What our writer puts between the header and the first node of ``tree.json``.
NODES_OPENING = ',\n "nodes": [\n'
LOCK_FILE = ".raptor.lock"
#: The build cache ``raptor build --out DIR`` keeps in ``DIR`` (see raptor_core.cli).
CACHE_DIR = ".raptor-cache"
#: Largest ``tree.json`` read or written: about two million nodes of 1,000 characters.
MAX_JSON_BYTES = 2 * 1024**3
#: Largest embedding dimension (today's largest models use 4,096).
MAX_DIM = 65_536
#: Largest ``.npy`` header (ours is 128 bytes; numpy itself refuses headers over 10,000).
MAX_NPY_HEADER_BYTES = 64 * 1024
#: Deepest nesting inside ``params``, ``build_info`` and a node's ``metadata`` (the
#: mapping itself is level 1).
MAX_VALUE_DEPTH = 32
#: Seconds a save waits for another save into the same directory.
LOCK_TIMEOUT_S = 600.0

_TMP_PREFIX = ".raptor-tmp-"
_MATRIX_NAME = re.compile(r"embeddings-([0-9a-f]{16})\.npy")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# Temporary names of versions before the lock: ".tree.json.<mkstemp>.tmp" and the matrix's.
_LEGACY_TMP = re.compile(r"\.(tree\.json|embeddings-[0-9a-f]{16}\.npy)\.[a-z0-9_]{8}\.tmp")
# Our writer puts the marker and the matrix name first; a file that starts otherwise is
# parsed in full before it is called ours.
_OUR_HEAD = re.compile(rb'\A\s*\{\s*"format"\s*:\s*"raptor-tree"\s*,')
_HEAD_MATRIX = re.compile(rb'"embeddings"\s*:\s*\{\s*"file"\s*:\s*"(embeddings-[0-9a-f]{16}\.npy)"')
_HEAD_BYTES = 64 * 1024
# Largest tree.idx: its columns take about 70 bytes a node, plus the ids and metadata.
_MAX_INDEX_BYTES = 4 * MAX_JSON_BYTES
# A \uXXXX escape of a surrogate: decoded by json into a str that cannot be encoded.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_MAX_OFFSET = 2**53
_MAX_VERSION_CHARS = 64
_IO_BLOCK = 16 * 1024 * 1024
_DOC_KEYS = frozenset(
    {
        "format",
        "format_version",
        "raptor_core_version",
        "num_nodes",
        "embeddings",
        "content_sha256",
        "params",
        "build_info",
        "nodes",
    }
)
_MATRIX_KEYS = frozenset({"file", "shape", "dtype", "sha256"})
_NODE_KEYS = frozenset(
    {"id", "text", "layer", "token_count", "children", "doc_id", "span", "doc_ids", "metadata"}
)
_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)


# =================================================================================================
# reading
# =================================================================================================
def read_tree(path: str | os.PathLike[str], *, mmap: bool = False, verify: bool = True) -> Tree:
    """Load and validate the tree saved in directory ``path`` (see the module docstring).

    Args:
        path: the tree's directory.
        mmap: memory-map the matrix (read-only) instead of reading it into memory.
        verify: also compare both SHA-256 checksums (every other check runs either way).

    Raises:
        TreeFormatError: anything wrong with the directory or its files.
    """
    directory = Path(path)
    # A concurrent save may replace tree.json and delete the matrix it named between our
    # two opens; the new tree.json is then complete, so read again.
    for _ in range(3):
        try:
            return _read_once(directory, mmap=mmap, verify=verify)
        except _TreeReplacedError:
            continue
    # Saves keep coming (a loop, or a starved reader on a busy machine): read once more
    # while holding the save lock, which keeps them out.  Only a lock file that a save has
    # already created is used: a load never creates files, and a read-only directory (or
    # a lock we cannot open) leaves the error below.
    lock_path = directory / LOCK_FILE
    if not lock_path.is_symlink() and lock_path.is_file():
        from filelock import FileLock, Timeout

        try:
            with FileLock(lock_path, timeout=LOCK_TIMEOUT_S):
                return _read_once(directory, mmap=mmap, verify=verify)
        except (_TreeReplacedError, Timeout, OSError):
            pass
    msg = f"{directory}: the tree kept changing while it was read (a save loop?); try again"
    raise TreeFormatError(msg)


class _TreeReplacedError(Exception):
    """tree.json was replaced while it was read (internal: triggers a new attempt)."""


def _read_once(directory: Path, *, mmap: bool, verify: bool) -> Tree:
    tree_file = directory / TREE_FILE
    try:
        fd, st = _open_regular(tree_file, MAX_JSON_BYTES)
    except FileNotFoundError:
        msg = (
            f"no RAPTOR tree at {directory}: {TREE_FILE} not found (build one with `raptor build`)"
        )
        raise TreeFormatError(msg) from None
    try:
        with open(fd, "rb") as f:
            raw = f.read(st.st_size + 1)
    except OSError as exc:
        msg = f"cannot read {tree_file}: {exc}"
        raise TreeFormatError(msg) from exc
    document = _parse_json(raw, tree_file)
    del raw
    meta = _check_document(document, tree_file)
    # _warn_version, _read_once, read_tree, Tree.load, the caller
    _warn_version(document["raptor_core_version"], stacklevel=5)
    body = {k: document[k] for k in ("params", "build_info", "nodes")}
    if verify:
        try:
            content_ok = _sha256_json(body) == document["content_sha256"]
        except RecursionError:
            content_ok = False
        if not content_ok:
            msg = f"{tree_file} content does not match its checksum: the file was edited or damaged"
            raise TreeFormatError(msg)
    nodes = _nodes_from_json(document["nodes"])
    matrix_path = directory / meta.file
    try:
        emb = _read_matrix(matrix_path, meta, mmap=mmap, verify=verify)
    except FileNotFoundError:
        if _changed(tree_file, st):
            raise _TreeReplacedError from None
        msg = f"embedding matrix {meta.file} of {directory} is missing"
        raise TreeFormatError(msg) from None
    except OSError as exc:  # EIO and the like, after the file was opened
        msg = f"cannot read {matrix_path}: {exc}"
        raise TreeFormatError(msg) from exc
    try:
        return Tree(
            nodes=nodes, embeddings=emb, params=body["params"], build_info=body["build_info"]
        )
    except TreeFormatError as exc:
        msg = f"{tree_file}: {exc}"
        raise TreeFormatError(msg) from exc


def open_tree_lazily(directory: Path, *, verify: bool = True) -> FileNodeStore:
    """Open the tree in ``directory`` through its node index (see :mod:`raptor_core.store.files`).

    Raises:
        TreeFormatError: anything wrong with the directory or its files.
    """
    # A save writes tree.idx, then tree.json: an open between the two sees a new index
    # beside the old tree.json.  Try again, then under the save lock (which keeps saves
    # out), before taking the index for stale (an older version re-saved the tree).
    for _ in range(3):
        try:
            return _open_once(directory, verify=verify, stale_ok=False)
        except _TreeReplacedError:
            continue
    lock_path = directory / LOCK_FILE
    if not lock_path.is_symlink() and lock_path.is_file():
        from filelock import FileLock, Timeout

        try:
            with FileLock(lock_path, timeout=LOCK_TIMEOUT_S):
                return _open_once(directory, verify=verify, stale_ok=True)
        except (_TreeReplacedError, Timeout, OSError):
            pass
    try:
        return _open_once(directory, verify=verify, stale_ok=True)
    except _TreeReplacedError:
        msg = f"{directory}: the tree kept changing while it was opened (a save loop?); try again"
        raise TreeFormatError(msg) from None


def _open_once(directory: Path, *, verify: bool, stale_ok: bool) -> FileNodeStore:
    from raptor_core.store import files
    from raptor_core.store._index import read_index

    tree_file = directory / TREE_FILE
    try:
        fd, st = _open_regular(tree_file, MAX_JSON_BYTES)
    except FileNotFoundError:
        msg = (
            f"no RAPTOR tree at {directory}: {TREE_FILE} not found (build one with `raptor build`)"
        )
        raise TreeFormatError(msg) from None
    tree_json = open(fd, "rb")  # noqa: SIM115 - the store keeps it open to read nodes
    try:
        try:
            index_fd, _ = _open_regular(directory / INDEX_FILE, _MAX_INDEX_BYTES)
        except FileNotFoundError:
            tree_json.close()
            return files.fall_back(directory, f"it has no node index ({INDEX_FILE})", verify=verify)
        index, document = read_index(directory / INDEX_FILE, index_fd, tree_json, st.st_size)
        if index is None:
            tree_json.close()
            if _changed(tree_file, st) or not stale_ok:
                raise _TreeReplacedError
            reason = (
                f"its {INDEX_FILE} describes another {TREE_FILE} (re-saved by an older version?)"
            )
            return files.fall_back(directory, reason, verify=verify)
        meta = check_header(document, tree_file)
        if (meta.n, meta.dim, meta.file, meta.sha256) != (
            len(index.columns.ids),
            index.dim,
            index.matrix_file,
            index.matrix_sha256,
        ):
            msg = f"{directory / INDEX_FILE} does not describe the matrix {TREE_FILE} names"
            raise TreeFormatError(msg)
        _warn_version(document["raptor_core_version"], stacklevel=5)
        try:
            with open_matrix(directory / meta.file, meta) as (matrix_file, offset):
                return files.open_lazily(
                    index.columns,
                    index,
                    tree_json,
                    matrix_file,
                    offset,
                    params=document["params"],
                    build_info=document["build_info"],
                    verify=verify,
                )
        except FileNotFoundError:
            if _changed(tree_file, st):
                raise _TreeReplacedError from None
            msg = f"embedding matrix {meta.file} of {directory} is missing"
            raise TreeFormatError(msg) from None
        except OSError as exc:
            msg = f"cannot read {directory / meta.file}: {exc}"
            raise TreeFormatError(msg) from exc
    except BaseException:
        tree_json.close()
        raise


def _parse_head(head: bytes, path: Path) -> dict[str, Any]:
    """The fields of ``tree.json`` before its nodes, as our writer lays them out."""
    opening = NODES_OPENING.encode()
    if not head.endswith(opening):
        msg = f"{path} is not laid out as the node index says; re-save the tree"
        raise TreeFormatError(msg)
    document = _parse_json(head[: -len(opening)] + b"\n}", path)
    _check_marker(document, path)
    _exact_keys(document, _DOC_KEYS - {"nodes"}, f"{path}")
    return document


def _warn_version(saved_by: str, *, stacklevel: int) -> None:
    if saved_by != __version__:
        warnings.warn(
            f"tree saved by raptor_core {saved_by}, loading with {__version__}",
            TreeVersionWarning,
            stacklevel=stacklevel,
        )


class MatrixMeta:
    """Where the matrix is and what it must hold, as ``tree.json`` records it."""

    __slots__ = ("dim", "file", "n", "sha256")

    def __init__(self, file: str, n: int, dim: int, sha256: str) -> None:
        self.file, self.n, self.dim, self.sha256 = file, n, dim, sha256


def _open_regular(path: Path, max_bytes: int) -> tuple[int, os.stat_result]:
    """Open ``path`` read-only if it is a regular file of at most ``max_bytes``.

    ``FileNotFoundError`` passes through (callers give their own message).
    """
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            msg = f"{path} is a symbolic link; tree files must be regular files in the tree's directory"
            raise TreeFormatError(msg)
        # O_NOFOLLOW closes the gap between the lstat and the open; O_NONBLOCK keeps a FIFO
        # planted under the name from blocking the open.
        fd = os.open(path, _OPEN_FLAGS)
    except (FileNotFoundError, TreeFormatError):
        raise  # (a TreeFormatError is a ValueError: not to be wrapped again below)
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
            msg = f"{path} is a symbolic link; tree files must be regular files in the tree's directory"
        else:
            msg = f"cannot open {path}: {exc}"
        raise TreeFormatError(msg) from exc
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_size > max_bytes:
        problem = f"has {st.st_size} bytes, more than the {max_bytes} this format allows"
    if problem is not None:
        os.close(fd)
        msg = f"{path} {problem}"
        raise TreeFormatError(msg)
    return fd, st


def _changed(path: Path, before: os.stat_result) -> bool:
    try:
        now = os.lstat(path)
    except OSError:
        return True
    return (now.st_ino, now.st_mtime_ns, now.st_size) != (
        before.st_ino,
        before.st_mtime_ns,
        before.st_size,
    )


def _reject_constant(name: str) -> Any:
    msg = f"{name} is not a valid JSON number"
    raise ValueError(msg)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        msg = f"number {text[:40]} overflows to infinity"
        raise ValueError(msg)
    return value


def _parse_json(raw: bytes, path: Path) -> Any:
    try:
        text = raw.decode("utf-8")
        document = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError, NaN/Infinity and over-long integers.
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        msg = f"{path} is not valid JSON (truncated or edited?): {reason}"
        raise TreeFormatError(msg) from exc
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(document, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            msg = f"{path} holds a string with an unpaired UTF-16 surrogate (\\ud800-\\udfff)"
            raise TreeFormatError(msg) from exc
    return document


def _check_document(document: Any, path: Path) -> MatrixMeta:
    """Check the top level of ``tree.json``; return what locates the matrix."""
    _check_marker(document, path)
    _exact_keys(document, _DOC_KEYS, f"{path}")
    nodes, n = document["nodes"], document["num_nodes"]
    if type(nodes) is not list:
        _fail(path, "nodes", "a list", nodes)
    if type(n) is not int or n != len(nodes):
        _fail(path, "num_nodes", f"the number of nodes listed ({len(nodes)})", n)
    return check_header(document, path)


def _check_marker(document: Any, path: Path) -> None:
    if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
        msg = f"{path} is not a RAPTOR tree file (missing format marker {FORMAT_NAME!r})"
        raise TreeFormatError(msg)
    version = document.get("format_version")
    if type(version) is not int or not 1 <= version <= FORMAT_VERSION:
        msg = (
            f"{path} has format_version {_short(version)}; this raptor_core ({__version__}) "
            f"reads versions 1..{FORMAT_VERSION}: upgrade raptor-retriever or rebuild the tree"
        )
        raise TreeFormatError(msg)


def check_header(document: dict[str, Any], path: Path) -> MatrixMeta:
    """Check the fields of ``tree.json`` other than ``nodes``; return what locates the matrix.

    The format marker, version and keys are checked by the caller.
    """
    n = document["num_nodes"]
    if type(n) is not int or n < 0:
        _fail(path, "num_nodes", "a non-negative integer", n)
    saved_by = document["raptor_core_version"]
    if type(saved_by) is not str or len(saved_by) > _MAX_VERSION_CHARS:
        _fail(path, "raptor_core_version", "a short string", saved_by)
    for key in ("params", "build_info"):
        if type(document[key]) is not dict:
            _fail(path, key, "an object", document[key])
        if _too_deep(document[key], MAX_VALUE_DEPTH):
            _fail(path, key, f"nested at most {MAX_VALUE_DEPTH} levels deep", "deeper")
    if not _is_sha256(document["content_sha256"]):
        _fail(path, "content_sha256", "64 hex digits", document["content_sha256"])
    matrix = document["embeddings"]
    if type(matrix) is not dict:
        _fail(path, "embeddings", "an object", matrix)
    _exact_keys(matrix, _MATRIX_KEYS, f"{path}: 'embeddings'")
    sha, file, shape = matrix["sha256"], matrix["file"], matrix["shape"]
    if not _is_sha256(sha):
        _fail(path, "embeddings.sha256", "64 hex digits", sha)
    name = _MATRIX_NAME.fullmatch(file) if type(file) is str else None
    if name is None or name.group(1) != sha[:16]:
        _fail(path, "embeddings.file", f"'embeddings-{sha[:16]}.npy' (a name, not a path)", file)
    if matrix["dtype"] != "float32":
        _fail(path, "embeddings.dtype", "'float32'", matrix["dtype"])
    if not (type(shape) is list and len(shape) == 2 and all(type(s) is int for s in shape)):
        _fail(path, "embeddings.shape", "two integers", shape)
    rows, dim = shape
    min_dim = 1 if n else 0
    if rows != n or not min_dim <= dim <= MAX_DIM:
        _fail(path, "embeddings.shape", f"[{n}, d] with {min_dim} <= d <= {MAX_DIM}", shape)
    return MatrixMeta(file, n, dim, sha)


def _nodes_from_json(entries: list[Any]) -> tuple[Node, ...]:
    """Build every node of ``tree.json`` once, with its parents already filled in.

    ``Tree`` fills in missing parents by copying each node; computing them here from the
    children lists (each child's parents in row order, as ``Tree`` derives them) saves that
    second construction of every node.  ``Tree`` still checks them.
    """
    for i, entry in enumerate(entries):
        if not _valid_node(entry):
            _explain_node(entry, i)
    row = {entry["id"]: i for i, entry in enumerate(entries)}
    parents: dict[int, list[str]] = {}
    for entry in entries:
        for child in entry["children"]:
            found = row.get(child)
            if found is not None:  # an unknown child is reported by Tree
                parents.setdefault(found, []).append(entry["id"])
    return tuple(
        _node(entry, tuple(parents[i]) if i in parents else ()) for i, entry in enumerate(entries)
    )


def _node(data: dict[str, Any], parents: tuple[str, ...]) -> Node:
    span = data["span"]
    return Node(
        id=data["id"],
        text=data["text"],
        layer=data["layer"],
        token_count=data["token_count"],
        children=tuple(data["children"]),
        doc_id=data["doc_id"],
        span=None if span is None else (span[0], span[1]),
        doc_ids=tuple(data["doc_ids"]),
        metadata=data["metadata"],
        parents=parents,
    )


def node_from_json(data: Any, index: int | None = None) -> Node:
    """Build a :class:`Node` from its ``tree.json`` entry, checking every field.

    Args:
        data: the parsed JSON object.
        index: its position in ``nodes`` (for the message).

    Raises:
        TreeFormatError: a missing or unknown key, or a field of the wrong type or range.
    """
    if not _valid_node(data):
        _explain_node(data, index)
    return _node(data, ())


def _valid_node(data: Any) -> bool:
    """Whether a parsed node entry is well formed (one fast expression; see _explain_node)."""
    if type(data) is not dict or data.keys() != _NODE_KEYS:
        return False
    children, doc_id, span = data["children"], data["doc_id"], data["span"]
    doc_ids, metadata = data["doc_ids"], data["metadata"]
    # `type(x) is int` rather than isinstance: JSON true/false are not layer numbers.
    return (
        type(data["id"]) is str
        and type(data["text"]) is str
        and type(data["layer"]) is int
        and type(data["token_count"]) is int
        and type(children) is list
        and all(type(c) is str for c in children)
        and (doc_id is None or type(doc_id) is str)
        and type(doc_ids) is list
        and all(type(d) is str for d in doc_ids)
        and (
            span is None
            or (
                type(span) is list
                and len(span) == 2
                and type(span[0]) is int
                and type(span[1]) is int
                and 0 <= span[0] <= span[1] <= _MAX_OFFSET
            )
        )
        and type(metadata) is dict
        and not (metadata and _too_deep(metadata, MAX_VALUE_DEPTH))
    )


def _explain_node(data: Any, index: int | None) -> NoReturn:
    """Raise the TreeFormatError that says what is wrong with a node entry."""
    where = "node" if index is None else f"node {index}"
    if not isinstance(data, dict):
        _bad_node(where, f"must be an object, got {type(data).__name__}")
    _exact_keys(data, _NODE_KEYS, where)
    if type(data["id"]) is not str:
        _bad_node(where, f"'id' must be a string, got {_short(data['id'])}")
    where = f"node {data['id'][:80]!r}"
    for key, kind, expected in (
        ("text", str, "a string"),
        ("layer", int, "an integer"),
        ("token_count", int, "an integer"),
        ("metadata", dict, "an object"),
    ):
        if type(data[key]) is not kind:
            _bad_node(where, f"{key!r} must be {expected}, got {_short(data[key])}")
    for key in ("children", "doc_ids"):
        value = data[key]
        if type(value) is not list or not all(type(v) is str for v in value):
            _bad_node(where, f"{key!r} must be a list of strings, got {_short(value)}")
    if data["doc_id"] is not None and type(data["doc_id"]) is not str:
        _bad_node(where, f"'doc_id' must be a string or null, got {_short(data['doc_id'])}")
    if _too_deep(data["metadata"], MAX_VALUE_DEPTH):
        _bad_node(where, f"'metadata' is nested more than {MAX_VALUE_DEPTH} levels deep")
    _bad_node(
        where,
        f"'span' must be null or [start, end] with 0 <= start <= end <= 2**53, "
        f"got {_short(data['span'])}",
    )


def _read_matrix(path: Path, meta: MatrixMeta, *, mmap: bool, verify: bool) -> NDArray[np.float32]:
    """Read (or map) the matrix after checking its header and size; see the module docstring."""
    n, dim = meta.n, meta.dim
    with open_matrix(path, meta) as (f, offset):
        digest = hashlib.sha256() if verify else None
        if digest is not None:
            f.seek(0)
            digest.update(f.read(offset))
        emb = _map_rows(f, offset, n, dim, digest) if mmap else _read_rows(f, path, n, dim, digest)
    if digest is not None and digest.hexdigest() != meta.sha256:
        msg = f"{path} does not match its checksum: truncated or replaced"
        raise TreeFormatError(msg)
    emb.flags.writeable = False
    return emb


@contextmanager
def open_matrix(path: Path, meta: MatrixMeta) -> Iterator[tuple[io.BufferedReader, int]]:
    """Open the matrix file, check its ``.npy`` header and size; yield it and its data offset.

    ``FileNotFoundError`` passes through; every other problem is a ``TreeFormatError``.
    """
    n, dim = meta.n, meta.dim
    data_bytes = n * dim * 4
    fd, st = _open_regular(path, data_bytes + MAX_NPY_HEADER_BYTES)
    with open(fd, "rb") as f:
        try:
            version = npy_format.read_magic(f)
            if version == (1, 0):
                shape, fortran_order, dtype = npy_format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran_order, dtype = npy_format.read_array_header_2_0(f)
            else:
                msg = f"unsupported .npy format version {version}"
                raise ValueError(msg)
        except Exception as exc:
            # numpy's header reader raises ValueError, SyntaxError, tokenize.TokenError,
            # RecursionError, ... on hostile bytes: whatever it raises, the header is bad.
            msg = f"{path} is not a valid .npy file: {type(exc).__name__}: {str(exc)[:200]}"
            raise TreeFormatError(msg) from exc
        # Everything about the array is checked before it is allocated or mapped.
        if dtype != np.dtype("<f4") or dtype.str != "<f4" or fortran_order or shape != (n, dim):
            msg = (
                f"{path} holds a {_short(shape)} {dtype!s} array"
                f"{' in Fortran order' if fortran_order else ''}; this tree needs a "
                f"C-order little-endian float32 ({n}, {dim}) matrix"
            )
            raise TreeFormatError(msg)
        offset = f.tell()
        if st.st_size != offset + data_bytes:
            msg = (
                f"{path} has {st.st_size} bytes; its header and a ({n}, {dim}) float32 matrix "
                f"take {offset + data_bytes}: the file is truncated or padded"
            )
            raise TreeFormatError(msg)
        yield f, offset


def _map_rows(
    f: io.BufferedReader, offset: int, n: int, dim: int, digest: Any
) -> NDArray[np.float32]:
    if n * dim == 0:
        return np.zeros((n, dim), dtype=np.float32)
    mapped = mmap_module.mmap(f.fileno(), 0, access=mmap_module.ACCESS_READ)
    emb: NDArray[np.float32] = np.frombuffer(mapped, dtype="<f4", count=n * dim, offset=offset)
    emb = emb.reshape(n, dim)
    # Rows first: on a zero-filled (sparse) file this fails at once, before a full hash.
    check_unit_rows(emb)
    if digest is not None:
        view = memoryview(mapped)
        for start in range(offset, len(view), _IO_BLOCK):
            digest.update(view[start : start + _IO_BLOCK])
        view.release()
    return emb


def _read_rows(
    f: io.BufferedReader, path: Path, n: int, dim: int, digest: Any
) -> NDArray[np.float32]:
    # np.empty commits no memory until written, and every block is checked before the next
    # is read: memory grows only with rows that are really in the file and valid.
    try:
        emb = np.empty((n, dim), dtype=np.float32)
    except MemoryError as exc:  # a sparse file can claim any size
        msg = f"{path}: a ({n}, {dim}) matrix does not fit in memory; load with mmap=True"
        raise TreeFormatError(msg) from exc
    if n * dim == 0:
        return emb
    buffer = emb.reshape(-1).view(np.uint8).data
    row_bytes = dim * 4
    rows_per_block = max(1, _IO_BLOCK // row_bytes)
    for first in range(0, n, rows_per_block):
        last = min(n, first + rows_per_block)
        chunk = buffer[first * row_bytes : last * row_bytes]
        got = 0
        while got < len(chunk):
            read = f.readinto(chunk[got:])
            if not read:
                msg = f"{path} ended early (it changed while it was read?)"
                raise TreeFormatError(msg)
            got += read
        check_unit_rows(emb[first:last], first)
        if digest is not None:
            digest.update(chunk)
    buffer.release()
    return emb


def _exact_keys(obj: Mapping[str, Any], expected: frozenset[str], where: str) -> None:
    missing = sorted(expected - obj.keys())
    unknown = sorted(str(k) for k in obj if k not in expected)
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing)}")
        if unknown:
            parts.append(f"unknown {', '.join(repr(k[:40]) for k in unknown[:5])}")
        msg = f"{where}: {'; '.join(parts)} (not a file this version wrote, or edited)"
        raise TreeFormatError(msg)


def _fail(path: Path, field: str, expected: str, got: Any) -> NoReturn:
    msg = f"{path}: {field!r} must be {expected}, got {_short(got)}"
    raise TreeFormatError(msg)


def _bad_node(where: str, problem: str) -> NoReturn:
    msg = f"malformed {where}: {problem}"
    raise TreeFormatError(msg)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_sha256(value: Any) -> bool:
    return type(value) is str and _SHA256_HEX.fullmatch(value) is not None


def _too_deep(value: dict[str, Any] | list[Any], limit: int) -> bool:
    """Whether a parsed JSON container nests more than ``limit`` levels (itself = 1)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        container, depth = stack.pop()
        if depth > limit:
            return True
        items = container.values() if isinstance(container, dict) else container
        for item in items:
            if isinstance(item, dict | list) and item:
                stack.append((item, depth + 1))
    return False


def _sha256_json(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


# =================================================================================================
# writing
# =================================================================================================
def write_tree(
    tree: Tree, path: str | os.PathLike[str], *, extra_files: Mapping[str, bytes] | None = None
) -> Path:
    """Save ``tree`` (and ``extra_files``) into directory ``path``, atomically, under its lock.

    Args:
        tree: the tree.
        path: the directory (created if missing).
        extra_files: more files to write in the same locked save, before ``tree.json``
            (plain names, e.g. an adapter's parameter file), as ``{name: content}``.

    Returns:
        The directory.

    Raises:
        InvalidParameterError: ``path`` is a file or a foreign non-empty directory, or the
            tree holds values that cannot be stored.
        TreeLockError: another save held the directory for more than ``LOCK_TIMEOUT_S``.
        TreeSaveError: the disk refused a write; the tree saved there before still loads.
    """
    directory = Path(path)
    extras = dict(extra_files or {})
    for name in extras:
        _check_extra_name(name)
    # Serialise everything before touching the disk: a bad value fails with nothing written.
    matrix = np.ascontiguousarray(tree.embeddings, dtype="<f4")
    header = _npy_header(matrix)
    data: bytes | memoryview = matrix.reshape(-1).view(np.uint8).data if matrix.size else b""
    digest = hashlib.sha256(header)
    digest.update(data)
    sha = digest.hexdigest()
    matrix_name = f"embeddings-{sha[:16]}.npy"
    payload, head_bytes, line_bytes = _tree_json(tree, matrix_name, matrix.shape, sha)
    from raptor_core.store._index import index_bytes

    index = index_bytes(
        tree,
        payload,
        head_bytes=head_bytes,
        line_bytes=line_bytes,
        matrix_name=matrix_name,
        matrix_sha256=sha,
        matrix=matrix,
    )

    if directory.exists() and not directory.is_dir():
        msg = f"cannot save a tree to {directory}: it exists and is not a directory"
        raise InvalidParameterError(msg)
    _claim(directory, extras)  # before creating anything in a directory that is not ours
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory):
        previous = _claim(directory, extras)  # again, now that no other save can interfere
        try:
            _remove_leftovers(directory, extras)
            matrix_path = directory / matrix_name
            if not _holds(matrix_path, sha, len(header) + len(data)):
                _atomic_write(directory, matrix_name, (header, data))
            for name, content in extras.items():
                _atomic_write(directory, name, (content,))
            # The node index names the tree.json it describes (size and head hash), so a
            # reader that sees the new index beside the old tree.json falls back instead of
            # mixing them.
            _atomic_write(directory, INDEX_FILE, (index,))
            _atomic_write(directory, TREE_FILE, (payload,))
        except OSError as exc:
            # Every write goes through a temporary file and os.replace, and tree.json (which
            # names its matrix) is replaced last: the tree that was there still loads.
            msg = (
                f"could not save the tree into {directory}: {exc.strerror or exc}; the tree "
                "saved there before (if any) is unchanged and still loads; free space or fix "
                "the permissions, then save again"
            )
            error = TreeSaveError(msg)
            error.errno, error.strerror, error.filename = exc.errno, exc.strerror, exc.filename
            raise error from exc
        # The save is done: what follows only tidies up, and a failure must not report it
        # as failed (the next save removes what is left).
        try:
            _fsync_dir(directory)
            # Only now is the previous matrix unreferenced; a crash before this line keeps it.
            if previous is not None and previous != matrix_name:
                (directory / previous).unlink(missing_ok=True)
            _remove_orphan_matrices(directory, keep=matrix_name)
        except OSError as exc:
            logger.warning("saved the tree into %s, but could not tidy up: %s", directory, exc)
    return directory


def _npy_header(matrix: NDArray[np.float32]) -> bytes:
    """The ``.npy`` 1.0 header numpy's own ``np.save`` writes for ``matrix``."""
    buf = io.BytesIO()
    npy_format.write_array_header_1_0(buf, npy_format.header_data_from_array_1_0(matrix))
    return buf.getvalue()


def _tree_json(
    tree: Tree, matrix_name: str, shape: tuple[int, ...], sha: str
) -> tuple[bytes, int, NDArray[np.int64]]:
    """``tree.json``'s bytes, the length of its head and the length of each node's line."""
    body: dict[str, Any] = {
        "params": dict(tree.params),
        "build_info": dict(tree.build_info),
        "nodes": [node.to_dict() for node in tree.nodes],
    }
    try:
        # One round trip stores exactly what a load will see (tuples as lists, int keys as
        # strings), so the checksum written is the checksum a load computes.
        body = json.loads(json.dumps(body, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidParameterError(_unserialisable(tree, exc)) from exc
    for key in ("params", "build_info"):
        if _too_deep(body[key], MAX_VALUE_DEPTH):
            msg = (
                f"tree {key} nest more than {MAX_VALUE_DEPTH} levels deep; a load would refuse them"
            )
            raise InvalidParameterError(msg)
    for i, entry in enumerate(body["nodes"]):
        if not _valid_node(entry):  # never write what a load would refuse
            try:
                _explain_node(entry, i)
            except TreeFormatError as exc:
                msg = f"cannot save this tree: {exc}"
                raise InvalidParameterError(msg) from exc
    head = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "raptor_core_version": __version__,
        "num_nodes": len(tree.nodes),
        "embeddings": {
            "file": matrix_name,
            "shape": list(shape),
            "dtype": "float32",
            "sha256": sha,
        },
        "content_sha256": "",
        "params": body["params"],
        "build_info": body["build_info"],
    }
    try:
        head["content_sha256"] = _sha256_json(body)
        # Indented header, then one node per line: readable, and each node goes through
        # json's C encoder (an indented dump of the whole tree runs in pure Python, 5x slower).
        text = json.dumps(head, ensure_ascii=False, indent=1)
        head_bytes = f"{text[:-2]}{NODES_OPENING}".encode()
        lines = [json.dumps(node, ensure_ascii=False).encode() for node in body["nodes"]]
        payload = b"".join((head_bytes, b",\n".join(lines), b"\n ]\n}\n"))
    except UnicodeEncodeError as exc:
        msg = (
            f"cannot save this tree: a text or metadata string holds an unpaired surrogate ({exc})"
        )
        raise InvalidParameterError(msg) from exc
    if len(payload) > MAX_JSON_BYTES:
        msg = (
            f"this tree's {TREE_FILE} would take {len(payload)} bytes, more than the "
            f"{MAX_JSON_BYTES} a load accepts (raptor_core.store._format.MAX_JSON_BYTES)"
        )
        raise InvalidParameterError(msg)
    line_bytes = np.fromiter(map(len, lines), dtype=np.int64, count=len(lines))
    return payload, len(head_bytes), line_bytes


def _unserialisable(tree: Tree, exc: BaseException) -> str:
    for where, value in (("params", tree.params), ("build_info", tree.build_info)):
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as inner:
            return f"tree {where} is not JSON-serialisable: {inner}"
    for node in tree.nodes:
        try:
            json.dumps(node.to_dict(), allow_nan=False)
        except (TypeError, ValueError, RecursionError) as inner:
            return (
                f"node {node.id!r} is not JSON-serialisable (metadata must be plain JSON "
                f"values): {inner}"
            )
    return f"the tree is not JSON-serialisable: {exc}"


def _check_extra_name(name: str) -> None:
    reserved = (
        name in (TREE_FILE, INDEX_FILE, LOCK_FILE, CACHE_DIR)
        or name.startswith((".", _TMP_PREFIX))
        or _MATRIX_NAME.fullmatch(name) is not None
    )
    if reserved or not name or Path(name).name != name or "/" in name or "\\" in name:
        msg = f"extra file name {name!r} must be a plain file name not used by the tree format"
        raise InvalidParameterError(msg)


def _claim(directory: Path, extras: Mapping[str, bytes]) -> str | None:
    """Check that a save may write into ``directory``; return the matrix its tree names.

    Raises:
        InvalidParameterError: the directory holds files that are neither a RAPTOR tree nor
            files this package writes.
    """
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        msg = f"cannot save a tree to {directory}: it exists and is not a directory"
        raise InvalidParameterError(msg) from None
    names = {entry.name: entry for entry in entries}
    # A directory (or anything but a file or a link) where the format keeps a file would
    # make the save fail halfway, after tree.json was replaced for some of these names.
    blocking = sorted(
        name
        for name, entry in names.items()
        if (
            name in (TREE_FILE, INDEX_FILE, LOCK_FILE)
            or name in extras
            or _MATRIX_NAME.fullmatch(name) is not None
        )
        and not entry.is_file(follow_symlinks=False)
        and not entry.is_symlink()
    )
    if blocking:
        msg = (
            f"cannot save a tree to {directory}: {', '.join(map(repr, blocking))} must be a "
            "file but is not (a directory?); remove it, or save elsewhere"
        )
        raise InvalidParameterError(msg)
    if TREE_FILE in names:
        return _our_tree_json(directory)
    foreign = sorted(name for name, entry in names.items() if not _ours(entry, extras))
    if foreign:
        shown = ", ".join(repr(name) for name in foreign[:5])
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        msg = (
            f"refusing to save a tree into {directory}: it is not empty and holds no RAPTOR "
            f"tree ({shown}{more}); save into a new or empty directory"
        )
        raise InvalidParameterError(msg)
    return None


def _ours(entry: os.DirEntry[str], extras: Mapping[str, bytes]) -> bool:
    name = entry.name
    if name == CACHE_DIR:
        return entry.is_dir(follow_symlinks=False)
    return (
        name in (LOCK_FILE, INDEX_FILE)
        or name in extras
        or _is_leftover(name, extras)
        or _MATRIX_NAME.fullmatch(name) is not None
    )


def _is_leftover(name: str, extras: Mapping[str, bytes]) -> bool:
    """Whether ``name`` is a temporary file of an interrupted save (this version's or older)."""
    return (
        name.startswith(_TMP_PREFIX)
        or _LEGACY_TMP.fullmatch(name) is not None
        or any(name == f".{extra}.tmp" for extra in extras)
    )


def _our_tree_json(directory: Path) -> str | None:
    """The matrix an existing ``tree.json`` names; refuse a ``tree.json`` that is not ours."""
    path = directory / TREE_FILE
    refuse = (
        f"refusing to save a tree into {directory}: its {TREE_FILE} is not a RAPTOR tree; "
        "save into a new or empty directory"
    )
    try:
        fd, _ = _open_regular(path, MAX_JSON_BYTES)
    except (TreeFormatError, FileNotFoundError) as exc:
        raise InvalidParameterError(refuse) from exc
    with open(fd, "rb") as f:
        head = f.read(_HEAD_BYTES)
        if _OUR_HEAD.match(head):
            found = _HEAD_MATRIX.search(head)
            return found.group(1).decode("ascii") if found else None
        # Not laid out as we write it (reformatted by a tool?): decide on the parsed file.
        head += f.read()
    try:
        document = _parse_json(head, path)
    except TreeFormatError as exc:
        raise InvalidParameterError(refuse) from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
        raise InvalidParameterError(refuse)
    matrix = document.get("embeddings")
    file = matrix.get("file") if isinstance(matrix, dict) else None
    return file if isinstance(file, str) and _MATRIX_NAME.fullmatch(file) else None


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    from filelock import FileLock, Timeout

    lock_path = directory / LOCK_FILE
    if lock_path.is_symlink():
        msg = f"{lock_path} is a symbolic link; remove it (the lock must be a plain file)"
        raise InvalidParameterError(msg)
    lock = FileLock(lock_path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.warning(
            "another process is saving a tree into %s; waiting up to %.0f s",
            directory,
            LOCK_TIMEOUT_S,
        )
        try:
            lock.acquire(timeout=LOCK_TIMEOUT_S)
        except Timeout as exc:
            msg = (
                f"another process has been saving into {directory} for more than "
                f"{LOCK_TIMEOUT_S:.0f} s (lock {lock_path}); wait for it or save elsewhere"
            )
            raise TreeLockError(msg) from exc
    try:
        yield
    finally:
        lock.release()


def _remove_leftovers(directory: Path, extras: Mapping[str, bytes]) -> None:
    """Delete temporary files of interrupted saves (call with the lock held)."""
    removed = 0
    for entry in os.scandir(directory):
        if _is_leftover(entry.name, extras) and not entry.is_dir(follow_symlinks=False):
            Path(entry.path).unlink(missing_ok=True)
            removed += 1
    if removed:
        logger.info("removed %d temporary file(s) of an interrupted save in %s", removed, directory)


def _remove_orphan_matrices(directory: Path, *, keep: str) -> None:
    """Delete matrices a killed save left: named after their own SHA-256, so surely ours."""
    for entry in os.scandir(directory):
        found = _MATRIX_NAME.fullmatch(entry.name)
        if found is None or entry.name == keep or not entry.is_file(follow_symlinks=False):
            continue
        if _sha256_file(Path(entry.path)).startswith(found.group(1)):
            Path(entry.path).unlink(missing_ok=True)
            logger.info("removed %s, left by an interrupted save", entry.path)


def _holds(path: Path, sha: str, size: int) -> bool:
    """Whether ``path`` is a regular file with exactly this content (a re-save of one tree)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        return False
    return _sha256_file(path) == sha


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        fd, _ = _open_regular(path, 1 << 62)
    except (TreeFormatError, FileNotFoundError):
        return ""
    with open(fd, "rb") as f:
        while block := f.read(_IO_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _atomic_write(directory: Path, name: str, chunks: Iterable[bytes | memoryview]) -> None:
    """Write ``directory/name`` through a fresh temporary file, fsync, then ``os.replace``."""
    tmp = directory / f"{_TMP_PREFIX}{secrets.token_hex(8)}.{name}"
    flags = (
        os.O_WRONLY
        | os.O_CREAT
        | os.O_EXCL
        | getattr(os, "O_NOFOLLOW", 0)
        | getattr(os, "O_CLOEXEC", 0)
        | getattr(os, "O_BINARY", 0)
    )
    # 0o666: the kernel applies the umask (and default ACLs), as for any file the user creates.
    fd = os.open(tmp, flags, 0o666)
    try:
        with open(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / name)
    except BaseException:
        # Also on KeyboardInterrupt: never leave a half-written temp file behind.
        tmp.unlink(missing_ok=True)
        raise


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
