"""The ``raptor`` command line: build, query and inspect trees.

This is an application entry point, so unlike the library modules it prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from raptor_core.exceptions import InvalidInputError, InvalidParameterError, RaptorError
from raptor_core.strategies import STRATEGIES
from raptor_core.types import Document

__all__ = ["main", "read_documents"]

TEXT_SUFFIXES = {".txt", ".md", ".markdown", ".rst", ".text"}


# -- input files ---------------------------------------------------------------------------------
def _iter_files(paths: Sequence[str]) -> Iterator[Path]:
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES | {".jsonl"}
            )
            if not found:
                msg = f"{path} contains no .txt, .md, .rst or .jsonl files"
                raise InvalidInputError(msg)
            yield from found
        elif path.is_file():
            yield path
        else:
            msg = f"{path} does not exist"
            raise InvalidInputError(msg)


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    if b"\x00" in data[:65536]:
        msg = f"{path} is a binary file, not text"
        raise InvalidInputError(msg)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        msg = f"{path} is not valid UTF-8 text (byte {exc.start}): convert it to UTF-8 first"
        raise InvalidInputError(msg) from exc


def read_documents(paths: Sequence[str]) -> list[Document]:
    """Read text/markdown files, folders of them, and ``.jsonl`` files with ``doc_id``/``text``."""
    docs: list[Document] = []
    for path in _iter_files(paths):
        if path.suffix.lower() == ".jsonl":
            for lineno, line in enumerate(_read_text(path).splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    msg = f"{path}:{lineno} is not valid JSON: {exc}"
                    raise InvalidInputError(msg) from exc
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    msg = f"{path}:{lineno} needs a JSON object with a string 'text' field"
                    raise InvalidInputError(msg)
                doc_id = str(record.get("doc_id", f"{path.stem}:{lineno}"))
                meta = {
                    k: v for k, v in record.items() if k not in {"text", "doc_id"} and _is_scalar(v)
                }
                meta["source"] = str(path)
                docs.append(Document(text=record["text"], doc_id=doc_id, metadata=meta))
        else:
            docs.append(
                Document(text=_read_text(path), doc_id=str(path), metadata={"source": str(path)})
            )
    return docs


def _is_scalar(value: object) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


# -- progress ------------------------------------------------------------------------------------
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


# -- commands ------------------------------------------------------------------------------------
def _build_models(args: argparse.Namespace) -> tuple[Any, Any]:
    """The embedder and summariser the build flags ask for (None: the builder's defaults)."""
    embedder: Any = None
    summarizer: Any = None
    if args.embed_provider == "openai":
        if args.embed_model:
            msg = "--embed-model names a sentence-transformers model: use --openai-embed-model"
            raise InvalidParameterError(msg)
        from raptor_core.backends.openai import OpenAIEmbedder

        embedder = OpenAIEmbedder(
            args.openai_embed_model,
            base_url=args.embed_base_url or args.llm_base_url,
            max_concurrency=args.max_concurrency,
            timeout=args.timeout,
        )
    elif args.embed_model:
        from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder

        embedder = SentenceTransformerEmbedder(args.embed_model)
    if args.llm == "openai":
        from raptor_core.backends.openai import OpenAISummarizer
        from raptor_core.types import DEFAULT_SUMMARY_PROMPT

        prompt = DEFAULT_SUMMARY_PROMPT
        if args.prompt_file:
            prompt = _read_text(Path(args.prompt_file))
        summarizer = OpenAISummarizer(
            args.llm_model, prompt=prompt, base_url=args.llm_base_url, timeout=args.timeout
        )
    elif args.prompt_file:
        msg = "--prompt-file needs an LLM summariser: add --llm openai"
        raise InvalidParameterError(msg)
    return embedder, summarizer


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


def _cmd_build(args: argparse.Namespace) -> int:
    from raptor_core.builder import TreeBuilder

    started = time.perf_counter()
    docs = read_documents(args.paths)
    embedder, summarizer = _build_models(args)
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
    from raptor_core.cache import BuildCache

    cache = BuildCache(Path(args.out) / ".raptor-cache")
    if not args.resume:
        cache.clear()  # --no-resume: pay for everything again, but stay resumable
    show = sys.stderr.isatty() and not args.quiet and not args.no_progress
    with _progress_bars(show) as progress:
        builder = TreeBuilder(embedder, summarizer, progress=progress, cache=cache, **builder_args)
        try:
            tree = builder.build(docs)
        finally:
            cache.close()
    persist_start = time.perf_counter()
    tree.save(args.out)
    persist = time.perf_counter() - persist_start
    total = time.perf_counter() - started
    if args.quiet:
        return 0
    info = tree.build_info
    layers = ", ".join(f"L{x['layer']}={x['nodes']}" for x in info["layers"])
    timings = dict(info["timings"], persist=round(persist, 4))
    print(
        f"built {args.out}: {info['documents']} documents, {info['chunks']} chunks, nodes per layer: {layers}"
    )
    print(
        "time: " + ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()) + f", total {total:.2f}s"
    )
    print(f"stopped: {info['stop_reason']}")
    _print_usage(info)
    return 0


