r"""The node index ``tree.idx``: what opening a saved tree lazily reads instead of ``tree.json``.

:meth:`~raptor_core.tree.Tree.save` writes it beside ``tree.json`` (format version 1, which
stays complete and authoritative: :meth:`~raptor_core.tree.Tree.load` never reads the
index).  :class:`~raptor_core.store.files.FileNodeStore` reads it to search a tree without
parsing every node: the structure comes from numpy columns, the matrix is memory-mapped,
and a node's JSON line is read from ``tree.json`` only when that node is returned.

Layout
------
::

    bytes 0..8     magic  b"RAPTIDX\\0"
    bytes 8..16    H, the header's length (little-endian uint64, at most 1 MiB)
    16..16+H       the header: a UTF-8 JSON object (below)
    then, from the next multiple of 8, the body:
        rec_start, rec_end   int64[n]   byte range of each node's line in tree.json
        child_ptr            int64[n+1] children of row r: child_rows[child_ptr[r]:child_ptr[r+1]]
        layer, tokens        int32[n]
        doc                  int32[n]   index into the doc ids (-1: none)
        meta                 int32[n]   index into the distinct metadata objects
        child_rows           int32[e]
        json_sha             32 bytes per block of tree.json (``block_bytes`` each)
        matrix_sha           32 bytes per block of matrix rows (``block_rows`` each)
        ids, docs, metas     UTF-8 JSON lists: node ids in row order, distinct doc ids,
                             distinct metadata objects

The header holds exactly ``format`` (``"raptor-tree-index"``), ``format_version`` (1),
``num_nodes``, ``num_edges``, ``dim``, ``tree_json`` (its ``size``, the length and SHA-256 of
its head, everything before the first node, and ``block_bytes``), ``matrix`` (``file``,
``sha256``, ``block_rows``), ``blobs`` (the byte lengths of the three lists) and
``body_sha256``.  Every section's type and length follows from those counts; the file must
be exactly as long as they say.

Reading: the same rules as tree.json
------------------------------------
The index is data from disk like ``tree.json`` (see :mod:`raptor_core.store._format` and
docs/security.md), and every problem with it is a ``TreeFormatError``:

* it is opened with the same flags (no symbolic link, FIFO or device) and is mapped, not
  read, so a sparse file claiming a huge body costs no memory;
* the header is parsed strictly (exact keys, exact types, bounded sizes) before anything is
  sized by it; the body's SHA-256 is checked before any column is used;
* the columns are then checked like a :class:`~raptor_core.tree.Tree`'s invariants
  (layers ``0..L-1`` none empty, children exactly one layer down and listed once, every
  summary has a child, token counts in range, byte ranges inside ``tree.json``, indexes
  inside their tables, unique ids), vectorised;
* the index describes one ``tree.json``: its size and the SHA-256 of its head must match
  the file beside it, otherwise the index is *stale* (an older version re-saved the tree)
  and the caller falls back to reading ``tree.json`` in full;
* blocks of ``tree.json`` and of the matrix are checked (SHA-256; rows also finite and
  unit-norm) the first time a node or row in them is used, and every node parsed from
  ``tree.json`` must agree with its columns (id, layer, token count, children, document,
  metadata).

Like the checksums of ``tree.json``, these digests detect accidents, not forgeries: whoever
can write the directory can describe a different valid tree.
"""

from __future__ import annotations

import hashlib
import json
import mmap as mmap_module
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from numpy.typing import NDArray

from raptor_core.exceptions import TreeFormatError
from raptor_core.tree import MAX_TOKEN_COUNT, Tree

__all__ = [
    "INDEX_FORMAT",
    "INDEX_VERSION",
    "JSON_BLOCK_BYTES",
    "MATRIX_BLOCK_BYTES",
    "MAX_HEAD_BYTES",
    "Columns",
    "IndexFile",
    "columns_from_tree",
    "index_bytes",
    "read_index",
]

