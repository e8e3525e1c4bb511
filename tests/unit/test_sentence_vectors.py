"""Sentence vectors taken from the forward passes that embed each layer (issue 15.1).

The extractive summariser needs a vector per sentence.  With a
:class:`~raptor_core.types.SpanEmbedder` it takes them from the passes that embed the layer's
texts (the builder's embedder is tapped), instead of embedding every sentence again.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from numpy.typing import NDArray

from raptor_core import SpanEmbedder
from raptor_core.build.builder import TreeBuilder
from raptor_core.build.summarizers import ExtractiveSummarizer, _sentence_spans
from raptor_core.testing import FakeEmbedder, WhitespaceTokenizer, check_tree_invariants

TOPICS = [
    "Cats purr when they are content. Kittens chase string all day. A cat sleeps for hours.",
    "Rockets carry satellites to orbit. Engines burn liquid fuel. Launch pads face the sea.",
    "Bread rises with yeast. Ovens bake loaves at high heat. Flour comes from wheat.",
    "Rivers flow to the ocean. Floods follow heavy rain. Bridges span wide rivers.",
]


class SpanFake(FakeEmbedder):
    """FakeEmbedder plus spans: a span's vector is the hashed bag of words of its text."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__(dim)
        self.span_calls = 0
        self.texts_with_spans: list[str] = []

    def embed_spans(
        self, texts: Sequence[str], spans: Sequence[Sequence[tuple[int, int]]]
    ) -> tuple[NDArray[np.float32], list[NDArray[np.float32]]]:
        self.span_calls += 1
        self.texts_with_spans.extend(texts)
        rows = [
            np.stack([self._vector(t[a:b]) for a, b in s])
            if s
            else np.zeros((0, self.dim), np.float32)
            for t, s in zip(texts, spans, strict=True)
        ]
        return np.stack([self._vector(t) for t in texts]), rows


def _docs(n: int = 12) -> list[str]:
    return [" ".join(TOPICS[i % 4].split(". ")[::-1]) + f" Note {i}." for i in range(n)]


def test_span_fake_is_a_span_embedder() -> None:
    assert isinstance(SpanFake(), SpanEmbedder)
    assert not isinstance(FakeEmbedder(), SpanEmbedder)


def test_tap_only_wraps_the_summarizers_own_span_embedder() -> None:
    span = SpanFake()
    summarizer = ExtractiveSummarizer(span, tokenizer=WhitespaceTokenizer())
    assert summarizer.sentence_vector_tap(span) is not span
    other = SpanFake()
    assert summarizer.sentence_vector_tap(other) is other  # not its embedder: left alone
    plain = FakeEmbedder()
    assert ExtractiveSummarizer(plain).sentence_vector_tap(plain) is plain


def test_build_embeds_no_sentence_separately_when_tapped() -> None:
    span = SpanFake()
    builder = TreeBuilder(
        span, tokenizer=WhitespaceTokenizer(), chunk_max_tokens=12, random_state=0
    )
    tree = builder.build(_docs())
    check_tree_invariants(tree)
    assert tree.num_layers >= 2
    # Every text embed_documents-style call went through embed_spans (the tap), and the
    # summariser never had to embed a text or a sentence of its own.
    assert span.calls == 0
    assert sorted(set(span.texts_with_spans)) == sorted({n.text for n in tree.nodes})


def test_summaries_match_whether_tapped_or_embedded_by_the_summarizer() -> None:
    clusters = [[TOPICS[0], TOPICS[1]], [TOPICS[2], TOPICS[3], TOPICS[0]]]
    tapped = ExtractiveSummarizer(SpanFake(), tokenizer=WhitespaceTokenizer())
    tap = tapped.sentence_vector_tap(tapped.embedder)
    tap.embed_documents(TOPICS)
    fresh_embedder = SpanFake()
    fresh = ExtractiveSummarizer(fresh_embedder, tokenizer=WhitespaceTokenizer())
    assert tapped.summarize_batch(clusters, max_tokens=12) == fresh.summarize_batch(
        clusters, max_tokens=12
    )
    # The fresh one embedded each distinct text once, with its spans, and no sentence alone.
    assert sorted(fresh_embedder.texts_with_spans) == sorted(TOPICS)
    assert fresh_embedder.calls == 0


def test_tapped_vectors_are_the_plain_embedders_vectors() -> None:
    span = SpanFake()
    tap = ExtractiveSummarizer(span).sentence_vector_tap(span)
    np.testing.assert_allclose(tap.embed_documents(TOPICS), FakeEmbedder().embed_documents(TOPICS))


