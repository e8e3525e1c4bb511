"""Executors: results in input order, typed errors naming the stage, the same tree as without one.

Ray itself is exercised in tests/integration/test_ray_real.py; here a fake executor stands in
for a cluster (it runs the work out of order and through pickle, as workers would).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from raptor_core.build.builder import TreeBuilder
from raptor_core.build.executors import (
    BuildStageError,
    Executor,
    LocalExecutor,
    Shipped,
    component_spec,
    stage_error,
)
from raptor_core.exceptions import (
    EmbeddingError,
    InvalidParameterError,
    LLMAuthenticationError,
    MissingDependencyError,
    SummarizationError,
)
from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer

T = TypeVar("T")
R = TypeVar("R")

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    {"doc_id": name, "text": text}
    for name, text in {
        "cats": "Cats purr softly. Cats sleep in the sun. Kittens chase string. A cat grooms.",
        "rockets": "Rockets burn fuel. Rockets reach orbit. Satellites circle the earth.",
        "bread": "Bakers knead dough. Yeast makes bread rise. Ovens bake loaves. Crust browns.",
        "bees": "Bees visit flowers. Bees make honey. Hives hum in summer. Pollen sticks.",
    }.items()
]


class ShuffledExecutor:
    """A stand-in cluster: runs items last-first on pickled copies, returns them in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int | None]] = []
        self.batch_sizes: list[int] = []

    def map_batches(self, fn: Callable[[T], R], batches: Sequence[T], *, stage: str) -> list[R]:
        self.calls.append((stage, len(batches), None))
        if stage == "embed":
            self.batch_sizes.extend(len(b) for b in batches)  # type: ignore[arg-type]
        remote = pickle.loads(pickle.dumps(fn))  # what a worker gets
        out: dict[int, R] = {}
        for i in reversed(range(len(batches))):
            out[i] = remote(batches[i])
        return [out[i] for i in range(len(batches))]

    def map_tasks(
        self,
        fn: Callable[[T], R],
        items: Sequence[T],
        *,
        stage: str,
        max_concurrency: int | None = None,
    ) -> list[R]:
        self.calls.append((stage, len(items), max_concurrency))
        remote = pickle.loads(pickle.dumps(fn))
        out = {i: remote(items[i]) for i in reversed(range(len(items)))}
        return [out[i] for i in range(len(items))]


def builder(executor: object = None, **kwargs: Any) -> TreeBuilder:
    return TreeBuilder(
        FakeEmbedder(),
        kwargs.pop("summarizer", None) or EchoSummarizer(),
        tokenizer=WhitespaceTokenizer(),
        chunk_max_tokens=8,
        summary_max_tokens=12,
        cluster_max_tokens=40,
        random_state=0,
        executor=executor,  # type: ignore[arg-type]
        **kwargs,
    )


def assert_same_tree(a: Any, b: Any) -> None:
    assert [n.id for n in a.nodes] == [n.id for n in b.nodes]
    assert [n.text for n in a.nodes] == [n.text for n in b.nodes]
    assert [n.children for n in a.nodes] == [n.children for n in b.nodes]
    np.testing.assert_allclose(a.embeddings, b.embeddings, atol=1e-6)


# -- LocalExecutor ------------------------------------------------------------------------------
def test_local_executor_is_an_executor() -> None:
    assert isinstance(LocalExecutor(), Executor)
    assert isinstance(ShuffledExecutor(), Executor)


def test_local_map_tasks_keeps_input_order_when_later_items_finish_first() -> None:
    first_may_finish = threading.Event()
    finished: list[int] = []

    def work(i: int) -> int:
        if i == 0:
            assert first_may_finish.wait(10)
        finished.append(i)
        if i == 2:
            first_may_finish.set()
        return i * 10

    out = LocalExecutor().map_tasks(work, [0, 1, 2], stage="demo", max_concurrency=3)
    assert out == [0, 10, 20]
    assert finished[-1] == 0  # it really finished last


def test_local_map_batches_in_order() -> None:
    assert LocalExecutor().map_batches(sum, [[1, 2], [3], [4, 5, 6]], stage="demo") == [3, 3, 15]


