"""Tests for pace.algo.advantages: overlong shaping, group-normalised advantages, dynamic sampling."""
from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pace.algo.advantages import correctness_reward, group_advantages, is_informative, overlong_penalty

pytestmark = pytest.mark.unit

# ---------------------------------------------------------------- overlong_penalty

# L_max = 20, L_cache = 4: the buffer starts after L_max − L_cache = 16 tokens.
#   |y| ≤ 16 → 0;  17 → (16 − 17)/4 = −0.25;  18 → −0.5;  19 → −0.75;  20 → −1;  > 20 → −1


@pytest.mark.parametrize(
    "length, expected",
    [(0, 0.0), (1, 0.0), (15, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (19, -0.75), (20, -1.0), (21, -1.0), (500, -1.0)],
)
def test_overlong_penalty_boundaries(length: int, expected: float) -> None:
    assert overlong_penalty(length, max_tokens=20, buffer=4) == pytest.approx(expected, abs=1e-12)


def test_overlong_penalty_dapo_recipe_values() -> None:
    # DAPO recipe: L_max = 20480, L_cache = 4096 → buffer starts at 16384.
    assert overlong_penalty(16384, 20480, 4096) == 0.0
    assert overlong_penalty(16385, 20480, 4096) == pytest.approx(-1 / 4096, abs=1e-15)
    assert overlong_penalty(18432, 20480, 4096) == pytest.approx(-0.5, abs=1e-15)
    assert overlong_penalty(20480, 20480, 4096) == pytest.approx(-1.0, abs=1e-15)
    assert overlong_penalty(20481, 20480, 4096) == -1.0


@pytest.mark.parametrize("buffer", [0, -3])
def test_overlong_penalty_without_buffer_is_a_hard_cutoff(buffer: int) -> None:
    assert overlong_penalty(0, 20, buffer) == 0.0
    assert overlong_penalty(20, 20, buffer) == 0.0  # exactly L_max is allowed
    assert overlong_penalty(21, 20, buffer) == -1.0


@settings(deadline=None)
@given(st.integers(1, 4096), st.integers(1, 4096), st.integers(0, 10_000))
def test_overlong_penalty_in_range_and_monotone(max_tokens: int, buffer: int, length: int) -> None:
    assume(buffer < max_tokens)
    p = overlong_penalty(length, max_tokens, buffer)
    assert -1.0 <= p <= 0.0
    assert overlong_penalty(length + 1, max_tokens, buffer) <= p  # longer never earns more


# ---------------------------------------------------------------- rewards and advantages


def test_correctness_reward() -> None:
    assert correctness_reward(True) == 1.0
    assert correctness_reward(False) == -1.0


def test_group_advantages_hand_values() -> None:
    # [1, −1, −1, 1]: mean 0, population std 1 → ±1/(1 + eps).
    eps = 1e-6
    assert group_advantages([1, -1, -1, 1], eps=eps, unbiased=False) == pytest.approx(
        [1 / (1 + eps), -1 / (1 + eps), -1 / (1 + eps), 1 / (1 + eps)], abs=1e-12
    )
    # [1, −1, −1, −1]: mean −0.5, population std sqrt((1.5² + 3·0.5²)/4) = sqrt(3)/2
    #   → correct: 1.5/(sqrt(3)/2) = sqrt(3);  wrong: −0.5/(sqrt(3)/2) = −1/sqrt(3).
    s3 = math.sqrt(3)
    assert group_advantages([1, -1, -1, -1], eps=0.0, unbiased=False) == pytest.approx([s3, -1 / s3, -1 / s3, -1 / s3], abs=1e-12)
    # Population std: [0, 2] → mean 1, std 1 → [−1, 1].
    assert group_advantages([0.0, 2.0], eps=0.0, unbiased=False) == pytest.approx([-1.0, 1.0], abs=1e-12)


def test_group_advantages_unbiased_std_is_the_default() -> None:
    # Bessel's correction (verl's DAPO recipe: torch.std): [0, 2] → std sqrt(2) → ±1/√2;
    # [1, −1, −1, 1] → std sqrt(4/3) → ±sqrt(3)/2; [1, −1, −1, −1] → std sqrt(3 / 3) = 1 → [1.5, −0.5 ×3].
    assert group_advantages([0.0, 2.0], eps=0.0) == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], abs=1e-12)
    h = math.sqrt(3) / 2
    assert group_advantages([1, -1, -1, 1], eps=0.0) == pytest.approx([h, -h, -h, h], abs=1e-12)
    assert group_advantages([1, -1, -1, 1], eps=0.0) != pytest.approx([1, -1, -1, 1], abs=1e-6)
    assert group_advantages([1, -1, -1, -1], eps=0.0) == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-12)
    import torch

    r = torch.tensor([1.0, -1.0, 0.3, -1.0, 1.0, 1.0, -1.0, -0.2], dtype=torch.float64)
    assert group_advantages(r.tolist(), eps=0.0) == pytest.approx(((r - r.mean()) / r.std()).tolist(), abs=1e-12)


