from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from raptor_core._threads import limit_threads, recommended_threads
from raptor_core.build.clustering import GMMClusterer, _bic_gmm_soft, cluster_within_limit
from raptor_core.exceptions import InvalidInputError, InvalidParameterError
from raptor_core.types import Clusterer

# -- data ---------------------------------------------------------------------------------------


def blobs(seed: int, n_blobs: int = 3, per_blob: int = 20, d: int = 32) -> NDArray[np.float32]:
    """Well-separated Gaussian blobs; rows ``i * per_blob ...`` belong to blob ``i``."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(n_blobs, d)) * 10.0
    rows = [c + rng.normal(scale=0.3, size=(per_blob, d)) for c in centres]
    return np.vstack(rows).astype(np.float32)


def noisy_line(seed: int, n: int = 60, d: int = 16) -> NDArray[np.float32]:
    """Points spread evenly along a segment: mixture components fitted to it must overlap."""
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=d), rng.normal(size=d)
    t = np.linspace(0.0, 1.0, n)[:, None]
    return (a + (b - a) * t + 0.01 * rng.normal(size=(n, d))).astype(np.float32)


def covers_all(clusters: list[list[int]], n: int) -> bool:
    return sorted({i for c in clusters for i in c}) == list(range(n))


def assert_canonical(clusters: list[list[int]], n: int) -> None:
    assert covers_all(clusters, n)
    assert all(c == sorted(set(c)) and c for c in clusters)
    assert clusters == sorted(clusters)
    assert len({tuple(c) for c in clusters}) == len(clusters)


# -- GMMClusterer -------------------------------------------------------------------------------


def test_satisfies_protocol_and_stores_params() -> None:
    clusterer = GMMClusterer(threshold=0.2, random_state=3)
    assert isinstance(clusterer, Clusterer)
    assert clusterer.get_params()["threshold"] == 0.2
    assert "random_state=3" in repr(clusterer)
    # Invalid values are stored as given and only rejected when used (scikit-learn style).
    assert GMMClusterer(threshold=-1.0).threshold == -1.0


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 11, 12])
def test_small_inputs(n: int) -> None:
    vectors = np.random.default_rng(n).normal(size=(n, 24)).astype(np.float32)
    clusters = GMMClusterer(random_state=0).cluster(vectors)
    if n == 0:
        assert clusters == []
        return
    assert_canonical(clusters, n)
    if n <= 11:  # at most reduction_dim + 1 points: kept whole, as in the paper
        assert clusters == [list(range(n))]


@pytest.mark.parametrize(("n", "reduction_dim"), [(3, 1), (4, 2), (5, 1), (13, 2)])
def test_small_inputs_small_reduction(n: int, reduction_dim: int) -> None:
    vectors = np.random.default_rng(n).normal(size=(n, 24)).astype(np.float32)
    clusters = GMMClusterer(reduction_dim=reduction_dim, random_state=0).cluster(vectors)
    assert_canonical(clusters, n)


def test_empty_input_with_zero_columns() -> None:
    assert GMMClusterer().cluster(np.zeros((0, 0), dtype=np.float32)) == []


@pytest.mark.parametrize("n", [3, 12, 40])
def test_identical_vectors_form_one_cluster(n: int) -> None:
    vectors = np.tile(np.arange(1, 9, dtype=np.float32), (n, 1))
    assert GMMClusterer(random_state=0).cluster(vectors) == [list(range(n))]


def test_scaled_copies_are_identical_under_cosine() -> None:
    vectors = np.outer(np.arange(1, 21), np.ones(6)).astype(np.float32)
    assert GMMClusterer(random_state=0).cluster(vectors) == [list(range(20))]


@pytest.mark.parametrize("metric", ["cosine", "euclidean", "manhattan"])
def test_degenerate_data_never_crashes(metric: str) -> None:
    rng = np.random.default_rng(1)
    base = rng.normal(size=(10, 16)).astype(np.float32)
    vectors = np.vstack([base, base, base[:5]])  # exact duplicates
    vectors[:, :8] = 0.0  # zero-variance dimensions
    vectors[3] = 0.0  # a zero vector (no direction under cosine)
    clusters = GMMClusterer(metric=metric, random_state=0).cluster(vectors)
    assert_canonical(clusters, len(vectors))


def test_pca_fallback_when_umap_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    umap = pytest.importorskip("umap")

    def broken(self: object, x: object) -> None:
        msg = "spectral layout failed"
        raise ValueError(msg)

    monkeypatch.setattr(umap.UMAP, "fit_transform", broken)
    vectors = blobs(1, per_blob=15)
    clusters = GMMClusterer(random_state=0).cluster(vectors)
    assert_canonical(clusters, len(vectors))
    assert all(len({i // 15 for i in c}) == 1 for c in clusters)


def test_well_separated_blobs_are_never_mixed() -> None:
    vectors = blobs(0)
    clusters = GMMClusterer(random_state=0).cluster(vectors)
    assert_canonical(clusters, len(vectors))
    # The local step may split a blob further, but no cluster may straddle two blobs.
    assert all(len({i // 20 for i in c}) == 1 for c in clusters)
    assert len(clusters) >= 3


def test_soft_clustering_shares_members() -> None:
    # Along an evenly filled segment, neighbouring mixture components overlap, so points near
    # their boundary have posterior >= 0.1 for both and join both clusters.
    shared = 0
    for seed in (0, 1):
        vectors = noisy_line(seed)
        clusterer = GMMClusterer(
            reduction_dim=1,
            metric="euclidean",
            global_n_neighbors=15,
            local_n_neighbors=15,
            random_state=seed,
        )
        clusters = clusterer.cluster(vectors)
        assert_canonical(clusters, len(vectors))
        counts = np.bincount([i for c in clusters for i in c], minlength=len(vectors))
        shared += int((counts > 1).sum())
    assert shared > 0


def test_posterior_threshold_and_no_orphans() -> None:
    # Two overlapping 1-D Gaussians: the points between them pass the 0.1 threshold for both.
    rng = np.random.default_rng(0)
    reduced = np.concatenate([rng.normal(-2, 1, 200), rng.normal(2, 1, 200)])[:, None]
    clusters = _bic_gmm_soft(reduced, max_clusters=10, threshold=0.1, seed=0)
    assert len(clusters) == 2
    assert len(np.intersect1d(clusters[0], clusters[1])) > 0
    # A threshold above every posterior still leaves nobody out (argmax membership).
    strict = _bic_gmm_soft(reduced, max_clusters=10, threshold=1.0, seed=0)
    assert sorted(np.concatenate(strict).tolist()) == list(range(400))


def test_same_seed_same_clusters() -> None:
    vectors = blobs(2, per_blob=15)
    first = GMMClusterer(random_state=7).cluster(vectors)
    second = GMMClusterer(random_state=7).cluster(vectors)
    assert first == second


# Hashed vectors of 14 short texts on which UMAP's own spectral start (ARPACK) gave two
# clusterings, alternately, call after call in one process.
ARPACK_RESTARTS = [
    "beta eps rho nu rho",
    "rho zeta iota mu zeta sigma alpha pi",
    "eps xi theta pi tau zeta",
    "eps xi nu rho pi",
    "tau sigma gamma alpha kappa eta rho pi",
    "lambda mu rho alpha kappa",
    "iota sigma tau pi iota rho beta",
    "zeta eps nu omicron rho eps",
    "pi zeta beta omicron pi iota delta gamma",
    "omicron eta alpha xi omicron",
    "lambda theta kappa alpha",
    "eps lambda iota mu gamma eta",
    "omicron theta alpha xi kappa nu",
    "iota rho rho",
]


def _exhaust_arpack() -> None:
    # An eigsh call whose Krylov space is the whole matrix: ARPACK draws restart vectors
    # from its process-wide seed, as UMAP's spectral start did on small graphs.
    from scipy.sparse.linalg import eigsh

    eigsh(np.diag(np.repeat([1.0, 2.0, 3.0], 5)), k=6, which="SM", ncv=15, v0=np.ones(15))


def test_clusters_do_not_depend_on_earlier_calls_in_the_process() -> None:
    from raptor_core.testing import FakeEmbedder

    vectors = FakeEmbedder(dim=384).embed_documents(ARPACK_RESTARTS)
    results = []
    for _ in range(10):  # before the fix, two clusterings came back within a few calls
        results.append(GMMClusterer(random_state=0).cluster(vectors))
        _exhaust_arpack()
    assert all(r == results[0] for r in results)


def test_spectral_start_is_deterministic_and_sign_fixed() -> None:
    from raptor_core.build.clustering import _exact_knn, _load_umap, _spectral_start

    umap = _load_umap()
    vectors = blobs(1, n_blobs=1, per_blob=40)
    indices, distances, _ = _exact_knn(vectors, 10, "cosine")
    first = _spectral_start(umap, vectors, (indices, distances), 5, "cosine", seed=3)
    _exhaust_arpack()
    again = _spectral_start(umap, vectors, (indices, distances), 5, "cosine", seed=3)
    assert first is not None and again is not None
    assert first.shape == (40, 5) and first.dtype == np.float32
    assert np.array_equal(first, again)
    # Scaled as UMAP scales its own start; each column's largest entry is positive.
    assert np.abs(first).max() == pytest.approx(10.0, abs=1e-3)
    pivots = np.argmax(np.abs(first), axis=0)
    assert np.all(first[pivots, np.arange(5)] > 0)


def test_spectral_start_declines_a_graph_of_several_components() -> None:
    from raptor_core.build.clustering import _exact_knn, _load_umap, _spectral_start

    umap = _load_umap()
    vectors = blobs(2, n_blobs=2, per_blob=15)
    # Each point's neighbours only within its own blob: two components.
    indices, distances, _ = _exact_knn(vectors, 5, "cosine")
    assert _spectral_start(umap, vectors, (indices, distances), 5, "cosine", seed=0) is None
    # ... and the clusterer still lays them out (from PCA's start) and keeps them apart.
    clusters = GMMClusterer(random_state=0, global_n_neighbors=5).cluster(vectors)
    assert_canonical(clusters, 30)
    assert all(max(c) < 15 or min(c) >= 15 for c in clusters)


def test_different_seeds_are_allowed_to_differ() -> None:
    vectors = noisy_line(3)
    results = [GMMClusterer(random_state=s).cluster(vectors) for s in (0, 1)]
    for clusters in results:  # both valid; equality is not required either way
        assert_canonical(clusters, len(vectors))


def test_same_result_under_any_thread_limit() -> None:
    vectors = blobs(4, per_blob=15)
    with limit_threads(1):
        capped = GMMClusterer(random_state=1).cluster(vectors)
    assert GMMClusterer(random_state=1).cluster(vectors) == capped


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"reduction_dim": 0}, "reduction_dim"),
        ({"reduction_dim": 2.5}, "reduction_dim"),
        ({"threshold": 0.0}, "threshold"),
        ({"threshold": 1.5}, "threshold"),
        ({"threshold": "0.1"}, "threshold"),
        ({"max_clusters": 0}, "max_clusters"),
        ({"global_n_neighbors": 1}, "global_n_neighbors"),
        ({"local_n_neighbors": True}, "local_n_neighbors"),
        ({"metric": "hamming"}, "metric"),
        ({"random_state": "seed"}, "random_state"),
    ],
)
def test_invalid_params_raise(params: dict[str, object], match: str) -> None:
    clusterer = GMMClusterer(**params)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match=match):
        clusterer.cluster(np.zeros((4, 3), dtype=np.float32))


@pytest.mark.parametrize(
    "vectors",
    [np.zeros(5, dtype=np.float32), np.array([[1.0, np.nan], [0.0, 1.0]]), np.zeros((3, 0))],
)
def test_invalid_vectors_raise(vectors: NDArray[np.float32]) -> None:
    with pytest.raises(InvalidInputError):
        GMMClusterer().cluster(vectors)


# -- cluster_within_limit -----------------------------------------------------------------------


class OneCluster:
    """Never makes progress: everything in one cluster."""

    def __init__(self) -> None:
        self.calls = 0

    def cluster(self, vectors: NDArray[np.float32]) -> list[list[int]]:
        self.calls += 1
        return [list(range(len(vectors)))]


class Halves:
    """Splits by order, with the middle row in both halves (soft membership)."""

    def cluster(self, vectors: NDArray[np.float32]) -> list[list[int]]:
        n = len(vectors)
        if n < 2:
            return [list(range(n))]
        mid = n // 2
        return [list(range(mid + 1)), list(range(mid, n))]


class Forgetful:
    """Leaves the last row out of every clustering."""

    def cluster(self, vectors: NDArray[np.float32]) -> list[list[int]]:
        return [list(range(len(vectors) - 1))] if len(vectors) > 1 else [[0]]


def check_limit(clusters: list[list[int]], tokens: list[int], limit: int) -> None:
    assert covers_all(clusters, len(tokens))
    for c in clusters:
        assert c == sorted(set(c)) and c
        if len(c) >= 2:
            assert sum(tokens[i] for i in c) <= limit


@pytest.mark.parametrize("clusterer", [OneCluster(), Halves(), Forgetful()])
def test_limit_with_fake_clusterers(clusterer: Clusterer) -> None:
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(40, 5)).astype(np.float32)
    tokens = rng.integers(1, 60, size=40).tolist()
    clusters = cluster_within_limit(clusterer, vectors, tokens, 100)
    check_limit(clusters, tokens, 100)
    assert cluster_within_limit(clusterer, vectors, tokens, 100) == clusters  # deterministic


def test_one_cluster_clusterer_terminates_on_identical_vectors() -> None:
    vectors = np.ones((64, 4), dtype=np.float32)
    tokens = [10] * 64
    fake = OneCluster()
    clusters = cluster_within_limit(fake, vectors, tokens, 25)
    check_limit(clusters, tokens, 25)
    assert fake.calls < 200


def test_oversized_row_becomes_its_own_cluster() -> None:
    vectors = np.random.default_rng(0).normal(size=(6, 3)).astype(np.float32)
    tokens = [10, 500, 10, 10, 10, 10]
    clusters = cluster_within_limit(OneCluster(), vectors, tokens, 100)
    assert [1] in clusters
    check_limit(clusters, tokens, 100)


def test_fitting_clusters_are_left_alone() -> None:
    vectors = np.zeros((4, 2), dtype=np.float32)
    clusters = cluster_within_limit(Halves(), vectors, [1, 1, 1, 1], 100)
    assert clusters == [[0, 1, 2], [2, 3]]


def test_limit_with_real_clusterer() -> None:
    vectors = blobs(5, per_blob=15)
    tokens = [40] * len(vectors)
    clusters = cluster_within_limit(GMMClusterer(random_state=0), vectors, tokens, 120)
    check_limit(clusters, tokens, 120)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=60),
    limit=st.integers(min_value=1, max_value=400),
    seed=st.integers(min_value=0, max_value=3),
)
def test_limit_property(tokens: list[int], limit: int, seed: int) -> None:
    vectors = np.random.default_rng(seed).normal(size=(len(tokens), 4)).astype(np.float32)
    for clusterer in (OneCluster(), Halves()):
        check_limit(cluster_within_limit(clusterer, vectors, tokens, limit), tokens, limit)


def test_limit_empty_input() -> None:
    assert cluster_within_limit(OneCluster(), np.zeros((0, 3), np.float32), [], 10) == []


@pytest.mark.parametrize(
    ("tokens", "limit", "error"),
    [
        ([1, 2], 0, InvalidParameterError),
        ([1, 2], 2.5, InvalidParameterError),
        ([1], 10, InvalidInputError),
        ([1, -2], 10, InvalidInputError),
    ],
)
def test_limit_invalid_arguments(tokens: list[int], limit: int, error: type[Exception]) -> None:
    with pytest.raises(error):
        cluster_within_limit(OneCluster(), np.zeros((2, 3), np.float32), tokens, limit)


def test_limit_rejects_out_of_range_indices() -> None:
    class Broken:
        def cluster(self, vectors: NDArray[np.float32]) -> list[list[int]]:
            return [[0, len(vectors)]]

    with pytest.raises(InvalidParameterError, match="outside"):
        cluster_within_limit(Broken(), np.zeros((3, 2), np.float32), [1, 1, 1], 10)


# -- threads ------------------------------------------------------------------------------------


def test_recommended_threads_is_positive() -> None:
    assert recommended_threads() >= 1


class FakeTorch(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("torch")
        self.threads = 4

    def get_num_threads(self) -> int:
        return self.threads

    def set_num_threads(self, n: int) -> None:
        self.threads = n


def test_limit_threads_caps_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    import numba
    from threadpoolctl import threadpool_info

    torch = FakeTorch()  # the real one takes seconds to import; only the seam matters here
    monkeypatch.setitem(sys.modules, "torch", torch)
    before_numba = numba.get_num_threads()
    with limit_threads(1):
        assert torch.threads == 1
        assert numba.get_num_threads() == 1
        assert all(pool["num_threads"] == 1 for pool in threadpool_info())
    assert torch.threads == 4
    assert numba.get_num_threads() == before_numba


def test_limit_threads_never_imports_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    with limit_threads(1):
        pass
    assert "torch" not in sys.modules


def test_limit_threads_none_and_invalid() -> None:
    with limit_threads(None):
        pass
    with pytest.raises(InvalidParameterError), limit_threads(0):
        pass
