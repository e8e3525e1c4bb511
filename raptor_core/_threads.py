"""Thread pools: capped for a build, kept out of the query path.

A RAPTOR build mixes three pools: BLAS/OpenMP (numpy, scikit-learn), torch's intra-op pool
(the embedding model) and numba's (UMAP).  Each sizes itself to the machine on its own; on a
shared or container-limited machine that oversubscribes the cores.  :func:`limit_threads` caps
them together and restores the previous settings afterwards.

A query is different: one matrix-vector product and one short text to embed, too little work to
share between threads.  A multi-threaded BLAS call on a busy machine waits a scheduler time slice
for its second thread (milliseconds, for microseconds of work), and concurrent queries fight
over the same pool.  So the query path computes scores with :func:`matvec` (numpy's own SIMD
loop, no thread pool, no global setting touched), searches FAISS under :func:`single_omp_thread`
and embeds a query under :func:`single_torch_thread`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core.exceptions import InvalidParameterError

__all__ = [
    "limit_threads",
    "matvec",
    "recommended_threads",
    "single_omp_thread",
    "single_torch_thread",
]

logger = logging.getLogger(__name__)


def recommended_threads() -> int:
    """Return the number of CPUs this process may run on (at least 1).

    Uses the scheduler affinity mask where the platform has one (Linux: it reflects
    ``taskset`` and container cpusets), else :func:`os.cpu_count`.
    """
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        with contextlib.suppress(OSError):
            return max(1, len(affinity(0)))
    return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def limit_threads(n: int | None) -> Iterator[None]:
    """Cap BLAS/OpenMP, torch and numba to ``n`` threads inside the block, then restore them.

    torch and numba are capped only if something has already imported them: this function never
    imports them itself, so it costs nothing to callers that do not use them.  A module imported
    *inside* the block starts with its own defaults.

    numba's thread count is per calling thread (a numba rule): the cap applies to the thread that
    entered the block.  torch's intra-op count is process-wide.

    Args:
        n: the most threads each pool may use; None leaves every pool as it is.

    Raises:
        InvalidParameterError: ``n`` is not None and not a positive integer.

    Examples:
        >>> with limit_threads(1):
        ...     pass
    """
    if n is None:
        yield
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        msg = f"the thread limit must be a positive integer or None, got {n!r}"
        raise InvalidParameterError(msg)

    from threadpoolctl import threadpool_limits

    with contextlib.ExitStack() as stack:
        stack.enter_context(threadpool_limits(limits=n))
        torch = sys.modules.get("torch")
        if torch is not None and hasattr(torch, "get_num_threads"):
            previous_torch = torch.get_num_threads()
            if previous_torch != n:
                torch.set_num_threads(n)
                stack.callback(torch.set_num_threads, previous_torch)
        numba = sys.modules.get("numba")
        if numba is not None and hasattr(numba, "set_num_threads"):
            previous_numba = numba.get_num_threads()
            target = min(n, numba.config.NUMBA_NUM_THREADS)
            if previous_numba != target:
                numba.set_num_threads(target)
                stack.callback(numba.set_num_threads, previous_numba)
        logger.debug("thread pools capped at %d", n)
        yield


def matvec(matrix: NDArray[Any], vector: NDArray[Any]) -> NDArray[Any]:
    """``matrix @ vector`` on the calling thread only, without BLAS.

    ``np.einsum`` (without ``optimize``) runs numpy's own vectorised loop, so no BLAS or OpenMP
    pool is woken and no process-wide thread setting is read or changed: safe from any number
    of threads at once.  For the memory-bound products of a query it is as fast as one BLAS
    thread or faster (``benchmarks/query_load.py`` measures both); capping BLAS around each
    call instead would change a process-wide setting that concurrent callers race to restore.
    """
    return np.einsum("ij,j->i", matrix, vector)


_torch_lock = threading.Lock()
_torch_users = 0
_torch_previous = 0


@contextlib.contextmanager
def single_torch_thread() -> Iterator[None]:
    """Run torch's CPU operators on one thread inside the block (if torch is imported).

    Embedding one query is a few milliseconds of work: spreading it over torch's intra-op pool
    saves little on an idle machine and costs a scheduler time slice per operator on a busy
    one.  torch's setting is process-wide, so the cap is reference-counted: the first block to
    enter sets one thread, the last to leave restores the previous count, and overlapping
    blocks from several threads never leave it changed.  While a block is open, torch work in
    *other* threads of the process (a build running beside queries) also runs on one thread.
    """
    global _torch_users, _torch_previous
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "set_num_threads"):
        yield
        return
    with _torch_lock:
        if _torch_users == 0:
            _torch_previous = torch.get_num_threads()
            if _torch_previous != 1:
                torch.set_num_threads(1)
        _torch_users += 1
    try:
        yield
    finally:
        with _torch_lock:
            _torch_users -= 1
            if _torch_users == 0 and _torch_previous != 1:
                torch.set_num_threads(_torch_previous)


@contextlib.contextmanager
def single_omp_thread(faiss: Any) -> Iterator[None]:
    """Run ``faiss``'s OpenMP regions started by the calling thread on one thread.

    FAISS spreads even a one-query search over its OpenMP pool, which on a busy machine waits
    for the other threads.  OpenMP's thread count set by ``omp_set_num_threads`` belongs to
    the calling thread, so this cap touches no other thread and needs no lock; the previous
    count is restored on leaving.
    """
    previous = int(faiss.omp_get_max_threads())
    if previous == 1:
        yield
        return
    faiss.omp_set_num_threads(1)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(previous)
