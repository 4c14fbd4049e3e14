"""A rollout server's liveness follows its progress (tokens), not its completions: a server whose only
requests are validation requests (n = k, returned whole) that take longer than
`rollout.engine_timeout_s` is alive while its engine's token counters (/metrics) move, and failed when
they stand still. Against a stand-in HTTP server (no engine): the generate route answers after
``REPLY_S``, its /metrics counters move (or not) on every read."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pace.rollout.remote import RemoteFleet
from pace.rollout.server_state import tokens_counted

TIMEOUT_S = 2.0  # rollout.engine_timeout_s of the fleets here
REPLY_S = 3 * TIMEOUT_S  # the validation request's answer: three timeouts after it was sent

METRICS = """# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",model_name="m"}} {prompt}
# HELP vllm:prompt_tokens_cached_total Number of cached prompt tokens.
vllm:prompt_tokens_cached_total{{engine="0",model_name="m"}} 1e6
vllm:prompt_tokens_by_source_total{{engine="0",model_name="m",source="local_compute"}} 1e6
vllm:generation_tokens_total{{engine="0",model_name="m"}} {generated}
vllm:generation_tokens_total{{engine="1",model_name="m"}} 5.0
vllm:generation_tokens_created 1.7e9
"""


def test_the_token_counters_are_summed_over_engines_and_nothing_else():
    page = METRICS.format(prompt=12.0, generated=30.0)
    assert tokens_counted(page) == 12.0 + 30.0 + 5.0  # by hand: the two counters, both engines
    assert tokens_counted("# nothing here\nvllm:num_requests_running 3\n") is None


class _Validating(BaseHTTPRequestHandler):
    progressing = True
    reads = 0

    def _send(self, body: bytes, kind: str = "application/json") -> None:
        try:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path.startswith("/metrics"):
            cls = type(self)
            cls.reads += 1
            generated = 100 + (7 * cls.reads if cls.progressing else 0)
            self._send(METRICS.format(prompt=50.0, generated=float(generated)).encode(), "text/plain")
        else:
            self._send(b'{"world_size": 1}' if self.path.startswith("/get_world_size") else b"{}")

    def do_POST(self):  # noqa: N802
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length) or b"{}")
        time.sleep(REPLY_S)
        n = body.get("sampling_params", {}).get("n", 1)
        choices = [{"index": j, "token_ids": [5, 6, 7], "text": "abc", "finish_reason": "stop"} for j in range(n)]
        self._send(json.dumps({"choices": choices}).encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def validating_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Validating)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    _Validating.reads = 0
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _validate(fleet: RemoteFleet) -> tuple[list, list]:
    """One validation-shaped request (n = 4, returned whole): the outputs until it ends or REPLY_S + 3 s
    pass, and the failures reported meanwhile."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(n=4, max_tokens=8, output_kind=RequestOutputKind.FINAL_ONLY)
    fleet.add_request("val-0-arith-0", {"prompt_token_ids": [1, 2, 3]}, params)
    outputs, failures, deadline = [], [], time.monotonic() + REPLY_S + 3.0
    while time.monotonic() < deadline and not outputs and not failures:
        outputs += fleet.step(timeout=0.1)
        failures += fleet.take_failures()
    return outputs, failures


@pytest.mark.parametrize("progressing", [True, False])
def test_a_server_busy_with_validation_is_alive_while_its_tokens_count_up(validating_server, progressing, monkeypatch):
    monkeypatch.setattr(_Validating, "progressing", progressing)
    fleet = RemoteFleet([validating_server], tokenizer=None, engine_timeout_s=TIMEOUT_S, stream_reader="thread")
    try:
        t0 = time.monotonic()
        outputs, failures = _validate(fleet)
        if progressing:  # silent three timeouts long, its counters moving: answered, never failed
            assert failures == [] and len(outputs) == 1 and len(outputs[0].outputs) == 4
            assert time.monotonic() - t0 >= REPLY_S - 0.5
            assert _Validating.reads >= 2  # its progress was read, not assumed
        else:  # the same silence with its counters still: failed within a timeout and the health ticks
            assert outputs == [] and len(failures) == 1, (outputs, failures)
            assert "no output and no progress" in failures[0].cause and "/metrics" in failures[0].cause
            assert time.monotonic() - t0 < TIMEOUT_S + 2.5
    finally:
        fleet.shutdown()