def _load_tree(directory: str) -> Any:
    from raptor_core.tree import Tree

    return Tree.load(directory, mmap=True)


def _query_embedder(tree: Any, override: str | None) -> Any:
    if override:
        from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder

        return SentenceTransformerEmbedder(override)
    from raptor_core.resolve import from_description

    return from_description(tree.params.get("embedder", {}))


def _hit_json(tree: Any, hit: Any) -> dict[str, Any]:
    node = hit.node
    out: dict[str, Any] = {
        "id": node.id,
        "layer": node.layer,
        "score": round(float(hit.score), 6),
        "text": node.text,
        "doc_id": node.doc_id,
        "source": hit.source,
    }
    if node.layer == 0:
        out["span"] = list(node.span) if node.span else None
    else:
        out["doc_ids"] = list(node.doc_ids)
        out["children"] = list(node.children)
    if len(hit.path) > 1:
        out["path"] = list(hit.path)
    if hit.reason:
        out["reason"] = hit.reason
    if hit.evidence:
        out["evidence"] = [{"id": i, "score": round(s, 6)} for i, s in hit.evidence]
    return out


def _cli_llm(args: argparse.Namespace) -> Any:
    """The LLM for ``--strategy llm|hybrid``: ``--llm openai`` (any OpenAI-compatible server)."""
    if getattr(args, "llm", None) != "openai":
        return None
    from raptor_core.backends.openai import OpenAIChatLLM

    return OpenAIChatLLM(args.llm_model, base_url=args.llm_base_url, timeout=args.timeout)


#: ``query`` flag (argparse dest) -> retriever parameter; a flag left unset is not passed.
_STRATEGY_FLAGS = {
    "layers": "layers",
    "start_layer": "start_layer",
    "num_layers": "num_layers",
    "threshold": "threshold",
    "top_k_per_layer": "top_k",
    "chunk_k": "chunk_k",
    "min_score": "min_score",
    "llm_timeout": "llm_timeout",
    "search_timeout": "timeout",
}


def _make_retriever(args: argparse.Namespace, tree: Any, embedder: Any) -> Any:
    from raptor_core.strategies import accepted_params, make_retriever

    strategy = getattr(args, "strategy", "collapsed")
    accepted = accepted_params(strategy)
    params: dict[str, Any] = {"k": args.top_k, "max_tokens": args.max_tokens}
    for dest, name in _STRATEGY_FLAGS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if name not in accepted:
            msg = f"--{dest.replace('_', '-')} does not apply to --strategy {strategy}"
            raise InvalidParameterError(msg)
        params[name] = value
    if args.layers:
        try:
            params["layers"] = [int(x) for x in args.layers.split(",")]
        except ValueError:
            msg = f"--layers takes comma-separated layer numbers, e.g. 0,1; got {args.layers!r}"
            raise InvalidParameterError(msg) from None
    llm = None
    if strategy in {"llm", "hybrid"}:
        llm = _cli_llm(args)
        if llm is None:
            msg = f"--strategy {strategy} needs an LLM: pass --llm ... (for example --llm openai)"
            raise InvalidParameterError(msg)
    return make_retriever(strategy, tree, embedder, llm=llm, **params)


