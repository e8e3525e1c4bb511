"""Incremental trees: add, replace and delete documents without rebuilding (issue 13).

:meth:`TreeBuilder.insert`, :meth:`~TreeBuilder.delete` and :meth:`~TreeBuilder.update` (and
their async twins) call :func:`apply_changes`, which maintains the tree *locally*, layer by
layer from the leaves up:

1. **Leaves.**  The leaves of deleted (or replaced) documents go; the new documents are chunked
   and only their chunks are embedded.  A document whose leaves are the tree's (ids, texts,
   spans, order) with other metadata is *relabelled* in place: its leaves take the new
   metadata and keep everything else, and the summaries above them keep id, text and
   vector and only recompute the metadata they derive from their members
   (:func:`~raptor_core.build.builder.summary_metadata`).  No embedding or summary depends on
   metadata, so this is the tree a fresh build with the new metadata gives, for free.
2. **Placement.**  Every node of layer ``l - 1`` that has no parent yet (a new leaf, or a new
   cluster formed below) is compared with the clusters of layer ``l``, each represented by the
   normalised mean (centroid) of its members' vectors *before* the change.  It joins the most
   similar cluster if its cosine to that centroid is at least the cosine of the cluster's own
   loosest member (so a cluster accepts nothing looser than what the clusterer put in it; a
   cluster of one member uses the median of that bound over the layer).  Nodes that fit no
   cluster are clustered among themselves with the builder's clusterer and form new clusters
   (one alone is carried up unchanged, as in a build).
3. **Changed clusters only.**  A cluster whose member list changed (members removed, members
   replaced by their own new versions, newcomers) is re-summarised and re-embedded; every
   other node is kept bit for bit (id, text, embedding).  Because a summary's id derives from
   its members' ids (:mod:`raptor_core.build.ids`), a changed cluster gets a new id, so its
   parents change too: the change propagates up exactly through the ancestors of what
   changed, and nowhere else.  A cluster left with one member is carried (no summary call);
   one left with none disappears.
4. **Split.**  A changed cluster whose members exceed ``cluster_max_tokens`` is re-clustered
   (its members only) with :func:`~raptor_core.build.clustering.cluster_within_limit`, as a build
   does; each part is summarised and all of them take the old cluster's place in its parents.
5. **Drift.**  A changed cluster of three or more members whose *cohesion* (mean cosine of its
   members to their centroid) falls below the layer's **cohesion floor** is re-clustered the
   same way.  The floor is the 10th percentile of the cohesion of that layer's clusters in the
   tree as first built (recorded in ``build_info["incremental"]["cohesion_floor"]`` by the
   first update and kept afterwards), i.e. a cluster is re-clustered once it is looser than all
   but the loosest tenth of the clusters the clusterer made itself.  Only the drifting
   cluster's members are re-clustered (its subtree one level down), never the whole tree.

The number of layers never grows: new top-layer nodes join the top layer.  Deleting every
document is refused (build a new tree instead).  Everything is deterministic for a given tree,
operation and builder (the clusterer is seeded with ``random_state``), since no step depends on
set or dictionary ordering of ids.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from raptor_core.build.builder import (
    _BuildRun,
    _document_items,
    summary_metadata,
    summary_node,
    to_documents,
)
from raptor_core.build.ids import summary_id
from raptor_core.exceptions import InvalidInputError, InvalidParameterError
from raptor_core.tree import Node, Tree
from raptor_core.types import Document

if TYPE_CHECKING:
    from raptor_core.build.builder import TreeBuilder

__all__ = [
    "COHESION_QUANTILE",
    "DRIFT_MIN_MEMBERS",
    "TreeUpdate",
    "UpdateReport",
    "checked_floor",
    "floor_build_info",
    "recorded_floor",
]

#: The cohesion floor of a layer is this quantile of its clusters' cohesion at build time.
COHESION_QUANTILE = 0.10
#: Clusters with fewer members are never re-clustered for drift (two points are always close
#: to their own mean, and the clusterer keeps small sets whole anyway).
DRIFT_MIN_MEMBERS = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateReport:
    """What an incremental update did and what it cost.

    Attributes:
        docs_added: documents that were not in the tree before.
        docs_replaced: documents whose text or metadata changed (their old leaves went, or,
            when only the metadata changed, took the new metadata in place).
        docs_removed: documents deleted.
        docs_unchanged: documents passed to ``update`` whose chunks and metadata were
            identical to the tree's (nothing was paid for them).
        nodes_added: ids of nodes in the new tree that the old one did not have.
        nodes_removed: ids of nodes of the old tree that are gone.
        nodes_changed: ids kept with new content (a document's metadata changed but not its
            text: its leaves, and the summaries above them whose shared metadata changed, keep
            their ids, texts and vectors).
        nodes_relinked: ids kept with the same content whose parents changed; stores that
            keep each node's parents (external vector stores) must rewrite these too.
        summary_calls: summaries requested from the summariser.
        summary_tokens: tokens (by the build's tokenizer) of the texts sent to be summarised.
        embedded_chunks: new leaves embedded.
        embedded_summaries: new summaries embedded.
        clusters_split: changed clusters split because they outgrew ``cluster_max_tokens``.
        reclustered_subtrees: changed clusters re-clustered because they drifted (see the
            module docs).
        seconds: wall time of the update.
        usage: what counting components reported (as ``build_info["usage"]``).
    """

    docs_added: tuple[str, ...] = ()
    docs_replaced: tuple[str, ...] = ()
    docs_removed: tuple[str, ...] = ()
    docs_unchanged: tuple[str, ...] = ()
    nodes_added: tuple[str, ...] = ()
    nodes_removed: tuple[str, ...] = ()
    nodes_changed: tuple[str, ...] = ()
    nodes_relinked: tuple[str, ...] = ()
    summary_calls: int = 0
    summary_tokens: int = 0
    embedded_chunks: int = 0
    embedded_summaries: int = 0
    clusters_split: int = 0
    reclustered_subtrees: int = 0
    seconds: float = 0.0
    usage: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        """Whether the tree changed at all."""
        return bool(self.nodes_added or self.nodes_removed or self.nodes_changed)

    @property
    def docs_changed(self) -> tuple[str, ...]:
        """Documents added, replaced or removed (what LlamaIndex's ``refresh`` reports)."""
        return (*self.docs_added, *self.docs_replaced, *self.docs_removed)

    def to_dict(self, *, ids: bool = False) -> dict[str, Any]:
        """A JSON-serialisable summary; node id lists are given as counts unless ``ids``."""
        out: dict[str, Any] = {}
        for name in self.__slots__:
            value = getattr(self, name)
            if name.startswith("nodes_") and not ids:
                out[name] = len(value)
            elif isinstance(value, tuple):
                out[name] = list(value)
            elif isinstance(value, Mapping):
                out[name] = {k: dict(v) for k, v in value.items()}
            else:
                out[name] = round(value, 4) if isinstance(value, float) else value
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class TreeUpdate:
    """The result of an incremental update: the new tree and what making it took.

    The tree passed in is never modified (trees are immutable); when nothing changed,
    ``tree`` is that same object.
    """

    tree: Tree
    report: UpdateReport


# -- planning ------------------------------------------------------------------------------------
DocumentLike = str | Document | Mapping[str, Any]


def prepare_insert(tree: Tree, documents: Iterable[DocumentLike]) -> list[Document]:
    """Normalise documents to insert; plain strings get the next free ``doc-N`` ids.

    Raises:
        InvalidInputError: empty, binary or duplicate documents (nothing has been paid).
        InvalidParameterError: a document id already in the tree (use ``update``).
    """
    docs = _normalise(tree, documents)
    existing = set(tree.doc_ids)
    # A pre-split chunk (chunk_of set) belongs to its source document: that id must be new.
    clash = list(
        dict.fromkeys(d.chunk_of or d.doc_id for d in docs if (d.chunk_of or d.doc_id) in existing)
    )
    if clash:
        msg = (
            f"document id(s) {clash[:5]} are already in the tree: use update() (raptor update) to replace a "
            "document, or give the new one another id"
        )
        raise InvalidParameterError(msg)
    return docs


def prepare_update(tree: Tree, documents: Iterable[DocumentLike]) -> list[Document]:
    """Normalise documents to update (or add, when their id is new)."""
    return _normalise(tree, documents)


def prepare_delete(tree: Tree, doc_ids: Iterable[str]) -> list[str]:
    """Check the ids to delete: known, distinct, and not every document of the tree.

    Raises:
        InvalidParameterError: an id is not in the tree, or ``doc_ids`` is a bare string.
        InvalidInputError: deleting them would leave the tree empty.
    """
    _check_tree(tree)
    if isinstance(doc_ids, str | bytes):
        msg = f"doc_ids must be a list of ids, not a single string ({doc_ids!r}): wrap it in a list"
        raise InvalidParameterError(msg)
    try:
        iterator = iter(doc_ids)  # not list(): a TypeError inside a generator is not ours
    except TypeError:
        msg = f"doc_ids must be a list of document ids (str), got {type(doc_ids).__name__}"
        raise InvalidParameterError(msg) from None
    ids = list(iterator)
    odd = next((d for d in ids if not isinstance(d, str)), None)
    if odd is not None:
        msg = f"doc_ids must be document ids (str), got {type(odd).__name__} {odd!a}"
        raise InvalidParameterError(msg)
    wanted = list(dict.fromkeys(ids))
    existing = tree.doc_ids
    known = set(existing)
    unknown = [d for d in wanted if d not in known]
    if unknown:
        shown = ", ".join(repr(d) for d in existing[:5])
        msg = (
            f"unknown document id(s) {unknown[:5]}: the tree holds {len(existing)} documents "
            f"({shown}{', ...' if len(existing) > 5 else ''})"
        )
        raise InvalidParameterError(msg)
    if wanted and len(wanted) == len(known):
        msg = "deleting every document would leave an empty tree: build a new tree instead"
        raise InvalidInputError(msg)
    return wanted


def _check_tree(tree: object) -> None:
    if not isinstance(tree, Tree):
        msg = f"tree must be a Tree (from build() or Tree.load()), got {type(tree).__name__}"
        raise InvalidParameterError(msg)


def _normalise(tree: Tree, documents: Iterable[DocumentLike]) -> list[Document]:
    _check_tree(tree)
    items = _document_items(documents)
    used = set(tree.doc_ids)
    # Only string ids can be taken; to_documents refuses the others, naming the document.
    for d in items:
        doc_id = (
            d.doc_id
            if isinstance(d, Document)
            else (d.get("doc_id") if isinstance(d, Mapping) else None)
        )
        if isinstance(doc_id, str):
            used.add(doc_id)
    counter = 0
    named: list[Any] = []
    for item in items:
        if isinstance(item, str):
            # to_documents would number them from doc-0, which the tree most likely holds.
            while f"doc-{counter}" in used:
                counter += 1
            used.add(f"doc-{counter}")
            named.append(Document(text=item, doc_id=f"doc-{counter}"))
        else:
            named.append(item)
    docs = to_documents(named)
    if not docs:
        msg = "no documents given"
        raise InvalidInputError(msg)
    for d in docs:
        # A pre-split chunk's id is its leaf's id: it may only be taken by its own document.
        if d.chunk_of is not None and d.doc_id in tree and tree.node(d.doc_id).doc_id != d.chunk_of:
            msg = (
                f"chunk id {d.doc_id!r} (of document {d.chunk_of!r}) is already the id of a node "
                "of another document in the tree: give the chunk another id"
            )
            raise InvalidInputError(msg)
    return docs


# -- the run ---------------------------------------------------------------------------------------
class _UpdateRun(_BuildRun):
    """One incremental update; reuses the build's embedding and summarising stages."""

    def __init__(
        self,
        builder: TreeBuilder,
        tree: Tree,
        *,
        add: Sequence[Document],
        remove: Sequence[str],
    ) -> None:
        builder._validate()
        self.docs = list(add)
        self._setup(builder)
        # New leaves are embedded as the tree's were, whatever this builder says: an update
        # must give the tree a full rebuild with the tree's parameters would (trees from
        # before section_context existed were embedded without it).
        self.section_context = tree.params.get("section_context") is True
        if tree.dim == 0 or len(tree) == 0:
            msg = "the tree is empty: build one with TreeBuilder.build()"
            raise InvalidInputError(msg)
        _check_same_embedder(tree, self.raw_embedder)
        self.tree = tree
        self.start = time.perf_counter()
        self.removing = list(remove)
        self.vectors = [np.zeros((0, tree.dim), dtype=np.float32)]  # pins the dimension
        self.floor = _cohesion_floor(tree)
        self.report: dict[str, Any] = {
            "summary_calls": 0,
            "summary_tokens": 0,
            "embedded_chunks": 0,
            "embedded_summaries": 0,
            "clusters_split": 0,
            "reclustered_subtrees": 0,
        }
        # The new tree, layer by layer.
        self.out_nodes: list[list[Node]] = []
        self.out_vectors: list[NDArray[np.float32]] = []
        # State between layers: old id -> ids that took its place (absent: itself).
        self.replaced: dict[str, list[str]] = {}
        self.orphans: list[str] = []  # new nodes of the last layer without a parent yet
        self.dirty: set[str] = set()  # nodes of the last layer that were (re)computed
        # Leaves of documents whose metadata alone changed (id -> the leaf with its new
        # metadata), and the nodes of the last layer kept in place with new metadata.
        self.relabelled: dict[str, Node] = {}
        self.relabelled_ids: set[str] = set()
        self.docs_added: list[str] = []
        self.docs_replaced: list[str] = []
        self.docs_unchanged: list[str] = []
        # The layer being made: old rows kept as they are, and the new nodes without a parent.
        self.kept_rows: list[int] = []
        self.next_orphans: list[str] = []

    # -- layer 0 ------------------------------------------------------------------------------
    def chunk_new(self) -> list[str]:
        """Chunk the new documents, drop unchanged ones; the texts to embed."""
        existing = set(self.tree.doc_ids)
        old_leaves: dict[str, list[Node]] = {}
        for leaf in self.tree.leaves:
            if leaf.doc_id is not None:
                old_leaves.setdefault(leaf.doc_id, []).append(leaf)
        self.make_leaves()  # fills self.layer_nodes with the new leaves
        by_doc: dict[str, list[Node]] = {}
        for leaf in self.layer_nodes:
            by_doc.setdefault(str(leaf.doc_id), []).append(leaf)
        keep: list[Node] = []
        whole = {d.doc_id: d.text for d in self.docs if d.chunk_of is None}
        # Pre-split chunks (chunk_of set) are leaves of their source document: a source is
        # added, replaced or unchanged as a whole, whichever of its chunks are given.
        for source in dict.fromkeys(d.chunk_of or d.doc_id for d in self.docs):
            new = by_doc[source]
            if source in existing:
                old = old_leaves.get(source, [])
                # The text too: a pre-split chunk's id is its tool's, not derived from its text.
                same_leaves = [(n.id, n.text, n.span) for n in new] == [
                    (n.id, n.text, n.span) for n in old
                ]
                if same_leaves and [n.metadata for n in new] == [n.metadata for n in old]:
                    self.docs_unchanged.append(source)
                    continue
                if same_leaves and self._embedded_alike(new, whole.get(source)):
                    # Only the metadata changed, and neither a leaf's vector nor a summary
                    # depends on it: the leaves are updated in place, their ancestors'
                    # metadata recomputed, and nothing is embedded or summarised (a rebuild
                    # with the new metadata would make this very tree).
                    self.docs_replaced.append(source)
                    for before, after in zip(old, new, strict=True):
                        if before.metadata != after.metadata:
                            self.relabelled[before.id] = replace(before, metadata=after.metadata)
                    continue
                self.docs_replaced.append(source)
                self.removing.append(source)
            else:
                self.docs_added.append(source)
            keep.extend(new)
        self.layer_nodes = keep
        return self.leaf_texts_to_embed()

    def _embedded_alike(self, leaves: Sequence[Node], text: str | None) -> bool:
        """Whether ``leaves`` (the tree's, same ids, texts, spans) would get the same vectors.

        A leaf is embedded from its text and, with section_context, from the section heading
        and table header above it, read from the document's text.  Those lie inside the
        leaves' spans, which are unchanged, unless the chunker left non-blank text out of
        every chunk: then the context may differ, and the document is replaced as before.
        """
        if text is None or not any(leaf.id in self.leaf_context for leaf in leaves):
            return True  # a pre-split chunk or a leaf without context: its text alone
        end = 0
        for start, stop in sorted(leaf.span for leaf in leaves if leaf.span is not None):
            if text[end:start].strip():
                return False
            end = max(end, stop)
        return not text[end:].strip()

    @property
    def nothing_to_do(self) -> bool:
        return not self.layer_nodes and not self.removing and not self.relabelled

    def commit_leaves(self, vectors: NDArray[np.float32]) -> None:
        gone = set(self.removing)
        rows = self.tree.layer_rows(0)
        kept_rows = [int(r) for r in rows if self.tree.nodes[r].doc_id not in gone]
        for r in rows:
            node = self.tree.nodes[r]
            if node.doc_id in gone:
                self.replaced[node.id] = []
        kept = [self.tree.nodes[r] for r in kept_rows]
        nodes = [self.relabelled.get(n.id, n) for n in kept] + self.layer_nodes
        self.relabelled_ids = set(self.relabelled)
        vecs = [self.tree.embeddings[kept_rows]]
        if self.layer_nodes:
            vecs.append(self.leaf_vectors(vectors))
        self.out_nodes.append(nodes)
        self.out_vectors.append(np.concatenate(vecs).astype(np.float32, copy=False))
        self.orphans = [n.id for n in self.layer_nodes]
        self.dirty = set(self.orphans)
        self.report["embedded_chunks"] = len(self.layer_nodes)

    # -- layers above -------------------------------------------------------------------------
    def plan_layer(self, layer: int) -> bool:
        """Decide the clusters of ``layer`` that must be (re)made; False once above the top."""
        from raptor_core.build.clustering import cluster_within_limit

        if layer >= self.tree.num_layers or not self.out_nodes[-1]:
            return False
        start = time.perf_counter()
        below = self.out_nodes[-1]
        below_vecs = self.out_vectors[-1]
        pos = {n.id: i for i, n in enumerate(below)}
        old_rows = self.tree.layer_rows(layer)
        olds = [self.tree.nodes[r] for r in old_rows]
        joined = self._place_orphans(olds, below_vecs, pos)
        kept: list[int] = []  # rows of old nodes kept as they are
        todo: list[tuple[str | None, list[str]]] = []
        for row, old, extra in zip(old_rows, olds, joined, strict=True):
            kids = list(
                dict.fromkeys([k for c in old.children for k in self.replaced.get(c, [c])] + extra)
            )
            if kids == list(old.children) and not any(k in self.dirty for k in kids):
                kept.append(int(row))
            elif not kids:
                self.replaced[old.id] = []
            else:
                todo.append((old.id, sorted(kids, key=pos.__getitem__)))
        placed = {k for extra in joined for k in extra}
        left = [o for o in self.orphans if o not in placed]
        if len(left) == 1:
            todo.append((None, left))
        elif left:
            idx = [pos[o] for o in left]
            groups = cluster_within_limit(
                self.clusterer,
                below_vecs[idx],
                [below[i].token_count for i in idx],
                self.b.cluster_max_tokens,
            )
            todo.extend((None, [left[j] for j in g]) for g in groups)
        # Split what outgrew the summariser's limit; re-cluster what drifted.
        parts_made: list[tuple[list[str], str | None]] = []  # (members, old cluster or None)
        floor = self.floor[layer - 1] if layer - 1 < len(self.floor) else None
        for old_id, kids in todo:
            idx = [pos[k] for k in kids]
            tokens = [below[i].token_count for i in idx]
            parts = [kids]
            if len(kids) > 1 and sum(tokens) > self.b.cluster_max_tokens:
                self.report["clusters_split"] += 1
                parts = self._recluster(kids, idx, tokens)
            elif (
                old_id is not None
                and floor is not None
                and len(kids) >= DRIFT_MIN_MEMBERS
                and _cohesion(below_vecs[idx]) < floor
            ):
                parts = self._recluster(kids, idx, tokens)
                if len(parts) > 1:
                    self.report["reclustered_subtrees"] += 1
            parts_made.extend((part, old_id) for part in parts)
        # Identical member lists make identical nodes (ids derive from members): keep one.
        kept_ids = {self.tree.nodes[r].id for r in kept}
        self.kept_rows = kept
        unique: dict[str, list[str]] = {}
        targets: dict[str, list[str]] = {}
        new_groups: list[str] = []
        for part, old_id in parts_made:
            nid = summary_id(layer, part)
            if old_id is not None:
                targets.setdefault(old_id, []).append(nid)
            elif nid not in new_groups:
                new_groups.append(nid)
            if nid not in kept_ids and nid not in unique:
                unique[nid] = part
        for old_id, nids in targets.items():
            self.replaced[old_id] = list(dict.fromkeys(nids))
        self.next_orphans = [n for n in new_groups if n not in kept_ids]
        self.layer = layer - 1
        member_ids = dict.fromkeys(k for p in unique.values() for k in p)
        self.layer_nodes = [below[pos[k]] for k in member_ids]
        member_pos = {n.id: i for i, n in enumerate(self.layer_nodes)}
        self.clusters = [[member_pos[k] for k in p] for p in unique.values()]
        self.layer_vectors = (
            below_vecs[[pos[n.id] for n in self.layer_nodes]] if unique else below_vecs[:0]
        )
        for c in self.clusters:
            if len(c) > 1:
                self.report["summary_calls"] += 1
                self.report["summary_tokens"] += sum(self.layer_nodes[i].token_count for i in c)
        self.timings["cluster"] += time.perf_counter() - start
        return True

    def _recluster(self, kids: list[str], idx: list[int], tokens: list[int]) -> list[list[str]]:
        from raptor_core.build.clustering import cluster_within_limit

        groups = cluster_within_limit(
            self.clusterer, self.out_vectors[-1][idx], tokens, self.b.cluster_max_tokens
        )
        return [[kids[j] for j in g] for g in groups]

    def _place_orphans(
        self, olds: list[Node], below_vecs: NDArray[np.float32], pos: Mapping[str, int]
    ) -> list[list[str]]:
        """For each old cluster of the layer, the orphans of the layer below that join it."""
        joined: list[list[str]] = [[] for _ in olds]
        if not self.orphans or not olds:
            return joined
        centroids, bounds = _centroids(self.tree, olds)
        vecs = below_vecs[[pos[o] for o in self.orphans]].astype(np.float64)
        sims = vecs @ centroids.T
        best = np.argmax(sims, axis=1)
        for o, b, row in zip(self.orphans, best.tolist(), sims, strict=True):
            if row[b] >= bounds[b]:
                joined[b].append(o)
        return joined

    def carried_only(self) -> list[str]:
        """The layer's texts when every cluster to make has one member (nothing to summarise)."""
        return [str(s) for s in self._with_carried([])]

    def summary_texts(self, summaries: Sequence[str]) -> list[str]:
        """The texts of the new summaries to embed (carried nodes reuse their member's vector)."""
        return [summaries[i] for i in self._to_summarize()]

    def commit_layer_update(
        self, layer: int, summaries: list[str], fresh: NDArray[np.float32]
    ) -> None:
        """Make the (re)computed nodes of ``layer`` and the layer's full node list."""
        from raptor_core.tokenizers import count_tokens

        made: list[Node] = []
        for cluster, text in zip(self.clusters, summaries, strict=True):
            members = [replace(self.layer_nodes[j], parents=()) for j in cluster]
            carried = len(members) == 1
            made.append(
                summary_node(
                    layer=layer,
                    text=text,
                    members=members,
                    token_count=members[0].token_count
                    if carried
                    else count_tokens(self.tokenizer, text),
                )
            )
        vecs = self.assemble_vectors(fresh) if made else self.layer_vectors[:0]
        self.report["embedded_summaries"] += int(fresh.shape[0]) if made else 0
        kept = self._kept_with_metadata()
        self.out_nodes.append(kept + made)
        parts = [self.tree.embeddings[self.kept_rows]]
        if made:
            parts.append(vecs)
        self.out_vectors.append(np.concatenate(parts).astype(np.float32, copy=False))
        self.orphans = self.next_orphans
        self.dirty = {n.id for n in made}

    def _kept_with_metadata(self) -> list[Node]:
        """The layer's kept nodes, their metadata recomputed where a member's changed.

        A kept node's members are the same nodes as before (ids, texts, vectors), so its id,
        text and vector stay; only the metadata it derives from them may differ.
        """
        kept = [self.tree.nodes[r] for r in self.kept_rows]
        if not self.relabelled_ids:
            return kept
        below = {n.id: n for n in self.out_nodes[-1]}
        out: list[Node] = []
        relabelled: set[str] = set()
        for node in kept:
            if any(c in self.relabelled_ids for c in node.children):
                metadata = summary_metadata([below[c] for c in node.children])
                if metadata != node.metadata:
                    node = replace(node, metadata=metadata)
                    relabelled.add(node.id)
            out.append(node)
        self.relabelled_ids = relabelled
        return out

    def finish_update(self, op: str) -> TreeUpdate:
        """Assemble the new tree and the report."""
        nodes = [replace(n, parents=()) for layer in self.out_nodes for n in layer]
        old = self.tree
        old_ids = {n.id for n in old.nodes}
        new_ids = {n.id for n in nodes}
        parents: dict[str, list[str]] = {}
        for n in nodes:
            for c in n.children:
                parents.setdefault(c, []).append(n.id)
        changed: list[str] = []
        relinked: list[str] = []
        for n in nodes:
            if n.id not in old_ids:
                continue
            before = old.node(n.id)
            if replace(before, parents=()) != n:
                changed.append(n.id)
            elif before.parents != tuple(parents.get(n.id, ())):
                relinked.append(n.id)
        removing = [d for d in self.removing if d not in set(self.docs_replaced)]
        report = UpdateReport(
            docs_added=tuple(self.docs_added),
            docs_replaced=tuple(self.docs_replaced),
            docs_removed=tuple(removing),
            docs_unchanged=tuple(self.docs_unchanged),
            nodes_added=tuple(n.id for n in nodes if n.id not in old_ids),
            nodes_removed=tuple(n.id for n in old.nodes if n.id not in new_ids),
            nodes_changed=tuple(changed),
            nodes_relinked=tuple(relinked),
            seconds=time.perf_counter() - self.start,
            usage={k: v for k, v in self.usage_delta().items() if v},
            **self.report,
        )
        info = dict(old.build_info)
        incremental = dict(info.get("incremental") or {})
        incremental["cohesion_floor"] = [round(float(x), 6) for x in self.floor]
        incremental["updates"] = int(incremental.get("updates", 0)) + 1
        incremental["last"] = {"op": op, **report.to_dict()}
        info["incremental"] = incremental
        info["documents"] = len({n.doc_id for n in self.out_nodes[0]})
        info["chunks"] = len(self.out_nodes[0])
        tree = Tree(
            nodes=tuple(nodes),
            embeddings=np.concatenate(self.out_vectors),
            params=old.params,
            build_info=info,
        )
        self.close()
        return TreeUpdate(tree=tree, report=report)

    def unchanged(self) -> TreeUpdate:
        report = UpdateReport(
            docs_unchanged=tuple(self.docs_unchanged),
            seconds=time.perf_counter() - self.start,
        )
        self.close()
        return TreeUpdate(tree=self.tree, report=report)

    def close(self) -> None:
        if self.cache is not None and self.owns_cache:
            self.cache.close()


# -- helpers ---------------------------------------------------------------------------------------
def _unit(x: NDArray[np.float64]) -> NDArray[np.float64]:
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(norms == 0.0, 1.0, norms)


def _cohesion(vectors: NDArray[np.float32]) -> float:
    """Mean cosine of unit ``vectors`` to their normalised mean."""
    x = vectors.astype(np.float64)
    centroid = _unit(x.mean(axis=0))
    return float(np.mean(x @ centroid))


def _centroids(
    tree: Tree, parents: Sequence[Node]
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Centroid of each parent's children and the cosine of its loosest child to it."""
    emb = tree.embeddings
    centroids = np.zeros((len(parents), tree.dim), dtype=np.float64)
    bounds = np.full(len(parents), np.nan)
    for i, parent in enumerate(parents):
        x = emb[tree.rows(list(parent.children))].astype(np.float64)
        c = _unit(x.mean(axis=0))
        centroids[i] = c
        if len(parent.children) > 1:
            bounds[i] = float(np.min(x @ c))
    multi = bounds[~np.isnan(bounds)]
    # A carried node's only member is its centroid (cosine 1): use the layer's typical bound.
    fallback = float(np.median(multi)) if multi.size else np.inf
    bounds[np.isnan(bounds)] = fallback
    return centroids, bounds


#: More summary layers than any tree has: a longer recorded floor is not one.
_MAX_FLOOR_LAYERS = 256


def checked_floor(value: object) -> list[float] | None:
    """``value`` as a cohesion floor (one cosine per summary layer), or None if it is not one.

    A floor read from a file or a store is data: a list of at most 256 finite numbers, else
    it is ignored (the next update measures the floor again).  A floor above 1 is one every
    changed cluster falls below (each drifts), one below -1 never: both stay valid settings.
    """
    if not isinstance(value, list | tuple) or len(value) > _MAX_FLOOR_LAYERS:
        return None
    if not all(
        isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in value
    ):
        return None
    return [float(x) for x in value]


def recorded_floor(build_info: Mapping[str, Any]) -> list[float] | None:
    """The cohesion floor a tree's ``build_info`` records (None: none yet, or not a valid one).

    Stores that keep a tree (vector stores, LlamaIndex's index store) save it beside the
    nodes: the first update measures it and later ones keep it, whatever store holds the tree.
    """
    incremental = build_info.get("incremental")
    return (
        checked_floor(incremental.get("cohesion_floor"))
        if isinstance(incremental, Mapping)
        else None
    )


def floor_build_info(floor: Sequence[float] | None) -> dict[str, Any]:
    """A ``build_info`` recording ``floor`` (empty for None), for a tree read from a store."""
    return {} if floor is None else {"incremental": {"cohesion_floor": list(floor)}}


def _cohesion_floor(tree: Tree) -> list[float]:
    """The drift floor of each summary layer (see the module docs), recorded or measured."""
    recorded = recorded_floor(tree.build_info)
    if recorded is not None:
        return recorded
    floors: list[float] = []
    for layer in range(1, tree.num_layers):
        values = [
            _cohesion(tree.embeddings[tree.rows(list(n.children))])
            for n in tree.layer(layer)
            if len(n.children) >= DRIFT_MIN_MEMBERS
        ]
        floors.append(float(np.quantile(values, COHESION_QUANTILE)) if values else -1.0)
    return floors


def _check_same_embedder(tree: Tree, embedder: object) -> None:
    """Refuse an embedder other than the tree's: its vectors would not be comparable."""
    from raptor_core.build.builder import describe

    recorded = tree.params.get("embedder")
    if not isinstance(recorded, Mapping):
        return
    now = describe(embedder)
    keys = [k for k in recorded if k == "class" or "model" in k or k == "dim"]
    differ = [k for k in keys if k in now and now[k] != recorded[k]]
    if differ:
        msg = (
            f"the tree was embedded with {dict((k, recorded[k]) for k in keys)}, but this "
            f"builder's embedder is {dict((k, now.get(k)) for k in keys)}: pass the same "
            "embedder, or rebuild the tree"
        )
        raise InvalidParameterError(msg)


# -- drivers ---------------------------------------------------------------------------------------
def run_sync(run: _UpdateRun, op: str) -> TreeUpdate:
    """Apply the planned change synchronously."""
    from raptor_core._threads import limit_threads

    with limit_threads(run.b.n_threads):
        texts = run.chunk_new()
        if run.nothing_to_do:
            return run.unchanged()
        run.layer = 0
        run.commit_leaves(
            run.embed_sync(texts) if texts else np.zeros((0, run.tree.dim), np.float32)
        )
        layer = 1
        while run.plan_layer(layer):
            summaries = run.summarize_sync() if run._to_summarize() else run.carried_only()
            todo = run.summary_texts(summaries)
            fresh = run.embed_sync(todo) if todo else np.zeros((0, run.tree.dim), np.float32)
            run.commit_layer_update(layer, summaries, fresh)
            layer += 1
        return run.finish_update(op)


async def run_async(run: _UpdateRun, op: str) -> TreeUpdate:
    """Apply the planned change with the async seams (CPU stages in a worker thread)."""
    import asyncio

    texts = await asyncio.to_thread(run.chunk_new)
    if run.nothing_to_do:
        return run.unchanged()
    run.layer = 0
    run.commit_leaves(await run.aembed(texts) if texts else np.zeros((0, run.tree.dim), np.float32))
    layer = 1
    while await asyncio.to_thread(run.plan_layer, layer):
        summaries = await run.summarize_async() if run._to_summarize() else run.carried_only()
        todo = run.summary_texts(summaries)
        fresh = await run.aembed(todo) if todo else np.zeros((0, run.tree.dim), np.float32)
        run.commit_layer_update(layer, summaries, fresh)
        layer += 1
    return run.finish_update(op)
