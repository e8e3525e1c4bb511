"""``raptor eval`` end to end: a tiny generated dataset, the real model, both frameworks."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
import warm_python
from openai_server import LOCALHOST, FakeOpenAIServer

pytestmark = [pytest.mark.integration, *LOCALHOST]

CROPS = ["barley", "saffron", "apricots", "lentils", "olives", "hops", "tea", "cotton"]
GOODS = [
    "copper pots",
    "wool blankets",
    "glass beads",
    "salted fish",
    "cedar planks",
    "silk thread",
]
RIVERS = ["Amber", "Silver", "Crooked", "Quiet", "Swift", "Black"]
DAYS = ["Monday", "Tuesday", "Thursday", "Saturday"]
ANIMALS = ["goats", "donkeys", "geese", "camels", "yaks", "pigs"]


def _village(rng: random.Random, name: str) -> tuple[str, dict[str, str]]:
    facts = {
        "crop": rng.choice(CROPS),
        "good": rng.choice(GOODS),
        "river": rng.choice(RIVERS),
        "day": rng.choice(DAYS),
        "animal": rng.choice(ANIMALS),
        "founder": rng.choice(["Ilse Varga", "Tomas Brecht", "Ana Ruiz", "Jon Okafor", "Mei Lin"]),
    }
    text = (
        f"The village of {name} lies beside the {facts['river']} river, where the valley opens "
        f"towards the hills. Its farmers grow {facts['crop']} on narrow terraces and keep "
        f"{facts['animal']} in stone pens behind their houses. Every {facts['day']} the square "
        f"fills with traders who exchange {facts['good']} for flour and salt. The village was "
        f"founded by {facts['founder']}, whose statue still stands by the old well, and the "
        f"children of {name} learn the story of that founding before they learn to read."
    )
    return text, facts


def _dataset(tmp_path: Path) -> tuple[Path, Path, dict[str, list[str]]]:
    rng = random.Random(7)
    names = [
        ["Oskarsby", "Pellwick", "Tarnholm", "Quenlow", "Brisca", "Ulmerod", "Vantoria", "Kesh"],
        [
            "Drummel",
            "Ferovia",
            "Gallantry",
            "Hoskeld",
            "Istravo",
            "Jorundel",
            "Lammerskirk",
            "Mirevale",
        ],
    ]
    docs, questions, gold = [], [], {}
    for d, village_names in enumerate(names):
        paragraphs = []
        for i, name in enumerate(village_names):
            text, facts = _village(rng, name)
            paragraphs.append(text)
            if i % 3 == 0:
                question = f"What do the farmers of {name} grow, and which animals do they keep?"
                sentence = text.split(". ")[1] + "."
                questions.append(
                    {
                        "doc_id": f"valley-{d}",
                        "question_id": f"valley-{d}-{name}",
                        "question": question,
                        "answers": [f"{facts['crop']} on narrow terraces"],
                        "evidence": [text],  # copied from the document
                    }
                )
                gold[question] = [text, sentence]
        docs.append(
            {"doc_id": f"valley-{d}", "title": f"Valley {d}", "text": "\n\n".join(paragraphs)}
        )
    docs_path = tmp_path / "docs.jsonl"
    questions_path = tmp_path / "questions.jsonl"
    docs_path.write_text("\n".join(json.dumps(x) for x in docs) + "\n", encoding="utf-8")
    questions_path.write_text("\n".join(json.dumps(x) for x in questions) + "\n", encoding="utf-8")
    return docs_path, questions_path, gold


PLUGIN = textwrap.dedent(
    """
    import json, os

    GOLD = json.loads(open(os.environ["EVAL_GOLD"], encoding="utf-8").read())

    class Oracle:
        def __init__(self, corpus):
            self.filler = corpus.chunks

        def retrieve(self, question, *, max_tokens):
            return [GOLD[question][0], *self.filler]

    class Unrelated:
        def __init__(self, corpus):
            pass

        def retrieve(self, question, *, max_tokens):
            return ["Rockets burn fuel and carry satellites into orbit around the earth."] * 50
    """
)


def _raptor(
    args: list[str], *, env: dict[str, str] | None = None, plugins: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``raptor ARGS`` in a process of its own, offline; ``plugins``: a folder holding
    evalplug.py."""
    full = dict(env or {})
    if plugins is not None:
        full["PYTHONPATH"] = os.pathsep.join([str(plugins), os.environ.get("PYTHONPATH", "")])
        full["EVAL_GOLD"] = str(plugins / "gold.json")
    return warm_python.raptor(*args, env=full)


