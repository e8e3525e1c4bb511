"""``RaptorRetriever``: a LlamaIndex ``BaseRetriever`` over a RAPTOR tree.

The class translates between dialects and nothing more: LlamaIndex's ``similarity_top_k``
becomes the core's ``k``, a core ``Hit`` becomes a ``NodeWithScore`` over a ``TextNode``.
The search itself is one of raptor_core's strategies.  Only ``_retrieve``/``_aretrieve``
are implemented, so LlamaIndex's ``retrieve`` keeps firing its callback and
instrumentation events (``RetrievalStartEvent``/``RetrievalEndEvent``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.base.llms.base import BaseLLM
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.constants import DEFAULT_SIMILARITY_TOP_K
from llama_index.core.schema import (
    IndexNode,
    NodeRelationship,
    NodeWithScore,
    QueryBundle,
    RelatedNodeInfo,
    TextNode,
)
from llama_index.core.vector_stores.types import MetadataFilters

from raptor_core.exceptions import InvalidParameterError, TreeFormatError
from raptor_core.retrieval import DEFAULT_MAX_TOKENS, Hit, TreeRetriever
from raptor_core.retrieval.registry import DEFAULT_STRATEGY as CORE_DEFAULT_STRATEGY
from raptor_core.retrieval.registry import STRATEGIES, accepted_params, make_retriever
from raptor_core.store._format import (
    MAX_JSON_BYTES,
    MAX_VALUE_DEPTH,
    _open_regular,
    _parse_json,
    write_tree,
)
from raptor_core.tree import Node, Tree
from raptor_core.types import LLM, Embedder, NodeStore
from raptor_llamaindex.ingestion import LLAMAINDEX_NODE_KEY, pop_node_fields
from raptor_llamaindex.models import attach_callback_manager, resolve_embedder, resolve_llm
from raptor_llamaindex.store import core_where

if TYPE_CHECKING:
    from raptor_llamaindex.index import RaptorIndex

__all__ = ["DEFAULT_STRATEGY", "RAPTOR_METADATA_KEYS", "RaptorRetriever", "hit_to_node"]

logger = logging.getLogger(__name__)

# The core's default (``"passage"``), so the adapters follow the registry.
DEFAULT_STRATEGY = CORE_DEFAULT_STRATEGY

#: Metadata keys this adapter adds to every node.  They are hidden from the LLM and from
#: re-embedding (``excluded_*_metadata_keys``) so they do not pollute prompts.
RAPTOR_METADATA_KEYS = (
    "raptor_layer",
    "raptor_doc_id",
    "raptor_span",
    "raptor_doc_ids",
    "raptor_children",
    "raptor_source",
    "raptor_path",
    "raptor_reason",
    "raptor_leaves",
)

#: The metadata key the core builder marks a carried copy with (see raptor_core.tree).
_CARRIED_KEY = "carried"

#: Strategies that call an LLM (async end to end in the core).
_NEEDS_LLM = frozenset({"llm", "hybrid"})

#: The file ``persist`` writes next to the tree's own files.
PARAMS_FILE = "raptor_llamaindex.json"
_FORMAT = "raptor-llamaindex"
_FORMAT_VERSION = 1


def hit_to_node(
    hit: Hit,
    *,
    excluded_llm_metadata_keys: Sequence[str] = (),
    excluded_embed_metadata_keys: Sequence[str] = (),
    last_leaf: Node | None = None,
) -> NodeWithScore:
    """Turn a core :class:`~raptor_core.Hit` into a LlamaIndex ``NodeWithScore``.

    Leaves keep their document's metadata and gain ``raptor_layer`` (0), ``raptor_doc_id``,
    ``raptor_span`` (``[start, end]`` character offsets, also in ``start_char_idx`` /
    ``end_char_idx``) and a ``SOURCE`` relationship, so ``node.ref_doc_id`` is the document id.
    Summaries keep the metadata all their leaves share (so a summary that passes a metadata
    filter shows why) and carry ``raptor_layer``, ``raptor_doc_ids`` (the documents they
    cover) and ``raptor_children`` (also as ``CHILD`` relationships); one over a single
    document has it as ``SOURCE`` too.  A node inside a summary links it as ``PARENT`` (the
    first one).  A passage of several leaves (the ``"passage"`` strategy) is a leaf-like node
    whose ``raptor_leaves`` lists the leaf ids it joins, in document order; its id is made
    for the hit (``first..last``, stored nowhere).  When its leaves were LlamaIndex nodes it
    keeps their ``SOURCE``, the first one's ``PREVIOUS`` and the last one's ``NEXT``
    (``last_leaf``: that leaf, as stored), so ``PrevNextNodePostprocessor`` extends it as it
    would a node.  The ``raptor_*`` keys, and the
    document keys named in ``excluded_*_metadata_keys``, are kept out of prompts and
    embeddings as LlamaIndex does for its own bookkeeping.
    """
    node = hit.node
    metadata: dict[str, Any] = dict(node.metadata)
    if not node.is_leaf:
        # The builder's mark of a carried copy: bookkeeping, never metadata its leaves
        # share (the builder leaves "carried" out of what it copies up).
        metadata.pop(_CARRIED_KEY, None)
    # A leaf that was a LlamaIndex node gets its node's fields back (see ingestion.py).  A
    # summary holds a record only when it is a carried copy of one such leaf; it keeps
    # that node's metadata exclusions, not its relationships or offsets.
    fields = pop_node_fields(metadata)
    metadata["raptor_layer"] = node.layer
    metadata["raptor_doc_ids"] = list(node.doc_ids)
    metadata["raptor_source"] = hit.source
    relationships: dict[NodeRelationship, Any] = {}
    if node.doc_id is not None:
        # A chunk's document, or the one document a summary covers: node.ref_doc_id.
        relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id=node.doc_id)
    if node.parents:
        relationships[NodeRelationship.PARENT] = RelatedNodeInfo(node_id=node.parents[0])
    if node.is_leaf:
        metadata["raptor_doc_id"] = node.doc_id
        metadata["raptor_span"] = list(node.span) if node.span is not None else None
    else:
        metadata["raptor_children"] = list(node.children)
        relationships[NodeRelationship.CHILD] = [RelatedNodeInfo(node_id=c) for c in node.children]
    if len(hit.path) > 1:
        metadata["raptor_path"] = list(hit.path)
    if hit.reason:
        metadata["raptor_reason"] = hit.reason
    if hit.leaves:
        metadata["raptor_leaves"] = list(hit.leaves)
    hidden = [k for k in RAPTOR_METADATA_KEYS if k in metadata]
    start = node.span[0] if node.span is not None else None
    end = node.span[1] if node.span is not None else None
    extra: dict[str, Any] = {}
    if fields is not None:
        excluded_embed_metadata_keys = [
            *fields.excluded_embed_metadata_keys,
            *excluded_embed_metadata_keys,
        ]
        excluded_llm_metadata_keys = [
            *fields.excluded_llm_metadata_keys,
            *excluded_llm_metadata_keys,
        ]
    if fields is not None and node.is_leaf:
        if len(hit.leaves) > 1:
            # A passage of several nodes: their shared document, and what lies around the
            # run (before its first node, after its last); the first node's offsets and
            # templates would be wrong for the joined text.
            source = fields.relationships.get(NodeRelationship.SOURCE)
            if source is not None:
                relationships[NodeRelationship.SOURCE] = source
            previous = fields.relationships.get(NodeRelationship.PREVIOUS)
            if previous is not None:
                relationships[NodeRelationship.PREVIOUS] = previous
            after = _next_of(last_leaf)
            if after is not None:
                relationships[NodeRelationship.NEXT] = after
        else:
            relationships = {**relationships, **fields.relationships}
            start, end = fields.start_char_idx, fields.end_char_idx
            extra = dict(fields.templates)
    text_node = TextNode(
        id_=node.id,
        text=node.text,
        metadata=metadata,
        excluded_embed_metadata_keys=list(dict.fromkeys([*hidden, *excluded_embed_metadata_keys])),
        excluded_llm_metadata_keys=list(dict.fromkeys([*hidden, *excluded_llm_metadata_keys])),
        relationships=relationships,
        start_char_idx=start,
        end_char_idx=end,
        **extra,
    )
    return NodeWithScore(node=text_node, score=hit.score)


def _next_of(leaf: Node | None) -> Any:
    """The ``NEXT`` relationship a leaf that was a LlamaIndex node had, else None."""
    if leaf is None:
        return None
    fields = pop_node_fields(dict(leaf.metadata))
    return None if fields is None else fields.relationships.get(NodeRelationship.NEXT)


def make_core_retriever(
    strategy: str,
    tree: Tree | NodeStore,
    embedder: Embedder,
    *,
    llm: LLM | None,
    k: int,
    max_tokens: int | None,
    params: Mapping[str, Any],
) -> TreeRetriever:
    """Create the raptor_core strategy object (validates the strategy and its parameters).

    Raises:
        InvalidParameterError: unknown strategy, or a parameter it does not take: the
            core's own ``k`` and ``max_tokens`` are refused among ``params``, since this
            adapter sets them from ``similarity_top_k`` and ``max_tokens``.
    """
    check_strategy_params(strategy, params)
    return make_retriever(
        strategy,
        tree,  # type: ignore[arg-type]  # every strategy takes a NodeStore where a Tree goes
        embedder,
        llm=llm,
        k=k,
        max_tokens=max_tokens,
        **params,
    )


def strategy_param_names(strategy: str) -> frozenset[str]:
    """The strategy's own keyword parameters (besides ``k``/``max_tokens``/``llm``).

    Raises:
        InvalidParameterError: unknown strategy.
    """
    return frozenset(accepted_params(strategy)) - {"k", "max_tokens"}


#: The core's parameters that the retriever sets from its own, with what to pass instead.
_CORE_NAMES = {
    "k": "pass similarity_top_k= instead (LlamaIndex's name for the number of nodes returned)",
    "max_tokens": "pass it as the retriever's own max_tokens= (the budget for all nodes together)",
}


def check_strategy_params(strategy: str, params: Mapping[str, Any]) -> None:
    """Refuse a strategy parameter the retriever cannot pass on, naming what it takes.

    The core's message would list ``k`` and ``max_tokens`` as accepted; here they come
    from the retriever's own ``similarity_top_k`` and ``max_tokens``, so the message lists
    the names a caller can actually pass.

    Raises:
        InvalidParameterError: unknown strategy, the core's ``k``/``max_tokens`` among the
            strategy parameters, or a parameter the strategy does not take.
    """
    known = strategy_param_names(strategy)
    for core, hint in _CORE_NAMES.items():
        if core in params:
            msg = f"a RAPTOR retriever takes no {core!r} strategy parameter: {hint}"
            raise InvalidParameterError(msg)
    unknown = sorted(str(name)[:80] for name in set(params) - known)
    if unknown:
        own = ", ".join(retriever_param_names())
        msg = (
            f"unknown retriever parameter(s) {', '.join(unknown)}: strategy {strategy!r} "
            f"takes {', '.join(sorted(known)) or 'no parameters of its own'}; the retriever "
            f"itself takes {own}"
        )
        raise InvalidParameterError(msg)


def retriever_param_names() -> tuple[str, ...]:
    """The keyword parameters of :class:`RaptorRetriever` itself (besides the strategy's)."""
    return tuple(
        name
        for name, param in inspect.signature(RaptorRetriever.__init__).parameters.items()
        if param.kind is param.KEYWORD_ONLY
    )


#: ``VectorStoreQueryMode`` values a RAPTOR retriever serves (LlamaIndex's own habit).
QUERY_MODES = ("default", "mmr")
#: Strategies ``vector_store_query_mode="mmr"`` may replace: the default ones (saved by an
#: index) and the collapsed pool MMR re-ranks.
_MMR_REPLACES = frozenset({CORE_DEFAULT_STRATEGY, "collapsed", "mmr"})


def query_mode_strategy(
    mode: object,
    kwargs: Mapping[str, Any] | None,
    strategy: str,
    strategy_params: Mapping[str, Any],
) -> tuple[str, dict[str, Any]]:
    """The strategy and parameters that LlamaIndex's ``vector_store_query_mode`` asks for.

    ``"mmr"`` runs the core ``"mmr"`` strategy, with ``mmr_threshold`` as its
    ``lambda_mult`` (both weigh relevance against redundancy the same way).

    Raises:
        InvalidParameterError: an unsupported mode, unknown ``vector_store_kwargs``, or
            ``"mmr"`` with a strategy it cannot replace.
    """
    name = getattr(mode, "value", mode)  # a VectorStoreQueryMode member or its string
    if name not in QUERY_MODES:
        msg = (
            f"vector_store_query_mode must be one of {', '.join(map(repr, QUERY_MODES))} "
            f"for a RAPTOR retriever, got {mode!r} (for keyword or hybrid search, use "
            "strategy='passage', which adds BM25 to the dense ranking)"
        )
        raise InvalidParameterError(msg)
    extra = dict(kwargs or {})
    params = dict(strategy_params)
    if name == "default":
        if extra:
            msg = (
                f"vector_store_kwargs {sorted(extra)} need vector_store_query_mode='mmr'; "
                "pass strategy parameters as keywords instead"
            )
            raise InvalidParameterError(msg)
        return strategy, params
    unknown = sorted(set(extra) - {"mmr_threshold"})
    if unknown:
        msg = f"unknown vector_store_kwargs {unknown} for mmr; accepted: mmr_threshold"
        raise InvalidParameterError(msg)
    if strategy not in _MMR_REPLACES:
        msg = (
            f"vector_store_query_mode='mmr' runs the 'mmr' strategy; it cannot be combined "
            f"with strategy={strategy!r}"
        )
        raise InvalidParameterError(msg)
    if strategy != "mmr":
        params = {}  # parameters of the replaced strategy would not fit MMR
    if "mmr_threshold" in extra:
        params["lambda_mult"] = extra["mmr_threshold"]
    return "mmr", params


class RaptorRetriever(BaseRetriever):
    """RAPTOR tree retriever for LlamaIndex.

    Searches a :class:`raptor_core.Tree` with any raptor_core strategy (``"passage"``:
    leaf hits grown into contiguous passages, the default; ``"collapsed"``: all layers
    ranked together, the paper's; ``"traversal"``: top-down beam; ``"value"``, ``"llm"``,
    ``"hybrid"``) and returns ``NodeWithScore`` objects, so it drops into query
    engines, chat engines, routers, fusion retrievers and postprocessors unchanged.

    Setup:
        ``pip install 'raptor-retriever[llamaindex]'``

    Key init args:
        tree: the RAPTOR tree (``Tree.load(dir)`` or ``TreeBuilder``), or a NodeStore
            holding one (``RaptorIndex.store``: a ``LlamaIndexNodeStore`` over a vector store).
        embed_model: the model the tree was built with: a LlamaIndex ``BaseEmbedding`` or a
            raptor_core ``Embedder``.  Default: the embedder recorded in the tree when a load
            may create it by itself (a local sentence-transformers model by name, see
            ``docs/loading-trees.md``), else ``Settings.embed_model`` if configured; a tree
            recording no embedder gets the packaged all-MiniLM-L6-v2.
        strategy: ``"passage"`` (default), ``"collapsed"``, ``"traversal"``, ``"value"``,
            ``"mmr"``, ``"llm"``, ``"hybrid"``.
        filters: LlamaIndex ``MetadataFilters`` on the documents' metadata (``doc_id`` /
            ``ref_doc_id`` mean the node's document); translated to the core filter
            dialect, so every strategy and store applies them alike.
        similarity_top_k: maximum number of nodes returned (the core's ``k``).
        max_tokens: token budget for all returned nodes together (the paper uses 2,000);
            ``None`` for no budget.
        llm: the LLM that guides the ``"llm"`` and ``"hybrid"`` strategies (LlamaIndex ``LLM``
            or raptor_core ``LLM``; default ``Settings.llm`` if configured).
        excluded_llm_metadata_keys / excluded_embed_metadata_keys: document metadata keys to
            keep out of prompts / embeddings (``RaptorIndex`` copies them from your
            ``Document`` objects, e.g. the file paths ``SimpleDirectoryReader`` hides).
        vector_store_query_mode: ``"default"``, or ``"mmr"`` as with ``VectorIndexRetriever``:
            runs the ``"mmr"`` strategy (maximal marginal relevance over every layer);
            ``vector_store_kwargs={"mmr_threshold": x}`` weighs relevance against novelty
            (the core's ``lambda_mult``; 1 is plain similarity).
        **strategy_params: the strategy's own parameters, e.g. ``layers=[0]`` or
            ``min_score=0.3`` for collapsed; ``start_layer``, ``num_layers``, ``top_k``,
            ``threshold`` for traversal.

    Instantiate:
        .. code-block:: python

            from raptor_core import TreeBuilder
            from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer
            from raptor_llamaindex import RaptorRetriever

            embedder = FakeEmbedder()
            tree = TreeBuilder(embedder, EchoSummarizer(), tokenizer=WhitespaceTokenizer(),
                               random_state=0).build(["Bees dance. Bees make honey. " * 20])
            retriever = RaptorRetriever(tree, embedder, similarity_top_k=3)

    Usage:
        .. code-block:: python

            for hit in retriever.retrieve("how do bees communicate?"):
                print(hit.score, hit.node.metadata["raptor_layer"], hit.node.text[:60])

    Use within a query engine:
        .. code-block:: python

            from llama_index.core.llms import MockLLM
            from llama_index.core.query_engine import RetrieverQueryEngine

            engine = RetrieverQueryEngine.from_args(retriever, llm=MockLLM())
            response = engine.query("how do bees communicate?")
    """

    def __init__(
        self,
        tree: Tree | NodeStore,
        embed_model: BaseEmbedding | Embedder | None = None,
        *,
        filters: MetadataFilters | None = None,
        strategy: str = DEFAULT_STRATEGY,
        similarity_top_k: int = DEFAULT_SIMILARITY_TOP_K,
        max_tokens: int | None = DEFAULT_MAX_TOKENS,
        llm: BaseLLM | LLM | None = None,
        excluded_llm_metadata_keys: Sequence[str] = (),
        excluded_embed_metadata_keys: Sequence[str] = (),
        callback_manager: CallbackManager | None = None,
        objects: list[IndexNode] | None = None,
        object_map: dict[str, Any] | None = None,
        verbose: bool = False,
        vector_store_query_mode: str = "default",
        vector_store_kwargs: Mapping[str, Any] | None = None,
        **strategy_params: Any,
    ) -> None:
        strategy, strategy_params = query_mode_strategy(
            vector_store_query_mode, vector_store_kwargs, strategy, strategy_params
        )
        if not isinstance(tree, Tree | NodeStore):
            msg = (
                "tree must be a raptor_core Tree or a NodeStore (LlamaIndexNodeStore, ...), "
                f"got {type(tree).__name__}"
            )
            raise InvalidParameterError(msg)
        self._tree = tree
        shape = tree if isinstance(tree, Tree) else getattr(tree, "shape", lambda: None)()
        self._embedder = resolve_embedder(embed_model, tree=shape)
        self._llm = resolve_llm(llm)
        if callback_manager is not None:
            # resolve_llm(llm, callback_manager=...)'s convention: the LLM-guided
            # strategies' calls report to the retriever's callback manager.
            attach_callback_manager(self._llm, callback_manager)
        if filters is not None and not isinstance(filters, MetadataFilters):
            msg = f"filters must be a LlamaIndex MetadataFilters, got {type(filters).__name__}"
            raise InvalidParameterError(msg)
        self.filters = filters
        self.strategy = strategy
        self.similarity_top_k = similarity_top_k
        self.max_tokens = max_tokens
        self.excluded_llm_metadata_keys = list(excluded_llm_metadata_keys)
        self.excluded_embed_metadata_keys = list(excluded_embed_metadata_keys)
        self.strategy_params = dict(strategy_params)
        # Set by RaptorIndex.as_retriever so that documents inserted later are seen.
        self._index: RaptorIndex | None = None
        self._seen = -1
        # Built now so that a bad strategy or parameter fails here, not at the first query.
        self._core = self._make_core()
        super().__init__(
            callback_manager=callback_manager,
            objects=objects,
            object_map=object_map,
            verbose=verbose,
        )

    def __repr__(self) -> str:
        return (
            f"RaptorRetriever(strategy={self.strategy!r}, "
            f"similarity_top_k={self.similarity_top_k}, max_tokens={self.max_tokens}, "
            f"tree={self._tree!r})"
        )

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_defaults(
        cls,
        *,
        nodes: Sequence[Any] | None = None,
        documents: Sequence[Any] | None = None,
        tree: Tree | None = None,
        embed_model: BaseEmbedding | Embedder | None = None,
        llm: BaseLLM | LLM | None = None,
        builder_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> RaptorRetriever:
        """Build a tree over ``nodes`` or ``documents`` (or take ``tree``) and wrap it.

        Args:
            nodes: LlamaIndex nodes; each is one leaf of the tree, kept whole with its id
                (``builder_kwargs={"rejoin_nodes": True}`` joins a node parser's nodes back
                into their documents instead: see ``RaptorIndex``).
            documents: LlamaIndex ``Document`` objects.
            tree: an existing tree instead of nodes/documents.
            embed_model: embeds chunks, summaries and queries (see the class docstring).
            llm: summarises clusters (default: ``Settings.llm`` if configured, else the
                offline extractive summariser) and guides LLM strategies.
            builder_kwargs: :class:`raptor_core.TreeBuilder` parameters (``random_state``, ...).
            **kwargs: retriever parameters (``similarity_top_k``, ``strategy``, ...).
        """
        given = sum(x is not None for x in (nodes, documents, tree))
        if given != 1:
            msg = "pass exactly one of nodes=, documents= or tree="
            raise InvalidParameterError(msg)
        if tree is None:
            from raptor_llamaindex.index import RaptorIndex

            items = nodes if nodes is not None else documents
            index = RaptorIndex.from_documents(
                list(items or ()), embed_model=embed_model, llm=llm, **dict(builder_kwargs or {})
            )
            return index.as_retriever(**kwargs)
        return cls(tree, embed_model, llm=llm, **kwargs)

    def _make_core(self) -> TreeRetriever:
        params = dict(self.strategy_params)
        if self.filters is not None:
            # The user's LlamaIndex filters, in the core dialect: every strategy and every
            # store (the in-memory tree too) applies them the same way.
            wanted = core_where(self.filters)
            given = params.get("where")
            params["where"] = wanted if given is None else {"$and": [given, wanted]}
        return make_core_retriever(
            self.strategy,
            self._tree,
            self._embedder,
            llm=self._llm,
            k=self.similarity_top_k,
            max_tokens=self.max_tokens,
            params=params,
        )

    @property
    def tree(self) -> Tree:
        """The tree searched (the index's current one when created by ``RaptorIndex``)."""
        self._sync_tree()
        if self._index is not None:
            return self._index.tree
        if isinstance(self._tree, Tree):
            return self._tree
        to_tree = getattr(self._tree, "to_tree", None)
        if to_tree is None:
            msg = f"{type(self._tree).__name__} cannot export its nodes as a Tree"
            raise InvalidParameterError(msg)
        tree: Tree = to_tree()
        return tree

    @property
    def store(self) -> Tree | NodeStore:
        """What the strategies search: the tree, or a NodeStore over a vector store."""
        return self._tree

    def _follow(self, index: RaptorIndex) -> None:
        """Track ``index``: its updates are seen on the next query."""
        self._index = index
        self._seen = index._version

    @property
    def embedder(self) -> Embedder:
        """The core embedder that embeds queries."""
        return self._embedder

    def get_params(self) -> dict[str, Any]:
        """The retrieval parameters (what ``persist`` stores), JSON-serialisable."""
        params: dict[str, Any] = {
            "strategy": self.strategy,
            "similarity_top_k": self.similarity_top_k,
            "max_tokens": self.max_tokens,
            "strategy_params": dict(self.strategy_params),
        }
        if self.excluded_llm_metadata_keys:
            params["excluded_llm_metadata_keys"] = list(self.excluded_llm_metadata_keys)
        if self.excluded_embed_metadata_keys:
            params["excluded_embed_metadata_keys"] = list(self.excluded_embed_metadata_keys)
        return params

    def _to_nodes(self, hits: Sequence[Hit]) -> list[NodeWithScore]:
        last = self._last_leaves(hits)
        return [
            hit_to_node(
                h,
                excluded_llm_metadata_keys=self.excluded_llm_metadata_keys,
                excluded_embed_metadata_keys=self.excluded_embed_metadata_keys,
                last_leaf=last.get(h.leaves[-1]) if len(h.leaves) > 1 else None,
            )
            for h in hits
        ]

    def _last_leaves(self, hits: Sequence[Hit]) -> dict[str, Node]:
        """The last leaf of each passage of several leaves (its ``NEXT``), read in one call."""
        # Only passages of LlamaIndex nodes have links to keep: RAPTOR's own chunks have none,
        # and a store-backed index would otherwise pay a read per query for nothing.
        ids = list(
            dict.fromkeys(
                h.leaves[-1]
                for h in hits
                if len(h.leaves) > 1 and LLAMAINDEX_NODE_KEY in h.node.metadata
            )
        )
        if not ids:
            return {}
        tree = self._tree
        if isinstance(tree, Tree):
            return {i: tree.node(i) for i in ids if i in tree}
        return {node.id: node for node in tree.get(ids)}

    def _sync_tree(self) -> None:
        # An index update changed the store: strategies may hold what they read (BM25 over
        # the leaves, neighbours), so make them again.
        if self._index is not None and self._index._version != self._seen:
            self._tree = self._index.store
            self._seen = self._index._version
            self._core = self._make_core()

    # -- retrieval -----------------------------------------------------------------------------
    def _query_embedding(self, query_bundle: QueryBundle) -> list[float] | None:
        """The bundle's precomputed embedding, or the mean of its custom embedding strings.

        Mirrors ``VectorIndexRetriever``: a bundle that carries an embedding (a cached one, or
        HyDE's ``custom_embedding_strs``) is searched with it instead of the query string.
        """
        if query_bundle.embedding is not None:
            return list(query_bundle.embedding)
        strs = query_bundle.custom_embedding_strs
        if strs and list(strs) != [query_bundle.query_str]:
            vectors = np.stack([np.asarray(self._core.embedder.embed_query(s)) for s in strs])
            return [float(x) for x in vectors.mean(axis=0)]
        return None

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        self._sync_tree()
        hits = self._core.retrieve(
            query_bundle.query_str,
            k=self.similarity_top_k,
            max_tokens=self.max_tokens,
            embedding=self._query_embedding(query_bundle),
        )
        return self._to_nodes(hits)

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        self._sync_tree()
        embedding = self._query_embedding(query_bundle)
        if isinstance(self._tree, Tree) or self.strategy in _NEEDS_LLM:
            hits = await self._core.aretrieve(
                query_bundle.query_str,
                k=self.similarity_top_k,
                max_tokens=self.max_tokens,
                embedding=embedding,
            )
        else:
            # A vector store's client blocks (HTTP, disk): embed the query with the model's
            # async API, then search off the event loop.
            if embedding is None:
                embedding = [
                    float(x) for x in await self._core.aembed_query(query_bundle.query_str)
                ]
            hits = await asyncio.to_thread(
                self._core.retrieve,
                query_bundle.query_str,
                k=self.similarity_top_k,
                max_tokens=self.max_tokens,
                embedding=embedding,
            )
            # Passages' last leaves are read from the store: off the event loop too.
            return await asyncio.to_thread(self._to_nodes, hits)
        return self._to_nodes(hits)

    # -- persistence ---------------------------------------------------------------------------
    def persist(self, persist_dir: str | os.PathLike[str]) -> Path:
        """Save the tree and the retrieval parameters to ``persist_dir``.

        The tree is written by :meth:`raptor_core.Tree.save` (plain JSON + ``.npy``, atomic);
        the parameters go to ``raptor_llamaindex.json`` beside it.
        """
        return save_with_params(self.tree, persist_dir, retriever=self.get_params())

    @classmethod
    def from_persist_dir(
        cls,
        persist_dir: str | os.PathLike[str],
        embed_model: BaseEmbedding | Embedder | None = None,
        *,
        llm: BaseLLM | LLM | None = None,
        **overrides: Any,
    ) -> RaptorRetriever:
        """Load a retriever saved by :meth:`persist` (or a tree saved by ``raptor build``).

        Args:
            persist_dir: the directory.
            embed_model: the model the tree was built with (see the class docstring).
            llm: the LLM for LLM-guided strategies (models are never saved).
            **overrides: retrieval parameters that replace the saved ones.
        """
        tree = Tree.load(persist_dir)
        saved = read_params(persist_dir).get("retriever", {})
        return cls(tree, embed_model, llm=llm, **merge_retriever_params(saved, overrides))


def merge_retriever_params(
    saved: Mapping[str, Any], overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """Saved retriever parameters updated by keyword overrides, flattened for ``__init__``.

    Strategy parameters saved for one strategy are dropped when ``overrides`` switches to
    another, since they would not fit it.
    """
    base = {k: v for k, v in saved.items() if k != "strategy_params"}
    strategy_params = dict(saved.get("strategy_params") or {})
    new_strategy = overrides.get("strategy")
    if new_strategy is not None and new_strategy != saved.get("strategy", DEFAULT_STRATEGY):
        strategy_params = {}
    return {**base, **strategy_params, **overrides}


def save_with_params(tree: Tree, path: str | os.PathLike[str], **sections: Any) -> Path:
    """Save ``tree`` and write ``raptor_llamaindex.json`` (``sections``) beside it.

    The parameters are encoded first, so a value that cannot be saved (an object passed as a
    strategy parameter) fails before anything is written.  Both files are written in one
    save under the directory's lock, each through its own temporary file and
    ``os.replace`` (see :mod:`raptor_core.store._format`), so concurrent saves never mix.
    """
    document = {"format": _FORMAT, "format_version": _FORMAT_VERSION, **sections}
    try:
        payload = json.dumps(document, ensure_ascii=False, indent=1, allow_nan=False)
        encoded = payload.encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:
        # UnicodeEncodeError (an unpaired surrogate) is a ValueError too.
        msg = (
            f"cannot persist: retrieval parameters must be JSON-serialisable ({exc}); "
            "pass objects such as a vector index again when loading instead"
        )
        raise InvalidParameterError(msg) from exc
    return write_tree(tree, path, extra_files={PARAMS_FILE: encoded})


#: ``TreeBuilder`` parameters ``raptor_llamaindex.json`` may hold, with the bounds a read
#: accepts (min, max, None allowed).  Nothing else is ever taken from the file: no cache
#: directory, no path, no URL, no component.
BUILDER_PARAMS: dict[str, tuple[int, int, bool]] = {
    "chunk_max_tokens": (1, 1_000_000, False),
    "summary_max_tokens": (1, 1_000_000, False),
    "cluster_max_tokens": (1, 10_000_000, False),
    "max_layers": (0, 1_000, False),
    "min_layer_size": (1, 10_000_000, False),
    "max_concurrency": (1, 256, False),
    "n_threads": (1, 4_096, True),
    "random_state": (0, 2**32 - 1, True),
}
#: ``TreeBuilder`` flags ``raptor_llamaindex.json`` may hold (True or False, nothing else).
BUILDER_FLAGS: frozenset[str] = frozenset({"section_context"})
#: Keys an older raptor_llamaindex wrote that a read drops (with a warning) instead of using.
_DROPPED_BUILDER_KEYS = frozenset({"cache"})
_RETRIEVER_KEYS = frozenset(
    {
        "strategy",
        "similarity_top_k",
        "max_tokens",
        "strategy_params",
        "excluded_llm_metadata_keys",
        "excluded_embed_metadata_keys",
    }
)
#: Strategy parameters that are objects, so never read from a file (pass them again).
_OBJECT_STRATEGY_PARAMS = frozenset({"index", "llm"})
_TOP_KEYS = frozenset(
    {"format", "format_version", "retriever", "builder", "documents", "rejoin_nodes", "join_pages"}
)
_MAX_STRING = 100_000
_MAX_LIST = 10_000
# An unpaired UTF-16 surrogate: json decodes the escape \ud800 into a str no UTF-8 file can hold.
_SURROGATE = re.compile("[\\ud800-\\udfff]")


def _bad(path: Path | str, what: str) -> TreeFormatError:
    return TreeFormatError(f"{path}: {what} (edited, damaged or not written by raptor_llamaindex)")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _scalar_ok(value: object) -> bool:
    if value is None or isinstance(value, bool) or _is_int(value):
        return True
    if isinstance(value, float):
        return bool(np.isfinite(value))
    return isinstance(value, str) and len(value) <= _MAX_STRING and _text_ok(value)


def _text_ok(value: str) -> bool:
    """Whether ``value`` encodes as UTF-8 (no unpaired surrogate)."""
    return _SURROGATE.search(value) is None


def _json_problem(value: object) -> str | None:
    """What makes ``value`` (a document's metadata) unfit to save or rebuild, if anything.

    Walked with a stack, not recursion, so a deeply nested value cannot overflow it.
    """
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            # Counted as the tree files count it: an empty container adds no level.
            if item and depth > MAX_VALUE_DEPTH:
                return f"is nested more than {MAX_VALUE_DEPTH} levels deep"
            if isinstance(item, dict):
                for key in item:
                    if not isinstance(key, str) or not _text_ok(key):
                        return "has a key that is not a UTF-8 string"
                stack.extend((v, depth + 1) for v in item.values())
            else:
                stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, str):
            if not _text_ok(item):
                return "holds a string with an unpaired UTF-16 surrogate (\\ud800-\\udfff)"
        elif isinstance(item, float):
            if not math.isfinite(item):
                return f"holds the number {item}, which JSON cannot carry"
        elif item is not None and not isinstance(item, bool | int):
            return f"holds a {type(item).__name__}, not a JSON value"
    return None


def check_builder_section(path: Path | str, section: object) -> dict[str, Any]:
    if not isinstance(section, dict):
        raise _bad(path, "'builder' is not an object")
    out: dict[str, Any] = {}
    for key, value in section.items():
        if key in _DROPPED_BUILDER_KEYS:
            logger.warning(
                "%s: ignoring the saved builder parameter %r: a load never takes it from a "
                "file; pass %s= to load() again",
                path,
                key,
                key,
            )
            continue
        if key in BUILDER_FLAGS:
            if not isinstance(value, bool):
                raise _bad(path, f"builder parameter {key} = {str(value)[:80]!r} is not a flag")
            out[key] = value
            continue
        if key not in BUILDER_PARAMS:
            raise _bad(path, f"unknown builder parameter {str(key)[:80]!r}")
        low, high, nullable = BUILDER_PARAMS[key]
        if value is None and nullable:
            out[key] = None
            continue
        if not _is_int(value) or not low <= value <= high:
            raise _bad(path, f"builder parameter {key} = {str(value)[:80]!r} is out of range")
        out[key] = value
    return out


def _check_strategy_params(path: Path | str, strategy: str, section: object) -> dict[str, Any]:
    if not isinstance(section, dict):
        raise _bad(path, "'strategy_params' is not an object")
    allowed = strategy_param_names(strategy) - _OBJECT_STRATEGY_PARAMS
    for key, value in section.items():
        if key not in allowed:
            raise _bad(path, f"strategy {strategy!r} has no saved parameter {str(key)[:80]!r}")
        if isinstance(value, list):
            if len(value) > _MAX_LIST or not all(
                _scalar_ok(v) and not isinstance(v, str) for v in value
            ):
                raise _bad(path, f"strategy parameter {key} is not a list of numbers")
        elif not _scalar_ok(value):
            raise _bad(path, f"strategy parameter {key} is not a number, string or flag")
    return dict(section)


def check_retriever_section(path: Path | str, section: object) -> dict[str, Any]:
    if not isinstance(section, dict):
        raise _bad(path, "'retriever' is not an object")
    unknown = sorted(str(k)[:80] for k in set(section) - _RETRIEVER_KEYS)
    if unknown:
        raise _bad(path, f"unknown retriever parameter(s) {unknown}")
    strategy = section.get("strategy", DEFAULT_STRATEGY)
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise _bad(path, f"unknown strategy {str(strategy)[:80]!r}")
    top_k = section.get("similarity_top_k", 1)
    if not _is_int(top_k) or not 1 <= top_k <= 1_000_000:
        raise _bad(path, "similarity_top_k is not a positive integer")
    max_tokens = section.get("max_tokens")
    if max_tokens is not None and (not _is_int(max_tokens) or not 1 <= max_tokens <= 10**9):
        raise _bad(path, "max_tokens is not a positive integer or null")
    for key in ("excluded_llm_metadata_keys", "excluded_embed_metadata_keys"):
        keys = section.get(key, [])
        if (
            not isinstance(keys, list)
            or len(keys) > _MAX_LIST
            or not all(isinstance(k, str) and len(k) <= 1_000 for k in keys)
        ):
            raise _bad(path, f"{key} is not a list of metadata key names")
    out = dict(section)
    if "strategy_params" in section:
        out["strategy_params"] = _check_strategy_params(path, strategy, section["strategy_params"])
    return out


def check_documents_section(path: Path | str, section: object) -> list[dict[str, Any]] | None:
    if section is None:
        return None
    if not isinstance(section, list):
        raise _bad(path, "'documents' is not a list")
    for i, item in enumerate(section):
        if (
            not isinstance(item, dict)
            or set(item) - {"doc_id", "text", "metadata"}
            or not isinstance(item.get("doc_id"), str)
            or not isinstance(item.get("text"), str)
            or not isinstance(item.get("metadata", {}), dict)
        ):
            raise _bad(path, f"document #{i} is not {{doc_id, text, metadata}}")
        # index_store.json is read by LlamaIndex's JSON loader, which takes NaN and
        # surrogates; the rebuild and the next save would fail on them later, far from here.
        if not _text_ok(item["doc_id"]) or not _text_ok(item["text"]):
            raise _bad(path, f"document #{i} holds an unpaired UTF-16 surrogate (\\ud800-\\udfff)")
        problem = _json_problem(item.get("metadata", {}))
        if problem is not None:
            raise _bad(path, f"the metadata of document #{i} {problem}")
    return section


def read_params(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate ``raptor_llamaindex.json``; an empty dict when there is none.

    The file is data from whoever handed over the directory, so its schema is checked
    strictly: known keys only, JSON scalars of the right type within bounds, strategy
    parameters the strategy accepts (never an object such as ``index``), builder parameters
    from :data:`BUILDER_PARAMS` and :data:`BUILDER_FLAGS` only.  A ``cache`` directory written by older versions is
    dropped with a warning: a file never chooses where we write.

    Raises:
        TreeFormatError: the file is a symbolic link, not a regular file or too large, is
            not valid JSON (NaN, over-long integers, unpaired surrogates and nesting deeper
            than the parser's recursion included) or breaks the schema.
    """
    path = Path(directory) / PARAMS_FILE
    # Read as the tree's own files are: a regular file in the directory (no symbolic link
    # to elsewhere, no FIFO), of bounded size (it holds the documents' text, so the
    # tree.json bound), parsed without NaN, over-long integers, surrogates or a
    # recursion-deep nesting.
    try:
        fd, st = _open_regular(path, MAX_JSON_BYTES)
    except FileNotFoundError:
        return {}
    try:
        with open(fd, "rb") as f:
            raw = f.read(st.st_size + 1)
    except OSError as exc:
        msg = f"cannot read {path}: {exc}"
        raise TreeFormatError(msg) from exc
    document = _parse_json(raw, path)
    del raw
    if not isinstance(document, dict) or document.get("format") != _FORMAT:
        msg = f"{path} is not a raptor_llamaindex parameter file"
        raise TreeFormatError(msg)
    version = document.get("format_version")
    if (
        not isinstance(version, int)
        or isinstance(version, bool)
        or not 1 <= version <= _FORMAT_VERSION
    ):
        msg = (
            f"{path} has format_version {str(version)[:40]!r}; "
            f"this raptor_llamaindex reads 1..{_FORMAT_VERSION}"
        )
        raise TreeFormatError(msg)
    unknown = sorted(str(k)[:80] for k in set(document) - _TOP_KEYS)
    if unknown:
        raise _bad(path, f"unknown section(s) {unknown}")
    out: dict[str, Any] = {"format": _FORMAT, "format_version": version}
    if "retriever" in document:
        out["retriever"] = check_retriever_section(path, document["retriever"])
    if "builder" in document:
        out["builder"] = check_builder_section(path, document["builder"])
    if "documents" in document:
        out["documents"] = check_documents_section(path, document["documents"])
    for flag in ("rejoin_nodes", "join_pages"):
        if flag in document:
            if not isinstance(document[flag], bool):
                raise _bad(path, f"{flag!r} is not true or false")
            out[flag] = document[flag]
    return out
