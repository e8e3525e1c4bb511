"""The passage strategy (the default) and its BM25 index, offline with fakes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from raptor_core import DEFAULT_STRATEGY, Node, PassageRetriever, Tree, TreeBuilder, make_retriever
from raptor_core.exceptions import InvalidParameterError
from raptor_core.retrieval.lexical import BM25Index, lexical_tokens
from raptor_core.retrieval.passage import SEPARATOR, seed_strength
from raptor_core.store.memory import InMemoryNodeStore
from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer, tiny_tree
from raptor_core.tokenizers import count_tokens

BEES = (
    "Bees live in a hive with one queen. The queen lays the eggs of the colony. "
    "Worker bees gather nectar from flowers. They dance to show the others where flowers are. "
    "In winter the bees cluster together. They shiver their flight muscles to keep warm. "
    "Honey is the food they store for the cold months. Beekeepers take only the surplus honey."
)
ROCKETS = (
    "Rockets burn liquid fuel and oxidiser. The exhaust pushes the rocket upwards. "
    "Stages drop away when their fuel is spent. A satellite reaches orbit at high speed. "
    "Engineers test engines on the ground first. Launch pads are far from towns."
)
STORY = (
    "A miller had three sons and a cat. When he died the eldest took the mill. "
    "The second son took the donkey. The youngest got only the cat and was sad. "
    "The cat asked for boots and a bag. With them it caught rabbits for the king. "
    "The king was pleased and rewarded the youngest son. He married the princess in the end."
)


@pytest.fixture(scope="module")
def tree() -> Tree:
    builder = TreeBuilder(
        FakeEmbedder(32),
        EchoSummarizer(),
        tokenizer=WhitespaceTokenizer(),
        chunk_max_tokens=12,
        summary_max_tokens=10,
        random_state=0,
    )
    return builder.build(
        [
            {"doc_id": "bees", "text": BEES},
            {"doc_id": "rockets", "text": ROCKETS},
            {"doc_id": "story", "text": STORY},
        ]
    )


def retriever(tree: Tree, **params: object) -> PassageRetriever:
    return PassageRetriever(tree, FakeEmbedder(32), **params)  # type: ignore[arg-type]


def leaves_in_order(tree: Tree, doc_id: str) -> list[str]:
    leaves = [leaf for leaf in tree.leaves if leaf.doc_id == doc_id]
    return [leaf.id for leaf in sorted(leaves, key=lambda n: n.span or (0, 0))]


QUERIES = ["why do bees shiver in winter", "what did the cat ask for", "rocket fuel", "honey"]


def test_is_the_default_strategy(tree: Tree) -> None:
    assert DEFAULT_STRATEGY == "passage"
    assert isinstance(make_retriever(DEFAULT_STRATEGY, tree, FakeEmbedder(32)), PassageRetriever)


@pytest.mark.parametrize("budget", [5, 12, 30, 60, 200])
@pytest.mark.parametrize("query", QUERIES)
def test_budget_is_never_exceeded(tree: Tree, query: str, budget: int) -> None:
    tokenizer = WhitespaceTokenizer()
    hits = retriever(tree, k=100).retrieve(query, max_tokens=budget)
    assert sum(count_tokens(tokenizer, h.node.text) for h in hits) <= budget
    assert sum(h.node.token_count for h in hits) <= budget
    # Without a tokenizer (a tree that names none) whole leaves only, still within budget.
    bare = Tree(nodes=tree.nodes, embeddings=tree.embeddings)
    hits = PassageRetriever(bare, FakeEmbedder(32), k=100).retrieve(query, max_tokens=budget)
    assert sum(count_tokens(tokenizer, h.node.text) for h in hits) <= budget
    assert all("[" not in h.id for h in hits)  # nothing was cut


@pytest.mark.parametrize("query", QUERIES)
def test_passages_are_contiguous_leaves_of_one_document(tree: Tree, query: str) -> None:
    hits = retriever(tree, k=100).retrieve(query, max_tokens=80)
    assert hits
    used: set[str] = set()
    for hit in hits:
        assert hit.layer == 0 and hit.source == "passage"
        ids = list(hit.leaves) or [hit.id]
        leaves = [tree.node(i) for i in ids]
        assert len({leaf.doc_id for leaf in leaves}) == 1
        assert hit.node.doc_id == leaves[0].doc_id
        order = leaves_in_order(tree, leaves[0].doc_id)  # type: ignore[arg-type]
        start = order.index(ids[0])
        assert order[start : start + len(ids)] == ids  # consecutive, in document order
        assert not used & set(ids)  # each leaf in one passage at most
        used |= set(ids)
        if hit.leaves and "[" not in hit.id:
            assert hit.id == f"{ids[0]}..{ids[-1]}"
            assert hit.node.text == SEPARATOR.join(leaf.text for leaf in leaves)
            assert hit.node.span == (leaves[0].span[0], leaves[-1].span[1])  # type: ignore[index]
        elif not hit.leaves:
            assert hit.node is tree.node(hit.id)  # a single leaf is the tree's own node


@pytest.mark.parametrize("query", QUERIES)
def test_scores_are_the_best_leaf_cosine_in_unit_range(tree: Tree, query: str) -> None:
    q = FakeEmbedder(32).embed_query(query)
    q = q / np.linalg.norm(q)
    for hit in retriever(tree, k=100).retrieve(query, max_tokens=60):
        assert 0.0 <= hit.score <= 1.0
        ids = list(hit.leaves) or [hit.id]
        cosines = [float(tree.embeddings[tree.row(i)] @ q) for i in ids]
        assert hit.score == pytest.approx(max(0.0, max(cosines)), abs=1e-6)
        assert [c for _, c in hit.evidence] == pytest.approx(cosines, abs=1e-6)


def test_deterministic_across_calls_and_instances(tree: Tree) -> None:
    first = [(h.id, h.score, h.node.text) for h in retriever(tree).retrieve("honey bees")]
    again = [(h.id, h.score, h.node.text) for h in retriever(tree).retrieve("honey bees")]
    assert first == again
    copy = Tree(nodes=tree.nodes, embeddings=np.array(tree.embeddings), params=tree.params)
    other = [(h.id, h.score, h.node.text) for h in retriever(copy).retrieve("honey bees")]
    assert other == first


def test_the_last_passage_is_cut_to_fill_the_budget(tree: Tree) -> None:
    tokenizer = WhitespaceTokenizer()
    for budget in range(3, 40):
        hits = retriever(tree, k=100).retrieve("bees shiver in winter", max_tokens=budget)
        used = sum(count_tokens(tokenizer, h.node.text) for h in hits)
        assert used <= budget
        cut = [h for h in hits if "[" in h.id]
        assert len(cut) <= 1
        if cut:
            # Only the last leaf of a passage is cut, keeping a start (or end) of its text.
            hit = cut[0]
            leaf = tree.node(hit.leaves[-1] if hit.id.endswith("]") else hit.leaves[0])
            piece = hit.node.text.split(SEPARATOR)[-1 if hit.id.endswith("]") else 0]
            assert leaf.text.startswith(piece) or leaf.text.endswith(piece)
            assert used >= budget - 1  # the cut fills the budget (one token for a separator)


def test_a_store_from_the_tree_cuts_with_the_tree_tokenizer(tree: Tree) -> None:
    # The in-memory store keeps the tree's params, so it finds the same budget tokenizer;
    # a store filled node by node knows none and returns whole leaves only.
    store = InMemoryNodeStore.from_tree(tree)
    bare = InMemoryNodeStore()
    bare.add(list(tree.nodes), tree.embeddings)
    query = "bees shiver in winter"
    on_tree = retriever(tree, k=100).retrieve(query, max_tokens=17)
    assert any("[" in h.id for h in on_tree)
    on_store = PassageRetriever(store, FakeEmbedder(32), k=100).retrieve(query, max_tokens=17)
    assert [(h.id, h.node.text) for h in on_store] == [(h.id, h.node.text) for h in on_tree]
    whole = PassageRetriever(bare, FakeEmbedder(32), k=100).retrieve(query, max_tokens=17)
    assert not any("[" in h.id for h in whole)


def test_without_a_budget_the_k_strongest_leaves_come_back_alone(tree: Tree) -> None:
    hits = retriever(tree, k=3, max_tokens=None).retrieve("queen bee eggs")
    assert len(hits) == 3
    assert all(not h.leaves and h.node is tree.node(h.id) for h in hits)
    every = retriever(tree, k=1000, max_tokens=None).retrieve("queen bee eggs")
    assert sorted(h.id for h in every) == sorted(leaf.id for leaf in tree.leaves)


def test_k_bounds_the_number_of_passages(tree: Tree) -> None:
    for k in (1, 2, 3):
        hits = retriever(tree, k=k).retrieve("bees and rockets and cats", max_tokens=500)
        assert 1 <= len(hits) <= k


def test_growth_needs_relevant_neighbours(tree: Tree) -> None:
    def covered(hits: list) -> list[list[str]]:  # type: ignore[type-arg]
        return [list(h.leaves) or [h.id] for h in hits]

    q = FakeEmbedder(32).embed_query("honey")
    best = max(tree.leaves, key=lambda n: float(tree.embeddings[tree.row(n.id)] @ q))
    flat = retriever(tree, k=100, window=0, lexical=False).retrieve("honey", max_tokens=24)
    assert best.id in covered(flat)[0]  # window 0: plain similarity order
    # No neighbour is relevant with rank_factor 0: the same selection as no window at all.
    none = retriever(tree, k=100, rank_factor=0, lexical=False).retrieve("honey", max_tokens=24)
    assert covered(none) == covered(flat)
    grown = retriever(tree, k=100, rank_factor=100).retrieve("honey", max_tokens=200)
    assert max(map(len, covered(grown))) > max(map(len, covered(flat)))


def test_filters_and_min_score(tree: Tree) -> None:
    hits = retriever(tree, where={"doc_id": "story"}).retrieve("bees", max_tokens=80)
    assert hits and all(h.node.doc_id == "story" for h in hits)
    assert retriever(tree, min_score=0.999).retrieve("zzz unrelated words", max_tokens=80) == []


def test_parameters_are_validated(tree: Tree) -> None:
    for params in ({"window": -1}, {"window": 1.5}, {"rank_factor": -1}, {"rank_factor": math.inf}):
        with pytest.raises(InvalidParameterError):
            retriever(tree, **params).retrieve("bees")
    with pytest.raises(InvalidParameterError):
        retriever(tree, lexical="yes").retrieve("bees")
    assert retriever(tree, window=1).get_params()["window"] == 1


@pytest.mark.parametrize("scope", ["all", "found"])
def test_sizes_too_large_for_a_float_mean_everything(tree: Tree, scope: str) -> None:
    # A rank factor or budget past float range used to overflow computing the pool sizes;
    # it means "every leaf", the same passages as a merely very large value.
    def found(**params: object) -> list[tuple[str, tuple[str, ...], float]]:
        hits = retriever(tree, scope=scope, **params).retrieve("honey")
        return [(h.id, h.leaves, h.score) for h in hits]

    assert found(rank_factor=1e308) == found(rank_factor=1e6)
    assert found(max_tokens=10**400) == found(max_tokens=10**9)
    assert found(k=10**400) == found(k=10**6)
    assert found(k=10**400, max_tokens=None) == found(k=10**6, max_tokens=None)
    everything = found(k=10**400, max_tokens=10**400, rank_factor=1e308)
    covered = {leaf for hit_id, leaves, _ in everything for leaf in leaves or (hit_id,)}
    assert covered == {leaf.id for leaf in tree.leaves}


def test_tiny_tree_joins_neighbours_into_one_passage() -> None:
    tree = tiny_tree()
    hit = PassageRetriever(tree, FakeEmbedder(tree.dim), max_tokens=30).retrieve("cats purr")[0]
    assert hit.id == "L0.0..L0.1" and hit.leaves == ("L0.0", "L0.1")


def test_seed_strength_takes_the_best_relative_signal() -> None:
    cosine = np.array([0.5, 0.4, -0.1], dtype=np.float32)
    lexical = np.array([0.0, 2.0, 1.0], dtype=np.float32)
    assert seed_strength(cosine, lexical).tolist() == pytest.approx([1.0, 1.0, 0.5])
    assert seed_strength(cosine, None).tolist() == pytest.approx([1.0, 0.8, 0.0])
    assert seed_strength(cosine, np.zeros(3, dtype=np.float32)).tolist() == pytest.approx(
        [1.0, 0.8, 0.0]
    )


# -- BM25 ------------------------------------------------------------------------------------------
def brute_bm25(texts: list[str], query: str, k1: float = 1.5, b: float = 0.75) -> list[float]:
    docs = [lexical_tokens(t) for t in texts]
    avgdl = sum(map(len, docs)) / len(docs)
    n = len(docs)
    out = []
    for doc in docs:
        score = 0.0
        for term in set(lexical_tokens(query)):
            df = sum(term in d for d in docs)
            tf = doc.count(term)
            if tf:
                idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
                score += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(doc) / avgdl))
        out.append(score)
    return out


def test_bm25_matches_the_formula() -> None:
    texts = [BEES, ROCKETS, STORY, "bees bees bees honey", "the a of"]
    index = BM25Index(texts)
    for query in ["bees honey", "rocket fuel orbit", "cat king", "the"]:
        assert index.scores(query).tolist() == pytest.approx(brute_bm25(texts, query), rel=1e-5)


def test_bm25_terms_are_lexical_tokens_whatever_the_text() -> None:
    """The index folds each distinct word once: terms, order and scores stay lexical_tokens'."""
    texts = [
        "Studies of bees: a study, the bee_hive and THE Bees' queens.",
        "",
        "the of and",  # stop words only: a text of length 0
        "Café cafés CAFÉ naïve Ünïcode 42 4_2 x",
        "bus buses glass glasses studies study",
    ]
    index = BM25Index(texts)
    expected: dict[str, int] = {}
    for text in texts:
        for term in lexical_tokens(text):
            expected.setdefault(term, len(expected))
    assert index.vocabulary == expected
    for query in ["studies bee", "café naive", "glass bus 42", "hive queen the", "x 2"]:
        assert index.scores(query).tolist() == pytest.approx(brute_bm25(texts, query), rel=1e-5)


