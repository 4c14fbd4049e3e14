"""The gloo backend's delta protocol (pace/weights/gloo.py) without an engine: trainer rank 0 and
one engine worker in one process, each with its own gloo group over one TCPStore, the worker's
model a recorder of what its loader receives. A patch update patches the worker's mirror and
reloads every tensor from it; a patch for weights the worker does not hold fails in one line."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from pace.net import free_port
from pace.weights import gloo
from pace.weights.delta import DeltaTracker
from pace.weights.transfer import CastSource


class _Loader:
    """The engine model's `load_weights`: keeps the last tensor of each name."""

    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}
        self.calls = 0

    def load_weights(self, weights):
        self.calls += 1
        for name, t in weights:
            self.loaded[name] = t.clone()
        return {name for name, _ in weights}


class _Client:
    """vLLM's four calls, the worker's side run in the calling thread (the trainer engine's update thread)."""

    def __init__(self, worker):
        self.worker, self.version = worker, None

    def start_weight_update(self):
        pass

    def update_weights(self, info: dict):
        info = {**info, "version": info.get("version") or self.version}  # as BlockingClient labels it
        self.worker.receive_weights(gloo.GlooUpdateInfo(**info))

    def finish_weight_update(self):
        pass


@pytest.fixture
def pair():
    """(trainer engine, worker engine, the trainer's model) joined in a gloo group of two."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    port, made = free_port(), {}
    worker = gloo.GlooWeightTransferEngine.__new__(gloo.GlooWeightTransferEngine)  # no vLLM engine around it
    worker.model, worker.device = _Loader(), torch.device("cpu")
    info = gloo.GlooInitInfo(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, delta=True)
    worker.parallel_config = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    joined = threading.Thread(target=worker.init_transfer_engine, args=(info,))
    joined.start()
    made["group"], made["store"] = gloo._group("127.0.0.1", port, 0, 2, is_master=True)
    joined.join(timeout=60)
    client = _Client(worker)
    trainer = gloo.GlooTrainerWeightTransferEngine(client=client, source=CastSource(model, torch.float32), is_sender=True)
    trainer.group, trainer._store = made["group"], made["store"]
    return trainer, worker, model, client


def test_patches_rebuild_every_tensor_in_the_worker_and_a_wrong_base_fails(pair):
    trainer, worker, model, client = pair
    tracker = DeltaTracker(model, torch.float32, full_every=0, max_frac=1.0)
    client.version = 1
    tracker.sent(tracker.plan(1), None)
    trainer.send_weights()  # θ_1 whole: the worker's baseline
    assert worker.mirror_version == 1 and set(worker.mirror) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    with torch.no_grad():
        model[0].weight[2, 3] += 1.0
        model[1].bias[1] -= 0.5
    plan = tracker.plan(2)
    assert sorted((p.name, p.indices.tolist()) for p in plan.patches) == [("0.weight", [15]), ("1.bias", [1])]
    calls = worker.model.calls
    trainer.send_patches(plan.patches, 2, base=1)
    tracker.sent(plan)
    assert worker.mirror_version == 2
    assert worker.model.calls == calls + 1  # one load of every tensor, from the patched mirror
    assert all(torch.equal(worker.model.loaded[n], p.detach()) for n, p in model.named_parameters())

    with torch.no_grad():
        model[1].weight[0, 0] += 1.0
    plan = tracker.plan(3)
    with pytest.raises(gloo.DeltaMismatch, match="patches for θ_1 → θ_3, but this engine worker holds θ_2"):
        trainer.send_patches(plan.patches, 3, base=1)
    assert worker.mirror_version == 2  # untouched: the broadcasts were all received first


def test_a_worker_without_a_whole_update_refuses_patches(pair):
    trainer, worker, model, _ = pair
    tracker = DeltaTracker(model, torch.float32, full_every=0, max_frac=1.0)
    tracker.sent(tracker.plan(1), None)
    with torch.no_grad():
        model[0].bias[0] += 1.0
    with pytest.raises(gloo.DeltaMismatch, match="holds no full update"):
        trainer.send_patches(tracker.plan(2).patches, 2, base=1)
