"""The rollout worker stepped by hand on the real vLLM CPU engine and the tiny model: per-token
versions across an update, prefix-forgetting scores, updates reaching requests in flight, groups in
flight kept at a stop, KV staleness (keep / recompute) and the stale-KV probe (the engine alone: test_engine.py)."""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import _hf_logprobs, _moved

pytestmark = pytest.mark.integration


def test_rollout_records_versions_across_an_update(llm, weights, tiny_model_path):
    """Step the worker by hand (no thread): an update lands mid-generation, tokens after it carry v=1."""
    from omegaconf import OmegaConf

    from pace.config import Config
    from pace.grading import Grader
    from pace.pool import Pool, build_policy
    from pace.rollout.fleet import EngineFleet
    from pace.rollout.worker import RolloutWorker
    from pace.tasks.arithmetic import ArithmeticSpec, make_prompts
    from pace.tasks.base import PromptSampler

    cfg = OmegaConf.structured(Config)
    cfg.data.batch_prompts, cfg.data.group_size, cfg.rollout.max_inflight_groups = 2, 4, 2
    cfg.rollout.max_tokens = 64
    pool = Pool(build_policy(cfg), informative=lambda g: True)
    sampler = PromptSampler(make_prompts(ArithmeticSpec(levels=[4]), "train"), seed=0)
    grader = Grader(workers=1)
    worker = RolloutWorker(EngineFleet([llm]), llm.get_tokenizer(), sampler, pool, grader=grader, cfg=cfg)
    worker._admit()
    assert pool.inflight == 2
    for _ in range(5):
        worker._consume(worker.fleet.step())
    worker.set_trainer_version(1)
    worker.post_weights(1, weights)  # same values, new version: the switch is what is recorded
    assert worker._apply_update() and worker.engine_version == 1
    while llm.llm_engine.has_unfinished_requests():
        worker._consume(worker.fleet.step())
    trajs = [t for p in worker._pending.values() for t in p.responses.values()]
    groups_done = len(worker._grading)
    trajs += [t for g, _ in worker._grading for t in g.trajectories]
    assert trajs and groups_done + len(worker._pending) == 2
    for t in trajs:
        assert len(t.versions) == len(t.response_ids) == len(t.logprobs)
        assert t.versions.tolist() == sorted(t.versions.tolist())  # versions never go back within a response
        assert t.completed_at == 1
    spanning = [t for t in trajs if t.versions[0] == 0 and t.versions[-1] == 1]
    assert spanning, "every response ended within 5 engine steps: no update landed mid-generation"
    for t in spanning:
        assert t.versions[:5].tolist() == [0] * 5 and t.versions[5:].tolist() == [1] * (len(t) - 5)
    # vLLM's own labels (weight_versions, set with each update) equalled these stamps token for token
    finished = sum(len(t) for t in trajs if t.finish_reason)
    assert worker.stats["versions_checked"] == finished > 0
    grader.close()


