"""Tests for pace.pool: fate accounting, dynamic-sampling filter, FIFO batches, stop and checkpoint
(admission and threads: tests/unit/test_pool_admission.py).

Groups are small fakes (`Group` of `Trajectory`s with chosen rewards, tests/helpers.py); no engine.
The `informative` callable is the one train.py builds: not all rewards equal (`is_informative`).
"""
from __future__ import annotations

import threading
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from omegaconf import OmegaConf

from pace.pool import Pool, build_policy
from pace.pool.base import PoolPolicy
from pace.records import Batch, Fate, Group
from tests.helpers import ALL_RIGHT, MIXED, informative, make_group, make_pool, submit_and_add

pytestmark = pytest.mark.unit


def fate_total(pool: Pool) -> int:
    c = pool.counts()
    return sum(c[f.value] for f in Fate)


# ---------------------------------------------------------------- accounting and batches


def test_lifecycle_counts_and_fates() -> None:
    pool = make_pool(batch_prompts=2)
    gs = [make_group(i, ALL_RIGHT if i == 1 else MIXED) for i in range(4)]
    for g in gs:
        pool.on_submitted(g)
        assert g.fate == Fate.INFLIGHT
    assert pool.counts()["inflight"] == 4 and pool.inflight == 4
    assert pool.add(gs[0], version=3) is True
    assert pool.add(gs[1], version=3) is False  # all rewards equal
    assert gs[0].fate == Fate.POOLED
    assert (gs[1].fate, gs[1].reason, gs[1].step) == (Fate.FILTERED, "all rewards equal", 3)
    c = pool.counts()
    assert (c["submitted"], c["inflight"], c["pooled"], c["filtered"], c["consumed"]) == (4, 2, 1, 1, 0)
    pool.check_accounting()
    assert set(g.id for g in pool.remaining()) == {0, 2, 3}


def test_add_of_unsubmitted_group_is_an_error() -> None:
    pool = make_pool()
    with pytest.raises(KeyError):
        pool.add(make_group(0), 0)


def test_filtered_groups_never_reach_a_batch() -> None:
    pool = make_pool(batch_prompts=3)
    for i in range(12):
        submit_and_add(pool, make_group(i, ALL_RIGHT if i % 2 else MIXED))  # odd ids filtered
    consumed = []
    for step in range(2):
        batch = pool.form_batch(step, timeout=0)
        assert batch is not None
        consumed += [g.id for g in batch.groups]
    assert pool.form_batch(2, timeout=0) is None  # only 6 informative groups existed
    assert consumed == [0, 2, 4, 6, 8, 10]
    assert all(g.fate == Fate.CONSUMED for g in pool.drain_decided() if g.id % 2 == 0)
    c = pool.counts()
    assert (c["consumed"], c["filtered"], c["pooled"]) == (6, 6, 0)
    pool.check_accounting()


def test_batches_are_fifo_in_completion_order_and_exactly_b() -> None:
    pool = make_pool(batch_prompts=3)
    gs = [make_group(i) for i in range(8)]
    for g in gs:
        pool.on_submitted(g)
    completion_order = [5, 2, 7, 0, 3, 1, 6, 4]  # completion order, not submission order
    for gid in completion_order:
        pool.add(gs[gid], version=0)
    b0 = pool.form_batch(0, timeout=0)
    b1 = pool.form_batch(1, timeout=0)
    assert isinstance(b0, Batch) and b0.step == 0 and b1.step == 1
    assert [g.id for g in b0.groups] == [5, 2, 7]
    assert [g.id for g in b1.groups] == [0, 3, 1]
    assert all(g.fate == Fate.CONSUMED for g in b0.groups) and all(g.step == 0 for g in b0.groups)
    assert all(g.step == 1 for g in b1.groups)
    assert len(b0.trajectories) == 3 * 4
    assert pool.form_batch(2, timeout=0) is None  # 2 left < B
    assert [g.id for g in pool.remaining()] == [6, 4]
    assert pool.batches_formed == 2 and pool.occupancy == 2


