"""The DAPO trainer on the tiny model (single process, CPU): a step moves the policy the right way."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def setup(tiny_model_path):
    from accelerate import Accelerator
    from omegaconf import OmegaConf

    from pace.config import Config

    cfg = OmegaConf.structured(Config)
    cfg.trainer.lr, cfg.trainer.micro_batch_size = 1e-5, 3  # micro-batching exercised: 4 trajectories
    cfg.trainer.warmup_steps = 0
    return tiny_model_path, cfg, Accelerator(cpu=True)


def _batch(tokenizer, model, advantage: float, prompt_text="12+34=?\n"):
    """One group: the worked answer twice, both with the given advantage, behaviour = current policy.

    The advantage has one sign in the batch on purpose: with opposite signs on shared tokens the
    gradients cancel to rounding noise, which Adam's first (sign-like) step turns into a random move.
    """
    from pace.algo.trainer import token_logprobs
    from pace.records import Batch, Group, Trajectory

    prompt = tokenizer(prompt_text, add_special_tokens=False).input_ids
    resp = tokenizer("12+34=46\nAnswer: 46", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    full = torch.tensor([prompt + resp])
    with torch.no_grad():
        lp, _ = token_logprobs(model(full).logits[:, :-1], full[:, 1:], 1.0)
    logprobs = lp[0, len(prompt) - 1 :].tolist()
    trajs = [Trajectory(list(resp), list(logprobs), [0] * len(resp), 0, "stop", advantage=advantage) for _ in range(2)]
    return Batch(step=0, groups=[Group(0, "p0", prompt, "46", 0, trajs)])


def _seq_logprob(model, prompt, traj):
    from pace.algo.trainer import token_logprobs

    full = torch.tensor([prompt + traj.response_ids])
    with torch.no_grad():
        lp, _ = token_logprobs(model(full).logits[:, :-1], full[:, 1:], 1.0)
    return lp[0, len(prompt) - 1 :].sum().item()


@pytest.mark.parametrize("variant", [("dapo", "behavior"), ("m2po", "behavior"), ("dapo", "proximal")])
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_step_moves_the_response_logprob_with_the_advantage(setup, advantage, variant):
    from transformers import AutoTokenizer

    from pace.algo.trainer import DAPOTrainer

    path, cfg, acc = setup
    cfg = cfg.copy()
    cfg.algo.name, cfg.algo.ratio_ref = variant
    trainer = DAPOTrainer(path, cfg, acc)
    model = acc.unwrap_model(trainer.model)
    batch = _batch(AutoTokenizer.from_pretrained(path), model, advantage)
    prompt, traj = batch.groups[0].prompt_ids, batch.trajectories[0]
    before = _seq_logprob(model, prompt, traj)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}

    metrics = trainer.step(batch)

    after = _seq_logprob(model, prompt, traj)
    assert trainer.version == 1
    assert metrics["train/ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy: π_θ == μ before the update
    assert metrics["train/clipfrac"] == 0.0
    assert (after - before) * advantage > 0, (before, after)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, params[n])]
    assert set(changed) == set(params), set(params) - set(changed)


def test_full_state_dict_matches_model_and_is_a_copy(setup):
    from pace.algo.trainer import DAPOTrainer

    path, cfg, acc = setup
    trainer = DAPOTrainer(path, cfg, acc)
    weights = dict(trainer.full_state_dict())
    model = acc.unwrap_model(trainer.model)
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[name], tensor)
        assert weights[name].data_ptr() != tensor.data_ptr()
