"""Policy-gradient losses as pure tensor functions (docs/design.md §4). No model, no distributed code.

Shapes: every per-token tensor is [N] or [B, T] with a 0/1 ``mask`` of the same shape marking the
response tokens that count. The loss is token-level: the sum over every counted token divided by
``num_tokens`` (the number of counted tokens of the whole mini-batch across micro-batches and
ranks), so micro-batching and data parallelism do not change it. `build_loss` picks the configured
variant once, from config (one function per variant; no string branches in the training step).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pace.algo import correction


@dataclass
class LossOut:
    loss: torch.Tensor  # scalar to backpropagate
    clipped: torch.Tensor  # scalar: number of counted tokens where a clip was active
    ratio_sum: torch.Tensor  # scalar: Σ ratio over counted tokens (for the mean ratio metric)
    masked: torch.Tensor | None = None  # scalar: counted tokens masked out (M2PO, a rejection correction)
    truncated: torch.Tensor | None = None  # scalar: counted tokens whose IS weight was truncated (TIS)
    weight_sum: torch.Tensor | None = None  # scalar: Σ IS weight w_t over counted tokens


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
    weight: torch.Tensor | None = None,
) -> LossOut:
    """Clip-higher PPO surrogate with the behaviour policy as ratio reference (``algo.ratio_ref=behavior``).

    r_t = exp(log π_θ − log μ); per token  L_t = max(−A r_t, −A clip(r_t, 1 − ε_low, 1 + ε_high)).
    With ``clip_ratio_c`` (dual clip, as in verl's DAPO recipe), tokens with A < 0 are further
    bounded by −A·c so a very stale token with a huge ratio cannot dominate the batch.

    ``weight`` (detached, per token; e.g. the 0/1 mask of a rejection correction): the surrogate
    of token t is multiplied by it; ``clipped`` then counts the tokens of non-zero weight only.
    """
    mask = mask.to(logp.dtype)
    log_ratio = (logp - logp_behavior).clamp(-20.0, 20.0)  # keeps exp finite on pathological tokens
    ratio = torch.exp(log_ratio)
    per_token, clipped = _surrogate(ratio, advantages, eps_low, eps_high, clip_ratio_c)
    counted = mask if weight is None else mask * weight.detach().to(logp.dtype)
    return LossOut(
        loss=(per_token * counted).sum() / num_tokens,
        clipped=(clipped * (counted != 0).to(logp.dtype)).sum().detach(),
        ratio_sum=(ratio * mask).sum().detach(),
    )


def m2po_loss(
    logp: torch.Tensor,
    logp_behavior: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    keep: torch.Tensor,
    num_tokens: int | float,
) -> LossOut:
    """M2PO's objective (``algo=m2po``, ``algo.m2po_variant=paper``; Algorithm 1), docs/design.md §4.

    L_t = −A_t r_t on the tokens ``keep`` holds (the mini-batch decision of
    `pace.algo.m2po.keep_mask`, made before the update), no clip; the sum is divided by
    ``num_tokens``, the counted tokens *before* masking (the project's token-level normalisation),
    so a masked token lowers the loss magnitude rather than reweighting the others.

    ``clipped`` is 0 (nothing is clipped); ``ratio_sum`` is Σ r over all counted tokens;
    ``masked`` the counted tokens not kept.
    """
    mask = mask.to(logp.dtype)
    keep = keep.detach().to(logp.dtype) * mask
    ratio = torch.exp((logp - logp_behavior).clamp(-20.0, 20.0))
    return LossOut(
        loss=(-advantages * ratio * keep).sum() / num_tokens,
        clipped=torch.zeros((), dtype=logp.dtype, device=logp.device),
        ratio_sum=(ratio * mask).sum().detach(),
        masked=(mask - keep).sum().detach(),
    )


def tis_pg_loss(
    logp: torch.Tensor,
    logp_behavior: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weight: torch.Tensor,
    num_tokens: int | float,
) -> LossOut:
    """Truncated-IS policy gradient under the behaviour reference (``algo.ratio_ref=behavior``
    with ``algo.is_correction=tis``: verl's bypass mode with the policy-gradient loss, ``pg_is``).

    ∇L = −Σ A_t w_t ∇log π_θ / num_tokens with w_t the truncated ratio (detached, from
    `pace.algo.correction.correct` on log π_θ − log μ), no PPO clip: the truncation bounds the
    step instead. Written as L_t = −A_t · sg(w_t / r_t) · r_t, whose value is −A_t w_t and whose
    gradient is the one above (r_t = π_θ/μ).
    """
    mask = mask.to(logp.dtype)
    ratio = torch.exp((logp - logp_behavior).clamp(-20.0, 20.0))
    scale = (weight.detach().to(logp.dtype) / ratio.detach()) * mask
    return LossOut(
        loss=(-advantages * scale * ratio).sum() / num_tokens,
        clipped=torch.zeros((), dtype=logp.dtype, device=logp.device),
        ratio_sum=(ratio * mask).sum().detach(),
        weight_sum=(weight.detach() * mask).sum(),
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
    weight: torch.Tensor | None = None,
) -> LossOut:
    """Decoupled PPO (``algo.ratio_ref=proximal``, as in AReaL), docs/design.md §4.

    r_t = exp(log π_θ − log π_prox), with π_prox the policy at the start of step j (recomputed by the
    trainer); per token  L_t = w_t · surrogate(r_t, A_t)  with the same clip-higher + dual-clip
    surrogate as ``dapo_loss`` and the behaviour importance weight w_t: ``weight`` when given (the
    processed ratio of `pace.algo.correction.correct`: truncated by TIS, 0 where MIS masks), else
    the raw ρ_t = exp(log π_prox − log μ). ``logp_prox`` and w_t are detached, so the gradient
    reaches ``logp`` only through r_t. With logp_prox == logp_behavior and no weight, w_t = 1 and
    this equals ``dapo_loss`` exactly.

    ``clipped`` counts clip events of r_t; ``ratio_sum`` is Σ r_t = Σ π_θ/π_prox; ``weight_sum`` is Σ w_t
    (all over counted tokens).
    """
    mask = mask.to(logp.dtype)
    logp_prox = logp_prox.detach()
    ratio = torch.exp((logp - logp_prox).clamp(-20.0, 20.0))
    if weight is None:
        weight = torch.exp((logp_prox - logp_behavior.detach()).clamp(-20.0, 20.0))
    weight = weight.detach().to(logp.dtype)
    per_token, clipped = _surrogate(ratio, advantages, eps_low, eps_high, clip_ratio_c)
    return LossOut(
        loss=(per_token * weight * mask).sum() / num_tokens,
        clipped=(clipped * mask).sum().detach(),
        ratio_sum=(ratio * mask).sum().detach(),
        weight_sum=(weight * mask).sum().detach(),
    )


def build_loss(algo) -> Callable[[torch.Tensor, dict, float], LossOut]:
    """The configured loss as fn(logp, batch tensors, num_tokens): one pure function per variant.

    M2PO reads its mini-batch decision from the batch (``m2po_keep`` or ``m2po_eps``, made by
    `DAPOTrainer._m2po_decide`); the IS corrections are computed per call from ρ = π_prox/μ
    (proximal) or sg(π_θ)/μ (behaviour), exact per sequence (a sequence never spans calls).
    """
    clip = dict(eps_low=algo.eps_low, eps_high=algo.eps_high, clip_ratio_c=algo.clip_ratio_c)
    if algo.name == "m2po":
        if algo.m2po_variant == "paper":
            return lambda logp, b, n: m2po_loss(logp, b["logp_behavior"], b["advantages"], b["loss_mask"], b["m2po_keep"], n)
        return lambda logp, b, n: dapo_loss(logp, b["logp_behavior"], b["advantages"], b["loss_mask"], n,
                                            eps_low=b["m2po_eps"][0], eps_high=b["m2po_eps"][1], clip_ratio_c=None)

    def corrected(log_rho: torch.Tensor, b: dict) -> correction.Correction:
        return correction.correct(log_rho, b["loss_mask"], b["seq_ids"], int(b["n_seqs"]), algo.is_correction,
                                  algo.is_level, algo.is_threshold, algo.is_threshold_lower)

    def with_counts(out: LossOut, c: correction.Correction) -> LossOut:
        out.masked, out.truncated = c.masked, c.truncated
        return out

    if algo.ratio_ref == "proximal":
        def proximal(logp, b, n):
            c = corrected(b["logp_prox"] - b["logp_behavior"], b)
            return with_counts(decoupled_loss(logp, b["logp_prox"], b["logp_behavior"], b["advantages"], b["loss_mask"], n,
                                              weight=c.weight, **clip), c)
        return proximal
    if algo.is_correction == "tis":
        def truncated(logp, b, n):
            c = corrected(logp.detach() - b["logp_behavior"], b)
            return with_counts(tis_pg_loss(logp, b["logp_behavior"], b["advantages"], b["loss_mask"], c.weight, n), c)
        return truncated
    if algo.is_correction == "mis":
        def masked(logp, b, n):
            c = corrected(logp.detach() - b["logp_behavior"], b)
            return with_counts(dapo_loss(logp, b["logp_behavior"], b["advantages"], b["loss_mask"], n, weight=c.keep, **clip), c)
        return masked
    return lambda logp, b, n: dapo_loss(logp, b["logp_behavior"], b["advantages"], b["loss_mask"], n, **clip)
