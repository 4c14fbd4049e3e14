"""The trainer's CUDA allocator setting (pace/allocator.py): expandable segments for a trainer on
CUDA, set before CUDA starts, never over the user's own setting, never on CPU or with the ipc
transfer, and not passed to the engine processes the run starts. Its effect on a GPU has not run."""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from pace import allocator

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SET = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PACE_TRAINER_ALLOC_CONF": "expandable_segments:True"}


def test_a_trainer_on_cuda_gets_expandable_segments_unless_the_user_chose_or_cpu_or_ipc():
    assert allocator.trainer_env({}, "cuda", "nccl") == SET
    assert allocator.trainer_env({"HOME": "/root"}, "cuda", None) == SET  # no engine (scripts/gpu_smoke.py)
    assert allocator.trainer_env({}, "cpu", "shm") == {} and allocator.trainer_env({}, "cpu", "gloo") == {}
    assert allocator.trainer_env({}, "cuda", "ipc") == {}  # CUDA IPC of the trainer's tensors every sync
    for user in ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, {"PYTORCH_CUDA_ALLOC_CONF": ""},
                 {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}):
        assert allocator.trainer_env(user, "cuda", "nccl") == {}, user


def test_configure_sets_this_process_and_keeps_a_users_value(monkeypatch):
    for var in (*allocator.USER_VARS, allocator.MARK):
        monkeypatch.delenv(var, raising=False)
    allocator.configure_trainer("cpu", "shm")
    assert not any(v in os.environ for v in (*allocator.USER_VARS, allocator.MARK))
    allocator.configure_trainer("cuda", "nccl")
    assert {k: os.environ[k] for k in SET} == SET
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    monkeypatch.delenv(allocator.MARK)
    allocator.configure_trainer("cuda", "nccl")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512" and allocator.MARK not in os.environ


def test_engine_processes_leave_out_the_runs_setting_and_keep_a_users():
    assert allocator.engine_excluded({}) == ()
    assert allocator.engine_excluded({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) == ()
    assert set(allocator.engine_excluded(SET)) == set(SET)
    changed = dict(SET, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True,max_split_size_mb:512")  # set since
    assert allocator.engine_excluded(changed) == (allocator.MARK,)


def test_servers_and_child_engines_started_by_a_cuda_run_do_not_inherit_it(monkeypatch):
    from pace.config import RolloutConfig
    from pace.rollout.engine import _engine_process_env
    from pace.rollout.server import serve_env

    for var in (*allocator.USER_VARS, allocator.MARK):
        monkeypatch.delenv(var, raising=False)
    allocator.configure_trainer("cuda", "nccl")
    env = serve_env(RolloutConfig(), "cuda", [1])
    assert not set(SET) & set(env) and env["CUDA_VISIBLE_DEVICES"] == "1"
    with _engine_process_env("child", [1]):
        assert not set(SET) & set(os.environ)
    assert {k: os.environ[k] for k in SET} == SET  # the trainer keeps it
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")  # the user's own: passed on
    monkeypatch.delenv(allocator.MARK)
    assert serve_env(RolloutConfig(), "cuda", [1])["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


def test_train_py_sets_it_before_the_accelerator_touches_the_gpu():
    """In train.py's `run`, `allocator.configure_trainer` is called before `Accelerator(...)` (the
    first CUDA use; the model, the engines and everything that allocates come after it)."""
    tree = ast.parse((ROOT / "train.py").read_text())
    run = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run")
    calls = [(n.lineno, ast.unparse(n.func)) for n in ast.walk(run) if isinstance(n, ast.Call)]
    configure = [line for line, f in calls if f == "allocator.configure_trainer"]
    accelerator = [line for line, f in calls if f == "Accelerator"]
    assert configure and accelerator and configure[0] < accelerator[0]
