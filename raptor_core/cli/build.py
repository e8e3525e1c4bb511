"""``raptor build``: read documents, build a tree, save it."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from raptor_core._argtypes import MAX_SEED, int_range, positive_float
from raptor_core.cli import models
from raptor_core.cli._common import TREE_FILE, one_line, path_text, safe
from raptor_core.cli.readers import read_documents
from raptor_core.exceptions import InvalidParameterError

__all__ = ["add_parser", "run_build"]


@contextmanager
def _progress_bars(enabled: bool) -> Iterator[Any]:
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description:<10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=False,
    ) as progress:
        tasks: dict[str, Any] = {}

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(stage, total=total)
            progress.update(tasks[stage], completed=done, total=total)

        yield update


def _print_estimate(estimate: Any) -> None:
    print(
        f"dry run: {estimate.documents} documents, {estimate.chunks} chunks; "
        "no model was called (projected with the typical cluster size, see docs/llm-services.md)"
    )
    print(
        f"{'layer':>5} {'nodes':>7} {'llm calls':>10} {'prompt tok':>11} {'compl tok':>10} "
        f"{'embed tok':>10}"
    )
    for x in estimate.layers:
        print(
            f"{x.layer:>5} {x.nodes:>7} {x.calls:>10} {x.prompt_tokens:>11} "
            f"{x.completion_tokens:>10} {x.embed_tokens:>10}"
        )
    print(
        f"{'total':>5} {'':>7} {estimate.calls:>10} {estimate.prompt_tokens:>11} "
        f"{estimate.completion_tokens:>10} {estimate.embed_tokens:>10}"
    )


def _print_usage(info: Any) -> None:
    rows = [(x["layer"], x.get("usage", {})) for x in info["layers"]]
    total = info.get("usage", {})
    shown = ("calls", "cache_hits", "retries", "prompt_tokens", "completion_tokens")
    if not any(counts.get(name, 0) for counts in total.values() for name in shown):
        return  # local models only: there is nothing to pay for, so no cost table
    print(
        f"{'layer':>5} {'llm calls':>10} {'cached':>7} {'retries':>8} {'prompt tok':>11} "
        f"{'compl tok':>10} {'embed calls':>12} {'embed tok':>10}"
    )
    for label, usage in [*rows, ("total", total)]:
        llm, emb = usage.get("summarize", {}), usage.get("embed", {})
        print(
            f"{label:>5} {llm.get('calls', 0):>10} {llm.get('cache_hits', 0):>7} "
            f"{llm.get('retries', 0) + emb.get('retries', 0):>8} {llm.get('prompt_tokens', 0):>11} "
            f"{llm.get('completion_tokens', 0):>10} {emb.get('calls', 0):>12} "
            f"{emb.get('prompt_tokens', 0):>10}"
        )


def _check_out(out: Path, *, overwrite: bool) -> None:
    """Refuse ``--out`` before any work: a file, or a tree without ``--overwrite``."""
    if out.exists() and not out.is_dir():
        msg = f"--out {path_text(out)} is a file: give a directory for the tree"
        raise InvalidParameterError(msg)
    if (out / TREE_FILE).exists() and not overwrite:
        msg = (
            f"--out {path_text(out)} already holds a tree: pass --overwrite to replace it, "
            "or choose another directory"
        )
        raise InvalidParameterError(msg)


def _probe_writable(out: Path) -> None:
    """Create ``out`` and write a scratch file in it, so an unwritable output fails now.

    Raises:
        OSError: read-only file system, no permission, no space (reported by ``main``).
    """
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=out) as probe:
        probe.write(b"\0" * 4096)
        probe.flush()
        os.fsync(probe.fileno())


def read_inputs(args: argparse.Namespace, paths: list[str]) -> list[Any]:
    """The documents named on the command line; each file skipped in a folder is one line.

    ``args`` carries the input options of :func:`add_input_arguments`.
    """
    skipped = 0
    command = f"raptor {args.command}"

    def report_skip(path: Path, reason: str) -> None:
        nonlocal skipped
        skipped += 1
        print(one_line(f"{command}: skipped {path_text(path)}: {reason}"), file=sys.stderr)

    docs = read_documents(
        paths,
        text_field=args.text_field,
        include=args.glob or (),
        exclude=args.exclude or (),
        on_skip=report_skip,
    )
    if skipped:
        print(
            f"{command}: skipped {skipped} file(s), read {len(docs)} document(s)",
            file=sys.stderr,
        )
    return docs


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """``--text-field``, ``--glob`` and ``--exclude``: how files become documents."""
    inputs = parser.add_argument_group("inputs (see docs/cli.md)")
    inputs.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help=".jsonl field / .csv column holding the text (default text); the others "
        "become metadata",
    )
    inputs.add_argument(
        "--glob",
        action="append",
        metavar="PATTERN",
        help="in folders, read only files matching PATTERN (repeatable), e.g. '*.md'",
    )
    inputs.add_argument(
        "--exclude",
        action="append",
        metavar="PATTERN",
        help="in folders, leave out files matching PATTERN (repeatable), e.g. 'drafts/*'",
    )


def _ray_executor(address: str | None) -> Any:
    """The executor for ``--ray ADDRESS`` (``local``: a Ray started for this build), or None."""
    if address is None:
        return None
    from raptor_core.build.ray_executor import RayExecutor

    executor = RayExecutor(None if address == "local" else address)
    executor._ray()  # import and connect now: a missing extra or a wrong address fails early
    # The command draws its own progress: keep Ray's per-dataset reports off the terminal
    # (they stay in Ray's session logs).
    import logging

    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False
    for name in ("ray", "ray.data"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return executor


def run_build(args: argparse.Namespace) -> int:
    """Run ``raptor build`` with parsed ``args``; returns the exit status."""
    from raptor_core.build.builder import TreeBuilder

    started = time.perf_counter()
    out = Path(args.out)
    if not args.dry_run:
        _check_out(out, overwrite=args.overwrite)
    docs = read_inputs(args, args.paths)
    embedder, summarizer = models.build_models(args)
    builder_args: dict[str, Any] = {
        "chunk_max_tokens": args.chunk_tokens,
        "summary_max_tokens": args.summary_tokens,
        "cluster_max_tokens": args.cluster_max_tokens,
        "max_layers": args.max_layers,
        "max_concurrency": args.max_concurrency,
        "n_threads": args.threads,
        "random_state": args.seed,
    }
    if args.dry_run:
        _print_estimate(TreeBuilder(embedder, summarizer, **builder_args).estimate(docs))
        return 0
    for component in (embedder, summarizer):
        check = getattr(component, "check_settings", None)
        if callable(check):
            check()  # a missing key fails now, not after the leaves are embedded
    _probe_writable(out)  # before the models run: a read-only or full --out fails now
    from raptor_core.build.cache import BuildCache

    cache = BuildCache(out / ".raptor-cache")
    if not args.resume:
        cache.clear()  # --no-resume: pay for everything again, but stay resumable
    show = sys.stderr.isatty() and not args.quiet and not args.no_progress
    executor = _ray_executor(args.ray)
    with _progress_bars(show) as progress:
        builder = TreeBuilder(
            embedder, summarizer, progress=progress, cache=cache, executor=executor, **builder_args
        )
        try:
            tree = builder.build(docs)
        finally:
            cache.close()
            if executor is not None:
                executor.close()
    persist_start = time.perf_counter()
    tree.save(out)
    persist = time.perf_counter() - persist_start
    total = time.perf_counter() - started
    if args.quiet:
        return 0
    info = tree.build_info
    layers = ", ".join(f"L{x['layer']}={x['nodes']}" for x in info["layers"])
    timings = dict(info["timings"], persist=round(persist, 4))
    print(
        safe(
            f"built {path_text(out)}: {info['documents']} documents, {info['chunks']} chunks, "
            f"nodes per layer: {layers}"
        )
    )
    print(
        "time: " + ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()) + f", total {total:.2f}s"
    )
    print(f"stopped: {info['stop_reason']}")
    _print_usage(info)
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``build`` on the ``raptor`` command's subparsers."""
    positive = int_range(1)
    build = sub.add_parser(
        "build", help="build a tree from files and folders (text, Markdown, HTML, PDF, ...)"
    )
    build.add_argument(
        "paths",
        nargs="+",
        help="files or folders: .txt .md .rst .html .pdf .docx, and records in .jsonl .csv .tsv",
    )
    add_input_arguments(build)
    build.add_argument("--out", required=True, help="directory to write the tree to")
    build.add_argument("--overwrite", action="store_true", help="replace the tree already in --out")
    build.add_argument(
        "--chunk-tokens", type=positive, default=100, help="leaf chunk size (default 100)"
    )
    build.add_argument(
        "--summary-tokens", type=positive, default=100, help="summary length (default 100)"
    )
    build.add_argument(
        "--cluster-max-tokens", type=positive, default=3500, help="max tokens summarised at once"
    )
    build.add_argument(
        "--max-layers", type=int_range(0), default=5, help="max summary layers (default 5)"
    )
    build.add_argument(
        "--seed",
        type=int_range(0, MAX_SEED),
        default=0,
        help="random_state for clustering (default 0)",
    )
    build.add_argument(
        "--threads", type=positive, default=None, help="cap torch/BLAS/numba threads"
    )
    build.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="chunk, embed and summarise on a Ray cluster: auto, HOST:PORT, ray://HOST:PORT, "
        "or local (start one here); needs the [ray] extra",
    )
    build.add_argument(
        "--embedder",
        default=None,
        metavar="SPEC",
        help="embedding model: NAME_OR_PATH (sentence-transformers) or openai:MODEL",
    )
    build.add_argument(
        "--embed-model", default=None, help="sentence-transformers model name or path"
    )
    llm = build.add_argument_group("models and services (see docs/llm-services.md)")
    llm.add_argument(
        "--llm",
        choices=["extractive", "openai"],
        default="extractive",
        help="summariser: offline extractive (default) or an OpenAI-compatible chat model",
    )
    llm.add_argument("--llm-model", default="gpt-4o-mini", help="chat model for --llm openai")
    llm.add_argument(
        "--llm-base-url",
        default=None,
        help="OpenAI-compatible API root, e.g. http://localhost:11434/v1 ($OPENAI_BASE_URL)",
    )
    llm.add_argument("--prompt-file", default=None, help="summary prompt template with {context}")
    llm.add_argument(
        "--embed-provider",
        choices=["sentence-transformers", "openai"],
        default="sentence-transformers",
        help="embedder: local sentence-transformers (default) or an OpenAI-compatible server",
    )
    llm.add_argument(
        "--openai-embed-model",
        default="text-embedding-3-small",
        help="embedding model for --embed-provider openai",
    )
    llm.add_argument("--embed-base-url", default=None, help="embeddings API root (--llm-base-url)")
    llm.add_argument("--max-concurrency", type=positive, default=4, help="requests in flight (4)")
    llm.add_argument(
        "--timeout", type=positive_float, default=60.0, help="seconds per request (60)"
    )
    llm.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse answers cached in OUT/.raptor-cache by an earlier or interrupted build "
        "(default); --no-resume empties that cache first",
    )
    llm.add_argument(
        "--dry-run", action="store_true", help="estimate calls and tokens; call nothing"
    )
    build.add_argument("--no-progress", action="store_true", help="no progress bars")
    build.add_argument("--quiet", "-q", action="store_true", help="print nothing on success")
    build.set_defaults(func=run_build)
    return build
