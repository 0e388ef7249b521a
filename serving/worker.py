"""The single engine worker: one thread serves queued jobs one at a time (the engine is batch 1).

Scheduling: a *short* job (``max_tokens`` at most ``short_tokens``, a robot controller's next action) waits only
behind other short jobs, never behind a long generation: it is queued ahead of every long job, and a long job that
is running pauses at its next cycle boundary (the engine keeps its state and the prefix cache its prompt and
output), lets the short jobs run, then continues ahead of the other long jobs. ``short_tokens`` 0 keeps arrival
order.

The HTTP side creates a :class:`Job`, submits it (:meth:`EngineWorker.submit` raises ``QueueFull`` when
``max_queue`` jobs are already waiting behind the running one) and awaits ``job.future``; streamed text
arrives on ``job.events``. Both are fed from the worker thread through ``loop.call_soon_threadsafe``.

A job ends in exactly one way: a :class:`~edgespec.engine.Completion` (finish reasons ``stop``, ``length``,
``cancelled``; a deadline hit mid-generation ends with ``timed_out`` set and the text so far), or an exception
on the future (:class:`JobError` with the HTTP status the failure maps to). A failure of one job, including an
out-of-memory error, never stops the worker.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from edgespec.engine import Completion, Engine, Request
from edgespec.errors import EdgespecError, PromptTooLongError

from .grammar import GrammarError
from .metrics import ServerMetrics
from .middleware import request_id

log = logging.getLogger("edgespec.serving")


END = object()
"""Put on ``Job.events`` after the last text piece, once ``Job.future`` is settled."""


class QueueFull(Exception):
    """No room for another job; ``retry_after`` is a hint in seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"queue full, retry after {retry_after}s")
        self.retry_after = retry_after


class WorkerStopped(Exception):
    """The worker is draining or stopped and takes no new jobs."""


