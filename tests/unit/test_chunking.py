from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raptor_core import tokenizers
from raptor_core.build.chunking import SentenceChunker, split_sentences
from raptor_core.exceptions import InvalidInputError, InvalidParameterError, MissingDependencyError
from raptor_core.tokenizers import (
    RegexTokenizer,
    TiktokenTokenizer,
    TokenizerFallbackWarning,
    count_tokens,
)
from raptor_core.types import Chunk, Chunker, Tokenizer


def _tiktoken_or_none() -> Tokenizer | None:
    try:
        tok = TiktokenTokenizer()
        tok.count("x")
    except MissingDependencyError:
        return None
    return tok


_TIKTOKEN = _tiktoken_or_none()
TOKENIZERS = [
    pytest.param(RegexTokenizer(), id="regex"),
    pytest.param(
        _TIKTOKEN,
        id="tiktoken",
        marks=pytest.mark.skipif(_TIKTOKEN is None, reason="cl100k_base cannot be loaded"),
    ),
]
REGEX = RegexTokenizer()


@pytest.fixture(autouse=True)
def _fresh_default() -> Iterator[None]:
    yield
    tokenizers._reset_caches()


def sentences_of(text: str) -> list[str]:
    return [text[s:e] for s, e in split_sentences(text)]


def check_invariants(text: str, chunks: Sequence[Chunk], tok: Tokenizer, max_tokens: int) -> None:
    """Everything a chunking must satisfy, whatever the text."""
    previous_end = 0
    for chunk in chunks:
        assert previous_end <= chunk.start < chunk.end <= len(text)
        assert text[chunk.start : chunk.end] == chunk.text
        assert chunk.text == chunk.text.strip()
        assert chunk.token_count == count_tokens(tok, chunk.text)
        assert chunk.token_count <= max_tokens
        # Nothing but whitespace between chunks: no character is lost.
        assert text[previous_end : chunk.start].strip() == ""
        previous_end = chunk.end
    assert text[previous_end:].strip() == ""


# --------------------------------------------------------------------------- split_sentences


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "Mr. Smith met Dr. Jones. They talked.",
            ["Mr. Smith met Dr. Jones.", "They talked."],
        ),
        (
            "Fruit, e.g. apples, i.e. food. The U.S. Army came. John F. Kennedy spoke.",
            ["Fruit, e.g. apples, i.e. food.", "The U.S. Army came.", "John F. Kennedy spoke."],
        ),
        ("See Fig. 3 and No. 5 on Jan. 5. Done.", ["See Fig. 3 and No. 5 on Jan. 5.", "Done."]),
        ("Apples, pears, etc. The end.", ["Apples, pears, etc.", "The end."]),
        (
            "He paused... Then he left. And so... on it went.",
            ["He paused...", "Then he left.", "And so... on it went."],
        ),
        (
            '"Why?" she asked. "Because." He left!',
            ['"Why?" she asked.', '"Because."', "He left!"],
        ),
        ("(This is an aside.) Next one?! Yes.", ["(This is an aside.)", "Next one?!", "Yes."]),
        (
            "Visit example.com today. It is v1.2.3 now.",
            ["Visit example.com today.", "It is v1.2.3 now."],
        ),
        ("Ms. Lee, Ph.D. in physics, and Prof. Ng met at 9 a.m. today.", None),
    ],
)
def test_split_sentences_english(text: str, expected: list[str] | None) -> None:
    assert sentences_of(text) == (expected or [text])


def test_split_sentences_decimals() -> None:
    assert sentences_of("Pi is 3.14 and e is 2.718. Both are irrational.") == [
        "Pi is 3.14 and e is 2.718.",
        "Both are irrational.",
    ]
    assert sentences_of("It costs $1,000.50 today. Prices rise.") == [
        "It costs $1,000.50 today.",
        "Prices rise.",
    ]


def test_split_sentences_cjk_and_other_scripts() -> None:
    assert sentences_of("第一句话。第二句话！第三句？最后") == [
        "第一句话。",
        "第二句话！",
        "第三句？",
        "最后",
    ]
    assert sentences_of("「你好。」他说。") == ["「你好。」", "他说。"]
    assert sentences_of("Это первое. Это второе!") == ["Это первое.", "Это второе!"]


