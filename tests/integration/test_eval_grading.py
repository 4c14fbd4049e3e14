"""The eval grading path (`EvalRun`) fed malformed model outputs, graded in the Grader's worker processes.

`EvalRun` is given hand-made engine outputs here (a recorder stands in for the engine's
`add_request`) so that outputs no tiny model would write reach the real grader: no answer, huge
numbers, LaTeX soup, megabyte strings, and a grader that hangs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from pace.evaluation import EvalRun, summarize
from pace.grading import Grader
from pace.tasks.base import Prompt
from tests.grader_hook import HANG, _test_fn
from tests.helpers import ADVERSARIAL

pytestmark = pytest.mark.integration


@dataclass
class _Recorder:
    """Stands in for the engine's add_request: EvalRun only submits to it."""

    added: list = field(default_factory=list)

    def add_request(self, rid, prompt, params, priority=0):
        self.added.append((rid, prompt, priority))


def _output(rid: str, texts: list[str]):
    comps = [SimpleNamespace(text=t, token_ids=list(range(min(len(t), 5)))) for t in texts]
    return SimpleNamespace(request_id=rid, finished=True, outputs=comps)


def _drive(run: EvalRun, outputs, deadline_s: float) -> float:
    t0 = time.monotonic()
    for out in outputs:
        assert run.owns(out.request_id)
        run.on_output(out)
        run.poll()
    while not run.poll():
        assert time.monotonic() - t0 < deadline_s, "evaluation grading hung"
        time.sleep(0.01)
    return time.monotonic() - t0


def test_malformed_outputs_grade_as_wrong_without_crashing():
    texts = list(ADVERSARIAL.values())
    golds = ["25", "\\frac{1}{2}", "2^{99}", "\\left(3,\\frac{\\pi}{2}\\right)"]
    sets = {"bench": [Prompt(f"p{i}", "q", g) for i, g in enumerate(golds)]}
    params = SimpleNamespace(n=len(texts))
    engine = _Recorder()
    with Grader(workers=1, timeout_s=5.0) as grader:
        run = EvalRun(sets, params, grader, prefix="v3", grade_answers=len(texts), answer_timeout_s=5.0 / 8)
        run.submit(engine, priority=-2, salt="v3")
        assert [(rid, p["cache_salt"], pr) for rid, p, pr in engine.added] == [
            (f"v3-bench-{i}", "v3", -2) for i in range(len(golds))]
        _drive(run, [_output(rid, texts) for rid, _, _ in engine.added], deadline_s=120)
        stats = grader.stats()
    grades = run.results["bench"]
    assert all(len(g) == len(texts) and all(isinstance(x, bool) for x in g) for g in grades)
    # the adversarial texts that do answer 25: after a megabyte of "(", and between null bytes
    right = [name for name, ok in zip(ADVERSARIAL, grades[0]) if ok]
    assert right == ["million_chars_then_answer", "null_bytes"]
    assert not any(any(g) for g in grades[1:])
    assert stats["reward/graded"] == len(texts) * len(golds)  # graded, not timed out or crashed
    assert summarize(run.results)["bench"] == pytest.approx(2 / len(texts) / len(golds))


def test_a_hanging_grade_ends_at_the_per_answer_deadline():
    # The grader's own deadline is long; the eval job's deadline is answer_timeout_s × answers.
    sets = {"bench": [Prompt("p0", "q", "1"), Prompt("p1", "q", "2")]}
    engine = _Recorder()
    with Grader(workers=1, timeout_s=600.0, fn=_test_fn) as grader:
        run = EvalRun(sets, SimpleNamespace(n=2), grader, grade_answers=2, answer_timeout_s=0.5)
        run.submit(engine)
        outputs = [_output("eval-bench-0", ["Answer: 1", HANG]), _output("eval-bench-1", ["Answer: 2", "Answer: 3"])]
        elapsed = _drive(run, outputs, deadline_s=30)
        stats = grader.stats()
    assert run.results["bench"] == [[False, False], [True, False]]  # the hung job scores all-False
    assert stats["reward/timeouts"] == 2 and stats["reward/graded"] == 2
    assert elapsed < 0.5 * 2 + 5  # deadline of the 2-answer job, plus a worker restart