def test_bm25_tokens_and_edge_cases() -> None:
    assert lexical_tokens("The Bees of the hive, and 3 queens!") == ["bee", "hive", "3", "queen"]
    assert lexical_tokens("Glass boss bus") == ["glass", "boss", "bus"]  # no over-folding
    assert BM25Index([]).scores("bees").shape == (0,)
    assert BM25Index(["bees"]).scores("the of and").tolist() == [0.0]
    with pytest.raises(InvalidParameterError):
        BM25Index(["x"], b=2.0)


class _QueryVector:
    """An embedder whose every query is one fixed vector (the tree's vectors are given)."""

    def __init__(self, vector: list[float]) -> None:
        self.vector = np.asarray(vector, dtype=np.float32)

    def embed_query(self, text: str) -> np.ndarray:
        return self.vector

    def embed_documents(self, texts: list[str]) -> np.ndarray:
        return np.tile(self.vector, (len(texts), 1))


def _five_leaves(cosines: dict[str, float]) -> Tree:
    """One document of five 10-word leaves A..E whose cosines to the query are given."""
    nodes, rows = [], []
    for i, name in enumerate("ABCDE"):
        text = " ".join(f"{name.lower()}{j}" for j in range(10))
        nodes.append(
            Node(
                id=name,
                text=text,
                layer=0,
                token_count=10,
                doc_id="doc",
                span=(i * 100, i * 100 + 99),
            )
        )
        c = cosines[name]
        rows.append([c, math.sqrt(1 - c * c), 0.0, 0.0])
    return Tree(nodes=tuple(nodes), embeddings=np.asarray(rows, dtype=np.float32))