def test_form_batch_timeout_returns_none_and_changes_nothing() -> None:
    pool = make_pool(batch_prompts=3)
    for i in range(2):
        submit_and_add(pool, make_group(i))
    t0 = time.monotonic()
    assert pool.form_batch(0, timeout=0.05) is None
    assert time.monotonic() - t0 >= 0.04
    assert pool.batches_formed == 0 and pool.occupancy == 2 and pool.drain_decided() == []
    submit_and_add(pool, make_group(2))
    batch = pool.form_batch(0, timeout=0)
    assert [g.id for g in batch.groups] == [0, 1, 2]


def test_form_batch_wakes_when_a_group_arrives() -> None:
    pool = make_pool(batch_prompts=1)
    g = make_group(0)
    pool.on_submitted(g)
    timer = threading.Timer(0.05, pool.add, args=(g, 0))
    timer.start()
    t0 = time.monotonic()
    batch = pool.form_batch(0, timeout=5.0)
    timer.join()
    assert batch is not None and batch.groups[0] is g
    assert time.monotonic() - t0 < 2.0  # woken by add, not by the timeout


def test_form_batch_timeout_is_a_deadline_even_while_groups_trickle_in() -> None:
    # B = 2 and only filtered groups arrive (one every 20 ms for 0.6 s): no batch can form, so
    # form_batch(timeout=0.1) must return None after ~0.1 s. train.py relies on this to notice a
    # rollout failure within 0.5 s.
    pool = make_pool(batch_prompts=2)
    stop = threading.Event()

    def trickle() -> None:
        for i in range(30):
            if stop.is_set():
                return
            submit_and_add(pool, make_group(i, ALL_RIGHT))
            time.sleep(0.02)

    t = threading.Thread(target=trickle)
    t.start()
    try:
        t0 = time.monotonic()
        assert pool.form_batch(0, timeout=0.1) is None
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        t.join()
    assert elapsed < 0.4, f"form_batch(timeout=0.1) blocked {elapsed:.2f} s"


def test_drain_decided_returns_each_decided_group_once() -> None:
    pool = make_pool(batch_prompts=2)
    for i in range(5):
        submit_and_add(pool, make_group(i, ALL_RIGHT if i in (1, 3) else MIXED))
    first = pool.drain_decided()
    assert sorted(g.id for g in first) == [1, 3]  # filtered at arrival
    assert pool.drain_decided() == []
    pool.form_batch(0, timeout=0)
    second = pool.drain_decided()
    assert sorted(g.id for g in second) == [0, 2]
    assert all(g.fate == Fate.CONSUMED for g in second)
    assert pool.drain_decided() == []
    assert pool.form_batch(1, timeout=0) is None  # group 4 alone
    assert pool.drain_decided() == []


class _RejectOldest(PoolPolicy):
    """Test policy: removes the first pooled group as rejected, then takes B FIFO."""

    name = "reject_oldest"

    def select(self, pooled, step):
        if len(pooled) < self.batch_prompts + 1:
            return None
        from pace.pool.base import Selection

        first = pooled.first(1 + self.batch_prompts)
        return Selection(batch=first[1:], removed=[(first[0], Fate.REJECTED, "oldest")],
                         metrics={"budget": 1})


def test_removed_groups_get_their_fate_and_leave_the_pool() -> None:
    pool = Pool(_RejectOldest(batch_prompts=2, max_inflight_groups=8), informative)
    for i in range(4):
        submit_and_add(pool, make_group(i))
    batch = pool.form_batch(7, timeout=0)
    assert [g.id for g in batch.groups] == [1, 2]
    decided = {g.id: g for g in pool.drain_decided()}
    assert (decided[0].fate, decided[0].reason, decided[0].step) == (Fate.REJECTED, "oldest", 7)
    assert [g.id for g in pool.remaining()] == [3]
    assert pool.last_metrics == {"budget": 1}
    c = pool.counts()
    assert (c["rejected"], c["consumed"], c["pooled"]) == (1, 2, 1)
    pool.check_accounting()


