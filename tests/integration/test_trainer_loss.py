"""The trainer's loss against the pure loss functions, on the tiny model (single process, CPU).

Behaviour log-probs here differ from the current policy (off-policy by a chosen amount), responses
have different lengths and the batch spans several micro- and mini-batches: the cases in which a
wrong normalisation, a wrong ratio reference or a loss silently reduced to DAPO shows (
points 2 and 3). The reference values come from `pace.algo.loss` applied to log-probs the test
computes itself with one forward pass over the whole batch.
"""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.integration

RESPONSES = ["12+34=46\nAnswer: 46", "Answer: 7", "1+1=2\n2+2=4\nAnswer: 4", "Answer: 4096", "3*3=9\nAnswer: 9",
             "Answer: 1", "7+8=15\n15+1=16\nAnswer: 16", "Answer: 23"]


@pytest.fixture(scope="module")
def env(tiny_model_path):
    from accelerate import Accelerator
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from pace.config import Config

    cfg = OmegaConf.structured(Config)
    cfg.trainer.lr, cfg.trainer.warmup_steps = 1e-4, 0  # constant LR: updates comparable across layouts
    return tiny_model_path, cfg, Accelerator(cpu=True), AutoTokenizer.from_pretrained(tiny_model_path)


def _trainer(env, **overrides):
    from omegaconf import OmegaConf

    from pace.algo.trainer import DAPOTrainer

    path, cfg, acc, _ = env
    cfg = cfg.copy()
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return DAPOTrainer(path, cfg, acc)


def _logprobs(model, pairs):
    """log π of every response token, one sequence at a time (no padding involved)."""
    from pace.algo.logprobs import full_logprobs as token_logprobs

    out = []
    for prompt, resp in pairs:
        full = torch.tensor([prompt + resp])
        lp, _ = token_logprobs(model(full).logits[:, :-1], full[:, 1:], 1.0)
        out.append(lp[0, len(prompt) - 1:])
    return out


def _batch(env, model, groups: int = 2, noise: float = 0.7, seed: int = 0):
    """``groups`` groups of 4 responses of different lengths; advantages of both signs; behaviour
    log-probs = the model's own + N(0, noise²) per token, so ratios are far from 1."""
    from pace.records import Batch, Group, Trajectory

    tok = env[3]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(groups):
        prompt = tok(f"{g + 11}+{g + 22}=?\n", add_special_tokens=False).input_ids
        resps = [tok(RESPONSES[(4 * g + i) % len(RESPONSES)], add_special_tokens=False).input_ids + [tok.eos_token_id]
                 for i in range(4)]
        with torch.no_grad():
            current = _logprobs(model, [(prompt, r) for r in resps])
        trajs = []
        for i, (r, lp) in enumerate(zip(resps, current)):
            behaviour = (lp + noise * torch.randn(lp.shape, generator=gen)).tolist()
            trajs.append(Trajectory(list(r), behaviour, [0] * len(r), 0, "stop", advantage=(1.0, -0.5, 0.8, -1.2)[i]))
        out.append(Group(g, f"p{g}", prompt, "0", 0, trajs))
    return Batch(step=0, groups=out)


def _response_logprobs(model, batch) -> torch.Tensor:
    return torch.cat(_logprobs(model, [(g.prompt_ids, t.response_ids.tolist()) for g in batch.groups for t in g.trajectories]))


def _reference(fn, model, batch, prox=None, **kw):
    """The pure loss on the whole batch at once: Σ over counted tokens / their number."""
    trajs = batch.trajectories
    logp = _response_logprobs(model, batch)
    behaviour = torch.tensor([x for t in trajs for x in t.logprobs])
    adv = torch.tensor([t.advantage for t in trajs for _ in t.response_ids])
    mask = torch.ones_like(logp)
    args = (logp, behaviour) if prox is None else (logp, prox, behaviour)
    return fn(*args, adv, mask, len(logp), **kw).loss.item()


