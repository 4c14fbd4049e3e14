"""Building the engines of a fleet at once (pace/rollout/engine.py `build_engines`), on the tiny model."""
from __future__ import annotations

import os
import threading
import time

import pytest

pytestmark = pytest.mark.integration


def _environ(pid: int) -> dict[str, str]:
    """The environment a process started with."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = f.read().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)


def test_child_engines_are_built_at_once_each_with_its_own_environment(tiny_model_path, monkeypatch):
    """Two out-of-process engines: the second build starts while the first is still building; each
    core process started with its own GPUs and compile cache and without the launcher's variables, and
    runs its model worker itself;
    this process's environment comes back; both engines generate."""
    from vllm import SamplingParams

    from pace.config import RolloutConfig
    from pace.placement import Placement
    from pace.rollout import engine as engine_lib
    from pace.rollout.fleet import EngineFleet

    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/tmp/pace-test-vllm-cache")
    spans, real = {}, engine_lib._new_llm

    def timed(model_path, rollout_cfg, dtype, seed, backend, routes=False):
        start = time.monotonic()
        llm = real(model_path, rollout_cfg, dtype, seed, backend, routes)
        spans[seed] = (start, time.monotonic(), threading.current_thread().name)
        return llm

    monkeypatch.setattr(engine_lib, "_new_llm", timed)
    t0 = time.monotonic()
    placement = Placement(device="cpu", world=1, mode="child", backend="shm", gpus=((0,), (1,)))  # GPU ids by hand
    llms = engine_lib.build_engines(tiny_model_path, RolloutConfig(engines=2), "float32", seed=0, placement=placement,
                                    transfer=False)
    wall = time.monotonic() - t0
    try:
        (s0, e0, _), (s1, e1, _) = (spans[0], spans[1])
        print(f"built 2 engines in {wall:.1f} s; builds {e0 - s0:.1f} s and {e1 - s1:.1f} s, the second "
              f"started {s1 - s0:.1f} s after the first")
        assert s1 < e0  # the second build started before the first had finished
        cores = [_environ(llm.llm_engine.engine_core.resources.engine_manager.processes[0].pid) for llm in llms]
        assert [c.get("CUDA_VISIBLE_DEVICES") for c in cores] == ["0", "1"]
        assert [c["VLLM_CACHE_ROOT"] for c in cores] == ["/tmp/pace-test-vllm-cache",
                                                          "/tmp/pace-test-vllm-cache/pace-engine-1"]
        assert not any("RANK" in c for c in cores)
        # each core process runs its model worker itself, as a GPU engine at TP 1 does (not a process of its own:
        # pace/rollout/engine.py `_cpu_worker_in_core`)
        import psutil

        pids = [llm.llm_engine.engine_core.resources.engine_manager.processes[0].pid for llm in llms]
        assert [[p.name() for p in psutil.Process(pid).children() if p.name().startswith("VLLM")] for pid in pids] == [[], []]
        assert "CUDA_VISIBLE_DEVICES" not in os.environ and os.environ["RANK"] == "0"
        assert os.environ["VLLM_CACHE_ROOT"] == "/tmp/pace-test-vllm-cache"
        fleet = EngineFleet(llms)
        params = SamplingParams(max_tokens=8, temperature=1.0, detokenize=False)
        for i in range(4):
            fleet.add_request(f"r{i}", {"prompt_token_ids": [5, 6, 7]}, params)
        done = set()
        while fleet.has_unfinished_requests():
            done |= {(o.request_id, len(o.outputs[0].token_ids)) for o in fleet.step() if o.finished}
        assert {r for r, _ in done} == {"r0", "r1", "r2", "r3"} and all(n > 0 for _, n in done)
        assert all(load == 0 for load in fleet._load) and {fleet._owner.get(f"r{i}") for i in range(4)} == {None}
    finally:
        for llm in llms:
            engine_lib.shutdown(llm)
