"""``RaptorRetriever``: a RAPTOR tree as a LangChain ``BaseRetriever``."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable
from langchain_core.runnables.config import run_in_executor
from langchain_core.vectorstores import VectorStore
from pydantic import (
    Field,
    InstanceOf,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from raptor_core._async import UpdateLock
from raptor_core.build.builder import TreeBuilder
from raptor_core.build.rejoin import MAX_GAP, join_pages, rejoin_splits, split_start
from raptor_core.components import check_embedder, embedder_for_tree
from raptor_core.exceptions import InvalidParameterError, RaptorError
from raptor_core.retrieval import Hit, TreeRetriever
from raptor_core.retrieval.registry import (
    DEFAULT_STRATEGY,
    STRATEGIES,
    accepted_params,
    make_retriever,
)
from raptor_core.tree import Tree
from raptor_core.types import LLM, Embedder, NodeStore
from raptor_core.types import Document as CoreDocument
from raptor_langchain.dialects import StoreDialect
from raptor_langchain.models import (
    LangChainEmbedder,
    LangChainLLM,
    RaptorEmbeddings,
    traced_llm,
)
from raptor_langchain.store import MANIFEST_ID, LangChainNodeStore

if TYPE_CHECKING:
    from langchain_core.callbacks import (
        AsyncCallbackManagerForRetrieverRun,
        CallbackManagerForRetrieverRun,
    )

__all__ = [
    "SEARCH_METADATA_KEYS",
    "SEARCH_TYPES",
    "START_INDEX_KEY",
    "RaptorRetriever",
    "hit_to_document",
    "rejoin_documents",
]

logger = logging.getLogger(__name__)

#: Per-call keywords LangChain itself may forward to ``_get_relevant_documents``.
_RUNTIME_KWARGS = frozenset({"verbose"})
#: ``search_type`` values of ``VectorStore.as_retriever``, as RAPTOR runs them: similarity
#: is the retriever's ``strategy`` (passages by default), mmr the core MMR strategy,
#: and similarity_score_threshold the strategy with hits below ``score_threshold`` dropped.
SEARCH_TYPES = ("similarity", "mmr", "similarity_score_threshold")
#: ``search_kwargs`` keys of ``VectorStore.as_retriever`` that are not strategy parameters.
_LANGCHAIN_KEYS = frozenset({"filter", "score_threshold"})
_NEEDS_LLM = frozenset({"llm", "hybrid"})
#: The metadata key LangChain's text splitters write with ``add_start_index=True``: where
#: the split starts in the document it was cut from.
START_INDEX_KEY = "start_index"


@dataclass(frozen=True, slots=True)
class _Plan:
    """One search, resolved: strategy, its parameters, and what is applied after it."""

    strategy: str
    params: dict[str, Any]
    k: int
    max_tokens: int | None
    score_threshold: float | None


#: One update lock per vector store object, shared by every retriever over it in this
#: process (two ``from_vectorstore`` calls on one store, a retriever per request in a web
#: app): each update reads the stored tree and writes back its own change, so two of them
#: at once through different retrievers would lose one.  Weak keys: the lock goes with the
#: store.
_STORE_LOCKS: weakref.WeakKeyDictionary[Any, UpdateLock] = weakref.WeakKeyDictionary()
_STORE_LOCKS_GUARD = threading.Lock()


def _store_lock(vectorstore: object) -> UpdateLock | None:
    """The update lock of ``vectorstore`` (None: it cannot be weakly referenced or hashed)."""
    with _STORE_LOCKS_GUARD:
        try:
            lock = _STORE_LOCKS.get(vectorstore)
            if lock is None:
                lock = _STORE_LOCKS[vectorstore] = UpdateLock()
        except TypeError:
            return None
        return lock


def _check_threshold(value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0.0 <= float(value) <= 1.0
    ):
        msg = (
            "search_type='similarity_score_threshold' needs search_kwargs['score_threshold'], "
            f"a number in [0, 1] compared with each document's score; got {value!r}"
        )
        raise InvalidParameterError(msg)
    return float(value)


#: The metadata keys that describe one search rather than the node it found: the same node
#: found by two queries differs only in these (see ``RaptorRetriever.search_metadata``).
SEARCH_METADATA_KEYS = frozenset(
    {"score", "raptor_strategy", "raptor_path", "raptor_reason", "raptor_evidence"}
)


def hit_to_document(hit: Hit, *, search_metadata: bool = True) -> Document:
    """Turn a core :class:`~raptor_core.retrieval.Hit` into a LangChain ``Document``.

    The document's ``id`` is the node id (for a passage that joins several leaves, the
    passage's id).  Its metadata is the source document's metadata (leaves only) plus
    ``score`` and ``raptor_*`` keys; the prefix keeps them from overwriting user keys such
    as ``source``.  ``search_metadata=False`` leaves out the keys that describe the search
    (``SEARCH_METADATA_KEYS``: ``score``, ``raptor_strategy``, ``raptor_path``,
    ``raptor_reason``, ``raptor_evidence``), so that the same node found by two queries
    gives equal documents, which wrappers that deduplicate by equality need:

    ``score``            similarity to the query (the strategy's score)
    ``raptor_layer``     0 for a leaf chunk, 1+ for summaries
    ``raptor_doc_id``    the leaf's source document id (None for summaries)
    ``raptor_span``      ``[start, end]`` character offsets of the leaf in its document
    ``raptor_doc_ids``   the documents the node covers
    ``raptor_children``  ids of the nodes a summary summarises (empty for leaves)
    ``raptor_strategy``  the strategy that selected the node
    ``raptor_path``      ids of the selected nodes leading to this one
    ``raptor_reason``    why an LLM-guided search chose it (only when given)
    ``raptor_evidence``  ``[chunk id, score]`` pairs behind the score (only when given)
    ``raptor_leaves``    the leaf ids a ``"passage"`` hit joins (only for joined passages)
    """
    node = hit.node
    # What describes this search, apart: left out whole with search_metadata=False, so a
    # node's own keys (a document's "score" included) are never dropped with it.
    search: dict[str, Any] = {
        "score": hit.score,
        "raptor_strategy": hit.source,
        "raptor_path": list(hit.path),
    }
    if hit.reason is not None:
        search["raptor_reason"] = hit.reason
    if hit.evidence:
        search["raptor_evidence"] = [[chunk, score] for chunk, score in hit.evidence]
    metadata: dict[str, Any] = dict(node.metadata)
    metadata.update(
        raptor_layer=node.layer,
        raptor_doc_id=node.doc_id,
        raptor_span=list(node.span) if node.span is not None else None,
        raptor_doc_ids=list(node.doc_ids),
        raptor_children=list(node.children),
    )
    if hit.leaves:
        metadata["raptor_leaves"] = list(hit.leaves)
    if search_metadata:
        metadata.update(search)
    return Document(page_content=node.text, metadata=metadata, id=node.id)


def rejoin_documents(documents: Sequence[CoreDocument]) -> list[tuple[CoreDocument, list[int]]]:
    """Put a text splitter's splits, and a loader's pages, back into their documents.

    Splits made with ``add_start_index=True`` carry ``metadata["start_index"]``; consecutive
    splits of one source (same other metadata, advancing offsets, agreeing overlaps) become
    that source again, with the id and metadata of its first split and without the offset
    key (see :func:`raptor_core.build.rejoin.rejoin_splits`).  Then consecutive pages of one
    PDF (``PyPDFLoader`` and the other loaders number them in ``metadata["page"]``; same
    other metadata, numbers one apart), whole or joined from their splits, become one
    document whose leaves keep the page they start on (see
    :func:`raptor_core.build.rejoin.join_pages`).  Anything else, a split or page joined
    with nothing included, is returned as it was given.  Returns each resulting document
    with the indices of the given ones it holds.
    """
    plain: list[CoreDocument] = []
    starts: list[int | None] = []
    for doc in documents:
        start = split_start(doc.metadata.get(START_INDEX_KEY))
        if start is not None:
            metadata = {k: v for k, v in doc.metadata.items() if k != START_INDEX_KEY}
            doc = dataclasses.replace(doc, metadata=metadata)
        plain.append(doc)
        starts.append(start)
    # Each source as it comes back when no page joins it, the indices it holds, and what
    # page joining sees of it: a source whose first split starts deep in its page (the
    # page's start is missing) keeps its offset key there, so it joins no page before it.
    sources: list[tuple[CoreDocument, list[int], CoreDocument]] = []
    for r in rejoin_splits(plain, starts):
        first, parts = r.parts[0], list(r.parts)
        start = starts[first]
        whole = r.document if len(parts) > 1 else documents[first]
        if start is None:
            sources.append((whole, parts, whole))
        elif start <= MAX_GAP:
            sources.append((whole, parts, r.document if len(parts) > 1 else plain[first]))
        else:
            sources.append((whole, parts, documents[first]))
    out: list[tuple[CoreDocument, list[int]]] = []
    for run in join_pages([candidate for _, _, candidate in sources]):
        if len(run.parts) == 1:
            whole, parts, _ = sources[run.parts[0]]
            out.append((whole, parts))
        else:
            out.append((run.document, [i for at in run.parts for i in sources[at][1]]))
    return out


#: Documents read to tell a store RAPTOR never wrote from a build cut short.
_FOREIGN_PROBE = 1000


def _no_tree_message(vectorstore: VectorStore, store: LangChainNodeStore) -> str:
    """Why ``from_vectorstore`` refuses a store without a complete tree, and what to do."""
    name = type(vectorstore).__name__
    build = (
        "build a tree into an empty store (a new collection) with "
        "RaptorRetriever.from_documents(..., vectorstore=...)"
    )
    count = len(store)
    if store.manifest is None and count:
        # Only a store RAPTOR wrote to holds raptor_ keys: without any, this is someone
        # else's collection, not a build cut short.  (This reads the store, on the error
        # path only: up to the first document RAPTOR wrote, and at most _FOREIGN_PROBE.)
        ours = any(
            any(str(key).startswith("raptor_") for key in doc.metadata or {})
            for doc in itertools.islice(store.dialect.scan(), _FOREIGN_PROBE)
        )
        if not ours:
            return (
                f"the {name} holds {count} document(s), none of which RAPTOR wrote (no "
                f"raptor_ metadata, no {MANIFEST_ID!r} document): from_vectorstore reopens a "
                f"tree that RaptorRetriever built into a store; {build}"
            )
    state = "an incomplete" if store.manifest is not None or count else "no"
    return (
        f"the {name} holds {state} RAPTOR tree (no complete {MANIFEST_ID!r} document; an "
        f"interrupted build leaves none): {build}"
    )


def _core_embedder(embeddings: Embeddings | Embedder) -> Embedder:
    if isinstance(embeddings, RaptorEmbeddings):
        # Unwrap: the tree then records the core model and reloads without being told.
        return embeddings.embedder
    if isinstance(embeddings, Embeddings):
        return LangChainEmbedder(embeddings)
    return embeddings


def _check_llm(llm: object) -> None:
    """Refuse an ``llm`` that is no model, before a build pays for any embedding.

    ``VectorStore.from_texts`` takes ``metadatas`` third, where ``from_texts`` here takes
    ``llm``: without this check such a call embeds every chunk and only then fails, in the
    first summary or in the retriever's construction.

    Raises:
        InvalidParameterError: ``llm`` is neither a LangChain model (a ``Runnable``) nor a
            raptor_core ``LLM`` (an object with ``complete``).
    """
    if llm is None or isinstance(llm, Runnable | LLM):
        return
    hint = ""
    if isinstance(llm, list | tuple) and llm and all(isinstance(m, Mapping) for m in llm):
        hint = (
            "; it looks like metadatas, which go by keyword: "
            "from_texts(texts, embeddings, metadatas=[...])"
        )
    msg = (
        "llm must be a LangChain chat model or LLM (a Runnable) or a raptor_core LLM (an "
        f"object with complete(prompt)), got {type(llm).__name__} {str(llm)[:60]}{hint}"
    )
    raise InvalidParameterError(msg)


def _core_llm(llm: Runnable[Any, Any] | LLM) -> LLM:
    _check_llm(llm)
    if isinstance(llm, Runnable):
        return LangChainLLM(llm)
    return llm


def _raptor_cause(exc: ValidationError) -> RaptorError | None:
    """The error one of our validators raised, when it is all that pydantic reports.

    Pydantic wraps a ``ValueError`` raised in a validator into its ``ValidationError``; the
    documented error is ours (an ``InvalidParameterError``, a ``ValueError`` too), so it is
    raised as it was.  A report that also holds pydantic's own findings (``k=0``) stays
    whole.
    """
    causes = [(error.get("ctx") or {}).get("error") for error in exc.errors()]
    if causes and all(isinstance(cause, RaptorError) for cause in causes):
        return causes[0]
    return None


def _default_embedder() -> Embedder:
    from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder

    return SentenceTransformerEmbedder()


class RaptorRetriever(BaseRetriever):
    r"""RAPTOR retriever: searches a tree of chunks and recursive summaries.

    Leaves are chunks of your documents; each layer above holds summaries of clusters of
    the layer below (RAPTOR, Sarthi et al., ICLR 2024).  A question about one detail
    matches a leaf; a question about a theme matches a summary.  Drop it in wherever a
    ``vectorstore.as_retriever()`` goes.  The tree lives in memory (``tree``) or in your
    own LangChain vector store (``vectorstore``: Chroma, ``InMemoryVectorStore``, ...).

    Setup:
        Install ``raptor-retriever`` with the LangChain extra.  The default embedding
        model (all-MiniLM-L6-v2) ships with the package and runs offline.

        ```bash
        pip install -U "raptor-retriever[langchain]"
        ```

    Key init args:
        tree: raptor_core.Tree | None
            An in-memory tree to search (see ``from_documents`` / ``from_tree``).
        vectorstore: VectorStore | None
            A LangChain vector store holding the tree (see ``from_documents(...,
            vectorstore=...)`` / ``from_vectorstore``); exactly one of the two.
        embeddings: Embeddings | raptor_core.Embedder | None
            Embeds queries; must be the model the tree was built with.  None: the vector
            store's own ``embeddings``, or the raptor_core embedder recorded in the tree.
        k: int
            Number of documents to return (default 4); ``search_kwargs={"k": ...}`` and
            ``invoke(q, k=...)`` override it.
        search_type: str
            ``"similarity"`` (default: the ``strategy``), ``"mmr"`` (maximal marginal
            relevance over the tree) or ``"similarity_score_threshold"``.
        search_kwargs: dict
            ``k``, ``filter`` (the vector store's own filter; the core filter dialect for an
            in-memory tree), ``fetch_k`` and ``lambda_mult`` (mmr), ``score_threshold``, and
            the strategy's own parameters (e.g. ``{"layers": [0]}``).
        strategy: str
            One of ``"passage"`` (default: leaf hits grown into contiguous passages),
            ``"collapsed"`` (the paper's), ``"traversal"``, ``"value"``, ``"mmr"``,
            ``"llm"``, ``"hybrid"``.
        llm: BaseChatModel | BaseLLM | raptor_core.LLM | None
            The model for the ``"llm"`` and ``"hybrid"`` strategies; its calls show as child
            runs of the retriever run.
        max_tokens: int | None
            Token budget for the returned documents; None: ``k`` alone bounds them.

    Instantiate:
        ```python
        from langchain_chroma import Chroma
        from langchain_core.documents import Document
        from raptor_langchain import RaptorRetriever

        docs = [Document(page_content=text, metadata={"source": name}) for name, text in pages]
        store = Chroma(collection_name="reports-raptor", embedding_function=embeddings)
        retriever = RaptorRetriever.from_documents(
            docs, embeddings=embeddings, llm=llm, vectorstore=store, k=4
        )
        # later, without rebuilding:
        retriever = RaptorRetriever.from_vectorstore(store, embeddings=embeddings)
        ```

    Usage:
        ```python
        query = "How do the main themes of the report connect?"

        retriever.invoke(query)
        retriever.invoke(query, k=2, filter={"source": "q3.pdf"})
        ```

        ```none
        [Document(id='L1-…', metadata={'score': 0.71, 'raptor_layer': 1, ...},
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

    tree: InstanceOf[Tree] | None = None
    """The RAPTOR tree to search, in memory (or use ``vectorstore``)."""
    vectorstore: InstanceOf[VectorStore] | None = None
    """A LangChain vector store holding the tree (or use ``tree``)."""
    embeddings: Embeddings | Embedder | None = None
    """Query embedding model: the one the tree was built with.  None: the vector store's own
    model, or, for a tree, the recorded one when it is a local sentence-transformers model by
    name (see ``docs/loading-trees.md``)."""
    k: int = Field(default=4, ge=1)
    """Number of documents to return."""
    strategy: str = DEFAULT_STRATEGY
    """Retrieval strategy; see ``raptor_core.retrieval.registry.STRATEGIES``.  On a vector
    store that cannot list its documents (a ``GenericDialect``), the default ``"passage"``
    strategy works on the leaves its search finds (``scope="found"``: no BM25)."""
    search_type: str = "similarity"
    """``"similarity"``, ``"mmr"`` or ``"similarity_score_threshold"`` (see ``SEARCH_TYPES``)."""
    llm: Runnable[Any, Any] | LLM | None = None
    """Model for the ``"llm"`` and ``"hybrid"`` strategies (a LangChain model or a core LLM)."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Token budget for the returned documents; None: no budget."""
    search_kwargs: dict[str, Any] = Field(default_factory=dict)
    """``VectorStore.as_retriever`` search keywords plus the strategy's own parameters."""
    dialect: StoreDialect | None = None
    """How to talk to ``vectorstore`` (default: chosen by its class)."""
    search_metadata: bool = True
    """Put the keys that describe the search into each document's metadata (``score``,
    ``raptor_strategy``, ``raptor_path``, ``raptor_reason``, ``raptor_evidence``).  False:
    only the node's own keys, so the same node found by two queries gives equal documents,
    as wrappers that deduplicate by ``Document`` equality (``MultiQueryRetriever``) need."""

    _embedder_cache: tuple[Any, Embedder] | None = PrivateAttr(default=None)
    _store_cache: tuple[Any, Any, Any, LangChainNodeStore] | None = PrivateAttr(default=None)
    _tree_builder: TreeBuilder | None = PrivateAttr(default=None)
    # Held by an update (add_documents, delete and their async forms) from reading the tree
    # to writing it back: two updates reading the same tree would each write back their own
    # change only, and one would be lost (UpdateLock.held for the async side).  Over a vector
    # store, the store's lock (_store_lock) is used instead, shared with other retrievers.
    _update_lock: UpdateLock = PrivateAttr(default_factory=UpdateLock)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            # Our validators' InvalidParameterError, as documented, not pydantic's wrapper.
            cause = _raptor_cause(exc)
            if cause is None:
                raise
            raise cause from None

    @field_validator("llm", mode="before")
    @classmethod
    def _a_model(cls, value: Any) -> Any:
        _check_llm(value)
        return value

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        if value not in STRATEGIES:
            msg = f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {value!r}"
            raise InvalidParameterError(msg)
        return value

    @field_validator("search_type")
    @classmethod
    def _known_search_type(cls, value: str) -> str:
        if value not in SEARCH_TYPES:
            msg = f"search_type must be one of {', '.join(map(repr, SEARCH_TYPES))}, got {value!r}"
            raise InvalidParameterError(msg)
        return value

    @model_validator(mode="after")
    def _one_source_and_known_kwargs(self) -> RaptorRetriever:
        if (self.tree is None) == (self.vectorstore is None):
            msg = (
                "pass exactly one of tree= (an in-memory raptor_core.Tree) and vectorstore= "
                "(a LangChain vector store holding a tree)"
            )
            raise InvalidParameterError(msg)
        self._plan({})  # search_type, strategy and search_kwargs agree, keys are known
        return self

    # -- resolution ----------------------------------------------------------------------------
    def _embedder(self) -> Embedder:
        # Keyed on the object itself (not its id): fields may be reassigned after construction.
        source: Any = self.embeddings
        if source is None:
            source = self.vectorstore.embeddings if self.vectorstore is not None else self.tree
        cached = self._embedder_cache
        if cached is not None and cached[0] is source:
            return cached[1]
        if self.vectorstore is None:
            assert self.tree is not None  # the validator guarantees one source
            given = _core_embedder(self.embeddings) if self.embeddings is not None else None
            # Checked against the tree's record when given; otherwise re-created only from the
            # closed allowlist of raptor_core.components (a tree file never picks code).
            embedder = embedder_for_tree(self.tree, given, pass_as="embeddings")
        elif isinstance(source, Embeddings | Embedder):
            embedder = _core_embedder(source)
            # A store's manifest is data too: it only describes the model, and what the
            # caller (or the store) supplies is checked against it, never created from it.
            store = self.store
            assert isinstance(store, LangChainNodeStore)
            check_embedder(store.shape(), embedder, pass_as="embeddings")  # type: ignore[arg-type]
        else:
            msg = (
                f"the {type(self.vectorstore).__name__} has no embedding model: pass "
                "embeddings= (the model the tree was built with)"
            )
            raise InvalidParameterError(msg)
        self._embedder_cache = (source, embedder)
        return embedder

    @property
    def store(self) -> Tree | NodeStore:
        """What the strategies search: the tree, or the vector store as a NodeStore."""
        if self.vectorstore is None:
            assert self.tree is not None  # the validator guarantees one source
            return self.tree
        key = (self.vectorstore, self.embeddings, self.dialect)
        cached = self._store_cache
        if cached is not None and all(a is b for a, b in zip(cached[:3], key, strict=True)):
            return cached[3]
        store = LangChainNodeStore(self.vectorstore, self.embeddings, dialect=self.dialect)
        self._store_cache = (*key, store)
        return store

    def _strategy(self) -> str:
        if self.search_type != "mmr":
            return self.strategy
        # search_type="mmr" names the strategy itself; only a different one set explicitly
        # (not the default) contradicts it.
        if "strategy" in self.model_fields_set and self.strategy not in ("collapsed", "mmr"):
            msg = (
                f"search_type='mmr' runs the 'mmr' strategy; it cannot be combined with "
                f"strategy={self.strategy!r} (use search_type='similarity' for that strategy)"
            )
            raise InvalidParameterError(msg)
        return "mmr"

    def _plan(self, call_kwargs: Mapping[str, Any]) -> _Plan:
        """Resolve ``search_kwargs`` and per-call keywords into one search.

        Per-call keywords override ``search_kwargs``, which override the ``k`` and
        ``max_tokens`` fields.  ``filter`` is the vector store's own filter (passed to the
        store as ``native_filter``); with an in-memory tree it is a core ``where`` filter.
        """
        strategy = self._strategy()
        merged = {**self.search_kwargs}
        merged.update((key, v) for key, v in call_kwargs.items() if key not in _RUNTIME_KWARGS)
        accepted = set(accepted_params(strategy)) | _LANGCHAIN_KEYS
        unknown = sorted(set(merged) - accepted)
        if unknown:
            hint = (
                " (fetch_k and lambda_mult need search_type='mmr')"
                if {"fetch_k", "lambda_mult"} & set(unknown)
                else ""
            )
            msg = (
                f"unknown search keyword(s) {', '.join(map(repr, unknown))} for "
                f"search_type={self.search_type!r}, strategy={strategy!r}{hint}; accepted: "
                f"{', '.join(sorted(accepted))}"
            )
            raise InvalidParameterError(msg)
        threshold = merged.pop("score_threshold", None)
        if self.search_type == "similarity_score_threshold":
            threshold = _check_threshold(threshold)
        elif threshold is not None:
            msg = (
                "score_threshold applies to search_type='similarity_score_threshold'; "
                f"this retriever's search_type is {self.search_type!r}"
            )
            raise InvalidParameterError(msg)
        user_filter = merged.pop("filter", None)
        if user_filter is not None:
            key = "where" if self.vectorstore is None else "native_filter"
            given = merged.get(key)
            if given is None:
                merged[key] = user_filter
            elif key == "where":
                merged[key] = {"$and": [given, user_filter]}
            else:
                msg = "pass the vector store's filter once: as filter= or as native_filter="
                raise InvalidParameterError(msg)
        k = merged.pop("k", self.k)
        max_tokens = merged.pop("max_tokens", self.max_tokens)
        return _Plan(strategy, merged, k, max_tokens, threshold)

    def _core(self, plan: _Plan, llm: LLM | None) -> TreeRetriever:
        # Unknown parameters raise InvalidParameterError listing the accepted ones.
        return make_retriever(
            plan.strategy,
            self.store,  # type: ignore[arg-type]
            self._embedder(),
            llm=llm,
            k=plan.k,
            max_tokens=plan.max_tokens,
            **plan.params,
        )

    def _llm(self, plan: _Plan, callbacks: Any) -> LLM | None:
        """The strategy's LLM, reporting its calls as children of this retriever run."""
        if self.llm is None or plan.strategy not in _NEEDS_LLM:
            return None
        return traced_llm(self.llm, callbacks)

    def _documents(self, plan: _Plan, hits: list[Hit]) -> list[Document]:
        if plan.score_threshold is not None:
            hits = [hit for hit in hits if hit.score >= plan.score_threshold]
        return [hit_to_document(hit, search_metadata=self.search_metadata) for hit in hits]

    # -- BaseRetriever -------------------------------------------------------------------------
    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        plan = self._plan(kwargs)
        core = self._core(plan, self._llm(plan, run_manager.get_child()))
        return self._documents(plan, core.retrieve(query))

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        plan = self._plan(kwargs)
        core = self._core(plan, self._llm(plan, run_manager.get_child()))
        if self.vectorstore is not None and plan.strategy not in _NEEDS_LLM:
            # A vector store's client blocks (HTTP, disk): keep it off the event loop.
            hits = await run_in_executor(None, core.retrieve, query)
        else:
            hits = await core.aretrieve(query)
        return self._documents(plan, hits)

    # -- incremental updates -------------------------------------------------------------------
    def add_documents(self, documents: Sequence[Document], **kwargs: Any) -> list[str]:
        """Add documents to the tree without rebuilding it; returns their document ids.

        Only the new chunks are embedded and only the clusters they join (and their
        ancestors) are re-summarised (see ``TreeBuilder.insert``).  Over a vector store,
        the new and changed nodes are upserted and the replaced ones deleted: the store is
        read, never rewritten whole.

        Args:
            documents: LangChain documents; ``Document.id`` (or ``ids=[...]``) becomes the
                document id, else a free ``doc-<n>`` is chosen.  Splits made with
                ``add_start_index=True``, and a PDF loader's pages, are joined back into
                their sources first, as in :meth:`from_documents`: a joined source takes
                its first split's (or page's) id, and the returned list has one id per
                source.
            **kwargs: ``ids``: the document ids, one per document; ``rejoin_splits``:
                False to index every document as it is given.

        Raises:
            InvalidParameterError: an id is already in the tree (delete it first), or an
                unknown keyword.
            InvalidInputError: an empty, binary or duplicate document (nothing is paid).
        """
        with self._lock():
            tree, docs = self._prepare_add(documents, kwargs)
            result = self._update_builder(tree).insert(tree, docs)
            self._commit(tree, result)
        return [d.doc_id for d in docs]

    async def aadd_documents(self, documents: Sequence[Document], **kwargs: Any) -> list[str]:
        """Async :meth:`add_documents`: summaries and embeddings use the models' async APIs."""
        async with self._lock().held():
            tree, docs = await run_in_executor(None, self._prepare_add, documents, kwargs)
            result = await self._update_builder(tree).ainsert(tree, docs)
            await run_in_executor(None, self._commit, tree, result)
        return [d.doc_id for d in docs]

    def delete(self, ids: Sequence[str] | None = None, **kwargs: Any) -> bool:
        """Delete documents by document id (what :meth:`add_documents` returned).

        Every summary that covered them is re-summarised from what it has left, or removed.

        Raises:
            InvalidParameterError: no ids, an unknown id, or an unknown keyword.
            InvalidInputError: the ids are every document of the tree.
        """
        with self._lock():
            tree, gone = self._prepare_delete(ids, kwargs)
            self._commit(tree, self._update_builder(tree).delete(tree, gone))
        return True

    async def adelete(self, ids: Sequence[str] | None = None, **kwargs: Any) -> bool:
        """Async :meth:`delete`."""
        async with self._lock().held():
            tree, gone = await run_in_executor(None, self._prepare_delete, ids, kwargs)
            result = await self._update_builder(tree).adelete(tree, gone)
            await run_in_executor(None, self._commit, tree, result)
        return True

    def _lock(self) -> UpdateLock:
        """The lock updates hold: the vector store's, shared by its retrievers, else our own."""
        shared = _store_lock(self.vectorstore) if self.vectorstore is not None else None
        return shared if shared is not None else self._update_lock

    def _current_tree(self) -> Tree:
        if self.tree is not None:
            return self.tree
        store = self.store
        assert isinstance(store, LangChainNodeStore)
        # Read back (the store cannot be searched for "every node under X" otherwise); the
        # writes that follow touch only what changed.
        return store.to_tree()

    def _prepare_add(
        self, documents: Sequence[Document], kwargs: Mapping[str, Any]
    ) -> tuple[Tree, list[CoreDocument]]:
        unknown = set(kwargs) - {"ids", "rejoin_splits"}
        if unknown:
            msg = (
                f"add_documents() got unknown keyword(s) {sorted(unknown)}; it accepts ids= "
                "and rejoin_splits="
            )
            raise InvalidParameterError(msg)
        documents = list(documents)
        ids = kwargs.get("ids")
        if ids is not None and len(ids) != len(documents):
            msg = f"ids has {len(ids)} entries for {len(documents)} documents"
            raise InvalidParameterError(msg)
        # Splits are joined first and named after (ids are per resulting document); until
        # then a document is known by its position.
        joined = self._core_documents(
            documents,
            rejoin=kwargs.get("rejoin_splits", True),
            ids=[str(i) for i in range(len(documents))],
        )
        given = [ids[i] if ids is not None else doc.id for i, doc in enumerate(documents)]
        tree = self._current_tree()
        used = set(tree.doc_ids) | {str(doc_id) for doc_id in given if doc_id}
        out: list[CoreDocument] = []
        counter = 0
        for source in joined:
            doc_id = given[int(source.doc_id)]
            if not doc_id:
                while f"doc-{counter}" in used:
                    counter += 1
                doc_id = f"doc-{counter}"
                used.add(doc_id)
            out.append(dataclasses.replace(source, doc_id=str(doc_id)))
        # Checked here, not left to the core: its message points to update(), which
        # TreeBuilder and the CLI have and this retriever does not.
        existing = set(tree.doc_ids)
        clash = list(dict.fromkeys(d.doc_id for d in out if d.doc_id in existing))
        if clash:
            msg = (
                f"document id(s) {clash[:5]} are already in the tree: to replace a document, "
                f"delete it first (retriever.delete({clash[:5]!r})), then add_documents the "
                "new version; or give the new one another id"
            )
            raise InvalidParameterError(msg)
        return tree, out

    def _prepare_delete(
        self, ids: Sequence[str] | None, kwargs: Mapping[str, Any]
    ) -> tuple[Tree, list[str]]:
        if kwargs:
            msg = f"delete() got unknown keyword(s) {sorted(kwargs)}"
            raise InvalidParameterError(msg)
        if not ids:
            msg = "delete() needs the document ids to delete (deleting everything is refused)"
            raise InvalidParameterError(msg)
        return self._current_tree(), list(ids)

    def _update_builder(self, tree: Tree) -> TreeBuilder:
        """The builder the tree was built with, or one re-made from its recorded parameters."""
        if self._tree_builder is not None:
            return self._tree_builder
        summarizer = None
        if self.llm is not None:
            from raptor_core.build.summarizers import LLMSummarizer

            summarizer = LLMSummarizer(_core_llm(self.llm))
        names = (
            "chunk_max_tokens",
            "summary_max_tokens",
            "cluster_max_tokens",
            "max_layers",
            "min_layer_size",
            "random_state",
        )
        params = {
            name: tree.params[name]
            for name in names
            if isinstance(tree.params.get(name), int) and not isinstance(tree.params[name], bool)
        }
        self._tree_builder = TreeBuilder(self._embedder(), summarizer, **params)
        return self._tree_builder

    def _commit(self, old: Tree, result: Any) -> None:
        """Point the retriever at the new tree; over a store, write only what changed."""
        new: Tree = result.tree
        if new is old:
            return
        if self.vectorstore is None:
            self.tree = new
            return
        store = self.store
        assert isinstance(store, LangChainNodeStore)
        report = result.report
        # Nodes kept whose parents changed are rewritten too: the store keeps raptor_parents.
        write = [*report.nodes_added, *report.nodes_changed, *report.nodes_relinked]
        if write:
            nodes = [new.node(i) for i in write]
            store.add(nodes, new.embeddings[new.rows(write)])
        if report.nodes_removed:
            store.delete(list(report.nodes_removed))
        store.record_floor(new)  # the tree read back next time keeps the update's floor

    # -- constructors --------------------------------------------------------------------------
    @staticmethod
    def _builder(
        embeddings: Embeddings | Embedder | None,
        llm: Runnable[Any, Any] | LLM | None,
        build_options: dict[str, Any],
    ) -> TreeBuilder:
        # Checked even when a summarizer is given: the retriever keeps the llm afterwards.
        _check_llm(llm)
        embedder = _core_embedder(embeddings) if embeddings is not None else _default_embedder()
        summarizer = build_options.pop("summarizer", None)
        if summarizer is None and llm is not None:
            from raptor_core.build.summarizers import LLMSummarizer

            summarizer = LLMSummarizer(_core_llm(llm))
        # summarizer None: TreeBuilder's offline extractive default.
        return TreeBuilder(embedder, summarizer, **build_options)

    @staticmethod
    def _core_documents(
        documents: Iterable[Document], *, rejoin: bool, ids: Sequence[str] | None = None
    ) -> list[CoreDocument]:
        """``documents`` as core documents, a text splitter's splits joined when ``rejoin``.

        Each is named ``ids[i]`` when ``ids`` is given, else ``Document.id`` or ``doc-<i>``.
        """
        out = []
        for i, doc in enumerate(documents):
            if not isinstance(doc, Document):
                msg = f"document #{i} must be a langchain_core Document, got {type(doc).__name__}"
                raise InvalidParameterError(msg)
            doc_id = ids[i] if ids is not None else doc.id or f"doc-{i}"
            out.append(
                CoreDocument(text=doc.page_content, doc_id=doc_id, metadata=dict(doc.metadata))
            )
        if not isinstance(rejoin, bool):
            msg = f"rejoin_splits must be True or False, got {rejoin!r}"
            raise InvalidParameterError(msg)
        if not rejoin:
            return out
        return [doc for doc, _ in rejoin_documents(out)]

    @staticmethod
    def _model(
        embeddings: Embeddings | Embedder | None, vectorstore: VectorStore | None
    ) -> Embeddings | Embedder | None:
        """The embedding model to build with: the given one, else the vector store's own."""
        if embeddings is None and vectorstore is not None:
            return vectorstore.embeddings
        return embeddings

    @staticmethod
    def _empty_store(
        vectorstore: VectorStore, embeddings: Embeddings | Embedder | None, dialect: Any
    ) -> LangChainNodeStore:
        store = LangChainNodeStore(vectorstore, embeddings, dialect=dialect)
        if store.manifest is not None or len(store) > 0:
            # Refuse before paying for a build.
            msg = (
                f"the {type(vectorstore).__name__} already holds documents: build into an "
                "empty store (a new collection), or reopen its tree with "
                "RaptorRetriever.from_vectorstore"
            )
            raise InvalidParameterError(msg)
        return store

    @classmethod
    def from_documents(
        cls,
        documents: Iterable[Document],
        embeddings: Embeddings | Embedder | None = None,
        llm: Runnable[Any, Any] | LLM | None = None,
        *,
        vectorstore: VectorStore | None = None,
        k: int = 4,
        strategy: str | None = None,
        search_type: str = "similarity",
        max_tokens: int | None = None,
        search_kwargs: dict[str, Any] | None = None,
        dialect: StoreDialect | None = None,
        rejoin_splits: bool = True,
        search_metadata: bool = True,
        **build_options: Any,
    ) -> RaptorRetriever:
        """Build a tree over LangChain documents and return a retriever over it.

        Args:
            documents: the documents; ``Document.id`` (or ``doc-<i>``) becomes the document
                id, and their metadata is copied onto every chunk.  Pass whole documents
                (what a loader returns), or splits made with ``add_start_index=True``.
            embeddings: a LangChain ``Embeddings`` or a raptor_core ``Embedder``; None: the
                vector store's own model, else the packaged offline all-MiniLM-L6-v2.
            llm: a LangChain chat model or LLM (or a core ``LLM``) that writes the summaries
                and serves the ``"llm"`` strategy; None: offline extractive summaries.
            vectorstore: an empty LangChain vector store to write every layer of the tree
                into (then nothing stays in memory); None: the tree is kept in memory.
            k: number of documents to return.
            strategy: retrieval strategy; None: the field's default (``"passage"``; on a
                store that cannot list its documents it works on the leaves its search
                finds).
            search_type: ``"similarity"``, ``"mmr"`` or ``"similarity_score_threshold"``.
            max_tokens: token budget for the returned documents.
            search_kwargs: ``k``, ``filter``, ``fetch_k``, ``lambda_mult``,
                ``score_threshold`` and strategy parameters.
            dialect: how to talk to ``vectorstore`` (default: chosen by its class).
            rejoin_splits: put a text splitter's splits back together first (see
                :func:`rejoin_documents`): consecutive documents with
                ``metadata["start_index"]`` (``add_start_index=True``) cut from one source
                become that source, which RAPTOR chunks itself; each overlap is then
                stored once, and passages may cross the splits' boundaries.  Consecutive
                pages of one PDF (``metadata["page"]``, as PDF loaders number them) are
                joined the same way, each leaf keeping its page.  False: every document is
                indexed as it is given.
            search_metadata: put ``score`` and the other keys that describe the search
                into the documents' metadata (see the field); False for wrappers that
                deduplicate by ``Document`` equality.
            **build_options: passed to :class:`raptor_core.TreeBuilder` (``chunk_max_tokens``,
                ``max_layers``, ``random_state``, ``summarizer``, ...).

        Raises:
            InvalidInputError: no documents, or an empty or duplicate one.
            InvalidParameterError: ``vectorstore`` already holds documents, ``llm`` is no
                model, or a field (``search_kwargs``, ``strategy``, ...) is invalid: all
                checked before the build.
            EmbeddingError, SummarizationError, LLMError: a model failed.
        """
        fields = cls._fields(
            k=k,
            strategy=strategy,
            search_type=search_type,
            max_tokens=max_tokens,
            search_kwargs=search_kwargs,
            search_metadata=search_metadata,
        )
        cls._check_fields(llm, fields)
        embeddings = cls._model(embeddings, vectorstore)
        store = cls._empty_store(vectorstore, embeddings, dialect) if vectorstore else None
        builder = cls._builder(embeddings, llm, build_options)
        tree = builder.build(cls._core_documents(documents, rejoin=rejoin_splits))
        return cls._over(tree, store, builder, embeddings, llm, **fields)

    @classmethod
    async def afrom_documents(
        cls,
        documents: Iterable[Document],
        embeddings: Embeddings | Embedder | None = None,
        llm: Runnable[Any, Any] | LLM | None = None,
        *,
        vectorstore: VectorStore | None = None,
        k: int = 4,
        strategy: str | None = None,
        search_type: str = "similarity",
        max_tokens: int | None = None,
        search_kwargs: dict[str, Any] | None = None,
        dialect: StoreDialect | None = None,
        rejoin_splits: bool = True,
        search_metadata: bool = True,
        **build_options: Any,
    ) -> RaptorRetriever:
        """Async :meth:`from_documents`: summaries and embeddings use the models' async APIs."""
        fields = cls._fields(
            k=k,
            strategy=strategy,
            search_type=search_type,
            max_tokens=max_tokens,
            search_kwargs=search_kwargs,
            search_metadata=search_metadata,
        )
        cls._check_fields(llm, fields)
        embeddings = cls._model(embeddings, vectorstore)
        store = cls._empty_store(vectorstore, embeddings, dialect) if vectorstore else None
        builder = cls._builder(embeddings, llm, build_options)
        tree = await builder.abuild(cls._core_documents(documents, rejoin=rejoin_splits))
        if store is not None:
            await run_in_executor(None, store.add_tree, tree)
        return cls._over(tree, store, builder, embeddings, llm, written=True, **fields)

    @staticmethod
    def _fields(**fields: Any) -> dict[str, Any]:
        """The retriever's fields as the ``from_*`` builders pass them."""
        fields["search_kwargs"] = dict(fields.get("search_kwargs") or {})
        if fields.get("strategy") is None:
            fields.pop("strategy", None)  # unset: the field's default for this store
        return fields

    @classmethod
    def _check_fields(cls, llm: Any, fields: Mapping[str, Any]) -> None:
        """Validate the fields before a build pays for embeddings and summaries.

        The retriever is constructed once over an empty tree: the same validators run
        (strategy, search_type, search_kwargs, k, llm) as on the built one.

        Raises:
            InvalidParameterError: a field is invalid (pydantic's ValidationError, a
                ValueError, for a wrong type or range).
        """
        empty = Tree(nodes=(), embeddings=np.zeros((0, 0), dtype=np.float32))
        cls(tree=empty, llm=llm, **fields)

    @classmethod
    def _over(
        cls,
        tree: Tree,
        store: LangChainNodeStore | None,
        builder: TreeBuilder,
        embeddings: Embeddings | Embedder | None,
        llm: Runnable[Any, Any] | LLM | None,
        *,
        written: bool = False,
        **fields: Any,
    ) -> RaptorRetriever:
        # Query with the very embedder the tree was built with.
        model = embeddings if embeddings is not None else builder.embedder
        if store is None:
            built = cls(tree=tree, embeddings=model, llm=llm, **fields)
            built._tree_builder = builder
            return built
        retriever = cls(
            vectorstore=store.vectorstore,
            embeddings=model,
            llm=llm,
            dialect=store.dialect,
            **fields,
        )
        if not written:
            store.add_tree(tree)
        store.embeddings = model
        retriever._store_cache = (store.vectorstore, model, store.dialect, store)
        retriever._tree_builder = builder
        return retriever

    @classmethod
    def from_vectorstore(
        cls,
        vectorstore: VectorStore,
        embeddings: Embeddings | Embedder | None = None,
        llm: Runnable[Any, Any] | LLM | None = None,
        *,
        dialect: StoreDialect | None = None,
        **kwargs: Any,
    ) -> RaptorRetriever:
        """Reopen a tree written into ``vectorstore`` by :meth:`from_documents`, without rebuilding.

        Args:
            vectorstore: the LangChain vector store (collection) holding the tree.
            embeddings: the model the tree was built with; None: the store's own model.
            llm: model for the ``"llm"`` and ``"hybrid"`` strategies.
            dialect: how to talk to the store (default: chosen by its class).
            **kwargs: other fields (``k``, ``strategy``, ``search_type``, ``search_kwargs``,
                ``max_tokens``).

        Raises:
            InvalidParameterError: the store holds no RAPTOR tree, or no embedding model is
                known.
            TreeFormatError: the tree's manifest is damaged or of a newer format.
        """
        retriever = cls(
            vectorstore=vectorstore, embeddings=embeddings, llm=llm, dialect=dialect, **kwargs
        )
        store = retriever.store
        assert isinstance(store, LangChainNodeStore)
        if not store.complete:
            raise InvalidParameterError(_no_tree_message(vectorstore, store))
        retriever._embedder()  # fail now, not at the first query, if no model is known
        return retriever

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
            embeddings: the model the tree was built with.  None re-creates the recorded
                embedder only when it is a local sentence-transformers model by name or a
                test fake (see ``docs/loading-trees.md``); any other model, LangChain's
                included, must be passed again.
            llm: model for the ``"llm"`` strategy.
            mmap: memory-map the embedding matrix instead of reading it.
            **kwargs: other fields (``k``, ``strategy``, ``max_tokens``, ``search_kwargs``, ...).

        Raises:
            TreeFormatError: no tree at ``path``, or a damaged one.
            InvalidParameterError: ``embeddings`` is None and the tree's embedder is not one
                a load creates by itself (the message says what to pass), or ``embeddings``
                does not fit the tree (another dimension).
        """
        tree = Tree.load(path, mmap=mmap)
        retriever = cls(tree=tree, embeddings=embeddings, llm=llm, **kwargs)
        retriever._embedder()  # fail now, not at the first query, if the model is unknown
        return retriever

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Save the tree to directory ``path`` (plain JSON + ``.npy``, written atomically).

        A tree in a vector store is exported first (every node and vector is read back).
        """
        if self.tree is not None:
            return self.tree.save(path)
        store = self.store
        assert isinstance(store, LangChainNodeStore)
        return store.to_tree().save(path)
