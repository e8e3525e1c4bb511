"""RAPTOR soft clustering: UMAP reduction + Gaussian mixtures chosen by BIC (paper, section 3).

:class:`GMMClusterer` follows the two-step scheme of the RAPTOR paper (Sarthi et al. 2024):

1. **Global**: reduce the vectors with UMAP to ``reduction_dim`` (10) dimensions using
   ``n_neighbors = int(sqrt(n - 1))``, fit Gaussian mixtures for k = 1, 2, … and keep the k
   with the lowest BIC, then assign every point to each component whose posterior probability
   is at least ``threshold`` (0.1): clusters may overlap (soft clustering).
2. **Local**: inside each global cluster, reduce again with a *local* UMAP
   (``n_neighbors = 10``) and repeat the BIC-selected mixture + threshold assignment.

A set of at most ``reduction_dim + 1`` points (a small input, or a small global cluster) is kept
whole, as the paper's code does for local clusters: see :meth:`GMMClusterer._soft_clusters`.

:func:`cluster_within_limit` adds the paper's recursive re-clustering of clusters whose text
would not fit the summariser's context.

**Corpus scale (buckets).**  The global step is superlinear: UMAP's neighbour graph and its
layout grow faster than the number of points (one pass over 11,661 chunk vectors took 37-42 s),
and its exact neighbours need an ``(n, n)`` matrix.  Above ``bucket_size`` points,
:meth:`GMMClusterer.cluster` first cuts the vectors into buckets of at most ``bucket_size`` near
points (seeded k-means on a sample, assigned to the nearest centre: see :func:`_partition`),
runs the two-step method in each bucket on its own, and returns the union of the buckets'
clusters.  Time and memory per point are then bounded by the bucket size, so a layer costs
time linear in its size; the layers above, once smaller than a bucket, are clustered whole,
so the tree still merges everything upward.  Each bucket is one self-contained job
(:class:`BucketJob`, run by the module-level :func:`cluster_bucket`), handed to a ``map_fn``
that may run them in other threads or processes: the result does not depend on the order or
place they run in.

Speed: with the paper's full sweep (k = 1..49 per mixture fit) one call on 500 MiniLM chunk
vectors took 12.6 s on 2 cores; it takes about 2 s here, through choices that keep the method:

* the BIC sweep stops once ``_BIC_PATIENCE`` (5) consecutive k have failed to beat the best
  BIC, and never tries more components than there are distinct points.  On real embeddings this
  picked the same k as the full sweep in 41 of 41 fits (3 seeds).  Where they differ (isotropic
  noise), the full sweep's BIC dips again at large k because full covariances collapse onto
  about ``reduction_dim`` points each, a degenerate-likelihood artefact; the first minimum is kept;
* mixtures start from k-means++ seeds rather than a full k-means run (a third of the cost of
  the many small local fits; EM refines either way);
* UMAP's exact nearest neighbours (UMAP itself uses exact ones below 4096 points) are computed
  here with one matrix product and handed over as ``precomputed_knn``: the same neighbours,
  without a numba kernel whose first-call compilation alone costs about 4 s;
* UMAP's numba kernels are compiled once per *machine* instead of once per *process*: the
  dispatchers of ``umap`` get numba's on-disk cache (see :func:`_enable_umap_jit_cache`);
* BLAS/OpenMP run on one thread during :meth:`GMMClusterer.cluster` (see the comment there).
"""

from __future__ import annotations

import inspect
import logging
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, TypeVar

import numpy as np
from numpy.typing import NDArray

from raptor_core._imports import require
from raptor_core.exceptions import InvalidInputError, InvalidParameterError
from raptor_core.types import Clusterer

__all__ = ["BucketJob", "GMMClusterer", "MapFn", "cluster_bucket", "cluster_within_limit"]

logger = logging.getLogger(__name__)

#: Stop the BIC sweep after this many consecutive k without a new best BIC.
_BIC_PATIENCE = 5
#: UMAP computes exact neighbours itself below this size (umap-learn's own cut-off); above it,
#: a dense (n, n) distance matrix would be too large and UMAP's NN-descent is used instead.
_EXACT_KNN_MAX = 4096
#: Up to this many points UMAP starts from a spectral layout computed here with a dense
#: eigensolver (:func:`_spectral_start`); above it, from its own (ARPACK's).  A dense solve of
#: 1,024 points takes about 0.1 s.
_DENSE_SPECTRAL_MAX = 1024
#: UMAP's epochs for graphs of up to 10,000 points; it drops edges weaker than 1 / epochs of
#: the strongest before laying the graph out.
_UMAP_EPOCHS = 500
#: Metrics for which this module computes exact neighbours; UMAP accepts the same names.
_METRICS = ("cosine", "euclidean", "manhattan")
#: sklearn's default covariance regulariser, as in the paper's code; keeps duplicate points and
#: zero-variance dimensions from making a component's covariance singular.
_REG_COVAR = 1e-6

_jit_cache_enabled = False

