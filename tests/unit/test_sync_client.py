"""BlockingClient (pace/weights/sync.py): the nccl/ipc weight-update calls run on the rollout thread; a
thread that dies with a call pending must fail the trainer within seconds, not hang it."""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

import pytest

from pace.errors import RolloutError
from pace.weights.sync import BlockingClient

pytestmark = pytest.mark.unit


class FakeRollout(threading.Thread):
    """The rollout thread's call protocol (RolloutWorker.call) with a loop that runs the queued
    calls until ``die`` is set, then exits with ``error`` set, leaving later calls unrun."""

    def __init__(self):
        super().__init__(daemon=True)
        self.calls: queue.Queue = queue.Queue()
        self.die = threading.Event()
        self.hold = threading.Event()  # set: queued calls wait (the thread is busy elsewhere)
        self.error = None

    def call(self, fn):
        future = Future()
        self.calls.put((fn, future))
        return future

    def run(self):
        while not self.die.is_set():
            if self.hold.is_set():
                time.sleep(0.01)
                continue
            try:
                fn, future = self.calls.get(timeout=0.01)
            except queue.Empty:
                continue
            future.set_result(fn())
        self.error = RuntimeError("engine core died")


def test_calls_run_on_the_thread_and_before_it_starts_on_the_caller(monkeypatch):
    monkeypatch.setattr(BlockingClient, "POLL_S", 0.05)
    rollout = FakeRollout()
    client = BlockingClient(rollout)
    assert client._run(threading.get_ident) == threading.get_ident()  # not started: here
    rollout.start()
    assert client._run(threading.get_ident) == rollout.ident  # on the rollout thread
    rollout.die.set()
    rollout.join(5)


def test_a_rollout_thread_that_dies_with_a_call_queued_fails_it_within_seconds(monkeypatch):
    monkeypatch.setattr(BlockingClient, "POLL_S", 0.05)
    rollout = FakeRollout()
    rollout.hold.set()  # alive, but not running calls: the call below is queued and waits
    rollout.start()
    client = BlockingClient(rollout)
    outcome = {}

    def wait():
        t = time.monotonic()
        try:
            client._run(lambda: None)  # the call is queued on a thread that will never run it
        except RolloutError as exc:
            outcome["error"] = exc
        outcome["s"] = time.monotonic() - t

    caller = threading.Thread(target=wait, daemon=True)
    caller.start()
    time.sleep(0.3)
    assert caller.is_alive() and not rollout.calls.empty()  # queued on a live thread
    rollout.die.set()  # the thread dies with the call never run
    rollout.join(5)
    caller.join(10)  # before the fix: it waited forever on the future
    assert not caller.is_alive(), "BlockingClient still waiting on a dead rollout thread"
    assert "engine core died" in str(outcome["error"]) and outcome["s"] < 3


class _Labelling:
    """A rollout with no thread started (calls run on the caller) that records the update calls."""

    ident = None

    def __init__(self):
        self.calls = []

    def begin_update(self):
        self.calls.append("begin")

    def end_update(self, version):
        self.calls.append(("end", version))


def test_an_update_labels_the_engines_with_the_version_it_was_started_with():
    """vLLM's trainer engines call start/finish_weight_update without a version: the engines are
    labelled with that of the `WeightUpdate` the update was started with, each update its own."""
    from pace.weights.update import WeightUpdate

    rollout = _Labelling()
    client = BlockingClient(rollout)
    with pytest.raises(RuntimeError, match=r"before start\(update\)"):
        client.start_weight_update()  # no update started: no version to label the engines with
    for version in (3, 4):
        client.start(WeightUpdate(version))
        client.start_weight_update()  # the trainer engine's own call: no second pause
        client.finish_weight_update()
    assert rollout.calls == ["begin", ("end", 3), "begin", ("end", 4)]
    with pytest.raises(RuntimeError, match="without an update started"):
        client.finish_weight_update()


class _Tensor:
    copies = 0

    def to(self, *args, **kwargs):
        _Tensor.copies += 1
        return self


@pytest.mark.parametrize("main", [True, False])
def test_streamed_weights_are_copied_to_host_on_rank_0_only(main):
    """WeightSync.weights on the nccl/ipc path (a checkpoint's θ): every rank walks the source (its
    all-gathers are collectives), only rank 0 keeps host copies."""
    from types import SimpleNamespace

    from pace.weights.sync import WeightSync

    walked = []

    def source():
        for i in range(3):
            walked.append(i)
            yield f"p{i}", _Tensor()

    _Tensor.copies = 0
    sync = SimpleNamespace(backend="nccl", acc=SimpleNamespace(is_main_process=main),
                           copies=source())
    out = WeightSync.weights(sync, version=3)
    assert walked == [0, 1, 2]
    assert (len(out), _Tensor.copies) == (3, 3) if main else (out, _Tensor.copies) == (None, 0)
