"""`pool.record_effective` in a real tiny Async run: the rollout rescores the pool's head on the
engine and the consumed groups' records carry PFS, u and S_eff (Figure 7's Async panel)."""
from __future__ import annotations

import json

import pandas as pd
import pytest

pytestmark = pytest.mark.integration


def test_an_async_run_records_effective_staleness(async_run):
    """The shared async run (tests/conftest.py: 6 steps, B = 8, 32 groups in flight, `pool.record_effective=1.0`)."""
    g = pd.concat([pd.read_parquet(p) for p in sorted((async_run / "groups").glob("part-*.parquet"))])
    consumed = g[g.fate == "consumed"]
    assert len(consumed) == 6 * 8 and consumed.s_eff.notna().all()
    stale = consumed[consumed.k_gen > 0]
    assert stale.pfs.notna().any(), "no consumed group with K_gen > 0 was rescored"
    assert (consumed.s_eff - (consumed.k_wait + consumed.u * consumed.k_gen)).abs().max() < 1e-9  # γ = 1
    steps = [json.loads(line) for line in (async_run / "metrics.jsonl").read_text().splitlines()]
    assert sum(s.get("rollout/rescore_seqs", 0) for s in steps) > 0 and sum(s.get("time/rescore", 0) for s in steps) > 0
