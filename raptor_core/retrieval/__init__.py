"""Retrieval strategies over a RAPTOR tree, one module each, all behind :class:`TreeRetriever`.

``base``        the result type (:class:`Hit`), the base class and shared budget helpers
``collapsed``   every layer in one pool (RAPTOR's collapsed tree)
``traversal``   top-down, layer by layer, into the children of what was picked
``value``       leaf search, then NodeScore aggregation up the tree (PageIndex-style)
``llm``         an LLM reads summaries and picks branches
``hybrid``      value-based and LLM-guided search in parallel with an early-stop judge
``mmr``         maximal marginal relevance over the collapsed pool (diverse context)
``passage``     leaf hits grown into contiguous passages where neighbours are relevant (default)
``lexical``     BM25 over node texts, the lexical signal of ``passage``
``registry``    the strategies by name (``make_retriever``), for the CLI and the adapters
"""

from __future__ import annotations

from raptor_core.retrieval.base import DEFAULT_K, DEFAULT_MAX_TOKENS, Hit, TreeRetriever
from raptor_core.retrieval.collapsed import CollapsedTreeRetriever
from raptor_core.retrieval.hybrid import HybridResult, HybridRetriever, JudgeDecision
from raptor_core.retrieval.llm import LLMGuidedRetriever
from raptor_core.retrieval.mmr import MMRRetriever
from raptor_core.retrieval.passage import PassageRetriever
from raptor_core.retrieval.registry import DEFAULT_STRATEGY, STRATEGIES, make_retriever
from raptor_core.retrieval.traversal import TreeTraversalRetriever
from raptor_core.retrieval.value import ValueBasedRetriever

__all__ = [
    "DEFAULT_K",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_STRATEGY",
    "STRATEGIES",
    "CollapsedTreeRetriever",
    "Hit",
    "HybridResult",
    "HybridRetriever",
    "JudgeDecision",
    "LLMGuidedRetriever",
    "MMRRetriever",
    "PassageRetriever",
    "TreeRetriever",
    "TreeTraversalRetriever",
    "ValueBasedRetriever",
    "make_retriever",
]
