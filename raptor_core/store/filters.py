"""The core's metadata filter dialect, checked once and evaluated per node.

A filter is a JSON-like mapping, the dialect Chroma, MongoDB and many vector stores share::

    {"author": "Grimm"}                                  # equality
    {"year": {"$gte": 1800, "$lt": 1900}}                # comparisons ($eq $ne $gt $gte $lt $lte)
    {"doc_id": {"$in": ["a", "b"]}}                      # membership ($in $nin)
    {"tags": {"$contains": "bees"}}                      # a list value holds "bees"
    {"tags": {"$any": ["bees", "ants"]}}                 # ... holds at least one of them
    {"tags": {"$all": ["bees", "ants"]}}                 # ... holds every one of them
    {"$or": [{"lang": "en"}, {"lang": "de"}]}            # $and / $or of sub-filters

Several keys in one mapping must all hold.  Keys are the node's metadata, plus ``doc_id``
(the node's document; summaries over several documents have none).  A missing key never
equals anything, and fails every comparison and list operator, but passes ``$ne`` and
``$nin``.  Comparisons need values of one kind (numbers with numbers, strings with strings);
anything else is a typed error when the filter is checked, not a silent mismatch at search
time.

The list operators (LlamaIndex's ``contains``, ``any`` and ``all``) match whole elements,
never substrings, with MongoDB's rule for a value that is not a list: it counts as a list of
that one value, so ``{"tags": {"$any": [...]}}`` passes a scalar ``tags`` exactly when
``$in`` would, and ``$contains`` then means ``$eq``.

Why summaries: the builder gives a summary the metadata that *every* leaf below it shares,
so a summary passes a filter only when all that it condenses would.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from raptor_core.exceptions import InvalidParameterError
from raptor_core.tree import Node

__all__ = ["OPERATORS", "canonical", "check_where", "compile_where"]

#: Comparison, membership and list operators of the dialect.
OPERATORS = frozenset(
    {"$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin", "$contains", "$any", "$all"}
)
#: Operators taking a list of scalars.
_LIST_OPERANDS = frozenset({"$in", "$nin", "$any", "$all"})
_LOGICAL = frozenset({"$and", "$or"})
_MAX_DEPTH = 16
_MISSING = object()

Predicate = Callable[[Node], bool]


def _scalar(value: object) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def check_where(where: object, *, _depth: int = 0) -> None:
    """Raise :class:`InvalidParameterError` unless ``where`` is a filter of the dialect."""
    if _depth > _MAX_DEPTH:
        msg = f"metadata filter is nested more than {_MAX_DEPTH} levels deep"
        raise InvalidParameterError(msg)
    if not isinstance(where, Mapping) or not where:
        msg = f"a metadata filter must be a non-empty mapping, got {where!r}"
        raise InvalidParameterError(msg)
    for key, condition in where.items():
        if not isinstance(key, str):
            msg = f"metadata filter keys must be strings, got {key!r}"
            raise InvalidParameterError(msg)
        if key in _LOGICAL:
            if not isinstance(condition, list | tuple) or not condition:
                msg = f"{key} takes a non-empty list of filters, got {condition!r}"
                raise InvalidParameterError(msg)
            for sub in condition:
                check_where(sub, _depth=_depth + 1)
        elif key.startswith("$"):
            msg = (
                f"unknown operator {key!r} at the top of a metadata filter: use $and or $or, "
                f"or put {sorted(OPERATORS)} under a metadata key"
            )
            raise InvalidParameterError(msg)
        elif isinstance(condition, Mapping):
            _check_condition(key, condition)
        elif not _scalar(condition):
            msg = f"metadata filter value for {key!r} must be a string, number, bool or None"
            raise InvalidParameterError(msg)


def _check_condition(key: str, condition: Mapping[Any, Any]) -> None:
    if not condition:
        msg = f"empty condition for metadata key {key!r}"
        raise InvalidParameterError(msg)
    for op, value in condition.items():
        if op not in OPERATORS:
            msg = f"unknown operator {op!r} for {key!r}: use one of {', '.join(sorted(OPERATORS))}"
            raise InvalidParameterError(msg)
        if op in _LIST_OPERANDS:
            if not isinstance(value, list | tuple | set | frozenset) or not all(
                _scalar(v) for v in value
            ):
                msg = f"{op} for {key!r} takes a list of strings, numbers or bools, got {value!r}"
                raise InvalidParameterError(msg)
            if op == "$all" and not value:
                # MongoDB's empty $all passes nothing, LlamaIndex's every node with the key:
                # refuse rather than pick one silently.
                msg = (
                    f"$all for {key!r} takes a non-empty list: drop the condition to pass "
                    f"every node"
                )
                raise InvalidParameterError(msg)
        elif op in ("$eq", "$ne", "$contains"):
            if not _scalar(value):
                msg = f"{op} for {key!r} takes a string, number, bool or None, got {value!r}"
                raise InvalidParameterError(msg)
        elif isinstance(value, bool) or not isinstance(value, int | float | str):
            msg = f"{op} for {key!r} compares with a number or a string, got {value!r}"
            raise InvalidParameterError(msg)


def canonical(where: Mapping[str, Any]) -> str:
    """A stable text form of a filter (a cache key for the masks stores compute).

    Raises:
        InvalidParameterError: ``where`` is not a filter of the dialect (checked first, so
            that a value JSON cannot write is reported as such, not as a ``TypeError``).

    Examples:
        >>> canonical({"tags": {"$any": {"b", "a"}}, "n": 1})
        '{"n":1,"tags":{"$any":["a","b"]}}'
    """
    check_where(where)
    return json.dumps(where, sort_keys=True, default=_sorted_set, separators=(",", ":"))


def _sorted_set(value: set[Any] | frozenset[Any]) -> list[Any]:
    """A set operand ($in, $any, ...) as a list in a stable order, even of mixed kinds."""
    try:
        return sorted(value)
    except TypeError:
        # "a" < 1 and None < "a" raise: order by kind, then by text, which always works.
        return sorted(value, key=lambda v: (type(v).__name__, repr(v)))


def _value(node: Node, key: str) -> Any:
    if key == "doc_id":
        return node.doc_id if node.doc_id is not None else _MISSING
    return node.metadata.get(key, _MISSING)


def _compare(op: str, have: Any, want: Any) -> bool:
    if op == "$eq":
        return have is not _MISSING and _same(have, want)
    if op == "$ne":
        return have is _MISSING or not _same(have, want)
    if op == "$in":
        return have is not _MISSING and any(_same(have, w) for w in want)
    if op == "$nin":
        return have is _MISSING or not any(_same(have, w) for w in want)
    if op in ("$contains", "$any", "$all"):
        if have is _MISSING:
            return False
        held = have if isinstance(have, list | tuple) else (have,)
        if op == "$contains":
            return any(_same(h, want) for h in held)
        found = [any(_same(h, w) for h in held) for w in want]
        return any(found) if op == "$any" else all(found)
    # Ordering: only between numbers or between strings; a metadata value of another kind
    # (or a missing key) simply does not satisfy it.
    numeric = isinstance(want, int | float) and not isinstance(want, bool)
    if have is _MISSING or isinstance(have, bool):
        return False
    if numeric != (isinstance(have, int | float)):
        return False
    if not numeric and not isinstance(have, str):
        return False
    if op == "$gt":
        return bool(have > want)
    if op == "$gte":
        return bool(have >= want)
    if op == "$lt":
        return bool(have < want)
    return bool(have <= want)


def _same(have: Any, want: Any) -> bool:
    # True == 1 in Python; in metadata a bool and a number are different values.
    if isinstance(have, bool) or isinstance(want, bool):
        return have is want
    return bool(have == want)


def compile_where(where: Mapping[str, Any]) -> Predicate:
    """Check ``where`` and return a predicate over nodes.

    Raises:
        InvalidParameterError: ``where`` is not a filter of the dialect.

    Examples:
        >>> from raptor_core.tree import Node
        >>> leaf = Node(id="a", text="t", layer=0, token_count=1, doc_id="d", metadata={"y": 3})
        >>> compile_where({"y": {"$gt": 2}, "doc_id": "d"})(leaf)
        True
        >>> tagged = Node(id="b", text="t", layer=0, token_count=1, metadata={"tags": ["x", "y"]})
        >>> compile_where({"tags": {"$any": ["x", "z"]}})(tagged)
        True
        >>> compile_where({"tags": {"$all": ["x", "z"]}})(tagged)
        False
    """
    check_where(where)
    return _compile(where)


def _all_of(parts: list[Predicate]) -> Predicate:
    def check(node: Node) -> bool:
        return all(p(node) for p in parts)

    return check


def _any_of(parts: list[Predicate]) -> Predicate:
    def check(node: Node) -> bool:
        return any(p(node) for p in parts)

    return check


def _field(key: str, ops: Mapping[str, Any]) -> Predicate:
    def check(node: Node) -> bool:
        have = _value(node, key)
        return all(_compare(op, have, want) for op, want in ops.items())

    return check


def _compile(where: Mapping[str, Any]) -> Predicate:
    parts: list[Predicate] = []
    for key, condition in where.items():
        if key == "$and":
            parts.append(_all_of([_compile(sub) for sub in condition]))
        elif key == "$or":
            parts.append(_any_of([_compile(sub) for sub in condition]))
        else:
            ops = dict(condition) if isinstance(condition, Mapping) else {"$eq": condition}
            parts.append(_field(key, ops))
    return parts[0] if len(parts) == 1 else _all_of(parts)
