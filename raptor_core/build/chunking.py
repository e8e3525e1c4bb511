"""Split documents into token-limited chunks of whole sentences (RAPTOR, section 3).

The paper's leaf nodes are chunks of at most 100 tokens that never cut a sentence
in half: sentences are packed greedily, and a sentence that would overflow the
current chunk moves whole to the next one.  A single sentence longer than the
limit is cut at clause boundaries, then at whitespace, then between characters,
so that no text is ever dropped.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable
from typing import Any

from raptor_core.exceptions import InvalidInputError, InvalidParameterError
from raptor_core.tokenizers import count_tokens, default_tokenizer
from raptor_core.types import Chunk, Tokenizer

__all__ = ["SentenceChunker", "split_sentences"]

# (start, end, token_count): a span of the source text, stripped of whitespace.
_Unit = tuple[int, int, int]

# ---------------------------------------------------------------------------
# Sentence splitting
# ---------------------------------------------------------------------------

# The characters str.splitlines() breaks on.
_NEWLINES = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
# A whitespace run holding at least one line break.  The lookbehind starts a
# match only at the beginning of a run, so a megabyte of spaces is scanned once.
_LINE_BREAK_RUN = re.compile(rf"(?<![^\S{_NEWLINES}])[^\S{_NEWLINES}]*[{_NEWLINES}]\s*")
_LINE_BREAK = re.compile(rf"\r\n|[{_NEWLINES}]")

_CLOSERS = "\"'”’»›)\\]}」』）】〕〉》"
_OPENERS = "\"'“‘«‹([{「『（【〔〈《"
_TERMINATOR = re.compile(
    # Latin-style marks end a sentence only before whitespace: "3.14", "e.g.," and
    # "example.com" do not.  The lookbehind makes a run like "?!" or "..." one
    # match, and keeps a long run of dots linear.
    rf"(?<![.!?…‽])[.!?…‽]+[{_CLOSERS}]*(?=\s|$)"
    # CJK marks need no space after them.
    rf"|(?P<cjk>[。！？｡]+[{_CLOSERS}]*)"
)


def _word_set(words: str) -> frozenset[str]:
    """Return the whitespace-separated words of ``words`` (easier to read than a list)."""
    return frozenset(words.split())


# Abbreviations that are almost never the last word of a sentence.
_ABBREVIATIONS = _word_set(
    """
    mr mrs ms mx messrs mme mlle dr prof rev fr gen col lt capt cmdr sgt maj adm gov
    sen rep pres hon st mt ft e.g i.e cf viz vs v al approx ca dept univ ph.d
    """
)
# Abbreviations that precede a number: "Fig. 3", "No. 5", "pp. 12", "Jan. 5".
_NUMBER_ABBREVIATIONS = _word_set(
    """
    no nos fig figs eq eqs vol vols p pp ch chap sec sect art ref refs tab para op ed
    jan feb mar apr jun jul aug sep sept oct nov dec
    """
)
# Initialisms written with periods: "U.S", "e.g", "a.m" (the last period is the match).
_INITIALISM = re.compile(r"(?:[^\W\d_]\.)+[^\W\d_]")
# Only the word right before a period is inspected; longer words are not abbreviations.
_MAX_ABBREVIATION_CHARS = 24


def _strip(text: str, start: int, end: int) -> tuple[int, int]:
    """Shrink ``[start, end)`` until it neither starts nor ends with whitespace."""
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def _line_blocks(text: str) -> list[tuple[int, int]]:
    """Cut ``text`` at line breaks that end a sentence.

    A blank line (a paragraph break) always ends a sentence; so does a single line
    break, unless the next line starts with a lowercase letter: that is hard-wrapped
    prose (books, e-mails), whose sentences continue across lines.
    """
    blocks: list[tuple[int, int]] = []
    start = 0
    for match in _LINE_BREAK_RUN.finditer(text):
        after = match.end()
        breaks = len(_LINE_BREAK.findall(match.group()))
        if breaks == 1 and after < len(text) and text[after].islower():
            continue
        blocks.append((start, match.start()))
        start = after
    blocks.append((start, len(text)))
    return blocks


def _ends_sentence(text: str, match: re.Match[str], block_start: int, block_end: int) -> bool:
    """Decide whether the terminator ``match`` really ends a sentence."""
    if match.group("cjk") is not None:
        return True
    nxt = match.end()
    while nxt < block_end and text[nxt].isspace():
        nxt += 1
    while nxt < block_end and text[nxt] in _OPENERS:
        nxt += 1
    if nxt >= block_end:
        return True
    following = text[nxt]
    # Sentences start with a capital, a digit or a symbol, almost never with a
    # lowercase letter: "approx. five", "'Why?' she asked", "and so... on".
    if following.islower():
        return False
    if match.group().rstrip(_CLOSERS) != ".":
        return True
    # A single period after an abbreviation, an initial or a list number.
    word_start = match.start()
    limit = max(block_start, word_start - _MAX_ABBREVIATION_CHARS)
    while word_start > limit and not text[word_start - 1].isspace():
        word_start -= 1
    if word_start > block_start and not text[word_start - 1].isspace():
        return True  # a longer word than any abbreviation
    word = text[word_start : match.start()].lstrip(_OPENERS)
    lowered = word.lower()
    if lowered in _ABBREVIATIONS or _INITIALISM.fullmatch(word):
        return False
    if lowered in _NUMBER_ABBREVIATIONS and following.isdigit():
        return False
    if len(word) == 1 and word.isupper():
        return False  # "John F. Kennedy"
    # "1. First item" at the start of a line is a list marker, not a sentence.
    return not (word.isdigit() and word_start == block_start)


def split_sentences(text: str) -> list[tuple[int, int]]:
    """Split ``text`` into sentences, returned as ``(start, end)`` spans.

    Each span is stripped of surrounding whitespace, the spans are increasing and
    disjoint, and together they hold every non-whitespace character of ``text``.
    A sentence ends at ``.``, ``!``, ``?`` or an ellipsis followed by whitespace
    (closing quotes and brackets stay with it), at ``。！？``, and at line breaks
    (see below).  A period does not end a sentence after common abbreviations
    ("Mr.", "e.g.", "U.S.", "Fig. 3"), single initials, or when the next word
    starts with a lowercase letter; decimals such as "3.14" are never cut.

    Blank lines always end a sentence.  A single line break does too, unless the
    next line starts with a lowercase letter (hard-wrapped prose).

    Args:
        text: the text to split.

    Returns:
        The sentence spans; ``[]`` when ``text`` is empty or only whitespace.

    Examples:
        >>> text = "Dr. Smith paid $3.50. Then he left!"
        >>> [text[s:e] for s, e in split_sentences(text)]
        ['Dr. Smith paid $3.50.', 'Then he left!']
    """
    spans: list[tuple[int, int]] = []

    def add(start: int, end: int) -> None:
        start, end = _strip(text, start, end)
        if start < end:
            spans.append((start, end))

    for block_start, block_end in _line_blocks(text):
        start = block_start
        for match in _TERMINATOR.finditer(text, block_start, block_end):
            if _ends_sentence(text, match, block_start, block_end):
                add(start, match.end())
                start = match.end()
        add(start, block_end)
    return spans


# ---------------------------------------------------------------------------
# Cutting sentences that are too long
# ---------------------------------------------------------------------------

# Clause boundaries: the cut goes right after the mark, which stays on the left.
# A comma must be followed by whitespace, so "1,000" stays whole.
_CLAUSE_END = re.compile(r"[;,:](?=\s)|[、，；：]|[—–]+|-{2,}|(?<=\s)-(?=\s)")
_NON_SPACE = re.compile(r"\S+")


def _split_clauses(text: str, start: int, end: int) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    for match in _CLAUSE_END.finditer(text, start, end):
        piece = _strip(text, start, match.end())
        if piece[0] < piece[1]:
            spans.append(piece)
        start = match.end()
    piece = _strip(text, start, end)
    if piece[0] < piece[1]:
        spans.append(piece)
    return spans


def _split_words(text: str, start: int, end: int) -> list[tuple[int, int]]:
    return [m.span() for m in _NON_SPACE.finditer(text, start, end)]


# From coarse to fine; the last resort (between characters) is _split_chars.
_SPLITTERS: tuple[Callable[[str, int, int], list[tuple[int, int]]], ...] = (
    _split_clauses,
    _split_words,
)


def _split_chars(
    text: str, start: int, end: int, n_tokens: int, max_tokens: int, count: Callable[[str], int]
) -> list[_Unit]:
    """Cut a span without whitespace into pieces of at most ``max_tokens`` tokens.

    Each piece's length is guessed from the span's characters per token, then
    shrunk in proportion to the overshoot until it fits: a few counts per piece.
    """
    chars_per_token = (end - start) / n_tokens
    units: list[_Unit] = []
    pos = start
    while pos < end:
        width = max(1, min(end - pos, int(chars_per_token * max_tokens)))
        n = count(text[pos : pos + width])
        while n > max_tokens:
            if width == 1:
                msg = (
                    f"max_tokens={max_tokens} is too small for this tokenizer: the single "
                    f"character {text[pos]!r} alone is {n} tokens."
                )
                raise InvalidParameterError(msg)
            width = max(1, min(width - 1, width * max_tokens // n))
            n = count(text[pos : pos + width])
        units.append((pos, pos + width, n))
        pos += width
    return units


# ---------------------------------------------------------------------------
# The chunker
# ---------------------------------------------------------------------------

# Below this a chunk cannot hold a short sentence, and one character can be four
# BPE tokens (an emoji, a rare ideograph), which could not be cut further.
_MIN_MAX_TOKENS = 8
# Exact counts of a growing chunk allowed while packing it (see _pack).
_EXACT_CHECKS_PER_CHUNK = 2


class SentenceChunker:
    """Pack whole sentences greedily into chunks of at most ``max_tokens`` tokens.

    This is the RAPTOR paper's leaf chunking.  Sentences come from
    :func:`split_sentences`.  A sentence that would overflow the current chunk
    starts the next one; a sentence longer than ``max_tokens`` on its own is cut at
    clause marks (``; , :`` and dashes), then at whitespace, then between
    characters, and its pieces are packed like sentences.  No text is dropped:
    every non-whitespace character lands in exactly one chunk, in order.

    Each sentence is counted once, and each chunk about once more for its exact
    ``token_count`` (BPE may count a concatenation differently from its parts), so
    the cost is linear in the length of the text: a 5 MB single line takes seconds.

    Args:
        tokenizer: counts tokens; ``None`` means :func:`~raptor_core.tokenizers.default_tokenizer`.
        max_tokens: the most tokens a chunk may hold (at least 8).

    Examples:
        >>> from raptor_core.tokenizers import RegexTokenizer
        >>> chunker = SentenceChunker(RegexTokenizer(), max_tokens=10)
        >>> [c.text for c in chunker.split("One two three. Four five six. Seven eight nine.")]
        ['One two three. Four five six.', 'Seven eight nine.']
    """

    def __init__(self, tokenizer: Tokenizer | None = None, max_tokens: int = 100) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(tokenizer={self.tokenizer!r}, max_tokens={self.max_tokens!r})"
        )

    def get_params(self) -> dict[str, Any]:
        """Return the constructor parameters, as given."""
        return {"tokenizer": self.tokenizer, "max_tokens": self.max_tokens}

    def _validated(self) -> tuple[Tokenizer, int]:
        max_tokens = self.max_tokens
        if (
            isinstance(max_tokens, bool)
            or not isinstance(max_tokens, numbers.Integral)
            or max_tokens < _MIN_MAX_TOKENS
        ):
            msg = (
                f"max_tokens must be an integer >= {_MIN_MAX_TOKENS}, got {max_tokens!r}; "
                "the RAPTOR paper uses 100."
            )
            raise InvalidParameterError(msg)
        tokenizer = default_tokenizer() if self.tokenizer is None else self.tokenizer
        if not isinstance(tokenizer, Tokenizer):
            msg = (
                f"tokenizer must have encode(text) and decode(ids) methods, "
                f"got {type(tokenizer).__name__}."
            )
            raise InvalidParameterError(msg)
        return tokenizer, int(max_tokens)

    def split(self, text: str) -> list[Chunk]:
        """Split ``text`` into chunks.

        Args:
            text: the document text.

        Returns:
            The chunks in document order; ``[]`` for empty or whitespace-only text.
            ``chunk.text == text[chunk.start:chunk.end]`` and ``chunk.token_count``
            is the exact count of ``chunk.text``, at most ``max_tokens``.

        Raises:
            InvalidParameterError: ``max_tokens`` or ``tokenizer`` is invalid, or a
                single character is more than ``max_tokens`` tokens.
            InvalidInputError: ``text`` is not a string.
        """
        tokenizer, max_tokens = self._validated()
        if not isinstance(text, str):
            msg = f"text must be a str, got {type(text).__name__}."
            raise InvalidInputError(msg)

        def count(piece: str) -> int:
            return count_tokens(tokenizer, piece)

        units: list[_Unit] = []
        for start, end in split_sentences(text):
            n = count(text[start:end])
            if n <= max_tokens:
                units.append((start, end, n))
            else:
                _cut(text, start, end, n, 0, max_tokens, count, units)
        return _pack(text, units, max_tokens, count)


def _cut(
    text: str,
    start: int,
    end: int,
    n_tokens: int,
    level: int,
    max_tokens: int,
    count: Callable[[str], int],
    units: list[_Unit],
) -> None:
    """Append to ``units`` pieces of an over-long span, each within ``max_tokens``."""
    if level == len(_SPLITTERS):
        units.extend(_split_chars(text, start, end, n_tokens, max_tokens, count))
        return
    pieces = _SPLITTERS[level](text, start, end)
    if pieces == [(start, end)]:
        # Nothing to cut at this level: go finer without counting again.
        _cut(text, start, end, n_tokens, level + 1, max_tokens, count, units)
        return
    for piece_start, piece_end in pieces:
        n = count(text[piece_start:piece_end])
        if n <= max_tokens:
            units.append((piece_start, piece_end, n))
        else:
            _cut(text, piece_start, piece_end, n, level + 1, max_tokens, count, units)


def _pack(
    text: str, units: list[_Unit], max_tokens: int, count: Callable[[str], int]
) -> list[Chunk]:
    """Pack consecutive units greedily into chunks.

    A chunk's size is estimated from counts already known: its units' counts,
    plus what each gap costs in front of the next unit's first character (with
    BPE a single space merges into the next word, " word" being one token, and
    costs nothing; a blank line costs one), minus the tokenizer's fixed overhead
    (``count("")``: special tokens such as BOS are counted once per text, not
    once per unit).  BPE may still count a join differently, by about a token.
    So when the next unit overflows the estimate by no more than one token per
    join, the joined text is counted exactly (at most twice per chunk) before
    the chunk is closed.  A closed chunk is counted exactly for its
    ``token_count``; if that count is over the limit (rare), trailing units go
    back to the stream and start the next chunk.

    Every count is of one unit or of at most one chunk plus one unit, and there
    are a few per chunk: linear in the length of the text, with no growing
    prefix re-encoded.
    """
    overhead = count("")
    gap_costs: dict[tuple[str, str], int] = {}
    chunks: list[Chunk] = []
    i = 0
    while i < len(units):
        first = i
        chunk_start = units[first][0]
        estimate = units[first][2]
        exact_through = first  # units[first..exact_through] have an exact count
        checks_left = _EXACT_CHECKS_PER_CHUNK
        i += 1
        while i < len(units):
            start, end, n = units[i]
            gap = text[units[i - 1][1] : start]
            key = (gap, text[start])
            cost = gap_costs.get(key)
            if cost is None:
                cost = max(0, count(gap + text[start]) - count(text[start])) if gap else 0
                gap_costs[key] = cost
            candidate = estimate + cost + n - overhead
            if candidate > max_tokens:
                if checks_left == 0 or candidate - max_tokens > i - first:
                    break
                checks_left -= 1
                candidate = count(text[chunk_start:end])
                if candidate > max_tokens:
                    break
                exact_through = i
            estimate = candidate
            i += 1
        if exact_through == i - 1:
            last, n = i - 1, estimate
        else:
            last, n = _longest_fitting(text, units, first, i - 1, max_tokens, count)
        end = units[last][1]
        chunks.append(Chunk(text=text[chunk_start:end], start=chunk_start, end=end, token_count=n))
        i = last + 1
    return chunks


def _longest_fitting(
    text: str,
    units: list[_Unit],
    first: int,
    last: int,
    max_tokens: int,
    count: Callable[[str], int],
) -> tuple[int, int]:
    """Return ``(j, n)``: the largest ``j <= last`` whose ``units[first..j]`` fit, and their count.

    Usually ``units[first..last]`` fit and this is one count.  A single unit always
    fits (it was counted alone), so the bisection below has an answer.
    """
    start = units[first][0]

    def joined(j: int) -> int:
        return units[first][2] if j == first else count(text[start : units[j][1]])

    n = joined(last)
    if n <= max_tokens:
        return last, n
    low, high = first, last - 1
    while low < high:
        middle = (low + high + 1) // 2
        if joined(middle) <= max_tokens:
            low = middle
        else:
            high = middle - 1
    return low, joined(low)
