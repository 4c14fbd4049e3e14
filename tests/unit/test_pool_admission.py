"""Tests for pace.pool's admission: what `SyncPolicy` and `AsyncPolicy` let the rollout start (one
batch per version, the in-flight cap, the pool's capacity), the policies built by name, and
producer/consumer threads that obey them (the pool's accounting and batches: tests/unit/test_pool.py).

Groups are small fakes (`Group` of `Trajectory`s with chosen rewards, tests/helpers.py); no engine.
"""
from __future__ import annotations

import threading
import time

import pytest
from omegaconf import OmegaConf

from pace.pool import Pool, build_policy
from pace.pool.policies import POLICIES, AsyncPolicy, SyncPolicy
from pace.records import Fate
from tests.helpers import ALL_RIGHT, MIXED, informative, make_group, make_pool, submit_and_add

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- admission


def test_sync_admission_one_batch_per_version() -> None:
    pool = Pool(SyncPolicy(batch_prompts=2, max_inflight_groups=16), informative)
    g = [make_group(i, ALL_RIGHT if i == 1 else MIXED) for i in range(6)]
    assert pool.admits(engine_version=0, trainer_version=0)
    pool.on_submitted(g[0])
    assert pool.admits(0, 0)  # 1 < B
    pool.on_submitted(g[1])
    assert not pool.admits(0, 0)  # pooled + inflight = 2 = B
    pool.add(g[0], 0)
    assert not pool.admits(0, 0)  # pooled 1 + inflight 1
    pool.add(g[1], 0)  # filtered: frees its slot, dynamic sampling regenerates
    assert pool.admits(0, 0)
    submit_and_add(pool, g[2])
    assert not pool.admits(0, 0)  # pooled 2 = B
    assert pool.form_batch(0, timeout=0) is not None
    # Batch 0 formed; the engine still holds θ_0 until the update is synced.
    assert not pool.admits(engine_version=0, trainer_version=0)
    assert not pool.admits(engine_version=0, trainer_version=1)
    assert pool.admits(engine_version=1, trainer_version=1)
    assert not pool.admits(engine_version=2, trainer_version=2)  # engine must hold exactly θ_{batches formed}


def test_sync_admission_respects_inflight_cap() -> None:
    pool = Pool(SyncPolicy(batch_prompts=4, max_inflight_groups=2), informative)
    pool.on_submitted(make_group(0))
    assert pool.admits(0, 0)
    pool.on_submitted(make_group(1))
    assert not pool.admits(0, 0)  # cap 2 reached though 2 < B = 4


def test_async_admission_only_caps_inflight() -> None:
    pool = Pool(AsyncPolicy(batch_prompts=2, max_inflight_groups=3), informative)
    for i in range(10):  # a full pool does not stop an async rollout
        submit_and_add(pool, make_group(i))
    assert pool.occupancy == 10
    assert pool.admits(engine_version=0, trainer_version=7)
    gs = [make_group(100 + i) for i in range(3)]
    for g in gs[:2]:
        pool.on_submitted(g)
    assert pool.admits(0, 0)
    pool.on_submitted(gs[2])
    assert not pool.admits(0, 0)  # inflight 3 = cap
    pool.add(gs[0], 0)
    assert pool.admits(5, 0)  # any engine version


@pytest.mark.parametrize("name, cls", [("sync", SyncPolicy), ("async", AsyncPolicy)])
def test_build_policy(name: str, cls: type) -> None:
    cfg = OmegaConf.create({"pool": {"name": name, "record_effective": 0.0}, "data": {"batch_prompts": 5}, "rollout": {"max_inflight_groups": 7}})
    policy = build_policy(cfg)
    assert type(policy) is cls
    assert (policy.batch_prompts, policy.max_inflight_groups) == (5, 7)
    assert POLICIES[name] is cls


# ---------------------------------------------------------------- threads


