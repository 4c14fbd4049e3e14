"""The real vLLM CPU engine on the tiny model: rescoring, in-place weight updates, the engine's
log-probs against the trainer's after a sync (the rollout worker driving it: test_engine_rollout.py),
and validation prompts sent as token ids."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import _moved, _prompt, sampled_vs_trainer

pytestmark = pytest.mark.integration


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


# ---------------------------------------------------------------- weights that really reach the engine

@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_and_trainer_logprobs_agree_after_a_weight_sync(llm, weights, tiny_model_path, temperature):
    """Guards against: weights that do not all reach the engine. After a load of the state dict of
    weights far from the engine's, the engine's ℓ^μ of the tokens it samples equals the trainer's
    log π_θ (its `token_logprobs` at the rollout temperature) to < 1e-4 per token."""
    from pace.rollout.engine import load_weights

    model, moved = _moved(tiny_model_path, seed=2)
    load_weights(llm, moved)
    try:
        worst, responses, tokens = sampled_vs_trainer(llm, model, temperature, seed=7)
    finally:
        load_weights(llm, weights)  # leave the shared engine as it was, pass or fail
    assert responses == 4
    print(f"T={temperature}: max |ℓ^μ − log π_θ| = {worst:.2e} over {tokens} tokens")
    # float32 on both sides: 2.0e-5 (T = 1) and 3.2e-5 (T = 0.7) here, the same before and after the
    # tied-head fix: this path loads the state dict, which names `lm_head.weight` and so reloads the
    # head (the stale head of every real sync is test_weight_sync.py's). The bound was 1e-3 for a
    # while, after one build of the tiny model on another machine gave 1.7e-4 at T = 0.7, which was
    # not explained; 1e-4 is what float32 gives, with 3× to spare, and what a dropped tensor exceeds.
    # Builds of the tiny model differ (its SFT is not bit-reproducible across processes), and the value
    # is a property of the build: 2.2e-5 / 1.5e-5 (T = 1 / 0.7) on one, 7.9e-5 / 1.7e-4 on another, each
    # the same on every run of it; so the bound is 5e-4, still far below a dropped tensor's nats.
    assert worst < 5e-4


def test_validation_token_ids_are_the_engine_s_own_tokenization(llm, tiny_model_path):
    """In-training validation sends its prompts as token ids (pace/evaluation.py `EvalRun` with a
    tokenizer): they are the ids this engine makes of the same text, and the request, asking for routed
    experts from the end of its prompt, is accepted."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from pace.config import Config
    from pace.evaluation import EvalRun, sampling_params, sets_from_config
    from pace.tasks.base import Prompt

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    cfg = OmegaConf.structured(Config)
    cfg.eval.max_tokens = 2
    sets, _ = sets_from_config(cfg, tokenizer)
    sets = {name: prompts[:3] for name, prompts in sets.items()}
    sets["special"] = [Prompt("s0", f"{tokenizer.eos_token}1+1=", "2")]  # a special token written in the text
    params = sampling_params(cfg, tokenizer, seeded=False, k=2)
    engine = llm.llm_engine
    for prefix, tok in (("text", None), ("ids", tokenizer)):  # the engine tokenizes the text; the run, the ids
        EvalRun(sets, params, None, prefix=prefix, tokenizer=tok).submit(engine, salt="s")
    prompts, samples = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                prompts[out.request_id], samples[out.request_id] = out.prompt_token_ids, len(out.outputs)
    ids = {rid.removeprefix("ids"): p for rid, p in prompts.items() if rid.startswith("ids")}
    text = {rid.removeprefix("text"): p for rid, p in prompts.items() if rid.startswith("text")}
    assert len(ids) == sum(len(ps) for ps in sets.values()) and ids == text
    assert set(samples.values()) == {2}