@pytest.mark.parametrize(
    ("stage", "error"),
    [("embed", EmbeddingError), ("summarize", SummarizationError), ("chunk", BuildStageError)],
)
def test_local_failures_raise_the_stage_type_and_name_the_stage(
    stage: str, error: type[Exception]
) -> None:
    with pytest.raises(error, match=rf"{stage} stage, batch 2 of 3 failed: ValueError") as info:
        LocalExecutor().map_batches(int, ["1", "x", "3"], stage=stage)
    assert isinstance(info.value.__cause__, ValueError)
    if isinstance(info.value, BuildStageError):
        assert info.value.stage == stage


def test_a_typed_error_keeps_its_type_with_the_stage_prefixed() -> None:
    def refuse(_: object) -> None:
        raise LLMAuthenticationError("bad key")

    with pytest.raises(LLMAuthenticationError, match=r"^summarize stage, item 1 of 2: bad key"):
        LocalExecutor().map_tasks(refuse, [1, 2], stage="summarize", max_concurrency=2)


def test_local_map_tasks_starts_nothing_after_a_failure() -> None:
    seen: list[int] = []

    def work(i: int) -> int:
        seen.append(i)
        if i == 1:
            raise ValueError("boom")
        return i

    with pytest.raises(SummarizationError, match="item 2 of 5"):
        LocalExecutor().map_tasks(work, range(5), stage="summarize", max_concurrency=1)  # type: ignore[arg-type]
    assert seen == [0, 1]


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_bad_max_concurrency(bad: object) -> None:
    with pytest.raises(InvalidParameterError, match="max_concurrency"):
        LocalExecutor().map_tasks(str, [1], stage="demo", max_concurrency=bad)  # type: ignore[arg-type]


def test_stage_errors_survive_pickling() -> None:
    error = stage_error("cluster", "item 1 of 1", ValueError("x"))
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, BuildStageError)
    assert copy.stage == "cluster"
    assert str(copy) == str(error)


def test_map_tasks_fits_the_map_fn_hook() -> None:
    # The bucketed clustering hook is ``map_fn(fn, items) -> list``.
    import functools

    map_fn = functools.partial(LocalExecutor().map_tasks, stage="cluster", max_concurrency=None)
    assert map_fn(len, ["ab", "c"]) == [2, 1]


# -- shipping components ------------------------------------------------------------------------
def test_an_allowlisted_embedder_travels_as_its_spec_and_is_built_once_per_process() -> None:
    embedder = FakeEmbedder(dim=24)
    embedder.embed_documents(["state that must not travel"])
    assert component_spec(embedder) == {"class": "raptor_core.testing.FakeEmbedder", "dim": 24}
    payload = pickle.dumps(Shipped(embedder))
    first = pickle.loads(payload).component
    second = pickle.loads(pickle.dumps(Shipped(FakeEmbedder(dim=24)))).component
    assert isinstance(first, FakeEmbedder)
    assert first.dim == 24
    assert first.calls == 0  # re-created from the spec, not a pickled copy
    assert first is second  # once per worker process


def test_a_component_off_the_allowlist_pickles_as_itself() -> None:
    summarizer = EchoSummarizer()
    summarizer.summarize(["a b"], max_tokens=1)
    assert component_spec(summarizer) is None
    copy = pickle.loads(pickle.dumps(Shipped(summarizer))).component
    assert isinstance(copy, EchoSummarizer)
    assert copy.calls == summarizer.calls


def test_a_model_at_a_local_path_has_no_spec(tmp_path: Path) -> None:
    from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder

    assert component_spec(SentenceTransformerEmbedder(str(tmp_path))) is None
    spec = component_spec(SentenceTransformerEmbedder(device="cpu", batch_size=8))
    assert spec is not None
    assert spec["class"].endswith("SentenceTransformerEmbedder")


# -- the builder through an executor ------------------------------------------------------------
def test_the_tree_is_the_same_with_any_executor() -> None:
    plain = builder().build(DOCS)
    local = builder(LocalExecutor()).build(DOCS)
    shuffled_executor = ShuffledExecutor()
    shuffled = builder(shuffled_executor).build(DOCS)
    assert plain.num_layers > 1
    assert_same_tree(plain, local)
    assert_same_tree(plain, shuffled)
    stages = {stage for stage, _, _ in shuffled_executor.calls}
    assert stages == {"chunk", "embed", "summarize"}
    summaries = [c for c in shuffled_executor.calls if c[0] == "summarize"]
    assert all(limit == 4 for _, _, limit in summaries)  # the builder's max_concurrency


