"""``RaptorIndex``: a RAPTOR tree as a LlamaIndex index, stored in your vector store.

``RaptorIndex.from_documents(docs).as_retriever()`` replaces
``VectorStoreIndex.from_documents(docs).as_retriever()``; ``as_query_engine`` and
``as_chat_engine`` work as they do on LlamaIndex indexes.  ``RaptorIndex`` is a
``BaseIndex``: every layer of the tree lives in the ``StorageContext``'s vector store (see
:mod:`raptor_llamaindex.store`), its :class:`RaptorIndexStruct` in the index store, and
``load_index_from_storage`` reopens it (importing ``raptor_llamaindex`` registers the
struct type ``"raptor"``).  The tree is built by :class:`raptor_core.TreeBuilder`: this
module converts documents, routes arguments and keeps the store in step.
"""

from __future__ import annotations

import asyncio
import bisect
import inspect
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.base.llms.base import BaseLLM
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.chat_engine.types import BaseChatEngine, ChatMode
from llama_index.core.data_structs.data_structs import IndexStruct
from llama_index.core.data_structs.registry import INDEX_STRUCT_TYPE_TO_INDEX_STRUCT_CLASS
from llama_index.core.data_structs.struct_type import IndexStructType
from llama_index.core.indices.base import BaseIndex
from llama_index.core.indices.registry import INDEX_STRUCT_TYPE_TO_INDEX_CLASS
from llama_index.core.llms import LLM as LlamaIndexLLMBase
from llama_index.core.schema import BaseNode, TransformComponent
from llama_index.core.schema import Document as LlamaIndexDocumentBase
from llama_index.core.storage.docstore.types import RefDocInfo
from llama_index.core.storage.storage_context import StorageContext

from raptor_core._async import UpdateLock
from raptor_core.build.builder import ProgressCallback, TreeBuilder, describe
from raptor_core.build.incremental import (
    UpdateReport,
    checked_floor,
    floor_build_info,
    recorded_floor,
)
from raptor_core.build.rejoin import Rejoined, continues, join_pages
from raptor_core.exceptions import InvalidInputError, InvalidParameterError, TreeFormatError
from raptor_core.store._format import MAX_DIM
from raptor_core.store.codec import (
    MAX_LAYERS,
    checked_dim,
    checked_layer_sizes,
    tree_layer_sizes,
)
from raptor_core.tree import Tree
from raptor_core.types import LLM, Document, Embedder, Summarizer
from raptor_llamaindex.ingestion import (
    LLAMAINDEX_NODE_KEY,
    abuild_tree,
    arun_ingestion,
    aupdate_tree,
    build_tree,
    rejoin_nodes,
    run_ingestion,
    to_core_documents,
    update_tree,
)
from raptor_llamaindex.models import (
    attach_callback_manager,
    resolve_embedder,
    resolve_summarizer,
)
from raptor_llamaindex.retriever import (
    BUILDER_FLAGS,
    BUILDER_PARAMS,
    DEFAULT_STRATEGY,
    RaptorRetriever,
    check_builder_section,
    check_documents_section,
    check_retriever_section,
    merge_retriever_params,
    read_params,
    save_with_params,
    strategy_param_names,
)
from raptor_llamaindex.store import LlamaIndexNodeStore

__all__ = ["RAPTOR_INDEX_TYPE", "RaptorIndex", "RaptorIndexStruct", "to_core_documents"]

logger = logging.getLogger(__name__)


_BUILDER_ARGS = frozenset(inspect.signature(TreeBuilder).parameters) - {"embedder", "summarizer"}
_RETRIEVER_ARGS = frozenset(
    {
        "strategy",
        "similarity_top_k",
        "max_tokens",
        "excluded_llm_metadata_keys",
        "excluded_embed_metadata_keys",
    }
)
#: Keywords LlamaIndex hands to both the retriever and the engine (as ``BaseIndex`` does).
_SHARED_ARGS = frozenset({"callback_manager", "verbose"})
_RETRIEVER_ONLY_ARGS = frozenset(
    {"objects", "object_map", "filters", "vector_store_query_mode", "vector_store_kwargs"}
)


def excluded_metadata_keys(items: Iterable[Any]) -> dict[str, list[str]]:
    """The metadata keys LlamaIndex documents hide from the LLM / embedder (union, sorted)."""
    llm: set[str] = set()
    embed: set[str] = set()
    for item in items:
        if isinstance(item, BaseNode):
            llm.update(item.excluded_llm_metadata_keys)
            embed.update(item.excluded_embed_metadata_keys)
    out: dict[str, list[str]] = {}
    if llm:
        out["excluded_llm_metadata_keys"] = sorted(llm)
    if embed:
        out["excluded_embed_metadata_keys"] = sorted(embed)
    return out


def _documents_from_tree(tree: Tree) -> list[Document]:
    # A bare tree (e.g. from `raptor build`) does not keep its documents: rejoin each one's
    # leaf chunks, in span order.  Whitespace between chunks is normalised to one space.
    texts: dict[str, list[tuple[int, str]]] = {}
    metadata: dict[str, list[Mapping[str, Any]]] = {}
    chunks: list[Document] = []
    for leaf in tree.leaves:
        if leaf.doc_id is None:
            continue
        if leaf.span is None:
            # A pre-split chunk (a LlamaIndex node): its own leaf again, never rejoined.
            chunks.append(
                Document(
                    text=leaf.text,
                    doc_id=leaf.id,
                    metadata=dict(leaf.metadata),
                    chunk_of=leaf.doc_id,
                )
            )
            continue
        start = leaf.span[0] if leaf.span is not None else 0
        texts.setdefault(leaf.doc_id, []).append((start, leaf.text))
        metadata.setdefault(leaf.doc_id, []).append(leaf.metadata)
    return [
        *(
            Document(
                text=" ".join(t for _, t in sorted(parts, key=lambda p: p[0])),
                doc_id=d,
                metadata=_shared_metadata(metadata[d]),
            )
            for d, parts in texts.items()
        ),
        *chunks,
    ]


