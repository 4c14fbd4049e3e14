"""ℓ^μ and the prompt's log-probs as the rollout reads them from vLLM's two containers: `FlatLogprobs`
(the rollout's requests ask for it: flat lists, read without a dict a token) and a list of
{token: Logprob} per position; both give the same values, and a flat container that is not one
entry a position is read entry by entry."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.unit


def _flat(entries):
    """vLLM's FlatLogprobs of positions given as lists of (token, log-prob), the first entry sampled."""
    from vllm.logprobs import FlatLogprobs

    flat = FlatLogprobs()
    for pos in entries:
        flat.append(None if pos is None else {t: _lp(v) for t, v in pos})
    return flat


def _lp(v):
    from vllm.logprobs import Logprob

    return Logprob(logprob=v, rank=1, decoded_token=None)


def test_sampled_logprobs_flat_and_dicts_agree():
    from pace.rollout.engine import sampled_logprobs

    ids = [11, 4, 9]
    flat = SimpleNamespace(token_ids=ids, logprobs=_flat([[(11, -0.5)], [(4, -1.5)], [(9, -0.25)]]))
    dicts = SimpleNamespace(token_ids=ids, logprobs=[{11: _lp(-0.5)}, {4: _lp(-1.5)}, {9: _lp(-0.25)}])
    assert sampled_logprobs(flat) == sampled_logprobs(dicts) == [-0.5, -1.5, -0.25]
    assert sampled_logprobs(flat) is flat.logprobs.logprobs  # the flat list itself
    # two entries a position (logprobs=1: a top-1 candidate beside the sampled token): read per position
    two = SimpleNamespace(token_ids=[11, 4], logprobs=_flat([[(3, -0.1), (11, -0.5)], [(4, -1.5), (8, -2.0)]]))
    assert sampled_logprobs(two) == [-0.5, -1.5]


def test_prompt_token_logprobs_flat_and_dicts_agree():
    from pace.rollout.engine import prompt_token_logprobs

    ids = [7, 11, 4, 9]
    positions = [None, [(11, -0.5)], [(4, -1.5)], [(9, -0.25)]]  # the first prompt token has none
    flat = SimpleNamespace(prompt_logprobs=_flat(positions))
    dicts = SimpleNamespace(prompt_logprobs=[None if p is None else {t: _lp(v) for t, v in p} for p in positions])
    assert prompt_token_logprobs(flat, ids, 2) == prompt_token_logprobs(dicts, ids, 2) == [-1.5, -0.25]
    assert prompt_token_logprobs(flat, ids, 1) == [-0.5, -1.5, -0.25]
