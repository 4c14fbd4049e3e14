"""The shared-memory weight-transfer backend's file format and the engine fleet's request routing
(pure logic; the engines' side runs in tests/integration/test_engine.py and test_multiprocess.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.unit


def test_slot_round_trip_keeps_names_dtypes_shapes_and_values(tmp_path):
    from pace.weights import transfer

    gen = torch.Generator().manual_seed(0)
    named = [("a.weight", torch.randn(3, 5, generator=gen)), ("b.bias", torch.randn(7, generator=gen).to(torch.bfloat16)),
             ("c", torch.arange(6, dtype=torch.int64).view(2, 3)), ("d.scalar", torch.tensor(2.5))]
    info = transfer.write_slot(str(tmp_path / "slot.bin"), transfer.tensor_meta(named), iter(named))
    assert all(off % transfer.ALIGN == 0 for off in info.offsets)  # a view of any dtype is aligned
    assert info.size == (tmp_path / "slot.bin").stat().st_size
    from dataclasses import asdict

    back = transfer.read_slot(asdict(info))
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, back):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_cast_source_sends_engine_dtype_once_per_tied_tensor_under_checkpoint_names():
    from pace.weights import transfer

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 4)
    model.head = torch.nn.Linear(4, 10, bias=False)
    model.head.weight = model.embed.weight  # tied, as Qwen3's small models
    wrapped = torch.nn.Module()
    wrapped.module = model  # DDP's prefix
    src = transfer.CastSource(wrapped, torch.bfloat16)
    meta = src.metadata()
    assert [m.name for m in meta] == ["embed.weight"] and meta[0].dtype == torch.bfloat16
    (name, tensor), = list(src)
    assert name == "embed.weight" and tensor.dtype == torch.bfloat16


def test_a_source_that_disagrees_with_its_metadata_is_refused(tmp_path):
    from pace.weights import transfer

    named = [("a", torch.zeros(2)), ("b", torch.zeros(3))]
    with pytest.raises(RuntimeError, match="'b'"):
        transfer.write_slot(str(tmp_path / "s.bin"), transfer.tensor_meta(named), iter([named[1], named[0]]))
    with pytest.raises(RuntimeError, match="1 tensors"):
        transfer.write_slot(str(tmp_path / "s.bin"), transfer.tensor_meta(named), iter(named[:1]))


def test_the_shm_trainer_engine_sends_as_vllm_calls_it_without_a_version_and_as_pace_does_with_one(tmp_path):
    """vLLM's trainer-side interface is `send_weights()`: the slot is written and handed over, the
    engines' label kept (None); with a version, the update carries it."""
    from pace.weights import transfer

    class Client:
        def __init__(self):
            self.inits, self.updates = [], []

        def init_weight_transfer_engine(self, info):
            self.inits.append(info)

        def post_update(self, update):
            self.updates.append(update)

    model = torch.nn.Linear(3, 2)
    client = Client()
    engine = transfer.ShmTrainerWeightTransferEngine.trainer_init(
        transfer.ShmTrainerInitInfo(directory=str(tmp_path), run_id="t", rank=0), client=client,
        source=transfer.CastSource(model, torch.float32))
    engine.send_weights()
    engine.send_weights(3)
    assert [u.version for u in client.updates] == [None, 3] and len(client.inits) == 1
    back = dict(transfer.read_slot(client.updates[0].info))
    assert torch.equal(back["weight"], model.weight.detach()) and torch.equal(back["bias"], model.bias.detach())
    engine.shutdown()


class _Engine:
    def __init__(self):
        self.added, self.aborted = [], []
        self.vllm_config = SimpleNamespace(device_config=SimpleNamespace(device_type="cpu"))

    def add_request(self, rid, prompt, params, priority=0):
        self.added.append(rid)

    def abort_request(self, ids):
        self.aborted += ids

    def has_unfinished_requests(self):
        return len(self.added) > len(self.aborted)


