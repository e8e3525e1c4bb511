"""LLM-guided tree search: an LLM reads the summaries and decides where to descend.

At each step the LLM sees the question and the candidate nodes (the top layer first, then
the children of the nodes it chose) and answers with JSON::

    {"selected": [{"id": "L2.3", "reason": "covers the Apollo programme"}]}

The chosen nodes are returned and their children become the next candidates, until the
leaves, ``num_layers`` steps, ``k`` hits or the token budget.  A malformed answer (or a
failed call) is retried once with a note on what was wrong; if the retry fails too, that
step falls back to similarity ranking and a warning is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core._async import run_sync
from raptor_core._llm import ask_json, render
from raptor_core.exceptions import InvalidParameterError
from raptor_core.retrieval.base import (
    DEFAULT_K,
    DEFAULT_MAX_TOKENS,
    Hit,
    TreeRetriever,
    _check_positive_int,
    check_similarity,
    selection_path,
    similarity_score,
    top_layer,
)
from raptor_core.retrieval.traversal import check_layer_span, first_layer
from raptor_core.tree import Tree, is_carried
from raptor_core.types import LLM, Embedder, Match, NodeStore

__all__ = ["SELECT_PROMPT", "LLMGuidedRetriever", "check_timeout"]

logger = logging.getLogger(__name__)

#: Placeholders: ``{query}``, ``{candidates}``, ``{top_k}`` (filled with str.replace).
SELECT_PROMPT = """You are searching a hierarchical index of documents for the passages that \
answer a question. Summary nodes summarise the nodes below them; passages are original text.

Question: {query}

Candidate nodes:
{candidates}

Select at most {top_k} nodes that contain the answer or are most likely to lead to it; the \
children of the selected summaries are shown next. Select none if no node is relevant.
Answer with a JSON object only, no other text:
{"selected": [{"id": "<node id>", "reason": "<one short sentence>"}]}"""


def check_timeout(name: str, value: object) -> None:
    """Raise InvalidParameterError unless ``value`` is None or a positive number of seconds."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        msg = f"{name} must be a positive number of seconds or None, got {value!r}"
        raise InvalidParameterError(msg)


def _preview(text: str, limit: int) -> str:
    """``text`` on one line, at most ``limit`` characters (an ellipsis marks a cut)."""
    flat = " ".join(text.split())
    if len(flat) <= limit:
        return flat
    if limit <= 3:  # no room for an ellipsis: flat[: limit - 3] would cut from the end
        return flat[:limit]
    return flat[: limit - 3].rstrip() + "..."


