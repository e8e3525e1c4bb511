"""One constructor for every retrieval strategy, by name, for the CLI and the adapters.

Library code should construct the classes directly; this exists because a command line and
framework configs carry names, not objects.
"""

from __future__ import annotations

import inspect
from typing import Any

from raptor_core.exceptions import InvalidParameterError
from raptor_core.retrieval.base import TreeRetriever
from raptor_core.retrieval.collapsed import CollapsedTreeRetriever
from raptor_core.retrieval.hybrid import HybridRetriever
from raptor_core.retrieval.llm import LLMGuidedRetriever
from raptor_core.retrieval.mmr import MMRRetriever
from raptor_core.retrieval.passage import PassageRetriever
from raptor_core.retrieval.traversal import TreeTraversalRetriever
from raptor_core.retrieval.value import ValueBasedRetriever
from raptor_core.tree import Tree
from raptor_core.types import LLM, Embedder

__all__ = ["DEFAULT_STRATEGY", "RETRIEVERS", "STRATEGIES", "accepted_params", "make_retriever"]

#: Strategy name -> retriever class.
RETRIEVERS: dict[str, type[TreeRetriever]] = {
    "collapsed": CollapsedTreeRetriever,
    "traversal": TreeTraversalRetriever,
    "value": ValueBasedRetriever,
    "llm": LLMGuidedRetriever,
    "hybrid": HybridRetriever,
    "mmr": MMRRetriever,
    "passage": PassageRetriever,
}
STRATEGIES: tuple[str, ...] = tuple(RETRIEVERS)
#: The strategy the CLI, ``raptor eval`` and the adapters use when none is named.
DEFAULT_STRATEGY = "passage"
_NEEDS_LLM = frozenset({"llm", "hybrid"})


def accepted_params(strategy: str) -> tuple[str, ...]:
    """The keyword parameters a strategy accepts (``llm`` excluded), in signature order."""
    cls = _class_of(strategy)
    return tuple(
        name
        for name, param in inspect.signature(cls.__init__).parameters.items()
        if param.kind is param.KEYWORD_ONLY and name != "llm"
    )


def _class_of(strategy: str) -> type[TreeRetriever]:
    try:
        return RETRIEVERS[strategy]
    except (KeyError, TypeError):
        msg = f"unknown retrieval strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}"
        raise InvalidParameterError(msg) from None


def make_retriever(
    strategy: str, tree: Tree, embedder: Embedder, *, llm: LLM | None = None, **params: Any
) -> TreeRetriever:
    """Construct the retriever of ``strategy`` with ``params``.

    Args:
        strategy: one of :data:`STRATEGIES`.
        tree: the tree to search.
        embedder: embeds queries.
        llm: required by ``"llm"`` and ``"hybrid"``; ignored by the others.
        **params: the strategy's keyword parameters (``k``, ``max_tokens``, ...).

    Raises:
        InvalidParameterError: unknown strategy, missing LLM, or a parameter the strategy
            does not accept (the message lists the accepted ones).

    Examples:
        >>> from raptor_core.testing import FakeEmbedder, tiny_tree
        >>> tree = tiny_tree()
        >>> make_retriever("traversal", tree, FakeEmbedder(dim=tree.dim), top_k=2).top_k
        2
    """
    cls = _class_of(strategy)
    accepted = accepted_params(strategy)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        msg = (
            f"strategy {strategy!r} does not accept {', '.join(unknown)}; "
            f"it accepts: {', '.join(accepted)}"
        )
        raise InvalidParameterError(msg)
    if strategy in _NEEDS_LLM:
        if llm is None:
            msg = f"strategy {strategy!r} needs an LLM: pass llm= (an object with complete(prompt))"
            raise InvalidParameterError(msg)
        return cls(tree, embedder, llm=llm, **params)  # type: ignore[call-arg]
    return cls(tree, embedder, **params)
