"""Engine placement (pace/placement.py; the child process's environment: pace/rollout/engine.py): which
GPUs an engine process sees."""
from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from pace.placement import Placement, engine_gpus, visible_devices
from pace.rollout.engine import _engine_process_env

pytestmark = pytest.mark.unit


def test_engine_gpus_are_the_ones_after_the_trainers_or_the_listed_ones():
    cfg = OmegaConf.create({"engines": 2, "tensor_parallel_size": 2, "gpus": None})
    assert engine_gpus(cfg, trainer_gpus=4) == [[4, 5], [6, 7]]
    cfg.gpus = [1, 3, 5, 7]
    assert engine_gpus(cfg, trainer_gpus=4) == [[1, 3], [5, 7]]


def test_indices_map_through_a_schedulers_visible_devices():
    assert visible_devices([4, 5], None) == "4,5" and visible_devices([4, 5], "") == "4,5"
    # a job given GPUs 8-15 of a 16-GPU node: index 4 is physical GPU 12, not 4 (the trainer's)
    assert visible_devices([4, 5], "8,9,10,11,12,13,14,15") == "12,13"
    assert visible_devices([1], "GPU-aa, GPU-bb") == "GPU-bb"  # UUIDs too
    with pytest.raises(ValueError, match=r"rollout\.gpus: GPU index 4 .* 4 visible"):
        visible_devices([4], "0,1,2,3")


def test_a_child_engine_starts_with_the_mapped_devices_and_the_parents_come_back(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "8,9,10,11,12,13,14,15")
    monkeypatch.setenv("RANK", "0")
    with _engine_process_env("child", [4, 5, 6, 7]):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "12,13,14,15" and "RANK" not in os.environ
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "8,9,10,11,12,13,14,15" and os.environ["RANK"] == "0"

class _Engine:
    """A stand-in engine (`LLM`): its seed, and its shutdown recorded in ``closed``."""

    def __init__(self, seed, closed: list):
        from types import SimpleNamespace

        self.seed, self.closed = seed, closed
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=self.shutdown))

    def shutdown(self, timeout=None):
        self.closed.append(self.seed)


def _children(gpus):
    """Child engines on ``gpus`` (each engine's list; None: no GPUs given)."""
    return Placement(device="cpu" if gpus is None else "cuda", world=1, mode="child", backend="nccl",
                     gpus=None if gpus is None else tuple(map(tuple, gpus)))



def test_a_fleet_build_gives_each_engine_its_gpus_and_leaves_none_running_when_one_fails(monkeypatch):
    """`build_engines` with stand-in builds (no core process): each starts under its own GPUs; when
    one fails, the engines already built are shut down, the error is raised, the environment is back."""
    from pace.rollout import engine as engine_lib

    seen, closed = [], []

    def build(model_path, rollout_cfg, dtype, seed, backend, routes=False):
        seen.append((seed, os.environ.get("CUDA_VISIBLE_DEVICES"), "RANK" in os.environ))
        if seed == 12:
            raise RuntimeError("engine 2 failed")
        return _Engine(seed, closed)

    monkeypatch.setattr(engine_lib, "_new_llm", build)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    cfg = OmegaConf.create({"engines": 3, "server_start_timeout_s": 60.0})
    with pytest.raises(RuntimeError, match="engine 2 failed"):
        engine_lib.build_engines("m", cfg, "bfloat16", 10, _children([[1], [2], [3]]), transfer=False)
    assert seen == [(10, "5", False), (11, "6", False), (12, "7", False)]
    assert sorted(closed) == [10, 11]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and os.environ["RANK"] == "0"
    seen.clear()
    built = engine_lib.build_engines("m", cfg, "bfloat16", 20, _children([[0], [1], [2]]), transfer=False)
    assert [e.seed for e in built] == [20, 21, 22] and [s[1] for s in seen] == ["4", "5", "6"]


