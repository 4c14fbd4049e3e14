"""Tests for pace.algo.loss.m2po_loss and decoupled_loss (DESIGN §4) against hand-computed values.

Shared per-token surrogate S(r, A) (ε_low = 0.2, ε_high = 0.28, dual clip c = 3), as in dapo_loss:
    S = max(−A·r, −A·clip(r, 0.8, 1.28)); and for A < 0, S = min(S, −A·c)

M2PO:  d_t = logp_t − logp_behavior_t; over the counted tokens, drop the k largest d_t² with k minimal
       such that mean(d² of the remaining counted tokens) ≤ τ;  loss = Σ_kept S(exp d_t, A_t) / num_tokens.
Decoupled:  r_t = π_θ/π_prox, w_t = min(π_prox/μ, is_cap);  loss = Σ_counted w_t·S(r_t, A_t) / num_tokens.
All tensors are float64 so hand values hold to 1e-12.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pace.algo.loss import dapo_loss, decoupled_loss, m2_keep_mask, m2po_loss

pytestmark = pytest.mark.unit

TOL = 1e-12
F64 = torch.float64


def t(x, grad: bool = False) -> torch.Tensor:
    return torch.tensor(x, dtype=F64, requires_grad=grad)


def m2po(d, advs, mask=None, num_tokens=None, **kw):
    """m2po_loss with logp_behavior = 0 and logp = d, so d_t (and log r_t) is exactly what we pass."""
    logp = t(d, grad=True)
    lb = torch.zeros_like(logp)
    mask = torch.ones_like(lb) if mask is None else t(mask)
    n = int(mask.sum().item()) if num_tokens is None else num_tokens
    return m2po_loss(logp, lb, t(advs), mask, n, **kw), logp


# ---------------------------------------------------------------------------------------- M2PO


def test_m2po_no_masking_when_second_moment_below_threshold_equals_dapo() -> None:
    # d = [0.1, −0.1, 0.2, 0]: d² = [0.01, 0.01, 0.04, 0] → M2 = 0.06 / 4 = 0.015 ≤ 0.04 → mask nothing.
    d, advs = [0.1, -0.1, 0.2, 0.0], [1.0, -1.0, 0.5, -2.0]
    out, logp = m2po(d, advs, m2_threshold=0.04)
    ref = dapo_loss(logp, torch.zeros_like(logp), t(advs), torch.ones(4, dtype=F64), 4)
    assert out.loss.item() == ref.loss.item()
    assert out.clipped.item() == ref.clipped.item()
    assert out.ratio_sum.item() == ref.ratio_sum.item()
    assert out.masked.item() == 0


def test_m2po_boundary_m2_equal_to_threshold_masks_nothing() -> None:
    # d = [0.5, −0.5]: d² = [0.25, 0.25] → M2 = 0.25 (exact in binary) ≤ τ = 0.25 → nothing masked.
    out, _ = m2po([0.5, -0.5], [1.0, 1.0], m2_threshold=0.25)
    assert out.masked.item() == 0
    # τ just below → M2 > τ; dropping one leaves 0.25 > τ, so both go: k = 2, loss 0.
    out, _ = m2po([0.5, -0.5], [1.0, 1.0], m2_threshold=0.2499)
    assert out.masked.item() == 2
    assert out.loss.item() == 0.0


def test_m2po_masks_the_single_outlier() -> None:
    # d = [0, 0, 0, 1]: d² = [0, 0, 0, 1] → M2 = 0.25 > 0.04; drop the 1 → remaining mean 0 ≤ 0.04; k = 1.
    # Kept tokens: r = 1, A = 1 → S = −1 each → loss = −3 / 4 (num_tokens stays 4, the pre-mask count).
    # (Unmasked, token 3 has r = e ≈ 2.718 < c, A = −1 → S = e, so dapo_loss would be (−3 + e)/4.)
    d, advs = [0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, -1.0]
    out, logp = m2po(d, advs)
    assert out.masked.item() == 1
    assert out.loss.item() == pytest.approx(-3.0 / 4, abs=TOL)
    ref = dapo_loss(logp, torch.zeros_like(logp), t(advs), t([1.0, 1.0, 1.0, 0.0]), 4)
    assert out.loss.item() == ref.loss.item()
    full = dapo_loss(logp, torch.zeros_like(logp), t(advs), torch.ones(4, dtype=F64), 4)
    assert full.loss.item() == pytest.approx((-3.0 + math.e) / 4, abs=TOL)
    # ratio_sum stays over all counted tokens (staleness metric): 3 + e; clips only on kept tokens: 0.
    assert out.ratio_sum.item() == pytest.approx(3.0 + math.e, abs=TOL)
    assert out.clipped.item() == 0


def test_m2po_masks_two_tokens_largest_by_square_and_zero_gradient() -> None:
    # d = [0.1, 0.1, 0.1, 0.1, 0.5, −1.0]: d² = [0.01, 0.01, 0.01, 0.01, 0.25, 1.0]
    #   k = 0: (0.04 + 0.25 + 1.0) / 6 = 0.215 > 0.04
    #   k = 1 (drop d = −1.0, largest d² though smallest d): (0.04 + 0.25) / 5 = 0.058 > 0.04
    #   k = 2 (drop d = 0.5): 0.04 / 4 = 0.01 ≤ 0.04  → k = 2
    # Kept: r = e^0.1 ≈ 1.105 ∈ [0.8, 1.28] so S = −A·r; A = [1, −1, 2, 0.5] → Σ = −2.5·e^0.1; / 6.
    d = [0.1, 0.1, 0.1, 0.1, 0.5, -1.0]
    advs = [1.0, -1.0, 2.0, 0.5, 1.0, -1.0]
    out, logp = m2po(d, advs)
    assert out.masked.item() == 2
    r = math.exp(0.1)
    assert out.loss.item() == pytest.approx(-2.5 * r / 6, abs=TOL)
    out.loss.backward()
    # gradient of a kept unclipped token: −A·r / N; masked tokens: exactly 0.
    assert logp.grad[:4].tolist() == pytest.approx([-a * r / 6 for a in advs[:4]], abs=TOL)
    assert logp.grad[4:].tolist() == [0.0, 0.0]


def test_m2po_padding_never_counts_nor_gets_masked() -> None:
    # Token 4 is padding with d = 5 (d² = 25): if it counted, M2 would be huge. Counted d = [0, 0, 0, 1]
    # → M2 = 0.25 > 0.04 → exactly one counted token (d = 1) is masked; padding is not in `masked`.
    out, logp = m2po([0.0, 0.0, 0.0, 1.0, 5.0], [1.0, 1.0, 1.0, 1.0, -1.0], mask=[1, 1, 1, 1, 0], num_tokens=4)
    assert out.masked.item() == 1
    assert out.loss.item() == pytest.approx(-3.0 / 4, abs=TOL)
    # Counted d = [0.1]*4 → M2 = 0.01 ≤ 0.04: nothing masked despite the padding outlier; equals dapo.
    d, advs, mask = [0.1, 0.1, 0.1, 0.1, 5.0], [1.0, -1.0, 1.0, 1.0, -1.0], [1, 1, 1, 1, 0]
    out, logp = m2po(d, advs, mask=mask, num_tokens=4)
    assert out.masked.item() == 0
    ref = dapo_loss(logp, torch.zeros_like(logp), t(advs), t(mask), 4)
    assert out.loss.item() == ref.loss.item()
    # The keep-mask leaves padding at 0 and never "unmasks" it.
    keep, k = m2_keep_mask(t([0.0, 0.0, 0.0, 1.0, 5.0]), t([1, 1, 1, 1, 0]), 0.04)
    assert keep.tolist() == [1, 1, 1, 0, 0] and k == 1


def test_m2po_2d_batch_with_padding() -> None:
    # [B, T] = [2, 3]; row 1 has padding (d = 9 there, never counted).
    # Counted d = [0, 0, 0 | 0, 2] → d² = [0, 0, 0, 0, 4] → M2 = 0.8 > 0.04; drop the 2 → 0 ≤ 0.04; k = 1.
    d = t([[0.0, 0.0, 0.0], [0.0, 2.0, 9.0]], grad=True)
    adv = t([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    out = m2po_loss(d, torch.zeros_like(d), adv, mask, 5)
    assert out.masked.item() == 1
    # kept: r = 1 → S = −A: −1, −1, −1, +1 → Σ = −2; / 5.
    assert out.loss.item() == pytest.approx(-2.0 / 5, abs=TOL)
    out.loss.backward()
    assert d.grad[1, 1].item() == 0.0 and d.grad[1, 2].item() == 0.0


def test_m2po_outputs_scalars_and_detached() -> None:
    out, _ = m2po([0.0, 1.0], [1.0, 1.0])
    assert out.loss.shape == () and out.masked.shape == () and out.clipped.shape == ()
    assert out.loss.requires_grad
    assert not out.masked.requires_grad and not out.clipped.requires_grad and not out.ratio_sum.requires_grad


@settings(max_examples=200, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.floats(-2.0, 2.0, allow_nan=False), st.booleans()), min_size=1, max_size=40
    ),
    tau=st.floats(0.001, 0.5),
)
def test_m2po_masking_is_sufficient_and_minimal(data, tau) -> None:
    d = t([x for x, _ in data])
    mask = t([1.0 if m else 0.0 for _, m in data])
    keep, k = m2_keep_mask(d, mask, tau)
    counted = [x * x for x, m in data if m]
    kept = [x * x for (x, m), kp in zip(data, keep.tolist()) if m and kp]
    dropped = [x * x for (x, m), kp in zip(data, keep.tolist()) if m and not kp]
    # padding is never kept; exactly k counted tokens dropped
    assert all(kp == 0 for (_, m), kp in zip(data, keep.tolist()) if not m)
    assert len(dropped) == k and len(kept) + k == len(counted)
    # the dropped tokens are the largest d²
    if dropped and kept:
        assert min(dropped) >= max(kept)
    # sufficient: the remaining mean is ≤ τ (empty remainder counts as 0)
    mean_kept = sum(kept) / len(kept) if kept else 0.0
    assert mean_kept <= tau + 1e-12
    # minimal: putting back the smallest dropped token would exceed τ
    if dropped:
        back = kept + [min(dropped)]
        assert sum(back) / len(back) > tau - 1e-12
    # the loss reports the same count
    out = m2po_loss(d, torch.zeros_like(d), torch.ones_like(d), mask, max(len(counted), 1), m2_threshold=tau)
    assert out.masked.item() == k


# ----------------------------------------------------------------------------------- decoupled


def test_decoupled_equals_dapo_when_prox_is_behavior() -> None:
    g = torch.Generator().manual_seed(1)
    logp = (torch.randn(3, 5, generator=g, dtype=F64) * 0.5).requires_grad_()
    lb = torch.randn(3, 5, generator=g, dtype=F64) * 0.5
    adv = torch.randn(3, 1, generator=g, dtype=F64).expand(3, 5)
    mask = t([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    ref = dapo_loss(logp, lb, adv, mask, 10)
    (g_ref,) = torch.autograd.grad(ref.loss, logp)
    out = decoupled_loss(logp, lb.clone(), lb, adv, mask, 10, is_cap=2.0)
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
    # Token 2: π_prox/μ = 4 > is_cap = 2 → w = 2; r = 1, A = −1 → L = 2 · 1 = 2.
    # Token 3: π_prox/μ = 0.5 → w = 0.5; r = 0.9, A = −2 → L = 0.5 · 1.8 = 0.9.
    lprox = t([math.log(1.5), math.log(1.5), math.log(4.0), math.log(0.5)])
    lr = t([math.log(1.1), math.log(1.5), 0.0, math.log(0.9)])
    logp = (lprox + lr).detach().requires_grad_()
    adv = t([1.0, 1.0, -1.0, -2.0])
    out = decoupled_loss(logp, lprox, torch.zeros(4, dtype=F64), adv, torch.ones(4, dtype=F64), 4, is_cap=2.0)
    assert out.loss.item() == pytest.approx((-1.65 - 1.92 + 2.0 + 0.9) / 4, abs=TOL)
    assert out.clipped.item() == 1
    assert out.ratio_sum.item() == pytest.approx(1.1 + 1.5 + 1.0 + 0.9, abs=TOL)
    assert out.weight_sum.item() == pytest.approx(1.5 + 1.5 + 2.0 + 0.5, abs=TOL)
    # Without a cap, token 2 keeps w = 4 → L = 4.
    out = decoupled_loss(logp, lprox, torch.zeros(4, dtype=F64), adv, torch.ones(4, dtype=F64), 4, is_cap=None)
    assert out.loss.item() == pytest.approx((-1.65 - 1.92 + 4.0 + 0.9) / 4, abs=TOL)


def test_decoupled_single_token_weight_scales_loss() -> None:
    # r = 1.1 inside the range, w = 1.5 → loss = 1.5 × the dapo loss at ratio 1.1 (= −1.1 for A = 1).
    lprox = t([math.log(1.5)])
    logp = (lprox + math.log(1.1)).detach().requires_grad_()
    out = decoupled_loss(logp, lprox, t([0.0]), t([1.0]), t([1.0]), 1, is_cap=2.0)
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
    out = decoupled_loss(logp, lprox, lb, adv, torch.ones(2, dtype=F64), n, is_cap=2.0)
    out.loss.backward()
    assert logp.grad.tolist() == pytest.approx([1.5 * -1.1 / n, 2.0 * 1.2 / n], abs=TOL)
    assert lprox.grad is None and lb.grad is None
    assert not out.weight_sum.requires_grad and not out.ratio_sum.requires_grad


def test_decoupled_masked_tokens_contribute_nothing() -> None:
    lprox = t([0.0, math.log(100.0)])
    logp = t([math.log(1.1), math.log(5000.0)], grad=True)
    out = decoupled_loss(logp, lprox, t([0.0, 0.0]), t([1.0, -100.0]), t([1.0, 0.0]), 1, is_cap=None)
    assert out.loss.item() == pytest.approx(-1.1, abs=TOL)
    assert out.weight_sum.item() == pytest.approx(1.0, abs=TOL)
    out.loss.backward()
    assert logp.grad[1].item() == 0.0


def test_decoupled_is_cap_must_be_given() -> None:
    x = t([0.0])
    with pytest.raises(TypeError):
        decoupled_loss(x, x, x, x, torch.ones(1, dtype=F64), 1)  # type: ignore[call-arg]
