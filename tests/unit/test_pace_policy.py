"""PACE's budget, scores and selection, plus the Stale-k and gate baselines (pure, fake groups)."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pace.pool import Pool
from pace.pool.base import AdmissionView
from pace.pool.columns import PoolColumns
from pace.pool.policies import GatePolicy, PacePolicy, StaleKPolicy
from pace.pool.scoring import RejectionController, ScoreWindow, score
from pace.records import Fate, Group, Trajectory

pytestmark = pytest.mark.unit


def group(gid: int, versions: list[int], c: int, pfs: float | None = None) -> Group:
    """One-trajectory group: token versions, completion version c, optional PFS."""
    t = Trajectory(list(range(len(versions))), [0.0] * len(versions), versions, c, "stop", correct=gid % 2 == 0)
    return Group(gid, f"p{gid}", [1], "0", 0, [t], pfs=pfs)


# ---------------------------------------------------------------- budget


@given(rho=st.floats(0, 1), n=st.integers(1, 10_000), b=st.integers(1, 512))
def test_budget_never_starves_the_trainer(rho, n, b):
    r = RejectionController.budget(rho, n, b)
    assert r >= 0
    if n >= b:
        assert n - r >= b
    assert r <= math.floor(rho * n)


def test_rho_rises_under_sustained_excess_and_decays_to_zero():
    c = RejectionController(target_pool=10, ema=0.9)
    rhos = [c.update(40) for _ in range(30)]  # excess 30/40 = 0.75 every step
    assert all(b > a for a, b in zip(rhos, rhos[1:]))
    assert rhos[-1] == pytest.approx(0.75 * (1 - 0.9**30))
    assert rhos[0] == pytest.approx(0.1 * 0.75)
    for _ in range(400):
        c.update(8)  # at or below target: no excess
    assert c.rho < 1e-15


# ---------------------------------------------------------------- scores


@given(kw=st.floats(0, 100), kg=st.floats(0, 100), u=st.floats(0, 1))
def test_effective_with_gamma_zero_is_raw(kw, kg, u):
    assert score("effective", kw, kg, u, gamma=0.0) == score("raw", kw, kg)


@given(kw=st.floats(0, 100), u=st.floats(0, 1), gamma=st.floats(0, 8))
def test_zero_generation_staleness_scores_waiting_staleness(kw, u, gamma):
    assert score("effective", kw, 0.0, u, gamma) == kw
    assert score("raw", kw, 0.0) == kw


def test_score_kinds_by_hand():
    # K_wait = 2, K_gen = 3, u = 0.5, γ = 2 → effective = 2 + 0.25·3 = 2.75; raw = 5; generation = 3
    assert score("effective", 2, 3, 0.5, 2) == 2.75
    assert score("raw", 2, 3) == 5 and score("generation", 2, 3) == 3
    with pytest.raises(ValueError):
        score("bogus", 1, 1)


def test_window_percentile_rank_and_eviction():
    w = ScoreWindow(size=4)
    assert w.rank(0.3) == 1.0  # empty: full weight
    w.extend([0.1, 0.2, 0.3, 0.4])
    assert [w.rank(v) for v in (0.05, 0.2, 0.4, 9)] == [0.0, 0.5, 1.0, 1.0]
    w.add(0.5)  # evicts 0.1
    assert len(w) == 4 and w.rank(0.1) == 0.0 and w.rank(0.2) == 0.25


# ---------------------------------------------------------------- PACE selection


def pace(b=2, target=2, ema=0.0, kind="raw", gamma=1.0):
    return PacePolicy(b, 100, score=kind, gamma=gamma, target_pool=target, ema=ema, score_window=16)


def test_pace_rejects_the_highest_scores_and_takes_fifo():
    # B = 2, target 2, ema 0 → ρ = excess = (6 − 2)/6; budget = min(⌊4/6·6⌋, 6 − 2) = 4.
    pooled = [group(i, [v] * 4, c) for i, (v, c) in enumerate([(0, 5), (5, 5), (1, 5), (4, 5), (2, 5), (3, 5)])]
    sel = pace().select(PoolColumns.of(pooled), step=6)
    # raw score = K = 6 − v: ids 0 (6), 2 (5), 4 (4), 5 (3) are the four stalest
    assert sorted(g.id for g, fate, _ in sel.removed) == [0, 2, 4, 5]
    assert all(fate == Fate.REJECTED for _, fate, _ in sel.removed)
    assert [g.id for g in sel.batch] == [1, 3]
    assert sel.metrics["budget"] == 4 and sel.metrics["rho"] == pytest.approx(4 / 6)


def test_pace_ties_reject_older_completion_first():
    pooled = [group(0, [3] * 2, 4), group(1, [2] * 2, 3), group(2, [5] * 2, 5)]
    # generation score: K_gen = 1 for ids 0 and 1 (tie), 0 for id 2; budget = min(⌊(1/3)·3⌋, 1) = 1
    sel = pace(b=2, kind="generation").select(PoolColumns.of(pooled), step=6)
    assert [g.id for g, _, _ in sel.removed] == [1]  # completed at 3, before id 0 at 4


@settings(max_examples=50)
@given(st.lists(st.tuples(st.integers(0, 8), st.integers(0, 3)), min_size=2, max_size=30), st.integers(1, 4))
def test_pace_rejected_scores_dominate_kept(specs, b):
    pooled = [group(i, [max(0, c - lag)] * 3, c) for i, (c, lag) in enumerate(specs)]
    sel = pace(b=b, target=b).select(PoolColumns.of(pooled), step=10)
    if len(pooled) < b:
        assert sel is None
        return
    k = {g.id: 10 - g.trajectories[0].versions[0] for g in pooled}  # raw score = K
    rejected = {g.id for g, _, _ in sel.removed}
    if rejected:
        assert min(k[i] for i in rejected) >= max(k[g.id] for g in pooled if g.id not in rejected)
    assert all(g.scores["score"] == k[g.id] for g, _, _ in sel.removed)
    assert len(sel.batch) == b and len(pooled) - len(rejected) >= b


def reference_select(pooled, step, kind, gamma, window, budget, b):
    """PACE's step 4–5 as a plain loop over groups (the spec the vectorised policy must match)."""
    ranked = []
    for pos, g in enumerate(pooled):
        u = window.rank(g.pfs) if g.pfs is not None else 1.0
        ranked.append((-score(kind, g.k_wait(step), g.k_gen(), u, gamma), g.completed_at, pos))
    rejected = {pos for _, _, pos in sorted(ranked)[:budget]}
    return sorted(pooled[p].id for p in rejected), [g.id for p, g in enumerate(pooled) if p not in rejected][:b]


