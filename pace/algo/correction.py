"""Importance-sampling corrections of the behaviour ratio and train–inference mismatch (docs/design.md §4).

Pure tensor functions over the flat per-response-token layout of `pace.algo.microbatch.collate`:
every tensor is [T] (the response tokens of a micro-batch, sequence after sequence), ``mask`` is
1 on the tokens that count (the model's actions), ``seq_ids`` [T] numbers the sequences 0..S−1.
A sequence never spans micro-batches, so sequence-level corrections are exact per call.

The importance ratio ρ_t = π_ref/μ compares the policy the trainer measures the behaviour
against with the engine's ℓ^μ: π_ref = π_prox (``algo.ratio_ref=proximal``, decoupled PPO:
verl's "decoupled mode") or π_θ itself, detached (``behavior``: verl's "bypass mode").

``algo.is_correction`` (literature in the README, "Off-policy corrections"):
- ``none``: w_t = ρ_t, nothing masked.
- ``tis`` (truncated IS; Yao et al. 2025, verl ``rollout_is``): w_t = min(ρ_t, C) per token
  (``is_level=token``) or min(Π_t ρ_t, C) for every token of the sequence (``sequence``).
- ``mis`` (masked IS / rejection; verl ``rollout_rs``, IcePop): a token (``token``), or all of a
  sequence (``sequence``: Π_t ρ_t; ``geometric``: (Π_t ρ_t)^(1/n), n its action tokens), is
  masked when that ratio is outside [C_low, C]; kept tokens keep w_t = ρ_t.
C = ``algo.is_threshold``, C_low = ``algo.is_threshold_lower`` (None: 1/C). Products are taken
in log space, clamped to [−20, 20] (verl's safety bound) before exponentiating.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

KINDS = ("none", "tis", "mis")
LEVELS = ("token", "sequence", "geometric")
BOUND = 20.0  # |log ρ| and |log Π ρ| are clamped here: exp(±20) is finite in float32


@dataclass
class Correction:
    weight: torch.Tensor  # [T] processed IS weight (detached); 0 where masked
    keep: torch.Tensor  # [T] 0/1: 1 on the counted tokens the correction keeps
    truncated: torch.Tensor  # scalar: counted tokens whose weight the truncation lowered
    masked: torch.Tensor  # scalar: counted tokens the mask removed


def sequence_sum(x: torch.Tensor, seq_ids: torch.Tensor, n_seqs: int) -> torch.Tensor:
    """Σ of ``x`` over each sequence, [S]."""
    return torch.zeros(n_seqs, dtype=x.dtype, device=x.device).index_add_(0, seq_ids, x)


def correct(log_rho: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, n_seqs: int, kind: str,
            level: str = "token", upper: float | None = None, lower: float | None = None) -> Correction:
    """The weights and the mask of correction ``kind`` at ``level`` for per-token log ρ (see the
    module docstring). ``upper`` = C, ``lower`` = C_low (None: 1/C)."""
    if kind not in KINDS or level not in LEVELS:
        raise ValueError(f"correct: kind {kind!r} not in {KINDS} or level {level!r} not in {LEVELS}")
    if kind != "none" and not (upper is not None and upper > 0):
        raise ValueError(f"correct: {kind} needs a threshold C > 0, got {upper}")
    if kind == "tis" and level == "geometric":
        raise ValueError("correct: a geometric-mean ratio is a rejection criterion (mis), not a weight")
    mask = mask.detach().to(log_rho.dtype)
    log_rho = log_rho.detach().clamp(-BOUND, BOUND) * mask
    zero = torch.zeros((), dtype=log_rho.dtype, device=log_rho.device)
    rho = torch.exp(log_rho)
    if kind == "none":
        return Correction(rho * mask, mask, zero, zero)
    if level == "token":
        log_level = log_rho
    else:
        total = sequence_sum(log_rho, seq_ids, n_seqs)
        if level == "geometric":
            total = total / sequence_sum(mask, seq_ids, n_seqs).clamp(min=1.0)
        log_level = total.clamp(-BOUND, BOUND)[seq_ids]
    if kind == "tis":
        level_rho = torch.exp(log_level)
        weight = level_rho.clamp(max=upper) * mask
        truncated = ((level_rho > upper).to(mask.dtype) * mask).sum()
        return Correction(weight, mask, truncated, zero)
    low = 1.0 / upper if lower is None else lower
    inside = (log_level >= (math.log(low) if low > 0 else -math.inf)) & (log_level <= math.log(upper))
    keep = inside.to(mask.dtype) * mask
    return Correction(rho * keep, keep, zero, (mask - keep).sum())


def on_policy_tokens(versions: torch.Tensor, first_versions: torch.Tensor, version: int, mask: torch.Tensor) -> torch.Tensor:
    """0/1 (dtype of ``mask``): the counted tokens of responses generated wholly under θ_version,
    their first token's version (``first_versions``, per token) included. A token labelled θ_v in a
    response begun under θ_{v−1} is left out: an update lands with requests in flight keeping their
    KV cache, so its context was computed under the older weights and its ℓ^μ is not log π_θv of
    the trainer's recomputation (by up to ~1e-3 a token at the tiny lab's learning rate), though
    nothing is wrong with the weights."""
    return ((versions == version) & (first_versions == version)).to(mask.dtype) * mask


def mismatch(logp: torch.Tensor, logp_behavior: torch.Tensor, on_policy: torch.Tensor,
             engines: torch.Tensor | None = None, n_engines: int = 0) -> dict[str, float]:
    """Sums over the on-policy tokens (``on_policy`` 0/1: `on_policy_tokens`, tokens the engine
    generated wholly with the weights the trainer holds) of |log π − log μ| and of the k3 estimator of KL(μ ‖ π),
    k3 = ρ − 1 − log ρ with ρ = π/μ (≥ 0; unbiased under samples from μ). Divided by ``tokens`` by
    the caller once summed over micro-batches and ranks.

    With ``engines`` ([T]: the engine that served each token's response, −1: several or unknown),
    also ``tokens/engine<i>`` and ``abs_logp_diff/engine<i>`` for every engine i < ``n_engines``,
    zero where this micro-batch has none of its tokens: every rank then sums the same keys
    (`engine_metrics` turns the totals into metrics)."""
    d = (logp.detach() - logp_behavior).clamp(-BOUND, BOUND).to(torch.float64)
    m = on_policy.to(torch.float64)
    out = {"tokens": float(m.sum()), "abs_logp_diff": float((d.abs() * m).sum()),
           "k3_kl": float(((torch.expm1(d) - d) * m).sum())}
    if engines is not None and n_engines > 0:
        slot = engines.to(torch.long) + 1  # slot 0 holds the tokens of no single engine (−1)
        tokens = torch.zeros(n_engines + 1, dtype=torch.float64, device=m.device).index_add_(0, slot, m)
        diffs = torch.zeros(n_engines + 1, dtype=torch.float64, device=m.device).index_add_(0, slot, d.abs() * m)
        for i, (n, s) in enumerate(zip(tokens[1:].tolist(), diffs[1:].tolist())):
            out[f"tokens/engine{i}"], out[f"abs_logp_diff/engine{i}"] = n, s
    return out


def engine_metrics(sums: dict[str, float]) -> dict[str, float]:
    """``mismatch/abs_logp_diff/engine<i>`` (per on-policy token) and ``mismatch/tokens/engine<i>``
    of every engine with on-policy tokens, from the sums of `mismatch` over micro-batches and ranks."""
    out = {}
    for key, n in sums.items():
        if key.startswith("tokens/engine") and n > 0:
            engine = key[len("tokens/"):]
            out[f"mismatch/abs_logp_diff/{engine}"] = sums[f"abs_logp_diff/{engine}"] / n
            out[f"mismatch/tokens/{engine}"] = int(n)
    return out
