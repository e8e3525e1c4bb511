"""Multiple-choice questions: loading, the LLM reader, and choice accuracy in the harness."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from raptor_core.evaluation import (
    EvalCorpus,
    LLMChoiceReader,
    Question,
    RetrieverSpec,
    evaluate,
    load_questions,
)
from raptor_core.evaluation import report as eval_report
from raptor_core.evaluation.readers import CHOICE_PROMPT, ChoiceReader, parse_choice
from raptor_core.evaluation.runner import unscorable
from raptor_core.exceptions import (
    InvalidInputError,
    InvalidParameterError,
    LLMAuthenticationError,
    LLMError,
    LLMTimeoutError,
)
from raptor_core.testing import EchoSummarizer, FakeEmbedder, ScriptedLLM, WhitespaceTokenizer
from raptor_core.types import Document

OPTIONS = ("by train", "on a white horse", "in a glass coach", "on foot")
STORY = (
    "The prince searched the kingdom for the owner of the slipper. "
    "He rode from town to town on a white horse. "
    "At every house the sisters tried the slipper on. "
    "The baker sold bread in the square every morning. "
    "The river froze early that winter and the mill stopped."
)


def _write(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


# -- data ------------------------------------------------------------------------------------
def test_options_and_gold_option_are_loaded(tmp_path: Path) -> None:
    docs = [Document(text=STORY, doc_id="s")]
    records: list[dict[str, object]] = [
        {"doc_id": "s", "question": "How?", "options": list(OPTIONS), "gold_option": 1},
        # Other sets carry empty options and a null gold option: not multiple choice.
        {"doc_id": "s", "question": "Who?", "options": [], "gold_option": None},
    ]
    first, second = load_questions(_write(tmp_path / "q.jsonl", records), docs)
    assert first.options == OPTIONS and first.gold_option == 1
    assert second.options == () and second.gold_option is None


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"options": ["a", "b"], "gold_option": 2}, "index of one of the 2 'options'"),
        ({"options": ["a", "b"], "gold_option": -1}, "index of one of the 2"),
        ({"options": ["a", "b"], "gold_option": True}, "index of one of the 2"),
        ({"options": ["a", "b"], "gold_option": "1"}, "index of one of the 2"),
        ({"options": "a b", "gold_option": 0}, "'options' must be a list of strings"),
        ({"options": ["only"], "gold_option": 0}, "at least two non-empty 'options'"),
        ({"options": ["a", " "], "gold_option": 0}, "at least two non-empty 'options'"),
        ({"gold_option": 0}, "index of one of the 0 'options'"),
    ],
)
def test_bad_multiple_choice_fields_are_rejected(
    tmp_path: Path, record: dict[str, object], match: str
) -> None:
    docs = [Document(text=STORY, doc_id="s")]
    line = {"doc_id": "s", "question": "q", **record}
    with pytest.raises(InvalidInputError, match=match):
        load_questions(_write(tmp_path / "q.jsonl", [line]), docs)


def test_a_repeated_question_must_keep_its_options(tmp_path: Path) -> None:
    docs = [Document(text=STORY, doc_id="s")]
    line = {"doc_id": "s", "question_id": "q", "question": "How?", "options": list(OPTIONS)}
    records = [{**line, "gold_option": 1}, {**line, "gold_option": 2}]
    with pytest.raises(InvalidInputError, match="different 'options' or 'gold_option'"):
        load_questions(_write(tmp_path / "q.jsonl", records), docs)


# -- parsing and the LLM reader --------------------------------------------------------------
@pytest.mark.parametrize(
    ("reply", "index"),
    [
        ("B", 1),
        (" (c) ", None),  # a lower-case letter is a word, not an option
        ("(C)", 2),
        ("D.", 3),
        ("**A**", 0),
        ("B) on a white horse", 1),
        ("The answer is C.", 2),
        ("Answer: (D)", 3),
        ("I think option A", 0),
        ("on a white horse", 1),
        ("On a WHITE horse!", 1),
        ("E", None),  # past the four options
        ("", None),
        ("I cannot tell from the context.", None),
    ],
)
def test_parse_choice(reply: str, index: int | None) -> None:
    if index is None:
        with pytest.raises(LLMError, match="names none of the options A-D"):
            parse_choice(reply, OPTIONS)
    else:
        assert parse_choice(reply, OPTIONS) == index


def test_an_option_text_that_starts_with_a_is_the_option_not_the_letter() -> None:
    options = ("A rebellion broke out", "The king fell ill")
    assert parse_choice("A rebellion broke out.", options) == 0
    assert parse_choice("The king fell ill", options) == 1


def test_the_prompt_holds_context_question_and_lettered_options() -> None:
    llm = ScriptedLLM(default="B")
    reader = LLMChoiceReader(llm)
    assert isinstance(reader, ChoiceReader)
    context = ["First passage {question} with braces.", "Second\n\npassage."]
    assert reader.choose("How did he travel?", OPTIONS, context) == 1
    prompt = llm.prompts[0]
    assert "First passage {question} with braces.\n\nSecond\n\npassage." in prompt
    assert "Question: How did he travel?" in prompt
    assert "A. by train\nB. on a white horse\nC. in a glass coach\nD. on foot" in prompt
    assert prompt.startswith(CHOICE_PROMPT.split("{context}")[0])
    LLMChoiceReader(llm).choose("q", OPTIONS, [])
    assert "Context:\n(empty)\n" in llm.prompts[-1]


def test_a_reply_that_names_no_option_is_asked_once_more() -> None:
    llm = ScriptedLLM(["Let me think.", "C"])
    assert LLMChoiceReader(llm).choose("q", OPTIONS, ["ctx"]) == 2
    assert len(llm.prompts) == 2
    garbage = ScriptedLLM(default="I don't know")
    with pytest.raises(LLMError, match="names none of the options"):
        LLMChoiceReader(garbage).choose("q", OPTIONS, ["ctx"])
    assert len(garbage.prompts) == 2


def test_a_failed_call_is_not_retried_as_a_bad_answer() -> None:
    llm = ScriptedLLM([LLMTimeoutError("the LLM did not answer within 1 s"), "A"])
    with pytest.raises(LLMTimeoutError):
        LLMChoiceReader(llm).choose("q", OPTIONS, ["ctx"])
    assert len(llm.prompts) == 1


@pytest.mark.parametrize(
    ("kwargs", "options", "match"),
    [
        ({}, ("one",), "needs 2 to 26 options"),
        ({"max_tokens": 0}, OPTIONS, "max_tokens must be a positive integer"),
        ({"prompt": "Context: {context}\nQuestion: {question}"}, OPTIONS, "must contain {options}"),
    ],
)
def test_reader_parameters_are_checked_where_used(
    kwargs: dict[str, object], options: tuple[str, ...], match: str
) -> None:
    reader = LLMChoiceReader(ScriptedLLM(default="A"), **kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match=match):
        reader.choose("q", options, ["ctx"])


# -- the harness -----------------------------------------------------------------------------
QUESTION = Question(
    doc_id="s",
    question_id="mc",
    question="How did the prince travel?",
    options=OPTIONS,
    gold_option=1,
)
RECALL_ONLY = Question(doc_id="s", question_id="plain", question="Who tried the slipper on?")


class Gold:
    """Returns the sentence that holds the answer."""

    def __init__(self, corpus: EvalCorpus) -> None:
        pass

    def retrieve(self, question: str, *, max_tokens: int) -> list[str]:
        return ["He rode from town to town on a white horse."]


class Distractor:
    """Returns a sentence that holds no option."""

    def __init__(self, corpus: EvalCorpus) -> None:
        pass

    def retrieve(self, question: str, *, max_tokens: int) -> list[str]:
        return ["The baker sold bread in the square every morning."]


def _reads_context(prompt: str) -> str:
    """A reader that answers the option whose text occurs in the context, else gives up."""
    context = prompt.split("Context:", 1)[1].split("Question:", 1)[0]
    for letter, option in zip("ABCD", OPTIONS, strict=False):
        if option in context:
            return letter
    return "I cannot tell."


def _evaluate(
    reader: ChoiceReader | None, questions: list[Question] | None = None, **kwargs: object
):
    return evaluate(
        [Document(text=STORY, doc_id="s")],
        questions or [QUESTION, RECALL_ONLY],
        retrievers=[RetrieverSpec("gold", Gold), RetrieverSpec("distractor", Distractor)],
        budgets=(50,),
        embedder=FakeEmbedder(16),
        summarizer=EchoSummarizer(),
        tokenizer=WhitespaceTokenizer(),
        reader=reader,
        builder_params={"chunk_max_tokens": 12},
        **kwargs,  # type: ignore[arg-type]
    )


def test_choice_accuracy_follows_the_context_the_reader_gets() -> None:
    llm = ScriptedLLM(default=_reads_context)
    result = _evaluate(LLMChoiceReader(llm))
    assert result.score("gold", 50, "choice_accuracy") == 1.0
    # The distractor's context names no option: the reader gives up twice, the question
    # scores 0 and the failure is counted, not hidden.
    assert result.score("distractor", 50, "choice_accuracy") == 0.0
    entry = {e["retriever"]: e for e in result.summary}
    assert entry["gold"]["reader_failures"] == 0 and entry["distractor"]["reader_failures"] == 1
    assert entry["gold"]["n_choice_accuracy"] == 1  # the plain question is not multiple choice
    failed = [r for r in result.rows if r["reader_error"]]
    assert [r["retriever"] for r in failed] == ["distractor"]
    assert "names none of the options" in failed[0]["reader_error"]
    assert len(llm.prompts) == 1 + 2  # one call for gold, two for the distractor
    assert "choice_accuracy" in result.metrics
    assert "LLMChoiceReader" in json.dumps(result.config["reader"])
    out = io.StringIO()
    eval_report.print_table(result, file=out, rich=False)
    text = out.getvalue()
    assert "choice" in text and "reader: 1 answers named no option or failed" in text


def test_without_a_reader_multiple_choice_is_not_scored() -> None:
    answered = Question(
        doc_id="s", question_id="answered", question="How?", answers=("a white horse",)
    )
    result = _evaluate(None, [QUESTION, answered])
    assert result.score("gold", 50, "choice_accuracy") is None
    assert "choice_accuracy" not in result.metrics
    assert all(r["choice_accuracy"] is None and r["reader_error"] is None for r in result.rows)


def test_without_a_reader_or_any_gold_nothing_is_built() -> None:
    # Only multiple-choice questions and one without gold: every score would be null, so
    # the run stops before building a tree, and says what a reader would change.
    with pytest.raises(InvalidInputError, match=r"none of the 2 questions.*reader="):
        _evaluate(None)
    assert unscorable([QUESTION, RECALL_ONLY]) == [QUESTION, RECALL_ONLY]
    assert unscorable([QUESTION, RECALL_ONLY], reader=True) == [RECALL_ONLY]


def test_a_rejected_request_stops_the_run() -> None:
    llm = ScriptedLLM(default=lambda _: (_ for _ in ()).throw(LLMAuthenticationError("bad key")))
    with pytest.raises(LLMAuthenticationError, match="bad key"):
        _evaluate(LLMChoiceReader(llm))


def test_a_reader_that_returns_no_index_is_an_error() -> None:
    class Broken:
        def choose(self, question: str, options: object, context: object) -> int:
            return 7

    with pytest.raises(InvalidParameterError, match=r"not an option index in 0\.\.3"):
        _evaluate(Broken())


def test_a_question_s_contexts_are_read_at_once_with_the_same_scores() -> None:
    import threading
    import time

    lock = threading.Lock()
    active = [0, 0]  # (now, most at once)

    def slow_reader(prompt: str) -> str:
        with lock:
            active[0] += 1
            active[1] = max(active[1], active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1
        return _reads_context(prompt)

    def run(workers: int) -> list[tuple[object, ...]]:
        result = evaluate(
            [Document(text=STORY, doc_id="s")],
            [QUESTION],
            retrievers=[RetrieverSpec("gold", Gold), RetrieverSpec("distractor", Distractor)],
            budgets=(20, 50),
            embedder=FakeEmbedder(16),
            summarizer=EchoSummarizer(),
            tokenizer=WhitespaceTokenizer(),
            reader=LLMChoiceReader(ScriptedLLM(default=slow_reader)),
            reader_workers=workers,
            builder_params={"chunk_max_tokens": 12},
        )
        return [
            (r["retriever"], r["budget"], r["choice_accuracy"], r["reader_error"])
            for r in result.rows
        ]

    concurrent = run(8)
    assert active[1] >= 2  # four contexts, read together
    active[1] = 0
    assert run(1) == concurrent and active[1] == 1
    assert [row[2] for row in concurrent] == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(InvalidParameterError, match="reader_workers must be a positive integer"):
        _evaluate(LLMChoiceReader(ScriptedLLM(default="A")), reader_workers=0)
