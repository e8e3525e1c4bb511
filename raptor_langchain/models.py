"""Wrappers between LangChain models and the raptor_core seams.

* :class:`LangChainEmbedder` makes any LangChain ``Embeddings`` a core
  :class:`~raptor_core.types.Embedder` (and ``AsyncEmbedder``), returning numpy arrays.
* :class:`LangChainLLM` makes any LangChain chat model, LLM or string-in runnable a core
  :class:`~raptor_core.types.LLM` (and ``AsyncLLM``), for summaries and LLM-guided search.
* :class:`RaptorEmbeddings` goes the other way: any core ``Embedder`` (for example the
  packaged local model) as a LangChain ``Embeddings``, so a vector store can share it.
* :func:`traced_llm` makes an LLM's calls visible to LangChain callbacks (tracing): a
  LangChain model is invoked with the callbacks, any other core ``LLM`` is reported as an
  LLM run around each call.

They translate types and errors only; no RAPTOR logic lives here.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
from langchain_core.callbacks import BaseCallbackManager
from langchain_core.embeddings import Embeddings
from langchain_core.messages import BaseMessage
from langchain_core.outputs import Generation, LLMResult
from langchain_core.runnables import Runnable, RunnableConfig
from numpy.typing import NDArray

from raptor_core._async import run_sync
from raptor_core.exceptions import EmbeddingError, LLMError, RaptorError
from raptor_core.types import LLM, AsyncEmbedder, AsyncLLM, Embedder

__all__ = ["LangChainEmbedder", "LangChainLLM", "RaptorEmbeddings", "TracedLLM", "traced_llm"]


def _model_name(model: object) -> str | None:
    """The model identifier a LangChain integration exposes, if any (for provenance only)."""
    for attr in ("model", "model_name", "model_id", "deployment_name"):
        value = getattr(model, attr, None)
        if isinstance(value, str) and value:
            return value
    return None


def _class_path(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


class LangChainEmbedder:
    """A raptor_core ``Embedder`` over a LangChain ``Embeddings``.

    Args:
        embeddings: any ``langchain_core.embeddings.Embeddings`` (OpenAI, Hugging Face,
            Ollama, ...).  Its async methods are used by async builds and retrieval.

    Examples:
        >>> from langchain_core.embeddings import DeterministicFakeEmbedding
        >>> embedder = LangChainEmbedder(DeterministicFakeEmbedding(size=8))
        >>> embedder.embed_documents(["a", "b"]).shape
        (2, 8)
    """

    def __init__(self, embeddings: Embeddings) -> None:
        self.embeddings = embeddings

    def __repr__(self) -> str:
        return f"LangChainEmbedder({self.embeddings!r})"

    def get_params(self) -> dict[str, Any]:
        """What the tree records about this embedder (the model class and name)."""
        return {"embeddings": _class_path(self.embeddings), "model": _model_name(self.embeddings)}

    def _matrix(self, vectors: object, n: int) -> NDArray[np.float32]:
        try:
            arr = np.asarray(vectors, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            msg = f"{type(self.embeddings).__name__} returned vectors of unequal length: {exc}"
            raise EmbeddingError(msg) from exc
        if n == 0 and arr.size == 0:
            return np.zeros((0, 0), dtype=np.float32)
        if arr.ndim != 2 or arr.shape[0] != n:
            msg = f"{type(self.embeddings).__name__} returned shape {arr.shape} for {n} texts"
            raise EmbeddingError(msg)
        return arr

    def _vector(self, vector: object) -> NDArray[np.float32]:
        try:
            arr = np.asarray(vector, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            msg = f"{type(self.embeddings).__name__} returned an unusable query vector: {exc}"
            raise EmbeddingError(msg) from exc
        if arr.ndim != 1:
            msg = f"{type(self.embeddings).__name__} returned a query vector of shape {arr.shape}"
            raise EmbeddingError(msg)
        return arr

    def _failed(self, what: str, exc: Exception) -> EmbeddingError:
        return EmbeddingError(f"{type(self.embeddings).__name__} failed to embed {what}: {exc!r}")

    def embed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Embed texts; returns ``(len(texts), d)`` float32."""
        try:
            vectors = self.embeddings.embed_documents(list(texts))
        except RaptorError:
            raise
        except Exception as exc:
            raise self._failed(f"{len(texts)} texts", exc) from exc
        return self._matrix(vectors, len(texts))

    def embed_query(self, text: str) -> NDArray[np.float32]:
        """Embed a query; returns ``(d,)`` float32."""
        try:
            vector = self.embeddings.embed_query(text)
        except RaptorError:
            raise
        except Exception as exc:
            raise self._failed("the query", exc) from exc
        return self._vector(vector)

    async def aembed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Async :meth:`embed_documents` (native when the LangChain model is)."""
        try:
            vectors = await self.embeddings.aembed_documents(list(texts))
        except RaptorError:
            raise
        except Exception as exc:
            raise self._failed(f"{len(texts)} texts", exc) from exc
        return self._matrix(vectors, len(texts))

    async def aembed_query(self, text: str) -> NDArray[np.float32]:
        """Async :meth:`embed_query` (native when the LangChain model is)."""
        try:
            vector = await self.embeddings.aembed_query(text)
        except RaptorError:
            raise
        except Exception as exc:
            raise self._failed("the query", exc) from exc
        return self._vector(vector)


class LangChainLLM:
    """A raptor_core ``LLM`` over a LangChain chat model, LLM, or any runnable taking a string.

    Chat models answer with a message, whose text is returned; LLMs and chains ending in a
    ``StrOutputParser`` answer with a string, returned as is.

    Args:
        model: e.g. ``ChatOpenAI(...)``, ``ChatOllama(...)``, ``OpenAI(...)``, or
            ``prompt | model``.
        max_tokens_kwarg: the keyword the model's ``invoke`` accepts for an output cap
            (``"max_tokens"`` for ChatOpenAI and ChatAnthropic).  When set, the length the
            caller asks for is forwarded under it; when None (default), it is not forwarded
            and the cap configured on the model applies, because models disagree on the
            name and some reject unknown keywords.
        config: the ``RunnableConfig`` every call is made with (callbacks, tags, ...).

    Examples:
        >>> from langchain_core.language_models.fake_chat_models import FakeListChatModel
        >>> LangChainLLM(FakeListChatModel(responses=["A summary."])).complete("Summarise: ...")
        'A summary.'
    """

    def __init__(
        self,
        model: Runnable[Any, Any],
        *,
        max_tokens_kwarg: str | None = None,
        config: RunnableConfig | None = None,
    ) -> None:
        self.model = model
        self.max_tokens_kwarg = max_tokens_kwarg
        self.config = config

    def with_config(self, config: RunnableConfig | None) -> LangChainLLM:
        """The same model, invoked with ``config`` (callbacks, tags, metadata).

        :class:`~raptor_langchain.RaptorRetriever` binds each search's child callbacks this
        way, so the model's calls show up as child runs of the retriever run.
        """
        return LangChainLLM(self.model, max_tokens_kwarg=self.max_tokens_kwarg, config=config)

    def __repr__(self) -> str:
        return f"LangChainLLM({type(self.model).__name__})"

    def get_params(self) -> dict[str, Any]:
        """What the tree records about this model (its class and name)."""
        return {"model_class": _class_path(self.model), "model": _model_name(self.model)}

    def _kwargs(self, max_tokens: int | None) -> dict[str, Any]:
        if self.max_tokens_kwarg is None or max_tokens is None:
            return {}
        return {self.max_tokens_kwarg: max_tokens}

    def _text(self, answer: object) -> str:
        if isinstance(answer, str):
            return answer
        if isinstance(answer, BaseMessage):
            # `.text` joins the text blocks of list-of-blocks content (Anthropic, reasoning models).
            return str(answer.text)
        kind = type(answer).__name__
        msg = f"{type(self.model).__name__} answered with {kind}, not text or a message"
        raise LLMError(msg)

    def _failed(self, exc: Exception) -> LLMError:
        return LLMError(f"{type(self.model).__name__} failed: {exc!r}")

    def complete(self, prompt: str, *, max_tokens: int | None = None) -> str:
        """Send ``prompt`` and return the answer's text."""
        try:
            answer = self.model.invoke(prompt, self.config, **self._kwargs(max_tokens))
        except RaptorError:
            raise
        except Exception as exc:
            raise self._failed(exc) from exc
        return self._text(answer)

    async def acomplete(self, prompt: str, *, max_tokens: int | None = None) -> str:
        """Async :meth:`complete` (native when the model is)."""
        try:
            answer = await self.model.ainvoke(prompt, self.config, **self._kwargs(max_tokens))
        except RaptorError:
            raise
        except Exception as exc:
            raise self._failed(exc) from exc
        return self._text(answer)