def test_only_engines_on_gpus_of_their_own_are_built_at_once(monkeypatch):
    """On a CPU (no placement) and for engines sharing a GPU, the builds run one after another here."""
    import threading

    from pace.rollout import engine as engine_lib

    threads = []
    monkeypatch.setattr(engine_lib, "_new_llm", lambda *a: threads.append(threading.current_thread().name) or object())
    cfg = OmegaConf.create({"engines": 2, "server_start_timeout_s": 60.0})
    for placement, at_once in ((None, False), ([[0], [0]], False), ([[0], [1]], True)):
        threads.clear()
        assert len(engine_lib.build_engines("m", cfg, "bfloat16", 0, _children(placement), transfer=False)) == 2
        assert [t.startswith("pace-engine-build") for t in threads] == [at_once] * 2, placement


def test_a_build_that_never_spawns_its_core_fails_by_the_start_deadline(monkeypatch):
    """A concurrent build that hangs before its EngineCore exists: one line naming the engine and the
    key, raised by `rollout.server_start_timeout_s`; the engines already built are shut down, the
    environment is back, and the hung build's thread does not hold up the rest."""
    import threading
    import time

    from pace.rollout import engine as engine_lib

    closed, release = [], threading.Event()

    def build(model_path, rollout_cfg, dtype, seed, backend, routes=False):
        if seed == 11:
            release.wait(30)  # hangs (until the test lets it go)
        return _Engine(seed, closed)

    monkeypatch.setattr(engine_lib, "_new_llm", build)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    cfg = OmegaConf.create({"engines": 3, "server_start_timeout_s": 0.3})
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^rollout engine 1: no EngineCore process 0.3 s .*\(rollout\.server_start_timeout_s=0\.3\)$"):
        engine_lib.build_engines("m", cfg, "bfloat16", 10, _children([[1], [2], [3]]), transfer=False)
    assert time.monotonic() - start < 5 and closed == [10]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    release.set()  # the late build's engine is shut down when it comes
    deadline = time.monotonic() + 5
    while closed != [10, 11] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closed == [10, 11]


