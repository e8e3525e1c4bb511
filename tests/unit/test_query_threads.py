"""The query path uses no BLAS thread pool and embeds a query on one torch thread."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from raptor_core._threads import matvec, single_torch_thread
from raptor_core.backends.numpy_index import NumpyIndex
from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder
from raptor_core.store.memory import InMemoryNodeStore
from raptor_core.testing import tiny_tree


def test_matvec_is_the_matrix_product() -> None:
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((1000, 48)).astype(np.float32)
    vector = rng.standard_normal(48).astype(np.float32)
    out = matvec(matrix, vector)
    assert out.shape == (1000,) and out.dtype == np.float32
    np.testing.assert_allclose(out, matrix @ vector, rtol=1e-4, atol=1e-4)
    # A memory-mapped or strided matrix (a loaded tree, a row subset) works the same.
    np.testing.assert_allclose(matvec(matrix[::3], vector), matrix[::3] @ vector, atol=1e-4)


def test_the_store_scores_through_matvec(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-memory store's search computes its scores with matvec (no BLAS thread pool)."""
    import raptor_core.store.memory as memory

    tree = tiny_tree()
    store = InMemoryNodeStore.from_tree(tree)
    query = tree.embeddings[0]
    expected = np.argsort(-(tree.embeddings @ query), kind="stable")[:3]
    seen: list[tuple[int, ...]] = []

    def counting_matvec(matrix: Any, vector: Any) -> Any:
        seen.append(matrix.shape)
        return matvec(matrix, vector)

    monkeypatch.setattr(memory, "matvec", counting_matvec)
    got = store.search(query, 3)
    assert [m.node.id for m in got] == [tree.nodes[int(i)].id for i in expected]
    assert seen == [tree.embeddings.shape]


def test_numpy_index_ranks_as_brute_force() -> None:
    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((500, 16)).astype(np.float32)
    index = NumpyIndex()
    index.add([f"n{i}" for i in range(500)], vectors)
    query = rng.standard_normal(16).astype(np.float32)
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    expected = np.argsort(-(unit @ query))[:5]
    assert [i for i, _ in index.search(query, 5)] == [f"n{i}" for i in expected]


torch = pytest.importorskip("torch")


@pytest.fixture
def two_torch_threads() -> Any:
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.mark.usefixtures("two_torch_threads")
def test_single_torch_thread_caps_and_restores() -> None:
    with single_torch_thread():
        assert torch.get_num_threads() == 1
        with single_torch_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1  # the outer block is still open
    assert torch.get_num_threads() == 2


@pytest.mark.usefixtures("two_torch_threads")
def test_overlapping_blocks_from_threads_leave_the_setting_unchanged() -> None:
    """Blocks that open and close out of order (concurrent queries) restore the count once."""
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    inside: list[int] = []

    def first() -> None:
        with single_torch_thread():
            first_in.set()
            second_in.wait(5)
            inside.append(torch.get_num_threads())
        first_out.set()

    def second() -> None:
        first_in.wait(5)
        with single_torch_thread():
            second_in.set()
            first_out.wait(5)  # the first block has closed; this one is still open
            inside.append(torch.get_num_threads())

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert inside == [1, 1]
    assert torch.get_num_threads() == 2


@pytest.mark.usefixtures("two_torch_threads")
def test_a_cpu_query_is_embedded_on_one_thread(
    st_embedder: SentenceTransformerEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    embedder = SentenceTransformerEmbedder(device="cpu")
    seen: list[int] = []
    real_encode = embedder.model.encode

    def encode(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(embedder.model, "encode", encode)
    query = embedder.embed_query("where do cats sleep?")
    documents = embedder.embed_documents(["where do cats sleep?"])
    assert seen == [1, 2]  # the query on one thread; documents keep torch's pool
    np.testing.assert_allclose(query, documents[0], atol=1e-5)
    assert torch.get_num_threads() == 2


def test_a_faiss_search_runs_on_one_openmp_thread_in_the_calling_thread_only() -> None:
    faiss = pytest.importorskip("faiss")
    from raptor_core._threads import single_omp_thread
    from raptor_core.backends.faiss_index import FaissIndex

    previous = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(2)
    try:
        counts: list[int] = []

        def count_in_another_thread() -> None:
            t = threading.Thread(target=lambda: counts.append(faiss.omp_get_max_threads()))
            t.start()
            t.join()

        count_in_another_thread()
        with single_omp_thread(faiss):
            assert faiss.omp_get_max_threads() == 1
            count_in_another_thread()  # OpenMP's count is per thread: the other keeps its own
        assert faiss.omp_get_max_threads() == 2
        assert counts[0] == counts[1]

        rng = np.random.default_rng(2)
        vectors = rng.standard_normal((300, 8)).astype(np.float32)
        index = FaissIndex()
        index.add([f"n{i}" for i in range(300)], vectors)
        exact = NumpyIndex()
        exact.add([f"n{i}" for i in range(300)], vectors)
        query = rng.standard_normal(8).astype(np.float32)
        assert [i for i, _ in index.search(query, 5)] == [i for i, _ in exact.search(query, 5)]
        assert faiss.omp_get_max_threads() == 2
    finally:
        faiss.omp_set_num_threads(previous)