def test_cluster_buckets_run_on_the_executor() -> None:
    from raptor_core.build.clustering import GMMClusterer

    def bucketed() -> GMMClusterer:
        return GMMClusterer(random_state=0, bucket_size=22)  # the smallest allowed

    docs = [
        {"doc_id": f"{d['doc_id']}-{i}", "text": f"{d['text']} {d['text'].upper()} Part {i}."}
        for i in range(3)
        for d in DOCS
    ]
    plain = builder(clusterer=bucketed()).build(docs)
    assert len(plain.leaves) > 22
    shuffled_executor = ShuffledExecutor()
    shuffled = builder(shuffled_executor, clusterer=bucketed()).build(docs)
    assert_same_tree(plain, shuffled)
    buckets = [n for stage, n, _ in shuffled_executor.calls if stage == "cluster"]
    assert buckets, "the leaf layer is larger than bucket_size: its buckets go to the executor"
    assert all(n >= 2 for n in buckets)


def test_embedding_batches_are_the_builders_256() -> None:
    docs = [
        {"doc_id": f"d{i}", "text": f"Word{i} alpha{i % 7}. Beta{i % 5} gamma."} for i in range(300)
    ]
    executor = ShuffledExecutor()
    builder(executor, max_layers=0).build(docs)
    assert executor.batch_sizes[0] == 256
    assert sum(executor.batch_sizes) == 300


def test_work_runs_on_the_workers_copies() -> None:
    # Everything went through pickle: the driver's own summariser was never called.
    summarizer = EchoSummarizer()
    tree = builder(ShuffledExecutor(), summarizer=summarizer).build(DOCS)
    assert tree.num_layers > 1
    assert summarizer.calls == []


def test_a_summariser_with_its_own_batch_stays_in_the_driver() -> None:
    from raptor_core.build.summarizers import ExtractiveSummarizer

    executor = ShuffledExecutor()
    summarizer = ExtractiveSummarizer(FakeEmbedder(), tokenizer=WhitespaceTokenizer())
    tree = builder(executor, summarizer=summarizer).build(DOCS)
    assert tree.num_layers > 1
    assert "summarize" not in {stage for stage, _, _ in executor.calls}


class FailingEmbedExecutor(ShuffledExecutor):
    def map_batches(self, fn: Callable[[T], R], batches: Sequence[T], *, stage: str) -> list[R]:
        if stage == "embed":
            return LocalExecutor().map_batches(_explode, batches, stage=stage)  # type: ignore[arg-type]
        return super().map_batches(fn, batches, stage=stage)


def _explode(_: object) -> object:
    raise RuntimeError("GPU fell off")


def test_an_executor_failure_names_layer_and_stage() -> None:
    with pytest.raises(EmbeddingError, match=r"layer 0.*embed stage, batch 1 of 1.*GPU fell off"):
        builder(FailingEmbedExecutor()).build(DOCS)


def test_an_executor_must_have_both_methods() -> None:
    with pytest.raises(InvalidParameterError, match="map_batches and map_tasks"):
        builder(object()).build(DOCS)


def test_the_cache_is_shared_with_builds_without_an_executor(tmp_path: Path) -> None:
    from raptor_core.build.cache import BuildCache

    first = builder(ShuffledExecutor(), cache=tmp_path / "cache").build(DOCS)

    # A plain build with the same components: every summary must come from the cache that
    # the executor's build filled (the keys are the raw summariser's, not its wrapper's).
    with BuildCache(tmp_path / "cache") as cache:
        again = TreeBuilder(
            FakeEmbedder(),
            EchoSummarizer(),
            tokenizer=WhitespaceTokenizer(),
            chunk_max_tokens=8,
            summary_max_tokens=12,
            cluster_max_tokens=40,
            random_state=0,
            cache=cache,
        ).build(DOCS)
        usage = again.build_info["usage"]["summarize"]
    assert usage["cache_misses"] == 0
    assert usage["cache_hits"] > 0
    assert_same_tree(first, again)


