"""The report's val_best table names the version each run selected (best.json, summary's `best`),
the one Table 1 scores, not a recomputation over another window."""
from __future__ import annotations

import pandas as pd
import pytest

from analysis.build import val_best_table
from analysis.runs import from_records


def _run(name: str, seed: int, avgs: dict[int, float], best: int | None) -> object:
    rows = [{"step": v, "time/step": 1.0} for v in range(5)]
    rows += [{"val/version": v, "val/avg": a, "val/arith_l1/mean@2": a} for v, a in avgs.items()]
    summary = {} if best is None else {"best": {"version": best, "val/avg": avgs[best], "path": "best"}}
    cfg = {"seed": seed, "pool": {"name": "sync"}, "algo": {"name": "dapo"}, "eval": {"k": 4, "best_within": 2}}
    return from_records(name, "local", rows, pd.DataFrame(), summary, cfg)


def test_val_best_is_the_runs_selection_within_its_own_window():
    avgs = {0: 0.1, 2: 0.5, 4: 0.9}  # θ_4 is better but past the run's eval.best_within = 2
    finished = _run("a", 0, avgs, best=2)
    stopped = _run("b", 1, avgs, best=None)  # no summary: its own eval.best_within still applies
    table, k, where = val_best_table([finished, stopped])
    assert [w["version"] for w in where["Sync"]] == [2, 2] and table["Sync"]["avg"] == pytest.approx(0.5) and k == "2"
    # an explicit --within recomputes over that window
    _, _, where = val_best_table([finished, stopped], within=4)
    assert [w["version"] for w in where["Sync"]] == [4, 4]
