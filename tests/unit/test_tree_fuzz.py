"""Fuzz the saved-tree format (issue 11: tree files are data, never code).

A small tree is built for real (TreeBuilder with the shipped fakes), saved, and queried.
Then thousands of deterministic variants of its files are written and loaded: truncations,
byte flips, field edits and type swaps, huge and negative numbers, NaN literals, deep
nesting, forged ``.npy`` headers and oversized shapes, symbolic links, FIFOs and
directories in place of each file, extra files.  Each variant must either raise
``TreeFormatError`` (never another exception type) or load a tree that retrieves:

* class "damage" (the checksums are left as they were, ``verify=True``): exactly the
  original's hits, ids and scores, for every query and strategy;
* class "forged" (the attacker recomputed the unkeyed checksums, or ``verify=False``):
  a valid tree may then differ, so the hits must keep every invariant instead (finite
  scores in [-1, 1], ids of the tree, the token budget respected), and they must equal the
  original's whenever the loaded tree equals the original.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.lib import format as npy_format

from raptor_core.build.builder import TreeBuilder
from raptor_core.exceptions import TreeFormatError
from raptor_core.retrieval.registry import make_retriever
from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer
from raptor_core.tree import Tree, TreeVersionWarning
from raptor_core.types import Document

DIM = 16
BUDGET = 30
QUERIES = ("cats purr in the sun", "rockets reach orbit", "yeast makes bread rise", "string")
STRATEGIES = {
    "collapsed": {"k": 6, "max_tokens": BUDGET},
    "traversal": {"k": 6, "max_tokens": BUDGET, "top_k": 2},
    "value": {"k": 4, "max_tokens": BUDGET},
}
TOPICS = {
    "cats": "Cats purr softly. Cats sleep in the sun. Kittens chase string. A cat grooms its fur.",
    "rockets": "Rockets burn fuel. Rockets reach orbit. Satellites circle the earth. Launch pads roar.",
    "bread": "Bakers knead dough. Yeast makes bread rise. Ovens bake loaves. Crust turns brown.",
    "sea": "Waves crash on rocks. Tides follow the moon. Fish swim in schools. Gulls cry over boats.",
    "trees": "Oaks drop acorns. Pines keep their needles. Roots drink water. Leaves turn red in autumn.",
    "music": "Drums keep the beat. Violins sing high notes. Choirs blend voices. Pianos have many keys.",
    "chess": "Pawns move forward. Bishops slide on diagonals. Knights jump over pieces. Kings stay safe.",
}
MIN_VARIANTS = 5000


class PairClusterer:
    """Consecutive pairs, the last row also in the first: soft clusters and, for odd layer
    sizes, a single-member cluster that the builder carries up unchanged."""

    def cluster(self, vectors: np.ndarray) -> list[list[int]]:
        n = len(vectors)
        clusters = [list(range(i, min(i + 2, n))) for i in range(0, n, 2)]
        if n > 3:
            clusters[0].append(n - 1)
        return clusters


Hits = tuple[tuple[str, float], ...]


def retrieve_all(tree: Tree) -> dict[tuple[str, str], Hits]:
    embedder = FakeEmbedder(DIM)
    out = {}
    for strategy, params in STRATEGIES.items():
        retriever = make_retriever(strategy, tree, embedder, **params)
        for query in QUERIES:
            out[strategy, query] = tuple((h.id, h.score) for h in retriever.retrieve(query))
    return out


def check_invariants(tree: Tree, results: dict[tuple[str, str], Hits]) -> None:
    for (strategy, _), hits in results.items():
        tokens = 0
        for node_id, score in hits:
            assert node_id in tree, f"{strategy}: hit {node_id!r} is not in the tree"
            assert np.isfinite(score) and -1.001 <= score <= 1.001, f"{strategy}: score {score}"
            tokens += tree.node(node_id).token_count
        assert tokens <= BUDGET, f"{strategy}: {tokens} tokens over the budget of {BUDGET}"


def same_tree(a: Tree, b: Tree) -> bool:
    return (
        a.nodes == b.nodes
        and np.array_equal(np.asarray(a.embeddings), np.asarray(b.embeddings))
        and a.params == b.params
    )


# -- the original ---------------------------------------------------------------------------
@dataclass
class Original:
    tree: Tree
    results: dict[tuple[str, str], Hits]
    tree_json: bytes
    matrix: bytes
    matrix_name: str
    outside: Path  # a directory outside the tree's, for symbolic-link targets

    @property
    def doc(self) -> dict[str, Any]:
        return json.loads(self.tree_json)


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Original:
    builder = TreeBuilder(
        FakeEmbedder(DIM),
        EchoSummarizer(),
        tokenizer=WhitespaceTokenizer(),
        clusterer=PairClusterer(),
        chunk_max_tokens=8,
        summary_max_tokens=10,
        cluster_max_tokens=100,
        min_layer_size=2,
    )
    docs = [Document(text=t, doc_id=k, metadata={"topic": k, "n": 1}) for k, t in TOPICS.items()]
    tree = builder.build(docs)
    assert tree.num_layers >= 3 and tree.carried_mask.any(), "want carried nodes in the mix"
    directory = tmp_path_factory.mktemp("original")
    tree.save(directory)
    (matrix_path,) = directory.glob("embeddings-*.npy")
    loaded = Tree.load(directory)
    results = retrieve_all(loaded)
    assert results == retrieve_all(tree)
    assert all(results.values())
    outside = tmp_path_factory.mktemp("outside")
    (outside / "tree.json").write_bytes((directory / "tree.json").read_bytes())
    (outside / matrix_path.name).write_bytes(matrix_path.read_bytes())
    return Original(
        tree=loaded,
        results=results,
        tree_json=(directory / "tree.json").read_bytes(),
        matrix=matrix_path.read_bytes(),
        matrix_name=matrix_path.name,
        outside=outside,
    )


# -- variants -------------------------------------------------------------------------------
@dataclass
class Variant:
    label: str
    files: dict[str, Any]  # name -> bytes | ("symlink", target) | ("fifo",) | ("dir",)
    forged: bool = False  # checksums recomputed, or loaded with verify=False
    verify: bool = True
    extra: dict[str, bytes] = field(default_factory=dict)


def sha256_json(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def fix_content(doc: Any) -> None:
    """Recompute content_sha256 as an attacker would (it is unkeyed)."""
    if isinstance(doc, dict) and all(k in doc for k in ("params", "build_info", "nodes")):
        body = {k: doc[k] for k in ("params", "build_info", "nodes")}
        doc["content_sha256"] = sha256_json(body)


def dump(doc: Any) -> bytes:
    return json.dumps(doc, indent=1, ensure_ascii=False).encode("utf-8")


def with_matrix(orig: Original, doc: dict[str, Any], matrix: bytes) -> dict[str, Any]:
    """Files for ``doc`` and a new matrix, the matrix's checksum and name recomputed."""
    sha = hashlib.sha256(matrix).hexdigest()
    name = f"embeddings-{sha[:16]}.npy"
    if isinstance(doc.get("embeddings"), dict):
        doc["embeddings"]["sha256"] = sha
        doc["embeddings"]["file"] = name
    return {"tree.json": dump(doc), name: matrix}


