"""Shared fixtures and the tiers of the suite. The engine environment must be set before vLLM or torch are
imported. Helpers that tests import live in tests/helpers.py."""
from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest
from hypothesis import settings

from tests.helpers import ROOT

# No per-example deadline (Hypothesis's default is 200 ms): these properties are about values, and on two
# workers with the cores shared an example's time says nothing.
settings.register_profile("pace", deadline=None)
settings.load_profile("pace")


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The default tiny model, built once into the repo cache (the same one `python train.py` uses)."""
    from pace.tiny import TinySpec, build_tiny

    return str(build_tiny(TinySpec(), ROOT / "data" / "cache", progress=False))


# The in-process engine on the default tiny model and its weights, one per test module that asks
# (test_engine.py, test_engine_rollout.py); the tests leave its weights as they found them.

@pytest.fixture(scope="module")
def llm(tiny_model_path):
    from pace.config import RolloutConfig
    from pace.rollout import engine as engine_lib

    llm = engine_lib.build_engine(tiny_model_path, RolloutConfig(), "float32", seed=0)
    yield llm
    engine_lib.shutdown(llm)


@pytest.fixture(scope="module")
def weights(tiny_model_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    return [(n, p.detach().clone()) for n, p in model.state_dict().items()]


@pytest.fixture(scope="session")
def tiny_tool_model_path() -> str:
    """The tiny tool-use model of conf/model/tiny_tool.yaml (what the *_tiny_tool presets build)."""
    from pace.tiny import build_tiny, shipped_specs

    return str(build_tiny(shipped_specs()["tool"], ROOT / "data" / "cache", progress=False))


# ---------------------------------------------------------------- finished runs that several tests read
# Each costs a `train.py` start (~25 CPU-seconds of imports alone: docs/tests.md), so a run whose outputs
# several tests check is made once. The tests read these folders and never write into them (one that
# resumes a run copies it first).

@pytest.fixture(scope="session")
def async_run(tiny_model_path, tmp_path_factory):
    """Async, 6 steps at B = 8 with 32 groups in flight, logged offline to wandb too, the effective
    staleness recorded on every consumed group (`pool.record_effective=1.0`): what
    test_shared_runs.py's logging and test_record_effective_run.py read."""
    from tests.helpers import run_train

    run_dir = tmp_path_factory.mktemp("async_run")
    proc = run_train(["+exp=async_tiny", "trainer.steps=6", "data.batch_prompts=8", "rollout.max_inflight_groups=32",
                      "eval.every=0", "logger.mode=offline", "pool.record_effective=1.0"], run_dir, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="session")
