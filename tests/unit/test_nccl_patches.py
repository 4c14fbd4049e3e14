"""The nccl backend's delta protocol (pace/weights/nccl_delta.py) without NCCL or a GPU: trainer rank 0's
`DeltaNCCLTrainerWeightTransferEngine` and one `pace_nccl` engine worker in one process, joined by a
stand-in communicator (what one side broadcasts, the other receives, in order, shape and dtype
checked); the worker's model a toy as vLLM builds one — the checkpoint's `q.weight` and `k.weight`
land in one fused parameter through its weight loader — run through vLLM's layerwise reload for whole
updates and vLLM's own `load_checkpoint_weight_patches` for patches, as on a GPU. What is not run
here: NCCL's broadcast, CUDA streams, a real vLLM model's loaders (docs/gpu.md)."""
from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest
import torch

from pace.weights import fingerprint as fp
from pace.weights.delta import DeltaTracker
from pace.weights.nccl_delta import (
    CheckedDeltaNCCLWeightTransferEngine,
    DeltaNCCLTrainerWeightTransferEngine,
    DeltaNCCLUpdateInfo,
)
from pace.weights.transfer import CastSource

pytestmark = pytest.mark.unit


class _End:
    """One side of the stand-in communicator: rank 0 puts each broadcast on the wire, a worker takes
    them in order into its (empty) tensor. ``log``: each receive's bytes, in order, shared with the model."""

    device = torch.device("cpu")

    def __init__(self, wire: queue.Queue, sender: bool, log: list):
        self.wire, self.sender, self.log = wire, sender, log

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream=None) -> None:
        assert src == 0 and stream is None  # a CPU device: no CUDA stream (nccl_delta.on_device)
        if self.sender:
            self.wire.put(tensor.detach().clone())
            return
        sent = self.wire.get(timeout=30)
        assert sent.shape == tensor.shape and sent.dtype == tensor.dtype, (sent.shape, tensor.shape)
        tensor.copy_(sent)
        self.log.append(("receive", tensor.numel() * tensor.element_size()))


def _shard_loader(param, loaded_weight, shard_id):
    """As vLLM's QKVParallelLinear.weight_loader: one shard's rows of the fused parameter, one copy."""
    rows = slice(0, 4) if shard_id == "q" else slice(4, 6)
    param.data[rows].copy_(loaded_weight)


class _FusedModel(torch.nn.Module):
    """The engine's model: `qk.weight` = [q; k] (4 + 2 rows), `out` as the checkpoint has it.
    `load_weights` reports the parameters it wrote, as vLLM's `AutoWeightsLoader`, and skips a name
    it does not know without a word, as that loader skips a tied alias or an unexpected bias."""

    def __init__(self, log: list):
        super().__init__()
        self.qk = torch.nn.Linear(4, 6, bias=False)
        self.qk.weight.weight_loader = _shard_loader
        self.out = torch.nn.Linear(6, 4)
        self.log = log

    def load_weights(self, weights) -> set[str]:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        names = set()
        for name, w in weights:
            self.log.append(("load", name))
            if name in ("q.weight", "k.weight"):
                self.qk.weight.weight_loader(self.qk.weight, w, name[0])
                names.add("qk.weight")
            elif name in ("out.weight", "out.bias"):
                p = self.get_parameter(name)
                getattr(p, "weight_loader", default_weight_loader)(p, w)
                names.add(name)
        return names

    def as_checkpoint(self) -> dict[str, torch.Tensor]:
        w = self.qk.weight.detach()
        return {"q.weight": w[:4], "k.weight": w[4:], "out.weight": self.out.weight.detach(), "out.bias": self.out.bias.detach()}