def test_fleet_keeps_a_group_on_one_engine_and_balances_groups():
    from pace.rollout.fleet import EngineFleet

    engines = [_Engine(), _Engine()]
    fleet = EngineFleet([SimpleNamespace(llm_engine=e) for e in engines])
    for g in range(4):
        for i in range(3):
            fleet.add_request(f"g{g}-{i}", {}, None, group=f"g{g}")
    assert [len(e.added) for e in engines] == [6, 6]
    assert {r[:2] for r in engines[0].added}.isdisjoint({r[:2] for r in engines[1].added})
    fleet.add_request("g0-0-1", {}, None, group="g0")  # a later turn follows its group
    owner = 0 if "g0-0" in engines[0].added else 1
    assert "g0-0-1" in engines[owner].added
    fleet.abort_request(["g1-0", "g0-0-1", "unknown"])
    assert sorted(engines[0].aborted + engines[1].aborted) == ["g0-0-1", "g1-0"]


class _WorkerGroup:
    """An out-of-process engine's workers for the fleet's weight RPCs: each call that is a
    collective (init, update) waits at a barrier all engines' calls must reach, as NCCL's
    rendezvous and broadcast do; a sequential fleet breaks the barrier (BrokenBarrierError)."""

    def __init__(self, tp: int, barrier):
        import queue

        self.barrier, self.calls = barrier, []
        self.llm_engine = _Engine()
        self.llm_engine.vllm_config.parallel_config = SimpleNamespace(world_size=tp)
        self.llm_engine.engine_core = SimpleNamespace(outputs_queue=queue.Queue())  # a child engine's client

    def collective_rpc(self, method, kwargs=None):
        self.calls.append((method, kwargs))
        if method in ("init_weight_transfer_engine", "update_weights"):
            self.barrier.wait()
        return [method] * self.llm_engine.vllm_config.parallel_config.world_size


def test_fleet_gives_each_engine_its_own_ranks_and_calls_the_engines_at_once():
    import threading

    from pace.rollout.fleet import EngineFleet

    barrier = threading.Barrier(3, timeout=5)
    groups = [_WorkerGroup(2, barrier) for _ in range(3)]  # 3 engines × TP 2 after the trainer's rank 0
    fleet = EngineFleet(groups)
    fleet.init_weight_transfer_engine({"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 7})
    offsets = [g.calls[0][1]["init_info"]["rank_offset"] for g in groups]
    assert offsets == [1, 3, 5]  # engine e's workers at 1 + 2e, 2 + 2e: ranks 1..6, none shared
    assert all(g.calls[0][1]["init_info"]["world_size"] == 7 for g in groups)
    fleet.load({"names": ["w"]})  # the broadcast: every engine inside update_weights at once
    assert all(g.calls[-1] == ("update_weights", {"update_info": {"names": ["w"]}}) for g in groups)
    assert fleet.collective_rpc("finish_weight_update") == ["finish_weight_update"] * 6  # per worker, engine order

    two = threading.Barrier(2, timeout=5)
    shm = EngineFleet([_WorkerGroup(1, two) for _ in range(2)])
    shm.init_weight_transfer_engine({"directory": "/dev/shm"})  # no ranks: the same info to each
    assert [g.calls[0][1]["init_info"] for g in shm.llms] == [{"directory": "/dev/shm"}] * 2


def test_an_engine_that_fails_its_call_raises_at_once_while_the_others_wait_in_the_collective():
    import threading
    import time

    from pace.rollout.fleet import EngineFleet

    barrier = threading.Barrier(2, timeout=5)
    groups = [_WorkerGroup(1, barrier), _WorkerGroup(1, barrier)]

    def dead(method, kwargs=None):
        raise RuntimeError("engine 1 died")

    groups[1].collective_rpc = dead  # engine 0 waits at the barrier for a peer that never comes
    fleet = EngineFleet(groups)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="engine 1 died"):
        fleet.load({"names": ["w"]})
    assert time.monotonic() - t < 2  # not after engine 0's wait (5 s here, the collective's timeout on GPUs)
    barrier.abort()  # release engine 0's thread
