"""scripts/bench_trainer_gpu.py runs end to end on CPU with `--tiny` (the GPU run uses the same code)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def test_bench_trainer_gpu_tiny_runs_and_both_paths_agree():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/bench_trainer_gpu.py"), "--tiny"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    paths = [(r["tokens"], r["path"]) for r in records if "path" in r and "tokens" in r]
    assert paths == [(512, "new"), (512, "old"), (1024, "new"), (1024, "old")]  # new first at every length
    assert all(not r["oom"] and r["seconds"] > 0 for r in records if "path" in r)
    assert next(r for r in records if "max_abs_logp_diff_new_vs_old" in r)["max_abs_logp_diff_new_vs_old"] < 1e-4
    assert any(r.get("tokens_per_s", 0) > 0 for r in records)
    assert next(r for r in records if "fsdp2_full_gather_s" in r)["fsdp2_full_gather_s"] > 0
    assert "| tokens | new: peak GiB" in proc.stdout
