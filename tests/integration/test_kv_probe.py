"""The stale-KV probe (`rollout.kv_probe`, pace/rollout/kv_probe.py) on the real vLLM CPU engine and
the tiny model, the rollout worker stepped by hand: responses spanning an update to very different
weights are prefilled again under them, and the gap logged is the one a fresh context gives."""
from __future__ import annotations

import math

import pytest

from tests.helpers import _hf_logprobs, _moved

pytestmark = pytest.mark.integration


def test_spanning_responses_are_probed_under_the_new_weights_and_pending_probes_dropped_at_an_update(
        llm, weights, tiny_model_path):
    """With keep (the default), a response that spans θ_0 → θ_1 generates its θ_1 tokens on θ_0's KV:
    the probe's mean |ℓ^μ − ℓ_fresh| over them must equal the one against the new model run on the
    whole sequence (HF), be clearly above the float floor, and its probes count no generated token.
    A probe still pending when the next update lands is aborted, not measured. Across an update to
    equal values the gap is the float floor (what recompute must give)."""
    from omegaconf import OmegaConf

    from pace.config import Config
    from pace.grading import Grader
    from pace.pool import Pool, build_policy
    from pace.rollout.engine import load_weights
    from pace.rollout.fleet import EngineFleet
    from pace.rollout.worker import RolloutWorker
    from pace.tasks.arithmetic import ArithmeticSpec, make_prompts
    from pace.tasks.base import PromptSampler

    cfg = OmegaConf.structured(Config)
    cfg.data.batch_prompts, cfg.data.group_size, cfg.rollout.max_inflight_groups = 2, 4, 2
    cfg.rollout.max_tokens, cfg.rollout.kv_probe = 48, 1.0
    pool = Pool(build_policy(cfg), informative=lambda g: True)
    sampler = PromptSampler(make_prompts(ArithmeticSpec(levels=[4]), "train"), seed=0)
    new, moved = _moved(tiny_model_path, seed=5)
    with Grader(workers=1) as grader:
        worker = RolloutWorker(EngineFleet([llm]), llm.get_tokenizer(), sampler, pool, grader=grader, cfg=cfg)

        def drain():
            while llm.llm_engine.has_unfinished_requests():
                worker._consume(worker.fleet.step())

        worker._admit()
        for _ in range(4):
            worker._consume(worker.fleet.step())
        worker.set_trainer_version(1)
        worker.post_weights(1, moved)
        assert worker._apply_update()
        drain()  # the responses finish under θ_1; their probes run in the same loop
        metrics = worker.metrics()
        groups = [g for g, _ in worker._grading]
        assert len(groups) == 2
        spanning, expected, tokens = 0, 0.0, 0
        for g in groups:
            for t in g.trajectories:
                v = t.versions.tolist()
                if v[0] != 0 or v[-1] != 1:
                    continue
                spanning += 1
                m = v.index(1)
                fresh = _hf_logprobs(new, g.prompt_ids + t.response_ids.tolist(), len(g.prompt_ids))
                expected += sum(abs(a - b) for a, b in zip(t.logprobs[m:].tolist(), fresh[m:]))
                tokens += len(t) - m
        assert spanning > 0, "every response ended within 4 engine steps: none spans the update"
        assert worker.stats["kv_probes"] == spanning and worker.stats["kv_probe_cancelled"] == 0
        assert not worker._kv_probes  # every probe returned
        assert metrics["mismatch/kv_tokens"] == tokens > 0
        gap = metrics["mismatch/kv_abs_logp_diff"]
        assert math.isfinite(gap) and gap == pytest.approx(expected / tokens, abs=1e-4)
        assert gap > 1e-3  # θ_0's KV under θ_1: far above the float floor (~1e-6)
        # the probes' sampled tokens are not generation
        assert worker.stats["tokens"] == sum(len(t) for g in groups for t in g.trajectories)
        assert math.isnan(worker.metrics()["mismatch/kv_abs_logp_diff"])  # none returned since

        # a probe pending when θ_2 lands is aborted before the new weights load
        pool.policy.max_inflight_groups = 4
        assert worker._admit()
        for _ in range(4):
            worker._consume(worker.fleet.step())
        worker.post_weights(2, weights)
        assert worker._apply_update()
        while not worker._kv_probes and llm.llm_engine.has_unfinished_requests():
            worker._consume(worker.fleet.step())  # until a response finishes, its probe sent, not yet run
        pending = list(worker._kv_probes)
        assert pending, "no response spanning θ_1 → θ_2 finished"
        before = worker.stats["kv_probe_tokens"]
        worker.post_weights(3, weights)
        assert worker._apply_update()
        assert worker.stats["kv_probe_cancelled"] == len(pending) and not worker._kv_probes
        assert not any(worker.fleet.holds(rid) for rid in pending)
        drain()
        # responses finishing now end at θ_3; the ones spanning θ_2 → θ_3 on θ_3 tokens only
        assert worker.stats["kv_probe_tokens"] >= before and not worker._kv_probes
        worker.metrics()

        # an update to equal values (θ_4 = θ_3): the stale KV is the fresh one, the gap the float floor
        pool.policy.max_inflight_groups = 6
        assert worker._admit()
        for _ in range(4):
            worker._consume(worker.fleet.step())
        worker.post_weights(4, weights)
        assert worker._apply_update()
        drain()
        floor = worker.metrics()
        assert floor["mismatch/kv_tokens"] > 0 and floor["mismatch/kv_abs_logp_diff"] < 1e-4, floor
    load_weights(llm, weights)  # leave the shared engine as it was