def npy_header(descr: Any, fortran: bool, shape: Any, version: tuple[int, int] = (1, 0)) -> bytes:
    buf = io.BytesIO()
    header = {"descr": descr, "fortran_order": fortran, "shape": shape}
    if version == (1, 0):
        npy_format.write_array_header_1_0(buf, header)
    else:
        npy_format.write_array_header_2_0(buf, header)
    return buf.getvalue()


def deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


POOL: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2,
    7,
    2**31,
    2**40,
    2**63,
    10**30,
    -(2**40),
    0.5,
    -0.0,
    1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
    "",
    "x",
    "0",
    "L0.0",
    "L1.0",
    "../tree.json",
    "/etc/passwd",
    "embeddings-0000000000000000.npy",
    "x" * 5000,
    [],
    [1, 2],
    ["L0.0"],
    ["L0.0", "L0.0"],
    [None],
    {},
    {"a": 1},
    {"carried": True},
    deep(40),
]


def field_paths(doc: dict[str, Any], rng: random.Random) -> list[tuple[Any, ...]]:
    """Where an edit can land: top-level keys, the matrix record, fields of some nodes."""
    paths: list[tuple[Any, ...]] = [(k,) for k in doc]
    paths += [("embeddings", k) for k in doc["embeddings"]]
    paths += [("embeddings", "shape", 0), ("embeddings", "shape", 1)]
    paths += [("params", k) for k in doc["params"]]
    paths += [("build_info", k) for k in doc["build_info"]]
    n = len(doc["nodes"])
    for i in [*sorted(rng.sample(range(n), min(n, 12))), 0, n - 1]:
        node = doc["nodes"][i]
        paths += [("nodes", i, k) for k in node]
        if node["children"]:
            paths.append(("nodes", i, "children", 0))
        if node["span"]:
            paths += [("nodes", i, "span", 0), ("nodes", i, "span", 1)]
        paths += [("nodes", i, "metadata", k) for k in node["metadata"]]
    return paths


