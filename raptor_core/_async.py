"""Async helpers shared by the core and the adapters.

``asyncio.run`` fails when the calling thread already runs an event loop (Jupyter, FastAPI
handlers, LlamaIndex's async pipelines).  :func:`run_sync` runs the coroutine on a private
event loop instead: in the calling thread when it has no running loop, else in a worker
thread, so a synchronous ``retrieve()`` works everywhere.

:class:`UpdateLock` serialises an index's updates across threads, tasks and event loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar, cast

__all__ = ["UpdateLock", "run_sync"]

#: Seconds between an async update's tries of a held :class:`UpdateLock`.
UPDATE_POLL_S = 0.01

T = TypeVar("T")


def _run_on_new_loop(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(factory())
    finally:
        try:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            # close() shuts the default executor down without waiting: a synchronous LLM
            # call abandoned by a timeout must not hold the caller hostage.
            loop.close()


def run_sync(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``factory()`` to completion on a private event loop and return its result.

    Args:
        factory: creates the coroutine; it is called on the thread that runs the loop.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run_on_new_loop(factory)
    # A loop is running in this thread: blocking it is the caller's choice (they called the
    # sync API), but nesting a second loop in the same thread is impossible.
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = _run_on_new_loop(factory)
        except BaseException as exc:  # re-raised in the calling thread
            box["error"] = exc

    worker = threading.Thread(target=target, name="raptor-run-sync", daemon=True)
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    return cast(T, box["result"])


class UpdateLock:
    """The lock an index's updates hold from reading its tree to writing the new one back.

    Two updates that read the same tree would each write back their own change only, and
    one would be lost.  Sync updates use it as a context manager; async ones through
    :meth:`held`, which waits without blocking the event loop.  One ``threading.Lock``
    serves both, so sync and async updates, from any thread or event loop, exclude one
    another.  A pickled or copied holder (``copy.deepcopy``, LangChain's serialisers) gets
    a new unlocked lock: a ``threading.Lock`` cannot be pickled or copied, and the copy has
    its own tree.
    """

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Hold the lock in a coroutine, without blocking the event loop.

        It is tried without blocking and retried after a short sleep: waiting for it in an
        executor thread instead would leave it taken by a thread nobody releases it from
        when the waiting task is cancelled, and waiters filling the executor would starve
        the holder's own executor steps (a deadlock); an ``asyncio.Lock`` belongs to one
        event loop and does not exclude sync callers.  An update takes far longer than the
        sleep, so the polling costs nothing measurable.
        """
        while not self.acquire(blocking=False):
            await asyncio.sleep(UPDATE_POLL_S)
        try:
            yield
        finally:
            self.release()

    def __reduce__(self) -> tuple[type[UpdateLock], tuple[()]]:
        return (type(self), ())

    def __deepcopy__(self, memo: dict[int, Any]) -> UpdateLock:
        return type(self)()
