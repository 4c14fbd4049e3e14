"""What a caller of `pace.grading.Grader` holds: the handle on one submitted batch (`GradeJob`), and
the error its ``result`` raises when the grader failed before grading it (`GraderError`)."""
from __future__ import annotations

import threading


class GraderError(RuntimeError):
    """The grader cannot grade: no worker can start, its watchdog failed, or answers stopped being
    graded. The message names the original exception and carries its traceback."""


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