def test_a_request_whose_connection_closes_before_any_answer_is_sent_again():
    """A pooled connection the server has closed (its keep-alive ended while the client reused it) breaks
    before any response: the request never reached the engine, and is sent once more under an id of its
    own (pace/rollout/protocol.py `post`); under load this failed healthy servers ("Server disconnected",
    "Can not write request body"). A break after the headers is not retried."""
    import asyncio
    import socket

    import aiohttp

    from pace.rollout.protocol import post

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    seen = []

    def serve():
        for i in range(2):
            conn, _ = listener.accept()
            data = conn.recv(65536)
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += conn.recv(65536)
            seen.append(json.loads(body))
            if i == 1:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
            conn.close()  # the first: closed unanswered, as a server ending a keep-alive

    threading.Thread(target=serve, daemon=True).start()

    async def go():
        async with aiohttp.ClientSession() as session:
            async with await post(session, f"http://127.0.0.1:{listener.getsockname()[1]}/x", {"request_id": "r-1"}) as resp:
                return resp.status, await resp.json()

    assert asyncio.run(go()) == (200, {})
    assert [b["request_id"] for b in seen] == ["r-1", "r-1.again"]
    listener.close()


class _SlowHealth(BaseHTTPRequestHandler):
    """/health answers after 3 s (past the fleet's 2-s deadline); the generate route streams a chunk every
    0.2 s for ``STREAM_S``, then ends."""

    STREAM_S = 11.0  # past three health checks of 3 s each (1 s apart, 2 s deadline)
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802
        if self.path.startswith("/health"):
            time.sleep(3.0)
        body = b'{"world_size": 1}' if self.path.startswith("/get_world_size") else b"{}"
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        t0, n = time.monotonic(), 0
        try:
            while time.monotonic() - t0 < self.STREAM_S:
                chunk = {"choices": [{"index": 0, "token_ids": [5], "text": "a", "finish_reason": None}]}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
                n += 1
                time.sleep(0.2)
            end = {"choices": [{"index": 0, "token_ids": [6], "text": "b", "finish_reason": "stop"}]}
            self.wfile.write(b"data: " + json.dumps(end).encode() + b"\n\ndata: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("delivering", [True, False])
def test_a_server_slow_to_answer_health_is_failed_only_when_it_delivers_nothing(delivering):
    """On a busy host a server's API loop answers /health late (every server at once: the rehearsal's
    two-core runs lost both). Misses count only while the server delivers nothing."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _SlowHealth)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    fleet = RemoteFleet([f"http://127.0.0.1:{httpd.server_address[1]}"], tokenizer=None, engine_timeout_s=60.0,
                        stream_reader="thread")
    try:
        if delivering:
            params = SamplingParams(max_tokens=64, output_kind=RequestOutputKind.DELTA)
            fleet.add_request("g-0-0", {"prompt_token_ids": [1, 2, 3]}, params)
        outputs, failures, deadline = [], [], time.monotonic() + _SlowHealth.STREAM_S + 3
        while time.monotonic() < deadline and not failures and not any(o.finished for o in outputs):
            outputs += fleet.step(timeout=0.1)
            failures += fleet.take_failures()
        if delivering:  # three health checks past their deadline meanwhile, never a miss
            assert failures == [] and any(o.finished for o in outputs) and len(outputs) > 20
        else:
            assert len(failures) == 1 and "/health failed 3 times" in failures[0].cause
    finally:
        fleet.shutdown()
        httpd.shutdown()
