"""Retrieval quality on public QA data: RAPTOR strategies against flat retrievers, equal budgets.

Runs the ``raptor eval`` harness (raptor_core.evaluation) on the sets of ../shared/data that
can be scored without a reader model, and writes a markdown table that the README quotes:

    qasper       evidence-paragraph recall, answer-string recall
    fairytaleqa  gold-section recall, answer-string recall
    qmsum        gold-turn recall and precision
    nq_leval     answer-string recall (one-token and numeric answers ignored)

Every retriever gets the same token budgets (400, 1,000, 2,000 cl100k tokens: the paper's
settings), the same embedding model and, for the "same chunks" baselines, the RAPTOR tree's
own ~100-token leaves.  Trees are summarised with the offline extractive summariser unless
an LLM is configured, so the summaries are sentences picked from the text, not abstractive.

The headline compares the default strategy with the best flat baseline (the strongest of
dense, BM25 and their reciprocal-rank fusion over the same leaves, and the LlamaIndex and
LangChain default retrievers with their own chunking) per set and budget, on the
development half of the documents, the held-out half, and all of them, with the average
margin over the sets; quality.png plots recall against budget.

Usage:
    python benchmarks/quality.py                      # a reduced run (about 15-20 min on 2 cores)
    python benchmarks/quality.py --limit-docs 0 --limit-questions 0    # everything
    python benchmarks/quality.py --sets qasper --limit-docs 3
    python benchmarks/quality.py --data /path/to/shared/data          # data elsewhere
    python benchmarks/quality.py --data DIR --sets all --limit-docs 0 --limit-questions 0

A set of another name (``--sets mine`` reads ``mine_docs.jsonl`` and ``mine.jsonl``, in the
format of ../shared/data/README.md; ``--sets all`` takes every such pair in ``--data``) is
scored by the gold signal its questions carry: evidence passages (evidence recall), sections
or turn spans (span recall), else answer strings (answer recall).

Writes benchmarks/results/quality.md, quality.json, quality.png and
quality/<set>/{results.json,recall.png}; trees are cached in benchmarks/results/cache, so a
rerun only retrieves and scores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(
    os.environ.get("RAPTOR_EVAL_DATA", Path(__file__).resolve().parents[2] / "shared" / "data")
)
RESULTS = ROOT / "benchmarks" / "results"

#: set -> (metrics shown, primary metric, default docs, default questions) for the reduced run.
SETS = {
    "qasper": (["evidence_recall", "answer_recall"], "evidence_recall", 8, 40),
    "fairytaleqa": (["span_recall", "answer_recall"], "span_recall", 6, 60),
    "qmsum": (["span_recall", "span_precision"], "span_recall", 4, 24),
    "nq_leval": (["answer_recall"], "answer_recall", 4, 24),
}
WHAT = {
    "evidence_recall": "gold evidence paragraphs found (>= half their tokens in the context)",
    "answer_recall": "a gold answer string occurs in the context",
    "span_recall": "gold sections / turns found (>= half their tokens in the context)",
    "span_precision": "share of context tokens that come from gold turns",
}


#: Reduced-run limits for a set not listed in SETS.
OTHER_SET_LIMITS = (8, 40)


def _inferred_spec(questions: list[Any]) -> tuple[list[str], str, int, int] | None:
    """SETS' entry for a set of another name, from the gold signal its questions carry.

    The strongest signal decides the primary metric: evidence passages, then gold sections
    or turn spans, then answer strings (None: nothing to score without a reader model).
    """
    answers = any(q.answers for q in questions)
    if any(q.options for q in questions):
        # Multiple choice (QuALITY): its answer strings are options, which a context holds
        # whether or not it supports them; only a reader model scores it.
        answers = False
    if any(q.evidence for q in questions):
        metrics = ["evidence_recall", *(["answer_recall"] if answers else [])]
    elif any(q.evidence_sections or q.evidence_turn_spans for q in questions):
        metrics = ["span_recall", "answer_recall" if answers else "span_precision"]
    elif answers:
        metrics = ["answer_recall"]
    else:
        return None
    return metrics, metrics[0], *OTHER_SET_LIMITS


#: A set name is also a folder name (the tree cache, the per-set results): plain names only.
_SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _discover(data: Path) -> list[str]:
    """Every set in ``data``: a ``<name>_docs.jsonl`` with its ``<name>.jsonl``, known sets first."""
    found = sorted(
        name
        for name in (p.name.removesuffix("_docs.jsonl") for p in data.glob("*_docs.jsonl"))
        if _SET_NAME.fullmatch(name) and (data / f"{name}.jsonl").is_file()
    )
    return [s for s in SETS if s in found] + [s for s in found if s not in SETS]


def _limit(value: int | None) -> int | None:
    return None if value is not None and value <= 0 else value


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sets",
        default=",".join(SETS),
        help="comma-separated sets, or 'all' for every <name>_docs.jsonl + <name>.jsonl in --data",
    )
    parser.add_argument(
        "--limit-docs", type=int, default=None, help="documents per set (0 = all; default per set)"
    )
    parser.add_argument(
        "--limit-questions",
        type=int,
        default=None,
        help="questions per set (0 = all; default per set)",
    )
    parser.add_argument("--budgets", default="400,1000,2000")
    parser.add_argument(
        "--retrievers", default=None, help="comma-separated (default: all available)"
    )
    parser.add_argument("--tree-per", choices=["doc", "all"], default="doc")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk-tokens", type=int, default=100, help="leaf chunk size")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument(
        "--data", default=str(DATA), help="the evaluation sets (default: ../shared/data)"
    )
    parser.add_argument("--cache", default=None, help="tree cache directory (default: OUT/cache)")
    args = parser.parse_args()

    data = Path(args.data)
    if not data.is_dir():
        print(f"quality benchmark: no data at {data}; nothing to do (see ../shared/data/README.md)")
        return 0
    from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder
    from raptor_core.evaluation import evaluate, load_documents, load_questions, report, select
    from raptor_core.evaluation.runner import environment

    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    if sets == ["all"]:
        sets = _discover(data)
    unknown = [
        s
        for s in sets
        if s not in SETS
        and not (
            _SET_NAME.fullmatch(s)
            and (data / f"{s}_docs.jsonl").is_file()
            and (data / f"{s}.jsonl").is_file()
        )
    ]
    if unknown:
        parser.error(
            f"unknown sets {unknown}: neither one of {', '.join(SETS)} nor a "
            f"<name>_docs.jsonl and <name>.jsonl pair in {data}"
        )
    budgets = [int(b) for b in args.budgets.split(",")]
    retrievers = None if args.retrievers is None else args.retrievers.split(",")
    out = Path(args.out)
    embedder = SentenceTransformerEmbedder()
    started = time.perf_counter()
    results = {}
    seconds: dict[str, float] = {}
    for name in sets:
        docs_path, questions_path = data / f"{name}_docs.jsonl", data / f"{name}.jsonl"
        if not docs_path.is_file() or not questions_path.is_file():
            print(f"{name}: {docs_path.name} or {questions_path.name} missing, skipped")
            continue
        docs = load_documents(docs_path)
        questions = load_questions(questions_path, docs)
        if name not in SETS:
            spec = _inferred_spec(questions)
            if spec is None:
                print(
                    f"{name}: no evidence, spans or (non multiple-choice) answers to score "
                    "without a reader model, skipped (raptor eval --reader llm scores it)"
                )
                continue
            SETS[name] = spec  # the report below reads every set's metrics from SETS
        _metrics, _primary, n_docs, n_questions = SETS[name]
        limit_docs = n_docs if args.limit_docs is None else _limit(args.limit_docs)
        limit_questions = (
            n_questions if args.limit_questions is None else _limit(args.limit_questions)
        )
        docs, questions = select(
            docs, questions, limit_docs=limit_docs, limit_questions=limit_questions
        )
        print(f"== {name}: {len(docs)} documents, {len(questions)} questions", flush=True)
        t0 = time.perf_counter()
        result = evaluate(
            docs,
            questions,
            retrievers=retrievers,
            budgets=budgets,
            tree_per=args.tree_per,
            embedder=embedder,
            cache_dir=(out / "cache" if args.cache is None else Path(args.cache)) / name,
            random_state=args.seed,
            builder_params={"chunk_max_tokens": args.chunk_tokens},
        )
        report.print_table(result)
        report.write_json(result, out / "quality" / name / "results.json")
        report.plot_recall(result, out / "quality" / name / "recall.png", title=name)
        seconds[name] = time.perf_counter() - t0
        print(f"{name}: {seconds[name]:.0f}s", flush=True)
        results[name] = result

    env = environment()
    elapsed = time.perf_counter() - started
    trees = sum(r.config["trees"] for r in results.values())
    cached = sum(r.config["cached"] for r in results.values())
    from raptor_core.retrieval.registry import DEFAULT_STRATEGY

    default = DEFAULT_STRATEGY
    halves = {name: _halves(res) for name, res in results.items()}
    command = " ".join(["python", "benchmarks/quality.py", *sys.argv[1:]])
    lines = [
        "# Retrieval quality at equal token budgets",
        "",
        f"Generated by `{command}` on {datetime.now(timezone.utc):%Y-%m-%d} at commit "
        f"`{_commit()}` in {elapsed:.0f} s ({cached} of {trees} trees loaded from the tree "
        "cache; the 'Index build' lines give their original build times). Seconds per set: "
        + ", ".join(f"{name} {seconds[name]:.0f}" for name in results)
        + ".",
        "",
        f"- Hardware: {env['cpu']}, {env['cpus']} CPU cores available, no GPU; {env['platform']}.",
        f"- Embedding model (every retriever): all-MiniLM-L6-v2 (sentence-transformers "
        f"{env['versions'].get('sentence-transformers', '?')}, "
        f"torch {env['versions'].get('torch', '?')}).",
        "- Summaries: the offline extractive summariser (no LLM). Budgets and chunk sizes in "
        f"tiktoken cl100k_base tokens; leaves are ~{args.chunk_tokens}-token chunks.",
        f"- Seed (`random_state` of UMAP/GMM): {args.seed}. One tree per document; each question "
        "searches its own document.",
        f"- Default strategy: `{default}`. Best flat baseline = the strongest, per set and "
        "budget, of `dense`, `bm25` and `fusion` (reciprocal-rank fusion of the two, k = 60) over "
        "the tree's own leaves and the LlamaIndex / LangChain default retrievers with their own "
        "default chunking (`SentenceSplitter()`: 1,024 tokens; `RecursiveCharacterTextSplitter()`: "
        "4,000 characters). Ranked lists are cut at the budget.",
        "- Development and held-out halves: documents split by a hash of their id "
        "(`raptor_core.evaluation.data.holdout_split`). Parameters were chosen on the "
        "development half only.",
        "",
    ]
    if results:
        lines += _headline(results, halves, budgets, default)
        lines += ["![recall against budget](quality.png)", ""]
    for name, res in results.items():
        metrics = SETS[name][0]
        cfg = res.config
        first = res.summary[0] if res.summary else {}
        scored = "; ".join(
            f"{report.LABELS[m]}: {WHAT[m]} ({first.get(f'n_{m}', 0)} questions scored)"
            for m in metrics
        )
        lines += [
            f"## {name}",
            "",
            f"{cfg['documents']} documents, {cfg['questions']} questions, {cfg['leaves']} leaves, "
            f"{cfg['nodes']} tree nodes. {scored}.",
            "",
            report.to_markdown(res, metrics=metrics),
            "",
            "Index build (s, all documents): "
            + ", ".join(f"{k} {v:.1f}" for k, v in res.builds.items() if v >= 0.05)
            + ".",
            "",
        ]
        if res.skipped:
            lines += ["Skipped: " + "; ".join(f"{k} ({v})" for k, v in res.skipped.items()), ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.md").write_text("\n".join(lines), encoding="utf-8")
    if results:
        _plot(results, budgets, default, out / "quality.png")
    summary = {
        "environment": env,
        "command": command,
        "commit": _commit(),
        "seed": args.seed,
        "budgets": budgets,
        "seconds": {"total": elapsed, **seconds},
        "default": default,
        # Each set's primary metric (the headline's), which benchmarks/compare.py reads.
        "primary": {name: SETS[name][1] for name in results},
        "margins": {
            name: {
                half: {
                    str(b): {
                        k: v
                        for k, v in _cell(res_half, SETS[name][1], b, default).items()
                        if k != "draws"
                    }
                    for b in budgets
                }
                for half, res_half in halves[name].items()
            }
            for name in results
        },
        "sets": {
            name: {k: v for k, v in res.to_dict().items() if k != "rows"}
            for name, res in results.items()
        },
    }
    (out / "quality.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    print(f"wrote {out / 'quality.md'}, {out / 'quality.json'} and {out / 'quality.png'}")
    return 0


def _commit() -> str:
    """The checked-out commit, with ``+dirty`` when the tree has uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=10", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _halves(result: Any) -> dict[str, Any]:
    """The run restricted to the development half, the held-out half, and all documents."""
    from raptor_core.evaluation.data import holdout_split

    doc_ids = {row["doc_id"] for row in result.rows}
    out = {}
    for half in ("dev", "held-out"):
        chosen = {d for d in doc_ids if holdout_split(d) == half}
        if chosen:
            out[half] = result.restrict(chosen)
    out["all"] = result
    return out


