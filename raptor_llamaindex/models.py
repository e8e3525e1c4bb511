"""LlamaIndex models as raptor_core seams: ``BaseEmbedding`` as an Embedder, ``LLM`` as an LLM.

The wrappers only translate types (lists of floats to numpy, ``CompletionResponse`` to ``str``)
and errors (to the raptor_core hierarchy).  They hold no RAPTOR logic.

This module also decides which model to use when none is passed (``resolve_*``):

* an explicit argument always wins (for a tree, an embedder is checked against the model
  the tree records: another dimension is an error, another model name a warning);
* for a tree, the embedder it records, **only** when a load may create it by itself: a
  local sentence-transformers model by name or a test fake (the closed allowlist of
  :mod:`raptor_core.components`).  A tree file never makes us create anything else;
* then ``Settings.embed_model`` / ``Settings.llm`` **if the application configured them**.
  The check reads ``Settings._embed_model`` / ``Settings._llm`` instead of the public
  properties, because those lazily resolve to OpenAI (a network client that raises without
  an API key).  LlamaIndex's placeholders ``MockEmbedding`` / ``MockLLM`` (what
  ``Settings.llm = None`` installs) count as "not configured";
* otherwise the offline defaults of raptor_core: the packaged all-MiniLM-L6-v2 embedder and
  the extractive summariser.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.base.llms.base import BaseLLM
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.embeddings.mock_embed_model import MockEmbedding
from llama_index.core.llms.mock import MockLLM
from llama_index.core.settings import Settings
from numpy.typing import NDArray
from pydantic import PrivateAttr

from raptor_core.build.summarizers import LLMSummarizer
from raptor_core.exceptions import (
    EmbeddingError,
    InvalidParameterError,
    LLMAuthenticationError,
    LLMError,
    LLMTimeoutError,
    RaptorError,
)
from raptor_core.tree import Tree
from raptor_core.types import DEFAULT_SUMMARY_PROMPT, LLM, AsyncEmbedder, Embedder, Summarizer

__all__ = [
    "LlamaIndexEmbedder",
    "LlamaIndexLLM",
    "LlamaIndexSummarizer",
    "RaptorEmbedding",
    "attach_callback_manager",
    "resolve_embedder",
    "resolve_llm",
    "resolve_summarizer",
]


def _name(model: object) -> str:
    return type(model).__name__


class LlamaIndexEmbedder:
    """A raptor_core ``Embedder`` (and ``AsyncEmbedder``) over any LlamaIndex ``BaseEmbedding``.

    Documents go through ``get_text_embedding_batch`` (batched by the model's
    ``embed_batch_size``), queries through ``get_query_embedding``, so models that prompt
    queries and documents differently keep doing so.  The async methods call the model's
    own ``aget_*`` methods.

    Setup:
        ``pip install 'raptor-retriever[llamaindex]'`` plus the embedding integration you use.

    Key init args:
        embed_model: the LlamaIndex embedding model.
        show_progress: show LlamaIndex's progress bar while embedding documents.

    Instantiate:
        .. code-block:: python

            from llama_index.core.embeddings import MockEmbedding
            from raptor_llamaindex import LlamaIndexEmbedder

            embedder = LlamaIndexEmbedder(MockEmbedding(embed_dim=8))

    Usage:
        .. code-block:: python

            embedder.embed_documents(["a cat", "a dog"]).shape  # (2, 8)
            embedder.embed_query("pets").shape  # (8,)

    Use with the core builder:
        .. code-block:: python

            from raptor_core import TreeBuilder

            tree = TreeBuilder(embedder).build(["Cats purr. Dogs bark. Birds sing."])
    """

    def __init__(self, embed_model: BaseEmbedding, *, show_progress: bool = False) -> None:
        self.embed_model = embed_model
        self.show_progress = show_progress

    def __repr__(self) -> str:
        return f"LlamaIndexEmbedder({_name(self.embed_model)}, model_name={self.model_name!r})"

    @property
    def model_name(self) -> str:
        """The wrapped model's ``model_name``."""
        return str(getattr(self.embed_model, "model_name", "unknown"))

    def get_params(self) -> dict[str, Any]:
        """What the tree records about the embedder (no credentials)."""
        return {"embed_class": _name(self.embed_model), "model_name": self.model_name}

    def _fail(self, what: str, exc: Exception) -> EmbeddingError:
        return EmbeddingError(f"{_name(self.embed_model)} failed to embed {what}: {exc!r}")

    @staticmethod
    def _matrix(vectors: Sequence[Sequence[float]]) -> NDArray[np.float32]:
        if len(vectors) == 0:
            return np.zeros((0, 0), dtype=np.float32)
        return np.asarray(vectors, dtype=np.float32)

    def embed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Embed texts as documents; shape ``(len(texts), d)``."""
        if not texts:
            return np.zeros((0, 0), dtype=np.float32)
        try:
            vectors = self.embed_model.get_text_embedding_batch(
                list(texts), show_progress=self.show_progress
            )
        except RaptorError:
            raise
        except Exception as exc:
            raise self._fail(f"{len(texts)} texts", exc) from exc
        return self._matrix(vectors)

    def embed_query(self, text: str) -> NDArray[np.float32]:
        """Embed a query; shape ``(d,)``."""
        try:
            vector = self.embed_model.get_query_embedding(text)
        except RaptorError:
            raise
        except Exception as exc:
            raise self._fail("the query", exc) from exc
        return np.asarray(vector, dtype=np.float32)

    async def aembed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Async :meth:`embed_documents` through the model's ``aget_text_embedding_batch``."""
        if not texts:
            return np.zeros((0, 0), dtype=np.float32)
        try:
            vectors = await self.embed_model.aget_text_embedding_batch(
                list(texts), show_progress=self.show_progress
            )
        except RaptorError:
            raise
        except Exception as exc:
            raise self._fail(f"{len(texts)} texts", exc) from exc
        return self._matrix(vectors)

    async def aembed_query(self, text: str) -> NDArray[np.float32]:
        """Async :meth:`embed_query` through the model's ``aget_query_embedding``."""
        try:
            vector = await self.embed_model.aget_query_embedding(text)
        except RaptorError:
            raise
        except Exception as exc:
            raise self._fail("the query", exc) from exc
        return np.asarray(vector, dtype=np.float32)


