"""PACE's ranking scores and rejection budget (docs/design.md §3, Algorithm 1). Pure functions, no engine.

Scores of a pooled group at step j (higher = staler = rejected first):
    generation   S = K_gen
    raw          S = K_wait + K_gen                    (= K, the policy lag)
    effective    S = K_wait + u^γ · K_gen              u = percentile rank of the group's Prefix
                                                       Forgetting Score in the recent window
With γ = 0, u^γ = 1 and `effective` equals `raw`; a group with K_gen = 0 scores K_wait whatever u.

Budget (Little's law: pool size ∝ waiting time):
    e_j = max(0, n_j − n*) / n_j        ρ_j = β ρ_{j−1} + (1 − β) e_j
    R_j = min(⌊ρ_j n_j⌋, n_j − B), never negative: rejection never leaves fewer than B groups.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable

import numpy as np

SCORES = ("effective", "raw", "generation")


def score(kind: str, k_wait, k_gen, u=1.0, gamma: float = 1.0):
    """Scalars or NumPy arrays (the pool scores every pooled group at once)."""
    if kind == "effective":
        return k_wait + (u**gamma) * k_gen
    if kind == "raw":
        return k_wait + k_gen
    if kind == "generation":
        return k_gen
    raise ValueError(f"pace.score must be one of {SCORES}, got {kind!r}")


class ScoreWindow:
    """The last `size` Prefix Forgetting Scores; percentile rank u ∈ [0, 1] of a value among them.

    u = fraction of window values ≤ value (the window's maximum has u = 1). An empty window gives
    u = 1: with no evidence yet, Generation Staleness counts in full (the `raw` score).
    """

    def __init__(self, size: int):
        self.size = size
        self._fifo: deque[float] = deque()
        self._sorted: list[float] = []
        self._array: np.ndarray | None = None  # `_sorted` as an array, rebuilt after changes

    def add(self, value: float) -> None:
        self._array = None
        self._fifo.append(value)
        bisect.insort(self._sorted, value)
        if len(self._fifo) > self.size:
            old = self._fifo.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def extend(self, values: Iterable[float]) -> None:
        for v in values:
            self.add(v)

    def rank(self, value: float) -> float:
        if not self._sorted:
            return 1.0
        return bisect.bisect_right(self._sorted, value) / len(self._sorted)

    def ranks(self, values: np.ndarray) -> np.ndarray:
        """`rank` of each value; NaN (not rescored yet) ranks 1: its K_gen counts in full.

        Sorts the values and counts window entries ≤ each by a cumulative histogram: at 100,000
        values this is 2× faster than ``np.searchsorted(window, values)``, whose binary searches
        over unsorted keys mispredict every branch.
        """
        if not self._sorted:
            return np.ones(len(values))
        if self._array is None:
            self._array = np.asarray(self._sorted)
        v = np.where(np.isnan(values), np.inf, values)
        order = np.argsort(v)
        first = np.searchsorted(v[order], self._array, side="left")  # sorted position of the first v ≥ w_k
        at_most = np.cumsum(np.bincount(first, minlength=len(v) + 1)[: len(v)])  # #{k: w_k ≤ v}, sorted order
        u = np.empty(len(v))
        u[order] = at_most / len(self._array)
        return u

    def __len__(self) -> int:
        return len(self._fifo)

    def state_dict(self) -> dict:
        return {"size": self.size, "values": list(self._fifo)}

    def load_state_dict(self, state: dict) -> None:
        self.__init__(state["size"])
        self.extend(state["values"])


def top_r(scores: np.ndarray, completed: np.ndarray, r: int) -> np.ndarray:
    """Positions of the ``r`` highest scores, ties broken by older completion, then position.

    O(n) selection (np.partition) plus a sort of the tied candidates only: the pool calls this
    every step over every pooled group.
    """
    n = len(scores)
    if r <= 0:
        return np.empty(0, dtype=np.int64)
    if r >= n:
        return np.arange(n)
    threshold = np.partition(scores, n - r)[n - r]  # the r-th highest score
    above = np.flatnonzero(scores > threshold)
    tied = np.flatnonzero(scores == threshold)
    tied = tied[np.lexsort((tied, completed[tied]))][: r - len(above)]
    return np.sort(np.concatenate([above, tied]))


def candidates(lo: np.ndarray, hi: np.ndarray, r: int) -> np.ndarray:
    """Positions that can be among the ``r`` highest scores when each score lies in [lo, hi].

    The r-th highest score is at least the r-th highest lower bound t, so a position whose upper
    bound is below t is never among them (nor tied with the r-th). Returned in ascending order.
    """
    n = len(lo)
    if r <= 0:
        return np.empty(0, dtype=np.int64)
    if r >= n:
        return np.arange(n)
    t = np.partition(lo, n - r)[n - r]
    return np.flatnonzero(hi >= t)


class RejectionController:
    """EMA of the pool's excess occupancy over its target: the rejection rate ρ."""

    def __init__(self, target_pool: int, ema: float):
        if target_pool < 0 or not 0 <= ema < 1:
            raise ValueError(f"RejectionController: need target_pool >= 0 and 0 <= ema < 1, got {target_pool}, {ema}")
        self.target_pool = target_pool
        self.ema = ema
        self.rho = 0.0

    def update(self, occupancy: int) -> float:
        excess = max(0, occupancy - self.target_pool) / occupancy if occupancy > 0 else 0.0
        self.rho = self.ema * self.rho + (1.0 - self.ema) * excess
        return self.rho

    @staticmethod
    def budget(rho: float, occupancy: int, batch: int) -> int:
        return max(0, min(math.floor(rho * occupancy), occupancy - batch))

    def state_dict(self) -> dict:
        return {"rho": self.rho}

    def load_state_dict(self, state: dict) -> None:
        self.rho = state["rho"]