def _tolist(vectors: object) -> list[Any]:
    out: list[Any] = np.asarray(vectors, dtype=np.float32).tolist()
    return out


class RaptorEmbeddings(Embeddings):
    """A LangChain ``Embeddings`` over a raptor_core ``Embedder``.

    Lets a LangChain vector store use the same model as a RAPTOR tree, for example the
    packaged offline all-MiniLM-L6-v2.  :class:`~raptor_langchain.RaptorRetriever` unwraps
    it, so a tree built through it records the core embedder and reloads without it.

    Args:
        embedder: any raptor_core ``Embedder``.

    Examples:
        >>> from raptor_core.testing import FakeEmbedder
        >>> len(RaptorEmbeddings(FakeEmbedder(dim=8)).embed_query("cats"))
        8
    """

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder

    def __repr__(self) -> str:
        return f"RaptorEmbeddings({self.embedder!r})"

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """Embed texts; one list of floats per text."""
        return _tolist(self.embedder.embed_documents(texts))

    def embed_query(self, text: str) -> list[float]:
        """Embed a query."""
        return _tolist(self.embedder.embed_query(text))

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        """Async :meth:`embed_documents`; native when the core embedder is async."""
        if isinstance(self.embedder, AsyncEmbedder):
            vectors = await self.embedder.aembed_documents(texts)
            return _tolist(vectors)
        return await super().aembed_documents(texts)

    async def aembed_query(self, text: str) -> list[float]:
        """Async :meth:`embed_query`; native when the core embedder is async."""
        if isinstance(self.embedder, AsyncEmbedder):
            vector = await self.embedder.aembed_query(text)
            return _tolist(vector)
        return await super().aembed_query(text)