def _llm_error(llm: object, exc: Exception) -> LLMError:
    msg = f"{_name(llm)} failed: {exc!r}"
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return LLMTimeoutError(msg)
    # Provider SDKs (openai, anthropic, httpx) put the HTTP status on the exception.
    status = getattr(exc, "status_code", None) or getattr(
        getattr(exc, "response", None), "status_code", None
    )
    if status in (401, 403):
        return LLMAuthenticationError(msg)
    return LLMError(msg)


class LlamaIndexLLM:
    """A raptor_core ``LLM`` (and ``AsyncLLM``) over any LlamaIndex ``LLM``.

    Calls ``llm.complete(prompt)`` / ``await llm.acomplete(prompt)`` and returns the text.
    Chat models work too: LlamaIndex turns the completion into a chat call.  Errors become
    :class:`~raptor_core.LLMError` (``LLMTimeoutError`` / ``LLMAuthenticationError`` when
    recognisable).

    Setup:
        ``pip install 'raptor-retriever[llamaindex]'`` plus the LLM integration you use.

    Key init args:
        llm: the LlamaIndex LLM.
        max_tokens_kwarg: LlamaIndex has no common per-call length argument, so by default the
            core's ``max_tokens`` is *not* forwarded (the model's own setting applies).  Name
            the keyword your integration accepts (``"max_tokens"`` for OpenAI) to forward it.

    Instantiate:
        .. code-block:: python

            from llama_index.core.llms import MockLLM
            from raptor_llamaindex import LlamaIndexLLM

            llm = LlamaIndexLLM(MockLLM(max_tokens=5))

    Usage:
        .. code-block:: python

            llm.complete("Summarise: bees dance.")  # 'text text text text text'

    Use as a summariser:
        .. code-block:: python

            from raptor_core.build.summarizers import LLMSummarizer

            summarizer = LLMSummarizer(llm)  # or LlamaIndexSummarizer(MockLLM())
    """

    def __init__(self, llm: BaseLLM, *, max_tokens_kwarg: str | None = None) -> None:
        self.llm = llm
        self.max_tokens_kwarg = max_tokens_kwarg

    def __repr__(self) -> str:
        return f"LlamaIndexLLM({_name(self.llm)})"

    def get_params(self) -> dict[str, Any]:
        """What the tree records about the model (no credentials)."""
        try:
            model = str(self.llm.metadata.model_name)
        except Exception:  # metadata is a property some integrations compute lazily
            model = "unknown"
        return {"llm_class": _name(self.llm), "model_name": model}

    def _kwargs(self, max_tokens: int | None) -> dict[str, Any]:
        if self.max_tokens_kwarg is None or max_tokens is None:
            return {}
        return {self.max_tokens_kwarg: max_tokens}

    def complete(self, prompt: str, *, max_tokens: int | None = None) -> str:
        """Return the model's completion of ``prompt``."""
        try:
            response = self.llm.complete(prompt, **self._kwargs(max_tokens))
        except RaptorError:
            raise
        except Exception as exc:
            raise _llm_error(self.llm, exc) from exc
        return str(response.text)

    async def acomplete(self, prompt: str, *, max_tokens: int | None = None) -> str:
        """Async :meth:`complete` through the model's ``acomplete``."""
        try:
            response = await self.llm.acomplete(prompt, **self._kwargs(max_tokens))
        except RaptorError:
            raise
        except Exception as exc:
            raise _llm_error(self.llm, exc) from exc
        return str(response.text)