def edit(doc: Any, path: tuple[Any, ...], op: str, value: Any = None) -> None:
    *parents, last = path
    target = doc
    for key in parents:
        target = target[key]
    if op == "set":
        target[last] = value
    elif op == "delete":
        del target[last]
    elif isinstance(target, dict):  # "add": an unknown key next to this one
        target["unexpected"] = value
    else:  # "add" in a list: one more element
        target.append(value)


def semantic_edits(orig: Original) -> Iterator[tuple[str, Callable[[dict[str, Any]], None]]]:
    """Edits a forger would try on purpose, each making a plausible but different tree."""
    nodes = orig.doc["nodes"]
    by_layer: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        by_layer.setdefault(node["layer"], []).append(i)
    summaries = [i for i, node in enumerate(nodes) if node["children"]]
    top = max(by_layer)

    def setter(i: int, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
        def apply(doc: dict[str, Any]) -> None:
            doc["nodes"][i][key] = value

        return apply

    for i in range(len(nodes)):
        layer = nodes[i]["layer"]
        for delta in (-1, 1, 2, 2**40, -(2**40)):
            yield f"node {i} layer {layer}+{delta}", setter(i, "layer", layer + delta)
        for tokens in (-1, -4000, 0, 10**6, 2**31, 2**63):
            yield f"node {i} token_count {tokens}", setter(i, "token_count", tokens)
        yield f"node {i} id of node 0", setter(i, "id", nodes[0]["id"])
        yield f"node {i} span reversed", setter(i, "span", [5, 2])
        yield f"node {i} negative span", setter(i, "span", [-3, 2])
        yield f"node {i} carried", setter(i, "metadata", {"carried": True})
    for i in summaries:
        children = nodes[i]["children"]
        yield f"node {i} no children", setter(i, "children", [])
        yield f"node {i} child twice", setter(i, "children", [*children, children[0]])
        yield f"node {i} unknown child", setter(i, "children", [*children, "ghost"])
        yield f"node {i} child is itself", setter(i, "children", [nodes[i]["id"]])
        yield f"node {i} children reversed", setter(i, "children", children[::-1])
        if nodes[i]["layer"] >= 2:
            yield f"node {i} child two layers down", setter(i, "children", [nodes[0]["id"]])
    for i in by_layer[0][:3]:
        yield f"leaf {i} with a child", setter(i, "children", [nodes[by_layer[0][-1]]["id"]])

    def drop_node(i: int) -> Callable[[dict[str, Any]], None]:
        def apply(doc: dict[str, Any]) -> None:
            del doc["nodes"][i]

        return apply

    def swap(i: int, j: int) -> Callable[[dict[str, Any]], None]:
        def apply(doc: dict[str, Any]) -> None:
            doc["nodes"][i], doc["nodes"][j] = doc["nodes"][j], doc["nodes"][i]

        return apply

    for i in (0, len(nodes) - 1, by_layer[top][0]):
        yield f"drop node {i}", drop_node(i)
    yield "swap two leaves", swap(by_layer[0][0], by_layer[0][1])
    yield "swap leaf and summary", swap(by_layer[0][0], by_layer[1][0])

    def renumber_layers(doc: dict[str, Any]) -> None:
        for node in doc["nodes"]:
            node["layer"] = node["layer"] * 2**40

    yield "layers times 2**40", renumber_layers


def variants(orig: Original) -> Iterator[Variant]:
    rng = random.Random(20240611)
    j0, m0, name0 = orig.tree_json, orig.matrix, orig.matrix_name
    n, dim = len(orig.tree), orig.tree.dim
    header_len = len(m0) - n * dim * 4

    def files(tree_json: bytes = j0, matrix: bytes = m0) -> dict[str, Any]:
        return {"tree.json": tree_json, name0: matrix}

    yield Variant("unchanged", files())
    yield Variant("unchanged, verify=False", files(), forged=True, verify=False)

    # Truncations and appended bytes.
    for cut in sorted(set(rng.sample(range(len(j0)), 300)) | {0, 1, len(j0) - 1}):
        yield Variant(f"tree.json cut at {cut}", files(tree_json=j0[:cut]))
    for cut in sorted(set(rng.sample(range(len(m0)), 150)) | {0, 8, header_len, len(m0) - 1}):
        yield Variant(f"matrix cut at {cut}", files(matrix=m0[:cut]))
        yield Variant(f"matrix cut at {cut}, verify=False", files(matrix=m0[:cut]), True, False)
    for extra in (b"\0", b" ", b"\n" * 10, b"x" * 4096):
        yield Variant(f"tree.json + {extra[:4]!r}", files(tree_json=j0 + extra))
        yield Variant(f"matrix + {len(extra)} bytes", files(matrix=m0 + extra))

    # Byte flips.
    for k in range(1000):
        data = bytearray(j0)
        for _ in range(rng.choice((1, 1, 2, 3))):
            data[rng.randrange(len(data))] = rng.randrange(256)
        yield Variant(f"tree.json flip {k}", files(tree_json=bytes(data)))
    for k in range(500):
        data = bytearray(m0)
        region = header_len if k % 2 else len(data)
        for _ in range(rng.choice((1, 2))):
            data[rng.randrange(region)] = rng.randrange(256)
        yield Variant(f"matrix flip {k}", files(matrix=bytes(data)))
        if k % 5 == 0:
            yield Variant(f"matrix flip {k}, verify=False", files(matrix=bytes(data)), True, False)

    # Reformatted JSON: same content, other layout (must load unchanged).
    doc = orig.doc
    for indent, sort, ascii_ in ((None, False, True), (4, True, False), (0, False, False)):
        text = json.dumps(doc, indent=indent, sort_keys=sort, ensure_ascii=ascii_).encode()
        yield Variant(f"reformatted {indent} {sort} {ascii_}", files(tree_json=text))

    # Field edits and type swaps, with and without recomputed checksums.
    paths = field_paths(orig.doc, rng)
    for k in range(1600):
        path = rng.choice(paths)
        op = rng.choice(("set", "set", "set", "set", "delete", "add"))
        value = rng.choice(POOL)
        forged = k % 2 == 1
        doc = orig.doc
        edit(doc, path, op, value)
        if forged:
            fix_content(doc)
        label = f"edit {op} {path} = {str(value)[:30]}{' (checksum fixed)' if forged else ''}"
        yield Variant(label, files(tree_json=dump(doc)), forged=forged)

    # Deliberate edits that keep the JSON well formed (checksum fixed: a forger's moves).
    for label, apply in semantic_edits(orig):
        doc = orig.doc
        apply(doc)
        for num_fixed in (False, True):
            if num_fixed:
                doc["num_nodes"] = len(doc["nodes"])
                doc["embeddings"]["shape"][0] = len(doc["nodes"])
            fix_content(doc)
            yield Variant(f"{label} (num fixed {num_fixed})", files(tree_json=dump(doc)), True)

    # Raw JSON text: NaN/Infinity literals, overflowing numbers, long integers, deep nesting.
    text0 = j0.decode()
    for literal in ("NaN", "Infinity", "-Infinity", "1e999", "-1e999", "9" * 5000, "1" * 4301):
        for anchor in ('"layer": 0', '"token_count": ', '"num_nodes": ', '"n": 1'):
            if anchor not in text0:
                continue
            if anchor.endswith(": "):
                start = text0.index(anchor) + len(anchor)
                end = start
                while text0[end].isdigit():
                    end += 1
                text = text0[:start] + literal + text0[end:]
            else:
                text = text0.replace(anchor, anchor.split(":")[0] + ": " + literal, 1)
            yield Variant(f"literal {literal[:10]} at {anchor}", files(tree_json=text.encode()))
            forged_doc = None
            with contextlib.suppress(ValueError):
                forged_doc = json.loads(text)
            if forged_doc is not None:
                fix_content(forged_doc)
                yield Variant(
                    f"literal {literal[:10]} at {anchor} (fixed)",
                    files(tree_json=json.dumps(forged_doc, indent=1).encode()),
                    forged=True,
                )
    for levels in (33, 200, 5000, 200_000):
        nest = "[" * levels + "]" * levels
        for anchor in ('"metadata": {}', '"params": {', '"build_info": {'):
            if anchor.endswith("{}"):
                text = text0.replace(anchor, f'"metadata": {{"deep": {nest}}}', 1)
            else:
                text = text0.replace(anchor, f'{anchor}"deep": {nest},', 1)
            yield Variant(f"nesting {levels} at {anchor}", files(tree_json=text.encode()))
    for levels in (33, 40, 300):
        doc = orig.doc
        doc["nodes"][0]["metadata"] = {"deep": deep(levels)}
        fix_content(doc)
        yield Variant(f"nesting {levels} in metadata (fixed)", files(tree_json=dump(doc)), True)
        doc = orig.doc
        doc["params"]["deep"] = deep(levels)
        fix_content(doc)
        yield Variant(f"nesting {levels} in params (fixed)", files(tree_json=dump(doc)), True)
    for surrogate in ("\\ud800", "\\udfff", "\\ud83d\\ude00"):
        text = text0.replace('"text": "', f'"text": "{surrogate}', 1)
        doc = json.loads(text)
        yield Variant(f"surrogate {surrogate}", files(tree_json=text.encode()))
        try:
            fix_content(doc)
            fixed = json.dumps(doc, indent=1).encode()  # ASCII escapes survive the dump
            yield Variant(f"surrogate {surrogate} (fixed)", files(tree_json=fixed), True)
        except UnicodeEncodeError:
            pass
    yield Variant("tree.json not UTF-8", files(tree_json=j0.decode().encode("utf-16")))
    yield Variant("tree.json with BOM", files(tree_json=b"\xef\xbb\xbf" + j0))
    for top in ("[]", "null", "1", '"raptor-tree"', "{}", '{"format": "raptor-tree"}'):
        yield Variant(f"top-level {top}", files(tree_json=top.encode()))

    # Forged .npy headers and oversized shapes, raw and with every checksum recomputed.
    data0 = m0[header_len:]
    shapes: list[Any] = [
        (2**40, dim),
        (3 * 2**40 // dim, dim),
        (n, 2**20),
        (n * dim,),
        (n, dim, 1),
        (dim, n),
        (n + 1, dim),
        (n - 1, dim),
        (0, dim),
        (n, 0),
        (),
    ]
    headers = [npy_header("<f4", False, s) for s in shapes]
    headers += [npy_header(d, False, (n, dim)) for d in ("<f8", ">f4", "|O", "<i4", "<f2", "|u1")]
    headers += [npy_header([("a", "<f4")], False, (n, dim)), npy_header("<f4", True, (n, dim))]
    headers += [npy_header("<f4", False, (n, dim), (2, 0))]  # 2.0: valid, read too
    headers += [
        b"\x93NUMPY\x03\x00" + m0[8:],
        b"\x93NUMPY\x01\x00\xff\xff" + b"{" * 200,
        b"\x93NUMPY\x02\x00\xff\xff\xff\x7f" + b"{" * 200,
        m0[:10] + b"{'descr': '<f4', 'fortran_order': False, 'shape': (" + b"(" * 500,
        npy_header("<f4", False, (n, dim)).replace(b"(", b"[").replace(b")", b"]"),
        b"PK\x03\x04" + m0[4:header_len],  # a zip (np.savez) header
    ]
    for k, header in enumerate(headers):
        for body in (data0, data0[: len(data0) // 2], b""):
            matrix = header + body
            yield Variant(f"npy header {k} body {len(body)}", files(matrix=matrix))
            doc = orig.doc
            yield Variant(
                f"npy header {k} body {len(body)} (fixed)", with_matrix(orig, doc, matrix), True
            )
            yield Variant(
                f"npy header {k} body {len(body)}, verify=False", files(matrix=matrix), True, False
            )
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    yield Variant("pickled npy", files(matrix=pickled.getvalue()))
    yield Variant("pickled npy (fixed)", with_matrix(orig, orig.doc, pickled.getvalue()), True)

    # Matrix contents a forger could write (checksums recomputed).
    emb = np.frombuffer(data0, dtype="<f4").reshape(n, dim).copy()
    edits: dict[str, Callable[[np.ndarray], None]] = {
        "row x2": lambda e: e.__setitem__(0, e[0] * 2),
        "row NaN": lambda e: e.__setitem__((1, 0), np.nan),
        "row inf": lambda e: e.__setitem__((2, 3), np.inf),
        "row zero": lambda e: e.__setitem__(3, 0.0),
        "row huge": lambda e: e.__setitem__((0, 0), 3e38),
        "all zero": lambda e: e.__setitem__(slice(None), 0.0),
        "row negated": lambda e: e.__setitem__(0, -e[0]),
        "rows swapped": lambda e: e.__setitem__([0, 1], e[[1, 0]]),
        "row +1e-4": lambda e: e.__setitem__((0, 0), e[0, 0] + 1e-4),
        "last row x1.01": lambda e: e.__setitem__(-1, e[-1] * 1.01),
    }
    for label, apply in edits.items():
        changed = emb.copy()
        with np.errstate(all="ignore"):
            apply(changed)
        matrix = m0[:header_len] + changed.astype("<f4").tobytes()
        yield Variant(f"matrix {label}", files(matrix=matrix))
        yield Variant(f"matrix {label} (fixed)", with_matrix(orig, orig.doc, matrix), True)
        yield Variant(f"matrix {label}, verify=False", files(matrix=matrix), True, False)

    # Matrix name and location games.
    for name in ("../" + name0, "/tmp/" + name0, name0.upper(), name0 + "/", "tree.json", ""):
        doc = orig.doc
        doc["embeddings"]["file"] = name
        yield Variant(f"matrix named {name!r}", files(tree_json=dump(doc)))
    yield Variant("matrix missing", {"tree.json": j0})
    yield Variant("tree.json missing", {name0: m0})
    yield Variant("empty directory", {})

    # Symbolic links, FIFOs and directories in place of each file; extra files.
    outside_json, outside_matrix = orig.outside / "tree.json", orig.outside / name0
    yield Variant("tree.json symlink outside", {"tree.json": ("symlink", outside_json), name0: m0})
    yield Variant("matrix symlink outside", {"tree.json": j0, name0: ("symlink", outside_matrix)})
    yield Variant(
        "both symlinks",
        {"tree.json": ("symlink", outside_json), name0: ("symlink", outside_matrix)},
    )
    yield Variant(
        "tree.json symlink inside",
        {"tree.json": ("symlink", "real.json"), "real.json": j0, name0: m0},
    )
    yield Variant(
        "matrix symlink to /dev/zero", {"tree.json": j0, name0: ("symlink", Path("/dev/zero"))}
    )
    yield Variant("tree.json dangling symlink", {"tree.json": ("symlink", "nowhere"), name0: m0})
    for target in ("tree.json", name0):
        for kind in (("fifo",), ("dir",)):
            variant = files()
            variant[target] = kind
            yield Variant(f"{target} is a {kind[0]}", variant)
    for junk in (
        {"notes.txt": b"hi"},
        {"embeddings-0123456789abcdef.npy": m0},
        {".raptor.lock": b""},
    ):
        variant = files()
        variant.update(junk)
        yield Variant(f"extra file {next(iter(junk))}", variant)
    doc = orig.doc
    doc["embeddings"]["file"] = "embeddings-0123456789abcdef.npy"
    yield Variant(
        "points at another matrix",
        {**files(tree_json=dump(doc)), "embeddings-0123456789abcdef.npy": m0},
    )


def write_variant(directory: Path, variant: Variant) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir()
    for name, content in variant.files.items():
        path = directory / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content[0] == "symlink":
            path.symlink_to(content[1])
        elif content[0] == "fifo":
            os.mkfifo(path)
        elif content[0] == "dir":
            path.mkdir()


def test_mutated_tree_files_load_identically_or_raise_tree_format_error(
    original: Original, tmp_path: Path
) -> None:
    directory = tmp_path / "variant"
    count = loaded_count = 0
    failures: list[str] = []
    for count, variant in enumerate(variants(original), start=1):
        write_variant(directory, variant)
        mmap = count % 2 == 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TreeVersionWarning)
            warnings.simplefilter("error", RuntimeWarning)  # a NaN computed silently fails too
            try:
                tree = Tree.load(directory, mmap=mmap, verify=variant.verify)
                results = retrieve_all(tree)
            except TreeFormatError:
                continue
            except Exception as exc:
                failures.append(f"{variant.label} (mmap={mmap}): {type(exc).__name__}: {exc}")
                continue
        loaded_count += 1
        if variant.forged and not same_tree(tree, original.tree):
            try:
                check_invariants(tree, results)
            except AssertionError as exc:
                failures.append(f"{variant.label} (mmap={mmap}): {exc}")
        elif results != original.results:
            failures.append(f"{variant.label} (mmap={mmap}): loaded with different hits")
    assert not failures, f"{len(failures)} of {count} variants:\n" + "\n".join(failures[:40])
    assert count >= MIN_VARIANTS
    assert loaded_count >= 20  # the harmless variants (layout, extra files, ...) do load
