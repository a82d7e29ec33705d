"""A small background job runner: one thread ("lane") per key, jobs that poll without holding it.

Knows nothing of checkpoints.  A job is a function that runs to completion, or returns the
monotonic time at which to run it again (a poll); between polls its lane runs other jobs, so a
job waiting for something never delays the jobs queued behind it.  A job that raises is
reported through ``on_crash``; failures recorded with :meth:`JobRunner.fail` are raised by
:meth:`JobRunner.wait` / :meth:`JobRunner.close`, never on the thread that queued the work.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from dcp_tiered.thread_priority import lower_thread_priority

log = logging.getLogger(__name__)

#: First and longest wait (seconds) between two polls of a job (:meth:`Job.poll_again`).
POLL_FIRST, POLL_MAX = 0.05, 2.0

#: Builds the error raised by ``wait``/``close``: (message, the causes of the failures, if any).
ErrorFactory = Callable[[str, "list[BaseException | None]"], Exception]


@dataclass(eq=False)
class Job:
    """One unit of background work on a lane; ``fn(job)`` returns when to run it again, or None when done."""

    lane: str
    fn: Callable[["Job"], float | None]
    what: str
    args: tuple = ()
    reads: Hashable | None = None  # what the job reads (the owner asks which are in use: :meth:`JobRunner.jobs`)
    state: str = "queued"
    data: dict = field(default_factory=dict)  # progress kept between runs

    def poll_again(self, state: str | None = None) -> float:
        """Wait before the next run, doubling from :data:`POLL_FIRST` to :data:`POLL_MAX`; the time to run again."""
        if state is not None:
            self.state = state
        self.data["delay"] = min(POLL_MAX, self.data.get("delay", POLL_FIRST / 2) * 2)
        return time.monotonic() + self.data["delay"]


class _Lane:
    def __init__(self, cond: threading.Condition) -> None:
        self.cond = cond
        self.ready: deque[Job] = deque()
        self.later: list[tuple[float, int, Job]] = []  # heap: (monotonic time, seq, job)
        self.thread: threading.Thread | None = None


def _default_error(message: str, causes: list[BaseException | None]) -> Exception:
    return RuntimeError(message)


class JobRunner:
    """Lanes of background jobs: per lane in order, lanes independent of each other.

    ``noun`` names the work in messages ("3 promotion(s) failed"); ``make_error`` builds the
    exception that :meth:`wait`/:meth:`close` raise; ``on_crash(job, exc)`` is told about a job
    that raised (default: :meth:`fail`); ``nice`` lowers the lanes' CPU priority.
    """

    def __init__(self, *, noun: str = "job", make_error: ErrorFactory = _default_error,
                 on_crash: Callable[[Job, Exception], None] | None = None, nice: int | None = 10,
                 thread_prefix: str = "dcp_tiered-jobs") -> None:
        self.noun, self.make_error, self.nice, self.thread_prefix = noun, make_error, nice, thread_prefix
        self.on_crash = on_crash
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._jobs: dict[Job, None] = {}  # pending jobs, in submission order
        self._lanes: dict[str, _Lane] = {}
        self._failures: list[tuple[str, BaseException | None]] = []
        self._seq = itertools.count()
        self.stopped = threading.Event()

    # -- queueing ---------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue ``job`` on its lane (started on first use); refused once the runner is closed."""
        if self.stopped.is_set():
            raise self.make_error(f"the {self.noun} runner is closed", [])
        with self._lock:
            self._jobs[job] = None
            lane = self._lanes.get(job.lane)
            if lane is None:
                lane = self._lanes[job.lane] = _Lane(threading.Condition(self._lock))
                lane.thread = threading.Thread(target=self._loop, args=(lane,), name=f"{self.thread_prefix}-{job.lane}",
                                               daemon=True)
                lane.thread.start()
            lane.ready.append(job)
            lane.cond.notify()

    def jobs(self) -> list[Job]:
        """The queued and running jobs, in submission order (a snapshot)."""
        with self._lock:
            return list(self._jobs)

    def pending(self) -> list[str]:
        """What is still queued or running, one line per job."""
        with self._lock:
            return [f"{j.what}: {j.state}" for j in self._jobs]

    # -- failures, waiting, closing ---------------------------------------------------

    def fail(self, line: str, cause: BaseException | None = None) -> None:
        """Record a failure, raised by the next :meth:`wait`/:meth:`raise_failures`."""
        with self._lock:
            self._failures.append((line, cause))

    def raise_failures(self) -> None:
        """Raise the failures recorded since the last call (one error listing them all), if any."""
        with self._lock:
            failed, self._failures = self._failures, []
        if failed:
            raise self.make_error(f"{len(failed)} {self.noun}(s) failed: " + "; ".join(line for line, _ in failed),
                                  [cause for _, cause in failed])

    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued job ran, then :meth:`raise_failures`.

        ``timeout`` (seconds): give up then with an error listing what is still pending (the jobs go on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._jobs:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    pending = [f"{j.what}: {j.state}" for j in self._jobs]
                    raise self.make_error(f"{len(pending)} {self.noun} job(s) still pending after {timeout}s: "
                                          + "; ".join(pending[:10]), [])
                self._idle.wait(left)
        self.raise_failures()

    def close(self, wait: bool = True, timeout: float | None = None) -> None:
        """Finish queued work (``wait``, at most ``timeout`` seconds) or drop it, then stop the lanes.

        Raises recorded failures, or the error listing what was still pending when ``timeout`` ran
        out (that work is dropped).  A job stuck in I/O cannot be interrupted: its daemon thread is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if wait:
                self.wait(timeout)
        finally:
            self.stopped.set()
            with self._lock:
                lanes = list(self._lanes.values())
                for lane in lanes:
                    lane.cond.notify_all()
            if deadline is None:  # dropping work (wait=False) does not wait long for a stuck job
                deadline = time.monotonic() + (60.0 if wait else 2.0)
            for lane in lanes:
                if lane.thread is not None and lane.thread is not threading.current_thread():
                    lane.thread.join(timeout=max(0.1, deadline - time.monotonic()))

    # -- the lanes --------------------------------------------------------------------

    def _done(self, job: Job) -> None:
        """Forget a finished or dropped job (the lock is held)."""
        self._jobs.pop(job, None)
        self._idle.notify_all()

    def _next(self, lane: _Lane) -> Job | None:
        """The lane's next job to run (None: stop); jobs waiting to poll again wait in a heap (the lock is held)."""
        while True:
            if self.stopped.is_set():
                for job in list(lane.ready) + [j for _, _, j in lane.later]:
                    self._done(job)
                lane.ready.clear()
                lane.later.clear()
                return None
            now = time.monotonic()
            if lane.later and lane.later[0][0] <= now:  # a due poll is quick: before the next long job
                return heapq.heappop(lane.later)[2]
            if lane.ready:
                return lane.ready.popleft()
            lane.cond.wait(lane.later[0][0] - now if lane.later else None)

    def _loop(self, lane: _Lane) -> None:
        lower_thread_priority(self.nice)
        while True:
            with self._lock:
                job = self._next(lane)
                if job is None:
                    return
                if job.state == "queued":
                    job.state = "running"
            again = None
            try:
                again = job.fn(job)
            except Exception as exc:  # reported, and raised at wait(); the thread must live on
                log.exception("background job failed: %s", job.what)
                self._crashed(job, exc)
            with self._lock:
                if again is not None and not self.stopped.is_set():
                    heapq.heappush(lane.later, (again, next(self._seq), job))
                else:
                    self._done(job)

    def _crashed(self, job: Job, exc: Exception) -> None:
        try:
            if self.on_crash is not None:
                self.on_crash(job, exc)
            else:
                self.fail(f"{job.what}: {type(exc).__name__}: {exc}", exc)
        except Exception:  # the hook itself failed: still surface the job's failure
            log.exception("reporting a failed background job failed")
            self.fail(f"{job.what}: {type(exc).__name__}: {exc}", exc)
