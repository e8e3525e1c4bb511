"""Okapi BM25 over node texts: the lexical signal of the fused strategies.

The index is built from nothing but the texts it ranks (a tree's node texts), so any tree,
loaded from disk or read from an external store that returns texts, can have one.  Building
it is a few sparse-matrix operations (milliseconds for thousands of chunks).

Scoring follows Robertson and Zaragoza (2009) with Lucene's always-positive IDF::

    idf(t)      = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))
    score(d, q) = sum over distinct t in q of
                  idf(t) * tf(t, d) * (k1 + 1) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))

Tokens are lower-cased runs of letters and digits (any script), minus a short list of
English function words, with a light plural/inflection fold (see :func:`lexical_tokens`).
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from raptor_core.exceptions import InvalidParameterError

__all__ = ["STOPWORDS", "BM25Index", "lexical_tokens"]

_WORD = re.compile(r"[^\W_]+", re.UNICODE)

#: English function words: frequent in every chunk, so they only add noise to BM25.
STOPWORDS = frozenset(
    [
        "a",
        "about",
        "above",
        "after",
        "again",
        "against",
        "all",
        "am",
        "an",
        "and",
        "any",
        "are",
        "as",
        "at",
        "be",
        "because",
        "been",
        "before",
        "being",
        "below",
        "between",
        "both",
        "but",
        "by",
        "can",
        "could",
        "did",
        "do",
        "does",
        "doing",
        "down",
        "during",
        "each",
        "few",
        "for",
        "from",
        "further",
        "had",
        "has",
        "have",
        "having",
        "he",
        "her",
        "here",
        "hers",
        "herself",
        "him",
        "himself",
        "his",
        "how",
        "i",
        "if",
        "in",
        "into",
        "is",
        "it",
        "its",
        "itself",
        "just",
        "me",
        "more",
        "most",
        "my",
        "myself",
        "no",
        "nor",
        "not",
        "now",
        "of",
        "off",
        "on",
        "once",
        "only",
        "or",
        "other",
        "our",
        "ours",
        "ourselves",
        "out",
        "over",
        "own",
        "same",
        "she",
        "should",
        "so",
        "some",
        "such",
        "than",
        "that",
        "the",
        "their",
        "theirs",
        "them",
        "themselves",
        "then",
        "there",
        "these",
        "they",
        "this",
        "those",
        "through",
        "to",
        "too",
        "under",
        "until",
        "up",
        "very",
        "was",
        "we",
        "were",
        "what",
        "when",
        "where",
        "which",
        "while",
        "who",
        "whom",
        "why",
        "will",
        "with",
        "would",
        "you",
        "your",
        "yours",
        "yourself",
        "yourselves",
    ]
)


def _fold(word: str) -> str:
    """A light inflection fold, so "bees"/"bee" and "dances"/"dance" share a term.

    Deliberately conservative (plural and third-person ``-s``, ``-ies``): a full stemmer
    conflates unrelated words, and the dense signal already handles paraphrase.
    """
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def _words(text: str) -> list[str]:
    """The lower-cased words of ``text``, stop words included."""
    return _WORD.findall(text.lower())


def _term(word: str) -> str | None:
    """The BM25 term of a lower-cased word (None: a stop word)."""
    return None if word in STOPWORDS else _fold(word)


def lexical_tokens(text: str) -> list[str]:
    """The BM25 terms of ``text``: lower-cased words, stop words dropped, plurals folded.

    Examples:
        >>> lexical_tokens("The Bees of the hive, and 3 queens!")
        ['bee', 'hive', '3', 'queen']
    """
    return [term for term in map(_term, _words(text)) if term is not None]


class _TermIds(dict[str, int]):
    """Word -> its term id in ``vocabulary`` (-1: a stop word), computed on first sight."""

    def __init__(self, vocabulary: dict[str, int]) -> None:
        super().__init__()
        self.vocabulary = vocabulary

    def __missing__(self, word: str) -> int:
        term = _term(word)
        term_id = -1 if term is None else self.vocabulary.setdefault(term, len(self.vocabulary))
        self[word] = term_id
        return term_id


class BM25Index:
    """Okapi BM25 scores of a fixed list of texts.

    Args:
        texts: the texts to rank (for example a tree's leaf texts).
        k1: term-frequency saturation (1.5, the common default).
        b: length normalisation (0.75, the common default).

    Examples:
        >>> index = BM25Index(["bees dance", "rockets fly", "bees and rockets"])
        >>> [round(float(s), 3) for s in index.scores("bees")]
        [0.47, 0.0, 0.47]
    """

    def __init__(self, texts: Sequence[str], *, k1: float = 1.5, b: float = 0.75) -> None:
        if not k1 >= 0.0 or not 0.0 <= b <= 1.0:
            msg = f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={k1!r}, b={b!r}"
            raise InvalidParameterError(msg)
        self.k1 = k1
        self.b = b
        self.vocabulary: dict[str, int] = {}
        # The tokens of every text, as term ids (-1: a stop word), in one flat array.  Each
        # distinct word is folded and looked up once (a store of a million leaves holds tens
        # of millions of words but a few hundred thousand distinct ones); the rest is a
        # dictionary lookup in C.  Same terms, in the same order, as lexical_tokens.
        n = len(texts)
        term_ids = _TermIds(self.vocabulary)
        cols = array("q")
        per_text = np.zeros(n, dtype=np.int64)
        for i, text in enumerate(texts):
            words = _words(text)
            per_text[i] = len(words)
            cols.extend(map(term_ids.__getitem__, words))
        n_terms = len(self.vocabulary)
        all_cols = np.frombuffer(cols, dtype=np.int64)
        kept = all_cols >= 0
        cols_of = all_cols[kept]
        rows_of = np.repeat(np.arange(n, dtype=np.int64), per_text)[kept]
        # A compressed sparse column layout by hand (numpy only: scipy.sparse costs a query
        # process a few hundred milliseconds to import).  One entry per (term, text) pair,
        # sorted by term, then text; its count is the term frequency.
        pairs, tf_counts = np.unique(cols_of * max(n, 1) + rows_of, return_counts=True)
        text_of = pairs % max(n, 1)
        term_of = pairs // max(n, 1)
        lengths = np.bincount(rows_of, minlength=n).astype(np.float64)
        avgdl = float(lengths.mean()) if n and lengths.mean() > 0 else 1.0
        df = np.bincount(term_of, minlength=n_terms).astype(np.float64)
        self.idf: NDArray[np.float64] = np.log1p((n - df + 0.5) / (df + 0.5))
        # Precompute the per-(text, term) BM25 weight so a query is a column gather and a sum.
        tf = tf_counts.astype(np.float64)
        norm = k1 * (1.0 - b + b * lengths[text_of] / avgdl)
        self._data: NDArray[np.float64] = tf * (k1 + 1.0) / (tf + norm)
        self._indices: NDArray[np.int64] = text_of
        self._indptr: NDArray[np.int64] = np.concatenate(
            ([0], np.cumsum(np.bincount(term_of, minlength=n_terms)))
        ).astype(np.int64)
        self.size = n

    def scores(self, query: str) -> NDArray[np.float32]:
        """``(n_texts,)`` BM25 scores of every text for ``query`` (0 where no term matches)."""
        out = np.zeros(self.size, dtype=np.float64)
        terms = {self.vocabulary[t] for t in lexical_tokens(query) if t in self.vocabulary}
        for col in sorted(terms):
            start, end = self._indptr[col], self._indptr[col + 1]
            out[self._indices[start:end]] += self.idf[col] * self._data[start:end]
        return out.astype(np.float32)
