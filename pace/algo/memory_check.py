"""Does the trainer fit its devices? Checked at start, before any engine is built or batch filled.

Each rank holds its share of the weights, gradients and AdamW's two moments, and at the first
`optimizer.step()` AdamW's foreach temporary beside them (pace/algo/memory_budget.optimizer_bytes):
20 bytes a parameter with fp32 master weights, over the FSDP2 shard group (all processes; HSDP: its
`dp_shard_size`), or whole on every rank without FSDP. A run whose ranks cannot hold that would die
at its first optimizer step, after the engines' start and the first batch (~30 minutes for the
30B-A3B). This refuses it in one line naming the numbers and the keys to change. Activations come
on top, so passing is necessary, not sufficient: rank 0 also warns (without stopping) when the
states and memory_budget.step_bytes's estimate of a `trainer.max_tokens_per_micro_batch` micro-batch
exceed the device.

The device's memory: `trainer.device_memory_gib` when set; else on CUDA the GPU's total
(`torch.cuda.mem_get_info`), less the colocated engine's share (`rollout.gpu_memory_utilization`
of it) with `rollout.placement=colocate`. On CPU, unless set, nothing is checked: the host's memory
is shared with the engines and the OS, and the CPU runs are the tiny ones. FSDP2's CPU offload
(`fsdp_offload_params: true`) keeps the states in host memory: not checked against the GPU.

Host memory at load (`check_host_memory`). The processes of a node that load the checkpoint hold
it whole in host memory before `prepare` shards it onto the devices: P × max(the checkpoint's
bytes, the trained dtype's) each (pace/algo/model_load.py: loaded in the checkpoint's dtype, then
upcast tensor by tensor; under FSDP2 with mixed precision rank 0 holds the fp32 copy until the
broadcast ends). Under FSDP2 with `fsdp_cpu_ram_efficient_loading` only rank 0 loads (the others
build on the meta device: nothing), else every process of the node does (`LOCAL_WORLD_SIZE`).
Each node's local rank 0 compares its node's sum with the host memory available
(`trainer.host_memory_gib`, else /proc/meminfo's MemAvailable, within the job's cgroup v2 limit
where one is set: Slurm's `--mem`, a container's), and every rank stops in one line if any node
cannot hold it: the 30B-A3B's 30.5 B parameters need 4 bytes each on rank 0's node, 114 GiB,
where before the meta ranks the 7 others took ~430 GB more (bf16 zeros of the model each). Only the
trainer's load is counted: the engines (their own nodes in the 30B-A3B preset), the pool and
FSDP2's offloaded states are not.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from pace.algo import memory_budget as mb
from pace.errors import ConfigError


@functools.lru_cache(maxsize=4)  # the device check and the host check both ask
def count_params(model_path: str) -> int:
    """The model's parameters (tied ones once), from its config on the meta device: no weights read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def layout(accelerator, cfg) -> tuple[int, int, str]:
    """(shards, master bytes, what holds the states) of this run's trainer: FSDP2 shards over the
    processes (HSDP: its shard group) and Accelerate upcasts a low-precision model to fp32 under
    mixed precision (accelerate.utils.fsdp_utils.fsdp2_prepare_model); otherwise every rank holds
    the model in `trainer.master_dtype` under mixed precision, in `model.dtype` without."""
    mixed = accelerator.mixed_precision in ("bf16", "fp16")
    if accelerator.is_fsdp2:
        pc = getattr(accelerator, "parallelism_config", None)
        shards = pc.dp_shard_size if pc is not None and (pc.dp_shard_size or 1) > 1 else accelerator.num_processes
        return shards, 4 if mixed else mb.BYTES[cfg.model.dtype], "FSDP2"
    return 1, mb.BYTES[cfg.trainer.master_dtype if mixed else cfg.model.dtype], "every"


def device_memory(cfg, device: str) -> tuple[int | None, str]:
    """(bytes the trainer may use on one of its devices, where the number comes from); None: no check."""
    if cfg.trainer.device_memory_gib is not None:
        return int(cfg.trainer.device_memory_gib * mb.GIB), "trainer.device_memory_gib"
    if device != "cuda":
        return None, "not checked on CPU"
    import torch

    total = torch.cuda.mem_get_info()[1]
    if cfg.rollout.placement == "colocate":
        share = cfg.rollout.gpu_memory_utilization
        return int(total * (1 - share)), f"the GPU's {total / mb.GIB:.1f} GiB less rollout.gpu_memory_utilization={share}"
    return total, "the GPU's total"