def test_in_context_off_embeds_sentences_alone() -> None:
    span = SpanFake()
    summarizer = ExtractiveSummarizer(span, tokenizer=WhitespaceTokenizer(), in_context=False)
    assert summarizer.sentence_vector_tap(span) is span
    summary = summarizer.summarize(TOPICS[:2], max_tokens=10)
    assert summary
    assert span.span_calls == 0
    assert span.texts_embedded == 6  # the six sentences, each alone


def test_memo_forgets_another_models_vectors() -> None:
    first, second = SpanFake(), SpanFake(dim=32)
    summarizer = ExtractiveSummarizer(first, tokenizer=WhitespaceTokenizer())
    summarizer.sentence_vector_tap(first).embed_documents(TOPICS)
    summarizer.embedder = second
    summary = summarizer.summarize(TOPICS[:2], max_tokens=10)
    assert summary
    assert sorted(second.texts_with_spans) == sorted(TOPICS[:2])  # re-embedded by the new model


def test_sentence_spans_skip_blank_sentences() -> None:
    sentences, spans = _sentence_spans("One here.   \n\n  Two  there!")
    assert sentences == ["One here.", "Two there!"]
    assert all(a < b for a, b in spans)


@pytest.mark.integration
def test_real_embed_spans(st_embedder) -> None:
    texts = [TOPICS[0], "word " * 400 + "end. A late sentence nobody sees in context."]
    spans = [_sentence_spans(t)[1] for t in texts]
    vectors, rows = st_embedder.embed_spans(texts, spans)
    np.testing.assert_allclose(vectors, st_embedder.embed_documents(texts), atol=1e-5)
    assert [r.shape for r in rows] == [(3, 384), (2, 384)]
    for r in rows:
        np.testing.assert_allclose(np.linalg.norm(r, axis=1), 1.0, atol=1e-5)
    # In context, a sentence is close to (not equal to) the sentence embedded alone.
    alone = st_embedder.embed_documents([TOPICS[0][a:b] for a, b in spans[0]])
    cosines = (rows[0] * alone).sum(axis=1)
    assert np.all(cosines > 0.6), cosines
    assert np.all(cosines < 0.9999), cosines
    # The last sentence of the long text lies past the model's 256 tokens: embedded alone.
    start, end = spans[1][-1]
    np.testing.assert_allclose(
        rows[1][-1], st_embedder.embed_documents([texts[1][start:end]])[0], atol=1e-5
    )


@pytest.mark.integration
def test_real_build_uses_the_tap(st_embedder) -> None:
    calls: list[int] = []
    original = st_embedder.embed_documents

    class Counting(type(st_embedder)):  # type: ignore[misc]
        def embed_documents(self, texts):
            calls.append(len(texts))
            return original(texts)

    embedder = Counting()
    tree = TreeBuilder(embedder, chunk_max_tokens=40, random_state=0).build(_docs(16))
    check_tree_invariants(tree)
    assert tree.num_layers >= 2
    assert calls == []  # the leaves, summaries and sentences all came from embed_spans


def test_token_offsets_leave_the_models_tokenizer_settings_alone(st_embedder) -> None:
    # A fast tokenizer keeps its padding and truncation on the shared Rust tokenizer, and
    # rewrites them for each call whose settings differ.  Offsets asked of the model's own
    # tokenizer (no padding) while another thread embedded a batch (padding) made that
    # batch ragged: "Unable to create tensor ...".  The offsets come from a private copy.
    from raptor_core.backends.sentence_transformers import _token_offsets

    model = st_embedder.model
    st_embedder.embed_documents(["one text", "and a longer second text"])  # pads the batch
    backend = model.tokenizer.backend_tokenizer
    before = (backend.padding, backend.truncation)
    texts = ["a cat", "The quick brown fox jumps over the lazy dog. " * 80]
    offsets = _token_offsets(model, texts, None)
    assert (backend.padding, backend.truncation) == before
    # The same offsets the model's tokenizer gives, cut at the model's window.
    expected = model.tokenizer(
        texts, return_offsets_mapping=True, truncation=True, max_length=model.max_seq_length
    )["offset_mapping"]
    assert offsets is not None
    assert [o.tolist() for o in offsets] == [[list(p) for p in e] for e in expected]
    assert len(offsets[1]) == model.max_seq_length