def _passage_leaves(tree: Tree, **params: object) -> list[tuple[str, ...]]:
    retriever = PassageRetriever(
        tree,
        _QueryVector([1.0, 0.0, 0.0, 0.0]),  # type: ignore[arg-type]
        max_tokens=45,
        window=2,
        rank_factor=10.0,  # every leaf is relevant enough to join a passage
        lexical=False,
        min_score=0.7,  # only C and D can seed
        budget_tokenizer=WhitespaceTokenizer(),
        **params,  # type: ignore[arg-type]
    )
    return [hit.leaves or (hit.id,) for hit in retriever.retrieve("q")]


def test_a_seed_grows_into_at_most_max_share_of_the_budget_stronger_side_first() -> None:
    tree = _five_leaves({"A": 0.1, "B": 0.6, "C": 1.0, "D": 0.8, "E": 0.1})
    # Half of 45 tokens holds the seed C and one neighbour: D, the stronger side.
    assert _passage_leaves(tree) == [("C", "D")]
    assert _passage_leaves(tree, max_share=0.5) == [("C", "D")]
    # The whole budget: both sides grow, the stronger first, until E no longer fits.
    assert _passage_leaves(tree, max_share=1.0) == [("A", "B", "C", "D")]
    # The stronger side decides, not the order in the document.
    swapped = _five_leaves({"A": 0.1, "B": 0.8, "C": 1.0, "D": 0.6, "E": 0.1})
    assert _passage_leaves(swapped) == [("B", "C")]


