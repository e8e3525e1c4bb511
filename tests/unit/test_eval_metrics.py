"""The evaluation harness on hand-made cases with known answers (no model, no network)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from raptor_core.evaluation import (
    Context,
    EvalCorpus,
    Question,
    RetrieverSpec,
    answer_recall,
    coverage,
    evaluate,
    evidence_recall,
    fit_budget,
    gold_units,
    load_documents,
    load_questions,
    normalize,
    report,
    resolve_retrievers,
    select,
    span_precision,
    span_recall,
)
from raptor_core.evaluation.metrics import section_texts, tokens, turn_texts
from raptor_core.exceptions import InvalidInputError, InvalidParameterError, MissingDependencyError
from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer
from raptor_core.types import Document

PASSAGE = "The hive keeps warm in winter because the bees shiver their flight muscles together."
OTHER = "Rockets burn liquid fuel and carry satellites into a low orbit around the earth."


# -- normalisation -------------------------------------------------------------------------------
def test_normalize_lowercases_and_keeps_alphanumeric_tokens() -> None:
    assert normalize("  The Cat's HAT,\n(1999) -- ok! ") == "the cat s hat 1999 ok"
    assert tokens("e.g. état") == ["e", "g", "tat"]
    assert normalize("") == ""


def test_whitespace_and_punctuation_differences_do_not_matter() -> None:
    gold = "Data . We build a dataset , ( see Table 1 ) of Twitter accounts ."
    doc = "Data. We build a dataset, (see Table 1) of Twitter accounts."
    assert coverage(gold, [doc]) == 1.0


# -- evidence recall -------------------------------------------------------------------------
def test_retriever_returning_the_evidence_scores_one() -> None:
    assert evidence_recall([PASSAGE], [PASSAGE]) == 1.0
    assert evidence_recall([PASSAGE, OTHER], [OTHER, "noise words here", PASSAGE]) == 1.0


def test_retriever_returning_nothing_scores_zero() -> None:
    assert evidence_recall([PASSAGE], []) == 0.0
    assert answer_recall(["shiver their flight muscles"], []) == 0.0
    assert span_recall([PASSAGE], []) == 0.0
    assert span_precision([PASSAGE], []) == 0.0


def test_partial_overlap_scores_in_between() -> None:
    score = evidence_recall([PASSAGE, OTHER], [PASSAGE])
    assert score == 0.5
    assert 0.0 < coverage(PASSAGE, [PASSAGE[:40]]) < 1.0


def test_found_when_at_least_half_of_the_tokens_are_present() -> None:
    toks = tokens(PASSAGE)  # 14 tokens
    half = " ".join(toks[: len(toks) // 2])
    less = " ".join(toks[: len(toks) // 2 - 1])
    assert coverage(PASSAGE, [half]) == 0.5
    assert evidence_recall([PASSAGE], [half]) == 1.0
    assert evidence_recall([PASSAGE], [less]) == 0.0


def test_a_passage_split_over_two_chunks_counts() -> None:
    words = PASSAGE.split()
    chunks = [" ".join(words[:7]), "something unrelated", " ".join(words[7:])]
    assert coverage(PASSAGE, chunks) == 1.0


def test_bag_of_words_overlap_is_not_enough() -> None:
    # Every word of the passage, in another order: no run of 4 survives.
    shuffled = " ".join(reversed(PASSAGE.split()))
    assert set(tokens(shuffled)) == set(tokens(PASSAGE))
    assert coverage(PASSAGE, [shuffled]) == 0.0
    assert evidence_recall([PASSAGE], [shuffled]) == 0.0


def test_runs_do_not_cross_retrieved_texts() -> None:
    words = tokens(PASSAGE)
    # Two-word pieces: each text holds a fragment shorter than a run.
    pieces = [" ".join(words[i : i + 2]) for i in range(0, len(words), 2)]
    assert coverage(PASSAGE, pieces) == 0.0
    assert coverage(PASSAGE, [" ".join(pieces)]) == 1.0


def test_no_evidence_is_none_and_tiny_passages_are_ignored() -> None:
    assert evidence_recall([], [PASSAGE]) is None
    assert evidence_recall(["[leftmargin=4mm]"], ["leftmargin 4mm"]) is None
    assert evidence_recall(["[leftmargin=4mm]", PASSAGE], [PASSAGE]) == 1.0


def test_ngram_is_configurable_and_validated() -> None:
    shuffled = " ".join(reversed(PASSAGE.split()))
    assert coverage(PASSAGE, Context.from_texts([shuffled], ngram=1)) == 1.0
    with pytest.raises(InvalidParameterError):
        Context.from_texts([PASSAGE], ngram=0)
    with pytest.raises(InvalidParameterError, match="list of strings"):
        evidence_recall([PASSAGE], PASSAGE)  # type: ignore[arg-type]


# -- answer recall ---------------------------------------------------------------------------
def test_answer_recall_matches_whole_normalised_phrases() -> None:
    assert answer_recall(["Golden hair"], ["A queen with golden  hair, fair skin."]) == 1.0
    assert answer_recall(["golden hair"], ["golden, long hair"]) == 0.0
    assert answer_recall(["cat food"], ["the category foods"]) == 0.0  # whole tokens only
    assert answer_recall(["nothing here", "fair skin"], ["golden hair, fair skin"]) == 1.0


def test_one_token_and_numeric_answers_are_not_scored() -> None:
    assert answer_recall(["Yes"], ["yes it is"]) is None
    assert answer_recall(["13", "1 200"], ["13 episodes"]) is None
    assert answer_recall(["Yes"], ["yes"], min_tokens=1) == 1.0
    assert answer_recall(["April 25 , 2018"], ["It aired on April 25, 2018."]) == 1.0


# -- spans -----------------------------------------------------------------------------------
STORY = (
    "Once upon a time a king had a wife with golden hair and a kind heart.\n\n"
    "The queen fell ill and made the king promise to marry only a woman as fair as she.\n"
    "  \n"
    "Years later the princess ran away and hid in the forest wearing a coat of furs."
)
MEETING = "\n".join(
    [
        "Chair: Let us start with the budget for the remote control project today.",
        "Designer: Yeah .",
        "Designer: The case should be made of rubber so it survives being dropped.",
        "Marketing: Users told us they lose the remote under the sofa all the time.",
        "Chair: Then we close the meeting and send the minutes to everyone.",
    ]
)


def test_sections_are_blank_line_blocks_numbered_from_one() -> None:
    sections = section_texts(STORY)
    assert len(sections) == 3
    q = Question(doc_id="d", question_id="q", question="who ran away?", evidence_sections=(3,))
    assert gold_units(q, STORY) == [sections[2]]


def test_turns_are_lines_numbered_from_zero_inclusive() -> None:
    turns = turn_texts(MEETING)
    q = Question(doc_id="m", question_id="q", question="case?", evidence_turn_spans=((1, 2),))
    assert gold_units(q, MEETING) == turns[1:3]


def test_span_recall_and_precision() -> None:
    turns = turn_texts(MEETING)
    gold = turns[1:4]  # "Yeah ." is too short to judge: two scorable turns
    assert span_recall(gold, [turns[2], turns[3]]) == 1.0
    assert span_recall(gold, [turns[2], turns[0]]) == 0.5
    assert span_recall(gold, [turns[0], turns[4]]) == 0.0
    assert span_precision(gold, [turns[2]]) == 1.0
    assert span_precision(gold, [turns[0]]) == 0.0
    mixed = span_precision(gold, [turns[2], turns[4]])
    assert mixed is not None and 0.4 < mixed < 0.6
    assert span_recall([], [turns[0]]) is None


# -- budget accounting -----------------------------------------------------------------------
def test_fit_budget_keeps_rank_order_and_cuts_the_crossing_text() -> None:
    tok = WhitespaceTokenizer()
    assert fit_budget(["a b c", "d e"], 10, tok) == (["a b c", "d e"], 5, False)
    assert fit_budget(["a b c", "d e f", "g"], 4, tok) == (["a b c", "d"], 4, True)
    assert fit_budget(["a b c d e"], 3, tok) == (["a b c"], 3, True)
    assert fit_budget([], 3, tok) == ([], 0, False)
    with pytest.raises(InvalidParameterError):
        fit_budget(["a"], 0, tok)


def test_fit_budget_with_the_default_tokenizer_never_exceeds() -> None:
    from raptor_core.tokenizers import count_tokens, default_tokenizer

    tok = default_tokenizer()
    texts = [PASSAGE * 5, OTHER * 5, "ünïcödé — “quotes” " * 20]
    for budget in (1, 7, 40, 100, 400):
        kept, used, _ = fit_budget(texts, budget, tok)
        assert used == sum(count_tokens(tok, t) for t in kept) <= budget


# -- data ------------------------------------------------------------------------------------
def _write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


def test_load_documents_and_questions(tmp_path: Path) -> None:
    docs = load_documents(
        _write_jsonl(
            tmp_path / "d.jsonl",
            [{"doc_id": "s", "text": STORY, "title": "T"}, {"doc_id": "s", "text": STORY}],
        )
    )
    assert [d.doc_id for d in docs] == ["s"] and docs[0].metadata == {"title": "T"}
    records = [
        {
            "doc_id": "s",
            "question_id": "q1",
            "question": "who?",
            "answers": ["a"],
            "evidence": ["e"],
        },
        {
            "doc_id": "s",
            "question_id": "q1",
            "question": "who?",
            "answers": ["b"],
            "evidence": ["e"],
        },
        {"doc_id": "s", "question": "what?", "evidence_sections": [2]},
    ]
    questions = load_questions(_write_jsonl(tmp_path / "q.jsonl", records), docs)
    assert [q.question_id for q in questions] == ["q1", "s:q3"]
    assert questions[0].answers == ("a", "b") and questions[0].evidence == ("e",)


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"doc_id": "s", "question": ""}, "'question' must be a non-empty string"),
        ({"doc_id": "s", "question": "q", "answers": "a"}, "'answers' must be a list"),
        ({"doc_id": "s", "question": "q", "evidence_sections": [0]}, "section numbers >= 1"),
        ({"doc_id": "s", "question": "q", "evidence_sections": [4]}, "has 3 blank-line-separated"),
        ({"doc_id": "s", "question": "q", "evidence_turn_spans": [[2, 1]]}, "first <= last"),
        ({"doc_id": "s", "question": "q", "evidence_turn_spans": [[0, 9]]}, "has 5 lines"),
        ({"doc_id": "zzz", "question": "q"}, "unknown doc_id 'zzz'"),
    ],
)
def test_invalid_questions_are_rejected_clearly(
    tmp_path: Path, record: dict[str, object], match: str
) -> None:
    docs = [Document(text=MEETING if "turn" in str(record) else STORY, doc_id="s")]
    with pytest.raises(InvalidInputError, match=match):
        load_questions(_write_jsonl(tmp_path / "q.jsonl", [record]), docs)


def test_invalid_files_are_rejected_clearly(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="does not exist"):
        load_documents(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"doc_id": "a", "text": "x"}\nnot json\n', encoding="utf-8")
    with pytest.raises(InvalidInputError, match=r"bad\.jsonl:2 is not valid JSON"):
        load_documents(bad)
    with pytest.raises(InvalidInputError, match="different text"):
        load_documents(
            _write_jsonl(
                tmp_path / "d.jsonl", [{"doc_id": "a", "text": "x"}, {"doc_id": "a", "text": "y"}]
            )
        )
    with pytest.raises(InvalidInputError, match="'text' must be a non-empty string"):
        load_documents(_write_jsonl(tmp_path / "e.jsonl", [{"doc_id": "a"}]))


def test_select_limits_round_robin() -> None:
    docs = [Document(text="x", doc_id=f"d{i}") for i in range(3)]
    qs = [Question(doc_id=f"d{i % 3}", question_id=f"q{i}", question="?") for i in range(9)]
    kept_docs, kept_qs = select(docs, qs, limit_docs=2, limit_questions=3)
    assert [d.doc_id for d in kept_docs] == ["d0", "d1"]
    assert [q.question_id for q in kept_qs] == ["q0", "q1", "q3"]


# -- the runner, with fakes ------------------------------------------------------------------
DOCS = {
    "bees": " ".join(
        [
            "Bees dance to tell the hive where the flowers are.",
            PASSAGE,
            "Honey is stored in wax cells that the workers build.",
            "The queen lays eggs all through the spring and summer.",
        ]
    ),
    "space": " ".join(
        [
            OTHER,
            "Astronauts train for years before they fly to the station.",
            "The moon has no air, so footprints stay for a long time.",
            "Telescopes in orbit see stars that are hidden by clouds from the ground.",
        ]
    ),
}
QUESTIONS = [
    Question(
        doc_id="bees",
        question_id="b1",
        question="How does the hive keep warm in winter?",
        answers=("shiver their flight muscles",),
        evidence=(PASSAGE,),
    ),
    Question(
        doc_id="space",
        question_id="s1",
        question="What carries satellites into orbit?",
        answers=("Rockets",),  # one token: not scorable
        evidence=(OTHER,),
    ),
]
GOLD = {q.question: list(q.evidence) for q in QUESTIONS}


class Oracle:
    """Returns the gold evidence, then filler: a perfect retriever."""

    def __init__(self, corpus: EvalCorpus) -> None:
        self.corpus = corpus

    def retrieve(self, question: str, *, max_tokens: int) -> list[str]:
        return [*GOLD[question], *self.corpus.chunks]


class Nothing:
    def __init__(self, corpus: EvalCorpus) -> None:
        pass

    def retrieve(self, question: str, *, max_tokens: int) -> list[str]:
        return []


class PairClusterer:
    def cluster(self, vectors: np.ndarray) -> list[list[int]]:
        n = len(vectors)
        return [list(range(i, min(i + 2, n))) for i in range(0, n, 2)]


def run(tmp_path: Path | None = None, **kwargs: object):
    params: dict[str, object] = {
        "retrievers": [
            "collapsed",
            "traversal",
            "value",
            "dense",
            RetrieverSpec("oracle", Oracle),
            RetrieverSpec("nothing", Nothing),
        ],
        "budgets": (6, 20, 60),
        "embedder": FakeEmbedder(32),
        "summarizer": EchoSummarizer(),
        "tokenizer": WhitespaceTokenizer(),
        "builder_params": {
            "chunk_max_tokens": 12,
            "summary_max_tokens": 10,
            "clusterer": PairClusterer(),
        },
        "cache_dir": None if tmp_path is None else tmp_path / "trees",
    }
    params.update(kwargs)
    docs = [Document(text=t, doc_id=k) for k, t in DOCS.items()]
    return evaluate(docs, QUESTIONS, **params)  # type: ignore[arg-type]


def test_evaluate_scores_oracle_one_and_empty_zero() -> None:
    result = run()
    for budget in (20, 60):
        assert result.score("oracle", budget, "evidence_recall") == 1.0
        assert result.score("oracle", budget, "answer_recall") == 1.0
    for budget in (6, 20, 60):
        assert result.score("nothing", budget, "evidence_recall") == 0.0
        assert result.score("nothing", budget, "context_tokens") == 0.0
    # 6 tokens hold less than half of a 14-token passage: even the oracle cannot find it.
    assert result.score("oracle", 6, "evidence_recall") == 0.0
    entry = next(e for e in result.summary if e["retriever"] == "oracle" and e["budget"] == 60)
    assert entry["n_evidence_recall"] == 2 and entry["n_answer_recall"] == 1
    assert entry["span_recall"] is None


def test_every_retriever_stays_within_the_budget() -> None:
    result = run()
    assert {r["retriever"] for r in result.rows} == {
        "collapsed",
        "traversal",
        "value",
        "dense",
        "oracle",
        "nothing",
    }
    assert len(result.rows) == 6 * 3 * len(QUESTIONS)
    for row in result.rows:
        assert 0 <= row["context_tokens"] <= row["budget"]
        assert row["latency_ms"] >= 0.0
        for metric in ("evidence_recall", "answer_recall"):
            assert row[metric] is None or 0.0 <= row[metric] <= 1.0
    # Flat ranked lists fill the budget exactly (the crossing chunk is cut).
    assert all(
        r["context_tokens"] == r["budget"]
        for r in result.rows
        if r["retriever"] == "dense" and r["budget"] < 60
    )


def test_llm_strategies_are_skipped_without_an_llm() -> None:
    specs, skipped = resolve_retrievers(["collapsed", "llm", "hybrid"])
    assert [s.name for s in specs] == ["collapsed"]
    assert set(skipped) == {"llm", "hybrid"} and "needs an LLM" in skipped["llm"]
    from raptor_core.testing import ScriptedLLM

    specs, skipped = resolve_retrievers(["llm", "hybrid"], llm=ScriptedLLM([]))
    assert [s.name for s in specs] == ["llm", "hybrid"] and not skipped
    with pytest.raises(InvalidParameterError, match="unknown retriever 'nope'"):
        resolve_retrievers(["nope"])
    with pytest.raises(InvalidParameterError, match="listed twice"):
        resolve_retrievers(["bm25", "bm25"])
    with pytest.raises(InvalidParameterError, match="cannot load retriever factory"):
        resolve_retrievers(["no_such_module_xyz:Factory"])


def test_missing_optional_baseline_is_skipped_not_fatal() -> None:
    def needs_framework(corpus: EvalCorpus) -> Nothing:
        msg = "'llama_index' is required: run `pip install 'raptor-retriever[llamaindex]'`."
        raise MissingDependencyError(msg)

    result = run(retrievers=["dense", RetrieverSpec("framework", needs_framework)])
    assert result.retrievers == ["dense"]
    assert "not installed" in result.skipped["framework"]


def test_bm25_without_bm25s_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bm25s", None)
    result = run(retrievers=["bm25", "dense"])
    assert result.retrievers == ["dense"] and "raptor-retriever[eval]" in result.skipped["bm25"]


def test_trees_are_cached_and_reused(tmp_path: Path) -> None:
    first = run(tmp_path, retrievers=["collapsed"])
    assert first.config["trees"] == 2 and first.config["cached"] == 0
    assert sorted(p.name for p in (tmp_path / "trees").iterdir()) == ["bees", "space"]
    second = run(tmp_path, retrievers=["collapsed"])
    assert second.config["cached"] == 2
    for a, b in zip(first.summary, second.summary, strict=True):
        assert a["evidence_recall"] == b["evidence_recall"]
    changed = run(tmp_path, retrievers=["collapsed"], random_state=1)
    assert changed.config["cached"] == 0  # another seed is another build


def test_trees_cached_before_a_change_of_method_are_built_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from raptor_core.evaluation import runner

    assert run(tmp_path, retrievers=["collapsed"]).config["cached"] == 0
    monkeypatch.setattr(runner, "_BUILD_REVISION", runner._BUILD_REVISION + 1)
    assert run(tmp_path, retrievers=["collapsed"]).config["cached"] == 0
    assert run(tmp_path, retrievers=["collapsed"]).config["cached"] == 2


def test_tree_over_all_documents() -> None:
    result = run(tree_per="all", retrievers=["dense", RetrieverSpec("oracle", Oracle)])
    assert result.config["trees"] == 1
    assert result.score("oracle", 60, "evidence_recall") == 1.0


def test_invalid_run_parameters() -> None:
    with pytest.raises(InvalidParameterError, match="tree_per"):
        run(tree_per="chapter")
    with pytest.raises(InvalidParameterError, match="budgets"):
        run(budgets=[0])
    with pytest.raises(InvalidInputError, match="no questions"):
        evaluate([Document(text="x", doc_id="d")], [])


# -- reports ---------------------------------------------------------------------------------
def test_reports(tmp_path: Path) -> None:
    result = run(retrievers=["dense", RetrieverSpec("oracle", Oracle)])
    table = report.format_table(result)
    assert "oracle" in table and "evidence" in table and "answer" in table
    markdown = report.to_markdown(result)
    assert markdown.splitlines()[0].startswith("| retriever | evidence @6 |")
    assert "| oracle | 0.000 | 1.000 | 1.000 |" in markdown
    saved = json.loads(report.write_json(result, tmp_path / "r" / "results.json").read_text())
    assert saved["summary"] == json.loads(json.dumps(result.summary))
    assert saved["config"]["budgets"] == [6, 20, 60]
    png = report.plot_recall(result, tmp_path / "recall.png", title="fake")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_evaluation_keeps_the_frameworks_out() -> None:
    code = (
        "import sys\n"
        "import raptor_core.evaluation, raptor_core.evaluation.cli, raptor_core.evaluation.report\n"
        "heavy = ('llama_index', 'langchain_core', 'torch', 'matplotlib', 'bm25s')\n"
        "bad = [m for m in heavy if m in sys.modules]\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


class CountingEmbedder(FakeEmbedder):
    def __init__(self, dim: int = 32) -> None:
        super().__init__(dim)
        self.queries: list[str] = []

    def embed_query(self, text: str) -> np.ndarray:
        self.queries.append(text)
        return super().embed_query(text)


def test_each_question_is_embedded_once_for_all_retrievers() -> None:
    embedder = CountingEmbedder()
    result = run(embedder=embedder, retrievers=["collapsed", "traversal", "value", "dense"])
    assert sorted(embedder.queries) == sorted(q.question for q in QUESTIONS)
    assert all(row["embed_ms"] is not None for row in result.rows)
    embedder = CountingEmbedder()
    run(embedder=embedder, retrievers=["collapsed", "dense"], cache_query_embeddings=False)
    assert len(embedder.queries) == 2 * 3 * len(QUESTIONS)  # retrievers x budgets x questions


def test_llm_strategies_run_when_an_llm_is_configured() -> None:
    from raptor_core.testing import ScriptedLLM

    result = run(retrievers=["llm", "hybrid"], llm=ScriptedLLM(default="1"))
    assert result.retrievers == ["llm", "hybrid"] and not result.skipped
    assert result.config["llm"]["class"].endswith("ScriptedLLM")
    for row in result.rows:
        assert row["context_tokens"] <= row["budget"]
        assert 0.0 <= row["evidence_recall"] <= 1.0


def test_value_evidence_variant_is_a_named_retriever() -> None:
    from raptor_core.evaluation.runner import available_retrievers, resolve_retrievers

    assert "value-evidence" in available_retrievers()
    (spec,), skipped = resolve_retrievers(["value-evidence"])
    assert spec.name == "value-evidence" and spec.family == "raptor" and not skipped
    assert spec.factory.strategy == "value" and spec.factory.params == {"include": "evidence"}
    (found,), _ = resolve_retrievers(["passage-found"])
    assert found.factory.strategy == "passage" and found.factory.params == {"scope": "found"}
