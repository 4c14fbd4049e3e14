"""The remote fleet's deadlines, against a stand-in HTTP server (no engine): a server that answers
/health but hangs in a weight-update call is failed after `rollout.engine_timeout_s`, not after the
broadcast's 30 minutes. vLLM's data-parallel API server does this when a headless engine behind it
has died (scripts/proto_vllm_dp.py); a plain server whose engine core is stuck would too."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pace.rollout.remote import RemoteFleet


class _Hangs(BaseHTTPRequestHandler):
    """/get_world_size and /health answer; every POST in ``hang`` waits ``HANG_S``; the rest answer {}."""

    hang = {"/pause"}
    HANG_S = 20.0
    released = threading.Event()  # set at the end of a test: the hanging calls return

    def _send(self, body: bytes = b"{}") -> None:
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting: the point of the test
            pass

    def do_GET(self):  # noqa: N802 - http.server's name
        self._send(b'{"world_size": 1}' if self.path.startswith("/get_world_size") else b"{}")

    def do_POST(self):  # noqa: N802
        if self.path.split("?")[0] in self.hang:
            self.released.wait(self.HANG_S)
        self._send()

    def log_message(self, *args):
        pass


@pytest.fixture
def hanging_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Hangs)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    _Hangs.released.clear()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    _Hangs.released.set()
    httpd.shutdown()


@pytest.mark.parametrize("hang", ["/pause", "/update_weight_version", "/resume"])
def test_a_server_hanging_in_an_update_call_fails_within_the_engine_timeout(hanging_server, hang, monkeypatch):
    monkeypatch.setattr(_Hangs, "hang", {hang})
    fleet = RemoteFleet([hanging_server], tokenizer=None, engine_timeout_s=1.0)
    try:
        t0 = time.monotonic()
        done = threading.Event()

        def update():
            fleet.begin_update()
            fleet.end_update(3)
            done.set()

        threading.Thread(target=update, daemon=True).start()
        assert done.wait(_Hangs.HANG_S / 2), f"the update still waits on {hang} after {time.monotonic() - t0:.1f} s"
        failures = fleet.take_failures()
        assert [f.index for f in failures] == [0] and "ReadTimeout" in failures[0].cause, failures
        assert fleet.alive == [] and fleet.needs_regroup
    finally:
        fleet.shutdown()
