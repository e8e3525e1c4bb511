"""``raptor eval``: compare retrievers on JSONL documents and questions at equal budgets.

This is an application entry point, so unlike the library modules it prints.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raptor_core._argtypes import MAX_SEED, int_range
from raptor_core.exceptions import InvalidInputError, InvalidParameterError

if TYPE_CHECKING:
    from raptor_core.evaluation.data import Question

__all__ = ["add_eval_parser"]


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        msg = f"expected comma-separated integers such as 400,1000,2000, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if not values or any(v < 1 for v in values):
        msg = f"expected positive integers, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return values


def add_eval_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` command to the ``raptor`` command line's subparsers."""
    p = subparsers.add_parser(
        "eval",
        help="score retrievers (RAPTOR strategies, BM25, LlamaIndex/LangChain defaults) on QA data",
        description=(
            "Build a RAPTOR tree per document, run each retriever at each token budget and "
            "score evidence, answer and span recall (see docs/evaluation.md). Writes "
            "results.json and recall.png to --out and prints a table."
        ),
    )
    p.add_argument("--docs", help="documents JSONL: doc_id, text")
    p.add_argument("--questions", help="questions JSONL: doc_id, question, answers, evidence, ...")
    p.add_argument(
        "--retrievers",
        default=None,
        help="comma-separated names (default: all available; see --list-retrievers), "
        "or module:Factory for your own",
    )
    p.add_argument("--list-retrievers", action="store_true", help="list retriever names and exit")
    p.add_argument(
        "--budgets", type=_int_list, default=[400, 1000, 2000], help="token budgets (400,1000,2000)"
    )
    p.add_argument(
        "--tree-per",
        choices=["doc", "all"],
        default="doc",
        help="one tree per document (default) or one over all",
    )
    p.add_argument(
        "--limit-docs",
        type=int_range(1),
        default=None,
        help="use the first N documents that have questions",
    )
    p.add_argument(
        "--limit-questions",
        type=int_range(1),
        default=None,
        help="use N questions, round-robin over documents",
    )
    p.add_argument(
        "--out",
        default="raptor-eval",
        help="output directory (default ./raptor-eval); trees are cached in OUT/trees",
    )
    p.add_argument(
        "--seed",
        type=int_range(0, MAX_SEED),
        default=0,
        help="random_state of the tree builds (default 0)",
    )
    p.add_argument(
        "--embed-model",
        default=None,
        help="sentence-transformers model (default: packaged all-MiniLM-L6-v2)",
    )
    p.add_argument(
        "--chunk-tokens",
        type=int_range(1),
        default=100,
        help="leaf chunk size (default 100, the paper's)",
    )
    p.add_argument(
        "--no-cache", action="store_true", help="rebuild trees even when OUT/trees has them"
    )
    p.add_argument("--no-plot", action="store_true", help="do not write recall.png")
    llm = p.add_argument_group("LLM (enables the llm and hybrid strategies)")
    llm.add_argument(
        "--llm", choices=["none", "openai"], default="none", help="an OpenAI-compatible chat model"
    )
    llm.add_argument("--llm-model", default="gpt-4o-mini", help="chat model for --llm openai")
    llm.add_argument(
        "--llm-base-url", default=None, help="OpenAI-compatible API root ($OPENAI_BASE_URL)"
    )
    llm.add_argument(
        "--llm-summaries", action="store_true", help="also summarise the trees with the LLM"
    )
    llm.add_argument(
        "--reader",
        choices=["none", "llm"],
        default="none",
        help="llm: answer multiple-choice questions (QuALITY) with the LLM from each "
        "retriever's context and score its accuracy (one call per question, retriever, budget)",
    )
    llm.add_argument(
        "--reader-workers",
        type=int_range(1, 64),
        default=8,
        help="reader calls in flight at once, over one question's contexts (default 8)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the summary as JSON instead of a table"
    )
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing but errors")
    p.set_defaults(func=_cmd_eval)
    return p


