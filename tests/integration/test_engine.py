"""The real vLLM CPU engine on the tiny model: rescoring, in-place weight updates, per-token versions."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    from pace.config import RolloutConfig
    from pace.rollout import engine as engine_lib

    llm = engine_lib.build_engine(tiny_model_path, RolloutConfig(), "float32", seed=0)
    yield llm
    engine_lib.shutdown(llm)


@pytest.fixture(scope="module")
def weights(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    return [(n, p.detach().clone()) for n, p in model.state_dict().items()]


def _generate(llm, prompt_ids, n=4, max_tokens=24):
    """Drive the engine directly and collect sampled tokens with their log-probs."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, logprobs=0, detokenize=False, seed=1234)
    for i in range(n):
        llm.llm_engine.add_request(f"gen-{i}", {"prompt_token_ids": prompt_ids}, params)
    out = {}
    while llm.llm_engine.has_unfinished_requests():
        for o in llm.llm_engine.step():
            if o.finished:
                c = o.outputs[0]
                out[o.request_id] = (list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
    return [out[f"gen-{i}"] for i in range(n)]


def _prompt(llm, text="12+34+5=?\n"):
    return llm.get_tokenizer()(text, add_special_tokens=False).input_ids


def test_rescoring_matches_generation_logprobs(llm):
    prompt = _prompt(llm)
    from pace.rollout.engine import rescore

    for ids, logprobs in _generate(llm, prompt):
        rescored = rescore(llm, [(prompt + ids, len(prompt))])[0]
        assert len(rescored) == len(ids)
        assert rescored == pytest.approx(logprobs, abs=1e-4)


def test_weight_update_changes_logprobs_and_restores(llm, weights):
    from pace.rollout.engine import load_weights, rescore

    prompt = _prompt(llm)
    seq = [(prompt + _generate(llm, prompt, n=1)[0][0], len(prompt))]
    before = rescore(llm, seq)[0]
    gen = torch.Generator().manual_seed(0)
    noisy = [(n, t + 0.05 * torch.randn(t.shape, generator=gen)) for n, t in weights]
    load_weights(llm, noisy)
    changed = rescore(llm, seq)[0]
    assert max(abs(a - b) for a, b in zip(before, changed)) > 1e-2
    load_weights(llm, weights)
    assert rescore(llm, seq)[0] == pytest.approx(before, abs=1e-5)


def test_rollout_records_versions_across_an_update(llm, weights, tiny_model_path):
    """Step the worker by hand (no thread): an update lands mid-generation, tokens after it carry v=1."""
    from omegaconf import OmegaConf

    from pace.config import Config
    from pace.pool import Pool, build_policy
    from pace.grading import Grader
    from pace.rollout.worker import RolloutWorker
    from pace.tasks.arithmetic import ArithmeticSpec, make_prompts
    from pace.tasks.base import PromptSampler

    cfg = OmegaConf.structured(Config)
    cfg.data.batch_prompts, cfg.data.group_size, cfg.rollout.max_inflight_groups = 2, 4, 2
    cfg.rollout.max_tokens = 64
    pool = Pool(build_policy(cfg), informative=lambda g: True)
    sampler = PromptSampler(make_prompts(ArithmeticSpec(levels=[4]), "train"), seed=0)
    grader = Grader(workers=1)
    worker = RolloutWorker(llm, llm.get_tokenizer(), sampler, pool, grader=grader, cfg=cfg)
    worker._admit()
    assert pool.inflight == 2
    for _ in range(5):
        worker._consume(llm.llm_engine.step())
    worker.set_trainer_version(1)
    worker.post_weights(1, weights)  # same values, new version: the switch is what is recorded
    assert worker._apply_update() and worker.engine_version == 1
    while llm.llm_engine.has_unfinished_requests():
        worker._consume(llm.llm_engine.step())
    trajs = [t for p in worker._pending.values() for t in p.responses.values()]
    groups_done = len(worker._grading)
    trajs += [t for g, _ in worker._grading for t in g.trajectories]
    assert trajs and groups_done + len(worker._pending) == 2
    for t in trajs:
        assert len(t.versions) == len(t.response_ids) == len(t.logprobs)
        assert t.versions == sorted(t.versions)  # versions never go back within a response
        assert t.completed_at == 1
    spanning = [t for t in trajs if t.versions[0] == 0 and t.versions[-1] == 1]
    assert spanning, "every response ended within 5 engine steps: no update landed mid-generation"
    for t in spanning:
        assert t.versions[:5] == [0] * 5 and t.versions[5:] == [1] * (len(t) - 5)
    grader.close()


def test_prefix_forgetting_score_is_zero_under_the_generating_weights(llm, weights):
    """PACE rescoring on the rollout thread's loop (stepped by hand): groups with K_gen > 0 are scored
    as they enter the pool and again after each update; PFS ≈ 0 under the weights that generated the
    prefix (at arrival, and after an update to equal values), clearly > 0 after the weights move."""
    import time

    from omegaconf import OmegaConf

    from pace.config import Config
    from pace.pool import Pool, build_policy
    from pace.grading import Grader
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
        worker = RolloutWorker(llm, llm.get_tokenizer(), sampler, pool, grader=grader, cfg=cfg)
        worker._admit()
        worker.set_trainer_version(1)  # completes at c = 1 with tokens from v = 0: K_gen = 1 > 0

        def drain():
            while llm.llm_engine.has_unfinished_requests():
                worker._consume(llm.llm_engine.step())

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
