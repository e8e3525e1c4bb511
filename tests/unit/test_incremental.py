"""Incremental trees (issue 13) with fakes: local maintenance, stable nodes, errors, determinism."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from raptor_core import InvalidInputError, InvalidParameterError, Tree, TreeBuilder
from raptor_core.build.incremental import TreeUpdate, UpdateReport
from raptor_core.testing import (
    EchoSummarizer,
    FakeEmbedder,
    GroupClusterer,
    WhitespaceTokenizer,
    check_tree_invariants,
)
from raptor_core.types import Chunk, Document

TOPICS = {
    "cats": "cat kitten purr whisker feline meow paw tail",
    "rockets": "rocket orbit launch fuel thrust booster satellite engine",
    "bread": "bread flour yeast dough oven crust knead loaf",
    "rivers": "river delta stream bank flood current estuary basin",
    "music": "violin cello melody rhythm chord tempo orchestra score",
    "chess": "chess knight bishop rook pawn gambit castle checkmate",
}


def doc(name: str, n: int = 6, marker: str = "", doc_id: str | None = None) -> Document:
    words = TOPICS[name].split()
    sentences = [
        f"The {words[i % 8]} and the {words[(i + 3) % 8]} meet {words[(i + 5) % 8]} {marker} {i}."
        for i in range(n)
    ]
    return Document(text=" ".join(sentences), doc_id=doc_id or name)


def builder(summarizer: EchoSummarizer | None = None, **kw: object) -> TreeBuilder:
    params: dict[str, object] = {
        "tokenizer": WhitespaceTokenizer(),
        "clusterer": GroupClusterer(3),
        "chunk_max_tokens": 12,
        "summary_max_tokens": 12,
        "random_state": 0,
    }
    params.update(kw)
    return TreeBuilder(FakeEmbedder(), summarizer or EchoSummarizer(), **params)  # type: ignore[arg-type]


def base_tree(b: TreeBuilder) -> Tree:
    return b.build([doc(name) for name in ("cats", "rockets", "bread", "rivers", "music")])


def same_node(a: Tree, b: Tree, node_id: str) -> bool:
    return a.node(node_id).text == b.node(node_id).text and np.array_equal(
        a.embeddings[a.row(node_id)], b.embeddings[b.row(node_id)]
    )


def test_insert_is_local_and_keeps_untouched_nodes_bit_for_bit() -> None:
    summarizer = EchoSummarizer()
    b = builder(summarizer)
    tree = base_tree(b)
    build_calls = len(summarizer.calls)
    summarizer.calls.clear()

    result = b.insert(tree, [doc("chess", marker="zugzwang")])

    assert isinstance(result, TreeUpdate) and isinstance(result.report, UpdateReport)
    new, report = result.tree, result.report
    check_tree_invariants(new, extractive=True)
    assert new.doc_ids == (*tree.doc_ids, "chess")
    assert report.docs_added == ("chess",)
    assert report.summary_calls == len(summarizer.calls) < build_calls
    new_leaves = {n.id for n in new.leaves if n.doc_id == "chess"}
    assert report.embedded_chunks == len(new_leaves) > 0
    # Every summary made is an ancestor of a new leaf: nothing else was re-summarised.
    touched = {a.id for leaf in new_leaves for a in new.ancestors(leaf)}
    assert set(report.nodes_added) - new_leaves <= touched
    # What went are the old versions of those summaries: no leaf, no more than were made.
    assert all(tree.node(i).layer > 0 for i in report.nodes_removed)
    assert len(report.nodes_removed) <= len(set(report.nodes_added) - new_leaves)
    # Untouched nodes keep id, text and embedding bit for bit; removed ones are the
    # ancestors of what changed.
    for node in tree.nodes:
        if node.id in new:
            assert same_node(tree, new, node.id)
    kept = [n.id for n in tree.nodes if n.id in new]
    assert len(kept) == len(tree) - len(report.nodes_removed)
    assert set(report.nodes_added) == {n.id for n in new.nodes} - {n.id for n in tree.nodes}


def test_insert_then_delete_gives_back_the_same_nodes() -> None:
    b = builder()
    tree = base_tree(b)
    grown = b.insert(tree, [doc("chess")]).tree
    back = b.delete(grown, ["chess"])
    check_tree_invariants(back.tree, extractive=True)
    assert {n.id for n in back.tree.nodes} == {n.id for n in tree.nodes}
    for node in tree.nodes:
        assert same_node(tree, back.tree, node.id)
    assert back.report.docs_removed == ("chess",)
    assert back.report.embedded_chunks == 0


def test_delete_leaves_no_text_of_the_document() -> None:
    summarizer = EchoSummarizer()
    b = builder(summarizer)
    tree = b.build([doc("cats"), doc("rockets", marker="kerosene"), doc("bread"), doc("rivers")])
    assert any("kerosene" in n.text for n in tree.nodes if n.layer > 0)
    summarizer.calls.clear()

    result = b.delete(tree, ["rockets"])

    new = result.tree
    check_tree_invariants(new, extractive=True)
    assert "rockets" not in new.doc_ids
    assert all("kerosene" not in n.text and "rockets" not in n.doc_ids for n in new.nodes)
    assert all("kerosene" not in t for call in summarizer.calls for t in call)
    assert result.report.summary_calls == len(summarizer.calls)
    # The clusters that held only that document are gone, not re-summarised.
    only_rockets = [n.id for n in tree.nodes if n.doc_ids == ("rockets",)]
    assert only_rockets and all(i in result.report.nodes_removed for i in only_rockets)


def test_update_unchanged_is_free_and_changed_is_replaced() -> None:
    summarizer = EchoSummarizer()
    embedder = FakeEmbedder()
    b = builder(summarizer)
    b.embedder = embedder
    tree = base_tree(b)
    summarizer.calls.clear()
    before = embedder.texts_embedded

    same = b.update(tree, [doc("cats"), doc("bread")])
    assert same.tree is tree and not same.report.changed
    assert same.report.docs_unchanged == ("cats", "bread")
    assert summarizer.calls == [] and embedder.texts_embedded == before

    changed = b.update(tree, [doc("cats"), doc("bread", marker="sourdough"), doc("chess")])
    report = changed.report
    check_tree_invariants(changed.tree, extractive=True)
    assert report.docs_unchanged == ("cats",)
    assert report.docs_replaced == ("bread",) and report.docs_added == ("chess",)
    assert report.docs_changed == ("chess", "bread")
    assert changed.tree.doc_ids.count("bread") == 1
    assert any("sourdough" in n.text for n in changed.tree.leaves)
    assert all(
        "sourdough" in n.text for n in changed.tree.leaves if n.doc_id == "bread"
    )  # no old leaf of bread is left
    assert all(n.id in changed.tree for n in tree.leaves if n.doc_id == "cats")


def test_update_of_metadata_only_keeps_leaf_ids() -> None:
    b = builder()
    tree = base_tree(b)
    bread = doc("bread")
    tagged = Document(text=bread.text, doc_id="bread", metadata={"shelf": "bakery"})
    result = b.update(tree, [tagged])
    old_ids = [n.id for n in tree.leaves if n.doc_id == "bread"]
    assert set(old_ids) <= set(result.report.nodes_changed)
    for node_id in old_ids:
        assert result.tree.node(node_id).metadata == {"shelf": "bakery"}
    check_tree_invariants(result.tree, extractive=True)


def tagged_docs(tags: dict[str, dict[str, object]]) -> list[Document]:
    """The base documents (and a Markdown one, embedded with its heading) with metadata."""
    docs = [doc(name) for name in ("cats", "rockets", "bread", "rivers", "music")]
    docs.append(Document(text="# Openings\n\n" + doc("chess", n=4).text, doc_id="chess"))
    return [Document(text=d.text, doc_id=d.doc_id, metadata=tags.get(d.doc_id, {})) for d in docs]


def same_tree(a: Tree, b: Tree) -> bool:
    """Same nodes (ids, texts, children, parents, metadata ...) in the same order, same vectors."""
    return list(a.nodes) == list(b.nodes) and np.array_equal(a.embeddings, b.embeddings)


@pytest.mark.parametrize(
    "changed",
    [
        {"bread": {"lang": "fr", "shelf": "bakery"}},  # one document
        {name: {"lang": "de"} for name in TOPICS},  # every document
        {"chess": {}, "cats": {"lang": "en", "new": 1}},  # metadata removed, a key added
    ],
)
def test_metadata_only_update_gives_the_tree_a_rebuild_gives(
    changed: dict[str, dict[str, object]],
) -> None:
    before = {name: {"lang": "en", "topic": name} for name in TOPICS}
    after = {**before, **changed}
    summarizer = EchoSummarizer()
    b = builder(summarizer)
    tree = b.build(tagged_docs(before))
    summarizer.calls.clear()
    embedder = b.embedder
    assert isinstance(embedder, FakeEmbedder)
    embedded = embedder.texts_embedded

    result = b.update(tree, tagged_docs(after))

    fresh = builder().build(tagged_docs(after))
    assert same_tree(result.tree, fresh)
    report = result.report
    assert summarizer.calls == [] and embedder.texts_embedded == embedded
    assert report.summary_calls == report.embedded_chunks == report.embedded_summaries == 0
    assert report.docs_replaced == tuple(d for d in after if after[d] != before[d])
    assert set(report.docs_unchanged) == {d for d in after if after[d] == before[d]}
    assert report.nodes_added == report.nodes_removed == report.nodes_relinked == ()
    # Every node whose metadata changed is reported changed (stores rewrite those), no other.
    assert set(report.nodes_changed) == {
        n.id for n in fresh.nodes if n.metadata != tree.node(n.id).metadata
    }
    assert report.nodes_changed
    assert [(n.id, n.text, n.children, n.parents) for n in result.tree.nodes] == [
        (n.id, n.text, n.children, n.parents) for n in tree.nodes
    ]
    assert np.array_equal(result.tree.embeddings, tree.embeddings)
    check_tree_invariants(result.tree, extractive=True)


def test_metadata_only_update_recomputes_shared_metadata_of_ancestors() -> None:
    b = builder()
    tree = b.build(tagged_docs({name: {"lang": "en"} for name in TOPICS}))
    root = tree.layer(tree.num_layers - 1)
    assert all(n.metadata.get("lang") == "en" for n in root)
    result = b.update(tree, tagged_docs({name: {"lang": "fr"} for name in TOPICS}))
    new = result.tree
    assert all(n.metadata.get("lang") == "fr" for n in new.nodes)
    # Only some documents relabelled: a summary over both kinds shares no "lang" any more.
    english: dict[str, dict[str, object]] = {name: {"lang": "en"} for name in TOPICS}
    mixed = b.update(tree, tagged_docs({**english, "cats": {"lang": "fr"}}))
    assert mixed.report.docs_replaced == ("cats",)
    for node in mixed.tree.nodes:
        if node.layer:
            docs = set(node.doc_ids)
            expected = "fr" if docs == {"cats"} else ("en" if "cats" not in docs else None)
            assert node.metadata.get("lang") == expected, node.id


def test_mixed_update_relabels_one_document_and_replaces_another() -> None:
    from raptor_core.build.builder import summary_metadata

    before: dict[str, dict[str, object]] = {name: {"lang": "en"} for name in TOPICS}
    b = builder()
    tree = b.build(tagged_docs(before))
    new_text = doc("bread", marker="sourdough").text
    bread = Document(text=new_text, doc_id="bread", metadata={"lang": "en"})
    rockets = next(d for d in tagged_docs({"rockets": {"lang": "fr"}}) if d.doc_id == "rockets")

    text_only = b.update(tree, [bread])
    both = b.update(tree, [rockets, bread])

    # The metadata change costs nothing more and changes no id, text or vector.
    assert both.report.summary_calls == text_only.report.summary_calls > 0
    assert both.report.embedded_chunks == text_only.report.embedded_chunks
    assert both.report.docs_replaced == ("rockets", "bread")
    assert [(n.id, n.text, n.children) for n in both.tree.nodes] == [
        (n.id, n.text, n.children) for n in text_only.tree.nodes
    ]
    assert np.array_equal(both.tree.embeddings, text_only.tree.embeddings)
    for leaf in both.tree.leaves:
        assert leaf.metadata == {"lang": "fr" if leaf.doc_id == "rockets" else "en"}
    # A cluster over both documents was re-summarised (bread changed it): its metadata is
    # that of its members now, rockets' new "lang" included (so no "lang" is shared).
    remade = [n for n in both.tree.nodes if {"rockets", "bread"} <= set(n.doc_ids)]
    assert remade and all(n.id not in tree for n in remade)
    assert all("lang" not in n.metadata for n in remade)
    # Every summary, re-made or kept, derives its metadata from its members' current ones.
    for node in both.tree.nodes:
        if node.layer:
            members = [both.tree.node(c) for c in node.children]
            assert node.metadata == summary_metadata(members), node.id
    assert any(
        n.metadata.get("lang") == "fr" for n in both.tree.nodes if n.layer and n.id in tree
    )  # kept summaries of rockets alone are relabelled in place
    rocket_leaves = [n.id for n in tree.leaves if n.doc_id == "rockets"]
    assert set(rocket_leaves) <= set(both.report.nodes_changed)
    check_tree_invariants(both.tree, extractive=True)


def test_metadata_only_update_of_pre_split_chunks_is_in_place() -> None:
    b = builder()
    chunks = [
        Document(text=doc(name, n=2).text, doc_id=f"{name}-0", chunk_of=name, metadata={"v": 1})
        for name in TOPICS
    ]
    tree = b.build(chunks)
    relabelled = [
        Document(text=c.text, doc_id=c.doc_id, chunk_of=c.chunk_of, metadata={"v": 2})
        for c in chunks
    ]
    result = b.update(tree, relabelled)
    assert same_tree(result.tree, b.build(relabelled))
    assert result.report.summary_calls == result.report.embedded_chunks == 0
    assert set(result.report.docs_replaced) == set(TOPICS)


class HeadingDroppingChunker:
    """One chunk per paragraph, leaving Markdown heading lines out of every chunk."""

    def split(self, text: str) -> list[Chunk]:
        chunks: list[Chunk] = []
        start = 0
        for part in text.split("\n\n"):
            if part and not part.startswith("#"):
                chunks.append(
                    Chunk(
                        text=part, start=start, end=start + len(part), token_count=len(part.split())
                    )
                )
            start += len(part) + 2
        return chunks


def test_a_leaf_whose_heading_is_outside_every_chunk_is_embedded_again() -> None:
    # The heading changed (same length, so the same spans and leaf ids) with the metadata; a
    # leaf's vector mixes in its heading, so relabelling in place would keep a stale vector.
    def docs(heading: str, lang: str) -> list[Document]:
        body = "\n\n".join(f"{heading}\n\n" + doc(n, n=2).text for n in ("cats", "rivers"))
        return [
            Document(text=body, doc_id="pets", metadata={"lang": lang}),
            *(doc(n) for n in ("rockets", "bread", "music")),
        ]

    b = builder(chunker=HeadingDroppingChunker())
    tree = b.build(docs("# Cats", "en"))
    result = b.update(tree, docs("# Dogs", "fr"))
    fresh = b.build(docs("# Dogs", "fr"))
    pets = [n.id for n in fresh.leaves if n.doc_id == "pets"]
    assert pets and all(n in tree for n in pets)  # same leaf ids as before
    assert result.report.embedded_chunks == len(pets)
    assert np.array_equal(
        result.tree.embeddings[result.tree.rows(pets)], fresh.embeddings[fresh.rows(pets)]
    )
    assert not np.array_equal(tree.embeddings[tree.rows(pets)], fresh.embeddings[fresh.rows(pets)])


def test_async_metadata_only_update_matches_sync() -> None:
    b = builder()
    tree = b.build(tagged_docs({}))
    relabelled = tagged_docs({"rivers": {"lang": "nl"}})
    sync = b.update(tree, relabelled)
    asynced = asyncio.run(b.aupdate(tree, relabelled))
    assert same_tree(sync.tree, asynced.tree)
    assert asynced.report.nodes_changed == sync.report.nodes_changed
    assert asynced.report.summary_calls == 0


def test_same_operations_give_the_same_tree() -> None:
    def run() -> Tree:
        b = builder()
        tree = base_tree(b)
        tree = b.insert(tree, [doc("chess")]).tree
        tree = b.delete(tree, ["bread"]).tree
        return b.update(tree, [doc("cats", marker="tabby")]).tree

    one, two = run(), run()
    assert [n.id for n in one.nodes] == [n.id for n in two.nodes]
    assert [n.text for n in one.nodes] == [n.text for n in two.nodes]
    assert np.array_equal(one.embeddings, two.embeddings)


def test_async_twins_match_sync() -> None:
    b = builder()
    tree = base_tree(b)
    sync = b.insert(tree, [doc("chess")]).tree
    asynced = asyncio.run(b.ainsert(tree, [doc("chess")])).tree
    assert [n.id for n in sync.nodes] == [n.id for n in asynced.nodes]
    assert np.array_equal(sync.embeddings, asynced.embeddings)
    deleted = asyncio.run(b.adelete(sync, ["chess"])).tree
    assert {n.id for n in deleted.nodes} == {n.id for n in tree.nodes}
    updated = asyncio.run(b.aupdate(tree, [doc("cats", marker="tabby")]))
    assert updated.report.docs_replaced == ("cats",)


def test_plain_strings_get_free_ids() -> None:
    b = builder()
    tree = b.build(["cat kitten purr. whisker feline meow.", "rocket orbit launch. fuel thrust."])
    result = b.insert(tree, ["bread flour yeast. dough oven crust."])
    assert result.tree.doc_ids == ("doc-0", "doc-1", "doc-2")


def test_split_when_a_cluster_outgrows_the_limit() -> None:
    b = builder(cluster_max_tokens=40)
    tree = base_tree(b)
    result = b.insert(tree, [doc("cats", doc_id="cats2")])
    check_tree_invariants(result.tree, extractive=True)
    assert result.report.clusters_split >= 1
    for node in result.tree.nodes:
        if len(node.children) > 1:
            assert sum(c.token_count for c in result.tree.children(node.id)) <= 40


def test_drift_reclusters_the_drifting_cluster_only() -> None:
    b = builder()
    tree = base_tree(b)
    floors = [2.0] * (tree.num_layers - 1)  # above any cohesion: every changed cluster drifts
    drifting = Tree(
        nodes=tree.nodes,
        embeddings=tree.embeddings,
        params=tree.params,
        build_info={**tree.build_info, "incremental": {"cohesion_floor": floors}},
    )
    calm = b.insert(tree, [doc("cats", n=12, doc_id="cats2")])
    result = b.insert(drifting, [doc("cats", n=12, doc_id="cats2")])
    check_tree_invariants(result.tree, extractive=True)
    assert calm.report.reclustered_subtrees == 0
    assert result.report.reclustered_subtrees >= 1
    # Still local: only clusters that changed anyway are re-clustered (a part of one may be
    # its old member list again, which keeps its old id).
    assert set(result.report.nodes_removed) <= set(calm.report.nodes_removed)
    assert result.tree.build_info["incremental"]["cohesion_floor"] == floors


def test_report_and_tree_survive_save_and_load(tmp_path) -> None:
    b = builder()
    result = b.insert(base_tree(b), [doc("chess")])
    info = result.tree.build_info
    assert info["documents"] == 6 and info["incremental"]["updates"] == 1
    assert info["incremental"]["last"]["op"] == "insert"
    loaded = Tree.load(result.tree.save(tmp_path / "t"))
    assert [n.id for n in loaded.nodes] == [n.id for n in result.tree.nodes]
    assert result.report.to_dict()["nodes_added"] == len(result.report.nodes_added)
    assert result.report.to_dict(ids=True)["nodes_added"] == list(result.report.nodes_added)


@pytest.mark.parametrize(
    ("documents", "error", "match"),
    [
        ([Document(text="cat purr", doc_id="cats")], InvalidParameterError, "update()"),
        ([Document(text="   ", doc_id="x")], InvalidInputError, "empty"),
        ([Document(text="abc\x00\x01\x02def", doc_id="x")], InvalidInputError, "binary"),
        ([], InvalidInputError, "no documents"),
        ("a single string", InvalidParameterError, "list"),
    ],
)
def test_bad_inserts_are_refused_before_anything_is_paid(
    documents: object, error: type[Exception], match: str
) -> None:
    summarizer = EchoSummarizer()
    embedder = FakeEmbedder()
    b = builder(summarizer)
    b.embedder = embedder
    tree = base_tree(b)
    summarizer.calls.clear()
    embedded = embedder.texts_embedded
    with pytest.raises(error, match=match):
        b.insert(tree, documents)  # type: ignore[arg-type]
    assert summarizer.calls == [] and embedder.texts_embedded == embedded


def test_bad_deletes_are_refused() -> None:
    b = builder()
    tree = b.build([doc("cats"), doc("bread")])
    with pytest.raises(InvalidParameterError, match=r"unknown document id.*'nope'"):
        b.delete(tree, ["nope"])
    with pytest.raises(InvalidParameterError, match="wrap it in a list"):
        b.delete(tree, "cats")
    with pytest.raises(InvalidInputError, match="empty tree"):
        b.delete(tree, ["cats", "bread"])


def test_another_embedder_is_refused() -> None:
    b = builder()
    tree = base_tree(b)
    other = TreeBuilder(FakeEmbedder(dim=32), EchoSummarizer(), tokenizer=WhitespaceTokenizer())
    with pytest.raises(InvalidParameterError, match="same embedder"):
        other.insert(tree, [doc("chess")])


def test_a_tree_of_leaves_only_grows_at_layer_zero() -> None:
    b = builder()
    tree = b.build([doc("cats", n=1)])
    assert tree.num_layers == 1
    result = b.insert(tree, [doc("bread", n=1)])
    assert result.tree.num_layers == 1 and len(result.tree) == 2
    assert result.report.summary_calls == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_operation_sequences_keep_every_invariant(seed: int) -> None:
    rng = np.random.default_rng(seed)
    b = builder(
        clusterer=GroupClusterer(int(rng.integers(2, 5))),
        cluster_max_tokens=int(rng.choice([40, 80, 3500])),
    )
    names = list(TOPICS)
    present = {name: doc(name, n=int(rng.integers(1, 8))) for name in names[:3]}
    tree = b.build(list(present.values()))
    for step in range(8):
        op = rng.choice(["insert", "delete", "update"])
        absent = [n for n in names if n not in present]
        if op == "insert" and absent:
            name = str(rng.choice(absent))
            present[name] = doc(name, n=int(rng.integers(1, 8)), marker=f"m{step}")
            result = b.insert(tree, [present[name]])
        elif op == "delete" and len(present) > 1:
            name = str(rng.choice(sorted(present)))
            del present[name]
            result = b.delete(tree, [name])
        else:
            name = str(rng.choice(sorted(present)))
            present[name] = doc(name, n=int(rng.integers(1, 8)), marker=f"u{step}")
            result = b.update(tree, [present[name]])
        tree = result.tree
        check_tree_invariants(tree, extractive=True)
        assert set(tree.doc_ids) == set(present)
        for leaf in tree.leaves:
            assert leaf.text in present[str(leaf.doc_id)].text
        for node in tree.nodes:
            if len(node.children) > 1:
                assert sum(c.token_count for c in tree.children(node.id)) <= b.cluster_max_tokens


# -- pre-split chunks (chunk_of): leaves of their source document, as LlamaIndex nodes are --------
def chunks(name: str, source: str, n: int = 3, marker: str = "") -> list[Document]:
    words = TOPICS[name].split()
    return [
        Document(
            text=f"The {words[i]} and the {words[i + 3]} {marker} {i}.",
            doc_id=f"{source}-chunk-{i}",
            chunk_of=source,
        )
        for i in range(n)
    ]


def chunked_tree(b: TreeBuilder) -> Tree:
    names = ("cats", "rockets", "bread", "rivers", "music")
    return b.build([c for i, name in enumerate(names) for c in chunks(name, f"src-{i}")])


def test_pre_split_chunks_are_inserted_under_their_source() -> None:
    summarizer = EchoSummarizer()
    b = builder(summarizer)
    tree = chunked_tree(b)
    summarizer.calls.clear()
    result = b.insert(tree, chunks("chess", "src-chess"))
    new, report = result.tree, result.report
    check_tree_invariants(new, built=False, extractive=True)  # chunk ids are given
    assert report.docs_added == ("src-chess",)
    assert {n.id for n in new.leaves if n.doc_id == "src-chess"} == {
        f"src-chess-chunk-{i}" for i in range(3)
    }
    assert report.embedded_chunks == 3
    assert report.summary_calls == len(summarizer.calls) > 0
    assert all(same_node(tree, new, leaf.id) for leaf in tree.leaves)
    # The source id is what must be new: more chunks of a known source go through update.
    with pytest.raises(InvalidParameterError, match="update"):
        b.insert(new, chunks("chess", "src-0", marker="more"))


def test_pre_split_update_compares_whole_sources_including_text() -> None:
    b = builder()
    tree = chunked_tree(b)
    same = b.update(tree, chunks("bread", "src-2"))
    assert same.tree is tree and same.report.docs_unchanged == ("src-2",)
    # Same chunk ids, new text: a pre-split chunk's id does not follow its text.
    edited = b.update(tree, chunks("bread", "src-2", n=2, marker="sourdough"))
    new, report = edited.tree, edited.report
    check_tree_invariants(new, built=False, extractive=True)  # chunk ids are given
    assert report.docs_replaced == ("src-2",)
    assert sorted(n.id for n in new.leaves if n.doc_id == "src-2") == [
        "src-2-chunk-0",
        "src-2-chunk-1",
    ]
    assert "src-2-chunk-0" in report.nodes_changed and "src-2-chunk-2" in report.nodes_removed
    assert all("sourdough" in n.text for n in new.leaves if n.doc_id == "src-2")
    deleted = b.delete(new, ["src-2"]).tree
    assert "src-2" not in deleted.doc_ids
    assert not any("sourdough" in n.text for n in deleted.nodes)


def test_a_pre_split_chunk_may_not_take_another_documents_node_id() -> None:
    b = builder()
    tree = chunked_tree(b)
    stolen = Document(text="chess knight bishop", doc_id="src-0-chunk-0", chunk_of="src-chess")
    with pytest.raises(InvalidInputError, match="another id"):
        b.update(tree, [stolen])