@settings(max_examples=100)
@given(
    specs=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3), st.integers(1, 4), st.one_of(st.none(), st.integers(0, 4))),
                   min_size=1, max_size=40),
    kind=st.sampled_from(["effective", "raw", "generation"]),
    gamma=st.sampled_from([0.0, 1.0, 2.0]),
    b=st.integers(1, 4),
    target=st.integers(0, 8),
)
def test_vectorised_selection_matches_the_reference_loop(specs, kind, gamma, b, target):
    # groups with ties in every column: completion c, generation lag, length, PFS on a coarse grid
    pooled = [group(i, [max(0, c - lag)] * n + [c], c, None if q is None else q / 4) for i, (c, lag, n, q) in enumerate(specs)]
    p = PacePolicy(b, 100, score=kind, gamma=gamma, target_pool=target, ema=0.0, score_window=8)
    p.record_pfs([0.0, 0.25, 0.5, 0.75, 1.0])
    sel = p.select(PoolColumns.of(pooled), step=7)
    if len(pooled) < b:
        assert sel is None
        return
    want_rejected, want_batch = reference_select(pooled, 7, kind, gamma, p.window, sel.metrics["budget"], b)
    assert sorted(g.id for g, _, _ in sel.removed) == want_rejected
    assert [g.id for g in sel.batch] == want_batch


def test_draw_rejects_only_the_high_scorers_drawn_before_the_batch_is_full():
    # The hand case above under `pace.selection=draw`: the budget is 4 (ids 0, 2, 4, 5), the draw in
    # completion order meets 0 (rejected), 1 (kept), 2 (rejected), 3 (kept): the batch is full, so
    # ids 4 and 5 stay pooled. The batch is the one `pool` selection takes.
    pooled = [group(i, [v] * 4, c) for i, (v, c) in enumerate([(0, 5), (5, 5), (1, 5), (4, 5), (2, 5), (3, 5)])]
    p = PacePolicy(2, 100, score="raw", gamma=1.0, target_pool=2, ema=0.0, score_window=16, selection="draw")
    sel = p.select(PoolColumns.of(pooled), step=6)
    assert sorted(g.id for g, _, _ in sel.removed) == [0, 2]
    assert [g.id for g in sel.batch] == [1, 3]
    assert sel.metrics["budget"] == 4 and sel.metrics["spared"] == 2


