"""Retrieval evaluation: RAPTOR strategies against flat baselines at equal token budgets.

Examples:
    >>> from raptor_core.evaluation import evaluate, load_documents, load_questions
    >>> docs = load_documents("qasper_docs.jsonl")  # doctest: +SKIP
    >>> questions = load_questions("qasper.jsonl", docs)  # doctest: +SKIP
    >>> result = evaluate(docs, questions, retrievers=["collapsed", "bm25"])  # doctest: +SKIP
    >>> result.score("collapsed", 2000, "evidence_recall")  # doctest: +SKIP
    0.71
"""

from __future__ import annotations

from raptor_core.evaluation.data import Question, gold_units, load_documents, load_questions, select
from raptor_core.evaluation.metrics import (
    Context,
    answer_recall,
    coverage,
    evidence_recall,
    fit_budget,
    normalize,
    span_precision,
    span_recall,
)
from raptor_core.evaluation.readers import ChoiceReader, LLMChoiceReader
from raptor_core.evaluation.runner import (
    DEFAULT_BUDGETS,
    ContextRetriever,
    EvalCorpus,
    EvalResult,
    RaptorStrategy,
    RetrieverSpec,
    available_retrievers,
    evaluate,
    resolve_retrievers,
)

__all__ = [
    "DEFAULT_BUDGETS",
    "ChoiceReader",
    "Context",
    "ContextRetriever",
    "EvalCorpus",
    "EvalResult",
    "LLMChoiceReader",
    "Question",
    "RaptorStrategy",
    "RetrieverSpec",
    "answer_recall",
    "available_retrievers",
    "coverage",
    "evaluate",
    "evidence_recall",
    "fit_budget",
    "gold_units",
    "load_documents",
    "load_questions",
    "normalize",
    "resolve_retrievers",
    "select",
    "span_precision",
    "span_recall",
]
