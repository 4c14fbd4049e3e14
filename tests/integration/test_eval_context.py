"""eval.py on the tiny model with benchmarks longer than its context: one line, no traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import BENCH, ROOT, needs_shared

pytestmark = pytest.mark.integration


@needs_shared(BENCH / "aime_2023.jsonl")
def test_eval_on_benchmarks_too_long_for_the_tiny_context_fails_in_one_line(tiny_model_path, tmp_path):
    """A failure seen, reproduced: `eval.py eval=math6` with the tiny model (context 256)
    ended in vLLM's 'prompt contains at least 257 input tokens' and a page of traceback."""
    cmd = [sys.executable, str(ROOT / "eval.py"), "eval=math6", f"eval.data_dir={BENCH}",
           "logger.progress=false", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "VLLMValidationError" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: aime_2023: all ") and "raise rollout.max_model_len" in last, last