def test_incremental_updates_go_through_the_executor_too() -> None:
    executor = ShuffledExecutor()
    b = builder(executor)
    tree = b.build(DOCS[:3])
    executor.calls.clear()
    grown = b.insert(tree, DOCS[3:]).tree
    plain = builder().insert(builder().build(DOCS[:3]), DOCS[3:]).tree
    assert_same_tree(grown, plain)
    assert {"chunk", "embed"} <= {stage for stage, _, _ in executor.calls}


# -- Ray as an optional extra -------------------------------------------------------------------
def test_ray_executor_without_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from raptor_core.build.ray_executor import RayExecutor

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(MissingDependencyError, match=r"raptor-retriever\[ray\]"):
        RayExecutor().map_tasks(str, [1], stage="demo")
    with pytest.raises(MissingDependencyError, match=r"raptor-retriever\[ray\]"):
        builder(RayExecutor()).build(DOCS)


def test_cli_ray_without_ray_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from raptor_core.cli import main

    (tmp_path / "a.txt").write_text("Cats purr. Dogs bark. Birds sing.", encoding="utf-8")
    monkeypatch.setitem(sys.modules, "ray", None)
    code = main(["build", str(tmp_path / "a.txt"), "--out", str(tmp_path / "t"), "--ray", "auto"])
    assert code == 1
    assert "raptor-retriever[ray]" in capsys.readouterr().err
    assert not (tmp_path / "t" / "tree.json").exists()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_gpus": -1}, "num_gpus"),
        ({"num_cpus_per_task": float("inf")}, "num_cpus_per_task"),
        ({"batch_size": 0}, "batch_size"),
        ({"concurrency": True}, "concurrency"),
        ({"address": ""}, "address"),
    ],
)
def test_ray_executor_parameters_are_checked_before_ray_starts(
    kwargs: dict[str, Any], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from raptor_core.build.ray_executor import RayExecutor

    monkeypatch.setitem(sys.modules, "ray", None)  # validation comes first: no Ray needed
    with pytest.raises(InvalidParameterError, match=name):
        RayExecutor(**kwargs).map_tasks(str, [1], stage="demo")


def test_importing_executors_does_not_import_ray() -> None:
    code = (
        "import sys, json\n"
        "import raptor_core\n"
        "from raptor_core.build.ray_executor import RayExecutor\n"
        "from raptor_core.build.executors import LocalExecutor\n"
        "from raptor_core import TreeBuilder\n"
        "TreeBuilder(executor=RayExecutor('auto'))\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'ray')))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


class SpanFake(FakeEmbedder):
    """FakeEmbedder with spans (a SpanEmbedder), counting the calls made on this copy."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__(dim)
        self.span_calls = 0

    def embed_spans(
        self, texts: Sequence[str], spans: Sequence[Sequence[tuple[int, int]]]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        self.span_calls += 1
        rows = [
            np.stack([self._vector(t[a:b]) for a, b in s]) if s else np.zeros((0, self.dim))
            for t, s in zip(texts, spans, strict=True)
        ]
        return np.stack([self._vector(t) for t in texts]), rows


def test_the_extractive_summariser_gets_its_sentence_vectors_from_the_workers() -> None:
    from raptor_core.build.summarizers import ExtractiveSummarizer

    def build(executor: object) -> tuple[Any, SpanFake]:
        span = SpanFake()
        summarizer = ExtractiveSummarizer(span, tokenizer=WhitespaceTokenizer())
        tree = TreeBuilder(
            span,
            summarizer,
            tokenizer=WhitespaceTokenizer(),
            chunk_max_tokens=8,
            cluster_max_tokens=40,
            random_state=0,
            executor=executor,  # type: ignore[arg-type]
        ).build(DOCS)
        return tree, span

    plain, local_span = build(None)
    shuffled, driver_span = build(ShuffledExecutor())
    assert plain.num_layers > 1
    assert local_span.span_calls > 0  # the local build tapped its own forward passes
    assert_same_tree(plain, shuffled)
    # On the executor the span passes ran on the workers' copies, and the summariser found
    # every sentence vector it needed in what they sent back: nothing was embedded here.
    assert driver_span.span_calls == 0
    assert driver_span.calls == 0
