"""The builder refuses malformed input with a typed error, before any model is called."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from raptor_core import Document, Tree, TreeBuilder
from raptor_core.build.clustering import GMMClusterer
from raptor_core.exceptions import InvalidInputError, InvalidParameterError, SummarizationError
from raptor_core.testing import EchoSummarizer, FakeEmbedder, GroupClusterer, WhitespaceTokenizer

DOCS = [f"Topic {i} is about thing{i}. It has a second sentence." for i in range(6)]


def make_builder(**kwargs: Any) -> TreeBuilder:
    params: dict[str, Any] = {"tokenizer": WhitespaceTokenizer(), "clusterer": GroupClusterer(2)}
    params.update(kwargs)
    embedder = params.pop("embedder", FakeEmbedder())
    summarizer = params.pop("summarizer", EchoSummarizer())
    return TreeBuilder(embedder, summarizer, **params)


@pytest.fixture(scope="module")
def tree() -> Tree:
    return make_builder().build(DOCS)


class SurrogateSummarizer:
    """Returns text holding a lone surrogate, as a model output decoded with errors would."""

    def summarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        return "summary \ud800 of the cluster"


# -- the documents argument ----------------------------------------------------------------------
ONE_DOCUMENT = [
    pytest.param("abc", "single string", id="str"),
    pytest.param(b"abc", "single string", id="bytes"),
    pytest.param({"doc_id": "a", "text": "hello world"}, "single mapping", id="mapping"),
    pytest.param(Document(text="hello world", doc_id="a"), "single Document", id="Document"),
    pytest.param(None, "got NoneType", id="None"),
    pytest.param(5, "got int", id="int"),
]


@pytest.mark.parametrize(("documents", "match"), ONE_DOCUMENT)
def test_build_and_estimate_refuse_one_document_instead_of_a_list(
    documents: object, match: str
) -> None:
    embedder = FakeEmbedder()
    builder = make_builder(embedder=embedder)
    with pytest.raises(InvalidParameterError, match=f"documents must be a list.*{match}"):
        builder.build(documents)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match=f"documents must be a list.*{match}"):
        builder.estimate(documents)  # type: ignore[arg-type]
    assert embedder.texts_embedded == 0


@pytest.mark.parametrize(("documents", "match"), ONE_DOCUMENT)
def test_insert_and_update_refuse_one_document_instead_of_a_list(
    tree: Tree, documents: object, match: str
) -> None:
    builder = make_builder()
    with pytest.raises(InvalidParameterError, match=f"documents must be a list.*{match}"):
        builder.insert(tree, documents)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match=f"documents must be a list.*{match}"):
        builder.update(tree, documents)  # type: ignore[arg-type]


def test_a_generator_of_documents_is_still_accepted() -> None:
    tree = make_builder().build(text for text in DOCS[:3])
    assert tree.doc_ids == ("doc-0", "doc-1", "doc-2")


# -- document fields -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (
            {"doc_id": "b", "text": "x y", "metadata": [1, 2]},
            r"#1 \('b'\): metadata must be a mapping.*list",
        ),
        (
            {"doc_id": "b", "text": "x y", "metadata": "abc"},
            r"#1 \('b'\): metadata must be a mapping.*str",
        ),
        (Document(text="x y", doc_id="b", metadata=[1]), r"#1 \('b'\): metadata must be a mapping"),  # type: ignore[arg-type]
        (Document(text="x y", doc_id=5), r"#1: doc_id must be a non-empty str, got int 5"),  # type: ignore[arg-type]
        ({"doc_id": None, "text": "x y"}, r"#1: doc_id must be a non-empty str, got NoneType"),
        ({"doc_id": 7, "text": "x y"}, r"#1: doc_id must be a non-empty str, got int 7"),
        ({"doc_id": "", "text": "x y"}, r"#1: doc_id is empty"),
        (Document(text="x y", doc_id="a\x00b"), r"#1: doc_id 'a\\x00b' contains a NUL"),
        (Document(text="x y", doc_id="\ud800"), r"#1: doc_id '\\ud800' is not Unicode text"),
    ],
)
def test_malformed_document_fields_are_refused_naming_the_document(bad: object, match: str) -> None:
    embedder = FakeEmbedder()
    with pytest.raises(InvalidInputError, match=f"document {match}"):
        make_builder(embedder=embedder).build([Document(text="fine text", doc_id="a"), bad])  # type: ignore[list-item]
    assert embedder.texts_embedded == 0


def test_metadata_none_means_no_metadata() -> None:
    tree = make_builder().build(
        [
            Document(text="Cats purr softly.", doc_id="cats", metadata=None),  # type: ignore[arg-type]
            {"doc_id": "dogs", "text": "Dogs bark loudly.", "metadata": None},
        ]
    )
    assert tree.doc_ids == ("cats", "dogs")
    assert all(leaf.metadata == {} for leaf in tree.leaves)


# -- summaries -----------------------------------------------------------------------------------
def test_a_summary_that_is_not_unicode_is_refused_naming_layer_and_cluster() -> None:
    builder = make_builder(summarizer=SurrogateSummarizer())
    match = r"layer 1, cluster 0: .*'\\ud800' at character 8, which is not Unicode text"
    with pytest.raises(SummarizationError, match=match):
        builder.build(DOCS)
    with pytest.raises(SummarizationError, match=match):
        asyncio.run(builder.abuild(DOCS))


# -- components and callbacks --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"progress": 5}, "progress must be a callable or None, got int"),
        ({"on_progress": "bar"}, "on_progress must be a callable or None, got str"),
        ({"chunker": 5}, r"chunker must have a split\(\) method"),
        ({"clusterer": object()}, r"clusterer must have a cluster\(\) method"),
        ({"tokenizer": 5}, r"tokenizer must have an encode\(\) method"),
        ({"random_state": -1}, r"random_state must be an int in \[0, 2\*\*32 - 1\]"),
        ({"random_state": 2**32}, r"random_state must be an int in \[0, 2\*\*32 - 1\]"),
        ({"random_state": True}, "random_state"),
        ({"random_state": 1.5}, "random_state"),
    ],
)
def test_components_and_callbacks_are_checked_before_any_work(
    params: dict[str, Any], match: str
) -> None:
    embedder = FakeEmbedder()
    builder = make_builder(embedder=embedder, **params)
    with pytest.raises(InvalidParameterError, match=match):
        builder.build(DOCS)
    with pytest.raises(InvalidParameterError, match=match):
        builder.estimate(DOCS)
    assert embedder.texts_embedded == 0


def test_the_largest_seed_is_accepted() -> None:
    tree = make_builder(random_state=2**32 - 1, progress=lambda *a: None).build(DOCS[:3])
    assert tree.params["random_state"] == 2**32 - 1


@pytest.mark.parametrize("seed", [-1, 2**32, True, "0"])
def test_gmm_clusterer_refuses_a_seed_out_of_range(seed: object) -> None:
    vectors = np.random.default_rng(0).random((20, 8)).astype(np.float32)
    with pytest.raises(InvalidParameterError, match="random_state must be an integer in"):
        GMMClusterer(random_state=seed).cluster(vectors)  # type: ignore[arg-type]


def test_gmm_clusterer_accepts_the_seed_range_ends() -> None:
    vectors = np.ones((2, 4), dtype=np.float32)  # too few rows to cluster: no model runs
    for seed in (0, 2**32 - 1, np.int64(3)):
        assert GMMClusterer(random_state=seed).cluster(vectors) == [[0, 1]]


# -- incremental updates -------------------------------------------------------------------------
def test_updates_refuse_something_other_than_a_tree(tree: Tree) -> None:
    builder = make_builder()
    match = "tree must be a Tree .*got NoneType"
    with pytest.raises(InvalidParameterError, match=match):
        builder.insert(None, ["x y"])  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match=match):
        builder.update(None, ["x y"])  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match=match):
        builder.delete(None, ["doc-0"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("doc_ids", "match"),
    [
        (None, "doc_ids must be a list of document ids.*got NoneType"),
        (5, "doc_ids must be a list of document ids.*got int"),
        ([5], "doc_ids must be document ids.*got int 5"),
        ([["doc-0"]], "doc_ids must be document ids.*got list"),
    ],
)
def test_delete_refuses_ids_that_are_not_a_list_of_strings(
    tree: Tree, doc_ids: object, match: str
) -> None:
    with pytest.raises(InvalidParameterError, match=match):
        make_builder().delete(tree, doc_ids)  # type: ignore[arg-type]
