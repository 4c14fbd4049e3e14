"""The ``gloo`` weight-transfer backend: vLLM's NCCL protocol over TCP (CPU engines in other processes).

Trainer rank 0 and every engine worker form one process group (gloo, over a TCPStore that rank 0
serves at `master_address:master_port`); rank 0 broadcasts each parameter in the engine dtype and
every worker loads it between vLLM's `start_weight_update` and `finish_weight_update` (layerwise
reload, with pace/weights/reload.py's checks). Ranks, rendezvous and the order of calls are those of
vLLM's NCCL engines (`vllm/distributed/weight_transfer/nccl_engine.py`): a worker's rank is
`rank_offset` + its engine's data-parallel index × the engine's workers + its own rank, the fleet
gives each engine its offset (pace/rollout/fleet.py) and calls the engines at once, and the
trainer broadcasts while the engines are inside `update_weights`. So the multi-engine rendezvous
and update that GPU runs take through NCCL run here on CPU, where the tests can see them.

Delta updates (`rollout.weight_delta`, pace/weights/delta.py): an update may carry sparse patches
(per tensor its changed flat indices, int32, and their values: vLLM's `SparseWeightPatch` on the
wire as `sparse_nccl_engine.py` broadcasts it). vLLM applies such patches in place
(`load_checkpoint_weight_patches`), which a CPU engine cannot take: its linear layers' weights are
packed into oneDNN/SGL kernels and removed after loading (`dispatch_cpu_unquantized_gemm(...,
remove_weight=True)`). So a worker here keeps a copy of the last tensors it received (`mirror`, in
checkpoint coordinates and the engine dtype), applies each patch to it and reloads every tensor
from it through the same checked layerwise reload as a full update: the wire carries the delta, the
engine is rebuilt exactly (tied head refreshed, coverage audited, every tensor fingerprinted).
"""
from __future__ import annotations

import datetime
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "pace_gloo"
TIMEOUT_S = 1800.0  # a rendezvous or a broadcast waiting for its peers, unless the update's deadline is given


def _group(host: str, port: int, rank: int, world_size: int, is_master: bool, timeout_s: float = TIMEOUT_S):
    """A gloo group of its own (not torch.distributed's default one: the trainer may have one,
    and an engine worker has vLLM's), over a TCPStore served by rank 0. Every operation on it (the
    rendezvous, each broadcast) fails after ``timeout_s`` (`rollout.update_timeout_s`): a peer that
    stopped inside the broadcast cannot hold the others past the update's deadline."""
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(host, port, world_size if is_master else None, is_master=is_master, timeout=timeout,
                     wait_for_workers=False)
    return ProcessGroupGloo(PrefixStore("pace_gloo", store), rank, world_size, timeout), store


def run_into(future: Future, fn, *args) -> None:
    """``fn(*args)``'s result or exception into ``future`` (a thread's target)."""
    try:
        future.set_result(fn(*args))
    except BaseException as exc:  # noqa: BLE001 - the caller gets it
        future.set_exception(exc)


def _broadcast(group, tensor: torch.Tensor) -> None:
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    group.broadcast([tensor], opts).wait()


# --- the worker (engine) side --------------------------------------------------------------


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    delta: bool = False  # keep a mirror of the received tensors: updates may be patches
    timeout_s: float = TIMEOUT_S  # each operation of the group (`rollout.update_timeout_s`)


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    num_updates_list: list[int] | None = None  # patches: changed elements per tensor (None: whole tensors)
    version: int | None = None  # the trainer step of these weights (the mirror's, with `delta`)
    base: int | None = None  # patches: the version they apply to (the mirror must hold it)


class DeltaMismatch(RuntimeError):
    """A patch update for weights the engine worker does not hold."""


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        p = self.parallel_config  # the rank as vLLM's nccl_common.worker_init_process_group computes it
        rank = p.data_parallel_index * p.world_size + p.rank + init_info.rank_offset
        self.group, self._store = _group(init_info.master_address, init_info.master_port, rank,
                                         init_info.world_size, is_master=False, timeout_s=init_info.timeout_s)
        # a (re)joined worker: the trainer sends it whole tensors first
        self.mirror: dict[str, torch.Tensor] | None = {} if init_info.delta else None
        self.mirror_version: int | None = None

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, info: GlooUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():  # as vLLM's NCCL engine: a draft head may come separately
            if info.num_updates_list is not None:
                self._receive_patches(info)
                return
            mirror = self.mirror
            if mirror is not None:
                self.mirror_version = None  # until every tensor is in
            for name, dtype_name, shape in zip(info.names, info.dtype_names, info.shapes):
                weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
                _broadcast(self.group, weight)
                if mirror is not None:
                    mirror[name] = weight
                self.model.load_weights([(name, weight.to(self.device))])
            if mirror is not None:
                self.mirror_version = info.version

    def _receive_patches(self, info: GlooUpdateInfo) -> None:
        """Apply the patches of one update to the mirror, then load every tensor from it (the CPU
        engine's packed kernels are rebuilt by the layerwise reload, as after a full update)."""
        mirror, held = self.mirror, self.mirror_version
        patches = []  # received in full first: every worker takes part in every broadcast
        for name, dtype_name, n in zip(info.names, info.dtype_names, info.num_updates_list):
            indices = torch.empty(n, dtype=torch.int32)
            values = torch.empty(n, dtype=getattr(torch, dtype_name))
            _broadcast(self.group, indices)
            _broadcast(self.group, values)
            patches.append((name, indices, values))
        if mirror is None or held is None or held != info.base:
            raise DeltaMismatch(f"weight patches for θ_{info.base} → θ_{info.version}, but this engine worker holds "
                                f"{'no full update' if held is None else f'θ_{held}'}: the trainer must send whole tensors")
        self.mirror_version = None  # until the patches are in
        for name, indices, values in patches:
            target = mirror.get(name)
            if target is None:
                raise DeltaMismatch(f"weight patch for {name!r}, which no full update sent")
            target.view(-1).index_copy_(0, indices.long(), values.to(target.dtype))
        self.model.load_weights([(name, t.to(self.device)) for name, t in mirror.items()])
        self.mirror_version = info.version

    def shutdown(self) -> None:
        self.group = self._store = None


