"""The weights a run syncs reach every layer of the engine, exactly, through the path a run takes:
the trainer's `WeightSync` (its `CastSource` over the model's parameters) → the pace_shm backend →
the rollout worker's fleet → vLLM's layerwise reload, with pace/weights/reload.py's checks.

Guards against (each seen failing): a tied output head left with θ_0's kernels after every sync
(vLLM-CPU packs the head's GEMM weights once; the tied checkpoint names the tensor only as
`embed_tokens`) — 2.1 nats a token after a move of every parameter; a sync that drops tensors
(every `layers.1.*`, or one projection of a fused `qkv_proj`), which vLLM lets pass.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


from tests.helpers import sampled_vs_trainer

pytestmark = pytest.mark.integration


def _engine(path):
    from pace.config import RolloutConfig
    from pace.rollout import engine as engine_lib

    return engine_lib.build_engine(path, RolloutConfig(), "float32", seed=0)


def _untied_model(path) -> str:
    """The tiny default's architecture with its own output head (as Qwen3-8B), random weights."""
    from transformers import Qwen3ForCausalLM

    from pace.tiny import build_tokenizer, model_config
    from pace.tiny_spec import TinySpec

    tok = build_tokenizer()
    cfg = model_config(TinySpec(), tok)
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tied(tiny_model_path):
    """The tiny default: its output head is its embedding (as Qwen3-4B and smaller)."""
    from pace.rollout import engine as engine_lib

    llm = _engine(tiny_model_path)
    yield tiny_model_path, llm
    engine_lib.shutdown(llm)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    from pace.rollout import engine as engine_lib

    path = _untied_model(tmp_path_factory.mktemp("untied"))
    llm = _engine(path)
    yield path, llm
    engine_lib.shutdown(llm)


def _moved(path, seed: int):
    """The trainer's model: ``path`` with every parameter moved by N(0, 0.05²) (the tied head moves
    with its embedding: one tensor)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def _sync(llm, model, version: int):
    """One sync as a run makes it: `WeightSync.prepare/publish` on the trainer's side, the rollout
    worker's update between engine steps on the engine's (stepped here by hand, no thread)."""
    from accelerate import Accelerator
    from omegaconf import OmegaConf

    from pace.config import Config
    from pace.placement import Placement
    from pace.pool import Pool, build_policy
    from pace.rollout.fleet import EngineFleet
    from pace.rollout.worker import RolloutWorker
    from pace.tasks.base import Prompt, PromptSampler
    from pace.weights.sync import WeightSync

    cfg = OmegaConf.structured(Config)
    worker = RolloutWorker(EngineFleet([llm]), llm.get_tokenizer(), PromptSampler([Prompt("p", "1+1=?\n", "2")]),
                           Pool(build_policy(cfg), informative=lambda g: True), None, cfg)
    sync = WeightSync(cfg, SimpleNamespace(acc=Accelerator(cpu=True), model=model), worker,
                      Placement.of(cfg.rollout, "cpu", 1))
    assert sync.backend == "pace_shm"
    try:
        sync.prepare(version)
        sync.publish(version)
        assert worker._apply_update() and worker.engine_version == version
    finally:
        sync.close()


def _audit(llm):
    """What the engine's last update received, layer by layer (pace/weights/reload.py)."""
    return llm.llm_engine.model_executor.driver_worker.worker.weight_transfer_engine.last_audit


@pytest.mark.parametrize("head", ["tied", "untied"])
def test_the_engine_computes_with_the_trainers_weights_after_a_real_sync(head, request):
    """After a sync through the run's path, the engine's ℓ^μ of the tokens it samples equals the
    trainer's log π_θ to < 1e-4 a token (float32 on both sides: ~3e-5 measured), for a tied and an
    untied head; and the engine's model reported loading every one of its parameters."""
    path, llm = request.getfixturevalue(head)
    for version, seed in ((1, 5), (2, 6)):  # two moves: the second is not a first load of anything
        model = _moved(path, seed)
        _sync(llm, model, version)
        for temperature in (1.0, 0.7):
            worst = sampled_vs_trainer(llm, model, temperature)[0]
            print(f"v{version} T={temperature}: max |ℓ^μ − log π_θ| = {worst:.2e}")
            assert worst < 1e-4, (version, temperature, worst)
    audit = _audit(llm)
    tied = [name for name, _ in audit.tied]
    assert tied == (["lm_head"] if head == "tied" else []) and not audit.missing
    # coverage, by vLLM's own parameter names (apart from the element counts the checks use): the
    # engine model's `load_weights` reported loading every parameter the engine model has
    engine_model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    names = {name for name, _ in engine_model.named_parameters()}
    assert audit.loaded == names, (names - audit.loaded, audit.loaded - names)


@pytest.mark.parametrize("dropped", [".layers.1.", "layers.1.self_attn.k_proj."])  # a layer; part of a fused qkv_proj
def test_a_sync_that_misses_tensors_fails_naming_the_layers_and_the_engine_recovers(tied, monkeypatch, dropped):
    from pace.weights import source
    from pace.weights.reload import IncompleteWeightUpdate

    path, llm = tied
    model = _moved(path, seed=7)
    attn = model.model.layers[1].self_attn
    qkv = sum(p.weight.numel() for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    got = 0 if dropped == ".layers.1." else qkv - attn.k_proj.weight.numel()
    named = f"model.layers.1.self_attn.qkv_proj got {got} of {qkv} elements"
    named_params = source.named_parameters  # what the weight sync's CastSource walks
    monkeypatch.setattr(source, "named_parameters", lambda model: ((n, p) for n, p in named_params(model) if dropped not in n))
    with pytest.raises(IncompleteWeightUpdate, match=named):
        _sync(llm, model, 3)
    engine_model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    unloaded = {name for name, _ in engine_model.named_parameters()} - _audit(llm).loaded
    if dropped == ".layers.1.":  # by name too
        assert unloaded and all(".layers.1." in n for n in unloaded), unloaded
    else:  # a partial projection still reports its name: only the element counts catch it
        assert not unloaded, unloaded
    monkeypatch.undo()
    _sync(llm, model, 3)  # the failed update closed its session: the engine takes the next one
    assert sampled_vs_trainer(llm, model, 1.0)[0] < 1e-4