LAYOUTS = {  # how one mini-batch of 8 sequences (lengths ~10–30 tokens) is cut and computed
    "1 per sequence": {"trainer.micro_batch_size": 1},
    "3 per micro-batch": {"trainer.micro_batch_size": 3},
    "all in one": {"trainer.micro_batch_size": 64},
    "token budget, padded": {"trainer.max_tokens_per_micro_batch": 60},
    "token budget, packed": {"trainer.max_tokens_per_micro_batch": 60, "trainer.packing": True},
    "full-vocabulary log-probs": {"trainer.micro_batch_size": 3, "trainer.logprob_chunk": None},
    "chunks of 5 positions": {"trainer.micro_batch_size": 3, "trainer.logprob_chunk": 5},
}


def test_the_loss_and_gradient_do_not_depend_on_the_micro_batch_layout(env):
    """Guards against: each micro-batch divided by its own token count (then the loss and the
    update change with the split), a packed or chunked path scoring the wrong positions, or an
    empty/duplicated trajectory in a token-budget plan."""
    from pace.algo.loss import dapo_loss

    losses, grads, metrics = {}, {}, {}
    for name, overrides in LAYOUTS.items():
        trainer = _trainer(env, **overrides)
        model = env[2].unwrap_model(trainer.model)
        batch = _batch(env, model)
        with torch.no_grad():
            expected = _reference(dapo_loss, model, batch)
        seen = _record_grads(trainer, model)
        metrics[name] = trainer.step(batch)
        losses[name], grads[name] = metrics[name]["train/loss"], seen[0]
        assert losses[name] == pytest.approx(expected, abs=1e-5), name
    first = next(iter(LAYOUTS))
    for name in LAYOUTS:  # the gradient handed to the optimizer, not just the loss
        assert losses[name] == pytest.approx(losses[first], abs=1e-5), name
        for p, g in grads[first].items():
            torch.testing.assert_close(grads[name][p], g, atol=1e-6, rtol=1e-4, msg=f"{name}: {p}")
    assert metrics["token budget, packed"]["train/pad_frac"] == 0.0
    assert metrics["1 per sequence"]["train/pad_frac"] == 0.0 and metrics["all in one"]["train/pad_frac"] > 0.2
    assert metrics["token budget, padded"]["train/pad_frac"] < metrics["all in one"]["train/pad_frac"]
    assert metrics["token budget, padded"]["train/micro_batches"] > 1


def _record_grads(trainer, model) -> list[dict]:
    """The (clipped) gradients at each optimizer step of ``trainer``, by parameter name."""
    seen, step = [], trainer.optimizer.step

    def record(*a, **k):
        seen.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        return step(*a, **k)

    trainer.optimizer.step = record
    return seen


def test_mini_batches_are_sequential_updates_each_normalised_by_its_own_tokens(env):
    """`trainer.mini_batches = 2` on groups (g0, g1) is two updates: exactly one step on (g0) then
    one on (g1); the step's loss is their mean."""
    split = _trainer(env, **{"trainer.mini_batches": 2, "trainer.micro_batch_size": 3})
    model = env[2].unwrap_model(split.model)
    batch = _batch(env, model)
    from pace.records import Batch

    seq = _trainer(env, **{"trainer.micro_batch_size": 3})
    a = seq.step(Batch(0, batch.groups[:1]))["train/loss"]
    b = seq.step(Batch(1, batch.groups[1:]))["train/loss"]
    assert split.step(batch)["train/loss"] == pytest.approx((a + b) / 2, abs=1e-5)
    for (name, p), q in zip(model.named_parameters(), env[2].unwrap_model(seq.model).parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-4, msg=name)


def _tensors(model, batch):
    trajs = batch.trajectories
    logp = _response_logprobs(model, batch)
    behaviour = torch.tensor([x for t in trajs for x in t.logprobs])
    adv = torch.tensor([t.advantage for t in trajs for _ in t.response_ids])
    seq_ids = torch.repeat_interleave(torch.arange(len(trajs)), torch.tensor([len(t) for t in trajs]))
    return logp, behaviour, adv, torch.ones_like(logp), seq_ids