#: Default ``bucket_size``.  The two-step method's cost per point grows with the input: on 5,442
#: MiniLM chunk vectors (2 loaded cores), buckets of at most 1,000 / 2,000 / 4,000 rows took
#: 7.8 / 7.6 / 11.9 ms per point, and the whole of 4,000 rows 31 ms (benchmarks/results/scale.md).
#: 2,000 also stays below UMAP's exact-neighbour cut-off (4096): one (n, n) matrix, 16 MB.
DEFAULT_BUCKET_SIZE = 2000
#: The pre-partition's k-means aims at buckets half this full, so that k-means' uneven cluster
#: sizes mostly fit without a second split.
_BUCKET_FILL = 0.5
#: k-means for the pre-partition is fitted on at most this many sampled rows per centre (and at
#: least _PARTITION_SAMPLE_MIN rows); every row is then assigned to its nearest centre.
_PARTITION_SAMPLE_PER_CENTRE = 256
_PARTITION_SAMPLE_MIN = 10_000
#: Rows assigned to nearest centres per block: bounds the (block, k) score matrix.
_ASSIGN_BLOCK = 65_536

_T = TypeVar("_T")
_R = TypeVar("_R")


class MapFn(Protocol):
    """``map_fn(fn, items) -> [fn(item) for item in items]``, run wherever the caller likes.

    ``fn`` is a module-level function (picklable) and each item is self-contained, so an
    implementation may run the calls in threads or other processes, in any order; it must
    return the results in the order of ``items``.
    """

    def __call__(self, fn: Callable[[_T], _R], items: Sequence[_T], /) -> list[_R]:
        """Return ``[fn(item) for item in items]``."""
        ...


def _serial_map(fn: Callable[[_T], _R], items: Sequence[_T], /) -> list[_R]:
    return [fn(item) for item in items]


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketJob:
    """One bucket of a bucketed :meth:`GMMClusterer.cluster` call: everything needed to redo it.

    Attributes:
        vectors: the bucket's rows, shape ``(m, d)``.
        params: :meth:`GMMClusterer.get_params` of the calling clusterer.
        seed: the bucket's own seed (drawn from the caller's ``random_state``).
    """

    vectors: NDArray[np.float32]
    params: dict[str, Any]
    seed: int


def cluster_bucket(job: BucketJob) -> list[list[int]]:
    """Cluster one bucket with the two-step method; indices are rows of ``job.vectors``.

    A module-level function so that a ``map_fn`` can send it to another process.
    """
    params = {**job.params, "random_state": job.seed, "bucket_size": None}
    return GMMClusterer(**params).cluster(job.vectors)


