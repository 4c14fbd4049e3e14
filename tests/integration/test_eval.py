"""eval.py on the tiny model: mean@k per level and overall, written to eval.json."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def test_eval_writes_mean_at_k(tiny_model_path, tmp_path):
    cmd = [sys.executable, str(ROOT / "eval.py"), "data.arithmetic.n_val=8", "data.group_size=3",
           "logger.progress=false", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "eval.json").read_text())
    scores = result["mean@3"]
    assert set(scores) == {"all", "level1", "level2", "level3", "level4"}
    # 8 problems × 3 samples: every score is a multiple of 1/3 per problem, averaged over its problems
    assert all(0.0 <= v <= 1.0 for v in scores.values())
    assert abs(scores["all"] * 8 * 3 - round(scores["all"] * 8 * 3)) < 1e-9
    assert scores["all"] == pytest.approx(sum(scores[f"level{i}"] for i in range(1, 5)) / 4)