class _Policy(torch.nn.Module):
    """The trainer's model: the checkpoint's names and layout."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(4, 4, bias=False)
        self.k = torch.nn.Linear(4, 2, bias=False)
        self.out = torch.nn.Linear(6, 4)


class _Client:
    """vLLM's four calls, the worker's run here (send_patches runs update_weights on a thread of its
    own while it broadcasts); what the worker's reload check reports after each update, as the fleet
    reads it (`pace_weight_update_failure`)."""

    def __init__(self, worker):
        self.worker, self.reports = worker, []

    def start_weight_update(self):
        self.worker.start_weight_update()

    def update_weights(self, info: dict):
        self.worker.receive_weights(self.worker.parse_update_info(info))

    def finish_weight_update(self):
        self.worker.finish_weight_update()
        self.reports.append(self.worker.take_failure())


def _receive_whole(self, info) -> None:
    """vLLM's NCCLWeightTransferEngine.receive_weights, unpacked: each tensor received, then loaded."""
    for name, dtype_name, shape in zip(info.names, info.dtype_names, info.shapes):
        weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
        self.model_update_group.broadcast(weight, src=0, stream=None)
        self.model.load_weights([(name, weight)])


@pytest.fixture
def pair(monkeypatch):
    """(trainer engine, worker, trainer model, client, log) joined by a stand-in communicator."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    monkeypatch.setattr(NCCLWeightTransferEngine, "receive_weights", _receive_whole)
    torch.manual_seed(0)
    policy, log, wire = _Policy(), [], queue.Queue()
    model = _FusedModel(log)
    record_metadata_for_reloading(model)  # vLLM does at the engine's load
    config = SimpleNamespace(parallel_config=SimpleNamespace(), model_config=SimpleNamespace(dtype=torch.float32))
    worker = CheckedDeltaNCCLWeightTransferEngine(None, config, torch.device("cpu"), model)
    worker.model_update_group = _End(wire, sender=False, log=log)
    client = _Client(worker)
    trainer = DeltaNCCLTrainerWeightTransferEngine(client=client, source=CastSource(policy, torch.float32))
    trainer.model_update_group = _End(wire, sender=True, log=log)
    return trainer, worker, policy, client, log


def _send_whole(trainer, policy, version: int) -> dict[str, int]:
    """θ_version whole, as vLLM's NCCL trainer engine sends it (labelled as BlockingClient labels it);
    the fingerprints of what was sent."""
    names = [n for n, _ in policy.named_parameters()]
    info = DeltaNCCLUpdateInfo(names=names, dtype_names=["float32"] * len(names),
                               shapes=[list(p.shape) for _, p in policy.named_parameters()], version=version)
    for _, p in policy.named_parameters():
        trainer.model_update_group.broadcast(p.detach().clone())
    trainer.client.start_weight_update()
    trainer.client.update_weights(vars(info))
    trainer.client.finish_weight_update()
    return {n: fp.tensor_fingerprint(p.detach()) for n, p in policy.named_parameters()}


def _holds(worker, policy) -> bool:
    got = worker.model.as_checkpoint()
    return all(torch.equal(got[n], p.detach()) for n, p in policy.named_parameters())


def _step(policy, *changes) -> None:
    with torch.no_grad():
        for name, index, delta in changes:
            policy.get_parameter(name).view(-1)[index] += delta


def test_patches_go_in_place_through_the_model_s_own_loader_and_a_wrong_base_is_refused(pair):
    trainer, worker, policy, client, _ = pair
    tracker = DeltaTracker(policy, torch.float32, full_every=0, max_frac=1.0)
    tracker.sent(tracker.plan(1), _send_whole(trainer, policy, 1))
    assert _holds(worker, policy) and worker.held_version == 1 and client.reports == [None]

    _step(policy, ("q.weight", 5, 1.0), ("k.weight", 7, -0.5), ("out.bias", 0, 2.0))
    plan = tracker.plan(2)
    assert not plan.full and sorted(p.name for p in plan.patches) == ["k.weight", "out.bias", "q.weight"]
    trainer.send_patches(plan.patches, 2, base=1)
    tracker.sent(plan)
    assert _holds(worker, policy) and worker.held_version == 2  # k's rows of the fused parameter too

    _step(policy, ("out.weight", 3, 1.0))
    before = worker.model.as_checkpoint()
    with pytest.raises(RuntimeError, match="patches for θ_1 → θ_3, but this engine worker holds θ_2"):
        trainer.send_patches(tracker.plan(3).patches, 3, base=1)
    assert all(torch.equal(before[n], t) for n, t in worker.model.as_checkpoint().items())  # nothing applied
    assert trainer.model_update_group.wire.empty()  # every broadcast was received


def test_chunks_are_consecutive_runs_within_the_bound_and_a_larger_patch_runs_alone():
    from pace.weights.inplace import chunks, wire_bytes

    assert wire_bytes(10, torch.float32) == 80 and wire_bytes(10, torch.bfloat16) == 60  # int32 index + value
    assert chunks([80, 48, 160, 16], 130) == [range(0, 2), range(2, 3), range(3, 4)]
    assert chunks([80, 48, 160, 16], 10_000) == [range(0, 4)]
    assert chunks([5, 5, 5], 5) == [range(0, 1), range(1, 2), range(2, 3)]
    assert chunks([], 100) == []
    with pytest.raises(ValueError):
        chunks([1], 0)


def test_a_worker_applies_each_chunk_before_it_receives_the_next(pair):
    """vLLM's sparse engine receives every patch of an update before it applies any (~16 GB on an 8B's
    GPU near delta_max_frac); here at most `chunk_bytes` of indices and values wait to be applied."""
    trainer, worker, policy, client, log = pair
    tracker = DeltaTracker(policy, torch.float32, full_every=0, max_frac=1.0)
    tracker.sent(tracker.plan(1), _send_whole(trainer, policy, 1))
    _step(policy, *[("q.weight", i, 1.0) for i in range(10)], *[("k.weight", i, 1.0) for i in range(6)],
          *[("out.weight", i, 1.0) for i in range(20)], *[("out.bias", i, 1.0) for i in range(2)])
    plan = tracker.plan(2)
    assert [(p.name, p.indices.numel()) for p in plan.patches] == [("q.weight", 10), ("k.weight", 6),
                                                                    ("out.weight", 20), ("out.bias", 2)]
    trainer.chunk_bytes = 130  # q (80 bytes: 10 int32 indices, 10 float32 values) and k (48) together, then one each
    del log[:]
    trainer.send_patches(plan.patches, 2, base=1)
    assert log == [("receive", 40), ("receive", 40), ("receive", 24), ("receive", 24),
                   ("load", "q.weight"), ("load", "k.weight"),
                   ("receive", 80), ("receive", 80), ("load", "out.weight"),  # 160 bytes: alone
                   ("receive", 8), ("receive", 8), ("load", "out.bias")]
    assert _holds(worker, policy) and worker.held_version == 2


def test_a_patch_that_reaches_no_parameter_or_one_the_whole_update_did_not_load_is_not_trusted(pair):
    """The names each patch's loader call reported against the tensors sent: a tensor the engine's
    loader skips without a word (a whole update of it goes unnoticed too: no engine layer lacks an
    element) is lost from a patch update, which the worker reports as untrusted (the fleet keeps it
    for the trainer, whose next sync is whole) and does not take patches on (`held_version` None)."""
    from pace.weights.gloo import DeltaMismatch

    trainer, worker, policy, client, _ = pair
    policy.register_parameter("scale", torch.nn.Parameter(torch.zeros(3)))  # a name the engine's loader skips
    tracker = DeltaTracker(policy, torch.float32, full_every=0, max_frac=1.0)
    tracker.sent(tracker.plan(1), _send_whole(trainer, policy, 1))
    assert client.reports == [None] and worker.held_version == 1

    _step(policy, ("scale", 1, 1.0), ("q.weight", 0, 1.0))
    plan = tracker.plan(2)
    trainer.send_patches(plan.patches, 2, base=1)  # it loaded: not a failure
    tracker.sent(plan)
    assert client.reports[-1] == {"untrusted": "weight patches θ_1 → θ_2: 1 of 2 tensors sent were written into no "
                                               "parameter (scale)"}
    assert worker.held_version is None and torch.equal(worker.model.as_checkpoint()["q.weight"], policy.q.weight)
    _step(policy, ("q.weight", 1, 1.0))
    with pytest.raises(DeltaMismatch, match="θ_2 → θ_3, but this engine worker holds no version to patch"):
        trainer.send_patches(tracker.plan(3).patches, 3, base=2)


def test_a_loader_that_writes_a_parameter_the_whole_update_did_not_load_is_not_trusted(pair):
    trainer, worker, policy, client, _ = pair
    tracker = DeltaTracker(policy, torch.float32, full_every=0, max_frac=1.0)
    tracker.sent(tracker.plan(1), _send_whole(trainer, policy, 1))
    load = worker.model.load_weights
    worker.model.load_weights = lambda weights: load(weights) | {"rope.cos_sin_cache"}
    _step(policy, ("q.weight", 0, 1.0), ("out.bias", 1, 1.0))
    trainer.send_patches(tracker.plan(2).patches, 2, base=1)
    assert client.reports[-1] == {"untrusted": "weight patches θ_1 → θ_2: 1 parameters were written that the last "
                                               "whole update did not load (rope.cos_sin_cache)"}
    assert worker.held_version is None


def test_the_untrusted_line_names_the_first_few_and_counts_the_rest():
    from pace.weights.inplace import untrusted

    written = {f"t{i}": set() for i in range(5)} | {"a": {"x", "y"}}
    assert untrusted(written, {"x"}, 4, 5) == ("weight patches θ_4 → θ_5: 5 of 6 tensors sent were written into no "
                                               "parameter (t0, t1, t2, and 2 more); 1 parameters were written that "
                                               "the last whole update did not load (y)")
    assert untrusted({"a": {"x"}}, {"x", "z"}, 4, 5) is None  # a patch need not touch every parameter
    assert untrusted({"a": {"x"}}, None, 4, 5).endswith("the model's loader does not report the parameters it "
                                                        "writes, so no patch can be audited")


class _Rollout:
    """Rank 0's rollout for a real `WeightSync` on the gloo backend with no engine workers (a group of
    one): the calls run here, the broadcast goes nowhere; the fleet reports ``untrusted[v]`` after the
    update of θ_v, as `Fleet.end_update` keeps a worker's report for `take_untrusted`."""

    ident = None
    sent_weights = None

    def __init__(self, untrusted: dict[int, str]):
        self.untrusted, self.loaded = untrusted, []
        self.fleet = SimpleNamespace(load=lambda info: None, transfer_workers=lambda: 0, alive=[], group_members=lambda: [],
                                     regroup_due=lambda admit: False, wait_failed=lambda known: [],
                                     take_untrusted=lambda: self.untrusted.pop(self.loaded[-1], None))

    def init_weight_transfer_engine(self, info):
        pass

    def begin_update(self):
        pass

    def end_update(self, version):
        self.loaded.append(version)


