"""``raptor add``, ``raptor update`` and ``raptor remove``: change a saved tree in place.

Each loads the tree, applies :meth:`TreeBuilder.insert`, :meth:`~TreeBuilder.update` or
:meth:`~TreeBuilder.delete` with the parameters the tree was built with, and saves it back
atomically (a crash before or during the save leaves the previous tree).  Summaries are
cached in ``TREE/.raptor-cache`` as ``raptor build`` does, so an interrupted run that is
repeated pays only for what it had not received.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from raptor_core._argtypes import int_range, positive_float
from raptor_core.cli import models
from raptor_core.cli._common import TREE_FILE, path_text, safe
from raptor_core.cli.build import (
    _print_usage,
    _progress_bars,
    add_budget_arguments,
    add_input_arguments,
    budget_from_args,
    print_spend,
    read_inputs,
)
from raptor_core.exceptions import InvalidInputError, InvalidParameterError

__all__ = ["add_parsers", "run_change"]

#: Builder parameters taken from the tree's record (``TreeBuilder.get_params``).
_FROM_TREE = (
    "chunk_max_tokens",
    "summary_max_tokens",
    "cluster_max_tokens",
    "max_layers",
    "min_layer_size",
    "random_state",
)


def _summarizer_default(tree: Any) -> tuple[str, str | None]:
    """``(llm, model)`` of the tree's summariser record: keep summarising the way it was."""
    record = tree.params.get("summarizer")
    # A tree built through the Batch API is updated per call: the same requests, and an
    # update is a few summaries, not worth hours of waiting.
    openai_classes = (".OpenAISummarizer", ".OpenAIBatchSummarizer")
    if isinstance(record, dict) and str(record.get("class", "")).endswith(openai_classes):
        model = record.get("model")
        return "openai", model if isinstance(model, str) else None
    return "extractive", None


def _builder(tree: Any, args: argparse.Namespace, progress: Any, cache: Any) -> Any:
    from raptor_core.build.builder import TreeBuilder

    llm, model = _summarizer_default(tree)
    args.llm = args.llm or llm
    args.llm_model = args.llm_model or model or "gpt-4o-mini"
    # build_models only picks the summariser here: the embedder is the tree's.
    summary_args = argparse.Namespace(
        **{**vars(args), "embedder": None, "embed_model": None},
        embed_provider="sentence-transformers",
    )
    _, summarizer = models.build_models(summary_args)
    embedder = models.query_embedder(tree, args)
    params: dict[str, Any] = {}
    for name in _FROM_TREE:
        value = tree.params.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            params[name] = value
    for component in (embedder, summarizer):
        check = getattr(component, "check_settings", None)
        if callable(check):
            check()  # a missing key fails now, before anything is embedded
    return TreeBuilder(
        embedder,
        summarizer,
        max_concurrency=args.max_concurrency,
        n_threads=args.threads,
        on_progress=progress,
        cache=cache,
        budget=budget_from_args(args),
        **params,
    )


def run_change(args: argparse.Namespace) -> int:
    """Run ``raptor add|update|remove`` with parsed ``args``; returns the exit status."""
    from raptor_core.build.cache import BuildCache
    from raptor_core.tree import Tree

    started = time.perf_counter()
    directory = Path(args.tree)
    if not (directory / TREE_FILE).is_file():
        msg = f"{path_text(directory)} holds no tree ({TREE_FILE}): build one with raptor build"
        raise InvalidParameterError(msg)
    tree = Tree.load(directory)
    op = args.command
    # Read and check every input before any model is loaded or called.
    docs = read_inputs(args, args.inputs) if op in {"add", "update"} else None
    if docs is not None:
        _check_same_files(tree, docs)
    budget_from_args(args)  # a flag mistake fails before any model is loaded
    show = sys.stderr.isatty() and not args.quiet and not args.no_progress
    cache = BuildCache(directory / ".raptor-cache")
    try:
        with _progress_bars(show) as bars:
            builder = _builder(tree, args, bars, cache)
            if op == "add":
                result = builder.insert(tree, docs)
            elif op == "update":
                result = builder.update(tree, docs)
            else:
                result = builder.delete(tree, args.inputs)
    finally:
        cache.close()
    if result.report.changed:
        result.tree.save(directory)
    if op == "update" and docs is not None:
        _note_files_gone(args, tree, docs)
    if args.quiet:
        return 0
    _print_report(directory, op, result, time.perf_counter() - started)
    print_spend(bars)
    return 0