class GMMClusterer:
    """RAPTOR's soft clustering: global then local UMAP + BIC-selected Gaussian mixtures.

    Parameters are stored as given and validated by :meth:`cluster` (scikit-learn style).

    Args:
        reduction_dim: UMAP output dimensions (paper: 10).
        threshold: a point joins every mixture component whose posterior probability is at least
            this (paper: 0.1).  A point below it everywhere joins its most likely component, so
            no point is ever left out.
        max_clusters: the largest number of mixture components tried (paper: 50).
        global_n_neighbors: UMAP neighbours for the global step; None uses the paper's
            ``int(sqrt(n - 1))``.
        local_n_neighbors: UMAP neighbours inside each global cluster (paper: 10).
        metric: distance between input vectors: ``"cosine"`` (paper), ``"euclidean"`` or
            ``"manhattan"``.
        random_state: seed for UMAP and the mixtures; the same seed and input give the same
            clusters.  None draws fresh randomness.
        bucket_size: inputs with more rows than this are cut into buckets of at most this many
            near rows, each clustered on its own (see the module docstring); None clusters
            every input whole, as the paper does.  At least ``2 * (reduction_dim + 1)``.

    At most ``reduction_dim + 1`` points (the whole input, or one global cluster) are kept as
    one cluster, as the paper's code does: too few for UMAP or for a meaningful mixture.

    UMAP's numba kernels are compiled on first use (about 4 s); this class enables numba's
    on-disk cache for them, so later processes on the same machine skip that cost.

    Examples:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> vectors = rng.normal(size=(3, 8)).astype(np.float32)
        >>> GMMClusterer(random_state=0).cluster(vectors)
        [[0, 1, 2]]
    """

    def __init__(
        self,
        *,
        reduction_dim: int = 10,
        threshold: float = 0.1,
        max_clusters: int = 50,
        global_n_neighbors: int | None = None,
        local_n_neighbors: int = 10,
        metric: str = "cosine",
        random_state: int | None = None,
        bucket_size: int | None = DEFAULT_BUCKET_SIZE,
    ) -> None:
        self.reduction_dim = reduction_dim
        self.threshold = threshold
        self.max_clusters = max_clusters
        self.global_n_neighbors = global_n_neighbors
        self.local_n_neighbors = local_n_neighbors
        self.metric = metric
        self.random_state = random_state
        self.bucket_size = bucket_size

    def get_params(self) -> dict[str, Any]:
        """Return the constructor parameters (scikit-learn style)."""
        return {
            "reduction_dim": self.reduction_dim,
            "threshold": self.threshold,
            "max_clusters": self.max_clusters,
            "global_n_neighbors": self.global_n_neighbors,
            "local_n_neighbors": self.local_n_neighbors,
            "metric": self.metric,
            "random_state": self.random_state,
            "bucket_size": self.bucket_size,
        }

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({args})"

    # -- public API ----------------------------------------------------------------------------
    def cluster(
        self, vectors: NDArray[np.float32], *, map_fn: MapFn | None = None
    ) -> list[list[int]]:
        """Soft-cluster the rows of ``vectors``.

        Args:
            vectors: array of shape ``(n, d)``.
            map_fn: runs the per-bucket jobs when the input is bucketed (more than
                ``bucket_size`` rows): ``map_fn(cluster_bucket, jobs)`` must return
                ``[cluster_bucket(job) for job in jobs]``, computed anywhere (threads,
                processes, a cluster).  None runs them one after the other here.

        Returns:
            Lists of row indices, each sorted; the lists are sorted too and pairwise distinct.
            They may overlap, and together they cover every row.

        Raises:
            InvalidParameterError: a constructor parameter is out of range, or ``map_fn``
                returned the wrong number of results.
            InvalidInputError: ``vectors`` is not a finite 2-D array.
        """
        self._validate()
        x = _as_matrix(vectors)
        n = x.shape[0]
        if n <= max(2, self.reduction_dim + 1):
            return [list(range(n))] if n else []  # too few to separate: see _soft_clusters
        threadpoolctl = require("threadpoolctl")
        # threadpoolctl only caps libraries already loaded, and scipy brings its own BLAS: load
        # everything before entering the cap.
        require("sklearn.mixture", package="scikit-learn")
        _load_umap()
        if self.bucket_size is not None and n > self.bucket_size:
            return self._bucketed(x, self.bucket_size, map_fn or _serial_map, threadpoolctl)
        # One BLAS/OpenMP thread: the matrices here are small (n x n distances, 10-dimensional
        # mixtures), so threads buy little, while their different summation orders would make
        # the seeded result depend on the thread count, and their wake-ups and spin-waits make
        # tiny solves many times slower on a busy machine (measured: a first call 4.4 s capped,
        # 40 s uncapped on 2 loaded cores).  UMAP itself runs single-threaded (n_jobs=1).
        with threadpoolctl.threadpool_limits(limits=1):
            found = self._two_step(x)
        # Canonical order, independent of how the mixtures happened to number their components.
        return [list(c) for c in sorted(set(found))]

    def _bucketed(
        self,
        x: NDArray[np.float32],
        bucket_size: int,
        map_fn: MapFn,
        threadpoolctl: ModuleType,
    ) -> list[list[int]]:
        """Partition ``x`` into buckets, cluster each through ``map_fn``, merge the clusters."""
        rng = np.random.default_rng(self.random_state)
        partition_seed = _seed(rng)
        # One thread for the same reason as the two-step method: k-means sums in an order
        # that depends on the thread count, and the buckets must not.
        with threadpoolctl.threadpool_limits(limits=1):
            buckets = _partition(x, bucket_size, self.metric, partition_seed)
        # Seeds drawn in bucket order (buckets are ordered by their first row), so each job's
        # result is fixed before any of them runs, whatever order map_fn runs them in.
        params = self.get_params()
        jobs = [BucketJob(vectors=x[rows], params=params, seed=_seed(rng)) for rows in buckets]
        logger.debug(
            "bucketed clustering: %d rows in %d buckets (largest %d)",
            x.shape[0],
            len(buckets),
            max(len(b) for b in buckets),
        )
        results = list(map_fn(cluster_bucket, jobs))
        if len(results) != len(jobs):
            msg = f"map_fn returned {len(results)} results for {len(jobs)} bucket jobs; it must return one per item, in order"
            raise InvalidParameterError(msg)
        found: set[tuple[int, ...]] = set()
        for rows, clusters in zip(buckets, results, strict=True):
            for cluster in clusters:
                found.add(tuple(rows[np.asarray(cluster, dtype=np.intp)].tolist()))
        return [list(c) for c in sorted(found)]

    # -- steps ---------------------------------------------------------------------------------
    def _two_step(self, x: NDArray[np.float32]) -> list[tuple[int, ...]]:
        """The paper's global then local clustering; clusters as tuples of row indices."""
        n = x.shape[0]
        rng = np.random.default_rng(self.random_state)
        global_nn = self.global_n_neighbors
        if global_nn is None:
            global_nn = max(2, int(math.sqrt(n - 1)))  # paper: sqrt(n - 1); UMAP needs >= 2
        global_clusters = self._soft_clusters(x, global_nn, rng)
        logger.debug("global step: %d points -> %d clusters", n, len(global_clusters))

        found: list[tuple[int, ...]] = []
        for members in global_clusters:
            local = self._soft_clusters(x[members], self.local_n_neighbors, rng)
            found.extend(tuple(members[c].tolist()) for c in local)
        return found

    def _validate(self) -> None:
        def positive_int(name: str, value: object, minimum: int) -> None:
            if not _is_int(value) or value < minimum:  # type: ignore[operator]
                msg = f"{name} must be an integer >= {minimum}, got {value!r}"
                raise InvalidParameterError(msg)

        positive_int("reduction_dim", self.reduction_dim, 1)
        positive_int("max_clusters", self.max_clusters, 1)
        positive_int("local_n_neighbors", self.local_n_neighbors, 2)
        if self.global_n_neighbors is not None:
            positive_int("global_n_neighbors", self.global_n_neighbors, 2)
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 < t <= 1.0:
            msg = f"threshold must be a probability in (0, 1], got {t!r}"
            raise InvalidParameterError(msg)
        if self.metric not in _METRICS:
            msg = f"metric must be one of {', '.join(map(repr, _METRICS))}, got {self.metric!r}"
            raise InvalidParameterError(msg)
        rs = self.random_state
        # A negative seed would reach numpy's default_rng as a raw ValueError.  The upper
        # bound is scikit-learn's random_state range, which TreeBuilder checks as well.
        if rs is not None and (not _is_int(rs) or not 0 <= rs <= 2**32 - 1):
            msg = f"random_state must be an integer in [0, 2**32 - 1] or None, got {rs!r}"
            raise InvalidParameterError(msg)
        if self.bucket_size is not None:
            # A bucket must hold enough rows for UMAP and a mixture: smaller sets are kept whole.
            positive_int("bucket_size", self.bucket_size, 2 * (self.reduction_dim + 1))

    def _soft_clusters(
        self, x: NDArray[np.float32], n_neighbors: int, rng: np.random.Generator
    ) -> list[NDArray[np.intp]]:
        """Reduce ``x`` and soft-assign it with a BIC-selected mixture; clusters as index arrays."""
        n = x.shape[0]
        # The paper keeps a set of at most reduction_dim + 1 points whole (its local step; its
        # tree also stops growing there).  UMAP's spectral layout cannot embed so few points
        # in reduction_dim dimensions, and a mixture fitted to them is degenerate: with one or
        # two points per component, BIC rewards collapsed covariances, so on such sets the
        # sweep returned n - 1 "clusters" for any data (measured for n = 3..5, any covariance
        # type).  Identical points have nothing to separate and would give UMAP a flat graph.
        if n <= max(2, self.reduction_dim + 1) or _all_identical(x, self.metric):
            return [np.arange(n)]
        reduced = self._umap(x, min(n_neighbors, n - 1), _seed(rng))
        if reduced is None:  # UMAP could not run on this data: a linear reduction instead
            reduced = _pca(x, min(self.reduction_dim, n - 1), self.metric)
        return _bic_gmm_soft(reduced, self.max_clusters, self.threshold, _seed(rng))

    def _umap(
        self, x: NDArray[np.float32], n_neighbors: int, seed: int
    ) -> NDArray[np.float64] | None:
        """UMAP-reduce ``x``; None when UMAP cannot handle it (the caller then uses PCA)."""
        umap = _load_umap()
        n = x.shape[0]
        precomputed: tuple[Any, ...] = (None, None, None)
        if n < _EXACT_KNN_MAX:
            precomputed = _exact_knn(x, n_neighbors, self.metric)
        try:
            init: str | NDArray[np.float32] = "spectral"
            if n <= _DENSE_SPECTRAL_MAX:
                knn = (precomputed[0], precomputed[1])
                start = _spectral_start(umap, x, knn, self.reduction_dim, self.metric, seed)
                # A graph of several components: PCA's start, which is deterministic too.
                init = "pca" if start is None else start
            reducer = umap.UMAP(
                n_neighbors=n_neighbors,
                n_components=self.reduction_dim,
                metric=self.metric,
                random_state=seed,
                init=init,
                # UMAP is always seeded here (from random_state), which makes it single-threaded;
                # saying so avoids its "n_jobs overridden" warning.
                n_jobs=1,
                low_memory=True,
                precomputed_knn=precomputed,
            )
            with warnings.catch_warnings():
                # Expected here: no NN-descent index for transform() (we never transform),
                # spectral-init fallbacks on tiny or degenerate graphs (random init is seeded),
                # disconnected points in the neighbour graph.
                warnings.filterwarnings("ignore", category=UserWarning, module=r"umap\.")
                # ... and the same, about disconnected graphs, from sklearn's spectral embedding.
                warnings.filterwarnings("ignore", message="Graph is not fully connected")
                reduced = reducer.fit_transform(x)
        except (ValueError, RuntimeError, TypeError, np.linalg.LinAlgError) as exc:
            logger.debug("UMAP failed on %d points (%s); using PCA instead", n, exc)
            return None
        reduced = np.asarray(reduced, dtype=np.float64)
        if not np.all(np.isfinite(reduced)):
            logger.debug("UMAP returned non-finite values on %d points; using PCA instead", n)
            return None
        return reduced