def _progress(enabled: bool) -> Any:
    if not enabled:
        return None, None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bars = Progress(
        TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    )
    tasks: dict[str, Any] = {}

    def update(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bars.add_task(stage, total=total)
        bars.update(tasks[stage], completed=done, total=total)

    return bars, update


def _check_gold(questions: list[Question], args: argparse.Namespace) -> int:
    """How many questions no metric can score; InvalidInputError when that is all of them.

    Without any gold the run would build every tree (the expensive part) and report only
    null metrics, so it stops here, before anything is built.
    """
    from raptor_core.evaluation.runner import unscorable

    reader = args.reader == "llm"
    unscored = unscorable(questions, reader=reader)
    if questions and len(unscored) == len(questions):
        limited = args.limit_docs is not None or args.limit_questions is not None
        which = " selected by --limit-docs/--limit-questions" if limited else ""
        hint = ""
        if not reader and any(q.gold_option is not None for q in questions):
            hint = "; multiple-choice questions are scored only with --reader llm --llm openai"
        msg = (
            f"none of the {len(questions)} questions{which} in {args.questions} has a gold "
            "field a metric can score, so every score would be null: give questions "
            "'evidence' (passages of 4 or more words copied from the document), 'answers' "
            "(of 2 or more words, not numbers), 'evidence_sections' or "
            f"'evidence_turn_spans', or 'options' with 'gold_option'{hint} "
            "(see docs/evaluation.md, Input format)"
        )
        raise InvalidInputError(msg)
    if unscored and not args.quiet:
        print(
            f"raptor eval: note: {len(unscored)} of {len(questions)} questions have no gold "
            "field a metric can score and count in no metric (see docs/evaluation.md)",
            file=sys.stderr,
        )
    return len(unscored)


def _cmd_eval(args: argparse.Namespace) -> int:
    from raptor_core.evaluation import report
    from raptor_core.evaluation.data import load_documents, load_questions, select
    from raptor_core.evaluation.runner import available_retrievers, evaluate

    llm = None
    if args.llm == "openai":
        from raptor_core.backends.openai import OpenAIChatLLM

        llm = OpenAIChatLLM(args.llm_model, base_url=args.llm_base_url)
    if args.list_retrievers:
        print("\n".join(available_retrievers(llm=True)))
        return 0
    if not args.docs or not args.questions:
        msg = "--docs and --questions are required"
        raise InvalidParameterError(msg)
    for name in ("limit_docs", "limit_questions"):
        value = getattr(args, name)
        if value is not None and value < 1:
            msg = f"--{name.replace('_', '-')} must be a positive integer, got {value}"
            raise InvalidParameterError(msg)
    started = time.perf_counter()
    docs = load_documents(args.docs)
    questions = load_questions(args.questions, docs)
    docs, questions = select(
        docs, questions, limit_docs=args.limit_docs, limit_questions=args.limit_questions
    )
    unscored = _check_gold(questions, args)
    embedder = None
    if args.embed_model:
        from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder

        embedder = SentenceTransformerEmbedder(args.embed_model)
    summarizer = None
    if args.llm_summaries:
        if llm is None:
            msg = "--llm-summaries needs --llm openai"
            raise InvalidParameterError(msg)
        from raptor_core.build.summarizers import LLMSummarizer

        summarizer = LLMSummarizer(llm)
    reader = None
    if args.reader == "llm":
        if llm is None:
            msg = "--reader llm needs --llm openai"
            raise InvalidParameterError(msg)
        from raptor_core.evaluation.readers import LLMChoiceReader

        reader = LLMChoiceReader(llm)
    names = (
        None if args.retrievers is None else [n for n in args.retrievers.split(",") if n.strip()]
    )
    out = Path(args.out)
    show = sys.stderr.isatty() and not args.quiet
    bars, update = _progress(show)
    if bars is not None:
        bars.start()
    try:
        result = evaluate(
            docs,
            questions,
            retrievers=names,
            budgets=args.budgets,
            tree_per=args.tree_per,
            embedder=embedder,
            summarizer=summarizer,
            llm=llm,
            reader=reader,
            reader_workers=args.reader_workers,
            builder_params={"chunk_max_tokens": args.chunk_tokens},
            cache_dir=None if args.no_cache else out / "trees",
            random_state=args.seed,
            progress=update,
        )
    finally:
        if bars is not None:
            bars.stop()
    report.write_json(result, out / "results.json")
    written = [out / "results.json"]
    if not args.no_plot:
        written.append(report.plot_recall(result, out / "recall.png"))
    if args.quiet:
        return 0
    if args.json:
        shown = {"summary": result.summary, "skipped": result.skipped, "unscored": unscored}
        print(json.dumps(shown, indent=1))
        return 0
    report.print_table(result)
    print(f"wrote {', '.join(map(str, written))} in {time.perf_counter() - started:.1f}s")
    return 0
