"""The grader's worker processes: one per slot, spawned, warmed up, killed, restarted with back-off.

Why processes: math-verify bounds its own work with ``signal.alarm``, which only works in the main
thread of a process, and our rollout calls the reward from a background thread. Even where the
alarm works it only fires between Python bytecodes, so a sympy/bignum computation stuck in C code
(``2^{10^{10}}``) ignores it. The only interrupt that always works is killing the process, so each
worker slot is a one-process ``ProcessPoolExecutor`` (spawn context: the parent runs threads and an
inference engine, and forking such a process can deadlock or duplicate GPU state). Using one
process per slot means we always know which process runs which job, so a kill never takes innocent
jobs down with it.

A worker that cannot start (spawn raises, or it dies or fails while warming up) is restarted with
back-off (``START_BACKOFF_S``, doubling) up to ``START_ATTEMPTS`` times, then its slot is given up
(``dead``); `pace.grading.Grader` fails once every slot is.

A worker is spawned without the parent's main script (pace/spawning.py): it imports this module and
math-verify, not train.py's torch and vLLM. The parent imports math-verify only if it grades itself.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor

from pace import priority, reward
from pace.grading_job import GradeJob
from pace.spawning import without_main

log = logging.getLogger(__name__)

# A fresh worker must start and import math-verify within this; otherwise it is restarted.
WARMUP_TIMEOUT_S = 120.0
# Starts (spawn + warm-up) of one worker slot that may fail in a row before the slot is given up,
# and the wait before the first retry (doubled after each: 0.5, 1, 2 s): a failure to fork under
# momentary memory or process pressure passes; a broken entry point fails the grader in seconds.
START_ATTEMPTS = 4
START_BACKOFF_S = 0.5

NO_WORKER_HINT = (
    "a worker that dies as it starts is most often a machine out of memory or processes, or a Python "
    "environment in which pace.reward cannot be imported (math-verify missing)"
)


# ---------------------------------------------------------------- worker process side

def _worker_init() -> None:
    # math-verify logs every timeout with the whole offending string; a 1M-char answer would
    # flood the parent's stderr. Errors still get through.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    priority.lower()  # rollout.engine_nice (a CPU run): below the trainer


def _warmup() -> int:
    """Import math-verify and build its LaTeX parser (≈100 ms the first time) before real jobs."""
    reward.is_correct("Answer: \\frac{1}{2}", "0.5")
    return os.getpid()


# ---------------------------------------------------------------- parent side

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


def exception_of(fut: Future) -> BaseException | None:
    """The future's exception without raising (a cancelled future's is CancelledError)."""
    return CancelledError() if fut.cancelled() else fut.exception()


class WorkerSlot:
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
        """Spawn a fresh worker (the old one killed) and submit its warm-up; a spawn that raises
        (``OSError`` when the machine cannot fork) counts as a failed start."""
        try:
            self.stop()
            self.job, self.ready, self.retry_at = None, False, None
            self.started = time.monotonic()
            self.executor = _new_executor()
            with without_main():  # the worker runs pace.reward only, not train.py's imports (pace/spawning.py)
                self.future = self.executor.submit(_warmup)  # spawns the process
            self.future.add_done_callback(on_done)
        except Exception as exc:  # noqa: BLE001 - fork/spawn failed: retried with back-off
            self.start_failed(f"starting the worker raised {exc!r}", traceback.format_exc())

    def stop(self) -> None:
        if self.executor is not None:
            _kill(self.executor)
            self.executor = None

    def close(self) -> None:
        """Stop the worker for good: an idle one exits cleanly, a busy or starting one is killed."""
        if self.executor is not None and self.ready and self.job is None:
            try:
                self.executor.shutdown(wait=True)  # idle: let it exit cleanly
            except Exception:  # noqa: BLE001 - a dead idle worker: nothing to wait for
                pass
            self.executor = None
        self.stop()

    @property
    def idle(self) -> bool:
        """Warmed up and free for a job."""
        return self.ready and self.job is None and not self.dead and self.retry_at is None

    def run(self, job: GradeJob, fn: Callable, on_done: Callable[[Future], None]) -> bool:
        """Hand ``job`` to this idle worker (its deadline starts now); False if the worker was
        found dead (killed from outside), the job not taken."""
        try:
            fut = self.executor.submit(fn, job.responses, job.golds)
        except Exception as exc:  # noqa: BLE001 - the idle worker died (killed from outside)
            log.warning("an idle grading worker was found dead (%r); starting a new one", exc)
            return False
        job.attempts += 1
        self.job, self.future, self.started = job, fut, time.monotonic()
        fut.add_done_callback(on_done)
        return True

    def deadlines(self) -> list[float]:
        """When the watchdog must look at this slot again: its job's deadline, its start retry,
        or the end of its warm-up."""
        out = [self.started + self.job.timeout_s] if self.job is not None else []
        if self.retry_at is not None:
            out.append(self.retry_at)
        if not self.ready and not self.dead and self.retry_at is None:
            out.append(self.started + WARMUP_TIMEOUT_S)
        return out

    def check_warmup(self, now: float) -> None:
        """Mark the slot ready once its warm-up has finished; a warm-up that failed or overran
        ``WARMUP_TIMEOUT_S`` counts as a failed start."""
        if not self.future.done():
            if now - self.started > WARMUP_TIMEOUT_S:
                self.start_failed(f"warm-up did not finish within {WARMUP_TIMEOUT_S:g} s")
            return
        exc = exception_of(self.future)
        if exc is None:
            self.ready, self.start_failures = True, 0
        else:  # the worker's own traceback rides along as the exception's cause
            self.start_failed(f"the worker failed while starting: {exc!r}",
                              "".join(traceback.format_exception(exc)))

    def start_failed(self, why: str, tb: str = "") -> None:
        """Schedule a retry after the back-off, or give the slot up after ``START_ATTEMPTS``."""
        self.start_failures += 1
        self.last_error, self.last_traceback = why, tb
        self.stop()
        self.ready = False
        if self.start_failures < START_ATTEMPTS:
            delay = START_BACKOFF_S * 2 ** (self.start_failures - 1)
            log.warning("grading worker start failed (%d/%d), retrying in %.1f s: %s",
                        self.start_failures, START_ATTEMPTS, delay, why)
            self.retry_at = time.monotonic() + delay
        else:
            log.error("grading worker start failed (%d/%d), giving the worker up: %s",
                      self.start_failures, START_ATTEMPTS, why)
            self.dead = True
