"""Tests for pace.grading that start no worker process (those are in tests/integration/test_grader_processes.py)."""
from __future__ import annotations

import pytest

from pace.grading import Grader

pytestmark = pytest.mark.unit


def test_grader_rejects_unpicklable_fn() -> None:
    with pytest.raises(TypeError):
        Grader(fn=lambda r, g: [True] * len(r))
