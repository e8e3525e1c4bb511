"""Run a build's chunking, embedding and summarising on a Ray cluster (the ``[ray]`` extra).

``TreeBuilder(..., executor=RayExecutor(address="auto"))`` or ``raptor build --ray auto``:

* chunking and embedding run as Ray Data ``map_batches`` over an actor pool; each actor
  builds the embedder once, from its allowlisted description when it has one
  (:class:`~raptor_core.build.executors.Shipped`), on its own best device;
* summaries are Ray tasks, at most the builder's ``max_concurrency`` at once; the build
  cache is read and written in the driver, so resuming works as without Ray;
* clustering independent buckets of a layer can run as Ray tasks through
  ``functools.partial(executor.map_tasks, stage="cluster", max_concurrency=None)``.

The builder cuts the batches (256 texts per embedding call) and every result comes back in
input order, so the tree is the one a local build gives for the same ``random_state``.

Workers import ``raptor_core`` (and your components' modules): install the same version of
``raptor-retriever`` on every node, or pass ``runtime_env={"py_modules": [...]}``.  A
component that is not on the allowlist travels pickled by Ray (cloudpickle): it must
pickle, and should create its clients on first use rather than in ``__init__``.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

import numpy as np

from raptor_core._imports import require
from raptor_core.build.executors import stage_error
from raptor_core.exceptions import InvalidParameterError, RaptorError

__all__ = ["RayExecutor"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class _Failed:
    """An exception raised on a worker, carried back as a value (Ray's wrappers hide its type)."""

    error: BaseException
    trace: str


def _capture(exc: BaseException) -> _Failed:
    import traceback

    from ray import cloudpickle  # what Ray sends the result with

    trace = "".join(traceback.format_exception(exc))
    try:
        cloudpickle.dumps(exc)
    except Exception:
        # A client error holding a socket or lock does not travel: keep its text.
        exc = RuntimeError(f"{type(exc).__name__}: {exc}")
    return _Failed(exc, trace)


class _Box:
    """Keeps a batch opaque to Arrow, which would otherwise turn a list of texts into a column.

    Ray Data stores it with its own serialiser (Arrow's Python-object extension type).
    """

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Box, (self.value,))