def test_split_sentences_line_breaks() -> None:
    text = "Title\n\nFirst paragraph here. Second sentence\n\nnext paragraph starts lower"
    assert sentences_of(text) == [
        "Title",
        "First paragraph here.",
        "Second sentence",
        "next paragraph starts lower",
    ]
    # Single line breaks: hard-wrapped prose continues, a capitalised line starts anew.
    text = "It was the best of times, it was\nthe worst of times. A list:\n- one\n- two\nEnd"
    assert sentences_of(text) == [
        "It was the best of times, it was\nthe worst of times.",
        "A list:",
        "- one",
        "- two",
        "End",
    ]
    assert sentences_of("1. First item\n2. Second item\r\n\r\nDone.") == [
        "1. First item",
        "2. Second item",
        "Done.",
    ]


def test_split_sentences_edge_cases() -> None:
    assert split_sentences("") == []
    assert split_sentences(" \n\t\n ") == []
    assert sentences_of("  no punctuation at all  ") == ["no punctuation at all"]
    assert sentences_of("...") == ["..."]
    assert sentences_of("Hi.\n\nthere") == ["Hi.", "there"]
    assert split_sentences("  Hi.  ") == [(2, 5)]


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_split_sentences_covers_text(text: str) -> None:
    previous_end = 0
    for start, end in split_sentences(text):
        assert previous_end <= start < end
        assert text[start:end] == text[start:end].strip()
        assert text[previous_end:start].strip() == ""
        previous_end = end
    assert text[previous_end:].strip() == ""


# --------------------------------------------------------------------------- parameters


def test_chunker_satisfies_protocol_and_stores_params() -> None:
    tok = RegexTokenizer()
    chunker = SentenceChunker(tok, max_tokens=3)  # stored as given, checked in split
    assert isinstance(chunker, Chunker)
    assert chunker.tokenizer is tok
    assert chunker.max_tokens == 3
    assert chunker.get_params() == {"tokenizer": tok, "max_tokens": 3}
    assert "max_tokens=3" in repr(chunker)


@pytest.mark.parametrize("max_tokens", [0, -5, 7, 8.0, "100", True, None])
def test_invalid_max_tokens(max_tokens: object) -> None:
    chunker = SentenceChunker(REGEX, max_tokens=max_tokens)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match="max_tokens must be an integer >= 8"):
        chunker.split("Some text.")


def test_numpy_integer_max_tokens() -> None:
    chunks = SentenceChunker(REGEX, max_tokens=np.int64(8)).split("One two. Three four.")
    assert all(c.token_count <= 8 for c in chunks)


def test_invalid_tokenizer_and_text() -> None:
    with pytest.raises(InvalidParameterError, match="tokenizer"):
        SentenceChunker("cl100k_base").split("text")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        SentenceChunker(REGEX).split(b"bytes")  # type: ignore[arg-type]


def test_empty_text() -> None:
    assert SentenceChunker(REGEX).split("") == []
    assert SentenceChunker(REGEX).split(" \n\n\t ") == []


def test_default_tokenizer_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizers._reset_caches()
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.warns(TokenizerFallbackWarning):
        chunks = SentenceChunker(max_tokens=20).split("A short text. Another sentence.")
    assert [c.text for c in chunks] == ["A short text. Another sentence."]
    assert chunks[0].token_count == RegexTokenizer().count(chunks[0].text)


# --------------------------------------------------------------------------- behaviour


def test_greedy_packing_keeps_sentences_whole() -> None:
    # RegexTokenizer: every word is one token, and so is every period.
    text = "Aa bb cc. Dd ee ff. Gg hh ii. Jj kk ll mm nn oo pp."
    chunks = SentenceChunker(REGEX, max_tokens=9).split(text)
    assert [c.text for c in chunks] == ["Aa bb cc. Dd ee ff.", "Gg hh ii.", "Jj kk ll mm nn oo pp."]
    assert [c.token_count for c in chunks] == [8, 4, 8]
    check_invariants(text, chunks, REGEX, 9)


def test_long_sentence_is_cut_at_clauses_first() -> None:
    clause = "one two three four five six"  # 6 tokens, 7 with its mark
    text = f"Start here. {clause}, {clause}; {clause}: {clause} — {clause}. End here."
    chunks = SentenceChunker(REGEX, max_tokens=10).split(text)
    check_invariants(text, chunks, REGEX, 10)
    # The pieces of a long sentence are packed like sentences, with their neighbours.
    assert [c.text for c in chunks] == [
        f"Start here. {clause},",
        f"{clause};",
        f"{clause}:",
        f"{clause} —",
        f"{clause}. End here.",
    ]


