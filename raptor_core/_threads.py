"""Cap the thread pools of BLAS/OpenMP, torch and numba for the duration of a block.

A RAPTOR build mixes three pools: BLAS/OpenMP (numpy, scikit-learn), torch's intra-op pool
(the embedding model) and numba's (UMAP).  Each sizes itself to the machine on its own; on a
shared or container-limited machine that oversubscribes the cores.  :func:`limit_threads` caps
them together and restores the previous settings afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

from raptor_core.exceptions import InvalidParameterError

__all__ = ["limit_threads", "recommended_threads"]

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
