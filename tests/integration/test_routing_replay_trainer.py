"""MoE routing replay through `DAPOTrainer` (CPU, a tiny random Qwen3-MoE, gradient checkpointing):
a step on routes recorded by scripts/gpu_smoke.py's engine stand-in (smoke_case.record_routes: the
top-k of noise-perturbed router logits) reproduces ℓ^μ and logs the planted share; without replay
the trainer misses ℓ^μ; a dense model is refused at trainer start. The reference-level checks
(an independent loop over experts, padded/packed, gradients) are tests/unit/test_routing_replay.py."""
from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers import ROOT

pytestmark = pytest.mark.integration

PROMPT, RESPONSE, ROWS = 6, 20, 3


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=128, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1, norm_topk_prob=True,
                         tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():  # routing that matters (the default init's std 0.02 makes it ~irrelevant)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
            layer.mlp.experts.gate_up_proj.normal_(0.0, 0.3)
            layer.mlp.experts.down_proj.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("moe")
    model.save_pretrained(path)
    return str(path)


def _trainer(path: str, replay: bool, checkpointing: bool = True):
    from accelerate import Accelerator
    from omegaconf import OmegaConf

    from pace.algo.trainer import DAPOTrainer
    from pace.config import Config

    cfg = OmegaConf.structured(Config)
    cfg.algo.routing_replay = replay
    cfg.model.gradient_checkpointing = checkpointing  # the routers run again in backward: inside the replay
    cfg.trainer.warmup_steps, cfg.trainer.micro_batch_size, cfg.trainer.logprob_chunk = 0, 2, 8  # 2 micro-batches
    return DAPOTrainer(path, cfg, Accelerator(cpu=True))


def _step(trainer) -> tuple[dict, float]:
    """A step on a batch whose routes and ℓ^μ are the engine stand-in's; its planted share."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import smoke_case

    batch = smoke_case.batch_of(trainer, PROMPT, RESPONSE, 128, rows=ROWS)
    planted = smoke_case.record_routes(trainer, batch)["planted_share"]
    assert all(len(t.prompt_routes) == PROMPT and len(t.routes) == RESPONSE - 1 for t in batch.trajectories)
    return trainer.step(batch), planted


def test_a_step_with_replay_reproduces_the_engines_logprobs_and_logs_the_planted_share(moe_path):
    metrics, planted = _step(_trainer(moe_path, replay=True))
    assert metrics["mismatch/tokens"] == ROWS * RESPONSE
    assert metrics["mismatch/abs_logp_diff"] < 1e-5  # π_θ = μ on the engine's routes (float floor)
    assert metrics["moe/route_diff_share"] == pytest.approx(planted) and planted > 0.05
    assert 0 < metrics["moe/route_diff_share/layer0"] <= 1 and "moe/route_diff_share/layer1" in metrics
    n = PROMPT + RESPONSE
    assert metrics["moe/replayed_share"] == pytest.approx((n - 1) / n)  # every position but the last token
    assert metrics["train/nonfinite_skipped"] == 0


def test_gradient_checkpointing_recomputes_the_routers_inside_the_replay(moe_path):
    """The update's gradients with gradient checkpointing equal those without: the backward's
    recompute of every layer routed as the forward did (the replay stays open over the backward)."""
    grads = []
    for checkpointing in (True, False):
        trainer = _trainer(moe_path, replay=True, checkpointing=checkpointing)
        optimizer_step = trainer.optimizer.step

        def capture(*args, trainer=trainer, optimizer_step=optimizer_step, **kwargs):
            grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
            return optimizer_step(*args, **kwargs)

        trainer.optimizer.step = capture
        _step(trainer)
    with_ckpt, without = grads
    for name, g in without.items():
        torch.testing.assert_close(with_ckpt[name], g, atol=1e-6, rtol=1e-4, msg=name)
    assert all(with_ckpt[f"model.layers.{i}.mlp.gate.weight"].abs().max() > 0 for i in (0, 1))


def test_without_replay_the_trainer_misses_the_engines_logprobs(moe_path):
    metrics, planted = _step(_trainer(moe_path, replay=False))
    assert planted > 0.05 and metrics["mismatch/abs_logp_diff"] > 1e-3
    assert not any(k.startswith("moe/") for k in metrics)


def test_a_dense_model_is_refused_at_trainer_start(tiny_model_path):
    from pace.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^algo.routing_replay: .* has no MoE router \(a dense model\); set "
                                          r"algo.routing_replay=false$"):
        _trainer(tiny_model_path, replay=True)