class JobError(Exception):
    """A job failed; ``status`` and ``code`` say how to answer it."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


@dataclass(eq=False)
class Job:
    """One request on its way through the worker."""

    request: Request
    loop: asyncio.AbstractEventLoop
    deadline: float                                 # time.monotonic() value
    stream: bool = False
    future: asyncio.Future = field(init=False)
    events: asyncio.Queue | None = field(init=False, default=None)
    cancel_event: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)
    started: float | None = None
    first_text: float | None = None
    finished: float | None = None
    timed_out: bool = False
    request_id: str = "-"
    preemptions: int = 0
    drained: bool = False                           # ended by the drain deadline (SIGTERM)

    def __post_init__(self) -> None:
        self.future = self.loop.create_future()
        # A streamed job whose client left may fail with nobody awaiting it: mark the exception as seen.
        self.future.add_done_callback(lambda f: f.cancelled() or f.exception())
        if self.stream:
            self.events = asyncio.Queue()

    def cancel(self) -> None:
        """Ask the worker to stop this job (client went away); safe from any thread."""
        self.cancel_event.set()

    @property
    def queue_s(self) -> float:
        return ((self.started or time.monotonic()) - self.arrived)

    # -- called on the worker thread -------------------------------------------------------------------------
    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _should_stop(self) -> bool:
        if self.cancel_event.is_set():
            return True
        if time.monotonic() >= self.deadline:
            self.timed_out = True
            return True
        return False

    def _on_text(self, text: str) -> None:
        if self.first_text is None:
            self.first_text = time.monotonic()
        if self.events is not None:
            self._post(self.events.put_nowait, text)

    def _resolve(self, result: Completion | None, error: BaseException | None) -> None:
        def settle() -> None:
            if not self.future.done():
                if error is not None:
                    self.future.set_exception(error)
                else:
                    self.future.set_result(result)
            if self.events is not None:
                self.events.put_nowait(END)
        self._post(settle)


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class EngineWorker:
    """Owns the engine's device work: a bounded queue and one thread that runs jobs in arrival order, short jobs
    first (see the module doc)."""

    def __init__(self, engine: Engine, max_queue: int, metrics: ServerMetrics | None = None,
                 stuck_grace_s: float = 60.0, short_tokens: int = 0) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.short_tokens = short_tokens
        self.metrics = metrics
        self.stuck_grace_s = stuck_grace_s
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._short_waiting = 0        # short jobs in the queue (they are all at its front)
        self._accepting = True
        self._stop = False
        self._service_s = 1.0          # moving average of a job's service time, for Retry-After
        self._thread = threading.Thread(target=self._loop, name="edgespec-engine", daemon=True)
        self._thread.start()

    # -- status ----------------------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return self._running is not None

    def is_stuck(self) -> bool:
        """True when the running job is far past its deadline (a hung device): the watchdog stops petting."""
        job = self._running
        return job is not None and time.monotonic() > job.deadline + self.stuck_grace_s

    def retry_after(self) -> int:
        ahead = len(self._queue) + (1 if self._running is not None else 0)
        return int(min(60, max(1, round(self._service_s * ahead))))

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.running.set(1 if self._running is not None else 0)
            self.metrics.waiting.set(len(self._queue))

    # -- submission ------------------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue ``job``; raises QueueFull or WorkerStopped."""
        with self._cond:
            if not self._accepting:
                raise WorkerStopped("server is shutting down")
            outstanding = len(self._queue) + (1 if self._running is not None else 0)
            if outstanding >= self.max_queue + 1:
                raise QueueFull(self.retry_after())
            if self.is_short(job):
                # Behind the short jobs already waiting, ahead of every long one.
                self._queue.insert(self._short_waiting, job)
                self._short_waiting += 1
            else:
                self._queue.append(job)
            self._update_gauges()
            self._cond.notify_all()

    def is_short(self, job: Job) -> bool:
        """A short job never waits behind a long one (see the module doc)."""
        return 0 < job.request.max_tokens <= self.short_tokens

    def _should_yield(self) -> bool:
        # Read without the lock: a stale value only moves the pause by one cycle.
        return self._short_waiting > 0

    def withdraw(self, job: Job) -> bool:
        """Remove a job that has not started (its client left); False if it already runs or ran."""
        with self._cond:
            try:
                self._queue.remove(job)
            except ValueError:
                return False
            if self.is_short(job):
                self._short_waiting -= 1
            self._update_gauges()
        return True

    # -- shutdown --------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop taking jobs; queued and running jobs still complete."""
        with self._cond:
            self._accepting = False

    def wait_idle(self, timeout: float) -> bool:
        """Block until no job runs or waits (True), or ``timeout`` seconds passed (False)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._running is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def end_for_drain(self) -> None:
        """The drain deadline passed: the running job stops at its next cycle (or prefill slice) as if its own
        deadline had passed (``finish_reason`` length, the text so far), a queued job that never started gets 503
        ``draining``, a paused one ends with what it has."""
        now = time.monotonic()
        with self._cond:
            jobs = list(self._queue) + ([self._running] if self._running is not None else [])
            for job in jobs:
                job.drained = True
                job.deadline = min(job.deadline, now)
            self._cond.notify_all()

    def cancel_all(self) -> None:
        """Ask every queued and running job to stop at its next cycle (shutdown past the grace period)."""
        with self._cond:
            jobs = list(self._queue) + ([self._running] if self._running is not None else [])
        for job in jobs:
            job.cancel()

    def stop(self, timeout: float | None = None) -> bool:
        """Close, let the queue drain, then end the thread. True if it ended within ``timeout``."""
        with self._cond:
            self._accepting = False
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the thread ------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                if self.is_short(job):
                    self._short_waiting -= 1
                self._running = job
                self._update_gauges()
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._running = None
                    self._update_gauges()
                    self._cond.notify_all()   # wait_idle

    def _requeue(self, job: Job) -> None:
        """A paused long job goes back ahead of the other long jobs (behind the short ones that paused it)."""
        with self._cond:
            self._queue.insert(self._short_waiting, job)
            self._update_gauges()
            self._cond.notify_all()

    def _run(self, job: Job) -> None:
        request_id.set(job.request_id)
        if job.request.partial is not None:   # a paused job: its checks ran before it first started
            self._generate(job)
            return
        job.started = time.monotonic()
        if job.cancel_event.is_set():
            job._resolve(None, JobError(499, "client closed the request", "cancelled"))
            self._fail("cancelled", job)
            return
        if job.drained:
            job._resolve(None, JobError(503, "the server is shutting down", "draining"))
            self._fail("draining", job)
            return
        if job.started >= job.deadline:
            job.timed_out = True
            job._resolve(None, JobError(504, "request timed out while waiting for the engine", "timeout"))
            self._fail("timeout", job)
            return
        req = job.request
        req.on_text = job._on_text
        req.cancelled = job._should_stop
        if not self.is_short(job):
            req.preempt = self._should_yield
        self._generate(job)

    def _generate(self, job: Job) -> None:
        req = job.request
        try:
            result = self.engine.complete(req)
        except EdgespecError as exc:
            code = ("context_length_exceeded" if isinstance(exc, PromptTooLongError)
                    else "grammar_error" if isinstance(exc, GrammarError) else "invalid_request")
            job._resolve(None, JobError(400, str(exc), code))
            self._fail("invalid_request", job)
        except Exception as exc:  # one request's failure must not end the worker
            if _is_oom(exc):
                log.error("out of memory serving a request (%s); freeing caches and carrying on", exc)
                self._recover_memory()
                job._resolve(None, JobError(503, "the engine ran out of memory on this request; retry or "
                                                 "shorten it", "out_of_memory"))
                self._fail("out_of_memory", job)
            else:
                log.exception("engine failed on a request")
                message = f"engine error: {type(exc).__name__}: {exc}"
                job._resolve(None, JobError(500, message, "internal_error"))
                self._fail("internal_error", job)
        else:
            if result.finish_reason == "preempted":
                job.preemptions += 1
                if self.metrics is not None:
                    self.metrics.preemptions.inc()
                log.info("request paused after %d tokens for a short request", result.completion_tokens)
                self._requeue(job)
                return
            job.finished = time.monotonic()
            self._service_s = 0.8 * self._service_s + 0.2 * (job.finished - job.started)
            reason = "length" if job.timed_out else result.finish_reason
            if self.metrics is not None:
                self.metrics.observe(result.telemetry, reason, queue_s=job.queue_s,
                                     e2e_s=job.finished - job.arrived,
                                     ttft_s=None if job.first_text is None else job.first_text - job.arrived,
                                     energy=result.energy)
            log.info("request done finish=%s timed_out=%s prompt=%d queue=%.0fms %s", reason, job.timed_out,
                     result.prompt_tokens, job.queue_s * 1000.0, result.telemetry.summary())
            job._resolve(result, None)

    def _fail(self, reason: str, job: Job) -> None:
        # A non-streamed job's failure becomes an error response, which the HTTP layer counts; a streamed one has
        # answered 200 already and ends with an error event, so only this count records it.
        if self.metrics is not None and job.stream:
            self.metrics.fail(reason)

    @staticmethod
    def _recover_memory() -> None:
        gc.collect()
        if torch.cuda.is_available():
            try:
                torch.cuda.empty_cache()
            except Exception:  # best effort
                log.warning("torch.cuda.empty_cache failed after OOM", exc_info=True)
