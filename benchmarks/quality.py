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

Usage:
    python benchmarks/quality.py                      # a reduced run (about 15-20 min on 2 cores)
    python benchmarks/quality.py --limit-docs 0 --limit-questions 0    # everything
    python benchmarks/quality.py --sets qasper --limit-docs 3

Writes benchmarks/results/quality.md, quality.json and quality/<set>/{results.json,recall.png};
trees are cached in benchmarks/results/cache, so a rerun only retrieves and scores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
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


def _limit(value: int | None) -> int | None:
    return None if value is not None and value <= 0 else value


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sets", default=",".join(SETS), help="comma-separated sets")
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
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()

    if not DATA.is_dir():
        print(f"quality benchmark: no data at {DATA}; nothing to do (see ../shared/data/README.md)")
        return 0
    from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder
    from raptor_core.evaluation import evaluate, load_documents, load_questions, report, select
    from raptor_core.evaluation.runner import environment

    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        parser.error(f"unknown sets {unknown}; choose from {', '.join(SETS)}")
    budgets = [int(b) for b in args.budgets.split(",")]
    retrievers = None if args.retrievers is None else args.retrievers.split(",")
    out = Path(args.out)
    embedder = SentenceTransformerEmbedder()
    started = time.perf_counter()
    results = {}
    for name in sets:
        metrics, _primary, n_docs, n_questions = SETS[name]
        docs_path, questions_path = DATA / f"{name}_docs.jsonl", DATA / f"{name}.jsonl"
        if not docs_path.is_file() or not questions_path.is_file():
            print(f"{name}: {docs_path.name} or {questions_path.name} missing, skipped")
            continue
        docs = load_documents(docs_path)
        questions = load_questions(questions_path, docs)
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
            cache_dir=out / "cache" / name,
            random_state=args.seed,
        )
        report.print_table(result)
        report.write_json(result, out / "quality" / name / "results.json")
        report.plot_recall(result, out / "quality" / name / "recall.png", title=name)
        print(f"{name}: {time.perf_counter() - t0:.0f}s", flush=True)
        results[name] = result

    env = environment()
    trees = sum(r.config["trees"] for r in results.values())
    cached = sum(r.config["cached"] for r in results.values())
    lines = [
        "# Retrieval quality at equal token budgets",
        "",
        f"Generated by `python benchmarks/quality.py` on {datetime.now(timezone.utc):%Y-%m-%d} "
        f"in {time.perf_counter() - started:.0f} s ({cached} of {trees} trees loaded from "
        "benchmarks/results/cache; the 'Index build' lines give their original build times).",
        "",
        f"- Hardware: {env['cpu']}, {env['cpus']} CPU cores available, no GPU; {env['platform']}.",
        f"- Embedding model (every retriever): all-MiniLM-L6-v2 (sentence-transformers "
        f"{env['versions'].get('sentence-transformers', '?')}, "
        f"torch {env['versions'].get('torch', '?')}).",
        "- Summaries: the offline extractive summariser (no LLM). Budgets and chunk sizes in "
        "tiktoken cl100k_base tokens; leaves are ~100-token chunks (the paper's setting).",
        f"- Seed (`random_state` of UMAP/GMM): {args.seed}. One tree per document; each question "
        "searches its own document.",
        "- `dense`, `llamaindex-vector` and `langchain-inmemory` rank the RAPTOR tree's own leaves "
        "with the same model (they should agree: a sanity check); `*-default-chunking` use the "
        "framework's default splitter (LlamaIndex `SentenceSplitter()`: 1,024 tokens; LangChain "
        "`RecursiveCharacterTextSplitter()`: 4,000 characters). Ranked lists are cut at the "
        "budget.",
        "",
    ]
    if results:
        lines += ["## Headline: primary metric at 400 and 2,000 tokens", ""]
        header = ["retriever"]
        for name in results:
            label = report.LABELS[SETS[name][1]]
            header += [f"{name} {label} @{min(budgets)}", f"@{max(budgets)}"]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        names = list(dict.fromkeys(r for res in results.values() for r in res.retrievers))
        for retriever in names:
            cells = [retriever]
            for name, res in results.items():
                primary = SETS[name][1]
                for budget in (min(budgets), max(budgets)):
                    try:
                        value = res.score(retriever, budget, primary)
                    except KeyError:
                        value = None
                    cells.append("-" if value is None else f"{value:.3f}")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
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
    summary = {
        "environment": env,
        "seed": args.seed,
        "budgets": budgets,
        "sets": {
            name: {k: v for k, v in res.to_dict().items() if k != "rows"}
            for name, res in results.items()
        },
    }
    (out / "quality.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    print(f"wrote {out / 'quality.md'} and {out / 'quality.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
