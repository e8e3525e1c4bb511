"""The immutable RAPTOR tree and its plain-file persistence.

A :class:`Tree` is a flat tuple of :class:`Node` objects plus one embedding
matrix whose row ``i`` belongs to ``nodes[i]``.  Layer 0 holds the leaf chunks;
layer ``l > 0`` holds summaries whose children live in lower layers.

On disk a tree is a directory::

    tree.json                 nodes, build parameters, format version, checksums
    embeddings-<sha>.npy      the (n, d) float32 matrix, loaded with allow_pickle=False

Saving is atomic: the new matrix gets a new file name, and ``tree.json`` (which
names the matrix and its SHA-256) is swapped in with ``os.replace`` last.  A
crash at any point leaves either the old tree or the new tree, never a mix.
Nothing is ever pickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core._version import __version__
from raptor_core.exceptions import InvalidParameterError, TreeFormatError

__all__ = ["FORMAT_VERSION", "Node", "Tree", "TreeVersionWarning"]

FORMAT_NAME = "raptor-tree"
FORMAT_VERSION = 1
_TREE_FILE = "tree.json"
_EMB_PREFIX = "embeddings-"


class TreeVersionWarning(UserWarning):
    """The tree was saved by another version of raptor_core."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    """One node of the tree.

    Attributes:
        id: unique within the tree.
        text: the chunk text (layer 0) or the summary text (layer > 0).
        layer: 0 for leaves, 1 for summaries of leaves, and so on.
        children: ids of the nodes this one summarises (empty for leaves).
        token_count: tokens in ``text`` according to the build's tokenizer.
        doc_id: the source document of a leaf; ``None`` for summaries.
        span: ``(start, end)`` character offsets of a leaf in its document.
        doc_ids: the documents this node covers (a leaf covers its own).
        metadata: the document's user metadata for leaves; empty for summaries.
    """

    id: str
    text: str
    layer: int
    token_count: int
    children: tuple[str, ...] = ()
    doc_id: str | None = None
    span: tuple[int, int] | None = None
    doc_ids: tuple[str, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_leaf(self) -> bool:
        """Whether this node is a chunk of a document (layer 0)."""
        return self.layer == 0

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict (the on-disk form)."""
        return {
            "id": self.id,
            "text": self.text,
            "layer": self.layer,
            "token_count": self.token_count,
            "children": list(self.children),
            "doc_id": self.doc_id,
            "span": list(self.span) if self.span is not None else None,
            "doc_ids": list(self.doc_ids),
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Node:
        """Inverse of :meth:`to_dict`; raises :class:`TreeFormatError` on a malformed entry."""
        try:
            span = data["span"]
            node = cls(
                id=str(data["id"]),
                text=_expect(data["text"], str, "text"),
                layer=_expect(data["layer"], int, "layer"),
                token_count=_expect(data["token_count"], int, "token_count"),
                children=tuple(_expect(c, str, "children") for c in data["children"]),
                doc_id=data["doc_id"] if data["doc_id"] is None else str(data["doc_id"]),
                span=None if span is None else (int(span[0]), int(span[1])),
                doc_ids=tuple(str(d) for d in data["doc_ids"]),
                metadata=dict(_expect(data["metadata"], dict, "metadata")),
            )
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            msg = f"malformed node entry {str(data)[:120]!r}: {exc}"
            raise TreeFormatError(msg) from exc
        return node


def _expect(value: Any, kind: type, name: str) -> Any:
    # bool is an int subclass; a layer of `true` is still an edited file.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        msg = f"field {name!r} should be {kind.__name__}, got {type(value).__name__}"
        raise TypeError(msg)
    return value


@dataclass(frozen=True, eq=False, kw_only=True)
class Tree:
    """An immutable RAPTOR tree.

    Attributes:
        nodes: every node, in embedding-row order (layer-major when built by TreeBuilder).
        embeddings: ``(len(nodes), d)`` float32, unit-normalised rows, read-only.
        params: how the tree was built (JSON-serialisable), see ``TreeBuilder.get_params``.
        build_info: what building it took: timings, calls, tokens per layer.

    Examples:
        >>> import numpy as np
        >>> leaf = Node(id="a", text="hello", layer=0, token_count=1, doc_id="d", doc_ids=("d",))
        >>> tree = Tree(nodes=(leaf,), embeddings=np.ones((1, 2), dtype=np.float32) / np.sqrt(2))
        >>> tree.num_layers, tree.node("a").text
        (1, 'hello')
    """

    nodes: tuple[Node, ...]
    embeddings: NDArray[np.float32]
    params: Mapping[str, Any] = field(default_factory=dict)
    build_info: Mapping[str, Any] = field(default_factory=dict)
    _row: dict[str, int] = field(init=False, repr=False)
    _parents: dict[str, tuple[str, ...]] = field(init=False, repr=False)
    _layers: tuple[NDArray[np.intp], ...] = field(init=False, repr=False)
    _layer_of: NDArray[np.intp] = field(init=False, repr=False)
    _tokens: NDArray[np.int64] = field(init=False, repr=False)
    _carried: NDArray[np.bool_] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        nodes = tuple(self.nodes)
        emb = np.asarray(self.embeddings)
        if emb.ndim != 2 or emb.shape[0] != len(nodes):
            msg = f"embeddings must have shape ({len(nodes)}, d), got {emb.shape}"
            raise TreeFormatError(msg)
        if emb.dtype != np.float32:
            emb = emb.astype(np.float32)
        if emb.flags.writeable:
            # The tree is immutable; copy so a caller's array cannot change it later.
            emb = emb.copy()
            emb.flags.writeable = False
        row: dict[str, int] = {}
        for i, node in enumerate(nodes):
            if node.id in row:
                msg = f"duplicate node id {node.id!r}"
                raise TreeFormatError(msg)
            row[node.id] = i
        parents: dict[str, list[str]] = {}
        for node in nodes:
            if node.layer < 0:
                msg = f"node {node.id!r} has negative layer {node.layer}"
                raise TreeFormatError(msg)
            for child in node.children:
                child_row = row.get(child)
                if child_row is None:
                    msg = f"node {node.id!r} lists unknown child {child!r}"
                    raise TreeFormatError(msg)
                if nodes[child_row].layer >= node.layer:
                    msg = f"node {node.id!r} (layer {node.layer}) has child {child!r} not below it"
                    raise TreeFormatError(msg)
                parents.setdefault(child, []).append(node.id)
        layer_of = np.fromiter((n.layer for n in nodes), dtype=np.intp, count=len(nodes))
        n_layers = int(layer_of.max()) + 1 if len(nodes) else 0
        layers = tuple(np.flatnonzero(layer_of == lvl) for lvl in range(n_layers))
        for lvl, rows in enumerate(layers):
            if rows.size == 0:
                msg = f"layer {lvl} is empty but layer {n_layers - 1} is not"
                raise TreeFormatError(msg)
            rows.flags.writeable = False
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "embeddings", emb)
        object.__setattr__(self, "params", dict(self.params))
        object.__setattr__(self, "build_info", dict(self.build_info))
        object.__setattr__(self, "_row", row)
        object.__setattr__(self, "_parents", {k: tuple(v) for k, v in parents.items()})
        object.__setattr__(self, "_layers", layers)
        tokens = np.fromiter((n.token_count for n in nodes), dtype=np.int64, count=len(nodes))
        layer_of.flags.writeable = False
        tokens.flags.writeable = False
        object.__setattr__(self, "_layer_of", layer_of)
        object.__setattr__(self, "_tokens", tokens)
        carried = np.fromiter(
            (
                len(n.children) == 1
                and n.metadata.get("carried") is True
                and n.text == nodes[row[n.children[0]]].text
                for n in nodes
            ),
            dtype=np.bool_,
            count=len(nodes),
        )
        carried.flags.writeable = False
        object.__setattr__(self, "_carried", carried)

    # -- shape ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._row

    def __repr__(self) -> str:
        sizes = ", ".join(str(len(rows)) for rows in self._layers)
        return f"Tree(nodes={len(self.nodes)}, layers=[{sizes}], dim={self.dim})"

    @property
    def dim(self) -> int:
        """Embedding dimension (0 for an empty tree built without an embedder)."""
        return int(self.embeddings.shape[1])

    @property
    def num_layers(self) -> int:
        """Number of layers, leaves included (0 for an empty tree)."""
        return len(self._layers)

    @property
    def top_layer(self) -> int:
        """Index of the highest layer (-1 for an empty tree)."""
        return len(self._layers) - 1

    @property
    def leaves(self) -> tuple[Node, ...]:
        """Layer-0 nodes."""
        return self.layer(0) if self._layers else ()

    @property
    def doc_ids(self) -> tuple[str, ...]:
        """Ids of the documents in the tree, in first-seen order."""
        seen: dict[str, None] = {}
        for node in self.leaves:
            if node.doc_id is not None:
                seen.setdefault(node.doc_id, None)
        return tuple(seen)

    # -- lookup --------------------------------------------------------------------------------
    def node(self, node_id: str) -> Node:
        """Return the node with this id; ``KeyError`` if there is none."""
        return self.nodes[self._row[node_id]]

    def row(self, node_id: str) -> int:
        """Return the embedding row of a node."""
        return self._row[node_id]

    def rows(self, node_ids: Sequence[str]) -> NDArray[np.intp]:
        """Return the embedding rows of several nodes."""
        return np.fromiter((self._row[i] for i in node_ids), dtype=np.intp, count=len(node_ids))

    def layer_rows(self, layer: int) -> NDArray[np.intp]:
        """Embedding rows of the nodes of one layer (read-only)."""
        if not 0 <= layer < len(self._layers):
            msg = f"layer must be in [0, {self.top_layer}], got {layer}"
            raise InvalidParameterError(msg)
        return self._layers[layer]

    def layer(self, layer: int) -> tuple[Node, ...]:
        """The nodes of one layer."""
        return tuple(self.nodes[i] for i in self.layer_rows(layer))

    def children(self, node_id: str) -> tuple[Node, ...]:
        """The nodes that ``node_id`` summarises."""
        return tuple(self.nodes[self._row[c]] for c in self.node(node_id).children)

    def parents(self, node_id: str) -> tuple[Node, ...]:
        """The summaries that include ``node_id`` (several under soft clustering)."""
        return tuple(self.nodes[self._row[p]] for p in self._parents.get(node_id, ()))

    def ancestors(self, node_id: str) -> tuple[Node, ...]:
        """Every node above ``node_id`` (parents, their parents, …), nearest layers first."""
        seen: dict[str, None] = {}
        frontier = [node_id]
        while frontier:
            nxt: list[str] = []
            for nid in frontier:
                for parent in self._parents.get(nid, ()):
                    if parent not in seen:
                        seen[parent] = None
                        nxt.append(parent)
            frontier = nxt
        return tuple(sorted((self.node(i) for i in seen), key=lambda n: n.layer))

    def leaf_descendants(self, node_id: str) -> tuple[Node, ...]:
        """The leaves under a node (the node itself if it is a leaf), in tree order."""
        found: set[int] = set()
        stack = [node_id]
        while stack:
            nid = stack.pop()
            node = self.node(nid)
            if node.is_leaf:
                found.add(self._row[nid])
            else:
                stack.extend(node.children)
        return tuple(self.nodes[i] for i in sorted(found))

    @property
    def layer_of_rows(self) -> NDArray[np.intp]:
        """``(n,)`` layer of each row, for vectorised filtering (read-only)."""
        return self._layer_of

    @property
    def carried_mask(self) -> NDArray[np.bool_]:
        """``(n,)`` True for nodes that carry their only child up unchanged (read-only).

        TreeBuilder does not summarise a single-member cluster: it copies the member into the
        next layer so that every branch reaches the top.  Retrieval skips these copies, which
        would otherwise take a second slot with the same text.
        """
        return self._carried

    @property
    def token_counts(self) -> NDArray[np.int64]:
        """``(n,)`` token count of each row (read-only)."""
        return self._tokens

    # -- persistence ---------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the tree to directory ``path`` atomically and return the path.

        Other files in the directory (for example a build cache) are left alone.
        """
        directory = Path(path)
        if directory.exists() and not directory.is_dir():
            msg = f"cannot save a tree to {directory}: it exists and is not a directory"
            raise InvalidParameterError(msg)
        directory.mkdir(parents=True, exist_ok=True)

        emb = np.ascontiguousarray(self.embeddings, dtype=np.float32)
        emb_bytes = _npy_bytes(emb)  # serialised once: hashed, then written as is
        emb_sha = hashlib.sha256(emb_bytes).hexdigest()
        emb_name = f"{_EMB_PREFIX}{emb_sha[:16]}.npy"
        emb_path = directory / emb_name
        if not (emb_path.exists() and _sha256_file(emb_path) == emb_sha):
            _atomic_write(emb_path, lambda f: f.write(emb_bytes))

        body = {
            "params": _jsonable(self.params, "params"),
            "build_info": _jsonable(self.build_info, "build_info"),
            "nodes": [_jsonable(n.to_dict(), f"node {n.id!r}") for n in self.nodes],
        }
        document = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "raptor_core_version": __version__,
            "num_nodes": len(self.nodes),
            "embeddings": {
                "file": emb_name,
                "shape": list(emb.shape),
                "dtype": "float32",
                "sha256": emb_sha,
            },
            "content_sha256": _sha256_json(body),
            **body,
        }
        payload = json.dumps(document, ensure_ascii=False, indent=1).encode("utf-8")
        _atomic_write(directory / _TREE_FILE, lambda f: f.write(payload))
        _fsync_dir(directory)
        # Only now is the old matrix unreferenced; a crash before this line keeps it.
        for stale in directory.glob(f"{_EMB_PREFIX}*.npy"):
            if stale.name != emb_name:
                stale.unlink(missing_ok=True)
        return directory

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, mmap: bool = False, verify: bool = True) -> Tree:
        """Load a tree saved by :meth:`save`.

        Args:
            path: the directory given to ``save``.
            mmap: memory-map the embedding matrix instead of reading it.
            verify: check the SHA-256 of the matrix and of the JSON content (detects edits).

        Raises:
            TreeFormatError: the directory is missing, truncated, edited or not a RAPTOR tree.
        """
        directory = Path(path)
        tree_file = directory / _TREE_FILE
        if not tree_file.is_file():
            msg = f"no RAPTOR tree at {directory}: {_TREE_FILE} not found (build one with `raptor build`)"
            raise TreeFormatError(msg)
        try:
            document = json.loads(tree_file.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            msg = f"{tree_file} is not valid JSON (truncated or edited?): {exc}"
            raise TreeFormatError(msg) from exc
        if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
            msg = f"{tree_file} is not a RAPTOR tree file (missing format marker {FORMAT_NAME!r})"
            raise TreeFormatError(msg)
        version = document.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
            msg = (
                f"{tree_file} has format_version {version!r}; this raptor_core ({__version__}) "
                f"reads versions 1..{FORMAT_VERSION}: upgrade raptor-retriever or rebuild the tree"
            )
            raise TreeFormatError(msg)
        saved_by = document.get("raptor_core_version")
        if saved_by != __version__:
            warnings.warn(
                f"tree saved by raptor_core {saved_by}, loading with {__version__}",
                TreeVersionWarning,
                stacklevel=2,
            )
        try:
            body = {k: document[k] for k in ("params", "build_info", "nodes")}
            emb_meta = document["embeddings"]
            emb_path = directory / str(emb_meta["file"])
            shape = tuple(int(s) for s in emb_meta["shape"])
            expected_sha = str(emb_meta["sha256"])
            content_sha = str(document["content_sha256"])
            num_nodes = int(document["num_nodes"])
        except (KeyError, TypeError, ValueError) as exc:
            msg = f"{tree_file} is missing required fields: {exc}"
            raise TreeFormatError(msg) from exc
        if verify and _sha256_json(body) != content_sha:
            msg = f"{tree_file} content does not match its checksum: the file was edited or damaged"
            raise TreeFormatError(msg)
        if emb_path.parent != directory or not emb_path.is_file():
            msg = f"embedding matrix {emb_path.name} of {directory} is missing"
            raise TreeFormatError(msg)
        if verify and _sha256_file(emb_path) != expected_sha:
            msg = f"{emb_path} does not match its checksum: truncated or replaced"
            raise TreeFormatError(msg)
        try:
            emb = np.load(emb_path, mmap_mode="r" if mmap else None, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            msg = f"cannot read embedding matrix {emb_path}: {exc}"
            raise TreeFormatError(msg) from exc
        if emb.shape != shape or emb.dtype != np.float32 or len(body["nodes"]) != num_nodes:
            msg = f"{directory}: matrix {emb.shape}/{emb.dtype} does not fit {num_nodes} nodes {shape}"
            raise TreeFormatError(msg)
        if not isinstance(body["nodes"], list):
            msg = f"{tree_file}: 'nodes' must be a list"
            raise TreeFormatError(msg)
        nodes = tuple(Node.from_dict(n) for n in body["nodes"])
        if not mmap:
            emb.flags.writeable = False
        return cls(
            nodes=nodes, embeddings=emb, params=body["params"], build_info=body["build_info"]
        )


# -- helpers ---------------------------------------------------------------------------------------
def _jsonable(value: Any, where: str) -> Any:
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        msg = f"{where} is not JSON-serialisable (metadata must be plain JSON values): {exc}"
        raise InvalidParameterError(msg) from exc


def _sha256_json(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _npy_bytes(arr: NDArray[np.float32]) -> bytes:
    """The exact ``.npy`` file content of ``arr`` (so its hash is the file's hash)."""
    import io

    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _atomic_write(target: Path, write: Any) -> None:
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        # Also on KeyboardInterrupt: never leave a half-written temp file behind.
        Path(tmp_name).unlink(missing_ok=True)
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