def test_threaded_producer_consumer_async() -> None:
    B, steps, extra = 4, 30, 3
    pool = make_pool(AsyncPolicy(batch_prompts=B, max_inflight_groups=6))
    n_useful = B * steps + extra
    produced_filtered: list[int] = []
    errors: list[BaseException] = []

    def producer() -> None:
        try:
            gid, useful = 0, 0
            while useful < n_useful:
                if not pool.admits(0, 0):
                    time.sleep(0.0005)
                    continue
                filtered = gid % 3 == 2
                g = make_group(gid, ALL_RIGHT if filtered else MIXED)
                pool.on_submitted(g)
                if gid % 7 == 0:
                    time.sleep(0.001)  # let the consumer interleave
                pool.add(g, version=0)
                if filtered:
                    produced_filtered.append(gid)
                else:
                    useful += 1
                gid += 1
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)

    t = threading.Thread(target=producer)
    t.start()
    batches, drained = [], []
    for step in range(steps):
        batch = pool.form_batch(step, timeout=10.0)
        assert batch is not None, f"no batch at step {step}"
        batches.append(batch)
        drained += pool.drain_decided()
    t.join(timeout=10.0)
    assert not t.is_alive() and not errors
    drained += pool.drain_decided()

    consumed = [g.id for b in batches for g in b.groups]
    assert all(len(b.groups) == B for b in batches)
    assert len(consumed) == len(set(consumed)) == B * steps  # nobody consumed twice
    assert consumed == sorted(consumed)  # FIFO: one producer completes groups in id order
    assert not set(consumed) & set(produced_filtered)
    assert all(g.fate == Fate.CONSUMED for b in batches for g in b.groups)
    assert [b.step for b in batches] == list(range(steps))
    drained_ids = [g.id for g in drained]
    assert len(drained_ids) == len(set(drained_ids))
    assert set(drained_ids) == set(consumed) | set(produced_filtered)
    c = pool.counts()
    assert (c["consumed"], c["filtered"], c["pooled"], c["inflight"]) == (B * steps, len(produced_filtered), extra, 0)
    pool.check_accounting()


def test_threaded_sync_batches_are_on_policy() -> None:
    # Rollout thread obeys SyncPolicy admission and tags each group with the engine version it was
    # generated with; the trainer "syncs" (engine_version = j + 1) after forming batch j. Every
    # group of batch j must have been generated with θ_j, and no generation overlaps training.
    B, steps = 3, 8
    pool = Pool(SyncPolicy(batch_prompts=B, max_inflight_groups=16), informative)
    engine = {"version": 0}
    stop = threading.Event()
    errors: list[BaseException] = []

    def rollout() -> None:
        try:
            gid = 0
            while not stop.is_set():
                v = engine["version"]
                if not pool.admits(v, v):
                    time.sleep(0.0005)
                    continue
                g = make_group(gid, ALL_RIGHT if gid % 4 == 3 else MIXED, submitted_at=v)
                pool.on_submitted(g)
                pool.add(g, v)
                gid += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=rollout)
    t.start()
    try:
        for step in range(steps):
            batch = pool.form_batch(step, timeout=10.0)
            assert batch is not None
            assert [g.submitted_at for g in batch.groups] == [step] * B
            assert pool.occupancy == 0 and pool.inflight == 0  # exactly one batch was generated
            engine["version"] = step + 1
    finally:
        stop.set()
        t.join(timeout=10.0)
    assert not errors
    pool.check_accounting()
    assert pool.counts()["consumed"] == B * steps


# ---------------------------------------------------------------- capacity


def test_capacity_blocks_admission_and_bounds_the_pool() -> None:
    pool = Pool(AsyncPolicy(batch_prompts=2, max_inflight_groups=100), informative, capacity=5)
    gid = 0
    while pool.admits(0, 0):  # production far ahead of training
        g = make_group(gid)
        gid += 1
        pool.on_submitted(g)
        if gid % 2:
            pool.add(g, 0)
    assert gid == 5 and pool.capacity_blocked  # pooled + in flight reached the capacity
    assert pool.occupancy + pool.inflight == 5
    assert pool.form_batch(0, timeout=0) is not None  # the trainer takes B ...
    assert pool.admits(0, 1) and not pool.capacity_blocked  # ... and production may go on
    with pytest.raises(ValueError, match="capacity 1 is below the batch size 2"):
        Pool(AsyncPolicy(batch_prompts=2, max_inflight_groups=4), informative, capacity=1)
