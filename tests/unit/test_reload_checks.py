"""pace/weights/reload.py on a toy module through vLLM's own layerwise reload (no engine): what an
update received, layer by layer; the tied layer's refresh; an incomplete update reported after
vLLM's finalize. The engine-level tests are tests/integration/test_weight_sync.py."""
from __future__ import annotations

import pytest
import torch
from tests.helpers import FULL, _Engine, _Toy, _update

pytestmark = pytest.mark.unit


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


def test_the_checked_engine_refreshes_the_tied_head_and_fails_an_incomplete_update_after_finalize():
    from pace.weights import reload

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
    from pace.weights import reload

    model = _Toy()
    model.head.quant_method = type("Fp8LinearMethod", (), {"process_weights_after_loading": lambda self, layer: None})()
    engine = reload.checked(_Engine)(model)
    _update(model, FULL, engine)
    assert engine.take_failure().startswith("weight update: tied layer head (Fp8LinearMethod) received no weights")


def test_every_backend_builds_a_checked_engine_in_the_workers():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from pace.weights import transfer
    from pace.weights.reload import ExactReload

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

    from pace.weights import reload
    import pace.weights.transfer  # noqa: F401 - registering the backends installs the filter

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

    from pace.weights.reload import expected_elements

    shard = SimpleNamespace(num_org_elements=50_280)
    assert expected_elements(SimpleNamespace(shard_indices=shard, embedding_dim=8), 50_304 * 8) == 50_280 * 8
    head = SimpleNamespace(shard_indices=shard, embedding_dim=8, has_bias=True)
    assert expected_elements(head, 50_304 * 9) == 50_280 * 9
    assert expected_elements(torch.nn.Linear(4, 4), 20) == 20


def test_a_model_counts_as_reloaded_from_the_first_update_it_begins_as_the_workers_rpc_says():
    """The reload probe compares only engines still holding their load from disk
    (pace/rollout/reload_probe.py): the worker's RPC answers per served model, as a dict (a server's
    `/collective_rpc` turns a scalar result into its str: "False" would read as true)."""
    from types import SimpleNamespace

    from pace.weights import reload
    from pace.weights.transfer import WorkerExtension

    engine = reload.checked(_Engine)(_Toy())
    worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: engine.model))
    assert WorkerExtension.pace_weights_reloaded(worker) == {"reloaded": False}
    _update(engine.model, {"embed.weight": FULL["embed.weight"]}, engine)  # even one that fails its checks
    assert engine.take_failure() is not None
    assert WorkerExtension.pace_weights_reloaded(worker) == {"reloaded": True}
    assert not reload.reloaded(_Toy())  # another model (another engine in this process) is not