def test_prefix_forgetting_score_is_zero_under_the_generating_weights(llm, weights):
    """PACE rescoring on the rollout thread's loop (stepped by hand): groups with K_gen > 0 are scored
    as they enter the pool and again after each update; PFS ≈ 0 under the weights that generated the
    prefix (at arrival, and after an update to equal values), clearly > 0 after the weights move."""
    import time

    from omegaconf import OmegaConf

    from pace.config import Config
    from pace.grading import Grader
    from pace.pool import Pool, build_policy
    from pace.rollout.fleet import EngineFleet
    from pace.rollout.worker import RolloutWorker
    from pace.tasks.arithmetic import ArithmeticSpec, make_prompts
    from pace.tasks.base import PromptSampler

    cfg = OmegaConf.structured(Config)
    cfg.pool.name, cfg.pace.prefix_tokens = "pace", 8
    # B = 1, target 0, ema 0: with two pooled groups the budget is 1, so both are rejection
    # candidates and get scored (at the second arrival, and after each update)
    cfg.pace.target_pool, cfg.pace.ema = 0, 0.0
    cfg.data.batch_prompts, cfg.data.group_size, cfg.rollout.max_inflight_groups = 1, 4, 2
    pool = Pool(build_policy(cfg), informative=lambda g: True)
    sampler = PromptSampler(make_prompts(ArithmeticSpec(levels=[2]), "train"), seed=0)
    with Grader(workers=1) as grader:
        worker = RolloutWorker(EngineFleet([llm]), llm.get_tokenizer(), sampler, pool, grader=grader, cfg=cfg)
        worker._admit()
        worker.set_trainer_version(1)  # completes at c = 1 with tokens from v = 0: K_gen = 1 > 0

        def drain():
            while llm.llm_engine.has_unfinished_requests():
                worker._consume(worker.fleet.step())

        drain()
        deadline = time.time() + 30
        while pool.occupancy < 2 and time.time() < deadline:
            worker._collect_grades()
            time.sleep(0.05)
        assert pool.occupancy == 2
        groups = pool.remaining()
        drain()  # the arrival scoring, under version 0: the weights that generated every token
        assert all(g.pfs_version == 0 for g in groups) and max(g.pfs for g in groups) < 1e-4
        assert len(pool.policy.window) == 2 and worker.stats["rescored"] == 2

        worker.post_weights(1, weights)  # same values as version 0
        worker._apply_update()
        drain()
        assert all(g.pfs_version == 1 for g in groups)
        assert max(g.pfs for g in groups) < 1e-4
        assert len(pool.policy.window) == 4 and worker.stats["rescored"] == 4

        gen = torch.Generator().manual_seed(1)
        worker.post_weights(2, [(n, t + 0.05 * torch.randn(t.shape, generator=gen)) for n, t in weights])
        worker._apply_update()
        drain()
        assert all(g.pfs_version == 2 and g.pfs > 1e-2 for g in groups)
    from pace.rollout.engine import load_weights

    load_weights(llm, weights)  # leave the shared engine as it was


# ---------------------------------------------------------------- weights that really reach the engine