class LLMGuidedRetriever(TreeRetriever):
    """LLM-guided tree search: the LLM chooses which nodes to expand, layer by layer.

    Hits come in the order the search chose them (top layer first, then in the LLM's
    order); ``Hit.score`` is the node's cosine similarity, ``Hit.reason`` the LLM's reason
    and ``Hit.path`` the chosen nodes that led to it.

    Args:
        tree: the tree to search (a :class:`Tree` or a :class:`~raptor_core.types.NodeStore`).
        embedder: embeds the query (to pre-rank candidates and for the fallback).
        llm: any :class:`~raptor_core.types.LLM` (``complete``; ``acomplete`` used when present).
        k: maximum number of hits; the search stops once it has them.
        max_tokens: context budget; a chosen node that does not fit is still expanded but
            not returned, and the search stops when the budget is full.
        top_k: nodes the LLM may choose per step.
        start_layer: layer to start at (default: the top layer; with a filter, the highest
            layer holding a node that passes it).
        num_layers: steps to descend (default: ``start_layer + 1``, down to the leaves).
        max_candidates: at most this many candidates (the most similar) are shown per step,
            which bounds the prompt on wide trees.
        preview_chars: each candidate's text is cut to this many characters in the prompt.
        min_score: candidates below this cosine similarity are never shown.
        llm_timeout: seconds per LLM call (None: wait); a timeout counts as a failed call.
        llm_max_tokens: answer length requested from the LLM.
        prompt: the selection prompt (see :data:`SELECT_PROMPT` for the placeholders).
        where: a metadata filter (see :class:`TreeRetriever`): only passing nodes are shown.
        native_filter: a filter in the store's own dialect.

    Examples:
        >>> from raptor_core.testing import FakeEmbedder, ScriptedLLM, tiny_tree
        >>> tree = tiny_tree()
        >>> llm = ScriptedLLM(['{"selected": [{"id": "L1.1", "reason": "rockets"}]}',
        ...                    '{"selected": [{"id": "L0.2", "reason": "fuel"}]}'])
        >>> hits = LLMGuidedRetriever(tree, FakeEmbedder(dim=tree.dim), llm=llm).retrieve("rockets")
        >>> [(h.id, h.reason) for h in hits], hits[-1].path
        ([('L1.1', 'rockets'), ('L0.2', 'fuel')], ('L1.1', 'L0.2'))
    """

    source = "llm"

    def __init__(
        self,
        tree: Tree | NodeStore,
        embedder: Embedder,
        *,
        llm: LLM,
        k: int = DEFAULT_K,
        max_tokens: int | None = DEFAULT_MAX_TOKENS,
        top_k: int = 3,
        start_layer: int | None = None,
        num_layers: int | None = None,
        max_candidates: int = 20,
        preview_chars: int = 500,
        min_score: float | None = None,
        llm_timeout: float | None = None,
        llm_max_tokens: int = 512,
        prompt: str = SELECT_PROMPT,
        where: Mapping[str, Any] | None = None,
        native_filter: Any = None,
    ) -> None:
        super().__init__(
            tree, embedder, k=k, max_tokens=max_tokens, where=where, native_filter=native_filter
        )
        self.llm = llm
        self.top_k = top_k
        self.start_layer = start_layer
        self.num_layers = num_layers
        self.max_candidates = max_candidates
        self.preview_chars = preview_chars
        self.min_score = min_score
        self.llm_timeout = llm_timeout
        self.llm_max_tokens = llm_max_tokens
        self.prompt = prompt

    def _validate(self) -> None:
        if not callable(getattr(self.llm, "complete", None)) and not callable(
            getattr(self.llm, "acomplete", None)
        ):
            msg = f"llm must have a complete(prompt) method (the LLM protocol), got {self.llm!r}"
            raise InvalidParameterError(msg)
        for name in ("top_k", "max_candidates", "preview_chars", "llm_max_tokens"):
            _check_positive_int(name, getattr(self, name))
        check_similarity("min_score", self.min_score)
        check_timeout("llm_timeout", self.llm_timeout)
        check_layer_span(top_layer(self.store), self.start_layer, self.num_layers)
        if not isinstance(self.prompt, str) or "{candidates}" not in self.prompt:
            msg = "prompt must be a string with a {candidates} placeholder (see SELECT_PROMPT)"
            raise InvalidParameterError(msg)

    # -- one step ------------------------------------------------------------------------------
    def render_prompt(self, query: str, candidates: Sequence[Match]) -> str:
        """The selection prompt for ``query`` and the ``candidates``."""
        lines = []
        for match in candidates:
            node = match.node
            kind = (
                f"summary, layer {node.layer}, {len(node.children)} children"
                if node.children
                else "passage"
            )
            lines.append(f"[{node.id}] ({kind}) {_preview(node.text, int(self.preview_chars))}")
        return render(
            self.prompt, query=query, candidates="\n".join(lines), top_k=str(int(self.top_k))
        )

    async def choose(self, query: str, candidates: Sequence[Match]) -> list[tuple[Match, str]]:
        """Ask the LLM which of the ``candidates`` (best-similarity first) to choose.

        Returns:
            ``(candidate, reason)`` pairs in the LLM's order, at most ``top_k``; an empty
            list when the LLM chose none.  Falls back to the ``top_k`` most similar
            candidates (logged) when the LLM's answer is unusable twice.
        """
        by_id = {m.node.id: m for m in candidates}

        def parse(answer: object) -> list[tuple[Match, str]]:
            items = answer.get("selected") if isinstance(answer, dict) else answer
            if not isinstance(items, list):
                msg = 'expected {"selected": [...]}'
                raise ValueError(msg)
            chosen: dict[str, tuple[Match, str]] = {}
            for item in items:
                if isinstance(item, dict):
                    node_id, reason = item.get("id"), item.get("reason")
                else:
                    node_id, reason = item, None
                key = str(node_id).strip().strip("[]") if node_id is not None else ""
                match = by_id.get(key)
                if match is not None and key not in chosen:  # unknown ids are ignored
                    chosen[key] = (match, str(reason).strip() if reason else "chosen by the LLM")
            if items and not chosen:
                named = [i.get("id") if isinstance(i, dict) else i for i in items][:5]
                msg = f"none of the chosen ids {named} is a candidate"
                raise ValueError(msg)
            return list(chosen.values())

        picked, error = await ask_json(
            self.llm,
            self.render_prompt(query, candidates),
            parse,
            max_tokens=int(self.llm_max_tokens),
            timeout=self.llm_timeout,
        )
        if picked is None:
            logger.warning(
                "LLM-guided search: the LLM's answer was unusable twice (%s); "
                "fell back to similarity ranking for %d candidates",
                error,
                len(candidates),
            )
            # Candidates come from the store best first.
            return [(m, f"similarity fallback: {error}") for m in candidates[: int(self.top_k)]]
        return picked[: int(self.top_k)]

    # -- the walk ------------------------------------------------------------------------------
    async def walk(
        self,
        query: str,
        vector: NDArray[np.float32],
        *,
        k: int,
        max_tokens: int | None,
        emit: Callable[[Hit], None] | None = None,
    ) -> list[Hit]:
        """Run the search with a unit query vector; ``emit`` is called with each hit as found.

        Used by :class:`~raptor_core.retrieval.hybrid.HybridRetriever` to stream hits into its queue.
        """
        store = self.store
        start = first_layer(self, store, self.start_layer)
        steps = start + 1 if self.num_layers is None else min(int(self.num_layers), start + 1)
        # Carried copies are shown (their child is reached through them) but never returned.
        where = self.node_filter(layers=frozenset({start}), include_carried=True)
        via: dict[str, str] = {}
        done: set[str] = set()
        hits: list[Hit] = []
        used = 0
        for _ in range(steps):
            candidates = [
                m
                # A store search is short next to an LLM call; inline keeps the order of
                # hybrid search's queue repeatable.
                for m in store.search(vector, int(self.max_candidates), where=where)
                if m.node.id not in done and (self.min_score is None or m.score >= self.min_score)
            ]
            if not candidates:
                break
            choices = await self.choose(query, candidates)
            if not choices:
                break
            for match, reason in choices:
                node = match.node
                done.add(node.id)
                for child in node.children:
                    via.setdefault(child, node.id)
                if is_carried(node):
                    continue  # a copy of its only child, which is shown next
                cost = node.token_count
                if max_tokens is not None and used + cost > max_tokens:
                    continue  # too long to return, but its children may fit
                hit = Hit(
                    node=node,
                    score=similarity_score(match.score),
                    source=self.source,
                    path=selection_path(via, node.id),
                    reason=reason,
                )
                hits.append(hit)
                used += cost
                if emit is not None:
                    emit(hit)
                if len(hits) >= k or (max_tokens is not None and used >= max_tokens):
                    return hits
            parents = frozenset(m.node.id for m, _ in choices if m.node.children)
            if not parents:
                break
            where = self.node_filter(parents=parents, include_carried=True)
        return hits

    def _retrieve(
        self, query: str, vector: NDArray[np.float32], *, k: int, max_tokens: int | None
    ) -> list[Hit]:
        return run_sync(lambda: self.walk(query, vector, k=k, max_tokens=max_tokens))

    async def _aretrieve(
        self, query: str, vector: NDArray[np.float32], *, k: int, max_tokens: int | None
    ) -> list[Hit]:
        return await self.walk(query, vector, k=k, max_tokens=max_tokens)
