"""The strategy factory, behaviour shared by every strategy, the CLI's --strategy and exports."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import raptor_core
from raptor_core import (
    STRATEGIES,
    CollapsedTreeRetriever,
    HybridRetriever,
    InvalidInputError,
    InvalidParameterError,
    LLMGuidedRetriever,
    MMRRetriever,
    Node,
    Tree,
    TreeRetriever,
    TreeTraversalRetriever,
    ValueBasedRetriever,
    make_retriever,
)
from raptor_core.cli import main
from raptor_core.retrieval.passage import PassageRetriever
from raptor_core.retrieval.registry import accepted_params
from raptor_core.testing import FakeEmbedder, ScriptedLLM, random_tree, tiny_tree


def any_llm() -> ScriptedLLM:
    """Selects nothing, never judges "enough": the LLM paths run and end quickly."""
    return ScriptedLLM(default='{"selected": [], "enough": false}')


@pytest.fixture
def tree() -> Tree:
    return tiny_tree()


def build(strategy: str, tree: Tree, **params) -> TreeRetriever:
    return make_retriever(strategy, tree, FakeEmbedder(tree.dim), llm=any_llm(), **params)


def test_strategy_names_and_classes(tree: Tree) -> None:
    assert STRATEGIES == ("collapsed", "traversal", "value", "llm", "hybrid", "mmr", "passage")
    expected = [
        CollapsedTreeRetriever,
        TreeTraversalRetriever,
        ValueBasedRetriever,
        LLMGuidedRetriever,
        HybridRetriever,
        MMRRetriever,
        PassageRetriever,
    ]
    assert [type(build(s, tree)) for s in STRATEGIES] == expected
    assert build("traversal", tree, top_k=2, threshold=0.5).get_params()["threshold"] == 0.5


def test_unknown_strategy(tree: Tree) -> None:
    with pytest.raises(InvalidParameterError, match="choose one of collapsed, traversal"):
        make_retriever("bm25", tree, FakeEmbedder(tree.dim))


@pytest.mark.parametrize("strategy", ["llm", "hybrid"])
def test_llm_strategies_need_an_llm(tree: Tree, strategy: str) -> None:
    with pytest.raises(InvalidParameterError, match="needs an LLM"):
        make_retriever(strategy, tree, FakeEmbedder(tree.dim))


def test_llm_is_ignored_by_vector_strategies(tree: Tree) -> None:
    retriever = make_retriever("collapsed", tree, FakeEmbedder(tree.dim), llm=any_llm(), k=2)
    assert len(retriever.retrieve("cats")) == 2


def test_parameters_a_strategy_does_not_accept(tree: Tree) -> None:
    with pytest.raises(InvalidParameterError, match="does not accept threshold; it accepts: k, "):
        make_retriever("collapsed", tree, FakeEmbedder(tree.dim), threshold=0.5)
    assert "chunk_k" in accepted_params("value") and "llm" not in accepted_params("hybrid")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_empty_tree_gives_no_hits(strategy: str) -> None:
    empty = Tree(nodes=(), embeddings=np.zeros((0, 8), np.float32))
    assert build(strategy, empty).retrieve("anything") == []


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("query", ["", "   ", None, 42])
def test_empty_or_non_text_query_is_an_input_error(tree: Tree, strategy: str, query) -> None:
    with pytest.raises(InvalidInputError):
        build(strategy, tree).retrieve(query)


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_a_query_that_is_not_unicode_text_is_an_input_error(
    tree: Tree, strategy: str
) -> None:
    # A lone surrogate (undecoded bytes) used to pass and fail inside the embedder, or, with
    # a precomputed embedding, reach the LLM's prompt.
    retriever = build(strategy, tree)
    with pytest.raises(InvalidInputError, match=r"'\\ud800', which is not valid Unicode text"):
        retriever.retrieve("cats \ud800 purr")
    vector = FakeEmbedder(tree.dim).embed_query("cats")
    with pytest.raises(InvalidInputError, match="not valid Unicode text"):
        retriever.retrieve("cats \udcff", embedding=vector)
    with pytest.raises(InvalidInputError, match="not valid Unicode text"):
        await retriever.aretrieve("cats \udcff", embedding=vector)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_k_larger_than_the_tree(tree: Tree, strategy: str) -> None:
    llm = ScriptedLLM(default="not json")  # the LLM paths fall back to similarity
    retriever = make_retriever(
        strategy, tree, FakeEmbedder(tree.dim), llm=llm, k=1000, max_tokens=None
    )
    hits = retriever.retrieve("cats purr")
    assert 0 < len(hits) <= len(tree)
    assert len({h.id for h in hits}) == len(hits)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_similar_nodes(tree: Tree, strategy: str) -> None:
    assert build(strategy, tree, min_score=0.99).retrieve("cats purr") == []


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("budget", [5, 30, 80])
def test_every_strategy_honours_max_tokens(strategy: str, budget: int) -> None:
    tree = random_tree(80, fanout=4, dim=16, random_state=1)
    retriever = make_retriever(
        strategy,
        tree,
        FakeEmbedder(tree.dim),
        llm=ScriptedLLM(default="not json"),  # LLM paths fall back to similarity
        k=50,
        max_tokens=budget,
    )
    hits = retriever.retrieve("leaf 7 summary")
    assert sum(h.node.token_count for h in hits) <= budget
    assert all(h.node.token_count <= budget for h in hits)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bad_k_and_max_tokens(tree: Tree, strategy: str) -> None:
    for params in ({"k": 0}, {"max_tokens": -5}):
        with pytest.raises(InvalidParameterError):
            build(strategy, tree).retrieve("cats", **params)


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_aretrieve_inside_a_running_loop(tree: Tree, strategy: str) -> None:
    retriever = build(strategy, tree, k=3)
    assert [h.id for h in await retriever.aretrieve("cats purr")] == [
        h.id for h in retriever.retrieve("cats purr")
    ]


def test_public_names_are_exported() -> None:
    names = {
        "TreeTraversalRetriever",
        "ValueBasedRetriever",
        "LLMGuidedRetriever",
        "HybridRetriever",
        "HybridResult",
        "JudgeDecision",
        "NumpyIndex",
        "FaissIndex",
        "STRATEGIES",
        "make_retriever",
    }
    assert names <= set(raptor_core.__all__)
    assert all(hasattr(raptor_core, n) for n in names)


# -- the CLI ------------------------------------------------------------------------------------
@pytest.fixture
def tree_dir(tmp_path, tree: Tree):
    described = Tree(
        nodes=tree.nodes,
        embeddings=tree.embeddings,
        params={"embedder": {"class": "raptor_core.testing.FakeEmbedder", "dim": tree.dim}},
    )
    return str(described.save(tmp_path / "tree"))


@pytest.mark.parametrize(
    ("flags", "source"),
    [
        ([], "passage"),
        (["--strategy", "passage", "--window", "1", "--rank-factor", "2"], "passage"),
        (["--strategy", "passage", "--max-share", "1"], "passage"),
        # Past float range: every leaf is near enough (no OverflowError traceback).
        (["--rank-factor", "1e308", "--max-tokens", "1" + "0" * 400], "passage"),
        (["--strategy", "traversal", "--top-k-per-layer", "1"], "traversal"),
        (["--strategy", "traversal", "--threshold", "0.1", "--start-layer", "1"], "traversal"),
        (["--strategy", "value", "--chunk-k", "2"], "value"),
        (["--strategy", "collapsed", "--layers", "0", "--min-score", "0.1"], "collapsed"),
    ],
)
def test_cli_query_strategies(tree_dir: str, capsys, flags: list[str], source: str) -> None:
    assert main(["query", tree_dir, "cats purr", "--json", *flags]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert hits and {h["source"] for h in hits} == {source}


def test_cli_json_hits_carry_their_documents_metadata(tmp_path, tree: Tree, capsys) -> None:
    nodes = tuple(
        dataclasses.replace(n, metadata={"title": f"doc of {n.id}"}) if n.layer == 0 else n
        for n in tree.nodes
    )
    described = Tree(
        nodes=nodes,
        embeddings=tree.embeddings,
        params={"embedder": {"class": "raptor_core.testing.FakeEmbedder", "dim": tree.dim}},
    )
    path = str(described.save(tmp_path / "tree"))
    assert main(["query", path, "cats purr", "--json", "--strategy", "collapsed"]) == 0
    hits = json.loads(capsys.readouterr().out)
    leaf_hits = [h for h in hits if h["layer"] == 0]
    assert leaf_hits
    for hit in leaf_hits:
        assert hit["metadata"] == {"title": f"doc of {hit['id']}"}
        assert set(hit) >= {"id", "layer", "score", "text", "doc_id", "source", "span"}


def test_cli_traversal_shows_paths(tree_dir: str, capsys) -> None:
    main(
        [
            "query",
            tree_dir,
            "cats purr",
            "--json",
            "--strategy",
            "traversal",
            "--top-k-per-layer",
            "1",
        ]
    )
    hits = json.loads(capsys.readouterr().out)
    assert [h["id"] for h in hits] == ["L1.0", "L0.0"]
    assert "path" not in hits[0] and hits[1]["path"] == ["L1.0", "L0.0"]


@pytest.mark.parametrize("strategy", ["llm", "hybrid"])
def test_cli_llm_strategies_need_an_llm(tree_dir: str, capsys, strategy: str) -> None:
    assert main(["query", tree_dir, "cats", "--strategy", strategy]) == 2
    assert f"--strategy {strategy} needs an LLM: pass --llm" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--threshold", "0.5"], "--threshold does not apply to --strategy passage"),
        (["--layers", "0"], "--layers does not apply to --strategy passage"),
        (["--strategy", "value", "--window", "1"], "--window does not apply to --strategy value"),
        (["--strategy", "value", "--layers", "0"], "--layers does not apply to --strategy value"),
        (
            ["--strategy", "collapsed", "--layers", "zero"],
            "--layers takes comma-separated layer numbers",
        ),
        (["--strategy", "traversal", "--start-layer", "7"], "start_layer must be in"),
    ],
)
def test_cli_strategy_errors(tree_dir: str, capsys, flags: list[str], message: str) -> None:
    assert main(["query", tree_dir, "cats", *flags]) == 2
    assert message in capsys.readouterr().err


def carried_tree() -> Tree:
    """Two real summaries plus a top-layer copy of one of them (a single-member cluster)."""
    base = tiny_tree()
    copy_of = base.node("L1.1")
    carried = Node(
        id="L2.0",
        text=copy_of.text,
        layer=2,
        token_count=copy_of.token_count,
        children=("L1.1",),
        doc_ids=copy_of.doc_ids,
        metadata={"carried": True},
    )
    top = Node(id="L2.1", text="Cats and kittens.", layer=2, token_count=3, children=("L1.0",))
    nodes = (*base.nodes, carried, top)
    vectors = np.vstack([base.embeddings, base.embeddings[base.row("L1.1")], base.embeddings[4]])
    return Tree(nodes=nodes, embeddings=vectors)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_carried_copies_are_never_returned(strategy: str) -> None:
    tree = carried_tree()
    assert tree.carried_mask.tolist() == [False] * 6 + [True, False]
    llm = ScriptedLLM(default="not json")  # similarity fallback: picks the carried node too
    retriever = make_retriever(
        strategy, tree, FakeEmbedder(tree.dim), llm=llm, k=100, max_tokens=None
    )
    hits = retriever.retrieve("rockets launch satellites into orbit")
    ids = [h.id for h in hits]
    assert "L2.0" not in ids
    if strategy == "passage":
        assert all(h.layer == 0 for h in hits)  # passages are made of leaves only
    else:
        assert "L1.1" in ids  # the original, reached through the copy by the top-down searches


class CountingEmbedder(FakeEmbedder):
    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.queries = 0

    def embed_query(self, text: str):
        self.queries += 1
        return super().embed_query(text)


@pytest.mark.parametrize("strategy", ["collapsed", "traversal", "value"])
async def test_precomputed_query_embedding(tree: Tree, strategy: str) -> None:
    from raptor_core import EmbeddingError

    embedder = CountingEmbedder(tree.dim)
    retriever = make_retriever(strategy, tree, embedder, k=2, max_tokens=None)
    vector = FakeEmbedder(tree.dim).embed_query("rockets orbit")
    by_vector = retriever.retrieve("this text is not embedded", embedding=vector)
    assert embedder.queries == 0
    assert [h.id for h in by_vector] == [h.id for h in retriever.retrieve("rockets orbit")]
    assert [h.id for h in await retriever.aretrieve("x", embedding=list(vector))] == [
        h.id for h in by_vector
    ]
    with pytest.raises(EmbeddingError, match="dimension"):
        retriever.retrieve("q", embedding=[1.0, 0.0])
    with pytest.raises(EmbeddingError, match="NaN"):
        retriever.retrieve("q", embedding=np.full(tree.dim, np.nan))


class WordEmbedder(FakeEmbedder):
    """Returns words instead of a vector for the query."""

    def embed_query(self, text: str):
        return "not a vector"

    async def aembed_query(self, text: str):
        return "not a vector"


@pytest.mark.parametrize("strategy", ["collapsed", "passage", "value"])
async def test_a_query_vector_that_is_not_numbers_is_an_embedding_error(
    tree: Tree, strategy: str
) -> None:
    from raptor_core import EmbeddingError

    retriever = make_retriever(strategy, tree, FakeEmbedder(tree.dim))
    for bad in ([1, [2]], "0.5", [10**400] * tree.dim, [object()] * tree.dim):
        with pytest.raises(EmbeddingError, match="embedding must be a flat sequence of numbers"):
            retriever.retrieve("cats", embedding=bad)
        with pytest.raises(EmbeddingError, match="embedding must be a flat sequence of numbers"):
            await retriever.aretrieve("cats", embedding=bad)
    words = make_retriever(strategy, tree, WordEmbedder(tree.dim))
    expected = "the embedder returned something other than a vector of numbers"
    with pytest.raises(EmbeddingError, match=expected):
        words.retrieve("cats")
    with pytest.raises(EmbeddingError, match=expected):
        await words.aretrieve("cats")