def test_after_untrusted_patches_the_next_sync_is_whole_on_every_rank_with_one_warning(capsys):
    from pace.config import Config
    from pace.placement import Placement
    from pace.weights.sync import WeightSync

    cfg = Config()
    cfg.model.dtype, cfg.rollout.weight_transfer, cfg.rollout.engines = "float32", "gloo", 0
    cfg.rollout.weight_delta, cfg.rollout.delta_max_frac, cfg.rollout.full_sync_every = True, 1.0, 0
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    why = "weight patches θ_1 → θ_2: 1 of 2 tensors sent were written into no parameter (scale) (and 1 more workers)"
    rollout, flags, now = _Rollout({2: why}), [], [0]
    trainer = SimpleNamespace(model=model, acc=SimpleNamespace(process_index=0, is_main_process=True))
    decide = lambda flag: flags.append((now[0], flag)) or flag  # noqa: E731 - Control.decide: rank 0's flag on every rank
    sync = WeightSync(cfg, trainer, rollout, Placement.of(cfg.rollout, "cpu", 1), decide=decide)
    plans = []
    try:
        for version in (1, 2, 3, 4):
            now[0] = version
            with torch.no_grad():
                model.bias[version % 3] += 1.0
            sync.prepare(version)
            sync.publish(version)
            plans.append((sync.plan.full, sync.plan.reason))
    finally:
        sync.close()
    assert rollout.loaded == [1, 2, 3, 4]
    assert plans == [(True, "first"), (False, "delta"), (True, "reset"), (False, "delta")]
    assert [v for v, flag in flags if flag] == [3]  # rank 0's decision, every rank's at prepare(3): all reset, all whole
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: {why}; the next weight sync sends θ whole (rollout.weight_delta)"]


