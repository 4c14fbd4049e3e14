"""PACE's ranking scores and rejection budget (DESIGN §3, Algorithm 1). Pure functions, no engine.

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

SCORES = ("effective", "raw", "generation")


def score(kind: str, k_wait: float, k_gen: float, u: float = 1.0, gamma: float = 1.0) -> float:
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

    def add(self, value: float) -> None:
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

    def __len__(self) -> int:
        return len(self._fifo)

    def state_dict(self) -> dict:
        return {"size": self.size, "values": list(self._fifo)}

    def load_state_dict(self, state: dict) -> None:
        self.__init__(state["size"])
        self.extend(state["values"])


class RejectionController:
    """EMA of the pool's excess occupancy over its target: the rejection rate ρ."""

    def __init__(self, target: int, ema: float):
        if target < 0 or not 0 <= ema < 1:
            raise ValueError(f"RejectionController: need target >= 0 and 0 <= ema < 1, got {target}, {ema}")
        self.target = target
        self.ema = ema
        self.rho = 0.0

    def update(self, occupancy: int) -> float:
        excess = max(0, occupancy - self.target) / occupancy if occupancy > 0 else 0.0
        self.rho = self.ema * self.rho + (1.0 - self.ema) * excess
        return self.rho

    @staticmethod
    def budget(rho: float, occupancy: int, batch: int) -> int:
        return max(0, min(math.floor(rho * occupancy), occupancy - batch))

    def state_dict(self) -> dict:
        return {"rho": self.rho}

    def load_state_dict(self, state: dict) -> None:
        self.rho = state["rho"]
