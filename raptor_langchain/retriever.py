"""``RaptorRetriever``: a RAPTOR tree as a LangChain ``BaseRetriever``."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable
from pydantic import Field, InstanceOf, PrivateAttr, field_validator

from raptor_core.builder import TreeBuilder
from raptor_core.exceptions import InvalidParameterError
from raptor_core.retrieval import Hit, TreeRetriever
from raptor_core.strategies import STRATEGIES, make_retriever
from raptor_core.tree import Tree
from raptor_core.types import LLM, Embedder
from raptor_core.types import Document as CoreDocument
from raptor_langchain.models import LangChainEmbedder, LangChainLLM, RaptorEmbeddings

if TYPE_CHECKING:
    from langchain_core.callbacks import (
        AsyncCallbackManagerForRetrieverRun,
        CallbackManagerForRetrieverRun,
    )

__all__ = ["RaptorRetriever", "hit_to_document"]

logger = logging.getLogger(__name__)

#: Per-call keywords LangChain itself may forward to ``_get_relevant_documents``.
_RUNTIME_KWARGS = frozenset({"verbose"})


def hit_to_document(hit: Hit) -> Document:
    """Turn a core :class:`~raptor_core.retrieval.Hit` into a LangChain ``Document``.

    The document's ``id`` is the node id.  Its metadata is the source document's metadata
    (leaves only) plus ``score`` and ``raptor_*`` keys; the prefix keeps them from
    overwriting user keys such as ``source``:

    ``score``            similarity to the query (the strategy's score)
    ``raptor_layer``     0 for a leaf chunk, 1+ for summaries
    ``raptor_doc_id``    the leaf's source document id (None for summaries)
    ``raptor_span``      ``[start, end]`` character offsets of the leaf in its document
    ``raptor_doc_ids``   the documents the node covers
    ``raptor_children``  ids of the nodes a summary summarises (empty for leaves)
    ``raptor_strategy``  the strategy that selected the node
    ``raptor_path``      ids of the selected nodes leading to this one
    ``raptor_reason``    why an LLM-guided search chose it (only when given)
    ``raptor_evidence``  ``[chunk id, score]`` pairs behind a value-based score (only when given)
    """
    node = hit.node
    metadata: dict[str, Any] = dict(node.metadata)
    metadata.update(
        score=hit.score,
        raptor_layer=node.layer,
        raptor_doc_id=node.doc_id,
        raptor_span=list(node.span) if node.span is not None else None,
        raptor_doc_ids=list(node.doc_ids),
        raptor_children=list(node.children),
        raptor_strategy=hit.source,
        raptor_path=list(hit.path),
    )
    if hit.reason is not None:
        metadata["raptor_reason"] = hit.reason
    if hit.evidence:
        metadata["raptor_evidence"] = [[chunk, score] for chunk, score in hit.evidence]
    return Document(page_content=node.text, metadata=metadata, id=node.id)


def _core_embedder(embeddings: Embeddings | Embedder) -> Embedder:
    if isinstance(embeddings, RaptorEmbeddings):
        # Unwrap: the tree then records the core model and reloads without being told.
        return embeddings.embedder
    if isinstance(embeddings, Embeddings):
        return LangChainEmbedder(embeddings)
    return embeddings


def _core_llm(llm: Runnable[Any, Any] | LLM) -> LLM:
    if isinstance(llm, Runnable):
        return LangChainLLM(llm)
    return llm


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return all(x is y for x, y in zip(a[:3], b[:3], strict=True)) and a[3:] == b[3:]


def _default_embedder() -> Embedder:
    from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder

    return SentenceTransformerEmbedder()


class RaptorRetriever(BaseRetriever):
    r"""RAPTOR retriever: searches a tree of chunks and recursive summaries.

    Leaves are chunks of your documents; each layer above holds summaries of clusters of
    the layer below (RAPTOR, Sarthi et al., ICLR 2024).  A question about one detail
    matches a leaf; a question about a theme matches a summary.  Drop it in wherever a
    ``vectorstore.as_retriever()`` goes.

    Setup:
        Install ``raptor-retriever`` with the LangChain extra.  The default embedding
        model (all-MiniLM-L6-v2) ships with the package and runs offline.

        ```bash
        pip install -U "raptor-retriever[langchain]"
        ```

    Key init args:
        tree: raptor_core.Tree
            The tree to search (see the ``from_documents`` / ``from_tree`` constructors).
        embeddings: Embeddings | raptor_core.Embedder | None
            Embeds queries; must be the model the tree was built with.  None: re-create
            the raptor_core embedder recorded in the tree.
        k: int
            Number of documents to return (default 4); ``invoke(q, k=...)`` overrides it.
        strategy: str
            One of ``"collapsed"`` (default, the paper's best), ``"traversal"``,
            ``"value"``, ``"llm"``, ``"hybrid"``.
        llm: BaseChatModel | BaseLLM | raptor_core.LLM | None
            The model for the ``"llm"`` strategy.
        max_tokens: int | None
            Token budget for the returned documents; None: ``k`` alone bounds them.
        search_kwargs: dict
            Extra strategy parameters (e.g. ``{"layers": [0]}``); per-call keywords
            override them.

    Instantiate:
        ```python
        from langchain_core.documents import Document
        from raptor_langchain import RaptorRetriever

        docs = [Document(page_content=text, metadata={"source": name}) for name, text in pages]
        retriever = RaptorRetriever.from_documents(docs, embeddings=embeddings, llm=llm, k=4)
        retriever.save("raptor-tree")  # later: RaptorRetriever.from_tree("raptor-tree", ...)
        ```

    Usage:
        ```python
        query = "How do the main themes of the report connect?"

        retriever.invoke(query)
        retriever.invoke(query, k=2)
        ```

        ```none
        [Document(id='L1.0', metadata={'score': 0.71, 'raptor_layer': 1, ...},
                  page_content='The report covers ...'), ...]
        ```

    Use within a chain:
        ```python
        from langchain_core.output_parsers import StrOutputParser
        from langchain_core.prompts import ChatPromptTemplate
        from langchain_core.runnables import RunnablePassthrough

        prompt = ChatPromptTemplate.from_template(
            '''Answer the question based only on the context provided.

        Context: {context}

        Question: {question}'''
        )


        def format_docs(docs):
            return "\n\n".join(doc.page_content for doc in docs)


        chain = (
            {"context": retriever | format_docs, "question": RunnablePassthrough()}
            | prompt
            | llm
            | StrOutputParser()
        )

        chain.invoke("How do the main themes of the report connect?")
        ```
    """

    tree: InstanceOf[Tree]
    """The RAPTOR tree to search."""
    embeddings: Embeddings | Embedder | None = None
    """Query embedding model: the one the tree was built with (None: recorded in the tree)."""
    k: int = Field(default=4, ge=1)
    """Number of documents to return."""
    strategy: str = "collapsed"
    """Retrieval strategy; see ``raptor_core.strategies.STRATEGIES``."""
    llm: Runnable[Any, Any] | LLM | None = None
    """Model for the ``"llm"`` strategy (a LangChain chat model or LLM, or a core LLM)."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Token budget for the returned documents; None: no budget."""
    search_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword parameters of the strategy."""

    _cache: tuple[tuple[Any, ...], TreeRetriever] | None = PrivateAttr(default=None)
    _embedder_cache: tuple[Any, Embedder] | None = PrivateAttr(default=None)

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        if value not in STRATEGIES:
            msg = f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {value!r}"
            raise ValueError(msg)
        return value

    # -- resolution ----------------------------------------------------------------------------
    def _embedder(self) -> Embedder:
        # Keyed on the object itself (not its id): fields may be reassigned after construction.
        source = self.embeddings if self.embeddings is not None else self.tree
        cached = self._embedder_cache
        if cached is not None and cached[0] is source:
            return cached[1]
        if self.embeddings is not None:
            embedder = _core_embedder(self.embeddings)
        else:
            embedder = self._recorded_embedder(self.tree)
        self._embedder_cache = (source, embedder)
        return embedder

    @staticmethod
    def _recorded_embedder(tree: Tree) -> Embedder:
        from raptor_core.resolve import from_description

        description = tree.params.get("embedder")
        if not isinstance(description, Mapping):
            msg = (
                "the tree does not record its embedder: pass embeddings= (the model that built it)"
            )
            raise InvalidParameterError(msg)
        try:
            embedder: Embedder = from_description(description)
        except InvalidParameterError as exc:
            msg = (
                f"cannot re-create the embedder this tree was built with "
                f"({description.get('class')}): pass embeddings= (the same model). {exc}"
            )
            raise InvalidParameterError(msg) from exc
        return embedder

    def _core(self, overrides: Mapping[str, Any]) -> TreeRetriever:
        """The core retriever; the one without per-call overrides is cached until fields change."""
        # Objects compared by identity, settings by value: fields may be reassigned.
        key = (
            self.tree,
            self.embeddings,
            self.llm,
            self.strategy,
            self.k,
            self.max_tokens,
            repr(self.search_kwargs),
        )
        cached = self._cache
        if not overrides and cached is not None and _same(cached[0], key):
            return cached[1]
        params = {**self.search_kwargs, **overrides}
        llm = _core_llm(self.llm) if self.llm is not None else None
        # Unknown parameters raise InvalidParameterError listing the accepted ones.
        retriever = make_retriever(
            self.strategy,
            self.tree,
            self._embedder(),
            llm=llm,
            k=self.k,
            max_tokens=self.max_tokens,
            **params,
        )
        if not overrides:
            self._cache = (key, retriever)
        return retriever

    def _split_kwargs(self, kwargs: Mapping[str, Any]) -> tuple[int, int | None, dict[str, Any]]:
        overrides = {k: v for k, v in kwargs.items() if k not in _RUNTIME_KWARGS}
        k = overrides.pop("k", self.k)
        max_tokens = overrides.pop("max_tokens", None)
        return k, max_tokens, overrides

    # -- BaseRetriever -------------------------------------------------------------------------
    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        k, max_tokens, overrides = self._split_kwargs(kwargs)
        hits = self._core(overrides).retrieve(query, k=k, max_tokens=max_tokens)
        return [hit_to_document(hit) for hit in hits]

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        k, max_tokens, overrides = self._split_kwargs(kwargs)
        hits = await self._core(overrides).aretrieve(query, k=k, max_tokens=max_tokens)
        return [hit_to_document(hit) for hit in hits]

    # -- constructors --------------------------------------------------------------------------
    @staticmethod
    def _builder(
        embeddings: Embeddings | Embedder | None,
        llm: Runnable[Any, Any] | LLM | None,
        build_options: dict[str, Any],
    ) -> TreeBuilder:
        embedder = _core_embedder(embeddings) if embeddings is not None else _default_embedder()
        summarizer = build_options.pop("summarizer", None)
        if summarizer is None and llm is not None:
            from raptor_core.summarizers import LLMSummarizer

            summarizer = LLMSummarizer(_core_llm(llm))
        # summarizer None: TreeBuilder's offline extractive default.
        return TreeBuilder(embedder, summarizer, **build_options)

    @staticmethod
    def _core_documents(documents: Iterable[Document]) -> list[CoreDocument]:
        out = []
        for i, doc in enumerate(documents):
            if not isinstance(doc, Document):
                msg = f"document #{i} must be a langchain_core Document, got {type(doc).__name__}"
                raise InvalidParameterError(msg)
            doc_id = doc.id if doc.id else f"doc-{i}"
            out.append(
                CoreDocument(text=doc.page_content, doc_id=doc_id, metadata=dict(doc.metadata))
            )
        return out

    @classmethod
    def from_documents(
        cls,
        documents: Iterable[Document],
        embeddings: Embeddings | Embedder | None = None,
        llm: Runnable[Any, Any] | LLM | None = None,
        *,
        k: int = 4,
        strategy: str = "collapsed",
        max_tokens: int | None = None,
        search_kwargs: dict[str, Any] | None = None,
        **build_options: Any,
    ) -> RaptorRetriever:
        """Build a tree over LangChain documents and return a retriever over it.

        Args:
            documents: the documents; ``Document.id`` (or ``doc-<i>``) becomes the document
                id, and their metadata is copied onto every chunk.
            embeddings: a LangChain ``Embeddings`` or a raptor_core ``Embedder``; None: the
                packaged offline all-MiniLM-L6-v2.
            llm: a LangChain chat model or LLM (or a core ``LLM``) that writes the summaries
                and serves the ``"llm"`` strategy; None: offline extractive summaries.
            k: number of documents to return.
            strategy: retrieval strategy.
            max_tokens: token budget for the returned documents.
            search_kwargs: extra strategy parameters.
            **build_options: passed to :class:`raptor_core.TreeBuilder` (``chunk_max_tokens``,
                ``max_layers``, ``random_state``, ``summarizer``, ...).

        Raises:
            InvalidInputError: no documents, or an empty or duplicate one.
            EmbeddingError, SummarizationError, LLMError: a model failed.
        """
        builder = cls._builder(embeddings, llm, build_options)
        tree = builder.build(cls._core_documents(documents))
        return cls._over(tree, builder, embeddings, llm, k, strategy, max_tokens, search_kwargs)

    @classmethod
    async def afrom_documents(
        cls,
        documents: Iterable[Document],
        embeddings: Embeddings | Embedder | None = None,
        llm: Runnable[Any, Any] | LLM | None = None,
        *,
        k: int = 4,
        strategy: str = "collapsed",
        max_tokens: int | None = None,
        search_kwargs: dict[str, Any] | None = None,
        **build_options: Any,
    ) -> RaptorRetriever:
        """Async :meth:`from_documents`: summaries and embeddings use the models' async APIs."""
        builder = cls._builder(embeddings, llm, build_options)
        tree = await builder.abuild(cls._core_documents(documents))
        return cls._over(tree, builder, embeddings, llm, k, strategy, max_tokens, search_kwargs)

    @classmethod
    def _over(
        cls,
        tree: Tree,
        builder: TreeBuilder,
        embeddings: Embeddings | Embedder | None,
        llm: Runnable[Any, Any] | LLM | None,
        k: int,
        strategy: str,
        max_tokens: int | None,
        search_kwargs: dict[str, Any] | None,
    ) -> RaptorRetriever:
        return cls(
            tree=tree,
            # Query with the very embedder the tree was built with.
            embeddings=embeddings if embeddings is not None else builder.embedder,
            llm=llm,
            k=k,
            strategy=strategy,
            max_tokens=max_tokens,
            search_kwargs=dict(search_kwargs or {}),
        )

    @staticmethod
    def _texts_as_documents(
        texts: Iterable[str],
        metadatas: Sequence[Mapping[str, Any]] | None,
        ids: Sequence[str] | None,
    ) -> list[Document]:
        texts = list(texts)
        for name, given in (("metadatas", metadatas), ("ids", ids)):
            if given is not None and len(given) != len(texts):
                msg = f"{name} has {len(given)} entries for {len(texts)} texts"
                raise InvalidParameterError(msg)
        return [
            Document(
                page_content=text,
                metadata=dict(metadatas[i]) if metadatas is not None else {},
                id=ids[i] if ids is not None else None,
            )
            for i, text in enumerate(texts)
        ]

    @classmethod
    def from_texts(
        cls,
        texts: Iterable[str],
        embeddings: Embeddings | Embedder | None = None,
        llm: Runnable[Any, Any] | LLM | None = None,
        metadatas: Sequence[Mapping[str, Any]] | None = None,
        *,
        ids: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> RaptorRetriever:
        """Like :meth:`from_documents`, from plain strings with optional metadata and ids."""
        docs = cls._texts_as_documents(texts, metadatas, ids)
        return cls.from_documents(docs, embeddings, llm, **kwargs)

    @classmethod
    async def afrom_texts(
        cls,
        texts: Iterable[str],
        embeddings: Embeddings | Embedder | None = None,
        llm: Runnable[Any, Any] | LLM | None = None,
        metadatas: Sequence[Mapping[str, Any]] | None = None,
        *,
        ids: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> RaptorRetriever:
        """Async :meth:`from_texts`."""
        docs = cls._texts_as_documents(texts, metadatas, ids)
        return await cls.afrom_documents(docs, embeddings, llm, **kwargs)

    @classmethod
    def from_tree(
        cls,
        path: str | os.PathLike[str],
        embeddings: Embeddings | Embedder | None = None,
        llm: Runnable[Any, Any] | LLM | None = None,
        *,
        mmap: bool = False,
        **kwargs: Any,
    ) -> RaptorRetriever:
        """Load a tree saved with :meth:`save` (or ``raptor build``) and retrieve over it.

        Args:
            path: the tree directory.
            embeddings: the model the tree was built with; None re-creates the raptor_core
                embedder recorded in the tree (a LangChain model must be passed again).
            llm: model for the ``"llm"`` strategy.
            mmap: memory-map the embedding matrix instead of reading it.
            **kwargs: other fields (``k``, ``strategy``, ``max_tokens``, ``search_kwargs``, ...).

        Raises:
            TreeFormatError: no tree at ``path``, or a damaged one.
            InvalidParameterError: ``embeddings`` is None and the tree's embedder cannot be
                re-created.
        """
        tree = Tree.load(path, mmap=mmap)
        retriever = cls(tree=tree, embeddings=embeddings, llm=llm, **kwargs)
        retriever._embedder()  # fail now, not at the first query, if the model is unknown
        return retriever

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Save the tree to directory ``path`` (plain JSON + ``.npy``, written atomically)."""
        return self.tree.save(path)