def test_after_patches_a_worker_reports_theta_v_s_fingerprints_and_is_judged_as_after_a_whole_sync(pair):
    """The worker advances its fingerprints of θ_1 as received by the patches it received and the
    plan's base sums: θ_2's and θ_3's exactly, judged by the trainer's `SentWeights` as a whole sync's
    are; a value changed on the wire is named."""
    trainer, worker, policy, _, _ = pair
    worker.fingerprinting = True  # pace_fingerprint_updates, before the first update
    sent = fp.SentWeights()
    tracker = DeltaTracker(policy, torch.float32, full_every=0, max_frac=1.0)
    prints = _send_whole(trainer, policy, 1)
    tracker.sent(tracker.plan(1), prints)
    sent.expect(1, prints)
    assert worker.fingerprint == prints
    for version, changes in ((2, [("q.weight", 5, 1.0), ("out.bias", 0, 2.0)]), (3, [("k.weight", 7, -0.5)])):
        _step(policy, *changes)
        plan = tracker.plan(version)
        trainer.send_patches(plan.patches, version, version - 1, plan.base_sums)
        tracker.sent(plan)
        sent.expect(version, plan.prints)
        assert worker.fingerprint == {n: fp.tensor_fingerprint(p.detach()) for n, p in policy.named_parameters()}
        assert sent.judge(version, [worker.fingerprint]) is None

    _step(policy, ("out.weight", 2, 1.0))
    plan = tracker.plan(4)
    plan.patches[0].values[0] += 1.0  # what the worker receives is not what the plan's fingerprints say
    trainer.send_patches(plan.patches, 4, 3, plan.base_sums)
    sent.expect(4, plan.prints)
    assert "1 of 4 tensors differ from the trainer's (first: out.weight)" in str(sent.judge(4, [worker.fingerprint]))