# --- the trainer side ----------------------------------------------------------------------


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    master_address: str = "127.0.0.1"
    master_port: int = 0
    world_size: int = 1  # trainer rank 0 + every engine worker
    delta: bool = False  # the workers keep a mirror: updates may be patches
    timeout_s: float = TIMEOUT_S  # the update's deadline: each operation of the group, and the wait for the workers


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Rank 0 drives the round (start, update concurrently with its broadcast, finish) through the
    client; every rank iterates the source (under FSDP each `full_tensor()` is a collective)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source: WeightSource, is_sender: bool):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group = self._store = None
        self.timeout_s = TIMEOUT_S

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source: WeightSource | None = None):
        if source is None:
            raise ValueError("gloo weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.timeout_s = init_info.timeout_s
        if not engine.is_sender:
            return engine
        worker = GlooInitInfo(master_address=init_info.master_address, master_port=init_info.master_port,
                              rank_offset=1, world_size=init_info.world_size, delta=init_info.delta,
                              timeout_s=init_info.timeout_s)
        # the workers wait inside init_weight_transfer_engine for the rendezvous rank 0 opens here
        with ThreadPoolExecutor(max_workers=1) as exe:
            future = exe.submit(client.init_weight_transfer_engine, asdict(worker))
            engine.group, engine._store = _group(init_info.master_address, init_info.master_port, 0,
                                                 init_info.world_size, is_master=True, timeout_s=init_info.timeout_s)
            future.result()
        return engine

    def send_weights(self) -> None:
        """Every tensor of the source (every rank iterates it); the client names their version."""
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        info = GlooUpdateInfo(names=[m.name for m in meta], dtype_names=[str(m.dtype).split(".")[-1] for m in meta],
                              shapes=[list(m.shape) for m in meta])
        future = self._start(info)
        sent = 0
        for name, tensor in self.source:  # the workers expect exactly `meta`, in order
            m = meta[sent] if sent < len(meta) else None
            if m is None or name != m.name or tensor.dtype != m.dtype or list(tensor.shape) != list(m.shape):
                raise ValueError(f"gloo weight transfer: parameter {sent} {name!r} differs from the metadata sent "
                                 f"({m.name if m else 'none left'!r})")
            _broadcast(self.group, tensor.detach().to("cpu").contiguous())
            sent += 1
        if sent != len(meta):
            raise ValueError(f"gloo weight transfer: the source yielded {sent} of the {len(meta)} parameters sent")
        self._received(future)
        self.client.finish_weight_update()

    def send_patches(self, patches: list, version: int, base: int, base_sums: list[int] | None = None) -> None:
        """Rank 0: the changed elements of θ_version against θ_base (pace/weights/delta.py's
        `Patch`es: name, int32 flat indices, values, full shape), as vLLM's sparse_nccl engine
        broadcasts them (indices, then values, per tensor). ``base_sums``: not needed here (the
        workers fingerprint every tensor they reload whole from their mirror)."""
        info = GlooUpdateInfo(names=[p.name for p in patches],
                              dtype_names=[str(p.values.dtype).split(".")[-1] for p in patches],
                              shapes=[list(p.full_shape) for p in patches],
                              num_updates_list=[int(p.indices.numel()) for p in patches], version=version, base=base)
        future = self._start(info)
        for p in patches:
            _broadcast(self.group, p.indices.detach().to("cpu", torch.int32).contiguous())
            _broadcast(self.group, p.values.detach().to("cpu").contiguous())
        self._received(future)
        self.client.finish_weight_update()

    def _start(self, info: GlooUpdateInfo) -> Future:
        """Start the update: the engines receive inside update_weights while rank 0 broadcasts; a
        daemon thread, so that an engine stuck in a failed broadcast does not hold this process's exit."""
        self.client.start_weight_update()
        future: Future = Future()
        threading.Thread(target=run_into, args=(future, self.client.update_weights, asdict(info)),
                         name="pace-gloo-update", daemon=True).start()
        if future.done():  # refused before any broadcast: say so, rather than wait for peers
            future.result()
        self._deadline = time.monotonic() + self.timeout_s
        return future

    def _received(self, future: Future) -> None:
        """The engines' update call, once the broadcast is out: within the update's deadline (a
        worker stopped inside the broadcast never answers; its update call is failed by then too)."""
        try:
            future.result(timeout=max(self._deadline - time.monotonic(), 0.0))
        except FutureTimeout as exc:
            raise TimeoutError(f"the engines' update_weights did not return within rollout.update_timeout_s="
                               f"{self.timeout_s:g} s") from exc

    def shutdown(self) -> None:
        self.group = self._store = None
