"""The dense + BM25 fusion baseline, the "best flat baseline" report and the held-out split."""

from __future__ import annotations

import io

import numpy as np
import pytest

from raptor_core import DEFAULT_STRATEGY
from raptor_core.build.builder import TreeBuilder
from raptor_core.evaluation import EvalCorpus, Question, evaluate, report
from raptor_core.evaluation.baselines import (
    RRF_K,
    BM25Baseline,
    DenseBaseline,
    FusionBaseline,
    reciprocal_rank_fusion,
)
from raptor_core.evaluation.data import HOLDOUT_SPLITS, holdout_split
from raptor_core.evaluation.runner import CORE_BASELINES, FLAT_BASELINES
from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer
from raptor_core.types import Document

pytest.importorskip("bm25s")

CHUNKS = [
    "Bees dance to show the hive where the flowers are.",
    "The queen bee lays every egg of the colony in spring.",
    "Rockets burn liquid fuel on the way to orbit.",
    "Satellites circle the earth in a low orbit.",
    "Winter bees shiver their flight muscles to keep the hive warm.",
    "Comets grow tails of gas when they come close to the sun.",
]


def corpus(chunks: list[str] = CHUNKS) -> EvalCorpus:
    tokenizer = WhitespaceTokenizer()
    builder = TreeBuilder(
        FakeEmbedder(32), EchoSummarizer(), tokenizer=tokenizer, chunk_max_tokens=12, max_layers=0
    )
    docs = [Document(text=text, doc_id=f"d{i}") for i, text in enumerate(chunks)]
    tree = builder.build(docs)
    assert [leaf.text for leaf in tree.leaves] == chunks
    return EvalCorpus(
        name="all",
        documents=tuple(docs),
        tree=tree,
        embedder=FakeEmbedder(32),
        tokenizer=tokenizer,
    )


def test_reciprocal_rank_fusion_sums_reciprocal_ranks() -> None:
    # 1: 1/61 + 1/62; 3: 1/63 + 1/61; 2: 1/62 only.
    assert reciprocal_rank_fusion([[1, 2, 3], [3, 1]]) == [1, 3, 2]
    assert RRF_K == 60
    # An item first in one list and absent from the other ties with nothing: order is kept.
    assert reciprocal_rank_fusion([[5], [7]]) == [5, 7]
    assert reciprocal_rank_fusion([[7], [5]]) == [7, 5]
    assert reciprocal_rank_fusion([[], []]) == []
    # A larger k flattens the discount: rank 1 in one list against rank 4 in both.
    assert reciprocal_rank_fusion([[1, 2, 3, 4], [5, 6, 7, 4]], k=1)[0] == 1
    assert reciprocal_rank_fusion([[1, 2, 3, 4], [5, 6, 7, 4]], k=60)[0] == 4


def test_fusion_ranks_the_union_of_dense_and_bm25() -> None:
    c = corpus()
    fusion, dense, bm25 = FusionBaseline(c), DenseBaseline(c), BM25Baseline(c)
    question = "why do winter bees shiver"
    got = fusion.retrieve(question, max_tokens=400)
    m = len(CHUNKS)
    lexical = bm25.ranked(question, m, matching_only=True)
    assert 0 < len(lexical) < m
    expected = reciprocal_rank_fusion([dense.ranked(question, m), lexical])
    assert got == [CHUNKS[i] for i in expected]
    assert got[0] == CHUNKS[4]  # first for both retrievers
    assert set(got) == set(CHUNKS)


def test_fusion_without_lexical_signal_follows_dense() -> None:
    c = corpus()
    question = "which ones were there"  # no chunk shares a term: BM25 has no signal
    assert BM25Baseline(c).ranked(question, 6, matching_only=True) == []
    assert FusionBaseline(c).retrieve(question, max_tokens=400) == DenseBaseline(c).retrieve(
        question, max_tokens=400
    )


def test_fusion_is_deterministic_and_asks_for_enough_chunks() -> None:
    c = corpus()
    fusion = FusionBaseline(c)
    first = fusion.retrieve("orbit rockets", max_tokens=100)
    assert first == fusion.retrieve("orbit rockets", max_tokens=100)
    assert len(first) == len(CHUNKS)  # candidate_k asks for at least 10 (all six here)


QUESTIONS = [
    Question(
        doc_id="d4",
        question_id="q1",
        question="why do winter bees shiver",
        evidence=("Winter bees shiver their flight muscles to keep the hive warm.",),
    ),
    Question(
        doc_id="d2",
        question_id="q2",
        question="what do rockets burn",
        evidence=("Rockets burn liquid fuel on the way to orbit.",),
    ),
]


def run_eval() -> object:
    docs = [Document(text=text, doc_id=f"d{i}") for i, text in enumerate(CHUNKS)]
    return evaluate(
        docs,
        QUESTIONS,
        retrievers=[DEFAULT_STRATEGY, "collapsed", *CORE_BASELINES],
        budgets=(5, 40),
        embedder=FakeEmbedder(32),
        summarizer=EchoSummarizer(),
        tokenizer=WhitespaceTokenizer(),
        builder_params={"chunk_max_tokens": 12},
    )