def _cell(result: Any, metric: str, budget: int, default: str) -> dict[str, Any]:
    """The default strategy's score, the best flat baseline and the margin for one cell.

    ``draws`` are the margin's paired-bootstrap draws (kept out of the JSON), ``interval``
    their 95% interval.
    """
    from raptor_core.evaluation import report

    best = report.best_flat(result, budget, metric)
    value = result.score(default, budget, metric) if default in result.retrievers else None
    draws = report.margin_draws(result, default, budget, metric)
    return {
        "default": value,
        "best_flat": None if best is None else best[1],
        "best_flat_name": None if best is None else best[0],
        "margin": None if best is None or value is None else value - best[1],
        "interval": None if draws is None else report.margin_interval(draws),
        "questions": result.config.get("questions"),
        "draws": draws,
    }


def _points(value: float) -> str:
    return f"{value * 100:+.1f}"


def _margin_text(margin: float | None, interval: tuple[float, float] | None) -> str:
    if margin is None:
        return "-"
    if interval is None:
        return _points(margin)
    return f"{_points(margin)} ({_points(interval[0])}, {_points(interval[1])})"


def _headline(
    results: dict[str, Any], halves: dict[str, Any], budgets: list[int], default: str
) -> list[str]:
    """Markdown: the default strategy against the best flat baseline, per set, budget, half."""
    from raptor_core.evaluation import report
    from raptor_core.evaluation.runner import FLAT_BASELINES

    lines = [
        f"## Headline: `{default}` (the default) against the best flat baseline",
        "",
        "Primary metric of each set; margin = default minus best flat baseline, in points "
        "(hundredths of recall), with its 95% interval from a paired bootstrap over the "
        "questions (`raptor_core.evaluation.report.margin_draws`; the best baseline is chosen "
        "again in every draw). An interval that straddles 0 is a tie at this sample size. The "
        "average is over the sets.",
        "",
    ]
    if not any(set(FLAT_BASELINES) & set(res.retrievers) for res in results.values()):
        lines += [
            "No flat baseline ran in this run (`--retrievers` named none of "
            f"{', '.join(f'`{b}`' for b in FLAT_BASELINES)}): there is no margin.",
            "",
        ]
    for half in ("dev", "held-out", "all"):
        header = ["set (questions)"]
        for b in budgets:
            header += [f"default @{b}", f"best flat @{b}", "margin (95% interval)"]
        lines += [f"**{half}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        margins: dict[int, list[float]] = {b: [] for b in budgets}
        draws: dict[int, list[Any]] = {b: [] for b in budgets}
        for name in results:
            res = halves[name].get(half)
            if res is None:
                continue
            metric = SETS[name][1]
            cells = [f"{name} {report_label(metric)} ({res.config.get('questions')})"]
            for b in budgets:
                cell = _cell(res, metric, b, default)
                if cell["margin"] is not None:
                    margins[b].append(cell["margin"])
                if cell["draws"] is not None:
                    draws[b].append(cell["draws"])
                best = cell["best_flat_name"]
                cells += [
                    _fmt(cell["default"]),
                    "-" if best is None else f"{_fmt(cell['best_flat'])} ({best})",
                    _margin_text(cell["margin"], cell["interval"]),
                ]
            lines.append("| " + " | ".join(cells) + " |")
        avg = ["**average margin**"]
        for b in budgets:
            values = margins[b]
            if not values:
                avg += ["", "", "-"]
                continue
            mean = sum(values) / len(values)
            # Sets are resampled independently; the interval is of the draw-wise average.
            interval = report.margin_interval(draws[b]) if len(draws[b]) == len(values) else None
            avg += ["", "", f"**{_margin_text(mean, interval)}**"]
        lines += ["| " + " | ".join(avg) + " |", ""]
    return lines


def report_label(metric: str) -> str:
    from raptor_core.evaluation import report

    return report.LABELS.get(metric, metric)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _plot(results: dict[str, Any], budgets: list[int], default: str, path: Path) -> None:
    """Recall against budget on each set's primary metric: the default, collapsed, flat baselines."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from raptor_core.evaluation.runner import FLAT_BASELINES

    shown = [default, "collapsed", *FLAT_BASELINES]
    fig = Figure(figsize=(4.2 * len(results), 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(results), squeeze=False)[0]
    for ax, (name, res) in zip(axes, results.items(), strict=True):
        metric = SETS[name][1]
        for retriever in (r for r in shown if r in res.retrievers):
            ys = [res.score(retriever, b, metric) for b in budgets]
            style = "-o" if retriever == default else "--" if retriever == "collapsed" else ":"
            ax.plot(
                budgets, ys, style, label=retriever, linewidth=2 if retriever == default else 1.2
            )
        ax.set_title(f"{name} ({report_label(metric)})")
        ax.set_xlabel("context budget (tokens)")
        ax.set_xticks(budgets)
        ax.set_ylim(0.0, 1.02)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("recall")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
