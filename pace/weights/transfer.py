"""Weight transfer from the trainer to the vLLM engines through vLLM's weight-transfer API.

vLLM 0.32 (`vllm.distributed.weight_transfer`) splits a weight update into a trainer side
(`TrainerWeightTransferEngine`: materialise each parameter, put it on the wire) and a worker side
(`WeightTransferEngine` in every engine worker: receive it and load it between
`start_weight_update` / `finish_weight_update`, which run vLLM's layerwise reload so kernel
repacking, fused projections and tied weights are redone). The worker side is driven by RPCs
(`init_weight_transfer_engine`, `start_weight_update`, `update_weights`, `finish_weight_update`)
issued by the rollout thread, which owns the engines (pace/rollout/fleet.py).

Backends, chosen by `rollout.weight_transfer`:
- ``nccl`` (vLLM's, GPU): trainer rank 0 broadcasts each parameter to every engine worker; every
  trainer rank takes part in the FSDP all-gather of each parameter (`full_tensor()`).
- ``gloo`` (pace/weights/gloo.py, both sides): the NCCL protocol over TCP — CPU engines in other
  processes, and the path the multi-engine rendezvous is tested through on CPU.
- ``shm`` (this module, registered with both factories): trainer rank 0 writes every parameter,
  cast to the engine dtype, into a file in /dev/shm (two alternating slots), and each worker
  maps the file and loads views of it. No pickling, no second host copy, no fp32 upcast. It is
  the CPU path and works for engines on the same host as trainer rank 0.

The worker sides are registered when this module is imported in the engine worker: the engines
are built with `worker_extension_cls="pace.weights.transfer.WorkerExtension"`, which vLLM imports
in every worker process before it creates the weight-transfer engine. Each is checked
(pace/weights/reload.py: a tied output head is re-processed after every update, and an update
that leaves a layer without weights fails): ``pace_shm``, and ``pace_nccl`` / ``pace_ipc`` for
vLLM's nccl and ipc engines (their trainer sides are vLLM's, unchanged).
"""
from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from pace.placement import SHM_TRANSFER as BACKEND
from pace.weights import source
from pace.weights.reload import ExactReload, reloaded
from pace.weights.update import WeightUpdate