def check_memory(cfg, model_path: str, accelerator, device: str) -> None:
    """Refuse (ConfigError, one line) a run whose trainer states exceed a device's memory."""
    memory, source = device_memory(cfg, device)
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if memory is None or (accelerator.is_fsdp2 and plugin is not None and bool(plugin.cpu_offload)):
        return
    params = count_params(model_path)
    shards, master, holder = layout(accelerator, cfg)
    need = mb.optimizer_bytes(params, shards, master)
    where = (f"over {shards} FSDP2 shards" if holder == "FSDP2" else
             f"on each of {accelerator.num_processes} processes (no FSDP: whole on every rank)")
    line = (f"the trainer's weights, gradients and AdamW state of {_count(params)} parameters need {_size(need)} a rank at "
            f"AdamW's step ({5 * master} bytes a parameter in {'fp32' if master == 4 else f'{8 * master}-bit'}, "
            f"{where}); a device has {_size(memory)} ({source})")
    if need <= memory:
        if accelerator.is_main_process:
            print(f"memory: {line}", file=sys.stderr, flush=True)
            step = step_estimate(cfg, model_path, holder == "FSDP2")
            peak = None if step is None else mb.states_bytes(params, shards, master) + step
            if peak is not None and peak > memory:
                print(f"warning: by estimate (pace/algo/memory_budget.py) a rank peaks at {_size(peak)} in a micro-batch of "
                      f"trainer.max_tokens_per_micro_batch={cfg.trainer.max_tokens_per_micro_batch} tokens, above its "
                      f"{_size(memory)}: lower it, or shard over more processes", file=sys.stderr, flush=True)
        return
    more = -(-mb.optimizer_bytes(params, 1, master) // memory) if holder == "FSDP2" else None
    fix = (f"shard over >= {more} processes (accelerate launch --num_processes, conf/accelerate/fsdp_8gpu.yaml for 8; "
           f"or several nodes: conf/accelerate/hsdp_2nodes.yaml), or keep the states in host memory "
           f"(fsdp_offload_params: true)" if more else "run under FSDP2 (accelerate launch --config_file "
           "conf/accelerate/fsdp.yaml)")
    raise ConfigError(f"{line}: {fix}; trainer.device_memory_gib overrides the device's size")


def host_load(cfg, model_path: str, accelerator) -> tuple[int, str, str]:
    """(bytes this node's processes hold while they load the model, who loads it, what to do when
    the node cannot hold that) for this process's node (module docstring)."""
    from transformers import AutoConfig

    from pace.algo.model_load import checkpoint_dtype, weights_from_rank0

    params = count_params(model_path)
    per = max(checkpoint_dtype(AutoConfig.from_pretrained(model_path)).itemsize, layout(accelerator, cfg)[1])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    if weights_from_rank0(accelerator) and accelerator.num_processes > 1:
        loaders = 1 if accelerator.is_main_process else 0
        who = (f"rank 0 loads it, {per} bytes a parameter; the node's {local - 1} other processes build it on the "
               f"meta device" if loaders else "rank 0 loads it, on another node")
        fix = "free host memory on this node or run rank 0 on a node with more"
    else:
        loaders = local
        who = f"{local} processes load it whole, {per} bytes a parameter each" if local > 1 else f"{per} bytes a parameter"
        fix = ("under FSDP2 set fsdp_cpu_ram_efficient_loading: true in the accelerate config (only rank 0 loads), "
               "or run fewer processes on a node, or free host memory" if local > 1 else "free host memory")
    return loaders * params * per, who, fix


def host_memory(cfg, root: str = "/") -> tuple[int | None, str]:
    """(bytes of host memory the load may take on this node, where the number comes from); None:
    unknown (no /proc/meminfo), not checked. ``root``: where /proc and /sys are (tests)."""
    if cfg.trainer.host_memory_gib is not None:
        return int(cfg.trainer.host_memory_gib * mb.GIB), "trainer.host_memory_gib"
    try:
        meminfo = (Path(root) / "proc/meminfo").read_text()
        available = next(int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None, "unknown"
    cgroup = _cgroup_room(root)
    if cgroup is not None and cgroup < available:
        return cgroup, "the job's cgroup memory.max less its memory in use"
    return available, "MemAvailable in /proc/meminfo"


def _cgroup_room(root: str) -> int | None:
    """Room left under the tightest cgroup v2 memory limit on this process's path (memory.max less
    memory.current, its reclaimable file cache not counted as used); None: no limit or no cgroup v2."""
    base = Path(root) / "sys/fs/cgroup"
    try:
        line = next(x for x in (Path(root) / "proc/self/cgroup").read_text().splitlines() if x.startswith("0::"))
    except (OSError, StopIteration):
        return None
    room, path = None, base / line[3:].strip().lstrip("/")
    while True:
        try:
            limit = (path / "memory.max").read_text().strip()
            if limit != "max":
                stat = dict(x.split() for x in (path / "memory.stat").read_text().splitlines() if x.count(" ") == 1)
                used = int((path / "memory.current").read_text()) - int(stat.get("file", 0))
                room = min(room if room is not None else int(limit), int(limit) - used)
        except (OSError, ValueError):
            pass
        if path == base or base not in path.parents:
            return room
        path = path.parent


def host_memory_line(cfg, model_path: str, accelerator, available: tuple[int | None, str] | None = None
                     ) -> tuple[bool, str]:
    """(does this node hold the model while its processes load it, the line that says so) —
    ``available``: `host_memory`'s answer, read here when not given; unknown memory passes."""
    need, who, fix = host_load(cfg, model_path, accelerator)
    memory, source = available if available is not None else host_memory(cfg)
    line = (f"loading {cfg.model.path or model_path} ({_count(count_params(model_path))} parameters) takes "
            f"{_size(need)} of this node's host memory ({who})")
    if memory is None:
        return True, f"{line}; its available memory is unknown: not checked"
    if need <= memory:
        return True, f"{line}; {_size(memory)} is available ({source})"
    return False, (f"host memory: {line}, but {_size(memory)} is available ({source}): {fix}; "
                   f"trainer.host_memory_gib overrides the available size")


def check_host_memory(cfg, model_path: str, accelerator, gather=None) -> None:
    """Every rank: refuse (ConfigError, one line) a run that some node cannot hold while it loads the
    model. Each node's local rank 0 reads its node's memory; ``gather`` (every rank's value, in rank
    order, on every rank: `Control.gather`) makes the decision every rank's."""
    fits, line = host_memory_line(cfg, model_path, accelerator) if accelerator.local_process_index == 0 else (True, "")
    lines = gather(None if fits else line) if gather is not None else [None if fits else line]
    problem = next((x for x in lines if x), None)
    if problem is not None:
        raise ConfigError(problem)
    if accelerator.is_main_process:
        print(f"host memory: {line}", file=sys.stderr, flush=True)


def step_estimate(cfg, model_path: str, fsdp: bool) -> int | None:
    """A micro-batch's activations and temporaries above the states (memory_budget.step_bytes) at the
    token budget, one row; None without a budget or chunked log-probs. It only feeds a warning and
    runs on rank 0 alone while the other ranks wait at the next barrier, so any error in it (a config
    whose shapes memory_budget.Shapes cannot read, say) is one warning and None, never a stop."""
    tokens, chunk = cfg.trainer.max_tokens_per_micro_batch, cfg.trainer.logprob_chunk
    if tokens is None or chunk is None:
        return None
    from transformers import AutoConfig

    try:
        shapes = mb.Shapes.of(AutoConfig.from_pretrained(model_path))
        return mb.step_bytes(shapes, tokens, tokens, chunk, cfg.model.dtype, cfg.model.gradient_checkpointing,
                             fsdp=fsdp, reduce=cfg.trainer.reduce_dtype)["total"]
    except Exception as exc:  # noqa: BLE001 - an estimate, not a check: warned, skipped
        cause = ": ".join([type(exc).__name__, *str(exc).splitlines()[:1]])
        print(f"warning: the micro-batch memory estimate (pace/algo/memory_budget.py) was skipped: {cause}",
              file=sys.stderr, flush=True)
        return None


def _count(params: int) -> str:
    return f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.2f} M"


def _size(nbytes: int) -> str:
    return f"{nbytes / mb.GIB:.1f} GiB" if nbytes >= mb.GIB // 10 else f"{nbytes / 2**20:.1f} MiB"