def test_a_placement_is_computed_once_from_the_config_and_frozen():
    import dataclasses

    from pace.placement import Placement

    cfg = OmegaConf.create({"engine_process": "auto", "weight_transfer": "auto", "placement": "separate", "engines": 2,
                            "tensor_parallel_size": 1, "gpus": None})
    cpu = Placement.of(cfg, "cpu", 1)
    assert (cpu.mode, cpu.backend, cpu.transfer, cpu.gpus) == ("child", "shm", "pace_shm", None)  # two engines: children
    gpu = Placement.of(cfg, "cuda", 2, local_trainers=2)
    assert (gpu.mode, gpu.backend, gpu.transfer, gpu.gpus) == ("child", "nccl", "nccl", ((2,), (3,)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        gpu.mode = "server"


def test_servers_a_run_starts_on_cuda_get_the_gpus_after_the_trainers_whatever_the_placement():
    """As `launch_local` has always placed them: a server process never shares the trainer's GPU."""
    cfg = OmegaConf.create({"engine_process": "server", "weight_transfer": "auto", "placement": "colocate", "engines": 2,
                            "tensor_parallel_size": 1, "gpus": None, "servers": []})
    servers = Placement.of(cfg, "cuda", 1, local_trainers=1)
    assert (servers.mode, servers.backend, servers.gpus) == ("server", "nccl", ((1,), (2,)))
    cfg.engine_process = "child"
    assert Placement.of(cfg, "cuda", 1, local_trainers=1).gpus is None  # a colocated child engine: the trainer's GPU


def test_an_engine_built_without_a_backend_gets_the_one_configured_for_this_machine(monkeypatch):
    """`build_engine`'s default: `rollout.weight_transfer` for this machine (as a run's placement
    names it), not pace's shared-memory backend on every machine; None: no weight transfer."""
    import torch

    from pace.rollout import engine as engine_lib

    built = []
    monkeypatch.setattr(engine_lib, "_new_llm", lambda path, cfg, dtype, seed, backend, routes=False: built.append(backend))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # build_engine sets it; restored after
    cfg = OmegaConf.create({"engine_process": "auto", "weight_transfer": "auto", "placement": "separate", "engines": 1,
                            "tensor_parallel_size": 1, "gpus": None})
    engine_lib.build_engine("m", cfg, "float32", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    engine_lib.build_engine("m", cfg, "float32", 0)
    cfg.placement = "colocate"
    engine_lib.build_engine("m", cfg, "float32", 0)
    engine_lib.build_engine("m", cfg, "float32", 0, backend=None)
    assert built == ["pace_shm", "nccl", "ipc", None]


def test_engines_on_servers_elsewhere_get_no_gpus_and_the_ones_started_here_start_after_one_trainer(monkeypatch):
    """Servers on other hosts (`rollout.servers`) take their own share there: the run places none,
    so a `rollout.gpus` meant for those hosts is not checked here. Servers the run starts (and
    separate engines) start after the trainer processes on this node: LOCAL_WORLD_SIZE, else one
    for servers and the whole world for engines."""
    from pace.errors import ConfigError

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = OmegaConf.create({"engine_process": "server", "weight_transfer": "auto", "placement": "separate", "engines": 2,
                            "tensor_parallel_size": 1, "gpus": [4, 5, 6], "servers": ["http://a:8100", "http://b:8100"]})
    remote = Placement.of(cfg, "cuda", 4)
    assert (remote.mode, remote.backend, remote.gpus) == ("server", "nccl", None)
    cfg.servers, cfg.gpus = [], None
    assert Placement.of(cfg, "cuda", 4).gpus == ((1,), (2,))  # started here: after one trainer GPU
    cfg.engine_process = "child"
    assert Placement.of(cfg, "cuda", 4).gpus == ((4,), (5,))  # separate engines: after the world's
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert Placement.of(cfg, "cuda", 4).gpus == ((2,), (3,))
    cfg.gpus = [4, 5, 6]  # two engines of one GPU each: a one-line error naming the key, exit status 2 in train.py
    with pytest.raises(ConfigError, match=r"^rollout\.gpus: 2 engines × tensor_parallel_size 1 need 2 GPU ids"):
        Placement.of(cfg, "cuda", 4)


def test_a_server_started_by_hand_takes_its_engines_share_of_the_gpus_and_the_runs_backend(monkeypatch):
    """`python -m pace.rollout.server --engine E`: engine E's slice of `rollout.gpus`, unchecked
    against the fleet's size (the list may name other hosts' GPUs too), and the run's backend."""
    from pace.rollout import server

    started = []
    monkeypatch.setattr(server, "_has_cuda", lambda: True)
    monkeypatch.setattr(server.os, "execve", lambda exe, cmd, env: started.append((cmd, env)))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    server.main(["--engine", "1", "--model", "m", "rollout.engines=2", "rollout.tensor_parallel_size=2",
                 "rollout.gpus=[0,1,2,3,4,5]"])
    (cmd, env), = started
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert cmd[cmd.index("--weight-transfer-config") + 1] == '{"backend": "pace_nccl"}'  # nccl, checked


def test_each_server_a_run_starts_compiles_into_a_cache_of_its_own(monkeypatch, tmp_path):
    """vLLM's compile cache root (VLLM_CACHE_ROOT, vllm/envs.py): servers started at once used to
    share it. Now server 0 keeps vLLM's root, every other one a directory of its own under it, as
    the child engines do; a server started by hand as engine E the same."""
    from types import SimpleNamespace

    from pace.config import RolloutConfig
    from pace.rollout import server

    envs = []

    class Started:  # a LocalServer that starts nothing
        def __init__(self, args, env, log_path, port):
            envs.append(env)

        def wait_ready(self, deadline):
            pass

    monkeypatch.setattr(server, "LocalServer", Started)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vc"))
    cfg = SimpleNamespace(rollout=RolloutConfig(engines=3), algo=SimpleNamespace(routing_replay=False),
                          model=SimpleNamespace(dtype="float32"), seed=0)
    server.launch_local("m", cfg, Placement("cpu", 1, "server", "gloo", None), tmp_path, transfer=False)
    assert [env["VLLM_CACHE_ROOT"] for env in envs] == [str(tmp_path / "vc"), str(tmp_path / "vc" / "pace-engine-1"),
                                                        str(tmp_path / "vc" / "pace-engine-2")]
    monkeypatch.delenv("VLLM_CACHE_ROOT")  # vLLM's default root: $XDG_CACHE_HOME/vllm
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert server.serve_env(RolloutConfig(), "cuda", [3], engine=2)["VLLM_CACHE_ROOT"] == str(
        tmp_path / "xdg" / "vllm" / "pace-engine-2")
    assert "VLLM_CACHE_ROOT" not in server.serve_env(RolloutConfig(), "cuda", [1], engine=0)
    started = []
    monkeypatch.setattr(server, "_has_cuda", lambda: False)
    monkeypatch.setattr(server.os, "execve", lambda exe, cmd, env: started.append(env))
    server.main(["--engine", "1", "--model", "m", "rollout.engines=2"])
    assert started[0]["VLLM_CACHE_ROOT"] == str(tmp_path / "xdg" / "vllm" / "pace-engine-1")


def test_engines_that_do_not_fit_the_node_are_refused_at_start_naming_the_keys(monkeypatch):
    """The 30B-A3B preset launched on one node of 8 GPUs (`accelerate launch --config_file
    conf/accelerate/fsdp_8gpu.yaml train.py +exp=pace_qwen3_30b_a3b`, no rollout.servers): its 4
    servers of TP 2 would get GPUs 8-15 and fail in their logs after the model loaded. Refused by
    `Placement.of` (every rank, before the model loads) in one line, with a fake GPU count."""
    from hydra import compose, initialize_config_dir

    from pace.config import register
    from pace.errors import ConfigError
    from tests.helpers import ROOT

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["+exp=pace_qwen3_30b_a3b"])
    r = cfg.rollout
    assert (r.engine_process, list(r.servers), r.engines, r.tensor_parallel_size) == ("server", [], 4, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # accelerate launch with fsdp_8gpu.yaml's 8 processes
    with pytest.raises(ConfigError) as err:
        Placement.of(r, "cuda", 8, node_gpus=8)
    line = str(err.value)
    assert "\n" not in line and line.startswith("rollout.servers is empty, so the run starts its rollout.engines=4 × "
                                                "rollout.tensor_parallel_size=2 engines as servers on this node, on GPUs 8-15")
    assert "this node has 8 GPUs (0-7)" in line and "rollout.servers (scripts/launch_slurm.sh" in line
    assert "num_processes" in line
    assert Placement.of(r, "cuda", 8, node_gpus=16).gpus == ((8, 9), (10, 11), (12, 13), (14, 15))  # a 16-GPU node
    r.servers = [f"http://node1:{8100 + e}" for e in range(4)]  # as the launchers pass them: nothing placed here
    assert Placement.of(r, "cuda", 8, node_gpus=8).gpus is None

    # separate child engines after the trainer's, and a rollout.gpus list on trainer GPUs
    r.engine_process, r.servers, r.engines, r.tensor_parallel_size = "child", [], 5, 1
    with pytest.raises(ConfigError, match=r"^rollout\.placement=separate puts rollout\.engines=5 × "
                                          r"rollout\.tensor_parallel_size=1 on GPUs 4-8 after the 4 trainer .*"
                                          r"but this node has 8 GPUs \(0-7\): run fewer trainer processes"):
        Placement.of(r, "cuda", 4, local_trainers=4, node_gpus=8)
    r.engines = 4
    assert Placement.of(r, "cuda", 4, local_trainers=4, node_gpus=8).gpus == ((4,), (5,), (6,), (7,))
    r.gpus = [2, 5, 6, 7]
    with pytest.raises(ConfigError, match=r"^rollout\.gpus=\[2, 5, 6, 7\] places .*but 2 is among the trainer "
                                          r"processes' GPUs \(0-3: one each\)"):
        Placement.of(r, "cuda", 4, local_trainers=4, node_gpus=8)


def test_a_cpu_server_runs_its_model_worker_in_its_engine_core(monkeypatch):
    # vLLM-CPU keeps the "uni" executor (no worker process of its own, as a GPU server at TP 1) only with
    # multiprocessing off, which a server's AsyncLLM does not need for its engine core process
    from pace.config import RolloutConfig
    from pace.rollout import server

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # as a child-engine build leaves it
    assert server.serve_env(RolloutConfig(), "cpu")["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert server.serve_env(RolloutConfig(cpu_threads_bind="auto"), "cpu")["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert server.serve_env(RolloutConfig(tensor_parallel_size=2), "cpu")["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert server.serve_env(RolloutConfig(), "cuda", [0])["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
