"""The exact vectors of a sentence-transformers model through ONNX Runtime, without torch.

Loading torch, transformers and sentence-transformers costs seconds before a single query can
be embedded; ONNX Runtime and the ``tokenizers`` library load in a fraction of that.  The
graph is the model's own transformer exported once by :func:`export_onnx` (fp32, no
quantisation), followed here by the same mean pooling and normalisation, so the vectors match
sentence-transformers' to float rounding (cosine above 0.9999; ``tests`` check >= 0.999).

Supported: models made of a Transformer module, mean pooling and optionally Normalize, as
all-MiniLM-L6-v2 (the default) is.  Exporting needs ``torch`` and ``onnx``
(``pip install 'raptor-retriever[onnx]'`` plus torch); embedding needs only ``onnxruntime``
and ``tokenizers``.

An export directory holds ``model.onnx``, ``tokenizer.json`` and ``raptor-onnx.json``.  The
JSON file is read as data: only numbers, booleans and a model name are taken from it, each
validated.
"""

from __future__ import annotations

import json
import os
import re
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core._imports import require
from raptor_core.exceptions import EmbeddingError, InvalidParameterError, MissingDependencyError

__all__ = ["ONNX_FORMAT", "OnnxEmbedder", "default_onnx_dir", "export_info", "export_onnx"]

#: Version of the export directory layout written by :func:`export_onnx`.
ONNX_FORMAT = 1

_META = "raptor-onnx.json"
_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
_MAX_SEQ_LENGTH = 8192


def default_onnx_dir() -> Path:
    """Where ``raptor export-onnx`` writes, and ``raptor query`` looks for, the default export.

    ``$RAPTOR_ONNX_DIR`` when set, else ``raptor-retriever/onnx/all-MiniLM-L6-v2`` under
    ``$XDG_CACHE_HOME`` (``~/.cache`` when unset).
    """
    explicit = os.environ.get("RAPTOR_ONNX_DIR")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(cache) / "raptor-retriever" / "onnx" / "all-MiniLM-L6-v2"


def export_info(directory: str | Path) -> dict[str, Any] | None:
    """The validated description of an export (model name, dim, ...), or None if there is none.

    Reads the small JSON file only: the model itself is not loaded.
    """
    try:
        return _read_meta(Path(directory))
    except EmbeddingError:
        return None


