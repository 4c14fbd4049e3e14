"""`pool.record_effective` in a real tiny Async run: the rollout rescores the pool's head on the
engine and the consumed groups' records carry PFS, u and S_eff (Figure 7's Async panel)."""
from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.integration


def test_an_async_run_records_effective_staleness(tiny_model_path, tmp_path):
    cmd = [sys.executable, str(ROOT / "train.py"), "+exp=async_tiny", "trainer.steps=6", "data.batch_prompts=8",
           "rollout.max_inflight_groups=32", "eval.every=0", "logger.mode=disabled", "logger.progress=false",
           "pool.record_effective=1.0", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    g = pd.concat([pd.read_parquet(p) for p in sorted((tmp_path / "groups").glob("part-*.parquet"))])
    consumed = g[g.fate == "consumed"]
    assert len(consumed) == 6 * 8 and consumed.s_eff.notna().all()
    stale = consumed[consumed.k_gen > 0]
    assert stale.pfs.notna().any(), "no consumed group with K_gen > 0 was rescored"
    assert (consumed.s_eff - (consumed.k_wait + consumed.u * consumed.k_gen)).abs().max() < 1e-9  # γ = 1
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(s.get("rollout/rescore_seqs", 0) for s in steps) > 0 and sum(s.get("time/rescore", 0) for s in steps) > 0
