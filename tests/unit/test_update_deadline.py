"""A weight update that fails on trainer rank 0 (a broadcast given up at its deadline, an engine lost in
it) is left by every rank together (pace/weights/sync.py): rank 0 walks the rest of the source first
(the gathers the other ranks wait in under FSDP), then every rank raises `UpdateFailed` with rank 0's
cause, so that every rank writes the checkpoint (train.py). The source's `finish` gathers without
fingerprinting; the NCCL sender's deadline aborts its communicator and fails the update."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

from pace.weights.sync import BlockingClient, UpdateFailed, WeightSync
from pace.weights.transfer import CastSource

pytestmark = pytest.mark.unit


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def test_finish_walks_what_is_left_of_a_pass_without_fingerprints():
    prints = []
    source = CastSource(_model(), torch.float32, on_sent=prints.append)
    walk = iter(source)
    next(walk), next(walk)  # the consumer gave up after two of six tensors
    assert source.finish() == 4 and prints == []  # gathered, not sent: nothing expected of the engines
    assert source.finish() == 0
    assert len(list(source)) == 6 and len(prints) == 1  # a full pass still fingerprints what it sends


class _Sender:
    """A gloo-like trainer engine: iterates the source; rank 0's broadcast fails after ``fail_after`` tensors."""

    def __init__(self, source, is_sender: bool, fail_after: int | None = None):
        self.source, self.is_sender, self.fail_after = source, is_sender, fail_after
        self.client = SimpleNamespace(start=lambda update: None)
        self.shut = False

    def send_weights(self):
        for i, _ in enumerate(self.source):
            if self.fail_after is not None and i == self.fail_after:
                raise TimeoutError("gloo broadcast timed out")

    def shutdown(self):
        self.shut = True


def _sync(is_sender: bool, fail_after: int | None, decided: list) -> WeightSync:
    """A WeightSync of the nccl/gloo kind, its collaborators stand-ins; ``decided``: what rank 0 decides
    (what `decide` returns on a rank ≥ 1), recorded for rank 0."""
    sync = WeightSync.__new__(WeightSync)
    sync.backend, sync.delta, sync.plan, sync.rollout, sync._due = "gloo", None, None, None, False
    sync.source = CastSource(_model(), torch.float32)
    sync.sender = _Sender(sync.source, is_sender, fail_after)
    sync.cfg = SimpleNamespace(rollout=SimpleNamespace(update_timeout_s=30.0))
    sync._version, sync._update = 7, None
    sync._regroup = lambda admit: None

    def decide(flag):
        if is_sender:
            decided.append(flag)
            return flag
        return decided.pop(0)

    sync.decide = decide
    return sync


def test_rank_0s_failed_broadcast_finishes_the_gathers_and_fails_the_update():
    decided = []
    sync = _sync(is_sender=True, fail_after=2, decided=decided)
    walked = []
    finish = sync.source.finish
    sync.source.finish = lambda: walked.append(finish()) or walked[-1]
    with pytest.raises(UpdateFailed, match=r"^the weight update to θ_7 failed: TimeoutError: gloo broadcast timed out"):
        sync.publish(7)
    assert walked == [3]  # tensors 3..5 of 6 gathered after the failure (the broadcast stopped at the third)
    assert sync.sender.shut
    assert decided == [None, "TimeoutError: gloo broadcast timed out"]  # go, then rank 0's cause to every rank


def test_every_other_rank_fails_the_update_with_rank_0s_cause():
    sync = _sync(is_sender=False, fail_after=None, decided=[None, "EngineFailed: rollout engine 1 failed"])
    with pytest.raises(UpdateFailed) as failed:
        sync.publish(7)
    assert failed.value.why == "weight update failed: EngineFailed: rollout engine 1 failed"
    assert sync.source.finish() == 0  # its own pass ran whole


def test_a_failure_before_the_transfer_is_every_ranks_too():
    decided = []
    sync = _sync(is_sender=True, fail_after=None, decided=decided)

    def dead(update):
        raise RuntimeError("rollout thread died")

    sync.sender.client.start = dead
    with pytest.raises(UpdateFailed, match="RuntimeError: rollout thread died"):
        sync.publish(7)
    assert decided == ["RuntimeError: rollout thread died"]  # decided before any rank entered the broadcast


