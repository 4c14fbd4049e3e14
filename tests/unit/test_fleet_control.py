"""The fleet's control endpoint (pace/rollout/control.py), its client (pace/rollout/fleetctl.py) and
scripts/launch_rollout_server.sh's JOIN path, against a stand-in fleet with the interface of
`RemoteFleet.join / drain / describe` (they queue work and return at once) on a loop thread of its own."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from pace.errors import ConfigError
from pace.rollout import control, fleetctl

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


class StandInFleet:
    """`RemoteFleet`'s operator interface, recording its calls; `_loop` runs on a thread as the fleet's does."""

    def __init__(self, urls: list[str]):
        self.servers = [{"index": i, "url": u, "state": "serving", "restarts": 0, "requests": 3,
                         "started_by_run": True} for i, u in enumerate(urls)]
        self.calls: list[tuple] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    def join(self, url: str) -> int:
        self.calls.append(("join", url))
        held = [s for s in self.servers if s["url"] == url and s["state"] not in ("dead", "left")]
        if held:
            raise ValueError(f"{url} is already in the fleet (engine {held[0]['index']}, {held[0]['state']})")
        self.servers.append({"index": len(self.servers), "url": url, "state": "joining", "restarts": 0,
                             "requests": 0, "started_by_run": False})
        return len(self.servers) - 1

    def drain(self, index: int) -> None:
        self.calls.append(("drain", index))
        if not 0 <= index < len(self.servers) or self.servers[index]["state"] in ("dead", "draining", "left"):
            raise ValueError(f"engine {index}: no such serving engine")
        self.servers[index]["state"] = "draining"

    def describe(self) -> list[dict]:
        return [dict(s) for s in self.servers]

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def _cfg(port=0, host="127.0.0.1"):
    return SimpleNamespace(rollout=SimpleNamespace(control_port=port, control_host=host, servers=[], transfer_address=None))


@pytest.fixture
def running(tmp_path):
    fleet = StandInFleet(["http://127.0.0.1:8100", "http://127.0.0.1:8101"])
    ctl = control.serve(fleet, _cfg(), tmp_path)
    yield fleet, ctl, tmp_path
    ctl.stop()
    fleet.close()


def _post(url: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_join_registers_the_url_and_a_duplicate_is_refused_in_one_line(running):
    fleet, ctl, _ = running
    assert _post(ctl.url + "/fleet/join", b'{"url": "http://node3:8100/"}') == (200, {"index": 2, "url": "http://node3:8100"})
    assert fleet.calls == [("join", "http://node3:8100")]  # the trailing slash dropped, as the fleet keeps URLs
    status, body = _post(ctl.url + "/fleet/join", b'{"url": "http://node3:8100"}')
    assert status == 400 and body["error"] == "http://node3:8100 is already in the fleet (engine 2, joining)"
    with urllib.request.urlopen(ctl.url + "/fleet", timeout=10) as r:
        listed = json.loads(r.read())
    assert listed["control"] == ctl.url
    assert [(s["index"], s["state"]) for s in listed["servers"]] == [(0, "serving"), (1, "serving"), (2, "joining")]


@pytest.mark.parametrize("route, data, key", [
    ("join", b"not json", '"url"'),
    ("join", b'["http://node3:8100"]', '"url"'),
    ("join", b'{"host": "node3"}', '"url"'),
    ("join", b'{"url": "node3:8100"}', '"url"'),
    ("drain", b"{}", '"index" or "url"'),
    ("drain", b'{"index": 0, "url": "http://127.0.0.1:8100"}', '"index" or "url"'),
    ("drain", b'{"index": "0"}', '"index"'),
    ("drain", b'{"index": true}', '"index"'),
])
def test_bad_input_is_a_400_naming_the_key_and_reaches_no_fleet_call(running, route, data, key):
    fleet, ctl, _ = running
    status, body = _post(f"{ctl.url}/fleet/{route}", data)
    assert status == 400 and key in body["error"] and "\n" not in body["error"]
    assert fleet.calls == []


def test_drain_by_index_or_url_and_a_second_drain_is_refused(running):
    fleet, ctl, _ = running
    assert _post(ctl.url + "/fleet/drain", b'{"index": 1}') == (200, {"index": 1})
    assert _post(ctl.url + "/fleet/drain", b'{"url": "http://127.0.0.1:8100/"}') == (200, {"index": 0})
    assert fleet.calls == [("drain", 1), ("drain", 0)]
    status, body = _post(ctl.url + "/fleet/drain", b'{"index": 1}')
    assert (status, body["error"]) == (400, "engine 1: no such serving engine")
    status, body = _post(ctl.url + "/fleet/drain", b'{"url": "http://nowhere:1"}')
    assert (status, body["error"]) == (400, "drain: no server of the fleet is at http://nowhere:1")


def test_a_url_drain_skips_the_servers_that_left_at_that_url(running):
    fleet, ctl, _ = running
    fleet.servers[0]["state"] = "left"
    fleet.servers.append({**fleet.servers[0], "index": 2, "state": "serving"})  # the same URL, joined again
    assert _post(ctl.url + "/fleet/drain", b'{"url": "http://127.0.0.1:8100"}') == (200, {"index": 2})


def test_fleet_json_names_the_endpoint_while_it_runs(tmp_path):
    fleet = StandInFleet([])
    try:
        ctl = control.serve(fleet, _cfg(), tmp_path / "run")
        assert json.loads((tmp_path / "run" / "fleet.json").read_text()) == {"control": ctl.url}
        assert ctl.url.startswith("http://127.0.0.1:")
        ctl.stop()
        assert not (tmp_path / "run" / "fleet.json").exists()
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(ctl.url + "/fleet", timeout=5)
        ctl.stop()  # twice: harmless
    finally:
        fleet.close()


def test_null_port_is_no_endpoint_and_a_taken_port_names_the_key(tmp_path):
    fleet = StandInFleet([])
    taken = socket.socket()
    try:
        assert control.serve(fleet, _cfg(port=None), tmp_path) is None
        assert not (tmp_path / "fleet.json").exists()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"^rollout\.control_port={port}: cannot listen on 127\.0\.0\.1"):
            control.serve(fleet, _cfg(port=port), tmp_path)
    finally:
        taken.close()
        fleet.close()


def test_default_host_is_where_the_servers_reach_rank_0():
    """null control_host: every server on this host → 127.0.0.1; a wildcard bind advertises this host's name."""
    fleet = StandInFleet([])
    try:
        ctl = control.serve(fleet, _cfg(host=None), None)
        assert ctl.url.startswith("http://127.0.0.1:") and ctl.file is None
        ctl.stop()
    finally:
        fleet.close()
    assert control.advertised("0.0.0.0", _cfg().rollout) == socket.gethostname()
    assert control.advertised("10.1.2.3", _cfg().rollout) == "10.1.2.3"