def test_eval_cli_end_to_end(tmp_path: Path) -> None:
    docs, questions, gold = _dataset(tmp_path)
    (tmp_path / "evalplug.py").write_text(PLUGIN, encoding="utf-8")
    (tmp_path / "gold.json").write_text(json.dumps(gold), encoding="utf-8")
    out = tmp_path / "out"
    retrievers = [
        "collapsed",
        "traversal",
        "value",
        "bm25",
        "dense",
        "llamaindex-vector",
        "langchain-inmemory-default-chunking",
        "oracle=evalplug:Oracle",
        "unrelated=evalplug:Unrelated",
    ]
    args = [
        "eval",
        "--docs", str(docs),
        "--questions", str(questions),
        "--retrievers", ",".join(retrievers),
        "--budgets", "100,400",
        "--out", str(out),
    ]  # fmt: skip
    proc = _raptor(args, plugins=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "oracle" in proc.stdout and "evidence" in proc.stdout

    assert (out / "recall.png").read_bytes()[:4] == b"\x89PNG"
    result = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert result["config"]["trees"] == 2 and result["config"]["questions"] == 6
    assert set(result["config"]["retrievers"]) == {r.split("=")[0] for r in retrievers}
    for row in result["rows"]:
        assert row["context_tokens"] <= row["budget"]
        for metric in ("evidence_recall", "answer_recall"):
            assert 0.0 <= row[metric] <= 1.0
    score = {(e["retriever"], e["budget"]): e for e in result["summary"]}
    assert score["oracle", 400]["evidence_recall"] == 1.0
    assert score["oracle", 400]["answer_recall"] == 1.0
    assert score["unrelated", 400]["evidence_recall"] == 0.0
    # Real retrievers find the (distinctively named) village at a 400-token budget.
    for name in ("collapsed", "dense", "bm25", "llamaindex-vector"):
        assert score[name, 400]["evidence_recall"] > score["unrelated", 400]["evidence_recall"]
    # Same chunks, same model: LlamaIndex's default retriever ranks like the dense baseline.
    assert (
        score["llamaindex-vector", 400]["evidence_recall"] == score["dense", 400]["evidence_recall"]
    )


@pytest.mark.slow
def test_eval_cli_llm_summaries_through_an_openai_compatible_server(tmp_path: Path) -> None:
    # The harness's LLM path (`--llm openai --llm-summaries`), through the real openai client
    # and the local test server: what a user runs against a real model (docs/evaluation.md).
    docs, questions, _ = _dataset(tmp_path)
    out = tmp_path / "out"
    with FakeOpenAIServer() as server:
        args = [
            "eval",
            "--docs", str(docs),
            "--questions", str(questions),
            "--retrievers", "passage,collapsed,llm,dense",
            "--budgets", "400",
            "--llm", "openai", "--llm-model", "fake-chat", "--llm-base-url", server.url,
            "--llm-summaries",
            "--chunk-tokens", "40",  # enough leaves for a layer of summaries
            "--out", str(out),
        ]  # fmt: skip
        proc = _raptor(args, env={"OPENAI_API_KEY": "sk-test-eval"})
        chats = server.requests("chat")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert "LLMSummarizer" in json.dumps(result["config"]["summarizer"])
    assert set(result["config"]["retrievers"]) == {"passage", "collapsed", "llm", "dense"}
    # Every summary node of the cached trees is the server's answer (its "S<hash>" tag).
    from raptor_core import Tree

    trees = [Tree.load(path.parent) for path in (out / "trees").rglob("tree.json")]
    assert len(trees) == 2
    summaries = [node.text for tree in trees for node in tree.nodes if node.layer > 0]
    assert summaries and all(re.match(r"S[0-9a-f]{8} ", text) for text in summaries)
    assert len(chats) >= len(summaries)
    score = {(e["retriever"], e["budget"]): e for e in result["summary"]}
    for name in ("passage", "collapsed", "llm", "dense"):
        assert 0.0 <= score[name, 400]["evidence_recall"] <= 1.0


def _river_questions(docs_path: Path, questions_path: Path) -> None:
    """Rewrite the questions as multiple choice: beside which river does a village lie?"""
    rng = random.Random(11)
    records = []
    for line in docs_path.read_text(encoding="utf-8").splitlines():
        doc = json.loads(line)
        for name, river in re.findall(
            r"The village of (\w+) lies beside the (\w+) river", doc["text"]
        ):
            options = [river, *rng.sample([r for r in RIVERS if r != river], 3)]
            rng.shuffle(options)
            records.append(
                {
                    "doc_id": doc["doc_id"],
                    "question_id": f"river-{name}",
                    "question": f"Beside which river does the village of {name} lie?",
                    "options": options,
                    "gold_option": options.index(river),
                }
            )
    questions_path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")


def _river_reader(prompt: str, max_tokens: int | None = None) -> str:
    """The test server's reader: answers from the context it is given, or gives up."""
    context = prompt.split("Context:", 1)[1].split("Question:", 1)[0]
    name = re.search(r"village of (\w+) lie\?", prompt)
    assert name is not None, prompt[-300:]
    found = re.search(rf"The village of {name[1]} lies beside the (\w+) river", context)
    if found is None:
        return "The context does not say."
    for letter, option in re.findall(r"^([A-D])\. (\w+)$", prompt, flags=re.MULTILINE):
        if option == found[1]:
            return f"Answer: {letter}"
    return "none of these"


@pytest.mark.slow
def test_eval_cli_reader_through_an_openai_compatible_server(tmp_path: Path) -> None:
    # QuALITY-style multiple choice (`--reader llm`): the reader model answers from each
    # retriever's context, through the real openai client and the local test server.
    docs, questions, gold = _dataset(tmp_path)
    _river_questions(docs, questions)
    (tmp_path / "evalplug.py").write_text(PLUGIN, encoding="utf-8")
    (tmp_path / "gold.json").write_text(json.dumps(gold), encoding="utf-8")
    out = tmp_path / "out"
    with FakeOpenAIServer(completion=_river_reader) as server:
        args = [
            "eval",
            "--docs", str(docs),
            "--questions", str(questions),
            "--retrievers", "passage,dense,unrelated=evalplug:Unrelated",
            "--budgets", "200",
            "--llm", "openai", "--llm-model", "fake-chat", "--llm-base-url", server.url,
            "--reader", "llm",
            "--out", str(out),
        ]  # fmt: skip
        proc = _raptor(args, env={"OPENAI_API_KEY": "sk-test-eval"}, plugins=tmp_path)
        chats = server.requests("chat")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "results.json").read_text(encoding="utf-8"))
    score = {e["retriever"]: e for e in result["summary"]}
    n = score["passage"]["n_choice_accuracy"]
    assert n == 16  # every village
    # The real embedder finds each village's paragraph: the reader answers from it.
    assert score["passage"]["choice_accuracy"] >= 0.75
    assert score["dense"]["choice_accuracy"] >= 0.75
    # Unrelated context: the reader gives up (asked twice), scored 0 and counted.
    assert score["unrelated"]["choice_accuracy"] == 0.0
    assert score["unrelated"]["reader_failures"] == n
    # One call per question and retriever, plus the second try after each give-up.
    assert len(chats) == sum(n + entry["reader_failures"] for entry in score.values())
    assert all("A. " in chat.prompt and "Context:" in chat.prompt for chat in chats)
    assert "reader: " in proc.stdout and "choice" in proc.stdout
