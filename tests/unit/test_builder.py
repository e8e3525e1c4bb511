from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from raptor_core.build.builder import TreeBuilder, to_documents
from raptor_core.build.summarizers import ExtractiveSummarizer, LLMSummarizer
from raptor_core.exceptions import (
    EmbeddingError,
    InvalidInputError,
    InvalidParameterError,
    LLMAuthenticationError,
    SummarizationError,
)
from raptor_core.testing import EchoSummarizer, FakeEmbedder, ScriptedLLM, WhitespaceTokenizer
from raptor_core.types import DEFAULT_SUMMARY_PROMPT, Document

TOPICS = {
    "cats": "Cats purr softly. Cats sleep in the sun. Kittens chase string. A cat grooms its fur.",
    "rockets": "Rockets burn fuel. Rockets reach orbit. Satellites circle the earth. Launch pads roar.",
    "bread": "Bakers knead dough. Yeast makes bread rise. Ovens bake loaves. Crust turns brown.",
}


class PairClusterer:
    """Deterministic clusterer for unit tests: consecutive pairs, the last row also in the first."""

    def __init__(self) -> None:
        self.calls = 0

    def cluster(self, vectors: np.ndarray) -> list[list[int]]:
        self.calls += 1
        n = len(vectors)
        clusters = [list(range(i, min(i + 2, n))) for i in range(0, n, 2)]
        if n > 2:
            clusters[0].append(n - 1)  # one shared member: soft clustering
        return clusters


def make_builder(**kwargs: object) -> TreeBuilder:
    params: dict[str, object] = {
        "tokenizer": WhitespaceTokenizer(),
        "clusterer": PairClusterer(),
        "chunk_max_tokens": 8,
        "summary_max_tokens": 10,
        "cluster_max_tokens": 100,
    }
    params.update(kwargs)
    return TreeBuilder(FakeEmbedder(32), EchoSummarizer(), **params)  # type: ignore[arg-type]


def test_builds_layers_with_children_and_doc_ids() -> None:
    tree = make_builder().build(
        [Document(text=t, doc_id=k, metadata={"topic": k}) for k, t in TOPICS.items()]
    )
    assert tree.num_layers >= 2
    for leaf in tree.leaves:
        assert leaf.doc_id in TOPICS
        start, end = leaf.span  # type: ignore[misc]
        assert TOPICS[leaf.doc_id][start:end].strip() == leaf.text
        assert leaf.metadata == {"topic": leaf.doc_id}
        assert leaf.token_count <= 8
    for layer in range(1, tree.num_layers):
        for node in tree.layer(layer):
            assert node.children
            assert all(tree.node(c).layer == layer - 1 for c in node.children)
            covered = {d for c in node.children for d in tree.node(c).doc_ids}
            assert set(node.doc_ids) == covered
    # soft clustering: one node has two parents
    assert any(len(tree.parents(n.id)) > 1 for n in tree.leaves)
    info = tree.build_info
    assert info["documents"] == 3 and info["chunks"] == len(tree.leaves)
    assert [x["nodes"] for x in info["layers"]] == [
        len(tree.layer(i)) for i in range(tree.num_layers)
    ]
    assert set(info["timings"]) == {"chunk", "embed", "cluster", "summarize"}
    assert info["stop_reason"]


def test_embeddings_are_unit_rows() -> None:
    tree = make_builder().build(list(TOPICS.values()))
    norms = np.linalg.norm(tree.embeddings, axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5)


def test_max_layers_limits_depth() -> None:
    assert make_builder(max_layers=1).build(list(TOPICS.values())).num_layers == 2
    assert make_builder(max_layers=0).build(list(TOPICS.values())).num_layers == 1


class OneCluster:
    def cluster(self, vectors: np.ndarray) -> list[list[int]]:
        return [list(range(len(vectors)))]


