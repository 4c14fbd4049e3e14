"""Tests for pace.staleness and the staleness properties of pace.records.Group (docs/design.md §2).

The property tests draw per-token versions v_t, a completion version c ≥ max v_t and a step
j ≥ c, and check Lemma 1 (K = K_gen + K_wait) and the token-weighted group means against a
direct computation over every token.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pace import staleness
from pace.records import Group, Trajectory

pytestmark = pytest.mark.unit

TOL = 1e-9

# ---------------------------------------------------------------- strategies


@st.composite
def trajectory_versions(draw, max_version: int = 1000, max_len: int = 64):
    """(versions, c): per-token versions and a completion version c ≥ max(versions)."""
    versions = draw(st.lists(st.integers(0, max_version), min_size=1, max_size=max_len))
    c = max(versions) + draw(st.integers(0, 50))
    return versions, c


@st.composite
def group_versions(draw):
    """(versions per trajectory, c per trajectory, step j ≥ max c)."""
    trajs = draw(st.lists(trajectory_versions(), min_size=1, max_size=8))
    versions = [v for v, _ in trajs]
    cs = [c for _, c in trajs]
    step = max(cs) + draw(st.integers(0, 50))
    return versions, cs, step


def make_traj(versions: list[int], completed_at: int) -> Trajectory:
    n = len(versions)
    return Trajectory(
        response_ids=list(range(n)), logprobs=[-1.0] * n, versions=list(versions),
        completed_at=completed_at, finish_reason="stop",
    )


def make_group(versions: list[list[int]], cs: list[int]) -> Group:
    return Group(
        id=0, prompt_id="p0", prompt_ids=[1, 2, 3], answer="1", submitted_at=min(min(v) for v in versions),
        trajectories=[make_traj(v, c) for v, c in zip(versions, cs)],
    )


# ---------------------------------------------------------------- hand-computed examples


def test_single_trajectory_hand_example() -> None:
    # versions [3, 3, 4, 5], completed at c = 5, consumed at step j = 7:
    #   K      = mean(7 − v) = (4 + 4 + 3 + 2) / 4 = 13/4 = 3.25
    #   K_gen  = mean(5 − v) = (2 + 2 + 1 + 0) / 4 =  5/4 = 1.25
    #   K_wait = 7 − 5 = 2                         → 1.25 + 2 = 3.25 ✓
    versions, c, j = [3, 3, 4, 5], 5, 7
    assert staleness.policy_lag(versions, j) == pytest.approx(3.25, abs=TOL)
    assert staleness.generation_staleness(versions, c) == pytest.approx(1.25, abs=TOL)
    assert staleness.waiting_staleness(c, j) == 2
    assert staleness.versions_spanned(versions) == 3  # versions 3, 4, 5
    assert staleness.group_staleness([versions], [c], j) == pytest.approx((3.25, 1.25, 2.0), abs=TOL)


def test_fresh_trajectory_has_zero_generation_staleness() -> None:
    # Every token from the version it completed at: K_gen = 0, K = K_wait = j − c.
    assert staleness.generation_staleness([4, 4, 4], 4) == 0
    assert staleness.policy_lag([4, 4, 4], 6) == 2
    assert staleness.versions_spanned([4, 4, 4]) == 1


def test_group_where_one_trajectory_finished_earlier() -> None:
    # Trajectory A: versions [1, 1], completed at c_A = 1 (finished early, then waited for B).
    # Trajectory B: versions [1, 2, 3, 3], completed at c_B = 3. The group enters the pool at 3.
    # Consumed at step j = 5; 6 tokens in all.
    #   K_gen  token sums: A: (1−1)·2 = 0;           B: (3−1)+(3−2)+0+0 = 3   → 3/6  = 0.5
    #   K_wait token sums: A: (5−1)·2 = 8 (from A's own completion);  B: (5−3)·4 = 8 → 16/6 = 8/3
    #   K      token sums: A: (5−1)·2 = 8;           B: 4+3+2+2 = 11         → 19/6
    # Lemma 1: 0.5 + 8/3 = 19/6 ✓. Had A's waiting counted from the group's completion (3)
    # instead, K_gen would be (4 + 3)/6 = 7/6 and K_wait 2: the split, not K, would differ.
    g = make_group([[1, 1], [1, 2, 3, 3]], [1, 3])
    assert g.completed_at == 3
    assert g.num_tokens == 6
    k, k_gen, k_wait = g.staleness(5)
    assert k == pytest.approx(19 / 6, abs=TOL)
    assert k_gen == pytest.approx(0.5, abs=TOL)
    assert k_wait == pytest.approx(8 / 3, abs=TOL)
    assert g.k_gen() == pytest.approx(0.5, abs=TOL)
    # At the group's own completion step A has already waited 2 steps: K_wait = (2·2 + 0·4)/6.
    assert g.staleness(3)[2] == pytest.approx(4 / 6, abs=TOL)


# ---------------------------------------------------------------- properties: one trajectory


@settings(deadline=None)
@given(trajectory_versions(), st.integers(0, 50))
def test_lemma1_single_trajectory(vc, wait: int) -> None:
    versions, c = vc
    j = c + wait
    k = staleness.policy_lag(versions, j)
    k_gen = staleness.generation_staleness(versions, c)
    k_wait = staleness.waiting_staleness(c, j)
    assert k == pytest.approx(k_gen + k_wait, abs=TOL)
    assert k_gen >= 0
    assert k_wait == wait
    # Against the definitions, token by token.
    assert k == pytest.approx(sum(j - v for v in versions) / len(versions), abs=TOL)
    assert k_gen == pytest.approx(sum(c - v for v in versions) / len(versions), abs=TOL)
    # One trajectory as a group gives the same triple.
    assert staleness.group_staleness([versions], [c], j) == pytest.approx((k, k_gen, k_wait), abs=TOL)


@settings(deadline=None)
@given(trajectory_versions(), st.integers(0, 50))
def test_waiting_staleness_grows_by_one_per_step(vc, wait: int) -> None:
    versions, c = vc
    j = c + wait
    assert staleness.waiting_staleness(c, j + 1) - staleness.waiting_staleness(c, j) == 1
    assert staleness.policy_lag(versions, j + 1) - staleness.policy_lag(versions, j) == pytest.approx(1, abs=TOL)


@settings(deadline=None)
@given(trajectory_versions())
def test_versions_spanned(vc) -> None:
    versions, _ = vc
    spanned = staleness.versions_spanned(versions)
    assert spanned == len(range(min(versions), max(versions) + 1))
    assert spanned >= 1


# ---------------------------------------------------------------- properties: groups


@settings(deadline=None)
@given(group_versions())
def test_lemma1_group_and_token_weighted_means(gv) -> None:
    versions, cs, j = gv
    k, k_gen, k_wait = staleness.group_staleness(versions, cs, j)
    assert k == pytest.approx(k_gen + k_wait, abs=TOL)
    assert k_gen >= 0
    assert k_wait >= 0

    # Direct computation over all tokens of the group, each with its own trajectory's c.
    tokens = [(v, c) for vs, c in zip(versions, cs) for v in vs]
    n = len(tokens)
    assert k == pytest.approx(sum(j - v for v, _ in tokens) / n, abs=TOL)
    assert k_gen == pytest.approx(sum(c - v for v, c in tokens) / n, abs=TOL)
    assert k_wait == pytest.approx(sum(j - c for _, c in tokens) / n, abs=TOL)

    # Token-weighted mean of the per-trajectory values.
    lens = [len(vs) for vs in versions]
    per_k = [staleness.policy_lag(vs, j) for vs in versions]
    per_gen = [staleness.generation_staleness(vs, c) for vs, c in zip(versions, cs)]
    per_wait = [staleness.waiting_staleness(c, j) for c in cs]
    assert k == pytest.approx(sum(m * x for m, x in zip(lens, per_k)) / n, abs=TOL)
    assert k_gen == pytest.approx(sum(m * x for m, x in zip(lens, per_gen)) / n, abs=TOL)
    assert k_wait == pytest.approx(sum(m * x for m, x in zip(lens, per_wait)) / n, abs=TOL)


@settings(deadline=None)
@given(group_versions())
def test_group_record_matches_functions(gv) -> None:
    versions, cs, j = gv
    g = make_group(versions, cs)
    assert g.completed_at == max(cs)
    assert g.num_tokens == sum(len(v) for v in versions)
    assert g.staleness(j) == pytest.approx(staleness.group_staleness(versions, cs, j), abs=TOL)
    # K_gen is fixed at completion: the same at every step ≥ completion.
    assert g.k_gen() == pytest.approx(g.staleness(j)[1], abs=TOL)
    assert g.k_gen() == pytest.approx(g.staleness(j + 7)[1], abs=TOL)
    # K_wait and K grow by exactly one per step; K_gen does not change.
    k0, gen0, wait0 = g.staleness(j)
    k1, gen1, wait1 = g.staleness(j + 1)
    assert wait1 - wait0 == pytest.approx(1, abs=TOL)
    assert k1 - k0 == pytest.approx(1, abs=TOL)
    assert gen1 == pytest.approx(gen0, abs=TOL)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "call",
    [
        lambda: staleness.policy_lag([], 3),
        lambda: staleness.generation_staleness([], 3),
        lambda: staleness.versions_spanned([]),
        lambda: staleness.group_staleness([[1, 2], []], [2, 2], 3),
        lambda: staleness.group_staleness([], [], 3),
        lambda: staleness.group_staleness([[1]], [1, 2], 3),  # one c per trajectory
    ],
)
def test_empty_or_mismatched_inputs_raise(call) -> None:
    with pytest.raises(ValueError):
        call()


def test_empty_response_error_says_so() -> None:
    with pytest.raises(ValueError, match="empty"):
        staleness.policy_lag([], 0)


def test_token_newer_than_completion_raises() -> None:
    with pytest.raises(ValueError, match="newer than completion"):
        staleness.generation_staleness([3, 6], 5)
    with pytest.raises(ValueError, match="newer than completion"):
        staleness.group_staleness([[1, 2], [3, 6]], [2, 5], 7)
    g = make_group([[1, 2], [3, 6]], [2, 5])
    with pytest.raises(ValueError, match="newer than completion"):
        g.staleness(7)
    with pytest.raises(ValueError, match="newer than completion"):
        g.k_gen()


@settings(deadline=None)  # like the others here: a timing deadline fails it on a busy machine, not on a bug
@given(
    st.lists(st.tuples(st.lists(st.integers(0, 20), min_size=1, max_size=8), st.integers(0, 5)), min_size=1, max_size=6),
    st.integers(0, 10),
)
def test_cached_group_k_gen_and_k_wait_match_the_exact_decomposition(specs, extra):
    from pace.records import Group, Trajectory

    trajs = [Trajectory(list(range(len(vs))), [0.0] * len(vs), vs, max(vs) + d, "stop") for vs, d in specs]
    g = Group(0, "p", [1], "0", 0, trajs)
    step = g.completed_at + extra
    k, k_gen, k_wait = g.staleness(step)
    assert abs(g.k_gen() - k_gen) < 1e-9 and abs(g.k_wait(step) - k_wait) < 1e-9
    assert abs(g.k_gen() + g.k_wait(step) - k) < 1e-9


def test_version_spans_run_length_encode_the_token_versions():
    from pace.staleness import version_spans

    assert version_spans([3, 3, 3]) == [3, 3]
    assert version_spans([0, 0, 1, 2, 2, 2]) == [0, 2, 1, 1, 2, 3]
    assert version_spans([]) == []


# ---------------------------------------------------------------- KV staleness


def test_kv_versions_hand_example() -> None:
    """One request prefilled at v=2 spans updates to 4 (keep: its context stays at 2); a tool turn
    starting at token 5 is a new request prefilled at 5."""
    v = [2, 2, 3, 4, 4, 5, 5, 6]
    assert staleness.kv_versions(v).tolist() == [2] * 8
    assert staleness.kv_versions(v, starts=[5]).tolist() == [2, 2, 2, 2, 2, 5, 5, 5]
    assert staleness.kv_versions(v, starts=[5], reprefill=True).tolist() == v
    assert staleness.kv_versions(v, starts=[0, 8, 99]).tolist() == [2] * 8  # out-of-range starts change nothing
    # K_kv of one trajectory completed at 6: mean(6 − w) = (5·4 + 3·1)/8; K_gen = mean(6 − v) = 17/8
    g = make_group([v], [6])
    g.trajectories[0].starts = [5]
    assert abs(g.k_kv() - 23 / 8) < TOL and abs(g.k_gen() - 17 / 8) < TOL


@settings(deadline=None)
@given(group_versions(), st.data())
def test_kv_staleness_bounds_generation_staleness(gv, data) -> None:
    """Versions never go back within a response, so w_t ≤ v_t: K_kv ≥ K_gen, with equality when every
    update re-prefilled (recompute); K_kv + K_wait is the context lag, exactly."""
    versions, cs, step = gv
    versions = [sorted(v) for v in versions]
    g = make_group(versions, cs)
    for t in g.trajectories:
        t.starts = sorted(set(data.draw(st.lists(st.integers(1, max(len(t) - 1, 1)), max_size=3))))
    k_kv, k_gen = g.k_kv(), g.k_gen()
    assert k_kv >= k_gen - TOL
    direct = [c - w for t, c in zip(g.trajectories, cs) for w in staleness.kv_versions(t.versions, t.starts)]
    assert abs(k_kv - sum(direct) / len(direct)) < TOL
    again = make_group(versions, cs)
    again.kv_reprefill = True
    assert abs(again.k_kv() - k_gen) < TOL


def test_kv_versions_follow_the_model_tokens_of_a_tool_response() -> None:
    """Tool output (not an action) is left out; the turn after it starts a request of its own."""
    t = Trajectory([1, 2, 3, 4, 5], [0.0] * 5, [0, 1, 1, 2, 2], 2, "stop", action_mask=[True, True, False, True, True])
    t.starts = [3]
    assert t.kv_versions().tolist() == [0, 0, 2, 2]
    t.truncate(2)
    assert t.starts == [] and t.kv_versions().tolist() == [0, 0]
    t.begin_request()
    t.begin_request()  # twice at one length: one start
    assert t.starts == [2]