ALIGN = 64  # bytes: every tensor starts at a multiple (views of any dtype are aligned)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def layout(meta: list[ParamMeta]) -> tuple[list[int], int]:
    """Byte offset of each tensor in the buffer, and the buffer size."""
    offsets, pos = [], 0
    for m in meta:
        offsets.append(pos)
        nbytes = torch.Size(m.shape).numel() * torch.empty((), dtype=m.dtype).element_size()
        pos += -(-nbytes // ALIGN) * ALIGN
    return offsets, max(pos, ALIGN)


# --- the worker (engine) side --------------------------------------------------------------


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    directory: str = ""


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    path: str
    size: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """Loads the weights of one update from a shared-memory file (the engine worker's side)."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        self.directory = init_info.directory
        self._maps: list[mmap.mmap] = []

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            finalize_layerwise_reload(self.model, self.model_config)
        finally:  # the layerwise reload buffers views of the file until a layer is complete
            maps, self._maps = self._maps, []
            for buf in maps:
                try:
                    buf.close()
                except BufferError:  # a view still alive: the mapping goes with the last one
                    pass

    def receive_weights(self, info: ShmUpdateInfo) -> None:
        with open(info.path, "rb") as f:  # a private mapping: pages are read in place, never copied back
            buf = mmap.mmap(f.fileno(), info.size, access=mmap.ACCESS_COPY)
        self._maps.append(buf)
        self.model.load_weights(_views(torch.frombuffer(buf, dtype=torch.uint8), info, self.device))

    def shutdown(self) -> None:
        pass


class CheckedShmWeightTransferEngine(ExactReload, ShmWeightTransferEngine):
    """The ``pace_shm`` worker side: the shm engine with pace/weights/reload.py's checks."""


def _views(flat: torch.Tensor, info: ShmUpdateInfo, device) -> Iterator[tuple[str, torch.Tensor]]:
    for name, dtype_name, shape, offset in zip(info.names, info.dtype_names, info.shapes, info.offsets):
        dtype = getattr(torch, dtype_name)
        n = torch.Size(shape).numel() * dtype.itemsize
        yield name, flat[offset : offset + n].view(dtype).view(shape).to(device)


class WorkerExtension:
    """`worker_extension_cls` of the engines: importing this module registers the backends in the
    worker process (the weight-transfer RPCs are vLLM's own); one call of its own."""

    def pace_weight_update_failure(self) -> str | dict | None:
        """What this worker's last weight update left undone (pace/weights/reload.py), or
        {"untrusted": why} for patches that loaded but are no base for the next (`ExactReload.take_failure`)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return engine.take_failure() if isinstance(engine, ExactReload) else None

    def pace_fingerprint_updates(self) -> None:
        """From the next update on, fingerprint what the model's loader receives (pace/weights/fingerprint.py)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if isinstance(engine, ExactReload):
            engine.fingerprinting = True

    def pace_weights_reloaded(self) -> dict:
        """``{"reloaded": bool}``: whether the served model has begun a weight update since it loaded its
        weights from disk (pace/weights/reload.py; the reload probe compares only models that have not).
        A dict: a server's `/collective_rpc` returns a scalar result as its str ("False")."""
        return {"reloaded": reloaded(self.model_runner.get_model())}

    def pace_weight_fingerprint(self) -> dict | str | None:
        """The fingerprints of this worker's last finished update (None: none since it started), or
        one line saying why they do not describe the served model."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, ExactReload) or not engine.fingerprinting:
            return "does not fingerprint its updates (not a checked weight-transfer engine, or not asked to)"
        if engine.model is not self.model_runner.get_model():
            return (f"loaded its updates into a {type(engine.model).__name__} that is not the model it serves "
                    f"({type(self.model_runner.get_model()).__name__})")
        return engine.fingerprint


# --- the trainer side ----------------------------------------------------------------------


@dataclass
class ShmTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    directory: str = field(default_factory=lambda: shm_dir())
    run_id: str = field(default="")


class ShmTrainerWeightTransferEngine(TrainerWeightTransferEngine[ShmTrainerInitInfo]):
    """Trainer rank 0 writes θ into one of two slot files; every rank iterates the source (under
    FSDP each `full_tensor()` is a collective). `send_weights` hands the slot to the client, which
    loads it into the engines (the rollout thread, between engine steps, without blocking the
    trainer: a newer slot replaces one not yet loaded, and a slot being loaded is not rewritten).
    """

    init_info_cls = ShmTrainerInitInfo

    def __init__(self, *, client, source, is_sender: bool, directory: str, run_id: str):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.paths = [os.path.join(directory, f"pace-weights-{run_id}-{i}.bin") for i in range(2)]
        self.locks = [threading.Lock(), threading.Lock()]
        self.slot = 0
        self.meta: list[ParamMeta] | None = None

    @classmethod
    def trainer_init(cls, init_info: ShmTrainerInitInfo, *, client, source: WeightSource | None = None):
        if source is None:
            raise ValueError("shm weight transfer needs a WeightSource")
        run_id = init_info.run_id or f"{os.getpid()}"
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     directory=init_info.directory, run_id=run_id)
        if engine.is_sender:
            client.init_weight_transfer_engine(asdict(ShmInitInfo(directory=init_info.directory)))
        return engine

    def write(self, version: int | None) -> WeightUpdate | None:
        """Materialise and write θ_version (every rank iterates; rank 0 writes). The update on rank 0."""
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return None
        slot = self.slot
        self.slot = 1 - slot
        with self.locks[slot]:  # not while the rollout thread loads this slot
            info = write_slot(self.paths[slot], meta, iter(self.source))
        return WeightUpdate(version, asdict(info), self.locks[slot])

    def send_weights(self, version: int | None = None) -> None:
        """vLLM's call (no argument): θ written and handed to the client, the engines' version
        label kept (None); a `WeightSync` writes its updates with their version instead."""
        update = self.write(version)
        if update is not None:
            self.client.post_update(update)

    def shutdown(self) -> None:
        if self.is_sender:
            for path in self.paths:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass


def shm_dir() -> str:
    """Where the slots live: /dev/shm (memory), else the temporary directory."""
    import tempfile

    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def write_slot(path: str, meta: list[ParamMeta], tensors) -> ShmUpdateInfo:
    """Write ``tensors`` ((name, tensor) pairs in ``meta``'s order, cast to ``meta``'s dtypes) into
    the file at ``path``, each at its aligned offset. One copy: into the shared mapping."""
    offsets, size = layout(meta)
    with open(path, "a+b") as f:
        if os.fstat(f.fileno()).st_size != size:
            f.truncate(size)
        buf = mmap.mmap(f.fileno(), size)
    try:
        flat = torch.frombuffer(buf, dtype=torch.uint8)
        count = 0
        for (name, tensor), m, offset in zip(tensors, meta, offsets):
            if name != m.name:
                raise RuntimeError(f"weight source yielded {name!r}, its metadata says {m.name!r}")
            n = tensor.numel() * m.dtype.itemsize
            flat[offset : offset + n].view(m.dtype).view(m.shape).copy_(tensor.detach())
            count += 1
        if count != len(meta):
            raise RuntimeError(f"weight source yielded {count} tensors, its metadata lists {len(meta)}")
        del flat
    finally:
        buf.close()
    return ShmUpdateInfo(path=path, size=size, names=[m.name for m in meta],
                         dtype_names=[_dtype_name(m.dtype) for m in meta],
                         shapes=[list(m.shape) for m in meta], offsets=offsets)


def read_slot(info: dict) -> list[tuple[str, torch.Tensor]]:
    """A copy of the weights of one update (the rollout thread keeps θ_v of a validation)."""
    out = []
    with open(info["path"], "rb") as f:
        data = f.read(info["size"])
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    for name, dtype_name, shape, offset in zip(info["names"], info["dtype_names"], info["shapes"], info["offsets"]):
        dtype = getattr(torch, dtype_name)
        n = torch.Size(shape).numel() * dtype.itemsize
        out.append((name, flat[offset : offset + n].view(dtype).view(shape).clone()))
    return out


def tensor_meta(named: list[tuple[str, torch.Tensor]]) -> list[ParamMeta]:
    return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in named]


class CastSource(WeightSource):
    """The trainer's parameters as the engine loads them (pace/weights/source.py): names without
    wrapper prefixes, each cast to the engine dtype on the trainer's device (a sharded DTensor keeps
    its sharding) and all-gathered if sharded (`full_tensor()`, a collective on every rank): no fp32
    on the wire. On a GPU each is gathered on the default stream and finished before it is yielded,
    whatever stream the consumer iterates on (vLLM's packed NCCL sender: a side stream). ``on_sent``:
    given the fingerprints of every tensor (pace/weights/fingerprint.py) once a pass has made them
    all, before it yields the last (trainer rank 0: before the engines finish); their position
    weights are made when the source is built, not inside the first pass (the sender's side stream)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, on_sent=None):
        self.model = model
        self.dtype = dtype
        self.on_sent = on_sent
        if on_sent is not None:
            from pace.weights import fingerprint

            for device in {p.device for _, p in source.named_parameters(model)}:
                fingerprint.prepare(device)
        self._pass: Iterator | None = None  # the pass under way (`finish`)
        self._abandoned = False

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, self.dtype, tuple(p.shape)) for name, p in source.named_parameters(self.model)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._abandoned = False
        self._pass = self._walk()
        return self._pass

    def _walk(self) -> Iterator[tuple[str, torch.Tensor]]:
        from pace.weights.fingerprint import Fingerprints

        prints = Fingerprints() if self.on_sent is not None else None
        params = list(source.named_parameters(self.model))
        for i, (name, p) in enumerate(params):
            tensor = source.engine_tensor(p, self.dtype)
            if prints is not None and not self._abandoned:
                prints.add(name, tensor)
                if i == len(params) - 1:  # before the last yield: a consumer need not resume the generator
                    self.on_sent(prints.prints)
            yield name, tensor

    def finish(self) -> int:
        """Run what is left of a pass its consumer gave up (a broadcast that failed): under FSDP every
        other rank waits in the all-gather of the next tensor, which it joins only with this rank.
        Nothing is fingerprinted (nothing more is sent). The tensors gathered; 0 when the pass had ended."""
        walk, self._pass = self._pass, None
        if walk is None:
            return 0
        self._abandoned = True
        return sum(1 for _ in walk)


# The worker-side engine of each backend: vLLM's nccl and ipc engines and this module's shm engine,
# each with pace/weights/reload.py's checks (exact tied heads, no layer left without weights).
ENGINE_BACKENDS = {BACKEND: BACKEND, "nccl": "pace_nccl", "ipc": "pace_ipc", "gloo": "pace_gloo"}


def engine_backend(backend: str) -> str:
    """The name the engines' `WeightTransferConfig` is given for trainer-side ``backend``."""
    return ENGINE_BACKENDS[backend]


def register() -> None:
    """Register the backends with vLLM's factories (idempotent): shm on both sides; the checked
    nccl and ipc engines on the worker side (the trainer side is vLLM's own, same protocol). The
    reload's per-layer "Failed to load weights" lines, decided by the checks, leave the log."""
    import logging

    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    from pace.weights import gloo
    from pace.weights.nccl_delta import CheckedDeltaNCCLWeightTransferEngine
    from pace.weights.reload import LAYERWISE_LOGGER, checked, decided_here

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, CheckedShmWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, ShmTrainerWeightTransferEngine)
    # the nccl engines also take patches in place (rollout.weight_delta: pace/weights/nccl_delta.py)
    for name, engine in (("pace_nccl", CheckedDeltaNCCLWeightTransferEngine), ("pace_ipc", checked(IPCWeightTransferEngine)),
                         (gloo.BACKEND, checked(gloo.GlooWeightTransferEngine))):
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, engine)
    if gloo.BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(gloo.BACKEND, gloo.GlooTrainerWeightTransferEngine)
    layerwise = logging.getLogger(LAYERWISE_LOGGER)
    if decided_here not in layerwise.filters:
        layerwise.addFilter(decided_here)


register()