async def _settle(value: Any) -> Any:
    """Await ``value`` when a callback manager's method returned a coroutine (async managers)."""
    if inspect.isawaitable(value):
        return await value
    return value


class TracedLLM:
    """A core ``LLM`` whose every call is reported to LangChain callbacks as an LLM run.

    For models that are not LangChain runnables (an ``OpenAILLM`` of the core, your own
    ``LLM``): tracers such as LangSmith then show each prompt and answer as a child run of
    the run that owns ``callbacks``.

    Args:
        llm: the core LLM.
        callbacks: a LangChain callback manager, typically ``run_manager.get_child()`` of
            the retriever run.
    """

    def __init__(self, llm: LLM, callbacks: BaseCallbackManager) -> None:
        self.llm = llm
        self.callbacks = callbacks

    def __repr__(self) -> str:
        return f"TracedLLM({self.llm!r})"

    @property
    def name(self) -> str:
        """The run name: the wrapped model's class."""
        return type(self.llm).__name__

    def get_params(self) -> dict[str, Any]:
        """The wrapped model's parameters, where it reports them."""
        params = getattr(self.llm, "get_params", None)
        return dict(params()) if callable(params) else {"class": self.name}

    async def acomplete(self, prompt: str, *, max_tokens: int | None = None) -> str:
        """Report an LLM run, call the model (natively async when it is), end the run."""
        # A CallbackManager (sync retrieval) answers at once, an AsyncCallbackManager with
        # a coroutine; the run managers they return differ the same way.
        manager: Any = self.callbacks
        runs = await _settle(
            manager.on_llm_start(
                {"name": self.name},
                [prompt],
                name=self.name,
                invocation_params={"max_tokens": max_tokens},
            )
        )
        run = runs[0]
        try:
            if isinstance(self.llm, AsyncLLM):
                answer = await self.llm.acomplete(prompt, max_tokens=max_tokens)
            else:
                answer = await asyncio.to_thread(self.llm.complete, prompt, max_tokens=max_tokens)
        except BaseException as exc:
            await _settle(run.on_llm_error(exc))
            raise
        await _settle(run.on_llm_end(LLMResult(generations=[[Generation(text=str(answer))]])))
        return answer

    def complete(self, prompt: str, *, max_tokens: int | None = None) -> str:
        """Synchronous :meth:`acomplete` (on a private event loop)."""
        return run_sync(lambda: self.acomplete(prompt, max_tokens=max_tokens))


def traced_llm(llm: Runnable[Any, Any] | LLM, callbacks: BaseCallbackManager | None) -> LLM:
    """``llm`` as a core ``LLM`` whose calls are child runs of ``callbacks``' run.

    A LangChain runnable (or a :class:`LangChainLLM` over one) is invoked with
    ``config={"callbacks": callbacks}``, so its own runs (chat model, token usage) nest
    under the caller's; any other core ``LLM`` is wrapped in :class:`TracedLLM`.

    Args:
        llm: a LangChain chat model, LLM or runnable, or a core ``LLM``.
        callbacks: the callback manager of the calling run's children; None: no tracing.
    """
    if isinstance(llm, Runnable):
        llm = LangChainLLM(llm)
    if callbacks is None:
        return llm
    if isinstance(llm, LangChainLLM):
        return llm.with_config({**(llm.config or {}), "callbacks": callbacks})
    return TracedLLM(llm, callbacks)