def export_onnx(
    out_dir: str | Path,
    model_name_or_path: str = "all-MiniLM-L6-v2",
    *,
    opset: int = 18,
) -> Path:
    """Export a sentence-transformers model's transformer to ``out_dir`` for :class:`OnnxEmbedder`.

    Runs once per model (seconds); needs torch 2.6 or later, sentence-transformers, ``onnx``
    and ``onnxscript`` (the ``onnx`` extra).  The graph comes from torch's ``torch.export``-based
    exporter (``dynamo=True``); the TorchScript exporter it replaces is deprecated in torch.

    Args:
        out_dir: directory to write (created; existing export files are replaced).
        model_name_or_path: as for :class:`SentenceTransformerEmbedder` (default: the packaged
            all-MiniLM-L6-v2).
        opset: ONNX opset of the exported graph (18, the exporter's own, by default: an older
            one is converted after export).

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    Raises:
        InvalidParameterError: the model is not Transformer + mean pooling (+ Normalize).
        MissingDependencyError: torch, sentence-transformers, onnx or onnxscript is missing,
            or torch is older than 2.6.
    """
    from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder

    torch = require("torch", package="torch")
    require("onnx", extra="onnx")
    require("onnxscript", extra="onnx")
    if _version_tuple(torch.__version__) < (2, 6):
        msg = (
            f"export_onnx needs torch 2.6 or later (torch.export's dynamic dimensions); "
            f"torch {torch.__version__} is installed: upgrade torch"
        )
        raise MissingDependencyError(msg)
    model = SentenceTransformerEmbedder(model_name_or_path, device="cpu").model
    modules = [type(m).__name__ for m in model]
    mean_only = len(modules) > 1 and getattr(model[1], "pooling_mode", None) == "mean"
    if modules[:2] != ["Transformer", "Pooling"] or not mean_only or len(modules) > 3:
        msg = (
            f"export_onnx supports Transformer + mean Pooling (+ Normalize) models; "
            f"{model_name_or_path!r} is {' + '.join(modules)}: use SentenceTransformerEmbedder"
        )
        raise InvalidParameterError(msg)
    if len(modules) == 3 and modules[2] != "Normalize":
        msg = f"export_onnx: unsupported last module {modules[2]} in {model_name_or_path!r}"
        raise InvalidParameterError(msg)
    transformer = model[0]
    tokenizer = transformer.tokenizer
    if not getattr(tokenizer, "is_fast", False):
        msg = f"export_onnx needs a fast (tokenizers) tokenizer; {model_name_or_path!r} has none"
        raise InvalidParameterError(msg)

    # The traced forward() takes positional tensors; the model wants keywords.
    class _Graph(torch.nn.Module):  # type: ignore[name-defined]
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return self.inner(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # A batch of two: torch.export treats a dimension of size 1 as a constant.
    example = tuple(torch.ones(2, 8, dtype=torch.long) for _ in _INPUTS)
    dynamic = torch.export.Dim.DYNAMIC
    graph = _Graph(transformer.auto_model).train(False)  # inference mode: no dropout
    with torch.no_grad(), warnings.catch_warnings():
        # torch's own pytree code warns about its own deprecated call; nothing we can change.
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
        torch.onnx.export(
            graph,
            example,
            str(out / "model.onnx"),
            input_names=list(_INPUTS),
            output_names=["last_hidden_state"],
            dynamic_shapes={name: {0: dynamic, 1: dynamic} for name in _INPUTS},
            opset_version=opset,
            dynamo=True,
            # One self-contained file (a MiniLM is 90 MB, far below protobuf's 2 GB limit),
            # so OnnxEmbedder never follows a path written inside the model.
            external_data=False,
            verbose=False,
        )
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    meta = {
        "format": ONNX_FORMAT,
        "model_name_or_path": model_name_or_path,
        "dim": int(
            (
                getattr(model, "get_embedding_dimension", None)
                or model.get_sentence_embedding_dimension
            )()
        ),
        "max_seq_length": int(model.max_seq_length),
        "normalize": len(modules) == 3,
    }
    (out / _META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return out


class OnnxEmbedder:
    """An :class:`~raptor_core.types.Embedder` running an :func:`export_onnx` directory.

    Gives the vectors of the exported sentence-transformers model (float rounding apart),
    starting in a fraction of the time torch takes to import.  Pass it to a retriever as the
    tree's embedder (the model name it reports is the exported one, so the tree's record
    matches), or to ``raptor query --embedder onnx:DIR``.

    Args:
        onnx_dir: a directory written by :func:`export_onnx`.
        normalize: unit vectors; None (default) follows the exported model.
        query_prompt: prefix for queries, as for :class:`SentenceTransformerEmbedder`.
        document_prompt: prefix for documents.
        batch_size: texts per forward pass.
        threads: ONNX Runtime intra-op threads; 1 (default) suits queries (see
            :mod:`raptor_core._threads`), more helps large ``embed_documents`` calls.

    Examples:
        >>> embedder = OnnxEmbedder("minilm-onnx")  # doctest: +SKIP
        >>> embedder.embed_query("a cat").shape  # doctest: +SKIP
        (384,)
    """

    #: Vectors depend slightly on batch padding, as with sentence-transformers.
    cacheable = False

    def __init__(
        self,
        onnx_dir: str | Path,
        *,
        normalize: bool | None = None,
        query_prompt: str | None = None,
        document_prompt: str | None = None,
        batch_size: int = 32,
        threads: int = 1,
    ) -> None:
        self.onnx_dir = onnx_dir
        self.normalize = normalize
        self.query_prompt = query_prompt
        self.document_prompt = document_prompt
        self.batch_size = batch_size
        self.threads = threads
        self._loaded: tuple[Any, Any, dict[str, Any]] | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"OnnxEmbedder(onnx_dir={str(self.onnx_dir)!r})"

    def get_params(self) -> dict[str, Any]:
        """Parameters for a tree's record; ``model_name_or_path`` is the exported model's."""
        return {
            "model_name_or_path": self._meta()["model_name_or_path"],
            "onnx_dir": str(self.onnx_dir),
            "normalize": self.normalize,
            "query_prompt": self.query_prompt,
            "document_prompt": self.document_prompt,
            "batch_size": self.batch_size,
        }

    def _meta(self) -> dict[str, Any]:
        return self._load()[2]

    def _load(self) -> tuple[Any, Any, dict[str, Any]]:
        with self._lock:
            if self._loaded is None:
                self._loaded = self._open()
            return self._loaded

    def _open(self) -> tuple[Any, Any, dict[str, Any]]:
        for name, value in (("batch_size", self.batch_size), ("threads", self.threads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                msg = f"OnnxEmbedder {name} must be a positive integer, got {value!r}"
                raise InvalidParameterError(msg)
        directory = Path(self.onnx_dir)
        meta = _read_meta(directory)
        ort = require("onnxruntime", extra="onnx")
        tokenizers = require("tokenizers", extra="onnx")
        tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        tokenizer.no_padding()
        tokenizer.enable_truncation(meta["max_seq_length"])
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        try:
            session = ort.InferenceSession(
                str(directory / "model.onnx"), options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # onnxruntime raises its own exception types
            msg = f"cannot load {directory / 'model.onnx'}: {exc}; re-run export_onnx"
            raise EmbeddingError(msg) from exc
        return session, tokenizer, meta

    @property
    def dim(self) -> int:
        """Embedding dimension of the exported model."""
        return int(self._meta()["dim"])

    def _encode(self, texts: list[str], prompt: str | None) -> NDArray[np.float32]:
        session, tokenizer, meta = self._load()
        if not texts:
            return np.zeros((0, meta["dim"]), dtype=np.float32)
        normalize = meta["normalize"] if self.normalize is None else self.normalize
        out = np.empty((len(texts), meta["dim"]), dtype=np.float32)
        for start in range(0, len(texts), self.batch_size):
            batch = [(prompt or "") + t for t in texts[start : start + self.batch_size]]
            encoded = tokenizer.encode_batch(batch)
            width = max(len(e.ids) for e in encoded)
            ids = np.zeros((len(batch), width), dtype=np.int64)  # 0: BERT's [PAD], masked out
            mask = np.zeros((len(batch), width), dtype=np.int64)
            for row, e in enumerate(encoded):
                ids[row, : len(e.ids)] = e.ids
                mask[row, : len(e.ids)] = 1
            feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
            hidden = session.run(None, feeds)[0]  # (batch, tokens, dim)
            weights = mask[:, :, None].astype(np.float32)
            pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
            if normalize:
                norms = np.linalg.norm(pooled, axis=1, keepdims=True)
                pooled = pooled / np.maximum(norms, 1e-12)
            out[start : start + len(batch)] = pooled
        return out

    def embed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Embed texts; returns ``(len(texts), d)`` float32."""
        return self._encode(list(texts), self.document_prompt)

    def embed_query(self, text: str) -> NDArray[np.float32]:
        """Embed one query; returns ``(d,)`` float32."""
        return self._encode([text], self.query_prompt)[0]


def _version_tuple(version: str) -> tuple[int, ...]:
    """``(2, 13)`` for ``"2.13.0+cpu"``, ``(2, 6)`` for ``"2.6.0rc1"``: the major and minor."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else ()


def _positive_int(value: object, limit: int) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= limit:
        return value
    return None


def _read_meta(directory: Path) -> dict[str, Any]:
    """The validated ``raptor-onnx.json`` of an export directory (data: nothing else is taken)."""
    fix = (
        f"write it with `raptor export-onnx --out {directory}` "
        "(raptor_core.backends.onnx.export_onnx)"
    )
    missing = [n for n in ("model.onnx", "tokenizer.json", _META) if not (directory / n).is_file()]
    if missing:
        msg = f"{directory} is not an ONNX export (missing {', '.join(missing)}): {fix}"
        raise EmbeddingError(msg)
    try:
        raw = json.loads((directory / _META).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        # ValueError covers undecodable bytes, bad JSON and integers past Python's digit
        # limit; RecursionError, nesting deeper than the parser's stack.
        msg = f"cannot read {directory / _META}: {type(exc).__name__}: {exc}; {fix}"
        raise EmbeddingError(msg) from exc
    if not isinstance(raw, dict) or raw.get("format") != ONNX_FORMAT:
        msg = f"{directory / _META} is not format {ONNX_FORMAT}: {fix}"
        raise EmbeddingError(msg)
    name, normalize = raw.get("model_name_or_path"), raw.get("normalize")
    dim, length = (
        _positive_int(raw.get("dim"), 65536),
        _positive_int(raw.get("max_seq_length"), _MAX_SEQ_LENGTH),
    )
    ok = (
        isinstance(name, str)
        and 0 < len(name) <= 300
        and dim is not None
        and length is not None
        and isinstance(normalize, bool)
    )
    if not ok:
        msg = f"{directory / _META} holds invalid values: {fix}"
        raise EmbeddingError(msg)
    return {
        "model_name_or_path": name,
        "dim": dim,
        "max_seq_length": length,
        "normalize": normalize,
    }