def test_report_shows_the_best_flat_baseline_and_the_default_margin() -> None:
    result = run_eval()
    assert result.retrievers == [DEFAULT_STRATEGY, "collapsed", "bm25", "dense", "fusion"]  # type: ignore[attr-defined]
    assert set(CORE_BASELINES) <= set(FLAT_BASELINES)
    best = report.best_flat(result, 40, "evidence_recall")  # type: ignore[arg-type]
    assert best is not None
    scores = {n: result.score(n, 40, "evidence_recall") for n in CORE_BASELINES}  # type: ignore[attr-defined]
    assert best[1] == max(scores.values()) and scores[best[0]] == best[1]
    default = report.default_retriever(result)  # type: ignore[arg-type]
    assert default == DEFAULT_STRATEGY
    gap = report.margin(result, default, 40, "evidence_recall")  # type: ignore[arg-type]
    assert gap == pytest.approx(result.score(default, 40, "evidence_recall") - best[1])  # type: ignore[attr-defined]
    markdown = report.to_markdown(result)  # type: ignore[arg-type]
    assert "**best flat baseline**" in markdown and f"**{default} − best flat**" in markdown
    # The printed notes give each margin with its 95% interval (paired bootstrap).
    out = io.StringIO()
    report.print_table(result, file=out, rich=False)  # type: ignore[arg-type]
    draws = report.margin_draws(result, default, 40, "evidence_recall")  # type: ignore[arg-type]
    assert draws is not None
    low, high = report.margin_interval(draws)
    assert f"{default} {gap:+.3f} (95% {low:+.3f}..{high:+.3f})" in out.getvalue()


def test_restrict_rescores_a_subset_of_documents() -> None:
    result = run_eval()
    only = result.restrict(["d4"])  # type: ignore[attr-defined]
    assert only.config["questions"] == 1 and {r["doc_id"] for r in only.rows} == {"d4"}
    for entry in only.summary:
        assert entry["questions"] == 1


def test_holdout_split_is_a_fixed_function_of_the_id() -> None:
    ids = [f"doc-{i}" for i in range(200)]
    splits = [holdout_split(i) for i in ids]
    assert set(splits) == set(HOLDOUT_SPLITS)
    assert splits == [holdout_split(i) for i in ids]
    assert 60 < splits.count("dev") < 140  # about half


def scored(per_retriever: dict[str, list[float | None]], budget: int = 40) -> object:
    """An EvalResult with one row per (question, retriever), as ``evaluate`` writes them."""
    from raptor_core.evaluation.runner import EvalResult

    rows = [
        {
            "doc_id": "d",
            "question_id": f"q{i}",
            "retriever": name,
            "budget": budget,
            "evidence_recall": value,
        }
        for name, values in per_retriever.items()
        for i, value in enumerate(values)
    ]
    summary = [{"retriever": name, "budget": budget} for name in per_retriever]
    return EvalResult(config={}, rows=rows, summary=summary, builds={})


def test_margin_draws_are_a_paired_bootstrap_of_the_margin() -> None:
    # The default wins every question by exactly 0.25: every resample says so.
    sure = scored({"passage": [0.5, 1.0, 0.75, 0.25], "dense": [0.25, 0.75, 0.5, 0.0]})
    draws = report.margin_draws(sure, "passage", 40, "evidence_recall")  # type: ignore[arg-type]
    assert draws is not None and draws.shape == (2000,)
    assert report.margin_interval(draws) == pytest.approx((0.25, 0.25))
    # One question of twenty decides: a tie at this sample size, the interval straddles 0.
    luck = scored({"passage": [1.0] + [0.0] * 19, "dense": [0.0] * 20})
    draws = report.margin_draws(luck, "passage", 40, "evidence_recall")  # type: ignore[arg-type]
    assert draws is not None
    low, high = report.margin_interval(draws)
    assert low <= 0.0 < 0.05 < high
    assert draws.mean() == pytest.approx(0.05, abs=0.01)
    # Unscored questions (no gold of that kind) are left out, as the means leave them out.
    gaps = scored({"passage": [1.0, None, 1.0], "dense": [0.0, None, 0.0]})
    draws = report.margin_draws(gaps, "passage", 40, "evidence_recall")  # type: ignore[arg-type]
    assert draws is not None and set(draws.tolist()) == {1.0}


def test_margin_draws_choose_the_best_baseline_in_every_draw() -> None:
    # Each baseline wins half of the questions: in any resample the better one is at least
    # as good as either, so no draw can exceed the margin over a baseline fixed in advance.
    result = scored(
        {
            "passage": [0.5] * 10,
            "dense": [1.0] * 5 + [0.0] * 5,
            "bm25": [0.0] * 5 + [1.0] * 5,
        }
    )
    draws = report.margin_draws(result, "passage", 40, "evidence_recall", resamples=500)  # type: ignore[arg-type]
    fixed = report.margin_draws(
        result,  # type: ignore[arg-type]
        "passage",
        40,
        "evidence_recall",
        baselines=("dense",),
        resamples=500,
    )
    assert draws is not None and fixed is not None
    assert (draws <= fixed + 1e-12).all() and draws.max() <= 0.0 < fixed.max()
    # Draws of several sets average element-wise into the interval of an average margin.
    low, high = report.margin_interval([draws, fixed])
    assert low < high


def test_margin_draws_and_interval_reject_what_cannot_be_answered() -> None:
    from raptor_core.exceptions import InvalidParameterError

    result = scored({"passage": [1.0], "dense": [0.0]})
    assert report.margin_draws(result, "collapsed", 40, "evidence_recall") is None  # type: ignore[arg-type]
    assert report.margin_draws(result, "passage", 40, "answer_recall") is None  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match="resamples"):
        report.margin_draws(result, "passage", 40, "evidence_recall", resamples=0)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match="confidence"):
        report.margin_interval(np.zeros(3), confidence=1.0)
    with pytest.raises(InvalidParameterError, match="no draws"):
        report.margin_interval([])
