"""Section headings and the leaves embedded in their context (TreeBuilder(section_context=...))."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from raptor_core import InvalidParameterError, Tree, TreeBuilder
from raptor_core.build.sections import (
    leaf_context,
    leaf_headings,
    leaf_table_headers,
    section_headings,
    table_headers,
)
from raptor_core.testing import EchoSummarizer, FakeEmbedder, GroupClusterer, WhitespaceTokenizer
from raptor_core.tree import Node
from raptor_core.types import Document

BODY = (
    "We compare our model with three strong systems trained on the same data and report "
    "their scores on the test split."
)
PAPER = (
    f"Introduction\n{BODY} It is a start.\n"
    f"Baselines\n{BODY} The first one is a bag of words.\n"
    f"Results\n{BODY} Ours wins by two points."
)


def headings(text: str) -> list[str]:
    return [heading for _, heading in section_headings(text)]


def test_plain_heading_lines_and_their_offsets() -> None:
    found = section_headings(PAPER)
    assert [h for _, h in found] == ["Introduction", "Baselines", "Results"]
    for offset, heading in found:
        assert PAPER[offset : offset + len(heading)] == heading


def test_markdown_and_html_headings() -> None:
    text = f"# Title\n\n{BODY}\n\n## Related work ##\n{BODY} <H2 class='x'>Career <i>records</i></h2> {BODY}"
    assert headings(text) == ["Title", "Related work", "Career records"]


@pytest.mark.parametrize(
    "text",
    [
        f"This line ends a sentence.\n{BODY}",  # prose, not a heading
        f"Grad A: I think\n{BODY}",  # a meeting turn
        f"Note the following;\n{BODY}",  # a clause
        f"As modern\ndarwinism gets popularized and {BODY}",  # hard-wrapped prose
        "Results\nToo short to be a section body.",  # no body line after it
        f"results\n{BODY}",  # lower case
        f"{'Word ' * 11}\n{BODY}",  # too many words for a heading
        f"'Quoted speech'\n{BODY}",
        "Last line without anything after it",
    ],
)
def test_lines_that_are_not_headings(text: str) -> None:
    assert headings(text) == []


def test_leaf_headings_follow_the_section_a_leaf_starts_in() -> None:
    spans = []
    for needle in ("We compare", "Baselines", "The first one", "Ours wins"):
        start = PAPER.index(needle)
        spans.append((start, start + 20))
    assert leaf_headings(PAPER, spans) == [
        "Introduction",
        None,  # the leaf starts with its heading: the context is in its text already
        "Baselines",
        "Results",
    ]
    assert leaf_headings(BODY, [(0, 10)]) == [None]


ROWS = "\n".join(
    f"| {item} | {n},000 | {n + 1},000 |"
    for n, item in enumerate(["Revenue", "Net income", "Diluted EPS"])
)
FILING = (
    f"# Results of operations\n{BODY}\n\n| Item | 2023 | 2022 |\n|:---|---:|---:|\n{ROWS}\n\n{BODY}"
)
PAGE = (
    '<H1> Super Bowl </H1> <Table> <Tr> <Th> Game </Th> <Th> Date </Th> <Th_colspan="2"> Winner </Th> </Tr>'
    " <Tr> <Td> I </Td> <Td> 1967 </Td> <Td> Green Bay </Td> </Tr> </Table> After the table."
)


def test_table_headers_of_markdown_and_html_tables() -> None:
    ((start, end, header),) = table_headers(FILING)
    assert header == "Item | 2023 | 2022"
    assert FILING[start:end].strip() == ROWS  # the body: every row after the delimiter line
    ((start, end, header),) = table_headers(PAGE)
    assert header == "Game Date Winner"
    assert PAGE[start:end].strip().startswith("<Tr> <Td> I </Td>")
    assert PAGE[end:] == " After the table."
    # Rows without a delimiter line, a delimiter without rows, a table without a header row.
    assert table_headers("| a | b |\n| 1 | 2 |") == []
    assert table_headers("| a | b |\n|---|---|\nprose") == []
    assert table_headers("<table><tr><td>1</td></tr></table>") == []
    # A blank line ends a Markdown table; a header line must sit on top of its delimiter.
    text = "| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |"
    ((start, end, header),) = table_headers(text)
    assert (header, text[start:end].strip()) == ("a | b", "| 1 | 2 |")
    assert table_headers("| a | b |\n\n|---|---|\n| 1 | 2 |") == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "text",
    [
        "<h2> word " * 20_000,  # headings never closed
        "<h2 " * 50_000,  # a tag never ended
        "<table> cell " * 20_000,  # tables never closed
        "<table><tr>" + "<tr> cell " * 20_000 + "</table>",  # rows never closed
        "<h2>" + "< x " * 50_000 + "</h2>",  # a heading full of "<"
        "# a" + " " * 50_000 + "b #",  # a long Markdown heading line
    ],
)
def test_hostile_markup_is_read_in_one_pass(text: str) -> None:
    # Lazy "<h2>(.*?)</h2>" patterns rescanned the rest of the text from every unclosed
    # tag: the first of these took a minute.  A document is data; it must not hang a build.
    section_headings(text)
    table_headers(text)


def test_closing_hashes_are_not_part_of_a_markdown_heading() -> None:
    text = f"## Results ##\r\n{BODY}\n# C#\n{BODY}\n### ###\n{BODY}"
    assert headings(text) == ["Results", "C#", "###"]


def test_leaves_in_a_table_body_take_its_header_row() -> None:
    def span(needle: str) -> tuple[int, int]:
        start = FILING.index(needle)
        return (start, start + len(needle))

    spans = [span("We compare"), span("| Item |"), span("| Net income"), span(BODY[:20])]
    spans[-1] = (FILING.rindex(BODY), len(FILING))
    assert leaf_table_headers(FILING, spans) == [None, None, "Item | 2023 | 2022", None]
    leaves = [
        Node(id=f"L{i}", text=FILING[a:b], layer=0, token_count=b - a, doc_id="f", span=(a, b))
        for i, (a, b) in enumerate(spans)
    ]
    context = leaf_context([Document(text=FILING, doc_id="f")], leaves)
    # The section heading, then the table's header row, then the leaf's own text.
    assert context["L2"] == f"Results of operations\nItem | 2023 | 2022\n{leaves[2].text}"
    assert context["L1"] == f"Results of operations\n{leaves[1].text}"
    assert set(context) == {"L0", "L1", "L2", "L3"}


def builder(**kw: object) -> TreeBuilder:
    params: dict[str, object] = {
        "tokenizer": WhitespaceTokenizer(),
        "clusterer": GroupClusterer(2),
        "chunk_max_tokens": 24,
        "summary_max_tokens": 12,
        "random_state": 0,
    }
    params.update(kw)
    return TreeBuilder(FakeEmbedder(), EchoSummarizer(), **params)  # type: ignore[arg-type]


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def expected_leaf_vectors(tree: Tree, texts: dict[str, str]) -> np.ndarray:
    embedder = FakeEmbedder()
    out = []
    for leaf in tree.leaves:
        assert leaf.span is not None and leaf.doc_id is not None
        plain = unit(embedder.embed_documents([leaf.text])[0])
        text = texts[leaf.doc_id]
        parts = [
            leaf_headings(text, [leaf.span])[0],
            leaf_table_headers(text, [leaf.span])[0],
        ]
        context = [part for part in parts if part is not None]
        if not context:
            out.append(plain)
        else:
            in_context = "\n".join([*context, leaf.text])
            in_context = unit(embedder.embed_documents([in_context])[0])
            out.append(unit(plain.astype(np.float64) + in_context))
    return np.array(out)


def test_leaves_under_a_heading_mix_their_two_vectors() -> None:
    docs = [Document(text=PAPER, doc_id="paper"), Document(text=BODY * 3, doc_id="story")]
    tree = builder().build(docs)
    assert tree.params["section_context"] is True
    rows = tree.layer_rows(0)
    np.testing.assert_allclose(
        tree.embeddings[rows],
        expected_leaf_vectors(tree, {"paper": PAPER, "story": BODY * 3}),
        atol=1e-6,
    )
    # Some paper leaves did change, and the story (no headings) did not.
    plain = builder(section_context=False).build(docs)
    assert plain.params["section_context"] is False
    assert [n.id for n in plain.nodes[: len(rows)]] == [n.id for n in tree.leaves]
    changed = {
        leaf.doc_id
        for leaf, a, b in zip(
            tree.leaves, tree.embeddings[rows], plain.embeddings[rows], strict=True
        )
        if not np.allclose(a, b)
    }
    assert changed == {"paper"}


def test_leaves_in_a_table_mix_in_its_header_row() -> None:
    table = f"{BODY}\n| Item | 2023 | 2022 |\n|---|---|---|\n{ROWS}\n{ROWS}\n{ROWS}"
    docs = [Document(text=table, doc_id="filing")]
    tree = builder(chunk_max_tokens=16).build(docs)
    rows = tree.layer_rows(0)
    assert any(leaf_table_headers(table, [leaf.span])[0] for leaf in tree.leaves if leaf.span)
    np.testing.assert_allclose(
        tree.embeddings[rows], expected_leaf_vectors(tree, {"filing": table}), atol=1e-6
    )
    plain = builder(chunk_max_tokens=16, section_context=False).build(docs)
    assert not np.allclose(tree.embeddings[rows], plain.embeddings[rows])


def test_async_build_gives_the_same_tree() -> None:
    docs = [Document(text=PAPER, doc_id="paper")]
    sync = builder().build(docs)
    async_ = asyncio.run(builder().abuild(docs))
    np.testing.assert_array_equal(sync.embeddings, async_.embeddings)


def test_pre_split_chunks_are_embedded_as_given() -> None:
    chunk = Document(text=f"Baselines\n{BODY}", doc_id="c1", chunk_of="paper")
    tree = builder().build([chunk, Document(text=BODY, doc_id="c2", chunk_of="paper")])
    expected = FakeEmbedder().embed_documents([leaf.text for leaf in tree.leaves])
    np.testing.assert_allclose(tree.embeddings[tree.layer_rows(0)], expected, atol=1e-6)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_section_context_must_be_a_bool(value: object) -> None:
    with pytest.raises(InvalidParameterError, match="section_context"):
        builder(section_context=value).build([PAPER])


def test_an_update_embeds_new_leaves_as_a_rebuild_would() -> None:
    first = Document(text=BODY * 2, doc_id="story")
    paper = Document(text=PAPER, doc_id="paper")
    tree = builder().build([first])
    updated = builder().insert(tree, [paper]).tree
    rows = updated.layer_rows(0)
    np.testing.assert_allclose(
        updated.embeddings[rows],
        expected_leaf_vectors(updated, {"story": BODY * 2, "paper": PAPER}),
        atol=1e-6,
    )


def test_an_update_keeps_the_trees_own_setting() -> None:
    # A tree built without section context (as every tree before it existed) stays so.
    tree = builder(section_context=False).build([Document(text=BODY * 2, doc_id="story")])
    legacy = Tree(
        nodes=tree.nodes,
        embeddings=tree.embeddings,
        params={k: v for k, v in tree.params.items() if k != "section_context"},
        build_info=tree.build_info,
    )
    for old in (tree, legacy):
        updated = builder().insert(old, [Document(text=PAPER, doc_id="paper")]).tree
        leaves = [leaf for leaf in updated.leaves if leaf.doc_id == "paper"]
        expected = FakeEmbedder().embed_documents([leaf.text for leaf in leaves])
        np.testing.assert_allclose(
            updated.embeddings[updated.rows([leaf.id for leaf in leaves])], expected, atol=1e-6
        )


def test_estimate_counts_the_second_embedding_of_leaves_under_a_heading() -> None:
    docs = [Document(text=PAPER, doc_id="paper")]
    with_, without = builder().estimate(docs), builder(section_context=False).estimate(docs)
    tree = builder().build(docs)
    spans = [leaf.span for leaf in tree.leaves if leaf.span is not None]
    extra = [
        f"{heading}\n{leaf.text}"
        for leaf, heading in zip(tree.leaves, leaf_headings(PAPER, spans), strict=True)
        if heading is not None
    ]
    assert extra
    tokenizer = WhitespaceTokenizer()
    assert with_.layers[0].embed_tokens - without.layers[0].embed_tokens == sum(
        len(tokenizer.encode(text)) for text in extra
    )
    assert with_.layers[0].nodes == without.layers[0].nodes


def test_the_dense_baseline_embeds_leaves_by_their_text_alone() -> None:
    from raptor_core.evaluation.baselines import DenseBaseline
    from raptor_core.evaluation.runner import EvalCorpus

    docs = [Document(text=PAPER, doc_id="paper"), Document(text=BODY * 3, doc_id="story")]

    def corpus(tree: Tree) -> EvalCorpus:
        return EvalCorpus(
            name="all",
            documents=tuple(docs),
            tree=tree,
            embedder=FakeEmbedder(),
            tokenizer=WhitespaceTokenizer(),
        )

    with_, without = builder().build(docs), builder(section_context=False).build(docs)
    assert not np.allclose(
        with_.embeddings[with_.layer_rows(0)], without.embeddings[without.layer_rows(0)]
    )
    a, b = DenseBaseline(corpus(with_)), DenseBaseline(corpus(without))
    np.testing.assert_allclose(a._matrix, b._matrix, atol=1e-6)
    assert a.retrieve("baselines bag of words", max_tokens=50) == b.retrieve(
        "baselines bag of words", max_tokens=50
    )
