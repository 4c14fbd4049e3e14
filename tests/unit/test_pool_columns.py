"""The pool's columnar store: order, values and removals survive growth and compaction."""
from __future__ import annotations

import numpy as np
import pytest

from pace.pool import Pool
from pace.pool.columns import PoolColumns
from pace.pool.policies import AsyncPolicy, PacePolicy
from pace.records import Group, Trajectory

pytestmark = pytest.mark.unit


def group(gid: int, versions: list[int], c: int, pfs: float | None = None) -> Group:
    t = Trajectory([1] * len(versions), [0.0] * len(versions), versions, c, "stop")
    return Group(gid, f"p{gid}", [1], "0", 0, [t], pfs=pfs)


def test_columns_hold_each_groups_staleness():
    # two trajectories of lengths 1 and 3 completing at 2 and 6: c̄ = (2 + 3·6)/4 = 5
    t1 = Trajectory([1], [0.0], [1], 2, "stop")
    t2 = Trajectory([1, 1, 1], [0.0] * 3, [4, 5, 6], 6, "stop")
    g = Group(0, "p", [1], "0", 0, [t1, t2])
    cols = PoolColumns.of([g, group(1, [3, 3], 3, pfs=0.5)])
    s = cols.slots()
    assert cols.c_mean[s].tolist() == [5.0, 3.0]
    assert cols.completed[s].tolist() == [6, 3]
    assert cols.k_gen[s][0] == pytest.approx(g.k_gen())
    # K_kv: t2's KV is version 4's throughout: (1·(2 − 1) + 3·(6 − 4))/4 = 7/4 > K_gen = (1 + 3)/4
    assert cols.k_kv[s].tolist() == [g.k_kv(), 0.0] and g.k_kv() == 7 / 4 and g.k_gen() == 1.0
    assert np.isnan(cols.pfs[s][0]) and cols.pfs[s][1] == 0.5
    assert cols.pfs_version[s].tolist() == [-1, -1]
    # K_wait from the columns equals the group's own token-weighted K_wait at any step
    assert 9 - cols.c_mean[s][0] == pytest.approx(g.staleness(9)[2])


def test_order_and_values_survive_growth_removal_and_compaction():
    cols = PoolColumns(capacity=4)
    groups = [group(i, [i], i) for i in range(5000)]
    for g in groups:
        cols.append(g)
    kept = []
    for g in groups:
        if g.id % 3 == 0:
            kept.append(g)
        else:
            cols.remove(g)  # removals trigger compaction more than once
    assert len(cols) == len(kept)
    assert [g.id for g in cols] == [g.id for g in kept]
    assert cols.completed[cols.slots()].tolist() == [g.id for g in kept]
    assert cols._end < 5000  # compacted
    cols.set_pfs(kept[2], 0.25, 7)
    i = cols.slots()[2]
    assert (cols.pfs[i], cols.pfs_version[i]) == (0.25, 7)
    assert kept[2] in cols and groups[1] not in cols
    with pytest.raises(ValueError, match="already pooled"):
        cols.append(kept[0])


def test_set_pfs_of_a_group_that_left_is_ignored():
    g = group(0, [1], 1)
    cols = PoolColumns.of([g])
    cols.remove(g)
    cols.set_pfs(g, 0.1, 3)  # rescoring finished after the group was consumed
    assert len(cols) == 0


def test_to_rescore_selects_stale_generations_not_yet_scored_under_this_version():
    # target 0, ema 0: every group is over target and within reach of the budget
    policy = PacePolicy(1, 16, score="effective", gamma=1.0, target_pool=0, ema=0.0, score_window=8)
    pool = Pool(policy, informative=lambda g: True)
    on_policy, off_a, off_b = group(0, [3, 3], 3), group(1, [1, 3], 3), group(2, [2, 3], 3)
    for g in (on_policy, off_a, off_b):
        pool.on_submitted(g)
        pool.add(g, 3)
    assert [g.id for g in pool.to_rescore(4)] == [1, 2]  # K_gen = 0 needs no rescoring
    pool.set_pfs(off_a, 0.3, 4)
    assert [g.id for g in pool.to_rescore(4)] == [2]
    assert [g.id for g in pool.to_rescore(5)] == [1, 2]


def test_policies_without_pfs_rescore_nothing():
    pool = Pool(AsyncPolicy(1, 16), informative=lambda g: True)
    for g in (group(0, [1, 3], 3), group(1, [2, 3], 3)):
        pool.on_submitted(g)
        pool.add(g, 3)
    assert pool.to_rescore(4) == []