class LlamaIndexSummarizer(LLMSummarizer):
    """A raptor_core ``Summarizer`` that asks a LlamaIndex ``LLM`` for each cluster summary.

    Shorthand for ``LLMSummarizer(LlamaIndexLLM(llm))`` with the paper's prompt.

    Setup:
        ``pip install 'raptor-retriever[llamaindex]'`` plus the LLM integration you use.

    Key init args:
        llm: the LlamaIndex LLM.
        prompt: template with a ``{context}`` placeholder (the RAPTOR paper's by default).
        max_tokens_kwarg: see :class:`LlamaIndexLLM`.

    Instantiate:
        .. code-block:: python

            from llama_index.core.llms import MockLLM
            from raptor_llamaindex import LlamaIndexSummarizer

            summarizer = LlamaIndexSummarizer(MockLLM(max_tokens=8))

    Usage:
        .. code-block:: python

            summarizer.summarize(["Bees dance.", "Bees make honey."], max_tokens=8)
    """

    def __init__(
        self,
        llm: BaseLLM,
        *,
        prompt: str = DEFAULT_SUMMARY_PROMPT,
        separator: str = "\n\n",
        max_tokens_kwarg: str | None = None,
    ) -> None:
        super().__init__(
            LlamaIndexLLM(llm, max_tokens_kwarg=max_tokens_kwarg),
            prompt=prompt,
            separator=separator,
        )

    def get_params(self) -> dict[str, Any]:
        """What the tree records about the summariser."""
        return {"prompt": self.prompt, **self.llm.get_params()}  # type: ignore[attr-defined]


