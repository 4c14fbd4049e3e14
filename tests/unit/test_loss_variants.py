"""Tests for the M2PO decisions (pace.algo.m2po), m2po_loss, tis_pg_loss and decoupled_loss (docs/design.md §4)
against hand-computed values.

Shared per-token surrogate S(r, A) (ε_low = 0.2, ε_high = 0.28, dual clip c = 3), as in dapo_loss:
    S = max(−A·r, −A·clip(r, 0.8, 1.28)); and for A < 0, S = min(S, −A·c)

M2PO (Algorithm 1): d_t = log π_θ − log μ; trust-region tokens: A > 0 with d > 0, or A < 0 with d < 0;
       among them drop the k largest d² with k minimal such that their remaining mean d² ≤ τ;
       loss = Σ_kept −A_t·exp(d_t) / num_tokens, no clip.
M2PO (adaptive_clip, the authors' code): τ* the largest breakpoint √(d_j²) with Σ_TR min(d², d_j²) < τ·n_TR;
       ε_low = max(1 − e^−τ*, 0.3), ε_high = min(e^τ* − 1, 0.5).
Decoupled:  r_t = π_θ/π_prox, w_t = the corrected π_prox/μ;  loss = Σ_counted w_t·S(r_t, A_t) / num_tokens.
All tensors are float64 so hand values hold to 1e-12.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pace.algo import m2po
from pace.algo.correction import correct
from pace.algo.loss import dapo_loss, decoupled_loss, m2po_loss, tis_pg_loss

pytestmark = pytest.mark.unit

TOL = 1e-12
F64 = torch.float64


def t(x, grad: bool = False) -> torch.Tensor:
    return torch.tensor(x, dtype=F64, requires_grad=grad)


def paper(d, advs, mask=None, tau=0.04, num_tokens=None):
    """Algorithm 1 on (d, A) with logp_behavior = 0 and logp = d: the loss, its logp, the keep mask, the stats."""
    logp = t(d, grad=True)
    mask = torch.ones_like(logp.detach()) if mask is None else t(mask)
    keep, stats = m2po.keep_mask(logp.detach(), t(advs), mask, tau)
    n = int(mask.sum().item()) if num_tokens is None else num_tokens
    return m2po_loss(logp, torch.zeros_like(logp), t(advs), mask, keep, n), logp, keep, stats


# -------------------------------------------------------------------------------- M2PO: paper


def test_only_trust_region_tokens_are_candidates_and_their_moment_decides() -> None:
    # d = [0.5, −0.5, 0.1, 0.3], A = [1, 1, −1, −1]: trust region = token 0 only (A > 0, r > 1);
    # tokens 2, 3 have A < 0 with r > 1 and token 1 A > 0 with r < 1: a PPO clip never acts on them.
    # M2 over the trust region = 0.25 > 0.04 → drop token 0 → nothing left (mean 0): k = 1.
    # (The old all-token second moment, (0.25 + 0.25 + 0.01 + 0.09)/4 = 0.15, dropped 3 tokens.)
    out, logp, keep, stats = paper([0.5, -0.5, 0.1, 0.3], [1.0, 1.0, -1.0, -1.0])
    assert keep.tolist() == [0.0, 1.0, 1.0, 1.0]
    assert stats == {"trust_region": 1.0, "m2": 0.25, "m2_after": 0.0, "masked": 1.0}
    # kept: −A·r, no clip: −e^−0.5 + e^0.1 + e^0.3, / 4 (the pre-mask count)
    expected = (-math.exp(-0.5) + math.exp(0.1) + math.exp(0.3)) / 4
    assert out.loss.item() == pytest.approx(expected, abs=TOL)
    assert out.masked.item() == 1 and out.clipped.item() == 0


def test_kept_tokens_are_not_clipped() -> None:
    # d = [0.3, 0.1], A = 1: both trust region, M2 = (0.09 + 0.01)/2 = 0.05 ≤ τ = 0.05 → keep both.
    # r_0 = e^0.3 ≈ 1.35 > 1.28: DAPO would clip it (gradient 0); M2PO's objective is −A·r, unclipped.
    out, logp, keep, _ = paper([0.3, 0.1], [1.0, 1.0], tau=0.05)
    assert keep.tolist() == [1.0, 1.0]
    assert out.loss.item() == pytest.approx(-(math.exp(0.3) + math.exp(0.1)) / 2, abs=TOL)
    out.loss.backward()
    assert logp.grad.tolist() == pytest.approx([-math.exp(0.3) / 2, -math.exp(0.1) / 2], abs=TOL)
    ref = dapo_loss(logp.detach().requires_grad_(), torch.zeros(2, dtype=F64), t([1.0, 1.0]), torch.ones(2, dtype=F64), 2)
    assert ref.loss.item() == pytest.approx(-(1.28 + math.exp(0.1)) / 2, abs=TOL)


def test_boundary_and_minimal_count() -> None:
    # trust-region d² = [0.25, 0.25]: M2 = 0.25 ≤ τ = 0.25 → none; τ just below: dropping one leaves
    # 0.25 > τ, so both go (k = 2) and the loss is 0.
    assert paper([0.5, 0.5], [1.0, 1.0], tau=0.25)[3]["masked"] == 0
    out, _, keep, stats = paper([0.5, -0.5], [1.0, -1.0], tau=0.2499)
    assert stats["masked"] == 2 and keep.tolist() == [0.0, 0.0] and out.loss.item() == 0.0


def test_largest_by_square_among_the_trust_region_and_zero_gradient() -> None:
    # trust region: tokens 0–3 (d = 0.1, A > 0), 4 (d = 0.5, A > 0), 5 (d = −1, A < 0); token 6 (d = −2,
    # A > 0) is outside it and is kept whatever its size.
    #   k = 0: (0.04 + 0.25 + 1)/6 = 0.215; k = 1 (d = −1): 0.29/5 = 0.058; k = 2 (d = 0.5): 0.04/4 ≤ 0.04.
    d = [0.1, 0.1, 0.1, 0.1, 0.5, -1.0, -2.0]
    advs = [1.0, 1.0, 2.0, 0.5, 1.0, -1.0, 1.0]
    out, logp, keep, stats = paper(d, advs)
    assert keep.tolist() == [1, 1, 1, 1, 0, 0, 1]
    assert stats["trust_region"] == 6 and stats["m2"] == pytest.approx(1.29 / 6, abs=TOL)
    assert stats["m2_after"] == pytest.approx(0.01, abs=TOL)
    r = math.exp(0.1)
    assert out.loss.item() == pytest.approx((-4.5 * r - math.exp(-2.0)) / 7, abs=TOL)
    out.loss.backward()
    assert logp.grad[4:6].tolist() == [0.0, 0.0]


def test_padding_never_counts_nor_gets_kept() -> None:
    # token 4 is padding with d = 5: if it counted, M2 would be huge; it is never kept either.
    out, _, keep, stats = paper([0.0, 0.1, 0.1, 1.0, 5.0], [1.0] * 5, mask=[1, 1, 1, 1, 0], num_tokens=4)
    # trust region (d > 0, A > 0): tokens 1, 2, 3 → (0.01 + 0.01 + 1)/3 > 0.04 → drop d = 1 → 0.01
    assert keep.tolist() == [1, 1, 1, 0, 0] and stats["masked"] == 1 and stats["trust_region"] == 3


def test_the_decision_over_a_batch_differs_from_per_micro_batch_decisions() -> None:
    # Two micro-batches: [0.3] alone has M2 = 0.09 > 0.04 (masked); with [0.01 ×4] beside it the batch
    # moment (0.09 + 4·0.0001)/5 ≈ 0.018 ≤ 0.04 keeps it. The trainer decides on the whole batch.
    d, a = t([0.3, 0.01, 0.01, 0.01, 0.01]), torch.ones(5, dtype=F64)
    whole, _ = m2po.keep_mask(d, a, torch.ones(5, dtype=F64), 0.04)
    first, _ = m2po.keep_mask(d[:1], a[:1], torch.ones(1, dtype=F64), 0.04)
    assert whole.tolist() == [1.0] * 5 and first.tolist() == [0.0]


@settings(max_examples=200, deadline=None)
@given(data=st.lists(st.tuples(st.floats(-2.0, 2.0, allow_nan=False), st.sampled_from([-1.0, 0.0, 1.0]), st.booleans()),
                     min_size=1, max_size=40),
       tau=st.floats(0.001, 0.5))
def test_masking_is_sufficient_and_minimal_over_the_trust_region(data, tau) -> None:
    d, a, mask = t([x for x, _, _ in data]), t([y for _, y, _ in data]), t([1.0 if m else 0.0 for *_, m in data])
    keep, stats = m2po.keep_mask(d, a, mask, tau)
    tr = [(x > 0 and y > 0) or (x < 0 and y < 0) for x, y, _ in data]
    for (x, y, m), kp, in_tr in zip(data, keep.tolist(), tr):
        if not m:
            assert kp == 0  # padding is never kept
        elif not in_tr:
            assert kp == 1  # outside the trust region: always kept
    kept = [x * x for (x, _, m), kp, in_tr in zip(data, keep.tolist(), tr) if m and in_tr and kp]
    dropped = [x * x for (x, _, m), kp, in_tr in zip(data, keep.tolist(), tr) if m and in_tr and not kp]
    assert len(dropped) == stats["masked"]
    if dropped and kept:
        assert min(dropped) >= max(kept)
    assert (sum(kept) / len(kept) if kept else 0.0) <= tau + 1e-12  # sufficient
    if dropped:  # minimal: putting back the smallest dropped would exceed τ
        back = kept + [min(dropped)]
        assert sum(back) / len(back) > tau - 1e-12


# ------------------------------------------------------------------------ M2PO: adaptive_clip


def test_radius_is_the_largest_breakpoint_within_the_budget() -> None:
    # v = d² = [0.01, 0.04, 0.09, 0.25], S = 0.04·4 = 0.16. Σ min(v, v_j): j=0 0.04, j=1 0.13, j=2 0.23 ≥ S
    # → τ*² = v_1 = 0.04, τ* = 0.2.
    assert m2po.solve_radius(t([0.01, 0.04, 0.09, 0.25]), 0.16) == pytest.approx(0.2, abs=TOL)
    assert m2po.solve_radius(t([1.0, 1.0]), 0.08) == 0.0  # capping at the smallest already exceeds S


def test_adaptive_clip_within_the_budget_leaves_the_ratio_unclipped() -> None:
    ones = torch.ones(2, dtype=F64)
    # M2 = 0.05² = 0.0025 ≤ τ = 0.04: τ* = ∞ → ε_low = max(1 − e^−∞, 0.3) = 1, ε_high = max(e^∞ − 1, 0.5) = ∞
    # (the authors: clip_low 0, clip_high 100000 → no clip on either side)
    eps_low, eps_high, stats = m2po.adaptive_clip(t([0.05, 0.05]), ones, ones, 0.04)
    assert (eps_low, eps_high, stats["binds"]) == (1.0, math.inf, 0.0)
    # no trust-region tokens at all (A > 0 with r < 1): the same
    assert m2po.adaptive_clip(t([-1.0, -1.0]), ones, ones, 0.04)[:2] == (1.0, math.inf)
    # an unclipped ratio far above 1.5 keeps its whole gradient
    logp = t([2.0, 2.0], grad=True)
    out = dapo_loss(logp, torch.zeros(2, dtype=F64), ones, ones, 2, eps_low=1.0, eps_high=math.inf, clip_ratio_c=None)
    assert out.loss.item() == pytest.approx(-math.exp(2.0), abs=1e-9) and out.clipped.item() == 0


def test_adaptive_clip_binding_with_a_small_radius_clips_at_the_floors() -> None:
    d = t([0.1, 0.2, 0.3, 0.5])  # all A > 0 with r > 1: the trust region
    adv = torch.ones(4, dtype=F64)
    eps_low, eps_high, stats = m2po.adaptive_clip(d, adv, torch.ones(4, dtype=F64), 0.04)
    # v = d² = [0.01, 0.04, 0.09, 0.25], M2 = 0.0975 > τ; S = 0.16: Σ min(v, v_j) = 0.04, 0.13, 0.23 → τ* = 0.2
    assert stats["radius"] == pytest.approx(0.2, abs=TOL) and stats["binds"] == 1.0
    assert stats["m2"] == pytest.approx(0.39 / 4, abs=TOL) and stats["m2_after"] == pytest.approx(0.13 / 4, abs=TOL)
    assert eps_low == 0.3  # max(1 − e^−0.2 = 0.1813, 0.3)
    assert eps_high == 0.5  # max(e^0.2 − 1 = 0.2214, 0.5): the floor, not the radius
    logp = d.clone().requires_grad_()
    out = dapo_loss(logp, torch.zeros(4, dtype=F64), adv, torch.ones(4, dtype=F64), 4, eps_low=eps_low,
                    eps_high=eps_high, clip_ratio_c=None)
    # r = e^0.1, e^0.2, e^0.3 < 1.5 stay; e^0.5 = 1.6487 is clipped to 1.5
    assert out.loss.item() == pytest.approx(-(math.exp(0.1) + math.exp(0.2) + math.exp(0.3) + 1.5) / 4, abs=1e-9)
    assert out.clipped.item() == 1
    # radius 0: ε_low = max(0, 0.3), ε_high = max(0, 0.5)
    ones = torch.ones(2, dtype=F64)
    assert m2po.adaptive_clip(t([1.0, 1.0]), ones, ones, 0.04)[:2] == (0.3, 0.5)


def test_adaptive_clip_binding_with_a_large_radius_clips_at_the_radius() -> None:
    # v = [0.25, 0.49, 4.0], τ = 0.5 → S = 1.5, M2 = 1.58 > τ. Σ min(v, v_j): j=0 0.75, j=1 1.23, j=2 4.74 ≥ S
    # → τ*² = 0.49, τ* = 0.7: ε_high = e^0.7 − 1 = 1.0138 (above the floor 0.5), ε_low = max(1 − e^−0.7 = 0.5034, 0.3)
    d, ones = t([0.5, 0.7, 2.0]), torch.ones(3, dtype=F64)
    eps_low, eps_high, stats = m2po.adaptive_clip(d, ones, ones, 0.5)
    assert stats["radius"] == pytest.approx(0.7, abs=TOL)
    assert eps_high == pytest.approx(math.exp(0.7) - 1, abs=TOL) and eps_high == pytest.approx(1.013753, abs=1e-6)
    assert eps_low == pytest.approx(1 - math.exp(-0.7), abs=TOL) and eps_low == pytest.approx(0.503415, abs=1e-6)


# -------------------------------------------------------------------- TIS under the behaviour ref


def test_tis_policy_gradient_hand_values() -> None:
    # r = π_θ/μ = [3, 0.5], A = [1, −1], C = 2 → w = [2, 0.5]; value −A·w / 2 = (−2 + 0.5)/2 = −0.75;
    # ∂L/∂log π = −A·w / n = [−1, 0.25] (no clip).
    lb = t([-1.0, -2.0])
    logp = (lb + t([math.log(3.0), math.log(0.5)])).detach().requires_grad_()
    mask = torch.ones(2, dtype=F64)
    c = correct(logp.detach() - lb, mask, torch.tensor([0, 1]), 2, "tis", "token", 2.0)
    out = tis_pg_loss(logp, lb, t([1.0, -1.0]), mask, c.weight, 2)
    assert out.loss.item() == pytest.approx(-0.75, abs=TOL)
    out.loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1.0, 0.25], abs=TOL)
    assert c.truncated.item() == 1 and out.weight_sum.item() == pytest.approx(2.5, abs=TOL)


def test_a_rejection_weight_removes_tokens_from_the_dapo_loss() -> None:
    logp = t([0.1, 3.0], grad=True)
    out = dapo_loss(logp, torch.zeros(2, dtype=F64), t([1.0, -1.0]), torch.ones(2, dtype=F64), 2, weight=t([1.0, 0.0]))
    assert out.loss.item() == pytest.approx(-math.exp(0.1) / 2, abs=TOL)
    out.loss.backward()
    assert logp.grad[1].item() == 0.0 and out.clipped.item() == 0  # the masked token's dual clip is not counted


# ----------------------------------------------------------------------------------- decoupled


def test_decoupled_equals_dapo_when_prox_is_behavior() -> None:
    g = torch.Generator().manual_seed(1)
    logp = (torch.randn(3, 5, generator=g, dtype=F64) * 0.5).requires_grad_()
    lb = torch.randn(3, 5, generator=g, dtype=F64) * 0.5
    adv = torch.randn(3, 1, generator=g, dtype=F64).expand(3, 5)
    mask = t([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    ref = dapo_loss(logp, lb, adv, mask, 10)
    (g_ref,) = torch.autograd.grad(ref.loss, logp)
    out = decoupled_loss(logp, lb.clone(), lb, adv, mask, 10)
    (g_out,) = torch.autograd.grad(out.loss, logp)
    assert out.loss.item() == ref.loss.item()
    assert out.clipped.item() == ref.clipped.item()
    assert out.ratio_sum.item() == ref.ratio_sum.item()
    assert torch.equal(g_out, g_ref)
    assert out.weight_sum.item() == 10.0  # w = exp(0) = 1 on every counted token


def test_decoupled_hand_values_weight_and_clip_on_prox_ratio() -> None:
    # μ: log μ = 0.  Token 0: π_prox/μ = 1.5 → w = 1.5; π_θ/π_prox = 1.1 (inside [0.8, 1.28]), A = 1
    #   → L = 1.5 · (−1.1) = −1.65. (π_θ/μ = 1.65 would be clipped to 1.28 by dapo_loss:
    #   the clip acts on the ratio to π_prox.)
    # Token 1: w = 1.5; r = 1.5 > 1.28, A = 1 → clipped: 1.5 · (−1.28) = −1.92; counts as clipped.
    # Token 2: π_prox/μ = 4 > C = 2 → w = 2 (TIS); r = 1, A = −1 → L = 2 · 1 = 2.
    # Token 3: π_prox/μ = 0.5 → w = 0.5; r = 0.9, A = −2 → L = 0.5 · 1.8 = 0.9.
    lprox = t([math.log(1.5), math.log(1.5), math.log(4.0), math.log(0.5)])
    lr = t([math.log(1.1), math.log(1.5), 0.0, math.log(0.9)])
    logp = (lprox + lr).detach().requires_grad_()
    adv = t([1.0, 1.0, -1.0, -2.0])
    ones, seqs = torch.ones(4, dtype=F64), torch.arange(4)
    w = correct(lprox, ones, seqs, 4, "tis", "token", 2.0).weight  # TIS at C = 2 (log μ = 0)
    out = decoupled_loss(logp, lprox, torch.zeros(4, dtype=F64), adv, ones, 4, weight=w)
    assert out.loss.item() == pytest.approx((-1.65 - 1.92 + 2.0 + 0.9) / 4, abs=TOL)
    assert out.clipped.item() == 1
    assert out.ratio_sum.item() == pytest.approx(1.1 + 1.5 + 1.0 + 0.9, abs=TOL)
    assert out.weight_sum.item() == pytest.approx(1.5 + 1.5 + 2.0 + 0.5, abs=TOL)
    # Without a correction, token 2 keeps w = 4 → L = 4.
    out = decoupled_loss(logp, lprox, torch.zeros(4, dtype=F64), adv, ones, 4)
    assert out.loss.item() == pytest.approx((-1.65 - 1.92 + 4.0 + 0.9) / 4, abs=TOL)
    raw = correct(lprox, ones, seqs, 4, "none").weight
    out = decoupled_loss(logp, lprox, torch.zeros(4, dtype=F64), adv, ones, 4, weight=raw)
    assert out.loss.item() == pytest.approx((-1.65 - 1.92 + 4.0 + 0.9) / 4, abs=TOL)


def test_decoupled_single_token_weight_scales_loss() -> None:
    # r = 1.1 inside the range, w = 1.5 → loss = 1.5 × the dapo loss at ratio 1.1 (= −1.1 for A = 1).
    lprox = t([math.log(1.5)])
    logp = (lprox + math.log(1.1)).detach().requires_grad_()
    out = decoupled_loss(logp, lprox, t([0.0]), t([1.0]), t([1.0]), 1)
    ref = dapo_loss(logp, lprox, t([1.0]), t([1.0]), 1)
    assert ref.loss.item() == pytest.approx(-1.1, abs=TOL)
    assert out.loss.item() == pytest.approx(1.5 * ref.loss.item(), abs=TOL)


def test_decoupled_weights_are_detached_gradient_only_through_ratio() -> None:
    # Unclipped token: dL/dlogp = w · (−A·r) / N; prox and behaviour get no gradient.
    lprox = t([math.log(1.5), math.log(4.0)], grad=True)
    lb = t([0.0, 0.0], grad=True)
    logp = (lprox.detach() + t([math.log(1.1), math.log(1.2)])).requires_grad_()
    adv = t([1.0, -1.0])
    n = 3
    w = correct(lprox - lb, torch.ones(2, dtype=F64), torch.arange(2), 2, "tis", "token", 2.0).weight
    out = decoupled_loss(logp, lprox, lb, adv, torch.ones(2, dtype=F64), n, weight=w)
    out.loss.backward()
    assert logp.grad.tolist() == pytest.approx([1.5 * -1.1 / n, 2.0 * 1.2 / n], abs=TOL)
    assert lprox.grad is None and lb.grad is None
    assert not out.weight_sum.requires_grad and not out.ratio_sum.requires_grad


def test_decoupled_masked_tokens_contribute_nothing() -> None:
    lprox = t([0.0, math.log(100.0)])
    logp = t([math.log(1.1), math.log(5000.0)], grad=True)
    out = decoupled_loss(logp, lprox, t([0.0, 0.0]), t([1.0, -100.0]), t([1.0, 0.0]), 1)
    assert out.loss.item() == pytest.approx(-1.1, abs=TOL)
    assert out.weight_sum.item() == pytest.approx(1.0, abs=TOL)
    out.loss.backward()
    assert logp.grad[1].item() == 0.0


def test_decoupled_with_a_rejection_weight_drops_the_masked_tokens() -> None:
    # MIS at C = 2 (lower 0.5) on ρ = π_prox/μ = [1.5, 4]: token 1 is masked, token 0 keeps w = 1.5.
    lprox = t([math.log(1.5), math.log(4.0)])
    logp = (lprox + math.log(1.1)).detach().requires_grad_()
    ones = torch.ones(2, dtype=F64)
    c = correct(lprox, ones, torch.arange(2), 2, "mis", "token", 2.0)
    out = decoupled_loss(logp, lprox, torch.zeros(2, dtype=F64), t([1.0, 1.0]), ones, 2, weight=c.weight)
    assert c.masked.item() == 1 and out.loss.item() == pytest.approx(1.5 * -1.1 / 2, abs=TOL)
    out.loss.backward()
    assert logp.grad[1].item() == 0.0