def test_a_good_update_is_decided_once_before_and_once_after():
    decided = []
    _sync(is_sender=True, fail_after=None, decided=decided).publish(7)
    assert decided == [None, None]


def test_the_deadline_aborts_a_sender_that_can_be_aborted():
    """vLLM's PyNccl broadcast has no timeout: past `rollout.update_timeout_s` the sender's `abort` (ncclCommAbort)
    is called from a timer, which returns the blocked broadcast."""
    sync = _sync(is_sender=True, fail_after=None, decided=[])
    sync.cfg.rollout.update_timeout_s = 0.2
    released = threading.Event()
    sync.sender.abort = released.set

    def blocked():
        if not released.wait(5):
            raise AssertionError("never aborted")
        raise TimeoutError("aborted")

    sync.sender.send_weights = blocked
    t0 = time.monotonic()
    with pytest.raises(UpdateFailed, match="TimeoutError: aborted"):
        sync.publish(7)
    assert 0.15 < time.monotonic() - t0 < 3.0


def test_an_aborted_update_is_not_finished_on_the_engines():
    """The NCCL sender's abort cancels the client: vLLM's send_weights then calls finish_weight_update, which
    must fail rather than label the engines with a version they did not get."""
    labelled = []
    client = BlockingClient(SimpleNamespace(ident=None, end_update=labelled.append, begin_update=lambda: None))
    client.start(SimpleNamespace(version=3))
    client.cancel()
    with pytest.raises(TimeoutError, match="θ_3 was aborted"):
        client.finish_weight_update()
    assert labelled == [] and client.update is None


class _Member(BaseHTTPRequestHandler):
    """A stand-in server in the weight-transfer group: /update_weights waits for the trainer to close the
    group (``closed``), then answers 500 as a live engine whose receive failed does; a frozen one never
    answers within the call's timeout."""

    closed = threading.Event()
    frozen = False

    def do_GET(self):  # noqa: N802 - http.server's name
        self._answer(200, b'{"world_size": 1}' if self.path.startswith("/get_world_size") else b"{}")

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path.startswith("/update_weights"):
            if self.frozen:
                time.sleep(30)
                return
            type(self).closed.wait(10)
            self._answer(500, b'{"error": "gloo recv: connection closed by peer"}')
        else:
            self._answer(200, b"{}")

    def _answer(self, code: int, body: bytes) -> None:
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("frozen", [{1}, {0}, {0, 1}])
def test_the_servers_that_did_not_answer_are_blamed_not_one_that_answered_once_the_group_closed(frozen):
    """The engines in ``frozen`` never answer their weight call; once the trainer gives the transfer up and
    closes the group, any other answers with an error (its receive failed) and is failed first. The ones to
    blame are the silent ones, whatever their index, every one of them when no other answered (gloo's receive
    waits out its deadline: which one stopped cannot be told). Before, the first failed was named: the live
    one, or with none failed yet, none."""
    from pace.rollout.remote import RemoteFleet

    _Member.closed.clear()
    servers = []
    for i in range(2):
        handler = type(f"_Member{i}", (_Member,), {"frozen": i in frozen})
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
    fleet = RemoteFleet([f"http://127.0.0.1:{h.server_address[1]}" for h in servers], tokenizer=None,
                        engine_timeout_s=60.0, stream_reader="thread", update_timeout_s=8.0)
    try:
        loading = threading.Thread(target=fleet.load, args=({"names": []},), daemon=True)
        loading.start()
        time.sleep(1.0)  # the transfer runs; the trainer's send to the frozen one never completes
        _Member.closed.set()  # the trainer gives it up and closes the group: the live one's receive fails
        blamed = fleet.wait_failed({0, 1}, timeout=5.0)
        assert sorted(s.index for s in blamed) == sorted(frozen), blamed
        for live in (s for s in fleet.servers if s.index not in frozen):
            assert live.answered and not live.calling  # it answered (an error), and is not named
    finally:
        _Member.closed.set()
        fleet.shutdown()
        for h in servers:
            h.shutdown()
