"""Summaries through the OpenAI Batch API: half the price, answers within hours.

:class:`OpenAIBatchSummarizer` is an :class:`~raptor_core.backends.openai.OpenAISummarizer`
that the builder hands a whole layer at once (it is a
:class:`~raptor_core.types.BatchSummarizer`).  The build cache answers what it can first;
the rest goes out as one job:

1. one JSONL file, a ``/v1/chat/completions`` request per cluster (the same request the
   per-call path sends), uploaded with ``purpose="batch"``;
2. ``batches.create(..., completion_window="24h")``, whose id is committed to the build
   cache at once, under a key made of the exact list of requests;
3. ``batches.retrieve`` every ``poll_interval`` seconds until the job ends or
   ``batch_timeout`` runs out;
4. the output file is read, answers are matched to clusters by ``custom_id`` and checked as
   per-call answers are.  A request the job did not answer well (an error line, an empty,
   broken or cut completion, or no line at all) is sent again through the normal per-call
   path at the normal price, and counted as ``batch_fallbacks`` in ``usage``.

A build killed while it waits, and run again with the same cache, finds the recorded id and
waits for that job: nothing is submitted or paid for twice.  Running out of ``batch_timeout``
raises :class:`~raptor_core.exceptions.LLMBatchError` and keeps the record, so a later run
picks the job up.  A job that failed, expired or was cancelled raises ``LLMBatchError`` and
its record is dropped, so the next run submits a new one; what an expired or cancelled job
did answer (and was billed for) is kept in the build cache, and only the rest is submitted
again.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar

from raptor_core.backends.openai import (
    DEFAULT_CHAT_MODEL,
    DEFAULT_SYSTEM_PROMPT,
    OpenAISummarizer,
    _AttemptCounter,
    _InvalidResponse,
)
from raptor_core.exceptions import (
    InvalidParameterError,
    LLMBatchError,
    LLMError,
    LLMRequestError,
    LLMResponseError,
)
from raptor_core.types import DEFAULT_SUMMARY_PROMPT

if TYPE_CHECKING:
    from raptor_core.build.cache import BuildCache

__all__ = ["BATCH_ENDPOINT", "OpenAIBatchSummarizer"]

logger = logging.getLogger(__name__)

BATCH_ENDPOINT = "/v1/chat/completions"
_RUNNING = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
_DEAD = frozenset({"failed", "expired", "cancelled"})
_BATCH_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")


def _namespace(value: Any) -> Any:
    """JSON data as attribute objects, the shape the per-call answer checks read."""
    if isinstance(value, Mapping):
        return SimpleNamespace(**{str(k): _namespace(v) for k, v in value.items()})
    if isinstance(value, list):
        return [_namespace(v) for v in value]
    return value


class OpenAIBatchSummarizer(OpenAISummarizer):
    """:class:`OpenAISummarizer` whose layers go through the OpenAI Batch API.

    Needs a build cache (``TreeBuilder(cache=...)``), where pending jobs are recorded so that
    a rerun resumes them; see the module docstring for the whole protocol.

    Args:
        model, prompt, separator, base_url, api_key, system_prompt, temperature,
            max_tokens_param, on_truncated, timeout, max_retries, backoff, max_backoff:
            as :class:`OpenAISummarizer` (they shape each request of the job, and the
            per-call requests of the fallback).
        poll_interval: seconds between two status checks of a job.
        batch_timeout: seconds to wait for a job before raising ``LLMBatchError`` (the job
            keeps running; a rerun with the same cache waits for it again).
        completion_window: the window the service has to finish a job (OpenAI: ``"24h"``).

    Examples:
        >>> from raptor_core import TreeBuilder
        >>> summarizer = OpenAIBatchSummarizer("gpt-4o-mini", poll_interval=300)
        >>> builder = TreeBuilder(summarizer=summarizer, cache="build-cache")
    """

    #: The builder refuses to run without a build cache (the job records live there).
    requires_cache: ClassVar[bool] = True
    cache_ignore = OpenAISummarizer.cache_ignore | {
        "poll_interval",
        "batch_timeout",
        "completion_window",
    }

    def __init__(
        self,
        model: str = DEFAULT_CHAT_MODEL,
        *,
        prompt: str = DEFAULT_SUMMARY_PROMPT,
        separator: str = "\n\n",
        base_url: str | None = None,
        api_key: str | None = None,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        temperature: float | None = 0.0,
        max_tokens_param: str = "max_tokens",
        on_truncated: str = "retry",
        timeout: float = 60.0,
        max_retries: int = 6,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        pacing: bool = True,
        max_requests_per_minute: int | None = None,
        max_tokens_per_minute: int | None = None,
        poll_interval: float = 60.0,
        batch_timeout: float = 26 * 3600.0,
        completion_window: str = "24h",
    ) -> None:
        super().__init__(
            model,
            prompt=prompt,
            separator=separator,
            base_url=base_url,
            api_key=api_key,
            system_prompt=system_prompt,
            temperature=temperature,
            max_tokens_param=max_tokens_param,
            on_truncated=on_truncated,
            timeout=timeout,
            max_retries=max_retries,
            backoff=backoff,
            max_backoff=max_backoff,
            pacing=pacing,
            max_requests_per_minute=max_requests_per_minute,
            max_tokens_per_minute=max_tokens_per_minute,
        )
        self.poll_interval = poll_interval
        self.batch_timeout = batch_timeout
        self.completion_window = completion_window

    def __repr__(self) -> str:
        return f"OpenAIBatchSummarizer(model={self.llm.model!r})"

    def get_params(self) -> dict[str, Any]:
        """Constructor parameters, without the API key (recorded in ``Tree.params``)."""
        return {
            **super().get_params(),
            "poll_interval": self.poll_interval,
            "batch_timeout": self.batch_timeout,
            "completion_window": self.completion_window,
        }

    def _validate_batch(self) -> None:
        for name in ("poll_interval", "batch_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                msg = f"OpenAIBatchSummarizer: {name} must be a positive number, got {value!r}"
                raise InvalidParameterError(msg)
        if not isinstance(self.completion_window, str) or not self.completion_window:
            msg = (
                "OpenAIBatchSummarizer: completion_window must be a non-empty string such as "
                f"'24h', got {self.completion_window!r}"
            )
            raise InvalidParameterError(msg)

    def check_settings(self) -> None:
        """Validate the prompt, the model's and the batch settings without any request."""
        super().check_settings()
        self._validate_batch()

    # -- the job ---------------------------------------------------------------------------------
    def summarize_batch(
        self,
        clusters: Sequence[Sequence[str]],
        *,
        max_tokens: int,
        cache: BuildCache | None = None,
    ) -> list[str]:
        """Summarise ``clusters`` with one batch job (or the job a killed run left behind).

        Raises:
            InvalidParameterError: no ``cache`` (the builder passes its own), or a bad setting.
            LLMBatchError: the job failed, expired or was cancelled (rerun: a new job is
                submitted), or ``batch_timeout`` ran out (rerun: the same job is awaited).
            LLMAuthenticationError, LLMRequestError, LLMTimeoutError, LLMError: an upload or
                status request failed, as in :meth:`OpenAIChatLLM.complete`.
        """
        if cache is None:
            msg = (
                "OpenAIBatchSummarizer needs a build cache to record its batch jobs: pass "
                "TreeBuilder(cache=DIRECTORY), or cache=BuildCache(DIRECTORY) when calling "
                "summarize_batch yourself"
            )
            raise InvalidParameterError(msg)
        self._validate_batch()
        if not clusters:
            return []
        all_bodies = [self.llm._request(self.render(texts), max_tokens) for texts in clusters]
        # Answers an expired or cancelled job did deliver (kept by an earlier run).
        kept = self._kept_answers(cache, all_bodies)
        pending = [i for i in range(len(all_bodies)) if i not in kept]
        answers: dict[int, str] = {}
        if pending:
            answers = self._run_job(cache, [all_bodies[i] for i in pending])
        by_cluster = {**kept, **{pending[j]: text for j, text in answers.items()}}
        for body in (all_bodies[i] for i in kept):
            cache.delete_job(self._answer_key(body))  # the summary cache has them from here
        out: list[str] = []
        for i, texts in enumerate(clusters):
            answer = by_cluster.get(i)
            if answer is None:
                # Rare (an error line, a cut or empty answer): the normal per-call path, with
                # its retries and its typed errors, at the normal price.
                self.usage.add(batch_fallbacks=1)
                answer = self.summarize(texts, max_tokens=max_tokens)
            out.append(self._check(answer))
        return out

    def _answer_key(self, body: Mapping[str, Any]) -> str:
        from raptor_core.build.cache import BuildCache

        return BuildCache.job_key(f"openai-batch-answer {self.llm.endpoint}", [body])

    def _kept_answers(self, cache: BuildCache, bodies: list[dict[str, Any]]) -> dict[int, str]:
        kept: dict[int, str] = {}
        for i, body in enumerate(bodies):
            record = cache.get_job(self._answer_key(body))
            summary = record.get("summary") if record else None
            if isinstance(summary, str) and summary.strip():
                kept[i] = summary
        return kept

    def _run_job(self, cache: BuildCache, bodies: list[dict[str, Any]]) -> dict[int, str]:
        """The usable answers, by index into ``bodies``, of the job made of ``bodies``."""
        # The job is the exact list of requests at this server: another list (a prompt, a
        # model or a cluster changed) is another job.
        key = cache.job_key(f"openai-batch {self.llm.endpoint}", bodies)
        client = self.llm._sync_client()
        batch = self._resume(cache, key, client)
        if batch is None:
            batch = self._submit(cache, key, client, bodies)
        batch = self._wait(client, batch)
        status = str(batch.status)
        if status in _DEAD:
            cache.delete_job(key)
            saved = 0
            if status != "failed":
                saved = self._keep_partial(cache, client, batch, bodies)
            raise self._dead(batch, status, saved)
        try:
            answers = self._collect(client, batch, len(bodies))
        except LLMResponseError:
            raise  # a garbled answer (a proxy?), not a verdict on the job: keep the record
        except LLMRequestError as exc:
            # The service deletes files after a while: a job finished long ago, resumed now,
            # may have lost its output.  Forget it, or every rerun would fail the same way.
            cache.delete_job(key)
            msg = (
                f"{self.llm._where()}: the results of batch {batch.id} cannot be read ({exc}); "
                "the job is forgotten: build again to submit a new one"
            )
            raise LLMBatchError(msg, batch_id=str(batch.id), status="completed") from exc
        cache.delete_job(key)
        return answers

    def _keep_partial(
        self, cache: BuildCache, client: Any, batch: Any, bodies: list[dict[str, Any]]
    ) -> int:
        """Store what an expired or cancelled job did answer (paid for): a rerun reuses it."""
        try:
            answers = self._collect(client, batch, len(bodies))
        except LLMError:
            logger.warning(
                "%s: could not read the partial results of batch %s",
                self.llm._where(),
                batch.id,
                exc_info=True,
            )
            return 0
        for index, summary in answers.items():
            cache.put_job(self._answer_key(bodies[index]), {"summary": summary})
        return len(answers)

    def _resume(self, cache: BuildCache, key: str, client: Any) -> Any:
        """The job recorded under ``key``, if the service still knows it."""
        record = cache.get_job(key)
        batch_id = record.get("batch_id") if record else None
        if record is None:
            return None
        if not isinstance(batch_id, str) or not _BATCH_ID.fullmatch(batch_id):
            # The cache file is data: an id goes into a request path only if it looks like
            # one the service gives out (no "/", "?", "..").
            logger.warning("%s: ignoring a malformed batch record %r", self.llm._where(), batch_id)
            cache.delete_job(key)
            return None
        try:
            batch = self._retrieve(client, batch_id)
        except LLMResponseError:
            raise  # a garbled answer is no proof the job is gone: keep the record
        except LLMRequestError:
            # 404: the service no longer has it (or never had: another account); start over.
            logger.warning(
                "%s: batch %s is unknown to the service: submitting a new one",
                self.llm._where(),
                batch_id,
            )
            cache.delete_job(key)
            return None
        logger.info("%s: resuming batch %s (%s)", self.llm._where(), batch_id, batch.status)
        return batch

    def _submit(
        self, cache: BuildCache, key: str, client: Any, bodies: list[dict[str, Any]]
    ) -> Any:
        lines = [
            json.dumps(
                {
                    "custom_id": f"cluster-{i}",
                    "method": "POST",
                    "url": BATCH_ENDPOINT,
                    "body": body,
                },
                ensure_ascii=False,
            )
            for i, body in enumerate(bodies)
        ]
        data = ("\n".join(lines) + "\n").encode("utf-8")
        upload = self.llm._call(
            lambda: client.files.create(
                file=("raptor-summaries.jsonl", data, "application/jsonl"), purpose="batch"
            )
        )
        batch = self.llm._call(
            lambda: client.batches.create(
                input_file_id=upload.id,
                endpoint=BATCH_ENDPOINT,
                completion_window=self.completion_window,
                metadata={"raptor_job": key[:32]},  # findable in the dashboard
            )
        )
        # Committed before the first wait: from here on, a killed run is resumed, not repaid.
        cache.put_job(
            key, {"batch_id": batch.id, "input_file_id": upload.id, "requests": len(bodies)}
        )
        self.usage.add(batches=1, batch_requests=len(bodies))
        logger.info(
            "%s: submitted batch %s of %d requests", self.llm._where(), batch.id, len(bodies)
        )
        return batch

    def _wait(self, client: Any, batch: Any) -> Any:
        """The job once it has ended (completed, failed, expired or cancelled)."""
        deadline = time.monotonic() + float(self.batch_timeout)
        while True:
            status = str(getattr(batch, "status", ""))
            if status == "completed" or status in _DEAD:
                return batch
            if status not in _RUNNING:
                msg = f"{self.llm._where()}: batch {batch.id} has an unknown status {status!r}"
                raise LLMBatchError(msg, batch_id=str(batch.id), status=status)
            left = deadline - time.monotonic()
            if left <= 0:
                msg = (
                    f"{self.llm._where()}: batch {batch.id} is still {status} after "
                    f"{self.batch_timeout:g}s (batch_timeout); it keeps running: build again "
                    "with the same cache to wait for it (nothing is submitted twice), or raise "
                    "batch_timeout"
                )
                raise LLMBatchError(msg, batch_id=str(batch.id), status=status)
            time.sleep(min(float(self.poll_interval), left))
            batch = self._retrieve(client, str(batch.id))

    def _retrieve(self, client: Any, batch_id: str) -> Any:
        return self.llm._call(lambda: client.batches.retrieve(batch_id))

    def _dead(self, batch: Any, status: str, saved: int) -> LLMBatchError:
        where, batch_id = self.llm._where(), str(batch.id)
        counts = getattr(batch, "request_counts", None)
        done = getattr(counts, "completed", None)
        total = getattr(counts, "total", None)
        progress = f" ({done} of {total} requests done)" if done is not None and total else ""
        if saved:
            progress += (
                f"; its {saved} answers are kept in the build cache, so only the others are "
                "submitted again"
            )
        if status == "failed":
            errors = getattr(getattr(batch, "errors", None), "data", None) or []
            said = "; ".join(str(getattr(e, "message", e)) for e in errors[:3])
            msg = (
                f"{where}: batch {batch_id} failed"
                + (f" ({said})" if said else "")
                + ": check the model name and parameters; the failed batch is forgotten, so "
                "building again submits a new one"
            )
        elif status == "expired":
            msg = (
                f"{where}: batch {batch_id} expired: the service did not finish it within "
                f"{self.completion_window}{progress}; build again to submit a new batch, or use "
                "OpenAISummarizer (per call, full price) for this build"
            )
        else:
            msg = (
                f"{where}: batch {batch_id} was cancelled{progress}; build again to submit a "
                "new batch"
            )
        return LLMBatchError(msg, batch_id=batch_id, status=status)

    def _collect(self, client: Any, batch: Any, n: int) -> dict[int, str]:
        """The usable answers of a finished job, by request index."""
        answers: dict[int, str] = {}
        error_id = getattr(batch, "error_file_id", None)
        if error_id:
            # Only read to say why: those requests go through the per-call fallback.
            errors = self.llm._call(lambda: client.files.content(error_id)).text
            lines = [line for line in str(errors).splitlines() if line.strip()]
            logger.warning(
                "%s: batch %s answered %d request(s) with an error (first: %.200s)",
                self.llm._where(),
                batch.id,
                len(lines),
                lines[0] if lines else "",
            )
        output_id = getattr(batch, "output_file_id", None)
        if not output_id:
            return answers
        text = self.llm._call(lambda: client.files.content(output_id)).text
        for line in str(text).splitlines():
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except (ValueError, RecursionError):
                continue  # a broken line: its request goes through the fallback
            index = self._index(item, n)
            response = item.get("response") if isinstance(item, dict) else None
            if index is None or not isinstance(response, dict):
                continue
            if response.get("status_code") != 200 or not isinstance(response.get("body"), dict):
                continue
            attempts = _AttemptCounter(1)
            attempts.next()  # not the last attempt: a cut answer is sent again per call
            try:
                answers[index] = self.llm._answer(_namespace(response["body"]), attempts)
            except (_InvalidResponse, LLMError) as exc:
                logger.warning(
                    "%s: batch answer %d unusable (%s): asking again", self.llm._where(), index, exc
                )
        return answers

    @staticmethod
    def _index(item: object, n: int) -> int | None:
        custom_id = item.get("custom_id") if isinstance(item, dict) else None
        if not isinstance(custom_id, str) or not custom_id.startswith("cluster-"):
            return None
        digits = custom_id.removeprefix("cluster-")
        if not digits.isdigit() or int(digits) >= n:
            return None
        return int(digits)
