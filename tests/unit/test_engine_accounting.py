"""Per-engine accounting: each response records the engine that served it (the fleet's outputs →
`Trajectory.engine` → the per-group Parquet), and the trainer's on-policy mismatch is summed per
engine over micro-batches (`correction.mismatch` / `engine_metrics`)."""
from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from pace.algo.correction import engine_metrics, mismatch
from pace.algo.microbatch import collate
from pace.config import Config
from pace.pool import Pool, build_policy
from pace.records import Trajectory
from pace.tasks.base import Prompt, PromptSampler

pytestmark = pytest.mark.unit


def test_a_response_served_by_a_second_engine_is_no_single_engines():
    t = Trajectory(engine=2)
    t.served_by(2)  # a later turn on the same engine
    assert t.engine == 2
    t.served_by(0)  # continued on another (its engine failed)
    assert t.engine == -1
    t.served_by(2)  # for good
    assert t.engine == -1
    assert Trajectory(engine=None).engine == -1  # a fleet that names no engine
    u = Trajectory(engine=1)
    u.served_by(None)
    assert u.engine == -1


def test_the_engine_survives_pickling_and_older_checkpoints_load_as_unknown():
    t = Trajectory([1, 2], [-0.1, -0.2], [0, 0], 1, "stop", engine=3)
    assert pickle.loads(pickle.dumps(t)).engine == 3
    state = t.__getstate__()
    del state["engine"]  # a checkpoint from before per-engine accounting
    old = Trajectory.__new__(Trajectory)
    old.__setstate__(state)
    assert old.engine == -1 and old.response_ids.tolist() == [1, 2]


class TwoTokenEngine:
    """A fake in-host engine: every step, one token for each request it holds."""

    def __init__(self, token: int):
        self.token = token
        self.requests: list[str] = []
        self.vllm_config = SimpleNamespace(device_config=SimpleNamespace(device_type="cpu"))

    def add_request(self, rid, prompt, params, priority=0):
        self.requests.append(rid)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def set_weight_version(self, version):
        pass

    def step(self):
        return [SimpleNamespace(request_id=rid, finished=False, outputs=[SimpleNamespace(
            token_ids=[self.token], logprobs=[{self.token: SimpleNamespace(logprob=-0.5)}], finish_reason=None,
            weight_versions=None)]) for rid in self.requests]


class Tokenizer:
    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(c) for c in text])


def test_the_rollout_records_the_in_host_engine_of_each_response():
    from pace.rollout.fleet import EngineFleet
    from pace.rollout.worker import RolloutWorker

    cfg = OmegaConf.structured(Config)
    cfg.rollout.max_inflight_groups = 2
    pool = Pool(build_policy(cfg), informative=lambda g: True)
    engines = [TwoTokenEngine(5), TwoTokenEngine(7)]
    fleet = EngineFleet([SimpleNamespace(llm_engine=e) for e in engines])
    worker = RolloutWorker(fleet, Tokenizer(), PromptSampler([Prompt("p0", "1+1=?\n", "2")]), pool, grader=None, cfg=cfg)
    assert worker._admit()  # two groups: one on each engine (the least loaded)
    for _ in range(3):
        worker._consume(fleet.step())
    groups = {gid: p.responses for gid, p in worker._pending.items()}
    assert sorted(groups) == [0, 1]
    for gid, responses in groups.items():
        assert len(responses) == cfg.data.group_size
        token = engines[gid].token
        assert all(t.response_ids.tolist() == [token] * 3 for t in responses.values())  # engine gid's tokens
        assert {t.engine for t in responses.values()} == {gid}
    # response 0 of group 0 goes on on engine 1 (as after a failover): served by no single engine
    rid = engines[0].requests[0]
    worker._consume([SimpleNamespace(request_id=rid, finished=False, engine=1, outputs=[SimpleNamespace(
        token_ids=[9], logprobs=[{9: SimpleNamespace(logprob=-0.1)}], finish_reason=None, weight_versions=None)])])
    assert groups[0][0].engine == -1 and len(groups[0][0]) == 4
    assert all(t.engine == 0 for i, t in groups[0].items() if i != 0)


def test_the_group_row_names_each_responses_engine():
    from pace.logger import group_row
    from pace.records import Group

    trajs = [Trajectory([1], [-0.1], [0], 0, "stop", engine=e) for e in (0, 1, -1)]
    assert group_row(Group(0, "p", [1], "0", 0, trajs))["engine"] == [0, 1, -1]


def _micro_batch(engines: list[int], lengths: list[int]) -> dict:
    trajs = [Trajectory([3] * n, [-1.0] * n, [0] * n, 0, "stop", engine=e) for e, n in zip(engines, lengths)]
    return collate(trajs, [[1, 2]] * len(trajs))


def test_per_engine_mismatch_is_summed_over_micro_batches_with_different_engines():
    # micro-batch a: engine 0 (2 tokens, |d| = 0.1 each), engine 1 (1 token, |d| = 0.4)
    # micro-batch b: engine 1 (2 tokens, |d| = 0.1), a response of several engines (-1: 3 tokens, |d| = 1)
    a, b = _micro_batch([0, 1], [2, 1]), _micro_batch([1, -1], [2, 3])
    assert a["engines"].tolist() == [0, 0, 1] and b["engines"].tolist() == [1, 1, -1, -1, -1]
    logp_a = a["logp_behavior"] + torch.tensor([0.1, -0.1, 0.4])
    logp_b = b["logp_behavior"] + torch.tensor([0.1, 0.1, 1.0, 1.0, 1.0])
    on_a, on_b = torch.ones(3), torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])  # the last token is off-policy
    n_engines = 3  # the batch names engines up to 2: engine 2 has no token in either micro-batch
    sums = {}
    for m in (mismatch(logp_a, a["logp_behavior"], on_a, a["engines"], n_engines),
              mismatch(logp_b, b["logp_behavior"], on_b, b["engines"], n_engines)):
        # every engine's keys in every micro-batch: ranks sum them as one vector of the same keys
        assert {f"tokens/engine{i}" for i in range(n_engines)} <= set(m)
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v
    out = engine_metrics(sums)
    assert out["mismatch/tokens/engine0"] == 2 and out["mismatch/tokens/engine1"] == 3
    assert out["mismatch/abs_logp_diff/engine0"] == pytest.approx(0.1, abs=1e-6)
    assert out["mismatch/abs_logp_diff/engine1"] == pytest.approx((0.4 + 0.1 + 0.1) / 3, abs=1e-6)
    assert "mismatch/tokens/engine2" not in out and "mismatch/abs_logp_diff/engine2" not in out  # no tokens
    # the totals still count every on-policy token, the several-engine response's too
    assert sums["tokens"] == 7 and sums["abs_logp_diff"] == pytest.approx(0.2 + 0.4 + 0.2 + 2.0, abs=1e-5)
    assert engine_metrics(mismatch(logp_a, a["logp_behavior"], on_a)) == {}  # no engines given: no per-engine keys


def test_a_response_kept_across_a_restart_is_no_single_engines():
    from pace.rollout.resuming import ResumingMixin

    worker = SimpleNamespace(stats={"resumed_tokens": 0})
    t = Trajectory([1, 2], [-0.1, -0.2], [0, 0], engine=1)
    ResumingMixin._keep(worker, t)  # its tokens so far came from an engine of the earlier process
    assert (t.engine, t.resumed, worker.stats["resumed_tokens"]) == (-1, 2, 2)