def reference_draw(pooled, step, kind, gamma, window, budget, b):
    """The paper's wording as a loop: draw groups in completion order; one among the `budget`
    highest scores of the pool is rejected, any other is kept, until B are kept."""
    top = set(reference_select(pooled, step, kind, gamma, window, budget, b)[0])
    rejected, batch = [], []
    for g in pooled:
        if len(batch) == b:
            break
        (rejected if g.id in top else batch).append(g.id)
    return sorted(rejected), batch


@settings(max_examples=100)
@given(
    specs=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3), st.integers(1, 4), st.one_of(st.none(), st.integers(0, 4))),
                   min_size=1, max_size=40),
    kind=st.sampled_from(["effective", "raw", "generation"]),
    b=st.integers(1, 4),
    target=st.integers(0, 8),
)
def test_draw_selection_matches_the_drawing_loop(specs, kind, b, target):
    pooled = [group(i, [max(0, c - lag)] * n + [c], c, None if q is None else q / 4) for i, (c, lag, n, q) in enumerate(specs)]
    p = PacePolicy(b, 100, score=kind, gamma=2.0, target_pool=target, ema=0.0, score_window=8, selection="draw")
    p.record_pfs([0.0, 0.25, 0.5, 0.75, 1.0])
    sel = p.select(PoolColumns.of(pooled), step=7)
    if len(pooled) < b:
        assert sel is None
        return
    want_rejected, want_batch = reference_draw(pooled, 7, kind, 2.0, p.window, sel.metrics["budget"], b)
    assert sorted(g.id for g, _, _ in sel.removed) == want_rejected
    assert [g.id for g in sel.batch] == want_batch
    assert sel.metrics["spared"] == sel.metrics["budget"] - len(want_rejected)


def test_pace_effective_discounts_generation_staleness_of_low_pfs_groups():
    p = pace(b=1, target=1, kind="effective", gamma=1.0)
    p.record_pfs([0.1, 0.2, 0.3, 0.4])
    a = group(0, [0] * 4, 4, pfs=0.05)  # K_gen 4, u = 0 → effective = K_wait = 1
    b = group(1, [3] * 4, 4, pfs=0.4)  # K_gen 1, u = 1 → effective = 1 + 1 = 2
    sel = p.select(PoolColumns.of([a, b]), step=5)
    assert a.scores["score"] == 1.0 and b.scores["score"] == 2.0
    assert [g.id for g, _, _ in sel.removed] == [1]  # raw would have rejected a (K = 5 vs 2)
    assert sel.metrics["pfs_coverage"] == 1.0  # both candidates had a PFS
    c = group(2, [0] * 4, 4)  # no PFS yet: ranks with u = 1
    sel = pace(b=1, target=1, kind="effective").select(PoolColumns.of([group(3, [0] * 4, 4, pfs=0.1), c]), step=5)
    assert sel.metrics["pfs_coverage"] == 0.5 and c.scores["u"] == 1.0


def test_pfs_candidates_are_the_groups_a_predicted_budget_can_reach():
    # B = 2, target 4, ema 0.5; groups completed at versions 0..7 (one token each, K_gen 0 or 3)
    pooled = [group(i, [max(0, i - 3 * (i == 6))], i) for i in range(8)]
    cols = PoolColumns.of(pooled)
    p = pace(b=2, target=4, ema=0.5, kind="effective")
    # predicted ρ = 0.5 · 0 + 0.5 · (8 − 4)/8 = 0.25 → budget ⌊0.25 · 8⌋ = 2 → look at the top 2·2 + 1 = 5
    # lower bounds K_wait = 10 − c: 10..3; the 5th highest is 6 (c = 4). Upper bounds reach it for
    # c ≤ 4, and for id 6 (K_wait 4 + K_gen 3 = 7): it could outrank the old ones.
    got = [g.id for g in cols.groups(p.pfs_candidates(cols, step=10))]
    assert got == [0, 1, 2, 3, 4, 6]
    assert p.controller.rho == 0.0  # predicting does not move the controller
    assert len(p.pfs_candidates(PoolColumns.of(pooled[:4]), step=10)) == 0  # at target, ρ = 0: no budget
    for kind in ("raw", "generation"):  # they never read the PFS
        assert len(pace(b=2, target=0, kind=kind).pfs_candidates(cols, step=10)) == 0