def _file_documents(tree: Any) -> dict[str, str]:
    """The tree's documents read from files that still exist, by their real path."""
    known: dict[str, str] = {}
    for doc_id in tree.doc_ids:
        if os.path.isfile(doc_id):
            known.setdefault(os.path.realpath(doc_id), doc_id)
    return known


def _check_same_files(tree: Any, docs: list[Any]) -> None:
    """Refuse a file the tree holds already under another spelling of its path.

    A file's document id is its path as given (``ud/bees.txt``); the same file given as
    ``/home/me/ud/bees.txt`` or ``ud/../ud/bees.txt`` would be added a second time instead
    of replacing the first.
    """
    have = set(tree.doc_ids)
    # New ids read from files (a record's id is not a path): the only ones either check is for.
    new_files = [d for d in docs if d.doc_id not in have and d.metadata.get("source") == d.doc_id]
    known: dict[str, str] | None = None
    for doc in new_files:
        if known is None:
            known = _file_documents(tree)
        same = known.get(os.path.realpath(doc.doc_id))
        if same is not None:
            msg = (
                f"{doc.doc_id} is the tree's document {same!r} under another path: pass it "
                f"as {same} so that it is replaced, not added a second time"
            )
            raise InvalidInputError(msg)
    _check_build_directory(tree, new_files)


def _relative_file_ids(tree: Any) -> list[str]:
    """The ids of the tree's file documents that are relative paths (records excluded)."""
    ids: dict[str, None] = {}
    for leaf in tree.leaves:
        doc_id = leaf.doc_id
        is_file = doc_id is not None and leaf.metadata.get("source") == doc_id
        if is_file and not os.path.isabs(doc_id):
            ids.setdefault(doc_id, None)
    return list(ids)


def _check_build_directory(tree: Any, given: list[Any]) -> None:
    """Refuse a file that looks like one of the tree's, run from another working directory.

    A relative id (``docs/a.txt``) is relative to the directory the tree was built from,
    which the tree does not record.  From elsewhere, the same file given as ``a.txt`` or
    ``../proj/docs/a.txt`` is a new id: it would be added beside the old copy, which stays.
    When none of the tree's relative ids exists from here (so this is evidently not the
    directory they were written from), a given file with the name of one of them is
    refused rather than guessed at.  ``given``: the files whose ids the tree does not hold.
    """
    if not given:
        return
    relative = _relative_file_ids(tree)
    if not relative or any(os.path.exists(doc_id) for doc_id in relative):
        return
    by_name: dict[str, list[str]] = {}
    for doc_id in relative:
        by_name.setdefault(os.path.basename(doc_id), []).append(doc_id)
    for doc in given:
        same_name = by_name.get(os.path.basename(doc.doc_id))
        if not same_name:
            continue
        real = os.path.realpath(doc.doc_id)
        # The id that ends the file's real path names the directory the build ran in.
        where = "the directory the tree was built from"
        recorded = same_name[0]
        for doc_id in same_name:
            tail = os.sep + os.path.normpath(doc_id)
            if real.endswith(tail):
                recorded, where = doc_id, path_text(Path(real[: -len(tail)] or os.sep))
                break
        msg = (
            f"{doc.doc_id} looks like the tree's document {recorded!r} given from another "
            "directory: a file's id is its path as given at build time, and none of the "
            f"tree's relative ids exists from here; run the command from {where} "
            f"with the same paths ({recorded}) so that it is replaced, not added a second "
            f"time (if it is another file, raptor remove {recorded} first)"
        )
        raise InvalidInputError(msg)


