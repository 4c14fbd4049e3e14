"""What a simulated prompt's G responses are: lengths and correctness (and their prefixes' drift).

Parametric (`sim.responses.levels`): a prompt draws a difficulty level by weight; its accuracy p
is the level's `p_correct`, or Beta-distributed around it with concentration κ (so some prompts
are all-right or all-wrong and dynamic sampling filters them, as in a real run); each response
is correct with probability p and has a log-normal length (median `len_median`, log-sd
`len_sigma`; wrong responses ×`wrong_len_factor`: DAPO's wrong answers run longer), rounded and
capped at `rollout.max_tokens` (a capped response finishes by length, as in vLLM).
`length_scale` multiplies every length before the cap (what if the responses were 2× longer?).

Empirical (`sim.responses.empirical`: a run directory or a Parquet glob): a prompt is a logged
group drawn at random, its G lengths and its number of correct responses (placed at random):
the length–correctness coupling of the real run, exactly.

Draws come in blocks (vectorised); one `numpy.random.Generator` seeded from `seed`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

BLOCK = 4096  # prompts drawn at once


class ResponseModel:
    def __init__(self, cfg, group_size: int, max_tokens: int, overlong_buffer: int, rng: np.random.Generator):
        self.cfg, self.g, self.cap, self.buffer, self.rng = cfg, group_size, max_tokens, overlong_buffer, rng
        self._empirical = _load_empirical(cfg.empirical, group_size) if cfg.empirical else None
        if self._empirical is None:
            levels = list(cfg.levels)
            if not levels:
                raise ValueError("sim.responses.levels is empty (and no sim.responses.empirical): nothing to draw from")
            w = np.array([lv.weight for lv in levels], dtype=np.float64)
            if (w < 0).any() or w.sum() <= 0:
                raise ValueError("sim.responses.levels: weights must be >= 0 and not all 0")
            self._levels, self._w = levels, w / w.sum()
        self._block: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]] = []

    def draw(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(lengths int64[G], correct bool[G], rewards float[G], level) of the next prompt."""
        if not self._block:
            self._block = self._draw_block()
        return self._block.pop()

    def _draw_block(self) -> list:
        n, g = BLOCK, self.g
        if self._empirical is not None:
            lengths, n_correct = self._empirical
            pick = self.rng.integers(0, len(lengths), size=n)
            lens = lengths[pick] * self.cfg.length_scale
            correct = self.rng.random((n, g)).argsort(axis=1) < n_correct[pick, None]
            level = np.zeros(n, dtype=np.int64)
        else:
            level = self.rng.choice(len(self._levels), size=n, p=self._w)
            p = np.empty(n)
            median = np.empty(n)
            sigma = np.empty(n)
            wrong = np.empty(n)
            for i, lv in enumerate(self._levels):
                at = level == i
                k = int(at.sum())
                if lv.concentration is None:
                    p[at] = lv.p_correct
                else:
                    a, b = lv.p_correct * lv.concentration, (1 - lv.p_correct) * lv.concentration
                    p[at] = self.rng.beta(max(a, 1e-6), max(b, 1e-6), size=k)
                median[at], sigma[at], wrong[at] = lv.len_median, lv.len_sigma, lv.wrong_len_factor
            if self.cfg.fixed_correct is not None:  # a deterministic model: exactly this many right
                correct = np.zeros((n, g), dtype=bool)
                correct[:, : self.cfg.fixed_correct] = True
            else:
                correct = self.rng.random((n, g)) < p[:, None]
            scale = (self.cfg.length_scale * median)[:, None] * np.where(correct, 1.0, wrong[:, None])
            lens = scale * np.exp(sigma[:, None] * self.rng.standard_normal((n, g)))
        lens = np.clip(np.rint(lens), 1, self.cap).astype(np.int64)
        rewards = np.where(correct, 1.0, -1.0) + _overlong(lens, self.cap, self.buffer)
        return [(lens[i], correct[i], rewards[i], int(level[i])) for i in range(n - 1, -1, -1)]


def _overlong(lens: np.ndarray, cap: int, buffer: int) -> np.ndarray:
    """DAPO's soft overlong punishment (`pace.algo.advantages.overlong_penalty`), vectorised."""
    if buffer <= 0:
        return np.where(lens > cap, -1.0, 0.0)
    start = cap - buffer
    return np.where(lens <= start, 0.0, (start - lens) / buffer)  # lengths never exceed the cap here


def _load_empirical(spec: str, g: int) -> tuple[np.ndarray, np.ndarray]:
    """(lengths [n, G], correct counts [n]) of the complete groups logged under ``spec``."""
    import pandas as pd

    path = Path(spec)
    parts = sorted(path.glob("groups/part-*.parquet")) if path.is_dir() else sorted(Path().glob(spec))
    if not parts:
        raise FileNotFoundError(f"sim.responses.empirical: no per-group Parquet at {spec} (groups/part-*.parquet)")
    df = pd.concat([pd.read_parquet(p, columns=["lengths", "acc_mean", "c"]) for p in parts], ignore_index=True)
    df = df[df.c.notna() & (df.lengths.map(len) == g)]
    if df.empty:
        raise ValueError(f"sim.responses.empirical: {spec} has no complete groups of G = {g} responses")
    return np.stack(df.lengths.to_numpy()).astype(np.int64), np.rint(df.acc_mean.to_numpy() * g).astype(np.int64)


class PfsModel:
    """Prefix Forgetting Score of a rescored group: a prefix's log-probs drift with the lag of its
    tokens. Per response, distance = scale · lag^power · exp(noise · ε) with lag the mean
    (version − v_t) over its first m tokens, and 0 for a prefix made by the loaded weights (as
    the real rescoring, which skips those); the group's PFS is the mean over its responses."""

    def __init__(self, cfg, rng: np.random.Generator):
        self.scale, self.power, self.noise, self.rng = cfg.scale, cfg.power, cfg.noise, rng

    def score(self, lags: np.ndarray) -> float:
        d = self.scale * np.power(lags, self.power) * np.exp(self.noise * self.rng.standard_normal(len(lags)))
        return float(np.where(lags > 0, d, 0.0).mean())