def test_kv_aware_ranks_by_kv_staleness_in_k_gens_place():
    # One response each, both completed at c = 3 (K_wait = 5 − 3 = 2 at step 5), no later request:
    # a: v = (0, 0, 3, 3) → K_gen = (3 + 3 + 0 + 0)/4 = 1.5; its KV is version 0's throughout → K_kv = 3
    # b: v = (1, 1, 1, 1) → K_gen = K_kv = 2. B = 1, target 1, ema 0 → budget 1.
    # effective, γ = 1, window (0.1 … 0.4): u(a) = 0.75, u(b) = 1
    #   K_gen: a 2 + 0.75·1.5 = 3.125, b 2 + 2 = 4 → b rejected; K_kv: a 2 + 0.75·3 = 4.25 → a rejected
    # raw: a 3.5 vs b 4 → b; kv_aware: 5 vs 4 → a.  generation: 1.5 vs 2 → b; kv_aware: 3 vs 2 → a.
    want = {("effective", False): (1, 3.125, 4.0), ("effective", True): (0, 4.25, 4.0),
            ("raw", False): (1, 3.5, 4.0), ("raw", True): (0, 5.0, 4.0),
            ("generation", False): (1, 1.5, 2.0), ("generation", True): (0, 3.0, 2.0)}
    for (kind, kv_aware), (rejected, score_a, score_b) in want.items():
        a, b = group(0, [0, 0, 3, 3], 3, pfs=0.3), group(1, [1] * 4, 3, pfs=0.4)
        assert (a.k_gen(), a.k_kv(), b.k_gen(), b.k_kv()) == (1.5, 3.0, 2.0, 2.0)
        p = PacePolicy(1, 100, score=kind, gamma=1.0, target_pool=1, ema=0.0, score_window=16, kv_aware=kv_aware)
        p.record_pfs([0.1, 0.2, 0.3, 0.4])
        sel = p.select(PoolColumns.of([a, b]), step=5)
        assert [g.id for g, _, _ in sel.removed] == [rejected], (kind, kv_aware)
        assert (a.scores["score"], b.scores["score"]) == (score_a, score_b), (kind, kv_aware)
        assert a.scores["s_eff"] == 2 + 0.75 * (3.0 if kv_aware else 1.5)  # logged S_eff: the term ranked


def test_kv_aware_widens_the_pfs_candidates_by_kv_staleness():
    # The case above, with group 5 made of two tokens v = (4, 5) at c = 5: K_wait = 5, K_gen = 0.5
    # (upper bound 5.5 < 6, the 5th highest lower bound: not a candidate), K_kv = 1 (upper bound 6:
    # under kv_aware it can reach the budget, so its PFS matters)
    pooled = [group(i, [4, 5] if i == 5 else [max(0, i - 3 * (i == 6))], i) for i in range(8)]
    cols = PoolColumns.of(pooled)
    for kv_aware, want in ((False, [0, 1, 2, 3, 4, 6]), (True, [0, 1, 2, 3, 4, 5, 6])):
        p = PacePolicy(2, 100, score="effective", gamma=1.0, target_pool=4, ema=0.5, score_window=16,
                       kv_aware=kv_aware)
        assert [g.id for g in cols.groups(p.pfs_candidates(cols, step=10))] == want


def test_pace_in_a_pool_keeps_accounting():
    pool = Pool(pace(b=2, target=2, ema=0.0), informative=lambda g: True)
    for i in range(8):
        g = group(i, [0] * 3, 0)
        pool.on_submitted(g)
        pool.add(g, 0)
    batch = pool.form_batch(3, timeout=1)
    assert len(batch.groups) == 2
    c = pool.counts()
    # 8 pooled, target 2, ema 0 → ρ = 6/8, budget = min(⌊6/8 · 8⌋, 8 − 2) = 6
    assert c["rejected"] == 6 and c["consumed"] == 2
    pool.check_accounting()


# ---------------------------------------------------------------- baselines


def test_stale_k_drops_over_the_lag_and_waits_for_fresh_groups():
    p = StaleKPolicy(2, 100, max_lag=2)
    old, fresh = group(0, [0] * 2, 1), group(1, [4] * 2, 4)
    sel = p.select(PoolColumns.of([old, fresh]), step=4)  # K(old) = 4 > 2 dropped; one fresh group < B: no batch
    assert [(g.id, f) for g, f, _ in sel.removed] == [(0, Fate.DROPPED_STALE)] and sel.batch == []
    sel = p.select(PoolColumns.of([fresh, group(2, [3] * 2, 4)]), step=4)
    assert [g.id for g in sel.batch] == [1, 2] and sel.removed == []


