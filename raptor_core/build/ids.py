"""Stable node ids: the same input gives the same ids, whatever else is in the tree.

A leaf's id is a digest of its document id, its character span and its text, so adding,
removing or re-chunking *another* document never renames it.  A summary's id is a digest of
its layer and the ids of its children: it changes exactly when what it summarises changes,
which is what incremental updates and external vector stores (upserts by id) rely on.  The
layer is part of the digest because a single-member cluster is carried up unchanged, and the
copy must not take its child's id.

Ids look like ``L0-3fa9c0e1b2d4f6a8c0e1``: the layer, then 80 bits of SHA-256 (a collision
among ten million nodes has a probability below 1e-10).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["leaf_id", "summary_id"]

_DIGEST_CHARS = 20


def _digest(*parts: str) -> str:
    # NUL never occurs in document ids or text that passed input validation, so joining on it
    # cannot make two different part lists collide.
    return hashlib.sha256("\x00".join(parts).encode("utf-8")).hexdigest()[:_DIGEST_CHARS]


def leaf_id(doc_id: str, start: int, end: int, text: str) -> str:
    """The id of the chunk ``text`` at ``[start, end)`` of document ``doc_id``.

    Examples:
        >>> leaf_id("doc", 0, 5, "Hello") == leaf_id("doc", 0, 5, "Hello")
        True
        >>> leaf_id("doc", 0, 5, "Hello") == leaf_id("other", 0, 5, "Hello")
        False
    """
    return f"L0-{_digest('leaf', doc_id, str(start), str(end), text)}"


def summary_id(layer: int, children: Iterable[str]) -> str:
    """The id of the layer-``layer`` node over ``children`` (order does not matter).

    Examples:
        >>> summary_id(1, ["a", "b"]) == summary_id(1, ["b", "a"])
        True
        >>> summary_id(1, ["a"]) == summary_id(2, ["a"])
        False
    """
    return f"L{layer}-{_digest('summary', str(layer), *sorted(children))}"