MAGIC = b"RAPTIDX\x00"
INDEX_FORMAT = "raptor-tree-index"
INDEX_VERSION = 1
#: Largest index header (ours is under 1 KiB).
MAX_INDEX_HEADER_BYTES = 1024 * 1024
#: Largest head of ``tree.json`` (format fields, params, build_info) an index may describe.
MAX_HEAD_BYTES = 16 * 1024 * 1024
#: Bytes of ``tree.json`` per checked block: a node read checks about one 64 KiB block.
JSON_BLOCK_BYTES = 64 * 1024
#: Bytes of matrix rows per checked block.
MATRIX_BLOCK_BYTES = 1024 * 1024

_HEADER_KEYS = frozenset(
    {
        "format",
        "format_version",
        "num_nodes",
        "num_edges",
        "dim",
        "tree_json",
        "matrix",
        "blobs",
        "body_sha256",
    }
)
_TREE_JSON_KEYS = frozenset({"size", "head_bytes", "head_sha256", "block_bytes"})
_MATRIX_KEYS = frozenset({"file", "sha256", "block_rows"})
_BLOB_KEYS = frozenset({"ids", "docs", "metas"})
_HASH = 32
_IO_BLOCK = 16 * 1024 * 1024
# The lines of tree.json are joined by ",\n" (see _format._tree_json).
_SEPARATOR = 2


@dataclass(frozen=True, eq=False)
class Columns:
    """A tree's structure as arrays: what searching and filtering read.

    Attributes:
        layer: ``(n,)`` layer of each row.
        tokens: ``(n,)`` token count of each row.
        doc: ``(n,)`` index into ``docs`` of each row's ``doc_id`` (-1: None).
        meta: ``(n,)`` index into ``metas`` of each row's metadata.
        child_ptr: ``(n + 1,)`` CSR pointers of the children.
        child_rows: ``(e,)`` children rows, in each node's listed order.
        ids: node ids in row order.
        docs: distinct document ids.
        metas: distinct metadata objects.
    """

    layer: NDArray[np.int32]
    tokens: NDArray[np.int32]
    doc: NDArray[np.int32]
    meta: NDArray[np.int32]
    child_ptr: NDArray[np.int64]
    child_rows: NDArray[np.int32]
    ids: list[str]
    docs: list[str]
    metas: list[dict[str, Any]]


def columns_from_tree(tree: Tree) -> Columns:
    """The columns of a (valid) tree."""
    n = len(tree)
    ids = [node.id for node in tree.nodes]
    row = {node_id: i for i, node_id in enumerate(ids)}
    docs: dict[str, int] = {}
    metas: dict[str, int] = {}
    meta_values: list[dict[str, Any]] = []
    doc = np.empty(n, dtype=np.int32)
    meta = np.empty(n, dtype=np.int32)
    for i, node in enumerate(tree.nodes):
        doc[i] = -1 if node.doc_id is None else docs.setdefault(node.doc_id, len(docs))
        # Not sort_keys: metadata may mix int and str keys (JSON makes them all strings).
        key = json.dumps(dict(node.metadata), ensure_ascii=False, default=str)
        found = metas.get(key)
        if found is None:
            found = metas[key] = len(meta_values)
            meta_values.append(dict(node.metadata))
        meta[i] = found
    counts = np.fromiter((len(node.children) for node in tree.nodes), dtype=np.int64, count=n)
    child_ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=child_ptr[1:])
    child_rows = np.fromiter(
        (row[c] for node in tree.nodes for c in node.children),
        dtype=np.int32,
        count=int(child_ptr[-1]),
    )
    return Columns(
        layer=tree.layer_of_rows.astype(np.int32),
        tokens=tree.token_counts.astype(np.int32),
        doc=doc,
        meta=meta,
        child_ptr=child_ptr,
        child_rows=child_rows,
        ids=ids,
        docs=list(docs),
        metas=meta_values,
    )


