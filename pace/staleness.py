"""Staleness of trajectories and groups (docs/design.md §2, paper Sec. 2). Pure functions, no engine.

Trainer versions θ_0, θ_1, …; update j consumes a batch and produces θ_{j+1}. Response token
y_t was produced by version v_t; the trajectory completed at trainer version c and is consumed
at step j.

    token lag               k_t       = j − v_t
    policy lag (Eq. 1)      K         = (1/|y|) Σ_t (j − v_t)
    Generation Staleness    K_gen     = (1/|y|) Σ_t (c − v_t)         fixed at completion, ≥ 0
    Waiting Staleness       K_wait    = j − c                          +1 per trainer step pooled
    Lemma 1                 K         = K_gen + K_wait                 (exact)

The keys and values token y_t attends to were computed by the weights of the moment they were:
its prompt's (and its own earlier tokens') at the last prefill of the engine request that produced
it. With `rollout.kv_on_update=keep` a request that spans an update keeps that cache, so w_t, the
oldest version in y_t's context, is the version of its request's prefill (the request's first
token's); with `recompute` every in-flight request is prefilled again at each update, so w_t = v_t.

    KV staleness            K_kv      = (1/|y|) Σ_t (c − w_t)          ≥ K_gen, = K_gen under recompute
    context lag                       = K_kv + K_wait                  (exact, as Lemma 1)

For a group (G trajectories of one prompt) every quantity is the token-weighted mean over its
trajectories, so Lemma 1 holds for groups too. Sums of integers are kept as integers and divided
once, so the identity holds to floating-point rounding of a single division.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _ints(versions: Sequence[int]) -> np.ndarray:
    """The versions as int64 (sums of integers stay exact), checked non-empty."""
    v = np.asarray(versions, dtype=np.int64)
    if v.size == 0:
        raise ValueError("staleness of an empty response is undefined")
    return v


def policy_lag(versions: Sequence[int], step: int) -> float:
    """K(τ; j) = mean_t (j − v_t)."""
    v = _ints(versions)
    return int(step * v.size - v.sum()) / v.size


def generation_staleness(versions: Sequence[int], completed_at: int) -> float:
    """K_gen(τ) = mean_t (c − v_t); ≥ 0 because no token is newer than its completion."""
    v = _ints(versions)
    if v.max() > completed_at:
        raise ValueError(f"token version {v.max()} is newer than completion version {completed_at}")
    return int(completed_at * v.size - v.sum()) / v.size


def waiting_staleness(completed_at: int, step: int) -> int:
    """K_wait(τ; j) = j − c."""
    return step - completed_at


def group_staleness(
    versions: Sequence[Sequence[int]], completed_at: Sequence[int], step: int
) -> tuple[float, float, float]:
    """Token-weighted (K, K_gen, K_wait) of a group of trajectories consumed at ``step``.

    Each trajectory keeps its own completion version c(τ): a response that finished before its
    siblings accrues Waiting Staleness while it waits for them (docs/design.md §2).
    """
    if len(versions) != len(completed_at) or not versions:
        raise ValueError("a group needs one completion version per trajectory, and at least one trajectory")
    n = 0
    lag = gen = wait = 0
    for vs, c in zip(versions, completed_at):
        v = _ints(vs)
        if v.max() > c:
            raise ValueError(f"token version {v.max()} is newer than completion version {c}")
        s, m = int(v.sum()), v.size
        n += m
        lag += step * m - s
        gen += c * m - s
        wait += (step - c) * m
    return lag / n, gen / n, wait / n


def kv_versions(versions: Sequence[int], starts: Sequence[int] = (), reprefill: bool = False) -> np.ndarray:
    """w_t of every token: the version of the first token of the engine request that produced it
    (``starts``: the token indices where a later request of the response began: a tool turn, a
    continuation after a restart or a failover), or v_t itself when every update re-prefilled the
    in-flight requests (``reprefill``)."""
    v = np.asarray(versions, dtype=np.int64)
    if reprefill or v.size == 0:
        return v.copy()
    bounds = sorted({0, v.size, *(int(s) for s in starts if 0 < s < v.size)})
    first = v[bounds[:-1]]
    return np.repeat(first, np.diff(bounds))


def group_kv_staleness(kv: Sequence[Sequence[int]], completed_at: Sequence[int]) -> float:
    """Token-weighted K_kv of a group: mean over its tokens of (c(τ) − w_t), with ``kv`` the w_t of
    each trajectory's tokens (`kv_versions`, over the model's own tokens)."""
    if len(kv) != len(completed_at) or not kv:
        raise ValueError("a group needs one completion version per trajectory, and at least one trajectory")
    n = total = 0
    for ws, c in zip(kv, completed_at):
        w = _ints(ws)
        if w.max() > c:
            raise ValueError(f"KV version {w.max()} is newer than completion version {c}")
        n += w.size
        total += c * w.size - int(w.sum())
    return total / n


def versions_spanned(versions: Sequence[int]) -> int:
    """How many weight versions produced tokens of one response (1 = no update mid-generation)."""
    v = _ints(versions)
    return int(v.max() - v.min()) + 1


def version_spans(versions: Sequence[int]) -> list[int]:
    """Run-length encoding of a response's token versions, flattened: [v_0, n_0, v_1, n_1, …] with
    n_i consecutive tokens produced by version v_i (versions never go back within a response, so
    a span per weight version it saw). Logged per response, so staleness can be recomputed from
    the run's records alone."""
    v = np.asarray(versions, dtype=np.int64)
    if v.size == 0:
        return []
    starts = np.concatenate(([0], np.flatnonzero(v[1:] != v[:-1]) + 1))
    counts = np.diff(np.append(starts, v.size))
    return np.stack([v[starts], counts], axis=1).reshape(-1).tolist()
