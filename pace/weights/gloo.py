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
"""
from __future__ import annotations

import datetime
import threading
from concurrent.futures import Future, ThreadPoolExecutor
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
TIMEOUT = datetime.timedelta(minutes=30)  # a rendezvous or a broadcast waiting for its peers


def _group(host: str, port: int, rank: int, world_size: int, is_master: bool):
    """A gloo group of its own (not torch.distributed's default one: the trainer may have one,
    and an engine worker has vLLM's), over a TCPStore served by rank 0."""
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    store = TCPStore(host, port, world_size if is_master else None, is_master=is_master, timeout=TIMEOUT,
                     wait_for_workers=False)
    return ProcessGroupGloo(PrefixStore("pace_gloo", store), rank, world_size, TIMEOUT), store


def _run_into(future: Future, fn, *args) -> None:
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


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        p = self.parallel_config  # the rank as vLLM's nccl_common.worker_init_process_group computes it
        rank = p.data_parallel_index * p.world_size + p.rank + init_info.rank_offset
        self.group, self._store = _group(init_info.master_address, init_info.master_port, rank,
                                         init_info.world_size, is_master=False)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, info: GlooUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():  # as vLLM's NCCL engine: a draft head may come separately
            for name, dtype_name, shape in zip(info.names, info.dtype_names, info.shapes):
                weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
                _broadcast(self.group, weight)
                self.model.load_weights([(name, weight.to(self.device))])

    def shutdown(self) -> None:
        self.group = self._store = None


# --- the trainer side ----------------------------------------------------------------------


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    master_address: str = "127.0.0.1"
    master_port: int = 0
    world_size: int = 1  # trainer rank 0 + every engine worker


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Rank 0 drives the round (start, update concurrently with its broadcast, finish) through the
    client; every rank iterates the source (under FSDP each `full_tensor()` is a collective)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source: WeightSource, is_sender: bool):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group = self._store = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source: WeightSource | None = None):
        if source is None:
            raise ValueError("gloo weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        worker = GlooInitInfo(master_address=init_info.master_address, master_port=init_info.master_port,
                              rank_offset=1, world_size=init_info.world_size)
        # the workers wait inside init_weight_transfer_engine for the rendezvous rank 0 opens here
        with ThreadPoolExecutor(max_workers=1) as exe:
            future = exe.submit(client.init_weight_transfer_engine, asdict(worker))
            engine.group, engine._store = _group(init_info.master_address, init_info.master_port, 0,
                                                 init_info.world_size, is_master=True)
            future.result()
        return engine

    def send_weights(self) -> None:
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        info = GlooUpdateInfo(names=[m.name for m in meta], dtype_names=[str(m.dtype).split(".")[-1] for m in meta],
                              shapes=[list(m.shape) for m in meta])
        self.client.start_weight_update()
        # the engines receive inside update_weights while rank 0 broadcasts; a daemon thread, so that
        # an engine stuck in a failed broadcast does not hold this process's exit
        future: Future = Future()
        threading.Thread(target=_run_into, args=(future, self.client.update_weights, asdict(info)),
                         name="pace-gloo-update", daemon=True).start()
        if future.done():  # refused before any broadcast: say so, rather than wait for peers
            future.result()
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
        future.result()
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.group = self._store = None
