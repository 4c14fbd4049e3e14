"""A simulated group: the pool's `Group`, with each response's versions kept as spans, not per token.

A cluster-scale simulation makes millions of responses of thousands of tokens; per-token arrays
would cost gigabytes and most of the run time. A response here is its length, its correctness,
its completion version c(τ) and its version spans [v_0, n_0, v_1, n_1, …] (n_i consecutive
tokens produced by weights v_i). Staleness is the same token-weighted integer arithmetic as
`pace.staleness.group_staleness` (docs/design.md §2), from Σ n_i and Σ v_i·n_i per response, so Lemma 1
holds exactly and the logged spans let `analysis/summarize_run.py` recompute every value.

KV staleness K_kv (`pace.staleness.kv_versions`): a response is one engine request, so its tokens
attend to KV prefilled with the version of its first token, except that a sequence preempted and
resumed has its whole context prefilled again (vLLM's recompute preemption): the tokens from the
resume on have the version of the first token made after it (``kv_starts``: where each resumed
segment began). With `kv_reprefill` (`rollout.kv_on_update=recompute`: every update re-prefills the
running sequences, `SimEngine`) w_t = v_t and K_kv = K_gen. Summed per response as Σ w_t, exactly.

The pool and its policies see a `Group` (id, completed_at, k_gen(), k_kv(), k_wait(), pfs, scores): they
cannot tell a simulated group from a real one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pace.records import Group


@dataclass(eq=False)
class SimGroup(Group):
    """G simulated responses. Arrays of length G; ``spans[i]`` is response i's flat span list."""

    prompt_tokens: int = 0
    target: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # drawn lengths
    correct: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    reward: np.ndarray = field(default_factory=lambda: np.zeros(0))
    done_at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # c(τ), −1 until finished
    finished_s: float = 0.0  # simulated time the last response finished
    spans: list = field(default_factory=list)
    engine: int = 0
    prefix_cached: tuple = (-1, -1)  # (engine, version) whose prefix cache holds the prompt
    remaining: int = 0  # responses not finished yet
    lengths: list = field(default_factory=list)  # `target` as Python ints (the engine reads them per token run)
    kv_starts: dict = field(default_factory=dict)  # response → token indices where a resumed (re-prefilled) run began
    _sums: tuple = (0, 0, 0, 0)  # (Σ n, Σ v·n, Σ c·n, Σ w) over the responses' tokens, set by `complete`

    def complete(self) -> None:
        """The last response finished: fix the integer sums staleness is computed from."""
        n = v = cn = w = 0
        for j, (s, c, m) in enumerate(zip(self.spans, self.done_at.tolist(), self.lengths)):
            if s[-2] > c:  # versions never go back within a response: the last span is the newest
                raise ValueError(f"group {self.id}: token version {s[-2]} is newer than completion version {c}")
            n += m
            vj = s[0] * s[1] if len(s) == 2 else sum(a * b for a, b in zip(s[0::2], s[1::2]))
            v += vj
            cn += c * m
            if self.kv_reprefill:
                w += vj
            else:  # one engine run (the common case): every token attends to its first token's version
                w += s[0] * m if j not in self.kv_starts else span_kv_sum(s, self.kv_starts[j])
        self._sums = (n, v, cn, w)

    @property
    def completed_at(self) -> int:
        return int(self.done_at.max())

    @property
    def num_tokens(self) -> int:
        return int(self.target.sum())

    def staleness(self, step: int) -> tuple[float, float, float]:
        """Token-weighted (K, K_gen, K_wait) if consumed at ``step``: the integer sums of
        `pace.staleness.group_staleness`, K = (jN − V)/N, K_gen = (CN − V)/N, K_wait = (jN − CN)/N."""
        n, v, cn, _ = self._sums
        return (step * n - v) / n, (cn - v) / n, (step * n - cn) / n

    def k_kv(self) -> float:
        """KV staleness K_kv = (CN − W)/N, W = Σ w_t (≥ K_gen: w_t ≤ v_t)."""
        n, _, cn, w = self._sums
        return (cn - w) / n

    def prefix_lag(self, version: int, m: int) -> np.ndarray:
        """Per response: mean lag (version − v_t) of its first ``m`` tokens under weights ``version``."""
        return np.array([span_prefix_lag(s, version, m) for s in self.spans])


