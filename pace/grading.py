"""Grading in worker processes, a deadline per job, and failures that reach the caller.

``Grader`` runs `pace.reward.grade_batch` (or a test's ``fn``) in worker *processes* it can kill
(`pace.grading_workers`: why processes, and how a worker is started, warmed up and restarted). Its
watchdog thread hands queued jobs to idle workers, collects their scores and enforces the deadlines.

What can go wrong, and what the caller sees:

- a job overruns its deadline: its worker is killed and replaced; its answers score wrong and
  count under ``reward/timeouts``;
- a worker dies mid-job (OOM kill, segfault, ``os._exit``): the job is retried once on a fresh
  worker, then its answers score wrong under ``reward/errors``; ``fn`` raising or returning a bad
  result, and an answer whose grading fails (``None`` from ``fn``), are ``reward/errors`` too;
- a worker found dead while idle (killed from outside) is replaced; the job waits for it;
- a worker that cannot start is restarted with back-off, a few times (`pace.grading_workers`).

The grader **fails** — every outstanding job's ``result`` and every later ``submit`` raise
`GraderError`, whose message names the cause with its traceback — when no worker can start, when
its watchdog thread raises, or when ``max_failed_in_row`` answers in a row could not be graded
(timeouts or errors: a run whose every group would be filtered must stop, not wait forever). It
never hands out scores for answers it did not try to grade. A script that creates a ``Grader`` must
keep its work under ``if __name__ == "__main__":`` (spawned workers import the main module).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError
from concurrent.futures import wait as wait_futures
from concurrent.futures.process import BrokenProcessPool

from pace import reward
from pace.grading_job import GradeJob, GraderError
from pace.grading_workers import NO_WORKER_HINT, START_ATTEMPTS, WARMUP_TIMEOUT_S, WorkerSlot, exception_of

log = logging.getLogger(__name__)

# Times a job may lose its worker (the process died under it) before its answers score as errors.
JOB_ATTEMPTS = 2

GradeFn = Callable[[list[str], list[str]], list[bool]]


class Grader:
    """Grades batches in ``workers`` processes, each job bounded by ``timeout_s`` seconds.

    ``stats()`` counts *answers* under ``reward/graded``, ``reward/timeouts`` and ``reward/errors``
    (their sum is the number of answers finished), plus worker ``reward/restarts``. A job's
    deadline starts when it is handed to an idle, warmed-up worker, so jobs queued behind a slow
    one are never timed out for waiting. ``fn`` replaces the batch grader (tests pass a top-level
    function that hangs or exits); it must be picklable by reference. ``max_failed_in_row``
    (answers; 0 or None: never) fails the grader when that many answers in a row could not be graded.

    Cost (2-core box): ≈0.01 ms per plain-integer answer, ≈4 ms per LaTeX answer, plus one round
    trip per job, so a 5 s deadline fits jobs of a few hundred answers with room to spare; submit
    a group or a batch per job, not a whole epoch.
    """

    def __init__(self, workers: int = 1, timeout_s: float = 5.0, fn: GradeFn | None = None,
                 max_failed_in_row: int | None = None):
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"Grader: need workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        if getattr(mp.current_process(), "_inheriting", False):  # a spawned worker re-running a script
            raise GraderError('a Grader was created while a spawned process imported the main module: keep '
                              'the work of the script under `if __name__ == "__main__":`')
        self.fn: GradeFn = fn if fn is not None else reward.grade_batch
        try:  # fail here, not in the watchdog, if fn cannot reach a worker
            pickle.dumps(self.fn)
        except Exception as e:
            raise TypeError(f"Grader: fn must be a picklable top-level function, got {self.fn!r}") from e
        self.workers = workers
        self.timeout_s = timeout_s
        self.max_failed_in_row = max_failed_in_row or 0
        self._lock = threading.Lock()
        self._kick = threading.Event()  # set by submit / future callbacks to wake the watchdog
        self._pending: deque[GradeJob] = deque()
        self._counts = dict.fromkeys(
            ("reward/graded", "reward/timeouts", "reward/errors", "reward/restarts"), 0
        )
        self._failed_in_row = 0  # answers not graded since the last graded one
        self._failure: str | None = None  # why the grader failed (message + traceback)
        self._closed = False  # no more submits (close() or a failure)
        self._shut = False  # workers stopped (close() ran)

        # Warm up: spawn every worker and import math-verify now, so the first job is fast.
        # Measured on the 2-core dev box: 0.45 s for 1 worker, 1.4 s for 2 started together; mostly
        # the sympy import (≈0.3 s) and the first LaTeX parse (≈0.1 s). A replacement after a kill
        # costs the same. See ``startup_s``. A start that fails here is retried by the watchdog.
        t0 = time.monotonic()
        self._slots = [WorkerSlot() for _ in range(workers)]
        with self._lock:
            for slot in self._slots:
                self._start(slot, restart=False)
        wait_futures([s.future for s in self._slots if s.future is not None], timeout=WARMUP_TIMEOUT_S)
        self.startup_s = time.monotonic() - t0

        self._watchdog = threading.Thread(target=self._watch, name="reward-grader", daemon=True)
        self._watchdog.start()

    # ------------------------------------------------------------ public API

    def submit(self, responses: list[str], golds: list[str], timeout_s: float | None = None) -> GradeJob:
        """Queue one batch; it runs as a single task in one worker, with deadline ``timeout_s``
        (default: the grader's) from the moment a worker starts it. Raises `GraderError` once
        the grader has failed or closed."""
        if len(responses) != len(golds):
            raise ValueError(f"Grader.submit: {len(responses)} responses but {len(golds)} golds")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"Grader.submit: timeout_s must be > 0, got {timeout_s}")
        self.check()
        job = GradeJob(list(responses), list(golds), timeout_s or self.timeout_s)
        if not job.responses:
            job._finish([])
            return job
        with self._lock:
            if self._failure is not None:
                raise GraderError(self._failure)
            if self._closed:
                raise GraderError("Grader.submit after close()")
            self._pending.append(job)
        self._kick.set()
        return job

    def grade(self, responses: list[str], golds: list[str]) -> list[bool]:
        return self.submit(responses, golds).result()

    @property
    def failure(self) -> str | None:
        """Why the grader failed (with the cause's traceback), or None while it works."""
        return self._failure

    def check(self) -> None:
        """Raise `GraderError` if the grader has failed (cheap: callers poll it)."""
        if self._failure is not None:
            raise GraderError(self._failure)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def state_dict(self) -> dict:
        """The counters (a resumed run continues them)."""
        return self.stats()

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self._counts.update({k: v for k, v in state.items() if k in self._counts})

    def close(self) -> None:
        """Stop the workers. Jobs not finished by now raise `GraderError` from ``result``."""
        with self._lock:
            if self._shut:
                return
            self._closed = self._shut = True
        self._kick.set()
        self._watchdog.join(timeout=10.0)
        with self._lock:
            for slot in self._slots:
                slot.close()
                if slot.job is not None:
                    slot.job._abort("the grader was closed before this job finished")
                    slot.job = None
            while self._pending:
                self._pending.popleft()._abort("the grader was closed before this job finished")

    def __enter__(self) -> Grader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ watchdog thread

    def _watch(self) -> None:
        """Finish done jobs, kill overdue ones, (re)start workers, hand pending jobs to idle ones."""
        try:
            while True:
                self._kick.clear()  # before the pass: a kick during it makes the next wait return
                with self._lock:
                    if self._closed:
                        return
                    now = time.monotonic()
                    for slot in self._slots:
                        self._service(slot, now)
                    if all(s.dead for s in self._slots):
                        errors = "; ".join(dict.fromkeys(s.last_error for s in self._slots))
                        self._give_up(f"no grading worker could start ({START_ATTEMPTS} attempts each, "
                                      f"{len(self._slots)} worker(s)): {errors}. Hint: {NO_WORKER_HINT}",
                                      self._slots[-1].last_traceback)
                    if self._closed:
                        return
                    self._dispatch()
                    wait_s = self._next_wait(time.monotonic())
                self._kick.wait(wait_s)
        except BaseException as exc:  # noqa: BLE001 - never leave a caller waiting on a dead watchdog
            with self._lock:
                self._give_up(f"the grading watchdog thread raised {exc!r}", traceback.format_exc())

    def _give_up(self, why: str, tb: str = "") -> None:
        """Fail the grader (lock held): outstanding jobs and later submits raise `GraderError`."""
        if self._failure is None:
            self._failure = f"grader failed: {why}" + (f"\n{tb.rstrip()}" if tb else "")
            log.error("%s", self._failure)
        self._closed = True
        for slot in self._slots:
            if slot.job is not None:
                slot.job._abort(self._failure)
                slot.job = None
        while self._pending:
            self._pending.popleft()._abort(self._failure)

    def _start(self, slot: WorkerSlot, restart: bool) -> None:
        if restart:
            self._counts["reward/restarts"] += 1
        slot.start(lambda _: self._kick.set())

    def _service(self, slot: WorkerSlot, now: float) -> None:
        if slot.dead or (slot.ready and slot.job is None):
            return
        if slot.retry_at is not None:
            if now >= slot.retry_at:
                self._start(slot, restart=True)
            return
        if slot.job is None:  # warming up
            slot.check_warmup(now)
            return
        if slot.future.done():
            self._collect(slot)
        elif now - slot.started > slot.job.timeout_s:
            job, slot.job = slot.job, None
            self._fail(job, "reward/timeouts", f"a job overran its {job.timeout_s:g} s deadline")
            self._start(slot, restart=True)

    def _collect(self, slot: WorkerSlot) -> None:
        job, fut = slot.job, slot.future
        assert job is not None
        slot.job = None
        exc = exception_of(fut)
        if isinstance(exc, BrokenProcessPool | CancelledError):
            # the worker died under the job (os._exit, OOM kill, segfault): retry it on a fresh one once
            if job.attempts < JOB_ATTEMPTS:
                log.warning("a grading worker died running a job (%r); retrying the job on a new worker", exc)
                self._pending.appendleft(job)
            else:
                self._fail(job, "reward/errors", f"the worker died running the job {job.attempts} times ({exc!r})")
            self._start(slot, restart=True)
            return
        scores = fut.result() if exc is None else None
        if exc is not None or not isinstance(scores, list) or len(scores) != len(job):
            log.warning("reward fn failed or returned a bad result: %r", exc or type(scores))
            self._fail(job, "reward/errors", f"the grading function raised {exc!r}" if exc is not None
                       else f"the grading function returned {type(scores).__name__} for {len(job)} answers")
            return
        failed = sum(s is None for s in scores)  # answers whose grading failed: wrong, counted
        self._counts["reward/graded"] += len(job) - failed
        self._counts["reward/errors"] += failed
        job._finish([bool(s) for s in scores])
        if failed < len(job):
            self._failed_in_row = 0
        else:
            self._not_graded(failed, "grading raised on every answer of a job (check_answer returned None)")

    def _fail(self, job: GradeJob, counter: str, cause: str) -> None:
        """The job's answers score wrong (they were tried and could not be graded), counted."""
        self._counts[counter] += len(job)
        job._finish([False] * len(job))
        self._not_graded(len(job), cause)

    def _not_graded(self, answers: int, cause: str) -> None:
        self._failed_in_row += answers
        if self.max_failed_in_row and self._failed_in_row >= self.max_failed_in_row:
            self._give_up(f"the last {self._failed_in_row} answers could not be graded (timeouts or errors; "
                          f"reward.max_failed_in_row = {self.max_failed_in_row}); the last cause: {cause}")

    def _dispatch(self) -> None:
        for slot in self._slots:
            if not self._pending:
                return
            if not slot.idle:
                continue
            job = self._pending.popleft()
            # The callback only sets an Event: it runs on the executor's thread and must not
            # take self._lock (the watchdog may hold it while calling into that executor).
            if not slot.run(job, self.fn, lambda _: self._kick.set()):  # the idle worker was found dead
                self._pending.appendleft(job)
                self._start(slot, restart=True)

    def _next_wait(self, now: float) -> float:
        """Sleep until the nearest deadline (callbacks and submit wake us earlier)."""
        deadlines = [d for s in self._slots for d in s.deadlines()]
        if not deadlines:
            return 1.0
        return min(1.0, max(0.0, min(deadlines) - now) + 0.01)
