"""pace/weights/delta.py: the patches of a delta sync rebuild the trainer's engine-dtype cast bit
for bit, carry exactly the elements whose cast changed, and the plan is whole when it must be."""
import pytest
import torch

from pace.weights import source
from pace.weights.delta import DeltaTracker, Plan, break_even, changed_positions
from pace.weights.fingerprint import tensor_fingerprint


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.Linear(40, 24))


def _casts(model, dtype) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(dtype).clone() for n, p in source.named_parameters(model)}


def _apply(held: dict[str, torch.Tensor], plan: Plan) -> dict[str, torch.Tensor]:
    """What an engine worker's mirror holds after the plan's patches (pace/weights/gloo.py)."""
    out = {n: t.clone() for n, t in held.items()}
    for p in plan.patches:
        out[p.name].view(-1).index_copy_(0, p.indices.long(), p.values)
    return out


def _prints(casts: dict[str, torch.Tensor]) -> dict[str, int]:
    return {n: tensor_fingerprint(t) for n, t in casts.items()}


def _adamw_step(model, lr: float) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model(torch.randn(8, 48)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_patches_rebuild_the_new_cast_bit_for_bit_and_carry_only_changed_elements(dtype):
    """Three AdamW steps, each synced as a delta: the engine's copy patched equals the trainer's
    cast exactly, the plan counts exactly the elements whose cast bits changed, and its
    fingerprints (from the change alone) are the whole new tensors'."""
    model = _model()
    tracker = DeltaTracker(model, dtype, full_every=0, max_frac=1.0)
    first = tracker.plan(1)
    assert first.full and first.reason == "first"
    held = _casts(model, dtype)
    tracker.sent(first, _prints(held))
    for version in (2, 3, 4):
        _adamw_step(model, lr=1e-3)
        new = _casts(model, dtype)
        plan = tracker.plan(version)
        assert not plan.full and plan.reason == "delta"
        want = sum(int((old.view(-1).view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
                        != new[n].view(-1).view(torch.int16 if dtype == torch.bfloat16 else torch.int32)).sum())
                   for n, old in held.items())
        assert plan.changed == want > 0
        assert sum(p.indices.numel() for p in plan.patches) == want
        assert all(p.indices.dtype == torch.int32 and bool((p.indices[1:] > p.indices[:-1]).all()) for p in plan.patches)
        patched = _apply(held, plan)
        assert all(torch.equal(patched[n].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               new[n].view(torch.int16 if dtype == torch.bfloat16 else torch.int32)) for n in new)
        assert plan.prints == _prints(new)
        assert plan.bytes == want * (4 + new["0.weight"].element_size())
        tracker.sent(plan)
        held = new


def test_a_master_that_moves_below_the_engine_dtype_s_resolution_is_not_sent():
    """The diff is of the bf16 casts, not of the fp32 masters: a master moved by far less than a
    bf16 step keeps its cast, and nothing of it goes on the wire (diffing the masters would send
    every element)."""
    model = _model()
    tracker = DeltaTracker(model, torch.bfloat16, full_every=0, max_frac=1.0)
    tracker.sent(tracker.plan(1), None)
    masters, casts = _casts(model, torch.float32), _casts(model, torch.bfloat16)
    with torch.no_grad():
        model[0].weight.mul_(1 + 1e-6)  # every master moves; bf16 keeps 8 bits of mantissa
        model[1].bias[3] += 1.0  # a cast that does change
    plan = tracker.plan(2)
    moved = sum(int((masters[n] != t).sum()) for n, t in _casts(model, torch.float32).items())
    recast = {n: changed_positions(casts[n], t).tolist() for n, t in _casts(model, torch.bfloat16).items()}
    assert moved == 40 * 48 + 1  # the masters: every element of the first weight, and the bias
    assert {p.name: p.indices.tolist() for p in plan.patches} == {n: v for n, v in recast.items() if v}
    assert plan.changed == sum(map(len, recast.values())) < 0.01 * moved  # a rounding boundary crossed, at most
    assert 3 in recast["1.bias"]


def test_a_sign_flip_of_zero_is_sent_the_comparison_is_of_bits():
    """−0.0 == +0.0 as values; the engine must hold the trainer's bits, so the flip is a change."""
    old, new = torch.tensor([0.0, 1.0, float("nan")]), torch.tensor([-0.0, 1.0, float("nan")])
    assert changed_positions(old, new).tolist() == [0]


def test_whole_syncs_first_every_n_when_too_much_changed_and_after_a_reset():
    model = _model()
    tracker = DeltaTracker(model, torch.bfloat16, full_every=3, max_frac=None)
    assert tracker.max_frac == pytest.approx(2 / 6) == break_even(torch.bfloat16)
    assert break_even(torch.float32) == pytest.approx(0.5)
    plans = []
    for version in range(1, 6):
        with torch.no_grad():
            model[1].bias[0] += 1.0  # one element a version: a delta whenever one may be
        plan = tracker.plan(version)
        tracker.sent(plan, None)
        plans.append((plan.full, plan.reason, plan.changed))
    # the changed count is measured for a periodic whole sync too; unknown only when the engines' is
    assert plans == [(True, "first", None), (False, "delta", 1), (False, "delta", 1), (True, "every", 1),
                     (False, "delta", 1)]
    with torch.no_grad():
        model[0].weight.add_(1.0)  # most elements change: whole is cheaper
    plan = tracker.plan(6)
    assert (plan.full, plan.reason) == (True, "changed") and plan.changed_frac > tracker.max_frac
    tracker.sent(plan, None)
    tracker.reset()  # an engine joined: what the engines hold is unknown
    plan = tracker.plan(7)
    assert (plan.full, plan.reason) == (True, "reset")
    with pytest.raises(RuntimeError, match="without its plan"):
        tracker.sent(Plan(8, False, "delta"))


def test_a_plan_made_before_a_reset_is_sent_whole_with_the_same_weights():
    """The group formed again between planning and sending (a server lost): the planned version's
    casts stay the baseline, sent whole."""
    model = _model()
    tracker = DeltaTracker(model, torch.float32, full_every=0, max_frac=1.0)
    tracker.sent(tracker.plan(1), None)
    with torch.no_grad():
        model[1].bias[0] += 1.0
    plan = tracker.plan(2)
    assert not plan.full
    tracker.reset()
    whole = tracker.whole(plan)
    assert whole.full and whole.version == 2 and whole.bytes == whole.total * 4
    tracker.sent(whole, None)
    assert tracker.version == 2
    with torch.no_grad():
        model[1].bias[1] += 1.0
    nxt = tracker.plan(3)
    assert [(p.name, p.indices.tolist()) for p in nxt.patches] == [("1.bias", [1])]  # against θ_2, not θ_1


def test_after_a_failed_sync_the_next_is_whole_and_the_baseline_is_the_last_sent():
    """A sync that failed leaves the engines' weights unknown: the next plan is whole, and the one
    after it a delta against what that whole sync sent."""
    model = _model()
    tracker = DeltaTracker(model, torch.bfloat16, full_every=0, max_frac=1.0)
    tracker.sent(tracker.plan(1), None)
    with torch.no_grad():
        model[1].bias[0] += 1.0
    assert not tracker.plan(2).full
    tracker.failed()
    with torch.no_grad():
        model[1].bias[1] += 1.0
    plan = tracker.plan(3)
    assert (plan.full, plan.reason, plan.changed) == (True, "reset", 2)  # θ_3 against θ_1, the last sent
    tracker.sent(plan, None)
    assert tracker.held_bytes == 2 * sum(p.numel() for p in model.parameters())  # one bf16 copy, on the host
    with torch.no_grad():
        model[1].bias[2] += 1.0
    assert [(p.name, p.indices.tolist()) for p in tracker.plan(4).patches] == [("1.bias", [2])]


def test_a_nan_among_the_changes_is_sent_whole():
    """vLLM's sparse patches mark unchanged elements with NaN and refuse NaN values: a changed
    value that is NaN (a diverged step the trainer did not skip) goes in a whole sync."""
    model = _model()
    tracker = DeltaTracker(model, torch.bfloat16, full_every=0, max_frac=1.0)
    tracker.sent(tracker.plan(1), None)
    with torch.no_grad():
        model[1].bias[0] = float("nan")
    plan = tracker.plan(2)
    assert (plan.full, plan.reason, plan.changed) == (True, "nan", 1)


def _terms(positions: torch.Tensor, values: torch.Tensor) -> int:
    """The fingerprint's definition (pace/weights/fingerprint.py), term by term: each element's int16
    words times w_i = (i·A mod P) + 1 at the word's position i in the whole tensor."""
    from pace.weights.fingerprint import A, P

    per = values.element_size() // 2
    words = values.contiguous().view(torch.int16).tolist()
    return sum(words[k * per + r] * (((pos * per + r) * A) % P + 1)
               for k, pos in enumerate(positions.tolist()) for r in range(per))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_delta_carries_theta_base_s_fingerprint_terms_at_each_patch_s_positions(dtype):
    """An engine worker that patches in place (nccl) advances its own fingerprints of θ_base with
    them (pace/weights/inplace.py): per patch, the terms of θ_base's elements at its positions."""
    model = _model()
    tracker = DeltaTracker(model, dtype, full_every=0, max_frac=1.0)
    held = _casts(model, dtype)
    tracker.sent(tracker.plan(1), _prints(held))
    _adamw_step(model, lr=1e-3)
    plan = tracker.plan(2)
    assert not plan.full and len(plan.base_sums) == len(plan.patches) == 4
    for patch, base in zip(plan.patches, plan.base_sums):
        assert base == _terms(patch.indices, held[patch.name].view(-1)[patch.indices.long()])
        # what a worker holding θ_1's fingerprints computes: θ_2's
        assert _prints(held)[patch.name] - base + _terms(patch.indices, patch.values) == plan.prints[patch.name]
    unprinted = DeltaTracker(_model(), dtype, full_every=0, max_frac=1.0, fingerprints=False)
    unprinted.sent(unprinted.plan(1), None)
    with torch.no_grad():
        unprinted.model[1].bias[0] += 1.0
    assert unprinted.plan(2).base_sums is None  # no fingerprints, nothing for the workers to advance
