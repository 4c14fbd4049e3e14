"""The trainer's loss against the pure loss functions, on the tiny model (single process, CPU).

Behaviour log-probs here differ from the current policy (off-policy by a chosen amount), responses
have different lengths and the batch spans several micro- and mini-batches: the cases in which a
wrong normalisation, a wrong ratio reference or a loss silently reduced to DAPO shows (issue #15,
points 2 and 3). The reference values come from `pace.algo.loss` applied to log-probs the test
computes itself with one forward pass over the whole batch.
"""
from __future__ import annotations

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


def test_m2po_in_the_trainer_is_the_m2po_loss_not_dapo(env):
    """Guards against: `algo.name=m2po` training with the DAPO loss (with behaviour = current policy
    the two are equal, so the off-policy batch here is what tells them apart)."""
    from pace.algo.loss import dapo_loss, m2po_loss

    # one micro-batch: m2po_loss decides its mask per call, i.e. per micro-batch (issue #18 moves the
    # decision to the whole mini-batch, as M2PO's Algorithm 1 does)
    trainer = _trainer(env, **{"algo.name": "m2po", "trainer.micro_batch_size": 64})
    model = env[2].unwrap_model(trainer.model)
    batch = _batch(env, model, noise=1.0)
    clip = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)
    with torch.no_grad():
        m2po = _reference(m2po_loss, model, batch, m2_threshold=0.04, **clip)
        dapo = _reference(dapo_loss, model, batch, **clip)
    assert abs(m2po - dapo) > 1e-2  # the case tells them apart
    assert trainer.step(batch)["train/loss"] == pytest.approx(m2po, abs=1e-5)


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
        loss1 = _reference(decoupled_loss, model, first, prox=prox1, is_cap=5.0, **clip)
        assert abs(loss1 - _reference(dapo_loss, model, first, **clip)) > 1e-2  # the case tells them apart
    # the weights after the first update, from a one-mini-batch step on the first group alone
    ref = _trainer(env, **{"algo.ratio_ref": "proximal", "trainer.micro_batch_size": 3})
    assert ref.step(first)["train/loss"] == pytest.approx(loss1, abs=1e-5)
    with torch.no_grad():
        loss2 = _reference(decoupled_loss, env[2].unwrap_model(ref.model), second, prox=prox2, is_cap=5.0, **clip)
    assert trainer.step(batch)["train/loss"] == pytest.approx((loss1 + loss2) / 2, abs=1e-5)
