"""Tests for pace.algo.loss.dapo_loss against hand-computed per-token values.

Per token (ε_low = 0.2, ε_high = 0.28, dual clip c):
    r = exp(logp − logp_behavior)
    L = max(−A·r, −A·clip(r, 0.8, 1.28)); and for A < 0, L = min(L, −A·c)
    loss = Σ_counted L / num_tokens
All tensors are float64 so hand values hold to 1e-12.
"""
from __future__ import annotations

import math

import pytest
import torch

from pace.algo.loss import dapo_loss

pytestmark = pytest.mark.unit

TOL = 1e-12


def run(ratios, advs, mask=None, num_tokens=None, **kw):
    """dapo_loss with logp_behavior = 0 and logp = log(ratio), so r_t is exactly what we pass."""
    logp = torch.tensor([math.log(r) for r in ratios], dtype=torch.float64, requires_grad=True)
    lb = torch.zeros_like(logp)
    adv = torch.tensor(advs, dtype=torch.float64)
    mask = torch.ones_like(lb) if mask is None else torch.tensor(mask, dtype=torch.float64)
    n = int(mask.sum().item()) if num_tokens is None else num_tokens
    return dapo_loss(logp, lb, adv, mask, n, **kw), logp


# (ratio, advantage, expected per-token loss, clipped?)  with ε_low 0.2, ε_high 0.28, c = 3
CASES = [
    # inside [0.8, 1.28]: unclipped, −A·r
    (1.1, 1.0, -1.1, False),
    (0.9, -2.0, 1.8, False),
    (1.0, 0.5, -0.5, False),
    # A > 0, r > 1.28: clipped to −A·1.28
    (1.5, 1.0, -1.28, True),
    (2.0, 0.5, -0.64, True),
    # A > 0, r < 0.8: pessimistic max keeps −A·r (no clip)
    (0.5, 1.0, -0.5, False),
    # A < 0, r < 0.8: clipped to −A·0.8
    (0.5, -1.0, 0.8, True),
    (0.1, -2.0, 1.6, True),
    # A < 0, 1.28 < r < c: −A·r (no clip, below the dual bound 3·|A|)
    (1.5, -1.0, 1.5, False),
    (2.5, -2.0, 5.0, False),
    # A < 0, r > c: dual clip → −A·c = 3·|A|
    (5.0, -1.0, 3.0, True),
    (4.0, -0.5, 1.5, True),
    # A = 0: nothing
    (7.0, 0.0, 0.0, False),
]


@pytest.mark.parametrize("ratio, adv, expected, clipped", CASES)
def test_per_token_hand_values(ratio: float, adv: float, expected: float, clipped: bool) -> None:
    out, _ = run([ratio], [adv], num_tokens=1, eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)
    assert out.loss.item() == pytest.approx(expected, abs=TOL)
    assert out.clipped.item() == (1.0 if clipped else 0.0)
    assert out.ratio_sum.item() == pytest.approx(ratio, abs=TOL)


def test_batch_of_all_cases_is_the_token_mean_and_counts_clips() -> None:
    ratios, advs, expected, clipped = zip(*CASES)
    out, _ = run(list(ratios), list(advs))
    assert out.loss.item() == pytest.approx(sum(expected) / len(CASES), abs=TOL)
    assert out.clipped.item() == sum(clipped)
    assert out.ratio_sum.item() == pytest.approx(sum(ratios), abs=1e-9)


def test_no_dual_clip_when_c_is_none() -> None:
    # A = −1, r = 5: without the dual clip the loss is −A·r = 5 and nothing is clipped.
    out, _ = run([5.0], [-1.0], clip_ratio_c=None)
    assert out.loss.item() == pytest.approx(5.0, abs=TOL)
    assert out.clipped.item() == 0
    # ... with it, 3.
    out, _ = run([5.0], [-1.0], clip_ratio_c=3.0)
    assert out.loss.item() == pytest.approx(3.0, abs=TOL)


def test_dual_clip_does_not_touch_positive_advantages() -> None:
    # A = +1, r = 5 > c: clip-higher gives −1.28; the dual clip (A < 0 only) must not apply.
    out, _ = run([5.0], [1.0], clip_ratio_c=3.0)
    assert out.loss.item() == pytest.approx(-1.28, abs=TOL)


def test_dual_clip_bound_from_config_value() -> None:
    # The Qwen3-8B presets use c = 10: A = −1, r = 5 stays unclipped (5 < 10); r = 20 → 10.
    out, _ = run([5.0, 20.0], [-1.0, -1.0], num_tokens=1, clip_ratio_c=10.0)
    assert out.loss.item() == pytest.approx(5.0 + 10.0, abs=1e-9)
    assert out.clipped.item() == 1


