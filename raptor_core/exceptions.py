"""Exceptions raised by raptor_core.

The hierarchy::

    RaptorError
    ├── InvalidParameterError (also ValueError)   a parameter is out of range or of the wrong kind
    ├── InvalidInputError (also ValueError)       a document or query cannot be used (empty, binary, …)
    ├── MissingDependencyError (also ImportError) an optional package is not installed
    ├── TreeFormatError (also ValueError)         a saved tree is truncated, edited or foreign
    ├── TreeLockError (also TimeoutError)         another process kept a tree directory locked too long
    ├── TreeSaveError (also OSError)              the disk refused a save; the tree saved before is intact
    ├── CacheError                                the build cache is damaged, foreign, newer or locked
    ├── BudgetExceededError                       the next LLM call would take spend past the build's cap
    └── BackendError                              a model or service failed
        ├── EmbeddingError                        the embedder failed or returned unusable vectors
        │   └── EmbeddingResponseError            the service kept answering 200 with an invalid body
        ├── SummarizationError                    the summariser failed or returned nothing usable
        └── LLMError                              a chat/completion model failed or returned garbage
            ├── LLMTimeoutError                   it did not answer in time, even after retries
            ├── LLMBatchError                     a batch job failed, expired, was cancelled or is still running
            └── LLMAuthenticationError            credentials or request rejected: retrying cannot help
                └── LLMRequestError               the request itself: unknown model, bad parameter
                    └── LLMResponseError          the service kept answering 200 with an invalid body

Dual inheritance keeps ``except ValueError`` / ``except ImportError`` working for
callers that do not know about this package, as scikit-learn does with
``NotFittedError(ValueError, AttributeError)``.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BudgetExceededError",
    "CacheError",
    "EmbeddingError",
    "EmbeddingResponseError",
    "InvalidInputError",
    "InvalidParameterError",
    "LLMAuthenticationError",
    "LLMBatchError",
    "LLMError",
    "LLMRequestError",
    "LLMResponseError",
    "LLMTimeoutError",
    "MissingDependencyError",
    "RaptorError",
    "SummarizationError",
    "TreeFormatError",
    "TreeLockError",
    "TreeSaveError",
]


class RaptorError(Exception):
    """Base class of every error raised on purpose by this package."""


class InvalidParameterError(RaptorError, ValueError):
    """A parameter has an invalid value (raised where the parameter is used)."""


class InvalidInputError(RaptorError, ValueError):
    """Input data (a document, a file, a query) cannot be processed."""


class MissingDependencyError(RaptorError, ImportError):
    """An optional dependency is missing; the message names the command that installs it."""


class TreeFormatError(RaptorError, ValueError):
    """A saved tree cannot be loaded: missing, truncated, edited or not a RAPTOR tree."""


class CacheError(RaptorError):
    """The build cache cannot be used: damaged, not a cache, newer, or locked too long.

    The message says what to do (usually: delete the cache directory, or build with
    ``--no-resume``, which starts the cache afresh).
    """


class BudgetExceededError(RaptorError):
    """A build stopped before an LLM call whose worst case would take spend past its cap.

    Raised by :class:`~raptor_core.build.builder.TreeBuilder` with a
    :class:`~raptor_core.build.budget.LLMBudget`.  Nothing beyond the cap was requested, and the
    calls still in flight were waited for, so every answer paid for is in the build cache: rerun
    with the same cache and a higher cap and they are cache hits that cost nothing.

    Attributes:
        spent_usd: what the build's summary calls cost (None without prices).
        spent_tokens: prompt plus completion tokens of the build's summary calls.
        calls: summary calls answered.
        max_cost_usd, max_summary_tokens: the caps (None: not capped).
        needed_usd, needed_tokens: the worst case of the call that was not made.
    """

    def __init__(
        self,
        message: str,
        *,
        spent_usd: float | None = None,
        spent_tokens: int = 0,
        calls: int = 0,
        max_cost_usd: float | None = None,
        max_summary_tokens: int | None = None,
        needed_usd: float | None = None,
        needed_tokens: int = 0,
    ) -> None:
        super().__init__(message)
        self.spent_usd = spent_usd
        self.spent_tokens = spent_tokens
        self.calls = calls
        self.max_cost_usd = max_cost_usd
        self.max_summary_tokens = max_summary_tokens
        self.needed_usd = needed_usd
        self.needed_tokens = needed_tokens


class TreeLockError(RaptorError, TimeoutError):
    """Another process held a tree directory's save lock for longer than the save waits."""


class TreeSaveError(RaptorError, OSError):
    """Writing a tree failed (disk full, permissions): what was saved there before still loads.

    ``errno``, ``strerror`` and ``filename`` are those of the ``OSError`` it wraps.
    """

    def __str__(self) -> str:
        # OSError formats itself from errno and strerror when they are set; the message,
        # which says what is safe and what to do, is ours.
        return str(self.args[0]) if self.args else super().__str__()


class BackendError(RaptorError):
    """A model or remote service failed."""


class EmbeddingError(BackendError):
    """The embedder failed or returned unusable vectors (wrong shape, NaN, all zeros)."""


class EmbeddingResponseError(EmbeddingError):
    """The embedding service answered HTTP 200 with invalid embeddings on every attempt.

    Invalid: not JSON, no ``data`` list, a wrong count or dimension, non-numbers.
    """


class SummarizationError(BackendError):
    """The summariser failed or returned an unusable summary."""


class LLMError(BackendError):
    """A chat/completion model failed or returned unusable output."""


class LLMTimeoutError(LLMError):
    """A model call timed out, after all retries."""


class LLMBatchError(LLMError):
    """A batch job (OpenAI Batch API) failed, expired or was cancelled, or outlived the wait.

    The message says what to do: a job that is still running is picked up again by a rerun
    with the same build cache; a failed one is forgotten, so a rerun submits a new one.

    Attributes:
        batch_id: the service's id of the job.
        status: its last known status (``"failed"``, ``"expired"``, ``"cancelled"``, or the
            status it was in when the wait ran out).
    """

    def __init__(self, message: str, *, batch_id: str = "", status: str = "") -> None:
        super().__init__(message)
        self.batch_id = batch_id
        self.status = status


class LLMAuthenticationError(LLMError):
    """The service rejected the credentials or the request: retrying cannot help."""


class LLMRequestError(LLMAuthenticationError):
    """The service rejected the request itself (unknown model, bad parameter), not the key.

    A subclass of :class:`LLMAuthenticationError` so that code which stops on "retrying cannot
    help" (``except LLMAuthenticationError``) stops on it too.
    """


class LLMResponseError(LLMRequestError):
    """The chat service answered HTTP 200 with an invalid completion on every attempt.

    Invalid: not JSON, no ``choices`` list, empty or non-text content.  A subclass of :class:`LLMRequestError`: more retries would not help; the server (or a
    proxy in front of it, or a ``base_url`` pointing at a web page) needs fixing.
    """
