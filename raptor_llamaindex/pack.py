"""A drop-in home for users of the deprecated ``llama-index-packs-raptor``.

The pack (``from llama_index.packs.raptor import RaptorPack, RaptorRetriever``) no longer
imports with current llama-index-core.  Changing that one import line to
``from raptor_llamaindex.pack import RaptorPack, RaptorRetriever`` keeps the pack's code
running: the same constructor arguments, ``pack.run(query, mode=...)``,
``retriever.retrieve(query, mode=...)``, ``persist``/``from_persist_dir`` and
``SummaryModule``.  Underneath, a :class:`~raptor_llamaindex.RaptorIndex` builds the tree.

How the pack's arguments map (``docs/migrating-from-the-pack.md`` has the full table):

* ``mode="collapsed"`` is the ``"collapsed"`` strategy and ``mode="tree_traversal"`` the
  ``"traversal"`` strategy selecting ``similarity_top_k`` nodes per layer; both return at
  most ``similarity_top_k`` nodes and, like the pack, have no token budget;
* ``tree_depth`` is ``max_layers``, ``summary_module`` (or ``llm``) writes the summaries,
  ``transformations`` decide the leaves (:mod:`raptor_llamaindex.ingestion`);
* ``vector_store`` is ``storage_context=StorageContext.from_defaults(vector_store=...)``:
  every layer of the tree goes into the user's vector store; other keywords are
  ``RaptorIndex`` / ``TreeBuilder`` parameters (``random_state``, ``cluster_max_tokens``, ...).

Differences on purpose: without ``transformations`` documents are split into the paper's
100-token chunks (the pack used ``Settings.transformations``, 1,024-token chunks); without
``llm`` or ``embed_model`` the offline defaults apply unless ``Settings`` names models (the
pack fell back to OpenAI); nothing is printed (``verbose`` is LlamaIndex's flag, progress
goes to ``logging``); and no ``asyncio.run`` is called, so it works in Jupyter and servers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from enum import Enum
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.base.llms.base import BaseLLM
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.schema import NodeWithScore, QueryBundle

from raptor_core.exceptions import InvalidParameterError
from raptor_core.types import DEFAULT_SUMMARY_PROMPT, Summarizer
from raptor_llamaindex.index import RaptorIndex
from raptor_llamaindex.ingestion import arun_ingestion
from raptor_llamaindex.models import LlamaIndexSummarizer
from raptor_llamaindex.retriever import RaptorRetriever as TreeRetriever

__all__ = ["QueryModes", "RaptorPack", "RaptorRetriever", "SummaryModule"]


class QueryModes(str, Enum):
    """The pack's retrieval modes."""

    tree_traversal = "tree_traversal"
    collapsed = "collapsed"


#: Pack mode -> raptor_core strategy.
_STRATEGIES = {"collapsed": "collapsed", "tree_traversal": "traversal"}
#: Keywords the pack forwarded to LlamaIndex's ``BaseRetriever``.
_BASE_RETRIEVER_ARGS = frozenset({"objects", "object_map"})


def _strategy(mode: object) -> str:
    value = mode.value if isinstance(mode, QueryModes) else mode
    if not isinstance(value, str) or value not in _STRATEGIES:
        msg = (
            f"mode must be 'collapsed' or 'tree_traversal', got {mode!r}; for the other "
            "RAPTOR strategies use raptor_llamaindex.RaptorIndex(...).as_retriever(strategy=...)"
        )
        raise InvalidParameterError(msg)
    return _STRATEGIES[value]


class SummaryModule:
    """The pack's ``SummaryModule``: which LLM writes cluster summaries, with which prompt.

    Args:
        llm: the LlamaIndex LLM; None: ``Settings.llm`` if configured, else the offline
            extractive summariser.
        summary_prompt: the instruction; a ``{context}`` placeholder marks where the
            cluster's texts go, else they are appended after it.
        num_workers: summaries requested at once (``max_concurrency``).
    """

    def __init__(
        self,
        llm: BaseLLM | None = None,
        summary_prompt: str = DEFAULT_SUMMARY_PROMPT,
        num_workers: int = 4,
    ) -> None:
        self.llm = llm
        self.summary_prompt = summary_prompt
        self.num_workers = num_workers

    def __repr__(self) -> str:
        return f"SummaryModule(llm={type(self.llm).__name__}, num_workers={self.num_workers!r})"

    def summarizer(self) -> Summarizer | None:
        """The core summariser (None: let ``RaptorIndex`` pick the default)."""
        if self.llm is None:
            return None
        prompt = self.summary_prompt
        if "{context}" not in prompt:
            # The pack sent its prompt as the question of a tree_summarize over the texts.
            prompt = f"{prompt}\n\n{{context}}"
        return LlamaIndexSummarizer(self.llm, prompt=prompt)


