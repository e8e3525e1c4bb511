"""Run a coroutine from synchronous code without ``asyncio.run``.

``asyncio.run`` fails when the calling thread already runs an event loop (Jupyter, FastAPI
handlers, LlamaIndex's async pipelines).  :func:`run_sync` runs the coroutine on a private
event loop instead: in the calling thread when it has no running loop, else in a worker
thread, so a synchronous ``retrieve()`` works everywhere.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

__all__ = ["run_sync"]

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