def span_prefix_lag(spans: list, version: int, m: int) -> float:
    """Mean lag (version − v_t) of the first ``m`` tokens of a response given as [v_0, n_0, v_1, n_1, …]."""
    left, total = m, 0
    for v, k in zip(spans[0::2], spans[1::2]):
        take = min(k, left)
        total += take * (version - v)
        left -= take
        if left == 0:
            break
    return total / max(m - left, 1)


def span_kv_sum(spans: list, starts=()) -> int:
    """Σ w_t over a response given as [v_0, n_0, v_1, n_1, …] whose engine runs began at token 0 and
    at ``starts``: each token's w_t is the version of the first token of its run."""
    m = sum(spans[1::2])
    if not starts:
        return spans[0] * m
    bounds = sorted({0, m, *(t for t in starts if 0 < t < m)})
    total, i, end = 0, 0, spans[1]  # span i holds the tokens before `end`
    for a, b in zip(bounds, bounds[1:]):
        while end <= a:
            i += 1
            end += spans[2 * i + 1]
        total += spans[2 * i] * (b - a)
    return total


def group_columns(groups: list[SimGroup]) -> dict[str, list]:
    """The per-group Parquet rows of `pace.logger.group_row` (same schema, docs/design.md §6), as columns."""
    cols: dict[str, list] = {name: [] for name in _COLUMNS}
    for grp in groups:
        complete = grp.remaining == 0
        k = grp.staleness(grp.step) if complete and grp.step is not None and grp.step >= 0 else (None, None, None)
        lengths = grp.target.tolist() if complete else []
        rewards = grp.reward
        add = {
            "id": grp.id, "prompt_id": grp.prompt_id, "fate": grp.fate.value, "reason": grp.reason, "step": grp.step,
            "submitted_at": grp.submitted_at, "c": grp.completed_at if complete else None,
            "k": k[0], "k_gen": k[1], "k_kv": grp.k_kv() if k[1] is not None else None, "k_wait": k[2], "pfs": grp.pfs, "u": grp.scores.get("u"),
            "s_eff": grp.scores.get("s_eff"), "score": grp.scores.get("score"), "rho": grp.scores.get("rho"),
            "budget": grp.scores.get("budget"), "pfs_version": grp.pfs_version,
            "reward_mean": float(rewards.mean()) if complete else None,
            "reward_std": float(rewards.std()) if complete else None,
            "acc_mean": float(grp.correct.mean()) if complete else None,
            "len_mean": float(grp.target.mean()) if complete else None,
            "len_max": int(grp.target.max()) if complete else None,
            "lengths": lengths, "num_tokens": sum(lengths),
            "versions_spanned": max(s[-2] - s[0] + 1 for s in grp.spans) if complete else None,
            "num_actions": sum(lengths), "tool_calls": [0] * len(lengths), "tool_errors": 0,
            "completed_at": grp.done_at.tolist() if complete else [],
            "version_spans": grp.spans if complete else [],
            "resumed_tokens": [0] * len(lengths),  # the simulator has no restarts
            "engine": [-1] * len(lengths),  # nor engine indices
            # where a preempted response was prefilled again (its context from there on is that version's)
            "request_starts": [sorted(grp.kv_starts.get(j, [])) for j in range(len(lengths))],
            "kv_reprefill": grp.kv_reprefill,
        }
        for name in _COLUMNS:
            cols[name].append(add[name])
    return cols


_COLUMNS = ("id", "prompt_id", "fate", "reason", "step", "submitted_at", "c", "k", "k_gen", "k_kv", "k_wait", "pfs",
            "u", "s_eff", "score", "rho", "budget", "pfs_version", "reward_mean", "reward_std", "acc_mean", "len_mean",
            "len_max", "lengths", "num_tokens", "versions_spanned", "num_actions", "tool_calls", "tool_errors",
            "completed_at", "version_spans", "resumed_tokens", "engine", "request_starts", "kv_reprefill")
