"""raptor_core: RAPTOR trees (recursive abstractive processing for tree-organized retrieval).

Framework-agnostic: chunking, embedding, clustering, summarising, the immutable tree and its
plain-file persistence, and the retrieval strategies.  Heavy dependencies (torch, UMAP,
scikit-learn, FAISS, openai) are imported only where they are used.
"""

from __future__ import annotations

import logging

from raptor_core._version import __version__
from raptor_core.backends.faiss_index import FaissHNSWIndex, FaissIndex
from raptor_core.backends.numpy_index import NumpyIndex
from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder
from raptor_core.build.budget import LLMBudget, Pricing
from raptor_core.build.builder import TreeBuilder
from raptor_core.build.chunking import SentenceChunker
from raptor_core.build.clustering import GMMClusterer
from raptor_core.build.incremental import TreeUpdate, UpdateReport
from raptor_core.build.progress import BuildProgress
from raptor_core.build.summarizers import ExtractiveSummarizer, LLMSummarizer
from raptor_core.exceptions import (
    BackendError,
    BudgetExceededError,
    CacheError,
    EmbeddingError,
    EmbeddingResponseError,
    InvalidInputError,
    InvalidParameterError,
    LLMAuthenticationError,
    LLMBatchError,
    LLMError,
    LLMRequestError,
    LLMResponseError,
    LLMTimeoutError,
    MissingDependencyError,
    RaptorError,
    SummarizationError,
    TreeFormatError,
    TreeLockError,
    TreeSaveError,
)
from raptor_core.retrieval import CollapsedTreeRetriever, Hit, MMRRetriever, TreeRetriever
from raptor_core.retrieval.hybrid import HybridResult, HybridRetriever, JudgeDecision
from raptor_core.retrieval.llm import LLMGuidedRetriever
from raptor_core.retrieval.passage import PassageRetriever
from raptor_core.retrieval.registry import DEFAULT_STRATEGY, STRATEGIES, make_retriever
from raptor_core.retrieval.traversal import TreeTraversalRetriever
from raptor_core.retrieval.value import ValueBasedRetriever
from raptor_core.store.files import FileNodeStore
from raptor_core.store.memory import InMemoryNodeStore
from raptor_core.tokenizers import RegexTokenizer, TiktokenTokenizer
from raptor_core.tree import Node, Tree
from raptor_core.types import (
    DEFAULT_SUMMARY_PROMPT,
    LLM,
    AsyncEmbedder,
    AsyncLLM,
    AsyncSummarizer,
    BatchSummarizer,
    Chunk,
    Chunker,
    Clusterer,
    Document,
    Embedder,
    Match,
    NodeFilter,
    NodeStore,
    Segment,
    SpanEmbedder,
    Summarizer,
    Tokenizer,
    VectorIndex,
)

# Library code never configures logging; applications do (txtai, httpx convention).
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "DEFAULT_STRATEGY",
    "DEFAULT_SUMMARY_PROMPT",
    "LLM",
    "STRATEGIES",
    "AsyncEmbedder",
    "AsyncLLM",
    "AsyncSummarizer",
    "BackendError",
    "BatchSummarizer",
    "BudgetExceededError",
    "BuildProgress",
    "CacheError",
    "Chunk",
    "Chunker",
    "Clusterer",
    "CollapsedTreeRetriever",
    "Document",
    "Embedder",
    "EmbeddingError",
    "EmbeddingResponseError",
    "ExtractiveSummarizer",
    "FaissHNSWIndex",
    "FaissIndex",
    "FileNodeStore",
    "GMMClusterer",
    "Hit",
    "HybridResult",
    "HybridRetriever",
    "InMemoryNodeStore",
    "InvalidInputError",
    "InvalidParameterError",
    "JudgeDecision",
    "LLMAuthenticationError",
    "LLMBatchError",
    "LLMBudget",
    "LLMError",
    "LLMGuidedRetriever",
    "LLMRequestError",
    "LLMResponseError",
    "LLMSummarizer",
    "LLMTimeoutError",
    "MMRRetriever",
    "Match",
    "MissingDependencyError",
    "Node",
    "NodeFilter",
    "NodeStore",
    "NumpyIndex",
    "PassageRetriever",
    "Pricing",
    "RaptorError",
    "RegexTokenizer",
    "Segment",
    "SentenceChunker",
    "SentenceTransformerEmbedder",
    "SpanEmbedder",
    "SummarizationError",
    "Summarizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "Tree",
    "TreeBuilder",
    "TreeFormatError",
    "TreeLockError",
    "TreeRetriever",
    "TreeSaveError",
    "TreeTraversalRetriever",
    "TreeUpdate",
    "UpdateReport",
    "ValueBasedRetriever",
    "VectorIndex",
    "__version__",
    "make_retriever",
]
