"""A fleet that heals and grows (pace/rollout/healing.py), against stand-in HTTP servers (no engine):
a failed server started again until the restart budget is spent, a joiner admitted only at the start
of an update, engines released before a group is formed, a joiner failed on its own check, a drain."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pace.rollout import healing
from pace.rollout.remote import RemoteFleet
from pace.rollout.server_state import DEAD, DRAINING, JOINING, LEFT, READY, SERVING, STARTING


class StandIn:
    """An HTTP server answering vLLM's routes with {} (/health 200, one worker), recording each POST's
    path; /collective_rpc answers ``rpc_results``."""

    def __init__(self):
        self.posts: list[str] = []
        self.queries: list[str] = []  # each POST's query string
        self.rpc_results: list = [None]
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802 - http.server's name
                path = self.path.split("?")[0]
                self._send({"world_size": 1} if path == "/get_world_size" else
                           {"is_paused": False} if path == "/is_paused" else {})

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path.split("?")[0]
                stand_in.posts.append(path)
                stand_in.queries.append(self.path.partition("?")[2])
                self._send({"results": stand_in.rpc_results} if path == "/collective_rpc" else {})

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeProcess:
    """A server this run started, as `LocalServer` (pace/rollout/server.py) looks to the fleet: its
    respawn answers at the next stand-in of ``spares``."""

    def __init__(self, url: str, spares: list, respawns: list):
        self.url, self.spares, self.respawns = url, spares, respawns
        self.proc = type("P", (), {"pid": 0})()
        self.killed = False

    def exit_code(self):
        return -9 if self.killed else None

    def kill(self, timeout: float = 2.0):
        self.killed = True

    def gone(self) -> bool:
        return self.killed

    def respawn(self):
        self.respawns.append(time.monotonic())
        return FakeProcess(self.spares.pop(0).url, self.spares, self.respawns)

    def wait_ready(self, deadline: float) -> None:
        pass


@pytest.fixture
def stand_ins():
    made = []

    def make(n):
        made.extend(StandIn() for _ in range(n))
        return made[-n:]

    yield make
    for s in made:
        s.close()


@pytest.fixture
def fleets():
    """``fleets(urls, **kw)``: a RemoteFleet, shut down at the end of the test."""
    made = []

    def make(urls, **kw):
        made.append(RemoteFleet(urls, tokenizer=None, **kw))
        return made[-1]

    yield make
    for fleet in made:
        fleet.shutdown()


def _until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_failed_server_is_started_again_then_the_budget_stops_it(stand_ins, capsys, fleets):
    first, spare, _ = servers = stand_ins(3)
    respawns = []
    proc = FakeProcess(first.url, [spare, servers[2]], respawns)
    fleet = fleets([first.url], processes=[proc], max_restarts=1, restart_backoff_s=0.2)
    server = fleet.servers[0]
    t_fail = time.monotonic()
    fleet.fail_engine(0, "killed")
    assert [f.index for f in fleet.take_failures()] == [0] and fleet.alive == []
    _until(lambda: server.state == READY)
    assert respawns[0] - t_fail >= 0.2  # after the backoff
    assert proc.killed and server.url == spare.url and server.restarts == fleet.restarts == 1
    assert fleet.regroup_due(admit=False) and server.state == READY  # lost: formed again; not admitted mid-update
    assert fleet.regroup_due(admit=True) and server.state == JOINING and fleet.joining() == [0]
    assert fleet.alive == [] and fleet.transfer_workers() == 1  # in the group, no requests
    assert fleet.promote(0) > 0 and server.state == SERVING and fleet.alive == [0]
    assert fleet.promote(0) is None  # once
    fleet.fail_engine(0, "killed again")
    _until(lambda: "restart budget spent" in capsys.readouterr().err)
    assert server.state == DEAD and len(respawns) == 1 and fleet.restarts == 1


def test_a_failed_url_server_is_readmitted_once_it_answers_again_cleaned(stand_ins, monkeypatch, fleets):
    monkeypatch.setattr(healing, "PROBE_INTERVAL_S", 0.05)
    a, b = stand_ins(2)
    fleet = fleets([a.url, b.url], max_restarts=2, restart_backoff_s=0.0)
    fleet.fail_engine(1, "missed /health")
    _until(lambda: fleet.servers[1].state == READY)
    # nothing of before left: resumed if paused (it is not), its requests aborted, its engine released
    assert b.posts == ["/abort_requests", "/shutdown_weight_transfer_engine"]
    assert fleet.servers[1].url == b.url and fleet.restarts == 1 and fleet.alive == [0]


def test_a_group_is_formed_after_releasing_the_engines_outside_an_update_only(stand_ins, fleets):
    a, b = stand_ins(2)
    fleet = fleets([a.url, b.url], max_restarts=0)
    fleet.init_weight_transfer_engine({"rank_offset": 1, "world_size": 3})
    for s in (a, b):  # an engine of an earlier run or group is released first
        assert s.posts == ["/shutdown_weight_transfer_engine", "/init_weight_transfer_engine"]
        s.posts.clear()
    fleet.begin_update()
    fleet.init_weight_transfer_engine({"rank_offset": 1, "world_size": 3})  # a regroup inside the update
    assert a.posts == ["/pause", "/start_weight_update", "/init_weight_transfer_engine"]
    fleet._resume()
    assert not fleet._updating and not any(s.paused for s in fleet.servers)


def test_a_joiner_failing_its_reload_check_is_failed_not_the_update(stand_ins, fleets):
    a, b = stand_ins(2)
    fleet = fleets([a.url, b.url], max_restarts=0)
    fleet.servers[1].state = JOINING
    b.rpc_results = ["layer 3 has no weights"]
    assert fleet._update_failures() == []
    [failure] = fleet.take_failures()
    assert fleet.servers[1].state == DEAD and "catch-up update did not load" in failure.cause
    assert not failure.serving  # it held no request: it fails no run, even under on_engine_failure=stop
    fleet.servers[0].state, a.rpc_results = SERVING, ["layer 1 has no weights"]  # a survivor's fails the update
    assert fleet._update_failures() == ["layer 1 has no weights"]
    b.rpc_results = [{"untrusted": "weight patches θ_1 → θ_2: …"}]  # not a failure: kept for the sync
    fleet.servers[1].state, a.rpc_results = JOINING, [None]
    assert fleet._update_failures() == [{"untrusted": "weight patches θ_1 → θ_2: …"}] and fleet.servers[1].state == JOINING


def test_a_server_joins_once_it_answers_and_a_duplicate_is_refused(stand_ins, monkeypatch, fleets):
    monkeypatch.setattr(healing, "PROBE_INTERVAL_S", 0.05)
    a, new = stand_ins(2)
    fleet = fleets([a.url])
    with pytest.raises(ValueError, match="already"):
        fleet.join(a.url + "/")
    with pytest.raises(ValueError, match="not a URL"):
        fleet.join("node3:8100")
    assert fleet.join(new.url) == 1 and fleet.servers[1].state == STARTING
    _until(lambda: fleet.servers[1].state == READY)
    # cleaned: whatever it ran aborted, an old weight-transfer engine released
    assert new.posts == ["/abort_requests", "/shutdown_weight_transfer_engine"]
    assert fleet.describe()[1] == {"index": 1, "url": new.url, "state": READY, "restarts": 0, "requests": 0,
                                   "started_by_run": False}


def test_a_drained_server_leaves_at_the_next_update_its_requests_moved_at_the_timeout(stand_ins, fleets):
    a, b = stand_ins(2)
    fleet = fleets([a.url, b.url], drain_timeout_s=0.3)
    fleet._owner["r"], fleet._load[1] = (1, 1), 1  # one request in flight on server 1
    fleet.drain(1)
    assert fleet.servers[1].state == DRAINING and fleet.alive == [0]
    with pytest.raises(ValueError, match="the last one serving"):
        fleet.drain(0)
    with pytest.raises(ValueError, match="not serving"):
        fleet.drain(1)
    assert not fleet.regroup_due(admit=True)  # not yet drained: it stays in the group
    _until(lambda: fleet.servers[1].drained)
    [moved] = fleet.take_failures()
    assert moved.drained and moved.request_ids == ["r"] and fleet._load[1] == 0
    assert fleet.regroup_due(admit=True) and fleet.servers[1].state == LEFT
    fleet.servers[1].grouped = True
    fleet.init_weight_transfer_engine({"rank_offset": 1, "world_size": 2})
    assert b.posts == ["/shutdown_weight_transfer_engine"]  # released, not in the new group
    assert a.posts[-1] == "/init_weight_transfer_engine" and fleet.transfer_workers() == 1


@pytest.mark.parametrize("reprefill", [False, True])
def test_an_update_pauses_the_servers_keeping_or_dropping_the_kv_of_their_requests(stand_ins, fleets, reprefill):
    """rollout.kv_on_update: keep pauses with the KV kept; recompute asks vLLM to clear the cache
    (with mode=keep it preempts the running requests, prefilled again at /resume)."""
    (a,) = stand_ins(1)
    fleet = fleets([a.url], max_restarts=0)
    fleet.reprefill_on_update = reprefill
    fleet.begin_update()
    fleet._resume()
    pause = a.queries[a.posts.index("/pause")]
    assert sorted(pause.split("&")) == ["clear_cache=" + ("true" if reprefill else "false"), "mode=keep"]