def test_fleetctl_join_drain_list_and_exit_codes(running, capsys):
    fleet, ctl, run_dir = running
    assert fleetctl.main(["join", "http://node3:8100", "--run-dir", str(run_dir)]) == 0
    assert capsys.readouterr().out == "http://node3:8100: engine 2, joins at the next weight update\n"
    assert fleetctl.main(["join", "http://node3:8100", "--control", ctl.url]) == 1
    assert capsys.readouterr().err == "fleetctl join: http://node3:8100 is already in the fleet (engine 2, joining)\n"
    assert fleetctl.main(["drain", "http://node3:8100", "--control", ctl.url]) == 0
    assert fleetctl.main(["drain", "0", "--control", ctl.url]) == 0
    assert fleet.calls[-2:] == [("drain", 2), ("drain", 0)]
    capsys.readouterr()
    assert fleetctl.main(["list", "--run-dir", str(run_dir)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "index  url                    state     restarts  requests  started_by_run",
        "0      http://127.0.0.1:8100  draining  0         3         True",
        "1      http://127.0.0.1:8101  serving   0         3         True",
        "2      http://node3:8100      draining  0         0         False",
    ]
    assert fleetctl.main(["list", "--run-dir", str(run_dir / "elsewhere")]) == 3
    assert "elsewhere/fleet.json: not found" in capsys.readouterr().err
    assert fleetctl.main(["list"]) == 3
    with pytest.raises(SystemExit) as exit_:
        fleetctl.main(["list", "--control", ctl.url, "--run-dir", str(run_dir)])
    assert exit_.value.code == 2


def test_fleetctl_says_when_the_run_is_gone(tmp_path, capsys):
    fleet = StandInFleet([])
    try:
        ctl = control.serve(fleet, _cfg(), tmp_path)
        url = ctl.url
        ctl.stop()
    finally:
        fleet.close()
    assert capsys.readouterr().err == f"fleet control: {url} (python -m pace.rollout.fleetctl list --control {url})\n"
    assert fleetctl.main(["list", "--control", url]) == 3
    assert capsys.readouterr().err.startswith(f"fleetctl list: {url}: no answer (")


STAND_IN_SERVER = '''
import argparse, http.server, pathlib, signal, sys
p = argparse.ArgumentParser(); p.add_argument("--host"); p.add_argument("--port", type=int); p.add_argument("--engine")
a, _ = p.parse_known_args()
def term(*_):
    pathlib.Path(sys.argv[0]).with_name("terminated").write_text(a.engine)
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *_): pass
http.server.HTTPServer((a.host, a.port), H).serve_forever()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, port: int, **env) -> subprocess.Popen:
    (tmp_path / "stand_in_server.py").write_text(STAND_IN_SERVER)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "PACE_ROLLOUT_SERVER": "stand_in_server",
           "HOST": "127.0.0.1", **env}
    return subprocess.Popen(["bash", str(ROOT / "scripts/launch_rollout_server.sh"), str(port), "5"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_launch_script_joins_its_server_and_passes_sigterm_on(running):
    fleet, ctl, run_dir = running
    port = _free_port()
    script = _launch(run_dir, port, JOIN_RUN_DIR=str(run_dir), ADVERTISE_HOST="node9")
    try:
        deadline = time.monotonic() + 60
        while ("join", f"http://node9:{port}") not in fleet.calls:
            assert script.poll() is None, script.communicate()
            assert time.monotonic() < deadline, "the script did not register its server"
            time.sleep(0.2)
        time.sleep(0.5)
        assert script.poll() is None  # it waits on the server
        script.send_signal(signal.SIGTERM)
        out, err = script.communicate(timeout=30)
    finally:
        script.kill()
    assert script.returncode == 0, err  # the server's own exit code, after it was sent SIGTERM
    assert (run_dir / "terminated").read_text() == "5"
    assert f"http://node9:{port}: engine 2, joins at the next weight update" in out


def test_launch_script_stops_its_server_when_the_fleet_refuses_it(running):
    fleet, ctl, run_dir = running
    port = _free_port()
    fleet.servers.append({"index": 2, "url": f"http://127.0.0.1:{port}", "state": "serving", "restarts": 0,
                          "requests": 0, "started_by_run": False})
    script = _launch(run_dir, port, JOIN=ctl.url)  # advertised as HOST (127.0.0.1): already in the fleet
    out, err = script.communicate(timeout=60)
    assert script.returncode == 1
    assert f"fleetctl join: http://127.0.0.1:{port} is already in the fleet" in err
    assert (run_dir / "terminated").read_text() == "5"  # not left running


@pytest.fixture
def remote_fleet():
    """``remote_fleet(transfer_address)``: a `RemoteFleet` with no server yet (its streams read on its loop),
    whose weight-transfer group meets trainer rank 0 at ``transfer_address``; shut down at the end."""
    from pace.rollout.remote import RemoteFleet

    made = []

    def make(transfer_address):
        made.append(RemoteFleet([], tokenizer=None, stream_reader="thread", transfer_address=transfer_address))
        return made[-1]

    yield make
    for fleet in made:
        fleet.shutdown()


def test_a_join_from_another_host_into_a_loopback_transfer_group_is_refused_naming_the_key(remote_fleet, tmp_path, capsys):
    """The servers of the run all on this host: the group's rendezvous is 127.0.0.1, which a server on
    another host cannot reach (its rendezvous would time out inside the regroup and end the run)."""
    fleet = remote_fleet("127.0.0.1")
    ctl = control.serve(fleet, _cfg(), tmp_path)
    try:
        capsys.readouterr()
        assert fleetctl.main(["join", "http://node3:8100", "--control", ctl.url]) == 1
        err = capsys.readouterr().err
        assert err.startswith("fleetctl join: join: http://node3:8100 is not on this host") and err.count("\n") == 1
        assert "rollout.transfer_address" in err and "127.0.0.1" in err
        assert fleet.describe() == []  # not registered: nothing joins the group at the next update
        for url in ("http://127.0.0.1:1", "http://localhost:2", "http://[::1]:3"):  # on this host: taken
            assert fleet.join(url) == len(fleet.servers) - 1
    finally:
        ctl.stop()


def test_a_join_from_another_host_is_taken_where_the_transfer_address_is_reachable(remote_fleet):
    """rollout.transfer_address set (or derived toward servers on other hosts): other hosts reach rank 0."""
    fleet = remote_fleet("10.0.0.7")
    assert fleet.join("http://node3:8100") == 0 and fleet.servers[0].url == "http://node3:8100"
    assert remote_fleet(None).join("http://node3:8100") == 0  # no group to meet in (shm): not this check's


def test_the_fleet_is_told_where_its_group_meets_rank_0(monkeypatch):
    """`build` gives the fleet the nccl/gloo group's rendezvous address (`transfer_address`'s rule)."""
    from pace.placement import Placement
    from pace.rollout import remote

    made = {}

    class Recorder:
        def __init__(self, urls, *args, **kw):
            made.update(kw)

        def set_version(self, version):
            pass

    monkeypatch.setattr(remote, "RemoteFleet", Recorder)
    monkeypatch.setattr(control, "serve", lambda fleet, cfg, log_dir: None)
    cfg = SimpleNamespace(rollout=SimpleNamespace(
        servers=["http://127.0.0.1:8100"], transfer_address=None, max_engine_restarts=3, on_engine_failure="continue",
        engine_timeout_s=120.0, restart_backoff_s=2.0, server_start_timeout_s=900.0, drain_timeout_s=300.0,
        stream_reader="thread", update_timeout_s=600.0))
    for backend, expected in (("gloo", "127.0.0.1"), ("nccl", "127.0.0.1"), ("shm", None)):
        remote.build("model", cfg, Placement("cpu", 1, "server", backend, None), None, None, 0)
        assert made["transfer_address"] == expected, backend
    cfg.rollout.transfer_address = "10.0.0.7"
    remote.build("model", cfg, Placement("cpu", 1, "server", "gloo", None), None, None, 0)
    assert made["transfer_address"] == "10.0.0.7"
