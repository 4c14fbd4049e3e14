"""Policy-gradient losses as pure tensor functions (DESIGN §4). No model, no distributed code.

Shapes: every per-token tensor is [N] or [B, T] with a 0/1 ``mask`` of the same shape marking the
response tokens that count. The loss is token-level: the sum over every counted token divided by
``num_tokens`` (the number of counted tokens of the whole mini-batch across micro-batches and
ranks), so micro-batching and data parallelism do not change it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossOut:
    loss: torch.Tensor  # scalar to backpropagate
    clipped: torch.Tensor  # scalar: number of counted tokens where a clip was active
    ratio_sum: torch.Tensor  # scalar: Σ ratio over counted tokens (for the mean ratio metric)
    masked: torch.Tensor | None = None  # m2po_loss: scalar number of counted tokens it masked out
    weight_sum: torch.Tensor | None = None  # decoupled_loss: Σ min(π_prox/μ, is_cap) over counted tokens


def _surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float, clip_ratio_c: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clip-higher + dual-clip PPO surrogate and the 0/1 "a clip was active" indicator."""
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1).to(ratio.dtype)
    if clip_ratio_c is not None:
        loss3 = -advantages * clip_ratio_c
        dual = (advantages < 0) & (per_token > loss3)
        per_token = torch.where(dual, loss3, per_token)
        clipped = torch.maximum(clipped, dual.to(ratio.dtype))
    return per_token, clipped


def dapo_loss(
    logp: torch.Tensor,
    logp_behavior: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: int | float,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    clip_ratio_c: float | None = 3.0,
) -> LossOut:
    """Clip-higher PPO surrogate with the behaviour policy as ratio reference (``algo.ratio_ref=behavior``).

    r_t = exp(log π_θ − log μ); per token  L_t = max(−A r_t, −A clip(r_t, 1 − ε_low, 1 + ε_high)).
    With ``clip_ratio_c`` (dual clip, as in verl's DAPO recipe), tokens with A < 0 are further
    bounded by −A·c so a very stale token with a huge ratio cannot dominate the batch.
    """
    mask = mask.to(logp.dtype)
    log_ratio = (logp - logp_behavior).clamp(-20.0, 20.0)  # keeps exp finite on pathological tokens
    ratio = torch.exp(log_ratio)
    per_token, clipped = _surrogate(ratio, advantages, eps_low, eps_high, clip_ratio_c)
    return LossOut(
        loss=(per_token * mask).sum() / num_tokens,
        clipped=(clipped * mask).sum().detach(),
        ratio_sum=(ratio * mask).sum().detach(),
    )


def m2_keep_mask(d: torch.Tensor, mask: torch.Tensor, m2_threshold: float) -> tuple[torch.Tensor, int]:
    """M2PO masking decision: 0/1 mask (same shape/dtype as ``mask``) of the counted tokens to keep.

    Among the counted tokens (mask > 0) the k tokens with the largest d² are dropped, k the smallest
    integer such that the mean d² of the remaining counted tokens is ≤ τ (an empty remainder counts as
    mean 0). Removing the current largest never raises the mean of the rest, so the remaining mean
    is non-increasing in k and the first k that satisfies the bound is the minimal one. Ties are
    broken by position (stable sort), so exactly k tokens are dropped. Computed in float64, detached.
    """
    keep_flat = mask.detach().reshape(-1).clone()  # a fresh flat copy, whatever the strides of ``mask``
    idx = torch.nonzero(keep_flat > 0, as_tuple=True)[0]
    n = idx.numel()
    if n == 0:
        return keep_flat.reshape(mask.shape), 0
    d2 = d.detach().reshape(-1)[idx].to(torch.float64).square()
    order = torch.argsort(d2, descending=True, stable=True)
    d2_sorted = d2[order]
    # suffix[k] = Σ_{j≥k} d2_sorted[j] = Σ d² of the tokens left after dropping the top k (k = 0..n-1);
    # summed from the smallest up (flip-cumsum-flip) so it is not a difference of large numbers.
    suffix = torch.flip(torch.cumsum(torch.flip(d2_sorted, [0]), 0), [0])
    remaining = torch.arange(n, 0, -1, dtype=torch.float64, device=d2.device)  # n - k
    ok = suffix / remaining <= m2_threshold
    k = int(torch.argmax(ok.to(torch.int8)).item()) if bool(ok.any()) else n
    if k:
        keep_flat[idx[order[:k]]] = 0
    return keep_flat.reshape(mask.shape), k


