"""Summarisers: the offline extractive default, and an adapter that turns any LLM into one."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import cast

import numpy as np
from numpy.typing import NDArray

from raptor_core.exceptions import EmbeddingError, InvalidParameterError, SummarizationError
from raptor_core.types import (
    DEFAULT_SUMMARY_PROMPT,
    LLM,
    AsyncLLM,
    Embedder,
    SpanEmbedder,
    Tokenizer,
)

__all__ = ["ExtractiveSummarizer", "LLMSummarizer"]


class ExtractiveSummarizer:
    """Offline summariser: picks the sentences that best *cover* the cluster, within a budget.

    Every sentence of the cluster is embedded; the summary is the set ``S`` of sentences that
    greedily maximises the facility-location coverage ``sum_i max_{j in S} sim(i, j)`` (each
    sentence of the cluster is "represented" by its most similar selected sentence), subject
    to ``sum_{j in S} tokens(j) <= max_tokens``.  Coverage rewards picking sentences from
    *different* sub-topics of a cluster, unlike taking the sentences nearest the centroid,
    which tends to repeat one theme.  Candidates are ranked by gain / sqrt(tokens), a middle
    ground between favouring short sentences (gain / tokens) and ignoring cost.  The chosen
    sentences are returned in their original order so the summary reads naturally.

    Sentence vectors come from work already done when the embedder is a
    :class:`~raptor_core.types.SpanEmbedder` (the default sentence-transformers one is): while
    the builder embeds a layer's texts, :meth:`sentence_vector_tap` keeps, for every sentence,
    the model's contextual token vectors pooled over it, from the same forward pass.  A
    cluster's sentences then need no embedding call at all; a text the tap did not see (an
    old leaf re-summarised by an incremental update) is embedded the same way, so both paths
    give the same vectors.  Measured on 62k tokens of QuALITY (benchmarks/build.py), this took
    summarising from 0.63x to 0.01x of the embedding time.  Other embedders embed each distinct
    sentence on its own, memoised per instance: soft clustering puts a sentence in several
    clusters, and the summaries of layer ``l`` are made of sentences of layer ``l - 1``.

    Args:
        embedder: embeds sentences (the tree's embedder by default, set by TreeBuilder).
        tokenizer: counts tokens (``default_tokenizer()`` when None).
        memo_size: most sentence vectors remembered (0 disables the memo).
        in_context: take sentence vectors from the texts' own forward passes when the
            embedder offers them (a :class:`~raptor_core.types.SpanEmbedder`); False embeds
            each sentence alone, as before.  Measured with the default model on QASPER and
            FairytaleQA (three seeds, 400/1,000/2,000 tokens), in-context choices moved the
            collapsed strategy's recall by -0.6 points on average (from -10 to +3.4 per set,
            budget and seed; FairytaleQA at 400 tokens lost in all three seeds) and leave the
            default passage strategy unchanged, since it reads leaves only:
            ``benchmarks/README.md``.
    """

    #: Not stored in a build cache: it is offline and deterministic, and recomputing it keeps
    #: its sentence vectors (embedded a layer at a time) identical to an uncached build.
    cacheable = False

    def __init__(
        self,
        embedder: Embedder | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        memo_size: int = 200_000,
        in_context: bool = True,
    ) -> None:
        self.embedder = embedder
        self.tokenizer = tokenizer
        self.memo_size = memo_size
        self.in_context = in_context
        self._memo: dict[str, NDArray[np.float32]] = {}
        self._memo_owner: object = None
        # text -> its sentences and their in-context vectors (SpanEmbedder path)
        self._in_context: dict[str, tuple[list[str], NDArray[np.float32]]] = {}
        self._in_context_size = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ExtractiveSummarizer(embedder={self.embedder!r})"

    def _resolved(self) -> tuple[Embedder, Tokenizer]:
        if self.embedder is None:
            msg = "ExtractiveSummarizer needs an embedder: pass one, or let TreeBuilder supply its own"
            raise InvalidParameterError(msg)
        if self.tokenizer is None:
            from raptor_core.tokenizers import default_tokenizer

            self.tokenizer = default_tokenizer()
        return self.embedder, self.tokenizer

    def _sentence_vectors(self, embedder: Embedder, sentences: list[str]) -> NDArray[np.float32]:
        """Unit vectors of ``sentences`` (distinct strings), embedding only the ones not memoised."""
        with self._lock:
            self._claim_memo(embedder)
            missing = list(dict.fromkeys(s for s in sentences if s not in self._memo))
        fresh = _unit_rows(embedder.embed_documents(missing), len(missing)) if missing else None
        with self._lock:
            if fresh is not None:
                if len(self._memo) + len(missing) > self.memo_size:
                    self._memo.clear()
                if self.memo_size > 0:
                    self._memo.update(zip(missing, fresh, strict=True))
            known = {s: self._memo[s] for s in sentences if s in self._memo}
        if fresh is not None:
            known.update(zip(missing, fresh, strict=True))
        return np.stack([known[s] for s in sentences])

    def sentence_vector_tap(self, embedder: Embedder) -> Embedder:
        """Wrap ``embedder`` so that what it embeds also gives this summariser sentence vectors.

        Returns ``embedder`` itself unless ``in_context`` is on and ``embedder`` is this
        summariser's own embedder and a :class:`~raptor_core.types.SpanEmbedder`.  The builder embeds every layer through the
        tap, so the clusters summarised next find their sentences' vectors already computed.
        """
        if (
            self.in_context is not True
            or embedder is not self.embedder
            or not isinstance(embedder, SpanEmbedder)
        ):
            return embedder
        return _SentenceVectorTap(embedder, self)

    def _claim_memo(self, embedder: object) -> None:
        """Make the memos ``embedder``'s (hold the lock): another model's vectors are meaningless."""
        if self._memo_owner is not embedder:
            self._memo.clear()
            self._in_context.clear()
            self._in_context_size = 0
            self._memo_owner = embedder

    def _remember_in_context(
        self,
        embedder: object,
        texts: Sequence[str],
        sentences: Sequence[list[str]],
        rows: Sequence[object],
    ) -> list[NDArray[np.float32]]:
        """Check ``embed_spans`` rows (one per sentence of each text), keep them, return them."""
        checked = [_unit_rows(r, len(found)) for r, found in zip(rows, sentences, strict=True)]
        with self._lock:
            self._claim_memo(embedder)
            for text, found, vectors in zip(texts, sentences, checked, strict=True):
                if text in self._in_context:
                    continue
                if self._in_context_size + len(found) > self.memo_size:
                    self._in_context.clear()
                    self._in_context_size = 0
                if self.memo_size > 0:
                    self._in_context[text] = (found, vectors)
                    self._in_context_size += len(found)
        return checked

    def _in_context_vectors(
        self, embedder: SpanEmbedder, texts: Sequence[str]
    ) -> list[tuple[list[str], NDArray[np.float32]]]:
        """Each text's sentences and their in-context vectors, embedding the texts not seen."""
        with self._lock:
            self._claim_memo(embedder)
            known = {t: self._in_context[t] for t in texts if t in self._in_context}
        missing = list(dict.fromkeys(t for t in texts if t not in known))
        if missing:
            sentences, spans = sentence_spans(missing)
            _, rows = embedder.embed_spans(missing, spans)
            checked = self._remember_in_context(embedder, missing, sentences, rows)
            known.update(zip(missing, zip(sentences, checked, strict=True), strict=True))
        return [known[t] for t in texts]

    def _cluster_sentences_in_context(
        self, embedder: SpanEmbedder, clusters: Sequence[Sequence[str]]
    ) -> tuple[list[list[str]], NDArray[np.float32] | None]:
        """Each cluster's distinct sentences, and all their vectors stacked cluster by cluster."""
        texts = list(dict.fromkeys(t for cluster in clusters for t in cluster))
        found = dict(zip(texts, self._in_context_vectors(embedder, texts), strict=True))
        per_cluster: list[list[str]] = []
        blocks: list[NDArray[np.float32]] = []
        for cluster in clusters:
            # A sentence met again (soft clustering, repeated text) keeps its first vector.
            seen: dict[str, NDArray[np.float32]] = {}
            for text in cluster:
                sentences, rows = found[text]
                for sentence, row in zip(sentences, rows, strict=True):
                    seen.setdefault(sentence, row)
            per_cluster.append(list(seen))
            if seen:
                blocks.append(np.stack(list(seen.values())))
        return per_cluster, (np.concatenate(blocks) if blocks else None)

    def summarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        """Summarise one cluster."""
        return self.summarize_batch([texts], max_tokens=max_tokens)[0]

    def summarize_batch(self, clusters: Sequence[Sequence[str]], *, max_tokens: int) -> list[str]:
        """Summarise many clusters with one embedding call for all their sentences."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            msg = f"max_tokens must be a positive integer, got {max_tokens!r}"
            raise InvalidParameterError(msg)
        from raptor_core.tokenizers import count_tokens

        embedder, tokenizer = self._resolved()
        if self.in_context is True and isinstance(embedder, SpanEmbedder):
            per_cluster, vectors = self._cluster_sentences_in_context(embedder, clusters)
        else:
            per_cluster = []
            for texts in clusters:
                seen: dict[str, None] = {}
                for text in texts:
                    for sentence in _sentence_spans(text)[0]:
                        # Soft clustering shares text between clusters, and documents repeat
                        # themselves: count each distinct sentence once.
                        seen.setdefault(sentence, None)
                per_cluster.append(list(seen))
            flat = [s for sentences in per_cluster for s in sentences]
            vectors = self._sentence_vectors(embedder, flat) if flat else None
        if vectors is None:
            return ["" for _ in clusters]

        out: list[str] = []
        offset = 0
        for sentences in per_cluster:
            block = vectors[offset : offset + len(sentences)]  # (n_sentences, d)
            offset += len(sentences)
            costs = np.array(
                [max(1, count_tokens(tokenizer, s)) for s in sentences], dtype=np.float64
            )
            chosen = _greedy_coverage(block, costs, float(max_tokens))
            if not chosen and sentences:
                # Every sentence is longer than the budget: cut the most central one at a
                # token boundary rather than return nothing.
                best = int(np.argmax(block @ block.mean(axis=0)))
                ids = tokenizer.encode(sentences[best])[:max_tokens]
                out.append(tokenizer.decode(ids).strip())
                continue
            summary = _join_sentences([sentences[i] for i in sorted(chosen)])
            # Sentence costs were counted one by one; joined, BPE may merge or split at the
            # seams.  Drop the last (least valuable) picks until the real count fits.
            while len(chosen) > 1 and count_tokens(tokenizer, summary) > max_tokens:
                chosen.pop()
                summary = _join_sentences([sentences[i] for i in sorted(chosen)])
            out.append(summary)
        return out


class _SentenceVectorTap:
    """An embedder that hands its span vectors to an :class:`ExtractiveSummarizer` as it goes."""

    # Same as what it wraps: the tap changes no vector, so a cache decision stays the same.
    def __init__(self, inner: Embedder, summarizer: ExtractiveSummarizer) -> None:
        self.inner = inner
        self.summarizer = summarizer
        self.cacheable = getattr(inner, "cacheable", True)

    def embed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]:
        texts = list(texts)
        sentences, spans = sentence_spans(texts)
        vectors, rows = cast(SpanEmbedder, self.inner).embed_spans(texts, spans)
        self.summarizer._remember_in_context(self.inner, texts, sentences, rows)
        return vectors

    def embed_query(self, text: str) -> NDArray[np.float32]:
        return self.inner.embed_query(text)


def _sentence_spans(text: str) -> tuple[list[str], list[tuple[int, int]]]:
    """The sentences of ``text`` (whitespace collapsed, empty ones dropped) and their spans."""
    from raptor_core.build.chunking import split_sentences

    sentences: list[str] = []
    spans: list[tuple[int, int]] = []
    for start, end in split_sentences(text):
        sentence = " ".join(text[start:end].split())
        if sentence:
            sentences.append(sentence)
            spans.append((start, end))
    return sentences, spans


def sentence_spans(
    texts: Sequence[str],
) -> tuple[list[list[str]], list[list[tuple[int, int]]]]:
    """Per text, its sentences and their spans (see :func:`_sentence_spans`): ``embed_spans`` input."""
    pairs = [_sentence_spans(t) for t in texts]
    return [found for found, _ in pairs], [spans for _, spans in pairs]


def _unit_rows(vectors: object, expected: int) -> NDArray[np.float32]:
    arr = np.asarray(vectors, dtype=np.float32)
    if arr.ndim != 2 or arr.shape[0] != expected or not np.all(np.isfinite(arr)):
        msg = (
            "the embedder returned the wrong number of vectors or NaN values for summary sentences"
        )
        raise EmbeddingError(msg)
    norms = np.linalg.norm(arr, axis=1, keepdims=True)
    return (arr / np.where(norms == 0.0, 1.0, norms)).astype(np.float32)


def _join_sentences(sentences: list[str]) -> str:
    """Join sentences so that they split back into the same sentences.

    A sentence without closing punctuation (a heading, a list item) gets a line break after
    it; joined with a space it would run into the next sentence.
    """
    parts: list[str] = []
    for sentence in sentences:
        if parts:
            parts.append(" " if parts[-1][-1] in _TERMINAL else "\n")
        parts.append(sentence)
    return "".join(parts)


_TERMINAL = frozenset(".!?…‽。！？｡\"'”’)]»")


def _greedy_coverage(
    vectors: NDArray[np.float32], costs: NDArray[np.float64], budget: float
) -> list[int]:
    """Budgeted greedy maximisation of facility-location coverage; returns chosen indices."""
    n = vectors.shape[0]
    sim = np.clip(vectors @ vectors.T, 0.0, 1.0)  # (n, n); negative similarity covers nothing
    covered = np.zeros(n, dtype=np.float64)  # how well each sentence is represented so far
    chosen: list[int] = []
    available = np.ones(n, dtype=bool)
    remaining = budget
    while True:
        available &= costs <= remaining
        if not available.any():
            break
        # gain[j] = sum_i max(0, sim[i, j] - covered[i])
        gains = np.maximum(sim - covered[:, None], 0.0).sum(axis=0)
        ratio = np.where(available, gains / np.sqrt(costs), -np.inf)
        j = int(np.argmax(ratio))
        if gains[j] <= 1e-9:
            break
        chosen.append(j)
        covered = np.maximum(covered, sim[:, j])
        remaining -= costs[j]
        available[j] = False
    return chosen


class LLMSummarizer:
    """A :class:`~raptor_core.types.Summarizer` over any :class:`~raptor_core.types.LLM`.

    Args:
        llm: the model (``complete(prompt, max_tokens=...)``, optionally ``acomplete``).
        prompt: template with a ``{context}`` placeholder; the paper's prompt by default.
        separator: joins the cluster's texts into the context.
    """

    def __init__(
        self, llm: LLM, *, prompt: str = DEFAULT_SUMMARY_PROMPT, separator: str = "\n\n"
    ) -> None:
        self.llm = llm
        self.prompt = prompt
        self.separator = separator

    def __repr__(self) -> str:
        return f"LLMSummarizer(llm={self.llm!r})"

    def render(self, texts: Sequence[str]) -> str:
        """The prompt sent for a cluster."""
        if "{context}" not in self.prompt:
            msg = "the summary prompt template must contain a '{context}' placeholder"
            raise InvalidParameterError(msg)
        # str.replace, not str.format: cluster text and user templates may contain braces.
        return self.prompt.replace("{context}", self.separator.join(texts))

    @staticmethod
    def _check(summary: object) -> str:
        if not isinstance(summary, str) or not summary.strip():
            msg = f"the LLM returned an empty summary ({summary!r}); check the model and prompt"
            raise SummarizationError(msg)
        return summary.strip()

    def summarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        """Ask the LLM for a summary of ``texts``."""
        return self._check(self.llm.complete(self.render(texts), max_tokens=max_tokens))

    async def asummarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        """Async :meth:`summarize`: native when the LLM is async, else in a thread."""
        prompt = self.render(texts)
        if isinstance(self.llm, AsyncLLM):
            answer = await self.llm.acomplete(prompt, max_tokens=max_tokens)
        else:
            answer = await asyncio.to_thread(self.llm.complete, prompt, max_tokens=max_tokens)
        return self._check(answer)
