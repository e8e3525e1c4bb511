"""RaptorRetriever over a text splitter's splits: they are joined back into their sources."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_text_splitters")

from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_text_splitters import RecursiveCharacterTextSplitter

from raptor_core.exceptions import InvalidParameterError
from raptor_core.testing import EchoSummarizer, FakeEmbedder, GroupClusterer, WhitespaceTokenizer
from raptor_core.tree import Tree
from raptor_core.types import Document as CoreDocument
from raptor_langchain import RaptorEmbeddings, RaptorRetriever
from raptor_langchain.retriever import rejoin_documents

DIM = 32
STORIES = {
    "slipper": (
        "Cinderella swept the ashes every morning. Her stepsisters laughed at her rags.\n\n"
        "A fairy gave her a gown and glass slippers. She danced with the prince until midnight.\n\n"
        "She ran away and lost a slipper on the stairs. The prince searched the whole kingdom.\n\n"
        "At last the slipper fitted her foot. They married and lived in the palace."
    ),
    "frog": (
        "A princess dropped her golden ball into a well. A frog brought it back to her.\n\n"
        "The frog asked to eat from her plate and sleep on her pillow. She refused at first.\n\n"
        "Her father made her keep her promise. The frog turned into a prince at dawn."
    ),
}


def sources() -> list[Document]:
    return [
        Document(page_content=text, metadata={"title": title, "genre": "fairy tale"})
        for title, text in STORIES.items()
    ]


def splits(**kwargs: Any) -> list[Document]:
    options = {"chunk_size": 120, "chunk_overlap": 40, "add_start_index": True} | kwargs
    splitter = RecursiveCharacterTextSplitter(**options)
    return splitter.split_documents(sources())


def options() -> dict[str, Any]:
    # GroupClusterer: UMAP's spectral initialisation varies from run to run on the hash
    # embedder's degenerate geometry (repeated eigenvalues), so two builds of one text
    # could get different summaries.  The real-model test is in test_langchain_chroma.py.
    return {
        "clusterer": GroupClusterer(2),
        "summarizer": EchoSummarizer(),
        "tokenizer": WhitespaceTokenizer(),
        "chunk_max_tokens": 12,
        "random_state": 0,
    }


def leaves(tree: Tree | None) -> list[tuple[str, str, tuple[int, int] | None, dict[str, Any]]]:
    assert tree is not None
    return [(n.doc_id or "", n.text, n.span, n.metadata) for n in tree.leaves]


def test_splits_build_the_tree_their_sources_build() -> None:
    given = splits()
    assert len(given) > 2 * len(STORIES)  # the splitter really split, with overlaps
    from_splits = RaptorRetriever.from_documents(given, FakeEmbedder(DIM), **options())
    # Ids as a whole-document build would give: the joined source takes its first split's.
    first = [0, next(i for i, d in enumerate(given) if d.metadata["title"] == "frog")]
    whole = [
        Document(page_content=d.page_content, metadata=d.metadata, id=f"doc-{i}")
        for d, i in zip(sources(), first, strict=True)
    ]
    from_sources = RaptorRetriever.from_documents(whole, FakeEmbedder(DIM), **options())
    assert leaves(from_splits.tree) == leaves(from_sources.tree)
    assert from_splits.tree is not None and from_sources.tree is not None
    assert [n.id for n in from_splits.tree.nodes] == [n.id for n in from_sources.tree.nodes]
    # The offset key is gone (it named where a split started, not a source) and the
    # spans are offsets in the source documents.
    for node in from_splits.tree.leaves:
        assert "start_index" not in node.metadata
        assert node.span is not None
        source = STORIES[node.metadata["title"]]
        assert source[node.span[0] : node.span[1]] == node.text


def test_the_async_build_joins_splits_too() -> None:
    sync = RaptorRetriever.from_documents(splits(), FakeEmbedder(DIM), **options())
    built = asyncio.run(RaptorRetriever.afrom_documents(splits(), FakeEmbedder(DIM), **options()))
    assert leaves(built.tree) == leaves(sync.tree)
    assert built.tree is not None and built.tree.doc_ids == ("doc-0", "doc-4")


def test_a_passage_crosses_split_boundaries_and_holds_each_overlap_once() -> None:
    retriever = RaptorRetriever.from_documents(
        splits(), FakeEmbedder(DIM), k=10, max_tokens=400, **options()
    )
    hits = retriever.invoke("slipper prince kingdom")
    slipper = [d for d in hits if d.metadata["title"] == "slipper"]
    # A 400-token budget holds the whole story: one passage, its text once, in order.
    assert len(slipper) == 1
    assert slipper[0].page_content.split() == STORIES["slipper"].split()


def test_rejoin_splits_false_indexes_every_split_as_a_document() -> None:
    given = splits()
    retriever = RaptorRetriever.from_documents(
        given, FakeEmbedder(DIM), rejoin_splits=False, **options()
    )
    assert retriever.tree is not None
    assert len(retriever.tree.doc_ids) == len(given)
    assert any("start_index" in n.metadata for n in retriever.tree.leaves)
    with pytest.raises(InvalidParameterError, match="rejoin_splits must be True or False"):
        RaptorRetriever.from_documents(given, FakeEmbedder(DIM), rejoin_splits="no", **options())


def test_splits_without_offsets_stay_documents() -> None:
    given = RecursiveCharacterTextSplitter(chunk_size=120, chunk_overlap=40).split_documents(
        sources()
    )
    retriever = RaptorRetriever.from_documents(given, FakeEmbedder(DIM), **options())
    assert retriever.tree is not None
    assert len(retriever.tree.doc_ids) == len(given)


@pytest.mark.parametrize("in_store", [False, True])
def test_add_documents_joins_splits_and_returns_one_id_per_source(in_store: bool) -> None:
    vectorstore = InMemoryVectorStore(RaptorEmbeddings(FakeEmbedder(DIM))) if in_store else None
    base = [Document(page_content="Bread needs flour. Yeast makes dough rise.", id="bread")]
    retriever = RaptorRetriever.from_documents(
        base, FakeEmbedder(DIM), vectorstore=vectorstore, **options()
    )
    given = splits()
    ids = retriever.add_documents(given)
    assert ids == ["doc-0", "doc-1"]
    tree = retriever._current_tree()
    assert set(tree.doc_ids) == {"bread", "doc-0", "doc-1"}
    assert {n.metadata.get("title") for n in tree.leaves if n.doc_id == "doc-1"} == {"frog"}
    # ids= given per split: a source takes its first split's.
    retriever.delete(ids)
    named = retriever.add_documents(given, ids=[f"split-{i}" for i in range(len(given))])
    frog = next(i for i, d in enumerate(given) if d.metadata["title"] == "frog")
    assert named == ["split-0", f"split-{frog}"]
    retriever.delete(named)
    assert len(retriever.add_documents(given, rejoin_splits=False)) == len(given)
    with pytest.raises(InvalidParameterError, match="accepts ids= and rejoin_splits="):
        retriever.add_documents(given, rejoin=False)


def test_only_runs_of_agreeing_splits_are_joined() -> None:
    def doc(text: str, start: object, **metadata: Any) -> CoreDocument:
        return CoreDocument(text=text, doc_id=text, metadata={"start_index": start, **metadata})

    docs = [
        doc("One two three.", 0),
        doc("three. Four.", 8),
        doc("Five.", 0),  # offsets restart: another source
        doc("Six.", -1),  # not an offset (str.find's "not found"): left as it is
        doc("Seven.", 0, page=1),
        doc("Eight.", 7, page=2),  # other metadata: another source
    ]
    out = rejoin_documents(docs)
    assert [(d.text, parts) for d, parts in out] == [
        ("One two three. Four.", [0, 1]),
        ("Five.", [2]),
        ("Six.", [3]),
        ("Seven.", [4]),
        ("Eight.", [5]),
    ]
    assert out[0][0].metadata == {}
    # Joined with nothing: returned as given, offset key and all.
    assert [d for d, _ in out[1:]] == docs[2:]


def test_the_baseline_s_own_splitter_splits_as_langchain_s_does(multi_topic_text: str) -> None:
    # raptor_langchain.baselines re-implements RecursiveCharacterTextSplitter for installs
    # without langchain-text-splitters: the default-chunking baseline must not change with
    # what is installed.
    from raptor_langchain.baselines import recursive_character_split

    texts = [multi_topic_text, *STORIES.values(), "word " * 3000, "x" * 9000, "a\n\nb\nc d"]
    for text in texts:
        real = RecursiveCharacterTextSplitter()
        assert recursive_character_split(text) == real.split_text(text)
        for size, overlap in ((120, 40), (1000, 200), (50, 0)):
            real = RecursiveCharacterTextSplitter(chunk_size=size, chunk_overlap=overlap)
            assert recursive_character_split(
                text, chunk_size=size, chunk_overlap=overlap
            ) == real.split_text(text), (size, overlap, text[:40])
