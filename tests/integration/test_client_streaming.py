"""The rollout client's cheaper stream on the real vLLM CPU engine (docs/benchmarks.md "The rollout
client's cost"): flat log-probs and chunked outputs (`rollout.stream_interval`) carry exactly the
tokens and ℓ^μ of one dict-per-token output a token, and the worker records vLLM's versions across an
update and at a stop when its stamps are no longer exact."""
from __future__ import annotations

import pytest

from tests.helpers import _prompt

pytestmark = pytest.mark.integration


def _stream(llm, prompt, **kw) -> list:
    """One seeded request's outputs, as (token ids, ℓ^μ, the log-probs container)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from pace.rollout.engine import sampled_logprobs

    params = SamplingParams(max_tokens=24, temperature=1.0, logprobs=0, detokenize=False, seed=7,
                            output_kind=RequestOutputKind.DELTA, **kw)
    llm.llm_engine.add_request("stream-0", {"prompt_token_ids": prompt}, params)
    outs = []
    while llm.llm_engine.has_unfinished_requests():
        for o in llm.llm_engine.step():
            outs += [(list(c.token_ids), sampled_logprobs(c), c.logprobs) for c in o.outputs]
    return outs


def test_flat_chunked_outputs_carry_the_tokens_and_logprobs_of_one_token_outputs(llm):
    from vllm.logprobs import FlatLogprobs

    prompt = _prompt(llm)
    one = _stream(llm, prompt)
    four = _stream(llm, prompt, flat_logprobs=True, stream_interval=4)
    assert [len(ids) for ids, _, _ in one] == [1] * 24
    assert [len(ids) for ids, _, _ in four] == [1, 4, 4, 4, 4, 4, 3]  # the first token at once, then every 4, the rest at the end
    assert [t for ids, _, _ in four for t in ids] == [t for ids, _, _ in one for t in ids]
    assert [x for _, lps, _ in four for x in lps] == [x for _, lps, _ in one for x in lps]  # exactly: the same floats
    for _, lps, container in four:  # read from vLLM's flat list as it is: no dict and Logprob a token
        assert isinstance(container, FlatLogprobs) and lps is container.logprobs


def test_chunked_rollout_records_vllm_versions_across_an_update_and_at_a_stop(llm, weights):
    """stream_interval=4 in process: tokens reach the worker up to 3 steps late, so its stamps are not
    checked; finished responses take vLLM's spans, and at a stop the delivered tokens take the output
    processor's versions although it holds more."""
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
    cfg.rollout.max_tokens, cfg.rollout.stream_interval = 64, 4
    pool = Pool(build_policy(cfg), informative=lambda g: True)
    grader = Grader(workers=1)
    worker = RolloutWorker(EngineFleet([llm]), llm.get_tokenizer(), PromptSampler(make_prompts(ArithmeticSpec(levels=[4]), "train"), seed=0),
                           pool, grader=grader, cfg=cfg)
    try:
        assert worker.fleet.in_process and not worker.stamps_exact
        worker._admit()
        for _ in range(7):
            worker._consume(worker.fleet.step())
        running = [(p.request_id(i), t) for p in worker._pending.values() for i, t in p.responses.items() if t.completed_at < 0]
        held = {rid: worker.fleet._request_state(rid).detokenizer.num_output_tokens() for rid, _ in running}
        behind = [(rid, t) for rid, t in running if held[rid] > len(t)]
        assert behind, "no request held tokens the worker had not been given: nothing chunked"
        for rid, t in behind:  # the delivered tokens' versions, from a processor that holds more
            assert worker.fleet.partial_versions(rid, len(t)).tolist() == [0] * len(t)
        worker.set_trainer_version(1)
        worker.post_weights(1, weights)
        assert worker._apply_update() and worker.engine_version == 1
        while llm.llm_engine.has_unfinished_requests():
            worker._consume(worker.fleet.step())
        trajs = [t for g, _ in worker._grading for t in g.trajectories]
        assert trajs and worker.stats["versions_checked"] == 0
        # generated 7 steps under θ_0, then under θ_1: vLLM's spans, not the stamps of tokens delivered late
        spanning = [t for t in trajs if t.versions[0] == 0 and t.versions[-1] == 1]
        assert spanning
        for t in spanning:
            assert t.versions.tolist() == [0] * 7 + [1] * (len(t) - 7)
    finally:
        grader.close()