class RaptorEmbedding(BaseEmbedding):
    """A LlamaIndex ``BaseEmbedding`` over a raptor_core ``Embedder`` (the other direction).

    Lets LlamaIndex components (``VectorStoreIndex``, semantic splitters, evaluators) share
    the exact model a RAPTOR tree was built with; by default the packaged, offline
    all-MiniLM-L6-v2.  ``RaptorIndex`` unwraps it, so the tree records the core embedder and
    ``RaptorIndex.load`` can re-create it.

    Setup:
        ``pip install 'raptor-retriever[llamaindex]'``

    Key init args:
        embedder: a raptor_core ``Embedder``; default ``SentenceTransformerEmbedder()``.
        embed_batch_size: texts per call to the core embedder.

    Instantiate:
        .. code-block:: python

            from raptor_llamaindex import RaptorEmbedding

            embed_model = RaptorEmbedding()  # packaged all-MiniLM-L6-v2, no network

    Usage:
        .. code-block:: python

            from llama_index.core import Document, VectorStoreIndex

            vector_index = VectorStoreIndex.from_documents(
                [Document(text="Bees dance.")], embed_model=embed_model
            )
    """

    _embedder: Embedder = PrivateAttr()

    def __init__(
        self, embedder: Embedder | None = None, *, embed_batch_size: int = 64, **kwargs: Any
    ) -> None:
        if embedder is None:
            from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder

            embedder = SentenceTransformerEmbedder()
        name = getattr(embedder, "model_name_or_path", None) or type(embedder).__name__
        kwargs.setdefault("model_name", str(name))
        super().__init__(embed_batch_size=embed_batch_size, **kwargs)
        self._embedder = embedder

    @classmethod
    def class_name(cls) -> str:
        """LlamaIndex's serialisation name."""
        return "RaptorEmbedding"

    @property
    def embedder(self) -> Embedder:
        """The wrapped raptor_core embedder."""
        return self._embedder

    def _get_query_embedding(self, query: str) -> list[float]:
        return [float(x) for x in np.asarray(self._embedder.embed_query(query)).reshape(-1)]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        if isinstance(self._embedder, AsyncEmbedder):
            vector = await self._embedder.aembed_query(query)
        else:
            vector = await asyncio.to_thread(self._embedder.embed_query, query)
        return [float(x) for x in np.asarray(vector).reshape(-1)]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._get_text_embeddings([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        matrix = self._embedder.embed_documents(texts)
        return np.asarray(matrix, dtype=np.float64).tolist()

    async def _aget_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        if isinstance(self._embedder, AsyncEmbedder):
            matrix = await self._embedder.aembed_documents(texts)
        else:
            matrix = await asyncio.to_thread(self._embedder.embed_documents, texts)
        return np.asarray(matrix, dtype=np.float64).tolist()


# -- resolution --------------------------------------------------------------------------------
def configured_embed_model() -> BaseEmbedding | None:
    """``Settings.embed_model`` if the application set a real one, without resolving the default."""
    model = Settings._embed_model
    return None if model is None or isinstance(model, MockEmbedding) else model


def configured_llm() -> BaseLLM | None:
    """``Settings.llm`` if the application set a real one, without resolving the default."""
    model = Settings._llm
    return None if model is None or isinstance(model, MockLLM) else model


def _is_core_embedder(obj: object) -> bool:
    return callable(getattr(obj, "embed_documents", None)) and callable(
        getattr(obj, "embed_query", None)
    )


def resolve_embedder(
    embed_model: BaseEmbedding | Embedder | None,
    *,
    tree: Tree | None = None,
) -> Embedder:
    """The core embedder for ``embed_model`` (see the module docstring for the fallbacks).

    Args:
        embed_model: a LlamaIndex ``BaseEmbedding``, a raptor_core ``Embedder`` or None.
        tree: the tree the embedder will search, when there is one.  A given model (or
            ``Settings.embed_model``) is checked against what the tree records; with
            neither, the recorded embedder is re-created only when it is on the closed
            allowlist of :mod:`raptor_core.components` (a local sentence-transformers model
            by name, a test fake): a tree file never picks code, a URL or a path.

    Raises:
        InvalidParameterError: ``embed_model`` is neither kind, does not fit the tree, or
            the tree's embedder is not one a load creates by itself and none is configured
            (the message says what to pass).
    """
    from raptor_core.components import check_embedder, recreate_embedder

    if embed_model is not None:
        if isinstance(embed_model, RaptorEmbedding):
            embedder: Embedder = embed_model.embedder
        elif isinstance(embed_model, BaseEmbedding):
            embedder = LlamaIndexEmbedder(embed_model)
        elif _is_core_embedder(embed_model):
            embedder = embed_model
        else:
            msg = (
                f"embed_model must be a LlamaIndex BaseEmbedding or a raptor_core Embedder, "
                f"got {type(embed_model).__name__}"
            )
            raise InvalidParameterError(msg)
        if tree is not None:
            check_embedder(tree, embedder, pass_as="embed_model")
        return embedder
    record = tree.params.get("embedder") if tree is not None else None
    if tree is None or record is None:
        # Nothing to match (a new build, or a tree that records no model): the defaults.
        settings_model = configured_embed_model()
        if settings_model is not None:
            return resolve_embedder(settings_model, tree=tree)
        from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder

        return SentenceTransformerEmbedder()
    try:
        # The model that built the tree, when a load may create it by itself.
        return recreate_embedder(record, dim=tree.dim if len(tree) else None, pass_as="embed_model")
    except InvalidParameterError:
        settings_model = configured_embed_model()
        if settings_model is None:
            raise
    # The application configured a model: the caller's choice, checked like a passed one.
    return resolve_embedder(settings_model, tree=tree)


def resolve_llm(llm: BaseLLM | LLM | None) -> LLM | None:
    """The core LLM for ``llm``: wrapped if it is LlamaIndex's, else ``Settings.llm`` or None."""
    if isinstance(llm, BaseLLM):
        return LlamaIndexLLM(llm)
    if llm is not None:
        if callable(getattr(llm, "complete", None)):
            return llm
        msg = f"llm must be a LlamaIndex LLM or a raptor_core LLM, got {type(llm).__name__}"
        raise InvalidParameterError(msg)
    settings_llm = configured_llm()
    return None if settings_llm is None else LlamaIndexLLM(settings_llm)


def attach_callback_manager(model: object, callback_manager: CallbackManager) -> None:
    """Make the LlamaIndex model behind ``model`` report to ``callback_manager``.

    LlamaIndex's own convention: ``VectorStoreIndex`` hands its callback manager to its
    embed model (``resolve_embed_model``) and ``BaseIndex.as_query_engine`` to its LLM
    (``resolve_llm``) by setting the model's ``callback_manager``; the model's own calls
    then emit the events a ``TokenCountingHandler`` counts, once each.  ``model`` is a
    LlamaIndex ``BaseEmbedding``/``BaseLLM`` or one of this module's wrappers over one;
    anything else (a raptor_core model, a :class:`RaptorEmbedding`, which RAPTOR unwraps
    and calls directly) is left alone.
    """
    target = model
    if isinstance(model, LlamaIndexEmbedder):
        target = model.embed_model
    elif isinstance(model, LlamaIndexLLM):
        target = model.llm
    if isinstance(target, RaptorEmbedding):
        return
    if (
        isinstance(target, BaseEmbedding | BaseLLM)
        and target.callback_manager is not callback_manager
    ):
        target.callback_manager = callback_manager


def resolve_summarizer(
    llm: BaseLLM | LLM | None, summarizer: Summarizer | None = None
) -> Summarizer | None:
    """The summariser for a build: ``summarizer``, else one over ``llm``, else None (extractive).

    None lets :class:`~raptor_core.TreeBuilder` use its offline extractive summariser.
    """
    if summarizer is not None:
        return summarizer
    if isinstance(llm, BaseLLM):
        return LlamaIndexSummarizer(llm)
    core_llm = resolve_llm(llm)
    return None if core_llm is None else LLMSummarizer(core_llm)
