"""Retrieval metrics that need no reader model: evidence, answer and span recall at a budget.

All comparisons happen on *normalised* text (``../shared/data/README.md``): lower-case, keep
the ``[a-z0-9]+`` tokens, join them with single spaces.  That makes the metrics blind to the
whitespace and punctuation differences between gold strings and document text.

A gold passage (an evidence paragraph, a fairy-tale section, a meeting turn) counts as
**found** when at least half of its normalised tokens appear in the retrieved context.  A
token "appears" when it lies inside a run of at least ``ngram`` consecutive passage tokens
that occurs, in the same order, inside one retrieved text.  Counting bare words instead
would let any context "find" any passage through its stop words: on QASPER, 20 random
chunks of the same paper that share no 6-gram with an evidence paragraph "found" 200 of
201 paragraphs by bare words, 56 with runs of 2, 13 with runs of 3 and 10 with runs of 4
(mostly headings of a few words), while the chunks that do hold the paragraph find 190 of
201 with any run length.  A passage split over two retrieved chunks still counts in full,
minus at most ``ngram - 1`` tokens at each cut.  Passages shorter than ``ngram`` tokens
(a LaTeX ``[leftmargin=4mm]``, a "Mm - hmm ." turn) occur everywhere and are not scored.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from raptor_core.exceptions import InvalidParameterError
from raptor_core.tokenizers import count_tokens
from raptor_core.types import Tokenizer

__all__ = [
    "DEFAULT_NGRAM",
    "FOUND_FRACTION",
    "Context",
    "answer_recall",
    "coverage",
    "evidence_recall",
    "fit_budget",
    "normalize",
    "scorable_answers",
    "section_texts",
    "span_precision",
    "span_recall",
    "tokens",
    "turn_texts",
]

#: Length of the token runs that must match for a passage token to count as present.
DEFAULT_NGRAM = 4
#: A passage is found when at least this fraction of its normalised tokens is present.
FOUND_FRACTION = 0.5

_TOKEN = re.compile(r"[a-z0-9]+")
_NUMERIC = re.compile(r"^[0-9 ]+$")
_BLANK_LINE = re.compile(r"\n[ \t]*\n")


def tokens(text: str) -> list[str]:
    """The normalised tokens of ``text``: lower-cased ``[a-z0-9]+`` runs.

    Examples:
        >>> tokens("The Cat's  hat, (1999)!")
        ['the', 'cat', 's', 'hat', '1999']
    """
    return _TOKEN.findall(text.lower())


def normalize(text: str) -> str:
    r"""Normalised text: the :func:`tokens` joined with single spaces.

    Examples:
        >>> normalize("  Hello,\nWORLD -- again. ")
        'hello world again'
    """
    return " ".join(tokens(text))


def _ngrams(toks: Sequence[str], n: int) -> Iterable[tuple[str, ...]]:
    return (tuple(toks[i : i + n]) for i in range(len(toks) - n + 1))


@dataclass(frozen=True, slots=True, eq=False)
class Context:
    """Retrieved texts, pre-processed once for all the metrics of one question.

    Runs never cross from one retrieved text into the next: the texts come in rank order,
    not document order, so a run spanning two of them would be an artefact.

    Args:
        texts: the retrieved texts, as given to the reader.
        ngram: run length for :func:`coverage` (see the module docstring).
    """

    texts: tuple[str, ...]
    ngram: int
    normalized: tuple[str, ...]
    token_lists: tuple[tuple[str, ...], ...]
    grams: frozenset[tuple[str, ...]]

    @classmethod
    def from_texts(cls, texts: Iterable[str], *, ngram: int = DEFAULT_NGRAM) -> Context:
        """Tokenise ``texts`` and index their runs of ``ngram`` tokens."""
        if isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 1:
            msg = f"ngram must be a positive integer, got {ngram!r}"
            raise InvalidParameterError(msg)
        texts = tuple(texts)
        token_lists = tuple(tuple(tokens(t)) for t in texts)
        grams = frozenset(g for toks in token_lists for g in _ngrams(toks, ngram))
        # Padded with spaces so that substring search matches whole tokens only.
        normalized = tuple(f" {' '.join(toks)} " for toks in token_lists)
        return cls(texts, ngram, normalized, token_lists, grams)

    @property
    def num_tokens(self) -> int:
        """Normalised tokens in the whole context."""
        return sum(len(t) for t in self.token_lists)

    def contains(self, phrase_tokens: Sequence[str]) -> bool:
        """Whether the token sequence occurs contiguously inside one retrieved text."""
        if not phrase_tokens:
            return False
        needle = f" {' '.join(phrase_tokens)} "
        return any(needle in text for text in self.normalized)


def _as_context(context: Context | Sequence[str]) -> Context:
    if isinstance(context, Context):
        return context
    if isinstance(context, str):
        msg = "pass the retrieved texts as a list of strings (or a Context), not one string"
        raise InvalidParameterError(msg)
    return Context.from_texts(context)


def coverage(passage: str | Sequence[str], context: Context | Sequence[str]) -> float:
    """Fraction of the passage's normalised tokens present in the context, in [0, 1].

    Args:
        passage: the gold passage, as text or as normalised tokens.
        context: the retrieved texts (or a :class:`Context` built from them).

    Returns:
        0.0 for an empty passage or context.

    Examples:
        >>> coverage("the quick brown fox jumps over", ["a quick brown fox jumps", "nothing"])
        0.6666666666666666
    """
    ctx = _as_context(context)
    toks = tokens(passage) if isinstance(passage, str) else list(passage)
    if not toks or not ctx.texts:
        return 0.0
    n = ctx.ngram
    if len(toks) < n:
        return 1.0 if ctx.contains(toks) else 0.0
    covered = [False] * len(toks)
    for i, gram in enumerate(_ngrams(toks, n)):
        if gram in ctx.grams:
            covered[i : i + n] = [True] * n
    return sum(covered) / len(toks)


def _found(passage: str, ctx: Context) -> bool:
    return coverage(passage, ctx) >= FOUND_FRACTION


def evidence_recall(evidence: Sequence[str], context: Context | Sequence[str]) -> float | None:
    """Fraction of gold evidence passages found in the context (None without evidence).

    A passage is found when at least half of its normalised tokens are present
    (:data:`FOUND_FRACTION`, see :func:`coverage`).  Passages shorter than the context's
    ``ngram`` are ignored (see the module docstring).

    Examples:
        >>> ev = ["Bees dance to show where flowers are.", "The hive keeps warm in winter."]
        >>> evidence_recall(ev, ["bees dance to show where the flowers are"])
        0.5
    """
    ctx = _as_context(context)
    gold = [p for p in evidence if len(tokens(p)) >= ctx.ngram]
    if not gold:
        return None
    return sum(_found(p, ctx) for p in gold) / len(gold)


def scorable_answers(
    answers: Sequence[str], *, min_tokens: int = 2, skip_numeric: bool = True
) -> list[list[str]]:
    """The gold answers that string matching can judge, as normalised token lists.

    One-token answers ("yes", "Paris") and numbers ("13", "1 200") match by chance in long
    contexts, so by default they are ignored (the data README's rule for ``nq_leval``).

    Examples:
        >>> scorable_answers(["Yes", "13", "April 25 , 2018", "golden hair"])
        [['april', '25', '2018'], ['golden', 'hair']]
    """
    out: list[list[str]] = []
    for answer in answers:
        toks = tokens(answer)
        if len(toks) < min_tokens:
            continue
        if skip_numeric and _NUMERIC.match(" ".join(toks)):
            continue
        out.append(toks)
    return out


def answer_recall(
    answers: Sequence[str],
    context: Context | Sequence[str],
    *,
    min_tokens: int = 2,
    skip_numeric: bool = True,
) -> float | None:
    """1.0 when any scorable gold answer occurs verbatim (normalised) in one retrieved text.

    Returns None when no answer is scorable (see :func:`scorable_answers`).

    Examples:
        >>> answer_recall(["golden hair"], ["A queen with Golden  hair."])
        1.0
        >>> answer_recall(["golden hair"], ["A queen with golden, long hair."])
        0.0
    """
    ctx = _as_context(context)
    gold = scorable_answers(answers, min_tokens=min_tokens, skip_numeric=skip_numeric)
    if not gold:
        return None
    return 1.0 if any(ctx.contains(a) for a in gold) else 0.0


def span_recall(units: Sequence[str], context: Context | Sequence[str]) -> float | None:
    """Fraction of gold units (sections, turns) found in the context (None without units).

    Units with fewer normalised tokens than the context's ``ngram`` ("Yeah .", "Mm - hmm .")
    are ignored: they occur everywhere and say nothing about what was retrieved.
    """
    ctx = _as_context(context)
    gold = [u for u in units if len(tokens(u)) >= ctx.ngram]
    if not gold:
        return None
    return sum(_found(u, ctx) for u in gold) / len(gold)


def span_precision(units: Sequence[str], context: Context | Sequence[str]) -> float | None:
    """Fraction of the context's normalised tokens that come from the gold units.

    A context token counts when it lies in a run of ``ngram`` tokens that also occurs in a
    gold unit.  None without gold units; 0.0 for an empty context.
    """
    ctx = _as_context(context)
    gold = [tokens(u) for u in units]
    gold = [g for g in gold if len(g) >= ctx.ngram]
    if not gold:
        return None
    total = ctx.num_tokens
    if total == 0:
        return 0.0
    n = ctx.ngram
    gold_grams = {g for toks in gold for g in _ngrams(toks, n)}
    hit = 0
    for toks in ctx.token_lists:
        covered = [False] * len(toks)
        for i, gram in enumerate(_ngrams(toks, n)):
            if gram in gold_grams:
                covered[i : i + n] = [True] * n
        hit += sum(covered)
    return hit / total


def section_texts(text: str) -> list[str]:
    """The sections of a document: blocks separated by blank lines (FairytaleQA), in order.

    Section ``i`` of the data (numbered from 1) is ``section_texts(text)[i - 1]``.
    """
    return [block.strip() for block in _BLANK_LINE.split(text.strip()) if block.strip()]


def turn_texts(text: str) -> list[str]:
    """The turns of a transcript: line ``i`` is turn ``i``, numbered from 0 (QMSum)."""
    return text.split("\n")


def fit_budget(
    texts: Sequence[str], max_tokens: int, tokenizer: Tokenizer
) -> tuple[list[str], int, bool]:
    """Keep texts in rank order within ``max_tokens``; cut the one that crosses the budget.

    The harness applies this to every retriever's output, so all of them are scored on the
    same budget measured by the same tokenizer.  Retrievers that fill the budget themselves
    (the RAPTOR strategies) pass through unchanged; a ranked list of chunks (BM25, the
    framework retrievers) is cut where a reader's context window would cut it.

    Returns:
        The texts that fit, the tokens they use, and whether anything was cut or dropped.

    Examples:
        >>> from raptor_core.testing import WhitespaceTokenizer
        >>> fit_budget(["a b c", "d e f", "g"], 4, WhitespaceTokenizer())
        (['a b c', 'd'], 4, True)
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        msg = f"max_tokens must be a positive integer, got {max_tokens!r}"
        raise InvalidParameterError(msg)
    kept: list[str] = []
    used = 0
    for text in texts:
        cost = count_tokens(tokenizer, text)
        if used + cost <= max_tokens:
            kept.append(text)
            used += cost
            continue
        room = max_tokens - used
        if room > 0:
            head = tokenizer.decode(tokenizer.encode(text)[:room]).strip()
            # Decoding a cut BPE sequence can re-tokenise to a different length: re-count.
            while head and count_tokens(tokenizer, head) > room:
                head = head[: max(0, math.floor(len(head) * 0.9))]
            if head:
                kept.append(head)
                used += count_tokens(tokenizer, head)
        return kept, used, True
    return kept, used, False
