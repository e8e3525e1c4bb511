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
from typing import TYPE_CHECKING, Any

from raptor_core._argtypes import MAX_SEED, finite_float, int_range, positive_float
from raptor_core.cli import models
from raptor_core.cli._common import TREE_FILE, one_line, path_text, safe
from raptor_core.cli.readers import read_documents
from raptor_core.exceptions import InvalidParameterError

__all__ = [
    "ProgressBars",
    "add_budget_arguments",
    "add_parser",
    "budget_from_args",
    "progress_fields",
    "run_build",
]

if TYPE_CHECKING:
    from raptor_core.build.budget import LLMBudget
    from raptor_core.build.progress import BuildProgress


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0 (a price)."""
    value = finite_float(text)
    if value < 0:
        msg = f"expected a number >= 0, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return value


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def progress_fields(event: BuildProgress) -> dict[str, str]:
    """The ETA and cost texts a progress bar shows for ``event``."""
    eta = "eta -:--:--" if event.eta_s is None else f"eta {_clock(event.eta_s)}"
    cost = ""
    if event.spent_usd is not None:
        cost = f"${event.spent_usd:.4f}"
        if event.max_cost_usd is not None:
            cost += f" of ${event.max_cost_usd:g}"
    elif event.max_summary_tokens is not None:
        used = event.prompt_tokens + event.completion_tokens
        cost = f"{used} of {event.max_summary_tokens} tok"
    return {"eta": eta, "cost": cost}


class ProgressBars:
    """The ``on_progress`` callback of a command: bars on a terminal, and the last figures."""

    def __init__(self, progress: Any = None) -> None:
        self._progress = progress
        self._tasks: dict[str, Any] = {}
        self.last: BuildProgress | None = None

    def __call__(self, event: BuildProgress) -> None:
        """Keep ``event`` and move its stage's bar."""
        self.last = event
        if self._progress is None:
            return
        fields = progress_fields(event)
        if event.stage not in self._tasks:
            self._tasks[event.stage] = self._progress.add_task(
                event.stage, total=event.total, **fields
            )
        self._progress.update(
            self._tasks[event.stage], completed=event.done, total=event.total, **fields
        )


@contextmanager
def _progress_bars(enabled: bool, console: Any = None) -> Iterator[ProgressBars]:
    if not enabled:
        yield ProgressBars()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description:<10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        # The builder's own ETA and spend (BuildProgress), the figures library users get.
        TextColumn("{task.fields[eta]}"),
        TextColumn("{task.fields[cost]}"),
        transient=False,
        console=console,
    ) as progress:
        yield ProgressBars(progress)


def add_budget_arguments(parser: argparse.ArgumentParser) -> None:
    """``--max-cost-usd``, ``--max-summary-tokens``, ``--price-prompt``, ``--price-completion``."""
    group = parser.add_argument_group("LLM budget (see docs/cli.md)")
    group.add_argument(
        "--max-cost-usd",
        type=positive_float,
        default=None,
        metavar="USD",
        help="stop before the summary call that would take spend past USD (needs the prices)",
    )
    group.add_argument(
        "--max-summary-tokens",
        type=int_range(1),
        default=None,
        metavar="N",
        help="stop before the summary call that would take prompt+completion tokens past N",
    )
    group.add_argument(
        "--price-prompt",
        type=non_negative_float,
        default=None,
        metavar="USD",
        help="the chat model's price per million prompt tokens (shows the cost)",
    )
    group.add_argument(
        "--price-completion",
        type=non_negative_float,
        default=None,
        metavar="USD",
        help="the chat model's price per million completion tokens",
    )


def budget_from_args(args: argparse.Namespace) -> LLMBudget | None:
    """The :class:`LLMBudget` the budget flags ask for (None when none is given)."""
    from raptor_core.build.budget import LLMBudget, Pricing

    prices = (args.price_prompt, args.price_completion)
    if (prices[0] is None) != (prices[1] is None):
        msg = (
            "--price-prompt and --price-completion go together: give both (USD per million tokens)"
        )
        raise InvalidParameterError(msg)
    pricing = (
        Pricing(prompt_usd_per_million=prices[0], completion_usd_per_million=prices[1])
        if prices[0] is not None and prices[1] is not None
        else None
    )
    if args.max_cost_usd is not None and pricing is None:
        msg = (
            "--max-cost-usd needs the model's prices: add --price-prompt and --price-completion "
            "(USD per million tokens), or cap tokens with --max-summary-tokens"
        )
        raise InvalidParameterError(msg)
    if pricing is None and args.max_cost_usd is None and args.max_summary_tokens is None:
        return None
    return LLMBudget(
        max_cost_usd=args.max_cost_usd, max_summary_tokens=args.max_summary_tokens, pricing=pricing
    )


def print_spend(bars: ProgressBars) -> None:
    """One line with what the summary calls cost, when a budget metered them."""
    event = bars.last
    if event is None or (
        event.spent_usd is None and event.max_cost_usd is None and event.max_summary_tokens is None
    ):
        return
    cost = f"${event.spent_usd:.4f} for " if event.spent_usd is not None else ""
    caps = []
    if event.max_cost_usd is not None:
        caps.append(f"${event.max_cost_usd:g}")
    if event.max_summary_tokens is not None:
        caps.append(f"{event.max_summary_tokens} tokens")
    cap = f" (cap: {', '.join(caps)})" if caps else ""
    print(
        f"llm cost: {cost}{event.summary_calls} summary calls, {event.prompt_tokens} prompt + "
        f"{event.completion_tokens} completion tokens{cap}"
    )


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
    if estimate.cost_usd is not None:
        print(f"projected llm cost: ${estimate.cost_usd:.4f} (completions at their maximum)")
    if estimate.within_budget is False:
        print(
            "warning: the projection exceeds the budget (--max-cost-usd / --max-summary-tokens): "
            "the build will likely stop at the cap; answers received are kept in the cache, so "
            "a rerun with a higher cap resumes",
            file=sys.stderr,
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
    budget = budget_from_args(args)  # a flag mistake fails before any file is read
    docs = read_inputs(args, args.paths)
    embedder, summarizer = models.build_models(args)
    builder_args: dict[str, Any] = {
        "chunk_max_tokens": args.chunk_tokens,
        "section_context": not args.no_section_context,
        "summary_max_tokens": args.summary_tokens,
        "cluster_max_tokens": args.cluster_max_tokens,
        "max_layers": args.max_layers,
        "max_concurrency": args.max_concurrency,
        "n_threads": args.threads,
        "random_state": args.seed,
        "budget": budget,
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
    with _progress_bars(show) as bars:
        builder = TreeBuilder(
            embedder, summarizer, on_progress=bars, cache=cache, executor=executor, **builder_args
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
    print_spend(bars)
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
        "--no-section-context",
        action="store_true",
        help="embed each leaf by its text alone, not also under its section heading or table header",
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
        "--batch",
        action="store_true",
        help="--llm openai: summaries through the OpenAI Batch API (half price, answers within "
        "hours; an interrupted build run again waits for the same jobs)",
    )
    llm.add_argument(
        "--batch-poll-interval",
        type=positive_float,
        default=60.0,
        help="--batch: seconds between status checks of a job (60)",
    )
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
    add_budget_arguments(build)
    build.add_argument("--no-progress", action="store_true", help="no progress bars")
    build.add_argument("--quiet", "-q", action="store_true", help="print nothing on success")
    build.set_defaults(func=run_build)
    return build
