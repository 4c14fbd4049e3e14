"""Where the rollout engines run and how weights reach them, as `rollout` says: the engine process
(`engine_mode`), the weight-transfer backend (`backend_kind`), each engine's GPUs (`engine_gpus`,
`visible_devices`), the launcher variables an engine process must not see, each engine's compile
cache (`compile_cache_root`). Functions of the config alone, importable without vLLM.

A run computes them once, into a frozen `Placement` handed to the fleet, the weight sync and the
run summary:

    placement = Placement.of(cfg.rollout, device, world)
    placement.mode        # inproc | child | server
    placement.backend     # shm | gloo | nccl | ipc
    placement.transfer    # the name vLLM's WeightTransferEngineFactory registers it under
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from pace.errors import ConfigError


# torchrun / accelerate variables: an engine process must not see the trainer's world
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_FSDP", "ACCELERATE_MIXED_PRECISION")


SHM_TRANSFER = "pace_shm"  # the shared-memory backend's registered name (the trainer side is pace's own)


@dataclass(frozen=True)
class Placement:
    device: str  # the trainer's: cpu or cuda
    world: int  # trainer processes
    mode: str  # the engine process: inproc, child or server
    backend: str  # shm, gloo, nccl or ipc
    gpus: tuple[tuple[int, ...], ...] | None  # each engine's GPU ids (on CUDA, separate or servers), else None

    @property
    def transfer(self) -> str:
        """The backend's name in vLLM's WeightTransferEngineFactory (shm: pace's own)."""
        return SHM_TRANSFER if self.backend == "shm" else self.backend

    @classmethod
    def of(cls, rollout_cfg, device: str, world: int, local_trainers: int | None = None,
           node_gpus: int | None = None) -> Placement:
        """The placement `rollout` describes for ``world`` trainer processes on ``device``;
        ``local_trainers``: those on this node, the GPUs engines start after (default: the
        launcher's LOCAL_WORLD_SIZE, else ``world`` for engines, 1 for servers). On CUDA, engines
        placed ``separate`` get GPUs of their own, and so do the servers this run starts whatever
        `rollout.placement` says (their process never shares the trainer's GPU); `rollout.servers`
        on other hosts get none (each server takes its own share: pace/rollout/server.py).
        Engines placed here must fit this node's ``node_gpus`` (default: the GPUs this process
        sees, `torch.cuda.device_count()`; unknown without CUDA): else ConfigError (`check_fits`)."""
        mode = engine_mode(rollout_cfg, device, world)
        gpus = None
        own = not rollout_cfg.servers if mode == "server" else rollout_cfg.placement == "separate"
        if device == "cuda" and own:
            fallback = 1 if mode == "server" else world
            local = local_trainers if local_trainers is not None else int(os.environ.get("LOCAL_WORLD_SIZE", fallback))
            gpus = tuple(tuple(g) for g in engine_gpus(rollout_cfg, local))
            check_fits(rollout_cfg, mode, gpus, local, node_gpus if node_gpus is not None else _visible_gpus())
        return cls(device=device, world=world, mode=mode, backend=backend_kind(rollout_cfg, device), gpus=gpus)


def _visible_gpus() -> int | None:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else None


def check_fits(rollout_cfg, mode: str, gpus, local: int, node_gpus: int | None) -> None:
    """Engines placed on this node (``gpus``: each one's ids) need GPUs that exist (< ``node_gpus``;
    None: not known, not checked) and that none of the ``local`` trainer processes uses (GPUs
    0 … local − 1, one each). Otherwise the run would load its model and then fail inside an
    engine's start (a server's log: no such device) or share a trainer's GPU: refused at start,
    in one line naming the keys and what to do."""
    ids = sorted({g for engine in gpus for g in engine})
    missing = [g for g in ids if node_gpus is not None and g >= node_gpus]
    shared = [g for g in ids if g < local]
    if not missing and not shared:
        return
    r = rollout_cfg
    sizes = f"rollout.engines={r.engines} × rollout.tensor_parallel_size={r.tensor_parallel_size}"
    if r.gpus:
        where = f"rollout.gpus={list(r.gpus)} places {sizes}"
    elif mode == "server":
        where = (f"rollout.servers is empty, so the run starts its {sizes} engines as servers on this node, "
                 f"on GPUs {_span(ids)} after the {local} trainer processes' (the accelerate config's num_processes)")
    else:
        where = (f"rollout.placement=separate puts {sizes} on GPUs {_span(ids)} after the {local} trainer "
                 f"processes' (the accelerate config's num_processes)")
    if missing:
        problem = f"this node has {node_gpus} GPUs ({_span(list(range(node_gpus)))})"
    else:
        problem = (f"{_span(shared)} {'is' if len(shared) == 1 else 'are'} among the trainer processes' GPUs "
                   f"({_span(list(range(local)))}: one each)")
    fix = ("give the URLs of servers on other nodes in rollout.servers (scripts/launch_slurm.sh and "
           "scripts/launch_hosts.sh start them and pass them), or " if mode == "server" else "")
    raise ConfigError(f"{where}, but {problem}: {fix}run fewer trainer processes (accelerate launch "
                      f"--num_processes / the config's num_processes) or fewer engines (rollout.engines, "
                      f"rollout.tensor_parallel_size), or list free GPUs in rollout.gpus")


def _span(ids: list[int]) -> str:
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1)) else ",".join(map(str, ids))


