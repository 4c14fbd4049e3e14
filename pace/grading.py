"""Grading in worker processes, a deadline per job, and failures that reach the caller.

``Grader`` runs `pace.reward.grade_batch` (or a test's ``fn``) in worker *processes*. Why
processes and a deadline of our own: math-verify bounds its own work with ``signal.alarm``, which
only works in the main thread of a process, and our rollout calls the reward from a background
thread. Even where the alarm works it only fires between Python bytecodes, so a sympy/bignum
computation stuck in C code (``2^{10^{10}}``) ignores it. The only interrupt that always works is
killing the process, so each worker slot is a one-process ``ProcessPoolExecutor`` (spawn context:
the parent runs threads and an inference engine, and forking such a process can deadlock or
duplicate GPU state). Using one process per slot means we always know which process runs which
job, so a kill never takes innocent jobs down with it.

What can go wrong, and what the caller sees:

- a job overruns its deadline: its worker is killed and replaced; its answers score wrong and
  count under ``reward/timeouts``;
- a worker dies mid-job (OOM kill, segfault, ``os._exit``): the job is retried once on a fresh
  worker, then its answers score wrong under ``reward/errors``; ``fn`` raising or returning a bad
  result, and an answer whose grading fails (``None`` from ``fn``), are ``reward/errors`` too;
- a worker found dead while idle (killed from outside) is replaced; the job waits for it;
- a worker that cannot start (spawn raises, or it dies or fails while warming up) is restarted
  with back-off (``START_BACKOFF_S``, doubling) up to ``START_ATTEMPTS`` times.

The grader **fails** — every outstanding job's ``result`` and every later ``submit`` raise
`GraderError`, whose message names the cause with its traceback — when no worker can start, when
its watchdog thread raises, or when ``max_failed_in_row`` answers in a row could not be graded
(timeouts or errors: a run whose every group would be filtered must stop, not wait forever). It
never hands out scores for answers it did not try to grade.

Spawn re-imports the parent's ``__main__`` in each worker: entry points must keep their work under
``if __name__ == "__main__":`` (without it every worker dies at start and the grader fails, naming
this). The parent imports math-verify only if it grades itself.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor
from concurrent.futures import wait as wait_futures
from concurrent.futures.process import BrokenProcessPool

from pace import reward

log = logging.getLogger(__name__)

# A fresh worker must start and import math-verify within this; otherwise it is restarted.
WARMUP_TIMEOUT_S = 120.0
# Starts (spawn + warm-up) of one worker slot that may fail in a row before the slot is given up,
# and the wait before the first retry (doubled after each: 0.5, 1, 2 s): a failure to fork under
# momentary memory or process pressure passes; a broken entry point fails the grader in seconds.
START_ATTEMPTS = 4
START_BACKOFF_S = 0.5
# Times a job may lose its worker (the process died under it) before its answers score as errors.
JOB_ATTEMPTS = 2

NO_WORKER_HINT = (
    "a worker that dies as it starts is most often a script that creates a Grader without keeping its "
    'work under `if __name__ == "__main__":` (spawned workers import the main module), or a machine out '
    "of memory or processes"
)

GradeFn = Callable[[list[str], list[str]], list[bool]]


class GraderError(RuntimeError):
    """The grader cannot grade: no worker can start, its watchdog failed, or answers stopped being
    graded. The message names the original exception and carries its traceback."""


# ---------------------------------------------------------------- worker process side

def _worker_init() -> None:
    # math-verify logs every timeout with the whole offending string; a 1M-char answer would
    # flood the parent's stderr. Errors still get through.
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def _warmup() -> int:
    """Import math-verify and build its LaTeX parser (≈100 ms the first time) before real jobs."""
    reward.is_correct("Answer: \\frac{1}{2}", "0.5")
    return os.getpid()


def _new_executor() -> ProcessPoolExecutor:
    return ProcessPoolExecutor(
        max_workers=1, mp_context=mp.get_context("spawn"), initializer=_worker_init
    )


def _kill(executor: ProcessPoolExecutor) -> None:
    """Kill the executor's worker now; ``shutdown`` alone would wait for a hung job forever.

    ``_processes`` is private, but it is the only handle on the workers before Python 3.14's
    ``kill_workers()``.
    """
    procs = list((getattr(executor, "_processes", None) or {}).values())
    for p in procs:
        try:
            p.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass
    try:
        executor.shutdown(wait=False, cancel_futures=True)
    except Exception:  # noqa: BLE001 - a broken executor's pipes may be closed already
        pass
    for p in procs:
        p.join(timeout=1.0)  # reap, so killed workers do not linger as zombies


def _exception(fut: Future) -> BaseException | None:
    """The future's exception without raising (a cancelled future's is CancelledError)."""
    return CancelledError() if fut.cancelled() else fut.exception()


# ---------------------------------------------------------------- parent side

class GradeJob:
    """Handle on one submitted batch. ``done`` never blocks (the rollout thread polls it)."""

    def __init__(self, responses: list[str], golds: list[str], timeout_s: float):
        self.responses = responses
        self.golds = golds
        self.timeout_s = timeout_s  # deadline once a worker starts it
        self.attempts = 0  # workers it was handed to
        self._scores: list[bool] | None = None
        self._error: str | None = None
        self._event = threading.Event()

    def __len__(self) -> int:
        return len(self.responses)

    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> list[bool]:
        """The scores, one per response. Raises `GraderError` if the grader failed before grading
        it, and ``TimeoutError`` only if *this wait* times out (the job itself always finishes
        within about its ``timeout_s`` of starting)."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"GradeJob not finished after {timeout} s")
        if self._error is not None:
            raise GraderError(self._error)
        assert self._scores is not None
        return list(self._scores)

    def _finish(self, scores: list[bool]) -> None:
        self._scores = scores
        self._event.set()

    def _abort(self, error: str) -> None:
        self._error = error
        self._event.set()


