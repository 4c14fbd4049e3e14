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
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1).to(logp.dtype)
    if clip_ratio_c is not None:
        loss3 = -advantages * clip_ratio_c
        dual = (advantages < 0) & (per_token > loss3)
        per_token = torch.where(dual, loss3, per_token)
        clipped = torch.maximum(clipped, dual.to(logp.dtype))
    return LossOut(
        loss=(per_token * mask).sum() / num_tokens,
        clipped=(clipped * mask).sum().detach(),
        ratio_sum=(ratio * mask).sum().detach(),
    )
