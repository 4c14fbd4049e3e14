"""KV staleness where K_gen is logged: the groups Parquet's `k_kv`, the step's `staleness/k_kv_mean`,
and summarize_run's line and check, against K_kv computed by hand from each token's context version."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pace.logger import group_row, group_schema
from pace.loop import step_metrics
from pace.records import Batch, Fate, Group, Trajectory

pytestmark = pytest.mark.unit


def traj(versions: list[int], c: int, starts: list[int] = ()) -> Trajectory:
    n = len(versions)
    t = Trajectory(list(range(n)), [-0.1] * n, versions, c, "stop", correct=True, reward=1.0)
    t.starts = list(starts)
    return t


def spanning_group(gid: int = 0, reprefill: bool = False) -> Group:
    """Response 0: one request prefilled at v=2 that spans updates to 4 (keep: every token's context
    holds v=2 KV). Response 1: prefilled at 3, a second request (a tool turn) from token 2, at 4."""
    g = Group(gid, f"p{gid}", [1], "3", 2, [traj([2, 2, 3, 4], 4), traj([3, 3, 4, 4, 4, 4], 4, starts=[2])],
              kv_reprefill=reprefill)
    g.fate, g.step = Fate.CONSUMED, 5
    return g


# K_kv by hand: w = [2,2,2,2] and [3,3,4,4,4,4], c = 4: Σ(c − w) = 8 + 2 over 10 tokens
K_KV = (4 * 4 - 8 + 2 * 1) / 10
# K_gen: Σ(c − v) = (2 + 2 + 1 + 0) + (1 + 1) over 10 tokens
K_GEN = 7 / 10


def test_the_group_row_logs_k_kv_beside_k_gen():
    row = group_row(spanning_group())
    assert row["k_kv"] == pytest.approx(K_KV, abs=1e-12) and row["k_gen"] == pytest.approx(K_GEN, abs=1e-12)
    assert K_KV > K_GEN
    # under recompute every update re-prefilled the request: the context is the token's own version
    assert group_row(spanning_group(reprefill=True))["k_kv"] == pytest.approx(K_GEN, abs=1e-12)
    # not complete (a response still generating): no staleness of any kind
    g = spanning_group()
    g.trajectories[1].completed_at = -1
    assert group_row(g)["k_kv"] is None and group_row(g)["k_gen"] is None


def test_the_step_logs_the_mean_k_kv_of_the_consumed_groups():
    pool = SimpleNamespace(drain_arrived=list, occupancy=0, last_metrics={}, inflight=0)
    batch = Batch(5, [spanning_group(0), spanning_group(1, reprefill=True)])
    m = step_metrics(batch, pool, decided=[], t_wait=0.0)
    assert m["staleness/k_kv_mean"] == pytest.approx((K_KV + K_GEN) / 2, abs=1e-12)
    assert m["staleness/k_gen_mean"] == pytest.approx(K_GEN, abs=1e-12)


def run_dir(tmp_path, rows: list[dict]):
    d = tmp_path / "run"
    (d / "groups").mkdir(parents=True)
    step = {"step": 0, "time/step": 1.0, "train/reward_mean": 0.0, "train/acc_mean": 0.5}
    (d / "metrics.jsonl").write_text(json.dumps(step) + "\n")
    (d / "summary.json").write_text(json.dumps({"status": "finished"}))
    pq.write_table(pa.Table.from_pylist(rows, schema=group_schema()), d / "groups" / "part-00000.parquet")
    return d


def test_summarize_prints_consumed_k_kv_and_checks_it_bounds_k_gen(tmp_path, capsys):
    from analysis.summarize_run import summarize

    rejected = spanning_group(2, reprefill=True)
    rejected.fate = Fate.REJECTED
    rows = [group_row(g) for g in (spanning_group(0), spanning_group(1, reprefill=True), rejected)]
    assert summarize(str(run_dir(tmp_path, rows)))
    out = capsys.readouterr().out.splitlines()
    assert f"consumed K_kv {(K_KV + K_GEN) / 2:.3f} (K_gen {K_GEN:.3f})   with K_kv > K_gen: 1" in out
    assert "K_kv >= K_gen on 3 groups: 0 violate it  ok" in out
    # a logged K_kv below K_gen fails the run's check
    rows[2]["k_kv"] = K_GEN - 0.1
    assert not summarize(str(run_dir(tmp_path / "bad", rows)))
    assert "K_kv >= K_gen on 3 groups: 1 violate it  FAILED" in capsys.readouterr().out.splitlines()


def test_summarize_reads_a_run_logged_before_k_kv(tmp_path, capsys):
    from analysis.runs import load_run
    from analysis.summarize_run import summarize

    old = {k: v for k, v in group_row(spanning_group(0)).items() if k != "k_kv"}
    schema = pa.schema([f for f in group_schema() if f.name != "k_kv"])
    d = run_dir(tmp_path, [])
    pq.write_table(pa.Table.from_pylist([old], schema=schema), d / "groups" / "part-00000.parquet")
    assert "k_kv" not in load_run(d).groups
    assert summarize(str(d))
    out = capsys.readouterr().out
    assert "K_kv" not in out and "Lemma 1 on 1 groups" in out
    # resumed with a version that logs it: the older part's rows read as NaN, not an error
    pq.write_table(pa.Table.from_pylist([group_row(spanning_group(1))], schema=group_schema()),
                   d / "groups" / "part-00001.parquet")
    assert load_run(d).groups.sort_values("id").k_kv.isna().tolist() == [True, False]
    assert summarize(str(d))
    assert "K_kv >= K_gen on 1 groups: 0 violate it  ok" in capsys.readouterr().out.splitlines()


def test_the_simulator_logs_the_mean_k_kv_of_the_consumed_groups(monkeypatch):
    """The simulator's step row: the mean `SimGroup.k_kv()` of the step's consumed groups. Where the
    simulated group has no K_kv of its own yet, a stand-in here: every token's context is its
    response's first version (one request per response, no preemption counted)."""
    import numpy as np

    from pace.sim.records import SimGroup
    from pace.sim.run import Simulation
    from tests.unit.test_sim import NOISY, sim_cfg

    if "k_kv" not in SimGroup.__dict__:
        def k_kv(g):
            n, cn = sum(g.lengths), sum(c * m for c, m in zip(g.done_at.tolist(), g.lengths))
            return (cn - sum(s[0] * m for s, m in zip(g.spans, g.lengths))) / n
        monkeypatch.setattr(SimGroup, "k_kv", k_kv, raising=False)
    decided = []
    sim = Simulation(sim_cfg(*NOISY, "pool.name=async"), on_step=lambda step, m, d: decided.extend(d))
    sim.run()
    for j, row in enumerate(sim.rows):
        consumed = [g for g in decided if g.fate == Fate.CONSUMED and g.step == j]
        assert row["staleness/k_kv_mean"] == pytest.approx(np.mean([g.k_kv() for g in consumed]), abs=1e-12)
        assert row["staleness/k_kv_mean"] >= row["staleness/k_gen_mean"] - 1e-12
    assert any(r["staleness/k_kv_mean"] > r["staleness/k_gen_mean"] + 1e-6 for r in sim.rows)  # not K_gen again