class _Slot:
    """One worker process and what it is doing: starting (warm-up), running ``job``, idle,
    waiting to retry a failed start (``retry_at``), or given up (``dead``)."""

    def __init__(self) -> None:
        self.executor: ProcessPoolExecutor | None = None
        self.future: Future | None = None
        self.job: GradeJob | None = None  # None while warming up or idle
        self.started = 0.0
        self.ready = False
        self.dead = False
        self.start_failures = 0  # in a row
        self.retry_at: float | None = None
        self.last_error = ""
        self.last_traceback = ""

    def start(self, on_done: Callable[[Future], None]) -> None:
        """Spawn a fresh worker (the old one killed) and submit its warm-up; raises what spawning
        raises (``OSError`` when the machine cannot fork)."""
        self.stop()
        self.job, self.ready, self.retry_at = None, False, None
        self.started = time.monotonic()
        self.executor = _new_executor()
        self.future = self.executor.submit(_warmup)  # spawns the process
        self.future.add_done_callback(on_done)

    def stop(self) -> None:
        if self.executor is not None:
            _kill(self.executor)
            self.executor = None


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
        self._slots = [_Slot() for _ in range(workers)]
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
                if slot.executor is not None and slot.ready and slot.job is None:
                    try:
                        slot.executor.shutdown(wait=True)  # idle: let it exit cleanly
                    except Exception:  # noqa: BLE001 - a dead idle worker: nothing to wait for
                        pass
                    slot.executor = None
                slot.stop()
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

    def _start(self, slot: _Slot, restart: bool) -> None:
        if restart:
            self._counts["reward/restarts"] += 1
        try:
            slot.start(lambda _: self._kick.set())
        except Exception as exc:  # noqa: BLE001 - fork/spawn failed: retried with back-off
            self._start_failed(slot, f"starting the worker raised {exc!r}", traceback.format_exc())

    def _start_failed(self, slot: _Slot, why: str, tb: str = "") -> None:
        slot.start_failures += 1
        slot.last_error, slot.last_traceback = why, tb
        slot.stop()
        slot.ready = False
        if slot.start_failures < START_ATTEMPTS:
            delay = START_BACKOFF_S * 2 ** (slot.start_failures - 1)
            log.warning("grading worker start failed (%d/%d), retrying in %.1f s: %s",
                        slot.start_failures, START_ATTEMPTS, delay, why)
            slot.retry_at = time.monotonic() + delay
        else:
            log.error("grading worker start failed (%d/%d), giving the worker up: %s",
                      slot.start_failures, START_ATTEMPTS, why)
            slot.dead = True

    def _service(self, slot: _Slot, now: float) -> None:
        if slot.dead or (slot.ready and slot.job is None):
            return
        if slot.retry_at is not None:
            if now >= slot.retry_at:
                self._start(slot, restart=True)
            return
        if slot.job is None:  # warming up
            self._service_warmup(slot, now)
            return
        if slot.future.done():
            self._collect(slot)
        elif now - slot.started > slot.job.timeout_s:
            job, slot.job = slot.job, None
            self._fail(job, "reward/timeouts", f"a job overran its {job.timeout_s:g} s deadline")
            self._start(slot, restart=True)

    def _service_warmup(self, slot: _Slot, now: float) -> None:
        if not slot.future.done():
            if now - slot.started > WARMUP_TIMEOUT_S:
                self._start_failed(slot, f"warm-up did not finish within {WARMUP_TIMEOUT_S:g} s")
            return
        exc = _exception(slot.future)
        if exc is None:
            slot.ready, slot.start_failures = True, 0
        else:  # the worker's own traceback rides along as the exception's cause
            self._start_failed(slot, f"the worker failed while starting: {exc!r}",
                               "".join(traceback.format_exception(exc)))

    def _collect(self, slot: _Slot) -> None:
        job, fut = slot.job, slot.future
        assert job is not None
        slot.job = None
        exc = _exception(fut)
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
            if not slot.ready or slot.job is not None or slot.dead or slot.retry_at is not None:
                continue
            job = self._pending.popleft()
            try:
                fut = slot.executor.submit(self.fn, job.responses, job.golds)
            except Exception as exc:  # noqa: BLE001 - the idle worker died (killed from outside)
                log.warning("an idle grading worker was found dead (%r); starting a new one", exc)
                self._pending.appendleft(job)
                self._start(slot, restart=True)
                continue
            job.attempts += 1
            slot.job, slot.future, slot.started = job, fut, time.monotonic()
            # The callback only sets an Event: it runs on the executor's thread and must not
            # take self._lock (the watchdog may hold it while calling into that executor).
            fut.add_done_callback(lambda _: self._kick.set())

    def _next_wait(self, now: float) -> float:
        """Sleep until the nearest deadline (callbacks and submit wake us earlier)."""
        deadlines = [s.started + s.job.timeout_s for s in self._slots if s.job is not None]
        deadlines += [s.retry_at for s in self._slots if s.retry_at is not None]
        deadlines += [s.started + WARMUP_TIMEOUT_S for s in self._slots
                      if not s.ready and not s.dead and s.retry_at is None]
        if not deadlines:
            return 1.0
        return min(1.0, max(0.0, min(deadlines) - now) + 0.01)