def _m2po_reference(model, batch, variant: str, per_sequence: bool = False) -> float:
    """M2PO's loss with its decision over the whole batch (or, to tell the two apart, per sequence)."""
    from pace.algo import m2po
    from pace.algo.loss import dapo_loss, m2po_loss

    logp, lb, adv, mask, seq_ids = _tensors(model, batch)
    d = logp - lb
    if variant == "adaptive_clip":
        eps_low, eps_high, _ = m2po.adaptive_clip(d, adv, mask, 0.04)
        return dapo_loss(logp, lb, adv, mask, len(logp), eps_low=eps_low, eps_high=eps_high, clip_ratio_c=None).loss.item()
    if per_sequence:
        keep = torch.cat([m2po.keep_mask(d[seq_ids == i], adv[seq_ids == i], mask[seq_ids == i], 0.04)[0]
                          for i in range(int(seq_ids.max()) + 1)])
    else:
        keep = m2po.keep_mask(d, adv, mask, 0.04)[0]
    return m2po_loss(logp, lb, adv, mask, keep, len(logp)).loss.item()


@pytest.mark.parametrize("variant", ["paper", "adaptive_clip"])
def test_m2po_decides_over_the_whole_mini_batch_whatever_the_layout(env, variant):
    """Guards against: M2PO deciding per micro-batch (its mask then changes with the split), training
    with the DAPO loss, or the decision's forward pass on other weights than the update's."""
    from pace.algo.loss import dapo_loss

    losses, grads = {}, {}
    for name in ("1 per sequence", "3 per micro-batch", "all in one", "token budget, padded"):
        trainer = _trainer(env, **{"algo.name": "m2po", "algo.m2po_variant": variant, **LAYOUTS[name]})
        model = env[2].unwrap_model(trainer.model)
        batch = _batch(env, model, noise=1.0)
        with torch.no_grad():
            expected = _m2po_reference(model, batch, variant)
            assert abs(expected - _reference(dapo_loss, model, batch)) > 1e-2  # the case tells M2PO from DAPO
            if variant == "paper":  # and a per-sequence (micro-batch of 1) decision from the batch's
                assert abs(expected - _m2po_reference(model, batch, variant, per_sequence=True)) > 1e-3
        seen = _record_grads(trainer, model)
        metrics = trainer.step(batch)
        losses[name], grads[name] = metrics["train/loss"], seen[0]
        assert losses[name] == pytest.approx(expected, abs=1e-5), name
        assert 0 < metrics["m2po/trust_region_frac"] < 1 and metrics["m2po/m2"] > 0.04
        if variant == "paper":
            assert 0 < metrics["m2po/masked_frac"] < metrics["m2po/trust_region_frac"] and metrics["m2po/m2_after"] <= 0.04
        else:
            # the budget binds in every mini-batch with a small radius: ε_high at its floor 0.5
            assert metrics["m2po/binds_frac"] == 1 and metrics["m2po/eps_high"] == 0.5
            assert metrics["m2po/m2_after"] <= 0.04 + 1e-9
    for name, g in grads.items():
        for p, ref in grads["1 per sequence"].items():
            torch.testing.assert_close(g[p], ref, atol=1e-6, rtol=1e-4, msg=f"{name}: {p}")


@pytest.mark.parametrize("ratio_ref, kind, level", [("proximal", "tis", "token"), ("behavior", "tis", "sequence"),
                                                    ("behavior", "mis", "geometric"), ("proximal", "mis", "sequence")])