def test_tokens_after_an_update_come_from_the_new_weights_and_new_requests_reuse_no_old_prefix(
        llm, weights, tiny_model_path):
    """Guards against: an update that does not reach requests in flight, and a new request reusing
    a prompt prefix cached under older weights (the rollout salts each request's prefix-cache key
    with the weight version). The worker is stepped by hand; θ_1 differs from θ_0.

    Reference for a response spanning the update, its first θ_1 token at index m: KV of the prompt
    and y_<m−1 from θ_0 (computed before the update), then θ_1 from y_{m−1} on (the in-flight
    request keeps its cache). A group started after the update: θ_1 alone, although its prompt's
    first KV block (128 tokens) was cached under θ_0 by the first group."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from pace.config import Config
    from pace.grading import Grader
    from pace.pool import Pool, build_policy
    from pace.rollout.engine import load_weights
    from pace.rollout.fleet import EngineFleet
    from pace.rollout.worker import RolloutWorker
    from pace.tasks.base import Prompt, PromptSampler

    cfg = OmegaConf.structured(Config)
    cfg.data.batch_prompts, cfg.data.group_size, cfg.rollout.max_inflight_groups = 1, 2, 1
    cfg.rollout.max_tokens = 40
    text = "+".join(str(i % 10) for i in range(76)) + "=?\n"  # 153 tokens: one full KV block of 128 and more
    pool = Pool(build_policy(cfg), informative=lambda g: True)
    old = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    new, moved = _moved(tiny_model_path, seed=3)
    with Grader(workers=1) as grader:
        worker = RolloutWorker(EngineFleet([llm]), llm.get_tokenizer(), PromptSampler([Prompt("long", text, "0")]), pool, grader, cfg)
        assert worker._admit() and len(worker.tokenizer(text, add_special_tokens=False).input_ids) > 128
        for _ in range(4):
            worker._consume(worker.fleet.step())
        worker.set_trainer_version(1)
        worker.post_weights(1, moved)
        assert worker._apply_update()
        pool.policy.max_inflight_groups = 2
        assert worker._admit()  # group 1: the same prompt, submitted under θ_1
        while llm.llm_engine.has_unfinished_requests():
            worker._consume(worker.fleet.step())
        groups = {g.id: g for g, _ in worker._grading}
    load_weights(llm, weights)
    assert set(groups) == {0, 1}
    prompt = groups[0].prompt_ids
    for traj in groups[0].trajectories:  # spanning: θ_0 tokens, then θ_1 tokens with θ_0's earlier KV
        versions = traj.versions.tolist()
        m = versions.index(1) if 1 in versions else len(traj)
        assert versions[:m] == [0] * m and m >= 1 and len(traj) > m, versions
        y = traj.response_ids.tolist()
        before = _hf_logprobs(old, prompt + y[:m], len(prompt))
        with torch.no_grad():
            past = old(torch.tensor([prompt + y[:m - 1]]), use_cache=True).past_key_values
            logits = new(torch.tensor([y[m - 1:len(y) - 1]]), past_key_values=past, use_cache=True).logits[0]
        after = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(y[m:]).unsqueeze(-1)).squeeze(-1).tolist()
        assert max(abs(a - b) for a, b in zip(traj.logprobs, before + after)) < 1e-4
        stale = _hf_logprobs(old, prompt + y, len(prompt))[m:]  # what a missed update would have produced
        # ... differs from them by several times the tolerance above, so that match tells the weights apart
        # (the gap depends on the tokens sampled, which depend on the CPU's kernels: 8.4e-4 on some machines)
        assert max(abs(a - b) for a, b in zip(traj.logprobs[m:], stale)) > 5e-4
    for traj in groups[1].trajectories:  # started after the update: θ_1 only, no θ_0 prefix reused
        assert set(traj.versions.tolist()) == {1}
        fresh = _hf_logprobs(new, prompt + traj.response_ids.tolist(), len(prompt))
        assert max(abs(a - b) for a, b in zip(traj.logprobs, fresh)) < 1e-4


def test_a_prefix_score_pending_when_an_update_lands_is_redone_under_the_new_weights(llm, weights, tiny_model_path):
    """Guards against: a PFS request submitted under θ_v, still queued when θ_{v+1} is loaded, being
    computed (at least in part) by θ_{v+1} yet recorded as θ_v's score. The PFS must be labelled
    with the weights that computed it, and equal the distance under them (θ_2 here)."""
    import time

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
    cfg.pool.name, cfg.pace.prefix_tokens, cfg.pace.target_pool, cfg.pace.ema = "pace", 8, 0, 0.0
    cfg.data.batch_prompts, cfg.data.group_size, cfg.rollout.max_inflight_groups = 1, 4, 2
    pool = Pool(build_policy(cfg), informative=lambda g: True)
    sampler = PromptSampler(make_prompts(ArithmeticSpec(levels=[2]), "train"), seed=1)
    new, moved = _moved(tiny_model_path, seed=4)
    with Grader(workers=1) as grader:
        worker = RolloutWorker(EngineFleet([llm]), llm.get_tokenizer(), sampler, pool, grader=grader, cfg=cfg)
        worker._admit()
        worker.set_trainer_version(1)  # K_gen = 1 > 0 at completion: the groups are rescored
        while llm.llm_engine.has_unfinished_requests():
            worker._consume(worker.fleet.step())
        worker.post_weights(1, weights)  # θ_1 (θ_0's values): prefixes of θ_0 tokens need a request
        assert worker._apply_update()
        deadline = time.time() + 30
        while pool.occupancy < 2 and time.time() < deadline:
            worker._collect_grades()  # the arrivals submit scoring requests under θ_1 ...
            time.sleep(0.05)
        assert pool.occupancy == 2 and worker._rescoring
        worker.set_trainer_version(2)
        worker.post_weights(2, moved)  # ... and θ_2 lands before the engine has run them
        assert worker._apply_update()
        while llm.llm_engine.has_unfinished_requests():
            worker._consume(worker.fleet.step())
        groups = pool.remaining()
    load_weights(llm, weights)
    for g in groups:
        assert g.pfs_version == 2, g.pfs_version
        m = cfg.pace.prefix_tokens
        per_response = []
        for t in g.trajectories:
            current = _hf_logprobs(new, g.prompt_ids + t.response_ids[:m].tolist(), len(g.prompt_ids))
            per_response.append(sum(abs(a - b) for a, b in zip(current, t.logprobs[:m])) / len(current))
        assert g.pfs == pytest.approx(sum(per_response) / len(per_response), abs=1e-4)


def test_groups_in_flight_are_kept_at_a_stop_and_continued_token_for_token(llm, weights, tiny_model_path):
    """A stop with groups in flight (the rollout stepped by hand, then stopped as its thread stops:
    versions settled, requests aborted); the checkpoint's pool and rollout state pickled together;
    a fresh worker on θ_1 continues them. Every kept token keeps its id, ℓ^μ and version; the
    continuation carries version 1; the kept prefix is context, not re-sampled (the engine's
    log-probs of the whole response, rescored, equal the recorded ones: same weights at v0 and v1);
    the groups finish into the pool with their fates adding up."""
    import pickle

    from omegaconf import OmegaConf

    from pace.config import Config
    from pace.grading import Grader
    from pace.pool import Pool, build_policy
    from pace.rollout.engine import rescore
    from pace.rollout.fleet import EngineFleet
    from pace.rollout.worker import RolloutWorker
    from pace.tasks.arithmetic import ArithmeticSpec, make_prompts
    from pace.tasks.base import PromptSampler

    cfg = OmegaConf.structured(Config)
    cfg.data.batch_prompts, cfg.data.group_size, cfg.rollout.max_inflight_groups = 2, 4, 3
    cfg.rollout.max_tokens = 64
    grader = Grader(workers=1)

    def worker_with(pool):
        sampler = PromptSampler(make_prompts(ArithmeticSpec(levels=[4]), "train"), seed=0)
        return RolloutWorker(EngineFleet([llm]), llm.get_tokenizer(), sampler, pool, grader=grader, cfg=cfg)

    pool = Pool(build_policy(cfg), informative=lambda g: True)
    first = worker_with(pool)
    first._admit()
    for _ in range(6):
        first._consume(first.fleet.step())
    # vLLM's labels of the tokens read so far (what a stop keeps) equal the in-process stamps
    labelled = [(first.fleet.partial_versions(p.request_id(i), len(t)), t.versions)
                for p in first._pending.values() for i, t in p.responses.items() if t.completed_at < 0]
    assert labelled and all(v is not None and v.tolist() == s.tolist() == [0] * 6 for v, s in labelled)
    first._abort_all()  # what the thread does when it stops
    assert not llm.llm_engine.has_unfinished_requests()
    rollout = first.state_dict()
    kept = rollout["inflight"]
    assert len(kept) == 3 and pool.inflight == 3
    blob = pickle.dumps({"pool": pool.state_dict(keep={getattr(p, "group", p).id for p in kept}), "rollout": rollout})
    before = {(p.group.id, i): (t.response_ids.copy(), t.logprobs.copy(), t.versions.copy(), t.completed_at)
              for p in kept if hasattr(p, "group") for i, t in p.responses.items()}  # (a Group: complete, grading)
    partial = [k for k, v in before.items() if v[3] < 0]
    assert partial and all(len(before[k][0]) == 6 for k in partial), "6 engine steps: 6 tokens a response"

    state = pickle.loads(blob)
    pool2 = Pool(build_policy(cfg), informative=lambda g: True)
    assert pool2.load_state_dict(state["pool"]) == [] and pool2.inflight == 3
    second = worker_with(pool2)
    second.load_state_dict(state["rollout"])
    second.load_inflight(state["rollout"]["inflight"], version=1)
    second.set_trainer_version(1)
    assert not second._continue_resumed()  # not before the engine holds θ_1
    second.post_weights(1, weights)
    assert second._apply_update() and second._continue_resumed()
    assert second.stats["resumed_groups"] == 3 and second.stats["resumed_tokens"] == 6 * len(partial)
    while pool2.counts()["pooled"] + pool2.counts()["filtered"] < 3:
        if llm.llm_engine.has_unfinished_requests():
            second._consume(second.fleet.step())
        second._collect_grades()
    pool2.check_accounting()
    groups = {g.id: g for g in pool2.remaining() + pool2.drain_decided()}
    for (gid, i), (ids, lps, vs, done) in before.items():
        t = groups[gid].trajectories[i]
        n = len(ids)
        assert t.response_ids[:n].tolist() == ids.tolist() and t.logprobs[:n].tolist() == lps.tolist()
        assert t.versions[:n].tolist() == vs.tolist() == [0] * n
        if done >= 0:  # finished before the stop: untouched
            assert len(t) == n and t.completed_at == done and t.resumed == 0
        else:
            assert t.resumed == n and t.completed_at == 1 and t.versions[n:].tolist() == [1] * (len(t) - n)
            prompt = groups[gid].prompt_ids
            assert rescore(llm, [(prompt + t.response_ids.tolist(), len(prompt))])[0] == pytest.approx(
                t.logprobs.tolist(), abs=1e-4)
    grader.close()


@pytest.mark.parametrize("kv_on_update", ["keep", "recompute"])
def test_tokens_after_an_update_attend_to_the_old_or_the_recomputed_cache(llm, weights, tiny_model_path, kv_on_update):
    """Responses in flight when very different weights θ_1 load. keep: their tokens after the update
    attend to the prompt's and earlier tokens' KV of θ_0, so their ℓ^μ are not a fresh prefill's under
    θ_1, and K_kv counts the gap exactly (each θ_1 token's context is from θ_0: K_kv − K_gen = its
    share of the group's tokens). recompute: the engine drops their KV at the update and prefills
    prompt + tokens so far again under θ_1: their ℓ^μ are the fresh prefill's to the float floor,
    K_kv = K_gen, and the prefilled tokens are counted (`reprefill_tokens`)."""
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
    cfg.rollout.max_tokens, cfg.rollout.kv_on_update = 48, kv_on_update
    pool = Pool(build_policy(cfg), informative=lambda g: True)
    sampler = PromptSampler(make_prompts(ArithmeticSpec(levels=[4]), "train"), seed=2)
    new, moved = _moved(tiny_model_path, seed=5, scale=0.2)  # far from θ_0: a stale context shows
    try:
        with Grader(workers=1) as grader:
            worker = RolloutWorker(EngineFleet([llm]), llm.get_tokenizer(), sampler, pool, grader, cfg)
            worker._admit()
            for _ in range(6):
                worker._consume(worker.fleet.step())
            in_flight = [(p.group.prompt_ids, t) for p in worker._pending.values() for t in p.responses.values()
                         if t.completed_at < 0]
            worker.set_trainer_version(1)
            worker.post_weights(1, moved)
            assert worker._apply_update()
            while llm.llm_engine.has_unfinished_requests():
                worker._consume(worker.fleet.step())
            groups = [g for g, _ in worker._grading] + [p.group for p in worker._pending.values()]
            for p in worker._pending.values():  # graded or not: every response is done
                p.group.trajectories = [p.responses[i] for i in sorted(p.responses)]
    finally:
        load_weights(llm, weights)
    assert in_flight and all(len(t) > 0 for _, t in in_flight)
    expected_reprefill = sum(len(p) + n for p, n in ((p, 6) for p, _ in in_flight))  # 6 steps: 6 tokens each
    assert worker.stats["reprefill_tokens"] == (expected_reprefill if kv_on_update == "recompute" else 0)
    spanning = 0
    for g in groups:
        assert g.kv_reprefill == (kv_on_update == "recompute")
        after = sum(int((t.versions == 1).sum()) for t in g.trajectories)
        n = sum(len(t) for t in g.trajectories)
        gap = g.k_kv() - g.k_gen()
        for t in g.trajectories:
            if t.versions[0] == 1:
                continue  # started after the update: nothing stale
            m = int((t.versions == 0).sum())
            if m == len(t):
                continue  # finished before the update
            spanning += 1
            fresh = _hf_logprobs(new, g.prompt_ids + t.response_ids.tolist(), len(g.prompt_ids))[m:]
            err = max(abs(a - b) for a, b in zip(t.logprobs[m:], fresh))
            if kv_on_update == "keep":
                assert err > 1e-2, err  # attended to θ_0's KV
            else:
                assert err < 1e-4, err  # prefilled again under θ_1
        if kv_on_update == "keep":  # every θ_1 token of a response begun under θ_0 has a θ_0 context
            stale = sum(int((t.versions == 1).sum()) for t in g.trajectories if t.versions[0] == 0)
            assert gap == pytest.approx(stale / n, abs=1e-12) and after >= stale
        else:
            assert gap == pytest.approx(0.0, abs=1e-12)
    assert spanning > 0, "no response spanned the update"


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

        def admit_then_update(inflight: int, version: int) -> None:
            """More groups in flight, four engine steps, then θ_version (θ_0's values) loads."""
            pool.policy.max_inflight_groups = inflight
            assert worker._admit()
            for _ in range(4):
                worker._consume(worker.fleet.step())
            worker.post_weights(version, weights)
            assert worker._apply_update()

        # a probe pending when θ_2 lands is aborted before the new weights load
        admit_then_update(4, 2)
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
        admit_then_update(6, 4)
        drain()
        floor = worker.metrics()
        assert floor["mismatch/kv_tokens"] > 0 and floor["mismatch/kv_abs_logp_diff"] < 1e-4, floor
    load_weights(llm, weights)  # leave the shared engine as it was