def test_check_accounting_detects_a_lost_group() -> None:
    pool = make_pool()
    submit_and_add(pool, make_group(0))
    pool._pooled.clear()  # simulate a bug that drops a group silently
    with pytest.raises(AssertionError, match="fate accounting"):
        pool.check_accounting()


# ---------------------------------------------------------------- stateful: accounting under any sequence


class PoolMachine(RuleBasedStateMachine):
    """Random submit / add / form_batch / drain sequences against a plain model of the pool."""

    B = 3

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(batch_prompts=self.B, max_inflight=10**6)
        self.next_id = 0
        self.inflight: list[Group] = []
        self.pooled: list[int] = []  # model: ids in completion order
        self.fates: dict[int, Fate] = {}
        self.undrained: set[int] = set()
        self.drained: set[int] = set()
        self.step = 0

    @rule(useful=st.booleans())
    def submit(self, useful: bool) -> None:
        g = make_group(self.next_id, MIXED if useful else ALL_RIGHT)
        self.next_id += 1
        self.pool.on_submitted(g)
        self.inflight.append(g)
        self.fates[g.id] = Fate.INFLIGHT

    @precondition(lambda self: self.inflight)
    @rule(data=st.data())
    def complete(self, data) -> None:
        g = self.inflight.pop(data.draw(st.integers(0, len(self.inflight) - 1)))
        pooled = self.pool.add(g, self.step)
        assert pooled == informative(g)
        if pooled:
            self.pooled.append(g.id)
            self.fates[g.id] = Fate.POOLED
        else:
            self.fates[g.id] = Fate.FILTERED
            self.undrained.add(g.id)

    @rule()
    def form(self) -> None:
        batch = self.pool.form_batch(self.step, timeout=0)
        if len(self.pooled) < self.B:
            assert batch is None
            return
        expected, self.pooled = self.pooled[: self.B], self.pooled[self.B :]
        assert [g.id for g in batch.groups] == expected
        for gid in expected:
            assert self.fates[gid] == Fate.POOLED  # never consumed twice
            self.fates[gid] = Fate.CONSUMED
            self.undrained.add(gid)
        self.step += 1

    @rule()
    def drain(self) -> None:
        ids = [g.id for g in self.pool.drain_decided()]
        assert len(ids) == len(set(ids))
        assert set(ids) == self.undrained
        assert not (set(ids) & self.drained)  # each decided group exactly once
        self.drained |= set(ids)
        self.undrained = set()

    @invariant()
    def accounting(self) -> None:
        self.pool.check_accounting()
        c = self.pool.counts()
        assert c["submitted"] == self.next_id == fate_total(self.pool)
        for fate in Fate:
            assert c[fate.value] == sum(f == fate for f in self.fates.values()), fate
        assert self.pool.batches_formed == self.step


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------- stop, checkpoint


def test_drop_inflight_and_abandon_keep_the_accounting() -> None:
    pool = make_pool(batch_prompts=2)
    for gid in range(3):
        submit_and_add(pool, make_group(gid))
    for gid in (3, 4):
        pool.on_submitted(make_group(gid))
    batch = pool.form_batch(0, timeout=0)  # decided consumed: not drained (logged) yet
    pool.abandon(batch, reason="training step failed: RuntimeError")  # the step on it failed
    dropped = pool.drop_inflight(1, reason="stopped: SIGTERM")
    assert sorted(g.id for g in dropped) == [3, 4]
    c = pool.counts()
    assert c["consumed"] == 0 and c["dropped_shutdown"] == 4 and c["pooled"] == 1 and c["inflight"] == 0
    pool.check_accounting()
    decided = pool.drain_decided()
    assert len(decided) == 4  # each once, with its final fate
    assert {g.id: g.fate for g in decided} == {0: Fate.DROPPED_SHUTDOWN, 1: Fate.DROPPED_SHUTDOWN,
                                               3: Fate.DROPPED_SHUTDOWN, 4: Fate.DROPPED_SHUTDOWN}