def test_long_clause_is_cut_at_whitespace_then_characters() -> None:
    words = " ".join(f"word{i}" for i in range(60))
    chunks = SentenceChunker(REGEX, max_tokens=10).split(words)
    check_invariants(words, chunks, REGEX, 10)
    assert all(c.text.split()[-1].startswith("word") for c in chunks)
    assert " ".join(c.text for c in chunks) == words  # cut between whole words only
    text = "Before. " + "x" * 5000 + " After."
    chunks = SentenceChunker(REGEX, max_tokens=10).split(text)
    check_invariants(text, chunks, REGEX, 10)
    assert len(chunks) >= 5000 // 60  # 6 letters per RegexTokenizer token
    assert "".join(c.text for c in chunks).replace(" ", "") == text.replace(" ", "")


@pytest.mark.parametrize("tok", TOKENIZERS)
def test_no_punctuation_and_cjk(tok: Tokenizer) -> None:
    text = " ".join(["lorem ipsum dolor sit amet consectetur"] * 200)
    chunks = SentenceChunker(tok, max_tokens=50).split(text)
    check_invariants(text, chunks, tok, 50)
    assert len(chunks) > 1
    cjk = "我们今天在公园里散步看见了很多花" * 50
    chunks = SentenceChunker(tok, max_tokens=20).split(cjk)
    check_invariants(cjk, chunks, tok, 20)
    assert "".join(c.text for c in chunks) == cjk


def test_chunk_smaller_than_a_character_is_an_error() -> None:
    class Expensive:
        """Ten tokens per character."""

        def encode(self, text: str) -> list[int]:
            return [0] * (10 * len(text))

        def decode(self, ids: Sequence[int]) -> str:
            return ""

    with pytest.raises(InvalidParameterError, match="too small for this tokenizer"):
        SentenceChunker(Expensive(), max_tokens=8).split("abc")


class WithSpecialTokens:
    """RegexTokenizer plus BOS and EOS on every text, like many Hugging Face tokenizers."""

    def __init__(self) -> None:
        self.inner = RegexTokenizer()

    def encode(self, text: str) -> list[int]:
        return [-1, *self.inner.encode(text), -2]

    def decode(self, ids: Sequence[int]) -> str:
        return self.inner.decode([i for i in ids if i >= 0])


def test_special_tokens_are_counted_once_per_chunk() -> None:
    tok = WithSpecialTokens()
    text = " ".join(["Aa bb cc."] * 8)  # 4 tokens per sentence, 6 with BOS and EOS
    chunks = SentenceChunker(tok, max_tokens=20).split(text)
    check_invariants(text, chunks, tok, 20)
    assert [c.token_count for c in chunks] == [18, 18]


class CountingTokenizer:
    """RegexTokenizer that records how many characters it was asked to count."""

    def __init__(self) -> None:
        self.inner = RegexTokenizer()
        self.chars = 0

    def encode(self, text: str) -> list[int]:
        self.chars += len(text)
        return self.inner.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.inner.decode(ids)

    def count(self, text: str) -> int:
        self.chars += len(text)
        return self.inner.count(text)


