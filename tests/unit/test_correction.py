"""Importance-sampling corrections and mismatch metrics (pace/algo/correction.py) against hand values.

Two sequences, ρ = [3, 0.5, 1.5 | 2, 0.25] (sequence products 2.25 and 0.5; geometric means
2.25^(1/3) ≈ 1.310 and 0.5^(1/2) ≈ 0.707).
"""
from __future__ import annotations

import math

import pytest
import torch

from pace.algo.correction import correct, mismatch

pytestmark = pytest.mark.unit

F64 = torch.float64
RHO = [3.0, 0.5, 1.5, 2.0, 0.25]
SEQ = torch.tensor([0, 0, 0, 1, 1])
ONES = torch.ones(5, dtype=F64)


def run(kind, level="token", upper=None, lower=None, mask=ONES, rho=RHO):
    return correct(torch.tensor([math.log(r) for r in rho], dtype=F64), mask, SEQ, 2, kind, level, upper, lower)


def test_none_is_the_raw_ratio() -> None:
    c = run("none")
    assert c.weight.tolist() == pytest.approx(RHO, abs=1e-12) and c.keep.tolist() == [1.0] * 5
    assert c.masked.item() == 0 and c.truncated.item() == 0


def test_tis_token_truncates_each_ratio() -> None:
    c = run("tis", "token", 2.0)
    assert c.weight.tolist() == pytest.approx([2.0, 0.5, 1.5, 2.0, 0.25], abs=1e-12)
    assert c.truncated.item() == 1  # only ρ = 3 exceeds C (ρ = 2 is at it)
    assert c.keep.tolist() == [1.0] * 5


def test_tis_sequence_truncates_the_product_for_every_token() -> None:
    c = run("tis", "sequence", 2.0)
    assert c.weight.tolist() == pytest.approx([2.0, 2.0, 2.0, 0.5, 0.5], abs=1e-12)  # min(2.25, 2), min(0.5, 2)
    assert c.truncated.item() == 3


def test_mis_token_masks_outside_the_band_and_keeps_the_ratio() -> None:
    c = run("mis", "token", 2.0)  # band [1/2, 2], bounds included
    assert c.keep.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]
    assert c.weight.tolist() == pytest.approx([0.0, 0.5, 1.5, 2.0, 0.0], abs=1e-12)
    assert c.masked.item() == 2
    assert run("mis", "token", 2.0, lower=0.2).keep.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]


def test_mis_sequence_and_geometric() -> None:
    assert run("mis", "sequence", 2.0).keep.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]  # 2.25 out, 0.5 in
    assert run("mis", "geometric", 1.2).keep.tolist() == [0.0] * 5  # 1.310 > 1.2; 0.707 < 1/1.2
    assert run("mis", "geometric", 1.4).keep.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]  # 0.707 < 1/1.4 = 0.714
    assert run("mis", "geometric", 1.42).keep.tolist() == [1.0] * 5  # 1/1.42 = 0.704


def test_masked_positions_count_in_no_product_and_no_mean() -> None:
    # token 1 (ρ = 0.5) is a tool-output token: sequence 0's product is 3 · 1.5 = 4.5, its geometric
    # mean over its 2 actions √4.5 ≈ 2.121; it is never kept nor weighted.
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0], dtype=F64)
    c = run("tis", "sequence", 10.0, mask=mask)
    assert c.weight.tolist() == pytest.approx([4.5, 0.0, 4.5, 0.5, 0.5], abs=1e-12)
    assert run("mis", "geometric", 2.1, mask=mask).keep.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert run("mis", "geometric", 2.2, mask=mask).keep.tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]


def test_weights_are_detached_and_bad_arguments_refused() -> None:
    log_rho = torch.zeros(5, dtype=F64, requires_grad=True)
    assert not correct(log_rho, ONES, SEQ, 2, "tis", "token", 2.0).weight.requires_grad
    with pytest.raises(ValueError):
        correct(log_rho, ONES, SEQ, 2, "tis", "geometric", 2.0)
    with pytest.raises(ValueError):
        correct(log_rho, ONES, SEQ, 2, "mis", "token", None)


def test_on_policy_tokens_are_those_of_responses_wholly_under_the_trainers_weights() -> None:
    from pace.algo.correction import on_policy_tokens

    # three responses at trainer version 3: [3, 3] wholly on-policy; [2, 3, 3] begun under θ_2 (its
    # θ_3 tokens have a θ_2 context: left out); [3, 3] with its second token masked (a tool output)
    versions = torch.tensor([3, 3, 2, 3, 3, 3, 3])
    first = torch.tensor([3, 3, 2, 2, 2, 3, 3])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    assert on_policy_tokens(versions, first, 3, mask).tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]


def test_mismatch_sums_on_policy_tokens_only() -> None:
    # d = log π − log μ = [0.1, 0, 5]; token 2 is stale (not on-policy): left out.
    logp, lb = torch.tensor([-1.0, -2.0, 0.0]), torch.tensor([-1.1, -2.0, -5.0])
    m = mismatch(logp, lb, torch.tensor([1.0, 1.0, 0.0]))
    assert m["tokens"] == 2
    assert m["abs_logp_diff"] == pytest.approx(0.1, abs=1e-6)
    assert m["k3_kl"] == pytest.approx(math.exp(0.1) - 1 - 0.1, abs=1e-7)  # ρ − 1 − log ρ
    assert mismatch(lb, lb, torch.ones(3))["k3_kl"] == 0.0
