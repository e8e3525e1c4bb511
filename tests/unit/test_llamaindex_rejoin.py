"""RaptorIndex(rejoin_nodes=True): a node parser's nodes are joined back into their documents."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, StorageContext, load_index_from_storage
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import NodeRelationship, TextNode

from raptor_core.exceptions import InvalidInputError, InvalidParameterError, TreeFormatError
from raptor_core.testing import EchoSummarizer, FakeEmbedder, GroupClusterer, WhitespaceTokenizer
from raptor_core.tree import Tree
from raptor_llamaindex import RaptorIndex, RaptorRetriever
from raptor_llamaindex.ingestion import rejoin_nodes
from raptor_llamaindex.retriever import PARAMS_FILE

DIM = 32
# One sentence a line: the splitter cuts at sentence ends and drops the whitespace there,
# and the line breaks put back are then the text's own, so the joined documents are exact.
STORIES = {
    "slipper": (
        "Cinderella swept the ashes every morning.\nHer stepsisters laughed at her rags.\n\n"
        "A fairy gave her a gown and glass slippers.\nShe danced with the prince until midnight.\n\n"
        "She ran away and lost a slipper on the stairs.\nThe prince searched the whole kingdom.\n\n"
        "At last the slipper fitted her foot.\nThey married and lived in the palace."
    ),
    "frog": (
        "A princess dropped her golden ball into a well.\nA frog brought it back to her.\n\n"
        "The frog asked to eat from her plate and sleep on her pillow.\nShe refused at first.\n\n"
        "Her father made her keep her promise.\nThe frog turned into a prince at dawn."
    ),
}


def sources() -> list[Document]:
    return [
        Document(
            text=text,
            id_=title,
            metadata={"title": title, "genre": "fairy tale"},
            excluded_llm_metadata_keys=["genre"],
        )
        for title, text in STORIES.items()
    ]


def splitter() -> SentenceSplitter:
    # Small nodes with an overlap: every story is cut into several overlapping nodes.
    return SentenceSplitter(chunk_size=40, chunk_overlap=12)


def nodes() -> list[Any]:
    return splitter().get_nodes_from_documents(sources())


def options(**extra: Any) -> dict[str, Any]:
    # GroupClusterer: UMAP's spectral initialisation varies from run to run on the hash
    # embedder's degenerate geometry, so two builds of one text could differ.  The real
    # parts are in tests/integration/test_llamaindex_real.py.
    return {
        "embed_model": FakeEmbedder(DIM),
        "clusterer": GroupClusterer(2),
        "summarizer": EchoSummarizer(),
        "tokenizer": WhitespaceTokenizer(),
        "chunk_max_tokens": 12,
        "random_state": 0,
        **extra,
    }


def layers(index: RaptorIndex) -> list[list[tuple[str, str, Any]]]:
    tree = index.tree
    return [[(n.id, n.text, n.span) for n in tree.layer(i)] for i in range(tree.num_layers)]


# -- rejoin_nodes ----------------------------------------------------------------------------------
def test_a_splitter_s_nodes_become_their_documents_again() -> None:
    given = nodes()
    assert len(given) > 2 * len(STORIES)  # really split, with overlaps
    joined = rejoin_nodes(given)
    assert [type(d) for d in joined] == [Document, Document]
    for doc, source in zip(joined, sources(), strict=True):
        assert doc.id_ == source.id_
        assert doc.text == source.text
        assert doc.metadata == source.metadata
        assert doc.excluded_llm_metadata_keys == ["genre"]


def test_what_cannot_be_joined_is_returned_as_given() -> None:
    given = nodes()
    frog = [n for n in given if n.ref_doc_id == "frog"]
    slipper = [n for n in given if n.ref_doc_id == "slipper"]
    assert len(slipper) >= 3
    no_offset = TextNode(text="A node made by hand.", id_="hand")
    document = Document(text="A whole document.", id_="whole")
    # A hole in the slipper story (its second node left out): none of its nodes is joined.
    holed = [slipper[0], *slipper[2:]]
    assert holed[1].start_char_idx - holed[0].end_char_idx > 16
    out = rejoin_nodes([no_offset, *holed, document, *frog])
    assert out[0] is no_offset
    assert out[1 : 1 + len(holed)] == holed
    assert out[1 + len(holed)] is document
    assert [d.id_ for d in out[2 + len(holed) :]] == ["frog"]
    # Nodes of two sources interleaved: neither source is one run.
    mixed = [slipper[0], frog[0], *slipper[1:], *frog[1:]]
    assert rejoin_nodes(mixed) == mixed


def test_nodes_with_their_own_metadata_stay_nodes() -> None:
    given = nodes()
    given[1].metadata = {**given[1].metadata, "keywords": "ashes, rags"}  # an extractor's
    out = rejoin_nodes(given)
    assert [n.node_id for n in out if n.ref_doc_id == "slipper"] == [
        n.node_id for n in given if n.ref_doc_id == "slipper"
    ]
    assert [d.id_ for d in out if isinstance(d, Document)] == ["frog"]


def test_repeated_text_whose_offsets_are_ambiguous_stays_nodes() -> None:
    # LlamaIndex looks for each node after the previous node's start: in text that repeats
    # one phrase, every node is found a sentence after the one before, and joining them
    # would keep 200 of its 720 characters.
    given = SentenceSplitter(chunk_size=64, chunk_overlap=16).get_nodes_from_documents(
        [Document(text="Bees dance. " * 60, id_="bees")]
    )
    assert rejoin_nodes(given) == given


def test_a_source_s_only_node_becomes_a_document() -> None:
    node = TextNode(text="Owls hunt at night.", id_="n1", start_char_idx=0, end_char_idx=19)
    node.relationships[NodeRelationship.SOURCE] = Document(
        text="x", id_="owls"
    ).as_related_node_info()
    (doc,) = rejoin_nodes([node])
    assert isinstance(doc, Document) and (doc.id_, doc.text) == ("owls", "Owls hunt at night.")


# -- RaptorIndex --------------------------------------------------------------------------------------
def test_nodes_build_the_tree_their_documents_build() -> None:
    whole = RaptorIndex.from_documents(sources(), **options())
    joined = RaptorIndex.from_documents(nodes(), rejoin_nodes=True, **options())
    assert layers(joined) == layers(whole)
    assert sorted(joined.ref_doc_ids) == ["frog", "slipper"]
    # Without the option the nodes are the leaves, as given.
    given = nodes()
    plain = RaptorIndex.from_documents(given, **options())
    assert {leaf.id for leaf in plain.tree.leaves} == {n.node_id for n in given}


def test_transformations_output_is_joined_and_rechunked() -> None:
    index = RaptorIndex.from_documents(
        sources(), transformations=[splitter()], rejoin_nodes=True, **options()
    )
    assert {leaf.doc_id for leaf in index.tree.leaves} == {"frog", "slipper"}
    assert all(leaf.span is not None for leaf in index.tree.leaves)  # RAPTOR's own chunks
    # Updates go through the same transformations and are joined too.
    changed = Document(text=STORIES["frog"] + "\n\nThey lived happily.", id_="frog")
    index.update_ref_doc(changed)
    assert any("happily" in leaf.text for leaf in index.tree.leaves)
    assert all(leaf.span is not None for leaf in index.tree.leaves)
    assert index.refresh_ref_docs([changed]) == [False]


def test_insert_nodes_joins_a_new_document_and_refuses_a_known_one() -> None:
    first, second = sources()
    index = RaptorIndex.from_documents([first], rejoin_nodes=True, **options())
    index.insert_nodes(splitter().get_nodes_from_documents([second]))
    assert sorted(index.ref_doc_ids) == ["frog", "slipper"]
    assert all(leaf.span is not None for leaf in index.tree.leaves)
    with pytest.raises(InvalidInputError, match="frog"):
        index.insert_nodes(splitter().get_nodes_from_documents([second]))


def test_async_build_joins_too() -> None:
    index = asyncio.run(RaptorIndex.afrom_documents(nodes(), rejoin_nodes=True, **options()))
    assert sorted(index.ref_doc_ids) == ["frog", "slipper"]
    assert all(leaf.span is not None for leaf in index.tree.leaves)


def test_the_setting_is_saved_with_the_index(tmp_path: Path) -> None:
    first, second = sources()
    index = RaptorIndex.from_documents([first], rejoin_nodes=True, **options())
    index.storage_context.persist(str(tmp_path / "storage"))
    embed = options()["embed_model"]
    components = {k: v for k, v in options().items() if k != "embed_model"}
    reopened = load_index_from_storage(
        StorageContext.from_defaults(persist_dir=str(tmp_path / "storage")),
        embed_model=embed,
        **components,
    )
    assert isinstance(reopened, RaptorIndex)
    reopened.insert_nodes(splitter().get_nodes_from_documents([second]))
    assert {leaf.doc_id for leaf in reopened.tree.leaves} == {"frog", "slipper"}
    assert all(leaf.span is not None for leaf in reopened.tree.leaves)
    # index.persist / RaptorIndex.load keep it as well; False can be asked for on loading.
    index.persist(tmp_path / "export")
    assert json.loads((tmp_path / "export" / PARAMS_FILE).read_text())["rejoin_nodes"] is True
    loaded = RaptorIndex.load(tmp_path / "export", embed, **components)
    loaded.insert_nodes(splitter().get_nodes_from_documents([second]))
    assert all(leaf.span is not None for leaf in loaded.tree.leaves)
    kept = RaptorIndex.load(tmp_path / "export", embed, rejoin_nodes=False, **components)
    kept.insert_nodes(splitter().get_nodes_from_documents([second]))
    assert any(leaf.span is None for leaf in kept.tree.leaves)


def test_an_index_without_the_setting_writes_no_key(tmp_path: Path) -> None:
    index = RaptorIndex.from_documents(sources(), **options())
    index.persist(tmp_path)
    assert "rejoin_nodes" not in json.loads((tmp_path / PARAMS_FILE).read_text())


def test_a_damaged_setting_is_a_format_error(tmp_path: Path) -> None:
    index = RaptorIndex.from_documents(sources(), rejoin_nodes=True, **options())
    index.persist(tmp_path / "export")
    params = tmp_path / "export" / PARAMS_FILE
    params.write_text(params.read_text().replace('"rejoin_nodes": true', '"rejoin_nodes": "yes"'))
    with pytest.raises(TreeFormatError, match="rejoin_nodes"):
        RaptorIndex.load(tmp_path / "export", options()["embed_model"])
    storage = tmp_path / "storage"
    index.storage_context.persist(str(storage))
    store_file = storage / "index_store.json"
    # The struct is a JSON string inside the index store's JSON.
    damaged = store_file.read_text().replace('\\"rejoin_nodes\\": true', '\\"rejoin_nodes\\": 1')
    assert damaged != store_file.read_text()
    store_file.write_text(damaged)
    with pytest.raises(TreeFormatError, match="rejoin_nodes"):
        load_index_from_storage(
            StorageContext.from_defaults(persist_dir=str(storage)),
            embed_model=options()["embed_model"],
        )


def test_rejoin_nodes_must_be_a_bool() -> None:
    with pytest.raises(InvalidParameterError, match="rejoin_nodes"):
        RaptorIndex.from_documents(nodes(), rejoin_nodes="yes", **options())


def test_from_tree_takes_the_setting_for_later_updates() -> None:
    built = RaptorIndex.from_documents([sources()[0]], **options())
    tree: Tree = built.tree
    index = RaptorIndex.from_tree(tree, rejoin_nodes=True, **options())
    index.insert_nodes(splitter().get_nodes_from_documents([sources()[1]]))
    assert all(leaf.span is not None for leaf in index.tree.leaves)


def test_a_retriever_from_nodes_can_join_them() -> None:
    given = options()
    embed = given.pop("embed_model")
    retriever = RaptorRetriever.from_defaults(
        nodes=nodes(), embed_model=embed, builder_kwargs={**given, "rejoin_nodes": True}
    )
    assert {leaf.doc_id for leaf in retriever.tree.leaves} == {"frog", "slipper"}
    assert all(leaf.span is not None for leaf in retriever.tree.leaves)