@pytest.mark.parametrize(
    "unit",
    [
        "The quick brown fox jumps over the lazy dog, again and again. ",  # sentences
        "the quick brown fox jumps over the lazy dog again and again ",  # no punctuation
        "abcdefghij",  # no whitespace at all
    ],
)
def test_one_megabyte_single_line_is_linear(unit: str) -> None:
    # Linear by construction: the tokenizer sees each character a small, fixed number
    # of times (once per sentence, clause or word holding it, and in at most three
    # chunk-sized counts per chunk), never in growing re-encoded prefixes: a
    # quadratic chunker would count ~10,000 times the text here.  Checked by
    # counting, not by a timer.
    text = unit * (1_000_000 // len(unit))
    tok = CountingTokenizer()
    chunks = SentenceChunker(tok, max_tokens=100).split(text)
    check_invariants(text, chunks, tok.inner, 100)
    assert tok.chars <= 8 * len(text)
    assert sum(c.token_count for c in chunks) >= 0.8 * tok.inner.count(text)


@pytest.mark.parametrize("tok", TOKENIZERS)
def test_chunk_text_is_exact_slice(tok: Tokenizer) -> None:
    text = "  Hello there.\n\n  General Kenobi!   You are a bold one.  \n"
    chunks = SentenceChunker(tok, max_tokens=8).split(text)
    check_invariants(text, chunks, tok, 8)
    assert chunks[0].start == 2


# --------------------------------------------------------------------------- properties

WORDS = [
    "apple",
    "river",
    "stone",
    "light",
    "quiet",
    "garden",
    "window",
    "the",
    "of",
    "a",
    "remarkable",
    "internationalisation",
    "7",
    "2024",
    "3.14",
    "naïve",
    "café",
    "über",
]
SEPARATORS = [" ", "  ", "\n", "\n\n", " \n\n ", "\t"]


@st.composite
def documents(draw: st.DrawFn) -> tuple[str, list[tuple[int, int]]]:
    """A text built from sentences whose spans are known."""
    n = draw(st.integers(1, 12))
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    for i in range(n):
        words = draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=45))
        # A sentence starts with a capitalised word; "A." or "7." alone would read as
        # an initial or a list number.
        words[0] = words[0].capitalize() if words[0].isalpha() and len(words[0]) > 1 else "Then"
        body = ""
        for j, word in enumerate(words):
            if j:
                body += draw(st.sampled_from([" ", " ", " ", ", ", "; ", " — "]))
            body += word
        sentence = body + draw(st.sampled_from([".", "!", "?", "...", '."', ".)"]))
        if i:
            sep = draw(st.sampled_from(SEPARATORS))
            parts.append(sep)
            pos += len(sep)
        parts.append(sentence)
        spans.append((pos, pos + len(sentence)))
        pos += len(sentence)
    return "".join(parts), spans


@pytest.mark.parametrize("tok", TOKENIZERS)
@settings(max_examples=60, deadline=None)
@given(doc=documents(), max_tokens=st.integers(8, 60))
def test_property_sentences(
    tok: Tokenizer, doc: tuple[str, list[tuple[int, int]]], max_tokens: int
) -> None:
    text, spans = doc
    assert split_sentences(text) == spans
    chunks = SentenceChunker(tok, max_tokens=max_tokens).split(text)
    check_invariants(text, chunks, tok, max_tokens)
    for start, end in spans:
        holders = [c for c in chunks if c.start <= start and end <= c.end]
        if count_tokens(tok, text[start:end]) <= max_tokens:
            assert len(holders) == 1, "a sentence that fits was split"
        else:
            assert not holders
            pieces = [c for c in chunks if start <= c.start < end or start < c.end <= end]
            assert len(pieces) >= 2


TEXT_ALPHABET = st.one_of(
    st.sampled_from(list("abcXYZ .,;:!?…—-'\"()\n\t。！？「」的是")),
    st.characters(),
)


@pytest.mark.parametrize("tok", TOKENIZERS)
@settings(max_examples=80, deadline=None)
@given(text=st.text(TEXT_ALPHABET, max_size=400), max_tokens=st.integers(8, 40))
def test_property_arbitrary_text(tok: Tokenizer, text: str, max_tokens: int) -> None:
    chunks = SentenceChunker(tok, max_tokens=max_tokens).split(text)
    check_invariants(text, chunks, tok, max_tokens)


class Superadditive:
    """Joined texts cost more than their parts: every fourth word adds a token.

    Packing estimates from the parts are then too low, and only the exact count of a
    closed chunk reveals the overflow.
    """

    def encode(self, text: str) -> list[int]:
        words = text.split()
        return [0] * (len(words) + len(words) // 4)

    def decode(self, ids: Sequence[int]) -> str:
        return ""


@settings(max_examples=60, deadline=None)
@given(doc=documents(), max_tokens=st.integers(8, 40))
def test_underestimated_chunks_give_units_back(
    doc: tuple[str, list[tuple[int, int]]], max_tokens: int
) -> None:
    text, spans = doc
    tok = Superadditive()
    chunks = SentenceChunker(tok, max_tokens=max_tokens).split(text)
    check_invariants(text, chunks, tok, max_tokens)
    for start, end in spans:
        if count_tokens(tok, text[start:end]) <= max_tokens:
            assert any(c.start <= start and end <= c.end for c in chunks)