# -- building blocks ---------------------------------------------------------------------------
def _as_matrix(vectors: NDArray[np.float32]) -> NDArray[np.float32]:
    x = np.asarray(vectors)
    if x.ndim != 2:
        msg = f"vectors must be a 2-D array (n, d), got shape {x.shape}"
        raise InvalidInputError(msg)
    if x.shape[0] > 0 and x.shape[1] == 0:
        msg = "vectors must have at least one column"
        raise InvalidInputError(msg)
    if not np.issubdtype(x.dtype, np.number) or np.iscomplexobj(x):
        msg = f"vectors must be real numbers, got dtype {x.dtype}"
        raise InvalidInputError(msg)
    x = x.astype(np.float32, copy=False)
    if not np.all(np.isfinite(x)):
        msg = "vectors contain NaN or infinite values"
        raise InvalidInputError(msg)
    return x


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _seed(rng: np.random.Generator) -> int:
    """A fresh seed for one UMAP or mixture fit, reproducible from the clusterer's random_state."""
    return int(rng.integers(0, 2**31 - 1))


def _unit_rows(x: NDArray[np.float32]) -> NDArray[np.float32]:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    # A zero vector has no direction: leave it at the origin (cosine distance 1 to everything).
    unit: NDArray[np.float32] = (x / np.where(norms > 0, norms, 1.0)).astype(np.float32)
    return unit