def matrix_block_rows(dim: int) -> int:
    """Rows per checked block of a matrix of dimension ``dim``."""
    return max(1, MATRIX_BLOCK_BYTES // max(1, 4 * dim))


def index_bytes(
    tree: Tree,
    payload: bytes,
    *,
    head_bytes: int,
    line_bytes: NDArray[np.int64],
    matrix_name: str,
    matrix_sha256: str,
    matrix: NDArray[np.float32],
) -> bytes:
    """The content of ``tree.idx`` for ``tree`` saved as ``payload`` (its ``tree.json``)."""
    cols = columns_from_tree(tree)
    n = len(tree)
    rec_start = np.full(n, head_bytes, dtype=np.int64)
    if n:
        rec_start[1:] += np.cumsum(line_bytes[:-1] + _SEPARATOR)
    rec_end = rec_start + line_bytes
    json_sha = b"".join(
        hashlib.sha256(payload[start : start + JSON_BLOCK_BYTES]).digest()
        for start in range(0, len(payload), JSON_BLOCK_BYTES)
    )
    dim = int(matrix.shape[1])
    block_rows = matrix_block_rows(dim)
    flat = matrix.reshape(-1).view(np.uint8) if matrix.size else np.zeros(0, np.uint8)
    step = max(1, block_rows * dim * 4)
    matrix_sha = b"".join(
        hashlib.sha256(flat[start : start + step].data).digest()
        for start in range(0, n * dim * 4, step)
    )
    blobs = [
        json.dumps(value, ensure_ascii=False).encode()
        for value in (cols.ids, cols.docs, cols.metas)
    ]
    body = b"".join(
        [
            rec_start.astype("<i8").tobytes(),
            rec_end.astype("<i8").tobytes(),
            cols.child_ptr.astype("<i8").tobytes(),
            cols.layer.astype("<i4").tobytes(),
            cols.tokens.astype("<i4").tobytes(),
            cols.doc.astype("<i4").tobytes(),
            cols.meta.astype("<i4").tobytes(),
            cols.child_rows.astype("<i4").tobytes(),
            json_sha,
            matrix_sha,
            *blobs,
        ]
    )
    header = {
        "format": INDEX_FORMAT,
        "format_version": INDEX_VERSION,
        "num_nodes": n,
        "num_edges": len(cols.child_rows),
        "dim": dim,
        "tree_json": {
            "size": len(payload),
            "head_bytes": head_bytes,
            "head_sha256": hashlib.sha256(payload[:head_bytes]).hexdigest(),
            "block_bytes": JSON_BLOCK_BYTES,
        },
        "matrix": {"file": matrix_name, "sha256": matrix_sha256, "block_rows": block_rows},
        "blobs": {"ids": len(blobs[0]), "docs": len(blobs[1]), "metas": len(blobs[2])},
        "body_sha256": hashlib.sha256(body).hexdigest(),
    }
    text = json.dumps(header).encode()
    padded = text + b" " * (-(16 + len(text)) % 8)
    return b"".join((MAGIC, len(padded).to_bytes(8, "little"), padded, body))


# =================================================================================================
# reading
# =================================================================================================
@dataclass(frozen=True, eq=False)
class IndexFile:
    """A checked ``tree.idx``: its columns and what locates the nodes and rows it indexes."""

    columns: Columns
    rec_start: NDArray[np.int64]
    rec_end: NDArray[np.int64]
    json_sha: NDArray[np.uint8]
    matrix_sha: NDArray[np.uint8]
    json_block_bytes: int
    matrix_block_rows: int
    head_bytes: int
    matrix_file: str
    matrix_sha256: str
    dim: int
    parent_ptr: NDArray[np.int64]
    parent_rows: NDArray[np.int64]


def read_index(
    path: Path, fd: int, tree_json: Any, tree_size: int
) -> tuple[IndexFile | None, dict[str, Any]]:
    """Read and check the index open at ``fd`` (closed here) against ``tree_json``.

    Args:
        path: the index file (for messages).
        fd: its open descriptor (a regular file, opened by the caller).
        tree_json: the open ``tree.json`` (a binary file).
        tree_size: its size.

    Returns:
        The index (None when it describes another ``tree.json``: stale) and the fields of
        ``tree.json`` before its nodes (format checked; the caller checks the rest).

    Raises:
        TreeFormatError: the index is malformed or damaged.
    """
    with open(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 16:
            _bad(path, "it is shorter than its fixed header")
        first = f.read(16)
        if first[:8] != MAGIC:
            _bad(path, "it does not start with the index marker")
        header_len = int.from_bytes(first[8:16], "little")
        if not 2 <= header_len <= MAX_INDEX_HEADER_BYTES or (16 + header_len) % 8:
            _bad(path, f"its header length {header_len} is out of range")
        header = _parse_header(path, f.read(header_len))
        tree_meta = header["tree_json"]
        if tree_meta["size"] != tree_size:
            return None, {}
        tree_json.seek(0)
        head = tree_json.read(tree_meta["head_bytes"])
        if hashlib.sha256(head).hexdigest() != tree_meta["head_sha256"]:
            return None, {}
        from raptor_core.store._format import TREE_FILE, _parse_head

        document = _parse_head(head, path.with_name(TREE_FILE))
        n, e = header["num_nodes"], header["num_edges"]
        # Bounded by tree.json before anything is sized by them: a node takes over 100
        # bytes there, a child id at least 3 and every table is a part of it.
        if n != document["num_nodes"] or n > tree_size // 64 or e > tree_size // 3:
            _bad(path, "its node or edge count does not fit its tree.json")
        if any(v > tree_size for v in header["blobs"].values()):
            _bad(path, "a table is larger than its tree.json")
        blobs = header["blobs"]
        n_json = -(-tree_size // tree_meta["block_bytes"])
        n_matrix = -(-n // header["matrix"]["block_rows"])
        sizes = [8 * n, 8 * n, 8 * (n + 1), 4 * n, 4 * n, 4 * n, 4 * n, 4 * e]
        sizes += [_HASH * n_json, _HASH * n_matrix, blobs["ids"], blobs["docs"], blobs["metas"]]
        start = 16 + header_len
        if size != start + sum(sizes):
            _bad(path, f"it has {size} bytes; its header describes {start + sum(sizes)}")
        if size == start:
            body: Any = b""
        else:
            # Mapped, not read: memory follows the pages really touched, and a sparse file
            # fails its checksum without ever being held in memory.
            body = mmap_module.mmap(f.fileno(), 0, access=mmap_module.ACCESS_READ)
    view = memoryview(body)[start:]
    digest = hashlib.sha256()
    for offset in range(0, len(view), _IO_BLOCK):
        digest.update(view[offset : offset + _IO_BLOCK])
    if digest.hexdigest() != header["body_sha256"]:
        _bad(path, "its content does not match its checksum (damaged)")
    parts: list[Any] = []
    offset = 0
    dtypes = ["<i8", "<i8", "<i8", "<i4", "<i4", "<i4", "<i4", "<i4", "u1", "u1"]
    for nbytes, dtype in zip(sizes, dtypes, strict=False):
        parts.append(
            np.frombuffer(
                view, dtype=dtype, count=nbytes // np.dtype(dtype).itemsize, offset=offset
            )
            if nbytes
            else np.zeros(0, dtype)
        )
        offset += nbytes
    texts = []
    for nbytes in sizes[len(dtypes) :]:
        texts.append(_parse_list(path, bytes(view[offset : offset + nbytes])))
        offset += nbytes
    rec_start, rec_end, child_ptr, layer, tokens, doc, meta, child_rows, json_sha, matrix_sha = (
        parts
    )
    ids, docs, metas = texts
    cols = Columns(
        layer=layer,
        tokens=tokens,
        doc=doc,
        meta=meta,
        child_ptr=child_ptr,
        child_rows=child_rows,
        ids=ids,
        docs=docs,
        metas=metas,
    )
    parent_ptr, parent_rows = _check_columns(path, cols, n)
    _check_records(path, rec_start, rec_end, tree_meta["head_bytes"], tree_size)
    index = IndexFile(
        columns=cols,
        rec_start=rec_start,
        rec_end=rec_end,
        json_sha=json_sha.reshape(n_json, _HASH),
        matrix_sha=matrix_sha.reshape(n_matrix, _HASH),
        json_block_bytes=tree_meta["block_bytes"],
        matrix_block_rows=header["matrix"]["block_rows"],
        head_bytes=tree_meta["head_bytes"],
        matrix_file=header["matrix"]["file"],
        matrix_sha256=header["matrix"]["sha256"],
        dim=header["dim"],
        parent_ptr=parent_ptr,
        parent_rows=parent_rows,
    )
    return index, document


def _parse_header(path: Path, raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        _bad(path, f"its header is not valid JSON ({str(exc)[:100]})")
    if type(header) is not dict or header.keys() != _HEADER_KEYS:
        _bad(path, "its header does not have the keys of this format")
    if header["format"] != INDEX_FORMAT or header["format_version"] != INDEX_VERSION:
        _bad(path, f"it is not a {INDEX_FORMAT} version {INDEX_VERSION} file")
    tree_meta, matrix, blobs = header["tree_json"], header["matrix"], header["blobs"]
    shapes = (
        (tree_meta, _TREE_JSON_KEYS),
        (matrix, _MATRIX_KEYS),
        (blobs, _BLOB_KEYS),
    )
    if not all(type(part) is dict and part.keys() == keys for part, keys in shapes):
        _bad(path, "its header does not have the keys of this format")
    numbers = [
        header["num_nodes"],
        header["num_edges"],
        header["dim"],
        tree_meta["size"],
        tree_meta["head_bytes"],
        tree_meta["block_bytes"],
        matrix["block_rows"],
        *blobs.values(),
    ]
    if not all(type(x) is int and 0 <= x < 2**62 for x in numbers):
        _bad(path, "its header holds a count that is not a non-negative integer")
    if not 1 <= tree_meta["head_bytes"] <= min(MAX_HEAD_BYTES, tree_meta["size"]):
        _bad(path, "its tree.json head length is out of range")
    if tree_meta["block_bytes"] < 1 or matrix["block_rows"] < 1:
        _bad(path, "its block sizes must be positive")
    hexes = (tree_meta["head_sha256"], matrix["sha256"], header["body_sha256"])
    if not all(
        type(h) is str and len(h) == 64 and set(h) <= set("0123456789abcdef") for h in hexes
    ):
        _bad(path, "its checksums must be 64 hex digits")
    if type(matrix["file"]) is not str:
        _bad(path, "its matrix file name must be a string")
    return header


def _parse_list(path: Path, raw: bytes) -> list[Any]:
    try:
        value = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        _bad(path, f"a table is not valid JSON ({str(exc)[:100]})")
    if type(value) is not list:
        _bad(path, "a table is not a JSON list")
    return value


def _check_columns(
    path: Path, cols: Columns, n: int
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Check the :class:`~raptor_core.tree.Tree` invariants on the columns (vectorised).

    Returns:
        The parents as CSR arrays (see :func:`parent_index`).
    """
    from raptor_core.store._format import MAX_VALUE_DEPTH, _too_deep

    ids, docs, metas = cols.ids, cols.docs, cols.metas
    if len(ids) != n or not set(map(type, ids)) <= {str}:
        _bad(path, f"its id table must hold {n} strings")
    # A set, not the id -> row map: that costs 2.5 times as much, and collapsed search
    # never needs it (the store builds it on first use).
    if len(set(ids)) != n:
        _bad(path, "its node ids are not unique")
    if not set(map(type, docs)) <= {str}:
        _bad(path, "its document table must hold strings")
    if not all(type(m) is dict and not (m and _too_deep(m, MAX_VALUE_DEPTH)) for m in metas):
        _bad(path, "its metadata table must hold objects nested at most 32 levels deep")
    layer = cols.layer
    if n:
        if int(layer.min()) < 0 or int(layer.max()) >= n:
            _bad(path, "a node's layer is out of range")
        if np.any(np.bincount(layer) == 0):
            _bad(path, "a layer is empty")
    if n and (int(cols.tokens.min()) < 0 or int(cols.tokens.max()) > MAX_TOKEN_COUNT):
        _bad(path, "a token count is out of range")
    if n and (int(cols.doc.min()) < -1 or int(cols.doc.max()) >= len(docs)):
        _bad(path, "a document index is out of range")
    if n and (int(cols.meta.min()) < 0 or int(cols.meta.max()) >= len(metas)):
        _bad(path, "a metadata index is out of range")
    ptr, child = cols.child_ptr, cols.child_rows
    counts = np.diff(ptr)
    if int(ptr[0]) != 0 or int(ptr[-1]) != child.size or np.any(counts < 0):
        _bad(path, "its children pointers are not a valid CSR index")
    if child.size and (int(child.min()) < 0 or int(child.max()) >= n):
        _bad(path, "a child row is out of range")
    parents = np.repeat(np.arange(n, dtype=np.int64), counts)
    if np.any(layer[child] != layer[parents] - 1):
        _bad(path, "a child is not exactly one layer below its parent")
    if np.any((layer > 0) & (counts == 0)):
        _bad(path, "a node above layer 0 has no children")
    ptr, parent_rows = parent_index(cols)
    # Each child's parents come sorted: a parent repeated for one child lists it twice.
    of_child = np.repeat(np.arange(n), np.diff(ptr))
    same = (of_child[1:] == of_child[:-1]) & (parent_rows[1:] == parent_rows[:-1])
    if np.any(same):
        _bad(path, "a node lists a child more than once")
    return ptr, parent_rows


#: What our writer puts between two node lines of tree.json, and after the last one.
_NODE_SEPARATOR = len(b",\n")
_NODES_CLOSING = len(b"\n ]\n}\n")


def _check_records(
    path: Path, start: NDArray[np.int64], end: NDArray[np.int64], head: int, size: int
) -> None:
    """Each node's byte range must be exactly its line of tree.json, in order.

    Lying inside the nodes is not enough: a range may point at any JSON object there, a
    node's own metadata included, and the store would then serve a text that Tree.load
    (and ``raptor inspect``) never shows.  Our writer lays the lines end to end, each
    followed by a separator, so the ranges must tile the node area exactly.
    """
    if start.size == 0:
        if size != head + _NODES_CLOSING:
            _bad(path, "tree.json holds nodes that the index does not list")
        return
    if (
        int(start[0]) != head
        or np.any(end <= start)
        or np.any(start[1:] != end[:-1] + _NODE_SEPARATOR)
        or int(end[-1]) + _NODES_CLOSING != size
    ):
        _bad(path, "its byte ranges are not tree.json's node lines, one after another")


def _no_constant(name: str) -> NoReturn:
    msg = f"{name} is not a valid JSON number"
    raise ValueError(msg)


def _bad(path: Path, problem: str) -> NoReturn:
    msg = (
        f"{path} is not a valid node index: {problem}; delete it to open the tree by reading "
        "tree.json in full, or re-save the tree (Tree.load(path).save(path)) to rewrite it"
    )
    raise TreeFormatError(msg)


def parent_index(cols: Columns) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """The parents of each row as CSR arrays (ptr, rows), each child's parents in row order."""
    n = cols.layer.shape[0]
    counts = np.diff(cols.child_ptr)
    parents = np.repeat(np.arange(n, dtype=np.int64), counts)
    # parents is ascending, so a stable sort by child keeps each child's parents in row order.
    order = np.argsort(cols.child_rows, kind="stable")
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(cols.child_rows, minlength=n), out=ptr[1:])
    return ptr, parents[order]


def meta_flags(metas: Sequence[Mapping[str, Any]]) -> NDArray[np.bool_]:
    """Whether each distinct metadata object marks a carried copy."""
    return np.fromiter((m.get("carried") is True for m in metas), dtype=np.bool_, count=len(metas))
