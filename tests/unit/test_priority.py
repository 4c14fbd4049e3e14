"""`rollout.engine_nice`: the rollout's processes run below the trainer on a CPU (pace/priority.py).

Each process reads the niceness from the environment as it starts; a child engine core inherits the
priority of the thread that spawns it. Measured by the kernel's own view (getpriority of the pid)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from pace import priority

pytestmark = pytest.mark.unit


def nice_of(pid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, pid)


@pytest.fixture
def nice3(monkeypatch):
    monkeypatch.setenv(priority.ENV, "3")
    return nice_of(0) + 3


def test_a_grading_worker_and_the_stream_reader_start_lowered(nice3):
    from pace.grading_workers import WorkerSlot
    from pace.rollout.streams import StreamReader

    slot = WorkerSlot()
    slot.start(lambda f: None)
    reader = StreamReader(lambda batch: None, keepalive_s=5.0)
    try:
        assert nice_of(slot.future.result(timeout=60)) == nice3
        assert nice_of(reader.process.pid) == nice3
        assert nice_of(0) == nice3 - 3  # this process (the trainer's) is left as it was
    finally:
        slot.close()
        reader.close()


def test_a_process_started_by_a_lowered_thread_inherits_it_and_the_caller_does_not(nice3):
    """What `build_engine` relies on: vLLM spawns a child engine core from the thread that builds it."""
    from pace.rollout.engine import _in_thread, _lowered

    def spawn():
        proc = subprocess.Popen([sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"],
                                stdout=subprocess.PIPE, text=True)
        return int(proc.communicate()[0]), nice_of(threading.get_native_id())

    child, thread = _in_thread("t", _lowered(spawn)).result(timeout=60)
    assert (child, thread) == (nice3, nice3)
    assert nice_of(threading.get_native_id()) == nice3 - 3


def test_niceness_zero_changes_nothing(monkeypatch):
    monkeypatch.setenv(priority.ENV, "0")
    before = nice_of(0)
    priority.lower_thread()
    assert nice_of(0) == before


def test_a_server_started_by_the_run_runs_lowered(nice3):
    """The server's entry point lowers itself before vLLM loads (pace/rollout/server.py ENTRY)."""
    from pace.rollout.server import ENTRY, ROOT

    code = ENTRY.split("from vllm")[0] + "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout) == nice3
