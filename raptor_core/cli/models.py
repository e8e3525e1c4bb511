"""The models a command line asks for: embedders, the summariser, the search LLM."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from raptor_core.cli._common import check_unicode
from raptor_core.exceptions import EmbeddingError, InvalidParameterError

__all__ = ["build_models", "make_embedder", "parse_embedder_spec", "query_embedder", "search_llm"]


def parse_embedder_spec(spec: str) -> tuple[str, str]:
    """``--embedder SPEC`` -> (provider, model).

    ``openai:MODEL`` is an OpenAI-compatible embeddings API (``--embed-base-url``);
    ``onnx:DIR`` a directory written by ``raptor export-onnx`` (queries only);
    ``sentence-transformers:NAME_OR_PATH`` or a bare ``NAME_OR_PATH`` is a local
    sentence-transformers model (a hub name or a directory).
    """
    provider, sep, rest = spec.partition(":")
    if sep and provider in {"openai", "sentence-transformers", "onnx"}:
        model = rest
    else:
        provider, model = "sentence-transformers", spec
    if not model.strip():
        msg = (
            f"--embedder {spec!r} names no model: use NAME_OR_PATH (sentence-transformers) "
            "or openai:MODEL"
        )
        raise InvalidParameterError(msg)
    check_unicode(model, "--embedder")
    return provider, model


def make_embedder(
    provider: str, model: str, args: argparse.Namespace, *, dimensions: int | None = None
) -> Any:
    """An embedder of ``provider`` (``openai`` or ``sentence-transformers``) for ``model``."""
    if provider == "openai":
        from raptor_core.backends.openai import OpenAIEmbedder

        return OpenAIEmbedder(
            model,
            base_url=args.embed_base_url or args.llm_base_url,
            max_concurrency=getattr(args, "max_concurrency", 4),
            timeout=args.timeout,
            dimensions=dimensions,
        )
    if provider == "onnx":
        from raptor_core.backends.onnx import OnnxEmbedder, export_info

        directory = Path(model).expanduser()
        if not directory.is_dir():
            msg = (
                f"--embedder onnx:{model}: no such directory: write an export there with "
                f"`raptor export-onnx --out {model}`"
            )
            raise InvalidParameterError(msg)
        embedder = OnnxEmbedder(directory)
        if export_info(directory) is None:
            # A folder that holds no export is the command line's mistake, as a missing one
            # is; the embedder's own check says which files are missing or what is wrong.
            try:
                _ = embedder.dim
            except EmbeddingError as exc:
                msg = f"--embedder onnx:{model}: {exc}"
                raise InvalidParameterError(msg) from exc
        return embedder
    from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder

    # A hub name ("org/name") and a relative folder look alike; a path written as one (from
    # the root, the home folder or the current folder) that is not there is a typing error.
    if model.startswith(("/", "~", "./", "../")) and not Path(model).expanduser().exists():
        msg = (
            f"--embedder {model}: no such file or directory: give the folder of a "
            "sentence-transformers model, or a model name"
        )
        raise InvalidParameterError(msg)
    return SentenceTransformerEmbedder(model)


def build_models(args: argparse.Namespace) -> tuple[Any, Any]:
    """The embedder and summariser the build flags ask for (None: the builder's defaults)."""
    from raptor_core.cli.readers import read_text

    embedder: Any = None
    summarizer: Any = None
    if args.embedder:
        if args.embed_model or args.embed_provider != "sentence-transformers":
            msg = "--embedder replaces --embed-model and --embed-provider: pass only --embedder"
            raise InvalidParameterError(msg)
        embedder = make_embedder(*parse_embedder_spec(args.embedder), args)
    elif args.embed_provider == "openai":
        if args.embed_model:
            msg = "--embed-model names a sentence-transformers model: use --openai-embed-model"
            raise InvalidParameterError(msg)
        embedder = make_embedder("openai", args.openai_embed_model, args)
    elif args.embed_model:
        embedder = make_embedder("sentence-transformers", args.embed_model, args)
    if args.llm == "openai":
        from raptor_core.backends.openai import OpenAISummarizer
        from raptor_core.types import DEFAULT_SUMMARY_PROMPT

        prompt = DEFAULT_SUMMARY_PROMPT
        if args.prompt_file:
            prompt = read_text(Path(args.prompt_file))
        if getattr(args, "batch", False):
            from raptor_core.backends.openai_batch import OpenAIBatchSummarizer

            summarizer = OpenAIBatchSummarizer(
                args.llm_model,
                prompt=prompt,
                base_url=args.llm_base_url,
                timeout=args.timeout,
                poll_interval=args.batch_poll_interval,
            )
        else:
            summarizer = OpenAISummarizer(
                args.llm_model, prompt=prompt, base_url=args.llm_base_url, timeout=args.timeout
            )
    elif getattr(args, "batch", False):
        msg = "--batch sends summaries through the OpenAI Batch API: add --llm openai"
        raise InvalidParameterError(msg)
    elif args.prompt_file:
        msg = "--prompt-file needs an LLM summariser: add --llm openai"
        raise InvalidParameterError(msg)
    return embedder, summarizer


def query_embedder(tree: Any, args: argparse.Namespace) -> Any:
    """The embedder for a query: ``--embedder``/``--embed-model``, else the tree's record.

    The record is only ever re-created from the closed allowlist of
    :mod:`raptor_core.components`; anything else must be named on the command line.  When
    the record is the packaged all-MiniLM-L6-v2 and ``raptor export-onnx`` has written its
    export (:func:`~raptor_core.backends.onnx.default_onnx_dir`), the query is embedded
    through ONNX Runtime instead: the same vectors, without importing torch.
    """
    from raptor_core.components import embedder_for_tree

    if args.embedder and args.embed_model:
        msg = "--embed-model is the old name of --embedder: pass only one of them"
        raise InvalidParameterError(msg)
    spec = args.embedder or args.embed_model
    embedder = None
    if spec:
        provider, model = parse_embedder_spec(spec)
        dimensions = None
        record = tree.params.get("embedder")
        if provider == "openai" and isinstance(record, dict) and record.get("model") == model:
            # A shortened text-embedding-3 tree needs the same `dimensions` (a number, safe).
            recorded = record.get("dimensions")
            if isinstance(recorded, int) and not isinstance(recorded, bool):
                dimensions = recorded if recorded == tree.dim else None
        embedder = make_embedder(provider, model, args, dimensions=dimensions)
    if embedder is None and not getattr(args, "no_onnx", False):
        embedder = _default_onnx(tree)
    return embedder_for_tree(tree, embedder, pass_as="--embedder")


def _default_onnx(tree: Any) -> Any:
    """An :class:`OnnxEmbedder` for a tree built with the packaged default model, if exported."""
    from importlib.util import find_spec

    from raptor_core.backends.sentence_transformers import DEFAULT_MODEL
    from raptor_core.components import recreate_embedder

    record = tree.params.get("embedder")
    if not isinstance(record, dict) or not str(record.get("class", "")).endswith(
        ".SentenceTransformerEmbedder"
    ):
        return None
    name = str(record.get("model_name_or_path", "")).removeprefix("sentence-transformers/")
    if name != DEFAULT_MODEL or find_spec("onnxruntime") is None or find_spec("tokenizers") is None:
        return None
    from raptor_core.backends.onnx import OnnxEmbedder, default_onnx_dir, export_info

    directory = default_onnx_dir()
    info = export_info(directory)
    if info is None:
        return None
    if str(info["model_name_or_path"]).removeprefix("sentence-transformers/") != DEFAULT_MODEL:
        return None  # an export of another model: never mix vectors of two models
    # The record's own checks (allowlist, prompts, normalize) apply; only the runtime differs.
    recorded = recreate_embedder(record, dim=tree.dim if len(tree) else None, pass_as="--embedder")
    return OnnxEmbedder(
        directory,
        normalize=getattr(recorded, "normalize", None),
        query_prompt=getattr(recorded, "query_prompt", None),
        document_prompt=getattr(recorded, "document_prompt", None),
    )


def search_llm(args: argparse.Namespace) -> Any:
    """The LLM for ``--strategy llm|hybrid``: ``--llm openai`` (any OpenAI-compatible server)."""
    if getattr(args, "llm", None) != "openai":
        return None
    from raptor_core.backends.openai import OpenAIChatLLM

    return OpenAIChatLLM(args.llm_model, base_url=args.llm_base_url, timeout=args.timeout)