def test_bm25_seeds_but_does_not_make_a_neighbour_relevant() -> None:
    # D shares every word with the query but is far from it in meaning; C is the only leaf
    # close enough to seed (min_score) and, with rank_factor 0.2, the only relevant one.
    tree = _five_leaves({"A": 0.1, "B": 0.6, "C": 1.0, "D": 0.1, "E": 0.1})

    def passages(**params: object) -> list[tuple[str, ...]]:
        retriever = PassageRetriever(
            tree,
            _QueryVector([1.0, 0.0, 0.0, 0.0]),  # type: ignore[arg-type]
            max_tokens=45,
            min_score=0.7,
            budget_tokenizer=WhitespaceTokenizer(),
            **params,  # type: ignore[arg-type]
        )
        return [hit.leaves or (hit.id,) for hit in retriever.retrieve("d1 d2 d3")]

    assert passages(rank_factor=0.2) == [("C",)]
    assert passages(rank_factor=0.2, lexical=False) == [("C",)]
    # Relevant by cosine (every leaf, with a wide rank_factor), D does join: half the budget
    # holds one neighbour, and D is the stronger side (its BM25 makes it a strong seed).
    assert passages(rank_factor=10.0) == [("C", "D")]


@pytest.mark.parametrize("share", [0, -0.5, 1.5, math.nan, math.inf, True, "half"])
def test_max_share_must_be_in_the_unit_interval(tree: Tree, share: object) -> None:
    with pytest.raises(InvalidParameterError, match="max_share"):
        retriever(tree, max_share=share).retrieve("bees")


