"""Trace runs as background jobs: start, poll progress, cancel. Deliberately small.

A trace takes seconds to minutes, too long for one HTTP request, so ``POST /api/jobs`` starts it on a worker
thread and answers with the job's id; ``GET /api/jobs/{id}`` reports the trace's own progress messages and
fraction (the ``progress`` callback the CLI draws as a bar) and, once done, the same JSON as the CLI's
``--json``; ``DELETE /api/jobs/{id}`` cancels it.

Cancellation is cooperative: the progress callback raises :class:`JobCancelled` at the trace's next progress
report (between steps and layouts), which unwinds the trace like any error. One job runs at a time: a trace
patches process-wide dispatch tables (autocast kernels, allocator hooks), so two at once could disturb each
other; a second start while one runs is refused (409). Finished jobs are kept (the last
:data:`KEEP_JOBS`) so a page can still read the result after a reload.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from trainfit.errors import TrainfitError

#: Finished jobs kept for polling.
KEEP_JOBS = 16


class JobCancelled(Exception):
    """Raised inside a job's progress callback once the job was cancelled."""


class JobState(StrEnum):
    RUNNING = "running"
    DONE = "done"
    ERROR = "error"
    CANCELLED = "cancelled"


@dataclass(slots=True)
class Job:
    """One background run: its state, last progress report, and result or one-line error."""

    id: str
    kind: str
    state: JobState = JobState.RUNNING
    message: str = "starting"
    fraction: float = 0.0
    result: dict[str, Any] | None = None
    error: str | None = None
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event)

    def to_json(self) -> dict[str, Any]:
        end = self.finished if self.finished is not None else time.monotonic()
        return {
            "id": self.id,
            "kind": self.kind,
            "state": self.state.value,
            "message": self.message,
            "fraction": self.fraction,
            "seconds": round(end - self.started, 3),
            "error": self.error,
            "result": self.result,
        }


class JobBusyError(Exception):
    """A job is already running."""


class Jobs:
    """The server's jobs: at most one running, the last few finished ones kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: OrderedDict[str, Job] = OrderedDict()

    def running(self) -> Job | None:
        with self._lock:
            return next((j for j in self._jobs.values() if j.state is JobState.RUNNING), None)

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def start(self, kind: str, work: Callable[[Callable[[str, float], None]], dict[str, Any]]) -> Job:
        """Run ``work(progress)`` on a thread; its return value is the job's result."""
        with self._lock:
            if any(j.state is JobState.RUNNING for j in self._jobs.values()):
                raise JobBusyError("a trace is already running; cancel it or wait for it to finish")
            job = Job(id=uuid.uuid4().hex[:12], kind=kind)
            self._jobs[job.id] = job
            finished = [k for k, j in self._jobs.items() if j.state is not JobState.RUNNING]
            for k in finished[: max(0, len(self._jobs) - KEEP_JOBS)]:
                del self._jobs[k]

        def progress(message: str, fraction: float) -> None:
            if job.cancel.is_set():
                raise JobCancelled
            job.message, job.fraction = message, max(0.0, min(1.0, float(fraction)))

        def run() -> None:
            try:
                result = work(progress)
            except JobCancelled:
                job.state, job.message = JobState.CANCELLED, "cancelled"
            except TrainfitError as exc:
                job.state, job.error = JobState.ERROR, " ".join(str(exc).split())
            except Exception as exc:  # a bug: keep the server up, say what broke
                job.state, job.error = JobState.ERROR, f"internal error: {type(exc).__name__}: {exc}"
            else:
                if job.cancel.is_set():
                    job.state, job.message = JobState.CANCELLED, "cancelled"
                else:
                    job.result, job.state, job.message, job.fraction = result, JobState.DONE, "done", 1.0
            job.finished = time.monotonic()

        threading.Thread(target=run, name=f"trainfit-job-{job.id}", daemon=True).start()
        return job

    def cancel(self, job_id: str) -> Job | None:
        job = self.get(job_id)
        if job is not None and job.state is JobState.RUNNING:
            job.cancel.set()
            job.message = "cancelling at the next progress report"
        return job
