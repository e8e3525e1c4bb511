"""The node <-> flat metadata codec both framework adapters store nodes with."""

from __future__ import annotations

import json
import math

import pytest

from raptor_core.exceptions import TreeFormatError
from raptor_core.store.codec import (
    is_node_metadata,
    node_from_metadata,
    node_metadata,
    scalar_value,
)
from raptor_core.tree import Node

LEAF = Node(
    id="leaf-1",
    text="Bees dance to show the way.",
    layer=0,
    token_count=7,
    doc_id="bees",
    span=(10, 37),
    doc_ids=("bees",),
    metadata={
        "source": "bees.md",
        "page": 3,
        "tags": ["insects", "dance"],
        "missing": None,
        "nested": {"a": 1},
        "raptor_layer": "user value, not structure",
        "doc_id": "kept only inside raptor_metadata when reserved",
    },
    parents=("sum-1",),
)
SUMMARY = Node(
    id="sum-1",
    text="Bees dance.",
    layer=1,
    token_count=2,
    children=("leaf-1", "leaf-2"),
    doc_ids=("bees", "hives"),
)


@pytest.mark.parametrize("node", [LEAF, SUMMARY])
@pytest.mark.parametrize("native_lists", [True, False])
@pytest.mark.parametrize("carried_as_int", [True, False])
def test_round_trip(node: Node, native_lists: bool, carried_as_int: bool) -> None:
    meta = node_metadata(node, native_lists=native_lists, carried_as_int=carried_as_int)
    assert is_node_metadata(meta)
    # What a store gives back: JSON-able scalars (and lists where it keeps lists).
    stored = json.loads(json.dumps(meta))
    assert node_from_metadata(node.id, node.text, stored) == node


def test_flat_keys_are_scalars_and_structure_is_not_overwritten() -> None:
    meta = node_metadata(LEAF, reserved={"doc_id"})
    assert meta["raptor_layer"] == 0  # the user's raptor_layer stays in raptor_metadata
    assert "doc_id" not in meta and "missing" not in meta and "nested" not in meta
    assert "tags" not in meta  # no lists where the store keeps none
    assert all(scalar_value(v) for v in meta.values())
    assert json.loads(meta["raptor_metadata"]) == LEAF.metadata
    assert node_metadata(LEAF, native_lists=True)["tags"] == ["insects", "dance"]
    assert node_metadata(LEAF, carried_as_int=True)["raptor_carried"] == 0


def test_numbers_handed_back_as_floats_and_empty_strings_for_none() -> None:
    meta = node_metadata(LEAF)
    meta.update(raptor_layer=0.0, raptor_token_count=7.0, raptor_span_start=10.0)
    assert node_from_metadata(LEAF.id, LEAF.text, meta) == LEAF
    bare = node_metadata(SUMMARY)
    bare.update(raptor_doc_id="", raptor_span_start="", raptor_span_end="")
    assert node_from_metadata(SUMMARY.id, SUMMARY.text, bare) == SUMMARY


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"raptor_layer": 1.5}, "raptor_layer should be an integer"),
        ({"raptor_layer": True}, "raptor_layer should be an integer"),
        ({"raptor_token_count": "7"}, "raptor_token_count should be an integer"),
        ({"raptor_children": '{"a": 1}'}, "raptor_children should be a list of ids"),
        ({"raptor_parents": [1, 2]}, "raptor_parents should be a list of ids"),
        ({"raptor_doc_ids": "not json"}, "Expecting value"),
        ({"raptor_metadata": "[1]"}, "raptor_metadata should hold a JSON object"),
        ({"raptor_span_start": math.inf}, "raptor_span_start should be an integer"),
        ({"raptor_span_end": math.nan}, "raptor_span_end should be an integer"),
    ],
)
def test_damaged_records_raise_tree_format_error(change: dict[str, object], why: str) -> None:
    meta = {**node_metadata(LEAF), **change}
    with pytest.raises(TreeFormatError, match="not a RAPTOR node") as info:
        node_from_metadata("leaf-1", LEAF.text, meta, written_by="RaptorIndex")
    assert why in str(info.value) and "RaptorIndex" in str(info.value)


@pytest.mark.parametrize("meta", [None, {}, {"raptor_layer": 0}, {"source": "x"}])
def test_foreign_records_are_not_nodes(meta: dict[str, object] | None) -> None:
    assert not is_node_metadata(meta)
    with pytest.raises(TreeFormatError, match="no raptor_layer/raptor_metadata"):
        node_from_metadata("x", "text", meta)
