"""The DAPO trainer on the tiny model (single process, CPU): a step moves the policy the right way."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import _batch

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


def _seq_logprob(model, prompt, traj):
    from pace.algo.logprobs import full_logprobs as token_logprobs

    full = torch.tensor([prompt + traj.response_ids.tolist()])
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


def test_nonfinite_loss_skips_the_update_and_counts_it(setup):
    from accelerate import Accelerator
    from transformers import AutoTokenizer

    from pace.algo.trainer import DAPOTrainer

    path, cfg, _ = setup
    trainer = DAPOTrainer(path, cfg, Accelerator(cpu=True))
    model = trainer.acc.unwrap_model(trainer.model)
    good = _batch(AutoTokenizer.from_pretrained(path), model, 1.0)
    trainer.step(good)  # Adam has state and the schedule has moved once
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    adam = {k: v.clone() for k, v in trainer.optimizer.state_dict()["state"][0].items()}
    lr = trainer.scheduler.get_last_lr()[0]

    bad = _batch(AutoTokenizer.from_pretrained(path), model, float("nan"))  # NaN advantages → NaN loss
    metrics = trainer.step(bad)

    assert metrics["train/nonfinite_skipped"] == 1 and trainer.nonfinite_skipped == 1
    assert trainer.version == 2  # the version advances, with θ unchanged
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    assert all(torch.equal(v, adam[k]) for k, v in trainer.optimizer.state_dict()["state"][0].items())
    assert trainer.scheduler.get_last_lr()[0] == lr
    assert all(p.grad is None for p in model.parameters())  # nothing left over for the next step
    assert trainer.step(good)["train/nonfinite_skipped"] == 0
    assert not all(torch.equal(p, params[n]) for n, p in model.named_parameters())


def test_save_and_load_restore_weights_optimizer_schedule_and_rng(setup, tmp_path):
    import json

    from accelerate import Accelerator
    from transformers import AutoTokenizer

    from pace.algo.trainer import DAPOTrainer

    path, cfg, _ = setup
    tok = AutoTokenizer.from_pretrained(path)
    a = DAPOTrainer(path, cfg, Accelerator(cpu=True))
    batch = _batch(tok, a.acc.unwrap_model(a.model), 1.0)
    for _ in range(2):
        a.step(batch)
    a.save(tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"trainer": a.state_dict()}))
    rng = torch.rand(3)  # what the RNG gives right after the save

    b = DAPOTrainer(path, cfg, Accelerator(cpu=True))
    b.load(tmp_path)
    assert torch.equal(torch.rand(3), rng)
    assert b.version == 2 and b.scheduler.get_last_lr() == a.scheduler.get_last_lr()
    ma, mb = a.acc.unwrap_model(a.model), b.acc.unwrap_model(b.model)
    assert all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters()))
    # one more identical step from both: same weights (the AdamW moments were restored too)
    a.step(batch), b.step(batch)
    assert all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters()))
