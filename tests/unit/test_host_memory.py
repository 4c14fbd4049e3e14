"""The start-up check of host memory at load (pace/algo/memory_check.py `check_host_memory`): what a
node's processes hold while they load the model, against a fake available size; where the
available size comes from (/proc/meminfo, a cgroup v2 limit, `trainer.host_memory_gib`)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf
from transformers import Qwen3MoeConfig

from pace.algo import memory_budget as mb
from pace.algo.memory_check import check_host_memory, count_params, host_memory, host_memory_line
from pace.config import Config
from pace.errors import ConfigError

pytestmark = pytest.mark.unit


def _accelerator(processes: int = 8, efficient: bool = True, main: bool = True, local_index: int = 0,
                 fsdp: bool = True, mixed: str = "bf16"):
    """conf/accelerate/fsdp_8gpu.yaml's trainer as each process of it sees itself."""
    plugin = SimpleNamespace(cpu_offload=False, cpu_ram_efficient_loading=efficient) if fsdp else None
    return SimpleNamespace(is_fsdp2=fsdp, num_processes=processes, mixed_precision=mixed, is_main_process=main,
                           local_process_index=local_index, parallelism_config=None,
                           state=SimpleNamespace(fsdp_plugin=plugin))


def _cfg(host_gib: float | None = None):
    cfg = OmegaConf.structured(Config)
    cfg.model.dtype, cfg.model.path, cfg.trainer.host_memory_gib = "bfloat16", "Qwen/Qwen3-30B-A3B-Base", host_gib
    return cfg


@pytest.fixture(scope="module")
def qwen3_30b_a3b(tmp_path_factory) -> str:
    """Qwen3-30B-A3B-Base's config.json, in bf16 as the hub's names it (scripts/gpu_smoke.py's shapes); no weights."""
    import sys

    from tests.helpers import ROOT

    sys.path.insert(0, str(ROOT / "scripts"))
    import smoke_setup

    path = tmp_path_factory.mktemp("qwen3_30b_a3b")
    Qwen3MoeConfig(**smoke_setup.QWEN3_30B_A3B, dtype="bfloat16").save_pretrained(path)
    return str(path)


def test_only_rank_0_loads_under_fsdp2_so_its_node_needs_the_fp32_model_and_no_more(qwen3_30b_a3b, monkeypatch):
    """The 30B-A3B on 8 processes (fsdp_8gpu.yaml, cpu_ram_efficient_loading): rank 0 holds the fp32
    copy Accelerate upcasts from the bf16 load, 4 bytes a parameter (~114 GiB); the 7 others build
    on meta. Refused at a byte less than that, passes at it; a node without rank 0 needs nothing."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    params = count_params(qwen3_30b_a3b)
    assert 30.4e9 < params < 30.6e9
    need = params * 4
    fits, line = host_memory_line(_cfg(), qwen3_30b_a3b, _accelerator(), available=(need - 1, "a fake size"))
    assert not fits and "\n" not in line
    assert line.startswith(f"host memory: loading Qwen/Qwen3-30B-A3B-Base ({params / 1e9:.2f} B parameters) takes "
                           f"{need / mb.GIB:.1f} GiB of this node's host memory (rank 0 loads it, 4 bytes a parameter; "
                           f"the node's 7 other processes build it on the meta device), but {(need - 1) / mb.GIB:.1f} GiB "
                           f"is available (a fake size)")
    assert f"{need / mb.GIB:.1f}" == "113.7" and "trainer.host_memory_gib" in line
    assert host_memory_line(_cfg(), qwen3_30b_a3b, _accelerator(), available=(need, "a fake size"))[0]
    # rank 8, local rank 0 of a second node (HSDP): rank 0 loads on another node, nothing here
    assert host_memory_line(_cfg(), qwen3_30b_a3b, _accelerator(main=False), available=(0, "a fake size"))[0]


def test_without_the_broadcast_every_process_of_the_node_loads_it_whole(qwen3_30b_a3b, monkeypatch):
    """fsdp_cpu_ram_efficient_loading off (or no FSDP): 8 processes × 4 bytes × P, named with the fix."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    need = 8 * count_params(qwen3_30b_a3b) * 4
    for acc in (_accelerator(efficient=False), _accelerator(fsdp=False)):
        fits, line = host_memory_line(_cfg(), qwen3_30b_a3b, acc, available=(need - 1, "a fake size"))
        assert not fits and f"takes {need / mb.GIB:.1f} GiB" in line and "(8 processes load it whole, 4 bytes" in line
        assert "fsdp_cpu_ram_efficient_loading: true" in line
        assert host_memory_line(_cfg(), qwen3_30b_a3b, acc, available=(need, "a fake size"))[0]
    # one process without mixed precision: the model's bytes (bf16 here), once
    acc = _accelerator(processes=1, fsdp=False, mixed="no")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert not host_memory_line(_cfg(), qwen3_30b_a3b, acc, available=(count_params(qwen3_30b_a3b) * 2 - 1, "x"))[0]
    assert host_memory_line(_cfg(), qwen3_30b_a3b, acc, available=(None, "unknown"))[0]  # unknown: not checked