def _note_files_gone(args: argparse.Namespace, tree: Any, docs: list[Any]) -> None:
    """Say which documents under an updated folder have no file any more.

    ``update`` adds and replaces; it never removes.  A file deleted from a folder would
    otherwise stay in the tree with no word, and the tree would look in step with the folder.
    """
    read = {doc.doc_id for doc in docs}
    for raw in args.inputs:
        if not Path(raw).is_dir():
            continue
        prefix = path_text(Path(raw)).rstrip("/") + "/"
        gone = sorted(
            doc_id
            for doc_id in tree.doc_ids
            if doc_id.startswith(prefix) and doc_id not in read and not os.path.exists(doc_id)
        )
        if gone:
            shown = " ".join(gone[:3]) + (" ..." if len(gone) > 3 else "")
            print(
                safe(
                    f"raptor update: note: {len(gone)} document(s) of the tree under {prefix} "
                    f"have no file any more; update never removes: raptor remove "
                    f"{path_text(Path(args.tree))} {shown}"
                ),
                file=sys.stderr,
            )


def _print_report(directory: Path, op: str, result: Any, seconds: float) -> None:
    r = result.report
    docs = []
    for label, ids in (
        ("added", r.docs_added),
        ("replaced", r.docs_replaced),
        ("removed", r.docs_removed),
        ("unchanged", r.docs_unchanged),
    ):
        if ids:
            docs.append(f"{len(ids)} {label}")
    print(safe(f"{op} {path_text(directory)}: documents {', '.join(docs) or 'none'}"))
    if not r.changed:
        print("nothing changed: the tree was not rewritten")
        return
    sizes = ", ".join(f"L{i}={len(result.tree.layer(i))}" for i in range(result.tree.num_layers))
    print(
        f"nodes: {len(r.nodes_added)} added, {len(r.nodes_removed)} removed, "
        f"{len(r.nodes_changed)} changed; nodes per layer: {sizes}"
    )
    print(
        f"work: {r.summary_calls} summaries ({r.summary_tokens} tokens in), "
        f"{r.embedded_chunks} chunks and {r.embedded_summaries} summaries embedded, "
        f"{r.clusters_split} clusters split, {r.reclustered_subtrees} re-clustered"
    )
    print(f"time: update {r.seconds:.2f}s, total {seconds:.2f}s")
    _print_usage({"layers": [], "usage": r.usage})


def add_parsers(sub: Any) -> None:
    """Register ``add``, ``update`` and ``remove`` on the ``raptor`` command's subparsers."""
    positive = int_range(1)
    helps = {
        "add": ("add documents to a saved tree without rebuilding it", "files, folders or .jsonl"),
        "update": (
            "replace documents of a saved tree by id (unchanged ones cost nothing; new ids are added)",
            "files, folders or .jsonl",
        ),
        "remove": ("remove documents from a saved tree by id", "document ids (see raptor inspect)"),
    }
    for name, (text, inputs) in helps.items():
        p = sub.add_parser(name, help=text)
        p.add_argument("tree", help="the tree's directory (rewritten atomically)")
        p.add_argument(
            "inputs", nargs="+", metavar="DOC_ID" if name == "remove" else "PATH", help=inputs
        )
        if name != "remove":
            add_input_arguments(p)
        p.add_argument(
            "--embedder",
            default=None,
            metavar="SPEC",
            help="the tree's embedding model when it cannot be re-created from the tree "
            "(NAME_OR_PATH or openai:MODEL)",
        )
        llm = p.add_argument_group("models and services (see docs/llm-services.md)")
        llm.add_argument(
            "--llm",
            choices=["extractive", "openai"],
            default=None,
            help="summariser (default: the kind the tree was built with)",
        )
        llm.add_argument("--llm-model", default=None, help="chat model (default: the tree's)")
        llm.add_argument("--llm-base-url", default=None, help="OpenAI-compatible API root")
        llm.add_argument("--prompt-file", default=None, help="summary prompt with {context}")
        llm.add_argument("--embed-base-url", default=None, help="embeddings API root")
        llm.add_argument(
            "--max-concurrency", type=positive, default=4, help="requests in flight (4)"
        )
        llm.add_argument(
            "--timeout", type=positive_float, default=60.0, help="seconds per request (60)"
        )
        add_budget_arguments(p)
        p.add_argument("--threads", type=positive, default=None, help="cap torch/BLAS threads")
        p.add_argument("--no-progress", action="store_true", help="no progress bars")
        p.add_argument("--quiet", "-q", action="store_true", help="print nothing on success")
        p.set_defaults(func=run_change, embed_model=None)
