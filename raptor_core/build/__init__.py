"""Building a tree: chunk, embed, cluster, summarise, repeat.

``chunking``     sentence-boundary chunks of ~100 tokens
``clustering``   UMAP + Gaussian mixtures chosen by BIC, global then local
``summarizers``  the offline extractive summariser and the LLM one
``builder``      :class:`TreeBuilder`, which runs the stages layer by layer
``cache``        a content-addressed cache of summaries and embeddings (resume a build)
``incremental``  insert, update and delete documents without rebuilding
``budget``       a hard cap on the cost or tokens of the summary calls (``LLMBudget``)
``progress``     progress events with ETA and spend (``BuildProgress``)
``rejoin``       a text splitter's splits joined back into the documents they were cut from
"""

from __future__ import annotations

from raptor_core.build.builder import TreeBuilder
from raptor_core.build.chunking import SentenceChunker
from raptor_core.build.clustering import GMMClusterer
from raptor_core.build.incremental import TreeUpdate, UpdateReport
from raptor_core.build.summarizers import ExtractiveSummarizer, LLMSummarizer

__all__ = [
    "ExtractiveSummarizer",
    "GMMClusterer",
    "LLMSummarizer",
    "SentenceChunker",
    "TreeBuilder",
    "TreeUpdate",
    "UpdateReport",
]