def engine_mode(rollout_cfg, device: str, world_size: int) -> str:
    """``inproc``, ``child`` or ``server`` for `rollout.engine_process` (``auto``: in-process only for
    one trainer process on CPU)."""
    mode = rollout_cfg.engine_process
    if mode == "auto":
        return "inproc" if device == "cpu" and world_size == 1 and rollout_cfg.engines == 1 else "child"
    return mode


def backend_kind(rollout_cfg, device: str) -> str:
    """shm, gloo, nccl or ipc for `rollout.weight_transfer` on ``device`` (importable before vLLM)."""
    backend = rollout_cfg.weight_transfer
    if backend == "auto" and rollout_cfg.engine_process == "server":  # engines on any host: over the network
        backend = "gloo" if device == "cpu" else "nccl"
    if backend == "auto":  # NCCL cannot pair two processes on one GPU: a colocated engine uses CUDA IPC
        backend = "shm" if device == "cpu" else "ipc" if rollout_cfg.placement == "colocate" else "nccl"
    return backend


def engine_gpus(rollout_cfg, trainer_gpus: int) -> list[list[int]]:
    """The GPU ids of each engine: `rollout.gpus` if given, else the GPUs after the trainer's
    (engine e on trainer_gpus + e·TP … + TP − 1)."""
    tp, n = rollout_cfg.tensor_parallel_size, rollout_cfg.engines
    ids = list(rollout_cfg.gpus) if rollout_cfg.gpus else list(range(trainer_gpus, trainer_gpus + n * tp))
    if len(ids) != n * tp:
        raise ConfigError(f"rollout.gpus: {n} engines × tensor_parallel_size {tp} need {n * tp} GPU ids, got {ids}")
    return [ids[e * tp : (e + 1) * tp] for e in range(n)]


def visible_devices(gpus: list[int], parent: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for an engine on ``gpus``, indices as this process sees its GPUs: under
    a scheduler's own list (``parent``, e.g. "4,5,6,7" or UUIDs) index i is its i-th entry, so the
    engine gets the GPU the trainer means by i, not physical GPU i."""
    if not parent or not parent.strip():
        return ",".join(map(str, gpus))
    ids = [d.strip() for d in parent.split(",") if d.strip()]
    bad = [g for g in gpus if not 0 <= g < len(ids)]
    if bad:
        raise ValueError(f"rollout.gpus: GPU index {bad[0]} is not among the {len(ids)} visible ones "
                         f"(CUDA_VISIBLE_DEVICES={parent})")
    return ",".join(ids[g] for g in gpus)


def compile_cache_root(engine: int) -> str | None:
    """The VLLM_CACHE_ROOT of this run's engine ``engine`` (a child engine or a server): None (vLLM's
    own, left as it is) for engine 0, `pace-engine-<e>` under it for the others. Each engine compiles
    (torch.compile, its CUDA graphs) into its cache; started at once, engines sharing one would
    write the same entries at once (each is rank 0 of data-parallel rank 0 to vLLM). Under vLLM's
    root, not the run's directory, so the next run finds each engine's cache warm."""
    if engine == 0:
        return None
    import vllm.envs

    # vLLM's root as an engine started now reads it (VLLM_CACHE_ROOT, else $XDG_CACHE_HOME/vllm or
    # ~/.cache/vllm: vllm/envs.py), from this environment, not `vllm.envs`' cached value (frozen
    # once an engine core has started in this process)
    root = vllm.envs.environment_variables["VLLM_CACHE_ROOT"]()
    return os.path.join(root, f"pace-engine-{engine}")