@pytest.mark.parametrize("rewards", [[1.0] * 4, [-1.0] * 8])
def test_group_advantages_zero_for_equal_rewards(rewards: list[float]) -> None:
    assert group_advantages(rewards) == [0.0] * len(rewards)
    assert group_advantages([0.3], unbiased=False) == [0.0]


def test_group_advantages_empty_raises() -> None:
    with pytest.raises(ValueError):
        group_advantages([])
    with pytest.raises(ValueError):  # a sample std needs two rewards
        group_advantages([1.0])


@settings(deadline=None)
@given(st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=32))
def test_group_advantages_mean_zero_unit_std(rewards: list[float]) -> None:
    assume(max(rewards) - min(rewards) > 1e-3)
    adv = group_advantages(rewards, eps=0.0)
    n = len(adv)
    mean = sum(adv) / n
    std = math.sqrt(sum((a - mean) ** 2 for a in adv) / (n - 1))  # the sample std (the default)
    assert mean == pytest.approx(0.0, abs=1e-9)
    assert std == pytest.approx(1.0, abs=1e-9)
    # Order is kept: a higher reward never gets a lower advantage (ties possible after rounding).
    for r1, a1 in zip(rewards, adv):
        for r2, a2 in zip(rewards, adv):
            if r1 > r2:
                assert a1 >= a2


@settings(deadline=None)
@given(st.lists(st.sampled_from([-1.0, 1.0]), min_size=2, max_size=16))
def test_group_advantages_with_eps_shrinks_std(rewards: list[float]) -> None:
    # With eps the std of the advantages is s/(s + eps) for reward std s.
    assume(len(set(rewards)) == 2)
    eps = 1e-2
    n = len(rewards)
    m = sum(rewards) / n
    s = math.sqrt(sum((r - m) ** 2 for r in rewards) / (n - 1))
    adv = group_advantages(rewards, eps=eps)
    std = math.sqrt(sum(a**2 for a in adv) / (n - 1))  # mean is 0; the sample std (the default)
    assert std == pytest.approx(s / (s + eps), abs=1e-12)


# ---------------------------------------------------------------- dynamic sampling


@pytest.mark.parametrize(
    "values, expected",
    [
        ([1.0, 1.0, 1.0, 1.0], False),  # all correct: no signal
        ([-1.0, -1.0], False),  # all wrong
        ([True, True, True], False),  # correctness flags work too
        ([True, False, True], True),
        ([1.0, -1.0, 1.0], True),
        ([0.5], False),  # a single response carries no comparison
        ([1.0, 1.0 + 1e-12], False),  # within tolerance
        ([1.0, 1.0 + 1e-6], True),
    ],
)
def test_is_informative(values, expected: bool) -> None:
    assert is_informative(values) is expected
