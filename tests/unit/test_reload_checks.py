"""pace/rollout/reload.py on a toy module through vLLM's own layerwise reload (no engine): what an
update received, layer by layer; the tied layer's refresh; an incomplete update reported after
vLLM's finalize. The engine-level tests are tests/integration/test_weight_sync.py."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit


class _Cache(torch.nn.Module):  # as RotaryEmbedding: a buffer computed from the config, no parameter
    def __init__(self):
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.arange(4.0), persistent=False)


def _embedding_method():
    """vLLM's UnquantizedEmbeddingMethod whose post-load processing packs `weight` into a kernel of
    the layer's own, as vLLM-CPU's `cpu_linear` does, which only re-processing refreshes."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    class Packing(UnquantizedEmbeddingMethod):
        def process_weights_after_loading(self, layer):
            layer.packed = layer.weight.detach().clone()

    return Packing()


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(6, 4)
        self.mid = torch.nn.Linear(4, 4)
        self.rope = _Cache()
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter, two layers
        self.head.quant_method = _embedding_method()
        self.head.quant_method.process_weights_after_loading(self.head)

    def load_weights(self, weights) -> set[str]:
        """As a vLLM model's: each tensor through its parameter's (wrapped) loader; names loaded."""
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        names = set()
        for name, w in weights:
            p = self.get_parameter(name)
            getattr(p, "weight_loader", default_weight_loader)(p, w)
            names.add(name)
        return names