def sync_run(tiny_model_path, tmp_path_factory):
    """Sync, 10 steps at B = 8, repeatable (`rollout.deterministic`), checkpoints at steps 3, 6, 9
    and 10, all kept: test_shared_runs.py checks it is on-policy and that a resume from step 3 equals it."""
    from tests.helpers import run_train

    run_dir = tmp_path_factory.mktemp("sync_run")
    proc = run_train(["+exp=sync_tiny", "trainer.steps=10", "trainer.save_every=3", "trainer.keep_checkpoints=4",
                      "rollout.deterministic=true", "logger.mode=disabled", "data.batch_prompts=8",
                      "rollout.max_inflight_groups=16", "eval.every=0"], run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


# B = 8 with 32 groups in flight (4 batches) and ρ without smoothing: a backlog forms within a
# few steps and both PACE variants reject, however busy the machine (16 in flight was not enough
# once, with the CI's cores shared: PACE (raw) then rejected nothing in 5 steps).
STUDY_SHORT = ["trainer.steps=5", "data.batch_prompts=8", "rollout.max_inflight_groups=32", "pace.ema=0.0",
               "eval.every=2", "eval.k=2", "eval.val_max_problems=5", "logger.mode=offline", "logger.progress=false"]
STUDY_SWEEPS = {
    "main": ["+exp=sync_tiny,async_tiny,pace_tiny,pace_raw_tiny"],
    "stalek": ["+exp=stalek_tiny", "pool.max_lag=1,8"],
}


@pytest.fixture(scope="session")
def study(tiny_model_path, tmp_path_factory):
    """Short tiny runs of every method the figures need, as two `train.py -m` sweeps (one folder
    each under the returned root): what test_analysis_runs.py builds into figures and tables, and
    test_shared_runs.py's check of a multirun's job folders reads."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("study")
    for name, args in STUDY_SWEEPS.items():
        cmd = [sys.executable, str(ROOT / "train.py"), "-m", *args, *STUDY_SHORT, f"hydra.sweep.dir={root / name}"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return root


TIERS = ("unit", "integration")

# Parallel runs (`-n 2 --dist loadgroup`, the README's command; pytest-xdist): each test file is one unit
# of work that one worker runs whole (its module fixtures are built once), except the files whose tests
# use one of these session fixtures: they go to one worker together (the fixture is built once). Units go
# out in FIRST's order, the longest (serial seconds on 2 cores) first, then the other integration files,
# then the unit tests, which fill the end.
SHARED = {"tiny_tool_model_path": "tool",  # the tool files' runs (the model itself ships built: data/tiny/)
          "study": "runs", "async_run": "runs", "sync_run": "runs"}  # runs that several files read
FIRST = ("tool", "runs", *(f"integration/test_{name}.py" for name in (
    "multiprocess", "resume", "rehearsal", "remote", "train_e2e", "delta_sync", "engine_rollout", "grader_processes",
    "engine_build", "stale_engine")))


def _units_of_work(items) -> dict:
    """Each test's unit of work: its file's path under tests/, or the group of the shared session
    fixtures the file's tests use."""
    path = {item: str(Path(item.path).relative_to(ROOT / "tests")) for item in items}
    groups = {}
    for item in items:
        groups.setdefault(path[item], set()).update(SHARED[f] for f in getattr(item, "fixturenames", ()) if f in SHARED)
    two = [f"  {path}: {' and '.join(sorted(g))}" for path, g in groups.items() if len(g) > 1]
    if two:
        raise pytest.UsageError("a test file uses the session fixtures of two groups (tests/conftest.py SHARED):\n"
                                + "\n".join(two))
    unknown = [name for name in FIRST if name not in SHARED.values() and not (ROOT / "tests" / name).is_file()]
    if unknown:
        raise pytest.UsageError(f"tests/conftest.py FIRST names no test file or group: {unknown}")
    return {item: next(iter(groups[path[item]]), path[item]) for item in items}


def pytest_configure(config):
    if config.getoption("dist", "no") == "loadgroup":
        config.option.loadscopereorder = False  # keep the order below (xdist sorts by test count otherwise)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A test's tier is its directory: every test under tests/unit/ is marked `unit`, under
    tests/integration/ `integration`. Collection fails, naming the tests, on a test outside both
    directories or marked with the other directory's tier."""
    refused = []
    for item in items:
        parts = Path(item.path).relative_to(ROOT / "tests").parts
        tier = parts[0] if len(parts) > 1 and parts[0] in TIERS else None
        other = [t for t in TIERS if t != tier and item.get_closest_marker(t)]
        if tier is None or other:
            refused.append(f"  {item.nodeid}: " + (f"marked {other[0]!r} under tests/{tier}/" if tier
                                                   else "not under tests/unit/ or tests/integration/"))
        else:
            item.add_marker(tier)
    if refused:
        raise pytest.UsageError("tests outside their tier (see docs/tests.md):\n" + "\n".join(refused))
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        unit = _units_of_work(items)
        for item in items:
            item.add_marker(pytest.mark.xdist_group(unit[item]))
        rank = {name: i for i, name in enumerate(FIRST)}
        items.sort(key=lambda item: (rank.get(unit[item], len(FIRST)), item.get_closest_marker("unit") is not None))