def _all_identical(x: NDArray[np.float32], metric: str) -> bool:
    """Whether all rows are the same point, up to float32 rounding (and scale, for cosine)."""
    y = _unit_rows(x) if metric == "cosine" else x
    spread = float(np.abs(y - y[0]).max())
    return spread <= 1e-6 * float(np.abs(y).max())


def _pairwise(x: NDArray[np.float32], metric: str) -> NDArray[np.float32]:
    """Dense (n, n) distance matrix."""
    d: NDArray[Any]
    if metric == "cosine":
        u = _unit_rows(x)
        d = 1.0 - u @ u.T
    elif metric == "euclidean":
        y = x.astype(np.float64)  # |a|^2 + |b|^2 - 2ab cancels badly in float32
        sq = np.einsum("ij,ij->i", y, y)
        d = np.sqrt(np.maximum(sq[:, None] + sq[None, :] - 2.0 * (y @ y.T), 0.0))
    else:  # manhattan: no matrix-product form; row blocks keep the memory at O(n * d * block)
        d = np.empty((x.shape[0], x.shape[0]), dtype=np.float32)
        step = max(1, 2**22 // max(1, x.shape[0] * x.shape[1]))
        for i in range(0, x.shape[0], step):
            d[i : i + step] = np.abs(x[i : i + step, None, :] - x[None, :, :]).sum(axis=2)
    out: NDArray[np.float32] = np.maximum(d, 0.0).astype(np.float32)  # rounding can dip below 0
    return out


def _exact_knn(
    x: NDArray[np.float32], k: int, metric: str
) -> tuple[NDArray[np.int32], NDArray[np.float32], None]:
    """Exact k nearest neighbours, each row starting with the point itself (UMAP's convention)."""
    d = _pairwise(x, metric)
    np.fill_diagonal(d, -1.0)  # self first even among exact duplicates
    idx = np.argsort(d, axis=1, kind="stable")[:, :k]
    dist = np.take_along_axis(d, idx, axis=1)
    dist[:, 0] = 0.0
    return idx.astype(np.int32), dist.astype(np.float32), None


def _spectral_start(
    umap: ModuleType,
    x: NDArray[np.float32],
    knn: tuple[NDArray[np.int32], NDArray[np.float32]],
    dim: int,
    metric: str,
    seed: int,
) -> NDArray[np.float32] | None:
    """UMAP's spectral start, from a dense eigensolver; None when the graph is not connected.

    UMAP's own start takes the eigenvectors of the normalised Laplacian of its neighbour graph
    from ARPACK, and ARPACK draws the vector it restarts from with a seed kept from call to
    call in the process.  It restarts when its Krylov space runs out: always on graphs of
    about ``2 * (dim + 1)`` points or fewer, where that space is the whole graph, and on
    repeated eigenvalues.  There, the layout (and so the clusters) depended on how many
    layouts the process had computed before: the same 14 hashed vectors were clustered two
    ways, alternately, call after call.  A dense solver has no such state.  Each vector's
    sign is fixed (its largest entry positive), as an eigenvector is defined only up to it,
    and the start is scaled and jittered as UMAP scales and jitters its own.
    """
    sparse = require("scipy.sparse", package="scipy")
    csgraph = require("scipy.sparse.csgraph", package="scipy")
    linalg = require("scipy.linalg", package="scipy")
    n = x.shape[0]
    indices, distances = knn
    graph, _, _ = umap.umap_.fuzzy_simplicial_set(
        x,
        indices.shape[1],  # n_neighbors
        np.random.RandomState(seed),  # unused: the neighbours are given
        metric,
        knn_indices=indices,
        knn_dists=distances,
    )
    graph = sparse.coo_matrix(graph)
    # UMAP lays out the graph without the edges too weak to be sampled in its 500 epochs.
    graph.data[graph.data < graph.data.max() / _UMAP_EPOCHS] = 0.0
    graph.eliminate_zeros()
    if csgraph.connected_components(graph, directed=False)[0] > 1:
        return None
    weights = graph.toarray().astype(np.float64)
    scale = 1.0 / np.sqrt(weights.sum(axis=0))
    laplacian = np.eye(n) - scale[:, None] * weights * scale[None, :]
    # The dim + 1 smallest; the first is the constant (degree) vector and is dropped.
    _, vectors = linalg.eigh(laplacian, subset_by_index=[0, dim])
    coords = vectors[:, 1:]
    pivots = np.argmax(np.abs(coords), axis=0)
    coords = coords * np.where(coords[pivots, np.arange(dim)] < 0, -1.0, 1.0)
    coords *= 10.0 / np.abs(coords).max()
    noise = np.random.default_rng(seed).normal(scale=1e-4, size=coords.shape)
    return (coords + noise).astype(np.float32)


def _pca(x: NDArray[np.float32], dim: int, metric: str) -> NDArray[np.float64]:
    """Project onto the top ``dim`` principal axes (fallback when UMAP cannot run)."""
    y = (_unit_rows(x) if metric == "cosine" else x).astype(np.float64)
    y = y - y.mean(axis=0)
    u, s, _ = np.linalg.svd(y, full_matrices=False)
    projected: NDArray[np.float64] = u[:, :dim] * s[:dim]
    return projected


def _bic_gmm_soft(
    reduced: NDArray[np.float64], max_clusters: int, threshold: float, seed: int
) -> list[NDArray[np.intp]]:
    """Fit mixtures for k = 1, 2, …, keep the lowest BIC, and threshold its posteriors.

    The sweep runs up to ``min(max_clusters, n - 1, distinct points)`` but stops early once
    ``_BIC_PATIENCE`` consecutive k have not improved on the best BIC found.
    """
    mixture = require("sklearn.mixture", package="scikit-learn")
    exceptions = require("sklearn.exceptions", package="scikit-learn")
    n = reduced.shape[0]
    distinct = len(np.unique(reduced, axis=0))
    k_max = max(1, min(max_clusters, n - 1, distinct))
    best: Any = None
    best_bic = math.inf
    since_best = 0
    with warnings.catch_warnings():
        # n_init=1 with modest max_iter may stop before full convergence; BIC still ranks k.
        warnings.filterwarnings("ignore", category=exceptions.ConvergenceWarning)
        for k in range(1, k_max + 1):
            gm = mixture.GaussianMixture(
                n_components=k,
                covariance_type="full",  # the paper's choice; cheap at 10 dimensions
                reg_covar=_REG_COVAR,
                # k-means++ seeding instead of sklearn's default full k-means run: a third of the
                # cost on the many small local fits; EM then refines the components either way.
                init_params="k-means++",
                n_init=1,
                max_iter=100,
                random_state=seed,
            )
            try:
                gm.fit(reduced)
                bic = float(gm.bic(reduced))
            except (ValueError, np.linalg.LinAlgError) as exc:
                # An ill-conditioned fit at this k: larger k would only be worse conditioned.
                logger.debug("GMM with k=%d failed on %d points: %s", k, n, exc)
                break
            if math.isfinite(bic) and bic < best_bic:
                best, best_bic, since_best = gm, bic, 0
            else:
                since_best += 1
                if since_best >= _BIC_PATIENCE:
                    break
    if best is None or best.n_components == 1:
        return [np.arange(n)]
    probs = best.predict_proba(reduced)  # (n, k)
    if not np.all(np.isfinite(probs)):
        return [np.arange(n)]
    member = probs >= threshold
    # Nobody is orphaned: a point below the threshold everywhere joins its likeliest component.
    member[np.arange(n), probs.argmax(axis=1)] = True
    return [np.flatnonzero(member[:, j]) for j in range(member.shape[1]) if member[:, j].any()]


def _partition(
    x: NDArray[np.float32], bucket_size: int, metric: str, seed: int
) -> list[NDArray[np.intp]]:
    """Cut the rows of ``x`` into buckets of at most ``bucket_size`` near rows.

    Seeded k-means (on unit rows for the cosine metric, so near-spherical k-means) is fitted on
    a sample and every row goes to its nearest centre: O(n * k * d) time and O(block * k)
    memory beyond the input, with ``k`` about ``2 n / bucket_size``.  Centres that attract
    fewer than ``bucket_size / 8`` rows are dropped and their rows go to the next nearest, so
    no bucket is too small to cluster.  A bucket still over the limit is cut again the same
    way; every cut makes at least two non-empty parts, so this terminates.  Manhattan vectors
    are partitioned by euclidean k-means: only the buckets' contents matter, not their shape.

    Returns:
        Sorted row-index arrays that partition ``range(n)``, ordered by their first row.
    """
    y = _unit_rows(x) if metric == "cosine" else x
    rng = np.random.default_rng(seed)
    min_rows = max(2, bucket_size // 8)
    parts: list[NDArray[np.intp]] = []
    todo = [np.arange(x.shape[0])]
    while todo:
        rows = todo.pop()
        if len(rows) <= bucket_size:
            parts.append(rows)
            continue
        k = math.ceil(len(rows) / (_BUCKET_FILL * bucket_size))
        groups = _kmeans_split(y[rows], k, min_rows, _seed(rng))
        if len(groups) < 2:  # all rows identical: any cut is as good as another
            groups = np.array_split(np.arange(len(rows)), math.ceil(len(rows) / bucket_size))
        todo.extend(rows[g] for g in groups)
    parts.sort(key=lambda rows: int(rows[0]))
    return parts


def _kmeans_split(
    y: NDArray[np.float32], k: int, min_rows: int, seed: int
) -> list[NDArray[np.intp]]:
    """Rows of ``y`` grouped by nearest k-means centre (fitted on a sample); sorted index arrays."""
    cluster = require("sklearn.cluster", package="scikit-learn")
    rng = np.random.default_rng(seed)
    n = y.shape[0]
    size = min(n, max(_PARTITION_SAMPLE_MIN, _PARTITION_SAMPLE_PER_CENTRE * k))
    if _all_identical(y, "euclidean"):
        return [np.arange(n)]
    sample = np.sort(rng.choice(n, size=size, replace=False))
    with warnings.catch_warnings():
        # Fewer distinct sample points than k: k-means warns and returns duplicate centres,
        # which simply attract no rows below.
        warnings.filterwarnings("ignore", message="Number of distinct clusters")
        km = cluster.KMeans(n_clusters=min(k, size), n_init=1, max_iter=50, random_state=seed)
        km.fit(y[sample].astype(np.float64))
    centres = np.asarray(km.cluster_centers_, dtype=np.float64)
    labels = _nearest(y, centres)
    counts = np.bincount(labels, minlength=len(centres))
    # Drop centres too small to be worth a bucket (keeping the two largest at least, so the
    # cut always makes progress) and give their rows to the nearest centre that stays.
    keep = counts >= min_rows
    if keep.sum() < 2:
        keep = np.zeros(len(centres), dtype=bool)
        keep[np.argsort(-counts, kind="stable")[:2]] = True
    if not keep.all():
        labels = np.flatnonzero(keep)[_nearest(y, centres[keep])]
    groups = [np.flatnonzero(labels == j) for j in range(len(centres))]
    return [g for g in groups if len(g)]


def _nearest(y: NDArray[np.float32], centres: NDArray[np.float64]) -> NDArray[np.intp]:
    """Index of each row's nearest centre (euclidean), in blocks to bound memory."""
    half_sq = 0.5 * np.einsum("ij,ij->i", centres, centres)
    out = np.empty(y.shape[0], dtype=np.intp)
    for start in range(0, y.shape[0], _ASSIGN_BLOCK):
        block = y[start : start + _ASSIGN_BLOCK].astype(np.float64)
        # argmin |y - c|^2 = argmax (y.c - |c|^2 / 2): one matrix product per block.
        out[start : start + len(block)] = np.argmax(block @ centres.T - half_sq, axis=1)
    return out


def _load_umap() -> ModuleType:
    """Import umap-learn (seconds: it brings numba and pynndescent) and enable its JIT cache."""
    with warnings.catch_warnings():
        # umap-learn announces with an ImportWarning that ParametricUMAP needs TensorFlow.
        warnings.simplefilter("ignore", ImportWarning)
        umap = require("umap", package="umap-learn")
    _enable_umap_jit_cache()
    return umap


def _enable_umap_jit_cache() -> None:
    """Turn on numba's on-disk cache for umap-learn's compiled kernels (once per process).

    umap-learn declares most of its numba functions without ``cache=True``, so each new process
    recompiles them on first use (about 4 s here for a 500-point fit, 8 s without
    ``precomputed_knn``).  With the cache, numba stores the machine code next to umap's sources
    (``umap/__pycache__``) or, where that is read-only, in its per-user cache directory, keyed and
    invalidated by source file and numba version, exactly as for umap's own cached functions.
    Any failure (no writable location, a numba without the API) leaves umap as it was.
    """
    global _jit_cache_enabled
    if _jit_cache_enabled:
        return
    _jit_cache_enabled = True
    try:
        from numba.core.dispatcher import Dispatcher
    except ImportError:  # pragma: no cover - umap always brings numba
        return
    count = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "umap" or name.startswith("umap.")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, Dispatcher):
                try:
                    value.enable_caching()
                    count += 1
                except Exception as exc:  # a cache is an optimisation only: never fail on it
                    logger.debug("numba cache not enabled for %r: %s", value, exc)
    logger.debug("numba on-disk cache enabled for %d umap kernels", count)


# -- token limits ------------------------------------------------------------------------------
#: Re-clustering with the clusterer itself goes this deep at most; below, splits are 2-means.
_MAX_RECLUSTER_DEPTH = 6
#: Children of one split may hold at most this many times the parent's rows (soft overlap);
#: more overlap than that would make the recursion's work grow geometrically.
_MAX_OVERLAP = 1.5


def cluster_within_limit(
    clusterer: Clusterer,
    vectors: NDArray[np.float32],
    token_counts: Sequence[int],
    max_tokens: int,
    *,
    map_fn: MapFn | None = None,
) -> list[list[int]]:
    """Cluster, then re-cluster every cluster whose texts exceed ``max_tokens`` (paper, §3).

    The RAPTOR paper re-clusters recursively any cluster whose combined text would overflow the
    summarisation model's context.  Here that recursion is bounded: when the clusterer makes no
    progress on a subset (it returns the whole subset, leaves rows out, or overlaps heavily), or
    after ``_MAX_RECLUSTER_DEPTH`` levels, the subset is split in two by a deterministic 2-means
    (or, for identical vectors, in index order at the token midpoint).  Every split yields
    strictly smaller subsets, so the process terminates.

    A single row whose own token count exceeds ``max_tokens`` cannot be split here; it becomes
    a cluster of its own (the summariser then has to truncate it).

    Args:
        clusterer: any :class:`~raptor_core.types.Clusterer`.
        vectors: array of shape ``(n, d)``.
        token_counts: tokens of each row's text, length ``n``.
        max_tokens: the most tokens a cluster of two or more rows may hold in total.
        map_fn: passed on as ``clusterer.cluster(vectors, map_fn=map_fn)`` to a clusterer whose
            ``cluster`` takes a ``map_fn`` keyword (:class:`GMMClusterer` runs its buckets
            through it); other clusterers are called without it.

    Returns:
        Clusters as sorted lists of row indices, without duplicates, in a deterministic order.
        Every row is in at least one cluster; every cluster of two or more rows holds at most
        ``max_tokens`` tokens.

    Raises:
        InvalidParameterError: ``max_tokens`` is not a positive integer, or the clusterer
            returned indices out of range.
        InvalidInputError: ``vectors`` is not 2-D, or ``token_counts`` has the wrong length or
            negative counts.
    """
    if not _is_int(max_tokens) or max_tokens < 1:
        msg = f"max_tokens must be a positive integer, got {max_tokens!r}"
        raise InvalidParameterError(msg)
    x = np.asarray(vectors)
    if x.ndim != 2:
        msg = f"vectors must be a 2-D array (n, d), got shape {x.shape}"
        raise InvalidInputError(msg)
    tokens = np.asarray(token_counts, dtype=np.int64).reshape(-1)
    n = x.shape[0]
    if tokens.shape[0] != n:
        msg = f"token_counts has {tokens.shape[0]} entries for {n} vectors"
        raise InvalidInputError(msg)
    if n and tokens.min() < 0:
        msg = "token_counts must not be negative"
        raise InvalidInputError(msg)
    if n == 0:
        return []

    everything = np.arange(n)
    out: dict[tuple[int, ...], None] = {}  # insertion-ordered set
    # Depth-first over an explicit stack: no recursion limit, output in a deterministic order.
    stack: list[tuple[NDArray[np.intp], int]] = []
    run = _cluster_call(clusterer, map_fn)
    for child in reversed(_clusterer_children(run, clusterer, x, everything)):
        # A cluster holding every row was just returned for these very rows: asking the
        # clusterer again would repeat it, so such a cluster goes straight to the split.
        stack.append((child, 1 if len(child) < n else _MAX_RECLUSTER_DEPTH + 1))
    while stack:
        members, depth = stack.pop()
        if len(members) == 1 or int(tokens[members].sum()) <= max_tokens:
            out.setdefault(tuple(members.tolist()), None)
            continue
        children: list[NDArray[np.intp]] | None = None
        if depth <= _MAX_RECLUSTER_DEPTH and len(members) > 2:
            children = _clusterer_children(run, clusterer, x, members)
            if not _makes_progress(children, members):
                logger.debug("re-clustering %d rows made no progress; splitting", len(members))
                children = None
        if children is None:
            children = _split_in_two(x, tokens, members)
        for child in reversed(children):
            stack.append((child, depth + 1))
    return [list(c) for c in out]


def _cluster_call(
    clusterer: Clusterer, map_fn: MapFn | None
) -> Callable[[NDArray[np.float32]], list[list[int]]]:
    """``clusterer.cluster``, with ``map_fn`` bound when given and the clusterer accepts it."""
    if map_fn is None:
        return clusterer.cluster
    try:
        accepts = "map_fn" in inspect.signature(clusterer.cluster).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        accepts = False
    if not accepts:
        return clusterer.cluster
    cluster_with_map: Callable[..., list[list[int]]] = clusterer.cluster
    return lambda vectors: cluster_with_map(vectors, map_fn=map_fn)


def _clusterer_children(
    run: Callable[[NDArray[np.float32]], list[list[int]]],
    clusterer: Clusterer,
    x: NDArray[Any],
    members: NDArray[np.intp],
) -> list[NDArray[np.intp]]:
    """Run ``run`` (``clusterer``'s ``cluster``) on ``x[members]`` and map its clusters back to rows.

    Rows the clusterer left out are gathered into one extra cluster so coverage is kept.
    """
    raw = run(x[members])
    m = len(members)
    covered = np.zeros(m, dtype=bool)
    children: list[NDArray[np.intp]] = []
    seen: set[tuple[int, ...]] = set()
    for cluster in raw:
        local = np.unique(np.asarray(list(cluster), dtype=np.intp))
        if local.size == 0:
            continue
        if local[0] < 0 or local[-1] >= m:
            msg = f"{type(clusterer).__name__}.cluster returned an index outside 0..{m - 1}"
            raise InvalidParameterError(msg)
        key = tuple(local.tolist())
        if key in seen:
            continue
        seen.add(key)
        covered[local] = True
        children.append(members[local])
    if not covered.all():
        children.append(members[~covered])
    return children


def _makes_progress(children: list[NDArray[np.intp]], members: NDArray[np.intp]) -> bool:
    if not children or any(len(c) >= len(members) for c in children):
        return False
    return sum(len(c) for c in children) <= _MAX_OVERLAP * len(members)


def _split_in_two(
    x: NDArray[Any], tokens: NDArray[np.int64], members: NDArray[np.intp]
) -> list[NDArray[np.intp]]:
    """Deterministic split of ``members`` (two or more rows) into two non-empty parts."""
    sub = np.asarray(x[members], dtype=np.float64)
    if len(members) > 2 and np.ptp(sub, axis=0).max() > 0:
        cluster = require("sklearn.cluster", package="scikit-learn")
        labels = cluster.KMeans(n_clusters=2, n_init=1, random_state=0).fit_predict(sub)
        left, right = members[labels == labels[0]], members[labels != labels[0]]
        if len(left) and len(right):
            return [left, right]
    # Identical vectors (or two rows): cut in index order where half the tokens are reached.
    cumulative = np.cumsum(tokens[members])
    cut = int(np.searchsorted(cumulative, cumulative[-1] / 2.0, side="left")) + 1
    cut = min(max(cut, 1), len(members) - 1)
    return [members[:cut], members[cut:]]