def _shared_metadata(metadatas: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    # A document's metadata is what all its leaves share: a leaf also holds the metadata of
    # the part of the text it starts in (a PDF's page, from `raptor build`).
    first, *others = metadatas
    return {k: v for k, v in first.items() if all(k in m and m[k] == v for m in others)}


def _empty_tree(embedder: Embedder) -> Tree:
    # LlamaIndex indexes may be empty (VectorStoreIndex.from_documents([])); so may ours.
    return Tree(
        nodes=(),
        embeddings=np.zeros((0, 0), dtype=np.float32),
        params={"embedder": describe(embedder)},
    )


def _jsonable_builder_args(args: Mapping[str, Any]) -> dict[str, Any]:
    # Only the plain numbers and flags a load accepts back (BUILDER_PARAMS, BUILDER_FLAGS).
    # Components (tokenizer, chunker, clusterer, progress) and the cache location are passed
    # again to load().
    numbers = {
        k: v for k, v in args.items() if k in BUILDER_PARAMS and (v is None or type(v) is int)
    }
    flags = {k: v for k, v in args.items() if k in BUILDER_FLAGS and type(v) is bool}
    return {**numbers, **flags}


class _TqdmProgress:
    """``show_progress=True``: one tqdm bar per build stage."""

    def __init__(self) -> None:
        self._bars: dict[str, Any] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        from tqdm.auto import tqdm

        bar = self._bars.get(stage)
        if bar is None or bar.total != total or done < bar.n:
            if bar is not None:
                bar.close()
            bar = self._bars[stage] = tqdm(total=total, desc=f"raptor {stage}", leave=False)
        bar.update(done - bar.n)

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()


#: The index-struct type RaptorIndex registers with LlamaIndex (``load_index_from_storage``).
RAPTOR_INDEX_TYPE = "raptor"
_STRUCT_VERSION = 1


@dataclass
class RaptorIndexStruct(IndexStruct):
    """What LlamaIndex's index store keeps of a :class:`RaptorIndex` (``index_store.json``).

    The nodes live in the vector store; this records how to use them: the retrieval
    defaults, the plain-number build parameters, how the tree was built (``Tree.params``,
    descriptions only) and the documents (``index.documents``).  It is data: a
    load validates it strictly and never imports, opens or fetches anything it names.
    """

    # Typed Any so that dataclasses-json hands back whatever the file holds: the shapes are
    # checked by a load (_checked_struct), with errors that say what is wrong.
    format_version: Any = _STRUCT_VERSION
    retriever: Any = field(default_factory=dict)
    builder: Any = field(default_factory=dict)
    params: Any = field(default_factory=dict)
    documents: Any = None
    #: nodes per layer, so that opening finds the top layer without a filtered scan of the
    #: vector store (None: written by an older version, the store is asked)
    layer_sizes: Any = None
    #: the vectors' dimension, so that a caller's embed model is checked on opening even when
    #: the vector store cannot tell it (no ``get_nodes``); None: empty, or an older version
    dim: Any = None
    #: whether a node parser's nodes are joined back into their documents on every update
    #: (see ``RaptorIndex``); None: written by an older version, which never joined them
    rejoin_nodes: Any = None
    #: whether a PDF loader's pages are joined into one document for the tree on every
    #: update (see ``RaptorIndex``); None: written by an older version, which never joined them
    join_pages: Any = None
    #: each summary layer's cohesion floor, which the first update of the tree measures and
    #: later ones keep (raptor_core.build.incremental); None: none measured yet
    cohesion_floor: Any = None

    @classmethod
    def get_type(cls) -> IndexStructType:
        """``"raptor"``: the key of RaptorIndex in LlamaIndex's registries."""
        return RAPTOR_INDEX_TYPE  # type: ignore[return-value]


def _checked_struct(struct: IndexStruct) -> RaptorIndexStruct:
    """Validate an index struct read back from an index store (it is data, see above)."""
    where = f"index struct {str(struct.index_id)[:80]!r}"
    if not isinstance(struct, RaptorIndexStruct):
        msg = f"{where} is a {type(struct).__name__}, not a RaptorIndexStruct"
        raise TreeFormatError(msg)
    version = struct.format_version
    if (
        not isinstance(version, int)
        or isinstance(version, bool)
        or not 1 <= version <= _STRUCT_VERSION
    ):
        msg = (
            f"{where} has format_version {str(version)[:40]!r}; this raptor_llamaindex reads "
            f"1..{_STRUCT_VERSION}: upgrade raptor-retriever"
        )
        raise TreeFormatError(msg)
    if not isinstance(struct.params, dict):
        msg = f"{where}: 'params' is not an object (edited or damaged)"
        raise TreeFormatError(msg)
    sizes = struct.layer_sizes
    if sizes is not None and (not isinstance(sizes, list) or checked_layer_sizes(sizes) is None):
        msg = (
            f"{where}: 'layer_sizes' is not a list of at most {MAX_LAYERS} counts >= 0 "
            "(edited or damaged); remove it to have the vector store asked instead"
        )
        raise TreeFormatError(msg)
    dim = struct.dim
    if dim is not None and checked_dim(dim) is None:
        msg = (
            f"{where}: 'dim' is not a vector dimension in 1..{MAX_DIM} (edited or damaged); "
            "remove it to have the first query check the embed model instead"
        )
        raise TreeFormatError(msg)
    if struct.cohesion_floor is not None and checked_floor(struct.cohesion_floor) is None:
        msg = (
            f"{where}: 'cohesion_floor' is not a list of finite numbers (edited or "
            "damaged); remove it to have the next update measure it again"
        )
        raise TreeFormatError(msg)
    for flag in ("rejoin_nodes", "join_pages"):
        value = getattr(struct, flag)
        if value is not None and not isinstance(value, bool):
            msg = f"{where}: {flag!r} is not true or false (edited or damaged)"
            raise TreeFormatError(msg)
    struct.retriever = check_retriever_section(where, struct.retriever)
    struct.builder = check_builder_section(where, struct.builder)
    struct.documents = check_documents_section(where, struct.documents)
    return struct


class RaptorIndex(BaseIndex[RaptorIndexStruct]):
    """A RAPTOR index for LlamaIndex: a tree of recursive summaries over your documents.

    A real LlamaIndex index: every layer of the tree (chunks and summaries) lives in the
    ``StorageContext``'s vector store as ``TextNode`` objects linked by ``SOURCE``/``PARENT``/
    ``CHILD`` relationships, ``storage_context.persist()`` saves it and
    ``load_index_from_storage`` reopens it.  Without a storage context, a new
    ``SimpleVectorStore`` is used.  Every retrieval strategy searches the vector store.

    Parameters are routed by name: :class:`raptor_core.TreeBuilder` parameters
    (``chunk_max_tokens``, ``max_layers``, ``random_state``, ``tokenizer``, ...) shape the
    build; retrieval parameters (``strategy``, ``similarity_top_k``, ``max_tokens`` and the
    strategy's own) become the defaults of ``as_retriever`` and are saved with the index.

    Models: ``embed_model`` defaults to ``Settings.embed_model`` when the application set one,
    else to the packaged, offline all-MiniLM-L6-v2.  ``llm`` (cluster summaries, LLM-guided
    strategies and the default answer model of ``as_query_engine``) defaults to
    ``Settings.llm`` when set; without one, summaries are extractive (offline).  The unset
    ``Settings`` defaults are never resolved, so no OpenAI key is needed.

    Updates: ``insert``/``insert_nodes``/``delete_ref_doc``/``update_ref_doc``/
    ``refresh_ref_docs`` (and their async twins) change the tree locally with
    :meth:`raptor_core.TreeBuilder.insert`/``delete``/``update``: only the new chunks are
    embedded, only the clusters they join or leave (and those clusters' ancestors) are
    summarised again, and only the nodes added, changed or re-parented are written to the
    vector store (removed ones are deleted); every other stored node is left as it is.  An
    empty tree, or one of leaves only, is built whole instead.  Retrievers and engines made
    earlier from this index follow on their next query.

    Nodes: nodes passed in (or made by ``transformations=``) are the tree's leaves as they
    are.  With ``rejoin_nodes=True`` a node parser's nodes are first joined back into the
    documents they were cut from (:func:`raptor_llamaindex.ingestion.rejoin_nodes`), which
    RAPTOR then chunks itself: better leaves for RAPTOR than nodes sized for a flat index,
    at the cost of the nodes' own ids.  The setting is saved with the index and every later
    update follows it.

    Pages: a PDF reader's pages (one ``Document`` per page, numbered by ``page_label``)
    are joined, consecutive pages of one file, into one document of the tree under the first
    page's id (:func:`raptor_core.build.rejoin.join_pages`), and each leaf keeps the page it
    starts on.  The index's documents stay the pages: updates, deletes and ``ref_doc_info``
    take page ids, and each update joins them again.  ``join_pages=False`` keeps each page a
    document; the setting is saved with the index (an index saved before it never joins).

    Setup:
        ``pip install 'raptor-retriever[llamaindex]'``

    Key init args (``from_documents``):
        documents: LlamaIndex ``Document`` objects or nodes.
        storage_context: where the nodes go (``StorageContext.from_defaults(vector_store=...)``).
        embed_model: a LlamaIndex ``BaseEmbedding`` or a raptor_core ``Embedder``.
        llm: a LlamaIndex ``LLM`` (or raptor_core ``LLM``).
        summarizer: a raptor_core ``Summarizer`` instead of one over ``llm``.
        show_progress: progress bars for the build stages.
        **kwargs: ``TreeBuilder`` parameters and retrieval defaults.

    Instantiate:
        .. code-block:: python

            from llama_index.core import Document
            from raptor_core.testing import FakeEmbedder
            from raptor_llamaindex import RaptorIndex

            docs = [Document(text="Bees dance to share where flowers are. " * 30, id_="bees"),
                    Document(text="Volcanoes erupt when magma rises. " * 30, id_="volcanoes")]
            index = RaptorIndex.from_documents(docs, embed_model=FakeEmbedder(),
                                               random_state=0, similarity_top_k=4)

    Usage:
        .. code-block:: python

            from llama_index.core import StorageContext, load_index_from_storage

            nodes = index.as_retriever().retrieve("Why do bees dance?")
            index.storage_context.persist("./raptor_index")
            index = load_index_from_storage(
                StorageContext.from_defaults(persist_dir="./raptor_index"),
                embed_model=FakeEmbedder(),
            )

    Use within a query engine or an agent tool:
        .. code-block:: python

            from llama_index.core.llms import MockLLM
            from llama_index.core.tools import QueryEngineTool

            engine = index.as_query_engine(llm=MockLLM())
            tool = QueryEngineTool.from_defaults(
                engine, name="raptor_docs", description="Answers questions about the documents"
            )
    """

    index_struct_cls = RaptorIndexStruct

    #: ``from_documents(transformations=...)``, applied again by :meth:`insert` (not saved).
    _transformations: Any = None

    def __init__(
        self,
        nodes: Sequence[Any] | None = None,
        *,
        index_struct: RaptorIndexStruct | None = None,
        storage_context: StorageContext | None = None,
        embed_model: BaseEmbedding | Embedder | None = None,
        llm: BaseLLM | LLM | None = None,
        summarizer: Summarizer | None = None,
        callback_manager: CallbackManager | None = None,
        show_progress: bool = False,
        transformations: Any = None,
        rejoin_nodes: bool | None = None,
        join_pages: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """Build over ``nodes`` (LlamaIndex's constructor protocol), or open ``index_struct``.

        ``load_index_from_storage`` calls this with the stored ``index_struct``; its keyword
        arguments (``embed_model``, ``llm``, ``TreeBuilder`` components for later updates)
        arrive here.  ``rejoin_nodes`` None keeps what the index was built with (False for
        a new one); ``join_pages`` None keeps it too (True for a new one).
        """
        for flag, value in (("rejoin_nodes", rejoin_nodes), ("join_pages", join_pages)):
            if value is not None and not isinstance(value, bool):
                msg = f"{flag} must be True or False, got {value!r:.80}"
                raise InvalidParameterError(msg)
        storage_context = storage_context or StorageContext.from_defaults()
        building = index_struct is None
        if index_struct is None:
            builder_kwargs, retriever_kwargs = self._split_kwargs(kwargs)
            items = list(nodes or [])
            docs = to_core_documents(items)  # bad input fails here, before any model call
            index_struct = RaptorIndexStruct(
                retriever={**excluded_metadata_keys(items), **retriever_kwargs},
                builder=_jsonable_builder_args(builder_kwargs),
                rejoin_nodes=bool(rejoin_nodes),
                join_pages=join_pages is not False,
            )
        else:
            index_struct = _checked_struct(index_struct)
            unknown = sorted(set(kwargs) - _BUILDER_ARGS)
            if unknown:
                msg = (
                    f"unknown parameter(s) {unknown}: an index opened from storage takes "
                    f"embed_model, llm, summarizer and TreeBuilder parameters {sorted(_BUILDER_ARGS)}"
                )
                raise InvalidParameterError(msg)
            builder_kwargs = {**index_struct.builder, **kwargs}
            items, docs = [], []
            if rejoin_nodes is not None:
                index_struct.rejoin_nodes = rejoin_nodes
            if join_pages is not None:
                index_struct.join_pages = join_pages
        self._store = LlamaIndexNodeStore(
            storage_context.vector_store,
            docstore=storage_context.docstore,
            params=index_struct.params,
            layer_sizes=None if building else index_struct.layer_sizes,
            dim=None if building else index_struct.dim,
        )
        if not building:
            self._store.build_info = floor_build_info(checked_floor(index_struct.cohesion_floor))
        if building and not self._store.listable:
            # A store that can neither list nor count (no get_nodes) is taken to be empty, as
            # asked: the index records its sizes from here on.
            self._store.layer_sizes = []
        if building and len(self._store) > 0:
            msg = (
                f"the {type(storage_context.vector_store).__name__} already holds nodes: build "
                "into an empty vector store (a new collection), or reopen the index it holds "
                "with load_index_from_storage"
            )
            raise InvalidParameterError(msg)
        shape = None if building else self._store.shape()
        self._embedder = resolve_embedder(embed_model, tree=shape)  # type: ignore[arg-type]
        self._llm = llm
        self._summarizer = summarizer
        self._builder_kwargs = builder_kwargs
        self._tree: Tree | None = None
        self._documents: list[Document] | None = None
        #: Bumped by every update, so retrievers made earlier know to start again.
        self._version = 0
        # Held by an update from reading the tree to writing the new one back: two at once
        # (asyncio.gather of ainsert calls, inserts from two threads) would each write back
        # their own change only, and all but the last would be lost.
        self._update_lock = UpdateLock()
        super().__init__(
            index_struct=index_struct,
            storage_context=storage_context,
            callback_manager=callback_manager,
            show_progress=show_progress,
        )
        # As VectorStoreIndex (resolve_embed_model) and BaseIndex.as_query_engine
        # (resolve_llm) do: the user's LlamaIndex models report to the index's callback
        # manager (callback_manager, else Settings'), so a TokenCountingHandler there counts
        # the build's, updates' and queries' embedding and summary calls.
        attach_callback_manager(self._embedder, self._callback_manager)
        attach_callback_manager(self._llm, self._callback_manager)
        # BaseIndex falls back to Settings.transformations; ours: RAPTOR's own chunker.
        self._transformations = transformations
        if building:
            self._documents = []
            if docs:
                self._update(added=items, show_progress=show_progress)
            else:
                self._save_struct(_empty_tree(self._embedder), [])

    def __repr__(self) -> str:
        return (
            f"RaptorIndex({type(self._vector_store).__name__}, nodes={len(self._store)}, "
            f"retriever={self.retriever_kwargs})"
        )

    # -- construction --------------------------------------------------------------------------
    @staticmethod
    def _split_kwargs(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        builder = {k: v for k, v in kwargs.items() if k in _BUILDER_ARGS}
        retriever = {k: v for k, v in kwargs.items() if k not in _BUILDER_ARGS}
        strategy = retriever.get("strategy", DEFAULT_STRATEGY)
        known = strategy_param_names(strategy)
        unknown = sorted(set(retriever) - _RETRIEVER_ARGS - known)
        if unknown:
            # Fail before an expensive build, not at the first query.
            msg = (
                f"unknown parameter(s) {unknown}: RaptorIndex accepts TreeBuilder parameters "
                f"{sorted(_BUILDER_ARGS)} and retrieval parameters "
                f"{sorted(_RETRIEVER_ARGS | known)} for strategy {strategy!r}"
            )
            raise InvalidParameterError(msg)
        return builder, _nest_retriever_args(retriever)

    @classmethod
    def from_documents(  # type: ignore[override]
        cls,
        documents: Sequence[Any],
        *,
        storage_context: StorageContext | None = None,
        embed_model: BaseEmbedding | Embedder | None = None,
        llm: BaseLLM | LLM | None = None,
        show_progress: bool = False,
        **kwargs: Any,
    ) -> RaptorIndex:
        """Build an index over LlamaIndex ``Document`` objects (or nodes, or raptor_core inputs).

        Args:
            documents: the documents; an empty list gives an empty index.
            storage_context: where every layer's nodes go: its vector store (empty: one
                tree per collection) and, for stores that keep no text, its docstore.
                Default: a new ``SimpleVectorStore``.
            embed_model: embeds chunks, summaries and queries.
            llm: summarises clusters and guides LLM strategies.
            show_progress: draw progress bars (tqdm) for the build stages.
            **kwargs: ``summarizer`` (a raptor_core ``Summarizer`` instead of one over
                ``llm``), ``callback_manager``, ``TreeBuilder`` parameters and retrieval
                defaults (see the class docs).
                ``transformations=`` (node parsers, extractors, or an ``IngestionPipeline``)
                are run first and their nodes become the leaves as they are (also a node
                parser passed as ``chunker=``); see :mod:`raptor_llamaindex.ingestion`.
                ``rejoin_nodes=True`` joins a node parser's nodes back into their documents
                first, for this build and every later update (see the class docs).

        Raises:
            InvalidInputError: an empty, binary or duplicate document.
            InvalidParameterError: an unknown or out-of-range parameter, or a vector store
                that already holds nodes.
        """
        transformations = _transformations(kwargs)
        items = run_ingestion(documents, transformations, show_progress=show_progress)
        index = cls(
            items,
            transformations=transformations,
            storage_context=storage_context,
            embed_model=embed_model,
            llm=llm,
            show_progress=show_progress,
            **kwargs,
        )
        if transformations is not None:
            index._ingested(documents)
        return index

    @classmethod
    async def afrom_documents(
        cls,
        documents: Sequence[Any],
        *,
        storage_context: StorageContext | None = None,
        embed_model: BaseEmbedding | Embedder | None = None,
        llm: BaseLLM | LLM | None = None,
        show_progress: bool = False,
        **kwargs: Any,
    ) -> RaptorIndex:
        """Async :meth:`from_documents`: uses the async model APIs; safe in a running loop."""
        transformations = _transformations(kwargs)
        items = await arun_ingestion(documents, transformations, show_progress=show_progress)
        docs = to_core_documents(items)
        index = cls(
            [],
            storage_context=storage_context,
            embed_model=embed_model,
            llm=llm,
            show_progress=show_progress,
            **kwargs,
        )
        index._transformations = transformations
        index._merge_excluded_keys(items)
        if docs:
            await index._aupdate(added=items, show_progress=show_progress)
        if transformations is not None:
            index._ingested(documents)
        return index

    @classmethod
    def from_tree(
        cls,
        tree: Tree,
        embed_model: BaseEmbedding | Embedder | None = None,
        llm: BaseLLM | LLM | None = None,
        *,
        summarizer: Summarizer | None = None,
        storage_context: StorageContext | None = None,
        documents: Sequence[Document] | None = None,
        rejoin_nodes: bool = False,
        join_pages: bool = False,
        **kwargs: Any,
    ) -> RaptorIndex:
        """Write an existing tree (built by ``TreeBuilder`` or ``raptor build``) into an index.

        ``kwargs`` are retrieval defaults and ``TreeBuilder`` parameters for later updates;
        ``rejoin_nodes`` and ``join_pages`` apply to later updates (see the class docs): a
        tree built elsewhere holds its documents as they were given, so pages are not
        joined unless asked.
        Without ``documents``, ``index.documents`` are rejoined from the leaf chunks.
        """
        if not isinstance(tree, Tree):
            msg = f"tree must be a raptor_core Tree, got {type(tree).__name__}"
            raise InvalidParameterError(msg)
        embedder = resolve_embedder(embed_model, tree=tree)
        builder_kwargs, retriever_kwargs = cls._split_kwargs(kwargs)
        index = cls(
            [],
            storage_context=storage_context,
            embed_model=embedder,
            llm=llm,
            summarizer=summarizer,
            rejoin_nodes=rejoin_nodes,
            join_pages=join_pages,
            **{k: v for k, v in kwargs.items() if k in builder_kwargs},
            **_flat_retriever_args(retriever_kwargs),
        )
        index._write(tree, None if documents is None else list(documents))
        return index

    # -- building ------------------------------------------------------------------------------
    def _builder(self, progress: ProgressCallback | None) -> TreeBuilder:
        kwargs = dict(self._builder_kwargs)
        if progress is not None:
            kwargs["progress"] = progress
        return TreeBuilder(
            self._embedder, resolve_summarizer(self._llm, self._summarizer), **kwargs
        )

    def _build(self, docs: Sequence[Document], *, show_progress: bool = False) -> Tree:
        if not docs:
            return _empty_tree(self._embedder)
        progress = _TqdmProgress() if show_progress else None
        try:
            return build_tree(self._builder(progress), docs)
        finally:
            if progress is not None:
                progress.close()

    async def _abuild(self, docs: Sequence[Document], *, show_progress: bool = False) -> Tree:
        if not docs:
            return _empty_tree(self._embedder)
        progress = _TqdmProgress() if show_progress else None
        try:
            return await abuild_tree(self._builder(progress), docs)
        finally:
            if progress is not None:
                progress.close()

    # -- the one update path -------------------------------------------------------------------
    def _plan(
        self, added: Sequence[Any], removed: Sequence[str]
    ) -> tuple[list[Document], list[Document], list[str]]:
        """Check an update before anything is paid: (documents after, to write, to delete).

        The documents to write are the added ones plus, for a pre-split node added to a
        source document the index holds (and does not remove), that source's current chunks:
        the core replaces a source as a whole, and LlamaIndex lets ``insert_nodes`` add nodes
        to a known ``ref_doc_id``.
        """
        current = self.documents
        gone = set(removed)
        missing = sorted(gone - {d.chunk_of or d.doc_id for d in current})
        if missing:
            msg = f"no document with id {missing[0]!r} in this index"
            raise InvalidInputError(msg)
        kept = [d for d in current if (d.chunk_of or d.doc_id) not in gone]
        if self._index_struct.rejoin_nodes:
            added = rejoin_nodes(added)
        docs = to_core_documents([*kept, *added])  # duplicates and bad input fail here
        new = docs[len(kept) :]
        sources = {d.chunk_of or d.doc_id for d in kept}
        for d in new:
            if d.chunk_of is None and d.doc_id in sources:
                # A whole document under the id of indexed nodes: nodes may join a source,
                # a document would silently replace it.
                _already_indexed(d.doc_id)
        grown = {d.chunk_of for d in new if d.chunk_of is not None}
        write = [d for d in kept if (d.chunk_of or d.doc_id) in grown] + new
        if self._index_struct.join_pages:
            # Pages are joined only when they follow each other: a replaced page keeps its place.
            docs = _in_place(docs, current)
        return docs, write, sorted(gone - {d.chunk_of or d.doc_id for d in write})

    def _runs(self, docs: Sequence[Document]) -> list[Rejoined]:
        """The tree's documents made of ``docs``: a PDF loader's pages joined, if asked."""
        if self._index_struct.join_pages:
            return join_pages(docs)
        return [Rejoined(document=d, parts=(i,)) for i, d in enumerate(docs)]

    def _tree_plan(
        self, docs: Sequence[Document], write: Sequence[Document], delete: Sequence[str]
    ) -> tuple[list[Document], list[Document], list[str]]:
        """:meth:`_plan`'s update in the tree's terms: (documents, to write, to delete).

        With ``join_pages``, the index's documents are the pages as given, and the tree holds
        each run of pages as one document (the first page's id).  A joined document is written
        when it is new, differs from the one the tree holds, or holds a document to write; a
        tree document that no longer results is deleted.
        """
        if not self._index_struct.join_pages:
            return list(docs), list(write), list(delete)
        before = {r.document.doc_id: r.document for r in self._runs(self.documents)}
        runs = self._runs(docs)
        written = {d.doc_id for d in write}
        tree_write = [
            r.document
            for r in runs
            if before.get(r.document.doc_id) != r.document
            or any(docs[i].doc_id in written for i in r.parts)
        ]
        tree_docs = [r.document for r in runs]
        gone = _sources(before.values()) - _sources(tree_docs)
        return tree_docs, tree_write, sorted(gone)

    def _needs_build(self, tree: Tree, write: Sequence[Document]) -> bool:
        # An empty tree has nothing to update; a tree of leaves only has no summary to keep
        # (and the core never adds layers), so building it again costs no summary call.
        return len(tree) == 0 or (bool(write) and tree.num_layers < 2)

    def _update(
        self, *, added: Sequence[Any] = (), removed: Sequence[str] = (), show_progress: bool = False
    ) -> list[UpdateReport] | None:
        """Add, replace and remove documents: every update of the index goes through here.

        The tree is changed locally by :meth:`TreeBuilder.insert`/``update``/``delete`` and
        only the nodes they report (added, changed or relinked; removed) are written to or
        deleted from the vector store.  Returns the core's reports (a removal and a write
        are two), or None when the tree was built whole.
        """
        with self._update_lock:
            return self._update_held(added, removed, show_progress)

    def _update_held(
        self, added: Sequence[Any], removed: Sequence[str], show_progress: bool
    ) -> list[UpdateReport] | None:
        docs, write, delete = self._plan(added, removed)
        tree_docs, write, delete = self._tree_plan(docs, write, delete)
        tree = self.tree
        keep_docs = self._documents is not None
        progress = _TqdmProgress() if show_progress else None
        reports: list[UpdateReport] | None = None
        try:
            if not docs or self._needs_build(tree, write):
                self._write(self._build(tree_docs, show_progress=show_progress), docs)
            else:
                reports = []
                builder = self._builder(progress)
                new = tree
                for op, items in self._steps(tree, write, delete):
                    result = update_tree(builder, op, new, items)
                    new = result.tree
                    reports.append(result.report)
                # Written once every step succeeded: a model failing in a later step (a
                # joined document deleted, then re-inserted) leaves store and struct as
                # they were, so the same call can be retried.
                self._apply(new, reports, docs if keep_docs else None)
        finally:
            if progress is not None:
                progress.close()
        self._after_update(added, removed)
        return reports

    async def _aupdate(
        self, *, added: Sequence[Any] = (), removed: Sequence[str] = (), show_progress: bool = False
    ) -> list[UpdateReport] | None:
        """Async :meth:`_update` (the core's async twins; store writes off the event loop)."""
        async with self._update_lock.held():
            return await self._aupdate_held(added, removed, show_progress)

    async def _aupdate_held(
        self, added: Sequence[Any], removed: Sequence[str], show_progress: bool
    ) -> list[UpdateReport] | None:
        docs, write, delete = await asyncio.to_thread(self._plan, added, removed)
        tree_docs, write, delete = await asyncio.to_thread(self._tree_plan, docs, write, delete)
        tree = await asyncio.to_thread(lambda: self.tree)
        keep_docs = self._documents is not None
        progress = _TqdmProgress() if show_progress else None
        reports: list[UpdateReport] | None = None
        try:
            if not docs or self._needs_build(tree, write):
                built = await self._abuild(tree_docs, show_progress=show_progress)
                await asyncio.to_thread(self._write, built, docs)
            else:
                reports = []
                builder = self._builder(progress)
                new = tree
                for op, items in self._steps(tree, write, delete):
                    result = await aupdate_tree(builder, op, new, items)
                    new = result.tree
                    reports.append(result.report)
                # As _update: nothing is written before every step succeeded.
                await asyncio.to_thread(self._apply, new, reports, docs if keep_docs else None)
        finally:
            if progress is not None:
                progress.close()
        self._after_update(added, removed)
        return reports

    @staticmethod
    def _steps(
        tree: Tree, write: Sequence[Document], delete: Sequence[str]
    ) -> list[tuple[str, Sequence[Any]]]:
        """The core calls of one update: a delete, then an insert or an update."""
        steps: list[tuple[str, Sequence[Any]]] = [("delete", delete)] if delete else []
        if write:
            # delete() never removes a source that is written, so the tree's ids tell.
            known = set(tree.doc_ids)
            replaces = any((d.chunk_of or d.doc_id) in known for d in write)
            steps.append(("update" if replaces else "insert", write))
        return steps

    def _apply(
        self, tree: Tree, reports: Sequence[UpdateReport], docs: list[Document] | None
    ) -> None:
        """Write the core steps of one update into the vector store: only what they name.

        ``tree`` is the tree after the last step.  A node one step removes may come back in a
        later one (same id) and one a step adds may go in the next: each named node is
        written if ``tree`` holds it and deleted otherwise.
        """
        # Kept nodes whose parents changed are rewritten too: the store keeps PARENT links.
        named = dict.fromkeys(
            node_id
            for report in reports
            for ids in (
                report.nodes_added,
                report.nodes_changed,
                report.nodes_relinked,
                report.nodes_removed,
            )
            for node_id in ids
        )
        write = [i for i in named if i in tree]
        if write:
            self._store.add([tree.node(i) for i in write], tree.embeddings[tree.rows(write)])
        gone = [i for i in named if i not in tree]
        if gone:
            self._store.delete(gone)
        self._save_struct(tree, docs)

    def _after_update(self, added: Sequence[Any], removed: Sequence[str]) -> None:
        self._merge_excluded_keys(added)
        # Document hashes in the docstore, as BaseIndex keeps them: refresh_ref_docs then
        # updates only documents that changed.
        for doc_id in removed:
            self._docstore.delete_document(doc_id, raise_error=False)
        self._record_hashes(added)
        self._storage_context.index_store.add_index_struct(self._index_struct)

    def _record_hashes(self, items: Iterable[Any], indexed: set[str] | None = None) -> None:
        # Keyed by what the caller passed: with transformations, the source documents (the
        # keys refresh_ref_docs looks up), not the nodes made from them.  Only for what the
        # index holds: a document whose transformations made no node (an ingestion
        # pipeline's docstore dropped a duplicate) is not indexed, and a recorded hash would
        # make refresh_ref_docs skip it for good.  ``indexed``: the caller's _indexed_ids().
        indexed = self._indexed_ids() if indexed is None else indexed
        for item in items:
            if isinstance(item, BaseNode) and item.node_id in indexed:
                self._docstore.set_document_hash(item.node_id, item.hash)

    def _indexed_ids(self) -> set[str]:
        """The ids the index holds: its documents' and, for pre-split nodes, their sources'."""
        return {i for d in self.documents for i in (d.doc_id, d.chunk_of) if i is not None}

    def _ingested(self, documents: Sequence[Any]) -> set[str]:
        """After an update from ``documents``: record the hashes of those now indexed.

        A document the index's transformations turned into no node at all is not indexed:
        said (VectorStoreIndex says nothing, and the document looks inserted), and its hash
        not recorded, so a later ``refresh_ref_docs`` tries it again.  Returns the ids the
        index now holds (:meth:`_indexed_ids`).
        """
        indexed = self._indexed_ids()
        for item in documents:
            if isinstance(item, BaseNode) and item.node_id not in indexed:
                logger.warning(
                    "document %r was not indexed: the index's transformations produced no "
                    "nodes for it (e.g. an IngestionPipeline's docstore skipped it as a "
                    "duplicate; remove it from that docstore, then insert or refresh it again)",
                    item.node_id,
                )
        self._record_hashes(documents, indexed)
        return indexed

    def _write(self, tree: Tree, docs: list[Document] | None) -> None:
        """Make the vector store hold exactly ``tree``: write what changed, delete the rest.

        Node ids are stable (a chunk's from its document and span, a summary's from its
        children), so after a rebuild most nodes are equal to stored ones and are left alone.
        """
        before = self._tree
        if before is None:
            old = {n.id for n in self._store}
            changed = list(range(len(tree)))
        else:
            old = {n.id for n in before.nodes}
            changed = [
                row
                for row, node in enumerate(tree.nodes)
                if node.id not in before
                or before.node(node.id) != node
                or not np.array_equal(before.embeddings[before.row(node.id)], tree.embeddings[row])
            ]
        if changed:
            rows = np.asarray(changed, dtype=np.intp)
            self._store.add([tree.nodes[r] for r in changed], tree.embeddings[rows])
        stale = old - {n.id for n in tree.nodes}
        if stale:
            self._store.delete(sorted(stale))
        self._save_struct(tree, docs)

    def _save_struct(self, tree: Tree, docs: list[Document] | None) -> None:
        self._tree = tree
        self._documents = docs
        self._store.params = dict(tree.params)
        self._index_struct.params = dict(tree.params)
        # After the store's writes, which drop the sizes it knew.
        self._store.layer_sizes = self._index_struct.layer_sizes = tree_layer_sizes(tree)
        self._index_struct.dim = tree.dim if len(tree) else None
        floor = recorded_floor(tree.build_info)
        self._index_struct.cohesion_floor = floor
        self._store.build_info = floor_build_info(floor)
        self._index_struct.documents = (
            None
            if docs is None
            else [{"doc_id": d.doc_id, "text": d.text, "metadata": dict(d.metadata)} for d in docs]
        )
        self._version += 1
        self._storage_context.index_store.add_index_struct(self._index_struct)

    def _merge_excluded_keys(self, items: Iterable[Any]) -> None:
        for key, names in excluded_metadata_keys(items).items():
            retriever = self._index_struct.retriever
            retriever[key] = sorted({*retriever.get(key, ()), *names})

    # -- contents ------------------------------------------------------------------------------
    @property
    def store(self) -> LlamaIndexNodeStore:
        """The vector store as a :class:`~raptor_core.types.NodeStore` (what strategies search)."""
        return self._store

    @property
    def tree(self) -> Tree:
        """The current tree, in memory (read from the vector store on first use after a load)."""
        if self._tree is None:
            self._tree = self._store.to_tree()
        return self._tree

    @property
    def embedder(self) -> Embedder:
        """The core embedder used for building and for queries."""
        return self._embedder

    @property
    def documents(self) -> tuple[Document, ...]:
        """The indexed documents as raptor_core ``Document`` objects."""
        if self._documents is None:
            saved = self._index_struct.documents
            if saved is not None:
                self._documents = to_core_documents(saved)
            else:
                return tuple(_documents_from_tree(self.tree))
        return tuple(self._documents)

    @property
    def ref_doc_ids(self) -> tuple[str, ...]:
        """Ids of the indexed documents."""
        # A pre-split node (chunk_of set) belongs to its source document.
        return tuple(dict.fromkeys(d.chunk_of or d.doc_id for d in self.documents))

    @property
    def ref_doc_info(self) -> dict[str, RefDocInfo]:
        """Each document's chunk (leaf) node ids and metadata, as LlamaIndex reports it."""
        leaves: dict[str, list[str]] = {}
        page_of = self._page_of_leaf()
        for leaf in self.tree.leaves:
            if leaf.doc_id is not None:
                leaves.setdefault(page_of.get(leaf.id, leaf.doc_id), []).append(leaf.id)
        # Pre-split nodes (chunk_of set) are reported under their source document.
        metadata: dict[str, dict[str, Any]] = {}
        for d in self.documents:
            meta = {k: v for k, v in d.metadata.items() if k != LLAMAINDEX_NODE_KEY}
            metadata.setdefault(d.chunk_of or d.doc_id, meta)
        return {
            ref: RefDocInfo(node_ids=leaves.get(ref, []), metadata=meta)
            for ref, meta in metadata.items()
        }

    def _page_of_leaf(self) -> dict[str, str]:
        """The page (its document id) each leaf of a joined PDF starts on."""
        docs = self.documents
        # Per joined document: its pages' ids and where they start.  A blank page has no
        # segment: it adds no text (see join_pages).
        joined = {
            r.document.doc_id: (
                [docs[i].doc_id for i in r.parts if docs[i].text.strip()],
                [segment.start for segment in r.document.segments],
            )
            for r in self._runs(docs)
            if len(r.parts) > 1
        }
        out: dict[str, str] = {}
        for leaf in self.tree.leaves if joined else ():
            if leaf.doc_id in joined and leaf.span is not None:
                pages, starts = joined[leaf.doc_id]
                out[leaf.id] = pages[max(0, bisect.bisect_right(starts, leaf.span[0]) - 1)]
        return out

    def _tree_doc_ids(self) -> dict[str, str]:
        """The tree document each indexed document is part of (itself, or its joined PDF)."""
        docs = self.documents
        return {
            docs[i].doc_id: run.document.chunk_of or run.document.doc_id
            for run in self._runs(docs)
            for i in run.parts
        }

    @property
    def retriever_kwargs(self) -> dict[str, Any]:
        """The retrieval defaults used by :meth:`as_retriever` (and saved with the index)."""
        return dict(self._index_struct.retriever)

    # -- updates -------------------------------------------------------------------------------
    def _build_index_from_nodes(self, nodes: Sequence[BaseNode], **_: Any) -> RaptorIndexStruct:
        # BaseIndex calls this only without an index struct; __init__ always passes one.
        self._update(added=list(nodes))
        return self._index_struct

    def _insert(self, nodes: Sequence[BaseNode], **_: Any) -> None:
        self._update(added=list(nodes))

    def insert(self, document: Any, **_: Any) -> None:
        """Add one document (or node) to the tree without rebuilding it (see the class docs).

        Raises:
            InvalidInputError: the document's id is already indexed (use
                :meth:`update_ref_doc`), or it is empty/binary.
        """
        self._check_new(document)
        # As BaseIndex.insert: a document goes through the index's transformations first.
        nodes = run_ingestion([document], self._transformations)
        if nodes:
            self.insert_nodes(nodes)
        self._ingested([document])

    def insert_nodes(self, nodes: Sequence[Any], **_: Any) -> None:
        """Add several documents or nodes with one incremental update.

        A node whose source document (``ref_doc_id``) is already indexed joins it: that
        document's chunks are updated together.
        """
        with self._callback_manager.as_trace("insert_nodes"):
            self._update(added=list(nodes))

    async def ainsert(self, document: Any, **_: Any) -> None:
        """Async :meth:`insert`."""
        self._check_new(document)
        nodes = await arun_ingestion([document], self._transformations)
        if nodes:
            await self.ainsert_nodes(nodes)
        self._ingested([document])

    def _check_new(self, document: Any) -> None:
        # Before the transformations run: their nodes would otherwise join the indexed
        # document of that id (as insert_nodes allows), duplicating its content.
        if isinstance(document, BaseNode) and not isinstance(document, LlamaIndexDocumentBase):
            return
        source = _source_id(document)
        if source in self.ref_doc_ids:
            _already_indexed(source)

    async def ainsert_nodes(self, nodes: Sequence[Any], **_: Any) -> None:
        """Async :meth:`insert_nodes`."""
        await self._aupdate(added=list(nodes))

    def _delete_node(self, node_id: str, **_: Any) -> None:
        if node_id in self.ref_doc_ids:
            self._update(removed=[node_id])
            return
        msg = (
            f"cannot delete node {node_id!r} alone: summaries depend on every chunk below "
            "them; delete whole documents with delete_ref_doc(doc_id)"
        )
        raise InvalidParameterError(msg)

    def delete_ref_doc(self, ref_doc_id: str, delete_from_docstore: bool = False, **_: Any) -> None:
        """Remove a document by id: its nodes go and the summaries above them are redone.

        Removing the last document leaves an empty index.  Its recorded hash goes with it.
        ``delete_from_docstore=True`` also removes, as ``BaseIndex`` does, the document's
        entry (``get_ref_doc_info``) and its leaf nodes from the index's docstore (nodes
        RAPTOR wrote there are deleted with the document anyway); a transformation's own
        docstore (an ``IngestionPipeline``'s) is not the index's and is left as it is.

        Raises:
            InvalidInputError: no document has this id.
        """
        leaves = self._leaf_ids(ref_doc_id) if delete_from_docstore else []
        self._update(removed=[ref_doc_id])
        if delete_from_docstore:
            self._delete_from_docstore(ref_doc_id, leaves)

    async def adelete_ref_doc(
        self, ref_doc_id: str, delete_from_docstore: bool = False, **_: Any
    ) -> None:
        """Async :meth:`delete_ref_doc`."""
        leaves = self._leaf_ids(ref_doc_id) if delete_from_docstore else []
        await self._aupdate(removed=[ref_doc_id])
        if delete_from_docstore:
            await asyncio.to_thread(self._delete_from_docstore, ref_doc_id, leaves)

    def _leaf_ids(self, ref_doc_id: str) -> list[str]:
        info = self.ref_doc_info.get(ref_doc_id)
        return [] if info is None else list(info.node_ids)

    def _delete_from_docstore(self, ref_doc_id: str, leaves: Sequence[str]) -> None:
        # BaseIndex.delete_ref_doc(delete_from_docstore=True): each node, then the document.
        for node_id in leaves:
            self._docstore.delete_document(node_id, raise_error=False)
        self._docstore.delete_ref_doc(ref_doc_id, raise_error=False)

    def update_ref_doc(self, document: Any, **_: Any) -> None:
        """Replace a document (same id), through the index's transformations.

        Unchanged text and metadata cost nothing (the core compares the chunks); a changed
        document's old nodes are deleted and its new ones inserted in one update.

        Raises:
            InvalidInputError: no document has this id (use :meth:`insert`).
        """
        removed = [_source_id(document)]
        self._update(added=run_ingestion([document], self._transformations), removed=removed)
        self._ingested([document])

    async def aupdate_ref_doc(self, document: Any, **_: Any) -> None:
        """Async :meth:`update_ref_doc`."""
        removed = [_source_id(document)]
        added = await arun_ingestion([document], self._transformations)
        await self._aupdate(added=added, removed=removed)
        self._ingested([document])

    def refresh_ref_docs(self, documents: Sequence[Any], **_: Any) -> list[bool]:
        """Insert new documents and update changed ones, in one incremental update.

        As LlamaIndex does, a document whose hash matches the one recorded at its insert is
        skipped without any work; the others go through the index's transformations and one
        :meth:`TreeBuilder.update`.

        Returns:
            For each document, whether the index changed for it: it was new, or the tree's
            chunks or metadata for it differ (a different hash with identical content, e.g. a
            document indexed before its hash was recorded, is False).
        """
        with self._callback_manager.as_trace("refresh_ref_docs"):
            todo = self._stale(documents)
            if not todo:
                return [False] * len(documents)
            items = run_ingestion([documents[i] for i in todo], self._transformations)
            known = self._known(documents, todo)
            reports = self._update(added=items, removed=known) if items or known else []
            indexed = self._ingested([documents[i] for i in todo])
            return self._refreshed(documents, todo, reports, self._tree_doc_ids(), indexed, known)

    async def arefresh_ref_docs(self, documents: Sequence[Any], **_: Any) -> list[bool]:
        """Async :meth:`refresh_ref_docs`."""
        todo = await asyncio.to_thread(self._stale, documents)
        if not todo:
            return [False] * len(documents)
        items = await arun_ingestion([documents[i] for i in todo], self._transformations)
        known = self._known(documents, todo)
        reports = await self._aupdate(added=items, removed=known) if items or known else []
        indexed = self._ingested([documents[i] for i in todo])
        return self._refreshed(documents, todo, reports, self._tree_doc_ids(), indexed, known)

    def _stale(self, documents: Sequence[Any]) -> list[int]:
        """Positions of the documents not indexed, or whose hash is not the one recorded."""
        if isinstance(documents, str | bytes) or not isinstance(documents, Sequence):
            msg = "refresh_ref_docs() takes a list of LlamaIndex documents"
            raise InvalidParameterError(msg)
        todo = []
        indexed: set[str] | None = None
        for i, doc in enumerate(documents):
            if not isinstance(doc, BaseNode):
                msg = f"document #{i} is a {type(doc).__name__}, not a LlamaIndex document"
                raise InvalidParameterError(msg)
            if self._docstore.get_document_hash(doc.node_id) != doc.hash:
                todo.append(i)
                continue
            # A recorded hash is not proof the document is here (a hash kept by another
            # index over the same docstore, or recorded before this rule): the index's own
            # documents decide.
            indexed = self._indexed_ids() if indexed is None else indexed
            if doc.node_id not in indexed:
                todo.append(i)
        return todo

    def _known(self, documents: Sequence[Any], todo: Sequence[int]) -> list[str]:
        known = set(self.ref_doc_ids)
        return [documents[i].node_id for i in todo if documents[i].node_id in known]

    @staticmethod
    def _refreshed(
        documents: Sequence[Any],
        todo: Sequence[int],
        reports: list[UpdateReport] | None,
        tree_doc_ids: Mapping[str, str],
        indexed: set[str],
        removed: Sequence[str],
    ) -> list[bool]:
        # No reports: the tree was built whole, and every stale document went into it,
        # except one its transformations made no node for: not indexed, nothing changed
        # (unless it was indexed before, and is now removed).
        changed = None if reports is None else {d for r in reports for d in r.docs_changed}
        stale = set(todo)
        gone = set(removed)
        return [
            i in stale
            and (doc.node_id in indexed or doc.node_id in gone)
            and (changed is None or tree_doc_ids.get(doc.node_id, doc.node_id) in changed)
            for i, doc in enumerate(documents)
        ]

    # -- retrieval and engines -----------------------------------------------------------------
    def as_retriever(self, **kwargs: Any) -> RaptorRetriever:
        """A :class:`RaptorRetriever` with the index's defaults, updated by ``kwargs``.

        Args:
            **kwargs: ``strategy``, ``similarity_top_k``, ``max_tokens``, strategy parameters,
                ``llm`` (for LLM-guided strategies), ``callback_manager``, ``verbose``,
                ``filters``, ``vector_store_query_mode="mmr"`` with
                ``vector_store_kwargs={"mmr_threshold": ...}``.
        """
        llm = kwargs.pop("llm", None) or self._llm
        kwargs.setdefault("callback_manager", self._callback_manager)
        mode = kwargs.get("vector_store_query_mode")
        if getattr(mode, "value", mode) == "mmr":
            # MMR replaces the saved strategy, and the saved strategy's parameters with it.
            kwargs.setdefault("strategy", "mmr")
        retriever = RaptorRetriever(
            self._store,
            self._embedder,
            llm=llm,
            **merge_retriever_params(self._index_struct.retriever, kwargs),
        )
        retriever._follow(self)
        return retriever

    def _engine_kwargs(self, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        strategy = kwargs.get(
            "strategy", self._index_struct.retriever.get("strategy", DEFAULT_STRATEGY)
        )
        retriever_names = (
            _RETRIEVER_ARGS
            | _RETRIEVER_ONLY_ARGS
            # The core's name for similarity_top_k: refused by the retriever with a hint,
            # where the engine would ignore it.
            | {"k"}
            | strategy_param_names(strategy)
            | set(self._index_struct.retriever.get("strategy_params") or {})
        )
        retriever = {k: v for k, v in kwargs.items() if k in retriever_names or k in _SHARED_ARGS}
        engine = {k: v for k, v in kwargs.items() if k not in retriever_names}
        return retriever, engine

    def _answer_llm(self, llm: LlamaIndexLLMBase | None) -> LlamaIndexLLMBase:
        if llm is not None:
            return llm
        if isinstance(self._llm, LlamaIndexLLMBase):
            return self._llm
        from llama_index.core.settings import Settings

        # LlamaIndex's own rule, as VectorStoreIndex applies it (OpenAI when nothing is set).
        return Settings.llm

    def as_query_engine(  # type: ignore[override]  # a model object only, never a name
        self, llm: LlamaIndexLLMBase | None = None, **kwargs: Any
    ) -> BaseQueryEngine:
        """A ``RetrieverQueryEngine`` over :meth:`as_retriever`.

        Args:
            llm: the answer model; default: the index's ``llm``, else ``Settings.llm``.
            **kwargs: retrieval parameters go to the retriever, the rest (``response_mode``,
                ``node_postprocessors``, ``streaming``, ...) to ``RetrieverQueryEngine.from_args``.
        """
        from llama_index.core.query_engine import RetrieverQueryEngine

        retriever_kwargs, engine_kwargs = self._engine_kwargs(kwargs)
        return RetrieverQueryEngine.from_args(
            self.as_retriever(**retriever_kwargs), llm=self._answer_llm(llm), **engine_kwargs
        )

    def as_chat_engine(  # type: ignore[override]  # a model object only, never a name
        self,
        chat_mode: ChatMode | str = ChatMode.BEST,
        llm: LlamaIndexLLMBase | None = None,
        **kwargs: Any,
    ) -> BaseChatEngine:
        """A LlamaIndex chat engine over the index.

        Args:
            chat_mode: ``"condense_plus_context"`` (also ``"best"``, the default),
                ``"context"``, ``"condense_question"`` or ``"simple"``.  For agents, wrap
                :meth:`as_query_engine` in a ``QueryEngineTool`` instead.
            llm: the chat model; default: the index's ``llm``, else ``Settings.llm``.
            **kwargs: retrieval parameters and chat-engine parameters.
        """
        from llama_index.core.chat_engine import (
            CondensePlusContextChatEngine,
            CondenseQuestionChatEngine,
            ContextChatEngine,
            SimpleChatEngine,
        )

        try:
            mode = ChatMode(chat_mode)
        except ValueError:
            mode = None
        answer_llm = self._answer_llm(llm)
        retriever_kwargs, engine_kwargs = self._engine_kwargs(kwargs)
        if mode in (ChatMode.BEST, ChatMode.CONDENSE_PLUS_CONTEXT):
            return CondensePlusContextChatEngine.from_defaults(
                retriever=self.as_retriever(**retriever_kwargs), llm=answer_llm, **engine_kwargs
            )
        if mode is ChatMode.CONTEXT:
            return ContextChatEngine.from_defaults(
                retriever=self.as_retriever(**retriever_kwargs), llm=answer_llm, **engine_kwargs
            )
        if mode is ChatMode.CONDENSE_QUESTION:
            engine = self.as_query_engine(llm=answer_llm, **retriever_kwargs)
            return CondenseQuestionChatEngine.from_defaults(
                query_engine=engine, llm=answer_llm, **engine_kwargs
            )
        if mode is ChatMode.SIMPLE:
            return SimpleChatEngine.from_defaults(llm=answer_llm, **engine_kwargs)
        msg = (
            f"chat_mode {chat_mode!r} is not supported: use 'condense_plus_context', 'context', "
            "'condense_question' or 'simple'; for an agent, give it "
            "QueryEngineTool.from_defaults(index.as_query_engine())"
        )
        raise InvalidParameterError(msg)

    # -- persistence ---------------------------------------------------------------------------
    def persist(self, persist_dir: str | os.PathLike[str]) -> Path:
        """Export the tree, the retrieval defaults, the build parameters and the documents.

        The directory holds the tree's own files (``tree.json``, ``embeddings-*.npy``, see
        :meth:`raptor_core.Tree.save`) and ``raptor_llamaindex.json``; :meth:`load` reads
        it back into a new ``SimpleVectorStore``.  To keep the index in its vector store,
        use ``index.storage_context.persist(persist_dir)`` and ``load_index_from_storage``
        instead.  Models are not saved: pass them to :meth:`load`.
        """
        documents = self._index_struct.documents
        # Written only when set, so that an index that never joins stays readable by versions
        # before the options.
        flags = {
            flag: True
            for flag in ("rejoin_nodes", "join_pages")
            if getattr(self._index_struct, flag)
        }
        return save_with_params(
            self.tree,
            persist_dir,
            retriever=self._index_struct.retriever,
            builder=_jsonable_builder_args(self._builder_kwargs),
            documents=documents,
            **flags,
        )

    @classmethod
    def load(
        cls,
        persist_dir: str | os.PathLike[str],
        embed_model: BaseEmbedding | Embedder | None = None,
        llm: BaseLLM | LLM | None = None,
        *,
        summarizer: Summarizer | None = None,
        callback_manager: CallbackManager | None = None,
        storage_context: StorageContext | None = None,
        rejoin_nodes: bool | None = None,
        join_pages: bool | None = None,
        **builder_kwargs: Any,
    ) -> RaptorIndex:
        """Load an index exported by :meth:`persist` (or a bare tree directory).

        Args:
            persist_dir: the directory.
            embed_model: the model the tree was built with.  Default: re-created from the
                tree's record only when it is a local sentence-transformers model by name (the
                packaged MiniLM, a hub id) or a test fake, else ``Settings.embed_model``; any
                other model must be passed (see ``docs/loading-trees.md``).
            llm: for summaries on later inserts, LLM strategies and answers.
            summarizer: a raptor_core ``Summarizer`` for later inserts.
            callback_manager: LlamaIndex callbacks.
            storage_context: where to write the tree's nodes (default: a new
                ``SimpleVectorStore``).
            rejoin_nodes: join a node parser's nodes back into their documents on later
                updates (see the class docs); None: as saved.
            join_pages: join a PDF loader's pages into one document on later updates
                (see the class docs); None: as saved.
            **builder_kwargs: ``TreeBuilder`` components or parameters for later inserts
                (the saved JSON-serialisable ones are restored automatically).

        Raises:
            TreeFormatError: the directory holds no tree or a damaged one.
        """
        tree = Tree.load(persist_dir)
        saved = read_params(persist_dir)
        documents = saved.get("documents")
        unknown = sorted(set(builder_kwargs) - _BUILDER_ARGS)
        if unknown:
            msg = f"unknown parameter(s) {unknown}: load() takes TreeBuilder parameters"
            raise InvalidParameterError(msg)
        embedder = resolve_embedder(embed_model, tree=tree)
        index = cls(
            [],
            storage_context=storage_context,
            embed_model=embedder,
            llm=llm,
            summarizer=summarizer,
            callback_manager=callback_manager,
            rejoin_nodes=saved.get("rejoin_nodes", False) if rejoin_nodes is None else rejoin_nodes,
            join_pages=saved.get("join_pages", False) if join_pages is None else join_pages,
            **{**(saved.get("builder") or {}), **builder_kwargs},
        )
        index._index_struct.retriever = dict(saved.get("retriever") or {})
        index._write(tree, None if documents is None else to_core_documents(documents))
        return index


def _in_place(docs: Sequence[Document], current: Sequence[Document]) -> list[Document]:
    """``docs`` with each page at the place where it joins its file.

    A document that replaces one of ``current`` (same id) keeps that one's place.  A new
    page that continues a page already placed (the next page of a file, inserted later)
    goes right after it, wherever that file sits among the index's documents: pages are
    joined only when they follow each other.  Other new documents go at the end.
    """
    place: dict[str, float] = {d.doc_id: float(i) for i, d in enumerate(current)}
    end = float(len(current))
    placed = [d for d in current if d.doc_id in place]
    key: dict[int, float] = {}
    for j, doc in enumerate(docs):
        if doc.doc_id in place:
            key[j] = place[doc.doc_id]
            continue
        # The latest placed page this one continues (a page and the one after it, both
        # new, chain: the second follows the first).
        before = next((p for p in reversed(placed) if continues(p, doc)), None)
        key[j] = end if before is None else place[before.doc_id]
        place[doc.doc_id] = key[j]
        placed.append(doc)
    order = sorted(range(len(docs)), key=lambda j: (key[j], j))
    return [docs[j] for j in order]


def _sources(docs: Iterable[Document]) -> set[str]:
    return {d.chunk_of or d.doc_id for d in docs}


def _flat_retriever_args(nested: Mapping[str, Any]) -> dict[str, Any]:
    """The saved shape (``strategy_params`` nested) -> flat keywords."""
    out = {k: v for k, v in nested.items() if k != "strategy_params"}
    out.update(nested.get("strategy_params") or {})
    return out


def _already_indexed(doc_id: str) -> NoReturn:
    msg = (
        f"duplicate document id {doc_id!r}: it is already indexed; use "
        "update_ref_doc(document) to replace it, or give the new document another id"
    )
    raise InvalidInputError(msg)


def _source_id(document: Any) -> str:
    """The id of the source document ``document`` is (or, for a node, belongs to)."""
    doc = to_core_documents([document])[0]
    return doc.chunk_of or doc.doc_id


def _transformations(kwargs: dict[str, Any]) -> Any:
    """Pop LlamaIndex ``transformations`` (or a node parser passed as ``chunker``) from kwargs."""
    transformations = kwargs.pop("transformations", None)
    chunker = kwargs.get("chunker")
    if isinstance(chunker, TransformComponent):
        # A LlamaIndex node parser is not a raptor_core Chunker: run it as a transformation.
        if transformations is not None:
            msg = "pass the node parser either as chunker= or in transformations=, not both"
            raise InvalidParameterError(msg)
        transformations = [kwargs.pop("chunker")]
    return transformations


def _nest_retriever_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """Flat retriever keywords -> the saved shape (``strategy_params`` nested)."""
    out: dict[str, Any] = {k: v for k, v in args.items() if k in _RETRIEVER_ARGS}
    strategy_params = {k: v for k, v in args.items() if k not in _RETRIEVER_ARGS}
    if strategy_params:
        out["strategy_params"] = strategy_params
    return out


# LlamaIndex picks the index class for a stored struct from these closed registries (by the
# struct's type string), so load_index_from_storage finds RaptorIndex once this module is
# imported; nothing in a persisted file names a class.
INDEX_STRUCT_TYPE_TO_INDEX_STRUCT_CLASS.setdefault(RAPTOR_INDEX_TYPE, RaptorIndexStruct)  # type: ignore[arg-type]
INDEX_STRUCT_TYPE_TO_INDEX_CLASS.setdefault(RAPTOR_INDEX_TYPE, RaptorIndex)  # type: ignore[arg-type]