class RaptorRetriever(BaseRetriever):
    """The pack's ``RaptorRetriever``, backed by :class:`raptor_llamaindex.RaptorIndex`.

    Setup:
        ``pip install 'raptor-retriever[llamaindex]'``, then replace
        ``from llama_index.packs.raptor import RaptorRetriever`` with
        ``from raptor_llamaindex.pack import RaptorRetriever``.

    Key init args:
        documents: LlamaIndex documents or nodes (``[]`` with ``existing_index``).
        tree_depth: summary layers above the leaves (``max_layers``).
        similarity_top_k: nodes returned (and selected per layer in ``tree_traversal``).
        llm / embed_model: the models (see the module docs for the defaults).
        vector_store: a LlamaIndex vector store that receives every layer of the tree.
        transformations: node parsers / extractors; their nodes are the leaves.
        summary_module: a :class:`SummaryModule` (prompt, concurrency).
        existing_index: a :class:`RaptorIndex` to search instead of building one.
        mode: ``"collapsed"`` (default) or ``"tree_traversal"``.
        **kwargs: ``callback_manager``, ``verbose``, and ``RaptorIndex`` / ``TreeBuilder``
            parameters such as ``random_state``.

    Instantiate:
        .. code-block:: python

            from llama_index.core import Document
            from raptor_core.testing import FakeEmbedder
            from raptor_llamaindex.pack import RaptorRetriever

            docs = [Document(text="Bees dance to share where flowers are. " * 20)]
            retriever = RaptorRetriever(docs, embed_model=FakeEmbedder(), random_state=0)

    Usage:
        .. code-block:: python

            nodes = retriever.retrieve("Why do bees dance?", mode="tree_traversal")

    Use within a query engine:
        .. code-block:: python

            from llama_index.core.llms import MockLLM
            from llama_index.core.query_engine import RetrieverQueryEngine

            engine = RetrieverQueryEngine.from_args(retriever, llm=MockLLM())
    """

    def __init__(
        self,
        documents: Sequence[Any],
        tree_depth: int = 3,
        similarity_top_k: int = 2,
        llm: BaseLLM | None = None,
        embed_model: BaseEmbedding | Any | None = None,
        vector_store: Any | None = None,
        transformations: Any | None = None,
        summary_module: SummaryModule | None = None,
        existing_index: RaptorIndex | None = None,
        mode: QueryModes | str = "collapsed",
        *,
        callback_manager: CallbackManager | None = None,
        verbose: bool = False,
        **kwargs: Any,
    ) -> None:
        _strategy(mode)  # fail now, not at the first query
        self.mode = mode.value if isinstance(mode, QueryModes) else mode
        self.tree_depth = tree_depth
        self.similarity_top_k = similarity_top_k
        self.summary_module = summary_module or SummaryModule(llm=llm)
        self._transformations = transformations
        base_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in _BASE_RETRIEVER_ARGS}
        if existing_index is not None:
            if not isinstance(existing_index, RaptorIndex):
                msg = (
                    f"existing_index must be a raptor_llamaindex RaptorIndex, got "
                    f"{type(existing_index).__name__}; a pack-built VectorStoreIndex cannot be "
                    "reused: rebuild from the documents"
                )
                raise InvalidParameterError(msg)
            self.index = existing_index
            if documents:
                self.index.insert_nodes(self._ingest(documents))
        else:
            self.index = self._new_index(
                documents, llm=llm, embed_model=embed_model, vector_store=vector_store, **kwargs
            )
        self._retrievers: dict[str, TreeRetriever] = {}
        super().__init__(callback_manager=callback_manager, verbose=verbose, **base_kwargs)

    def _build_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"max_layers": self.tree_depth, **kwargs}
        summarizer = self.summary_module.summarizer()
        if summarizer is not None:
            out.setdefault("summarizer", summarizer)
            out.setdefault("max_concurrency", self.summary_module.num_workers)
        return out

    def _new_index(
        self,
        documents: Sequence[Any],
        *,
        llm: BaseLLM | None,
        embed_model: Any,
        vector_store: Any,
        **kwargs: Any,
    ) -> RaptorIndex:
        build = self._build_kwargs(kwargs)
        if vector_store is not None:
            if not documents:
                # The pack re-connected with the store alone; our index struct (retrieval
                # defaults, documents for updates) is in the index store, not the vector store.
                msg = (
                    "re-connecting to a vector store also needs the index's persist "
                    "directory (the tree's structure is kept there, not in the store): after "
                    "building, call retriever.persist(persist_dir); later use "
                    "RaptorRetriever.from_persist_dir(persist_dir, embed_model=..., "
                    "vector_store=vector_store)"
                )
                raise InvalidParameterError(msg)
            from llama_index.core import StorageContext

            build["storage_context"] = StorageContext.from_defaults(vector_store=vector_store)
        return RaptorIndex.from_documents(
            list(documents),
            embed_model=embed_model,
            llm=llm or self.summary_module.llm,
            transformations=self._transformations,
            **build,
        )

    def _ingest(self, documents: Sequence[Any]) -> list[Any]:
        from raptor_llamaindex.ingestion import run_ingestion

        return run_ingestion(documents, self._transformations)

    # -- retrieval -----------------------------------------------------------------------------
    def _retriever(self, mode: QueryModes | str | None) -> TreeRetriever:
        strategy = _strategy(mode or self.mode)
        retriever = self._retrievers.get(strategy)
        if retriever is None:
            params: dict[str, Any] = {
                "strategy": strategy,
                "similarity_top_k": self.similarity_top_k,
                "max_tokens": None,  # the pack returned top-k nodes, with no token budget
                "callback_manager": self.callback_manager,
            }
            if strategy == "traversal":
                params["top_k"] = self.similarity_top_k
            retriever = self._retrievers[strategy] = self.index.as_retriever(**params)
        return retriever

    def retrieve(
        self, str_or_query_bundle: str | QueryBundle, mode: QueryModes | str | None = None
    ) -> list[NodeWithScore]:
        """Retrieve with ``mode`` (default: the constructor's), as the pack did."""
        return self._retriever(mode).retrieve(str_or_query_bundle)

    async def aretrieve(
        self, str_or_query_bundle: str | QueryBundle, mode: QueryModes | str | None = None
    ) -> list[NodeWithScore]:
        """Async :meth:`retrieve` (no ``asyncio.run``: safe inside a running loop)."""
        return await self._retriever(mode).aretrieve(str_or_query_bundle)

    async def collapsed_retrieval(self, query_str: str) -> list[NodeWithScore]:
        """The pack's ``collapsed_retrieval``: ``aretrieve(query_str, mode="collapsed")``."""
        return await self.aretrieve(query_str, mode="collapsed")

    async def tree_traversal_retrieval(self, query_str: str) -> list[NodeWithScore]:
        """The pack's ``tree_traversal_retrieval``: ``aretrieve(..., mode="tree_traversal")``."""
        return await self.aretrieve(query_str, mode="tree_traversal")

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return self._retriever(None)._retrieve(query_bundle)

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return await self._retriever(None)._aretrieve(query_bundle)

    # -- updates and persistence ---------------------------------------------------------------
    async def insert(self, documents: Sequence[Any]) -> None:
        """Add documents (through ``transformations``) with one incremental tree update."""
        nodes = await arun_ingestion(documents, self._transformations)
        await self.index.ainsert_nodes(nodes)

    def persist(self, persist_dir: str | os.PathLike[str]) -> None:
        """Save the index through its ``storage_context``, as the pack did."""
        self.index.storage_context.persist(persist_dir=os.fspath(persist_dir))

    @classmethod
    def from_persist_dir(
        cls,
        persist_dir: str | os.PathLike[str],
        embed_model: BaseEmbedding | Any | None = None,
        **kwargs: Any,
    ) -> RaptorRetriever:
        """Load a retriever saved by :meth:`persist`; ``kwargs`` as for the constructor.

        ``vector_store=`` reopens an index whose nodes live in that store (the store is
        passed again, as LlamaIndex's ``StorageContext.from_defaults`` expects).
        """
        from llama_index.core import StorageContext, load_index_from_storage

        vector_store = kwargs.pop("vector_store", None)
        llm = kwargs.get("llm")
        storage_context = StorageContext.from_defaults(
            persist_dir=os.fspath(persist_dir), vector_store=vector_store
        )
        index = load_index_from_storage(storage_context, embed_model=embed_model, llm=llm)
        if not isinstance(index, RaptorIndex):
            msg = f"{persist_dir} holds a {type(index).__name__}, not a RaptorIndex"
            raise InvalidParameterError(msg)
        return cls([], existing_index=index, **kwargs)


