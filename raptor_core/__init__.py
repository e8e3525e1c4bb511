"""raptor_core: RAPTOR trees (recursive abstractive processing for tree-organized retrieval).

Framework-agnostic: chunking, embedding, clustering, summarising, the immutable tree and its
plain-file persistence, and the retrieval strategies.  Heavy dependencies (torch, UMAP,
scikit-learn, FAISS, openai) are imported only where they are used.
"""

from __future__ import annotations

import logging

from raptor_core._version import __version__
from raptor_core.backends.faiss_index import FaissIndex
from raptor_core.backends.numpy_index import NumpyIndex
from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder
from raptor_core.builder import TreeBuilder
from raptor_core.chunking import SentenceChunker
from raptor_core.clustering import GMMClusterer
from raptor_core.exceptions import (
    BackendError,
    EmbeddingError,
    InvalidInputError,
    InvalidParameterError,
    LLMAuthenticationError,
    LLMError,
    LLMRequestError,
    LLMTimeoutError,
    MissingDependencyError,
    RaptorError,
    SummarizationError,
    TreeFormatError,
)
from raptor_core.hybrid import HybridResult, HybridRetriever, JudgeDecision
from raptor_core.llm_search import LLMGuidedRetriever
from raptor_core.retrieval import CollapsedTreeRetriever, Hit, TreeRetriever
from raptor_core.strategies import STRATEGIES, make_retriever
from raptor_core.summarizers import ExtractiveSummarizer, LLMSummarizer
from raptor_core.tokenizers import RegexTokenizer, TiktokenTokenizer
from raptor_core.traversal import TreeTraversalRetriever
from raptor_core.tree import Node, Tree
from raptor_core.types import (
    DEFAULT_SUMMARY_PROMPT,
    LLM,
    AsyncEmbedder,
    AsyncLLM,
    AsyncSummarizer,
    Chunk,
    Chunker,
    Clusterer,
    Document,
    Embedder,
    Summarizer,
    Tokenizer,
    VectorIndex,
)
from raptor_core.value_search import ValueBasedRetriever

# Library code never configures logging; applications do (txtai, httpx convention).
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "DEFAULT_SUMMARY_PROMPT",
    "LLM",
    "STRATEGIES",
    "AsyncEmbedder",
    "AsyncLLM",
    "AsyncSummarizer",
    "BackendError",
    "Chunk",
    "Chunker",
    "Clusterer",
    "CollapsedTreeRetriever",
    "Document",
    "Embedder",
    "EmbeddingError",
    "ExtractiveSummarizer",
    "FaissIndex",
    "GMMClusterer",
    "Hit",
    "HybridResult",
    "HybridRetriever",
    "InvalidInputError",
    "InvalidParameterError",
    "JudgeDecision",
    "LLMAuthenticationError",
    "LLMError",
    "LLMGuidedRetriever",
    "LLMRequestError",
    "LLMSummarizer",
    "LLMTimeoutError",
    "MissingDependencyError",
    "Node",
    "NumpyIndex",
    "RaptorError",
    "RegexTokenizer",
    "SentenceChunker",
    "SentenceTransformerEmbedder",
    "SummarizationError",
    "Summarizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "Tree",
    "TreeBuilder",
    "TreeFormatError",
    "TreeRetriever",
    "TreeTraversalRetriever",
    "ValueBasedRetriever",
    "VectorIndex",
    "__version__",
    "make_retriever",
]