def test_the_last_of_k_passages_still_grows() -> None:
    tree = _five_leaves({"A": 0.1, "B": 0.6, "C": 1.0, "D": 0.8, "E": 0.1})
    assert _passage_leaves(tree, k=1) == [("C", "D")]
    assert _passage_leaves(tree, k=1, max_share=1.0) == [("A", "B", "C", "D")]


class CountingStore(InMemoryNodeStore):
    """An in-memory store that records how many results each search asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[int, bool]] = []  # (k, restricted to ids)

    def search(self, vector, k, *, where=None):  # type: ignore[no-untyped-def]
        self.asked.append((k, where is not None and where.ids is not None))
        return super().search(vector, k, where=where)


def test_one_search_of_the_store_whatever_its_size() -> None:
    # 2,000 leaves of 10 words and a budget no run of whole leaves fills exactly: a store
    # that knows no tokenizer never cuts a leaf, so a few tokens are always left over.  The
    # seeds come from a pool of the best leaves by cosine and by BM25, fetched in one
    # search; ranking every leaf to look for one short enough to fill the gap used to widen
    # the search until it read the whole store, on every query.
    sentences = [f"Item {i} tells of honey and bees in hive {i % 37}." for i in range(2000)]
    builder = TreeBuilder(
        FakeEmbedder(32),
        EchoSummarizer(),
        tokenizer=WhitespaceTokenizer(),
        chunk_max_tokens=10,
        max_layers=0,
    )
    tree = builder.build([{"doc_id": "big", "text": " ".join(sentences)}])
    leaves = len(tree.leaves)
    assert leaves > 1500
    store = CountingStore()
    store.add(list(tree.nodes), tree.embeddings)  # no params: whole leaves only
    hits = PassageRetriever(store, FakeEmbedder(32), k=100).retrieve("honey bees", max_tokens=45)
    used = sum(h.node.token_count for h in hits)
    assert hits and used <= 45
    dense = [k for k, restricted in store.asked if not restricted]
    assert len(dense) == 1 and dense[0] < leaves / 10


class SearchOnlyStore(CountingStore):
    """A store reached only through its search API: it says it cannot list its nodes."""

    listable = False

    def __iter__(self):  # type: ignore[no-untyped-def]
        msg = "this store cannot list its nodes"
        raise InvalidParameterError(msg)


def _search_only(tree: Tree) -> SearchOnlyStore:
    store = SearchOnlyStore()
    store.add(list(tree.nodes), tree.embeddings)
    return store


@pytest.mark.parametrize("query", ["why do bees shiver in winter", "rocket fuel", "the cat"])
@pytest.mark.parametrize("budget", [24, 60, None])
def test_a_store_that_cannot_list_gets_passages_of_the_leaves_found(
    tree: Tree, query: str, budget: int | None
) -> None:
    store = _search_only(tree)
    on_store = PassageRetriever(
        store, FakeEmbedder(32), k=100, budget_tokenizer=WhitespaceTokenizer()
    )
    on_tree = retriever(tree, k=100, scope="found")
    hits = on_store.retrieve(query, max_tokens=budget)
    assert [(h.id, h.leaves, h.score) for h in hits] == [
        (h.id, h.leaves, h.score) for h in on_tree.retrieve(query, max_tokens=budget)
    ]
    # One search (or two, when the leaves found are smaller than the tree's chunk size
    # suggested), never a listing; passages are still contiguous leaves of one document.
    assert 1 <= len(store.asked) <= 2 and not any(restricted for _, restricted in store.asked)
    for hit in hits:
        if hit.leaves:
            doc = hit.node.doc_id
            assert doc is not None
            order = leaves_in_order(tree, doc)
            at = order.index(hit.leaves[0].split("[")[0])
            assert [x.split("[")[0] for x in hit.leaves] == order[at : at + len(hit.leaves)]
    if budget is not None:
        assert sum(count_tokens(WhitespaceTokenizer(), h.node.text) for h in hits) <= budget
    # Reading every leaf needs a listing: asked for explicitly, it fails clearly.
    with pytest.raises(InvalidParameterError, match="cannot list"):
        PassageRetriever(store, FakeEmbedder(32), scope="all").retrieve(query)


def test_found_passages_grow_by_similarity_alone(tree: Tree) -> None:
    # On the leaves found, seeds still grow into their relevant neighbours (every span gap
    # of this tree is one space), but no BM25 is involved.
    for query in ("why do bees shiver in winter", "the youngest son and the cat"):
        found = retriever(tree, k=100, scope="found").retrieve(query, max_tokens=60)
        grown = [h for h in found if h.leaves]
        assert grown
        assert all("by similarity" in h.reason and "BM25" not in h.reason for h in grown)


def test_found_leaves_are_neighbours_only_across_whitespace() -> None:
    from raptor_core.retrieval.passage import _Leaves

    def leaf(name: str, doc: str | None, span: tuple[int, int] | None) -> Node:
        return Node(id=name, text=name, layer=0, token_count=1, doc_id=doc, span=span)

    nodes = [
        leaf("b", "d", (11, 20)),  # found first: order does not matter
        leaf("a", "d", (0, 10)),  # one character before b: neighbours
        leaf("c", "d", (22, 30)),  # two characters after b: neighbours
        leaf("e", "d", (33, 40)),  # three after c: a leaf could lie between, so not
        leaf("x", "other", (31, 32)),  # another document
        leaf("y", None, None),  # no place in a document
    ]
    order = _Leaves.found(nodes).order
    assert order.prev.tolist() == [1, -1, 0, -1, -1, -1]
    assert order.next.tolist() == [2, 0, -1, -1, -1, -1]


def test_scope_is_validated(tree: Tree) -> None:
    with pytest.raises(InvalidParameterError, match="scope must be one of 'auto', 'all', 'found'"):
        retriever(tree, scope="some").retrieve("bees")


def test_a_store_updated_to_the_same_size_is_read_again(tree: Tree) -> None:
    # The leaves a store was read for are kept while it is unchanged: an update that adds as
    # many nodes as it removes keeps the count, and the passages must still see the new leaf.
    store = InMemoryNodeStore.from_tree(tree)
    embedder = FakeEmbedder(dim=tree.dim)
    query = "glaciers carve deep valleys"
    passages = PassageRetriever(store, embedder, k=5, max_tokens=60)
    assert not any("glaciers" in h.node.text for h in passages.retrieve(query))
    old = tree.leaves[0]
    new = Node(
        id="L0-glaciers",
        text="Glaciers carve deep valleys.",
        layer=0,
        token_count=4,
        doc_id=old.doc_id,
        span=old.span,
        doc_ids=old.doc_ids,
    )
    size, revision = len(store), store.revision
    store.delete([old.id])
    store.add([new], embedder.embed_documents([new.text]))
    assert len(store) == size and store.revision != revision
    hits = PassageRetriever(store, embedder, k=5, max_tokens=60).retrieve(query)
    assert "glaciers" in hits[0].node.text.lower()
    assert all(old.id not in (h.node.id, *h.leaves) for h in hits)


def _overlapping_chunks(
    texts: list[str], *, spans: bool = False, cosines: list[float] | None = None
) -> Tree:
    """One document of chunks with the given texts and cosines to the query (default: 1).

    Without ``spans`` they are pre-split chunks (as a splitter with ``chunk_overlap``
    makes them); with spans they are the builder's own chunks.
    """
    nodes = [
        Node(
            id=f"c{i}",
            text=text,
            layer=0,
            token_count=len(text.split()),
            doc_id="doc",
            span=(i * 1000, i * 1000 + len(text)) if spans else None,
        )
        for i, text in enumerate(texts)
    ]
    rows = [[c, math.sqrt(1 - c * c), 0.0, 0.0] for c in cosines or [1.0] * len(texts)]
    return Tree(nodes=tuple(nodes), embeddings=np.asarray(rows, dtype=np.float32))


def _words(first: int, last: int) -> str:
    return " ".join(f"word{j:02d}" for j in range(first, last))


def _one_passage(tree: Tree, max_tokens: int) -> list:
    return PassageRetriever(
        tree,
        _QueryVector([1.0, 0.0, 0.0, 0.0]),  # type: ignore[arg-type]
        max_tokens=max_tokens,
        window=2,
        max_share=1.0,
        lexical=False,
        budget_tokenizer=WhitespaceTokenizer(),
    ).retrieve("q")


def test_overlapping_pre_split_chunks_are_joined_without_repeating_the_overlap() -> None:
    # A splitter's chunk_overlap: each chunk starts with the last three words of the one before.
    tree = _overlapping_chunks([_words(0, 10), _words(7, 17), _words(14, 24)])
    [hit] = _one_passage(tree, max_tokens=100)
    assert hit.leaves == ("c0", "c1", "c2")
    assert hit.node.text.split() == _words(0, 24).split()  # every word once, in order
    assert hit.node.text == SEPARATOR.join([_words(0, 10), _words(10, 17), _words(17, 24)])


def test_text_that_repeats_is_kept_unless_it_is_a_splitters_overlap() -> None:
    texts = [_words(0, 10), _words(7, 17)]
    # The builder's own chunks never overlap: a repeat in them is the document's text.
    [hit] = _one_passage(_overlapping_chunks(texts, spans=True), max_tokens=100)
    assert hit.node.text == SEPARATOR.join(texts)
    # Repeats shorter than a few words are text too ("Yes. Yes." in a transcript).
    short = ["We agreed. Yes.", "Yes. Then we left the room."]
    [hit] = _one_passage(_overlapping_chunks(short), max_tokens=100)
    assert hit.node.text == SEPARATOR.join(short)


def test_a_cut_chunk_after_an_overlap_keeps_what_is_new() -> None:
    tree = _overlapping_chunks([_words(0, 10), _words(7, 17), _words(14, 24)])
    # c0 takes 10 of the 15 tokens; c1 does not fit whole and is cut to what is left, and
    # its first three words, the overlap, are in the passage already.
    [hit] = _one_passage(tree, max_tokens=15)
    assert hit.leaves == ("c0", "c1")
    assert hit.node.text.split() == _words(0, 14).split()
    # The id counts the characters of the cut chunk the passage holds, overlap included.
    assert hit.id.startswith("c0..c1[:")
    kept = int(hit.id.rsplit("[:", 1)[1].rstrip("]"))
    assert tree.node("c1").text[:kept].split() == _words(7, 14).split()


def test_a_cut_chunk_before_an_overlap_keeps_what_is_new() -> None:
    # c1 seeds; c0 precedes it and is cut to its end, without the words c1 repeats.
    tree = _overlapping_chunks([_words(0, 10), _words(7, 17)], cosines=[0.8, 1.0])
    [hit] = _one_passage(tree, max_tokens=14)
    assert hit.leaves == ("c0", "c1")
    # One token of the room is kept for the separator: three new words of c0 fit.
    assert hit.node.text.split() == _words(4, 17).split()
    assert hit.id.startswith("c0[-")
    kept = int(hit.id.split("[-", 1)[1].split(":", 1)[0])
    assert tree.node("c0").text[-kept:].split() == _words(4, 10).split()


@pytest.mark.timeout(60)
def test_overlap_detection_stays_linear_on_repetitive_text() -> None:
    # One phrase repeated: its start recurs everywhere in the chunk before.
    phrase = "la la la la la la "
    long = phrase * 20_000
    tree = _overlapping_chunks([long + "end.", long], cosines=[1.0, 0.99])
    [hit] = _one_passage(tree, max_tokens=10**6)
    assert hit.leaves == ("c0", "c1")
    # No overlap found (the first leaf ends otherwise): both texts whole, joined.
    assert hit.node.text == long + "end." + SEPARATOR + long


def test_the_first_async_search_reads_the_leaves_off_the_event_loop(
    tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading every leaf of a large store takes seconds: not on the loop's thread."""
    import asyncio
    import threading

    from raptor_core.retrieval import passage

    store = InMemoryNodeStore.from_tree(tree)
    threads: list[str] = []
    from_store = passage._Leaves.from_store.__func__  # type: ignore[attr-defined]

    def recording(cls: type, store_: object) -> object:
        threads.append(threading.current_thread().name)
        return from_store(cls, store_)

    monkeypatch.setattr(passage._Leaves, "from_store", classmethod(recording))
    found = PassageRetriever(store, FakeEmbedder(32), k=5)

    async def twice() -> tuple[list[str], list[str]]:
        loop_thread = threading.current_thread().name
        first = await found.aretrieve("bees shiver in winter", max_tokens=60)
        second = await found.aretrieve("rockets reach orbit", max_tokens=60)
        assert loop_thread not in threads  # read in a worker thread, once
        return [h.id for h in first], [h.id for h in second]

    first, second = asyncio.run(twice())
    assert len(threads) == 1
    sync = PassageRetriever(InMemoryNodeStore.from_tree(tree), FakeEmbedder(32), k=5)
    assert first == [h.id for h in sync.retrieve("bees shiver in winter", max_tokens=60)]
    assert second == [h.id for h in sync.retrieve("rockets reach orbit", max_tokens=60)]
