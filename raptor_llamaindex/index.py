"""``RaptorIndex``: build, persist and query a RAPTOR tree the way a LlamaIndex index is used.

``RaptorIndex.from_documents(docs).as_retriever()`` replaces
``VectorStoreIndex.from_documents(docs).as_retriever()``; ``as_query_engine`` and
``as_chat_engine`` work as they do on LlamaIndex indexes.  The tree is built by
:class:`raptor_core.TreeBuilder`: this module only converts documents and routes arguments.

``RaptorIndex`` is not a subclass of LlamaIndex's ``BaseIndex``: that class is built around a
docstore, an index struct and LlamaIndex's own node parsing, none of which a RAPTOR tree
uses.  It offers the same entry points instead (``from_documents``, ``as_retriever``,
``as_query_engine``, ``as_chat_engine``, ``insert``, ``delete_ref_doc``) and its own
``persist``/``load`` to a directory of plain files.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.base.llms.base import BaseLLM
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.chat_engine.types import BaseChatEngine, ChatMode
from llama_index.core.llms import LLM as LlamaIndexLLMBase
from llama_index.core.schema import BaseNode, TransformComponent

from raptor_core.build.builder import ProgressCallback, TreeBuilder, describe
from raptor_core.exceptions import InvalidInputError, InvalidParameterError
from raptor_core.tree import Tree
from raptor_core.types import LLM, Document, Embedder, Summarizer
from raptor_llamaindex.ingestion import (
    abuild_tree,
    arun_ingestion,
    build_tree,
    run_ingestion,
    to_core_documents,
)
from raptor_llamaindex.models import resolve_embedder, resolve_summarizer
from raptor_llamaindex.retriever import (
    BUILDER_PARAMS,
    DEFAULT_STRATEGY,
    RaptorRetriever,
    merge_retriever_params,
    read_params,
    save_with_params,
    strategy_param_names,
)

__all__ = ["RaptorIndex", "to_core_documents"]

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
_RETRIEVER_ONLY_ARGS = frozenset({"objects", "object_map"})


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
    metadata: dict[str, dict[str, Any]] = {}
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
        metadata.setdefault(leaf.doc_id, dict(leaf.metadata))
    return [
        *(
            Document(
                text=" ".join(t for _, t in sorted(parts, key=lambda p: p[0])),
                doc_id=d,
                metadata=metadata[d],
            )
            for d, parts in texts.items()
        ),
        *chunks,
    ]


def _empty_tree(embedder: Embedder) -> Tree:
    # LlamaIndex indexes may be empty (VectorStoreIndex.from_documents([])); so may ours.
    return Tree(
        nodes=(),
        embeddings=np.zeros((0, 0), dtype=np.float32),
        params={"embedder": describe(embedder)},
    )


def _jsonable_builder_args(args: Mapping[str, Any]) -> dict[str, Any]:
    # Only the plain numbers a load accepts back (BUILDER_PARAMS).  Components (tokenizer,
    # chunker, clusterer, progress) and the cache location are passed again to load().
    return {k: v for k, v in args.items() if k in BUILDER_PARAMS and (v is None or type(v) is int)}


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


class RaptorIndex:
    """A RAPTOR index for LlamaIndex: a tree of recursive summaries over your documents.

    Build it from LlamaIndex ``Document`` objects or nodes, then use it like any LlamaIndex
    index.  Parameters are routed by name: :class:`raptor_core.TreeBuilder` parameters
    (``chunk_max_tokens``, ``max_layers``, ``random_state``, ``tokenizer``, ...) shape the
    build; retrieval parameters (``strategy``, ``similarity_top_k``, ``max_tokens`` and the
    strategy's own) become the defaults of ``as_retriever`` and are saved by ``persist``.

    Models: ``embed_model`` defaults to ``Settings.embed_model`` when the application set one,
    else to the packaged, offline all-MiniLM-L6-v2.  ``llm`` (cluster summaries, LLM-guided
    strategies and the default answer model of ``as_query_engine``) defaults to
    ``Settings.llm`` when set; without one, summaries are extractive (offline).  The unset
    ``Settings`` defaults are never resolved, so no OpenAI key is needed.

    Updates: ``insert``/``delete_ref_doc`` rebuild the whole tree from the stored documents.
    RAPTOR's clusters and summaries depend on every document, so attaching a document to an
    existing tree would leave stale summaries; a rebuild costs a fresh build and yields
    exactly the tree ``from_documents`` would.  Retrievers and engines made earlier from this
    index switch to the new tree on their next query.

    Setup:
        ``pip install 'raptor-retriever[llamaindex]'``

    Key init args (``from_documents``):
        documents: LlamaIndex ``Document`` objects or nodes.
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

            nodes = index.as_retriever().retrieve("Why do bees dance?")
            index.persist("./raptor_index")
            index = RaptorIndex.load("./raptor_index", embed_model=FakeEmbedder())

    Use within a query engine or an agent tool:
        .. code-block:: python

            from llama_index.core.llms import MockLLM
            from llama_index.core.tools import QueryEngineTool

            engine = index.as_query_engine(llm=MockLLM())
            tool = QueryEngineTool.from_defaults(
                engine, name="raptor_docs", description="Answers questions about the documents"
            )
    """

    #: ``from_documents(transformations=...)``, applied again by :meth:`insert` (not saved).
    _transformations: Any = None

    def __init__(
        self,
        tree: Tree,
        *,
        embed_model: BaseEmbedding | Embedder | None = None,
        llm: BaseLLM | LLM | None = None,
        summarizer: Summarizer | None = None,
        documents: Sequence[Document] | None = None,
        retriever_kwargs: Mapping[str, Any] | None = None,
        builder_kwargs: Mapping[str, Any] | None = None,
        callback_manager: CallbackManager | None = None,
    ) -> None:
        if not isinstance(tree, Tree):
            msg = f"tree must be a raptor_core Tree, got {type(tree).__name__}"
            raise InvalidParameterError(msg)
        self._tree = tree
        self._embedder = resolve_embedder(embed_model, tree=tree)
        self._llm = llm
        self._summarizer = summarizer
        self._documents = list(documents) if documents is not None else None
        self._retriever_kwargs = dict(retriever_kwargs or {})
        self._builder_kwargs = dict(builder_kwargs or {})
        self._callback_manager = callback_manager

    def __repr__(self) -> str:
        return f"RaptorIndex({self._tree!r}, retriever={self._retriever_kwargs})"

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
    def from_documents(
        cls,
        documents: Sequence[Any],
        embed_model: BaseEmbedding | Embedder | None = None,
        llm: BaseLLM | LLM | None = None,
        *,
        summarizer: Summarizer | None = None,
        show_progress: bool = False,
        callback_manager: CallbackManager | None = None,
        **kwargs: Any,
    ) -> RaptorIndex:
        """Build an index over LlamaIndex ``Document`` objects (or nodes, or raptor_core inputs).

        Args:
            documents: the documents; an empty list gives an empty index.
            embed_model: embeds chunks, summaries and queries.
            llm: summarises clusters and guides LLM strategies.
            summarizer: a raptor_core ``Summarizer`` that replaces the one made from ``llm``.
            show_progress: draw progress bars (tqdm) for the build stages.
            callback_manager: LlamaIndex callbacks for retrievers and engines.
            **kwargs: ``TreeBuilder`` parameters and retrieval defaults (see the class docs);
                ``transformations=`` (node parsers, extractors, or an ``IngestionPipeline``)
                are run first and their nodes become the leaves as they are (also a node
                parser passed as ``chunker=``); see :mod:`raptor_llamaindex.ingestion`.

        Raises:
            InvalidInputError: an empty, binary or duplicate document.
            InvalidParameterError: an unknown or out-of-range parameter.
        """
        transformations = _transformations(kwargs)
        builder_kwargs, retriever_kwargs = cls._split_kwargs(kwargs)
        documents = run_ingestion(documents, transformations, show_progress=show_progress)
        docs = to_core_documents(documents)
        retriever_kwargs = {**excluded_metadata_keys(documents), **retriever_kwargs}
        embedder = resolve_embedder(embed_model)
        index = cls(
            _empty_tree(embedder),
            embed_model=embedder,
            llm=llm,
            summarizer=summarizer,
            documents=[],
            retriever_kwargs=retriever_kwargs,
            builder_kwargs=builder_kwargs,
            callback_manager=callback_manager,
        )
        index._transformations = transformations
        index._tree = index._build(docs, show_progress=show_progress)
        index._documents = docs
        return index

    @classmethod
    async def afrom_documents(
        cls,
        documents: Sequence[Any],
        embed_model: BaseEmbedding | Embedder | None = None,
        llm: BaseLLM | LLM | None = None,
        *,
        summarizer: Summarizer | None = None,
        show_progress: bool = False,
        callback_manager: CallbackManager | None = None,
        **kwargs: Any,
    ) -> RaptorIndex:
        """Async :meth:`from_documents`: uses the async model APIs; safe in a running loop."""
        transformations = _transformations(kwargs)
        builder_kwargs, retriever_kwargs = cls._split_kwargs(kwargs)
        documents = await arun_ingestion(documents, transformations, show_progress=show_progress)
        docs = to_core_documents(documents)
        retriever_kwargs = {**excluded_metadata_keys(documents), **retriever_kwargs}
        embedder = resolve_embedder(embed_model)
        index = cls(
            _empty_tree(embedder),
            embed_model=embedder,
            llm=llm,
            summarizer=summarizer,
            documents=[],
            retriever_kwargs=retriever_kwargs,
            builder_kwargs=builder_kwargs,
            callback_manager=callback_manager,
        )
        index._transformations = transformations
        index._tree = await index._abuild(docs, show_progress=show_progress)
        index._documents = docs
        return index

    @classmethod
    def from_tree(
        cls,
        tree: Tree,
        embed_model: BaseEmbedding | Embedder | None = None,
        llm: BaseLLM | LLM | None = None,
        *,
        summarizer: Summarizer | None = None,
        **kwargs: Any,
    ) -> RaptorIndex:
        """Wrap an existing tree (built by ``TreeBuilder`` or ``raptor build``).

        ``kwargs`` are retrieval defaults and ``TreeBuilder`` parameters for later inserts.
        """
        builder_kwargs, retriever_kwargs = cls._split_kwargs(kwargs)
        return cls(
            tree,
            embed_model=embed_model,
            llm=llm,
            summarizer=summarizer,
            retriever_kwargs=retriever_kwargs,
            builder_kwargs=builder_kwargs,
        )

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

    # -- contents ------------------------------------------------------------------------------
    @property
    def tree(self) -> Tree:
        """The current tree (immutable; ``insert`` replaces it)."""
        return self._tree

    @property
    def embedder(self) -> Embedder:
        """The core embedder used for building and for queries."""
        return self._embedder

    @property
    def documents(self) -> tuple[Document, ...]:
        """The indexed documents as raptor_core ``Document`` objects."""
        if self._documents is None:
            return tuple(_documents_from_tree(self._tree))
        return tuple(self._documents)

    @property
    def ref_doc_ids(self) -> tuple[str, ...]:
        """Ids of the indexed documents."""
        # A pre-split node (chunk_of set) belongs to its source document.
        return tuple(dict.fromkeys(d.chunk_of or d.doc_id for d in self.documents))

    @property
    def retriever_kwargs(self) -> dict[str, Any]:
        """The retrieval defaults used by :meth:`as_retriever` (and saved by :meth:`persist`)."""
        return dict(self._retriever_kwargs)

    # -- updates -------------------------------------------------------------------------------
    def _with_added(self, items: Iterable[Any]) -> list[Document]:
        current = self.documents
        if self._documents is None and current:
            logger.info("rebuilding from documents rejoined from the tree's leaf chunks")
        return to_core_documents([*current, *items])

    def insert(self, document: Any, **_: Any) -> None:
        """Add one document (or node) and rebuild the tree (see the class docstring).

        Raises:
            InvalidInputError: the document's id is already indexed, or it is empty/binary.
        """
        # As BaseIndex.insert: a document goes through the index's transformations first.
        self.insert_nodes(run_ingestion([document], self._transformations))

    def _merge_excluded_keys(self, items: Iterable[Any]) -> None:
        for key, names in excluded_metadata_keys(items).items():
            self._retriever_kwargs[key] = sorted({*self._retriever_kwargs.get(key, ()), *names})

    def insert_nodes(self, nodes: Sequence[Any], **_: Any) -> None:
        """Add several documents or nodes with one rebuild."""
        docs = self._with_added(nodes)
        self._tree = self._build(docs)
        self._documents = docs
        self._merge_excluded_keys(nodes)

    async def ainsert(self, document: Any, **_: Any) -> None:
        """Async :meth:`insert`."""
        await self.ainsert_nodes(await arun_ingestion([document], self._transformations))

    async def ainsert_nodes(self, nodes: Sequence[Any], **_: Any) -> None:
        """Async :meth:`insert_nodes`."""
        docs = self._with_added(nodes)
        self._tree = await self._abuild(docs)
        self._documents = docs
        self._merge_excluded_keys(nodes)

    def delete_ref_doc(self, ref_doc_id: str, **_: Any) -> None:
        """Remove a document by id and rebuild the tree.

        Raises:
            InvalidInputError: no document has this id.
        """
        current = self.documents
        kept = [d for d in current if (d.chunk_of or d.doc_id) != ref_doc_id]
        if len(kept) == len(current):
            msg = f"no document with id {ref_doc_id!r} in this index"
            raise InvalidInputError(msg)
        self._tree = self._build(kept)
        self._documents = kept

    # -- retrieval and engines -----------------------------------------------------------------
    def as_retriever(self, **kwargs: Any) -> RaptorRetriever:
        """A :class:`RaptorRetriever` with the index's defaults, updated by ``kwargs``.

        Args:
            **kwargs: ``strategy``, ``similarity_top_k``, ``max_tokens``, strategy parameters,
                ``llm`` (for LLM-guided strategies), ``callback_manager``, ``verbose``.
        """
        llm = kwargs.pop("llm", None) or self._llm
        kwargs.setdefault("callback_manager", self._callback_manager)
        retriever = RaptorRetriever(
            self._tree,
            self._embedder,
            llm=llm,
            **merge_retriever_params(self._retriever_kwargs, kwargs),
        )
        retriever._index = self
        return retriever

    def _engine_kwargs(self, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        strategy = kwargs.get("strategy", self._retriever_kwargs.get("strategy", DEFAULT_STRATEGY))
        retriever_names = (
            _RETRIEVER_ARGS
            | _RETRIEVER_ONLY_ARGS
            | strategy_param_names(strategy)
            | set(self._retriever_kwargs.get("strategy_params") or {})
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

    def as_query_engine(
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

    def as_chat_engine(
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
        """Save the tree, the retrieval defaults, the build parameters and the documents.

        The directory holds the tree's own files (``tree.json``, ``embeddings-*.npy``, see
        :meth:`raptor_core.Tree.save`) and ``raptor_llamaindex.json``.  Models are not saved:
        pass them to :meth:`load` (or configure ``Settings``).
        """
        documents = None
        if self._documents is not None:
            documents = [
                {"doc_id": d.doc_id, "text": d.text, "metadata": dict(d.metadata)}
                for d in self._documents
            ]
        return save_with_params(
            self._tree,
            persist_dir,
            retriever=self._retriever_kwargs,
            builder=_jsonable_builder_args(self._builder_kwargs),
            documents=documents,
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
        **builder_kwargs: Any,
    ) -> RaptorIndex:
        """Load an index saved by :meth:`persist` (or a bare tree directory).

        Args:
            persist_dir: the directory.
            embed_model: the model the tree was built with.  Default: re-created from the
                tree's record only when it is a local sentence-transformers model by name (the
                packaged MiniLM, a hub id) or a test fake, else ``Settings.embed_model``; any
                other model must be passed (see ``docs/loading-trees.md``).
            llm: for summaries on later inserts, LLM strategies and answers.
            summarizer: a raptor_core ``Summarizer`` for later inserts.
            callback_manager: LlamaIndex callbacks.
            **builder_kwargs: ``TreeBuilder`` components or parameters for later inserts
                (the saved JSON-serialisable ones are restored automatically).

        Raises:
            TreeFormatError: the directory holds no tree or a damaged one.
        """
        tree = Tree.load(persist_dir)
        saved = read_params(persist_dir)
        documents = saved.get("documents")
        return cls(
            tree,
            embed_model=embed_model,
            llm=llm,
            summarizer=summarizer,
            documents=None if documents is None else to_core_documents(documents),
            retriever_kwargs=saved.get("retriever") or {},
            builder_kwargs={**(saved.get("builder") or {}), **builder_kwargs},
            callback_manager=callback_manager,
        )


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
