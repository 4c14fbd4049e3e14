"""A failure in the rollout thread reaches the trainer thread within one poll (fake engine: threading logic only)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from pace.config import Config
from pace.pool import Pool, build_policy
from pace.tasks.base import Prompt, PromptSampler


class ExplodingEngine:
    """Accepts requests, then fails on the third engine step."""

    def __init__(self):
        self.steps = 0
        self.requests = []
        self.vllm_config = SimpleNamespace(device_config=SimpleNamespace(device_type="cuda"))

    def add_request(self, rid, prompt, params, priority=0):
        self.requests.append(rid)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.steps += 1
        if self.steps == 3:
            raise RuntimeError("engine exploded on purpose")
        return []

    def abort_request(self, ids):
        self.requests.clear()

    def set_weight_version(self, version):
        pass


class Tokenizer:
    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(c) for c in text])


def test_rollout_exception_stops_the_trainer_wait_with_its_traceback():
    from pace.loop import wait_for_batch
    from pace.rollout.fleet import EngineFleet
    from pace.rollout.worker import RolloutError, RolloutWorker

    cfg = OmegaConf.structured(Config)
    pool = Pool(build_policy(cfg), informative=lambda g: True)
    sampler = PromptSampler([Prompt("p0", "1+1=?\n", "2")])
    engine = ExplodingEngine()
    fleet = EngineFleet([SimpleNamespace(llm_engine=engine)])
    worker = RolloutWorker(fleet, Tokenizer(), sampler, pool, grader=None, cfg=cfg)
    worker.start()
    t0 = time.monotonic()
    with pytest.raises(RolloutError, match="engine exploded on purpose") as info:
        wait_for_batch(pool, worker, step=0, stop=SimpleNamespace(requested=False))
    assert time.monotonic() - t0 < 2.0
    msg = str(info.value)
    assert "Traceback (most recent call last)" in msg and "in step" in msg  # the rollout thread's own traceback
    worker.join(timeout=5)
    assert not worker.is_alive()
    assert engine.requests == []  # in-flight requests were aborted on the way out
    assert pool.counts()["inflight"] == cfg.rollout.max_inflight_groups  # still counted, not lost


class CountingEngine(ExplodingEngine):
    """Never finishes a request; counts engine steps."""

    def step(self):
        self.steps += 1
        time.sleep(0.001)
        return []


def test_paused_holds_the_thread_between_engine_steps_and_a_dead_thread_is_idle():
    from pace.rollout.fleet import EngineFleet
    from pace.rollout.worker import RolloutWorker

    cfg = OmegaConf.structured(Config)
    pool = Pool(build_policy(cfg), informative=lambda g: True)
    engine = CountingEngine()
    worker = RolloutWorker(EngineFleet([SimpleNamespace(llm_engine=engine)]), Tokenizer(),
                           PromptSampler([Prompt("p0", "1+1=?\n", "2")]),
                           pool, grader=None, cfg=cfg)
    worker.start()
    while engine.steps < 5:
        time.sleep(0.01)
    with worker.paused():
        held = engine.steps
        state = worker.state_dict()
        time.sleep(0.3)
        assert engine.steps == held  # no engine step while paused
    assert state["next_group_id"] == pool.submitted == cfg.rollout.max_inflight_groups  # one consistent moment
    deadline = time.monotonic() + 2
    while engine.steps == held and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.steps > held  # and it goes on afterwards
    worker.stop()
    t0 = time.monotonic()
    with worker.paused():  # a stopped thread: nothing to wait for
        pass
    assert time.monotonic() - t0 < 0.5