def m2po_loss(
    logp: torch.Tensor,
    logp_behavior: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: int | float,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    clip_ratio_c: float | None = 3.0,
    m2_threshold: float = 0.04,
) -> LossOut:
    """M2PO baseline (``algo=m2po``, "Second-Moment Trust Policy Optimization"), DESIGN §4.

    d_t = log π_θ − log μ (detached for the decision). With M2 = mean of d_t² over the counted tokens,
    if M2 > τ = ``m2_threshold`` the counted tokens with the largest d_t² are masked out, greedily
    from the largest down, until the mean d_t² of the remaining counted tokens is ≤ τ (the minimal
    number of tokens; see :func:`m2_keep_mask`). If M2 ≤ τ nothing is masked and the result equals
    :func:`dapo_loss` exactly.

    Choice: the paper's M2PO uses no ratio clipping, but here it replaces DAPO's loss, so on the kept
    tokens we apply the same clip-higher + dual-clip surrogate as ``dapo_loss``; the only difference
    from ``dapo_loss`` is the masking. The sum is divided by ``num_tokens`` (the counted tokens
    *before* masking), so masking lowers the loss magnitude instead of reweighting the other tokens.

    The masking decision is made per call, over the tokens passed in: to mask on the mini-batch
    second moment the trainer must pass the whole mini-batch (on each rank); with micro-batching it
    is a per-micro-batch decision.

    Outputs: ``clipped`` counts clip events on the kept tokens only (masked tokens are not in the
    loss); ``ratio_sum`` is Σ π_θ/μ over all counted tokens (the staleness metric, divided by the
    trainer's counted-token total); ``masked`` is the number of tokens masked.
    """
    keep, k = m2_keep_mask(logp - logp_behavior, mask, m2_threshold)
    mask = mask.to(logp.dtype)
    keep = keep.to(logp.dtype)
    log_ratio = (logp - logp_behavior).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    per_token, clipped = _surrogate(ratio, advantages, eps_low, eps_high, clip_ratio_c)
    return LossOut(
        loss=(per_token * keep).sum() / num_tokens,
        clipped=(clipped * keep).sum().detach(),
        ratio_sum=(ratio * mask).sum().detach(),
        masked=torch.tensor(float(k), dtype=logp.dtype, device=logp.device),
    )


def decoupled_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behavior: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: int | float,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    clip_ratio_c: float | None = 3.0,
    *,
    is_cap: float | None,
) -> LossOut:
    """Decoupled PPO (``algo.ratio_ref=proximal``, as in AReaL), DESIGN §4.

    r_t = exp(log π_θ − log π_prox), with π_prox the policy at the start of step j (recomputed by the
    trainer); per token  L_t = w_t · surrogate(r_t, A_t)  with the same clip-higher + dual-clip
    surrogate as ``dapo_loss`` and the behaviour importance weight
    w_t = min(exp(log π_prox − log μ), ``is_cap``)  (no cap when ``is_cap`` is None; keyword-only and
    required, so the caller passes ``algo.is_cap`` explicitly rather than relying on a made-up default).
    ``logp_prox`` and w_t are detached, so the gradient reaches ``logp`` only through r_t.
    With logp_prox == logp_behavior, w_t = 1 and this equals ``dapo_loss`` exactly.

    ``clipped`` counts clip events of r_t; ``ratio_sum`` is Σ r_t = Σ π_θ/π_prox; ``weight_sum`` is Σ w_t
    (all over counted tokens).
    """
    mask = mask.to(logp.dtype)
    logp_prox = logp_prox.detach()
    ratio = torch.exp((logp - logp_prox).clamp(-20.0, 20.0))
    weight = torch.exp((logp_prox - logp_behavior.detach()).clamp(-20.0, 20.0))
    if is_cap is not None:
        weight = weight.clamp(max=is_cap)
    per_token, clipped = _surrogate(ratio, advantages, eps_low, eps_high, clip_ratio_c)
    return LossOut(
        loss=(per_token * weight * mask).sum() / num_tokens,
        clipped=(clipped * mask).sum().detach(),
        ratio_sum=(ratio * mask).sum().detach(),
        weight_sum=(weight * mask).sum().detach(),
    )