def test_every_rank_stops_when_any_node_cannot_hold_it(qwen3_30b_a3b, monkeypatch, capsys):
    """Each node's local rank 0 decides for its node; the gathered lines stop every rank, and a
    rank that is not its node's first reads nothing."""
    import pace.algo.memory_check as mc

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    read = []
    monkeypatch.setattr(mc, "host_memory", lambda cfg: read.append(cfg) or (10**15, "a fake size"))
    check_host_memory(_cfg(), qwen3_30b_a3b, _accelerator())
    assert len(read) == 1 and "host memory: loading Qwen/Qwen3-30B-A3B-Base" in capsys.readouterr().err
    check_host_memory(_cfg(), qwen3_30b_a3b, _accelerator(main=False, local_index=3), gather=lambda v: [None, v])
    assert len(read) == 1
    with pytest.raises(ConfigError, match="^host memory: a node's line$"):
        check_host_memory(_cfg(), qwen3_30b_a3b, _accelerator(main=False, local_index=3),
                          gather=lambda v: [None, "host memory: a node's line", v])


def test_available_memory_is_meminfos_within_a_cgroup_limit_or_the_key(tmp_path):
    """MemAvailable (kB); under a cgroup v2 limit on the process's path (a Slurm job's --mem: the job's
    cgroup, not the step's) the room left there, its file cache not counted as used."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text("MemTotal: 4194304 kB\nMemFree: 1 kB\nMemAvailable: 2097152 kB\n")
    assert host_memory(_cfg(), root=str(tmp_path)) == (2 * mb.GIB, "MemAvailable in /proc/meminfo")
    (tmp_path / "proc/self/cgroup").write_text("0::/job_7/step_0\n")
    job, step = tmp_path / "sys/fs/cgroup/job_7", tmp_path / "sys/fs/cgroup/job_7/step_0"
    step.mkdir(parents=True)
    (step / "memory.max").write_text("max\n")
    (job / "memory.max").write_text(f"{mb.GIB}\n")
    (job / "memory.current").write_text(f"{600 * 2**20}\n")
    (job / "memory.stat").write_text(f"anon {400 * 2**20}\nfile {200 * 2**20}\nfile_dirty 0\n")
    assert host_memory(_cfg(), root=str(tmp_path)) == (mb.GIB - 400 * 2**20, "the job's cgroup memory.max less its memory in use")
    assert host_memory(_cfg(0.5), root=str(tmp_path)) == (mb.GIB // 2, "trainer.host_memory_gib")
    assert host_memory(_cfg(), root=str(tmp_path / "nowhere")) == (None, "unknown")
