"""M2PO's decisions (Zheng et al. 2025, "Second-Moment Trust Policy Optimization"), docs/design.md §4.

Pure functions over the flat tokens of a whole mini-batch (every micro-batch of every rank, in
one order): the trainer gathers them in a forward pass before the update (pace/algo/trainer.py),
so the decision does not depend on how the mini-batch is split. d_t = log π_θ − log μ, detached;
r_t = exp(d_t).

Trust-region tokens: A > 0 with r > 1, or A < 0 with r < 1 — the tokens a PPO clip could act on
(M2PO's Algorithm 1, "T ← all trust-region tokens"; the authors' code calls them harmful).

- ``paper`` (Algorithm 1, `keep_mask`): while the mean d² over the trust-region tokens left is
  above τ (``algo.m2_threshold``), mask the one with the largest d²; the loss is then the
  unclipped −A·r over the kept tokens (`pace.algo.loss.m2po_loss`).
- ``adaptive_clip`` (the authors' code, Infini-AI-Lab/M2PO ``compute_m2po_policy_loss``,
  `adaptive_clip`): no mask; a radius τ* is solved so that the trust-region tokens' second moment
  with |d| capped at τ* stays within the budget τ, and r is clipped to [e^−τ*, e^τ*] widened to at
  least [0.7, 1.5] (the authors' floors on ε: ``miniclip_low`` 0.3, ``miniclip_high`` 0.5).
"""
from __future__ import annotations

import math

import torch


def trust_region(d: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """0/1 (dtype of ``mask``): the counted tokens with A > 0 and r > 1, or A < 0 and r < 1."""
    tr = ((advantages > 0) & (d > 0)) | ((advantages < 0) & (d < 0))
    return tr.to(mask.dtype) * (mask > 0).to(mask.dtype)


def drop_largest(d: torch.Tensor, candidates: torch.Tensor, tau: float) -> tuple[torch.Tensor, int]:
    """Among the tokens with ``candidates`` > 0 the k with the largest d² are dropped, k the
    smallest integer such that the mean d² of the rest is ≤ τ (an empty rest counts as mean 0).
    Removing the current largest never raises the mean of the rest, so the first k that satisfies
    the bound is the minimal one. Ties are broken by position (stable sort), so exactly k tokens
    are dropped. Returns the 0/1 dropped indicator (dtype of ``candidates``) and k. float64, detached.
    """
    flat = candidates.detach().reshape(-1)
    dropped = torch.zeros_like(flat)
    idx = torch.nonzero(flat > 0, as_tuple=True)[0]
    n = idx.numel()
    if n == 0:
        return dropped.reshape(candidates.shape), 0
    d2 = d.detach().reshape(-1)[idx].to(torch.float64).square()
    order = torch.argsort(d2, descending=True, stable=True)
    # suffix[k] = Σ d² of the tokens left after dropping the top k (k = 0..n-1), summed from the
    # smallest up (flip-cumsum-flip) so it is not a difference of large numbers.
    suffix = torch.flip(torch.cumsum(torch.flip(d2[order], [0]), 0), [0])
    ok = suffix / torch.arange(n, 0, -1, dtype=torch.float64, device=d2.device) <= tau
    k = int(torch.argmax(ok.to(torch.int8)).item()) if bool(ok.any()) else n
    dropped[idx[order[:k]]] = 1
    return dropped.reshape(candidates.shape), k


def keep_mask(d: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, tau: float) -> tuple[torch.Tensor, dict]:
    """Algorithm 1: the 0/1 mask (dtype of ``mask``) of the counted tokens kept, and its stats:
    ``trust_region`` (tokens), ``m2`` (their mean d² before), ``m2_after`` (after), ``masked``."""
    tr = trust_region(d, advantages, mask)
    dropped, k = drop_largest(d, tr, tau)
    keep = (mask > 0).to(mask.dtype) - dropped
    d2 = d.detach().to(torch.float64).square()
    n_tr = float(tr.sum())
    m2 = float((d2 * tr.to(torch.float64)).sum()) / n_tr if n_tr else 0.0
    left = n_tr - k
    m2_after = float((d2 * (tr - dropped).to(torch.float64)).sum()) / left if left else 0.0
    return keep, {"trust_region": n_tr, "m2": m2, "m2_after": m2_after, "masked": float(k)}


def solve_radius(sorted_d2: torch.Tensor, target_sum: float) -> float:
    """τ* for ascending v_i = d_i²: the largest breakpoint √v_j with Σ_i min(v_i, v_j) < S
    (the authors' `_solve_tau_from_sorted_delta2`), 0 when even capping at the smallest exceeds S.
    Callers only ask when Σ v_i > S."""
    n = sorted_d2.numel()
    capped = torch.cumsum(sorted_d2, 0) + sorted_d2 * torch.arange(n - 1, -1, -1, dtype=sorted_d2.dtype)
    k = int(torch.argmax((capped >= target_sum).to(torch.int8)).item())  # the first breakpoint at or over S
    return 0.0 if k == 0 else math.sqrt(float(sorted_d2[k - 1]))


def adaptive_clip(d: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, tau: float,
                  eps_low_min: float = 0.3, eps_high_min: float = 0.5) -> tuple[float, float, dict]:
    """The authors' variant: (ε_low, ε_high) of the clip [1 − ε_low, 1 + ε_high] for this
    mini-batch, and stats (``trust_region``, ``m2``, ``m2_after``, ``radius``, ``binds``).

    M2 = mean d² over the trust-region tokens; if M2 ≤ τ (or there are none) τ* = ∞, else
    τ* = `solve_radius` of their d² at budget τ·n. Then ε_low = max(1 − e^−τ*, ``eps_low_min``)
    and ε_high = max(e^τ* − 1, ``eps_high_min``): both are floors, so the clip range is never
    tighter than [0.7, 1.5] (the authors' ``miniclip_low``/``miniclip_high``, which raise
    ``clip_low``/``clip_high`` when below them), and within the budget there is no upper clip at all
    (ε_high = ∞; the authors' τ* = 100000 stands for it) and none below (ε_low = 1).
    """
    tr = trust_region(d, advantages, mask) > 0
    d2 = d.detach().reshape(-1)[tr.reshape(-1)].to(torch.float64).square()
    n = d2.numel()
    m2 = float(d2.mean()) if n else 0.0
    radius, m2_after = math.inf, m2
    if n and m2 > tau:
        radius = solve_radius(torch.sort(d2).values, tau * n)
        m2_after = float(d2.clamp(max=radius * radius).mean())
    eps_low = max(1.0 - math.exp(-radius), eps_low_min)
    eps_high = max(math.expm1(radius) if radius < 700 else math.inf, eps_high_min)
    stats = {"trust_region": float(n), "m2": m2, "m2_after": m2_after, "radius": radius, "binds": float(radius < math.inf)}
    return eps_low, eps_high, stats
