"""Two updates of one index racing each other, forced without timing.

An update reads the tree, computes the new one and writes it back; two of them that read the
same tree each write back their own change only.  :class:`GatedEmbedder` holds the first
update after it has read the tree until the second is under way, and :class:`ContendedLock`
(the index's update lock) lets the first go on as soon as the second finds the lock taken.
Used by the LangChain and LlamaIndex concurrency tests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import NDArray

from raptor_core._async import UpdateLock
from raptor_core.testing import FakeEmbedder

__all__ = ["FIRST", "SAFETY_S", "SECOND", "ContendedLock", "GatedEmbedder"]

FIRST = "Bread needs flour. Yeast makes dough rise. Ovens bake the loaf. Crust turns brown."
SECOND = "Violins have strings. Bows draw the notes. Cellos sing low. Orchestras tune up."
#: Generous: only reached when an update never arrives (the test then fails, not hangs).
SAFETY_S = 30.0


class GatedEmbedder(FakeEmbedder):
    """Holds the first update's embedding until the second update has got under way.

    Once ``armed``, the first call that embeds a chunk of ``FIRST`` sets ``holding`` and
    waits for ``release``; embedding a chunk of ``SECOND`` sets ``release``.  Without a lock
    both updates then read the same tree; with one the second waits for the lock and
    :class:`ContendedLock` sets ``release`` instead.
    """

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.armed = False
        self.holding = threading.Event()
        self.release = threading.Event()
        self.timed_out = False

    def embed_documents(self, texts: Sequence[str]) -> NDArray[np.float32]:
        if self.armed and any(t in SECOND for t in texts):
            self.release.set()
        if self.armed and any(t in FIRST for t in texts):
            self.armed = False  # once: summaries of the first document embed freely
            self.holding.set()
            self.timed_out = not self.release.wait(SAFETY_S)
        return super().embed_documents(texts)


class ContendedLock(UpdateLock):
    """An index's update lock, calling ``on_wait`` when an update finds it taken."""

    __slots__ = ("_on_wait",)

    def __init__(self, on_wait: Callable[[], None]) -> None:
        super().__init__()
        self._on_wait = on_wait

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if super().acquire(blocking=False):
            return True
        self._on_wait()
        return super().acquire(blocking, timeout) if blocking else False
