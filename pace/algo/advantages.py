"""Reward shaping and group-normalised advantages (DAPO, docs/design.md §4). Pure Python, no torch."""
from __future__ import annotations

import math
from collections.abc import Sequence


def overlong_penalty(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment with L_max = ``max_tokens`` and L_cache = ``buffer``.

        0                               if |y| ≤ L_max − L_cache
        ((L_max − L_cache) − |y|) / L_cache   inside the buffer (0 → −1)
        −1                              beyond L_max
    """
    if buffer <= 0:
        return -1.0 if length > max_tokens else 0.0
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    if length <= max_tokens:
        return (start - length) / buffer
    return -1.0


def correctness_reward(correct: bool) -> float:
    """Rule reward: +1 correct, −1 wrong."""
    return 1.0 if correct else -1.0


def group_advantages(rewards: Sequence[float], eps: float = 1e-6, unbiased: bool = True) -> list[float]:
    """A_i = (r_i − mean(r)) / (std(r) + eps) within one group (no KL, no critic); std with
    Bessel's correction (divided by n − 1, as ``torch.std`` in verl's DAPO recipe and AReaL) or
    without (``unbiased=False``: the population std, divided by n).

    A group whose rewards are all equal gets zero advantages; dynamic sampling filters such
    groups before they reach the trainer.
    """
    n = len(rewards)
    if n == 0 or (unbiased and n < 2):
        raise ValueError(f"a group needs at least {2 if unbiased else 1} rewards, got {n}")
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1 if unbiased else n))
    return [(r - mean) / (std + eps) for r in rewards]


def is_informative(values: Sequence[float], tol: float = 1e-9) -> bool:
    """Dynamic sampling: a group is kept only if its values are not all equal."""
    return max(values) - min(values) > tol