class _BatchWorker:
    """A Ray Data actor: ``fn`` is unpickled (and its model built) once per actor."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        out = np.empty(len(batch["index"]), dtype=object)
        for j, box in enumerate(batch["item"]):
            try:
                out[j] = self.fn(box.value)
            except Exception as exc:
                out[j] = _capture(exc)
        return {"index": np.asarray(batch["index"]), "out": out}


def _run_task(fn: Callable[[Any], Any], item: Any) -> Any:
    try:
        return fn(item)
    except Exception as exc:
        return _capture(exc)


class RayExecutor:
    """An :class:`~raptor_core.build.executors.Executor` on a Ray cluster.

    Ray is imported, and the cluster connected (or a local one started), on first use.

    Args:
        address: the cluster: ``None`` starts a local Ray in this process when none is
            running (all of this machine's cores); ``"auto"`` joins the cluster started on
            this machine with ``ray start``; ``"HOST:PORT"`` a head node's GCS address;
            ``"ray://HOST:10001"`` a Ray Client server.  Ignored when Ray is already
            initialised in this process (the executor then uses that).
        num_cpus_per_task: CPUs reserved by each chunk/embed actor and each task.
        num_gpus: GPUs reserved by each embedding actor (e.g. ``1``, or ``0.5`` to share a
            GPU between two); 0 embeds on CPUs.
        batch_size: texts per embedding batch; None: 256, the builder's own batch, which
            gives the same tree as a local build.  Another size is faster on big GPUs but
            may change a local model's vectors by ~1e-7 and so the tree.
        concurrency: most actors in the chunk/embed pool; None: as many as the cluster's
            CPUs (or GPUs, with ``num_gpus``) allow.
        runtime_env: passed to ``ray.init`` when this executor connects (for example
            ``{"py_modules": [...]}`` or environment variables for the workers).

    Raises:
        MissingDependencyError: Ray is not installed (``pip install 'raptor-retriever[ray]'``).

    Examples:
        >>> executor = RayExecutor(address="auto", num_gpus=1)  # doctest: +SKIP
        >>> tree = TreeBuilder(executor=executor, random_state=0).build(texts)  # doctest: +SKIP
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        num_cpus_per_task: float = 1.0,
        num_gpus: float = 0.0,
        batch_size: int | None = None,
        concurrency: int | None = None,
        runtime_env: Mapping[str, Any] | None = None,
    ) -> None:
        self.address = address
        self.num_cpus_per_task = num_cpus_per_task
        self.num_gpus = num_gpus
        self.batch_size = batch_size
        self.concurrency = concurrency
        self.runtime_env = runtime_env
        self._started = False
        # Summaries call map_tasks from several threads: only one of them may start Ray.
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RayExecutor(address={self.address!r})"

    def get_params(self) -> dict[str, Any]:
        """The constructor parameters (runtime_env left out: it may hold secrets)."""
        return {
            "address": self.address,
            "num_cpus_per_task": self.num_cpus_per_task,
            "num_gpus": self.num_gpus,
            "batch_size": self.batch_size,
            "concurrency": self.concurrency,
        }

    # -- lifecycle ----------------------------------------------------------------------------
    def _validate(self) -> None:
        if self.address is not None and (not isinstance(self.address, str) or not self.address):
            msg = f"address must be None, 'auto', 'HOST:PORT' or 'ray://HOST:PORT', got {self.address!r}"
            raise InvalidParameterError(msg)
        for name, minimum in (("num_cpus_per_task", 0.0), ("num_gpus", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
                msg = f"{name} must be a number >= {minimum}, got {value!r}"
                raise InvalidParameterError(msg)
            if not math.isfinite(value):
                msg = f"{name} must be finite, got {value!r}"
                raise InvalidParameterError(msg)
        for name in ("batch_size", "concurrency"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                msg = f"{name} must be a positive integer or None, got {value!r}"
                raise InvalidParameterError(msg)

    def _ray(self) -> ModuleType:
        """Ray, connected: the running instance, or the one ``address`` names."""
        self._validate()
        ray = require("ray", extra="ray")
        with self._lock:
            self._connect(ray)
        return ray

    def _connect(self, ray: ModuleType) -> None:
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"address": self.address, "log_to_driver": False}
            if self.runtime_env is not None:
                kwargs["runtime_env"] = dict(self.runtime_env)
            if self.address is None:
                kwargs["include_dashboard"] = False  # a local instance: no web server
            try:
                ray.init(**kwargs)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                msg = (
                    f"cannot connect to Ray at {self.address or 'a new local instance'!r}: {exc}. "
                    "Start a cluster (`ray start --head`), or pass address=None for a local one."
                )
                raise InvalidParameterError(msg) from exc
            self._started = True

    def close(self) -> None:
        """Disconnect from Ray if this executor connected (a local instance stops)."""
        if self._started:
            import ray

            ray.shutdown()
            self._started = False

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- work -------------------------------------------------------------------------------
    def _pool_size(self, ray: ModuleType, stage: str) -> int:
        if self.concurrency is not None:
            return self.concurrency
        resources = ray.cluster_resources()
        if stage == "embed" and self.num_gpus > 0:
            return max(1, int(resources.get("GPU", 0) // self.num_gpus))
        per = self.num_cpus_per_task if self.num_cpus_per_task > 0 else 1.0
        return max(1, int(resources.get("CPU", 1) // per))

    def map_batches(self, fn: Callable[[T], R], batches: Sequence[T], *, stage: str) -> list[R]:
        """Run ``fn`` over ``batches`` with Ray Data on an actor pool; results in input order."""
        if not batches:
            return []
        ray = self._ray()
        data = require("ray.data", extra="ray")
        size = min(self._pool_size(ray, stage), len(batches))
        gpus = self.num_gpus if stage == "embed" else 0.0
        # Boxed batches are Python objects to Arrow: say that is intended (it is Ray's
        # default, but unset it logs a warning for every build).
        data.DataContext.get_current().enable_fallback_to_arrow_object_ext_type = True
        ds = data.from_items([{"index": i, "item": _Box(b)} for i, b in enumerate(batches)])
        ds = ds.map_batches(
            _BatchWorker,
            fn_constructor_args=(fn,),
            batch_size=1,  # one builder batch per call: the builder chose its composition
            batch_format="numpy",
            compute=data.ActorPoolStrategy(min_size=1, max_size=size),
            num_cpus=self.num_cpus_per_task,
            num_gpus=gpus,
        )
        try:
            done = ds.take_all()
        except RaptorError:
            raise
        except Exception as exc:
            # The pool itself failed (an actor could not be created, a worker died, the
            # function could not be sent): the batches' own errors come back as values.
            raise stage_error(stage, f"{len(batches)} batches on Ray", exc) from exc
        results: list[Any] = [None] * len(batches)
        for row in done:
            results[int(row["index"])] = row["out"]
        for i, result in enumerate(results):
            if isinstance(result, _Failed):
                self._raise_failed(stage, f"batch {i + 1} of {len(batches)}", result)
        return results

    def map_tasks(
        self,
        fn: Callable[[T], R],
        items: Sequence[T],
        *,
        stage: str,
        max_concurrency: int | None = None,
    ) -> list[R]:
        """Run ``fn`` on each item as a Ray task, at most ``max_concurrency`` at once.

        After the first failure no further task starts and those in flight are cancelled.
        """
        if max_concurrency is not None and (
            isinstance(max_concurrency, bool)
            or not isinstance(max_concurrency, int)
            or max_concurrency < 1
        ):
            msg = f"max_concurrency must be a positive integer or None, got {max_concurrency!r}"
            raise InvalidParameterError(msg)
        if not items:
            return []
        ray = self._ray()
        try:
            fn_ref = ray.put(fn)  # sent once, not with every task
        except Exception as exc:
            msg = (
                f"{stage} stage: the work cannot be sent to Ray workers ({type(exc).__name__}: "
                f"{exc}); use components that pickle (clients created on first use)"
            )
            raise InvalidParameterError(msg) from exc
        remote = ray.remote(_run_task).options(num_cpus=self.num_cpus_per_task, max_retries=0)
        window = max_concurrency or len(items)
        results: list[Any] = [None] * len(items)
        pending: dict[Any, int] = {}
        next_item = 0
        try:
            while next_item < len(items) or pending:
                while next_item < len(items) and len(pending) < window:
                    pending[remote.remote(fn_ref, items[next_item])] = next_item
                    next_item += 1
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    i = pending.pop(ref)
                    what = f"item {i + 1} of {len(items)}"
                    try:
                        result = ray.get(ref)
                    except Exception as exc:  # the worker died, or the task was lost
                        raise stage_error(stage, what, exc) from exc
                    if isinstance(result, _Failed):
                        self._raise_failed(stage, what, result)
                    results[i] = result
        except BaseException:
            for ref in pending:
                ray.cancel(ref)  # a failure or Ctrl-C: spend nothing more
            raise
        return results

    @staticmethod
    def _raise_failed(stage: str, what: str, failed: _Failed) -> None:
        logger.debug("%s stage, %s failed on a Ray worker:\n%s", stage, what, failed.trace)
        error = stage_error(stage, what, failed.error)
        if error is failed.error:
            raise error
        raise error from failed.error
