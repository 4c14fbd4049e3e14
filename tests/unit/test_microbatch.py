"""Micro-batch planning (pace/algo/microbatch.py): every trajectory once, the same number of
micro-batches on every rank, the token budget kept, work balanced across ranks."""
from __future__ import annotations

import random

import pytest

from pace.algo import microbatch

pytestmark = pytest.mark.unit


def _check(plan, lengths, n_ranks):
    assert len(plan) == n_ranks
    seen = sorted(i for mbs in plan for mb in mbs for i in mb)
    assert seen == list(range(len(lengths)))  # each trajectory exactly once
    assert len({len(mbs) for mbs in plan}) == 1  # same number of micro-batches on every rank (FSDP collectives)
    assert all(any(mb for mb in mbs) for mbs in plan)  # every rank has work


def test_by_count_is_the_strided_share_cut_in_consecutive_micro_batches():
    plan = microbatch.plan([5] * 7, 2, max_seqs=2)
    assert plan == [[[0, 2], [4, 6]], [[1, 3], [5]]]
    plan = microbatch.plan([5] * 5, 2, max_seqs=2)  # rank 0: 3 → 2 micro-batches, rank 1: 2 → 1, split to 2
    assert plan == [[[0, 2], [4]], [[1], [3]]]
    assert microbatch.plan([5] * 3, 1, max_seqs=64) == [[[0, 1, 2]]]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("n_ranks", [1, 2, 4])
def test_token_budget_is_kept_balanced_and_complete(packed, n_ranks):
    rng = random.Random(0)
    for trial in range(50):
        lengths = [int(rng.lognormvariate(5, 1)) + 1 for _ in range(rng.randint(n_ranks, 64))]
        budget = rng.choice([256, 1024, 4096])
        plan = microbatch.plan(lengths, n_ranks, max_seqs=1, max_tokens=budget, packed=packed)
        _check(plan, lengths, n_ranks)
        for mbs in plan:
            for mb in mbs:
                if len(mb) > 1:  # a sequence over the budget goes alone
                    assert microbatch.cost([lengths[i] for i in mb], packed) <= budget
        loads = [sum(lengths[i] for mb in mbs for i in mb) for mbs in plan]
        assert max(loads) - min(loads) <= max(lengths)  # greedy longest-first: within one sequence


def test_padded_micro_batches_group_similar_lengths():
    lengths = [100, 10, 98, 12, 97, 11, 99, 9]
    plan = microbatch.plan(lengths, 1, max_seqs=1, max_tokens=400, packed=False)
    assert plan == [[[0, 6, 2, 4], [3, 5, 1, 7]]]  # the four long ones together, then the short ones
    pad = sum(len(mb) * max(lengths[i] for i in mb) - sum(lengths[i] for i in mb) for mb in plan[0])
    assert pad == 6 + 6  # vs ~4 × 88 if short and long were mixed


def test_a_rank_with_fewer_trajectories_than_micro_batches_gets_empty_ones():
    # one 900-token response vs eight of 100: rank 0 holds the long one alone; rank 1 needs 2 micro-batches
    lengths = [900] + [100] * 8
    plan = microbatch.plan(lengths, 2, max_seqs=1, max_tokens=400, packed=True)
    _check(plan, lengths, 2)
    assert plan[0] == [[0], []] and [len(mb) for mb in plan[1]] == [4, 4]


def test_a_bad_budget_names_the_key():
    with pytest.raises(ValueError, match="trainer.max_tokens_per_micro_batch"):
        microbatch.plan([3], 1, max_seqs=1, max_tokens=0)
