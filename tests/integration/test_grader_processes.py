"""Tests for pace.grading and pace.grading_workers: the process-pool Grader, its deadlines, and failures that reach the caller.

They spawn real worker processes. ``_test_fn`` (tests/grader_hook.py) is the test hook passed as
``Grader(fn=...)``: it hangs, crashes, raises or sleeps on a sentinel response, so production code
carries no test-only sentinels. Start failures are injected where they happen:
in the parent (``_new_executor`` raising, as fork does under memory pressure) or in the worker (a
warm-up that dies, as a script without a main guard does).
"""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

import pace.grading_workers as grading_workers
from pace.grading import Grader
from pace.grading_job import GraderError
from tests.grader_hook import CRASH, HANG, RAISE, SLOW, _test_fn

pytestmark = pytest.mark.integration


def _all_none(responses: list[str], golds: list[str]) -> list:
    return [None] * len(responses)


def _dying_warmup() -> int:
    os._exit(3)  # the worker dies as it starts


def _some_answers_fail(responses: list[str], golds: list[str]) -> list:
    return [True, None, False][: len(responses)]


def _worker_pids(g: Grader) -> list[int]:
    return [pid for s in g._slots if s.executor is not None for pid in (s.executor._processes or {})]


TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def grader():
    with Grader(workers=1, timeout_s=TIMEOUT_S, fn=_test_fn) as g:
        yield g


def test_grader_batch(grader: Grader) -> None:
    before = grader.stats()
    responses = ["Answer: 25", "Answer: \\frac{1}{2}", "Answer: 7", "\\boxed{2^{99}}", ""]
    golds = ["025", "0.5", "8", "2^{99}", "1"]
    assert grader.grade(responses, golds) == [True, True, False, True, False]
    assert grader.stats()["reward/graded"] - before["reward/graded"] == 5


def test_grader_empty_job(grader: Grader) -> None:
    job = grader.submit([], [])
    assert job.done() and job.result() == []


def test_grader_hang_times_out_and_recovers(grader: Grader) -> None:
    before = grader.stats()
    t0 = time.monotonic()
    job = grader.submit(["Answer: 1", HANG], ["1", "1"])
    assert not job.done()  # non-blocking poll while the worker hangs
    assert time.monotonic() - t0 < 0.1
    assert job.result(timeout=TIMEOUT_S + 10) == [False, False]
    assert time.monotonic() - t0 < TIMEOUT_S + 2.0
    after = grader.stats()
    assert after["reward/timeouts"] - before["reward/timeouts"] == 2  # counts answers
    assert after["reward/restarts"] - before["reward/restarts"] == 1
    # A job queued behind the hung one waits for the fresh worker, then grades normally.
    assert grader.submit(["Answer: 3"], ["3"]).result(timeout=60) == [True]


def test_a_job_that_kills_its_worker_is_retried_once_then_an_error(grader: Grader) -> None:
    before = grader.stats()
    assert grader.submit([CRASH], ["1"]).result(timeout=60) == [False]
    after = grader.stats()
    assert after["reward/errors"] - before["reward/errors"] == 1
    assert after["reward/restarts"] - before["reward/restarts"] == 2  # one per attempt
    assert grader.grade(["Answer: 4"], ["4"]) == [True]


def test_a_worker_killed_mid_job_from_outside_loses_no_grades(grader: Grader) -> None:
    """Guards against: a worker killed under a job (OOM killer) scoring the job's answers wrong."""
    before = grader.stats()
    job = grader.submit([SLOW, "Answer: 5"], ["1", "5"])
    time.sleep(0.5)  # the worker is sleeping inside the job
    pids = _worker_pids(grader)
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)
    assert job.result(timeout=60) == [False, True]  # graded on the retry
    after = grader.stats()
    assert after["reward/graded"] - before["reward/graded"] == 2 and after["reward/errors"] == before["reward/errors"]