def test_state_dict_round_trip_counts_inflight_as_dropped() -> None:
    import pickle

    cfg = OmegaConf.create({"data": {"batch_prompts": 2}, "rollout": {"max_inflight_groups": 8},
                            "pool": {"name": "pace", "max_lag": 4.0, "max_head_offpolicyness": 4, "record_effective": 0.0},
                            "pace": {"score": "effective", "gamma": 2.0, "target_pool": 2, "ema": 0.5, "score_window": 8,
                                     "selection": "pool", "kv_aware": False}})
    pool = Pool(build_policy(cfg), informative)
    for gid in range(6):
        submit_and_add(pool, make_group(gid, submitted_at=0), version=0)
    pool.set_pfs(pool.remaining()[0], 0.3, 1)
    pool.form_batch(2, timeout=0)  # ρ moves, groups are rejected / consumed
    submit_and_add(pool, make_group(6, rewards=ALL_RIGHT))  # filtered, not drained yet
    pool.on_submitted(make_group(7))  # in flight at the checkpoint
    blob = pickle.dumps(pool.state_dict())

    restored = Pool(build_policy(cfg), informative)
    dropped = restored.load_state_dict(pickle.loads(blob))
    assert [g.id for g in dropped] == [7] and dropped[0].fate is Fate.DROPPED_SHUTDOWN
    assert [g.id for g in restored.remaining()] == [g.id for g in pool.remaining() if g.fate is Fate.POOLED]
    assert restored.policy.controller.rho == pool.policy.controller.rho > 0
    assert restored.policy.window.state_dict() == pool.policy.window.state_dict()
    assert restored.batches_formed == pool.batches_formed and restored.submitted == pool.submitted == 8
    c = restored.counts()
    assert c["inflight"] == 0 and c["dropped_shutdown"] == 1 and c["filtered"] == 1
    restored.check_accounting()
    undrained = {g.id: g.fate for g in pool.drain_decided()}
    assert {g.id: g.fate for g in restored.drain_decided()} == {**undrained, 7: Fate.DROPPED_SHUTDOWN}
    # the restored pool goes on: same next batch as the original would form
    assert [g.id for g in restored.form_batch(3, timeout=0).groups] == [g.id for g in pool.form_batch(3, timeout=0).groups]


@pytest.mark.parametrize("keep_inflight", [True, False])
def test_groups_the_rollout_kept_stay_in_flight_across_a_checkpoint(keep_inflight) -> None:
    """`state_dict(keep=...)`: the groups in flight whose state the rollout kept stay in flight in the
    restored pool (the resumed run continues them); the others are dropped as before. With
    `keep_inflight` False (rollout.resume_inflight=false at the resume) the kept ones are dropped too.
    A checkpoint from before in-flight resume (no "inflight" entry) loads with its groups dropped."""
    import pickle

    pool = make_pool(batch_prompts=2)
    for gid in range(3):
        submit_and_add(pool, make_group(gid))
    for gid in (3, 4, 5):
        pool.on_submitted(make_group(gid))
    state = pickle.loads(pickle.dumps(pool.state_dict(keep={3, 5})))
    assert [g.id for g in state["inflight"]] == [3, 5] and [g.id for g in state["dropped"]] == [4]

    restored = make_pool(batch_prompts=2)
    dropped = restored.load_state_dict(state, keep_inflight=keep_inflight)
    assert sorted(g.id for g in dropped) == ([4] if keep_inflight else [3, 4, 5])
    c = restored.counts()
    assert (c["inflight"], c["dropped_shutdown"]) == ((2, 1) if keep_inflight else (0, 3))
    restored.check_accounting()
    if keep_inflight:  # they finish into the pool as any group in flight does
        kept = {g.id: g for g in restored.remaining() if g.fate is Fate.INFLIGHT}
        assert restored.add(kept[3], version=1) and restored.counts()["pooled"] == 4
        restored.check_accounting()

    old = {k: v for k, v in pool.state_dict().items() if k != "inflight"}  # the format before it
    assert [g.id for g in make_pool(batch_prompts=2).load_state_dict(old)] == [3, 4, 5]