def test_patches_sent_without_base_sums_leave_the_worker_without_fingerprints(pair):
    trainer, worker, policy, _, _ = pair
    worker.fingerprinting = True
    tracker = DeltaTracker(policy, torch.float32, full_every=0, max_frac=1.0)
    tracker.sent(tracker.plan(1), _send_whole(trainer, policy, 1))
    _step(policy, ("q.weight", 0, 1.0))
    trainer.send_patches(tracker.plan(2).patches, 2, 1)
    assert worker.fingerprint is None  # not θ_1's: judged, it would read "has received no weights"


def test_a_whole_update_that_failed_its_reload_check_is_no_base_for_patches(pair):
    """The worker holds a version for patches only once its update passed the reload's checks: a
    whole update that left a layer short (the run stops on it; a joiner is failed) is not patched on."""
    from pace.weights.gloo import DeltaMismatch

    trainer, worker, policy, client, _ = pair
    tracker = DeltaTracker(policy, torch.float32, full_every=0, max_frac=1.0)
    tracker.sent(tracker.plan(1), None)
    with torch.no_grad():
        k = policy.k.weight.detach().clone()
        del policy.k  # θ_1 without k.weight: the fused qk layer gets 16 of its 24 elements
    _send_whole(trainer, policy, 1)
    policy.k = torch.nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        policy.k.weight.copy_(k)
    assert client.reports[-1].startswith("weight update incomplete: qk got 16 of 24 elements")
    assert worker.held_version is None
    _step(policy, ("q.weight", 0, 1.0))
    with pytest.raises(DeltaMismatch, match="holds no version to patch"):
        trainer.send_patches(tracker.plan(2).patches, 2, 1)


def test_the_trainer_expects_fingerprints_of_an_nccl_delta_that_carries_base_sums():
    from pace.weights.delta import Plan
    from pace.weights.sync import WeightSync

    for backend, base_sums, judged in (("nccl", [7], True), ("nccl", None, False), ("gloo", None, True)):
        sent = fp.SentWeights()
        sync = SimpleNamespace(rollout=SimpleNamespace(sent_weights=sent), backend=backend)
        WeightSync._expect_delta(sync, Plan(5, False, "delta", prints={"w": 3}, base_sums=base_sums))
        assert sent.expects(5) is judged, backend