def test_is_corrections_in_the_trainer_are_the_pure_functions(env, ratio_ref, kind, level):
    """Guards against: a correction left out of the trainer's loss, computed per micro-batch on split
    sequences, or with the wrong ratio (π_prox/μ under the proximal reference, sg(π_θ)/μ under the
    behaviour one)."""
    from pace.algo.correction import correct
    from pace.algo.loss import dapo_loss, decoupled_loss, tis_pg_loss

    threshold = {"token": 2.0, "sequence": 4.0, "geometric": 1.3}[level]
    for layout in ("1 per sequence", "3 per micro-batch"):
        trainer = _trainer(env, **{"algo.ratio_ref": ratio_ref, "algo.is_correction": kind, "algo.is_level": level,
                                   "algo.is_threshold": threshold, **LAYOUTS[layout]})
        model = env[2].unwrap_model(trainer.model)
        batch = _batch(env, model, noise=0.7)
        with torch.no_grad():
            logp, lb, adv, mask, seq_ids = _tensors(model, batch)
            n_seqs, n = int(seq_ids.max()) + 1, len(logp)
            c = correct(logp - lb, mask, seq_ids, n_seqs, kind, level, threshold)  # at θ_0, π_prox = π_θ
            if ratio_ref == "proximal":
                expected = decoupled_loss(logp, logp, lb, adv, mask, n, weight=c.weight).loss.item()
            elif kind == "tis":
                expected = tis_pg_loss(logp, lb, adv, mask, c.weight, n).loss.item()
            else:
                expected = dapo_loss(logp, lb, adv, mask, n, weight=c.keep).loss.item()
            assert abs(expected - _reference(dapo_loss, model, batch)) > 1e-3, "the case tells the correction apart"
        metrics = trainer.step(batch)
        assert metrics["train/loss"] == pytest.approx(expected, abs=1e-5), layout
        frac = metrics["mismatch/masked_frac" if kind == "mis" else "mismatch/truncated_frac"]
        assert frac == pytest.approx(((c.masked if kind == "mis" else c.truncated) / n).item(), abs=1e-9) and 0 < frac < 1


def test_mismatch_metrics_count_the_on_policy_tokens(env):
    """Behaviour log-probs = the trainer's own (float32): every on-policy token has |Δ log p| ~ 0;
    tokens of an older version are left out of the count."""
    trainer = _trainer(env, **{"trainer.micro_batch_size": 3})
    model = env[2].unwrap_model(trainer.model)
    batch = _batch(env, model, noise=0.0)
    stale = batch.groups[1].trajectories[0]
    stale.versions[:] = -1  # generated by an older policy than the trainer's version 0
    spanning = batch.groups[0].trajectories[0]
    spanning.versions[:1] = -1  # begun under an older policy, ended under the trainer's: left out too
    metrics = trainer.step(batch)
    tokens = sum(len(t) for t in batch.trajectories)
    assert metrics["mismatch/tokens"] == tokens - len(stale) - len(spanning)
    assert metrics["mismatch/abs_logp_diff"] < 1e-5 and abs(metrics["mismatch/k3_kl"]) < 1e-9
    noisy = _trainer(env, **{"trainer.micro_batch_size": 3})
    metrics = noisy.step(_batch(env, env[2].unwrap_model(noisy.model), noise=0.3))
    assert metrics["mismatch/abs_logp_diff"] == pytest.approx(0.3 * math.sqrt(2 / math.pi), rel=0.3)  # E|N(0, σ²)|
    assert metrics["mismatch/k3_kl"] > 0


def test_decoupled_ppo_takes_the_step_start_policy_as_proximal(env):
    """Guards against: the proximal log-probs replaced by the behaviour ones (decoupled PPO reduces
    to DAPO), or recomputed from the current weights at each mini-batch (π_prox must be θ_j, the
    weights at the start of the step, for every mini-batch of it)."""
    from pace.algo.loss import dapo_loss, decoupled_loss
    from pace.records import Batch

    clip = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)
    trainer = _trainer(env, **{"algo.ratio_ref": "proximal", "trainer.mini_batches": 2, "trainer.micro_batch_size": 3})
    model = env[2].unwrap_model(trainer.model)
    batch = _batch(env, model)
    first, second = Batch(0, batch.groups[:1]), Batch(0, batch.groups[1:])
    with torch.no_grad():  # π_prox of both mini-batches: the weights before the step
        prox1, prox2 = _response_logprobs(model, first), _response_logprobs(model, second)
        loss1 = _reference(decoupled_loss, model, first, prox=prox1, **clip)
        assert abs(loss1 - _reference(dapo_loss, model, first, **clip)) > 1e-2  # the case tells them apart
    # the weights after the first update, from a one-mini-batch step on the first group alone
    ref = _trainer(env, **{"algo.ratio_ref": "proximal", "trainer.micro_batch_size": 3})
    assert ref.step(first)["train/loss"] == pytest.approx(loss1, abs=1e-5)
    with torch.no_grad():
        loss2 = _reference(decoupled_loss, env[2].unwrap_model(ref.model), second, prox=prox2, **clip)
    assert trainer.step(batch)["train/loss"] == pytest.approx((loss1 + loss2) / 2, abs=1e-5)
