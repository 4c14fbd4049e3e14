"""Rule reward for math answers (DESIGN §4): extract the final answer, check it against the gold.

Three layers, from pure to process-bound:

1. ``extract_answer`` – pure string work on the tail of the response (DAPO format
   ``Answer: ...``, falling back to the last ``\\boxed{...}``). Linear time, no regex that can
   backtrack, so it is safe on million-character or adversarial outputs.
2. ``is_correct`` – a fast exact path for plain numbers ("025" == "25"), otherwise math-verify
   on both sides wrapped in ``$...$``. Never raises.
3. ``Grader`` – runs ``is_correct`` in worker *processes* with a deadline per job.

Why processes and a deadline of our own: math-verify bounds its own work with ``signal.alarm``,
which only works in the main thread of a process, and our rollout calls the reward from a
background thread. Even where the alarm works it only fires between Python bytecodes, so a
sympy/bignum computation stuck in C code (``2^{10^{10}}``) ignores it. The only interrupt that
always works is killing the process, so each worker slot is a one-process
``ProcessPoolExecutor`` (spawn context: the parent runs threads and an inference engine, and
forking such a process can deadlock or duplicate GPU state). A watchdog thread kills a slot whose
job overruns ``timeout_s`` and starts a fresh one; the job scores all-False. Using one process per
slot means we always know which process runs which job, so a kill never takes innocent jobs
down with it.

Spawn re-imports the parent's ``__main__`` in each worker: entry points must keep their work under
``if __name__ == "__main__":``. This module imports math-verify lazily so the parent pays nothing
for it until a worker (or a direct ``is_correct`` call) needs it.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import wait as wait_futures
from concurrent.futures.process import BrokenProcessPool
from decimal import Decimal, InvalidOperation

log = logging.getLogger(__name__)

# Only the end of a response can hold the final answer. DAPO's reference reward looks at the last
# 300 characters (the longest MATH-500 answer has 197); we keep 4,000 so long LaTeX answers and a
# little trailing chatter still fit, while a 1M-character output costs the same as a short one.
TAIL_CHARS = 4_000
# Answers longer than this are scored wrong without calling math-verify: no real answer is this
# long, and math-verify's regexes / sympy on such strings are where pathological time goes.
MAX_VERIFY_CHARS = 1_000
# math-verify's own per-call timeout inside a worker (whole seconds: it uses signal.alarm). Gold
# parses are cached, so one answer costs at most parse(pred) + verify = 2 s, under the default
# 5 s job deadline: one pathological answer loses its own point, not its whole job.
ANSWER_TIMEOUT_S = 1
# A fresh worker must start and import math-verify within this; otherwise it is restarted.
WARMUP_TIMEOUT_S = 120.0
# A slot whose warm-up fails this many times in a row is given up (spawn itself is broken).
MAX_WARMUP_FAILURES = 3

GradeFn = Callable[[list[str], list[str]], list[bool]]


# ---------------------------------------------------------------- extraction (pure)

_BOXED = "\\boxed{"


def _closing_brace(text: str, i: int) -> int | None:
    """Index of the ``}`` that closes the group whose content starts at ``i``; None if unbalanced.

    Escaped braces ``\\{`` ``\\}`` are skipped, so ``\\boxed{\\left\\{1\\right.}`` still closes.
    """
    depth = 1
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n and text[i + 1] in "{}":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``; None if absent or if that one never closes
    (the model was cut off mid-answer: an earlier box is not its final answer)."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    end = _closing_brace(text, start + len(_BOXED))
    return None if end is None else text[start + len(_BOXED):end]


def _strip_decoration(s: str) -> str:
    """Strip whitespace, ``**``, a trailing period, ``$..$``, ``\\(..\\)``, ``\\[..\\]`` until stable.

    Only C-level string operations, and every pass shortens the string, so this stays fast even
    on thousands of nested ``$``.
    """
    while True:
        before = s
        s = s.strip().strip("*").strip()
        if s.endswith("."):
            s = s[:-1].rstrip()
        if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
            s = s[1:-1]
        elif len(s) >= 4 and s[:2] in ("\\(", "\\[") and s[-2:] in ("\\)", "\\]"):
            s = s[2:-2]
        if s == before:
            return s


def _unwrap(s: str) -> str:
    """The bare answer: handles ``**Answer:** 42``, ``$42$.``, ``$$42$$``, ``\\(42\\)``, ``\\boxed{42}``.

    A whole-answer ``\\boxed{}`` is unwrapped once (a Python-level scan), not in a loop, so
    nested boxes cannot make this quadratic.
    """
    s = _strip_decoration(s)
    if s.startswith(_BOXED) and _closing_brace(s, len(_BOXED)) == len(s) - 1:
        s = _strip_decoration(s[len(_BOXED):-1])
    return s


def extract_answer(text: str) -> str | None:
    """The model's final answer, or None.

    DAPO format: what follows the LAST ``Answer:`` up to the end of that line (if the marker ends
    its line, the next non-empty line, as DAPO's ``Answer\\s*:\\s*([^\\n]+)`` does), stripped of
    whitespace, a trailing period, surrounding ``$`` (and ``**``, ``\\(..\\)``, a whole-answer
    ``\\boxed{}``). Without an ``Answer:``, the content of the last ``\\boxed{...}``.
    Only the last ``TAIL_CHARS`` characters are searched: an answer further back than that is
    not a final answer, and the cap makes the cost independent of the response length.
    """
    tail = text[-TAIL_CHARS:]
    i = tail.rfind("Answer:")
    if i >= 0:
        rest = tail[i + len("Answer:"):].lstrip()
        answer = _unwrap(rest.split("\n", 1)[0])
        if answer:
            return answer
    boxed = _last_boxed(tail)
    if boxed is None:
        return None
    return _unwrap(boxed) or None


# ---------------------------------------------------------------- correctness (pure)

# One optional sign, digits with an optional fraction. ASCII only: str.isdigit and \d without
# re.ASCII accept "²" and other digits that Decimal rejects. No nested quantifiers, so matching
# a 4,000-digit string is linear.
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)", re.ASCII)
# Thousands separators only in groups of three, so the tuple "1,2" never becomes 12.
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?", re.ASCII)


def _as_number(s: str) -> Decimal | None:
    """Exact value of a plain integer/decimal answer ("1,000", "025", "0.50", "1\\,000"), else None.

    Decimal, not int/float: exact for any length (int() refuses > 4,300 digits) and equal across
    leading/trailing zeros.
    """
    s = s.replace("{,}", ",").replace("\\,", "").replace("\\!", "").replace(" ", "")
    if "," in s:
        if not _THOUSANDS.fullmatch(s):
            return None
        s = s.replace(",", "")
    if not _NUMBER.fullmatch(s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


_GOLD_CACHE: dict[tuple[str, int | None], list] = {}


def _parse_gold(gold: str, timeout: int | None) -> list:
    """math-verify parse of a gold answer, cached: a group of G responses shares one gold."""
    from math_verify import parse

    key = (gold, timeout)
    if key not in _GOLD_CACHE:
        if len(_GOLD_CACHE) >= 4096:  # bounded; golds repeat within a batch, not across a run
            _GOLD_CACHE.clear()
        _GOLD_CACHE[key] = parse(f"${gold}$", parsing_timeout=timeout)
    return _GOLD_CACHE[key]


def _math_verify(pred: str, gold: str, timeout: int | None) -> bool:
    from math_verify import parse, verify

    gold_parsed = _parse_gold(gold, timeout)
    if not gold_parsed:
        return False
    pred_parsed = parse(f"${pred}$", parsing_timeout=timeout)
    if not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def check_answer(response: str, gold: str, timeout_s: int | None = ANSWER_TIMEOUT_S) -> bool | None:
    """Whether ``response``'s final answer equals ``gold``; None if grading it failed (an
    exception in extraction or math-verify). Never raises.

    Plain numbers on both sides are compared exactly; anything else goes to math-verify with
    ``timeout_s`` (whole seconds) on each parse/verify call. math-verify's timeout needs
    ``signal.alarm``, so off the main thread it is dropped (math-verify would otherwise raise,
    and every answer would silently score False) and the call is unbounded: threads should grade
    through ``Grader``, whose worker processes run this in their main thread.
    """
    try:
        pred = extract_answer(response)
        gold = _unwrap(gold)
        if pred is None or not gold:
            return False
        pred_num, gold_num = _as_number(pred), _as_number(gold)
        if pred_num is not None and gold_num is not None:
            return pred_num == gold_num
        if len(pred) > MAX_VERIFY_CHARS:
            return False
        return _math_verify(pred, gold, timeout_s if _in_main_thread() else None)
    except BaseException as e:  # noqa: BLE001 - a reward must never crash the rollout
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        return None


def is_correct(response: str, gold: str, timeout_s: int | None = ANSWER_TIMEOUT_S) -> bool:
    """`check_answer` with a failure scored as wrong. Never raises."""
    return bool(check_answer(response, gold, timeout_s))


def grade_batch(responses: list[str], golds: list[str]) -> list[bool | None]:
    """The default worker function: one job = one call, so one round trip per job. None marks an
    answer whose grading failed: it scores wrong and counts under `reward/errors`."""
    return [check_answer(r, g) for r, g in zip(responses, golds)]


# ---------------------------------------------------------------- worker process side

def _worker_init() -> None:
    # math-verify logs every timeout with the whole offending string; a 1M-char answer would
    # flood the parent's stderr. Errors still get through.
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def _warmup() -> int:
    """Import math-verify and build its LaTeX parser (≈100 ms the first time) before real jobs."""
    is_correct("Answer: \\frac{1}{2}", "0.5")
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
    executor.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        p.join(timeout=1.0)  # reap, so killed workers do not linger as zombies


# ---------------------------------------------------------------- parent side

class GradeJob:
    """Handle on one submitted batch. ``done`` never blocks (the rollout thread polls it)."""

    def __init__(self, responses: list[str], golds: list[str], timeout_s: float):
        self.responses = responses
        self.golds = golds
        self.timeout_s = timeout_s  # deadline once a worker starts it
        self._scores: list[bool] | None = None
        self._event = threading.Event()

    def __len__(self) -> int:
        return len(self.responses)

    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> list[bool]:
        """The scores, one per response. Raises ``TimeoutError`` only if *this wait* times out;
        the job itself always finishes within about its ``timeout_s`` of starting."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"GradeJob not finished after {timeout} s")
        assert self._scores is not None
        return list(self._scores)

    def _finish(self, scores: list[bool]) -> None:
        self._scores = scores
        self._event.set()


class _Slot:
    """One worker process and what it is doing: warming up, running ``job``, or idle."""

    def __init__(self) -> None:
        self.executor = _new_executor()
        self.future: Future = self.executor.submit(_warmup)
        self.job: GradeJob | None = None  # None while warming up or idle
        self.started = time.monotonic()
        self.ready = False
        self.dead = False
        self.warmup_failures = 0

    def restart(self) -> None:
        _kill(self.executor)
        self.executor = _new_executor()
        self.future = self.executor.submit(_warmup)
        self.job = None
        self.started = time.monotonic()
        self.ready = False


class Grader:
    """Grades batches in ``workers`` processes, each job bounded by ``timeout_s`` seconds.

    Outcomes per job: graded (scores from the worker), timeout (the worker overran: all-False,
    worker killed and replaced), error (the worker crashed or ``fn`` raised: all-False, replaced
    if crashed); per answer, a None score from ``fn`` (its grading failed) is wrong and an error. ``stats()`` counts *answers* under ``reward/graded``, ``reward/timeouts``,
    ``reward/errors`` so their sum is the number of answers finished, plus ``reward/restarts``.

    A job's deadline starts when it is handed to an idle, warmed-up worker, so jobs queued behind
    a slow one are never timed out for waiting. ``fn`` replaces the batch grader (tests pass a
    top-level function that hangs or exits); it must be picklable by reference.

    Cost (same box): ≈0.01 ms per plain-integer answer, ≈4 ms per LaTeX answer, plus one
    round trip per job, so a 5 s deadline fits jobs of a few hundred answers with room to spare;
    submit a group or a batch per job, not a whole epoch.
    """

    def __init__(self, workers: int = 1, timeout_s: float = 5.0, fn: GradeFn | None = None):
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"Grader: need workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.fn: GradeFn = fn if fn is not None else grade_batch
        try:  # fail here, not in the watchdog, if fn cannot reach a worker
            pickle.dumps(self.fn)
        except Exception as e:
            raise TypeError(f"Grader: fn must be a picklable top-level function, got {self.fn!r}") from e
        self.workers = workers
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._kick = threading.Event()  # set by submit / future callbacks to wake the watchdog
        self._pending: deque[GradeJob] = deque()
        self._counts = dict.fromkeys(
            ("reward/graded", "reward/timeouts", "reward/errors", "reward/restarts"), 0
        )
        self._closed = False  # no more submits
        self._shut = False  # workers stopped (close() ran)

        # Warm up: spawn every worker and import math-verify now, so the first job is fast.
        # Measured on the 2-core dev box (shared with other jobs): 0.45 s for 1 worker, 1.4 s for
        # 2 started together; mostly the sympy import (≈0.3 s) and the first LaTeX parse (≈0.1 s).
        # A replacement worker after a kill costs the same. See ``startup_s``.
        t0 = time.monotonic()
        self._slots = [_Slot() for _ in range(workers)]
        for slot in self._slots:
            slot.future.add_done_callback(lambda _: self._kick.set())
        wait_futures([s.future for s in self._slots], timeout=WARMUP_TIMEOUT_S)
        self.startup_s = time.monotonic() - t0

        self._watchdog = threading.Thread(target=self._watch, name="reward-grader", daemon=True)
        self._watchdog.start()

    # ------------------------------------------------------------ public API

    def submit(self, responses: list[str], golds: list[str], timeout_s: float | None = None) -> GradeJob:
        """Queue one batch; it runs as a single task in one worker, with deadline ``timeout_s``
        (default: the grader's) from the moment a worker starts it."""
        if len(responses) != len(golds):
            raise ValueError(f"Grader.submit: {len(responses)} responses but {len(golds)} golds")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"Grader.submit: timeout_s must be > 0, got {timeout_s}")
        job = GradeJob(list(responses), list(golds), timeout_s or self.timeout_s)
        if not job.responses:
            job._finish([])
            return job
        with self._lock:
            if self._closed:
                raise RuntimeError("Grader.submit after close()")
            self._pending.append(job)
        self._kick.set()
        return job

    def grade(self, responses: list[str], golds: list[str]) -> list[bool]:
        return self.submit(responses, golds).result()

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
        """Stop the workers. Jobs not finished by now score all-False (not counted)."""
        with self._lock:
            if self._shut:
                return
            self._closed = self._shut = True
        self._kick.set()
        self._watchdog.join(timeout=10.0)
        with self._lock:
            for slot in self._slots:
                if slot.ready and slot.job is None:
                    slot.executor.shutdown(wait=True)  # idle: let it exit cleanly
                else:
                    _kill(slot.executor)
                if slot.job is not None:
                    slot.job._finish([False] * len(slot.job))
                    slot.job = None
            while self._pending:
                job = self._pending.popleft()
                job._finish([False] * len(job))

    def __enter__(self) -> Grader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ watchdog thread

    def _watch(self) -> None:
        """Finish done jobs, kill overdue ones, hand pending jobs to idle slots; repeat."""
        try:
            while True:
                self._kick.clear()  # before the pass: a kick during it makes the next wait return
                with self._lock:
                    if self._closed:
                        return
                    now = time.monotonic()
                    for slot in self._slots:
                        self._service(slot, now)
                    if all(s.dead for s in self._slots):  # nothing can ever grade: fail, never hang
                        while self._pending:
                            self._fail(self._pending.popleft(), "reward/errors")
                    self._dispatch()
                    wait_s = self._next_wait(time.monotonic())
                self._kick.wait(wait_s)
        except BaseException:  # noqa: BLE001 - never leave a caller waiting on a dead watchdog
            log.exception("reward grader watchdog crashed; failing all outstanding jobs")
            with self._lock:
                self._closed = True
                for slot in self._slots:
                    if slot.job is not None:
                        self._fail(slot.job, "reward/errors")
                        slot.job = None
                while self._pending:
                    self._fail(self._pending.popleft(), "reward/errors")

    def _service(self, slot: _Slot, now: float) -> None:
        if slot.dead or (slot.ready and slot.job is None):
            return
        if slot.job is None:  # warming up
            self._service_warmup(slot, now)
            return
        if slot.future.done():
            self._collect(slot)
        elif now - slot.started > slot.job.timeout_s:
            self._fail(slot.job, "reward/timeouts")
            self._restart(slot)

    def _service_warmup(self, slot: _Slot, now: float) -> None:
        if not slot.future.done():
            if now - slot.started > WARMUP_TIMEOUT_S:
                self._warmup_failed(slot, "timed out")
            return
        exc = slot.future.exception()
        if exc is None:
            slot.ready, slot.warmup_failures = True, 0
        else:
            self._warmup_failed(slot, repr(exc))

    def _warmup_failed(self, slot: _Slot, why: str) -> None:
        slot.warmup_failures += 1
        log.warning(
            "reward worker warm-up failed (%d/%d): %s", slot.warmup_failures, MAX_WARMUP_FAILURES, why
        )
        if slot.warmup_failures < MAX_WARMUP_FAILURES:
            self._restart(slot)
            return
        slot.dead = True
        _kill(slot.executor)

    def _collect(self, slot: _Slot) -> None:
        job, fut = slot.job, slot.future
        assert job is not None
        slot.job = None
        exc = fut.exception()
        if isinstance(exc, BrokenProcessPool):  # the worker died mid-job (os._exit, OOM kill, segfault)
            self._fail(job, "reward/errors")
            self._restart(slot)
            return
        scores = fut.result() if exc is None else None
        if exc is not None or not isinstance(scores, list) or len(scores) != len(job):
            log.warning("reward fn failed or returned a bad result: %r", exc or type(scores))
            self._fail(job, "reward/errors")
            return
        failed = sum(s is None for s in scores)  # answers whose grading failed: wrong, counted
        self._counts["reward/graded"] += len(job) - failed
        self._counts["reward/errors"] += failed
        job._finish([bool(s) for s in scores])

    def _fail(self, job: GradeJob, counter: str) -> None:
        self._counts[counter] += len(job)
        job._finish([False] * len(job))

    def _restart(self, slot: _Slot) -> None:
        self._counts["reward/restarts"] += 1
        slot.restart()
        slot.future.add_done_callback(lambda _: self._kick.set())

    def _dispatch(self) -> None:
        for slot in self._slots:
            if not self._pending:
                return
            if slot.ready and slot.job is None and not slot.dead:
                job = self._pending.popleft()
                slot.job = job
                slot.started = time.monotonic()
                slot.future = slot.executor.submit(self.fn, job.responses, job.golds)
                # The callback only sets an Event: it runs on the executor's thread and must not
                # take self._lock (the watchdog may hold it while calling into that executor).
                slot.future.add_done_callback(lambda _: self._kick.set())

    def _next_wait(self, now: float) -> float:
        """Sleep until the nearest deadline (callbacks and submit wake us earlier)."""
        deadlines = [s.started + s.job.timeout_s for s in self._slots if s.job is not None]
        deadlines += [s.started + WARMUP_TIMEOUT_S for s in self._slots if not s.ready and not s.dead]
        if not deadlines:
            return 1.0
        return min(1.0, max(0.0, min(deadlines) - now) + 0.01)
