"""Bucketed clustering (issue 16): large inputs are pre-partitioned and clustered per bucket."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import pytest
from numpy.typing import NDArray

import raptor_core.build.clustering as clustering
from raptor_core.build.clustering import (
    BucketJob,
    GMMClusterer,
    _partition,
    cluster_bucket,
    cluster_within_limit,
)
from raptor_core.exceptions import InvalidParameterError
from raptor_core.testing import GroupClusterer

T = TypeVar("T")
R = TypeVar("R")


def labelled_blobs(
    seed: int, n_blobs: int = 8, per_blob: int = 30, d: int = 32
) -> tuple[NDArray[np.float32], NDArray[np.intp]]:
    """Well-separated blobs, rows shuffled; also each row's blob."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(n_blobs, d)) * 10.0
    rows = np.vstack([c + rng.normal(scale=0.3, size=(per_blob, d)) for c in centres])
    order = rng.permutation(len(rows))
    labels = np.repeat(np.arange(n_blobs), per_blob)
    return rows[order].astype(np.float32), labels[order]


def blobs(seed: int) -> NDArray[np.float32]:
    return labelled_blobs(seed)[0]


class RecordingMap:
    """A map_fn that records its jobs and runs them in reverse order (results kept in order)."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []

    def __call__(self, fn: Callable[[T], R], items: Sequence[T], /) -> list[R]:
        self.calls.append(list(items))
        results = {i: fn(items[i]) for i in reversed(range(len(items)))}
        return [results[i] for i in range(len(items))]


def covers(clusters: list[list[int]], n: int) -> bool:
    return sorted({i for c in clusters for i in c}) == list(range(n))


# -- the pre-partition --------------------------------------------------------------------------


@pytest.mark.parametrize("metric", ["cosine", "euclidean", "manhattan"])
def test_partition_is_a_bounded_deterministic_partition(metric: str) -> None:
    x = blobs(0)
    parts = _partition(x, 80, metric, seed=5)
    assert len(parts) >= 3
    assert all(0 < len(p) <= 80 for p in parts)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(x)))
    assert all(np.all(np.diff(p) > 0) for p in parts)  # sorted rows
    assert [int(p[0]) for p in parts] == sorted(int(p[0]) for p in parts)
    again = _partition(x, 80, metric, seed=5)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def test_partition_keeps_near_rows_together() -> None:
    x, labels = labelled_blobs(1)
    parts = _partition(x, 80, "cosine", seed=0)
    # Every blob (30 rows, far from the others) lies in a single bucket.
    for blob in range(8):
        holders = {
            i for i, p in enumerate(parts) if np.isin(np.flatnonzero(labels == blob), p).any()
        }
        assert len(holders) == 1


def test_partition_of_identical_rows_cuts_in_order() -> None:
    x = np.ones((100, 8), dtype=np.float32)
    parts = _partition(x, 30, "cosine", seed=0)
    assert all(len(p) <= 30 for p in parts)
    assert np.array_equal(np.concatenate(parts), np.arange(100))


def test_partition_of_a_small_input_is_one_bucket() -> None:
    parts = _partition(blobs(0), 240, "cosine", seed=0)
    assert len(parts) == 1 and np.array_equal(parts[0], np.arange(240))


# -- GMMClusterer with buckets ------------------------------------------------------------------


def test_bucketing_only_past_the_threshold() -> None:
    x = blobs(2)
    record = RecordingMap()
    whole = GMMClusterer(random_state=0, bucket_size=None).cluster(x)
    # At the threshold the input is clustered whole, exactly as without buckets.
    assert GMMClusterer(random_state=0, bucket_size=240).cluster(x, map_fn=record) == whole
    assert record.calls == []
    bucketed = GMMClusterer(random_state=0, bucket_size=239).cluster(x, map_fn=record)
    assert len(record.calls) == 1
    jobs = record.calls[0]
    assert len(jobs) >= 2 and all(isinstance(j, BucketJob) for j in jobs)
    assert all(len(j.vectors) <= 239 for j in jobs)
    assert sum(len(j.vectors) for j in jobs) == len(x)
    assert covers(bucketed, len(x))


def test_bucketed_clusters_cover_every_row_and_stay_inside_buckets() -> None:
    x, labels = labelled_blobs(3)
    clusters = GMMClusterer(random_state=1, bucket_size=80).cluster(x)
    assert covers(clusters, len(x))
    assert clusters == sorted(clusters)
    assert all(c == sorted(set(c)) for c in clusters)
    rng = np.random.default_rng(1)
    parts = _partition(x, 80, "cosine", int(rng.integers(0, 2**31 - 1)))
    bucket_of = np.empty(len(x), dtype=np.intp)
    for b, rows in enumerate(parts):
        bucket_of[rows] = b
    assert all(len(set(bucket_of[c].tolist())) == 1 for c in clusters)
    # Separated blobs are still found: no cluster mixes two blobs.
    assert all(len(set(labels[c].tolist())) == 1 for c in clusters)


def test_bucketed_is_deterministic_and_independent_of_map_order() -> None:
    x = blobs(4)
    clusterer = GMMClusterer(random_state=7, bucket_size=80)
    serial = clusterer.cluster(x)
    assert clusterer.cluster(x) == serial
    record = RecordingMap()  # runs the buckets last to first
    assert clusterer.cluster(x, map_fn=record) == serial
    assert len(record.calls) == 1 and len(record.calls[0]) >= 3


def test_bucket_jobs_are_self_contained_and_picklable() -> None:
    x = blobs(5)
    record = RecordingMap()
    GMMClusterer(random_state=3, bucket_size=80, threshold=0.2).cluster(x, map_fn=record)
    job = record.calls[0][0]
    assert job.params["threshold"] == 0.2
    copy = pickle.loads(pickle.dumps(job))
    assert pickle.loads(pickle.dumps(cluster_bucket)) is cluster_bucket
    assert cluster_bucket(copy) == cluster_bucket(job)


def test_map_fn_must_return_one_result_per_job() -> None:
    def lossy(fn: Callable[[T], R], items: Sequence[T], /) -> list[R]:
        return [fn(items[0])]

    with pytest.raises(InvalidParameterError, match="one per item"):
        GMMClusterer(random_state=0, bucket_size=80).cluster(blobs(0), map_fn=lossy)


@pytest.mark.parametrize("bucket_size", [21, 0, -5, 3.5, True, "100"])
def test_bucket_size_is_validated_when_used(bucket_size: Any) -> None:
    clusterer = GMMClusterer(bucket_size=bucket_size)
    assert clusterer.bucket_size is bucket_size  # stored as given
    with pytest.raises(InvalidParameterError, match="bucket_size"):
        clusterer.cluster(blobs(0))


def test_bucket_size_is_a_recorded_parameter() -> None:
    assert GMMClusterer().get_params()["bucket_size"] == clustering.DEFAULT_BUCKET_SIZE == 2000
    assert "bucket_size=None" in repr(GMMClusterer(bucket_size=None))


# -- cluster_within_limit passes map_fn on ------------------------------------------------------


def test_cluster_within_limit_forwards_map_fn() -> None:
    x = blobs(6)
    record = RecordingMap()
    clusterer = GMMClusterer(random_state=0, bucket_size=80)
    tokens = [10] * len(x)
    with_map = cluster_within_limit(clusterer, x, tokens, 400, map_fn=record)
    assert record.calls and len(record.calls[0]) >= 3
    assert with_map == cluster_within_limit(clusterer, x, tokens, 400)
    assert covers(with_map, len(x))


def test_cluster_within_limit_leaves_other_clusterers_alone() -> None:
    record = RecordingMap()
    x = blobs(0)[:30]
    clusters = cluster_within_limit(GroupClusterer(3), x, [5] * 30, 100, map_fn=record)
    assert record.calls == []
    assert covers(clusters, 30)


@pytest.mark.slow
def test_buckets_run_in_other_processes_with_the_same_result() -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    x = blobs(7)
    clusterer = GMMClusterer(random_state=2, bucket_size=80)
    serial = clusterer.cluster(x)
    context = multiprocessing.get_context("spawn")  # nothing inherited: the jobs must pickle
    with ProcessPoolExecutor(max_workers=2, mp_context=context) as pool:

        def in_pool(fn: Callable[[T], R], items: Sequence[T], /) -> list[R]:
            return list(pool.map(fn, items))

        assert clusterer.cluster(x, map_fn=in_pool) == serial