def _cmd_query(args: argparse.Namespace) -> int:
    tree = _load_tree(args.tree)
    embedder = _query_embedder(tree, args.embed_model)
    retriever = _make_retriever(args, tree, embedder)
    hits = retriever.retrieve(args.question)
    if args.json:
        print(json.dumps([_hit_json(tree, h) for h in hits], ensure_ascii=False, indent=2))
        return 0
    if not hits:
        print("no results")
        return 0
    used = sum(h.node.token_count for h in hits)
    print(f"{len(hits)} nodes, {used} tokens")
    for hit in hits:
        where = (
            hit.node.doc_id if hit.node.layer == 0 else f"summary of {len(hit.node.doc_ids)} doc(s)"
        )
        print(f"\n[{hit.node.id} | layer {hit.node.layer} | score {hit.score:.3f} | {where}]")
        print(hit.node.text)
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    tree = _load_tree(args.tree)
    info = tree.build_info
    rows = []
    for layer in range(tree.num_layers):
        nodes = tree.layer(layer)
        tokens = sum(n.token_count for n in nodes)
        children = [len(n.children) for n in nodes] if layer else []
        below = sum(n.token_count for n in tree.layer(layer - 1)) if layer else 0
        rows.append(
            {
                "layer": layer,
                "nodes": len(nodes),
                "tokens": tokens,
                "avg_children": round(sum(children) / len(children), 2) if children else None,
                # Compression: tokens of the layer below per token of this layer.
                "compression": round(below / tokens, 2) if layer and tokens else None,
            }
        )
    if args.json:
        print(json.dumps({"layers": rows, "params": tree.params, "build_info": info}, indent=2))
        return 0
    print(
        f"{args.tree}: {len(tree)} nodes, {tree.num_layers} layers, dim {tree.dim}, {len(tree.doc_ids)} documents"
    )
    print(f"{'layer':>5} {'nodes':>7} {'tokens':>9} {'avg children':>13} {'compression':>12}")
    for r in rows:
        avg = "-" if r["avg_children"] is None else f"{r['avg_children']:.2f}"
        comp = "-" if r["compression"] is None else f"{r['compression']:.2f}x"
        print(f"{r['layer']:>5} {r['nodes']:>7} {r['tokens']:>9} {avg:>13} {comp:>12}")
    print("build parameters:")
    for key, value in tree.params.items():
        print(f"  {key}: {json.dumps(value) if isinstance(value, dict) else value}")
    if info.get("stop_reason"):
        print(f"stopped: {info['stop_reason']}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raptor", description="Build and query RAPTOR trees.")
    sub = parser.add_subparsers(dest="command", required=True)

    build = sub.add_parser("build", help="build a tree from text/markdown files, folders or .jsonl")
    build.add_argument(
        "paths", nargs="+", help="files or folders (.txt .md .rst, .jsonl with doc_id/text)"
    )
    build.add_argument("--out", required=True, help="directory to write the tree to")
    build.add_argument(
        "--chunk-tokens", type=int, default=100, help="leaf chunk size (default 100)"
    )
    build.add_argument(
        "--summary-tokens", type=int, default=100, help="summary length (default 100)"
    )
    build.add_argument(
        "--cluster-max-tokens", type=int, default=3500, help="max tokens summarised at once"
    )
    build.add_argument("--max-layers", type=int, default=5, help="max summary layers (default 5)")
    build.add_argument(
        "--seed", type=int, default=0, help="random_state for clustering (default 0)"
    )
    build.add_argument("--threads", type=int, default=None, help="cap torch/BLAS/numba threads")
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
    llm.add_argument("--max-concurrency", type=int, default=4, help="requests in flight (4)")
    llm.add_argument("--timeout", type=float, default=60.0, help="seconds per request (60)")
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
    build.set_defaults(func=_cmd_build)

    query = sub.add_parser("query", help="retrieve context for a question")
    query.add_argument("tree", help="tree directory")
    query.add_argument("question")
    query.add_argument("--top-k", "-k", type=int, default=10, help="max nodes (default 10)")
    query.add_argument("--max-tokens", type=int, default=2000, help="context budget (default 2000)")
    query.add_argument(
        "--layers", default=None, help="comma-separated layers to search (collapsed)"
    )
    strategy = query.add_argument_group("retrieval strategy (see docs/retrieval.md)")
    add = strategy.add_argument
    add("--strategy", choices=STRATEGIES, default="collapsed", help="search strategy (collapsed)")
    add("--start-layer", type=int, default=None, help="traversal/llm: first layer (top)")
    add("--num-layers", type=int, default=None, help="traversal/llm: layers to descend")
    add("--threshold", type=float, default=None, help="traversal: keep cosine >= this")
    add("--top-k-per-layer", type=int, default=None, help="traversal/llm/hybrid: nodes per step")
    add("--chunk-k", type=int, default=None, help="value/hybrid: chunks retrieved (20)")
    add("--min-score", type=float, default=None, help="ignore nodes below this cosine")
    add("--llm-timeout", type=float, default=None, help="llm/hybrid: seconds per LLM call")
    add("--search-timeout", type=float, default=None, help="hybrid: seconds in all (60)")
    add("--llm", choices=["openai"], default=None, help="llm/hybrid: the chat model's API")
    add("--llm-model", default="gpt-4o-mini", help="llm/hybrid: chat model for --llm openai")
    add("--llm-base-url", default=None, help="OpenAI-compatible API root ($OPENAI_BASE_URL)")
    add("--timeout", type=float, default=60.0, help="llm/hybrid: seconds per request (60)")
    query.add_argument("--embed-model", default=None, help="override the tree's embedding model")
    query.add_argument("--json", action="store_true", help="print hits as JSON")
    query.set_defaults(func=_cmd_query)

    inspect = sub.add_parser("inspect", help="print a tree's shape and build parameters")
    inspect.add_argument("tree", help="tree directory")
    inspect.add_argument("--json", action="store_true", help="print as JSON")
    inspect.set_defaults(func=_cmd_inspect)

    from raptor_core.evaluation.cli import add_eval_parser  # light: argparse only

    add_eval_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``raptor`` command."""
    # The packaged model loads from disk; never let a missing network stall the CLI.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # transformers draws a "Loading weights" bar on every model load; the CLI has its own.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except RaptorError as exc:
        print(f"raptor {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"raptor {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