def test_stale_k_drops_on_the_policy_lag_not_the_waiting_staleness():
    """Guards against: Stale-k dropping on K_wait (or K_gen) instead of K = K_gen + K_wait."""
    p = StaleKPolicy(1, 100, max_lag=2)
    # completed at c = 3 from tokens of version 0: K_gen = 3, K_wait = 4 - 3 = 1, K = 4 > 2
    sel = p.select(PoolColumns.of([group(0, [0, 0], 3)]), step=4)
    assert [(g.id, f) for g, f, _ in sel.removed] == [(0, Fate.DROPPED_STALE)]
    # K_gen = 0, K_wait = 2, K = 2: kept (the bound is K <= max_lag)
    sel = p.select(PoolColumns.of([group(1, [2, 2], 2)]), step=4)
    assert [g.id for g in sel.batch] == [1] and sel.removed == []
    # a response spanning versions, v = (1, 1, 3) at c = 3, j = 4: K_wait = 1, K = 4 − 5/3 = 2.33 > 2
    sel = p.select(PoolColumns.of([group(2, [1, 1, 3], 3), group(3, [3, 3, 4], 4)]), step=4)
    assert [g.id for g, _, _ in sel.removed] == [2] and [g.id for g in sel.batch] == [3]


def test_gate_admission_arithmetic():
    gate = GatePolicy(batch_prompts=4, max_inflight_groups=100, max_head_offpolicyness=2)
    view = lambda v, started: AdmissionView(v, v, v, started, 0, 0, 4)  # noqa: E731
    assert gate.admits(view(0, 11)) and not gate.admits(view(0, 12))  # (0 + 2 + 1)·4 = 12
    assert gate.admits(view(1, 15)) and not gate.admits(view(1, 16))
    # filtered (and shutdown-dropped) groups give their place back: mostly-filtered runs cannot deadlock
    assert gate.admits(AdmissionView(0, 0, 0, 12, 0, 0, 4, discarded=1))
    assert not gate.admits(AdmissionView(0, 0, 0, 13, 0, 0, 4, discarded=1))


def test_gate_bounds_by_the_trainer_version_not_batches_formed_or_the_engine():
    """Guards against: GatePolicy.admits counting formed batches (one batch further ahead than η
    allows: batch j is formed while θ_j is still training) or the engine version."""
    gate = GatePolicy(batch_prompts=4, max_inflight_groups=100, max_head_offpolicyness=1)
    # training batch 1 (trainer at θ_1), batch 2 formed already, engine still at θ_0: (1 + 1 + 1)·4 = 12
    view = lambda started, engine=0: AdmissionView(engine, 1, 2, started, 0, 0, 4)  # noqa: E731
    assert gate.admits(view(11)) and not gate.admits(view(12))  # batches formed would allow 16
    assert not gate.admits(view(12, engine=3))  # nor does an engine ahead of the trainer


def test_the_pool_gives_the_gate_back_places_of_filtered_and_dropped_groups():
    """Guards against: `Pool._view` reporting nothing discarded (a mostly-filtered gate run deadlocks)."""
    pool = Pool(GatePolicy(batch_prompts=2, max_inflight_groups=100, max_head_offpolicyness=0),
                informative=lambda g: g.id != 1)
    groups = [group(i, [0], 0) for i in range(4)]
    for g in groups[:2]:
        assert pool.admits(0, 0)
        pool.on_submitted(g)
    assert not pool.admits(0, 0)  # (0 + 0 + 1)·2 places, both started
    pool.add(groups[1], 0)  # filtered: its place comes back
    assert pool.admits(0, 0)
    pool.on_submitted(groups[2])
    assert not pool.admits(0, 0)
    pool.drop_inflight(0)  # a stop drops groups 0 and 2: their places come back too
    assert pool.admits(0, 0)
    pool.on_submitted(groups[3])
    assert pool.admits(0, 0) and pool.counts()["dropped_shutdown"] == 2


@settings(max_examples=100)
@given(st.lists(st.one_of(st.none(), st.integers(0, 10)), max_size=60), st.lists(st.integers(0, 10), max_size=20))
def test_vectorised_ranks_match_the_scalar_rank(values, window):
    import numpy as np

    w = ScoreWindow(size=16)
    w.extend(v / 10 for v in window)
    arr = np.array([np.nan if v is None else v / 10 for v in values], dtype=float)
    want = [1.0 if v is None else w.rank(v / 10) for v in values]
    assert w.ranks(arr).tolist() == want