def test_an_idle_worker_killed_from_outside_is_replaced(grader: Grader) -> None:
    """Guards against a failure seen: a worker that died while idle made the next submit
    crash the watchdog, and every later submit raise 'Grader.submit after close()'."""
    assert grader.grade(["Answer: 1"], ["1"]) == [True]
    before = grader.stats()
    pids = _worker_pids(grader)
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)
    time.sleep(0.5)  # the executor notices and marks itself broken
    assert grader.submit(["Answer: 2"], ["2"]).result(timeout=60) == [True]
    assert grader.grade(["Answer: 3"], ["4"]) == [False]
    after = grader.stats()
    assert grader.failure is None
    assert after["reward/restarts"] - before["reward/restarts"] == 1
    assert after["reward/graded"] - before["reward/graded"] == 2


def test_grader_fn_exception_is_error(grader: Grader) -> None:
    before = grader.stats()
    assert grader.grade([RAISE, "x"], ["1", "2"]) == [False, False]
    assert grader.stats()["reward/errors"] - before["reward/errors"] == 2
    assert grader.stats()["reward/restarts"] == before["reward/restarts"]  # the worker survived


def test_grader_default_fn_and_queued_jobs() -> None:
    with Grader(workers=2, timeout_s=5.0) as g:
        jobs = [g.submit([f"Answer: {i}", f"Answer: {i + 1}"], [str(i), str(i)]) for i in range(6)]
        assert [j.result(timeout=60) for j in jobs] == [[True, False]] * 6
        expected = {"reward/graded": 12, "reward/timeouts": 0, "reward/errors": 0, "reward/restarts": 0}
        assert g.stats() == expected
    with pytest.raises(GraderError, match="after close"):
        g.submit(["Answer: 1"], ["1"])


def test_a_failed_answer_scores_wrong_and_is_counted() -> None:
    with Grader(workers=1, timeout_s=30, fn=_some_answers_fail) as g:
        assert g.grade(["a", "b", "c"], ["1", "1", "1"]) == [True, False, False]
        stats = g.stats()
    assert stats["reward/graded"] == 2 and stats["reward/errors"] == 1


# ---------------------------------------------------------------- failures that reach the caller

def _failing_executor(failures: list[int]):
    """``_new_executor`` that raises ENOMEM (fork under memory pressure) on the calls in ``failures``."""
    real, calls = grading_workers._new_executor, [0]

    def new_executor():
        calls[0] += 1
        if failures == ["always"] or calls[0] in failures:
            raise OSError(errno.ENOMEM, "Cannot allocate memory (injected)")
        return real()

    return new_executor, calls


def test_a_worker_start_that_fails_once_is_retried_and_grades(monkeypatch) -> None:
    new_executor, calls = _failing_executor([1])
    monkeypatch.setattr(grading_workers, "_new_executor", new_executor)
    t0 = time.monotonic()
    with Grader(workers=1, timeout_s=5.0) as g:
        assert g.submit(["Answer: 7", "Answer: 8"], ["7", "7"]).result(timeout=60) == [True, False]
        stats = g.stats()
    assert calls[0] == 2 and stats["reward/restarts"] == 1 and stats["reward/graded"] == 2
    assert time.monotonic() - t0 < grading_workers.START_BACKOFF_S + 20


def test_a_worker_that_never_starts_fails_the_grader_with_its_cause(monkeypatch) -> None:
    """Guards against: a grader with no live worker scoring every answer wrong, silently."""
    new_executor, calls = _failing_executor(["always"])
    monkeypatch.setattr(grading_workers, "_new_executor", new_executor)
    t0 = time.monotonic()
    with Grader(workers=1, timeout_s=5.0) as g:
        job = g.submit(["Answer: 1"], ["1"])
        with pytest.raises(GraderError, match="no grading worker could start") as info:
            job.result(timeout=60)
        elapsed = time.monotonic() - t0
        assert "Cannot allocate memory (injected)" in str(info.value)
        with pytest.raises(GraderError, match="Cannot allocate memory"):  # and every later submit
            g.submit(["Answer: 2"], ["2"])
        with pytest.raises(GraderError):
            g.check()
        assert g.stats()["reward/graded"] == g.stats()["reward/errors"] == 0  # nothing scored
    assert calls[0] == grading_workers.START_ATTEMPTS
    backoff = sum(grading_workers.START_BACKOFF_S * 2 ** i for i in range(grading_workers.START_ATTEMPTS - 1))
    assert backoff - 0.1 < elapsed < backoff + 5  # retried with back-off, then loud within seconds


