"""LlamaIndex ingestion: the user's node parsers and pipelines decide the leaves of the tree.

``RaptorIndex.from_documents(docs, transformations=[SentenceSplitter(chunk_size=256), ...])``
runs the transformations exactly as ``VectorStoreIndex`` does (``run_transformations``, or
an ``IngestionPipeline``'s ``run``) and the nodes that come out become the tree's leaves as
they are: never chunked again.  Nodes passed directly (``RaptorIndex.from_documents(nodes)``,
``insert_nodes``) are leaves too.  A LlamaIndex ``Document`` without transformations is still
split by RAPTOR's own chunker (the paper's 100-token chunks of whole sentences).
``RaptorIndex(..., rejoin_nodes=True)`` first joins a node parser's nodes back into the
documents they were cut from (:func:`rejoin_nodes`), and RAPTOR's chunker cuts those.

What a node keeps, in the tree and in every ``NodeWithScore`` retrieved from it:

* its id: the leaf's id **is** the node's id (``node.node_id``; LlamaIndex assigns a UUID to
  nodes made without one), so evaluation sets keyed by node id keep working;
* its metadata, unchanged, and its ``excluded_embed_metadata_keys`` /
  ``excluded_llm_metadata_keys``;
* its relationships (``SOURCE``, ``PREVIOUS``, ``NEXT``, ``PARENT``, ``CHILD``) and
  ``start_char_idx`` / ``end_char_idx``;
* its source document: the leaf's ``doc_id`` is the node's ``ref_doc_id`` (the node's own id
  when it has no ``SOURCE``), so summaries list source documents in ``raptor_doc_ids`` and
  ``delete_ref_doc(document_id)`` removes all of a document's nodes;
* its place among its source's nodes, in the order they were given (node parsers return
  them in document order): vector stores such as Qdrant list points in the order of their
  ids, and the default ``passage`` strategy must know which nodes are neighbours
  (:func:`chunk_position`).

The fields that raptor_core has no place for travel in one metadata entry,
:data:`LLAMAINDEX_NODE_KEY`, a JSON string (vector stores such as Chroma take strings, not
nested objects).  :func:`hit_to_node <raptor_llamaindex.retriever.hit_to_node>` takes it out
again, so it never reaches a prompt or a user.

The leaf is embedded from the node's text alone (``MetadataMode.NONE``), as RAPTOR embeds
chunks; summaries are written from the texts alone too.  A node's ``embedding``, if a
transformation set one, is not reused: the tree embeds every node with its own model so that
leaves and summaries share one vector space.

Builds and updates run inside a LlamaIndex instrumentation span (:func:`build_tree`,
:func:`update_tree`), and the LlamaIndex models wrapped by :mod:`raptor_llamaindex.models`
emit their own embedding and LLM events within it, as they do in the framework's own
indices.  raptor_core models (the default MiniLM embedder, the extractive summariser) call no
LlamaIndex model and report no events.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import string
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from llama_index.core.ingestion import IngestionPipeline, arun_transformations, run_transformations
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.schema import (
    BaseNode,
    MetadataMode,
    NodeRelationship,
    RelatedNodeInfo,
    TextNode,
    TransformComponent,
)
from llama_index.core.schema import Document as LlamaIndexDocument

from raptor_core.build.builder import TreeBuilder, to_documents
from raptor_core.build.incremental import TreeUpdate
from raptor_core.build.rejoin import rejoin_splits, split_start
from raptor_core.exceptions import InvalidParameterError
from raptor_core.tree import Tree
from raptor_core.types import Document

__all__ = [
    "LLAMAINDEX_NODE_KEY",
    "NodeFields",
    "abuild_tree",
    "arun_ingestion",
    "aupdate_tree",
    "build_tree",
    "chunk_position",
    "node_to_document",
    "pop_node_fields",
    "rejoin_nodes",
    "run_ingestion",
    "to_core_documents",
    "update_tree",
]

logger = logging.getLogger(__name__)
dispatcher = get_dispatcher(__name__)

#: Leaf metadata entry (a JSON string) holding what a LlamaIndex node keeps beyond its text
#: and metadata.  Taken out again when a leaf is returned as a ``NodeWithScore``.
LLAMAINDEX_NODE_KEY = "raptor_llamaindex_node"

_RECORD_VERSION = 1
_TEMPLATE_FIELDS = ("text_template", "metadata_template", "metadata_separator")
_TEXT_NODE_DEFAULTS = {name: TextNode.model_fields[name].default for name in _TEMPLATE_FIELDS}


# -- running the user's transformations ---------------------------------------------------------
def _check_transformations(transformations: object) -> IngestionPipeline | list[TransformComponent]:
    if isinstance(transformations, IngestionPipeline):
        return transformations
    items = (
        [transformations]
        if isinstance(transformations, TransformComponent)
        else list(transformations)
        if isinstance(transformations, Iterable) and not isinstance(transformations, str)
        else None
    )
    if items is None or not all(isinstance(t, TransformComponent) for t in items):
        msg = (
            "transformations must be a list of LlamaIndex transformations (node parsers such "
            "as SentenceSplitter, metadata extractors, ...) or an IngestionPipeline, got "
            f"{transformations!r:.200}"
        )
        raise InvalidParameterError(msg)
    return items


def run_ingestion(
    documents: Sequence[Any], transformations: object, *, show_progress: bool = False
) -> list[Any]:
    """Run ``transformations`` over ``documents`` as ``VectorStoreIndex.from_documents`` does.

    Args:
        documents: LlamaIndex documents or nodes.
        transformations: a list of ``TransformComponent`` (a single one is accepted), an
            ``IngestionPipeline`` (its own transformations, cache and docstore apply), or
            None to return ``documents`` unchanged.
        show_progress: LlamaIndex's progress bars.

    Returns:
        The nodes that become the tree's leaves.  The input list is not modified.

    Raises:
        InvalidParameterError: ``transformations`` holds something else.
    """
    if transformations is None:
        return list(documents)
    checked = _check_transformations(transformations)
    if isinstance(checked, IngestionPipeline):
        return list(checked.run(documents=list(documents), show_progress=show_progress))
    return list(
        run_transformations(list(documents), checked, in_place=False, show_progress=show_progress)
    )


async def arun_ingestion(
    documents: Sequence[Any], transformations: object, *, show_progress: bool = False
) -> list[Any]:
    """Async :func:`run_ingestion` (``arun_transformations`` / ``IngestionPipeline.arun``)."""
    if transformations is None:
        return list(documents)
    checked = _check_transformations(transformations)
    if isinstance(checked, IngestionPipeline):
        return list(await checked.arun(documents=list(documents), show_progress=show_progress))
    return list(
        await arun_transformations(
            list(documents), checked, in_place=False, show_progress=show_progress
        )
    )


# -- nodes back into their documents ------------------------------------------------------------
def _node_start(item: object) -> tuple[str, int] | None:
    """(source id, offset in it) of a node a node parser cut from a document, else None."""
    if not isinstance(item, TextNode) or isinstance(item, LlamaIndexDocument):
        return None
    source = item.ref_doc_id
    start = split_start(item.start_char_idx)
    if not source or start is None:
        return None
    return source, start


def rejoin_nodes(items: Sequence[Any]) -> list[Any]:
    """Nodes a node parser cut from one document, put back together into that document.

    LlamaIndex's node parsers (``SentenceSplitter`` and the others) record each node's
    source (``ref_doc_id``) and where it starts in the source's text (``start_char_idx``).
    Consecutive nodes of one source with the same metadata, advancing offsets and agreeing
    overlaps (``chunk_overlap``) are that source's text again
    (:func:`raptor_core.build.rejoin.rejoin_splits` lays them); they are replaced, at the
    first one's place, by a LlamaIndex ``Document`` with the source's id, that text, and
    the nodes' metadata and excluded metadata keys, which RAPTOR's chunker then cuts into
    its own leaves.  A source's only node becomes a ``Document`` the same way.

    Everything else is returned as given, so nothing is joined on a guess: documents,
    nodes without a source or an offset, and every node of a source whose nodes here do not
    make exactly one run (a gap, other metadata, overlaps that disagree, nodes of another
    source in between) or whose text repeats itself so closely that its offsets are
    ambiguous (``refuse_periodic`` of :func:`~raptor_core.build.rejoin.rejoin_splits`).

    Examples:
        >>> from llama_index.core import Document
        >>> from llama_index.core.node_parser import SentenceSplitter
        >>> text = " ".join(f"Bee {i} dances to show where flowers grow." for i in range(40))
        >>> source = Document(text=text, id_="bees")
        >>> nodes = SentenceSplitter(chunk_size=64, chunk_overlap=16).get_nodes_from_documents([source])
        >>> len(nodes), [(d.id_, d.text == text) for d in rejoin_nodes(nodes)]
        (10, [('bees', True)])
    """
    items = list(items)
    keys = [_node_start(item) for item in items]
    plain = []
    for item, key in zip(items, keys, strict=True):
        if key is None:
            # Not a node with an offset: rejoin_splits leaves it alone (its offset is None).
            plain.append(Document(text="", doc_id=""))
            continue
        # Only nodes of one source, with one metadata and one set of hidden keys, may join.
        same = {
            "source": key[0],
            "metadata": item.metadata,
            "embed": item.excluded_embed_metadata_keys,
            "llm": item.excluded_llm_metadata_keys,
        }
        text = item.get_content(metadata_mode=MetadataMode.NONE)
        plain.append(Document(text=text, doc_id=item.node_id, metadata=same))
    # LlamaIndex searches for a node's text from the previous node's start, so in text that
    # repeats itself the offsets land too early; such runs come back as their nodes, and a
    # source split into several runs is left as given below.
    runs = rejoin_splits(
        plain, [None if key is None else key[1] for key in keys], refuse_periodic=True
    )
    runs_of: dict[str, int] = {}
    for run in runs:
        key = keys[run.parts[0]]
        if key is not None:
            runs_of[key[0]] = runs_of.get(key[0], 0) + 1
    out: list[Any] = []
    for run in runs:
        first = items[run.parts[0]]
        key = keys[run.parts[0]]
        if key is None or runs_of[key[0]] != 1:
            out.extend(items[i] for i in run.parts)
            continue
        out.append(
            LlamaIndexDocument(
                id_=key[0],
                text=run.document.text,
                metadata=dict(first.metadata),
                excluded_embed_metadata_keys=list(first.excluded_embed_metadata_keys),
                excluded_llm_metadata_keys=list(first.excluded_llm_metadata_keys),
            )
        )
    return out


# -- nodes to leaves ------------------------------------------------------------------------------
def _relationships_json(node: BaseNode) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for relation, info in node.relationships.items():
        if isinstance(info, list):
            out[str(relation.value)] = [i.model_dump(mode="json") for i in info]
        else:
            out[str(relation.value)] = info.model_dump(mode="json")
    return out


def node_to_document(node: BaseNode, *, position: int | None = None) -> Document:
    """A pre-split core document for one LlamaIndex node (one leaf; see the module docs).

    ``position`` is the node's place among its source document's nodes (from 0), recorded
    so that a store listing nodes in another order can give them back in document order.

    Raises:
        InvalidInputError: from the core's checks later (empty text, non-JSON metadata).
    """
    source = node.ref_doc_id or node.node_id
    record: dict[str, Any] = {
        "version": _RECORD_VERSION,
        # The id makes every record unique, so a summary never inherits one as metadata
        # that all its leaves share.
        "id": node.node_id,
        "source": source,
        "excluded_embed_metadata_keys": list(node.excluded_embed_metadata_keys),
        "excluded_llm_metadata_keys": list(node.excluded_llm_metadata_keys),
        "relationships": _relationships_json(node),
    }
    if isinstance(node, TextNode):
        record["start_char_idx"] = node.start_char_idx
        record["end_char_idx"] = node.end_char_idx
        for name in _TEMPLATE_FIELDS:
            if getattr(node, name) != _TEXT_NODE_DEFAULTS[name]:
                record[name] = getattr(node, name)
    if position is not None:
        record["position"] = position
    metadata = dict(node.metadata)
    metadata[LLAMAINDEX_NODE_KEY] = json.dumps(record, ensure_ascii=False, default=str)
    return Document(
        text=node.get_content(metadata_mode=MetadataMode.NONE),
        doc_id=node.node_id,
        metadata=metadata,
        chunk_of=source,
    )


def _whole_document(document: LlamaIndexDocument) -> Document:
    # A LlamaIndex Document without transformations: RAPTOR's chunker splits it.
    metadata = dict(document.metadata)
    ref = document.ref_doc_id
    if ref is not None and ref != document.node_id:
        metadata.setdefault("ref_doc_id", ref)
    return Document(
        text=document.get_content(metadata_mode=MetadataMode.NONE),
        doc_id=document.node_id,
        metadata=metadata,
    )


def _parse_record(raw: object) -> dict[str, Any] | None:
    """The node record in ``raw`` (a leaf's metadata entry), or None when it is damaged.

    The entry comes from files anyone may edit: besides broken JSON, an over-long integer
    (ValueError) or a nesting deeper than the parser's recursion (RecursionError) is a
    damaged record too, never an error of the retrieval that meets it.
    """
    if not isinstance(raw, str):
        return None
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):  # ValueError covers json.JSONDecodeError
        return None
    return record if isinstance(record, dict) else None


def _record(metadata: Mapping[str, Any]) -> dict[str, Any]:
    return _parse_record(metadata.get(LLAMAINDEX_NODE_KEY)) or {}


def _source(record: Mapping[str, Any]) -> str | None:
    source = record.get("source")
    return source if isinstance(source, str) and source else None


def _source_of(metadata: Mapping[str, Any]) -> str | None:
    return _source(_record(metadata))


def chunk_position(metadata: Mapping[str, Any]) -> int | None:
    """A pre-split leaf's place among its source's nodes, from its metadata (None: unknown).

    Leaves written before positions were recorded have none; they keep the store's order.
    """
    return _position(_record(metadata))


def _position(record: Mapping[str, Any]) -> int | None:
    position = record.get("position")
    if isinstance(position, int) and not isinstance(position, bool) and position >= 0:
        return position
    return None


def to_core_documents(items: Iterable[Any]) -> list[Document]:
    """Convert LlamaIndex documents and nodes (or raptor_core inputs) to core documents.

    A LlamaIndex ``Document`` is a whole text for RAPTOR's chunker; any other node (a
    ``TextNode`` from a node parser) is one pre-split leaf (:func:`node_to_document`).
    Core documents that carry a node record (read back from a persisted index) are marked
    pre-split again.  Strings, core documents and mappings pass through to
    :func:`raptor_core.build.builder.to_documents`.

    Raises:
        InvalidInputError: a document is empty, binary, has non-JSON metadata or a duplicate id.
    """
    converted: list[Any] = []
    # Nodes are numbered per source in the order given, after those of the source already
    # indexed (documents read back come first: see RaptorIndex's updates).
    following: dict[str, int] = {}
    for item in items:
        if isinstance(item, LlamaIndexDocument):
            converted.append(_whole_document(item))
        elif isinstance(item, BaseNode):
            source = item.ref_doc_id or item.node_id
            position = following.get(source, 0)
            following[source] = position + 1
            converted.append(node_to_document(item, position=position))
        else:
            converted.append(item)
            if isinstance(item, Document):
                record = _record(item.metadata)
                known = _position(record)
                if known is not None:
                    origin = _source(record) or item.chunk_of or item.doc_id
                    following[origin] = max(following.get(origin, 0), known + 1)
    out = []
    for doc in to_documents(converted):
        of = None if doc.chunk_of is not None else _source_of(doc.metadata)
        out.append(doc if of is None else dataclasses.replace(doc, chunk_of=of))
    return out


# -- leaves back to nodes -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NodeFields:
    """What :func:`pop_node_fields` restores onto a retrieved ``TextNode``."""

    excluded_embed_metadata_keys: tuple[str, ...] = ()
    excluded_llm_metadata_keys: tuple[str, ...] = ()
    relationships: Mapping[NodeRelationship, RelatedNodeInfo | list[RelatedNodeInfo]] = (
        dataclasses.field(default_factory=dict)
    )
    start_char_idx: int | None = None
    end_char_idx: int | None = None
    templates: Mapping[str, str] = dataclasses.field(default_factory=dict)


def _strings(value: object) -> tuple[str, ...]:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return ()


def _related(value: object) -> RelatedNodeInfo | None:
    # Built field by field: the record is data (a tree file may come from anyone), so only
    # these plain fields are read, never a class name.
    if not isinstance(value, dict) or not isinstance(value.get("node_id"), str):
        return None
    metadata = value.get("metadata")
    hash_ = value.get("hash")
    try:
        return RelatedNodeInfo(
            node_id=value["node_id"],
            node_type=value.get("node_type"),
            metadata=metadata if isinstance(metadata, dict) else {},
            hash=hash_ if isinstance(hash_, str) else None,
        )
    except ValueError:  # pydantic's ValidationError: an unknown node_type
        return None


def _relationships(value: object) -> dict[NodeRelationship, Any]:
    out: dict[NodeRelationship, Any] = {}
    if not isinstance(value, dict):
        return out
    for key, raw in value.items():
        try:
            relation = NodeRelationship(key)
        except ValueError:
            continue
        if isinstance(raw, list):
            infos = [i for i in (_related(r) for r in raw) if i is not None]
            if infos:
                out[relation] = infos
        else:
            info = _related(raw)
            if info is not None:
                out[relation] = info
    return out


#: The placeholders each template may use: LlamaIndex fills them with str.format, so a
#: template read from a file must not reach attributes or items ("{content.__class__}").
_TEMPLATE_PLACEHOLDERS = {
    "text_template": frozenset({"content", "metadata_str"}),
    "metadata_template": frozenset({"key", "value"}),
    "metadata_separator": frozenset(),
}


def _safe_template(name: str, value: object) -> bool:
    if not isinstance(value, str):
        return False
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(value) if f is not None]
    except ValueError:  # unbalanced braces
        return False
    return all(f in _TEMPLATE_PLACEHOLDERS[name] for f in fields)


def _index(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def pop_node_fields(metadata: dict[str, Any]) -> NodeFields | None:
    """Remove the node record from a leaf's ``metadata`` (in place) and parse it.

    Returns None when the leaf was not a LlamaIndex node.  A damaged record is dropped
    with a warning (the text and metadata are still returned).
    """
    raw = metadata.pop(LLAMAINDEX_NODE_KEY, None)
    if raw is None:
        return None
    record = _parse_record(raw)
    if record is None:
        logger.warning("ignoring a damaged %s entry in a leaf's metadata", LLAMAINDEX_NODE_KEY)
        return None
    return NodeFields(
        excluded_embed_metadata_keys=_strings(record.get("excluded_embed_metadata_keys")),
        excluded_llm_metadata_keys=_strings(record.get("excluded_llm_metadata_keys")),
        relationships=_relationships(record.get("relationships")),
        start_char_idx=_index(record.get("start_char_idx")),
        end_char_idx=_index(record.get("end_char_idx")),
        templates={
            name: record[name]
            for name in _TEMPLATE_FIELDS
            if name in record and _safe_template(name, record[name])
        },
    )


# -- building under an instrumentation span -------------------------------------------------------
@dispatcher.span
def build_tree(builder: TreeBuilder, documents: Sequence[Document]) -> Tree:
    """``builder.build(documents)`` inside a LlamaIndex instrumentation span."""
    return builder.build(documents)


@dispatcher.span
async def abuild_tree(builder: TreeBuilder, documents: Sequence[Document]) -> Tree:
    """``await builder.abuild(documents)`` inside a LlamaIndex instrumentation span."""
    return await builder.abuild(documents)


@dispatcher.span
def update_tree(builder: TreeBuilder, op: str, tree: Tree, items: Sequence[Any]) -> TreeUpdate:
    """``builder.insert/update/delete(tree, items)`` (``op``) inside an instrumentation span."""
    if op == "insert":
        return builder.insert(tree, items)
    if op == "update":
        return builder.update(tree, items)
    return builder.delete(tree, items)


@dispatcher.span
async def aupdate_tree(
    builder: TreeBuilder, op: str, tree: Tree, items: Sequence[Any]
) -> TreeUpdate:
    """Async :func:`update_tree` (the core's async twins)."""
    if op == "insert":
        return await builder.ainsert(tree, items)
    if op == "update":
        return await builder.aupdate(tree, items)
    return await builder.adelete(tree, items)