class RaptorPack:
    """The pack's ``RaptorPack``: builds a :class:`RaptorRetriever` and runs queries on it.

    ``RaptorPack(documents, llm=..., embed_model=...)`` then ``pack.run(query, mode=...)``;
    ``pack.retriever`` and ``pack.get_modules()`` as in the pack.  Arguments as for
    :class:`RaptorRetriever` (``verbose`` defaults to True, as in the pack, and prints
    nothing).
    """

    def __init__(
        self,
        documents: Sequence[Any],
        llm: BaseLLM | None = None,
        embed_model: BaseEmbedding | Any | None = None,
        vector_store: Any | None = None,
        similarity_top_k: int = 2,
        mode: QueryModes | str = "collapsed",
        verbose: bool = True,
        **kwargs: Any,
    ) -> None:
        self.retriever = RaptorRetriever(
            documents,
            embed_model=embed_model,
            llm=llm,
            similarity_top_k=similarity_top_k,
            vector_store=vector_store,
            mode=mode,
            verbose=verbose,
            **kwargs,
        )

    def get_modules(self) -> dict[str, Any]:
        """The pack's modules: ``{"retriever": ...}``."""
        return {"retriever": self.retriever}

    def run(self, query: str, mode: QueryModes | str | None = None) -> list[NodeWithScore]:
        """Retrieve nodes for ``query`` (``retriever.retrieve(query, mode=mode)``)."""
        return self.retriever.retrieve(query, mode=mode)
