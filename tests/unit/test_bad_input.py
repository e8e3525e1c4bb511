"""Bad input across the package: every case gets a typed error or a documented behaviour.

Never a stack trace from numpy, UMAP or scikit-learn.  The documented behaviours
(docs/llm-services.md, "Bad input"):

* empty, whitespace-only and binary documents, duplicate doc ids, and no documents at all
  raise InvalidInputError; so do binary and invalid-UTF-8 files read by the CLI;
* duplicated *texts* under different ids are kept (two leaves with identical vectors);
* non-English text and text without sentence punctuation are chunked by tokens and build;
* a 5 MB single line builds;
* NaN, infinite, all-zero or wrongly shaped embeddings raise EmbeddingError;
* an empty (or non-string) summary raises SummarizationError naming the layer and cluster.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai_server import GroupClusterer

from raptor_core.build.builder import TreeBuilder
from raptor_core.cli import main, read_documents
from raptor_core.exceptions import (
    EmbeddingError,
    InvalidInputError,
    RaptorError,
    SummarizationError,
)
from raptor_core.retrieval import CollapsedTreeRetriever
from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer
from raptor_core.types import Document

pytestmark = pytest.mark.timeout(120)

GERMAN = (
    "Die Katze schläft auf dem Sofa. Größere Hunde bellen laut im Hof! "
    "Über die Brücke fährt ein Zug nach München. Straßenbahnen sind in Zürich üblich."
)
CHINESE = "猫在沙发上睡觉。狗在院子里大声叫！火车经过桥梁开往北京。上海有很多电车吗？我们明天见。"
ARABIC = "القطة تنام على الأريكة. الكلاب تنبح بصوت عال في الفناء! هل يذهب القطار إلى القاهرة؟ نعم."
SAMPLE = [
    "Cats purr on the sofa. Dogs bark at the mail carrier. Birds sing before dawn.",
    "Rockets burn fuel to reach orbit. Satellites circle the earth. Launch pads roar.",
    "Bakers knead the dough at night. Yeast makes bread rise. Ovens bake the loaves.",
]
NO_PUNCTUATION = " ".join(
    ["word"] * 5 + ["another", "token", "stream", "without", "any", "stops"] * 40
)


def fast_builder(embedder: Any = None, summarizer: Any = None, **kwargs: Any) -> TreeBuilder:
    params: dict[str, Any] = {
        "tokenizer": WhitespaceTokenizer(),
        "clusterer": GroupClusterer(),
        "chunk_max_tokens": 10,
        "summary_max_tokens": 8,
    }
    params.update(kwargs)
    return TreeBuilder(embedder or FakeEmbedder(16), summarizer or EchoSummarizer(), **params)


def _assert_leaves_cover(tree, docs: dict[str, str]) -> None:
    for leaf in tree.leaves:
        assert leaf.span is not None
        start, end = leaf.span
        assert docs[leaf.doc_id][start:end].strip() == leaf.text


# -- documents ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("documents", "match"),
    [
        ([], "no documents"),
        ([""], "empty"),
        (["   \n\t  "], "empty"),
        (["fine text.", "\u3000\u2003"], "empty"),  # Unicode spaces only
        (["text with a NUL \x00 byte"], "binary"),
        (["".join(chr(i) for i in range(1, 32)) * 10], "binary"),
        ([b"bytes are not text"], "must be a str"),
        ([Document(text="a.", doc_id="x"), Document(text="b.", doc_id="x")], "duplicate doc_id"),
        ([{"doc_id": "x"}], "no 'text'"),
        ([{"text": "ok.", "metadata": {"when": object()}}], "JSON"),
        ([None], "must be a str"),
    ],
)
def test_unusable_documents_raise_invalid_input(documents, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        fast_builder().build(documents)


def test_duplicated_texts_are_kept_as_separate_documents() -> None:
    text = "Cats purr softly. Kittens chase string all day long."
    tree = fast_builder().build([text, text, text])
    assert tree.doc_ids == ("doc-0", "doc-1", "doc-2")
    per_doc = [[n.text for n in tree.leaves if n.doc_id == d] for d in tree.doc_ids]
    assert per_doc[0] == per_doc[1] == per_doc[2]
    hits = CollapsedTreeRetriever(tree, FakeEmbedder(16), k=3).retrieve("cats purr")
    assert hits and all(np.isfinite(h.score) for h in hits)


@pytest.mark.parametrize(
    "text", [GERMAN, CHINESE, ARABIC, NO_PUNCTUATION], ids=["de", "zh", "ar", "nopunct"]
)
def test_non_english_and_unpunctuated_text_builds_with_the_default_tokenizer(text: str) -> None:
    builder = TreeBuilder(
        FakeEmbedder(16), EchoSummarizer(), clusterer=GroupClusterer(), chunk_max_tokens=12
    )
    docs = {"a": text, "b": text[::-1]}
    tree = builder.build([{"doc_id": k, "text": v} for k, v in docs.items()])
    _assert_leaves_cover(tree, docs)
    assert all(leaf.token_count <= 12 for leaf in tree.leaves)
    assert tree.num_layers >= 2
    hits = CollapsedTreeRetriever(tree, FakeEmbedder(16), k=2).retrieve(text[:20])
    assert hits


def test_five_megabyte_single_line_builds() -> None:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "rocket", "bread", "river", "cat", "report", "budget"]
    sentences, size = [], 0
    while size < 5_000_000:
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(6, 20))).capitalize() + "."
        sentences.append(sentence)
        size += len(sentence) + 1
    line = " ".join(sentences)
    assert "\n" not in line and len(line) >= 5_000_000
    builder = TreeBuilder(
        FakeEmbedder(16), EchoSummarizer(), clusterer=GroupClusterer(10), max_layers=1
    )
    tree = builder.build([line])
    assert len(tree.leaves) > 5000
    assert all(leaf.token_count <= 100 for leaf in tree.leaves)
    first, last = tree.leaves[0], tree.leaves[-1]
    assert first.span is not None and last.span is not None
    assert line[first.span[0] : first.span[1]] == first.text and last.span[1] == len(line)


# -- files and the CLI -------------------------------------------------------------------------
def test_binary_and_invalid_utf8_files(tmp_path, capsys) -> None:
    binary = tmp_path / "image.txt"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Größe und Übermaß.".encode("latin-1"))
    empty = tmp_path / "empty.md"
    empty.write_text("  \n")
    with pytest.raises(InvalidInputError, match="binary"):
        read_documents([str(binary)])
    with pytest.raises(InvalidInputError, match=r"not valid UTF-8.*convert"):
        read_documents([str(latin1)])
    for path in (binary, latin1, empty):
        code = main(["build", str(path), "--out", str(tmp_path / "out"), "--quiet"])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("raptor build: error:") and "Traceback" not in err
    bom = tmp_path / "bom.txt"
    bom.write_bytes("\ufeffText with a byte order mark.".encode())
    assert read_documents([str(bom)])[0].text == "Text with a byte order mark."


def test_malformed_jsonl(tmp_path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text('{"doc_id": "a", "text": "fine."}\n{"doc_id": "b", "text": 3}\n')
    with pytest.raises(InvalidInputError, match=r"docs.jsonl:2"):
        read_documents([str(path)])
    path.write_text('{"doc_id": "a", "text": "fine."}\nnot json\n')
    with pytest.raises(InvalidInputError, match=r"docs.jsonl:2 is not valid JSON"):
        read_documents([str(path)])


# -- embedders ---------------------------------------------------------------------------------
class BadEmbedder:
    """Returns vectors with a defect at row ``row`` (or a broken shape)."""

    def __init__(self, defect: str, row: int = 1) -> None:
        self.defect = defect
        self.row = row
        self.inner = FakeEmbedder(8)

    def embed_documents(self, texts: Sequence[str]):
        out = self.inner.embed_documents(texts).copy()
        if self.defect == "nan":
            out[min(self.row, len(out) - 1)] = np.nan
        elif self.defect == "inf":
            out[min(self.row, len(out) - 1), 0] = np.inf
        elif self.defect == "zero":
            out[min(self.row, len(out) - 1)] = 0.0
        elif self.defect == "short":
            return out[:-1]
        elif self.defect == "flat":
            return out.reshape(-1)
        elif self.defect == "none":
            return None
        elif self.defect == "ragged":
            return [list(row) for row in out[:-1]] + [[1.0]]
        elif self.defect == "strings":
            return [["a"] * 8 for _ in texts]
        return out

    def embed_query(self, text: str):
        return self.inner.embed_query(text)


@pytest.mark.parametrize(
    "defect", ["nan", "inf", "zero", "short", "flat", "none", "ragged", "strings"]
)
def test_unusable_embeddings_raise_embedding_error(defect: str) -> None:
    with pytest.raises(EmbeddingError):
        fast_builder(BadEmbedder(defect)).build(SAMPLE)


def test_embedding_dimension_change_between_layers() -> None:
    class Shrinking:
        def __init__(self) -> None:
            self.calls = 0

        def embed_documents(self, texts):
            self.calls += 1
            dim = 8 if self.calls == 1 else 4
            return np.random.default_rng(self.calls).normal(size=(len(texts), dim))

        def embed_query(self, text):
            return np.ones(8)

    with pytest.raises(EmbeddingError, match="dimension changed"):
        fast_builder(Shrinking()).build(SAMPLE)


def test_bad_query_vectors_raise_embedding_error() -> None:
    tree = fast_builder().build(["Cats purr. Dogs bark. Birds sing."])
    for vector in (np.full(16, np.nan), np.zeros(16), np.ones(5)):

        class Query(FakeEmbedder):
            def embed_query(self, text, _v=vector):
                return _v

        with pytest.raises(EmbeddingError):
            CollapsedTreeRetriever(tree, Query(16)).retrieve("cats")
    for query in ("", "   ", None, b"cats"):
        with pytest.raises(InvalidInputError):
            CollapsedTreeRetriever(tree, FakeEmbedder(16)).retrieve(query)  # type: ignore[arg-type]


# -- summarisers -------------------------------------------------------------------------------
class ConstantSummarizer:
    def __init__(self, answer: object) -> None:
        self.answer = answer

    def summarize(self, texts: Sequence[str], *, max_tokens: int):
        return self.answer


@pytest.mark.parametrize("answer", ["", "   \n", None, 42, ["a list"]])
def test_empty_or_non_string_summary_raises_summarization_error(answer: object) -> None:
    with pytest.raises(SummarizationError, match=r"layer 1, cluster \d+.*empty summary"):
        fast_builder(summarizer=ConstantSummarizer(answer)).build(SAMPLE)


def test_summarizer_exception_is_wrapped_with_its_place() -> None:
    class Crashing:
        def summarize(self, texts, *, max_tokens):
            return 1 / 0

    with pytest.raises(SummarizationError, match=r"layer 1, cluster 0.*ZeroDivisionError"):
        fast_builder(summarizer=Crashing()).build(SAMPLE)


# -- real UMAP + GMM on degenerate input -------------------------------------------------------
@pytest.mark.parametrize(
    "documents",
    [
        ["The same sentence again."] * 40,  # identical vectors
        ["Only one short document."],
        ["First. Second.", "Third."],
        ["x"] * 3 + ["y"] * 3,  # two points repeated
    ],
    ids=["40-duplicates", "one-chunk", "three-chunks", "two-points"],
)
def test_real_clustering_survives_degenerate_input(documents: list[str]) -> None:
    from raptor_core.build.clustering import GMMClusterer

    builder = TreeBuilder(
        FakeEmbedder(16),
        EchoSummarizer(),
        tokenizer=WhitespaceTokenizer(),
        clusterer=GMMClusterer(random_state=0),
        chunk_max_tokens=8,
    )
    tree = builder.build(documents)
    assert len(tree.leaves) >= 1 and np.all(np.isfinite(tree.embeddings))
    assert tree.build_info["stop_reason"]


# -- properties --------------------------------------------------------------------------------
_texts = st.text(alphabet=st.characters(codec="utf-8"), min_size=0, max_size=300)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_texts, min_size=0, max_size=4))
def test_any_text_builds_or_raises_invalid_input(texts: list[str]) -> None:
    try:
        tree = fast_builder().build(texts)
    except InvalidInputError:
        return
    docs = {f"doc-{i}": t for i, t in enumerate(texts)}
    _assert_leaves_cover(tree, docs)
    assert all(leaf.token_count <= 10 for leaf in tree.leaves)
    assert np.all(np.isfinite(tree.embeddings))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_texts.filter(str.strip), min_size=1, max_size=3))
def test_any_text_with_the_default_tokenizer(texts: list[str]) -> None:
    builder = TreeBuilder(
        FakeEmbedder(16), EchoSummarizer(), clusterer=GroupClusterer(), chunk_max_tokens=16
    )
    try:
        tree = builder.build(texts)
    except InvalidInputError:
        return
    _assert_leaves_cover(tree, {f"doc-{i}": t for i, t in enumerate(texts)})


_vectors = st.lists(
    st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=4, max_size=4
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_vectors, min_size=3, max_size=3))
def test_any_embedding_values_build_or_raise_embedding_error(rows: list[list[float]]) -> None:
    class Fixed:
        def embed_documents(self, texts):
            return np.array([rows[i % 3] for i in range(len(texts))], dtype=np.float32)

        def embed_query(self, text):
            return np.array(rows[0], dtype=np.float32)

    try:
        tree = fast_builder(Fixed(), max_layers=1).build(["a b c. d e f. g h i.", "j k l. m n o."])
    except EmbeddingError:
        return
    except RaptorError as exc:  # pragma: no cover - any other typed error is a finding too
        pytest.fail(f"unexpected {type(exc).__name__}: {exc}")
    assert np.allclose(np.linalg.norm(tree.embeddings, axis=1), 1.0, atol=1e-4)
