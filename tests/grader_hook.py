"""The grader's test hook, passed as ``Grader(fn=...)``: spawned grading workers import this module to
unpickle it, so it imports nothing heavy (tests/helpers.py imports torch, which would eat the job
deadlines the tests measure). Not a test module."""
from __future__ import annotations

import os
import time

from pace.reward import grade_batch

HANG, CRASH, RAISE, SLOW = "__test_hang__", "__test_crash__", "__test_raise__", "__test_slow__"


def _test_fn(responses: list[str], golds: list[str]) -> list[bool]:
    """Worker-side test hook: must be a top-level function so spawn can pickle it by name."""
    if HANG in responses:
        time.sleep(3600)
    if CRASH in responses:
        os._exit(1)
    if RAISE in responses:
        raise RuntimeError("grading bug")
    if SLOW in responses:
        time.sleep(1.5)
    return grade_batch(responses, golds)