def test_a_worker_that_dies_while_starting_fails_the_grader_with_the_likely_causes(monkeypatch) -> None:
    monkeypatch.setattr(grading_workers, "_warmup", _dying_warmup)
    with Grader(workers=1, timeout_s=5.0) as g:
        with pytest.raises(GraderError, match="BrokenProcessPool") as info:
            g.submit(["Answer: 1"], ["1"]).result(timeout=60)
    assert grading_workers.NO_WORKER_HINT in str(info.value)


def test_a_script_without_a_main_guard_grades(tmp_path) -> None:
    """Workers are spawned without the script (pace/spawning.py), so one without `if __name__ == "__main__":`
    grades. (Before, each worker re-ran the script, whose Grader spawned again, and could not start:
    the 20 answers came back all False with no exception, later a GraderError.)"""
    script = tmp_path / "grade_script.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {str(grading_workers.__file__.rsplit('/pace/', 1)[0])!r})\n"
        "from pace.grading import Grader\n"
        "g = Grader(workers=1, timeout_s=5)\n"
        "print('scores', g.grade(['Answer: 1', 'Answer: 2'] * 10, ['1'] * 20), g.stats())\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"scores {[True, False] * 10}" in proc.stdout and "'reward/restarts': 0" in proc.stdout, proc.stdout


def test_the_watchdog_raising_fails_every_caller_with_its_traceback(monkeypatch) -> None:
    """Guards against: the watchdog's own exception going only to a logger, and callers seeing
    'Grader.submit after close()'."""
    def broken_dispatch(self):
        if self._pending:
            raise ValueError("watchdog bug (injected)")

    monkeypatch.setattr(Grader, "_dispatch", broken_dispatch)
    with Grader(workers=1, timeout_s=5.0) as g:
        job = g.submit(["Answer: 1"], ["1"])
        with pytest.raises(GraderError) as info:
            job.result(timeout=30)
        msg = str(info.value)
        assert "watchdog thread raised ValueError('watchdog bug (injected)')" in msg
        assert "Traceback (most recent call last)" in msg and "broken_dispatch" in msg
        with pytest.raises(GraderError, match="watchdog bug"):
            g.submit(["Answer: 2"], ["2"])


def test_answers_that_stop_being_graded_fail_the_grader() -> None:
    """Guards against: a run whose every answer errors (all groups filtered) waiting forever."""
    with Grader(workers=1, timeout_s=5.0, fn=_all_none, max_failed_in_row=10) as g:
        for _ in range(2):  # 8 answers in a row not graded: still working
            assert g.grade(["a"] * 4, ["1"] * 4) == [False] * 4
        g.check()
        assert g.grade(["a"] * 4, ["1"] * 4) == [False] * 4  # the job that crosses the limit is finished
        with pytest.raises(GraderError, match="the last 12 answers could not be graded") as info:
            g.submit(["a"], ["1"])
        assert "check_answer returned None" in str(info.value) and "reward.max_failed_in_row = 10" in str(info.value)


def test_a_graded_answer_resets_the_count_of_answers_not_graded() -> None:
    with Grader(workers=1, timeout_s=5.0, fn=_some_answers_fail, max_failed_in_row=2) as g:
        for _ in range(5):  # one of three answers fails in every job: never two in a row of jobs
            assert g.grade(["a", "b", "c"], ["1"] * 3) == [True, False, False]
        assert g.failure is None


def test_close_leaves_no_job_scored_that_was_not_graded() -> None:
    g = Grader(workers=1, timeout_s=60.0, fn=_test_fn)
    running, queued = g.submit([HANG], ["1"]), g.submit(["Answer: 1"], ["1"])
    time.sleep(0.3)
    g.close()
    for job in (running, queued):
        assert job.done()
        with pytest.raises(GraderError, match="closed before this job finished"):
            job.result()