def _update(model, weights: dict, engine=None):
    """One update as a weight-transfer engine runs it: start, each tensor through its (wrapped)
    weight loader, finish; with ``engine`` (an ExactReload) its own start/finish."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )
    from pace.rollout import reload

    record_metadata_for_reloading(model)
    shared = reload.shared_parameters(model)
    if engine is not None:
        engine.start_weight_update()
    else:
        initialize_layerwise_reload(model)
    model.load_weights(weights.items())
    if engine is not None:
        return engine.finish_weight_update()
    found = reload.audit(model, shared)
    finalize_layerwise_reload(model, type("ModelConfig", (), {"dtype": torch.float32})())
    return found


FULL = {"embed.weight": torch.ones(6, 4), "mid.weight": torch.full((4, 4), 2.0), "mid.bias": torch.full((4,), 3.0)}


def test_a_complete_update_names_the_tied_head_and_the_buffer_only_layer():
    model = _Toy()
    found = _update(model, FULL)
    assert set(found.complete) == {"embed", "mid"} and not found.missing
    assert [n for n, _ in found.tied] == ["head"] and found.derived == ["rope"]
    assert model.head.weight is model.embed.weight and torch.equal(model.head.weight, FULL["embed.weight"])


@pytest.mark.parametrize("dropped, missing", [("mid.weight", ("mid", 4, 20)), ("mid.bias", ("mid", 16, 20)),
                                              ("embed.weight", ("embed", 0, 24))])
def test_a_missing_or_partial_layer_is_missing_and_a_tied_partner_of_it_is_not_excused(dropped, missing):
    found = _update(_Toy(), {k: v for k, v in FULL.items() if k != dropped})
    embed_lost = dropped == "embed.weight"  # then the head has no loaded partner to be refreshed from
    assert sorted(found.missing) == sorted([missing] + ([("head", 0, 24)] if embed_lost else []))
    assert [n for n, _ in found.tied] == ([] if embed_lost else ["head"])


class _Engine:
    """A worker-side weight-transfer engine's layerwise lifecycle, as vLLM's nccl/ipc engines run it."""

    def __init__(self, model):
        self.model = model

    def drain_pending(self):  # vLLM's base class: nothing deferred
        pass

    def start_weight_update(self):
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self):
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, type("ModelConfig", (), {"dtype": torch.float32})())
        self.finished = True


def test_the_checked_engine_refreshes_the_tied_head_and_fails_an_incomplete_update_after_finalize():
    from pace.rollout import reload

    engine = reload.checked(_Engine)(_Toy())
    _update(engine.model, FULL, engine)
    head = engine.model.head
    assert torch.equal(head.packed, FULL["embed.weight"])  # re-processed from the updated shared weight
    assert [n for n, _ in engine.last_audit.tied] == ["head"]
    assert engine.last_audit.loaded == set(FULL) and "load_weights" not in vars(engine.model)  # unwrapped

    assert engine.take_failure() is None

    engine = reload.checked(_Engine)(_Toy())
    before = engine.model.mid.weight.detach().clone()
    _update(engine.model, {"embed.weight": FULL["embed.weight"]}, engine)  # vLLM's lifecycle completes
    assert engine.finished and torch.equal(engine.model.mid.weight, before)  # finalize ran: vLLM put θ_prev back
    assert engine.take_failure().startswith("weight update incomplete: mid got 0 of 20 elements (1 layers")
    assert engine.take_failure() is None  # taken once


def test_a_tied_layer_whose_processing_cannot_be_redone_fails_in_one_line():
    from pace.rollout import reload

    model = _Toy()
    model.head.quant_method = type("Fp8LinearMethod", (), {"process_weights_after_loading": lambda self, layer: None})()
    engine = reload.checked(_Engine)(model)
    _update(model, FULL, engine)
    assert engine.take_failure().startswith("weight update: tied layer head (Fp8LinearMethod) received no weights")


def test_every_backend_builds_a_checked_engine_in_the_workers():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from pace.rollout import transfer
    from pace.rollout.reload import ExactReload

    bases = {"pace_shm": transfer.ShmWeightTransferEngine, "nccl": NCCLWeightTransferEngine, "ipc": IPCWeightTransferEngine}
    for backend, base in bases.items():
        cls = WeightTransferEngineFactory._registry[transfer.engine_backend(backend)]()
        assert issubclass(cls, ExactReload) and issubclass(cls, base), backend
        assert cls.__mro__.index(ExactReload) < cls.__mro__.index(base)  # its start/finish wrap the backend's


def test_only_the_failed_load_lines_the_audit_decides_are_dropped_from_vllms_log():
    """vLLM's "Failed to load weights" lines are decided by the audit; its other reload messages
    (e.g. the device-memory warning about weight order) still reach the log. A handler on vLLM's
    logger itself (vLLM's logging config stops propagation to the root logger pytest captures)."""
    import logging

    from vllm.model_executor.model_loader.reload import layerwise

    from pace.rollout import reload
    import pace.rollout.transfer  # noqa: F401 - registering the backends installs the filter

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    logger, keep = logging.getLogger(reload.LAYERWISE_LOGGER), Keep()
    level = logger.level
    logger.addHandler(keep)
    logger.setLevel(logging.WARNING)
    try:
        layerwise.logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        layerwise.logger.warning("Allocating %.1f MB of device memory to buffers", 12.0)
    finally:
        logger.removeHandler(keep)
        logger.setLevel(level)
    assert keep.messages == ["Allocating 12.0 MB of device memory to buffers"]


def test_a_padded_vocabulary_expects_only_the_rows_a_checkpoint_has():
    """vLLM pads a vocab-parallel layer's rows to a multiple of 64 and zero-fills them itself
    (uncounted): a vocabulary of 50,280 must not read as a partial load."""
    from types import SimpleNamespace

    from pace.rollout.reload import expected_elements

    shard = SimpleNamespace(num_org_elements=50_280)
    assert expected_elements(SimpleNamespace(shard_indices=shard, embedding_dim=8), 50_304 * 8) == 50_280 * 8
    head = SimpleNamespace(shard_indices=shard, embedding_dim=8, has_bias=True)
    assert expected_elements(head, 50_304 * 9) == 50_280 * 9
    assert expected_elements(torch.nn.Linear(4, 4), 20) == 20