def test_single_cluster_layer_is_not_built() -> None:
    tree = make_builder(clusterer=OneCluster(), cluster_max_tokens=10_000).build(
        list(TOPICS.values())
    )
    assert tree.num_layers == 1
    assert "single cluster" in tree.build_info["stop_reason"]


@pytest.mark.parametrize("texts", [["One."], ["One. Two."], ["a b c d e f g h i j k l m n o p"]])
def test_small_inputs(texts: list[str]) -> None:
    tree = make_builder().build(texts)
    assert len(tree.leaves) >= 1


def test_params_recorded() -> None:
    tree = make_builder(random_state=7).build(list(TOPICS.values()))
    assert tree.params["random_state"] == 7
    assert tree.params["chunk_max_tokens"] == 8
    assert tree.params["embedder"]["class"] == "raptor_core.testing.FakeEmbedder"
    assert tree.params["embedder"]["dim"] == 32


def test_init_stores_params_verbatim_and_validates_in_build() -> None:
    builder = TreeBuilder(chunk_max_tokens=-3)  # no error here: sklearn convention
    assert builder.chunk_max_tokens == -3
    with pytest.raises(InvalidParameterError, match="chunk_max_tokens"):
        builder.build(["text"])


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_layers": -1}, "max_layers"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"summary_max_tokens": True}, "summary_max_tokens"),
        ({"cluster_max_tokens": 50, "chunk_max_tokens": 100}, "cluster_max_tokens"),
        ({"n_threads": 0}, "n_threads"),
        ({"random_state": "seed"}, "random_state"),
    ],
)
def test_absurd_parameters(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(InvalidParameterError, match=name):
        make_builder(**kwargs).build(["Some text."])


@pytest.mark.parametrize(
    ("docs", "message"),
    [
        ([], "no documents"),
        ([""], "empty"),
        (["   \n\t "], "empty"),
        (["abc\x00def"], "binary"),
        ([b"bytes"], "must be a str"),
        ([Document(text="a", doc_id="x"), Document(text="b", doc_id="x")], "duplicate"),
        ([{"doc_id": "x"}], "no 'text'"),
        ([{"doc_id": "x", "text": "t", "metadata": {"bad": object()}}], "JSON"),
    ],
)
def test_bad_documents(docs: list[object], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        make_builder().build(docs)  # type: ignore[arg-type]


def test_mapping_documents_keep_extra_fields() -> None:
    (doc,) = to_documents([{"doc_id": "a", "text": "t", "title": "T", "metadata": {"x": 1}}])
    assert doc.doc_id == "a" and doc.metadata == {"title": "T", "x": 1}


class NaNEmbedder(FakeEmbedder):
    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        out = super().embed_documents(texts)
        out[0] = np.nan
        return out


class ZeroEmbedder(FakeEmbedder):
    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        return np.zeros((len(texts), self.dim), dtype=np.float32)


class WrongShapeEmbedder(FakeEmbedder):
    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        return super().embed_documents(texts)[:-1]


@pytest.mark.parametrize(
    ("embedder", "message"),
    [(NaNEmbedder(), "NaN"), (ZeroEmbedder(), "all-zero"), (WrongShapeEmbedder(), "shape")],
)
def test_bad_embeddings_are_clear_errors(embedder: FakeEmbedder, message: str) -> None:
    builder = TreeBuilder(
        embedder, EchoSummarizer(), tokenizer=WhitespaceTokenizer(), clusterer=PairClusterer()
    )
    with pytest.raises(EmbeddingError, match=message):
        builder.build(list(TOPICS.values()))


class EmptySummarizer:
    def summarize(self, texts: Sequence[str], *, max_tokens: int) -> str:
        return "  "


def test_empty_summary_is_a_clear_error() -> None:
    builder = make_builder()
    builder.summarizer = EmptySummarizer()
    with pytest.raises(SummarizationError, match=r"layer 1, cluster 0.*empty"):
        builder.build(list(TOPICS.values()))


def test_summariser_exception_is_wrapped_with_location() -> None:
    builder = make_builder()
    builder.summarizer = LLMSummarizer(ScriptedLLM([RuntimeError("boom")], default="fine"))
    builder.max_concurrency = 1
    with pytest.raises(SummarizationError, match=r"layer 1, cluster 0.*boom"):
        builder.build(list(TOPICS.values()))


def test_typed_backend_errors_keep_their_type() -> None:
    builder = make_builder()
    builder.summarizer = LLMSummarizer(
        ScriptedLLM(default=lambda p: (_ for _ in ()).throw(LLMAuthenticationError("bad key")))
    )
    with pytest.raises(LLMAuthenticationError, match="bad key"):
        builder.build(list(TOPICS.values()))


def test_llm_summariser_uses_paper_prompt() -> None:
    llm = ScriptedLLM(default="a summary")
    builder = make_builder()
    builder.summarizer = LLMSummarizer(llm)
    tree = builder.build(list(TOPICS.values()))
    assert tree.num_layers >= 2
    head = DEFAULT_SUMMARY_PROMPT.split("{context}")[0]
    assert llm.prompts and all(p.startswith(head) and p.endswith(":") for p in llm.prompts)


def test_progress_callback_sees_every_stage() -> None:
    seen: set[str] = set()
    make_builder(progress=lambda stage, done, total: seen.add(stage)).build(list(TOPICS.values()))
    assert seen == {"chunk", "embed", "cluster", "summarize"}


async def test_abuild_matches_build_inside_running_loop() -> None:
    docs = list(TOPICS.values())
    sync_tree = make_builder().build(docs)
    async_tree = await make_builder().abuild(docs)
    assert [n.text for n in sync_tree.nodes] == [n.text for n in async_tree.nodes]
    assert np.allclose(sync_tree.embeddings, async_tree.embeddings)
    assert asyncio.get_running_loop().is_running()


def test_extractive_summary_covers_cluster_and_respects_budget() -> None:
    tokenizer = WhitespaceTokenizer()
    summarizer = ExtractiveSummarizer(FakeEmbedder(64), tokenizer=tokenizer)
    texts = [TOPICS["cats"], TOPICS["rockets"]]
    summary = summarizer.summarize(texts, max_tokens=12)
    assert 0 < len(summary.split()) <= 12
    # Coverage picks from both sub-topics, not just the first text.
    assert any(w in summary.lower() for w in ("cat", "kitten")) and any(
        w in summary.lower() for w in ("rocket", "orbit", "satellite", "launch")
    )
    # Sentences are whole sentences of the input.
    for sentence in summary.split(". "):
        assert sentence.strip(".") in " ".join(texts)


def test_extractive_summary_is_not_a_prefix() -> None:
    tokenizer = WhitespaceTokenizer()
    summarizer = ExtractiveSummarizer(FakeEmbedder(64), tokenizer=tokenizer)
    texts = [TOPICS["cats"], TOPICS["rockets"], TOPICS["bread"]]
    summary = summarizer.summarize(texts, max_tokens=15)
    prefix = " ".join(" ".join(texts).split()[:15])
    assert summary != prefix


def test_extractive_invalid_budget() -> None:
    summarizer = ExtractiveSummarizer(FakeEmbedder(8), tokenizer=WhitespaceTokenizer())
    with pytest.raises(InvalidParameterError):
        summarizer.summarize(["x."], max_tokens=0)


def test_llm_summariser_template_and_empty_answer() -> None:
    with pytest.raises(InvalidParameterError, match="context"):
        LLMSummarizer(ScriptedLLM(default="x"), prompt="no placeholder").summarize(
            ["a"], max_tokens=5
        )
    summarizer = LLMSummarizer(ScriptedLLM(default=lambda p: p), prompt="Sum {x} up: {context}")
    assert summarizer.summarize(["a {b}"], max_tokens=5) == "Sum {x} up: a {b}"
    with pytest.raises(SummarizationError, match="empty"):
        LLMSummarizer(ScriptedLLM(default="")).summarize(["a"], max_tokens=5)


class FixedClusterer:
    """Returns a fixed clustering for the first layer, then one cluster (stops the build)."""

    def __init__(self, first: list[list[int]]) -> None:
        self.first = first
        self.calls = 0

    def cluster(self, vectors: np.ndarray) -> list[list[int]]:
        self.calls += 1
        return self.first if self.calls == 1 else [list(range(len(vectors)))]


def test_single_member_clusters_are_carried_up_not_summarised() -> None:
    from raptor_core.retrieval import CollapsedTreeRetriever

    texts = ["Cats purr.", "Cats sleep.", "Rockets fly.", "Rockets burn.", "Bread rises."]
    summarizer = EchoSummarizer()
    builder = TreeBuilder(
        FakeEmbedder(32),
        summarizer,
        tokenizer=WhitespaceTokenizer(),
        clusterer=FixedClusterer([[0, 1], [2, 3], [4]]),
        cluster_max_tokens=100,
    )
    tree = builder.build(texts)
    layer1 = tree.layer(1)
    assert len(layer1) == 3
    assert len(summarizer.calls) == 2  # no call for the single-member cluster
    carried = layer1[2]
    (child,) = tree.children(carried.id)
    assert carried.text == child.text and carried.metadata == {"carried": True}
    assert np.array_equal(
        tree.embeddings[tree.row(carried.id)], tree.embeddings[tree.row(child.id)]
    )
    assert list(tree.carried_mask) == [False] * 7 + [True]
    hits = CollapsedTreeRetriever(tree, FakeEmbedder(32), k=8, max_tokens=None).retrieve(
        "bread rises"
    )
    assert [h.node.text for h in hits].count("Bread rises.") == 1
    assert carried.id not in {h.id for h in hits}


def test_layer_with_fewer_than_two_real_groups_is_not_built() -> None:
    texts = ["Cats purr.", "Cats sleep.", "Rockets fly.", "Bread rises."]
    builder = TreeBuilder(
        FakeEmbedder(32),
        EchoSummarizer(),
        tokenizer=WhitespaceTokenizer(),
        clusterer=FixedClusterer([[0, 1], [2], [3]]),
        cluster_max_tokens=100,
    )
    tree = builder.build(texts)
    assert tree.num_layers == 1
    assert "no longer groups" in tree.build_info["stop_reason"]


def test_extractive_memo_embeds_each_sentence_once() -> None:
    embedder = FakeEmbedder(32)
    summarizer = ExtractiveSummarizer(embedder, tokenizer=WhitespaceTokenizer())
    shared = "Cats purr softly."
    first = summarizer.summarize_batch(
        [[shared, "Dogs bark."], [shared, "Birds sing."]], max_tokens=20
    )
    assert embedder.texts_embedded == 3  # the shared sentence once
    again = summarizer.summarize_batch(
        [[shared, "Dogs bark."], [shared, "Birds sing."]], max_tokens=20
    )
    assert again == first and embedder.texts_embedded == 3
    other = FakeEmbedder(32)
    summarizer.embedder = other  # a different model must not reuse the old vectors
    summarizer.summarize([shared], max_tokens=5)
    assert other.texts_embedded == 1


class SeamTokenizer(WhitespaceTokenizer):
    """Counts one extra token per sentence seam, as BPE can at a join."""

    def count(self, text: str) -> int:
        return len(text.split()) + text.count(". ")


def test_extractive_summary_fits_budget_even_when_joining_adds_tokens() -> None:
    summarizer = ExtractiveSummarizer(FakeEmbedder(64), tokenizer=SeamTokenizer())
    texts = [TOPICS["cats"], TOPICS["rockets"], TOPICS["bread"]]
    for budget in (5, 8, 12, 20):
        summary = summarizer.summarize(texts, max_tokens=budget)
        assert 0 < SeamTokenizer().count(summary) <= budget