def test_clip_range_follows_eps_arguments() -> None:
    # ε_high = 0.5: r = 1.4 is inside → −1.4; ε_low = 0.1: A < 0, r = 0.85 is below 0.9 → 0.9.
    out, _ = run([1.4, 0.85], [1.0, -1.0], num_tokens=1, eps_low=0.1, eps_high=0.5)
    assert out.loss.item() == pytest.approx(-1.4 + 0.9, abs=TOL)
    assert out.clipped.item() == 1


def test_masked_tokens_contribute_nothing() -> None:
    # Token 2 is masked and would dominate (A = −100, r = 50); its loss, clip, ratio and grad vanish.
    out, logp = run([1.1, 0.9, 50.0], [1.0, -1.0, -100.0], mask=[1, 1, 0], num_tokens=2)
    assert out.loss.item() == pytest.approx((-1.1 + 0.9) / 2, abs=TOL)
    assert out.clipped.item() == 0
    assert out.ratio_sum.item() == pytest.approx(2.0, abs=TOL)
    out.loss.backward()
    assert logp.grad[2].item() == 0.0


def test_token_level_normalisation_2d_and_micro_batches() -> None:
    # [B, T] = [2, 3] batch with padding; num_tokens counts the masked-in tokens of the whole batch.
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(2, 3, generator=g, dtype=torch.float64) * 0.5
    lb = torch.randn(2, 3, generator=g, dtype=torch.float64) * 0.5
    adv = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.float64)
    n = 4
    whole = dapo_loss(logp, lb, adv, mask, n)
    # Sum over tokens / number of tokens, not a mean of per-sequence means.
    per_token = []
    for i in range(2):
        for t in range(3):
            if mask[i, t]:
                per_token.append(dapo_loss(logp[i, t : t + 1], lb[i, t : t + 1], adv[i, t : t + 1], mask[i, t : t + 1], 1).loss.item())
    assert whole.loss.item() == pytest.approx(sum(per_token) / n, abs=TOL)
    seq_mean = (sum(per_token[:3]) / 3 + per_token[3]) / 2
    assert whole.loss.item() != pytest.approx(seq_mean, abs=1e-6)  # guards against sequence-level averaging
    # Two micro-batches (one row each), both normalised by the whole batch's count, sum to the whole.
    parts = [dapo_loss(logp[i : i + 1], lb[i : i + 1], adv[i : i + 1], mask[i : i + 1], n) for i in range(2)]
    assert sum(p.loss.item() for p in parts) == pytest.approx(whole.loss.item(), abs=TOL)
    assert sum(p.clipped.item() for p in parts) == whole.clipped.item()
    assert sum(p.ratio_sum.item() for p in parts) == pytest.approx(whole.ratio_sum.item(), abs=TOL)


def test_gradient_of_unclipped_token_is_minus_a_ratio_over_n() -> None:
    # d/dlogp [−A·exp(logp − lb)] / N = −A·r / N for an unclipped token; 0 for a clipped one.
    n = 5  # num_tokens of the whole mini-batch, larger than this micro-batch
    ratios = [1.1, 0.9, 1.5, 0.5, 5.0]
    advs = [2.0, -0.5, 1.0, -1.0, -1.0]  # tokens 2, 3, 4 are clipped (clip-high, clip-low, dual)
    out, logp = run(ratios, advs, num_tokens=n)
    out.loss.backward()
    assert logp.grad[0].item() == pytest.approx(-2.0 * 1.1 / n, abs=TOL)
    assert logp.grad[1].item() == pytest.approx(0.5 * 0.9 / n, abs=TOL)
    assert logp.grad[2:].tolist() == [0.0, 0.0, 0.0]
    assert out.clipped.item() == 3


def test_outputs_are_scalars_and_metrics_detached() -> None:
    out, _ = run([1.1, 1.5], [1.0, 1.0])
    assert out.loss.shape == () and out.clipped.shape == () and out.ratio_sum.shape == ()
    assert out.loss.requires_grad
    assert not out.clipped.requires_grad and not out.ratio_sum.requires_grad


def test_extreme_log_ratio_stays_finite() -> None:
    # A huge log-ratio (a very stale token) must not produce inf/nan.
    logp = torch.tensor([0.0, 0.0], dtype=torch.float64, requires_grad=True)
    lb = torch.tensor([-500.0, 500.0], dtype=torch.float64)
    out = dapo_loss(logp, lb, torch.tensor([-1.0, 1.0], dtype=torch.float64), torch.ones(2, dtype=torch.float64), 2)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all()
    # token 0: A = −1, r huge → dual clip 3; token 1: A = +1, r ≈ 0 → −A·r ≈ 0
    assert out.loss.item() == pytest.approx(3.0 / 2, abs=1e-6)
